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

Storage: ``x``, ``dy`` and the outputs ``y``, ``dx`` share one dtype (float32, float16 or
bfloat16; math and sums are float32, each stored value rounded once to nearest even); ``w`` is
float32 or that dtype, and ``dw`` takes ``w``'s (summed in float32, rounded once); ``inv`` and
``rope`` are float32 always.

Tuning (``clops.tuning``; the spec ``SPEC``): op ``"qk_norm_rope"``, shape class ``{"hd": hd}``, parameters
``wg`` work-items per group, ``vw`` vector width (1, 2, 4, 8 or 16; the largest power of
two ≤ ``vw`` dividing ``hd`` is used), ``upg`` units (row, head) handled at a time by a
group (divides ``wg``), ``rb`` units per backward group, i.e. per partial row of the dw
reduction (a multiple of ``upg``). The dw column sum is :func:`clops.norm.column_sum` (groups of
32 columns × 8 row slices; two launches beyond 512 partial rows).
"""
from __future__ import annotations

import numpy as np
import pyopencl.array as cla

from .args import (F32, FLOATS, check_array, check_queue, check_sequences, events, hold, index_scalar, index_type,
                   outputs, positive_int, scratch, storage, upload_sequences, wrote)
from .norm import VECTOR_WIDTHS, check_eps, column_sum, gain_offset, pow2_ceil, vector_width
from .spec import Spec

TEMPLATE = "qk_norm_rope.cl.mako"
MAX_HD = 512


def heuristic(dev, sc):
    """One vector of 4 per work-item up to 128 work-items per unit; groups of at least 128."""
    hd = sc["hd"]
    cap = int(min(dev.max_work_group_size, 1024))
    vw = vector_width(4, hd)
    tpu = min(pow2_ceil(hd // vw), 128, cap)
    wg = max(tpu, min(128, cap))
    return {"wg": wg, "vw": vw, "upg": wg // tpu, "rb": 32 * (wg // tpu)}


def local_bytes(p, sc):
    """Local memory of a group: the units' vectors (for the rotation) and the reduction scratch."""
    return 4 * (p["upg"] * sc["hd"] + p["wg"])


def _render(p, sc):
    hd = sc["hd"]
    p = dict(p, hd=hd, vw=vector_width(p["vw"], hd), st="float", wst="float")  # storage types: each call's own
    p["ch"] = -(-hd // (p["vw"] * (p["wg"] // p["upg"])))
    return p


SPEC = Spec(
    "qk_norm_rope", TEMPLATE, ("wg", "vw", "upg", "rb"),
    lambda sc: {"wg": [32, 64, 128, 256, 512], "vw": [1, 2, 4, 8], "upg": [1, 2, 4, 8], "rb": [8, 16, 32, 64]},
    heuristic,
    rules=lambda p, sc: ((p["vw"] in VECTOR_WIDTHS, f"vw must be one of {VECTOR_WIDTHS}"),
                         (p["wg"] % p["upg"] == 0 and p["rb"] % p["upg"] == 0, "upg must divide wg and rb")),
    local_bytes=local_bytes, render=_render,
    doc="qk_norm_rope and qk_norm_rope_bwd: wg work-items per group, vw vector width, upg units per group, "
        "rb units per backward group")


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
    sc = {"hd": hd}
    p = SPEC.params(queue.device, sc)
    idx = index_type(units * hd + p["rb"] * hd)
    _, knl = SPEC.kernels(queue, sc, half=half, idx=idx, st=st, wst=wst, varlen=varlen)
    return p, knl[name], index_scalar(idx)(units)


def _launch(queue, name, n, heads, hd, half, window, st, wst, varlen):
    """(kernel, groups, blocks of the backward, [units, heads, window or sequences] as its scalars):
    one memo lookup when warm."""
    return SPEC.plan(queue, ("launch", name, n, heads, hd, half, window, st, wst, varlen), _launch_plan, name,
                     n * heads, heads, hd, half, window, st, wst, varlen)


def _launch_plan(queue, name, units, heads, hd, half, window, st, wst, varlen):
    p, knl, itype_units = _plan(queue, name, units, hd, half, st, wst, varlen)
    blocks = -(-units // p["rb"])  # the backward's groups, each a partial row of dw
    groups = (-(-units // p["upg"]),) if name == "qk_norm_rope_fwd" else (blocks,)
    return knl, groups, blocks, [itype_units, np.uint32(heads), np.uint32(window)]


def qk_norm_rope(queue, x, w, rope, *, eps=1e-6, gemma=True, window=None, cu_seqlens=None, max_seqlen=None, out=None,
                 inv=None, wait_for=None, allocator=None):
    """``(y, inv)``: per-head RMSNorm of ``x`` then RoPE; ``inv [n, heads]`` = 1/rms per unit."""
    check_queue(queue)
    eps = check_eps(eps)
    n, heads, hd = _geometry(queue, x, w)
    half, window, cu, rope = _rope(queue, rope, n, hd, window, cu_seqlens, max_seqlen)
    y, inv = outputs(queue, allocator, [("out", out, x.shape), ("inv", inv, (n, heads), F32)],
                     [("x", x), ("w", w), ("rope", rope)], dtype=x.dtype)
    knl, groups, _, sizes = _launch(queue, "qk_norm_rope_fwd", n, heads, hd, half, window, storage(x.dtype),
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
    knl, groups, blocks, sizes = _launch(queue, "qk_norm_rope_bwd", n, heads, hd, half, window, storage(x.dtype),
                                         storage(w.dtype), int(cu is not None))
    cu = upload_sequences(queue, cu, n, allocator)
    partial = scratch(queue, blocks * hd, allocator)  # per-block column sums
    args = [dx.base_data, partial, x.base_data, w.base_data, inv.base_data] + ([rope.base_data] if half else [])
    args += ([cu.base_data] if cu is not None else []) + [dy.base_data, *sizes, gain_offset(gemma)]
    evt = knl(queue, groups, args, wait_for=events(wait_for, dx, x, w, inv, rope, cu, dy))
    done = column_sum(queue, partial, blocks, hd, dw, accumulate, wait_for=[evt], allocator=allocator)
    hold([done], partial, dx, dw, x, w, inv, rope, cu, dy)
    wrote([evt], dx)
    wrote([evt, done], dw)  # both stages' events: the profile of dw covers its two kernels
    return dx, dw
