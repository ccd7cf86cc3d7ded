"""Every op, forward and backward, gives the same bits on repeated runs (no float atomics,
fixed reduction orders), at shapes with many work-groups, row blocks and query/key tiles."""
import numpy as np
import pyopencl.array as cla
import pytest

import clops
from clops import reference as ref
from clops.reference import rnd
from helpers import to_device

RUNS = 3


def _elementwise(queue):
    rows, width = 33, 257
    a, b, dc = to_device(queue, rnd((rows, width), 1, 3.0), rnd((rows, width), 2, 2.0), rnd((rows, width), 3))
    gate, rw = to_device(queue, rnd(width, 4), rnd(rows, 5))
    return {
        "swiglu": lambda: [clops.swiglu(queue, a, b)],
        "swiglu_bwd": lambda: clops.swiglu_bwd(queue, a, b, dc),
        "swiglu_limit": lambda: [clops.swiglu_limit(queue, a, b, limit=1.5, scale=0.5, row_weight=rw)],
        "swiglu_gated": lambda: [clops.swiglu_gated(queue, a, b, gate)],
        "swiglu_gated_bwd": lambda: clops.swiglu_gated_bwd(queue, a, b, gate, dc),
        "sigmoid_gate": lambda: [clops.sigmoid_gate(queue, a, b)],
        "sigmoid_gate_bwd": lambda: clops.sigmoid_gate_bwd(queue, a, b, dc),
        "add": lambda: [clops.add(queue, a, b)],
    }


def _norm(queue):
    n, d = 300, 96
    x, w, dy = to_device(queue, rnd((n, d), 6, 2.0), rnd(d, 7, 0.5), rnd((n, d), 8))
    _, inv = clops.rms_norm(queue, x, w)
    base = rnd(d, 9)
    return {
        "rms_norm": lambda: list(clops.rms_norm(queue, x, w, gemma=True)),
        "rms_norm_bwd": lambda: [clops.rms_norm_bwd(queue, x, w, inv, dy)],
        "rms_norm_dw": lambda: [clops.rms_norm_dw(queue, x, inv, dy)],
        "rms_norm_dw (accumulated)": lambda: [clops.rms_norm_dw(queue, x, inv, dy, dw=cla.to_device(queue, base))],
        "rms_norm_bwd (one pass)": lambda: list(clops.rms_norm_bwd(queue, x, w, inv, dy, want_dw=True)),
        "add_rms_norm": lambda: list(clops.add_rms_norm(queue, x, dy, w)),
        "add_rms_norm_bwd": lambda: list(clops.add_rms_norm_bwd(queue, x, w, inv, dy, x, dw=cla.to_device(queue, base))),
    }


def _qk_norm_rope(queue):
    n, heads, hd, half = 40, 4, 64, 16
    x, w, dy = to_device(queue, rnd((n, heads, hd), 10, 2.0), rnd(hd, 11, 0.5), rnd((n, heads, hd), 12))
    rope = cla.to_device(queue, ref.rope_table(20, half))
    _, inv = clops.qk_norm_rope(queue, x, w, rope)
    return {
        "qk_norm_rope": lambda: list(clops.qk_norm_rope(queue, x, w, rope)),
        "qk_norm_rope_bwd": lambda: list(clops.qk_norm_rope_bwd(queue, x, w, inv, rope, dy)),
    }


def _attention(queue):
    windows, window, nh, nkv, hd = 2, 67, 4, 2, 32
    n = windows * window
    q, k, v, do = to_device(queue, rnd((n, nh, hd), 13), rnd((n, nkv, hd), 14), rnd((n, nkv, hd), 15),
                       rnd((n, nh, hd), 16))
    o, lse = clops.attention(queue, q, k, v, window=window)
    return {
        "attention": lambda: list(clops.attention(queue, q, k, v, window=window)),
        "attention_bwd (dS stored)": lambda: list(clops.attention_bwd(queue, q, k, v, o, lse, do, window=window,
                                                                       store_ds=True)),
        "attention_bwd (dS recomputed)": lambda: list(clops.attention_bwd(queue, q, k, v, o, lse, do, window=window,
                                                                           store_ds=False)),
    }


FAMILIES = {"elementwise": _elementwise, "norm": _norm, "qk_norm_rope": _qk_norm_rope, "attention": _attention}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_repeated_runs_are_bitwise_identical(queue, family):
    for op, run in FAMILIES[family](queue).items():
        first = [a.get() for a in run()]
        assert all(np.isfinite(a).all() for a in first), op
        for _ in range(RUNS - 1):
            again = [a.get() for a in run()]
            same = [a.tobytes() == b.tobytes() for a, b in zip(first, again)]
            assert all(same), f"{op}: output {same.index(False)} differs between runs"
