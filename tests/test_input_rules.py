"""Input the ops once took silently (issue #19): scalars finite in float64 but not in float32,
flags that are not bools, ``wait_for`` values that are not events of the queue's context, and
``rope_table`` arguments. Each is refused naming the argument, before anything is enqueued, and
given output arrays keep their bytes (the checks of test_bad_input)."""
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pytest

import clops
from test_bad_input import _check_refused, _other_context

SCALARS = [
    ("rms_norm", {"eps": 1e39}, "eps"),
    ("rms_norm_bwd", {"eps": 2**1100}, "eps"),
    ("qk_norm_rope", {"eps": 1e39}, "eps"),
    ("swiglu_limit", {"limit": 1e39}, "limit"),
    ("swiglu_limit", {"scale": -1e39}, "scale"),
    ("attention", {"scale": 1e39}, "scale"),
    ("attention_bwd", {"scale": 2**1100}, "scale"),
    ("attention", {"scale": 3e38}, "scale"),  # finite in float32, but not scale·log2(e)
]


@pytest.mark.parametrize("op, kw, named", SCALARS, ids=[f"{op}-{kw}"[:40] for op, kw, _ in SCALARS])
def test_scalars_beyond_float32_are_refused(queue, monkeypatch, op, kw, named):
    _check_refused(queue, monkeypatch, op, named, ValueError, kw)


@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_bwd", "qk_norm_rope", "qk_norm_rope_bwd"])
def test_gemma_must_be_a_bool(queue, monkeypatch, op):
    _check_refused(queue, monkeypatch, op, "gemma", TypeError, {"gemma": "False"})


def _foreign_event(queue):
    """An event of another context on the same device (on Intel's runtime, waiting on it aborted the process)."""
    return cl.enqueue_marker(_other_context(queue, (1,)).queue)


BAD_WAITS = {  # kind -> (exception, make(queue) -> the wait_for value)
    "[None]": (TypeError, lambda queue: [None]),
    "['x']": (TypeError, lambda queue: ["x"]),
    "a string": (TypeError, lambda queue: "x"),
    "zero": (TypeError, lambda queue: 0),
    "an event of another context": (ValueError, lambda queue: _foreign_event(queue)),
    "a list with an event of another context": (ValueError, lambda queue: [_foreign_event(queue)]),
}


# One op per way its first launch is reached: elementwise, the row kernels, the two-stage gain
# gradient, the q/k norm backward, the three-pass attention backward.
@pytest.mark.parametrize("kind", sorted(BAD_WAITS))
@pytest.mark.parametrize("op", ["add", "rms_norm", "rms_norm_dw", "qk_norm_rope_bwd", "attention_bwd"])
def test_bad_wait_for_is_refused(queue, monkeypatch, op, kind):
    exc, make = BAD_WAITS[kind]
    _check_refused(queue, monkeypatch, op, "wait_for", exc, {"wait_for": make(queue)})


@pytest.mark.parametrize("wrap", [lambda e: e, lambda e: (e,), lambda e: [e, e]], ids=["event", "tuple", "list"])
def test_wait_for_takes_one_event_or_a_sequence(queue, wrap):
    a = cla.to_device(queue, np.arange(8, dtype=np.float32))
    user = cl.UserEvent(queue.context)
    c = clops.add(queue, a, a, wait_for=wrap(user))
    user.set_status(cl.command_execution_status.COMPLETE)
    assert (c.get() == 2 * np.arange(8)).all()


@pytest.mark.parametrize("args, kw, exc, named", [
    ((4.5, 2), {}, TypeError, "window"),
    ((0, 2), {}, ValueError, "window"),
    ((4, -1), {}, ValueError, "rotary_half"),
    ((4, 2.0), {}, TypeError, "rotary_half"),
    ((4, 2), {"theta": 0.0}, ValueError, "theta"),
    ((4, 2), {"theta": -1e4}, ValueError, "theta"),
    ((4, 2), {"theta": float("nan")}, ValueError, "theta"),
])
def test_rope_table_refuses_bad_arguments(args, kw, exc, named):
    with pytest.raises(exc, match=named):
        clops.rope_table(*args, **kw)
