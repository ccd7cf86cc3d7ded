"""The launch path: warm calls render and read nothing, events stay short, nothing waits on the
host, scratch lives until its kernels have run, exit waits for pending kernels, allocators and overlapping outputs are checked,
plans are keyed by the gain's dtype, stale tuning entries fall back, and the specs' local-memory formulas match the built kernels."""
import json
import os
import subprocess
import sys
import threading

import ml_dtypes
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pytest

import clops
from clops import args, attn, elementwise, embed, loss, norm, optim, program, qk_rope, tuning
from clops.reference import rnd
from helpers import to_device

N, D, NH, NKV, HD, WINDOW = 24, 32, 4, 2, 16, 12


def _inputs(queue):
    x, w, dy = to_device(queue, rnd((N, D), 1), rnd(D, 2), rnd((N, D), 3))
    q, = to_device(queue, rnd((N, NH, HD), 4))
    k, v = to_device(queue, rnd((N, NKV, HD), 5), rnd((N, NKV, HD), 6))
    rope, = to_device(queue, clops.rope_table(WINDOW, HD // 4))
    return x, w, dy, q, k, v, rope


def _chain(queue, inputs, wait_for=None, allocator=None):
    """Every op with scratch or several kernels, each result feeding the next; returns the results."""
    x, w, dy, q, k, v, rope = inputs
    kw = {"allocator": allocator}
    y, inv = clops.rms_norm(queue, x, w, wait_for=wait_for, **kw)
    dx = clops.rms_norm_bwd(queue, y, w, inv, dy, **kw)
    dw = clops.rms_norm_dw(queue, y, inv, dx, **kw)
    qn, qinv = clops.qk_norm_rope(queue, q, w[:HD].copy(queue), rope, **kw)
    o, lse = clops.attention(queue, qn, k, v, window=WINDOW, **kw)
    dq, dk, dv = clops.attention_bwd(queue, qn, k, v, o, lse, o, window=WINDOW, **kw)
    dqr, dwq = clops.qk_norm_rope_bwd(queue, q, w[:HD].copy(queue), qinv, rope, dq, **kw)
    return {"y": y, "dx": dx, "dw": dw, "o": o, "dq": dq, "dk": dk, "dv": dv, "dqr": dqr, "dwq": dwq}


def test_warm_call_renders_reads_and_checks_nothing(queue, monkeypatch):
    inputs = _inputs(queue)
    first = {k: a.get() for k, a in _chain(queue, inputs).items()}

    def forbidden(*a, **k):
        raise AssertionError("a warm call rendered a template or read a tuning file")

    monkeypatch.setattr(program, "_render", forbidden)
    monkeypatch.setattr(tuning, "_load", forbidden)
    monkeypatch.setattr(tuning, "lookup", forbidden)
    again = _chain(queue, inputs)
    assert all(np.array_equal(first[k], a.get()) for k, a in again.items())


def test_events_stay_short(queue):
    a, = to_device(queue, rnd(1000, 1))
    out, dw = cla.empty_like(a), cla.zeros(queue, (8,), np.float32)
    x, dy = to_device(queue, rnd((125, 8), 2), rnd((125, 8), 3))
    inv, = to_device(queue, np.ones(125, np.float32))
    for _ in range(100):
        clops.add(queue, a, a, out=out)
        clops.rms_norm_dw(queue, x, inv, dy, dw=dw)
    assert len(out.events) == 1 and len(dw.events) == 2  # rms_norm_dw: its two kernels
    assert np.allclose(dw.get(), 100 * (dy.get() * x.get()).sum(0), rtol=1e-5)


def test_no_op_waits_on_the_host(queue):
    """Gated by a user event nobody has completed, every op still returns: none waits on the host."""
    gate = cl.UserEvent(queue.context)
    inputs = _inputs(queue)
    done = {}
    thread = threading.Thread(target=lambda: done.update(_chain(queue, inputs, wait_for=[gate])), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "an op waited on the host"
    assert done["dwq"].events[-1].command_execution_status > 0  # still queued behind the gate
    gate.set_status(cl.command_execution_status.COMPLETE)
    want = _chain(queue, inputs)
    assert all(np.array_equal(want[k].get(), a.get()) for k, a in done.items())


def test_out_of_order_queue_and_shared_pool_give_the_in_order_bits(queue):
    """On an out-of-order queue, and on two in-order queues sharing one pool, every op's kernels run
    in their order and no scratch is handed out again while it is in use."""
    props = cl.command_queue_properties
    if not queue.device.queue_properties & props.OUT_OF_ORDER_EXEC_MODE_ENABLE:
        pytest.skip("the device has no out-of-order queues")
    inputs = _inputs(queue)
    want = {k: a.get() for k, a in _chain(queue, inputs).items()}
    ooo = cl.CommandQueue(queue.context, properties=props.OUT_OF_ORDER_EXEC_MODE_ENABLE)
    pool = args.deferred_pool(queue.context)
    other = cl.CommandQueue(queue.context)
    for _ in range(3):
        got = _chain(ooo, inputs, allocator=pool)
        noise = _chain(other, inputs, allocator=pool)  # takes whatever the pool has free meanwhile
        for k, a in got.items():
            assert np.array_equal(want[k], a.get()), k
        del noise


def test_scratch_is_held_until_its_kernels_complete(queue):
    pool = args.deferred_pool(queue.context)
    x, w, dy, *_ = _inputs(queue)
    _, inv = clops.rms_norm(queue, x, w)
    queue.finish()
    gate = cl.UserEvent(queue.context)
    dw = clops.rms_norm_dw(queue, x, inv, dy, wait_for=[gate], allocator=pool)
    assert pool.active_blocks == 2  # dw and its partial sums, held while the kernels wait
    gate.set_status(cl.command_execution_status.COMPLETE)
    dw.get()
    queue.finish()
    clops.rms_norm_dw(queue, x, inv, dy, dw=dw, allocator=pool)  # the next op releases what completed
    queue.finish()
    assert pool.active_blocks <= 2


EXIT_CHILD = """
import atexit, os, threading, time
import numpy as np, pyopencl as cl, pyopencl.array as cla

def report():  # registered before clops is imported: runs after clops' own exit handler
    print(int(y.events[-1].get_info(cl.event_info.COMMAND_EXECUTION_STATUS)))

atexit.register(report)
import clops
dev = next(d for p in cl.get_platforms() if p.name == os.environ["P"] for d in p.get_devices() if d.name == os.environ["D"])
ctx = cl.Context([dev])  # held: Intel's CPU runtime invalidates a queue's context that Python dropped
queue = cl.CommandQueue(ctx)
x, w = cla.to_device(queue, np.ones((8, 16), np.float32)), cla.to_device(queue, np.ones(16, np.float32))
gate = cl.UserEvent(queue.context)
y, _ = clops.rms_norm(queue, x, w, wait_for=[gate])
threading.Thread(target=lambda: (time.sleep(0.5), gate.set_status(cl.command_execution_status.COMPLETE)), daemon=True).start()
"""


def test_pending_kernels_are_waited_for_at_exit(queue):
    """A process that exits with an op's kernel pending waits for it (PoCL 3.1 crashes one that exits
    while its compiler builds a pending launch's kernel: tools/pocl_exit_repro.py)."""
    env = dict(os.environ, P=queue.device.platform.name, D=queue.device.name)
    run = subprocess.run([sys.executable, "-c", EXIT_CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["0"]  # CL_COMPLETE when the child's last exit handler ran


def test_exit_wait_gives_up_on_a_kernel_that_cannot_run(queue):
    """A kernel gated by a user event nobody completes: the exit's wait warns after its limit, not hangs."""
    x, w, *_ = _inputs(queue)
    gate = cl.UserEvent(queue.context)
    y, _ = clops.rms_norm(queue, x, w, wait_for=[gate])
    with pytest.warns(UserWarning, match="kernels still pending after 0.2 s at exit"):
        args.wait_held(0.2)
    gate.set_status(cl.command_execution_status.COMPLETE)
    y.get()


@pytest.mark.parametrize("shape, dtype", [((3, 5, 7), args.F32), ((4,), args.I32), ((2, 6), args.FLOATS[2])])
def test_new_arrays_are_those_pyopencl_checks(queue, shape, dtype):
    """The arrays ops make (pyopencl's unchecked constructor) are those of its checked one."""
    got = args.new_array(queue, shape, None, dtype)
    want = cla.Array(queue, shape, dtype, allocator=got.allocator, data=got.base_data)
    for attr in ("shape", "strides", "dtype", "size", "nbytes", "offset", "allocator", "events", "queue", "context"):
        assert getattr(got, attr) == getattr(want, attr), attr
    assert (got.flags.c_contiguous, got.flags.f_contiguous) == (want.flags.c_contiguous, want.flags.f_contiguous)
    host = np.arange(got.size).reshape(shape).astype(dtype)
    got.set(host)
    assert (got.get() == host).all()


@pytest.mark.parametrize("allocator, word", [
    ("pool", "allocator: expected a callable"),
    (lambda n: None, "allocator: asked for"),
    ("small", "allocator: asked for .* returned 4 bytes"),
])
def test_allocator_is_checked(queue, allocator, word):
    a, = to_device(queue, rnd(100, 1))
    if allocator == "small":
        allocator = lambda n: cl.Buffer(queue.context, cl.mem_flags.READ_WRITE, 4)  # noqa: E731
    with pytest.raises(TypeError, match=word):
        clops.add(queue, a, a, allocator=allocator)


def test_overlapping_outputs_are_refused(queue):
    x, w, dy, q, k, v, rope = _inputs(queue)
    lse, = to_device(queue, rnd((N, NH), 8))
    same, = to_device(queue, rnd((N, NH, HD), 7))
    wq = w[:HD].copy(queue)
    both = cla.zeros(queue, k.shape, np.float32)
    ones = cla.to_device(queue, np.ones(N, np.float32))
    cases = [
        ("dk: shares memory with k", lambda: clops.attention_bwd(queue, q, k, v, q, lse, q, window=WINDOW, dk=k)),
        ("dv: shares memory with k", lambda: clops.attention_bwd(queue, q, k, v, q, lse, q, window=WINDOW, dv=k)),
        ("dk: shares memory with dv", lambda: clops.attention_bwd(queue, q, k, v, q, lse, q, window=WINDOW, dk=both,
                                                                   dv=both)),
        ("out: shares memory with k", lambda: clops.attention(queue, q, same, same, window=WINDOW, out=same)),
        ("da: shares memory with db", lambda: clops.swiglu_bwd(queue, x, x, x, da=dy, db=dy)),
        ("dx: shares memory with dy", lambda: clops.rms_norm_bwd(queue, x, w, ones, dy, dx=dy)),
        ("dx: shares memory with x", lambda: clops.qk_norm_rope_bwd(queue, q, wq, lse, rope, q, dx=q)),
    ]
    square, row = to_device(queue, rnd((D, D), 9), rnd((1, D), 11))
    gain = cla.to_device(queue, rnd(D, 10))
    cases += [
        ("inv: shares memory with w", lambda: clops.rms_norm(queue, square, gain, inv=gain)),  # n = d
        ("out: shares memory with gate", lambda: clops.swiglu_gated(queue, row, row, gain, out=gain.reshape(1, D))),
    ]
    for word, call in cases:
        before = [a.get() for a in (x, dy, q, k, v, same, both, square, gain)]
        with pytest.raises(ValueError, match=word):
            call()
        after = [a.get() for a in (x, dy, q, k, v, same, both, square, gain)]
        assert all(np.array_equal(b, c) for b, c in zip(before, after)), f"{word}: an array was written"


def test_elementwise_in_place_is_allowed(queue):
    a, b = to_device(queue, rnd(1000, 1), rnd(1000, 2))
    want = a.get() + b.get()
    assert clops.add(queue, a, b, out=a) is a
    assert np.array_equal(a.get(), want)


def test_plans_are_keyed_by_the_gains_dtype(queue):
    """The ops whose gain (gate, row weight) may be float32 or the storage type, at bfloat16 storage on
    the same shapes with each: the same values give the same bits (a 16-bit dw rounded once from the
    same float32 sum); a plan or program keyed without the gain's dtype runs the other's kernel."""
    bf = np.dtype(ml_dtypes.bfloat16)
    x, dy, ds = to_device(queue, *(rnd((N, D), s).astype(bf) for s in (1, 3, 4)))
    q, dq = to_device(queue, *(rnd((N, NH, HD), s).astype(bf) for s in (5, 6)))
    rope, = to_device(queue, clops.rope_table(WINDOW, HD // 4))
    w16 = rnd(D, 2).astype(bf)

    def run(w):
        wq = w[:HD].copy(queue)
        y, inv = clops.rms_norm(queue, x, w)
        qn, qinv = clops.qk_norm_rope(queue, q, wq, rope)
        out = [y, inv, clops.rms_norm_bwd(queue, x, w, inv, dy), *clops.rms_norm_bwd(queue, x, w, inv, dy, want_dw=True),
               *clops.add_rms_norm(queue, x, dy, w), *clops.add_rms_norm_bwd(queue, x, w, inv, dy, ds), qn, qinv,
               *clops.qk_norm_rope_bwd(queue, q, wq, qinv, rope, dq), clops.swiglu_gated(queue, x, dy, w),
               *clops.swiglu_gated_bwd(queue, x, dy, w, ds),
               clops.swiglu_limit(queue, x, dy, limit=1.0, row_weight=w[:N].copy(queue))]
        # dw, dw of qk_norm_rope_bwd: of w's dtype; the float32 gain's rounded as the 16-bit one's is
        return [(a.get().astype(bf) if a.shape in ((D,), (HD,)) else a.get()).tobytes() for a in out]

    first = run(cla.to_device(queue, w16))
    assert run(cla.to_device(queue, w16.astype(np.float32))) == first
    assert run(cla.to_device(queue, w16)) == first


def test_stale_tuning_entry_warns_and_takes_the_heuristic(queue, tmp_path, monkeypatch):
    monkeypatch.setenv("CLOPS_TUNING_DIR", str(tmp_path))
    path = tuning.user_file(queue.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"entries": {"elementwise": {"": {"wg": 3 * queue.device.max_work_group_size,
                                                                 "vw": 4, "ept": 1}}}}))
    tuning.reload()
    a, = to_device(queue, rnd(1000, 1))
    with pytest.warns(UserWarning, match="tuning entry from user .* not used, the heuristic is"):
        c = clops.add(queue, a, a)
    assert np.array_equal(c.get(), 2 * a.get())
    tuning.override("elementwise", {}, {"wg": 3 * queue.device.max_work_group_size, "vw": 4, "ept": 1})
    try:
        with pytest.raises(clops.LimitError, match="work-items per group"):  # an override is used as given
            clops.add(queue, a, a)
    finally:
        tuning.override("elementwise", {}, None)


# (spec, shape class, the kernels' extra render parameters, parameter sets besides the device's own)
LOCAL = [
    (norm.ROWS, {"d": 96, "st": "float"}, {"idx": "uint"}, [{"wg": 64, "vw": 2, "rpg": 4, "rr": 1}]),
    (norm.ROWS, {"d": 96, "st": "bf16"}, {"idx": "uint", "st": "bf16"}, []),
    (norm.ROWS_BWD, {"d": 96, "st": "bf16"}, {"idx": "uint", "st": "bf16"}, []),
    (norm.BWD_DW, {"d": 96, "st": "float"}, {"idx": "uint"}, [{"wg": 64, "vw": 2, "rpg": 4, "rr": 1, "gpc": 2, "pf": 2},
                                               {"wg": 32, "vw": 4, "rpg": 1, "rr": 2, "gpc": 1, "pf": 1}]),
    (qk_rope.SPEC, {"hd": 32, "st": "float"}, {"idx": "uint", "half": 8},
     [{"wg": 32, "vw": 2, "upg": 4, "gpc": 2, "hpw": 2, "pf": 1},  # two units a segment: twice the unit sums
      {"wg": 64, "vw": 4, "upg": 64, "gpc": 1, "hpw": 1, "pf": 3},  # the last sum in slices
      {"wg": 16, "vw": 4, "upg": 16, "gpc": 1, "hpw": 1, "pf": 2},  # no scratch
      {"wg": 64, "vw": 1, "upg": 1, "gpc": 1, "hpw": 1, "pf": 1}]),  # the tree
    (qk_rope.SPEC, {"hd": 32, "st": "float"}, {"idx": "uint", "half": 8, "varlen": 1}, []),
    (attn.FWD, {"hd": 40}, {"idx": "uint"}, [{"bq": 12, "rq": 3, "tx": 3, "bk": 9, "vw": 1, "dc": 5, "kc": 3},
                                             {"bq": 16, "rq": 2, "tx": 8, "bk": 24, "vw": 2, "dc": 48, "kc": 12}]),
    (attn.FWD_MMA, {"hd": 40, "st": "float", "product": "fma"}, {"idx": "uint"}, [{"nw": 1, "bk": 32, "stages": 2, "af": 1, "sx": 1, "gp": 1}]),
    (attn.FWD_MMA, {"hd": 40, "st": "bf16", "product": "fma"}, {"idx": "uint"}, [{"nw": 3, "bk": 16, "stages": 1, "af": 2, "sx": 1, "gp": 1}]),
    (attn.FWD_MMA, {"hd": 48, "st": "bf16", "product": "fma"}, {"idx": "uint"}, [{"nw": 2, "bk": 16, "stages": 2, "af": 1, "sx": 2, "gp": 1}]),
    (attn.BWD_MMA["dq"], {"hd": 40, "st": "bf16", "product": "fma"}, {"idx": "uint"}, [{"nw": 3, "bk": 32, "af": 2, "stages": 2}]),
    (attn.BWD_MMA["dkv"], {"hd": 40, "st": "float", "product": "fma"}, {"idx": "uint"},
     [{"nw": 1, "bk": 48, "af": 1, "cs": 1, "sx": 1}]),
    (attn.BWD_MMA["dkv"], {"hd": 64, "st": "bf16", "product": "fma"}, {"idx": "uint", "store_ds": 1},
     [{"nw": 2, "bk": 32, "af": 1, "cs": 2, "sx": 2}]),
    (attn.BWD_MMA["dqs"], {"hd": 40, "st": "bf16", "product": "fma"}, {"idx": "uint"}, [{"nw": 3, "bk": 32}]),
    (attn.BWD["dkv"], {"hd": 16}, {"idx": "uint", "store_ds": 1},
     [{"wg": 16, "split": 1, "bq": 8, "bk": 8, "sq": 2, "sk": 2, "dc": 8, "jc": 4, "tr": 2, "td": 4, "vw": 2}]),
    (attn.BWD["dq"], {"hd": 16}, {"idx": "uint"},
     [{"wg": 16, "split": 1, "bq": 8, "bk": 8, "sq": 2, "sk": 2, "dc": 16, "jc": 4, "tr": 2, "td": 4, "vw": 2}]),
    (attn.BWD["dqs"], {"hd": 16}, {"idx": "uint"}, [{"wg": 8, "bq": 8, "jc": 5, "tr": 4, "td": 4, "vw": 2}]),
    (elementwise.SPEC, {}, {"idx": "uint"}, []),
    (loss.SPEC, {}, {"idx": "uint", "cap": 1}, [{"wg": 5, "unroll": 1}, {"wg": 64, "unroll": 4}]),
    (loss.BWD, {"st": "bf16"}, {"idx": "uint", "cap": 1}, [{"wg": 5, "ept": 3}]),
    (embed.SPEC, {}, {"idx": "uint", "count": 1}, [{"wg": 8}]),
    (optim.SPEC, {}, {"idx": "uint"}, []),
    (norm.DW, {"d": 96, "st": "float"}, {"idx": "uint"}, []),
]


@pytest.mark.parametrize("spec, sc, extra, sets", LOCAL, ids=[f"{r[0].op}" for r in LOCAL])
def test_local_memory_formula_matches_the_built_kernels(queue, spec, sc, extra, sets):
    """spec.local_bytes is what the largest kernel of the family declares (CL_KERNEL_LOCAL_MEM_SIZE);
    drivers may round a kernel's local memory up a little, never down."""
    info = cl.kernel_work_group_info.LOCAL_MEM_SIZE
    for p in [spec.resolve(queue.device, sc)[0]] + sets:
        p = spec.check(queue.device, sc, p)
        built = program.kernels(queue, spec.template, dict(spec.render(p, sc), **extra),
                                work_group_size=spec.wg(p, sc))
        used = max(k.knl.get_work_group_info(info, queue.device) for k in built.values())
        want = spec.local_bytes(p, sc)
        if used == 0 < want:  # PoCL 6.0 reports 0 for every kernel: nothing to check there
            pytest.skip(f"{queue.device.platform.version.strip()} reports no local memory (CL_KERNEL_LOCAL_MEM_SIZE 0)")
        assert want <= used <= want + 64, f"{spec.op} {p}: formula {want} bytes, kernels {used}"
