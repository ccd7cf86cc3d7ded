"""Per-head q/k RMSNorm with partial RoPE: forward and backward. Template: ``qk_norm_rope.cl.mako``.

``x`` is ``[n, heads, hd]`` (or ``[n, heads·hd]``, ``hd = len(w)``); each (row, head) unit is
RMS-normalised over ``hd`` with gain ``w`` (gemma style ``1 + w`` by default), then its first
``2·half`` dims are rotated with half-split pairing ``(i, i + half)`` by the angle of position
``row mod window``, or with ``cu_seqlens`` the row's offset in its sequence; the other dims pass
through. ``hd``: a multiple of 4 up to 512.

The rotation table ``rope`` is a device array ``[table, half, 2]`` (cos, sin), e.g.
``cla.to_device(queue, rope_table(window, half, theta=...))``; ``window`` defaults to its
length and may be given shorter (a table too short for ``window`` is an error). At most one of
``window`` and ``cu_seqlens``, attention's sequences (:func:`clops.attention`: int32 offsets from
0 to n, a numpy array, checked and copied without waiting, or a device array with ``max_seqlen``);
the table must then hold the longest sequence (``max_seqlen`` when given), and each row's sequence
is found on the device by a binary search over the offsets (nothing is read back). No rotation
(``half = 0``): pass ``rope=None`` or the empty ``[table, 0, 2]`` array (pyopencl holds
such arrays without a buffer); ``window`` and the sequences are then not used (the sequences are
still checked). Outputs must not overlap inputs.

Range: as :mod:`clops.norm`'s — any finite unit is normalised right (units whose squares leave
float32 take a slow path that reads the unit again, scaled by a power of two; the others keep their
bits), ``inv`` is 1/rms rounded to float32 (subnormal or inf at the far ends), and the backward takes
``x·inv`` for units whose ``inv`` is outside [2^−32, 2^32].

Storage: ``x``, ``dy`` and the outputs ``y``, ``dx`` share one dtype (float32, float16 or
bfloat16; math and sums are float32, each stored value rounded once to nearest even); ``w`` is
float32 or that dtype, and ``dw`` takes ``w``'s (summed in float32, rounded once); ``inv`` and
``rope`` are float32 always.

Layout of the kernels (``qk_norm_rope.cl.mako``): a unit is read in vectors of ``VW`` elements,
``VW`` dividing ``hd`` and ``half``, so that each rotation pair of vectors (dims ``[VW·p, VW·p + VW)``
and their partners ``half`` further) belongs to one work-item, which rotates it in registers with
one load of the table; ``wg/upg`` work-items (a segment) share a unit, each owning a few such slots
(pairs, or single vectors past ``2·half``), and add the unit's sum of squares through local memory
after one barrier. A segment takes ``hpw`` consecutive units (the heads of a row), loading the gain's
and the row's table vectors once for them. The backward's groups each walk a range of units, keeping
their gain-gradient sums in registers, and write one partial row each.

Tuning (``clops.tuning``; the spec ``SPEC``): op ``"qk_norm_rope"``, shape class ``{"hd": hd, "st": st}``
(``st`` the storage type of ``x``), parameters
``wg`` work-items per group, ``vw`` vector width (1, 2, 4, 8 or 16; the largest power of
two ≤ ``vw`` dividing ``hd`` and the rotary half is used), ``upg`` segments of a group (divides
``wg``; a unit is shared by the ``wg/upg`` work-items of a segment), ``hpw`` units (row, head) a
segment takes one after the other (1 to 4; above 1 only with at most 32 work-items a unit: the GPU
heuristic's 1, an H100's sweep at bf16 hd 64 finding 2 and 4 slower; on CPUs 2 at float32 up to hd
64), so ``upg·hpw`` units a group at a time, ``gpc`` backward groups per compute unit: the backward's
grid is at most ``gpc`` × CL_DEVICE_MAX_COMPUTE_UNITS groups, each walking at least ``MIN_STEPS``
steps of ``upg·hpw`` units
(:func:`clops.norm.bwd_dw_groups`), each group a partial row of the dw reduction, ``pf`` how the
backward gets each next step's units: 1 loaded when the step comes, 2 prefetched into the caches while
this step waits on its sum (PTX on NVIDIA), 3 loaded into registers then (twice the step's registers),
as :mod:`clops.norm`'s one passes. The dw column
sum is :func:`clops.norm.column_sum` (groups of 8 columns × 32 row slices; two launches beyond
2048 partial rows).
"""
from __future__ import annotations

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

from . import runtime
from .args import (F32, FLOATS, check_array, check_queue, check_sequences, events, hold, index_scalar, index_type,
                   outputs, positive_int, scratch, storage, upload_sequences, wrote)
from .norm import VECTOR_WIDTHS, bwd_dw_groups, check_eps, column_sum, gain_offset, vector_width, wg_cap
from .spec import Spec

TEMPLATE = "qk_norm_rope.cl.mako"
MAX_HD = 512
# A backward group walks at least this many steps of units (fewer partial rows of dw); a partial row is
# 1/upg of a step's units, so fewer steps than the rows' norm needs (clops.norm.MIN_STEPS).
MIN_STEPS = 2


def heuristic(dev, sc):
    """GPUs: vectors of 4, about four of them per work-item (TPU = hd/16 work-items a unit, at most 64),
    groups of 256, two backward groups per compute unit (the backward holds four pairs of x and dy
    vectors and its sums: about 96 registers for sm_80 through clang and ptxas, so two groups of 256
    fill a compute unit's registers and the whole grid is resident at once). CPUs: vectors of 8, one
    work-item a unit (no barrier a step), groups of 32, four backward groups per compute unit: on
    PoCL and Intel's runtime the fastest of the layouts tried, forward and backward, at hd 64 to 512.
    There, at float32 up to hd 64, two units a work-item (``hpw`` 2; 2026-12-07, 2 cores, forward +
    backward of 4096 rows × 8 heads at hd 64: PoCL 3.1 1.09-1.23 ms against 1.32-1.54, Intel's runtime
    1.02-1.50 against 1.45-1.62, three runs each; hd 32 over 8192 rows, both runtimes, two runs each, 0.71-0.73
    against 0.77-1.47, over 4096 rows mixed, 0.40-0.95 against 0.76-0.91);
    at hd 128 and at bf16 (hd 64) one is as fast or faster (PoCL hd 128 3.13 against 3.59; bf16 2.05-2.21
    against 2.15-2.19, Intel 2.07-2.09 against 2.18-2.19).
    At 16-bit storage on a GPU, the same work-items a unit in groups of 128, four backward groups per
    compute unit: on an H100 (2026-12-05, bf16, forward + backward) 0.089 / 0.154 / 0.285 ms against
    0.094 / 0.162 / 0.300 at hd 64 / 128 / 256; at float32 that layout is no faster at hd 64 and slower
    above (an H100, 2026-12-06, % of copy forward / backward: 82-84 / 78-79 against 82-83 / 80 at hd 64,
    83 / 90 against 95 / 89-90 at hd 128 and 256). At bf16, 16-byte loads (``vw`` 8) run hd 64's
    forward / backward at 47 / 39 % against 71 / 56, one work-item a unit at 23 / 29, eight backward
    groups a compute unit at 71 / 52, groups of 256 at 69 / 54. There, on NVIDIA's
    GPUs from hd 128, the backward prefetches each next step (``pf`` 2, PTX): on an H100 (2026-12-06, bf16)
    0.165 / 0.164 ms against 0.187 / 0.182 at hd 128 / 256; at hd 64 (12 steps a group) 0.056 against
    0.051; at float32 0.320 / 0.324 against 0.301 / 0.300, and ``pf`` 3 (144 registers at bf16) no faster.
    Up to hd 64 at 16 bits, the next step loaded into registers (``pf`` 3) ran 0.0814 ms against 0.0852 at
    ``pf`` 1 before ``hpw`` (an H100, 2026-12-07, bf16, a sweep of forward + backward at hd 64), at 128
    registers in NVIDIA's build, four groups of 128 filling a compute unit's; the template since ``hpw``
    builds it at 139 (three groups), and it takes ``pf`` 1 again: on an H100 (2026-12-08, the same sweep)
    0.0862 ms against 0.0976 at ``pf`` 2 and 0.0993 at 3, ``hpw`` 2 0.0920."""
    hd = sc["hd"]
    cap = wg_cap(dev)
    if dev.type & cl.device_type.CPU:
        wg = min(32, cap)
        hpw = 2 if sc["st"] == "float" and hd <= 64 else 1
        return {"wg": wg, "vw": vector_width(8, hd), "upg": wg, "gpc": 4, "hpw": hpw, "pf": 1}
    vw = vector_width(4, hd)
    tpu = min(_pow2_floor(max(1, hd // vw // 4)), 64, cap)
    narrow = sc["st"] != "float"
    wg = max(tpu, min(128 if narrow else 256, cap))
    pf = 2 if hd >= 128 and narrow and runtime.nvidia(dev) else 1
    return {"wg": wg, "vw": vw, "upg": wg // tpu, "gpc": 4 if narrow else 2, "hpw": 1, "pf": pf}


def _pow2_floor(v):
    return 1 << (int(v).bit_length() - 1)


def _slices(p, hd):
    """The backward's slices of segments in its last sum (cl_kernels/qk_norm_rope.cl.mako's SL)."""
    return min(p["upg"], p["wg"] // hd)


def local_bytes(p, sc):
    """Local memory of the backward (the forward's is at most its first term): the two halves of the
    unit sums' scratch (none at one work-item a unit, unless the last sum's slices use it) and the
    segments' sums of the gain gradient."""
    hd = sc["hd"]
    scratch = 2 * p["hpw"] * p["wg"] if p["wg"] > p["upg"] or _slices(p, hd) > 1 else 0
    return 4 * (scratch + p["upg"] * hd)


def _render(p, sc):
    # the template lowers vw until it divides hd and the rotary half (a render extra, as the storage types)
    return dict(p, hd=sc["hd"], vw=vector_width(p["vw"], sc["hd"]), st="float", wst="float")


SPEC = Spec(
    "qk_norm_rope", TEMPLATE, ("wg", "vw", "upg", "gpc", "hpw", "pf"),
    lambda sc: {"wg": [64, 128, 256, 512], "vw": [2, 4, 8], "upg": [2, 4, 8, 16, 32, 64],
                "gpc": [1, 2, 4, 8], "hpw": [1, 2, 4], "pf": [1, 2, 3]},
    heuristic,
    rules=lambda p, sc: ((p["vw"] in VECTOR_WIDTHS, f"vw must be one of {VECTOR_WIDTHS}"),
                         (p["wg"] % p["upg"] == 0, "upg must divide wg"),
                         (p["hpw"] in (1, 2, 3, 4), "hpw must be 1, 2, 3 or 4"),
                         (p["hpw"] == 1 or p["wg"] // p["upg"] <= 32,
                          "hpw above 1 needs at most 32 work-items a unit (wg/upg)"),
                         (p["pf"] in (1, 2, 3), "pf must be 1, 2 or 3")),
    local_bytes=local_bytes, render=_render,
    doc="qk_norm_rope and qk_norm_rope_bwd: wg work-items per group, vw vector width, upg segments per group "
        "(per step), hpw units (consecutive heads) a segment takes, the table and the gain loaded once for them, "
        "gpc backward groups per compute unit, pf the backward's next step (1 loaded when it comes, 2 "
        "prefetched, 3 loaded into registers during this step's sum)")


def _geometry(queue, x, w):
    """(n, heads, hd) of ``x`` with gain ``w``; the head dim is checked."""
    check_array("x", x, queue, dtype=FLOATS)
    check_array("w", w, queue, ndim=1, dtype=(x.dtype, F32) if x.dtype != F32 else F32)
    hd = w.shape[0]
    if x.ndim == 3:
        if x.shape[2] != hd:
            raise ValueError(f"w: expected shape ({x.shape[2]},) (the head dim of x {x.shape}), got {w.shape}")
        n, heads = x.shape[:2]
    elif x.ndim == 2:
        if x.shape[1] % hd:
            raise ValueError(f"w: head dim {hd} does not divide the rows of x {x.shape}")
        n, heads = x.shape[0], x.shape[1] // hd
    else:
        raise ValueError(f"x: expected [n, heads, hd] or [n, heads·hd], got shape {x.shape}")
    if hd % 4 or hd > MAX_HD:
        raise ValueError(f"x: unsupported head dim {hd} (a multiple of 4 up to {MAX_HD})")
    return n, heads, hd


def _rope(queue, rope, n, hd, window, cu_seqlens, max_seqlen):
    """(half, window or the number of sequences, cu_seqlens (numpy or device) or None, rope or None) of
    ``n`` rows, checked against head dim ``hd``."""
    cu = None
    if cu_seqlens is not None:  # attention's checks (and exactly one of window and cu_seqlens)
        nseq, longest, cu = check_sequences(queue, n, window, cu_seqlens, max_seqlen, tokens="x")
    elif max_seqlen is not None:
        raise ValueError("max_seqlen: only with cu_seqlens")
    if rope is None:
        return 0, 1, None, None
    if isinstance(rope, cla.Array) and rope.size == 0:
        if rope.dtype != np.float32:
            raise TypeError(f"rope: dtype must be float32, got {rope.dtype}")
        if rope.ndim != 3 or rope.shape[1:] != (0, 2):
            raise ValueError(f"rope: expected shape [table, half, 2], got {rope.shape}")
        return 0, 1, None, None
    check_array("rope", rope, queue, ndim=3)
    table, half, two = rope.shape
    if two != 2:
        raise ValueError(f"rope: expected shape [table, half, 2] (cos, sin), got {rope.shape}")
    if 2 * half > hd:
        raise ValueError(f"rope: half {half} exceeds hd/2 = {hd // 2}")
    if cu is not None:
        if longest > table:
            raise ValueError(f"rope: the table has {table} positions, too short for the longest sequence "
                             f"({'max_seqlen ' if max_seqlen is not None else ''}{longest})")
        return half, nseq, cu, rope
    window = table if window is None else positive_int("window", window)
    if window > table:
        raise ValueError(f"rope: the table has {table} positions, too short for window {window}")
    return half, window, None, rope


def _plan(queue, name, units, hd, half, st="float", wst="float", varlen=0):
    """(params, kernel, units as its index type), built (the ops reach it through _launch's memo)."""
    sc = {"hd": hd, "st": st}
    p = SPEC.params(queue.device, sc)
    # unit offsets past the end (the last group's units), and the backward's unit ranges
    block = p["upg"] * p["hpw"]
    idx = index_type((units + block) * hd, 2 * (units + block))
    _, knl = SPEC.kernels(queue, sc, half=half, idx=idx, st=st, wst=wst, varlen=varlen,
                          ptx=int(runtime.nvidia(queue.device)))
    return p, knl[name], index_scalar(idx)(units)


def _launch(queue, name, n, heads, hd, half, window, st, wst, varlen):
    """(kernel, groups, [units, heads, window or sequences] as its scalars): one memo lookup when warm."""
    return SPEC.plan(queue, ("launch", name, n, heads, hd, half, window, st, wst, varlen), _launch_plan, name,
                     n * heads, heads, hd, half, window, st, wst, varlen)


def _launch_plan(queue, name, units, heads, hd, half, window, st, wst, varlen):
    p, knl, itype_units = _plan(queue, name, units, hd, half, st, wst, varlen)
    block = p["upg"] * p["hpw"]  # the units of a group at a time
    if name == "qk_norm_rope_fwd":
        groups = -(-units // block)
    else:  # each group a partial row of dw
        groups = bwd_dw_groups(queue.device, {"rpg": block, "gpc": p["gpc"]}, units, MIN_STEPS)
    return knl, (groups,), [itype_units, np.uint32(heads), np.uint32(window)]


def qk_norm_rope(queue, x, w, rope, *, eps=1e-6, gemma=True, window=None, cu_seqlens=None, max_seqlen=None, out=None,
                 inv=None, wait_for=None, allocator=None):
    """``(y, inv)``: per-head RMSNorm of ``x`` then RoPE; ``inv [n, heads]`` = 1/rms per unit."""
    check_queue(queue)
    eps = check_eps(eps)
    n, heads, hd = _geometry(queue, x, w)
    half, window, cu, rope = _rope(queue, rope, n, hd, window, cu_seqlens, max_seqlen)
    y, inv = outputs(queue, allocator, [("out", out, x.shape), ("inv", inv, (n, heads), F32)],
                     [("x", x), ("w", w), ("rope", rope)], dtype=x.dtype)
    knl, groups, sizes = _launch(queue, "qk_norm_rope_fwd", n, heads, hd, half, window, storage(x.dtype),
                                 storage(w.dtype), int(cu is not None))
    cu = upload_sequences(queue, cu, n, allocator)
    args = [y.base_data, inv.base_data, x.base_data, w.base_data] + ([rope.base_data] if half else [])
    args += ([cu.base_data] if cu is not None else []) + [*sizes, eps, gain_offset(gemma)]
    evt = knl(queue, groups, args, wait_for=events(wait_for, y, inv, x, w, rope, cu))
    hold([evt], y, inv, x, w, rope, cu)
    return wrote([evt], y, inv)


def qk_norm_rope_bwd(queue, x, w, inv, rope, dy, *, gemma=True, window=None, cu_seqlens=None, max_seqlen=None,
                     dx=None, dw=None, wait_for=None, allocator=None):
    """``(dx, dw)``: the inverse rotation of ``dy``, then the RMSNorm backward.

    ``dx`` is written; ``dw [hd]`` (``w``'s dtype) is summed over rows and heads, written, or added into a
    given ``dw``. ``window`` / ``cu_seqlens`` / ``max_seqlen``: those of the forward.
    """
    check_queue(queue)
    n, heads, hd = _geometry(queue, x, w)
    half, window, cu, rope = _rope(queue, rope, n, hd, window, cu_seqlens, max_seqlen)
    check_array("inv", inv, queue, shape=(n, heads))
    check_array("dy", dy, queue, shape=x.shape, dtype=x.dtype, like="x")
    accumulate = dw is not None
    dx, dw = outputs(queue, allocator, [("dx", dx, x.shape), ("dw", dw, (hd,), w.dtype)],
                     [("x", x), ("w", w), ("inv", inv), ("rope", rope), ("dy", dy)], dtype=x.dtype)
    knl, groups, sizes = _launch(queue, "qk_norm_rope_bwd", n, heads, hd, half, window,
                                 storage(x.dtype), storage(w.dtype), int(cu is not None))
    cu = upload_sequences(queue, cu, n, allocator)
    partial = scratch(queue, groups[0] * hd, allocator)  # per-group column sums
    args = [dx.base_data, partial, x.base_data, w.base_data, inv.base_data] + ([rope.base_data] if half else [])
    args += ([cu.base_data] if cu is not None else []) + [dy.base_data, *sizes, gain_offset(gemma)]
    evt = knl(queue, groups, args, wait_for=events(wait_for, dx, x, w, inv, rope, cu, dy))
    done = column_sum(queue, partial, groups[0], hd, dw, accumulate, wait_for=[evt], allocator=allocator)
    hold([done], partial, dx, dw, x, w, inv, rope, cu, dy)
    wrote([evt], dx)
    wrote([evt, done], dw)  # both stages' events: the profile of dw covers its two kernels
    return dx, dw
