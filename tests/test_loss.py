"""cross_entropy / cross_entropy_bwd against the float64 reference (torch's definition, no
reduction): vocab sizes up to Qwen's, label smoothing, softcap, ignored and out-of-range
targets, in place, determinism, refusals.

float16 / bfloat16 logits: the reference takes the same rounded logits (and, for the backward, the
device's float32 lse); loss and lse stay float32 at the float32 tolerance (relative L2 1e-6), and
dlogits, stored at the logits' dtype, is within 1 storage ulp of the float64 gradient rounded once,
relative to its row's scale (the row's largest |gradient|), plus the float32 tolerance (1e-5 of
that scale; helpers.narrow_ulps)."""
import ml_dtypes
import numpy as np
import pyopencl.array as cla
import pytest

import clops
from clops import reference as ref, tuning
from clops.args import storage
from clops.reference import rel_err, rnd
from helpers import NARROW, narrow_ulps, to_device

IGNORE = -100


def _targets(n, vocab, seed):
    t = np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)
    t[1] = IGNORE  # one ignored row
    return t


@pytest.mark.parametrize("n, vocab, smoothing, softcap, scale", [
    (5, 1, 0.0, None, 1.0), (7, 37, 0.1, None, 4.0), (6, 50257, 0.0, None, 8.0), (4, 151936, 0.1, 30.0, 8.0),
    (6, 1000, 0.0, 15.0, 100.0), (3, 300, 0.0, None, 1e4),  # large logits: the online max keeps exp in range
    (5, 300, 0.2, 5.0, 20.0),  # smoothing's Σ z of capped logits (Σ x of the raw ones is far from it)
], ids=lambda v: str(v))
def test_parity(queue, n, vocab, smoothing, softcap, scale):
    x = rnd((n, vocab), 1, scale)
    t = _targets(n, vocab, 2)
    dloss = rnd(n, 3, 1.0)
    kw = dict(ignore_index=IGNORE, label_smoothing=smoothing, softcap=softcap)
    dx, ddl = to_device(queue, x, dloss)
    loss, lse = clops.cross_entropy(queue, dx, t, **kw)
    want_loss, want_lse = ref.cross_entropy(x, t, **kw)
    assert rel_err(lse.get(), want_lse) <= 1e-6
    assert rel_err(loss.get(), want_loss) <= 1e-6 and loss.get()[1] == 0.0
    grad = clops.cross_entropy_bwd(queue, dx, t, lse, ddl, **kw)
    want = ref.cross_entropy_bwd(x, t, lse.get(), dloss, **kw)
    assert rel_err(grad.get(), want) <= 1e-5 and not grad.get()[1].any()


def test_in_place_and_deterministic(queue):
    x = rnd((5, 3000), 4, 6.0)
    t, dloss = _targets(5, 3000, 5), rnd(5, 6)
    dx, ddl = to_device(queue, x, dloss)
    loss, lse = clops.cross_entropy(queue, dx, t, softcap=20.0)
    again, _ = clops.cross_entropy(queue, dx, t, softcap=20.0)
    assert loss.get().tobytes() == again.get().tobytes()
    apart = clops.cross_entropy_bwd(queue, dx, t, lse, ddl, softcap=20.0).get()
    assert clops.cross_entropy_bwd(queue, dx, t, lse, ddl, softcap=20.0, dlogits=dx) is dx
    assert dx.get().tobytes() == apart.tobytes()  # the logits were overwritten with the same bits


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), NARROW[1]], ids=str)
def test_ignore_index_inside_the_vocab(queue, dtype):
    """An ignore_index that is a token (a pad id, 0 here): its rows have loss 0 and gradient 0 in both
    passes, as an ignore_index outside [0, vocab) does (the kernels must not take it for a target)."""
    n, vocab = 6, 300
    x = rnd((n, vocab), 17, 4.0).astype(dtype)
    t = np.array([0, 5, 0, 299, 7, 0], np.int32)
    dloss = rnd(n, 18, 1.0)
    kw = dict(ignore_index=0, label_smoothing=0.1)
    dx, ddl = to_device(queue, x, dloss)
    loss, lse = clops.cross_entropy(queue, dx, t, **kw)
    want_loss, want_lse = ref.cross_entropy(x, t, **kw)
    assert rel_err(lse.get(), want_lse) <= 1e-6 and rel_err(loss.get(), want_loss) <= 1e-6
    assert not loss.get()[t == 0].any()
    grad = clops.cross_entropy_bwd(queue, dx, t, lse, ddl, **kw).get()
    want = ref.cross_entropy_bwd(x, t, lse.get(), dloss, **kw)
    assert not grad[t == 0].any()
    if dtype == np.float32:
        assert rel_err(grad, want) <= 1e-5
    else:
        assert ref.ulps_off(grad, want, dtype, scale=np.abs(want).max(1, keepdims=True)) <= narrow_ulps(dtype, 1e-5)


def test_device_targets_out_of_range_give_nan_loss_and_zero_gradient(queue):
    x = rnd((4, 50), 7, 2.0)
    t = np.array([3, 50, -7, IGNORE], np.int32)
    dx, dt, ddl = to_device(queue, x, t, np.ones(4, np.float32))
    loss, lse = clops.cross_entropy(queue, dx, dt)
    got = loss.get()
    assert np.isfinite(got[0]) and np.isnan(got[1]) and np.isnan(got[2]) and got[3] == 0.0
    assert rel_err(lse.get(), ref.cross_entropy(x, t)[1]) <= 1e-6
    grad = clops.cross_entropy_bwd(queue, dx, dt, lse, ddl).get()
    assert grad[0].any() and not grad[1:].any()


@pytest.mark.parametrize("dtype", NARROW, ids=str)
@pytest.mark.parametrize("n, vocab, smoothing, softcap, scale", [
    (7, 37, 0.1, None, 4.0), (6, 1000, 0.0, 15.0, 100.0), (4, 50257, 0.1, 30.0, 8.0)], ids=lambda v: str(v))
def test_narrow_logits(queue, dtype, n, vocab, smoothing, softcap, scale):
    """Rows not a multiple of the work-group, an ignored row, a device target out of range, softcap,
    the backward apart and in place."""
    x = rnd((n, vocab), 1, scale).astype(dtype)
    t = _targets(n, vocab, 2)
    t[2] = vocab  # out of range, from the device: loss NaN, gradient 0
    dloss = rnd(n, 3, 1.0)
    kw = dict(ignore_index=IGNORE, label_smoothing=smoothing, softcap=softcap)
    dx, dt, ddl = to_device(queue, x, t, dloss)
    loss, lse = clops.cross_entropy(queue, dx, dt, **kw)
    want_loss, want_lse = ref.cross_entropy(x, t, **kw)
    assert loss.dtype == lse.dtype == np.float32 and rel_err(lse.get(), want_lse) <= 1e-6
    ok = np.arange(n) != 2
    assert np.isnan(loss.get()[2]) and rel_err(loss.get()[ok], want_loss[ok]) <= 1e-6
    grad = clops.cross_entropy_bwd(queue, dx, dt, lse, ddl, **kw)
    want = ref.cross_entropy_bwd(x, t, lse.get(), dloss, **kw)
    assert grad.dtype == dtype
    assert ref.ulps_off(grad.get(), want, dtype, scale=np.abs(want).max(1, keepdims=True)) <= narrow_ulps(dtype, 1e-5)
    assert clops.cross_entropy_bwd(queue, dx, dt, lse, ddl, dlogits=dx, **kw) is dx
    assert dx.get().tobytes() == grad.get().tobytes()


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), NARROW[1]], ids=str)
@pytest.mark.parametrize("params, bwd", [({"wg": 7, "unroll": 2}, {"wg": 7, "ept": 3}),
                                         ({"wg": 32, "unroll": 4}, {"wg": 4, "ept": 1})], ids=str)
def test_launch_parameters(queue, dtype, params, bwd):
    """Groups not a power of two, several vectors per step; rows of an odd vocab start off and on the
    vector boundary; the backward's rows in several groups, the last one part full, an edge longer
    than a group."""
    n, vocab = 5, 1003
    x = rnd((n, vocab), 13, 6.0).astype(dtype)
    t, dloss = _targets(n, vocab, 14), rnd(n, 15)
    kw = dict(ignore_index=IGNORE, label_smoothing=0.1)
    dx, ddl = to_device(queue, x, dloss)
    bwd_class = {"st": storage(dtype)}
    tuning.override("cross_entropy", {}, params)
    tuning.override("cross_entropy_bwd", bwd_class, bwd)
    try:
        loss, lse = clops.cross_entropy(queue, dx, t, **kw)
        grad = clops.cross_entropy_bwd(queue, dx, t, lse, ddl, **kw).get()
    finally:
        tuning.override("cross_entropy", {}, None)
        tuning.override("cross_entropy_bwd", bwd_class, None)
    want_loss, want_lse = ref.cross_entropy(x, t, **kw)
    assert rel_err(lse.get(), want_lse) <= 1e-6 and rel_err(loss.get(), want_loss) <= 1e-6
    want = ref.cross_entropy_bwd(x, t, lse.get(), dloss, **kw)
    if dtype == np.float32:
        assert rel_err(grad, want) <= 1e-5
    else:
        assert ref.ulps_off(grad, want, dtype, scale=np.abs(want).max(1, keepdims=True)) <= narrow_ulps(dtype, 1e-5)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), NARROW[1]], ids=str)
def test_infinite_logits(queue, dtype):
    """−∞ logits (masked tokens) add nothing, wherever they are: a row's first half (each work-item's
    first logits), every other one, all but the target's; +∞ makes lse +∞."""
    n, vocab = 4, 300
    x = rnd((n, vocab), 16, 4.0)
    t = np.array([200, 1, 7, 3], np.int32)
    x[0, :150] = x[1, ::2] = x[2] = -np.inf
    x[2, 7] = 1.0
    x[3, 5] = np.inf
    x = x.astype(dtype)
    dx, ddl = to_device(queue, x, np.ones(n, np.float32))
    loss, lse = clops.cross_entropy(queue, dx, t)
    want_loss, want_lse = ref.cross_entropy(x[:3], t[:3])
    assert rel_err(lse.get()[:3], want_lse) <= 1e-6 and rel_err(loss.get()[:3], want_loss) <= 1e-6
    assert lse.get()[3] == np.inf
    grad = clops.cross_entropy_bwd(queue, dx, t, lse, ddl).get()[:3].astype(np.float64)
    want = ref.cross_entropy_bwd(x[:3], t[:3], lse.get()[:3], np.ones(3))
    assert not grad[np.isinf(x[:3])].any() and np.abs(grad - want).max() <= 1e-5 * np.abs(want).max() + 2e-3


def test_refusals(queue):
    x, = to_device(queue, rnd((3, 10), 8))
    lse, dl = to_device(queue, rnd(3, 9), rnd(3, 10))
    ok = np.array([1, 2, 3], np.int32)
    one, = to_device(queue, rnd((3, 1), 11))  # a vocab of 1
    cases = [
        (ValueError, "targets: 10 at index 1 is outside \\[0, 10\\) and is not -100",
         lambda: clops.cross_entropy(queue, x, np.array([1, 10, 2], np.int32))),
        (TypeError, "targets: dtype must be int32", lambda: clops.cross_entropy(queue, x, ok.astype(np.int64))),
        (ValueError, "targets: expected shape", lambda: clops.cross_entropy(queue, x, ok[:2])),
        (TypeError, "targets: dtype must be int32",
         lambda: clops.cross_entropy(queue, x, cla.to_device(queue, ok.astype(np.float32)))),
        (ValueError, "label_smoothing", lambda: clops.cross_entropy(queue, x, ok, label_smoothing=1.5)),
        (ValueError, "label_smoothing: must be in \\[0, 1\\], got -0.1",
         lambda: clops.cross_entropy_bwd(queue, x, ok, lse, dl, label_smoothing=-0.1)),
        (ValueError, "softcap", lambda: clops.cross_entropy(queue, x, ok, softcap=0.0)),
        (TypeError, "ignore_index", lambda: clops.cross_entropy(queue, x, ok, ignore_index=True)),
        (TypeError, "logits: dtype", lambda: clops.cross_entropy(queue, cla.to_device(queue, np.zeros((3, 10))), ok)),
        (TypeError, "dlogits: dtype must be bfloat16, got float32",
         lambda: clops.cross_entropy_bwd(queue, cla.to_device(queue, rnd((3, 10), 12).astype(ml_dtypes.bfloat16)), ok,
                                         lse, dl, dlogits=x)),
        (TypeError, "lse: dtype must be float32, got float16",
         lambda: clops.cross_entropy_bwd(queue, x, ok, cla.to_device(queue, rnd(3, 9).astype(np.float16)), dl)),
        (ValueError, "dlogits: shares memory with lse",
         lambda: clops.cross_entropy_bwd(queue, one, ok * 0, lse, dl, dlogits=lse.reshape(3, 1))),
    ]
    for exc, word, call in cases:
        with pytest.raises(exc, match=word):
            call()
