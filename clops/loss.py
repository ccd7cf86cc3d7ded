"""Cross-entropy over a vocabulary: per-row loss and log-sum-exp, and the logits' gradient.
Template: ``cross_entropy.cl.mako``.

``logits [n, vocab]`` float32, float16 or bfloat16 (storage: the math is float32), ``targets [n]``
int32 (a device array, or a numpy array that is checked on the host and copied without waiting);
``loss`` and ``lse`` float32 ``[n]`` always, ``dlogits`` of the logits' dtype. One pass
over each row (an online max and sum), any vocab size. ``label_smoothing`` as
``torch.nn.functional.cross_entropy`` defines it; ``softcap=c`` replaces each logit x by
``c·tanh(x/c)`` first. A logit of −∞ (a masked token) adds nothing. Rows whose target is
``ignore_index`` have loss 0 and gradient 0 (lse is still theirs); a target outside
``[0, vocab)`` from the host is refused, from the device gives that row loss NaN and gradient 0.
No reduction: the caller sums or averages ``loss`` (and scales ``dloss`` to match).

Tuning: op ``"cross_entropy"`` (the forward), shape class ``{}``, parameters ``wg``, work-items per
row, and ``unroll``, the 16-byte vectors each work-item loads per step before their arithmetic; op
``"cross_entropy_bwd"``, shape class ``{"st": storage type}``, parameters ``wg``, work-items per
group, and ``ept``, the 16-byte vectors of a row each work-item loads (all before it stores), so
that a row takes ⌈(vocab / vector) / (wg·ept)⌉ groups.
"""
from __future__ import annotations

import numpy as np
import pyopencl as cl

from .args import (FLOATS, check_array, check_index, check_queue, events, finite_float, hold, index_type,
                   outputs, storage, upload_index, wrote)
from .spec import Spec


def heuristic(dev, sc):
    gpu = bool(dev.type & cl.device_type.GPU)
    # GPU: 32 bytes in flight per work-item (a memory-bound row needs them to cover the latency)
    return {"wg": int(min(256 if gpu else 64, dev.max_work_group_size)), "unroll": 2 if gpu else 1}


def heuristic_bwd(dev, sc):
    gpu = bool(dev.type & cl.device_type.GPU)
    # 64 bytes read per work-item before its first store; short-lived groups, as an elementwise op's
    return {"wg": int(min(256 if gpu else 64, dev.max_work_group_size)), "ept": 4}


SPEC = Spec("cross_entropy", "cross_entropy.cl.mako", ("wg", "unroll"),
            lambda sc: {"wg": [32, 64, 128, 256, 512, 1024], "unroll": [1, 2, 4]},
            heuristic, local_bytes=lambda p, sc: 12 * p["wg"],
            # the logits' storage type and whether the forward sums z: each call passes its own
            render=lambda p, sc: dict(p, kind="fwd", st="float", smooth=1),
            doc="cross_entropy: wg work-items per row, unroll 16-byte vectors per work-item per step")
BWD = Spec("cross_entropy_bwd", "cross_entropy.cl.mako", ("wg", "ept"),
           lambda sc: {"wg": [64, 128, 256, 512, 1024], "ept": [1, 2, 4, 8]},
           heuristic_bwd, render=lambda p, sc: dict(p, kind="bwd", st=sc["st"], smooth=1),
           doc="cross_entropy_bwd at storage st: wg work-items per group, ept 16-byte vectors per work-item")


def _scalars(ignore_index, label_smoothing, softcap):
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")
    if not -2**31 <= ignore_index < 2**31:
        raise ValueError(f"ignore_index: must fit int32, got {ignore_index}")
    smoothing = finite_float("label_smoothing", label_smoothing)
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"label_smoothing: must be in [0, 1], got {smoothing}")
    cap = 0.0 if softcap is None else finite_float("softcap", softcap)
    if softcap is not None and cap <= 0:
        raise ValueError(f"softcap: must be positive, got {cap}")
    return int(ignore_index), smoothing, cap


def _geometry(queue, logits, targets, ignore_index):
    check_queue(queue)
    check_array("logits", logits, queue, ndim=2, dtype=FLOATS)
    n, vocab = logits.shape
    if vocab >= 2**31:
        raise ValueError(f"logits: a vocab of {vocab} does not fit the int32 targets")
    # a host array is copied once every argument is checked (upload_index after outputs)
    return n, vocab, check_index("targets", targets, queue, (n,), below=vocab, also=ignore_index)


def _kernel(queue, spec, sc, name, logits, cap, smoothing):
    p, knl = spec.kernels(queue, sc, cap=int(cap > 0), smooth=int(smoothing > 0), idx=index_type(logits.size),
                          st=storage(logits.dtype))
    return p, knl[name]


def cross_entropy(queue, logits, targets, *, ignore_index=-100, label_smoothing=0.0, softcap=None, loss=None,
                  lse=None, wait_for=None, allocator=None):
    """``(loss [n], lse [n])`` of ``logits [n, vocab]`` against ``targets [n]`` (see the module docstring)."""
    ignore_index, smoothing, cap = _scalars(ignore_index, label_smoothing, softcap)
    n, vocab, targets = _geometry(queue, logits, targets, ignore_index)
    loss, lse = outputs(queue, allocator, [("loss", loss, (n,)), ("lse", lse, (n,))],
                        [("logits", logits), ("targets", targets)])
    targets = upload_index(queue, targets, allocator)
    _, knl = _kernel(queue, SPEC, {}, "cross_entropy_fwd", logits, cap, smoothing)
    evt = knl(queue, (n,), [loss.base_data, lse.base_data, logits.base_data, targets.base_data, np.uint32(vocab), np.int32(ignore_index),
                            np.float32(smoothing), np.float32(cap)],
              wait_for=events(wait_for, loss, lse, logits, targets))
    hold([evt], loss, lse, logits, targets)
    return wrote([evt], loss, lse)


def cross_entropy_bwd(queue, logits, targets, lse, dloss, *, ignore_index=-100, label_smoothing=0.0, softcap=None,
                      dlogits=None, wait_for=None, allocator=None):
    """``dlogits [n, vocab]``: the gradient of ``loss`` (given ``dloss [n]``) with respect to the logits.

    ``dlogits=logits`` is allowed: the gradient overwrites the logits (no second copy of them).
    """
    ignore_index, smoothing, cap = _scalars(ignore_index, label_smoothing, softcap)
    n, vocab, targets = _geometry(queue, logits, targets, ignore_index)
    check_array("lse", lse, queue, shape=(n,))
    check_array("dloss", dloss, queue, shape=(n,))
    (dlogits,) = outputs(queue, allocator, [("dlogits", dlogits, (n, vocab))],
                         [("logits", logits), ("targets", targets), ("lse", lse), ("dloss", dloss)],
                         in_place={"dlogits": ("logits",)}, dtype=logits.dtype)
    targets = upload_index(queue, targets, allocator)
    st = storage(logits.dtype)
    p, knl = _kernel(queue, BWD, {"st": st}, "cross_entropy_bwd", logits, cap, smoothing)
    vw = 4 if st == "float" else 8  # 16 bytes
    chunks = max(1, -(-(vocab // vw) // (p["wg"] * p["ept"])))  # a row's whole vectors are fewer than vocab / vw
    evt = knl(queue, (n * chunks,), [dlogits.base_data, logits.base_data, targets.base_data, lse.base_data, dloss.base_data,
                                     np.uint32(vocab), np.uint32(chunks), np.int32(ignore_index), np.float32(smoothing),
                                     np.float32(cap)],
              wait_for=events(wait_for, dlogits, logits, targets, lse, dloss))
    hold([evt], dlogits, logits, targets, lse, dloss)
    return wrote([evt], dlogits)[0]

