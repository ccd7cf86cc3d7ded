"""clops.profile: kernels with parameters, sizes and times; host-side counts; refusal; nothing left on."""
import pyopencl as cl
import pyopencl.array as cla
import pytest

import clops
from clops import args, program
from clops.profile import measure
from clops.reference import rnd


def test_records_kernels_and_counts(queue):
    n = 5000
    a, b, dc = (cla.to_device(queue, rnd(n, s)) for s in (1, 2, 3))
    given = cla.empty_like(a)
    with clops.profile(queue) as prof:
        clops.swiglu(queue, a, b, out=given)  # written into a given array: no buffer created
        da, db = clops.swiglu_bwd(queue, a, b, dc)
        clops.add(queue, da, db)
    assert [r.name for r in prof.launches] == ["swiglu_fwd", "swiglu_bwd", "add"]
    r = prof.launches[1]
    assert r.template == "elementwise.cl.mako" and {"wg", "vw", "ept", "idx"} <= set(r.params)
    assert r.local_size == (r.params["wg"],) and r.global_size[0] % r.params["wg"] == 0
    assert r.global_size[0] * r.params["ept"] * r.params["vw"] >= n
    assert all(x.ms > 0 for x in prof.launches)
    assert prof.counts["buffers"] == 3 and prof.counts["buffer_bytes"] == 3 * 4 * n
    rows = prof.summary()
    assert sorted(row[0] for row in rows) == ["add", "swiglu_bwd", "swiglu_fwd"]
    assert all(row[1] == 1 for row in rows) and abs(sum(row[4] for row in rows) - 1) < 1e-9
    assert rows[0][2] >= rows[-1][2]  # longest first
    text = prof.table()
    assert "swiglu_bwd" in text and "buffers created 3" in text
    assert 0 < prof.kernel_ms(["add"]) < prof.kernel_ms() <= prof.span_ms()
    assert abs(prof.kernel_ms() - sum(row[2] for row in rows)) < 1e-9


def test_nothing_registered_outside_the_block(queue):
    a = cla.to_device(queue, rnd(100, 1))
    with clops.profile(queue) as prof:
        assert program.observers and args.host_observers
    assert not program.observers and not args.host_observers
    clops.add(queue, a, a)
    assert prof.launches == [] and prof.counts["buffers"] == 0
    with pytest.raises(ValueError, match="no clops kernel"):
        prof.kernel_ms()


def test_other_queues_are_not_recorded(queue):
    other = cl.CommandQueue(queue.context, properties=cl.command_queue_properties.PROFILING_ENABLE)
    a = cla.to_device(other, rnd(100, 1))
    with clops.profile(queue) as prof:
        clops.add(other, a, a)
    assert prof.launches == [] and prof.counts["buffers"] == 0


def test_refuses_queue_without_profiling(queue):
    with pytest.raises(ValueError, match="PROFILING_ENABLE"):
        clops.profile(cl.CommandQueue(queue.context))
    with pytest.raises(TypeError, match="queue"):
        clops.profile(queue.context)


def test_measure(queue):
    a = cla.to_device(queue, rnd(1000, 1))
    ms, times = measure(queue, lambda: clops.add(queue, a, a), warmup=1, runs=7)
    assert len(times) == 7 and min(times) <= ms <= max(times) and ms > 0
