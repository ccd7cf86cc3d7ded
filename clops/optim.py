"""AdamW, in place: ``adamw(queue, p, g, m, v, *, lr, step, ...)``. Template: ``adamw.cl.mako``.

torch.optim.AdamW's formula (bias correction, decoupled weight decay; ``step`` counts from 1)
on float32 master state ``p``, ``m``, ``v`` and the gradient ``g`` (float32, float16 or bfloat16:
widened to float32), all of one shape. ``p_half=`` (float16 or bfloat16, of that shape) gets the
updated ``p`` rounded once to its dtype: the model's 16-bit weights, written in the same pass.
The update reads each element before it writes it; ``p``, ``m``, ``v``, ``g`` and ``p_half``
must be distinct arrays. Tuning: op ``"adamw"``, shape class ``{}``, parameters as the elementwise
family's (``wg``, ``vw``, ``ept``).
"""
from __future__ import annotations

import math

import numpy as np

from . import elementwise
from .args import (FLOATS, check_array, check_disjoint, check_queue, events, finite_float, hold, index_scalar,
                   index_type, positive_int, storage, wrote)
from .spec import Spec

SPEC = Spec("adamw", "adamw.cl.mako", ("wg", "vw", "ept"),
            lambda sc: {"wg": [64, 128, 256, 512], "vw": [1, 2, 4], "ept": [1, 2, 4, 8]},
            elementwise.heuristic, rules=elementwise.SPEC.rules,
            render=lambda p, sc: dict(p, gst="float", pst=None),  # g's and p_half's storage: each call passes its own
            doc="adamw: wg work-items per group, vw vector width, ept vectors per work-item")


def _unit(name, value, *, closed_top=False):
    value = finite_float(name, value)
    if not (0.0 <= value <= 1.0 if closed_top else 0.0 <= value < 1.0):
        raise ValueError(f"{name}: must be in [0, 1{']' if closed_top else ')'}, got {value}")
    return value


def adamw(queue, p, g, m, v, *, lr, step, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, p_half=None,
          wait_for=None):
    """One AdamW step on ``p`` with gradient ``g``, moments ``m`` and ``v``, all updated in place
    (and ``p``'s 16-bit copy written into ``p_half`` when given); returns ``(p, m, v)``."""
    check_queue(queue)
    lr, eps, weight_decay = (finite_float(k, x) for k, x in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)))
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if value < 0:
            raise ValueError(f"{name}: must be ≥ 0, got {value}")
    beta1, beta2 = _unit("beta1", beta1), _unit("beta2", beta2)
    step = positive_int("step", step)
    check_array("p", p, queue)
    check_array("g", g, queue, shape=p.shape, dtype=FLOATS)
    for name, arr in (("m", m), ("v", v)):
        check_array(name, arr, queue, shape=p.shape)
    if p_half is not None:
        check_array("p_half", p_half, queue, shape=p.shape, dtype=FLOATS[1:])
    check_disjoint([("p", p), ("m", m), ("v", v), ("p_half", p_half)], [("g", g)])
    pr = SPEC.params(queue.device, {})
    n = p.size
    idx = index_type(n + pr["wg"] * pr["ept"] * pr["vw"])
    pst = None if p_half is None else storage(p_half.dtype)
    _, knl = SPEC.kernels(queue, {}, idx=idx, gst=storage(g.dtype), pst=pst)
    bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    scalars = [index_scalar(idx)(n)] + [np.float32(x) for x in (1.0 - lr * weight_decay, 1.0 - beta1, beta2,
                                                                 1.0 - beta2, lr / bc1, math.sqrt(bc2), eps)]
    bufs = [p.base_data, m.base_data, v.base_data, g.base_data] + ([p_half.base_data] if p_half is not None else [])
    evt = knl["adamw"](queue, (-(-n // (pr["wg"] * pr["ept"] * pr["vw"])),), bufs + scalars,
                       wait_for=events(wait_for, p, m, v, g, p_half))
    hold([evt], p, m, v, g, p_half)
    if p_half is not None:
        wrote([evt], p_half)
    return wrote([evt], p, m, v)
