"""``python -m clops tune``: template-parameter sweeps into the tuning database.

For one op (its name in the tuning database) and shape class, each configuration
of the family's parameter lists (ordered; the first list varies slowest) that
passes the family's restrictions is set through ``clops.tuning.override`` and run
through the public op, so the sweep never reaches into a kernel:

1. the op's outputs are checked against ``clops.reference`` (float64) — on the
   timed problem, or with ``--check-small`` on the family's small problem of the
   same shape class, which is much faster for full-size memory-bound problems and
   attention (the reference is computed once, before the budget counts); a
   wrong result is reported and skipped, and so is a configuration the op rejects or
   that fails to build or launch (LimitError, ValueError, BuildError, OpenCL
   errors), each with its reason;
2. the op is timed from profiling events: warm-up calls, then ``--runs`` (≥ 7)
   calls, each the sum of its kernels' device times (a family may time only
   some of them); the median is kept, with GB/s (bytes read + written) or TFLOP/s.

Every result is written to a JSON file as soon as it is known, so an
interrupted sweep resumes where it stopped. The file's header names the device,
driver, template hash (of the family's template files' text), problem size and
parameter names; resuming against another device, driver or template is
refused. Each run also times the op's current configuration (database or
heuristic, no override); ``--save`` writes the fastest correct configuration
into the user tuning database when it beats that one, so a short sweep cannot
replace a better default. ``--plot`` draws the sweep (matplotlib, when installed).

A family is one :class:`Family` entry in :data:`FAMILIES`.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pyopencl.tools as cl_tools

import clops

from . import attn, elementwise, embed, loss, mma, norm, optim, qk_rope, runtime, tuning
from . import reference as ref
from .args import storage_dtype
from .profile import Profile, measure
from .program import KERNEL_DIR
from .spec import Spec

MIN_RUNS = 7
# The parity tolerances (relative L2 against float64): forward, attention forward (lse: FWD), backward.
FWD, ATTENTION, BWD = 1e-6, 1e-5, 1e-5


def _storage_tol(st, tol):
    """``tol`` at float32 storage; at 16 bits the relative L2 of the outputs' one rounding (about 2⁻⁹)."""
    return tol if st == "float" else 1e-2


@dataclasses.dataclass
class Case:
    """One problem ready to run: ``call()`` enqueues the op and returns its outputs in the order of ``want``."""

    call: object
    reference: object  # () -> the float64 outputs (computed when first needed, then kept as ``want``)
    tol: tuple  # relative L2 tolerance of each output
    unit: str  # "GB/s" or "TFLOP/s"
    work: float  # bytes read + written, or FLOPs, per call

    @functools.cached_property
    def want(self):
        return self.reference()


@dataclasses.dataclass
class Family:
    """A sweep of one kernel family: its spec (parameters, candidates, rules; the op's own) and the
    problem a sweep times."""

    spec: Spec
    shape_class: dict  # default shape class; --class overrides
    problem: object  # problem(shape_class, small) -> {size name: int}
    prepare: object  # prepare(queue, shape_class, problem) -> Case
    doc: str
    kernels: tuple = ()  # kernels timed (empty: all the op enqueues)

    @property
    def op(self):
        return self.spec.op

    @property
    def templates(self):  # the template files whose text (and includes) the results depend on
        return (self.spec.template,)

    def space(self, sc):
        return self.spec.space(sc)

    def reject(self, p, dev, sc):
        """The rule of the spec that ``p`` breaks (its text), or None."""
        broken = self.spec.violation(dev, sc, p)
        return broken and broken[0]


def _pool(queue):
    return cl_tools.MemoryPool(cl_tools.ImmediateAllocator(queue))


def _upload(queue, *arrays):
    return [cla.to_device(queue, a) for a in arrays]


def _nbytes(*shapes):
    return 4 * sum(int(np.prod(s)) for s in shapes)


# ---- elementwise: swiglu forward + backward stand in for the family (one parameter set) ----

def _elementwise(queue, sc, pb):
    shape = (pb["rows"], pb["width"])
    a, b, dc = ref.rnd(shape, 1, 4.0), ref.rnd(shape, 2, 2.0), ref.rnd(shape, 3, 1.0)
    da, db, ddc = _upload(queue, a, b, dc)
    pool = _pool(queue)

    def call():
        return (clops.swiglu(queue, da, db, allocator=pool), *clops.swiglu_bwd(queue, da, db, ddc, allocator=pool))

    return Case(call, lambda: (ref.swiglu(a, b), *ref.swiglu_bwd(a, b, dc)), (FWD, BWD, BWD), "GB/s",
                _nbytes(*[shape] * 8))


# ---- RMSNorm rows (forward + backward) and the gain gradient ----

def _norm_data(queue, pb, d, st="float"):
    """x and dy [rows, d] of storage ``st``, a float32 gain w [d]: host and device copies."""
    n, dtype = pb["rows"], storage_dtype(st)
    x, w, dy = ref.rnd((n, d), 1, 2.0).astype(dtype), ref.rnd(d, 2, 1.0), ref.rnd((n, d), 3, 1.0).astype(dtype)
    return (x, w, dy), _upload(queue, x, w, dy)


def _inv(queue, x, w):
    """inv of the rows of ``x`` (the float64 reference's, rounded to float32): host and device copies."""
    inv = ref.rms_norm(x, w)[1].astype(np.float32)
    return inv, _upload(queue, inv)[0]


def _rms_norm(queue, sc, pb):
    """rms_norm, x of storage ``sc["st"]``; the work counted is the bytes moved."""
    d, st = sc["d"], sc["st"]
    (x, w, _), (dx_, dw_, _) = _norm_data(queue, pb, d, st)
    pool = _pool(queue)
    return Case(lambda: clops.rms_norm(queue, dx_, dw_, allocator=pool), lambda: ref.rms_norm(x, w),
                (_storage_tol(st, FWD), FWD), "GB/s", 2 * x.nbytes + _nbytes((d,), (pb["rows"],)))  # x, y; w, inv


def _rms_norm_bwd(queue, sc, pb):
    """rms_norm_bwd without the gain gradient, x and dy of storage ``sc["st"]``."""
    d, st = sc["d"], sc["st"]
    (x, w, dy), (dx_, dw_, ddy) = _norm_data(queue, pb, d, st)
    inv, dinv = _inv(queue, x, w)
    pool = _pool(queue)
    return Case(lambda: (clops.rms_norm_bwd(queue, dx_, dw_, dinv, ddy, allocator=pool),),
                lambda: (ref.rms_norm_bwd(x, w, inv, dy),), (_storage_tol(st, BWD),), "GB/s",
                3 * x.nbytes + _nbytes((d,), (pb["rows"],)))  # x, dy, dx; w, inv


def _rms_norm_dw(queue, sc, pb):
    d, n = sc["d"], pb["rows"]
    (x, w, dy), (dx_, _, ddy) = _norm_data(queue, pb, d, sc["st"])
    inv, dinv = _inv(queue, x, w)
    pool = _pool(queue)
    return Case(lambda: (clops.rms_norm_dw(queue, dx_, dinv, ddy, allocator=pool),),
                lambda: (ref.rms_norm_dw(x, inv, dy),), (BWD,), "GB/s", 2 * x.nbytes + _nbytes((n,), (d,)))


def _one_pass(resid, queue, sc, pb):
    """The one-pass backward: rms_norm_bwd with the gain gradient, or with ``resid`` add_rms_norm_bwd (the
    same pass with ds read and added)."""
    d, n, st = sc["d"], pb["rows"], sc["st"]
    (x, w, dy), (dx_, dw_, ddy) = _norm_data(queue, pb, d, st)
    inv, dinv = _inv(queue, x, w)
    pool = _pool(queue)
    if resid:
        r = ref.rnd((n, d), 4, 1.0).astype(x.dtype)
        (dr,) = _upload(queue, r)
        ds = r.astype(np.float64)
        call = lambda: clops.add_rms_norm_bwd(queue, dx_, dw_, dinv, ddy, dr, allocator=pool)
    else:
        ds = 0.0
        call = lambda: clops.rms_norm_bwd(queue, dx_, dw_, dinv, ddy, want_dw=True, allocator=pool)
    return Case(call, lambda: (ds + ref.rms_norm_bwd(x, w, inv, dy), ref.rms_norm_dw(x, inv, dy)),
                (_storage_tol(st, BWD), BWD), "GB/s",
                (3 + resid) * x.nbytes + _nbytes((d,), (n,), (d,)))  # x, dy, dx (and ds); w, inv, dw


# ---- attention: forward, and the backward's two kernels (each swept through attention_bwd) ----

def attention_flops(windows, window, nh, hd):
    """Forward FLOPs of causal attention: two matrix products (S = QKᵀ, O = PV), the causal half counted."""
    return 4 * windows * nh * window * window * hd / 2


def _attention_data(pb, hd):
    n = pb["windows"] * pb["window"]
    q = ref.rnd((n, pb["nh"], hd), 1, 1.0)
    k, v = ref.rnd((n, pb["nkv"], hd), 2, 1.0), ref.rnd((n, pb["nkv"], hd), 3, 1.0)
    return q, k, v


def _attention_fwd(queue, sc, pb):
    q, k, v = _attention_data(pb, sc["hd"])
    dq, dk, dv = _upload(queue, q, k, v)
    pool = _pool(queue)
    return Case(lambda: clops.attention(queue, dq, dk, dv, window=pb["window"], allocator=pool),
                lambda: ref.attention(q, k, v, window=pb["window"]), (ATTENTION, FWD), "TFLOP/s",
                attention_flops(pb["windows"], pb["window"], pb["nh"], sc["hd"]))


def _mma_mode(queue, sc, taken):
    """The CLOPS_MMA mode that runs the tile products ``sc["product"]``, checked with ``taken(queue, st)``
    (clops.mma.forward_product or backward_product) on this device."""
    mode = "fma" if sc["product"] == "fma" else "1"
    with mma.using(mode):
        product, reason = taken(queue, sc["st"])
    if product != sc["product"]:
        raise ValueError(f"--class product={sc['product']}: at st={sc['st']} this device takes "
                         f"{product or 'the portable kernels'} ({reason}); product=fma runs anywhere")
    return mode


def _attention_fwd_mma(queue, sc, pb):
    """The forward on the matrix-unit driver with the tile products ``sc["product"]`` at storage
    ``sc["st"]`` (16-bit results: the relative L2 of their one rounding allowed, about 2⁻⁹)."""
    mode = _mma_mode(queue, sc, mma.forward_product)
    q, k, v = (x.astype(storage_dtype(sc["st"])) for x in _attention_data(pb, sc["hd"]))
    dq, dk, dv = _upload(queue, q, k, v)
    pool = _pool(queue)

    def call():
        with mma.using(mode):
            return clops.attention(queue, dq, dk, dv, window=pb["window"], allocator=pool)

    return Case(call, lambda: ref.attention(q, k, v, window=pb["window"]),
                (_storage_tol(sc["st"], ATTENTION), FWD), "TFLOP/s",
                attention_flops(pb["windows"], pb["window"], pb["nh"], sc["hd"]))


def _attention_bwd(products, store_ds):
    """The backward (dQ the way ``store_ds`` says, as attention_bwd takes it), its work counted as
    ``products`` matrix products of a forward's size each (dkv: S, dP, dV, dK; dq: S, dP, dQ; dqs: dQ)."""
    return lambda queue, sc, pb: _attention_bwd_case(queue, sc, pb, products, store_ds)


def _attention_bwd_case(queue, sc, pb, products, store_ds, mode="0"):
    """``mode``: the CLOPS_MMA mode the timed calls run under: "0" the portable passes (the families of
    attn.BWD, whatever CLOPS_MMA says), or the matrix-unit backward's at storage ``sc["st"]``."""
    dtype = storage_dtype(sc.get("st", "float"))
    q, k, v = (x.astype(dtype) for x in _attention_data(pb, sc["hd"]))
    dq, dk, dv = _upload(queue, q, k, v)
    pool = _pool(queue)
    # The forward's outputs are the backward's inputs, and the reference is given the same ones
    # (a float64 host forward of a full-size problem would take minutes).
    o_, lse_ = clops.attention(queue, dq, dk, dv, window=pb["window"], allocator=pool)
    o, lse = o_.get(), lse_.get()
    do = ref.rnd(o.shape, 4, 1.0).astype(dtype)
    dev_args = (dq, dk, dv, o_, lse_, *_upload(queue, do))

    def call():
        with mma.using(mode):
            return clops.attention_bwd(queue, *dev_args, window=pb["window"], store_ds=store_ds, allocator=pool)

    return Case(call, lambda: ref.attention_bwd(q, k, v, o, lse, do, window=pb["window"]),
                (_storage_tol(sc.get("st", "float"), BWD),) * 3, "TFLOP/s",
                products / 2 * attention_flops(pb["windows"], pb["window"], pb["nh"], sc["hd"]))


def _attention_bwd_mma(pass_):
    """One pass of the matrix-unit backward (dq: S, dP, dQ, dS recomputed; dkv: S, dP, dV, dK, dS stored
    where attention_bwd stores it; dqs: dQ from the stored dS), timed alone."""
    products, store_ds = {"dq": (3, False), "dkv": (4, None), "dqs": (1, True)}[pass_]

    def prepare(queue, sc, pb):
        mode = _mma_mode(queue, sc, mma.backward_product)
        return _attention_bwd_case(queue, sc, pb, products, store_ds, mode)

    return Family(attn.BWD_MMA[pass_], {"hd": 128, "st": "bf16", "product": "bf16"}, _attention_problem, prepare,
                  f"attention_bwd's {pass_} pass on the matrix-unit driver at storage st (product: its tile "
                  f"products, the device's or fma), timing attn_bwd_{pass_}", kernels=(f"attn_bwd_{pass_}",))


def _qk_norm_rope(queue, sc, pb):
    """qk_norm_rope + its backward, x and dy of storage ``sc["st"]``, a float32 gain."""
    hd, st, n, heads, window = sc["hd"], sc["st"], pb["rows"], pb["heads"], pb["window"]
    dtype = storage_dtype(st)
    x, w, dy = (ref.rnd((n, heads, hd), 1, 2.0).astype(dtype), ref.rnd(hd, 2, 0.5),
                ref.rnd((n, heads, hd), 3, 1.0).astype(dtype))
    rope = ref.rope_table(window, hd // 4)
    dx_, dw_, ddy, drope = _upload(queue, x, w, dy, rope)
    pool = _pool(queue)

    def call():
        y_, inv_ = clops.qk_norm_rope(queue, dx_, dw_, drope, allocator=pool)
        return (y_, inv_, *clops.qk_norm_rope_bwd(queue, dx_, dw_, inv_, drope, ddy, allocator=pool))

    def reference():
        y, inv = ref.qk_norm_rope(x, w, rope)
        return (y, inv, *ref.qk_norm_rope_bwd(x, w, inv, rope, dy))

    unit = x.nbytes  # x, y; x, dy, dx; the gain, inv and dw float32
    work = 2 * unit + _nbytes((hd,), (n, heads)) + 3 * unit + _nbytes((hd,), (n, heads), (hd,))
    return Case(call, reference, (_storage_tol(st, FWD), FWD, _storage_tol(st, BWD), BWD), "GB/s", work)


def _bwd_family(kind):
    names = {"dkv": ("attn_bwd_dsum", "attn_bwd_dkv"), "dq": ("attn_bwd_dq",), "dqs": ("attn_bwd_dqs",)}[kind]
    how = {"dkv": " (dS stored where attention_bwd stores it)", "dq": " (dQ recomputing dS)", "dqs": " with dS stored"}
    prepare = {"dkv": _attention_bwd(4, None), "dq": _attention_bwd(3, False), "dqs": _attention_bwd(1, True)}[kind]
    return Family(attn.BWD[kind], {"hd": 128}, _attention_problem, prepare,
                  f"attention_bwd on [windows·window, nh|nkv, hd]{how[kind]}, timing {' + '.join(names)}",
                  kernels=names)


def _attention_problem(sc, small):
    if small:
        return {"windows": 2, "window": 48, "nh": 4, "nkv": 2}
    return {128: {"windows": 8, "window": 2048, "nh": 32, "nkv": 8},
            256: {"windows": 4, "window": 4096, "nh": 16, "nkv": 2}}.get(sc["hd"],
                                                                          {"windows": 16, "window": 1024, "nh": 12,
                                                                           "nkv": 12})


def _cross_entropy(queue, sc, pb):
    """Both ops (their outputs checked) on float32 logits, or on ``sc["st"]``'s (the backward's family: its
    16-bit gradient within the relative L2 of one rounding, about 2⁻⁹); the work counted is the bytes of
    the op the family times (forward: logits, targets read, loss, lse written; backward: logits, targets,
    lse, dloss read, dlogits written)."""
    n, vocab = pb["rows"], pb["vocab"]
    dtype = storage_dtype(sc.get("st", "float"))
    x, dloss = ref.rnd((n, vocab), 1, 8.0).astype(dtype), ref.rnd(n, 2)
    t = np.random.default_rng(3).integers(0, vocab, n).astype(np.int32)
    dx, dl, dt = *_upload(queue, x, dloss), cla.to_device(queue, t)
    pool = _pool(queue)

    def call():
        loss, lse = clops.cross_entropy(queue, dx, dt, allocator=pool)
        return loss, lse, clops.cross_entropy_bwd(queue, dx, dt, lse, dl, allocator=pool)

    def reference():
        loss, lse = ref.cross_entropy(x, t)
        return loss, lse, ref.cross_entropy_bwd(x, t, lse, dloss)

    row = x.dtype.itemsize * n * vocab
    work = row + _nbytes((n,), (n,), (n,)) if "st" not in sc else 2 * row + _nbytes((n,), (n,), (n,))
    return Case(call, reference, (FWD, FWD, _storage_tol(sc.get("st", "float"), BWD)), "GB/s", work)


def _embedding(queue, sc, pb):
    n, vocab, d = pb["rows"], pb["vocab"], pb["d"]
    table, dout = ref.rnd((vocab, d), 1), ref.rnd((n, d), 2)
    ids = np.random.default_rng(3).integers(0, vocab, n).astype(np.int32)
    dtab, ddout, dids = *_upload(queue, table, dout), cla.to_device(queue, ids)
    pool = _pool(queue)
    return Case(lambda: (clops.embedding(queue, dtab, dids, allocator=pool),
                         clops.embedding_bwd(queue, dids, ddout, vocab=vocab, allocator=pool)),
                lambda: (ref.embedding(table, ids), ref.embedding_bwd(ids, dout, vocab)), (0.0, BWD), "GB/s",
                _nbytes((n,), (n, d), (n, d), (n,), (n, d), (vocab, d)))


def _adamw(queue, sc, pb):
    n = pb["rows"]
    p, g, m, v = ref.rnd(n, 1), ref.rnd(n, 2), ref.rnd(n, 3, 0.1), abs(ref.rnd(n, 4, 0.1))
    kw = dict(lr=1e-3, step=2, weight_decay=0.1)

    def call():  # from the same state every time: the update is in place
        state = _upload(queue, p, g, m, v)
        return clops.adamw(queue, *state, **kw)

    return Case(call, lambda: ref.adamw(p, g, m, v, **kw), (FWD,) * 3, "GB/s", _nbytes(*[(n,)] * 7))


def _xent_problem(sc, small):
    return {"rows": 8 if small else 4096, "vocab": 5000 if small else 50257}


_TOKENS = 16384  # the memory-bound benchmark: n = 16384 tokens, d = 5120 (SwiGLU at 3·d)


def _norm_rows(sc, small):
    """The norm families' problem: 256 rows small, else the benchmark's tokens."""
    return {"rows": 256 if small else _TOKENS}


FAMILIES = {
    "elementwise": Family(
        elementwise.SPEC, {},
        lambda sc, small: {"rows": 64, "width": 960} if small else {"rows": _TOKENS, "width": 3 * 5120},
        _elementwise, "swiglu + swiglu_bwd on [rows, width]; one parameter set serves every elementwise op"),
    "rms_norm": Family(norm.ROWS, {"d": 5120, "st": "float"}, _norm_rows, _rms_norm,
                       "rms_norm on [rows, d] of storage st (float, half, bf16); add_rms_norm takes its tiles"),
    "rms_norm_bwd": Family(norm.ROWS_BWD, {"d": 5120, "st": "float"}, _norm_rows, _rms_norm_bwd,
                           "rms_norm_bwd without dw on [rows, d] of storage st"),
    "rms_norm_dw": Family(norm.DW, {"d": 5120, "st": "float"}, _norm_rows, _rms_norm_dw,
                          "rms_norm_dw on [rows, d] of storage st"),
    "rms_norm_bwd_dw": Family(norm.BWD_DW, {"d": 5120, "st": "float"}, _norm_rows, functools.partial(_one_pass, False),
                              "rms_norm_bwd(want_dw=True) on [rows, d] of storage st: dx and dw in one pass"),
    "add_rms_norm_bwd": Family(norm.ADD_BWD_DW, {"d": 5120, "st": "float"}, _norm_rows,
                               functools.partial(_one_pass, True),
                               "add_rms_norm_bwd on [rows, d] of storage st: the one pass reading ds too"),
    "attention_fwd": Family(attn.FWD, {"hd": 128}, _attention_problem, _attention_fwd,
                            "attention forward on [windows·window, nh|nkv, hd]"),
    "attention_fwd_mma": Family(attn.FWD_MMA, {"hd": 128, "st": "bf16", "product": "bf16"}, _attention_problem,
                                _attention_fwd_mma, "attention forward on the matrix-unit driver at storage st "
                                "(product: its tile products, the device's or fma)"),
    "attention_bwd_mma_dq": _attention_bwd_mma("dq"),
    "attention_bwd_mma_dkv": _attention_bwd_mma("dkv"),
    "attention_bwd_mma_dqs": _attention_bwd_mma("dqs"),
    "attention_bwd_dkv": _bwd_family("dkv"),
    "attention_bwd_dq": _bwd_family("dq"),
    "attention_bwd_dqs": _bwd_family("dqs"),
    "cross_entropy": Family(loss.SPEC, {}, _xent_problem, _cross_entropy,
                            "cross_entropy on float32 [rows, vocab] (its parameters serve every storage type), "
                            "timing cross_entropy_fwd", kernels=("cross_entropy_fwd",)),
    "cross_entropy_bwd": Family(loss.BWD, {"st": "bf16"}, _xent_problem, _cross_entropy,
                                "cross_entropy_bwd on [rows, vocab] logits of storage st (float, half, bf16), "
                                "timing cross_entropy_bwd", kernels=("cross_entropy_bwd",)),
    "embedding": Family(embed.SPEC, {}, lambda sc, small: {"rows": 64 if small else _TOKENS,
                                                           "vocab": 500 if small else 50257, "d": 64 if small else 1024},
                        _embedding, "embedding + embedding_bwd on ids [rows] of a [vocab, d] table"),
    "adamw": Family(optim.SPEC, {}, lambda sc, small: {"rows": 4099 if small else 2**26}, _adamw,
                    "adamw on [rows] (the timed calls include uploading the state they start from)"),
    "qk_norm_rope": Family(
        qk_rope.SPEC, {"hd": 128, "st": "float"},
        lambda sc, small: {"rows": 128 if small else _TOKENS, "heads": 4 if small else 16, "window": 64 if small
                           else 4096},
        _qk_norm_rope, "qk_norm_rope + qk_norm_rope_bwd on [rows, heads, hd] of storage st, rotary half hd/4"),
}


# ---- the sweep ----

def template_hash(templates):
    """sha256 over the text of ``templates`` and every template they include (``file="..."``)."""
    h, seen, todo = hashlib.sha256(), set(), list(templates)
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        text = (KERNEL_DIR / name).read_text()
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
        todo.extend(sorted(set(re.findall(r'file="([^"]+)"', text))))
    return h.hexdigest()


def configurations(space, reject, dev, sc, derive=None):
    """(kept, left_out): the product of the lists in order (with derived parameters added), and
    {rule: count} of those left out; ``reject(p, dev, sc)`` is the rule ``p`` breaks or None."""
    names = list(space)
    kept, left_out = [], {}
    for values in itertools.product(*(space[k] for k in names)):
        p = dict(zip(names, values))
        if derive is not None:
            p = derive(p, sc)
        failed = reject(p, dev, sc) if reject is not None else None
        if failed is None:
            kept.append(p)
        else:
            left_out[failed] = left_out.get(failed, 0) + 1
    return kept, left_out


def _key(params):
    return json.dumps(params, sort_keys=True)


def header(fam, dev, sc, problem, space, check_problem=None):
    platform, name, driver = runtime.device_identity(dev)
    return {"tool": "clops tune", "op": fam.op, "shape_class": sc,
            "device": {"platform": platform, "name": name, "driver": driver, "key": tuning.device_key(dev)},
            "template_hash": template_hash(fam.templates), "templates": list(fam.templates),
            "problem": problem, "check_problem": check_problem or problem, "params": list(space)}


def load_results(path, head):
    """The results already in ``path`` for this exact header; ValueError when the header differs."""
    with open(path) as f:
        old = json.load(f)
    oh = old.get("header", {})
    if oh.get("device") != head["device"]:
        d = oh.get("device", {})
        raise ValueError(f"{path} holds results from {d.get('name')!r} (driver {d.get('driver')!r}, "
                         f"{d.get('platform')!r}); this is {head['device']['name']!r} (driver "
                         f"{head['device']['driver']!r}, {head['device']['platform']!r}): refusing to resume "
                         "(pass --fresh to start over, or another --out)")
    if oh.get("template_hash") != head["template_hash"]:
        raise ValueError(f"{path} was made with other template text ({', '.join(head['templates'])} changed "
                         "since): refusing to resume (pass --fresh to start over, or another --out)")
    for field in ("op", "shape_class", "problem", "check_problem", "params"):
        if oh.get(field) != head[field]:
            raise ValueError(f"{path} was made for {field} {oh.get(field)!r}, this sweep has {head[field]!r}: "
                             "refusing to resume (pass --fresh to start over, or another --out)")
    return old.get("results", [])


def _write(path, head, results):
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps({"header": head, "results": results}, indent=1) + "\n")
    os.replace(tmp, path)


def _reason(e):
    lines = str(e).strip().splitlines() or [""]
    text = lines[0] + (f" (+{len(lines) - 1} lines)" if len(lines) > 1 else "")
    return f"{type(e).__name__}: {text}"


def evaluate(queue, fam, case, sc, params, runs, warmup, check=None):
    """The result of one configuration: status ok | wrong | failed, with its reason or figures.
    ``params`` None: the configuration the op uses without an override (database or heuristic).
    Correctness is checked on ``check`` (another problem of the shape class) when given, else on ``case``."""
    dev = queue.device
    check = check or case
    if params is not None:
        tuning.override(fam.op, sc, params, device=dev)
    try:
        with Profile(queue) as prof:
            outs = check.call()
        errs = [ref.rel_err(o.get(), w) for o, w in zip(outs, check.want)]
        # the parameters of the kernels timed (attention_bwd's dq family: not the dkv pass's, which has them too)
        used = {r.name: {k: v for k, v in r.params.items() if k != "checked"} for r in prof.launches
                if not fam.kernels or r.name in fam.kernels}
        bad = [f"output {i}: rel err {e:.2e} > {t:.0e}"
               for i, (e, t) in enumerate(zip(errs, check.tol)) if not e <= t]
        err = max(errs)
        if bad:
            return {"params": params, "status": "wrong", "err": err, "used": used, "reason": "; ".join(bad)}
        ms, times = measure(queue, case.call, warmup=warmup, runs=runs, kernels=fam.kernels or None)
    except (ValueError, RuntimeError, cl.Error) as e:
        return {"params": params, "status": "failed", "reason": _reason(e)}
    finally:
        if params is not None:
            tuning.override(fam.op, sc, None, device=dev)
    figure = case.work / (ms * 1e6) if case.unit == "GB/s" else case.work / (ms * 1e9)
    return {"params": params, "status": "ok", "err": err, "ms": ms, case.unit: figure, "times_ms": times,
            "used": used}


def _progress(i, total, params, r, best, out):
    width = 20
    done = round(width * i / total) if total else width
    bar = "#" * done + "-" * (width - done)
    best_text = f" | best {best['ms']:.4f} ms" if best else ""
    out(f"[{bar}] {i}/{total} {_fmt(params)}: {_outcome(r)[:120]}{best_text}")


def _outcome(r):
    return {"ok": lambda: f"{r['ms']:.4f} ms", "wrong": lambda: "WRONG " + r["reason"],
            "failed": lambda: "FAILED " + r["reason"]}[r["status"]]()


def _fmt(params):
    return " ".join(f"{k}={v}" for k, v in params.items())


def sweep(queue, fam, sc, problem, space, path, *, runs=MIN_RUNS, warmup=2, restrict=True, sample=None, seed=0,
          budget_s=None, fresh=False, check_problem=None, out=print):
    """Run (or resume) a sweep; returns (header, results, current). Results are in the file after every
    configuration; ``current`` is the op's configuration without an override, timed in this run.
    ``check_problem``: check correctness on that problem instead of the timed one."""
    if runs < MIN_RUNS:
        raise ValueError(f"runs: at least {MIN_RUNS} timed runs, got {runs}")
    dev = queue.device
    head = header(fam, dev, sc, problem, space, check_problem)
    results = [] if fresh or not Path(path).exists() else load_results(path, head)
    configs, left_out = configurations(space, fam.reject if restrict else None, dev, sc, fam.spec.sweep_derive)
    for text, count in left_out.items():
        out(f"left out by restriction '{text}': {count}")
    if sample is not None and sample < len(configs):
        picked = set(random.Random(seed).sample(range(len(configs)), sample))
        configs = [p for i, p in enumerate(configs) if i in picked]
    done = {_key(r["params"]) for r in results}
    todo = [p for p in configs if _key(p) not in done]
    out(f"{fam.op} {tuning.shape_key(sc) or '(no shape class)'} on {dev.name.strip()}: {len(configs)} "
        f"configurations, {len(configs) - len(todo)} already in {path}, problem {problem}")
    case = fam.prepare(queue, sc, problem)
    check = fam.prepare(queue, sc, check_problem) if check_problem else None
    # the float64 reference is made at the first check, before the budget's clock starts: say so, as at
    # full-size attention problems it takes a while
    checked_on = f"the small problem {check_problem}" if check_problem else "the timed problem"
    out(f"checking each configuration against float64 on {checked_on}, its reference computed first, once")
    current = evaluate(queue, fam, case, sc, None, runs, warmup, check)
    out(f"current configuration ({tuning.lookup(dev, fam.op, sc)[1] or 'heuristic'}): " + _outcome(current))
    best = min((r for r in results if r["status"] == "ok"), key=lambda r: r["ms"], default=None)
    start = time.monotonic()
    for i, params in enumerate(todo, len(configs) - len(todo) + 1):
        if budget_s is not None and time.monotonic() - start > budget_s:
            out(f"time budget of {budget_s} s spent: stopping; run again to resume")
            break
        r = evaluate(queue, fam, case, sc, params, runs, warmup, check)
        results.append(r)
        _write(path, head, results)
        if r["status"] == "ok" and (best is None or r["ms"] < best["ms"]):
            best = r
        _progress(i, len(configs), params, r, best, out)
    if not Path(path).exists():
        _write(path, head, results)
    return head, results, current


def best_result(results):
    return min((r for r in results if r["status"] == "ok"), key=lambda r: r["ms"], default=None)


def _names(head, results):
    """The parameter names of the results (derived ones included), in order."""
    return list(dict.fromkeys(k for r in results for k in r["params"])) or head["params"]


def current_params(head, results, current):
    """The parameters the op used without an override: ``current``'s configuration, read from its first
    launch of a kernel that takes them all (not, say, the column sum a gain gradient ends with, which
    rms_norm_dw's spec renders at float32)."""
    names = _names(head, results)
    own = [used for used in current.get("used", {}).values() if all(k in used for k in names)]
    return {k: own[0][k] for k in names} if own else {}


def comparison(head, results, current):
    """The sweep's last line: its fastest correct configuration against the op's current one."""
    params = _fmt(current_params(head, results, current))
    now = f"current configuration{' ' + params if params else ''}: {_outcome(current)}"
    best = best_result(results)
    if best is None:
        return f"no correct configuration in the sweep; {now}"
    line = f"best swept {_fmt(best['params'])}: {best['ms']:.4f} ms; {now}"
    if current["status"] == "ok" and current["ms"] > 0:
        line += f"; the best takes {best['ms'] / current['ms']:.2f}× the current's time"
    return line


def table(head, results, top=20):
    """The results as text: the fastest ``top`` correct ones, then every wrong or failed one with its reason."""
    names = _names(head, results)
    ok = sorted((r for r in results if r["status"] == "ok"), key=lambda r: r["ms"])
    unit = next((u for u in ("GB/s", "TFLOP/s") if ok and u in ok[0]), "")
    width = {n: max(6, len(n) + 1) for n in names}  # a space before each name
    cols = "".join(f"{n:>{width[n]}}" for n in names)
    lines = [f"{cols} {'ms':>10} {unit:>9} {'rel err':>9}"]
    for r in ok[:top]:
        vals = "".join(f"{r['params'].get(n, '')!s:>{width[n]}}" for n in names)
        lines.append(f"{vals} {r['ms']:>10.4f} {r[unit]:>9.3g} {r['err']:>9.1e}")
    if len(ok) > top:
        lines.append(f"... {len(ok) - top} more correct configurations")
    for r in results:
        if r["status"] != "ok":
            vals = "".join(f"{r['params'].get(n, '')!s:>{width[n]}}" for n in names)
            lines.append(f"{vals} {r['status'].upper():>10} {r['reason'][:160]}")
    counts = {s: sum(r["status"] == s for r in results) for s in ("ok", "wrong", "failed")}
    lines.append(f"{len(results)} configurations: {counts['ok']} correct, {counts['wrong']} wrong, "
                 f"{counts['failed']} failed")
    return "\n".join(lines)


def plot(head, results, path, current=None):
    """A PNG of time per configuration in sweep order: each bar the median, labelled with its parameters,
    with the spread (min to max) of its runs; the best in red, the current configuration a dashed line.
    False (and why) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False, "--plot: matplotlib is not installed, so no chart was written (pip install matplotlib)"
    ok = [r for r in results if r["status"] == "ok"]
    if not ok:
        return False, "--plot: no correct configuration to draw"
    best = best_result(results)
    names = _names(head, results)
    x = list(range(len(ok)))
    ms = [r["ms"] for r in ok]
    fig, ax = plt.subplots(figsize=(max(6, 0.12 * len(ok)), 5))
    ax.bar(x, ms, color=["tab:red" if r is best else "tab:blue" for r in ok])
    ax.errorbar(x, ms, yerr=[[r["ms"] - min(r["times_ms"]) for r in ok], [max(r["times_ms"]) - r["ms"] for r in ok]],
                fmt="none", ecolor="black", elinewidth=0.6, capsize=1, label="min to max of the timed runs")
    if current is not None and current["status"] == "ok":
        ax.axhline(current["ms"], color="tab:green", linestyle="--", linewidth=1,
                   label=f"current {_fmt(current_params(head, results, current))}: {current['ms']:.4f} ms")
    ax.set_xticks(x)
    ax.set_xticklabels([",".join(str(r["params"].get(n, "")) for n in names) for r in ok], rotation=90, fontsize=6)
    ax.set_xlabel(f"configuration ({','.join(names)}), in sweep order")
    ax.set_ylabel("ms (median)")
    ax.set_title(f"{head['op']} {tuning.shape_key(head['shape_class'])} on {head['device']['name']}\n"
                 f"best {_fmt(best['params'])}, {best['ms']:.4f} ms", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True, f"chart written to {path}"


# ---- command line ----

def _value(text):
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _pairs(items, what):
    out = {}
    for item in items or ():
        if "=" not in item:
            raise SystemExit(f"{what} {item!r}: expected NAME=VALUE")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _list_families(out=print):
    for name, fam in FAMILIES.items():
        out(f"{name}: {fam.doc}; shape class {fam.shape_class or '{}'}")
        for k, v in fam.space(fam.shape_class).items():
            out(f"    {k}: {v}")
        if fam.spec.doc:
            out(f"    ({fam.spec.doc})")


def main(argv=None, queue=None):
    p = argparse.ArgumentParser(prog="python -m clops tune", description=__doc__.split("\n\n")[0])
    p.add_argument("op", nargs="?", help="tuning-database op name (--list shows them)")
    p.add_argument("--list", action="store_true", help="list the op families, their parameters and restrictions")
    p.add_argument("--class", dest="sclass", action="append", metavar="K=V",
                   help="shape class entry, e.g. hd=128 (--list shows each op's keys)")
    p.add_argument("--size", action="append", metavar="K=V", help="problem size entry, e.g. rows=4096")
    p.add_argument("--param", action="append", metavar="NAME=V1,V2",
                   help="candidates of one parameter, in order (replaces the family's list)")
    p.add_argument("--small", action="store_true", help="small default problem (CPUs)")
    p.add_argument("--check-small", action="store_true",
                   help="check each configuration on the small problem instead of the timed one (the "
                        "float64 check of a full-size memory-bound problem takes seconds per configuration)")
    p.add_argument("--runs", type=int, default=MIN_RUNS, help=f"timed runs per configuration (≥ {MIN_RUNS})")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before timing")
    p.add_argument("--out", help="results file (default: clops-tune-<op>-<class>-<device>.json here)")
    p.add_argument("--fresh", action="store_true", help="start over instead of resuming the results file")
    p.add_argument("--sample", type=int, help="time only this many configurations, drawn at random (--seed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, help="stop after this many seconds of configurations, counted from "
                   "after the current configuration's run and the float64 reference (the file resumes)")
    p.add_argument("--no-restrictions", action="store_true",
                   help="try every configuration; the op's own checks reject the invalid ones")
    p.add_argument("--top", type=int, default=20, help="correct configurations shown in the table")
    p.add_argument("--plot", metavar="PNG", help="save a chart of the sweep (needs matplotlib)")
    p.add_argument("--save", action="store_true", help="write the best configuration to the user tuning database")
    a = p.parse_args(argv)
    if a.list:
        _list_families()
        return 0
    if not a.op:
        p.error(f"name the op to tune: one of {', '.join(FAMILIES)} (--list shows their parameters)")
    fam = FAMILIES.get(a.op)
    if fam is None:
        print(f"unknown op {a.op!r}; known: {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    classes = _pairs(a.sclass, "--class")
    for k in classes:
        if k not in fam.shape_class:  # an entry under another key is one the op never looks up
            print(f"--class {k}: {fam.op}'s shape class has no {k!r} (it has {', '.join(fam.shape_class) or 'none'})",
                  file=sys.stderr)
            return 2
    sc = dict(fam.shape_class, **{k: _value(v) for k, v in classes.items()})
    problem = dict(fam.problem(sc, a.small), **{k: int(v) for k, v in _pairs(a.size, "--size").items()})
    space = fam.space(sc)
    for k, v in _pairs(a.param, "--param").items():
        if k not in space:
            print(f"--param {k}: {fam.op} has no parameter {k!r} (it has {', '.join(space)})", file=sys.stderr)
            return 2
        space[k] = [_value(x) for x in v.split(",") if x]
    queue = queue or runtime.default_queue(profiling=True)
    dev = queue.device
    path = a.out or f"clops-tune-{a.op}-{re.sub('[^A-Za-z0-9]+', '', tuning.shape_key(sc)) or 'all'}-" \
                    f"{tuning.device_key(dev)}.json"
    try:
        head, results, current = sweep(queue, fam, sc, problem, space, path, runs=a.runs, warmup=a.warmup,
                              restrict=not a.no_restrictions, sample=a.sample, seed=a.seed, budget_s=a.budget_s,
                              fresh=a.fresh, check_problem=fam.problem(sc, True) if a.check_small else None)
    except KeyboardInterrupt:
        if Path(path).exists():
            with open(path) as f:
                done = json.load(f)
            print(table(done["header"], done["results"], a.top))
        print(f"\ninterrupted: the results so far are in {path}; run the same command again to resume")
        return 130
    except ValueError as e:
        print(f"clops tune: {e}", file=sys.stderr)
        return 2
    print(table(head, results, a.top))
    print(comparison(head, results, current))
    best = best_result(results)
    if a.plot:
        print(plot(head, results, a.plot, current)[1])
    if a.save:
        if best is None:
            print("--save: no correct configuration, nothing saved")
            return 1
        if current["status"] == "ok" and current["ms"] <= best["ms"]:
            print(f"--save: the op's current configuration ({current['ms']:.4f} ms) is at least as fast as the "
                  f"best swept one ({best['ms']:.4f} ms): nothing saved")
            return 0
        saved = tuning.save(dev, fam.op, sc, best["params"])
        print(f"saved {_fmt(best['params'])} for {fam.op} {tuning.shape_key(sc) or '{}'} to {saved}")
    return 0 if best is not None else 1
