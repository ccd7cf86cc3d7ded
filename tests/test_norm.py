"""RMSNorm parity (forward, dx, dw; both gain styles) at the seed's shape and edge shapes, launch-parameter
variants through the tuning override, deterministic dw, and bad input rejected before anything runs; the
same ops at float16 / bfloat16 storage.

Tolerances. float32 storage: relative L2 error against the float64 reference, 1e-6 forward (y, inv) and
1e-5 for the gradients (dx, dw). float16 / bfloat16 storage: the reference takes the same rounded inputs
(x, w, dy) and, for the backward, the device's own inv; every stored 16-bit output is within 1 ulp of
its dtype of the float64 result rounded once, the ulp taken at the row's scale (the largest |value| of
the row), plus the float32 tolerance above relative to that scale (tests/helpers.assert_storage_close);
float32 outputs (inv, rms_norm_dw's dw) keep the float32 tolerances."""
import ml_dtypes
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pytest

import clops
from clops import program
from clops import norm
from clops import reference as ref
from clops import tuning
from clops.program import OutOfBoundsError
from clops.reference import rel_err, rnd
from helpers import ROW_OPS, assert_storage_close, norm_override, storage_override, to_device


def _parity(queue, x, w, dy, gemma, eps=1e-6):
    X, W, DY = to_device(queue, x, w, dy)
    y, inv = clops.rms_norm(queue, X, W, eps=eps, gemma=gemma)
    wy, winv = ref.rms_norm(x, w, eps=eps, gemma=gemma)
    assert rel_err(y.get(), wy) <= 1e-6
    assert rel_err(inv.get(), winv) <= 1e-6
    dx = clops.rms_norm_bwd(queue, X, W, inv, DY, eps=eps, gemma=gemma)
    assert rel_err(dx.get(), ref.rms_norm_bwd(x, w, winv, dy, gemma=gemma)) <= 1e-5
    dw = clops.rms_norm_dw(queue, X, inv, DY)
    assert rel_err(dw.get(), ref.rms_norm_dw(x, winv, dy)) <= 1e-5
    return y.get(), inv.get()


SHAPES = [(37, 5120), (7, 1), (5, 3), (3, 4097), (1, 5120), (1, 1), (65, 8)]


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("n,d", SHAPES)
def test_matches_reference(queue, n, d, gemma):
    _parity(queue, rnd((n, d), 1, 3.0), rnd(d, 2, 0.5), rnd((n, d), 3, 1.0), gemma)


@pytest.mark.parametrize("gemma", [False, True])
def test_rows_of_zeros_and_large_values(queue, gemma):
    n, d = 9, 300
    x = rnd((n, d), 4, 1e4)
    x[[0, 4, 8]] = 0.0
    y, inv = _parity(queue, x, rnd(d, 5, 0.5), rnd((n, d), 6, 1.0), gemma)
    assert np.all(y[[0, 4, 8]] == 0.0)
    np.testing.assert_allclose(inv[[0, 4, 8]], 1.0 / np.sqrt(1e-6), rtol=1e-6)


def test_dw_adds_into_given_and_is_deterministic(queue):
    n, d = 300, 1000
    x, dy = rnd((n, d), 7, 2.0), rnd((n, d), 8, 1.0)
    _, inv = ref.rms_norm(x, rnd(d, 9, 1.0))
    inv = inv.astype(np.float32)
    X, INV, DY = to_device(queue, x, inv, dy)
    first = clops.rms_norm_dw(queue, X, INV, DY).get()
    for _ in range(3):
        assert clops.rms_norm_dw(queue, X, INV, DY).get().tobytes() == first.tobytes()
    base = rnd(d, 10, 5.0)
    (DW,) = to_device(queue, base)
    got = clops.rms_norm_dw(queue, X, INV, DY, dw=DW)
    assert got is DW
    assert rel_err(DW.get(), base + ref.rms_norm_dw(x, inv, dy)) <= 1e-5


@pytest.mark.parametrize("d,rows,dw", [
    (4097, dict(wg=32, vw=1, rpg=1, rr=1), dict(wg=32, vw=1, rb=7)),  # 129 vectors per work-item: read twice
    (5120, dict(wg=64, vw=8, rpg=2, rr=1), dict(wg=16, vw=8, rb=1)),
    (6, dict(wg=64, vw=4, rpg=16, rr=1), dict(wg=64, vw=16, rb=300)),  # vw capped to 2 (divides 6)
    (129, dict(wg=24, vw=2, rpg=3, rr=2), dict(wg=3, vw=2, rb=5)),  # groups not a power of two; read twice
])
def test_launch_parameters(queue, d, rows, dw):
    norm_override(ROW_OPS, d, rows)
    norm_override("rms_norm_dw", d, dw)
    _parity(queue, rnd((37, d), 11, 3.0), rnd(d, 12, 0.5), rnd((37, d), 13, 1.0), True)


def test_row_tiles_are_chosen_per_storage_type(queue):
    """The row families' shape class carries the activations' storage: an override at bfloat16 is not
    float32's, and the heuristic loads 16 bytes a vector at each (vw 8 at 16 bits, 4 at float32)."""
    d = 64
    for spec in (norm.ROWS, norm.ROWS_BWD, norm.BWD_DW, norm.ADD_BWD_DW, norm.DW):
        assert [spec.resolve(queue.device, {"d": 5120, "st": st})[0]["vw"] for st in ("float", "half", "bf16")] == [4, 8, 8]
    x = rnd((4, d), 1)
    X, W, XB = to_device(queue, x, rnd(d, 2), x.astype(ml_dtypes.bfloat16))
    tuning.override("rms_norm", {"d": d, "st": "bf16"}, dict(wg=64, vw=4, rpg=3, rr=1))
    try:
        clops.rms_norm(queue, X, W)  # float32: the heuristic's tiles
        with pytest.raises(ValueError, match="rpg must divide wg"):
            clops.rms_norm(queue, XB, W)
    finally:
        tuning.override("rms_norm", {"d": d, "st": "bf16"}, None)


def test_parameters_the_device_cannot_hold(queue):
    norm_override("rms_norm", 64, dict(wg=2 * queue.device.max_work_group_size, vw=4, rpg=1, rr=1))
    X, W = to_device(queue, rnd((4, 64), 1), rnd(64, 2))
    with pytest.raises(clops.LimitError, match="MAX_WORK_GROUP_SIZE"):
        clops.rms_norm(queue, X, W)
    norm_override("rms_norm", 64, dict(wg=64, vw=4, rpg=3, rr=1))
    with pytest.raises(ValueError, match="rpg must divide wg"):
        clops.rms_norm(queue, X, W)
    norm_override("rms_norm", 64, dict(wg=64, vw=4, rpg=1, rr=3))
    with pytest.raises(ValueError, match="rr must be 1 or 2"):
        clops.rms_norm(queue, X, W)


def test_rr_picks_whether_rows_are_held():
    """rr 1 holds a work-item's share of a row in registers (up to MAX_CACHED vectors), rr 2 reads it twice."""
    sc = {"d": 512, "st": "bf16"}
    for spec in (norm.ROWS, norm.BWD_DW):
        p = dict(wg=64, vw=8, rpg=1, rr=1, **({"gpc": 2, "pf": 1} if spec is norm.BWD_DW else {}))
        assert spec.render(p, sc)["cache"] and not spec.render(dict(p, rr=2), sc)["cache"]
        assert not spec.render(dict(p, vw=1, wg=8), {"d": 8 * (norm.MAX_CACHED + 1), "st": "bf16"})["cache"]


def test_bad_input_is_rejected_before_anything_runs(queue):
    n, d = 5, 12
    X, W, INV, DY = to_device(queue, rnd((n, d), 1), rnd(d, 2), rnd(n, 3), rnd((n, d), 4))
    sentinel = np.full(d, 7.0, np.float32)
    DW, OUT, DX = to_device(queue, sentinel, np.full((n, d), 7.0, np.float32), np.full((n, d), 7.0, np.float32))
    cases = [
        (ValueError, "dw", lambda: clops.rms_norm_dw(queue, X, INV, DY, dw=cla.zeros(queue, d + 1, np.float32))),
        (ValueError, "dy", lambda: clops.rms_norm_dw(queue, X, INV, to_device(queue, rnd((n, d + 1), 5))[0], dw=DW)),
        (ValueError, "inv", lambda: clops.rms_norm_dw(queue, X, to_device(queue, rnd(n + 1, 5))[0], DY, dw=DW)),
        (ValueError, "w", lambda: clops.rms_norm(queue, X, to_device(queue, rnd(d - 1, 5))[0], out=OUT)),
        (ValueError, "x", lambda: clops.rms_norm(queue, to_device(queue, rnd(n * d, 5))[0], W)),
        (TypeError, "x", lambda: clops.rms_norm(queue, cla.to_device(queue, np.zeros((n, d))), W, out=OUT)),
        (TypeError, "w", lambda: clops.rms_norm_bwd(queue, X, np.zeros(d, np.float32), INV, DY, dx=DX)),
        (ValueError, "eps", lambda: clops.rms_norm(queue, X, W, eps=float("nan"), out=OUT)),
        (ValueError, "dx", lambda: clops.rms_norm_bwd(queue, X, W, INV, DY, dx=DW)),
        (ValueError, "out", lambda: clops.rms_norm(queue, X, W, out=DW)),
    ]
    for exc, name, call in cases:
        with pytest.raises(exc, match=name):
            call()
    ctx2 = cl.Context([queue.device])  # held: Intel's runtime drops a context only its queue references
    other = cl.CommandQueue(ctx2)
    (X2,) = to_device(other, rnd((n, d), 1))
    with pytest.raises(ValueError, match="x: array belongs to another context"):
        clops.rms_norm(queue, X2, W, out=OUT)
    assert DW.get().tobytes() == sentinel.tobytes()
    assert np.all(OUT.get() == 7.0) and np.all(DX.get() == 7.0)


def test_checked_build_catches_out_of_range_rows(queue, monkeypatch):
    """The guards are in place: a launch for 5 rows over buffers of 2 raises in a checked build."""
    monkeypatch.setenv("CLOPS_CHECKED", "1")
    program.reload_switches()  # CLOPS_CHECKED is read once
    d = 64
    X, W = to_device(queue, rnd((2, d), 1), rnd(d, 2))
    y, inv = cla.empty(queue, (2, d), np.float32), cla.empty(queue, 2, np.float32)
    knl, groups, sizes = norm._row_kernel(queue, "rms_norm_fwd", 5, d)
    with pytest.raises(OutOfBoundsError, match=r"rms_norm_fwd .*(x|y|inv_out)\["):
        knl(queue, groups, [y.data, inv.data, X.data, W.data, *sizes, np.float32(1e-6), np.float32(0)])


# ---- float16 / bfloat16 storage ----

NARROW = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


@pytest.mark.parametrize("dtype", NARROW, ids=str)
@pytest.mark.parametrize("case", range(len(SHAPES) + 1))
def test_narrow_storage(queue, dtype, case):
    """rms_norm, rms_norm_bwd and rms_norm_dw at 16-bit storage, at every edge shape and rows of zeros
    and of 1e4; the gain style and the gain's dtype (float32 or the activations') alternate."""
    if case < len(SHAPES):
        (n, d), scale = SHAPES[case], 3.0
    else:
        (n, d), scale = (9, 300), 1e4
    x, dy = rnd((n, d), 1, scale).astype(dtype), rnd((n, d), 3, 1.0).astype(dtype)
    if case == len(SHAPES):
        x[[0, 4, 8]] = 0
    gemma, wdtype = case % 2 == 1, dtype if case % 4 < 2 else np.dtype(np.float32)
    w = rnd(d, 2, 0.5).astype(wdtype)
    X, W, DY = to_device(queue, x, w, dy)
    y, inv = clops.rms_norm(queue, X, W, gemma=gemma)
    wy, winv = ref.rms_norm(x, w, gemma=gemma)
    assert_storage_close("y", y, wy, dtype, 1e-6)
    assert inv.dtype == np.float32 and rel_err(inv.get(), winv) <= 1e-6
    dx = clops.rms_norm_bwd(queue, X, W, inv, DY, gemma=gemma)
    # The stored inv, except at d = 1: there dx = inv·w·dy·(1 − x²·inv²) cancels to w·dy·eps·inv³, and the
    # formula's float64 value at a float32 inv is off by inv's rounding; the float64 inv is taken (as above).
    assert_storage_close("dx", dx, ref.rms_norm_bwd(x, w, winv if d == 1 else inv.get(), dy, gemma=gemma), dtype,
                         1e-5)
    base = rnd(d, 4, 2.0)
    (DW,) = to_device(queue, base)
    assert clops.rms_norm_dw(queue, X, inv, DY, dw=DW) is DW
    wdw = ref.rms_norm_dw(x, inv.get(), dy)
    assert rel_err(DW.get(), base + wdw) <= 1e-5
    dw = clops.rms_norm_dw(queue, X, inv, DY)
    assert dw.dtype == np.float32 and rel_err(dw.get(), wdw) <= 1e-5
    if case == len(SHAPES):
        assert np.all(y.get()[[0, 4, 8]] == 0)


def test_narrow_dtypes_are_checked(queue):
    n, d = 3, 8
    xb = cla.to_device(queue, rnd((n, d), 1).astype(ml_dtypes.bfloat16))
    wh = cla.to_device(queue, rnd(d, 2).astype(np.float16))
    w32, inv = cla.to_device(queue, rnd(d, 2)), cla.to_device(queue, rnd(n, 3))
    with pytest.raises(TypeError, match="w: dtype must be bfloat16 or float32, got float16"):
        clops.rms_norm(queue, xb, wh)
    with pytest.raises(TypeError, match=r"dy: dtype must be bfloat16 \(that of x\), got float32"):
        clops.rms_norm_bwd(queue, xb, w32, inv, cla.to_device(queue, rnd((n, d), 4)))
    with pytest.raises(TypeError, match="inv: dtype must be float32, got bfloat16"):
        clops.rms_norm_bwd(queue, xb, w32, cla.zeros(queue, n, ml_dtypes.bfloat16), xb)
    with pytest.raises(TypeError, match="out: dtype must be bfloat16, got float32"):
        clops.rms_norm(queue, xb, w32, out=cla.zeros(queue, (n, d), np.float32))
    with pytest.raises(TypeError, match="inv: dtype must be float32, got bfloat16"):
        clops.rms_norm(queue, xb, w32, inv=cla.zeros(queue, n, ml_dtypes.bfloat16))
    with pytest.raises(TypeError, match="dw: dtype must be float32, got bfloat16"):
        clops.rms_norm_dw(queue, xb, inv, xb, dw=cla.zeros(queue, d, ml_dtypes.bfloat16))
    with pytest.raises(TypeError, match="w: dtype must be float32, got bfloat16"):
        clops.rms_norm(queue, cla.to_device(queue, rnd((n, d), 1)), cla.zeros(queue, d, ml_dtypes.bfloat16))


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)], ids=str)
def test_column_sum_in_two_stages(queue, dtype):
    """Over 2·CHUNK partial rows the column sum takes two launches (chunks, then their sums): rms_norm_dw
    with one row a block, and qk_norm_rope_bwd with two units a block (a 16-bit dw rounded once at the end)."""
    n, d = 3 * norm.CHUNK + 5, 40
    norm_override("rms_norm_dw", d, dict(wg=32, vw=4, rb=1))
    x, w, dy = rnd((n, d), 1, 2.0).astype(dtype), rnd(d, 2, 0.5).astype(dtype), rnd((n, d), 3).astype(dtype)
    X, W, DY = to_device(queue, x, w, dy)
    _, inv = clops.rms_norm(queue, X, W)
    base = rnd(d, 4)
    (DW,) = to_device(queue, base)
    clops.rms_norm_dw(queue, X, inv, DY, dw=DW)
    assert rel_err(DW.get(), base + ref.rms_norm_dw(x, inv.get(), dy)) <= 1e-5
    hd = d // 2  # x as [n, 2, hd]: 2·n units, two a partial row (clops.qk_rope.MIN_STEPS steps of one unit)
    storage_override("qk_norm_rope", {"hd": hd}, dict(wg=8, vw=2, upg=2, gpc=1 << 20, hpw=1, pf=3))
    try:
        w2 = rnd(hd, 5, 0.5).astype(dtype)
        X3, DY3, (W2,) = X.reshape(n, 2, hd), DY.reshape(n, 2, hd), to_device(queue, w2)
        _, inv3 = clops.qk_norm_rope(queue, X3, W2, None)
        _, dw = clops.qk_norm_rope_bwd(queue, X3, W2, inv3, None, DY3)
        want = ref.rms_norm_dw(x.reshape(2 * n, hd), inv3.get().reshape(2 * n), dy.reshape(2 * n, hd))
        if dtype == np.float32:
            assert rel_err(dw.get(), want) <= 1e-5
        else:
            assert_storage_close("dw", dw, want, dtype, 1e-5)
    finally:
        storage_override("qk_norm_rope", {"hd": hd}, None)
