"""Elementwise parity at sizes that exercise the tail (1, odd, not a multiple of the vector width,
one element past a work-group's span), and launch-parameter variants through the tuning override."""
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


@pytest.mark.parametrize("rows,width", [(1, 1), (3, 7), (5, 4), (2, 4099)])
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


def test_outputs_written_into_given_arrays(queue):
    a, b = rnd((4, 9), 11), rnd((4, 9), 12)
    A, B = to_device(queue, a, b)
    out = cla.empty(queue, (4, 9), np.float32)
    assert clops.add(queue, A, B, out=out) is out
    np.testing.assert_allclose(out.get(), a + b, rtol=1e-7)
