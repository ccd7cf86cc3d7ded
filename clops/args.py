"""Argument checks and output allocation shared by every op.

Every check runs before anything is enqueued and names the argument.
"""
from __future__ import annotations

from decimal import Decimal

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

# Profilers register here (clops.profile) to count host-side work; empty, counting costs one dict check.
host_observers = {}
FLOAT32_MAX = float(np.finfo(np.float32).max)


def note(queue, what, amount=1):
    """Tell profilers that clops did ``amount`` of ``what`` (e.g. "buffers", "buffer_bytes") on ``queue``."""
    for observe in list(host_observers.values()):
        observe(queue, what, amount)


def check_queue(queue):
    if not isinstance(queue, cl.CommandQueue):
        raise TypeError(f"queue: expected a pyopencl.CommandQueue, got {type(queue).__name__}")


def check_array(name, arr, queue, shape=None, ndim=None):
    """Require a C-contiguous float32 ``pyopencl.array.Array`` on ``queue``'s context, zero offset."""
    if not isinstance(arr, cla.Array):
        raise TypeError(f"{name}: expected a pyopencl.array.Array, got {type(arr).__name__}")
    if arr.dtype != np.float32:
        raise TypeError(f"{name}: dtype must be float32, got {arr.dtype}")
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
    return arr


def output(name, given, queue, shape, allocator):
    """``given`` checked against ``shape``, or a new float32 array from ``allocator``."""
    if given is None:
        arr = cla.empty(queue, tuple(shape), np.float32, allocator=allocator)
        if host_observers:
            note(queue, "buffers")
            note(queue, "buffer_bytes", arr.nbytes)
        return arr
    return check_array(name, given, queue, shape=shape)


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
    context) plus those pending on the arrays it touches."""
    out = wait_list(wait_for, next(a.context for a in arrays if a is not None))
    for a in arrays:
        if a is not None:
            out.extend(a.events)
    return out


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
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


def index_type(*sizes):
    """'uint' when every index fits 32 bits (cheaper on GPUs), else 'ulong'."""
    return "uint" if max(sizes) < 2**32 else "ulong"


def index_scalar(idx):
    """The numpy type of a kernel argument of OpenCL type ``idx`` (from :func:`index_type`)."""
    return np.uint32 if idx == "uint" else np.uint64
