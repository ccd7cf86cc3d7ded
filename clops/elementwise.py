"""Elementwise ops: SwiGLU (plain, clamped/scaled/row-weighted, column-gated),
the sigmoid output gate and add. Template: ``elementwise.cl.mako``.

Inputs and outputs share one float dtype (float32, float16 or bfloat16: storage; the math is
float32); ``gate`` and ``row_weight`` may be float32 or that dtype.

An output may be given as one of the same-shaped inputs (``out=a``: in place); it may
not overlap another input, a gathered vector (``gate``, ``row_weight``) or another output."""
from __future__ import annotations

import numpy as np
import pyopencl as cl

from .args import (F32, FLOATS, check_array, check_queue, events, finite_float, hold, index_scalar, index_type,
                   outputs, storage, wrote)
from .spec import Spec

def heuristic(dev, sc):
    """Work-group size, vector width and vectors per work item from the device's limits."""
    gpu = bool(dev.type & cl.device_type.GPU)
    return {"wg": int(min(256, dev.max_work_group_size)), "vw": 4, "ept": 4 if gpu else 8}


# One parameter set serves every elementwise op (shape class {}).
SPEC = Spec(
    "elementwise", "elementwise.cl.mako", ("wg", "vw", "ept"),
    lambda sc: {"wg": [64, 128, 256, 512, 1024], "vw": [1, 2, 4, 8], "ept": [1, 2, 4, 8, 16]},
    heuristic, rules=lambda p, sc: ((p["vw"] in (1, 2, 4, 8, 16), "vw must be 1, 2, 4, 8 or 16"),),
    render=lambda p, sc: dict(p, st="float", gst="float", row_aligned=0),  # each call passes its own
    doc="wg work-items per group, vw vector width, ept vectors per work-item")


# The inputs an output may be (in place): those read element by element, not the gathered gate / row_weight.
IN_PLACE = dict.fromkeys(("out", "da", "db"), ("a", "b", "dc"))


def _plan(queue, name, n, st, gst, width):
    """(kernel, grid, n as its index type) of elementwise kernel ``name`` over ``n`` elements (rows of
    ``width`` for a gathering kernel, else None)."""
    p = SPEC.params(queue.device, {})
    per_group = p["wg"] * p["ept"] * p["vw"]
    idx = index_type(n + per_group)
    row_aligned = int(width is not None and width % p["vw"] == 0)  # each vector within one row
    _, knl = SPEC.kernels(queue, {}, idx=idx, st=st, gst=gst, row_aligned=row_aligned)
    return knl[name], (-(-n // per_group),), index_scalar(idx)(n), index_scalar(idx)


def _launch(queue, name, outs, ins, n, scalars=(), gathers=(), wait_for=None):
    """``scalars`` end with the row width when there are ``gathers``."""
    st, gst = storage(ins[0].dtype), storage(gathers[0].dtype) if gathers else "float"
    width = scalars[-1] if gathers else None
    knl, groups, count, itype = SPEC.plan(queue, (name, n, st, gst, width), _plan, name, n, st, gst, width)
    arrays = (*outs, *ins, *gathers)
    args = [a.base_data for a in arrays]
    args.append(count)
    for s in scalars:
        args.append(itype(s) if isinstance(s, int) else np.float32(s))
    evt = knl(queue, groups, args, wait_for=events(wait_for, *arrays))
    hold([evt], *arrays)
    return wrote([evt], *outs)


def _same_shape(queue, first, **named):
    """Check the first array (a float dtype), then every other against its shape and dtype."""
    name0, a0 = first
    check_array(name0, a0, queue, dtype=FLOATS)
    for name, arr in named.items():
        check_array(name, arr, queue, shape=a0.shape, dtype=a0.dtype, like=name0)
    return a0.shape


def _gathered(name, arr, queue, a, length):
    """A gathered vector (gate, row_weight): float32 or ``a``'s dtype, of ``length``."""
    return check_array(name, arr, queue, shape=(length,), dtype=(a.dtype, F32) if a.dtype != F32 else F32)


def _binary(queue, kernel, a, b, out, wait_for, allocator):
    """``out = f(a, b)`` for a kernel of two same-shaped inputs."""
    check_queue(queue)
    shape = _same_shape(queue, ("a", a), b=b)
    (out,) = outputs(queue, allocator, [("out", out, shape)], [("a", a), ("b", b)], IN_PLACE, a.dtype)
    return _launch(queue, kernel, [out], [a, b], a.size, wait_for=wait_for)[0]


def _binary_bwd(queue, kernel, a, b, dc, da, db, wait_for, allocator):
    """``(da, db)`` of a two-input op given ``dc``."""
    check_queue(queue)
    shape = _same_shape(queue, ("a", a), b=b, dc=dc)
    da, db = outputs(queue, allocator, [("da", da, shape), ("db", db, shape)], [("a", a), ("b", b), ("dc", dc)],
                     IN_PLACE, a.dtype)
    return _launch(queue, kernel, [da, db], [a, b, dc], a.size, wait_for=wait_for)


def swiglu(queue, a, b, *, out=None, wait_for=None, allocator=None):
    """``c = silu(a)·b``."""
    return _binary(queue, "swiglu_fwd", a, b, out, wait_for, allocator)


def swiglu_bwd(queue, a, b, dc, *, da=None, db=None, wait_for=None, allocator=None):
    """``(da, db)`` of ``c = silu(a)·b`` given ``dc``."""
    return _binary_bwd(queue, "swiglu_bwd", a, b, dc, da, db, wait_for, allocator)


def swiglu_limit(queue, a, b, *, limit, scale=1.0, row_weight=None, out=None, wait_for=None, allocator=None):
    """``c = scale·rw[row]·silu(min(a, L))·clamp(b, −L, L)``; ``limit ≤ 0``: no clamp.

    ``a``, ``b``: ``[rows, width]``; ``row_weight``: ``[rows]`` or None.
    """
    check_queue(queue)
    limit, scale = finite_float("limit", limit), finite_float("scale", scale)
    check_array("a", a, queue, ndim=2, dtype=FLOATS)
    check_array("b", b, queue, shape=a.shape, dtype=a.dtype, like="a")
    if row_weight is not None:
        _gathered("row_weight", row_weight, queue, a, a.shape[0])
    (out,) = outputs(queue, allocator, [("out", out, a.shape)], [("a", a), ("b", b), ("row_weight", row_weight)],
                     IN_PLACE, a.dtype)
    if row_weight is None:
        return _launch(queue, "swiglu_limit_fwd", [out], [a, b], a.size, (limit, scale), wait_for=wait_for)[0]
    return _launch(queue, "swiglu_limit_rows_fwd", [out], [a, b], a.size, (limit, scale, a.shape[1]),
                   gathers=[row_weight], wait_for=wait_for)[0]


def _gated_checks(queue, a, gate, **same):
    check_queue(queue)
    shape = _same_shape(queue, ("a", a), **same)
    _gathered("gate", gate, queue, a, shape[-1])
    return shape


def swiglu_gated(queue, a, b, gate, *, out=None, wait_for=None, allocator=None):
    """``c = silu(a)·b·gate[col]``, ``gate`` of the last dimension's length."""
    shape = _gated_checks(queue, a, gate, b=b)
    (out,) = outputs(queue, allocator, [("out", out, shape)], [("a", a), ("b", b), ("gate", gate)], IN_PLACE,
                     a.dtype)
    return _launch(queue, "swiglu_gated_fwd", [out], [a, b], a.size, (shape[-1],), gathers=[gate],
                   wait_for=wait_for)[0]


def swiglu_gated_bwd(queue, a, b, gate, dc, *, da=None, db=None, wait_for=None, allocator=None):
    """``(da, db)`` of ``swiglu_gated`` given ``dc``."""
    shape = _gated_checks(queue, a, gate, b=b, dc=dc)
    da, db = outputs(queue, allocator, [("da", da, shape), ("db", db, shape)],
                     [("a", a), ("b", b), ("dc", dc), ("gate", gate)], IN_PLACE, a.dtype)
    return tuple(_launch(queue, "swiglu_gated_bwd", [da, db], [a, b, dc], a.size, (shape[-1],), gathers=[gate],
                         wait_for=wait_for))


def sigmoid_gate(queue, a, b, *, out=None, wait_for=None, allocator=None):
    """``c = a·σ(b)``."""
    return _binary(queue, "sigmoid_gate_fwd", a, b, out, wait_for, allocator)


def sigmoid_gate_bwd(queue, a, b, dc, *, da=None, db=None, wait_for=None, allocator=None):
    """``(da, db)`` of ``c = a·σ(b)`` given ``dc``."""
    return _binary_bwd(queue, "sigmoid_gate_bwd", a, b, dc, da, db, wait_for, allocator)


def add(queue, a, b, *, out=None, wait_for=None, allocator=None):
    """``c = a + b``."""
    return _binary(queue, "add", a, b, out, wait_for, allocator)
