"""Matrix multiplies through CLBlast's C API, by ctypes: ``gemm(queue, a, b)``.

CLBlast is a system library (Debian: ``apt install libclblast1``; elsewhere build it or point
``CLOPS_CLBLAST`` at ``libclblast.so``); no compiler is needed. It is looked for when ``gemm`` is
first called, never at import. Arrays are float32 row-major 2-D ``pyopencl.array.Array`` s as
every op takes them. CLBlast's enqueue takes no wait list, so ``gemm`` first enqueues a barrier
on ``wait_for`` and the arrays' pending events, unless the queue is in order and they are all its
own (then its order implies them). CLBlast's temporary matrices (the padded or transposed copies
its fast kernel takes) come from the op's allocator as scratch, their size asked of CLBlast once
per shape: CLBlast would otherwise create and release a buffer at every call.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import types
import weakref

import numpy as np
import pyopencl as cl

from . import program
from .program import notify
from .args import check_array, check_queue, events, finite_float, hold, outputs, scratch, wrote

_ROW_MAJOR, _NO, _YES = 101, 111, 112
# What clops.profile records of a gemm: CLBlast's own kernels are not clops', so one entry stands for them.
_SGEMM = types.SimpleNamespace(name="CLBlastSgemm", template="CLBlast", params={}, local_size=(1, 1))
_lib = {}
_lock = threading.Lock()


_stamps = weakref.WeakKeyDictionary()  # context -> a one-byte buffer


def _stamp(ctx):
    """A one-byte buffer of ``ctx``, the target of the fill that starts a profiled gemm's time."""
    with _lock:
        if ctx not in _stamps:
            _stamps[ctx] = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 1)
        return _stamps[ctx]


def library():
    """The loaded CLBlast (ctypes), or RuntimeError saying how to install it."""
    with _lock:
        if "lib" not in _lib:
            path = os.environ.get("CLOPS_CLBLAST") or ctypes.util.find_library("clblast")
            if not path:
                raise RuntimeError("clops.gemm needs CLBlast: install it (Debian/Ubuntu: apt install libclblast1) "
                                   "or set CLOPS_CLBLAST to the path of libclblast.so")
            lib = ctypes.CDLL(path)
            if not hasattr(lib, "CLBlastSgemmWithTempBuffer"):
                raise RuntimeError(f"clops.gemm needs CLBlast 1.5 or later (CLBlastSgemmWithTempBuffer); {path} "
                                   "lacks it")
            size, mem, f32, ptr = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_float, ctypes.POINTER(ctypes.c_void_p)
            lib.CLBlastSgemmWithTempBuffer.restype = lib.CLBlastSGemmTempBufferSize.restype = ctypes.c_int
            lib.CLBlastSgemmWithTempBuffer.argtypes = ([ctypes.c_int] * 3 + [size] * 3
                                                       + [f32, mem, size, size, mem, size, size, f32, mem, size, size,
                                                          ptr, ptr, mem])
            lib.CLBlastSGemmTempBufferSize.argtypes = [ctypes.c_int] * 3 + [size] * 9 + [ptr, ctypes.POINTER(size)]
            _lib["lib"] = lib
        return _lib["lib"]


def gemm(queue, a, b, *, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, out=None, wait_for=None,
         allocator=None):
    """``out = alpha·op(a)·op(b) + beta·out`` with ``op(x) = xᵀ`` when ``trans_x``: ``op(a)`` is
    ``[m, k]``, ``op(b)`` ``[k, n]``, ``out`` ``[m, n]`` (given when ``beta`` is not 0)."""
    check_queue(queue)
    check_array("a", a, queue, ndim=2)
    check_array("b", b, queue, ndim=2)
    alpha, beta = finite_float("alpha", alpha), finite_float("beta", beta)
    for name, flag_ in (("trans_a", trans_a), ("trans_b", trans_b)):
        if not isinstance(flag_, bool):
            raise TypeError(f"{name}: expected True or False, got {flag_!r}")
    m, k = a.shape[::-1] if trans_a else a.shape
    kb, n = b.shape[::-1] if trans_b else b.shape
    if kb != k:
        raise ValueError(f"b: op(b) has {kb} rows, op(a) {k} columns (a {a.shape}, b {b.shape}, "
                         f"trans_a={trans_a}, trans_b={trans_b})")
    if beta != 0.0 and out is None:
        raise ValueError("out: needed when beta is not 0 (it is added into)")
    (out,) = outputs(queue, allocator, [("out", out, (m, n))], [("a", a), ("b", b)])
    lib = _lib.get("lib") or library()  # the lock only until it is loaded
    temp_bytes = _temp_bytes(lib, queue, trans_a, trans_b, m, n, k, a.shape[1], b.shape[1])
    temp = scratch(queue, temp_bytes // 4, allocator) if temp_bytes else None
    pending = events(wait_for, a, b, out)
    if program.observers:  # profiled: a one-byte fill, whose start time is valid where a barrier's is not
        gate = [cl.enqueue_fill_buffer(queue, _stamp(queue.context), np.uint8(0), 0, 1, wait_for=pending)]
    elif pending and not _implied(queue, pending):
        gate = [cl.enqueue_barrier(queue, wait_for=pending)]
    else:
        gate = []
    evt = ctypes.c_void_p()
    status = lib.CLBlastSgemmWithTempBuffer(_ROW_MAJOR, _YES if trans_a else _NO, _YES if trans_b else _NO, m, n, k,
                                            alpha, a.data.int_ptr, 0, a.shape[1], b.data.int_ptr, 0, b.shape[1], beta,
                                            out.data.int_ptr, 0, n, ctypes.byref(ctypes.c_void_p(queue.int_ptr)),
                                            ctypes.byref(evt), temp.int_ptr if temp is not None else None)
    if status != 0:
        raise RuntimeError(f"CLBlastSgemm failed with status {status} (m={m}, n={n}, k={k})")
    done = cl.Event.from_int_ptr(evt.value, retain=False)
    if program.observers:
        notify(queue, _SGEMM, (m, n), done, start=gate[0])  # CLBlast may run several kernels: time them all
    hold([done, *gate], a, b, out, temp)
    return wrote([done], out)[0]


_OUT_OF_ORDER = cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE


def _implied(queue, evts):
    """Whether ``queue`` runs its commands in order and every one of ``evts`` is one of its commands: then
    a command enqueued now starts after them without a wait list."""
    if queue.properties & _OUT_OF_ORDER:
        return False
    own = queue.int_ptr
    for e in evts:
        q = e.command_queue  # None for a user event
        if q is None or q.int_ptr != own:
            return False
    return True


_temp_sizes = {}  # (device, trans_a, trans_b, m, n, k) -> bytes of CLBlast's temporary buffer


def _temp_bytes(lib, queue, trans_a, trans_b, m, n, k, lda, ldb):
    """The bytes of the temporary buffer CLBlast's SGEMM takes for this problem on ``queue``'s device (0: none),
    asked of CLBlast once per problem (the leading dimensions follow from it: the arrays are contiguous)."""
    key = (queue.device, trans_a, trans_b, m, n, k)
    found = _temp_sizes.get(key)
    if found is None:
        size = ctypes.c_size_t()
        status = lib.CLBlastSGemmTempBufferSize(_ROW_MAJOR, _YES if trans_a else _NO, _YES if trans_b else _NO, m, n,
                                                k, 0, lda, 0, ldb, 0, n, ctypes.byref(ctypes.c_void_p(queue.int_ptr)),
                                                ctypes.byref(size))
        if status != 0:
            raise RuntimeError(f"CLBlastSGemmTempBufferSize failed with status {status} (m={m}, n={n}, k={k})")
        found = _temp_sizes[key] = size.value
    return found
