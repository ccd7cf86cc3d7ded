"""adamw against the float64 reference of torch.optim.AdamW's formula, over several steps and
tiles (vector tails), and its refusals."""
import numpy as np
import pytest

import clops
from clops import reference as ref, tuning
from clops.reference import rel_err, rnd
from helpers import to_device

KW = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("shape", [(1,), (7, 37), (4096,)])
@pytest.mark.parametrize("tiles", [None, {"wg": 16, "vw": 4, "ept": 3}, {"wg": 8, "vw": 1, "ept": 1}],
                         ids=["default", "vw4", "vw1"])
def test_steps_match_the_reference(queue, shape, tiles):
    p, m, v = rnd(shape, 1, 1.0), np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    dp, dm, dv = to_device(queue, p, m, v)
    tuning.override("adamw", {}, tiles)
    try:
        for step in (1, 2, 3):
            g = rnd(shape, 10 + step, 0.5)
            got = clops.adamw(queue, dp, to_device(queue, g)[0], dm, dv, step=step, **KW)
            p, m, v = ref.adamw(p, g, m, v, step=step, **KW)
            for name, a, want in zip("pmv", got, (p, m, v)):
                assert rel_err(a.get(), want) <= 1e-6, (name, step)
            p, m, v = (a.get() for a in got)  # the next step starts from the stored float32 state
    finally:
        tuning.override("adamw", {}, None)


def test_refusals(queue):
    p, g, m, v = to_device(queue, *(rnd(10, s) for s in range(4)))
    cases = [
        (ValueError, "lr: must be ≥ 0", dict(lr=-1.0, step=1)),
        (ValueError, "beta1: must be in", dict(lr=1e-3, step=1, beta1=1.0)),
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
    with pytest.raises(ValueError, match="g: expected shape"):
        clops.adamw(queue, p, to_device(queue, rnd(11, 5))[0], m, v, lr=1e-3, step=1)
    assert all(np.array_equal(b, a.get()) for b, a in zip(before, (p, g, m, v)))
