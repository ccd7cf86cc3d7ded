"""Argument checks, allocation and event bookkeeping shared by every op.

Every check runs before anything is enqueued and names the argument.

Allocation: arrays an op creates (outputs and scratch) come from ``allocator`` when
given (any callable taking a byte count and returning a ``pyopencl.Buffer`` of at
least that size, e.g. a ``pyopencl.tools.MemoryPool``), else from one memory pool
per context (:func:`memory_pool`). Every array an op's kernels use (its inputs,
outputs and scratch) is held until those kernels have completed (polled, never
waited for, at every op call that makes scratch and every ``POLL_EVERY``-th other
one), so a pool never hands memory out while a kernel still uses it: not the op's
scratch, and not an array its caller has dropped, on any queue or any number of
queues sharing one pool.

Events: an op's first kernel waits on ``wait_for`` plus the pending events of every
array it reads or writes (pyopencl's ``.events``); each output's ``.events`` then
becomes the op's kernels that wrote it, which completed means all it waited on
completed too, so the lists never grow and nothing waits on the host.

Exit: the kernels still pending when the interpreter exits are waited for (``atexit``; up to
``EXIT_WAIT_S``), before the runtimes' libraries are torn down: PoCL 3.1 crashes a process that exits while its compiler thread
builds a kernel a pending launch needs (``tools/pocl_exit_repro.py``; README, known limitations).
"""
from __future__ import annotations

import atexit
import collections
import math
import threading
import time
import warnings
import weakref
from decimal import Decimal

import ml_dtypes
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pyopencl.tools as cl_tools

# Profilers register here (clops.profile) to count host-side work; empty, counting costs one dict check.
host_observers = {}
FLOAT32_MAX = float(np.finfo(np.float32).max)


def note(queue, what, amount=1):
    """Tell profilers that clops did ``amount`` of ``what`` ("buffers", "buffer_bytes") on ``queue``."""
    for observe in list(host_observers.values()):
        observe(queue, what, amount)


def check_queue(queue):
    if not isinstance(queue, cl.CommandQueue):
        raise TypeError(f"queue: expected a pyopencl.CommandQueue, got {type(queue).__name__}")


F32, I32 = np.dtype(np.float32), np.dtype(np.int32)
# The storage dtypes of activations (math is float32 in every kernel) and their template names.
FLOATS = (F32, np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_STORAGE = dict(zip(FLOATS, ("float", "half", "bf16")))


def storage(dtype):
    """The template's storage type name of a float dtype of :data:`FLOATS`."""
    return _STORAGE[dtype]


def storage_dtype(st):
    """The float dtype of storage type name ``st`` (the inverse of :func:`storage`)."""
    return next(dt for dt, name in _STORAGE.items() if name == st)


def check_array(name, arr, queue, shape=None, ndim=None, dtype=F32, like=None):
    """Require a C-contiguous ``pyopencl.array.Array`` of ``dtype`` (float32 unless told; a tuple: any
    of them) on ``queue``'s context, zero offset (of ``shape``, a tuple, or of ``ndim`` dimensions,
    when given). ``like`` names the argument whose dtype ``dtype`` is, for the error message."""
    if (type(arr) is cla.Array and arr.offset == 0 and arr.size and arr.flags.c_contiguous
            and ((dt := arr.dtype) is dtype or (dt in dtype if type(dtype) is tuple else dt == dtype))
            and (shape is None or arr.shape == shape) and (ndim is None or len(arr.shape) == ndim)
            and (arr.queue is queue or arr.context == queue.context)):
        return arr  # the common case, in one test; the checks below say what is wrong
    if not isinstance(arr, cla.Array):
        raise TypeError(f"{name}: expected a pyopencl.array.Array, got {type(arr).__name__}")
    allowed = dtype if type(dtype) is tuple else (dtype,)
    if arr.dtype not in allowed:
        raise TypeError(f"{name}: dtype must be {' or '.join(map(str, allowed))}"
                        f"{f' (that of {like})' if like else ''}, got {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {arr.shape}")
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name}: empty array (shape {arr.shape})")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous (strides {arr.strides} for shape {arr.shape})")
    if arr.offset != 0:
        raise ValueError(f"{name}: views with a nonzero offset ({arr.offset} bytes) are not supported; pass a copy")
    if arr.context != queue.context:
        raise ValueError(f"{name}: array belongs to another context than the queue")
    return arr  # a subclass of pyopencl.array.Array


_pools = weakref.WeakKeyDictionary()  # context -> its default MemoryPool
_pool_by_id = {}  # id(context) -> (weak reference to it, its pool): found without making a weak reference
# (event, scratch arrays) not yet released, oldest first. Held strongly, whatever the context:
# a queue's Python context object may go while its kernels still run.
_held = collections.deque()
_pool_lock = threading.Lock()
_calls = [0]  # op calls, for POLL_EVERY
POLL_EVERY = 8  # op calls between two looks at the held arrays (every call that makes scratch looks too)
_STATUS = cl.event_info.COMMAND_EXECUTION_STATUS  # get_info with it: a fifth of the property's cost


def memory_pool(queue):
    """The memory pool that ops on ``queue``'s context allocate from when no ``allocator`` is given
    (``memory_pool(queue).free_held()`` gives its unused memory back to the device)."""
    ctx = queue.context
    found = _pool_by_id.get(id(ctx))
    if found is not None and found[0]() is ctx:
        return found[1]
    with _pool_lock:
        pool = _pools.get(ctx)
        if pool is None:
            # Deferred, not ImmediateAllocator: that one writes into each new buffer on the queue it
            # was made with, which on NVIDIA's driver waited on a gated queue and, from another
            # queue, could land after an op on that queue had written the buffer.
            pool = _pools[ctx] = deferred_pool(ctx)
        _pool_by_id[id(ctx)] = (weakref.ref(ctx, _forget_pool(id(ctx))), pool)
    return pool


def _forget_pool(key):
    """The callback that drops ``_pool_by_id[key]`` when its context goes (not a later one's entry)."""
    table = _pool_by_id  # held here: at interpreter exit the module's globals are None when it runs

    def forget(ref):  # no lock: it may run while _release_completed holds _pool_lock, and the id is not
        if table.get(key, (None,))[0] is ref:  # reused before the context's callbacks have run
            table.pop(key, None)
    return forget


def deferred_pool(ctx):
    """A MemoryPool over a DeferredAllocator of ``ctx``; pyopencl's warning that an out-of-memory
    error then surfaces at a later enqueue rather than at allocation is known and accepted."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Memory pools expect non-deferred semantics")
        return cl_tools.MemoryPool(cl_tools.DeferredAllocator(ctx))


def check_allocator(allocator):
    if allocator is not None and not callable(allocator):
        raise TypeError(f"allocator: expected a callable taking a byte count (e.g. a pyopencl.tools.MemoryPool), "
                        f"got {type(allocator).__name__}")


def _buffer(queue, nbytes, allocator):
    """(a buffer of at least ``nbytes`` from ``allocator`` or the context's pool, the allocator used)."""
    alloc = memory_pool(queue) if allocator is None else allocator
    buf = alloc(nbytes)
    # the context's pool returns buffers of the size asked for; a given allocator is checked
    if allocator is not None and (not isinstance(buf, cl.MemoryObjectHolder) or buf.size < nbytes):
        got = f"{buf.size} bytes" if isinstance(buf, cl.MemoryObjectHolder) else type(buf).__name__
        raise TypeError(f"allocator: asked for {nbytes} bytes, returned {got}")
    if host_observers:
        note(queue, "buffers")
        note(queue, "buffer_bytes", nbytes)
    return buf, alloc


def new_array(queue, shape, allocator, dtype=F32):
    """A new C-contiguous array of ``shape`` (positive ints) and ``dtype`` (a numpy dtype) from
    ``allocator`` (or the context's pool), its buffer checked."""
    shape = tuple(shape)
    size = math.prod(shape)
    buf, alloc = _buffer(queue, dtype.itemsize * size, allocator)
    strides, step = [], dtype.itemsize
    for s in reversed(shape):
        strides.append(step)
        step *= s
    # pyopencl's constructor without its checks of arbitrary shapes and dtypes (these are known good):
    # what it makes its own results and views with; a third of the time of the checked path
    return cla.Array(None, shape, dtype, allocator=alloc, data=buf, strides=tuple(reversed(strides)), _fast=True,
                     _size=size, _context=queue.context, _queue=queue)


def check_index(name, arr, queue, shape, *, below, also=None):
    """``arr`` as an op's int32 index array of ``shape``: a device array as it is (its values are the
    kernels' to check), or a numpy array whose values are checked here (each in ``[0, below)`` or
    equal to ``also``), returned as a host copy that :func:`upload_index` copies once every other
    argument is checked (a refused call enqueues nothing)."""
    if not isinstance(arr, np.ndarray):
        return check_array(name, arr, queue, shape=shape, dtype=I32)
    if arr.dtype != I32:
        raise TypeError(f"{name}: dtype must be int32, got {arr.dtype}")
    if arr.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {arr.shape}")
    bad = (arr < 0) | (arr >= below)
    if also is not None:
        bad &= arr != also
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}: {int(arr.flat[i])} at index {i} is outside [0, {below})"
                         + (f" and is not {also}" if also is not None else ""))
    return np.ascontiguousarray(arr).copy()  # the caller may change arr before the copy runs


def upload_index(queue, arr, allocator):
    """A :func:`check_index` result on the device: a host copy is copied without waiting (and held
    until then); a device array is returned as it is."""
    if not isinstance(arr, np.ndarray):
        return arr
    check_allocator(allocator)
    dev = new_array(queue, arr.shape, allocator, I32)
    evt = cl.enqueue_copy(queue, dev.base_data, arr, is_blocking=False)
    hold([evt], arr)
    dev.events = [evt]
    return dev


def index_array(name, arr, queue, shape, *, below, also=None, allocator=None):
    """:func:`check_index` then :func:`upload_index`, for a caller whose other arguments are checked."""
    return upload_index(queue, check_index(name, arr, queue, shape, below=below, also=also), allocator)


def check_sequences(queue, n, window, cu_seqlens, max_seqlen, tokens="q"):
    """(sequences, their longest length T, cu_seqlens or None) of the ``n`` tokens of argument ``tokens``:
    ``window`` equal windows, or the sequences of ``cu_seqlens`` (a numpy array, checked here, or a
    device array, with max_seqlen)."""
    if (window is None) == (cu_seqlens is None):
        raise ValueError("window: give exactly one of window and cu_seqlens")
    if window is not None:
        if max_seqlen is not None:
            raise ValueError("max_seqlen: only with cu_seqlens")
        window = positive_int("window", window)
        if n % window:
            raise ValueError(f"window: {window} does not divide the {n} tokens of {tokens}")
        return n // window, window, None
    if isinstance(cu_seqlens, np.ndarray):
        if cu_seqlens.dtype != np.int32:
            raise TypeError(f"cu_seqlens: dtype must be int32, got {cu_seqlens.dtype}")
        if cu_seqlens.ndim != 1 or cu_seqlens.size < 2:
            raise ValueError(f"cu_seqlens: expected nseq + 1 ≥ 2 offsets in one dimension, got shape {cu_seqlens.shape}")
        if cu_seqlens[0] != 0 or cu_seqlens[-1] != n:
            raise ValueError(f"cu_seqlens: must run from 0 to the {n} tokens of {tokens}, got "
                             f"{cu_seqlens[0]} … {cu_seqlens[-1]}")
        lengths = np.diff(cu_seqlens)
        if (lengths < 0).any():
            i = int(np.flatnonzero(lengths < 0)[0])
            raise ValueError(f"cu_seqlens: offsets must not decrease, got {cu_seqlens[i]} then {cu_seqlens[i + 1]}")
        longest = int(lengths.max())
        if max_seqlen is not None and positive_int("max_seqlen", max_seqlen) < longest:
            raise ValueError(f"max_seqlen: {max_seqlen} is below the longest sequence of cu_seqlens ({longest})")
        return cu_seqlens.size - 1, longest if max_seqlen is None else int(max_seqlen), cu_seqlens
    check_array("cu_seqlens", cu_seqlens, queue, ndim=1, dtype=I32)
    if cu_seqlens.size < 2:
        raise ValueError(f"cu_seqlens: expected nseq + 1 ≥ 2 offsets, got shape {cu_seqlens.shape}")
    if max_seqlen is None:
        raise ValueError("max_seqlen: required with a device cu_seqlens (its values are not read back)")
    max_seqlen = positive_int("max_seqlen", max_seqlen)
    if max_seqlen > n:
        raise ValueError(f"max_seqlen: {max_seqlen} is above the {n} tokens of {tokens}")
    return cu_seqlens.size - 1, max_seqlen, cu_seqlens


def upload_sequences(queue, cu, n, allocator):
    """``cu`` of :func:`check_sequences` on the device (a numpy one copied without waiting), or None."""
    if cu is None or isinstance(cu, cla.Array):
        return cu
    return index_array("cu_seqlens", cu, queue, cu.shape, below=n + 1, allocator=allocator)


def outputs(queue, allocator, given, inputs, in_place={}, dtype=F32):
    """An op's outputs, in order: ``given`` is ((name, array or None, shape[, dtype]), ...), of
    ``dtype`` unless the entry says; the arrays given are checked (type, dtype, shape, no overlap
    with ``inputs`` ((name, array or None), ...) or each other, see :func:`check_disjoint`), the
    others are new (:func:`new_array`)."""
    if allocator is not None:
        check_allocator(allocator)
    _calls[0] += 1
    if _calls[0] % POLL_EVERY == 0:  # a status query costs about a microsecond: not every call
        _release_completed()
    result, ptrs, n_given = [], set(), 0
    for entry in given:
        arr = entry[1]
        if arr is None:
            arr = new_array(queue, entry[2], allocator, entry[3] if len(entry) > 3 else dtype)
        else:
            check_array(entry[0], arr, queue, shape=entry[2], dtype=entry[3] if len(entry) > 3 else dtype)
            ptrs.add(arr.base_data.int_ptr)
            n_given += 1
        result.append(arr)
    if n_given:  # the common case: distinct buffers, none an input's; else check_disjoint says which pair
        if len(ptrs) == n_given:
            for _, b in inputs:
                if isinstance(b, cla.Array) and b.base_data.int_ptr in ptrs:
                    break
            else:
                return result
        check_disjoint([(entry[0], entry[1]) for entry in given], inputs, in_place)
    return result


def scratch(queue, floats, allocator):
    """A scratch buffer of ``floats`` float32s (a buffer, not an array: kernels take buffers; pass it
    to :func:`hold` with the op's arrays). What completed is released first, so a loop of one op
    reuses its scratch at once."""
    _release_completed()
    return _buffer(queue, 4 * floats, allocator)[0]


def hold(evts, *arrays):
    """Keep ``arrays`` (everything an op's kernels read or write) alive until all of ``evts`` have
    completed, so that neither a pool nor a caller who drops an array can hand its memory out while
    a kernel still uses it."""
    _held.append((evts, arrays))  # deque.append is atomic; releasing takes the lock


def _release_completed():
    """Drop the holds whose kernels have completed, oldest first, up to the first still pending."""
    if not _held:
        return
    with _pool_lock:
        while _held:
            for e in _held[0][0]:
                if e.get_info(_STATUS) > 0:  # CL_COMPLETE is 0, errors are negative
                    return
            _held.popleft()


EXIT_WAIT_S = 60.0  # the longest the exit waits: a kernel gated by a user event nobody completes never runs


@atexit.register
def wait_held(limit_s=EXIT_WAIT_S):
    """Wait for the kernels of every hold not yet released, up to ``limit_s`` seconds, then warn of
    those still pending (at exit: see the module docstring)."""
    if not _held:
        return
    for queue in {e.command_queue for evts, _ in list(_held) for e in evts}:
        queue.flush()  # submitted, so that they run while this waits
    deadline = time.monotonic() + limit_s
    while True:
        _release_completed()
        if not _held:
            return
        if time.monotonic() > deadline:
            warnings.warn(f"clops: {len(_held)} ops' kernels still pending after {limit_s:g} s at exit")
            return
        time.sleep(0.001)


def check_disjoint(given, inputs, in_place={}):
    """ValueError naming both arguments when a given output shares memory with an input or another
    output (arrays start at offset 0, so sharing a buffer is overlapping). ``given``, ``inputs``:
    ((name, array, None or a host index array (memory of its own)), ...). ``in_place``: {output
    name: names of the inputs it may be exactly} (of the same size: the kernel reads each element
    before it writes it)."""
    outs = [(n, a) for n, a in given if a is not None]
    if not outs:
        return
    ptrs = {a.base_data.int_ptr for _, a in outs}
    if len(ptrs) == len(outs):
        for _, b in inputs:
            if isinstance(b, cla.Array) and b.base_data.int_ptr in ptrs:
                break
        else:
            return  # the common case; the loop below finds the pair that shares memory
    for i, (name, a) in enumerate(outs):
        ptr = a.base_data.int_ptr
        others = [(n, b, True) for n, b in inputs] + [(n, b, False) for n, b in outs[i + 1:]]
        for other, b, is_input in others:
            if not isinstance(b, cla.Array) or b.base_data.int_ptr != ptr:
                continue
            if is_input and other in in_place.get(name, ()) and a.nbytes == b.nbytes:
                continue
            raise ValueError(f"{name}: shares memory with {other}; an output may not overlap "
                             f"{'an input' if is_input else 'another output'}")


def wait_list(wait_for, context):
    """``wait_for`` as a list: None, one ``pyopencl.Event`` or a sequence of them, all on ``context``."""
    if wait_for is None:
        return []
    if isinstance(wait_for, cl.Event):
        wait_for = [wait_for]
    elif isinstance(wait_for, (str, bytes)) or not hasattr(wait_for, "__iter__"):
        raise TypeError(f"wait_for: expected a pyopencl.Event or a sequence of them, got {type(wait_for).__name__}")
    out = list(wait_for)
    for e in out:
        if not isinstance(e, cl.Event):
            raise TypeError(f"wait_for: expected pyopencl.Events, got a {type(e).__name__} among them")
        if e.context != context:
            raise ValueError("wait_for: an event belongs to another context than the queue")
    return out


def events(wait_for, *arrays):
    """The events a launch waits on: ``wait_for`` (see :func:`wait_list`; checked against the arrays'
    context) plus those pending on the arrays it touches, each once (an op's outputs share their
    events, and every entry of a wait list costs the driver time)."""
    out = [] if wait_for is None else wait_list(wait_for, next(a.context for a in arrays if a is not None))
    seen = [id(e) for e in out]  # a list: a few entries, searched faster than a set is built
    for a in arrays:
        if a is not None:
            for e in a.events:
                if id(e) not in seen:
                    seen.append(id(e))
                    out.append(e)
    return out


def wrote(evts, *arrays):
    """``arrays``' pending events become ``evts``, the op's kernels that wrote them (each waited on
    the arrays' earlier events), so the lists stay short; returns the arrays."""
    for a in arrays:
        a.events = [*evts]
    return arrays


def positive_int(name, value, *, zero_ok=False):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{name}: must be {'≥ 0' if zero_ok else 'positive'}, got {value}")
    return int(value)


def finite_float(name, value):
    """``value`` as a float that is finite in float32 (the kernels' type)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    if not abs(value) <= FLOAT32_MAX:  # also NaN; a Python int is compared exactly, however large
        shown = Decimal(int(value)) if isinstance(value, (int, np.integer)) else value
        raise ValueError(f"{name}: must be finite in float32 (|value| ≤ {FLOAT32_MAX:.7g}), got {shown:.4g}")
    return float(value)


def flag(name, value):
    """``value`` if it is a bool: a string such as "False" would be taken as true."""
    if value is True or value is False:
        return value
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


def index_type(*sizes):
    """'uint' when every index fits 32 bits (cheaper on GPUs), else 'ulong'."""
    return "uint" if max(sizes) < 2**32 else "ulong"


def index_scalar(idx):
    """The numpy type of a kernel argument of OpenCL type ``idx`` (from :func:`index_type`)."""
    return np.uint32 if idx == "uint" else np.uint64
