"""Invalid input to every public op: refused with a TypeError or ValueError naming the argument,
before anything is enqueued, and given output arrays keep their bytes.

One table: each row is (op, what is wrong, the argument the error must name, the call). The
generic rows come from mutating one array argument of a valid call at a time; the op-specific
rows (head dims, windows, GQA groups, scalars, template parameters beyond the device) follow.
"""
import dataclasses

import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pytest

import clops
import clops.program
from clops import tuning
from clops.reference import rnd

SENTINEL = 7.25


@dataclasses.dataclass
class Spec:
    fn: object
    ins: dict  # positional array arguments in order: name -> shape
    outs: dict  # keyword arrays (outputs, and swiglu_limit's row_weight): name -> shape
    kw: dict = dataclasses.field(default_factory=dict)
    lead: tuple = ()  # arguments whose shape sets the others' (a changed shape is no error of theirs)
    any_rank: tuple = ()  # arguments of any rank


R, W = 3, 8  # elementwise [rows, width]
N, D = 4, 8  # norm [n, d]
QN, QH, QD, QW = 4, 2, 8, 2  # qk_norm_rope [n, heads, hd], rope window; rotary half 2
AW, AN, NH, NKV, HD = 4, 8, 4, 2, 8  # attention window, tokens, heads, kv heads, head dim

_ew = {"a": (R, W), "b": (R, W)}
_ew_bwd = {"a": (R, W), "b": (R, W), "dc": (R, W)}
_ew_outs = {"da": (R, W), "db": (R, W)}
SPECS = {
    "swiglu": Spec(clops.swiglu, _ew, {"out": (R, W)}, lead=("a",), any_rank=("a",)),
    "swiglu_bwd": Spec(clops.swiglu_bwd, _ew_bwd, _ew_outs, lead=("a",), any_rank=("a",)),
    "swiglu_limit": Spec(clops.swiglu_limit, _ew, {"out": (R, W), "row_weight": (R,)}, {"limit": 1.5},
                         lead=("a",)),
    "swiglu_gated": Spec(clops.swiglu_gated, dict(_ew, gate=(W,)), {"out": (R, W)}, lead=("a",),
                         any_rank=("a",)),
    "swiglu_gated_bwd": Spec(clops.swiglu_gated_bwd, dict(_ew, gate=(W,), dc=(R, W)), _ew_outs, lead=("a",),
                             any_rank=("a",)),
    "sigmoid_gate": Spec(clops.sigmoid_gate, _ew, {"out": (R, W)}, lead=("a",), any_rank=("a",)),
    "sigmoid_gate_bwd": Spec(clops.sigmoid_gate_bwd, _ew_bwd, _ew_outs, lead=("a",), any_rank=("a",)),
    "add": Spec(clops.add, _ew, {"out": (R, W)}, lead=("a",), any_rank=("a",)),
    "rms_norm": Spec(clops.rms_norm, {"x": (N, D), "w": (D,)}, {"out": (N, D), "inv": (N,)}, lead=("x",)),
    "rms_norm_bwd": Spec(clops.rms_norm_bwd, {"x": (N, D), "w": (D,), "inv": (N,), "dy": (N, D)}, {"dx": (N, D)},
                         lead=("x",)),
    "rms_norm_dw": Spec(clops.rms_norm_dw, {"x": (N, D), "inv": (N,), "dy": (N, D)}, {"dw": (D,)}, lead=("x",)),
    "rms_norm_bwd one pass": Spec(clops.rms_norm_bwd, {"x": (N, D), "w": (D,), "inv": (N,), "dy": (N, D)},
                                  {"dx": (N, D), "dw": (D,)}, lead=("x",)),
    "add_rms_norm": Spec(clops.add_rms_norm, {"a": (N, D), "b": (N, D), "w": (D,)},
                         {"s": (N, D), "out": (N, D), "inv": (N,)}, lead=("a",)),
    "add_rms_norm_bwd": Spec(clops.add_rms_norm_bwd, {"s": (N, D), "w": (D,), "inv": (N,), "dy": (N, D),
                                                      "ds": (N, D)}, {"dx": (N, D), "dw": (D,)}, lead=("s",)),
    "qk_norm_rope": Spec(clops.qk_norm_rope, {"x": (QN, QH, QD), "w": (QD,), "rope": (QW, 2, 2)},
                         {"out": (QN, QH, QD), "inv": (QN, QH)}, lead=("x",)),
    "qk_norm_rope_bwd": Spec(clops.qk_norm_rope_bwd, {"x": (QN, QH, QD), "w": (QD,), "inv": (QN, QH),
                                                      "rope": (QW, 2, 2), "dy": (QN, QH, QD)},
                             {"dx": (QN, QH, QD), "dw": (QD,)}, lead=("x",)),
    "attention": Spec(clops.attention, {"q": (AN, NH, HD), "k": (AN, NKV, HD), "v": (AN, NKV, HD)},
                      {"out": (AN, NH, HD), "lse": (AN, NH)}, {"window": AW}, lead=("q",)),
    "attention_bwd": Spec(clops.attention_bwd, {"q": (AN, NH, HD), "k": (AN, NKV, HD), "v": (AN, NKV, HD),
                                                "o": (AN, NH, HD), "lse": (AN, NH), "do": (AN, NH, HD)},
                          {"dq": (AN, NH, HD), "dk": (AN, NKV, HD), "dv": (AN, NKV, HD)}, {"window": AW},
                          lead=("q",)),
}
def _array(queue, shape, seed=0):
    return cla.to_device(queue, np.random.default_rng(seed).uniform(0.5, 1.0, shape).astype(np.float32))


def _noncontiguous(queue, shape):
    if len(shape) == 1:
        return cla.zeros(queue, (2 * shape[0],), np.float32)[::2]
    swapped = (shape[1], shape[0]) + tuple(shape[2:])
    return cla.zeros(queue, swapped, np.float32).transpose((1, 0) + tuple(range(2, len(shape))))


_OTHER = {}


def _other_context(queue, shape):
    """An array on a second context of the same device (held: Intel's runtime loses unreferenced contexts)."""
    key = queue.device.int_ptr
    if key not in _OTHER:
        ctx = cl.Context([queue.device])
        _OTHER[key] = (ctx, cl.CommandQueue(ctx))
    return cla.zeros(_OTHER[key][1], shape, np.float32)


# kind -> (exception, make(queue, shape) -> the bad argument)
MUTATIONS = {
    "float64": (TypeError, lambda queue, shape: cla.zeros(queue, shape, np.float64)),
    "numpy array": (TypeError, lambda queue, shape: np.zeros(shape, np.float32)),
    "extra dimension": (ValueError, lambda queue, shape: cla.zeros(queue, (1, *shape), np.float32)),
    "wrong shape": (ValueError, lambda queue, shape: cla.zeros(queue, (*shape[:-1], shape[-1] + 1), np.float32)),
    "non-contiguous": (ValueError, _noncontiguous),
    "offset view": (ValueError, lambda queue, shape: cla.zeros(queue, (int(np.prod(shape)) + 1,), np.float32)[1:]
                    .reshape(shape)),
    "other context": (ValueError, _other_context),
}


def call(queue, op, replace=None, **kw):
    """Run ``op`` on valid arrays (sentinel-filled outputs), ``replace`` swapping some; returns the outputs."""
    spec = SPECS[op]
    replace = replace or {}
    args = [replace.get(name) if name in replace else _array(queue, shape, seed)
            for seed, (name, shape) in enumerate(spec.ins.items())]
    outs = {name: replace.get(name) if name in replace else cla.to_device(queue, np.full(shape, SENTINEL, np.float32))
            for name, shape in spec.outs.items()}
    spec.fn(queue, *args, **outs, **dict(spec.kw, **kw))
    return outs


def _generic_rows():
    rows = []
    for op, spec in SPECS.items():
        for name, shape in {**spec.ins, **spec.outs}.items():
            for kind, (exc, make) in MUTATIONS.items():
                if kind == "extra dimension" and name in spec.any_rank:
                    continue
                if kind == "wrong shape" and name in spec.lead:
                    continue
                rows.append((op, kind, name, exc, lambda queue, make=make, name=name, shape=shape:
                             {"replace": {name: make(queue, shape)}}))
    return rows


def _tokens(n):
    return lambda queue: {"replace": {"k": cla.zeros(queue, (n, NKV, HD), np.float32)}}


def _attn(nh, nkv, hd, n=AN, window=AW):
    def make(queue):
        shapes = {"q": (n, nh, hd), "k": (n, nkv, hd), "v": (n, nkv, hd), "o": (n, nh, hd), "lse": (n, nh),
                  "do": (n, nh, hd), "out": (n, nh, hd), "dq": (n, nh, hd), "dk": (n, nkv, hd), "dv": (n, nkv, hd)}
        return {"replace": {k: _array(queue, s) for k, s in shapes.items()}, "window": window}

    return make


def _qk(hd, rope=(QW, 2, 2), **kw):
    def make(queue):
        shapes = {"x": (QN, QH, hd), "w": (hd,), "dy": (QN, QH, hd), "out": (QN, QH, hd), "dx": (QN, QH, hd),
                  "dw": (hd,), "rope": rope}
        return dict({"replace": {k: _array(queue, s) for k, s in shapes.items()}}, **kw)

    return make


def _scalar(**kw):
    return lambda queue: kw


def _cu(*offsets):
    return np.array(offsets, np.int32)


SPECIFIC = [
    # (op, what, named, exception, make(queue) -> call kwargs)
    *[(op, "head dim not a multiple of 8", "q", ValueError, _attn(NH, NKV, 12)) for op in ("attention", "attention_bwd")],
    *[(op, "head dim above 256", "q", ValueError, _attn(NH, NKV, 264)) for op in ("attention", "attention_bwd")],
    *[(op, "window not dividing the tokens", "window", ValueError, _attn(NH, NKV, HD, window=3))
      for op in ("attention", "attention_bwd")],
    *[(op, "window zero", "window", ValueError, _attn(NH, NKV, HD, window=0)) for op in ("attention", "attention_bwd")],
    *[(op, "nh % nkv != 0", "k", ValueError, _attn(NH, 3, HD)) for op in ("attention", "attention_bwd")],
    *[(op, "k of other tokens", "k", ValueError, _tokens(AN + AW)) for op in ("attention", "attention_bwd")],
    *[(op, "scale infinite", "scale", ValueError, _scalar(scale=float("inf"))) for op in ("attention", "attention_bwd")],
    ("attention_bwd", "store_ds not a bool", "store_ds", TypeError, _scalar(store_ds="yes")),
    *[(op, what, named, exc, make) for op in ("attention", "attention_bwd") for what, named, exc, make in [
        ("both window and cu_seqlens", "window", ValueError, _scalar(cu_seqlens=_cu(0, AN))),
        ("neither window nor cu_seqlens", "window", ValueError, _scalar(window=None)),
        ("cu_seqlens decreasing", "cu_seqlens", ValueError, _scalar(window=None, cu_seqlens=_cu(0, 5, 3, AN))),
        ("cu_seqlens past n", "cu_seqlens", ValueError, _scalar(window=None, cu_seqlens=_cu(0, 4, AN + 1))),
        ("cu_seqlens not from 0", "cu_seqlens", ValueError, _scalar(window=None, cu_seqlens=_cu(1, AN))),
        ("cu_seqlens int64", "cu_seqlens", TypeError,
         _scalar(window=None, cu_seqlens=np.array([0, AN], np.int64))),
        ("cu_seqlens a list", "cu_seqlens", TypeError, _scalar(window=None, cu_seqlens=[0, AN])),
        ("device cu_seqlens float32", "cu_seqlens", TypeError,
         lambda queue: {"window": None, "cu_seqlens": cla.to_device(queue, np.array([0, AN], np.float32)),
                        "max_seqlen": AN}),
        ("device cu_seqlens without max_seqlen", "max_seqlen", ValueError,
         lambda queue: {"window": None, "cu_seqlens": cla.to_device(queue, _cu(0, AN))}),
        ("max_seqlen below the longest", "max_seqlen", ValueError,
         _scalar(window=None, cu_seqlens=_cu(0, 2, AN), max_seqlen=3)),
        ("max_seqlen above n", "max_seqlen", ValueError,
         lambda queue: {"window": None, "cu_seqlens": cla.to_device(queue, _cu(0, AN)), "max_seqlen": AN + 1}),
        ("max_seqlen with window", "max_seqlen", ValueError, _scalar(max_seqlen=AW)),
        ("sliding_window zero", "sliding_window", ValueError, _scalar(sliding_window=0)),
        ("sliding_window a float", "sliding_window", TypeError, _scalar(sliding_window=2.0)),
        ("softcap zero", "softcap", ValueError, _scalar(softcap=0.0)),
        ("softcap negative", "softcap", ValueError, _scalar(softcap=-30.0)),
        ("softcap NaN", "softcap", ValueError, _scalar(softcap=float("nan"))),
        ("softcap a string", "softcap", TypeError, _scalar(softcap="30")),
        ("causal not a bool", "causal", TypeError, _scalar(causal="no")),
    ]],
    *[(op, "head dim not a multiple of 4", "x", ValueError, _qk(6, rope=(QW, 1, 2)))
      for op in ("qk_norm_rope", "qk_norm_rope_bwd")],
    *[(op, "rotary half above hd/2", "rope", ValueError, _qk(QD, rope=(QW, 5, 2)))
      for op in ("qk_norm_rope", "qk_norm_rope_bwd")],
    *[(op, "rope not (cos, sin) pairs", "rope", ValueError, _qk(QD, rope=(QW, 2, 3)))
      for op in ("qk_norm_rope", "qk_norm_rope_bwd")],
    *[(op, "window longer than the table", "rope", ValueError, _qk(QD, window=QW + 1))
      for op in ("qk_norm_rope", "qk_norm_rope_bwd")],
    *[(op, what, named, exc, make) for op in ("qk_norm_rope", "qk_norm_rope_bwd") for what, named, exc, make in [
        ("both window and cu_seqlens", "window", ValueError, _scalar(window=QW, cu_seqlens=_cu(0, 2, QN))),
        ("cu_seqlens decreasing", "cu_seqlens", ValueError, _scalar(cu_seqlens=_cu(0, 2, 1, QN))),
        ("cu_seqlens past n", "cu_seqlens", ValueError, _scalar(cu_seqlens=_cu(0, 2, QN + 1))),
        ("cu_seqlens int64", "cu_seqlens", TypeError, _scalar(cu_seqlens=np.array([0, 2, QN], np.int64))),
        ("device cu_seqlens without max_seqlen", "max_seqlen", ValueError,
         lambda queue: {"cu_seqlens": cla.to_device(queue, _cu(0, 2, QN))}),
        ("max_seqlen without cu_seqlens", "max_seqlen", ValueError, _scalar(max_seqlen=QW)),
        ("a sequence longer than the table", "rope", ValueError, _scalar(cu_seqlens=_cu(0, 1, QN))),
        ("max_seqlen longer than the table", "rope", ValueError,
         lambda queue: {"cu_seqlens": cla.to_device(queue, _cu(0, 2, QN)), "max_seqlen": QW + 1}),
    ]],
    ("qk_norm_rope", "eps negative", "eps", ValueError, _scalar(eps=-1.0)),
    ("rms_norm", "eps NaN", "eps", ValueError, _scalar(eps=float("nan"))),
    ("rms_norm", "eps a string", "eps", TypeError, _scalar(eps="1e-6")),
    ("add_rms_norm", "eps NaN", "eps", ValueError, _scalar(eps=float("nan"))),
    ("add_rms_norm_bwd", "gemma not a bool", "gemma", TypeError, _scalar(gemma=1)),
    ("rms_norm_bwd", "want_dw not a bool", "want_dw", TypeError, _scalar(want_dw="yes")),
    ("swiglu_limit", "limit NaN", "limit", ValueError, _scalar(limit=float("nan"))),
    ("swiglu_limit", "scale infinite", "scale", ValueError, _scalar(scale=float("inf"))),
    ("swiglu", "queue not a queue", "queue", TypeError, None),
]

ROWS = _generic_rows() + SPECIFIC


def _launches(monkeypatch):
    seen = []
    monkeypatch.setitem(clops.program.observers, "test_bad_input", lambda q, knl, *_: seen.append(knl.name))
    return seen


def _check_refused(queue, monkeypatch, op, named, exc, kwargs):
    seen = _launches(monkeypatch)
    replace = kwargs.pop("replace", {})
    given = {n: replace.get(n) if n in replace else cla.to_device(queue, np.full(s, SENTINEL, np.float32))
             for n, s in SPECS[op].outs.items()}
    # The bytes of every given keyword array that can be read back whole.
    before = {n: a.get().tobytes() for n, a in given.items()
              if isinstance(a, cla.Array) and a.flags.c_contiguous and a.offset == 0}
    with pytest.raises(exc) as info:
        call(queue, op, dict(replace, **given), **kwargs)
    assert named in str(info.value), f"{op}: {info.value!r} does not name {named!r}"
    assert not seen, f"{op}: launched {seen} before refusing"
    queue.finish()
    changed = [n for n, b in before.items() if given[n].get().tobytes() != b]
    assert not changed, f"{op}: given arrays {changed} were written"


@pytest.mark.parametrize("op, what, named, exc, make", ROWS, ids=[f"{r[0]}-{r[2]}-{r[1]}" for r in ROWS])
def test_bad_input_is_refused(queue, monkeypatch, op, what, named, exc, make):
    if make is None:  # the queue itself is the bad argument
        with pytest.raises(exc, match=named):
            SPECS[op].fn("not a queue", *[_array(queue, s) for s in SPECS[op].ins.values()])
        return
    _check_refused(queue, monkeypatch, op, named, exc, make(queue))


# (op, output): the inputs that output may be exactly; every elementwise op's out, da, db may be its a, b, dc
IN_PLACE = {("add_rms_norm", "s"): ("a", "b"), ("add_rms_norm", "out"): ("a", "b"), ("add_rms_norm_bwd", "dx"): ("ds",)}


def _sharing_pairs():
    """(op, output, other): each given output with each input and each later output, except the
    inputs an output of the same size may be exactly (README: in place)."""
    rows = []
    for op, spec in SPECS.items():
        outs = [n for n in spec.outs if n != "row_weight"]  # swiglu_limit's row_weight is an input
        ins = list(spec.ins) + [n for n in spec.outs if n == "row_weight"]
        shapes = {**spec.ins, **spec.outs}
        elementwise = spec.fn.__module__ == "clops.elementwise"
        rows += [(op, o, x) for i, o in enumerate(outs) for x in ins + outs[i + 1:]
                 if not (x in (("a", "b", "dc") if elementwise else IN_PLACE.get((op, o), ()))
                         and np.prod(shapes[o]) == np.prod(shapes[x]))]
    return rows


@pytest.mark.parametrize("op, out, other", _sharing_pairs(), ids=lambda x: x)
def test_outputs_sharing_memory_are_refused(queue, monkeypatch, op, out, other):
    """Two views from offset 0 of one buffer, whatever their shapes, given as the output and the other
    array: refused naming both, nothing launched, nothing written."""
    shapes = {**SPECS[op].ins, **SPECS[op].outs}
    sizes = {n: int(np.prod(shapes[n])) for n in (out, other)}
    shared = _array(queue, max(sizes.values()), seed=5)
    replace = {n: shared[:sizes[n]].reshape(shapes[n]) for n in (out, other)}
    _check_refused(queue, monkeypatch, op, f"{out}: shares memory with {other}", ValueError, {"replace": replace})


# Template parameters the device cannot hold, through clops.tuning.override: (op, tuning op, shape
# class, parameters, the limit the error must name[, keyword arguments of the op call]).
LIMITS = [
    ("add", "elementwise", {}, lambda dev: {"wg": 2 * dev.max_work_group_size, "vw": 4, "ept": 1}, "work-items"),
    ("rms_norm", "rms_norm", {"d": D, "st": "float"},
     lambda dev: {"wg": 2 * dev.max_work_group_size, "vw": 4, "rpg": 1, "rr": 1}, "work-items"),
    ("rms_norm_bwd", "rms_norm_bwd", {"d": D, "st": "float"},
     lambda dev: {"wg": 2 * dev.max_work_group_size, "vw": 4, "rpg": 1, "rr": 1}, "work-items"),
    ("rms_norm_dw", "rms_norm_dw", {"d": D, "st": "float"}, lambda dev: {"wg": 2 * dev.max_work_group_size, "vw": 4, "rb": 2},
     "work-items"),
    ("qk_norm_rope", "qk_norm_rope", {"hd": QD, "st": "float"},
     lambda dev: {"wg": 2 * dev.max_work_group_size, "vw": 4, "upg": 1, "gpc": 1, "hpw": 1, "pf": 1}, "work-items"),
    ("attention", "attention_fwd", {"hd": HD},
     lambda dev: {"bq": 2 * dev.max_work_group_size, "rq": 1, "tx": 1, "bk": 8, "vw": 1, "dc": 8, "kc": 8},
     "work-items"),
    ("attention", "attention_fwd", {"hd": HD},
     lambda dev: {"bq": 8, "rq": 1, "tx": 1, "bk": dev.local_mem_size // 32, "vw": 1, "dc": 8, "kc": 8},
     "local memory"),
    # (bq/sq)·(bk/sk) = (bq/tr)·(hd/td) = wg: 2 × the device's work-group limit
    ("attention_bwd", "attention_bwd_dq", {"hd": HD},
     lambda dev: {"wg": 2 * dev.max_work_group_size, "bq": dev.max_work_group_size // 4, "bk": 8, "sq": 1, "sk": 1,
                  "dc": 8, "jc": 8, "tr": 1, "td": 1, "vw": 1, "split": 1}, "work-items", {"store_ds": False}),
    ("attention_bwd", "attention_bwd_dqs", {"hd": HD},
     lambda dev: {"wg": 2 * dev.max_work_group_size, "bq": dev.max_work_group_size // 4, "jc": 8, "tr": 1, "td": 1,
                  "vw": 1}, "work-items", {"store_ds": True}),
    ("attention_bwd", "attention_bwd_dqs", {"hd": HD},
     lambda dev: {"wg": 8, "bq": 8, "jc": dev.local_mem_size // 32, "tr": 1, "td": HD, "vw": 1}, "local memory",
     {"store_ds": True}),
]


@pytest.mark.parametrize("op, tuned, shape_class, params, named, kw", [r if len(r) == 6 else r + ({},) for r in LIMITS],
                         ids=[f"{r[1]}-{r[4]}" for r in LIMITS])
def test_parameters_beyond_the_device_are_refused(queue, monkeypatch, op, tuned, shape_class, params, named, kw):
    tuning.override(tuned, shape_class, params(queue.device), device=queue.device)
    try:
        _check_refused(queue, monkeypatch, op, named, ValueError, dict(kw))
    finally:
        tuning.override(tuned, shape_class, None, device=queue.device)


@pytest.mark.parametrize("op", sorted(SPECS))
def test_valid_call_runs(queue, op):
    """The table's valid calls are valid: every refusal above comes from the one bad argument."""
    outs = call(queue, op)
    queue.finish()
    assert all(np.isfinite(a.get()).all() for a in outs.values())


@pytest.mark.parametrize("op", ["embedding", "embedding_bwd", "cross_entropy", "cross_entropy_bwd"])
def test_host_indices_are_copied_only_for_calls_accepted(queue, monkeypatch, op):
    """Host ids / targets are checked with the other arguments and copied only once all pass: a call refused
    on a later argument enqueues nothing, not even their copy (whose pending event, kept past a refusal,
    outlived its queue at exit on Intel's runtime). The same call accepted makes the one copy."""
    ids = np.array([1, 0, 2], np.int32)
    table, rows = cla.to_device(queue, rnd((4, 8), 1)), cla.to_device(queue, rnd((3, 8), 2))
    lse, dloss = cla.to_device(queue, rnd(3, 3)), cla.to_device(queue, rnd(3, 4))
    bad = cla.zeros(queue, 5, np.float32)
    calls = {
        "embedding": lambda **kw: clops.embedding(queue, table, ids, **kw),
        "embedding_bwd": lambda **kw: clops.embedding_bwd(queue, ids, rows, vocab=4, **kw),
        "cross_entropy": lambda **kw: clops.cross_entropy(queue, rows, ids, **kw),
        "cross_entropy_bwd": lambda **kw: clops.cross_entropy_bwd(queue, rows, ids, lse, dloss, **kw),
    }
    out = {"embedding": "out", "embedding_bwd": "dtable", "cross_entropy": "loss", "cross_entropy_bwd": "dlogits"}[op]
    queue.finish()
    copies, copy = [], cl.enqueue_copy
    monkeypatch.setattr(cl, "enqueue_copy", lambda *a, **kw: copies.append(a) or copy(*a, **kw))
    with pytest.raises(ValueError, match=f"{out}: expected shape"):
        calls[op](**{out: bad})
    assert copies == []
    calls[op]()
    assert len(copies) == 1
    queue.finish()
