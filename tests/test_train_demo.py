"""The worked example: a tiny model's first-step gradients and first 10 losses agree with the same
model in PyTorch (CPU, float64), and a short run lowers the loss, on every device."""
import ctypes.util
import dataclasses
import os

import pyopencl as cl
import pytest

from clops import train_demo

pytestmark = pytest.mark.skipif(not (os.environ.get("CLOPS_CLBLAST") or ctypes.util.find_library("clblast")),
                                reason="CLBlast is not installed (apt install libclblast1)")


def test_check_against_pytorch(queue):
    pytest.importorskip("torch")
    lines = []
    assert train_demo.check(queue, train_demo.TINY, out=lines.append), "\n".join(lines)
    assert sum("e-" in line for line in lines) >= 25 + 10  # every gradient and every loss was compared


def test_short_run_learns(queue):
    curve = train_demo.train(queue, dataclasses.replace(train_demo.TINY, steps=40), log=10, out=lambda *a, **k: None)
    assert curve[-1][1] < 0.8 * curve[0][1], curve


def test_model_needs_an_in_order_queue(queue):
    """The model writes the same arrays at every step and relies on the queue's order between them."""
    ooo = cl.CommandQueue(queue.context, properties=cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE)
    with pytest.raises(ValueError, match="queue: .*in-order"):
        train_demo.Model(ooo, train_demo.TINY, train_demo.init_weights(train_demo.TINY))
