"""Elementwise ops: SwiGLU (plain, clamped/scaled/row-weighted, column-gated),
the sigmoid output gate and add. Template: ``elementwise.cl.mako``."""
from __future__ import annotations

import numpy as np
import pyopencl as cl

from . import tuning
from .args import check_array, check_queue, events, finite_float, index_scalar, index_type, output
from .program import kernels

TEMPLATE = "elementwise.cl.mako"


def heuristic_params(dev):
    """Work-group size, vector width and vectors per work item from the device's limits."""
    gpu = bool(dev.type & cl.device_type.GPU)
    return {"wg": int(min(256, dev.max_work_group_size)), "vw": 4, "ept": 4 if gpu else 8}


def params_for(dev):
    return tuning.choose(dev, "elementwise", {}, lambda: heuristic_params(dev))


def _launch(queue, name, outs, ins, n, scalars=(), gathers=(), wait_for=None):
    p = params_for(queue.device)
    per_group = p["wg"] * p["ept"] * p["vw"]
    idx = index_type(n + per_group)
    knl = kernels(queue, TEMPLATE, dict(p, idx=idx), work_group_size=p["wg"])[name]
    itype = index_scalar(idx)
    args = [a.data for a in (*outs, *ins, *gathers)] + [itype(n)]
    args += [itype(s) if isinstance(s, int) else np.float32(s) for s in scalars]
    evt = knl(queue, (-(-n // per_group),), args, wait_for=events(wait_for, *outs, *ins, *gathers))
    for a in outs:
        a.add_event(evt)
    return outs


def _same_shape(queue, first, **named):
    """Check the first array, then every other against its shape."""
    name0, a0 = first
    check_array(name0, a0, queue)
    for name, arr in named.items():
        check_array(name, arr, queue, shape=a0.shape)
    return a0.shape


def _binary(queue, kernel, a, b, out, wait_for, allocator):
    """``out = f(a, b)`` for a kernel of two same-shaped inputs."""
    check_queue(queue)
    shape = _same_shape(queue, ("a", a), b=b)
    out = output("out", out, queue, shape, allocator)
    return _launch(queue, kernel, [out], [a, b], a.size, wait_for=wait_for)[0]


def _binary_bwd(queue, kernel, a, b, dc, da, db, wait_for, allocator):
    """``(da, db)`` of a two-input op given ``dc``."""
    check_queue(queue)
    shape = _same_shape(queue, ("a", a), b=b, dc=dc)
    da, db = output("da", da, queue, shape, allocator), output("db", db, queue, shape, allocator)
    return tuple(_launch(queue, kernel, [da, db], [a, b, dc], a.size, wait_for=wait_for))


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
    check_array("a", a, queue, ndim=2)
    check_array("b", b, queue, shape=a.shape)
    if row_weight is not None:
        check_array("row_weight", row_weight, queue, shape=(a.shape[0],))
    out = output("out", out, queue, a.shape, allocator)
    if row_weight is None:
        return _launch(queue, "swiglu_limit_fwd", [out], [a, b], a.size, (limit, scale), wait_for=wait_for)[0]
    return _launch(queue, "swiglu_limit_rows_fwd", [out], [a, b], a.size, (limit, scale, a.shape[1]),
                   gathers=[row_weight], wait_for=wait_for)[0]


def _gated_checks(queue, a, gate, **same):
    check_queue(queue)
    shape = _same_shape(queue, ("a", a), **same)
    check_array("gate", gate, queue, shape=(shape[-1],))
    return shape


def swiglu_gated(queue, a, b, gate, *, out=None, wait_for=None, allocator=None):
    """``c = silu(a)·b·gate[col]``, ``gate`` of the last dimension's length."""
    shape = _gated_checks(queue, a, gate, b=b)
    out = output("out", out, queue, shape, allocator)
    return _launch(queue, "swiglu_gated_fwd", [out], [a, b], a.size, (shape[-1],), gathers=[gate],
                   wait_for=wait_for)[0]


def swiglu_gated_bwd(queue, a, b, gate, dc, *, da=None, db=None, wait_for=None, allocator=None):
    """``(da, db)`` of ``swiglu_gated`` given ``dc``."""
    shape = _gated_checks(queue, a, gate, b=b, dc=dc)
    da, db = output("da", da, queue, shape, allocator), output("db", db, queue, shape, allocator)
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
