"""RMSNorm: forward, backward and the gain gradient. Template: ``rms_norm.cl.mako``.

``y = x·inv·w_eff`` over the last axis of ``x [n, d]``, ``inv = 1/sqrt(mean(x²) + eps)``,
``w_eff = w`` or, with ``gemma=True``, ``1 + w``. Outputs must not overlap inputs.

Range: any finite row is normalised right, also where ``x²`` leaves float32 (the kernels sum squares
scaled by a power of two from the row's largest exponent). ``inv`` is 1/rms rounded to float32: a
subnormal where rms > 2^126, inf where rms < 2^−128 (eps = 0). The backward and ``rms_norm_dw`` are
right for every row whose ``inv`` is a normal float; a subnormal ``inv`` costs them precision.

Tuning (``clops.tuning.choose`` / ``clops.tuning.override``), shape class ``{"d": d}``:

- op ``"rms_norm"`` (``rms_norm`` and ``rms_norm_bwd``): ``wg`` work-items per group,
  ``vw`` vector width (1, 2, 4, 8 or 16; the largest power of two ≤ ``vw`` that divides
  ``d`` is used, so rows start on vector boundaries), ``rpg`` rows per group (divides
  ``wg``; a row is shared by ``wg/rpg`` work-items).
- op ``"rms_norm_dw"`` (``rms_norm_dw``, and the column sum of ``qk_norm_rope_bwd``):
  ``wg`` work-items (columns) per group, ``vw`` as above, ``rb`` rows summed per partial
  block of the first stage.
"""
from __future__ import annotations

import numpy as np

from . import tuning
from .args import check_array, check_queue, events, finite_float, index_scalar, index_type, output
from .program import kernels

TEMPLATE = "rms_norm.cl.mako"
VECTOR_WIDTHS = (1, 2, 4, 8, 16)
# Rows wider than this many vectors per work-item are read twice instead of held in registers.
MAX_CACHED = 32


def pow2_ceil(v):
    return 1 << max(0, int(v) - 1).bit_length()


def vector_width(vw, d):
    """The largest power of two ≤ ``vw`` that divides ``d``."""
    while d % vw:
        vw //= 2
    return vw


def _cap(dev):
    return int(min(dev.max_work_group_size, 1024))


def heuristic_rows(dev, d):
    """About 8 vectors per work-item, up to 256 work-items per row; small rows share a group.
    (At 1024, rms_norm_fwd's registers held the H200's CL_KERNEL_WORK_GROUP_SIZE to 256 at d = 4097.)"""
    vw = vector_width(4, d)
    tpr = min(pow2_ceil(-(-d // (vw * 8))), _cap(dev), 256)
    wg = max(tpr, min(64, _cap(dev)))
    return {"wg": wg, "vw": vw, "rpg": wg // tpr}


def heuristic_dw(dev, d):
    return {"wg": min(128, _cap(dev)), "vw": vector_width(4, d), "rb": 64}


def check_params(op, params, names):
    """``params`` restricted to ``names``, each a positive int; ValueError naming what is wrong."""
    missing = [k for k in names if k not in params]
    if missing:
        raise ValueError(f"{op} parameters {params}: missing {missing}")
    p = {k: params[k] for k in names}
    for k, v in p.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{op} parameters {params}: {k} must be a positive int")
    if "vw" in p and p["vw"] not in VECTOR_WIDTHS:
        raise ValueError(f"{op} parameters {params}: vw must be one of {VECTOR_WIDTHS}")
    return {k: int(v) for k, v in p.items()}


def row_params(dev, d):
    """Template parameters of the row kernels for width ``d``."""
    p = check_params("rms_norm", tuning.choose(dev, "rms_norm", {"d": d}, lambda: heuristic_rows(dev, d)),
                     ("wg", "vw", "rpg"))
    if p["wg"] % p["rpg"]:
        raise ValueError(f"rms_norm parameters {p}: rpg must divide wg")
    p["vw"] = vector_width(p["vw"], d)
    p["ch"] = -(-d // (p["vw"] * (p["wg"] // p["rpg"])))
    p["cache"] = p["ch"] <= MAX_CACHED
    return p


def dw_params(dev, d):
    """Template parameters of the gain-gradient kernels for width ``d``."""
    p = check_params("rms_norm_dw", tuning.choose(dev, "rms_norm_dw", {"d": d}, lambda: heuristic_dw(dev, d)),
                     ("wg", "vw", "rb"))
    p["vw"] = vector_width(p["vw"], d)
    return p


def gain_offset(gemma):
    """The kernels' w_offset: gains are ``w + offset`` (1 for gemma-style gains)."""
    return np.float32(1.0 if gemma else 0.0)


def check_eps(eps):
    eps = finite_float("eps", eps)
    if eps < 0:
        raise ValueError(f"eps: must be ≥ 0, got {eps}")
    return np.float32(eps)


def _check_x(queue, x):
    check_array("x", x, queue, ndim=2)
    return x.shape


def _row_kernel(queue, name, n, d):
    p = row_params(queue.device, d)
    idx = index_type((n + p["rpg"]) * d)  # row offsets of the last group's rows, past n too
    knl = kernels(queue, TEMPLATE, dict(p, kind="rows", idx=idx), work_group_size=p["wg"])[name]
    sizes = [index_scalar(idx)(n), np.uint32(d // p["vw"]), np.float32(d)]
    return knl, (-(-n // p["rpg"]),), sizes


def rms_norm(queue, x, w, *, eps=1e-6, gemma=False, out=None, inv=None, wait_for=None, allocator=None):
    """``(y, inv)``: RMSNorm of ``x [n, d]`` with gain ``w [d]``; ``inv [n]`` = 1/rms of each row."""
    check_queue(queue)
    eps = check_eps(eps)
    n, d = _check_x(queue, x)
    check_array("w", w, queue, shape=(d,))
    y = output("out", out, queue, (n, d), allocator)
    inv = output("inv", inv, queue, (n,), allocator)
    knl, groups, sizes = _row_kernel(queue, "rms_norm_fwd", n, d)
    evt = knl(queue, groups, [y.data, inv.data, x.data, w.data, *sizes, eps, gain_offset(gemma)],
              wait_for=events(wait_for, y, inv, x, w))
    y.add_event(evt)
    inv.add_event(evt)
    return y, inv


def rms_norm_bwd(queue, x, w, inv, dy, *, eps=1e-6, gemma=False, dx=None, wait_for=None, allocator=None):
    """``dx = inv·w_eff·dy − x·inv³/d·Σ dy·w_eff·x`` (written, not accumulated).

    ``eps`` (the forward's) is used only at ``d = 1``, where that formula cancels
    catastrophically in float32 and ``dx = w_eff·dy·eps·inv³`` is used instead.
    """
    check_queue(queue)
    eps = check_eps(eps)
    n, d = _check_x(queue, x)
    check_array("w", w, queue, shape=(d,))
    check_array("inv", inv, queue, shape=(n,))
    check_array("dy", dy, queue, shape=(n, d))
    dx = output("dx", dx, queue, (n, d), allocator)
    knl, groups, sizes = _row_kernel(queue, "rms_norm_bwd", n, d)
    evt = knl(queue, groups, [dx.data, x.data, w.data, inv.data, dy.data, *sizes, eps, gain_offset(gemma)],
              wait_for=events(wait_for, dx, x, w, inv, dy))
    dx.add_event(evt)
    return dx


def _dw_kernels(queue, rows, d):
    p = dw_params(queue.device, d)
    idx = index_type((rows + p["rb"]) * d + p["wg"] * p["vw"])
    return p, idx, kernels(queue, TEMPLATE, dict(p, kind="dw", idx=idx), work_group_size=p["wg"])


def column_sum(queue, partial, dw, accumulate, wait_for=None):
    """Enqueue ``dw (+)= Σ_rows partial [rows, cols]`` in row order; returns the event."""
    rows, cols = partial.shape
    p, _, knl = _dw_kernels(queue, rows, cols)
    return knl["column_sum"](queue, (-(-cols // p["wg"]),),
                             [dw.data, partial.data, np.uint32(rows), np.uint32(cols), np.int32(accumulate)],
                             wait_for=events(wait_for, partial, dw))


def rms_norm_dw(queue, x, inv, dy, *, dw=None, wait_for=None, allocator=None):
    """``dw [d] = Σ_rows dy·x·inv``; with ``dw`` given, the gradient is added into it."""
    check_queue(queue)
    n, d = _check_x(queue, x)
    check_array("inv", inv, queue, shape=(n,))
    check_array("dy", dy, queue, shape=(n, d))
    accumulate = dw is not None
    dw = output("dw", dw, queue, (d,), allocator)
    p, idx, knl = _dw_kernels(queue, n, d)
    blocks = -(-n // p["rb"])
    partial = output("partial", None, queue, (blocks, d), allocator)  # scratch: per-block column sums
    dv = d // p["vw"]
    evt = knl["rms_norm_dw_partial"](queue, (-(-dv // p["wg"]), blocks),
                                     [partial.data, x.data, inv.data, dy.data, index_scalar(idx)(n), np.uint32(dv)],
                                     wait_for=events(wait_for, x, inv, dy))
    dw.add_event(evt)  # both stages' events: the profile of dw covers its two kernels
    dw.add_event(column_sum(queue, partial, dw, accumulate, wait_for=[evt]))
    return dw
