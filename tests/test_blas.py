"""clops.blas.gemm (CLBlast through ctypes) against float64 numpy: transposes, beta, refusals."""
import ctypes.util
import os
import time

import numpy as np
import pyopencl as cl
import pytest

from clops import blas
from clops.reference import rel_err, rnd
from helpers import to_device

pytestmark = pytest.mark.skipif(not (os.environ.get("CLOPS_CLBLAST") or ctypes.util.find_library("clblast")),
                                reason="CLBlast is not installed (apt install libclblast1)")


@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm(queue, trans_a, trans_b):
    m, n, k = 33, 20, 17
    a = rnd((k, m) if trans_a else (m, k), 1)
    b = rnd((n, k) if trans_b else (k, n), 2)
    da, db = to_device(queue, a, b)
    want = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
    c = blas.gemm(queue, da, db, trans_a=trans_a, trans_b=trans_b)
    assert rel_err(c.get(), want) <= 1e-6
    c0 = rnd((m, n), 3)  # other than a·b, so that alpha and beta swapped show
    c = blas.gemm(queue, da, db, trans_a=trans_a, trans_b=trans_b, alpha=2.0, beta=-0.5, out=to_device(queue, c0)[0])
    assert rel_err(c.get(), 2 * want - 0.5 * c0) <= 1e-6


@pytest.mark.parametrize("trans_a, trans_b", [(False, True), (True, False)])
def test_gemm_with_temporary_matrices(queue, trans_a, trans_b):
    """Odd sizes past CLBlast's direct kernel (its threshold is tuned per device: about 1000 on the CPU
    runtimes, more on NVIDIA's): its fast kernel takes padded, transposed copies, in the temporary
    buffer clops gives it (C's too, with beta)."""
    lib = blas.library()
    for m, n, k in ((1030, 1000, 990), (2062, 2000, 1990), (4110, 4000, 3990)):
        if blas._temp_bytes(lib, queue, trans_a, trans_b, m, n, k, m if trans_a else k, k if trans_b else n) > 0:
            break
    else:
        pytest.skip("CLBlast takes its direct kernel up to 4110 × 4000 × 3990 on this device")
    a = rnd((k, m) if trans_a else (m, k), 1)
    b = rnd((n, k) if trans_b else (k, n), 2)
    c0 = rnd((m, n), 3)
    da, db, c = to_device(queue, a, b, c0)
    want = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
    blas.gemm(queue, da, db, trans_a=trans_a, trans_b=trans_b, beta=0.5, out=c)
    assert rel_err(c.get(), want + 0.5 * c0) <= 1e-6


def test_waits_for_another_queue(queue):
    """An input written on another queue: the gemm waits for it (a barrier; on the queue's own in-order
    commands it needs none)."""
    a, b = rnd((8, 8), 1), rnd((8, 8), 2)
    da, db = to_device(queue, np.zeros_like(a), b)
    other, gate = cl.CommandQueue(queue.context), cl.UserEvent(queue.context)
    da.events = [cl.enqueue_copy(other, da.data, a, wait_for=[gate], is_blocking=False)]  # not yet run
    assert not blas._implied(queue, da.events) and not blas._implied(queue, [gate])
    c = blas.gemm(queue, da, db)
    assert blas._implied(queue, c.events)
    queue.flush()  # submitted: without the barrier it would run now, on the zeros
    time.sleep(0.2)
    assert c.events[0].command_execution_status != cl.command_execution_status.COMPLETE
    gate.set_status(cl.command_execution_status.COMPLETE)
    assert rel_err(c.get(), a.astype(np.float64) @ b) <= 1e-6
    ooo = cl.CommandQueue(queue.context, properties=cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE)
    assert not blas._implied(ooo, [cl.enqueue_marker(ooo)])


def test_refusals(queue):
    a, b = to_device(queue, rnd((4, 3), 1), rnd((4, 5), 2))
    with pytest.raises(ValueError, match="b: op\\(b\\) has 4 rows, op\\(a\\) 3 columns"):
        blas.gemm(queue, a, b)
    with pytest.raises(ValueError, match="out: needed when beta"):
        blas.gemm(queue, a, b, trans_a=True, beta=1.0)
    with pytest.raises(ValueError, match="out: expected shape \\(3, 5\\), got \\(5, 3\\)"):
        blas.gemm(queue, a, b, trans_a=True, out=to_device(queue, rnd((5, 3), 3))[0])
    with pytest.raises(TypeError, match="trans_a"):
        blas.gemm(queue, a, b, trans_a=1)
    with pytest.raises(ValueError, match="out: shares memory with b"):
        blas.gemm(queue, a, b, trans_a=True, out=b.reshape(20)[:15].reshape(3, 5))  # a view of b's buffer


def test_missing_library_says_how_to_install(monkeypatch):
    monkeypatch.setattr(blas, "_lib", {})
    monkeypatch.delenv("CLOPS_CLBLAST", raising=False)
    monkeypatch.setattr(blas.ctypes.util, "find_library", lambda name: None)
    with pytest.raises(RuntimeError, match="apt install libclblast1"):
        blas.library()
