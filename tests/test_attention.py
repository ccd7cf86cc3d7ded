"""The portable attention forward (attention_fwd.cl.mako) against the float64 reference, on every
device: CLOPS_MMA=0 here, so that on NVIDIA, where float32 takes the matrix units, these still test
the portable kernel (the matrix units' are tests/test_attention_mma.py's)."""
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pytest

import clops
from clops import reference as ref
from clops import tuning
from clops.attn import FWD

O_TOL, LSE_TOL = 1e-5, 1e-6

pytestmark = pytest.mark.usefixtures("portable_attention")


def _inputs(windows, window, nh, nkv, hd, scale=1.0):
    n = windows * window
    return ref.rnd((n, nh, hd), 11, scale), ref.rnd((n, nkv, hd), 12, scale), ref.rnd((n, nkv, hd), 13)


def _run(queue, q, k, v, window, **kw):
    o, lse = clops.attention(queue, *(cla.to_device(queue, x) for x in (q, k, v)), window=window, **kw)
    return o.get(), lse.get()


def _check(queue, windows, window, nh, nkv, hd, scale=None):
    q, k, v = _inputs(windows, window, nh, nkv, hd)
    o, lse = _run(queue, q, k, v, window, scale=scale)
    want_o, want_lse = ref.attention(q, k, v, window=window, scale=scale)
    assert ref.rel_err(o, want_o) <= O_TOL
    assert ref.rel_err(lse, want_lse) <= LSE_TOL


@pytest.mark.parametrize("hd", [8, 40, 64, 80, 96, 128, 256])
def test_head_dims(queue, hd):
    _check(queue, 2, 37, 6, 2, hd)


@pytest.mark.parametrize("window", [1, 15, 16, 17, 100])
@pytest.mark.parametrize("nkv", [1, 4])
def test_windows_and_groups(queue, window, nkv):
    _check(queue, 2, window, 4, nkv, 64)


def test_explicit_scale(queue):
    _check(queue, 2, 33, 4, 2, 40, scale=0.37)


def test_large_logits_stay_finite(queue):
    # |q·k|·scale reaches ~1e3: a softmax near one-hot, exp2 arguments far from 0.
    q, k, v = _inputs(2, 40, 4, 2, 64, scale=32.0)
    o, lse = _run(queue, q, k, v, 40)
    want_o, want_lse = ref.attention(q, k, v, window=40)
    assert np.abs(want_lse).max() > 500
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    assert ref.rel_err(o, want_o) <= O_TOL
    assert ref.rel_err(lse, want_lse) <= LSE_TOL


# Tile shapes the template must honour: vector widths 1/2/4, odd row and key tiles,
# head-dim padding (40 is not a multiple of tx·vw), bk ≠ bq, several V chunks, loads that
# do not fill the work-group evenly.
VARIANTS = [
    {"bq": 12, "rq": 3, "tx": 3, "bk": 9, "vw": 1, "dc": 5, "kc": 3},
    {"bq": 8, "rq": 2, "tx": 4, "bk": 16, "vw": 2, "dc": 6, "kc": 8},
    {"bq": 32, "rq": 8, "tx": 8, "bk": 8, "vw": 4, "dc": 8, "kc": 4},
    {"bq": 16, "rq": 2, "tx": 8, "bk": 24, "vw": 2, "dc": 48, "kc": 12},  # dc ≥ hd: Q stays staged
    {"bq": 16, "rq": 4, "tx": 4, "bk": 12, "vw": 1, "dc": 12, "kc": 6},  # Pᵀ vectors wider than vw
]


@pytest.mark.parametrize("params", VARIANTS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_tile_variants(queue, params):
    tuning.override("attention_fwd", {"hd": 40}, params)
    try:
        assert FWD.resolve(queue.device, {"hd": 40}) == (params, "override")
        _check(queue, 2, 37, 4, 2, 40)
    finally:
        tuning.override("attention_fwd", {"hd": 40}, None)


@pytest.mark.parametrize("params, word", [
    ({"bq": 16, "rq": 4, "tx": 4, "bk": 18, "vw": 4, "dc": 32, "kc": 6}, "bk must be a multiple of tx"),
    ({"bq": 16, "rq": 4, "tx": 4, "bk": 16, "vw": 3, "dc": 6, "kc": 16}, "vw"),
    ({"bq": 16, "rq": 4, "tx": 4, "bk": 16, "vw": 4}, "named"),
    ({"bq": 4096, "rq": 1, "tx": 64, "bk": 64, "vw": 4, "dc": 32, "kc": 16}, "work-items"),
])
def test_bad_params_raise_limit_error(queue, params, word):
    tuning.override("attention_fwd", {"hd": 64}, params)
    try:
        q, k, v = _inputs(1, 8, 2, 1, 64)
        with pytest.raises(clops.LimitError, match=word):
            _run(queue, q, k, v, 8)
    finally:
        tuning.override("attention_fwd", {"hd": 64}, None)


def test_local_memory_limit(queue):
    # Q and K chunks of dc columns for 16 + 16 rows: more than the device's local memory.
    dc = queue.device.local_mem_size // (4 * 32) + 4
    big = {"bq": 16, "rq": 4, "tx": 4, "bk": 16, "vw": 4, "dc": dc, "kc": 16}
    tuning.override("attention_fwd", {"hd": 256}, big)
    try:
        with pytest.raises(clops.LimitError, match="local memory"):
            FWD.params(queue.device, {"hd": 256})
    finally:
        tuning.override("attention_fwd", {"hd": 256}, None)


@pytest.mark.parametrize("local_mem, max_wg", [(49152, 1024), (32768, 256), (65536, 1024)])
def test_gpu_heuristic_fits_every_head_dim(local_mem, max_wg):
    class Gpu:
        type, local_mem_size, max_work_group_size = cl.device_type.GPU, local_mem, max_wg

    for hd in range(8, 257, 8):
        assert FWD.check(Gpu, {"hd": hd}, FWD.heuristic(Gpu, {"hd": hd}))


def test_writes_into_given_outputs(queue):
    q, k, v = _inputs(1, 20, 4, 2, 16)
    out = cla.zeros(queue, (20, 4, 16), np.float32)
    lse = cla.zeros(queue, (20, 4), np.float32)
    dq, dk, dv = (cla.to_device(queue, x) for x in (q, k, v))
    got_o, got_lse = clops.attention(queue, dq, dk, dv, window=20, out=out, lse=lse)
    assert got_o is out and got_lse is lse
    want_o, want_lse = ref.attention(q, k, v, window=20)
    assert ref.rel_err(out.get(), want_o) <= O_TOL and ref.rel_err(lse.get(), want_lse) <= LSE_TOL


def _bad_cases(queue):
    q, k, v = _inputs(2, 8, 4, 2, 16)
    dq, dk, dv = (cla.to_device(queue, x) for x in (q, k, v))
    ok = dict(q=dq, k=dk, v=dv, window=8)
    dev = lambda a: cla.to_device(queue, np.ascontiguousarray(a))  # noqa: E731
    return [
        (dict(ok, q=cla.to_device(queue, q.astype(np.float64))), TypeError, "q"),
        (dict(ok, k=dev(k[:8])), ValueError, "k"),
        (dict(ok, v=dev(v[:, :1])), ValueError, "v"),
        (dict(ok, q=dev(q[:, :3]), k=dev(k), v=dev(v)), ValueError, "nkv"),
        (dict(ok, k=dev(k[:, :1]), v=dev(v[:, :1]), q=dev(np.zeros((16, 4, 12), np.float32))), ValueError, "k"),
        (dict(ok, q=dev(np.zeros((16, 4, 12), np.float32)), k=dev(np.zeros((16, 2, 12), np.float32)),
              v=dev(np.zeros((16, 2, 12), np.float32))), ValueError, "head dim"),
        (dict(ok, q=dev(np.zeros((16, 4, 264), np.float32)), k=dev(np.zeros((16, 2, 264), np.float32)),
              v=dev(np.zeros((16, 2, 264), np.float32))), ValueError, "head dim"),
        (dict(ok, window=5), ValueError, "window"),
        (dict(ok, window=0), ValueError, "window"),
        (dict(ok, window=8.0), TypeError, "window"),
        (dict(ok, scale=float("nan")), ValueError, "scale"),
        (dict(ok, q=dq.reshape(16, 64)), ValueError, "q"),
    ]


def test_bad_input_raises_before_writing(queue):
    for kwargs, err, word in _bad_cases(queue):
        out = cla.to_device(queue, np.full((16, 4, 16), 7.0, np.float32))
        lse = cla.to_device(queue, np.full((16, 4), 7.0, np.float32))
        with pytest.raises(err, match=word):
            clops.attention(queue, out=out, lse=lse, **kwargs)
        queue.finish()
        assert (out.get() == 7.0).all() and (lse.get() == 7.0).all(), kwargs


def test_bad_outputs(queue):
    q, k, v = _inputs(1, 8, 2, 1, 16)
    dq, dk, dv = (cla.to_device(queue, x) for x in (q, k, v))
    with pytest.raises(ValueError, match="out"):
        clops.attention(queue, dq, dk, dv, window=8, out=cla.zeros(queue, (8, 2, 8), np.float32))
    lse = cla.to_device(queue, np.full((8, 2), 7.0, np.float32))
    with pytest.raises(TypeError, match="lse"):
        clops.attention(queue, dq, dk, dv, window=8, lse=cla.zeros(queue, (8, 2), np.float64))
    with pytest.raises(ValueError, match="out"):
        clops.attention(queue, dq, dk, dv, window=8, out=cla.zeros(queue, (8, 2, 8), np.float32), lse=lse)
    assert (lse.get() == 7.0).all()
