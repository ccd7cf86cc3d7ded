"""RMSNorm: forward, backward and the gain gradient. Template: ``rms_norm.cl.mako``.

``y = x·inv·w_eff`` over the last axis of ``x [n, d]``, ``inv = 1/sqrt(mean(x²) + eps)``,
``w_eff = w`` or, with ``gemma=True``, ``1 + w``. Outputs must not overlap inputs.

Storage: ``x``, ``dy`` and the outputs ``y``, ``dx`` share one dtype (float32, float16 or
bfloat16; math and sums are float32, each stored value rounded once to nearest even); ``w`` is
float32 or that dtype; ``inv`` is float32 always, and so is ``rms_norm_dw``'s ``dw``.

Tuning (``clops.tuning``; the specs ``ROWS`` and ``DW``), shape class ``{"d": d}``:

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

from .args import (F32, FLOATS, check_array, check_queue, events, finite_float, flag, hold, index_scalar, index_type,
                   outputs, scratch, storage, wrote)
from .spec import Spec

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


def heuristic_rows(dev, sc):
    """About 8 vectors per work-item, up to 256 work-items per row; small rows share a group.
    (At 1024, rms_norm_fwd's registers held the H200's CL_KERNEL_WORK_GROUP_SIZE to 256 at d = 4097.)"""
    d = sc["d"]
    vw = vector_width(4, d)
    tpr = min(pow2_ceil(-(-d // (vw * 8))), _cap(dev), 256)
    wg = max(tpr, min(64, _cap(dev)))
    return {"wg": wg, "vw": vw, "rpg": wg // tpr}


def heuristic_dw(dev, sc):
    return {"wg": min(128, _cap(dev)), "vw": vector_width(4, sc["d"]), "rb": 64}


def _vw_rule(p):
    return p["vw"] in VECTOR_WIDTHS, f"vw must be one of {VECTOR_WIDTHS}"


# Storage types (clops.args.storage) are render extras each call passes (st: activations, wst: the
# gain, dwst: the gain gradient); float32 unless told.
_FLOAT32 = {"st": "float", "wst": "float", "dwst": "float"}


def _render_rows(p, sc):
    p = dict(p, kind="rows", vw=vector_width(p["vw"], sc["d"]), **_FLOAT32)
    p["ch"] = -(-sc["d"] // (p["vw"] * (p["wg"] // p["rpg"])))
    p["cache"] = p["ch"] <= MAX_CACHED
    return p


ROWS = Spec(
    "rms_norm", TEMPLATE, ("wg", "vw", "rpg"),
    lambda sc: {"wg": [32, 64, 128, 256, 512, 1024], "vw": [1, 2, 4, 8], "rpg": [1, 2, 4, 8]},
    heuristic_rows, rules=lambda p, sc: (_vw_rule(p), (p["wg"] % p["rpg"] == 0, "rpg must divide wg")),
    local_bytes=lambda p, sc: 4 * p["wg"], render=_render_rows,
    doc="rms_norm and rms_norm_bwd: wg work-items per group, vw vector width, rpg rows per group")

DW = Spec(
    "rms_norm_dw", TEMPLATE, ("wg", "vw", "rb"),
    lambda sc: {"wg": [32, 64, 128, 256, 512], "vw": [1, 2, 4, 8], "rb": [16, 32, 64, 128, 256]},
    heuristic_dw, rules=lambda p, sc: (_vw_rule(p),),
    render=lambda p, sc: dict(p, kind="dw", vw=vector_width(p["vw"], sc["d"]), **_FLOAT32),
    doc="rms_norm_dw and the column sum of qk_norm_rope_bwd: wg columns per group, vw vector width, "
        "rb rows per partial block")


def gain_offset(gemma):
    """The kernels' w_offset: gains are ``w + offset`` (1 for gemma-style gains); ``gemma`` must be a bool."""
    return np.float32(1.0 if flag("gemma", gemma) else 0.0)


def check_eps(eps):
    eps = finite_float("eps", eps)
    if eps < 0:
        raise ValueError(f"eps: must be ≥ 0, got {eps}")
    return np.float32(eps)


def _check_x(queue, x):
    check_array("x", x, queue, ndim=2, dtype=FLOATS)
    return x.shape


def check_gain(name, w, queue, x, shape):
    """A gain (or its gradient) ``w`` of ``shape``: float32 or the dtype of the activations ``x``."""
    return check_array(name, w, queue, shape=shape, dtype=(x.dtype, F32) if x.dtype != F32 else F32)


def _row_plan(queue, name, n, d, st, wst):
    sc = {"d": d}
    p = ROWS.params(queue.device, sc)
    idx = index_type((n + p["rpg"]) * d)  # row offsets of the last group's rows, past n too
    _, knl = ROWS.kernels(queue, sc, idx=idx, st=st, wst=wst)
    sizes = [index_scalar(idx)(n), np.uint32(d // p["vw"]), np.float32(d)]
    return knl[name], (-(-n // p["rpg"]),), sizes


def _row_kernel(queue, name, n, d, st="float", wst="float"):
    """(kernel, grid, size arguments) of row kernel ``name``: one memo lookup when warm."""
    return ROWS.plan(queue, (name, n, d, st, wst), _row_plan, name, n, d, st, wst)


def rms_norm(queue, x, w, *, eps=1e-6, gemma=False, out=None, inv=None, wait_for=None, allocator=None):
    """``(y, inv)``: RMSNorm of ``x [n, d]`` with gain ``w [d]``; ``y`` of ``x``'s dtype, ``inv [n]``
    (float32) = 1/rms of each row."""
    check_queue(queue)
    eps = check_eps(eps)
    n, d = _check_x(queue, x)
    check_gain("w", w, queue, x, (d,))
    y, inv = outputs(queue, allocator, [("out", out, (n, d)), ("inv", inv, (n,), F32)], [("x", x), ("w", w)],
                     dtype=x.dtype)
    knl, groups, sizes = _row_kernel(queue, "rms_norm_fwd", n, d, storage(x.dtype), storage(w.dtype))
    evt = knl(queue, groups, [y.base_data, inv.base_data, x.base_data, w.base_data, *sizes, eps, gain_offset(gemma)],
              wait_for=events(wait_for, y, inv, x, w))
    hold([evt], y, inv, x, w)
    return wrote([evt], y, inv)


def rms_norm_bwd(queue, x, w, inv, dy, *, eps=1e-6, gemma=False, dx=None, wait_for=None, allocator=None):
    """``dx = inv·w_eff·dy − x·inv³/d·Σ dy·w_eff·x`` (written, not accumulated; ``x``'s dtype).

    ``eps`` (the forward's) is used only at ``d = 1``, where that formula cancels
    catastrophically in float32 and ``dx = w_eff·dy·eps·inv³`` is used instead.
    """
    check_queue(queue)
    eps = check_eps(eps)
    n, d = _check_x(queue, x)
    check_gain("w", w, queue, x, (d,))
    check_array("inv", inv, queue, shape=(n,))
    check_array("dy", dy, queue, shape=(n, d), dtype=x.dtype, like="x")
    (dx,) = outputs(queue, allocator, [("dx", dx, (n, d))], [("x", x), ("w", w), ("inv", inv), ("dy", dy)],
                    dtype=x.dtype)
    knl, groups, sizes = _row_kernel(queue, "rms_norm_bwd", n, d, storage(x.dtype), storage(w.dtype))
    evt = knl(queue, groups, [dx.base_data, x.base_data, w.base_data, inv.base_data, dy.base_data, *sizes, eps, gain_offset(gemma)],
              wait_for=events(wait_for, dx, x, w, inv, dy))
    hold([evt], dx, x, w, inv, dy)
    return wrote([evt], dx)[0]


def column_sum(queue, partial, rows, cols, dw, accumulate, wait_for=None):
    """Enqueue ``dw (+)= Σ_rows partial`` (a buffer of [rows, cols] floats) in row order, in float32, then
    rounded once to ``dw``'s dtype; returns the event."""
    knl, groups, sizes = DW.plan(queue, ("column_sum", rows, cols, dw.dtype), _column_sum_plan, rows, cols, dw.dtype)
    return knl(queue, groups, [dw.base_data, partial, *sizes, np.int32(accumulate)], wait_for=events(wait_for, dw))


def _column_sum_plan(queue, rows, cols, dtype):
    sc = {"d": cols}
    p = DW.params(queue.device, sc)
    _, knl = DW.kernels(queue, sc, idx=index_type((rows + p["rb"]) * cols + p["wg"] * p["vw"]), st="float",
                        dwst=storage(dtype))
    return knl["column_sum"], (-(-cols // p["wg"]),), (np.uint32(rows), np.uint32(cols))


def rms_norm_dw(queue, x, inv, dy, *, dw=None, wait_for=None, allocator=None):
    """``dw [d] = Σ_rows dy·x·inv`` (float32, whatever the dtype of ``x`` and ``dy``); with ``dw``
    given, the gradient is added into it."""
    check_queue(queue)
    n, d = _check_x(queue, x)
    check_array("inv", inv, queue, shape=(n,))
    check_array("dy", dy, queue, shape=(n, d), dtype=x.dtype, like="x")
    accumulate = dw is not None
    (dw,) = outputs(queue, allocator, [("dw", dw, (d,))], [("x", x), ("inv", inv), ("dy", dy)])
    sc = {"d": d}
    p = DW.params(queue.device, sc)
    idx = index_type((n + p["rb"]) * d + p["wg"] * p["vw"])
    _, knl = DW.kernels(queue, sc, idx=idx, st=storage(x.dtype), dwst="float")
    blocks = -(-n // p["rb"])
    partial = scratch(queue, blocks * d, allocator)  # per-block column sums
    dv = d // p["vw"]
    evt = knl["rms_norm_dw_partial"](queue, (-(-dv // p["wg"]), blocks),
                                     [partial, x.base_data, inv.base_data, dy.base_data, index_scalar(idx)(n), np.uint32(dv)],
                                     wait_for=events(wait_for, x, inv, dy))
    done = column_sum(queue, partial, blocks, d, dw, accumulate, wait_for=[evt])
    hold([done], partial, dw, x, inv, dy)
    return wrote([evt, done], dw)[0]  # both stages' events: the profile of dw covers its two kernels
