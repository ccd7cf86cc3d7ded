"""adamw against the float64 reference of torch.optim.AdamW's formula, over several steps and
tiles (vector tails), and its refusals.

16-bit gradients and weights: the reference takes the same rounded g; p, m, v stay float32 at the
float32 tolerance (relative L2 1e-6), and p_half is the stored float32 p rounded once to nearest
even (numpy's rounding of the device's p, bit for bit), so within 1 storage ulp of the float64 p
rounded once, element by element."""
import numpy as np
import pyopencl.array as cla
import pytest

import clops
from clops import reference as ref, tuning
from clops.reference import rel_err, rnd
from helpers import NARROW, to_device

KW = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("shape, g_scale", [((1,), 0.5), ((7, 37), 0.5), ((4096,), 0.5), ((7, 37), 3 * KW["eps"])],
                         ids=["1", "7x37", "4096", "7x37-g-near-eps"])  # g near eps: eps after the bias correction
@pytest.mark.parametrize("tiles", [None, {"wg": 16, "vw": 4, "ept": 3}, {"wg": 8, "vw": 1, "ept": 1}],
                         ids=["default", "vw4", "vw1"])
def test_steps_match_the_reference(queue, shape, g_scale, tiles):
    p, m, v = rnd(shape, 1, 1.0), np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    dp, dm, dv = to_device(queue, p, m, v)
    tuning.override("adamw", {}, tiles)
    try:
        for step in (1, 2, 3):
            g = rnd(shape, 10 + step, g_scale)
            got = clops.adamw(queue, dp, to_device(queue, g)[0], dm, dv, step=step, **KW)
            p, m, v = ref.adamw(p, g, m, v, step=step, **KW)
            for name, a, want in zip("pmv", got, (p, m, v)):
                assert rel_err(a.get(), want) <= 1e-6, (name, step)
            p, m, v = (a.get() for a in got)  # the next step starts from the stored float32 state
    finally:
        tuning.override("adamw", {}, None)


@pytest.mark.parametrize("dtype", NARROW, ids=str)
@pytest.mark.parametrize("tiles", [None, {"wg": 16, "vw": 4, "ept": 3}], ids=["default", "vw4"])
def test_narrow_gradient_and_half_copy(queue, dtype, tiles):
    """Step 1: a 16-bit g and p_half; step 2: a float32 g and p_half; step 3: a 16-bit g alone."""
    shape = (7, 37)  # 259 elements: a vector tail at vw 4
    p, m, v = rnd(shape, 1, 1.0), np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    dp, dm, dv = to_device(queue, p, m, v)
    half = cla.empty(queue, shape, dtype)
    tuning.override("adamw", {}, tiles)
    try:
        for step, g_dtype, p_half in ((1, dtype, half), (2, np.float32, half), (3, dtype, None)):
            g = rnd(shape, 10 + step, 0.5).astype(g_dtype)
            before = half.get()
            got = clops.adamw(queue, dp, to_device(queue, g)[0], dm, dv, step=step, p_half=p_half, **KW)
            p, m, v = ref.adamw(p, g, m, v, step=step, **KW)
            for name, a, want in zip("pmv", got, (p, m, v)):
                assert rel_err(a.get(), want) <= 1e-6, (name, step)
            if p_half is not None:
                assert ref.ulps_off(half.get(), p, dtype) <= 1, step
            p, m, v = (a.get() for a in got)
            want_half = p.astype(dtype) if p_half is not None else before  # no p_half: the copy is left alone
            assert half.get().tobytes() == want_half.tobytes(), step
    finally:
        tuning.override("adamw", {}, None)


@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_half_copy_keeps_nan_and_inf(queue, dtype):
    """p_half of a NaN p is NaN whatever its payload (bfloat16's rounding carry must not reach the
    sign or exponent: 0x7fffffff, NVIDIA's canonical NaN, became −0, 0xffffffff +0, 0x7f800001 Inf),
    ±Inf stays ±Inf; lr 0 leaves p as it is (vector body and tail)."""
    nans = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFFC0FFFF, 0x7FC08000], np.uint32).view(np.float32)
    p = np.tile(np.concatenate([nans, np.array([np.inf, -np.inf, 1.0, -3.0], np.float32)]), 3)
    dp, dg, dm, dv = to_device(queue, p, *(np.zeros_like(p) for _ in range(3)))
    half = cla.empty(queue, p.shape, dtype)
    clops.adamw(queue, dp, dg, dm, dv, lr=0.0, step=1, p_half=half)
    got, nan = half.get(), np.isnan(p)
    assert (np.isnan(got) == nan).all(), got
    assert got[~nan].tobytes() == p[~nan].astype(dtype).tobytes()


def test_refusals(queue):
    p, g, m, v = to_device(queue, *(rnd(10, s) for s in range(4)))
    cases = [
        (ValueError, "lr: must be ≥ 0", dict(lr=-1.0, step=1)),
        (ValueError, "beta1: must be in", dict(lr=1e-3, step=1, beta1=1.0)),
        (ValueError, "beta2: must be in \\[0, 1\\), got 1.0", dict(lr=1e-3, step=1, beta2=1.0)),  # 1 − β2^step = 0
        (ValueError, "eps: must be ≥ 0", dict(lr=1e-3, step=1, eps=-1e-8)),
        (ValueError, "step: must be positive", dict(lr=1e-3, step=0)),
        (TypeError, "step: expected an int", dict(lr=1e-3, step=1.5)),
        (ValueError, "weight_decay", dict(lr=1e-3, step=1, weight_decay=-0.1)),
    ]
    before = [a.get() for a in (p, g, m, v)]
    for exc, word, kw in cases:
        with pytest.raises(exc, match=word):
            clops.adamw(queue, p, g, m, v, **kw)
    with pytest.raises(ValueError, match="p: shares memory with m"):
        clops.adamw(queue, p, g, p, v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="v: shares memory with g"):
        clops.adamw(queue, p, g, m, g, lr=1e-3, step=1)
    half = cla.to_device(queue, rnd(10, 6).astype(np.float16))
    with pytest.raises(TypeError, match="p_half: dtype must be float16 or bfloat16, got float32"):
        clops.adamw(queue, p, g, m, v, lr=1e-3, step=1, p_half=to_device(queue, rnd(10, 7))[0])
    with pytest.raises(ValueError, match="p_half: shares memory with g"):
        clops.adamw(queue, p, half, m, v, lr=1e-3, step=1, p_half=half)
    with pytest.raises(TypeError, match="g: dtype must be float32 or float16 or bfloat16, got int32"):
        clops.adamw(queue, p, cla.zeros(queue, 10, np.int32), m, v, lr=1e-3, step=1)
    # the state is float32; this float16 m lies over 10 float32s' bytes (a kernel taking it stays inside)
    m16 = cla.Array(queue, (10,), np.float16, data=cla.zeros(queue, 10, np.float32).data)
    with pytest.raises(TypeError, match="m: dtype must be float32, got float16"):
        clops.adamw(queue, p, g, m16, v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="g: expected shape"):
        clops.adamw(queue, p, to_device(queue, rnd(11, 5))[0], m, v, lr=1e-3, step=1)
    assert all(np.array_equal(b, a.get()) for b, a in zip(before, (p, g, m, v)))
