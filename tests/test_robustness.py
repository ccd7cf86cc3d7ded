"""Numerical robustness: RMSNorm rows of zeros and of large magnitude, attention logits of
magnitude 1e3 and 1e4, and a NaN that stays in the outputs depending on its row and does
not spread to the others."""
import ml_dtypes
import numpy as np
import pyopencl.array as cla
import pytest

import clops
from clops import reference as ref
from clops import tuning
from clops.attn import bwd_heuristic
from clops.reference import rel_err, rnd
from helpers import ROW_OPS, assert_storage_close, norm_override, storage_override, to_device


def _get(*arrays):
    return [a.get() for a in arrays]


# ---- RMSNorm extremes ----

@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_rows_of_zeros(queue, gemma):
    n, d = 9, 96
    x, w, dy = rnd((n, d), 1, 2.0), rnd(d, 2, 0.5), rnd((n, d), 3, 1.0)
    x[[0, 4, 8]] = 0.0
    x_, w_, dy_ = to_device(queue, x, w, dy)
    y, inv = _get(*clops.rms_norm(queue, x_, w_, gemma=gemma))
    assert np.all(y[[0, 4, 8]] == 0.0)
    assert np.allclose(inv[[0, 4, 8]], 1.0 / np.sqrt(np.float32(1e-6)), rtol=1e-6)
    wy, winv = ref.rms_norm(x, w, gemma=gemma)
    assert rel_err(y, wy) <= 1e-6 and rel_err(inv, winv) <= 1e-6
    inv_ = cla.to_device(queue, inv)
    dx = clops.rms_norm_bwd(queue, x_, w_, inv_, dy_, gemma=gemma).get()
    dw = clops.rms_norm_dw(queue, x_, inv_, dy_).get()
    assert np.isfinite(dx).all() and np.isfinite(dw).all()
    assert rel_err(dx, ref.rms_norm_bwd(x, w, winv, dy, gemma=gemma)) <= 1e-5
    assert rel_err(dw, ref.rms_norm_dw(x, winv, dy)) <= 1e-5


@pytest.mark.parametrize("magnitude", [1e4, 1e-4])
def test_rms_norm_large_and_small_rows(queue, magnitude):
    n, d = 7, 160
    x, w, dy = rnd((n, d), 4, magnitude), rnd(d, 5, 0.5), rnd((n, d), 6, 1.0)
    x_, w_, dy_ = to_device(queue, x, w, dy)
    y, inv = clops.rms_norm(queue, x_, w_, eps=0.0 if magnitude < 1 else 1e-6)
    wy, winv = ref.rms_norm(x, w, eps=0.0 if magnitude < 1 else 1e-6)
    assert rel_err(y.get(), wy) <= 1e-6 and rel_err(inv.get(), winv) <= 1e-6
    assert rel_err(clops.rms_norm_bwd(queue, x_, w_, inv, dy_).get(), ref.rms_norm_bwd(x, w, winv, dy)) <= 1e-5
    assert rel_err(clops.rms_norm_dw(queue, x_, inv, dy_).get(), ref.rms_norm_dw(x, winv, dy)) <= 1e-5


# ---- rows outside float32's square range (#19) ----
# x² overflows float32 from |x| ≈ 1.8e19 and is subnormal below |x| ≈ 1e-19. Rows at 1e30 and 1e-30
# (ramped: magnitudes over three decades), one flat near float32's top (rms > 2^126: inv subnormal,
# so the backward takes 1/rms again from x), one flat at 1e-40 (rms < 2^−128: inv = inf, dx past
# float32; y and dw still right) and normal rows, in one call, eps = 0. Tolerances per row (rel_err's
# floor would hide the tiny ones): float32 1e-6 forward, 1e-5 gradients; bfloat16 (float32's range)
# the storage rule at the row's scale.
SCALES = [1.0, 1e30, 3.0, 1e-30, 2e38, 0.1, 1e-40]
FLAT = {2e38, 1e-40}
INF_INV = SCALES.index(1e-40)
RANGE_DTYPES = [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)]


def _extreme_rows(shape, seed, dtype):
    """[len(SCALES), ...] rows (the first axis), magnitudes in [ramp/2, ramp]·scale, signs random."""
    u = rnd(shape, seed).astype(np.float64)
    ramp = np.geomspace(1e-3, 1.0, shape[-1])
    x = np.sign(u) * (1 + np.abs(u)) / 2 * np.stack([np.ones(shape[1:]) if s in FLAT else np.broadcast_to(ramp, shape[1:])
                                                     for s in SCALES])
    return (x * np.reshape(SCALES, (-1,) + (1,) * (len(shape) - 1))).astype(np.float32).astype(dtype)


def _rows_close(name, got, want, dtype, tol, rows=None):
    """Each row (last axis; units flattened) within tol (float32) or the storage rule (16-bit)."""
    got = np.asarray(got.get() if hasattr(got, "get") else got)
    got, want = got.reshape(-1, got.shape[-1]), np.asarray(want, np.float64).reshape(-1, got.shape[-1])
    keep = np.ones(len(got), bool) if rows is None else rows
    if got.dtype == np.float32:
        errs = np.linalg.norm(got[keep].astype(np.float64) - want[keep], axis=1) / np.linalg.norm(want[keep], axis=1)
        assert np.all(errs <= tol), f"{name}: relative errors per row {errs}"
    else:
        assert_storage_close(name, got[keep], want[keep], dtype, tol)


def _inv_close(got, want, inf_rows):
    """inv: within 1e-6 of 1/rms, and inf where 1/rms is past float32."""
    got, want = got.get().ravel().astype(np.float64), want.ravel()
    assert np.all(np.isinf(got[inf_rows])), got
    assert np.all(np.abs(got[~inf_rows] / want[~inf_rows] - 1) <= 1e-6), got / want - 1


@pytest.mark.parametrize("dtype", RANGE_DTYPES, ids=str)
@pytest.mark.parametrize("d,rows,pf", [(300, None, None), (300, dict(wg=64, vw=4, rpg=1, rr=1), 3),  # loaded ahead
                                       (4097, dict(wg=32, vw=1, rpg=1, rr=1), None)])  # 4097: read twice
def test_rms_norm_rows_outside_the_square_range(queue, dtype, d, rows, pf):
    x, w, dy = _extreme_rows((len(SCALES), d), 25, dtype), rnd(d, 26, 0.5), rnd((len(SCALES), d), 27, 4.0).astype(dtype)
    x_, w_, dy_ = to_device(queue, x, w, dy)
    inf_rows = np.arange(len(SCALES)) == INF_INV
    norm_override(ROW_OPS, d, rows)
    norm_override("rms_norm_bwd_dw", d, pf and dict(rows, gpc=1, pf=pf))  # the one pass walks every row
    try:
        y, inv = clops.rms_norm(queue, x_, w_, eps=0.0)
        dx = clops.rms_norm_bwd(queue, x_, w_, inv, dy_, eps=0.0)
        dx1, dw1 = clops.rms_norm_bwd(queue, x_, w_, inv, dy_, eps=0.0, want_dw=True)
        dw = clops.rms_norm_dw(queue, x_, inv, dy_)
    finally:
        norm_override((*ROW_OPS, "rms_norm_bwd_dw"), d, None)
    wy, winv = ref.rms_norm(x, w, eps=0.0)
    _rows_close("y", y, wy, dtype, 1e-6)
    _inv_close(inv, winv, inf_rows)
    wdx, wdw = ref.rms_norm_bwd(x, w, winv, dy), ref.rms_norm_dw(x, winv, dy)
    _rows_close("dx", dx, wdx, dtype, 1e-5, ~inf_rows)
    _rows_close("dx (one pass)", dx1, wdx, dtype, 1e-5, ~inf_rows)
    assert rel_err(dw.get(), wdw) <= 1e-5 and rel_err(dw1.get(), wdw) <= 1e-5


@pytest.mark.parametrize("dtype", RANGE_DTYPES, ids=str)
def test_add_rms_norm_rows_outside_the_square_range(queue, dtype):
    d = 300
    a, b = _extreme_rows((len(SCALES), d), 31, dtype), (_extreme_rows((len(SCALES), d), 32, np.float32) / 4).astype(dtype)
    w, dy, ds = rnd(d, 33, 0.5), rnd((len(SCALES), d), 34, 4.0).astype(dtype), rnd((len(SCALES), d), 35).astype(dtype)
    a_, b_, w_, dy_, ds_ = to_device(queue, a, b, w, dy, ds)
    inf_rows = np.arange(len(SCALES)) == INF_INV
    s, y, inv = clops.add_rms_norm(queue, a_, b_, w_, eps=0.0)
    dx, dw = clops.add_rms_norm_bwd(queue, s, w_, inv, dy_, ds_, eps=0.0)
    ws, wy, winv = ref.add_rms_norm(a, b, w, eps=0.0)
    _rows_close("s", s, ws, dtype, 1e-6)
    _rows_close("y", y, wy, dtype, 1e-6)
    _inv_close(inv, winv, inf_rows)
    # The backward's x is the stored s, its inv the device's (of the float32 sum), except where that is
    # not a normal float (inf, subnormal): the kernels take 1/rms of x = s again there.
    dinv = inv.get()
    normal = np.isfinite(dinv) & (dinv >= np.finfo(np.float32).tiny)
    sinv = np.where(normal, dinv, ref.rms_norm(s.get(), w, eps=0.0)[1])
    wdx, wdw = ref.add_rms_norm_bwd(s.get(), w, sinv, dy, ds)
    _rows_close("dx", dx, wdx, dtype, 1e-5, ~inf_rows)
    assert rel_err(dw.get(), wdw) <= 1e-5


@pytest.mark.parametrize("dtype", RANGE_DTYPES, ids=str)
@pytest.mark.parametrize("hd,half,params", [
    (128, 32, dict(wg=64, vw=4, upg=8, gpc=1, hpw=1, pf=3)),  # 8 work-items a unit (the GPU heuristic's layout at
                                                              # hd 128), the next step loaded during the sum
    (128, 32, dict(wg=64, vw=4, upg=4, gpc=1, hpw=2, pf=3)),  # two units a segment, one after the other
    (36, 6, dict(wg=64, vw=4, upg=1, gpc=2, hpw=1, pf=2)),    # an odd rotary half's vw 2, 15 slots over 64 work-items
                                                              # (the tree), the next step prefetched
    (64, 0, None),                               # no rotation; the device's layout
])
def test_qk_norm_rope_units_outside_the_square_range(queue, dtype, hd, half, params):
    heads = 2
    x = _extreme_rows((len(SCALES), heads, hd), 28, dtype)
    x[:, 1] = x[::-1, 1]  # the units of a row at different scales
    w, dy = rnd(hd, 29, 0.5), rnd(x.shape, 30, 4.0).astype(dtype)
    table = ref.rope_table(len(SCALES), max(half, 1))[:, :half]
    x_, w_, dy_ = to_device(queue, x, w, dy)
    rope_ = cla.to_device(queue, np.ascontiguousarray(table)) if half else None
    storage_override("qk_norm_rope", {"hd": hd}, params)
    try:
        y, inv = clops.qk_norm_rope(queue, x_, w_, rope_, eps=0.0)
        dx, dw = clops.qk_norm_rope_bwd(queue, x_, w_, inv, rope_, dy_)
    finally:
        storage_override("qk_norm_rope", {"hd": hd}, None)
    wy, winv = ref.qk_norm_rope(x, w, table, eps=0.0)
    wdx, wdw = ref.qk_norm_rope_bwd(x, w, winv, table, dy)
    inf_units = np.zeros((len(SCALES), heads), bool)
    inf_units[INF_INV, 0] = inf_units[len(SCALES) - 1 - INF_INV, 1] = True
    _rows_close("y", y, wy, dtype, 1e-6)
    _inv_close(inv, winv, inf_units.ravel())
    _rows_close("dx", dx, wdx, dtype, 1e-5, ~inf_units.ravel())
    assert rel_err(dw.get(), wdw) <= 1e-5


def test_qk_norm_rope_units_of_zeros(queue):
    n, heads, hd, half = 6, 3, 64, 16
    x, w, dy = rnd((n, heads, hd), 7, 2.0), rnd(hd, 8, 0.5), rnd((n, heads, hd), 9, 1.0)
    x[2, 1] = 0.0
    table = ref.rope_table(n, half)
    x_, w_, dy_, rope_ = to_device(queue, x, w, dy, table)
    y, inv = clops.qk_norm_rope(queue, x_, w_, rope_)
    assert np.all(y.get()[2, 1] == 0.0) and np.isfinite(inv.get()).all()
    dx, dw = clops.qk_norm_rope_bwd(queue, x_, w_, inv, rope_, dy_)
    wdx, wdw = ref.qk_norm_rope_bwd(x, w, ref.qk_norm_rope(x, w, table)[1], table, dy)
    assert rel_err(dx.get(), wdx) <= 1e-5 and rel_err(dw.get(), wdw) <= 1e-5


# ---- attention with large logits ----

@pytest.mark.parametrize("logit", [1e3, 1e4])
def test_attention_large_logits(queue, logit):
    windows, window, nh, nkv, hd = 2, 33, 4, 2, 32
    n = windows * window
    # Scores q·k·scale of standard deviation ≈ logit (uniform entries of variance amp²/3): a softmax
    # close to one-hot, far outside exp's range without the running max.
    amp = np.sqrt(3.0 * logit)
    q, k, v, do = rnd((n, nh, hd), 10, amp), rnd((n, nkv, hd), 11, amp), rnd((n, nkv, hd), 12), rnd((n, nh, hd), 13)
    q_, k_, v_, do_ = to_device(queue, q, k, v, do)
    o, lse = clops.attention(queue, q_, k_, v_, window=window)
    wo, wlse = ref.attention(q, k, v, window=window)
    assert np.abs(wlse).max() > logit
    assert np.isfinite(o.get()).all() and np.isfinite(lse.get()).all()
    assert rel_err(o.get(), wo) <= 1e-5 and rel_err(lse.get(), wlse) <= 1e-6
    dq, dk, dv = [g.get() for g in clops.attention_bwd(queue, q_, k_, v_, o, lse, do_, window=window)]
    wdq, wdk, wdv = ref.attention_bwd(q, k, v, wo, wlse, do, window=window)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    # A float32 score s carries a rounding error of about |s|·2⁻²⁴·√hd, which exp turns into a
    # relative error of the weights P = exp(s − lse): the backward's tolerance grows with the logit.
    tol = 2e-7 * logit
    assert rel_err(dv, wdv) <= tol
    # dS = P·(dP − D) cancels to about 0 when P is one-hot, so dQ and dK are tiny and their
    # relative error means nothing; their error is bounded by the scale of their terms instead.
    natural = amp / np.sqrt(hd) * np.abs(do).max() * np.abs(v).max()
    for name, got, want in (("dq", dq, wdq), ("dk", dk, wdk)):
        assert np.abs(got - want).max() <= tol * natural, name


# ---- a NaN stays where it belongs ----

def _nan_exactly(got, where, what):
    """``got`` is NaN exactly where the boolean mask ``where`` is set."""
    bad = np.isnan(got) != where
    assert not bad.any(), f"{what}: NaN pattern differs at {np.argwhere(bad)[:5].tolist()}"


def test_elementwise_nan_stays_in_its_element(queue):
    rows, width = 5, 67
    a, b, dc = rnd((rows, width), 14, 3.0), rnd((rows, width), 15, 2.0) + 3.0, rnd((rows, width), 16) + 2.0
    gate, rw = rnd(width, 17) + 2.0, rnd(rows, 18) + 2.0
    a[2, 30] = np.nan
    only = np.zeros((rows, width), bool)
    only[2, 30] = True
    a_, b_, dc_, g_, rw_ = to_device(queue, a, b, dc, gate, rw)
    outs = {
        "swiglu": [clops.swiglu(queue, a_, b_)],
        "swiglu_bwd": clops.swiglu_bwd(queue, a_, b_, dc_),
        "swiglu_limit": [clops.swiglu_limit(queue, a_, b_, limit=0.0, scale=0.5, row_weight=rw_)],
        "swiglu_gated": [clops.swiglu_gated(queue, a_, b_, g_)],
        "swiglu_gated_bwd": clops.swiglu_gated_bwd(queue, a_, b_, g_, dc_),
        "sigmoid_gate": [clops.sigmoid_gate(queue, a_, b_)],
        "sigmoid_gate_bwd": clops.sigmoid_gate_bwd(queue, a_, b_, dc_),
        "add": [clops.add(queue, a_, b_)],
    }
    none = np.zeros_like(only)
    for op, arrays in outs.items():
        # Every output depends on a, except sigmoid_gate_bwd's da = dc·σ(b).
        for got, where in zip(arrays, (none, only) if op == "sigmoid_gate_bwd" else (only, only)):
            _nan_exactly(got.get(), where, op)
    # A NaN gate column, a NaN row weight: that column, that row.
    gate[11], rw[3] = np.nan, np.nan
    g_, rw_ = to_device(queue, gate, rw)
    col, row = np.zeros((rows, width), bool), np.zeros((rows, width), bool)
    col[:, 11], row[3] = True, True
    b_clean = cla.to_device(queue, b)
    a_clean = cla.to_device(queue, rnd((rows, width), 14, 3.0))
    _nan_exactly(clops.swiglu_gated(queue, a_clean, b_clean, g_).get(), col, "swiglu_gated gate")
    _nan_exactly(clops.swiglu_limit(queue, a_clean, b_clean, limit=0.0, row_weight=rw_).get(), row,
                 "swiglu_limit row_weight")


def test_norm_nan_stays_in_its_row(queue):
    n, d = 8, 48
    x, w, dy = rnd((n, d), 19, 2.0), rnd(d, 20, 0.5), rnd((n, d), 21)
    x[5, 17] = np.nan
    rows = np.zeros((n, d), bool)
    rows[5] = True
    x_, w_, dy_ = to_device(queue, x, w, dy)
    y, inv = clops.rms_norm(queue, x_, w_)
    _nan_exactly(y.get(), rows, "rms_norm y")
    _nan_exactly(inv.get(), rows[:, 0], "rms_norm inv")
    _nan_exactly(clops.rms_norm_bwd(queue, x_, w_, inv, dy_).get(), rows, "rms_norm_bwd")
    assert np.isnan(clops.rms_norm_dw(queue, x_, inv, dy_).get()).all()  # a sum over every row


def test_qk_norm_rope_nan_stays_in_its_unit(queue):
    n, heads, hd, half = 6, 3, 32, 8
    x, w, dy = rnd((n, heads, hd), 22, 2.0), rnd(hd, 23, 0.5), rnd((n, heads, hd), 24)
    x[4, 2, 3] = np.nan
    unit = np.zeros((n, heads, hd), bool)
    unit[4, 2] = True
    x_, w_, dy_, rope_ = to_device(queue, x, w, dy, ref.rope_table(3, half))
    y, inv = clops.qk_norm_rope(queue, x_, w_, rope_)
    _nan_exactly(y.get(), unit, "qk_norm_rope y")
    _nan_exactly(inv.get(), unit[..., 0], "qk_norm_rope inv")
    dx, dw = clops.qk_norm_rope_bwd(queue, x_, w_, inv, rope_, dy_)
    _nan_exactly(dx.get(), unit, "qk_norm_rope_bwd dx")
    assert np.isnan(dw.get()).all()


WINDOWS, WINDOW, NH, NKV, HD = 3, 70, 4, 2, 16  # several key blocks per window at the usual tiles
N = WINDOWS * WINDOW
NAN_AT = {"q": (WINDOW + 40, 3, 5), "k": (2 * WINDOW + 9, 0, 2), "v": (2 * WINDOW + 33, 1, 7),
          "do": (WINDOW + 2, 2, 11)}  # (token, head, column) of the NaN in each input


def _attention(queue, q, k, v, do, store_ds):
    q_, k_, v_, do_ = to_device(queue, q, k, v, do)
    o, lse = clops.attention(queue, q_, k_, v_, window=WINDOW)
    dq, dk, dv = clops.attention_bwd(queue, q_, k_, v_, o, lse, do_, window=WINDOW, store_ds=store_ds)
    return {name: a.get() for name, a in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv))}


def _nan_pattern(source):
    """Where the outputs must be NaN (and only there) for a NaN at NAN_AT[source]: the entries that
    depend on it in exact arithmetic, masked score entries counting as absent, not as zeros."""
    tok, head, col = NAN_AT[source]
    rep = NH // NKV
    g = head if source in ("k", "v") else head // rep  # kv head of the NaN
    heads = slice(g * rep, (g + 1) * rep)  # query heads reading kv head g
    win = slice(tok // WINDOW * WINDOW, (tok // WINDOW + 1) * WINDOW)
    upto, after = slice(win.start, tok + 1), slice(tok, win.stop)  # keys ≤ tok; rows ≥ tok
    want = {"o": np.zeros((N, NH, HD), bool), "lse": np.zeros((N, NH), bool),
            "dq": np.zeros((N, NH, HD), bool), "dk": np.zeros((N, NKV, HD), bool),
            "dv": np.zeros((N, NKV, HD), bool)}
    if source == "q":  # its row's scores: o, lse, dq of the row; dK, dV of the keys it sees
        want["o"][tok, head] = want["lse"][tok, head] = want["dq"][tok, head] = True
        want["dk"][upto, g] = want["dv"][upto, g] = True
    elif source == "k":  # a score of every row from tok on, whose lse then carries it to the window's dK, dV
        want["o"][after, heads] = want["lse"][after, heads] = want["dq"][after, heads] = True
        want["dk"][win, g] = want["dv"][win, g] = True
    elif source == "v":  # one column of o from tok on; D = Σ dO·O then makes dS rows NaN: dq, dk
        want["o"][after, heads, col] = want["dq"][after, heads] = True
        want["dk"][win, g] = True
    else:  # dO: D and dP of its row: dq of the row, dK of the keys it sees; dV in one column
        want["dq"][tok, head] = want["dk"][upto, g] = True
        want["dv"][upto, g, col] = True
    return want


# dc: the backward's two step-2 paths (restaged, or step 1's tiles), with dQ recomputed; and dQ
# from stored dS (which neither dc changes)
@pytest.mark.parametrize("dc, store_ds", [(HD // 2, False), (HD, False), (HD, True)])
@pytest.mark.parametrize("source", sorted(NAN_AT))
def test_attention_nan_stays_in_its_dependants(queue, source, dc, store_ds):
    inputs = dict(zip(("q", "k", "v", "do"), (rnd((N, NH, HD), 25), rnd((N, NKV, HD), 26),
                                               rnd((N, NKV, HD), 27), rnd((N, NH, HD), 28))))
    inputs[source][NAN_AT[source]] = np.nan
    ops = ("dkv", "dq")
    for kind in ops:
        tuning.override("attention_bwd_" + kind, {"hd": HD}, dict(bwd_heuristic(queue.device, kind, HD), dc=dc))
    try:
        got = _attention(queue, *inputs.values(), store_ds)
    finally:
        for kind in ops:
            tuning.override("attention_bwd_" + kind, {"hd": HD}, None)
    for name, where in _nan_pattern(source).items():
        _nan_exactly(got[name], where, f"{name} (NaN in {source})")
