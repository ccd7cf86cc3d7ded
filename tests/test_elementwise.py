"""Elementwise parity at sizes that exercise the tail (1, odd, not a multiple of the vector width,
one element past a work-group's span), and launch-parameter variants through the tuning override."""
import ml_dtypes
import numpy as np
import pyopencl.array as cla
import pytest

import clops
from clops import reference as ref
from clops import tuning
from clops.reference import rel_err, rnd
from helpers import to_device

TOL = 1e-6
SIZES = [1, 3, 4, 5, 1023, 4097, 4 * 4 * 256 + 1]


@pytest.mark.parametrize("n", SIZES)
def test_flat_ops_any_length(queue, n):
    a, b, dc = rnd(n, 1, 4.0), rnd(n, 2, 2.0), rnd(n, 3, 1.0)
    A, B, DC = to_device(queue, a, b, dc)
    assert rel_err(clops.swiglu(queue, A, B).get(), ref.swiglu(a, b)) <= TOL
    assert rel_err(clops.sigmoid_gate(queue, A, B).get(), ref.sigmoid_gate(a, b)) <= TOL
    assert rel_err(clops.add(queue, A, B).get(), ref.add(a, b)) <= TOL
    for got, want in zip(clops.swiglu_bwd(queue, A, B, DC), ref.swiglu_bwd(a, b, dc)):
        assert rel_err(got.get(), want) <= TOL
    for got, want in zip(clops.sigmoid_gate_bwd(queue, A, B, DC), ref.sigmoid_gate_bwd(a, b, dc)):
        assert rel_err(got.get(), want) <= TOL


# Widths a multiple of the vector width (each vector in one row) and not; more than one step of a
# work-item's vectors (its row and column stepped past the row's end, and by whole rows).
@pytest.mark.parametrize("rows,width", [(1, 1), (3, 7), (5, 4), (2, 4099), (3, 1028), (257, 8)])
def test_row_and_column_ops(queue, rows, width):
    a, b, dc = rnd((rows, width), 4, 4.0), rnd((rows, width), 5, 2.0), rnd((rows, width), 6, 1.0)
    gate, rw = rnd(width, 7, 1.0), rnd(rows, 8, 1.0)
    A, B, DC, G, RW = to_device(queue, a, b, dc, gate, rw)
    assert rel_err(clops.swiglu_gated(queue, A, B, G).get(), ref.swiglu_gated(a, b, gate)) <= TOL
    for got, want in zip(clops.swiglu_gated_bwd(queue, A, B, G, DC), ref.swiglu_gated_bwd(a, b, gate, dc)):
        assert rel_err(got.get(), want) <= TOL
    for limit in (0.5, 0.0, -1.0):
        got = clops.swiglu_limit(queue, A, B, limit=limit, scale=0.5, row_weight=RW).get()
        assert rel_err(got, ref.swiglu_limit(a, b, limit=limit, scale=0.5, row_weight=rw)) <= TOL


def test_clamp_is_applied(queue):
    """A limit inside the data range must change the result (the clamp cannot be a no-op)."""
    a, b = np.full((1, 8), 5.0, np.float32), np.full((1, 8), -5.0, np.float32)
    A, B = to_device(queue, a, b)
    got = clops.swiglu_limit(queue, A, B, limit=1.0).get()
    np.testing.assert_allclose(got, ref.swiglu_limit(a, b, limit=1.0), rtol=1e-6)
    assert not np.allclose(got, ref.swiglu(a, b))


def test_saturated_tails(queue):
    """σ(−x) in the gradients without the cancellation of 1 − σ(x): sigmoid_gate_bwd's db was 0 from
    b ≈ 16.6 (float64: 1.4e-11 at 25), swiglu_bwd's da off by 9.5e-7 at a ≈ 16.6. Element by element."""
    t = np.concatenate([np.linspace(4, 40, 512), -np.linspace(4, 40, 512)]).astype(np.float32)
    one = np.ones_like(t)
    T, ONE = to_device(queue, t, one)
    da = clops.swiglu_bwd(queue, T, ONE, ONE)[0].get()
    db = clops.sigmoid_gate_bwd(queue, ONE, T, ONE)[1].get()
    np.testing.assert_allclose(da, ref.swiglu_bwd(t, one, one)[0], rtol=6e-7)
    np.testing.assert_allclose(db, ref.sigmoid_gate_bwd(one, t, one)[1], rtol=1e-6)


@pytest.mark.parametrize("params", [dict(wg=64, vw=1, ept=1), dict(wg=32, vw=2, ept=3), dict(wg=128, vw=8, ept=2),
                                    dict(wg=16, vw=16, ept=1)])
def test_launch_parameters(queue, params):
    n = 3 * 1000 + 7
    a, b = rnd(n, 9, 3.0), rnd(n, 10, 3.0)
    A, B = to_device(queue, a, b)
    tuning.override("elementwise", {}, params)
    try:
        got = clops.swiglu(queue, A, B).get()
    finally:
        tuning.override("elementwise", {}, None)
    assert rel_err(got, ref.swiglu(a, b)) <= TOL


def test_same_size_other_width(queue):
    """The gathered ops on arrays of one size but two row widths, one a multiple of the vector width
    (a vector in one row: the gate read as a vector, one row weight per vector) and one not, the
    aligned one first: each call takes its width's kernel (the plan is per width, not per size)."""
    tuning.override("elementwise", {}, dict(wg=16, vw=4, ept=2))  # vw 4 whatever the database says
    try:
        for rows, width in ((9, 8), (8, 9)):
            a, b, dc = rnd((rows, width), 1, 4.0), rnd((rows, width), 2, 2.0), rnd((rows, width), 3)
            gate, rw = rnd(width, 4), rnd(rows, 5)
            A, B, DC, G, RW = to_device(queue, a, b, dc, gate, rw)
            assert rel_err(clops.swiglu_gated(queue, A, B, G).get(), ref.swiglu_gated(a, b, gate)) <= TOL, width
            for got, want in zip(clops.swiglu_gated_bwd(queue, A, B, G, DC), ref.swiglu_gated_bwd(a, b, gate, dc)):
                assert rel_err(got.get(), want) <= TOL, width
            got = clops.swiglu_limit(queue, A, B, limit=1.0, row_weight=RW).get()
            assert rel_err(got, ref.swiglu_limit(a, b, limit=1.0, row_weight=rw)) <= TOL, width
    finally:
        tuning.override("elementwise", {}, None)


def test_outputs_written_into_given_arrays(queue):
    a, b = rnd((4, 9), 11), rnd((4, 9), 12)
    A, B = to_device(queue, a, b)
    out = cla.empty(queue, (4, 9), np.float32)
    assert clops.add(queue, A, B, out=out) is out
    np.testing.assert_allclose(out.get(), a + b, rtol=1e-7)


# ---- float16 / bfloat16 storage: float32 math, one rounding to nearest even per stored element ----

NARROW = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


@pytest.mark.parametrize("dtype", NARROW, ids=str)
@pytest.mark.parametrize("n", [5, 4097])
def test_narrow_storage_within_one_ulp(queue, dtype, n):
    """Every elementwise op at 16-bit storage, against the float64 result of the same (rounded)
    inputs rounded once: within 1 ulp of the storage type, element by element (vector body and tail)."""
    a, b, dc = (rnd(n, s, 4.0).astype(dtype) for s in (1, 2, 3))
    rows, width = 1, n
    gate, rw = rnd(width, 7, 1.0).astype(dtype), rnd(rows, 8, 1.0)  # row_weight float32: either is allowed
    A, B, DC, G, RW = to_device(queue, a, b, dc, gate, rw)
    A2, B2, DC2 = (x.reshape(rows, width) for x in (A, B, DC))
    a2, b2, dc2 = (x.reshape(rows, width) for x in (a, b, dc))
    cases = [(clops.swiglu(queue, A, B), ref.swiglu(a, b)), (clops.sigmoid_gate(queue, A, B), ref.sigmoid_gate(a, b)),
             (clops.add(queue, A, B), ref.add(a, b)),
             (clops.swiglu_gated(queue, A2, B2, G), ref.swiglu_gated(a2, b2, gate)),
             (clops.swiglu_limit(queue, A2, B2, limit=2.0, scale=0.5, row_weight=RW),
              ref.swiglu_limit(a2, b2, limit=2.0, scale=0.5, row_weight=rw))]
    for fn, rfn in ((clops.swiglu_bwd, ref.swiglu_bwd), (clops.sigmoid_gate_bwd, ref.sigmoid_gate_bwd)):
        cases += zip(fn(queue, A, B, DC), rfn(a, b, dc))
    cases += zip(clops.swiglu_gated_bwd(queue, A2, B2, G, DC2), ref.swiglu_gated_bwd(a2, b2, gate, dc2))
    for got, want in cases:
        assert got.dtype == dtype
        assert ref.ulps_off(got.get(), want, dtype) <= 1


@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_narrow_gathers_of_whole_vector_rows(queue, dtype):
    """The gathered ops at 16-bit storage, gate and row weight too, on rows a multiple of the vector
    width long (a row weight per vector, the gate read as vectors): within 1 ulp element by element."""
    rows, width = 37, 96
    a, b, dc = (rnd((rows, width), s, 4.0).astype(dtype) for s in (1, 2, 3))
    gate, rw = rnd(width, 7, 1.0).astype(dtype), rnd(rows, 8, 1.0).astype(dtype)
    A, B, DC, G, RW = to_device(queue, a, b, dc, gate, rw)
    cases = [(clops.swiglu_gated(queue, A, B, G), ref.swiglu_gated(a, b, gate)),
             (clops.swiglu_limit(queue, A, B, limit=2.0, scale=0.5, row_weight=RW),
              ref.swiglu_limit(a, b, limit=2.0, scale=0.5, row_weight=rw))]
    cases += zip(clops.swiglu_gated_bwd(queue, A, B, G, DC), ref.swiglu_gated_bwd(a, b, gate, dc))
    for got, want in cases:
        assert ref.ulps_off(got.get(), want, dtype) <= 1


@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_narrow_rounding_is_to_nearest_even(queue, dtype):
    """``add``'s float32 sum stored as numpy rounds it, bit for bit: ties to even, overflow to ±Inf
    (float16: from 65520, the tie above the largest half), subnormals, NaN and ±Inf kept; every bit
    pattern widened and stored back unchanged, and sums of random pairs of them rounded right."""
    fi = ml_dtypes.finfo(dtype)
    tiny, eps, big = float(fi.smallest_subnormal), float(fi.eps), float(fi.max)  # big + 2**(…): the tie above it
    a = np.array([1, 1, 1, -1, big, -big, big, tiny, 3 * tiny, 0, np.nan, np.inf, -np.inf, 2, 7],
                 np.float32)
    b = np.array([eps / 2, 3 * eps / 2, eps / 4, -eps / 2, 2.0 ** (fi.maxexp - fi.nmant - 2), -big, 0, tiny, -tiny,
                  -0.0, 1, 1, 1, np.nan, -np.inf], np.float32)
    every = np.arange(2 ** 16, dtype=np.uint16).view(dtype)  # each bit pattern: + (−0) keeps it, + a shuffle mixes
    shuffled = np.random.default_rng(0).permutation(every)
    a = np.concatenate([a.astype(dtype), every, every])
    b = np.concatenate([b.astype(dtype), np.full_like(every, -0.0), shuffled])
    A, B = to_device(queue, a, b)
    with np.errstate(over="ignore", invalid="ignore"):  # Inf − Inf among the pairs
        want = (a.astype(np.float32) + b.astype(np.float32)).astype(dtype)
    got = clops.add(queue, A, B).get()
    nan = np.isnan(want)  # NaN payloads are the device's
    assert (np.isnan(got) == nan).all() and got[~nan].tobytes() == want[~nan].tobytes(), (got, want)
    assert np.isinf(got[4:6]).all() and got[11] == np.inf and got[12] == -np.inf


def test_mixed_dtypes_are_refused(queue):
    a = cla.to_device(queue, rnd(8, 1).astype(ml_dtypes.bfloat16))
    b = cla.to_device(queue, rnd(8, 2))
    h = cla.to_device(queue, rnd(8, 3).astype(np.float16))
    with pytest.raises(TypeError, match=r"b: dtype must be bfloat16 \(that of a\), got float32"):
        clops.add(queue, a, b)
    with pytest.raises(TypeError, match="gate: dtype must be bfloat16 or float32, got float16"):
        clops.swiglu_gated(queue, a.reshape(1, 8), a.reshape(1, 8), h)
    with pytest.raises(TypeError, match=r"out: dtype must be bfloat16, got float32"):
        clops.add(queue, a, a, out=b)
    with pytest.raises(TypeError, match="a: dtype must be float32 or float16 or bfloat16, got int32"):
        clops.add(queue, cla.zeros(queue, 8, np.int32), a)
