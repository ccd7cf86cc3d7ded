"""RMSNorm: forward, backward and the gain gradient, and the residual add fused with the norm
(the pre-norm block's seam). Template: ``rms_norm.cl.mako``.

``y = x·inv·w_eff`` over the last axis of ``x [n, d]``, ``inv = 1/sqrt(mean(x²) + eps)``,
``w_eff = w`` or, with ``gemma=True``, ``1 + w``. Outputs must not overlap inputs, except
``add_rms_norm``'s ``s`` / ``out`` (``a`` or ``b``) and ``add_rms_norm_bwd``'s ``dx`` (``ds``): in
place.

The gain gradient ``dw = Σ_rows dy·x·inv`` comes from ``rms_norm_dw`` alone (two kernels) or with
``dx`` in one read of ``x`` and ``dy`` (``rms_norm_bwd(..., want_dw=True)`` or ``dw=``, and
``add_rms_norm_bwd``): a row kernel whose groups walk the rows strided (group g of G the rows g,
g + G, ...: the groups' rows of a moment lie close together), keeping their
columns' sums in registers, then a column sum of the groups' partial rows — fixed orders, no
atomics, the same bits on every run.

Range: any finite row is normalised right, also where ``x²`` leaves float32. The kernels sum ``x²``
in float32 and test ``mean + eps`` once per row; rows where it overflowed or is below 2^−100 (with
eps < 2^−100) re-read the row and sum ``(x·2^−e)²``, e the exponent of the row's largest ``|x|``
(``rescale`` in ``common.cl.mako`` says why those bounds); the other rows keep their bits. ``inv``
is 1/rms rounded to float32: subnormal where rms > 2^126, inf where rms < 2^−128 (eps = 0). The
backwards read ``x·inv`` in place of ``x`` for rows whose ``inv`` is outside [2^−32, 2^32], and take
1/rms from ``x`` again where ``inv`` is not a normal float (``add_rms_norm_bwd``: from ``s``).

Storage: ``x``, ``dy`` and the outputs ``y``, ``dx`` share one dtype (float32, float16 or
bfloat16; math and sums are float32, each stored value rounded once to nearest even); ``w`` is
float32 or that dtype; ``inv`` is float32 always, and so is ``rms_norm_dw``'s ``dw``.

Tuning (``clops.tuning``; the specs ``ROWS``, ``ROWS_BWD``, ``BWD_DW``, ``ADD_BWD_DW`` and ``DW``),
shape class ``{"d": d, "st": st}`` (``st`` the activations' storage type: ``float``, ``half`` or
``bf16``):

- ops ``"rms_norm"`` (``rms_norm``, ``add_rms_norm``) and ``"rms_norm_bwd"`` (``rms_norm_bwd``
  without ``dw``; the spec ``ROWS_BWD``):
  ``wg`` work-items per group, ``vw`` vector width (1, 2, 4, 8 or 16; the largest power of
  two ≤ ``vw`` that divides ``d`` is used, so rows start on vector boundaries), ``rpg`` rows
  per group (divides ``wg``; a row is shared by ``wg/rpg`` work-items), ``rr`` reads of a row:
  1, held in registers between its sum and its outputs where a work-item's share is at most
  ``MAX_CACHED`` vectors (else read twice); 2, read twice (from the caches: fewer registers, more
  rows in flight). The heuristics load 16 bytes a vector (``vw`` 4 at float32, 8 at 16-bit
  storage) and hold rows (``rr`` 1); at 16-bit storage the backward spreads a row over float32's
  work-items, as the one-pass backwards do.
- ops ``"rms_norm_bwd_dw"`` (the one-pass backward: ``rms_norm_bwd`` with ``dw``; the spec
  ``BWD_DW``) and ``"add_rms_norm_bwd"`` (the same pass reading ``ds`` too; ``ADD_BWD_DW``): ``wg``,
  ``vw``, ``rpg``, ``rr`` as above (``rpg`` rows per step), ``gpc`` groups per compute unit: the
  grid is at most ``gpc`` × CL_DEVICE_MAX_COMPUTE_UNITS groups, each walking at least
  ``MIN_STEPS`` steps of rows, ``pf`` 2 prefetches each step's next rows into the caches while the
  step waits on its sum, 3 loads them into registers then (rows held only: twice their registers),
  1 neither. The heuristics take ``rms_norm_bwd``'s layout (dx then has its bits): at float32 with
  ``gpc`` 2, on NVIDIA's GPUs ``pf`` 3 where rows are held; at 16-bit storage on NVIDIA's GPUs
  rows held and prefetched, ``gpc`` 2, but ``add_rms_norm_bwd`` rows read twice, ``gpc`` 4; on
  other GPUs rows read twice, ``gpc`` 4, and ``add_rms_norm_bwd`` about 16 vectors a work-item and
  ``gpc`` 8.
- op ``"rms_norm_dw"`` (``rms_norm_dw``): ``wg`` work-items (columns) per group of the first
  stage, ``vw`` as above, ``rb`` rows summed per partial block. The column sum (every gain
  gradient's last stage, ``qk_norm_rope_bwd``'s too) has groups of 256 work-items: 8
  columns × 32 slices of rows (``COLUMN_SUM_COLS``, ``COLUMN_SUM_SLICES``).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pyopencl as cl

from . import runtime
from .args import (F32, FLOATS, check_array, check_queue, events, finite_float, flag, hold, index_scalar, index_type,
                   outputs, scratch, storage, storage_dtype, wrote)
from .spec import Spec

TEMPLATE = "rms_norm.cl.mako"
VECTOR_WIDTHS = (1, 2, 4, 8, 16)
# Rows wider than this many vectors per work-item are read twice instead of held in registers (rr 1).
MAX_CACHED = 32


def pow2_ceil(v):
    return 1 << max(0, int(v) - 1).bit_length()


def vector_width(vw, d):
    """The largest power of two ≤ ``vw`` that divides ``d``."""
    while d % vw:
        vw //= 2
    return vw


def wg_cap(dev):
    """The largest work-group the heuristics consider on ``dev``."""
    return int(min(dev.max_work_group_size, 1024))


def heuristic_rows(dev, sc):
    """Vectors of 16 bytes, about 8 of them per work-item, up to 256 work-items per row; small rows
    share a group. (NVIDIA's driver 580 gives every kernel a CL_KERNEL_WORK_GROUP_SIZE of 256, even one
    of 10 registers declaring reqd_work_group_size 1024: an H100, 2026-12-06. At bf16, vw 8 took
    rms_norm_bwd from 67 % to 76 % of the copy bandwidth on the H200 at d = 5120, and the one-pass
    backwards' best tiles had it too.)"""
    return _rows_layout(dev, sc, 8)


def _vw_16_bytes(sc):
    """The vector width of 16-byte loads at the class's storage type (4 at float32, 8 at 16 bits), capped to
    divide d."""
    return vector_width(16 // storage_dtype(sc["st"]).itemsize, sc["d"])


def _rows_layout(dev, sc, vectors):
    """Vectors of 16 bytes, about ``vectors`` of them per work-item, up to 256 work-items per row."""
    d = sc["d"]
    vw = _vw_16_bytes(sc)
    tpr = min(pow2_ceil(-(-d // (vw * vectors))), wg_cap(dev), 256)
    wg = max(tpr, min(64, wg_cap(dev)))
    return {"wg": wg, "vw": vw, "rpg": wg // tpr, "rr": 1}


def heuristic_dw(dev, sc):
    """Vectors of 16 bytes (vw 4 at float32, 8 at 16-bit storage); 64 rows a partial block, 32 at 16 bits
    (an H100, 2026-12-06, bf16 at d = 5120: the sweep's best, 0.136 ms, 0.141 at 64 rows; in the bench
    as fast as float32's tiles, vw 4 and 64 rows, were at bf16: 0.134-0.136 ms against 0.135)."""
    st = sc["st"]
    return {"wg": min(128, wg_cap(dev)), "vw": _vw_16_bytes(sc), "rb": 64 if st == "float" else 32}


def _nvidia_gpu(dev):
    return bool(dev.type & cl.device_type.GPU) and runtime.nvidia(dev)


def heuristic_rows_bwd(dev, sc):
    """rms_norm_bwd: the row heuristic's layout at float32; at 16-bit storage float32's work-items a row,
    about 4 vectors each (a widened vector is twice float32's registers), as the one-pass backwards take.
    (An H100, 2026-12-06, bf16 at d = 5120, alternating: 0.180 / 0.181 ms against 0.189 / 0.189 at the
    forward's 8 vectors a work-item, which keeps them: 0.120 / 0.125 there against 0.138 / 0.137.)"""
    return heuristic_rows(dev, sc) if sc["st"] == "float" else _rows_layout(dev, sc, 4)


def heuristic_bwd_dw(dev, sc):
    """rms_norm_bwd's layout (dx then has its bits). float32: rows held, two groups per compute unit, on an
    NVIDIA GPU each step's rows loaded during the previous step's sum (pf 3, where rows are held).
    16-bit storage: on an NVIDIA GPU, where the prefetch is PTX, rows held and prefetched, two groups per
    compute unit (an H100, 2026-12-06, bf16 at d = 5120, at four groups: 0.224 ms against 0.235 read
    twice, 0.283 held without the prefetch; 2026-12-07's sweeps: two groups 0.195-0.203 against
    0.203-0.205 at four, read twice 0.207 at best); on other GPUs four groups per compute unit, rows read
    twice. (H100 sweeps at d = 5120, 2026-12-05: bf16 0.235 ms read twice against 0.373 at the
    forward's layout held, gpc 4; float32 0.422 against 0.448 at gpc 4. An H100, 2026-12-06, alternating:
    float32 pf 3 0.366 / 0.367 ms against 0.416 / 0.417 at pf 1, add_rms_norm_bwd 0.455 / 0.454 against
    0.484 / 0.485; at bf16 pf 3 takes 128-158 registers and 1.4-2x pf 2's time.)"""
    p = heuristic_rows_bwd(dev, sc)
    if sc["st"] == "float":
        ahead = _render_rows(p, sc)["cache"] and _nvidia_gpu(dev)  # pf 3 needs rows held
        return dict(p, gpc=2, pf=3 if ahead else 1)
    if _nvidia_gpu(dev):
        return dict(p, rr=1, gpc=2, pf=2)
    return dict(p, rr=2, gpc=4 if dev.type & cl.device_type.GPU else 2, pf=1)


def heuristic_add_bwd_dw(dev, sc):
    """heuristic_bwd_dw's, but at 16-bit storage: on an NVIDIA GPU rms_norm_bwd's layout with rows read
    twice, no prefetch, four groups per compute unit (an H100's sweep, 2026-12-07, bf16 at d = 5120:
    0.267 ms against 0.301 held and prefetched at eight groups, the heuristic until then, and 0.283 read
    twice at eight); on other GPUs about 16 vectors a work-item, rows read twice, eight groups per compute
    unit (H100 sweep at d = 5120, bf16, 2026-12-05: 0.358 ms at wg 64, gpc 8 against 0.404 at
    rms_norm_bwd_dw's layout). The pass that reads ds too."""
    if sc["st"] != "float" and _nvidia_gpu(dev):
        return dict(heuristic_rows_bwd(dev, sc), rr=2, gpc=4, pf=1)
    if sc["st"] != "float" and dev.type & cl.device_type.GPU:
        return dict(_rows_layout(dev, sc, 16), rr=2, gpc=8, pf=1)
    return heuristic_bwd_dw(dev, sc)


def _vw_rule(p):
    return p["vw"] in VECTOR_WIDTHS, f"vw must be one of {VECTOR_WIDTHS}"


def _row_rules(p, sc):
    return _vw_rule(p), (p["wg"] % p["rpg"] == 0, "rpg must divide wg"), (p["rr"] in (1, 2), "rr must be 1 or 2")


# Storage types (clops.args.storage) are render extras each call passes (st: activations, wst: the
# gain, dwst: the gain gradient); float32 unless told.
_FLOAT32 = {"st": "float", "wst": "float", "dwst": "float"}


def _render_rows(p, sc):
    p = dict(p, kind="rows", vw=vector_width(p["vw"], sc["d"]), **_FLOAT32)
    p["ch"] = -(-sc["d"] // (p["vw"] * (p["wg"] // p["rpg"])))
    p["cache"] = p["rr"] == 1 and p["ch"] <= MAX_CACHED
    return p


def _render_bwd_dw(p, sc):
    return dict(_render_rows(p, sc), kind="rows_dw")


def _one_pass_rules(p, sc):
    rows = _row_rules(p, sc)
    held = p["pf"] != 3 or (all(ok for ok, _ in rows) and _render_rows(p, sc)["cache"])
    return (*rows, (p["pf"] in (1, 2, 3), "pf must be 1, 2 or 3"),
            (held, f"pf 3 needs rows held (rr 1, at most {MAX_CACHED} vectors a work-item)"))


ROWS = Spec(
    "rms_norm", TEMPLATE, ("wg", "vw", "rpg", "rr"),
    lambda sc: {"wg": [32, 64, 128, 256, 512, 1024], "vw": [1, 2, 4, 8], "rpg": [1, 2, 4, 8], "rr": [1, 2]},
    heuristic_rows, rules=_row_rules,
    local_bytes=lambda p, sc: 4 * p["wg"], render=_render_rows,
    doc="rms_norm and add_rms_norm: wg work-items per group, vw vector width, rpg rows per group, "
        "rr reads of a row (1 held in registers, 2 read twice)")

ROWS_BWD = dataclasses.replace(ROWS, op="rms_norm_bwd", heuristic=heuristic_rows_bwd,
                               doc="rms_norm_bwd without dw: the parameters of rms_norm")
BWD_DW = Spec(
    "rms_norm_bwd_dw", TEMPLATE, ("wg", "vw", "rpg", "rr", "gpc", "pf"),
    lambda sc: {"wg": [64, 128, 256, 512, 1024], "vw": [1, 2, 4, 8], "rpg": [1, 2, 4], "rr": [1, 2],
                "gpc": [1, 2, 4, 8], "pf": [1, 2, 3]},
    heuristic_bwd_dw, rules=_one_pass_rules,
    # the row sums' scratch, and the segments' partial sums when a group takes several rows a step
    local_bytes=lambda p, sc: 4 * p["wg"] * (1 + (vector_width(p["vw"], sc["d"]) if p["rpg"] > 1 else 0)),
    render=_render_bwd_dw,
    doc="rms_norm_bwd with dw (one pass): wg work-items per group, vw vector width, rpg rows per step, rr "
        "reads of a row, gpc groups per compute unit, pf 2 the next step's rows prefetched, 3 loaded into registers "
        "during this step's sum (rows held only), 1 neither")
ADD_BWD_DW = dataclasses.replace(BWD_DW, op="add_rms_norm_bwd", heuristic=heuristic_add_bwd_dw,
                                 doc="add_rms_norm_bwd (one pass): the parameters of rms_norm_bwd_dw")
_ONE_PASS = {"rms_norm_bwd_dw": BWD_DW, "add_rms_norm_bwd": ADD_BWD_DW}  # kernel name: its spec

# The column sum's groups: 8 columns × 32 slices of rows (rendered as cl_kernels/rms_norm.cl.mako's CS_CW, CS_S)
COLUMN_SUM_COLS, COLUMN_SUM_SLICES = 8, 32
COLUMN_SUM_WG = COLUMN_SUM_COLS * COLUMN_SUM_SLICES
DW = Spec(
    "rms_norm_dw", TEMPLATE, ("wg", "vw", "rb"),
    lambda sc: {"wg": [32, 64, 128, 256, 512], "vw": [1, 2, 4, 8], "rb": [16, 32, 64, 128, 256]},
    heuristic_dw, rules=lambda p, sc: (_vw_rule(p),), wg=lambda p, sc: max(p["wg"], COLUMN_SUM_WG),
    local_bytes=lambda p, sc: 4 * COLUMN_SUM_WG,
    render=lambda p, sc: dict(p, kind="dw", vw=vector_width(p["vw"], sc["d"]), cs_cw=COLUMN_SUM_COLS,
                              cs_s=COLUMN_SUM_SLICES, **_FLOAT32),
    doc="rms_norm_dw: wg columns per group, vw vector width, rb rows per partial block (the column sum of "
        "every gain gradient comes with it)")
MIN_STEPS = 4  # a one-pass backward group walks at least this many steps of rows (fewer partial rows)


_OFFSETS = (np.float32(0.0), np.float32(1.0))


def gain_offset(gemma):
    """The kernels' w_offset: gains are ``w + offset`` (1 for gemma-style gains); ``gemma`` must be a bool."""
    return _OFFSETS[flag("gemma", gemma)]


_eps_seen = {}  # float eps -> np.float32 eps, for those that passed the checks (a few values in practice)


def check_eps(eps):
    if type(eps) is float:  # the common case: a Python float already checked once
        found = _eps_seen.get(eps)
        if found is not None:
            return found
    checked = finite_float("eps", eps)
    if checked < 0:
        raise ValueError(f"eps: must be ≥ 0, got {checked}")
    found = np.float32(checked)
    if type(eps) is float and len(_eps_seen) < 64:
        _eps_seen[eps] = found
    return found


def _check_x(queue, x):
    check_array("x", x, queue, ndim=2, dtype=FLOATS)
    return x.shape


def check_gain(name, w, queue, x, shape):
    """A gain (or its gradient) ``w`` of ``shape``: float32 or the dtype of the activations ``x``."""
    return check_array(name, w, queue, shape=shape, dtype=(x.dtype, F32) if x.dtype != F32 else F32)


def _row_plan(queue, spec, name, n, d, st, wst):
    sc = {"d": d, "st": st}
    p = spec.params(queue.device, sc)
    idx = index_type((n + p["rpg"]) * d)  # row offsets of the last group's rows, past n too
    _, knl = spec.kernels(queue, sc, idx=idx, st=st, wst=wst, ptx=int(runtime.nvidia(queue.device)))
    sizes = [index_scalar(idx)(n), np.uint32(d // p["vw"]), np.float32(d)]
    return knl[name], (-(-n // p["rpg"]),), sizes


def _row_kernel(queue, name, n, d, st="float", wst="float"):
    """(kernel, grid, size arguments) of row kernel ``name``: one memo lookup when warm."""
    spec = ROWS_BWD if name == "rms_norm_bwd" else ROWS
    return spec.plan(queue, (name, n, d, st, wst), _row_plan, spec, name, n, d, st, wst)


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


def rms_norm_bwd(queue, x, w, inv, dy, *, eps=1e-6, gemma=False, dx=None, dw=None, want_dw=False, wait_for=None,
                 allocator=None):
    """``dx = inv·w_eff·dy − x·inv³/d·Σ dy·w_eff·x`` (written, not accumulated; ``x``'s dtype).

    With ``dw`` given or ``want_dw=True``: ``(dx, dw)``, the gain gradient ``dw [d] = Σ_rows
    dy·x·inv`` computed in the same read of ``x`` and ``dy`` (of ``w``'s dtype; a given ``dw`` is
    added into, in float32, then rounded once). Without: ``dx`` alone.

    ``eps`` (the forward's) is used only at ``d = 1``, where that formula cancels
    catastrophically in float32 and ``dx = w_eff·dy·eps·inv³`` is used instead.
    """
    check_queue(queue)
    eps = check_eps(eps)
    fused = flag("want_dw", want_dw) or dw is not None
    n, d = _check_x(queue, x)
    check_gain("w", w, queue, x, (d,))
    check_array("inv", inv, queue, shape=(n,))
    check_array("dy", dy, queue, shape=(n, d), dtype=x.dtype, like="x")
    inputs = [("x", x), ("w", w), ("inv", inv), ("dy", dy)]
    if fused:
        accumulate = dw is not None
        dx, dw = outputs(queue, allocator, [("dx", dx, (n, d)), ("dw", dw, (d,), w.dtype)], inputs, dtype=x.dtype)
        return _bwd_dw(queue, "rms_norm_bwd_dw", dx, dw, accumulate, x, w, inv, dy, None, eps, gemma, wait_for,
                       allocator)
    (dx,) = outputs(queue, allocator, [("dx", dx, (n, d))], inputs, dtype=x.dtype)
    knl, groups, sizes = _row_kernel(queue, "rms_norm_bwd", n, d, storage(x.dtype), storage(w.dtype))
    evt = knl(queue, groups, [dx.base_data, x.base_data, w.base_data, inv.base_data, dy.base_data, *sizes, eps,
                              gain_offset(gemma)],
              wait_for=events(wait_for, dx, x, w, inv, dy))
    hold([evt], dx, x, w, inv, dy)
    return wrote([evt], dx)[0]


def bwd_dw_groups(dev, p, n, min_steps=MIN_STEPS):
    """The groups of a one-pass backward over ``n`` rows with parameters ``p``: at most ``gpc`` per compute
    unit, each walking at least ``min_steps`` steps of ``rpg`` rows (group g the steps g, g + groups, ...)."""
    steps = -(-n // p["rpg"])
    return max(1, min(steps // min_steps, p["gpc"] * dev.max_compute_units))


def _bwd_dw_plan(queue, name, n, d, st, wst):
    sc, spec = {"d": d, "st": st}, _ONE_PASS[name]
    p = spec.params(queue.device, sc)
    # row offsets past n (the last step's rows), and the strided walk's rows up to n + groups·rpg ≤ 2n + rpg
    idx = index_type((n + p["rpg"]) * d, 2 * n + p["rpg"])
    _, knl = spec.kernels(queue, sc, idx=idx, st=st, wst=wst, ptx=int(runtime.nvidia(queue.device)))
    groups = bwd_dw_groups(queue.device, p, n)
    return knl[name], groups, [index_scalar(idx)(n), np.uint32(d // p["vw"]), np.float32(d)]


def _bwd_dw(queue, name, dx, dw, accumulate, x, w, inv, dy, ds, eps, gemma, wait_for, allocator):
    """Enqueue a one-pass backward (``name``: rms_norm_bwd_dw, or add_rms_norm_bwd with ``ds``), then the
    column sum of its groups' partial sums into ``dw``; returns ``(dx, dw)``."""
    n, d = x.shape
    st, wst = storage(x.dtype), storage(w.dtype)
    knl, groups, sizes = _ONE_PASS[name].plan(queue, (n, d, st, wst), _bwd_dw_plan, name, n, d, st, wst)
    partial = scratch(queue, groups * d, allocator)  # per-group column sums
    ins = [x, w, inv, dy] + ([ds] if ds is not None else [])
    args = [dx.base_data, partial, *(a.base_data for a in ins), *sizes, eps, gain_offset(gemma)]
    evt = knl(queue, (groups,), args, wait_for=events(wait_for, dx, *ins))
    done = column_sum(queue, partial, groups, d, dw, accumulate, wait_for=[evt], allocator=allocator)
    hold([done], partial, dx, dw, *ins)
    wrote([evt], dx)
    wrote([evt, done], dw)  # both stages' events: the profile of dw covers its two kernels
    return dx, dw


# Partial rows a column-sum group adds; more than 2·CHUNK rows take two launches. (An H100, 2026-12-06, bf16,
# qk_norm_rope_bwd's 528 partial rows of 128 / 256 floats: 5.3-5.6 µs in one launch against 8.2-8.4 in two at
# 256, sixteen loads in flight; eight in flight 6.7 µs and 8.6-8.9. 2026-12-07, groups of 8 columns × 32 slices
# against 32 × 8, CHUNK 512 before: 4.7-4.8 µs against 5.6-6.1 there, 4.2-4.5 against 5.0-5.2 at 64 floats,
# add_rms_norm_bwd's 1056 rows of 5120 in one launch 14.5 µs against 16.3 in two; the one pass's 528 rows of
# 5120 8.6-8.7 against 8.7-8.9.)
CHUNK = 1024
_ACCUMULATE = (np.int32(0), np.int32(1))


def _column_plan(queue, rows, cols, dwst):
    """(kernel, grid, scalar arguments before the accumulate flag) of a column sum of ``rows`` partial
    rows: into ``dw`` (of storage type ``dwst``), or with ``dwst`` None, chunks of CHUNK rows into a
    float32 scratch of ``-(-rows // CHUNK)`` rows."""
    sc = {"d": cols, "st": "float"}  # the partial sums are float32; the column sum uses none of the class's tiles
    p = DW.params(queue.device, sc)
    idx = index_type((rows + p["rb"]) * cols + p["wg"] * p["vw"])
    _, knl = DW.kernels(queue, sc, idx=idx, st="float", dwst=dwst or "float")
    groups = -(-cols // COLUMN_SUM_COLS)
    grid = (groups, 1) if dwst else (groups, -(-rows // CHUNK))
    return knl["column_sum"], grid, [np.uint32(rows), np.uint32(cols)], np.uint32(rows if dwst else CHUNK)


def column_sum(queue, partial, rows, cols, dw, accumulate, wait_for=None, allocator=None):
    """Enqueue ``dw (+)= Σ_rows partial`` (a buffer of [rows, cols] floats) in a fixed order, in float32,
    then rounded once to ``dw``'s dtype; returns the last event. Over 2·CHUNK rows, chunks of CHUNK
    rows are summed into a float scratch first (more groups at work), then its rows into ``dw``."""
    if rows > 2 * CHUNK:
        chunks = -(-rows // CHUNK)
        knl, grid, sizes, chunk = DW.plan(queue, ("column_sum", rows, cols, None), _column_plan, rows, cols, None)
        mid = scratch(queue, chunks * cols, allocator)
        evt = knl(queue, grid, [mid, partial, *sizes, _ACCUMULATE[0], chunk], wait_for=wait_for)
        done = column_sum(queue, mid, chunks, cols, dw, accumulate, wait_for=[evt], allocator=allocator)
        hold([done], mid)
        return done
    dwst = storage(dw.dtype)
    knl, grid, sizes, chunk = DW.plan(queue, ("column_sum", rows, cols, dwst), _column_plan, rows, cols, dwst)
    return knl(queue, grid, [dw.base_data, partial, *sizes, _ACCUMULATE[accumulate], chunk],
               wait_for=events(wait_for, dw))


def _dw_plan(queue, n, d, st):
    sc = {"d": d, "st": st}
    p = DW.params(queue.device, sc)
    idx = index_type((n + p["rb"]) * d + p["wg"] * p["vw"])
    _, knl = DW.kernels(queue, sc, idx=idx, st=st, dwst="float")
    blocks = -(-n // p["rb"])
    dv = d // p["vw"]
    return knl["rms_norm_dw_partial"], (-(-dv // p["wg"]), blocks), blocks, [index_scalar(idx)(n), np.uint32(dv)]


def rms_norm_dw(queue, x, inv, dy, *, dw=None, wait_for=None, allocator=None):
    """``dw [d] = Σ_rows dy·x·inv`` (float32, whatever the dtype of ``x`` and ``dy``); with ``dw``
    given, the gradient is added into it."""
    check_queue(queue)
    n, d = _check_x(queue, x)
    check_array("inv", inv, queue, shape=(n,))
    check_array("dy", dy, queue, shape=(n, d), dtype=x.dtype, like="x")
    accumulate = dw is not None
    (dw,) = outputs(queue, allocator, [("dw", dw, (d,))], [("x", x), ("inv", inv), ("dy", dy)])
    st = storage(x.dtype)
    knl, grid, blocks, sizes = DW.plan(queue, ("rms_norm_dw", n, d, st), _dw_plan, n, d, st)
    partial = scratch(queue, blocks * d, allocator)  # per-block column sums
    evt = knl(queue, grid, [partial, x.base_data, inv.base_data, dy.base_data, *sizes],
              wait_for=events(wait_for, x, inv, dy))
    done = column_sum(queue, partial, blocks, d, dw, accumulate, wait_for=[evt], allocator=allocator)
    hold([done], partial, dw, x, inv, dy)
    return wrote([evt, done], dw)[0]  # both stages' events: the profile of dw covers its two kernels


ADD_IN_PLACE = dict.fromkeys(("s", "out"), ("a", "b"))  # the residual stream, not inv


def add_rms_norm(queue, a, b, w, *, eps=1e-6, gemma=False, s=None, out=None, inv=None, wait_for=None,
                 allocator=None):
    """``(s, y, inv)``: the residual sum ``s = a + b`` and its RMSNorm, in one read of ``a`` and ``b``.

    ``a``, ``b`` ``[n, d]`` (one dtype; ``s`` and ``y`` take it), gain ``w [d]``. ``y`` and ``inv [n]``
    (float32) come from the float32 sum, before ``s`` is rounded to its storage type: ``y`` is
    ``rms_norm`` of that sum (float32: ``rms_norm(add(a, b))`` bit for bit). ``s`` or ``out`` may be
    given as ``a`` or ``b`` (in place: the residual stream updated where it lies).
    """
    check_queue(queue)
    eps = check_eps(eps)
    check_array("a", a, queue, ndim=2, dtype=FLOATS)
    n, d = a.shape
    check_array("b", b, queue, shape=(n, d), dtype=a.dtype, like="a")
    check_gain("w", w, queue, a, (d,))
    s, y, inv = outputs(queue, allocator, [("s", s, (n, d)), ("out", out, (n, d)), ("inv", inv, (n,), F32)],
                        [("a", a), ("b", b), ("w", w)], ADD_IN_PLACE, dtype=a.dtype)
    knl, groups, sizes = _row_kernel(queue, "add_rms_norm_fwd", n, d, storage(a.dtype), storage(w.dtype))
    evt = knl(queue, groups, [s.base_data, y.base_data, inv.base_data, a.base_data, b.base_data, w.base_data, *sizes,
                              eps, gain_offset(gemma)],
              wait_for=events(wait_for, s, y, inv, a, b, w))
    hold([evt], s, y, inv, a, b, w)
    return wrote([evt], s, y, inv)


def add_rms_norm_bwd(queue, s, w, inv, dy, ds, *, eps=1e-6, gemma=False, dx=None, dw=None, wait_for=None,
                     allocator=None):
    """``(dx, dw)`` of ``add_rms_norm``: ``dx = ds + rms_norm_bwd(s, w, inv, dy)`` (the gradient of both
    ``a`` and ``b``; ``ds`` is what reaches ``s`` from elsewhere) and ``dw = Σ_rows dy·s·inv``, in one
    read of ``s``, ``dy`` and ``ds``. ``dw`` takes ``w``'s dtype; a given ``dw`` is added into (in
    float32, rounded once). ``dx`` may be given as ``ds`` (in place). ``eps``: as ``rms_norm_bwd``'s."""
    check_queue(queue)
    eps = check_eps(eps)
    check_array("s", s, queue, ndim=2, dtype=FLOATS)
    n, d = s.shape
    check_gain("w", w, queue, s, (d,))
    check_array("inv", inv, queue, shape=(n,))
    check_array("dy", dy, queue, shape=(n, d), dtype=s.dtype, like="s")
    check_array("ds", ds, queue, shape=(n, d), dtype=s.dtype, like="s")
    accumulate = dw is not None
    dx, dw = outputs(queue, allocator, [("dx", dx, (n, d)), ("dw", dw, (d,), w.dtype)],
                     [("s", s), ("w", w), ("inv", inv), ("dy", dy), ("ds", ds)], {"dx": ("ds",)}, dtype=s.dtype)
    return _bwd_dw(queue, "add_rms_norm_bwd", dx, dw, accumulate, s, w, inv, dy, ds, eps, gemma, wait_for, allocator)
