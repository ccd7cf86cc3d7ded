"""Grouped-query attention inside windows or sequences: forward (and, below it, the backward).

Layout: q ``[n, nh, hd]``, k and v ``[n, nkv, hd]``, C-contiguous, of one storage dtype (float32,
float16 or bfloat16: loads widen, the math is float32, each stored result is rounded once to
nearest even; ``lse``, the backward's D and its dS scratch are float32 always);
``n = windows · window`` tokens (or the sequences of ``cu_seqlens``), attention
never crosses a window and positions restart at 0 in each; key j is seen by
query i of the same window iff ``j ≤ i`` (causal, the default; every j otherwise),
and with a sliding window W only when ``i − W < j`` (and, not causal, ``j < i + W``);
query head h reads kv head ``h // (nh / nkv)``.

Variants are render flags of the same templates (``causal``, ``sliding``,
``softcap``, ``varlen``; see the templates' banners), with the tiles of the
causal kernels: causal over equal windows renders the kernels as they were
before the variants.

Forward op name in the tuning database: ``"attention_fwd"``, shape class
``{"hd": hd}``; its spec is ``FWD`` (and the backward's ``BWD[kind]``, see
below). Template ``attention_fwd.cl.mako``. Its parameters:

- ``bq``: query rows per work-group; a multiple of ``rq``.
- ``rq``: query rows per work-item (its register tile has ``rq`` rows of scores
  and of the output); ``bq / rq`` work-items share the rows of a group.
- ``tx``: work-items across keys (scores) and across head-dim columns (output);
  the work-group has ``tx · bq / rq`` work-items.
- ``bk``: keys per key block (the online-softmax step); a multiple of ``tx``
  (each work-item scores ``bk / tx`` keys per row) and of ``kc``.
- ``vw``: vector width (1, 2 or 4) of loads and of the output columns a work-item
  owns; divides ``dc``. The head dim is padded to a multiple of ``tx · vw`` in the
  output tile (padding is zero and never stored).
- ``dc``: head-dim chunk of Q and K staged in local memory per step of Q·Kᵀ;
  a multiple of ``vw``. With ``dc ≥ hd`` the Q block is staged once and stays.
- ``kc``: keys of V staged in local memory per step of P·V; divides ``bk``.

Local memory: ``4·(max((bq + bk)·(dc + vw), pv) + bq·tx)`` bytes with
``pv = bk·(bq + 4) + kc·(hdp + vw)`` (``bk·(bq + 4)`` rounded up to a multiple of
``vw``), ``hdp`` the padded head dim; with ``dc ≥ hd``:
``4·(bq·(dc + vw) + max(bk·(dc + vw), pv) + bq·tx)``. A parameter set that breaks a rule or does
not fit the device raises :class:`clops.LimitError` (a ValueError).
"""
from __future__ import annotations

import dataclasses
import math
import typing

import numpy as np
import pyopencl as cl

from .args import (F32, FLOAT32_MAX, FLOATS, check_array, check_queue, check_sequences, events, finite_float, flag,
                   hold, index_type, outputs, positive_int, scratch, storage, upload_sequences, wrote)
from . import mma
from .program import LimitError
from .spec import Spec

MAX_HD = 256
LOG2E = 1.4426950408889634
# The variant flags and storage type of the templates (_Call.extra) rendered when a call gives none:
# causal attention at float32.
PLAIN = {"causal": 1, "sliding": 0, "softcap": 0, "varlen": 0, "st": "float", "emulate": 0}


def visible_condition(causal, sliding, i, j):
    """The templates' mask: the OpenCL C condition that query position ``i`` sees key position ``j``
    of its sequence (C expressions; ``W`` is the kernels' sliding window), None when every pair is seen."""
    if not sliding:
        return f"{j} <= {i}" if causal else None
    if causal:
        return f"{j} <= {i} && {i} < {j} + W"
    return f"{i} < {j} + W && {j} < {i} + W"


def mask_edges(causal, sliding, q0, k0, nq, nk):
    """The matrix-unit drivers' conditions (C expressions) that some query of [q0, q0 + nq) does not see
    some key of [k0, k0 + nk) of the same sequence (``W`` the kernels' sliding window)."""
    out = [f"{k0} + {nk} - 1 > {q0}"] if causal else []
    if sliding:
        out.append(f"{q0} + {nq} > {k0} + W")
        if not causal:
            out.append(f"{k0} + {nk} > {q0} + W")
    return out


def _check_geometry(queue, q, k, v):
    """(n, nh, nkv, hd) of valid q, k, v; raises naming the argument otherwise."""
    check_queue(queue)
    check_array("q", q, queue, ndim=3, dtype=FLOATS)
    n, nh, hd = q.shape
    check_array("k", k, queue, ndim=3, dtype=q.dtype, like="q")
    if k.shape[0] != n or k.shape[2] != hd:
        raise ValueError(f"k: expected shape ({n}, nkv, {hd}) to match q {q.shape}, got {k.shape}")
    nkv = k.shape[1]
    check_array("v", v, queue, shape=k.shape, dtype=q.dtype, like="q")
    if nh % nkv:
        raise ValueError(f"k: nh ({nh}, from q) must be a multiple of nkv ({nkv}, from k)")
    if hd % 8 or hd > MAX_HD:
        raise ValueError(f"q: head dim {hd} unsupported (multiples of 8 from 8 to {MAX_HD})")
    return n, nh, nkv, hd


def _scale(scale, hd):
    """The score scale: ``scale`` checked, or 1/sqrt(hd)."""
    if scale is None:
        return 1.0 / math.sqrt(hd)
    scale = finite_float("scale", scale)
    if abs(scale) * LOG2E > FLOAT32_MAX:  # the kernels take scale·log2(e)
        raise ValueError(f"scale: |scale|·log2(e) must be finite in float32, got {scale:.4g}")
    return scale


class _Call(typing.NamedTuple):
    """One attention call's geometry and variant, checked: what the kernels are rendered and run with (a
    named tuple: a frozen dataclass cost 1.5-2 µs a call to make)."""
    n: int
    nh: int
    nkv: int
    hd: int
    nseq: int  # windows, or sequences of cu_seqlens
    T: int  # the window, or the longest sequence (max_seqlen)
    cu: object  # cu_seqlens (numpy until uploaded) or None
    causal: bool
    W: int  # the sliding window, 0 for none (also when it covers every sequence)
    softcap: float  # 0.0 for none
    scale: float
    st: str  # q, k and v's storage type (clops.args.storage)

    def extra(self):
        """The variant's template parameters (all four 0/1 flags, causal alone: the plain kernels; the
        storage type)."""
        return {"causal": int(self.causal), "sliding": int(self.W > 0), "softcap": int(self.softcap > 0),
                "varlen": int(self.cu is not None), "st": self.st}

    def coefs(self):
        """The score coefficient (scale·log2 e, or scale/softcap under the cap) and, with a softcap,
        softcap·log2 e: the kernels' capped log2-domain score is softcap·log2 e·tanh(s·scale/softcap)."""
        if self.softcap:
            return [np.float32(self.scale / self.softcap), np.float32(self.softcap * LOG2E)]
        return [np.float32(self.scale * LOG2E)]

    def variant_args(self, softcap=True):
        """The trailing kernel arguments of a variant: the sliding window, then (``softcap``) softcap·log2 e."""
        return ([np.uint32(self.W)] if self.W else []) + (self.coefs()[1:] if softcap else [])

    def key(self):
        """What determines the kernels, grids and scalar arguments of the call (a plan's memo key)."""
        return (self.n, self.nh, self.nkv, self.hd, self.nseq, self.T, self.causal, self.W, self.softcap, self.scale,
                self.st, self.cu is not None)


def _check_call(queue, q, k, v, window, cu_seqlens, max_seqlen, causal, sliding_window, softcap, scale):
    n, nh, nkv, hd = _check_geometry(queue, q, k, v)
    nseq, T, cu = check_sequences(queue, n, window, cu_seqlens, max_seqlen)
    causal = flag("causal", causal)
    W = 0 if sliding_window is None else positive_int("sliding_window", sliding_window)
    if W >= T:  # a window that covers every sequence masks nothing
        W = 0
    scale = _scale(scale, hd)
    cap = 0.0
    if softcap is not None:
        cap = finite_float("softcap", softcap)
        if not np.float32(cap) > 0:
            raise ValueError(f"softcap: must be positive, got {softcap!r}")
        if abs(scale) / cap > FLOAT32_MAX or cap * LOG2E > FLOAT32_MAX:
            raise ValueError(f"softcap: scale/softcap and softcap·log2(e) must be finite in float32, got {cap:.4g}")
    return _Call(n, nh, nkv, hd, nseq, T, cu, causal, W, cap, scale, storage(q.dtype))


def fwd_heuristic(dev, sc):
    """Forward tiles from the device's limits (the shapes that measured best on an H200, by head dim)."""
    hd = sc["hd"]
    if not dev.type & cl.device_type.GPU:
        return {"bq": 16, "rq": 4, "tx": 4, "bk": 16, "vw": 4, "dc": 32, "kc": 16}
    small = hd <= 64
    p = {"bq": 64, "rq": 8 if 64 < hd <= 128 else 4, "tx": 8 if small else 16, "bk": 32 if small else 64,
         "vw": 4, "dc": hd if small else 32, "kc": 16}
    while _fwd_local_bytes(p, sc) > dev.local_mem_size and p["bk"] > p["tx"]:
        p["bk"] //= 2
        p["kc"] = min(p["kc"], p["bk"])
    while fwd_wg(p, sc) > dev.max_work_group_size and p["bq"] > p["rq"]:
        p["bq"] //= 2
    return p


def _fwd_hdp(hd, p):
    step = p["tx"] * p["vw"]
    return -(-hd // step) * step


def fwd_wg(p, sc):
    """Work-items of a forward group: ``tx`` across keys times ``bq / rq`` across rows."""
    return p["tx"] * (p["bq"] // p["rq"])


def _fwd_local_bytes(p, sc):
    hd, bq, bk, dc, vw, kc, tx = sc["hd"], p["bq"], p["bk"], p["dc"], p["vw"], p["kc"], p["tx"]
    # Step 1's K (and Q) chunks share local memory with Pᵀ and the V chunk of steps 2-3.
    pv = -(-bk * (bq + 4) // vw) * vw + kc * (_fwd_hdp(hd, p) + vw)
    if dc >= hd:  # Q resident beside them
        return 4 * (bq * (dc + vw) + max(bk * (dc + vw), pv) + bq * tx)
    return 4 * (max((bq + bk) * (dc + vw), pv) + bq * tx)


def _fwd_rules(p, sc):
    return (
        (p["vw"] in (1, 2, 4), "vw must be 1, 2 or 4"),
        (p["bq"] % p["rq"] == 0, "bq must be a multiple of rq"),
        (p["bk"] % p["tx"] == 0, "bk must be a multiple of tx"),
        (p["bk"] % p["kc"] == 0, "kc must divide bk"),
        (p["dc"] % p["vw"] == 0, "dc must be a multiple of vw"),
    )


FWD = Spec(
    "attention_fwd", "attention_fwd.cl.mako", ("bq", "rq", "tx", "bk", "vw", "dc", "kc"),
    lambda sc: {"bq": [16, 32, 64, 128], "rq": [1, 2, 4, 8], "tx": [4, 8, 16, 32], "bk": [16, 32, 64, 128],
                "vw": [1, 2, 4], "dc": [16, 32, 64], "kc": [8, 16, 32]},
    fwd_heuristic, rules=_fwd_rules, wg=fwd_wg, local_bytes=_fwd_local_bytes,
    render=lambda p, sc: dict(p, hd=sc["hd"], **PLAIN), doc="attention forward (the module docstring lists the tiles)")


# The matrix-unit forward: attention_fwd_mma.cl.mako, the same kernel arguments and grid layout,
# its tile products (tile_products.cl.mako) chosen by clops.mma.forward_product. Op name in the
# tuning database "attention_fwd_mma", shape class {"hd", "st", "product"}. Its parameters:
#   nw  warps of 32 work-items per group, each on 16 query rows (16·nw/sx/gp rows a group);
#   gp  query heads a group (1, 2 or 4; nw/sx a multiple), the heads of one KV head: its row tiles are
#       the heads' in turn, so a staged key block serves gp heads over 16·nw/sx/gp positions (a sliding
#       window's group visits fewer keys outside the window). A call whose heads a KV head serves
#       (nh/nkv) gp does not divide takes the largest power of two that does (the heuristic: 2 with the 16-bit
#       products on a GPU);
#   bk  keys per key block, a multiple of 16;
#   stages  buffers of K and V: 1, or 2 (a block staged during all of the block before's products);
#   af  how the matrix-unit products fetch the warps' Q: 1 once, held in registers; 2 from global memory
#       at each key block (L1-cached). The heuristic holds Q (1) but for tf32x3 above hd 128: the register
#       proxy (tools/nvptx_registers.py, tf32x3 at hd 256, the heuristic's 8 warps and 16 keys) spills
#       264 bytes a lane holding Q and 36 reading it, and an H100 runs it 1.27 times as fast reading it;
#   sx  1, or 2: the warps in column halves' pairs, two on each 16 rows, each on half of the head dim's
#       columns of Q and O (half the accumulators a warp), adding the pair's partial S through local
#       memory (nw even, hd a multiple of 16).
# Local memory: 2·stages·bk·(hd + e)·s + 4·(stages + 1) bytes (s = 4, e = 4 for float storage; s = 2,
# e = 8 for 16-bit), plus 4·(16·nw·bk + 64·nw) with the portable products, plus 4·16·nw·bk with sx 2.

def _mma_local_bytes(p, sc, stages=1):
    pad, size = (8, 2) if sc["st"] != "float" else (4, 4)
    stage = p["bk"] * (sc["hd"] + pad) * size  # K, and V
    portable = 4 * (16 * p["nw"] * p["bk"] + 2 * 32 * p["nw"]) if sc["product"] == "fma" else 0
    pairs = 4 * 16 * p["nw"] * p["bk"] if p.get("sx") == 2 else 0  # the backward's dq and dqs: none
    return 2 * stages * stage + 4 * (stages + 1) + portable + pairs


def _h200_tiles(sc):
    """The H200's measured forward tiles: 8 warps and 32 keys above hd 128 (float32 storage: above 64),
    4 and 64 below."""
    big = sc["hd"] > (64 if sc["st"] == "float" else 128)
    return {"nw": 8, "bk": 32} if big else {"nw": 4, "bk": 64}


def _mma_heuristic(dev, sc):
    """Two warps, 16 keys and one buffer off a GPU. On a GPU (fewer keys until the blocks fit): with the
    16-bit products 4 warps, 64 keys up to hd 64, 32 above, two buffers where they fit, one above (an
    H100's bf16 sweeps, 2026-12-05, causal forward: hd 128 251 TFLOP/s against 233 at 64 keys and one
    buffer, hd 64 194 against 180; hd 256 4 warps as fast as 8, and faster under a sliding window of
    512, 185 against 155, or a softcap, 246 against 234; 2 warps slower there too, 2026-12-06: sliding-512
    143 / 154 / 130 against 190 / 199 / 173 at hd 256 / 128 / 64, and 16 or 64 keys at hd 128 190 / 187
    against 198); tf32x3 4 warps and 32 keys in one buffer (16 at hd 256, where 32 do not fit); the others the
    H200's tiles, one buffer. Q held (af 1), but above hd 128 for tf32x3 only in column halves' pairs (sx 2)
    and read at each step (af 2) for the others. The 16-bit products take two query heads a group (gp 2,
    where a KV head serves two or more): on an H100 (2026-12-08, bf16, tile overrides in one process, the
    bench's shapes, TFLOP/s) causal 266.4 / 261.0 against 260.6 / 252.1 at qwen-hd256 / llama-hd128 and
    sliding-512 216.4 / 222.5 against 199.4 / 202.5 (gp 4: 265.5 / 256.8 and 207.4 / 220.3; 8 warps on
    two heads 256.6 / 192.6 and 184.9 / 165.1)."""
    if not dev.type & cl.device_type.GPU:
        return {"nw": 2, "bk": 16, "stages": 1, "af": 1, "sx": 1, "gp": 1}
    if sc["product"] in ("bf16", "f16"):
        p = {"nw": 4, "bk": 64 if sc["hd"] <= 64 else 32, "stages": 2, "af": 1, "sx": 1, "gp": 2}
        if _mma_local_bytes(p, sc, 2) > dev.local_mem_size:
            p["stages"] = 1
    else:
        # tf32x3 from an H100's sweeps, 2026-12-06, with P·V's sums from zero each block: hd 64 0.533 ms
        # against 0.566 at 64 keys; hd 128 5.45 against 6.04 at 16 keys in two buffers, 5.69 with 8 warps;
        # 2026-12-07, P·V in four chains: hd 256 (16 keys) Q held by column halves' pairs 10.75 ms against
        # 12.72 read at each step by whole rows, 15.22 held by whole rows (it spills), 10.97 with 8 warps
        pairs = sc["product"] == "tf32x3" and sc["hd"] > 128 and sc["hd"] % 16 == 0
        p = dict({"nw": 4, "bk": 32} if sc["product"] == "tf32x3" else _h200_tiles(sc), stages=1,
                 af=2 if sc["hd"] > 128 and not pairs else 1, sx=2 if pairs else 1, gp=1)
    while _mma_local_bytes(p, sc, p["stages"]) > dev.local_mem_size and p["bk"] > 16:
        p["bk"] //= 2
    return p


# sx 2: on NVIDIA each pair of warps waits at a hardware barrier of its own, ids 1 .. 15 (tile_products'
# PAIR_BARRIER), so at most 15 pairs a group
PAIR_WARPS_MAX = 30


def _pair_warps(nw):
    """``nw`` warps split into column halves' pairs (sx 2): an even count with a barrier id for each pair."""
    return nw % 2 == 0 and nw <= PAIR_WARPS_MAX


FWD_MMA = Spec(
    "attention_fwd_mma", "attention_fwd_mma.cl.mako", ("nw", "bk", "stages", "af", "sx", "gp"),
    lambda sc: {"nw": [1, 2, 4, 8], "bk": [16, 32, 64, 128], "stages": [1, 2], "af": [1, 2], "sx": [1, 2],
                "gp": [1, 2, 4]},
    _mma_heuristic,
    rules=lambda p, sc: ((p["bk"] % 16 == 0, "bk must be a multiple of 16"),
                         (p["gp"] in (1, 2, 4) and p["nw"] // p["sx"] % p["gp"] == 0,
                          "gp must be 1, 2 or 4, dividing nw/sx"),
                         (p["stages"] in (1, 2), "stages must be 1 or 2"), (p["af"] in (1, 2), "af must be 1 or 2"),
                         (p["sx"] == 1 or (p["sx"] == 2 and _pair_warps(p["nw"]) and sc["hd"] % 16 == 0),
                          f"sx must be 1, or 2 with nw even, at most {PAIR_WARPS_MAX} (a hardware barrier a pair) "
                          "and hd a multiple of 16")),
    wg=lambda p, sc: 32 * p["nw"], local_bytes=lambda p, sc: _mma_local_bytes(p, sc, p["stages"]),
    render=lambda p, sc: {**PLAIN, "fuse": 0, "capref": 0, **p, "hd": sc["hd"], "st": sc["st"], "kind": sc["product"]},
    doc="attention forward on the matrix-unit driver (clops.mma chooses its tile products)")


# The matrix-unit forward takes softcap·log2 e as every row's reference max (no row maxima) up to this
# softcap·log2 e (softcap 34.7): P = 2^(capped − cap) ≥ 2^(−2·CAPREF_MAX), far from float32's underflow.
CAPREF_MAX = 50.0


def _fwd_plan(queue, call):
    """(kernel, grid, scalar arguments) of the forward for ``call``: one memo lookup when warm."""
    product, _ = mma.forward_product(queue, call.st)
    idx = index_type(call.n * call.nh * call.hd)
    c = call.coefs()[0]
    if product is None:
        p, knl = FWD.kernels(queue, {"hd": call.hd}, idx=idx, **call.extra())
        rows, heads = p["bq"], call.nh
    else:
        sc = {"hd": call.hd, "st": call.st, "product": product}
        gp = FWD_MMA.params(queue.device, sc)["gp"]
        while (call.nh // call.nkv) % gp:  # a group's heads share a KV head
            gp //= 2
        p, knl = FWD_MMA.kernels(queue, sc, idx=idx, emulate=int(mma.emulated()), fuse=int(c > 0),
                                 capref=int(0 < call.softcap * LOG2E <= CAPREF_MAX), **call.extra(), gp=gp)
        rows, heads = 16 * p["nw"] // p["sx"] // gp, call.nh // gp
    scalars = [np.uint32(call.T), np.uint32(call.nh), np.uint32(call.nh // call.nkv), c]
    return knl["attention_fwd"], (heads, call.nseq, -(-call.T // rows)), scalars + call.variant_args()


def attention(queue, q, k, v, *, window=None, cu_seqlens=None, max_seqlen=None, causal=True, sliding_window=None,
              softcap=None, scale=None, out=None, lse=None, wait_for=None, allocator=None):
    """``(o [n, nh, hd], lse [n, nh])``: softmax attention inside each window or sequence.

    Exactly one of ``window`` (equal windows) and ``cu_seqlens`` (int32 offsets of the
    sequences, from 0 to n: a numpy array, or a device array with ``max_seqlen``, at least
    its longest sequence). Query i sees key j ≤ i (``causal``) or every key, and with
    ``sliding_window=W`` only keys with i − W < j (and, not causal, j < i + W).
    ``softcap=c`` caps the scaled scores to c·tanh(s/c). ``lse`` is the natural
    log-sum-exp of the (capped) scaled scores of each (row, head).
    """
    call = _check_call(queue, q, k, v, window, cu_seqlens, max_seqlen, causal, sliding_window, softcap, scale)
    n, nh, hd = call.n, call.nh, call.hd
    out, lse = outputs(queue, allocator, [("out", out, (n, nh, hd)), ("lse", lse, (n, nh), F32)],
                       [("q", q), ("k", k), ("v", v)], dtype=q.dtype)
    knl, groups, scalars = FWD.plan(queue, (*call.key(), mma.mode()), _fwd_plan, call)
    cu = upload_sequences(queue, call.cu, call.n, allocator)
    args = [q.base_data, k.base_data, v.base_data, out.base_data, lse.base_data] + ([cu.base_data] if cu is not None else [])
    evt = knl(queue, groups, args + scalars, wait_for=events(wait_for, q, k, v, out, lse, cu))
    hold([evt], q, k, v, out, lse, cu)
    return wrote([evt], out, lse)


# ---- backward ----
#
# attention_bwd enqueues three kernels of ``attention_bwd.cl.mako``: D = Σ dO·O per
# (row, head) into a scratch array, dK/dV (one work-group per key block, window
# and kv head, looping over the group's query heads and the query blocks from the
# diagonal on) and dQ (one work-group per query block, window and head). No
# atomics: the result is the same bit for bit on every run. dQ comes one of two
# ways (``store_ds``):
#   stored  the dK/dV pass also writes dS (the causal triangle of each window and
#           head: windows·nh·window·(window+1)/2 floats of scratch; with a variant
#           R floats per (token, head), see ds_scratch_floats) and the dQ
#           pass ("dqs") computes dQ = dS·K from it;
#   recomputed  the dQ pass ("dq") computes S, dP and dS again: no scratch,
#           but three matrix products per block pair instead of one.
#
# Op names in the tuning database: "attention_bwd_dkv", "attention_bwd_dq" and
# "attention_bwd_dqs", shape class {"hd": hd}. dkv and dq take the same names:
#   wg  work-items per group; must equal split·(bq/sq)·(bk/sk) and, with
#       rows = bk for dkv (key rows accumulated), bq for dq (query rows),
#       split·(bk/tr)·(hd/td) for dkv, (bq/tr)·(hd/td) for dq.
#   split  1: each work-item computes both S and dP (and, in dkv, accumulates
#       both dV and dK); 2: the two halves of the group take one each.
#   bq  query rows per block; bk keys per block.
#   sq, sk  score tile of a work-item (sq query rows × sk keys of S and dP);
#       sq divides bq, sk divides bk.
#   dc  head-dim columns of Q, dO, K, V staged per step of S = Q·Kᵀ; divides hd,
#       a multiple of vw.
#   jc  rows staged (all hd columns) per step of the accumulation: query rows of
#       Q and dO for dkv (divides bq), key rows of K for dq (divides bk).
#   tr  accumulator rows per work-item: 1, 2, 4, 8 or 16, dividing rows.
#   td  accumulator head-dim columns per work-item; divides hd, a multiple of vw.
#   vw  vector width of loads and accumulators: 1, 2 or 4.
# Local memory: 4·(max((2·bq + 2·bk)·(dc/vw + 1)·vw, m·jc·hd) + m·bq·bk) bytes,
# m = 2 for dkv, 1 for dq.
# dqs takes wg, bq, jc (keys of K and columns of dS staged per step, any
# positive count), tr, td and vw as dq does, with wg = (bq/tr)·(hd/td); local
# memory 4·(jc·hd + bq·(jc + 1)) bytes.
# A set that breaks a rule or does not fit the device raises LimitError (a
# ValueError) naming the rule.

BWD_TEMPLATE = "attention_bwd.cl.mako"


def _bwd_mats(kind):
    return 2 if kind == "dkv" else 1


def _bwd_local_bytes(kind):
    def local_bytes(p, sc):
        hd = sc["hd"]
        if kind == "dqs":
            return 4 * (p["jc"] * hd + p["bq"] * (p["jc"] + 1))
        m = _bwd_mats(kind)
        # step 2 stages its operand only when step 1 did not hold the whole head dim (dc < hd)
        stage = max((2 * p["bq"] + 2 * p["bk"]) * (p["dc"] // p["vw"] + 1) * p["vw"],
                    0 if p["dc"] == hd else m * p["jc"] * hd)
        return 4 * (stage + m * p["bq"] * p["bk"])

    return local_bytes


def bwd_tile_wg(kind, hd, p):
    """Work-items of step 2's accumulator tiles: (rows/tr)·(hd/td), rows = bk for dkv, bq for dq;
    times split for dkv, whose halves accumulate dV and dK (dq's one matrix is shared by all)."""
    rows = p["bk"] if kind == "dkv" else p["bq"]
    return (p["split"] if kind == "dkv" else 1) * (rows // p["tr"]) * (hd // p["td"])


def _bwd_rules(kind):
    def rules(p, sc):
        hd = sc["hd"]
        rows, rname = (p["bk"], "bk") if kind == "dkv" else (p["bq"], "bq")
        step2 = (
            (p["vw"] in (1, 2, 4), "vw must be 1, 2 or 4"),
            (hd % p["td"] == 0 and p["td"] % p["vw"] == 0, "td must divide hd and be a multiple of vw"),
            (p["tr"] in (1, 2, 4, 8, 16) and rows % p["tr"] == 0, f"tr must be 1, 2, 4, 8 or 16 and divide {rname}"),
        )
        if kind == "dqs":
            return step2 + ((bwd_tile_wg(kind, hd, p) == p["wg"], "wg must equal (bq/tr)·(hd/td)"),)
        chunked, cname = (p["bq"], "bq") if kind == "dkv" else (p["bk"], "bk")
        return step2 + (
            (p["split"] in (1, 2), "split must be 1 or 2"),
            (hd % p["dc"] == 0 and p["dc"] % p["vw"] == 0, "dc must divide hd and be a multiple of vw"),
            (p["bq"] % p["sq"] == 0 and p["bk"] % p["sk"] == 0, "sq must divide bq and sk divide bk"),
            (chunked % p["jc"] == 0, f"jc must divide {cname}"),
            (p["split"] * (p["bq"] // p["sq"]) * (p["bk"] // p["sk"]) == p["wg"],
             "wg must equal split·(bq/sq)·(bk/sk)"),
            (bwd_tile_wg(kind, hd, p) == p["wg"],
             f"wg must equal {'split·' if kind == 'dkv' else ''}({rname}/tr)·(hd/td)"),
        )

    return rules


def _bwd_heuristic(kind):
    def heuristic(dev, sc):
        return bwd_heuristic(dev, kind, sc["hd"])

    return heuristic


def bwd_heuristic(dev, kind, hd):
    """Backward tiles for ``kind`` ("dkv", "dq" or "dqs"): the largest accumulator tile
    (at most 64 floats per work-item when possible) on up to 128 (GPU) or 256 work-items."""
    # vw and the columns per work-item: as many column groups as hd allows, td ≤ 32 where possible
    for vw in (4, 2, 1):
        ncol = 1
        while (hd // vw) % (2 * ncol) == 0 and hd // (2 * ncol) >= 8:
            ncol *= 2
        if hd // ncol <= 32:
            break
    td, m = hd // ncol, _bwd_mats(kind)
    # On the H200 groups of 64-128 work-items beat 256 at every head dim measured (more groups per SM).
    max_wg = min(128 if dev.type & cl.device_type.GPU else 256, dev.max_work_group_size)
    tiles = [(rows, tr) for rows in (64, 32, 16) for tr in (16, 8, 4, 2, 1)
             if rows % tr == 0 and (rows // tr) * ncol <= max_wg]
    fits = [t for t in tiles if m * t[1] * td <= 64] or [min(tiles, key=lambda t: t[1])]
    rows, tr = max(fits, key=lambda t: ((t[0] // t[1]) * ncol, t[1]))
    wg = (rows // tr) * ncol
    if kind == "dqs":
        return {"wg": wg, "bq": rows, "jc": 16, "tr": tr, "td": td, "vw": vw}
    for other in (64, 32, 16, 8, 4, 2, 1):
        if (rows * other) % wg == 0 and rows * other // wg <= 16:
            break
    e1 = rows * other // wg
    bq, bk = (other, rows) if kind == "dkv" else (rows, other)
    sq = next(s for s in (4, 2, 1) if e1 % s == 0 and bq % s == 0 and bk % (e1 // s) == 0)
    dc = next(d for d in (32, 16, 8, 4, 2, 1) if hd % d == 0 and d % vw == 0)  # halved below until it fits
    p = {"wg": wg, "split": 1, "bq": bq, "bk": bk, "sq": sq, "sk": e1 // sq, "dc": dc, "jc": math.gcd(8, other),
         "tr": tr, "td": td, "vw": vw}
    while _bwd_local_bytes(kind)(p, {"hd": hd}) > dev.local_mem_size and p["dc"] > vw:
        p["dc"] //= 2
    return p


def _bwd_derive(kind):
    """What a sweep does not choose: wg from the accumulator tiles (bwd_tile_wg), then, but for dqs,
    sk so that split·(bq/sq)·(bk/sk) = wg (0: impossible)."""

    def derive(p, sc):
        if kind == "dqs":
            return dict(p, wg=bwd_tile_wg(kind, sc["hd"], p))
        wg = bwd_tile_wg(kind, sc["hd"], p)
        per = p["split"] * p["bq"] * p["bk"]
        return dict(p, wg=wg, sk=per // (p["sq"] * wg) if per % (p["sq"] * wg) == 0 else 0)

    return derive


def _bwd_render(kind):
    """The template parameters of the ``kind`` pass; dkv adds ``lanes``, attn_bwd_dsum's work-items
    per row (up to 8 that read the row's vectors side by side, as many as divide the row and the group)."""

    def render(p, sc):
        p = dict(p, kind=kind, hd=sc["hd"], **PLAIN)
        if kind == "dkv":
            p["lanes"] = math.gcd(sc["hd"] // p["vw"], 8, p["wg"])
        return p

    return render


def _bwd_spec(kind, names, space, doc):
    return Spec("attention_bwd_" + kind, BWD_TEMPLATE, names, lambda sc: dict(space), _bwd_heuristic(kind),
                rules=_bwd_rules(kind), local_bytes=_bwd_local_bytes(kind), render=_bwd_render(kind),
                sweep_derive=_bwd_derive(kind), doc=doc)


_BWD_NAMES = ("wg", "split", "bq", "bk", "sq", "sk", "dc", "jc", "tr", "td", "vw")
_BWD_SPACE = {"bq": [16, 32, 64], "bk": [16, 32, 64], "tr": [1, 2, 4, 8], "td": [8, 16, 32, 64], "vw": [2, 4],
              "dc": [8, 16, 32], "jc": [4, 8, 16], "sq": [1, 2, 4], "split": [1, 2]}
BWD = {
    "dkv": _bwd_spec("dkv", _BWD_NAMES, _BWD_SPACE, "attn_bwd_dsum and attn_bwd_dkv (dK, dV; dS stored or not)"),
    "dq": _bwd_spec("dq", _BWD_NAMES, _BWD_SPACE, "attn_bwd_dq (dQ recomputing S, dP and dS)"),
    "dqs": _bwd_spec("dqs", ("wg", "bq", "jc", "tr", "td", "vw"),
                     {"bq": [16, 32, 64, 128], "tr": [1, 2, 4, 8, 16], "td": [8, 16, 32, 64], "vw": [2, 4],
                      "jc": [8, 16, 32, 64]}, "attn_bwd_dqs (dQ = dS·K from the stored dS)"),
}


# The matrix-unit backward: attention_bwd_mma.cl.mako, each pass its own spec, with the forward's tile
# products (clops.mma.backward_product): "dkv" storing dS, then "dqs" (dQ = dS·K; its program has the
# D kernel run first); or, dS recomputed, "dq" (it also stores D for "dkv") then "dkv". Op names in the
# tuning database "attention_bwd_mma_" + the pass, shape class {"hd", "st", "product"}. Parameters:
#   nw  warps of 32 work-items per group, each on 16 rows (query rows in dq, keys in dkv);
#   bk  the staged block: keys (dq, dqs) or query rows (dkv), a multiple of 16;
#   af  dq and dkv: how the 16-bit products fetch the warps' A operands: 1 once, held in registers; 2 from
#       global memory at each step (L1-cached: fewer registers, what hd 256 needs);
#   stages  dq only: buffers of K and V, 1 (three barriers a block), or 2 (the next block's staged during
#       all of this block's products, one barrier a block, as the forward's). The heuristic takes 2
#       (and 32 keys) with the 16-bit products up to hd 64, 1 elsewhere; at bf16 two buffers fit 48 KiB up
#       to 32 keys at hd 128 (not yet swept there), 64 at hd 64;
#   cs  dkv only, 1 or 2: the group computes 1/cs of dK's and dV's columns (cs groups per key block,
#       each computing S and dP again), cs·8 dividing hd;
#   sx  dkv only, 1 or 2: the warps computing S and dP for 16 keys; 2 (with cs 2, nw even, 32 dividing
#       hd): the column halves are the two warps of a pair in one group, each computing S and dP over
#       its half of the columns and adding its pair's partial sums through local memory (8·nw keys a
#       group).
# Local memory: as the forward's, but with the portable products no quad reductions (256·nw bytes
# fewer); dkv adds 8·bk bytes (the block's lse and D), and with sx 2 64·nw·bk (the partial sums).

def _bwd_mma_local_bytes(pass_):
    def local_bytes(p, sc):
        quads = 256 * p["nw"] if sc["product"] == "fma" else 0
        return _mma_local_bytes(p, sc, p.get("stages", 1)) - quads + (8 * p["bk"] if pass_ == "dkv" else 0)

    return local_bytes


def _bwd_mma_heuristic(pass_):
    """Tiles from the H200's sweeps (bf16) on a GPU, fewer keys until the blocks fit; two warps and 16
    elsewhere."""
    def heuristic(dev, sc):
        gpu = dev.type & cl.device_type.GPU
        # tf32x3 holds float A operands, twice the 16-bit kinds' registers: "big" above hd 64, as the forward's
        big = sc["hd"] > (64 if sc["product"] == "tf32x3" else 128)
        if pass_ == "dqs":
            # tf32x3 from an H100's sweeps, 2026-12-06 (hd 128 2.97 ms against 3.08 with 8 warps) and, with
            # its split of two instructions, 2026-12-07 (hd 256, where 32 keys do not fit: 6.59 against 6.95
            # with 2 warps); the 16-bit products not yet swept: the H200's forward tiles
            if not gpu:
                p = {"nw": 2, "bk": 16}
            elif sc["product"] == "tf32x3":
                p = {"nw": 4, "bk": 32}
            else:
                p = _h200_tiles(sc)
        elif gpu:
            # measured on the H200 (bf16): dq 4 warps and 64 keys up to hd 128, above 8 warps and 32
            # keys; dkv 4 warps and 32 query rows, above hd 128 the column halves in the two warps of
            # a pair (qwen-hd256: 6.12 ms against 9.65 in two groups; at hd 128 3.52 against 2.67 whole);
            # the A operands held in registers (dq at hd 256 too, spilling: 4.50 ms against 5.77 read at
            # each step). tf32x3's dq the same warps, 32 keys from hd 128 (an H100's sweeps, 2026-12-07,
            # P·V in four chains: hd 256 19.1 ms held against 23.4 read at each step; hd 128 7.26 against
            # 7.52 with 8 warps, 7.70 read)
            p = {"nw": 8 if pass_ == "dq" and sc["hd"] > 128 else 4, "bk": 32 if big or pass_ == "dkv" else 64,
                 "af": 1}
            # tf32x3's dkv reads its A operands at each step (L1) above hd 128, its column halves in four
            # warp pairs (an H100's sweeps, 2026-12-06: hd 128 15.1 ms held against 20.3 read; hd 256
            # 33.0 in four pairs against 36.2 in two)
            if sc["product"] == "tf32x3" and pass_ == "dkv" and sc["hd"] > 128:
                p.update(af=2, nw=8)
        else:
            p = {"nw": 2, "bk": 16, "af": 1}
        if pass_ == "dq":
            # the 16-bit products up to hd 64: 32 keys in two buffers (an H100, 2026-12-06: bf16 0.187 ms
            # against 0.209 at 64 keys in one); tf32x3 64 keys in one (2026-12-07: 0.651 against 0.688 at 32)
            small = gpu and sc["product"] in ("bf16", "f16") and sc["hd"] <= 64
            p["stages"] = 2 if small else 1
            if small:
                p["bk"] = 32
        if pass_ == "dkv":
            p["cs"] = 2 if big and gpu and sc["hd"] % 16 == 0 else 1
            p["sx"] = 2 if big and gpu and sc["hd"] % 32 == 0 else 1
        while _bwd_mma_local_bytes(pass_)(p, sc) > dev.local_mem_size and p["bk"] > 16:
            p["bk"] //= 2
        return p

    return heuristic


def _bwd_mma_rules(p, sc):
    return ((p["bk"] % 16 == 0, "bk must be a multiple of 16"), (p.get("af", 1) in (1, 2), "af must be 1 or 2"),
            (p.get("stages", 1) in (1, 2), "stages must be 1 or 2"),
            (p.get("cs", 1) in (1, 2) and sc["hd"] % (8 * p.get("cs", 1)) == 0, "cs must be 1 or 2, 8·cs dividing hd"),
            (p.get("sx", 1) in (1, 2), "sx must be 1 or 2"),
            (p.get("sx", 1) == 1 or (p["cs"] == 2 and _pair_warps(p["nw"]) and sc["hd"] % 32 == 0),
             f"sx 2 needs cs 2, an even nw of at most {PAIR_WARPS_MAX} (a hardware barrier a pair) and 32 dividing hd"))


BWD_MMA = {pass_: Spec(
    "attention_bwd_mma_" + pass_, "attention_bwd_mma.cl.mako",
    ("nw", "bk") + (("af",) if pass_ != "dqs" else ()) + (("stages",) if pass_ == "dq" else ())
    + (("cs", "sx") if pass_ == "dkv" else ()),
    lambda sc, pass_=pass_: {"nw": [1, 2, 4, 8], "bk": [16, 32, 64], **({"af": [1, 2]} if pass_ != "dqs" else {}),
                             **({"stages": [1, 2]} if pass_ == "dq" else {}),
                             **({"cs": [1, 2], "sx": [1, 2]} if pass_ == "dkv" else {})},
    _bwd_mma_heuristic(pass_), rules=_bwd_mma_rules,
    wg=lambda p, sc: 32 * p["nw"], local_bytes=_bwd_mma_local_bytes(pass_),
    render=lambda p, sc, pass_=pass_: {**PLAIN, "af": 1, "stages": 1, "cs": 1, "sx": 1, "store_ds": 0, **p, "hd": sc["hd"],
                                       "st": sc["st"], "kind": sc["product"], "pass_": pass_},
    doc=f"attention backward's {pass_} pass on the matrix-unit driver (clops.mma chooses its tile products)")
    for pass_ in ("dq", "dkv", "dqs")}


def ds_scratch_floats(call):
    """Floats of the dS scratch of the stored way: the causal triangle of each window and head; with
    a variant, R floats per (token, head), R the longest row a query can see (see the template)."""
    if call.causal and not call.W and call.cu is None:
        return call.nseq * call.nh * call.T * (call.T + 1) // 2
    row = (call.W if call.causal else 2 * call.W - 1) if call.W else call.T
    return call.n * call.nh * row


def ds_tiles(call):
    """(tiles, RT) of the matrix-unit backward's stored dS (attention_bwd_mma.cl.mako): 16×16 tiles of
    256 elements; RT the tiles of a query tile's row, 0 for the causal triangles of equal windows."""
    nt = -(-call.T // 16)
    if call.causal and not call.W and call.cu is None:
        return call.nseq * call.nh * nt * (nt + 1) // 2, 0
    qt = np.arange(nt)
    lo = np.maximum(16 * qt + 1 - call.W, 0) // 16 if call.W else 0
    hi = qt if call.causal else (np.minimum(call.T - 1, 16 * qt + 14 + call.W) // 16 if call.W else (call.T - 1) // 16)
    rt = int(np.max(hi - lo)) + 1
    rows = call.nseq * nt if call.cu is None else -(-call.n // 16) + call.nseq
    return rows * call.nh * rt, rt


def ds_tile_floats(call, product):
    """Floats of the matrix-unit backward's dS scratch: elements of the product's operand type."""
    return ds_tiles(call)[0] * 256 // (2 if product in ("bf16", "f16") else 1)


# On the matrix units, recomputing S and dP in the dQ pass costs two products of hd each, while the
# stored dS costs the same bytes at every hd: on an H100 at bf16, storing took fwd + bwd from 155 to
# 183 TFLOP/s at hd 256 and lost at hd 64 (124 against 137). At hd 128 the H200 gains by it (2026-12-06,
# stored against recomputed: causal 188.4 against 179.6, softcap 178.1 / 169.7, varlen 185.7 / 183.6,
# non-causal 208.7 / 204.9) and the H100 is within 3 % either way (182.0 / 181.5, 171.0 / 169.8,
# 177.8 / 183.2, 203.3 / 206.7). tf32x3's products cost three of the unit's each, so it stores from hd 64
# (an H100, 2026-12-06, small-hd64 forward + backward: 2.107 ms stored against 2.442 recomputed; below hd
# 64 not measured). The least hd from which each product stores dS by default:
MMA_STORE_DS_MIN_HD = {"tf32x3": 64, "bf16": 128, "f16": 128, "fma": 128}


def store_ds_default(dev, scratch_bytes):
    """attention_bwd's choice when ``store_ds`` is None: store dS when its scratch fits one
    allocation and takes at most an eighth of the device's global memory."""
    return scratch_bytes <= min(dev.max_mem_alloc_size, dev.global_mem_size // 8)


@dataclasses.dataclass(frozen=True)
class _BwdPlan:
    """The backward's kernels, grids and fixed scalar arguments for one call's key: D, dK/dV, then dQ (from
    the stored dS, or recomputing it); the portable passes, or the matrix units' with dS stored."""
    dsum: object
    dsum_groups: tuple
    dkv: object
    kv_groups: tuple
    kv_scalars: list  # after the buffers (and cu_seqlens): geometry, coefficients, variant (matrix units: RT)
    dq: object  # attn_bwd_dqs (dS stored) or attn_bwd_dq
    q_groups: tuple
    q_scalars: list
    store_ds: bool
    floats: int  # of the dS scratch


def _bwd_plan(queue, call, store_ds, floats):
    sc, extra = {"hd": call.hd}, call.extra()
    qkind = "dqs" if store_ds else "dq"
    idx = index_type(call.n * call.nh * call.hd, floats if store_ds else 0)
    pk, kv_knl = BWD["dkv"].kernels(queue, sc, idx=idx, store_ds=int(store_ds), **extra)
    # dQ from the stored dS does not depend on the softcap: one build for both
    pq, q_knl = BWD[qkind].kernels(queue, sc, idx=idx, **(dict(extra, softcap=0) if store_ds else extra))
    geom = [np.uint32(call.T), np.uint32(call.nh), np.uint32(call.nkv), np.uint32(call.nseq)]
    coefs = [call.coefs()[0], np.float32(call.scale)]
    rows = call.n * call.nh
    return _BwdPlan(kv_knl["attn_bwd_dsum"], (-(-rows // (pk["wg"] // pk["lanes"])),),
                    kv_knl["attn_bwd_dkv"], (-(-call.T // pk["bk"]) * call.nseq * call.nkv,),
                    geom + coefs + call.variant_args(),
                    q_knl["attn_bwd_" + qkind], (-(-call.T // pq["bq"]) * call.nseq * call.nh,),
                    geom + call.variant_args(softcap=False) if store_ds else geom + coefs + call.variant_args(),
                    store_ds, floats)


def _bwd_route(queue, call, store_ds):
    """The backward's plan: the matrix-unit passes where the device's product allows
    (clops.mma.backward_product), else the portable ones; dS stored as ``store_ds`` says (None: as
    store_ds_default says, on the matrix units only from the product's MMA_STORE_DS_MIN_HD)."""
    product, _ = mma.backward_product(queue, call.st)
    floats = ds_scratch_floats(call) if product is None else ds_tile_floats(call, product)
    if store_ds is None:
        store_ds = ((product is None or call.hd >= MMA_STORE_DS_MIN_HD[product])
                    and store_ds_default(queue.device, 4 * floats))
    elif store_ds and 4 * floats > queue.device.max_mem_alloc_size:
        raise LimitError(f"store_ds: the dS scratch takes {4 * floats} bytes, more than the device's "
                         f"CL_DEVICE_MAX_MEM_ALLOC_SIZE ({queue.device.max_mem_alloc_size})")
    if product is None:
        return _bwd_plan(queue, call, store_ds, floats)
    return _bwd_mma_plan(queue, call, product, store_ds, floats)


@dataclasses.dataclass(frozen=True)
class _BwdMmaPlan:
    """The matrix-unit backward's two kernels, grids and scalar arguments for one call's key, dS
    recomputed (stored, it takes a _BwdPlan: the portable passes' order and arguments)."""
    dq: object
    q_groups: tuple
    dkv: object
    kv_groups: tuple
    scalars: list  # after the buffers (and cu_seqlens), both passes


def dsum_lanes(hd):
    """Work-items a row of the matrix-unit backward's attn_bwd_dsum: up to 8, reading the row's 4-element
    vectors side by side (as many as divide them)."""
    return math.gcd(hd // 4, 8)


def _bwd_mma_plan(queue, call, product, store, floats):
    sc = {"hd": call.hd, "st": call.st, "product": product}
    tiles, rt = ds_tiles(call) if store else (0, 0)
    idx = index_type(call.n * call.nh * call.hd, 256 * tiles)
    emulate = int(mma.emulated())
    qpass = "dqs" if store else "dq"
    # dQ from the stored dS does not depend on the softcap: one build for both
    pq, q_knl = BWD_MMA[qpass].kernels(queue, sc, idx=idx, emulate=emulate,
                                       **dict(call.extra(), softcap=0 if store else int(call.softcap > 0)))
    pk, kv_knl = BWD_MMA["dkv"].kernels(queue, sc, idx=idx, emulate=emulate, store_ds=int(store), **call.extra())
    geom = [np.uint32(call.T), np.uint32(call.nh), np.uint32(call.nh // call.nkv)]
    scalars = geom + [call.coefs()[0], np.float32(call.scale)] + call.variant_args()
    q_groups = (call.nh, call.nseq, -(-call.T // (16 * pq["nw"])))
    kv_groups = (call.nkv * (1 if pk["sx"] == 2 else pk["cs"]), call.nseq, -(-call.T // (16 * pk["nw"] // pk["sx"])))
    if not store:
        return _BwdMmaPlan(q_knl["attn_bwd_dq"], q_groups, kv_knl["attn_bwd_dkv"], kv_groups, scalars)
    band = [np.uint32(rt)] if rt else []  # the stored dS's tiles a query tile, where not triangles
    return _BwdPlan(q_knl["attn_bwd_dsum"], (-(-call.n * call.nh // (32 * pq["nw"] // dsum_lanes(call.hd))),),
                    kv_knl["attn_bwd_dkv"], kv_groups, scalars + band,
                    q_knl["attn_bwd_dqs"], q_groups, geom + call.variant_args(softcap=False) + band, True, floats)


def attention_bwd(queue, q, k, v, o, lse, do, *, window=None, cu_seqlens=None, max_seqlen=None, causal=True,
                  sliding_window=None, softcap=None, scale=None, store_ds=None, dq=None, dk=None, dv=None,
                  wait_for=None, allocator=None):
    """``(dq, dk, dv)`` of :func:`attention` given its ``o``, ``lse`` and the output gradient ``do``,
    with the same ``window`` / ``cu_seqlens``, ``causal``, ``sliding_window``, ``softcap`` and ``scale``.

    ``dk`` and ``dv`` are summed over the query heads that share each kv head.
    The matrix-unit backward runs where the forward takes the matrix units (:mod:`clops.mma`),
    the portable one elsewhere. ``store_ds``: True, the dK/dV pass stores dS in a scratch array
    and dQ is computed from it; False, the dQ pass recomputes it (no scratch, more arithmetic);
    None (default): on the portable kernels, stored when the scratch takes at most an eighth
    of the device's global memory and fits one allocation (CL_DEVICE_MAX_MEM_ALLOC_SIZE); on the
    matrix units, the same but only from hd 64 at float32 (tf32x3) and hd 128 at 16 bits
    (MMA_STORE_DS_MIN_HD), recomputed below. The scratch: portable,
    causal over equal windows ``4·windows·nh·window·(window + 1)/2`` bytes, otherwise
    ``4·n·nh·R``, R the longest row of keys a query sees (the sliding window W causal, 2W − 1
    not, else the window or max_seqlen); matrix units, tiles of 16×16 elements (2 bytes at
    16-bit storage, else 4) over the same pairs, rounded out to whole tiles (:func:`ds_tiles`).
    """
    call = _check_call(queue, q, k, v, window, cu_seqlens, max_seqlen, causal, sliding_window, softcap, scale)
    n, nh = call.n, call.nh
    check_array("o", o, queue, shape=q.shape, dtype=q.dtype, like="q")
    check_array("lse", lse, queue, shape=(n, nh))
    check_array("do", do, queue, shape=q.shape, dtype=q.dtype, like="q")
    if store_ds is not None and not isinstance(store_ds, bool):
        raise TypeError(f"store_ds: expected True, False or None, got {store_ds!r}")
    plan = BWD["dkv"].plan(queue, (*call.key(), store_ds, mma.mode()), _bwd_route, call, store_ds)
    dq, dk, dv = outputs(queue, allocator, [("dq", dq, q.shape), ("dk", dk, k.shape), ("dv", dv, k.shape)],
                         [("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse), ("do", do)], dtype=q.dtype)
    cu = upload_sequences(queue, call.cu, call.n, allocator)
    seqs = [cu.base_data] if cu is not None else []
    dsum = scratch(queue, n * nh, allocator)  # D = Σ dO·O
    if isinstance(plan, _BwdMmaPlan):  # dq first: it stores D for dkv
        e_q = plan.dq(queue, plan.q_groups, [q.base_data, k.base_data, v.base_data, o.base_data, do.base_data,
                                             lse.base_data, dsum, dq.base_data] + seqs + plan.scalars,
                      wait_for=events(wait_for, q, k, v, o, do, lse, dq, cu))
        e_kv = plan.dkv(queue, plan.kv_groups, [q.base_data, k.base_data, v.base_data, do.base_data, lse.base_data,
                                                dsum, dk.base_data, dv.base_data] + seqs + plan.scalars,
                        wait_for=[e_q] + events(None, dk, dv))
        hold([e_kv], q, k, v, o, lse, do, dq, dk, dv, dsum, cu)
        wrote([e_kv], dk, dv)
        wrote([e_q], dq)
        return dq, dk, dv
    stored = [scratch(queue, plan.floats, allocator)] if plan.store_ds else []  # dS
    e_sum = plan.dsum(queue, plan.dsum_groups, [o.base_data, do.base_data, dsum, np.uint32(n * nh)],
                      wait_for=events(wait_for, o, do))
    ins = [q.base_data, k.base_data, v.base_data, do.base_data, lse.base_data, dsum]
    e_kv = plan.dkv(queue, plan.kv_groups, ins + [dk.base_data, dv.base_data] + stored + seqs + plan.kv_scalars,
                    wait_for=[e_sum] + events(None, q, k, v, lse, dk, dv, cu))
    if plan.store_ds:
        e_q = plan.dq(queue, plan.q_groups, [k.base_data, stored[0], dq.base_data] + seqs + plan.q_scalars,
                      wait_for=[e_kv] + events(None, dq))
    else:
        e_q = plan.dq(queue, plan.q_groups, ins + [dq.base_data] + seqs + plan.q_scalars,
                      wait_for=[e_sum] + events(None, q, k, v, lse, dq, cu))
    # on an out-of-order queue dQ (recomputed) may finish before dK/dV: both are waited for
    hold([e_kv, e_q], q, k, v, o, lse, do, dq, dk, dv, dsum, cu, *stored)
    wrote([e_kv], dk, dv)
    wrote([e_q], dq)
    return dq, dk, dv
