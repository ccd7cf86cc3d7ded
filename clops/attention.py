"""Causal grouped-query attention inside windows: forward (and, below it, the backward).

Layout: q ``[n, nh, hd]``, k and v ``[n, nkv, hd]``, float32, C-contiguous;
``n = windows · window`` tokens, attention never crosses a window and
positions restart at 0 in each; key j is seen by query i of the same window
iff ``j ≤ i``; query head h reads kv head ``h // (nh / nkv)``.

Forward op name in the tuning database: ``"attention_fwd"``, shape class
``{"hd": hd}``. Template ``attention_fwd.cl.mako``. Its parameters:

- ``bq``: query rows per work-group; a multiple of ``rq``.
- ``rq``: query rows per work-item (its register tile has ``rq`` rows of scores
  and of the output); ``bq / rq`` work-items share the rows of a group.
- ``tx``: work-items across keys (scores) and across head-dim columns (output);
  the work-group has ``tx · bq / rq`` work-items.
- ``bk``: keys per key block (the online-softmax step); a multiple of ``tx``
  (each work-item scores ``bk / tx`` keys per row) and of ``kc``.
- ``vw``: vector width (1, 2 or 4) of loads and of the output columns a work-item
  owns; divides ``dc``. The head dim is padded to a multiple of ``tx · vw`` in the
  output tile (padding is zero and never stored).
- ``dc``: head-dim chunk of Q and K staged in local memory per step of Q·Kᵀ;
  a multiple of ``vw``.
- ``kc``: keys of V staged in local memory per step of P·V; divides ``bk``.

Local memory: ``4·(max((bq + bk)·(dc + vw), kc·(hdp + vw)) + bk·(bq + 4) + bq·tx)``
bytes, ``hdp`` the padded head dim. A parameter set that breaks a rule or does
not fit the device raises :class:`clops.LimitError` (a ValueError).
"""
from __future__ import annotations

import math

import numpy as np
import pyopencl as cl

from . import tuning
from .args import check_array, check_queue, events, finite_float, index_type, output, positive_int
from .program import LimitError, kernels

FWD_TEMPLATE = "attention_fwd.cl.mako"
MAX_HD = 256
LOG2E = 1.4426950408889634


def _check_geometry(queue, q, k, v, window):
    """(n, nh, nkv, hd, windows) of a valid attention call; raises naming the argument otherwise."""
    check_queue(queue)
    window = positive_int("window", window)
    check_array("q", q, queue, ndim=3)
    n, nh, hd = q.shape
    check_array("k", k, queue, ndim=3)
    if k.shape[0] != n or k.shape[2] != hd:
        raise ValueError(f"k: expected shape ({n}, nkv, {hd}) to match q {q.shape}, got {k.shape}")
    nkv = k.shape[1]
    check_array("v", v, queue, shape=k.shape)
    if nh % nkv:
        raise ValueError(f"k: nh ({nh}, from q) must be a multiple of nkv ({nkv}, from k)")
    if hd % 8 or hd > MAX_HD:
        raise ValueError(f"q: head dim {hd} unsupported (multiples of 8 from 8 to {MAX_HD})")
    if n % window:
        raise ValueError(f"window: {window} does not divide the {n} tokens of q")
    return n, nh, nkv, hd, n // window


def _scale(scale, hd):
    """The score scale: ``scale`` checked, or 1/sqrt(hd)."""
    return 1.0 / math.sqrt(hd) if scale is None else finite_float("scale", scale)


def fwd_heuristic(dev, hd):
    """Forward tiles from the device's limits: a 4-row × (bk/tx)-key score tile per work-item."""
    gpu = bool(dev.type & cl.device_type.GPU)
    if not gpu:
        return {"bq": 16, "rq": 4, "tx": 4, "bk": 16, "vw": 4, "dc": 32, "kc": 16}
    tx = 16 if hd > 128 else 8
    p = {"bq": 64, "rq": 4, "tx": tx, "bk": 64, "vw": 4, "dc": 32, "kc": 16}
    while _fwd_local_bytes(hd, p) > dev.local_mem_size and p["kc"] > 4:
        p["kc"] //= 2
    if _fwd_wg(p) > dev.max_work_group_size:
        p = dict(p, bq=p["bq"] // 2, bk=p["bk"] // 2)
    return p


def _fwd_hdp(hd, p):
    step = p["tx"] * p["vw"]
    return -(-hd // step) * step


def _fwd_wg(p):
    return p["tx"] * (p["bq"] // p["rq"])


def _fwd_local_bytes(hd, p):
    bq, bk, dc, vw, kc, tx = p["bq"], p["bk"], p["dc"], p["vw"], p["kc"], p["tx"]
    return 4 * (max((bq + bk) * (dc + vw), kc * (_fwd_hdp(hd, p) + vw)) + bk * (bq + 4) + bq * tx)


def fwd_params(dev, hd):
    """Checked forward parameters for ``dev`` and head dim ``hd`` (database, else heuristic)."""
    p = tuning.choose(dev, "attention_fwd", {"hd": hd}, lambda: fwd_heuristic(dev, hd))
    names = ("bq", "rq", "tx", "bk", "vw", "dc", "kc")
    if sorted(p) != sorted(names) or not all(isinstance(p[x], int) and p[x] > 0 for x in names):
        raise LimitError(f"attention_fwd hd={hd}: parameters must be positive ints named {names}, got {p}")
    rules = (
        (p["vw"] in (1, 2, 4), "vw must be 1, 2 or 4"),
        (p["bq"] % p["rq"] == 0, "bq must be a multiple of rq"),
        (p["bk"] % p["tx"] == 0, "bk must be a multiple of tx"),
        (p["bk"] % p["kc"] == 0, "kc must divide bk"),
        (p["dc"] % p["vw"] == 0, "dc must be a multiple of vw"),
    )
    for ok, rule in rules:
        if not ok:
            raise LimitError(f"attention_fwd hd={hd} {p}: {rule}")
    if _fwd_wg(p) > dev.max_work_group_size:
        raise LimitError(f"attention_fwd hd={hd} {p}: {_fwd_wg(p)} work-items (tx·bq/rq) exceed the device's "
                         f"CL_DEVICE_MAX_WORK_GROUP_SIZE ({dev.max_work_group_size})")
    need = _fwd_local_bytes(hd, p)
    if need > dev.local_mem_size:
        raise LimitError(f"attention_fwd hd={hd} {p}: needs {need} bytes of local memory, "
                         f"CL_DEVICE_LOCAL_MEM_SIZE is {dev.local_mem_size}")
    return p


def attention(queue, q, k, v, *, window, scale=None, out=None, lse=None, wait_for=None, allocator=None):
    """``(o [n, nh, hd], lse [n, nh])``: causal softmax attention inside each window.

    ``lse`` is the natural log-sum-exp of the scaled scores of each (row, head).
    """
    n, nh, nkv, hd, windows = _check_geometry(queue, q, k, v, window)
    scale = _scale(scale, hd)
    p = fwd_params(queue.device, hd)
    out = output("out", out, queue, (n, nh, hd), allocator)
    lse = output("lse", lse, queue, (n, nh), allocator)
    idx = index_type(n * nh * hd)
    knl = kernels(queue, FWD_TEMPLATE, dict(p, hd=hd, idx=idx), work_group_size=_fwd_wg(p))["attention_fwd"]
    nqb = -(-window // p["bq"])
    args = [q.data, k.data, v.data, out.data, lse.data, np.uint32(window), np.uint32(nh), np.uint32(nh // nkv),
            np.float32(scale * LOG2E)]
    evt = knl(queue, (nh, windows, nqb), args, wait_for=events(wait_for, q, k, v, out, lse))
    out.add_event(evt)
    lse.add_event(evt)
    return out, lse
