"""attention / attention_bwd at float16 and bfloat16 storage against the float64 reference.

q, k, v (and o, do, dq, dk, dv) share one 16-bit dtype; lse, the backward's D and its dS scratch
are float32. The reference takes the same rounded q, k, v, do and, for the backward, the same
stored forward outputs: the float64 o rounded once to the dtype, lse rounded to float32 (the
backward is tested alone, as in tests/test_attention_bwd.py).

Tolerances: lse at the float32 forward's (relative L2 LSE_TOL); o, dq, dk and dv within 1 storage
ulp of the float64 result rounded once, relative to the row's scale, plus the float32 tolerance of
tests/test_attention*.py (O_TOL, TOL) of that scale (helpers.assert_storage_close). A row is one
(token, head) of hd values; its scale is its largest |value|, for a gradient at least the
gradient's RMS: rows that cancel, as dQ of a window's first query (its dS is rounding noise around
0), are bounded by the float32 tests only through the whole gradient's relative L2.

Each 16-bit result is also, bit for bit, the float32 op's on the widened inputs (same tiles)
rounded once to nearest even: the math is float32 and the store its one rounding. (Not for a
forward on the matrix units, whose 16-bit products round P to the storage type as an operand:
tests/test_attention_mma.py.)
"""
import contextlib

import ml_dtypes
import numpy as np
import pyopencl.array as cla
import pytest

import clops
from clops import reference as ref
from clops import mma, tuning
from clops.args import storage
from helpers import NARROW, assert_storage_close, to_device
from test_attention import LSE_TOL, O_TOL, VARIANTS as FWD_VARIANTS
from test_attention_bwd import TOL, VARIANTS as BWD_VARIANTS
from test_attention_variants import CU, VARLEN, _variant

BF16 = np.dtype(ml_dtypes.bfloat16)

# (tokens, nh, nkv, hd, the ops' keywords, the tiles: {op: parameters}, None for the device's own)
CASES = {
    "hd64-nkv1": (74, 4, 1, 64, {"window": 37}, None),  # a window no multiple of the tiles, one KV head
    # odd row, key and head-dim tiles, vector widths 1 (forward, dQ) and 2 (dK/dV, split halves)
    "hd40-odd-tiles": (74, 4, 2, 40, {"window": 37},
                       {"attention_fwd": FWD_VARIANTS[0], "attention_bwd_dkv": BWD_VARIANTS["dkv"][4],
                        "attention_bwd_dq": BWD_VARIANTS["dq"][0], "attention_bwd_dqs": BWD_VARIANTS["dqs"][0]}),
}
# sequences of different lengths with a sliding window and a softcap (test_attention_variants' varlen case)
VARIANT = (100, 4, 1, 64, dict(cu_seqlens=CU, **_variant(*VARLEN["sliding-softcap"])), None)


@contextlib.contextmanager
def _tiles(hd, tiles):
    """Run the block with ``tiles`` as the tuning overrides at head dim ``hd`` (None: none)."""
    for op, p in (tiles or {}).items():
        tuning.override(op, {"hd": hd}, p)
    try:
        yield
    finally:
        for op in tiles or {}:
            tuning.override(op, {"hd": hd}, None)


def _inputs(n, nh, nkv, hd, dtype):
    return [ref.rnd(s, seed).astype(dtype) for s, seed in (((n, nh, hd), 11), ((n, nkv, hd), 12),
                                                           ((n, nkv, hd), 13), ((n, nh, hd), 14))]


def _at_float32(op, queue, arrays, **kw):
    """``op``'s results (host arrays) at float32 storage, on ``arrays`` widened."""
    return [g.get() for g in op(queue, *to_device(queue, *(a.astype(np.float32) for a in arrays)), **kw)]


def _same_bits(got, want):
    return got.dtype == want.dtype and got.tobytes() == want.tobytes()


def _grad_scale(grad):
    """Each (token, head) row's largest |value|, at least the gradient's RMS (see the module docstring)."""
    return np.maximum(np.abs(grad).max(-1, keepdims=True), np.sqrt(np.mean(grad * grad)))


def _check_forward(queue, dtype, n, nh, nkv, hd, kw, tiles):
    q, k, v, _ = _inputs(n, nh, nkv, hd, dtype)
    with _tiles(hd, tiles):
        o, lse = clops.attention(queue, *to_device(queue, q, k, v), **kw)
        o32, lse32 = _at_float32(clops.attention, queue, (q, k, v), **kw)
    paths = {mma.forward_product(queue, st)[0] for st in ("float", storage(dtype))}
    if paths in ({None}, {"fma"}):  # the same kernel's float32 math at both storage types
        assert _same_bits(o.get(), o32.astype(dtype)) and _same_bits(lse.get(), lse32)
    want_o, want_lse = ref.attention(q, k, v, **kw)
    assert_storage_close("o", o, want_o, dtype, O_TOL)
    assert ref.rel_err(lse.get(), want_lse) <= LSE_TOL


def _check_backward(queue, dtype, store_ds, n, nh, nkv, hd, kw, tiles):
    q, k, v, do = _inputs(n, nh, nkv, hd, dtype)
    o, lse = ref.attention(q, k, v, **kw)
    o, lse = o.astype(dtype), lse.astype(np.float32)  # what the forward stores
    arrays = (q, k, v, o, lse, do)
    with _tiles(hd, tiles):
        got = clops.attention_bwd(queue, *to_device(queue, *arrays), store_ds=store_ds, **kw)
        got32 = _at_float32(clops.attention_bwd, queue, arrays, store_ds=store_ds, **kw)
    assert all(_same_bits(g.get(), w.astype(dtype)) for g, w in zip(got, got32))
    for name, g, w in zip(("dq", "dk", "dv"), got, ref.attention_bwd(*arrays, **kw)):
        assert_storage_close(name, g, w, dtype, TOL, scale=_grad_scale(w))


@pytest.fixture(params=[True, False], ids=["ds-stored", "ds-recomputed"])
def store_ds(request):
    """Both ways to dQ, on the portable kernels (the matrix-unit backward, the default on NVIDIA at 16-bit
    storage, is tests/test_attention_mma.py's)."""
    with mma.using("0"):
        yield request.param


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_forward(queue, dtype, case):
    _check_forward(queue, dtype, *case)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_backward(queue, dtype, store_ds, case):
    _check_backward(queue, dtype, store_ds, *case)


def test_variants_forward_at_bfloat16(queue):
    _check_forward(queue, BF16, *VARIANT)


def test_variants_backward_at_bfloat16(queue, store_ds):
    _check_backward(queue, BF16, store_ds, *VARIANT)


def _filled(queue, shape, dtype):
    return cla.to_device(queue, np.full(shape, 7, dtype))


def test_forward_refuses_mixed_dtypes(queue):
    hq, hk, hv, _ = _inputs(8, 2, 1, 16, BF16)
    q, k, v, k32, v16 = to_device(queue, hq, hk, hv, hk.astype(np.float32), hv.astype(np.float16))
    out, lse = _filled(queue, (8, 2, 16), BF16), _filled(queue, (8, 2), np.float32)
    bad_out, bad_lse = _filled(queue, (8, 2, 16), np.float32), _filled(queue, (8, 2), BF16)
    for change, name in [({"k": k32}, "k"), ({"v": v16}, "v"), ({"out": bad_out}, "out"), ({"lse": bad_lse}, "lse")]:
        args = dict(dict(q=q, k=k, v=v, out=out, lse=lse), **change)
        with pytest.raises(TypeError, match=f"^{name}: dtype must be"):
            clops.attention(queue, window=8, **args)
    queue.finish()
    assert all((a.get().astype(np.float32) == 7).all() for a in (out, lse, bad_out, bad_lse))


def test_backward_refuses_mixed_dtypes(queue):
    hq, hk, hv, hdo = _inputs(8, 2, 1, 16, np.float16)
    q, k, v, o, do, o_bf16, do32 = to_device(queue, hq, hk, hv, hdo, hdo, hdo.astype(BF16), hdo.astype(np.float32))
    lse = _filled(queue, (8, 2), np.float32)
    outs = {"dq": _filled(queue, (8, 2, 16), np.float16), "dk": _filled(queue, (8, 1, 16), np.float16),
            "dv": _filled(queue, (8, 1, 16), np.float16)}
    for change, name in [({"o": o_bf16}, "o"), ({"do": do32}, "do"), ({"lse": _filled(queue, (8, 2), np.float16)}, "lse"),
                         ({"dq": _filled(queue, (8, 2, 16), np.float32)}, "dq"), ({"dv": _filled(queue, (8, 1, 16), BF16)}, "dv")]:
        args = dict(dict(q=q, k=k, v=v, o=o, lse=lse, do=do, **outs), **change)
        with pytest.raises(TypeError, match=f"^{name}: dtype must be"):
            clops.attention_bwd(queue, window=8, **args)
    queue.finish()
    assert all((a.get() == 7).all() for a in outs.values())
