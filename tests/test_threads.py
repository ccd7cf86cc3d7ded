"""Ops called from several host threads, each with its own queue on one context.

pyopencl kernel objects hold their arguments: two threads setting them at once could launch
one thread's kernel with the other's buffers. clops.program.Kernel holds a lock per kernel
from setting the arguments to the enqueue, and the program cache a lock around builds; these
tests start the threads together on a fresh context, so they also build concurrently.
"""
import sys
import threading

import numpy as np
import pytest
import pyopencl as cl
import pyopencl.array as cla

import clops
from clops import reference as ref
from clops.reference import rnd

THREADS = 6


@pytest.fixture(autouse=True)
def fast_switching():
    """Switch threads every 10 µs, not 5 ms: without the kernel lock, argument setting then
    interleaves within a few launches (seen: crashes on PoCL, LogicErrors on Intel's runtime)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


def _in_threads(ctx, fn):
    """``fn(queue, i)`` in THREADS threads started together, each on its own queue; their results."""
    start = threading.Barrier(THREADS)
    results, errors = [None] * THREADS, []

    def body(i):
        try:
            queue = cl.CommandQueue(ctx)
            start.wait()
            results[i] = fn(queue, i)
            queue.finish()
        except Exception as e:  # reported by the test's thread
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return results


def _every_family(queue, i):
    """A chain of every family's ops on data and shapes of thread ``i``; host results."""
    rows, width = 20 + i, 67 + 2 * i
    a, b, dc = (cla.to_device(queue, rnd((rows, width), 10 * i + s, 2.0)) for s in range(3))
    out = {"swiglu": clops.swiglu(queue, a, b), "add": clops.add(queue, a, b)}
    out["da"], out["db"] = clops.swiglu_bwd(queue, a, b, dc)
    w = cla.to_device(queue, rnd(width, 10 * i + 3, 0.5))
    out["y"], inv = clops.rms_norm(queue, a, w)
    out["dx"] = clops.rms_norm_bwd(queue, a, w, inv, dc)
    out["dw"] = clops.rms_norm_dw(queue, a, inv, dc)
    n, heads, hd = 8 + i, 2, 32
    x, dy = (cla.to_device(queue, rnd((n, heads, hd), 10 * i + s)) for s in (4, 5))
    wq = cla.to_device(queue, rnd(hd, 10 * i + 6, 0.5))
    rope = cla.to_device(queue, ref.rope_table(n, 8))
    out["qy"], qinv = clops.qk_norm_rope(queue, x, wq, rope)
    out["qdx"], out["qdw"] = clops.qk_norm_rope_bwd(queue, x, wq, qinv, rope, dy)
    window, nh, nkv = 9 + i, 4, 2
    q, k, v, do = (cla.to_device(queue, rnd((2 * window, h, 16), 10 * i + s))
                   for s, h in ((7, nh), (8, nkv), (9, nkv), (10, nh)))
    out["o"], lse = clops.attention(queue, q, k, v, window=window)
    out["dq"], out["dk"], out["dv"] = clops.attention_bwd(queue, q, k, v, out["o"], lse, do, window=window)
    return {name: arr.get() for name, arr in out.items()}


def test_every_family_from_threads_matches_one_thread(ctx_factory):
    ctx = ctx_factory()
    threaded = _in_threads(ctx, _every_family)
    queue = cl.CommandQueue(ctx)
    for i, got in enumerate(threaded):
        want = _every_family(queue, i)  # deterministic ops: the same bits
        differ = [name for name in want if got[name].tobytes() != want[name].tobytes()]
        assert not differ, f"thread {i}: {differ} differ from a single-threaded run"


def test_one_kernel_under_contention(ctx_factory):
    """Every thread launches the same kernel (add) with its own sizes and buffers, many times."""
    ctx = ctx_factory()

    def hammer(queue, i):
        wrong = 0
        for it in range(40):
            n = 1 + 97 * i + it
            a, b = rnd(n, 1000 * i + it), rnd(n, 1000 * i + it + 500)
            c = clops.add(queue, cla.to_device(queue, a), cla.to_device(queue, b)).get()
            wrong += not np.array_equal(c, a + b)
        return wrong

    assert _in_threads(ctx, hammer) == [0] * THREADS
