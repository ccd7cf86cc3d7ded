"""Attention variants against the float64 reference, forward and backward (both ways to dQ):
non-causal, sliding window, logit softcap, and sequences of different lengths (cu_seqlens).

As in tests/test_attention_bwd.py, the backward takes o and lse from the reference forward.
"""
import math

import numpy as np
import pyopencl.array as cla
import pytest

import clops
from clops import reference as ref
from clops import tuning
from test_attention import VARIANTS as FWD_TILES
from test_attention_bwd import VARIANTS as BWD_TILES

O_TOL, LSE_TOL, TOL = 1e-5, 1e-6, 1e-5

# (causal, sliding_window, softcap) over 2 windows of 37 tokens: not a multiple of any tile
EQUAL = {
    "bidirectional": (False, None, None),
    "sliding": (True, 5, None),
    "sliding-bidirectional": (False, 5, None),
    "softcap": (True, None, 3.0),
    "all": (False, 7, 2.0),
    "sliding-covers-window": (True, 64, None),
    "sliding-edge-on-block-edge": (False, 2, None),  # a block's first row sees the previous block's last key
}
# offsets with an empty sequence, one of a single token, lengths across tile edges
CU = np.array([0, 5, 5, 60, 61, 100], np.int32)
VARLEN = {
    "causal": (True, None, None),
    "bidirectional": (False, None, None),
    "sliding-softcap": (True, 3, 2.0),
    "sliding-bidirectional": (False, 3, None),
}


@pytest.fixture(params=[True, False], ids=["ds-stored", "ds-recomputed"])
def store_ds(request):
    return request.param


def _variant(causal, sliding_window, softcap):
    return {"causal": causal, "sliding_window": sliding_window, "softcap": softcap}


def _qkv(n, nh, nkv, hd):
    return ref.rnd((n, nh, hd), 11), ref.rnd((n, nkv, hd), 12), ref.rnd((n, nkv, hd), 13)


def _ref_kw(kw):
    """The reference's keywords: cu_seqlens on the host, no max_seqlen."""
    return {x: y.get() if isinstance(y, cla.Array) else y for x, y in kw.items() if x != "max_seqlen"}


def _forward(queue, n, nh, nkv, hd, **kw):
    q, k, v = _qkv(n, nh, nkv, hd)
    o, lse = clops.attention(queue, *(cla.to_device(queue, x) for x in (q, k, v)), **kw)
    want_o, want_lse = ref.attention(q, k, v, **_ref_kw(kw))
    assert ref.rel_err(o.get(), want_o) <= O_TOL
    assert ref.rel_err(lse.get(), want_lse) <= LSE_TOL


def _backward(queue, store_ds, n, nh, nkv, hd, **kw):
    """(got, want) gradients (dq, dk, dv)."""
    q, k, v = _qkv(n, nh, nkv, hd)
    do = ref.rnd((n, nh, hd), 14)
    ref_kw = _ref_kw(kw)
    o, lse = (a.astype(np.float32) for a in ref.attention(q, k, v, **ref_kw))
    arrays = (q, k, v, o, lse, do)
    got = clops.attention_bwd(queue, *(cla.to_device(queue, a) for a in arrays), store_ds=store_ds, **kw)
    return [g.get() for g in got], ref.attention_bwd(*arrays, **ref_kw), arrays


def _check_backward(queue, store_ds, n, nh, nkv, hd, **kw):
    got, want, _ = _backward(queue, store_ds, n, nh, nkv, hd, **kw)
    errs = [ref.rel_err(g, w) for g, w in zip(got, want)]
    assert max(errs) <= TOL, dict(zip(("dq", "dk", "dv"), errs))


@pytest.mark.parametrize("variant", EQUAL.values(), ids=EQUAL.keys())
def test_forward(queue, variant):
    _forward(queue, 74, 4, 2, 40, window=37, **_variant(*variant))


@pytest.mark.parametrize("variant", EQUAL.values(), ids=EQUAL.keys())
def test_backward(queue, store_ds, variant):
    _check_backward(queue, store_ds, 74, 4, 2, 40, window=37, **_variant(*variant))


@pytest.mark.parametrize("nkv, hd", [(1, 128), (4, 8)])
def test_other_head_dims_and_groups(queue, store_ds, nkv, hd):
    kw = dict(window=37, **_variant(*EQUAL["all"]))
    _forward(queue, 74, 4, nkv, hd, **kw)
    _check_backward(queue, store_ds, 74, 4, nkv, hd, **kw)


@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window_of_one(queue, store_ds, causal):
    # Each query sees itself alone: o = v, P = 1 and dS = P·(dP − D) is rounding noise around 0,
    # so dq and dk are checked against the size of their terms, dv (= dO summed over the group)
    # relatively (as tests/test_attention_bwd.py's window of one).
    kw = dict(window=37, causal=causal, sliding_window=1)
    _forward(queue, 74, 4, 2, 40, **kw)
    (dq, dk, dv), (_, _, want_dv), (q, k, _, _, _, do) = _backward(queue, store_ds, 74, 4, 2, 40, **kw)
    assert ref.rel_err(dv, want_dv) <= TOL
    assert np.linalg.norm(dq) <= TOL * np.linalg.norm(do) * np.linalg.norm(k)
    assert np.linalg.norm(dk) <= TOL * np.linalg.norm(do) * np.linalg.norm(q)


@pytest.mark.parametrize("variant", VARLEN.values(), ids=VARLEN.keys())
def test_varlen(queue, store_ds, variant):
    kw = dict(cu_seqlens=CU, **_variant(*variant))
    _forward(queue, 100, 4, 1, 64, **kw)
    _check_backward(queue, store_ds, 100, 4, 1, 64, **kw)


def test_varlen_device_offsets(queue, store_ds):
    # cu_seqlens on the device, max_seqlen above the longest sequence: nothing is read back
    kw = dict(cu_seqlens=cla.to_device(queue, CU), max_seqlen=70, **_variant(*VARLEN["sliding-bidirectional"]))
    _forward(queue, 100, 4, 1, 64, **kw)
    _check_backward(queue, store_ds, 100, 4, 1, 64, **kw)


# Tiles the variants' masks and the softcap's split halves must honour (the first split-2 set of
# each backward pass: P, then P·(1 − tanh²), passes between the halves through local memory).
@pytest.mark.parametrize("op, params", [("attention_fwd", FWD_TILES[0]), ("attention_fwd", FWD_TILES[3])]
                         + [("attention_bwd_" + kind, next(p for p in BWD_TILES[kind] if p.get("split") == 2))
                            for kind in ("dkv", "dq")], ids=lambda x: x if isinstance(x, str) else "")
def test_tile_variants(queue, op, params):
    tuning.override(op, {"hd": 40}, params)
    try:
        for kw in (dict(window=37, **_variant(*EQUAL["all"])), dict(cu_seqlens=CU, **_variant(*VARLEN["sliding-softcap"])),
                   dict(window=37, **_variant(*EQUAL["sliding-edge-on-block-edge"]))):
            n = 100 if "cu_seqlens" in kw else 74
            if op == "attention_fwd":
                _forward(queue, n, 4, 2, 40, **kw)
            else:
                for store in (True, False) if op.endswith("dkv") else (False,):
                    _check_backward(queue, store, n, 4, 2, 40, **kw)
    finally:
        tuning.override(op, {"hd": 40}, None)


def test_store_ds_beyond_one_allocation_is_refused(queue):
    # non-causal: n·nh·window floats of dS, beyond CL_DEVICE_MAX_MEM_ALLOC_SIZE in one window
    window = 1 << math.ceil(math.log2(math.sqrt(queue.device.max_mem_alloc_size / 4)) + 1)
    q, k = cla.zeros(queue, (window, 1, 8), np.float32), cla.zeros(queue, (window, 1, 8), np.float32)
    lse = cla.zeros(queue, (window, 1), np.float32)
    with pytest.raises(clops.LimitError, match="^store_ds: .*CL_DEVICE_MAX_MEM_ALLOC_SIZE"):
        clops.attention_bwd(queue, q, k, k, q, lse, q, window=window, causal=False, store_ds=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sliding", [True, False])
def test_mask_edges_match_the_pairs(causal, sliding):
    """The matrix-unit drivers mask only blocks where mask_edges holds: evaluated as Python against every
    pair of small blocks, it must hold wherever some pair is unseen (and only there)."""
    from clops.attn import mask_edges, visible_condition

    seen, edges = visible_condition(causal, sliding, "i", "j"), mask_edges(causal, sliding, "q0", "k0", "nq", "nk")
    for W in (1, 3, 8) if sliding else (None,):
        for q0 in range(0, 12, 3):
            for k0 in range(0, 24, 2):
                for nq, nk in ((1, 1), (4, 2), (2, 8)):
                    env = dict(W=W, q0=q0, k0=k0, nq=nq, nk=nk)
                    pairs = [eval(seen.replace("&&", "and"), dict(env, i=i, j=j)) if seen else True
                             for i in range(q0, q0 + nq) for j in range(k0, k0 + nk)]
                    assert any(eval(e, dict(env)) for e in edges) == (not all(pairs)), env
