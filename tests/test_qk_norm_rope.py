"""Per-head q/k RMSNorm + partial RoPE parity (y, inv, dx, dw; both gain styles) at the seed's shape, head dims
4…512, half from 0 to hd/2, both x layouts, a window shorter than the table (positions restart every window),
the sequences of cu_seqlens (positions restart at each); launch-parameter variants; deterministic dw; bad input rejected before anything runs; the same ops at
float16 / bfloat16 storage.

Tolerances (as tests/test_norm.py): float32 storage, relative L2 error against the float64 reference,
1e-6 forward (y, inv) and 1e-5 for the gradients (dx, dw). float16 / bfloat16 storage: the reference
takes the same rounded inputs (x, w, dy) and the device's own inv; every stored 16-bit output (y, dx,
and dw when w is 16-bit) is within 1 ulp of its dtype of the float64 result rounded once, the ulp
taken at the row's scale (the largest |value| of the (row, head) unit; of the whole dw), plus the
float32 tolerance relative to that scale (tests/helpers.assert_storage_close); float32 outputs (inv,
dw of a float32 w) keep the float32 tolerances."""

import ml_dtypes
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pytest

import clops
from clops import program
from clops import reference as ref
from clops import tuning
from clops.program import OutOfBoundsError

from clops import qk_rope as qkr  # noqa: E402
from clops.reference import rel_err, rnd
from helpers import assert_storage_close, storage_override, to_device


def _parity(queue, x, w, table, dy, gemma, window=None, flat=False):
    """Run forward and backward on the device; compare with the reference (which takes the window from the
    table's length). ``flat``: pass x and dy as [n, heads·hd]."""
    n, heads, hd = x.shape
    shape = (n, heads * hd) if flat else x.shape
    X, W, DY = to_device(queue, x.reshape(shape), w, dy.reshape(shape))
    rope = None if table is None else cla.to_device(queue, table)
    used = ref.rope_table(1, 0) if table is None else table[:window] if window else table
    y, inv = clops.qk_norm_rope(queue, X, W, rope, gemma=gemma, window=window)
    wy, winv = ref.qk_norm_rope(x, w, used, gemma=gemma)
    assert y.shape == X.shape and inv.shape == (n, heads)
    assert rel_err(y.get().reshape(x.shape), wy) <= 1e-6
    assert rel_err(inv.get(), winv) <= 1e-6
    dx, dw = clops.qk_norm_rope_bwd(queue, X, W, inv, rope, DY, gemma=gemma, window=window)
    wdx, wdw = ref.qk_norm_rope_bwd(x, w, winv, used, dy, gemma=gemma)
    assert rel_err(dx.get().reshape(x.shape), wdx) <= 1e-5
    assert rel_err(dw.get(), wdw) <= 1e-5
    return y.get().reshape(x.shape), inv.get()


def _data(n, heads, hd, seed=7, scale=2.0):
    return rnd((n, heads, hd), seed, scale), rnd(hd, seed + 1, 0.3), rnd((n, heads, hd), seed + 2, 1.0)


SHAPES = [  # window, windows, heads, hd, half
    (19, 2, 3, 256, 32),   # the seed's test
    (8, 2, 4, 64, 0),
    (8, 2, 4, 64, 32),
    (5, 3, 2, 128, 64),
    (5, 3, 2, 128, 17),
    (7, 1, 2, 4, 1),
    (3, 2, 1, 512, 100),
    (4, 2, 3, 12, 6),
]


@pytest.mark.parametrize("gemma", [True, False])
@pytest.mark.parametrize("window,windows,heads,hd,half", SHAPES)
def test_matches_reference(queue, window, windows, heads, hd, half, gemma):
    x, w, dy = _data(window * windows, heads, hd)
    _parity(queue, x, w, ref.rope_table(window, half) if half else None, dy, gemma)


def test_flat_layout_short_window_and_partial_window(queue):
    x, w, dy = _data(11, 3, 64)
    table = ref.rope_table(9, 20)
    _parity(queue, x, w, table, dy, True, window=4, flat=True)   # 11 rows: the last window is partial
    x, w, dy = _data(1, 2, 40)
    _parity(queue, x, w, table, dy, True)


def test_positions_restart_every_window(queue):
    """window=3 over a table of 9: rows r and r + 3 are the same data, so their outputs (y, dx) are the
    same bits; with the table's own window (9) they are not."""
    x, w, dy = np.tile(rnd((3, 2, 16), 1), (3, 1, 1)), rnd(16, 2, 0.3), np.tile(rnd((3, 2, 16), 3), (3, 1, 1))
    X, W, DY, R = to_device(queue, x, w, dy, ref.rope_table(9, 8))
    y, inv = clops.qk_norm_rope(queue, X, W, R, window=3)
    dx, _ = clops.qk_norm_rope_bwd(queue, X, W, inv, R, DY, window=3)
    for got in (y.get(), dx.get()):
        assert got.tobytes() == np.tile(got[:3], (3, 1, 1)).tobytes()
    y9 = clops.qk_norm_rope(queue, X, W, R)[0].get()
    assert not np.array_equal(y9[3:6], y9[:3])


SEQUENCES = [  # lengths (empty and one-token sequences among them), offsets on the device, storage dtype
    ([3, 0, 1, 6, 0], False, np.float32),
    ([0, 1, 9, 2], True, np.float32),
    ([5, 0, 1, 4], True, ml_dtypes.bfloat16),
]


@pytest.mark.parametrize("lengths,on_device,dtype", SEQUENCES, ids=["numpy", "device", "bfloat16"])
def test_sequences_match_reference(queue, lengths, on_device, dtype):
    """cu_seqlens: each row rotated to its offset in its sequence, over a table longer than the longest
    (numpy offsets; device ones with a max_seqlen above the longest); tolerances as test_narrow_storage."""
    cu = np.cumsum([0] + lengths, dtype=np.int32)
    x, w, dy = _data(int(cu[-1]), 3, 16)
    x, dy = x.astype(dtype), dy.astype(dtype)
    table = ref.rope_table(max(lengths) + 2, 6)
    X, W, DY, R = to_device(queue, x, w, dy, table)
    kw = {"cu_seqlens": cla.to_device(queue, cu), "max_seqlen": max(lengths) + 1} if on_device else {"cu_seqlens": cu}
    y, inv = clops.qk_norm_rope(queue, X, W, R, **kw)
    dx, dw = clops.qk_norm_rope_bwd(queue, X, W, inv, R, DY, **kw)
    wy, winv = ref.qk_norm_rope(x, w, table, cu_seqlens=cu)
    wdx, wdw = ref.qk_norm_rope_bwd(x, w, inv.get(), table, dy, cu_seqlens=cu)
    assert rel_err(inv.get(), winv) <= 1e-6 and rel_err(dw.get(), wdw) <= 1e-5  # float32, as w
    if dtype == np.float32:
        assert rel_err(y.get(), wy) <= 1e-6 and rel_err(dx.get(), wdx) <= 1e-5
    else:
        assert_storage_close("y", y, wy, dtype, 1e-6)
        assert_storage_close("dx", dx, wdx, dtype, 1e-5)


def test_equal_sequences_rotate_as_the_window(queue):
    """cu_seqlens of equal sequences gives window='s bits (y, inv, dx, dw)."""
    x, w, dy = _data(12, 2, 32)
    X, W, DY, R = to_device(queue, x, w, dy, ref.rope_table(5, 10))
    got = []
    for kw in ({"window": 4}, {"cu_seqlens": np.arange(0, 13, 4, dtype=np.int32)}):
        y, inv = clops.qk_norm_rope(queue, X, W, R, **kw)
        got.append([a.get().tobytes() for a in (y, inv, *clops.qk_norm_rope_bwd(queue, X, W, inv, R, DY, **kw))])
    assert got[0] == got[1]


def test_empty_table_means_no_rotation(queue):
    x, w, _ = _data(6, 2, 16)
    X, W = to_device(queue, x, w)
    empty = cla.to_device(queue, clops.rope_table(6, 0))
    y0, inv0 = clops.qk_norm_rope(queue, X, W, empty)
    y1, inv1 = clops.qk_norm_rope(queue, X, W, None)
    assert y0.get().tobytes() == y1.get().tobytes()
    assert rel_err(y0.get(), ref.qk_norm_rope(x, w, clops.rope_table(6, 0))[0]) <= 1e-6


@pytest.mark.parametrize("gemma", [True, False])
def test_rows_of_zeros_and_large_values(queue, gemma):
    x, w, dy = _data(10, 3, 128, scale=1e4)
    x[[0, 7]] = 0.0
    x[3, 1] = 0.0
    y, inv = _parity(queue, x, w, ref.rope_table(5, 48), dy, gemma)
    assert np.all(y[[0, 7]] == 0.0) and np.all(y[3, 1] == 0.0)
    np.testing.assert_allclose(inv[[0, 7]], 1.0 / np.sqrt(1e-6), rtol=1e-6)


def test_dw_adds_into_given_and_is_deterministic(queue):
    x, w, dy = _data(40, 4, 128)
    table = ref.rope_table(10, 32)
    X, W, DY, R = to_device(queue, x, w, dy, table)
    _, inv = clops.qk_norm_rope(queue, X, W, R)
    first = clops.qk_norm_rope_bwd(queue, X, W, inv, R, DY)[1].get()
    for _ in range(3):
        assert clops.qk_norm_rope_bwd(queue, X, W, inv, R, DY)[1].get().tobytes() == first.tobytes()
    base = rnd(128, 3, 5.0)
    (DW,) = to_device(queue, base)
    _, got = clops.qk_norm_rope_bwd(queue, X, W, inv, R, DY, dw=DW)
    assert got is DW
    want = ref.qk_norm_rope_bwd(x, w, inv.get(), table, dy)[1]
    assert rel_err(DW.get(), base + want) <= 1e-5


@pytest.fixture
def override():
    set_ = []

    def put(hd, params):
        storage_override("qk_norm_rope", {"hd": hd}, params)
        set_.append(hd)

    yield put
    for hd in set_:
        storage_override("qk_norm_rope", {"hd": hd}, None)


@pytest.mark.parametrize("hd,half,params", [
    (256, 32, dict(wg=64, vw=4, upg=4, gpc=1, hpw=1, pf=3)),  # 16 work-items per unit over 56 slots; groups of many
                                                              # steps, each loading the next during its sum
    (256, 100, dict(wg=96, vw=2, upg=3, gpc=2, hpw=1, pf=2)),  # groups not a power of two; 50 pairs over 32
                                                               # work-items; the next step prefetched
    (64, 13, dict(wg=64, vw=16, upg=1, gpc=4, hpw=1, pf=1)),     # an odd half: vw 1, 51 slots over 64 work-items (the tree)
    (64, 32, dict(wg=32, vw=16, upg=16, gpc=1, hpw=1, pf=3)),    # vw 16: two table loads a pair; 2 work-items per unit
    (128, 48, dict(wg=128, vw=8, upg=16, gpc=1, hpw=1, pf=2)),   # vw 8; 6 pairs and 4 pass-through vectors over 8 work-items
    (12, 6, dict(wg=16, vw=8, upg=4, gpc=2, hpw=1, pf=1)),       # vw capped to 2 (divides 12 and 6); a work-item idle a unit
    (20, 2, dict(wg=64, vw=4, upg=16, gpc=1, hpw=1, pf=3)),      # vw 2: one pair, 9 pass-through; the last sum in 3 slices
    (16, 8, dict(wg=16, vw=4, upg=16, gpc=2, hpw=1, pf=1)),      # one work-item a unit: no unit sum through local memory
    (24, 0, dict(wg=32, vw=4, upg=8, gpc=1, hpw=1, pf=3)),       # no rotation: 6 vectors over 4 work-items
    (40, 20, dict(wg=8, vw=4, upg=2, gpc=64, hpw=1, pf=3)),      # many backward groups of a step or two (21 partial rows)
    (512, 256, dict(wg=8, vw=1, upg=1, gpc=3, hpw=1, pf=1)),
    # a segment's units one after the other, the table and the gain loaded once for them (3 heads a row)
    (64, 16, dict(wg=64, vw=4, upg=16, gpc=1, hpw=2, pf=3)),  # segments crossing rows: the next row's table
    (128, 32, dict(wg=32, vw=4, upg=4, gpc=2, hpw=3, pf=2)),  # a row a segment; the unit sums through local memory
    (16, 8, dict(wg=16, vw=4, upg=16, gpc=2, hpw=4, pf=1)),   # one work-item a unit, four units
    (24, 0, dict(wg=32, vw=4, upg=8, gpc=1, hpw=2, pf=1)),    # no rotation
])
def test_launch_parameters(queue, override, hd, half, params):
    override(hd, params)
    x, w, dy = _data(14, 3, hd)
    _parity(queue, x, w, ref.rope_table(7, half), dy, True)
    if params["hpw"] > 1 and half:
        _gpu_layout_parity(queue, hd, half)  # bfloat16 over sequences: segments crossing into another one


class _Platform:
    name = "NVIDIA CUDA"


class _Gpu:  # what the heuristic reads of a device: an NVIDIA GPU's
    type = cl.device_type.GPU
    max_work_group_size = 1024
    platform = _Platform


@pytest.mark.parametrize("hd,half", [(64, 16), (128, 64), (96, 20)])
def test_gpu_layout_on_this_device(queue, hd, half):
    """The GPU heuristic's layouts (hd/16 work-items a unit, groups of 256 at float32 and 128 at 16 bits,
    the backward's next step prefetched there from hd 128; CPUs take one
    work-item a unit) at float32 and bfloat16 storage over sequences (hd 96, half 20: 19 slots, 5 of them
    pairs, over 4 work-items)."""
    layouts = {st: qkr.heuristic(_Gpu, {"hd": hd, "st": st}) for st in ("float", "bf16")}
    if max(p["wg"] for p in layouts.values()) > queue.device.max_work_group_size:
        pytest.skip("groups of 256")
    try:
        for st, p in layouts.items():
            tuning.override("qk_norm_rope", {"hd": hd, "st": st}, p)
        _gpu_layout_parity(queue, hd, half)
    finally:
        for st in layouts:
            tuning.override("qk_norm_rope", {"hd": hd, "st": st}, None)


def _gpu_layout_parity(queue, hd, half):
    x, w, dy = _data(10, 3, hd)
    _parity(queue, x, w, ref.rope_table(5, half), dy, False)
    cu = np.array([0, 3, 3, 10], np.int32)
    xb, dyb = x.astype(ml_dtypes.bfloat16), dy.astype(ml_dtypes.bfloat16)
    table = ref.rope_table(8, half)
    X, W, DY, R = to_device(queue, xb, w, dyb, table)
    y, inv = clops.qk_norm_rope(queue, X, W, R, cu_seqlens=cu)
    dx, dw = clops.qk_norm_rope_bwd(queue, X, W, inv, R, DY, cu_seqlens=cu)
    assert_storage_close("y", y, ref.qk_norm_rope(xb, w, table, cu_seqlens=cu)[0], xb.dtype, 1e-6)
    wdx, wdw = ref.qk_norm_rope_bwd(xb, w, inv.get(), table, dyb, cu_seqlens=cu)
    assert_storage_close("dx", dx, wdx, xb.dtype, 1e-5)
    assert rel_err(dw.get(), wdw) <= 1e-5


def test_parameters_the_device_cannot_hold(queue, override):
    dev = queue.device
    X, W = to_device(queue, rnd((2, 1, 512), 1), rnd(512, 2))
    upg = 1 << (dev.local_mem_size // (4 * 512)).bit_length()  # units whose rows overflow local memory
    override(512, dict(wg=upg, vw=4, upg=upg, gpc=1, hpw=1, pf=1))
    with pytest.raises(clops.LimitError, match="local memory"):
        clops.qk_norm_rope(queue, X, W, None)
    override(512, dict(wg=2 * dev.max_work_group_size, vw=4, upg=1, gpc=1, hpw=1, pf=1))
    with pytest.raises(clops.LimitError, match="MAX_WORK_GROUP_SIZE"):
        clops.qk_norm_rope(queue, X, W, None)
    override(512, dict(wg=64, vw=4, upg=3, gpc=1, hpw=1, pf=1))
    with pytest.raises(ValueError, match="upg must divide"):
        clops.qk_norm_rope(queue, X, W, None)


def test_tiles_are_chosen_per_storage_type(queue):
    """The shape class carries x's storage type: an override at bfloat16 is not float32's."""
    hd = 32
    x = rnd((2, 1, hd), 1)
    X, W, XB = to_device(queue, x, rnd(hd, 2), x.astype(ml_dtypes.bfloat16))
    tuning.override("qk_norm_rope", {"hd": hd, "st": "bf16"}, dict(wg=64, vw=4, upg=3, gpc=1, hpw=1, pf=1))
    try:
        clops.qk_norm_rope(queue, X, W, None)  # float32: the heuristic's tiles
        with pytest.raises(ValueError, match="upg must divide"):
            clops.qk_norm_rope(queue, XB, W, None)
    finally:
        tuning.override("qk_norm_rope", {"hd": hd, "st": "bf16"}, None)


def test_bad_input_is_rejected_before_anything_runs(queue):
    n, heads, hd = 6, 2, 16
    x, w, dy = _data(n, heads, hd)
    X, W, DY, R = to_device(queue, x, w, dy, ref.rope_table(3, 4))
    INV = cla.to_device(queue, np.ones((n, heads), np.float32))
    DW, OUT, DX = to_device(queue, np.full(hd, 7.0, np.float32), np.full(x.shape, 7.0, np.float32),
                       np.full(x.shape, 7.0, np.float32))
    bad_rows = to_device(queue, rnd((n, heads, 6), 1), rnd(6, 1), rnd((n, 2, 520), 1), rnd(520, 1),
                    rnd((n, 30), 1), rnd((n, heads, hd), 1).astype(np.float64))
    cases = [
        (ValueError, "dw", lambda: clops.qk_norm_rope_bwd(queue, X, W, INV, R, DY, dw=cla.zeros(queue, hd + 1, np.float32), dx=DX)),
        (ValueError, "too short for window 4", lambda: clops.qk_norm_rope(queue, X, W, R, window=4, out=OUT)),
        (ValueError, "rope: half 9 exceeds", lambda: clops.qk_norm_rope(queue, X, W, to_device(queue, ref.rope_table(3, 9))[0], out=OUT)),
        (ValueError, "rope", lambda: clops.qk_norm_rope(queue, X, W, to_device(queue, rnd((3, 4, 3), 1))[0], out=OUT)),
        (TypeError, "rope", lambda: clops.qk_norm_rope(queue, X, W, cla.to_device(queue, np.zeros((3, 0, 2))), out=OUT)),
        (ValueError, "unsupported head dim 6", lambda: clops.qk_norm_rope(queue, bad_rows[0], bad_rows[1], None)),
        (ValueError, "unsupported head dim 520", lambda: clops.qk_norm_rope(queue, bad_rows[2], bad_rows[3], None)),
        (ValueError, "w: head dim 16 does not divide", lambda: clops.qk_norm_rope(queue, bad_rows[4], W, None)),
        (ValueError, "w: expected shape", lambda: clops.qk_norm_rope(queue, X, bad_rows[1], None, out=OUT)),
        (TypeError, "x: dtype", lambda: clops.qk_norm_rope(queue, bad_rows[5], W, R, out=OUT)),
        (ValueError, "inv", lambda: clops.qk_norm_rope_bwd(queue, X, W, DW, R, DY, dx=DX, dw=DW)),
        (ValueError, "dy", lambda: clops.qk_norm_rope_bwd(queue, X, W, INV, R, bad_rows[4], dx=DX, dw=DW)),
        (ValueError, "window", lambda: clops.qk_norm_rope(queue, X, W, R, window=0, out=OUT)),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()
    ctx2 = cl.Context([queue.device])  # held: Intel's runtime drops a context only its queue references
    (R2,) = to_device(cl.CommandQueue(ctx2), ref.rope_table(3, 4))
    with pytest.raises(ValueError, match="rope: array belongs to another context"):
        clops.qk_norm_rope_bwd(queue, X, W, INV, R2, DY, dx=DX, dw=DW)
    assert np.all(DW.get() == 7.0) and np.all(OUT.get() == 7.0) and np.all(DX.get() == 7.0)


def test_checked_build_catches_a_table_read_past_its_end(queue, monkeypatch):
    """The guards are in place: window 5 over a table of 2 positions raises in a checked build."""
    monkeypatch.setenv("CLOPS_CHECKED", "1")
    program.reload_switches()  # CLOPS_CHECKED is read once
    x, w, _ = _data(5, 1, 16)
    X, W, R = to_device(queue, x, w, ref.rope_table(2, 8))
    y, inv = cla.empty(queue, x.shape, np.float32), cla.empty(queue, (5, 1), np.float32)
    p, knl, units = qkr._plan(queue, "qk_norm_rope_fwd", 5, 16, 8)
    args = [y.data, inv.data, X.data, W.data, R.data, units, np.uint32(1), np.uint32(5), np.float32(1e-6),
            np.float32(1)]
    with pytest.raises(OutOfBoundsError, match=r"qk_norm_rope_fwd .*rope\["):
        knl(queue, (-(-5 // (p["upg"] * p["hpw"])),), args)


# ---- float16 / bfloat16 storage ----

NARROW = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


@pytest.mark.parametrize("dtype", NARROW, ids=str)
@pytest.mark.parametrize("case", range(len(SHAPES) + 1))
def test_narrow_storage(queue, dtype, case):
    """qk_norm_rope and its backward at 16-bit storage at every edge shape, and units of zeros among
    values of 1e4; the gain style and the gain's dtype (float32 or the activations', then dw's too)
    alternate; a 16-bit dw given is added into in float32 and rounded once."""
    if case < len(SHAPES):
        window, windows, heads, hd, half = SHAPES[case]
        scale = 2.0
    else:
        window, windows, heads, hd, half, scale = 5, 2, 3, 128, 48, 1e4
    x, w, dy = _data(window * windows, heads, hd, scale=scale)
    if case == len(SHAPES):
        x[[0, 7]] = 0
        x[3, 1] = 0
    gemma, wdtype = case % 2 == 0, dtype if case % 4 < 2 else np.dtype(np.float32)
    x, w, dy = x.astype(dtype), w.astype(wdtype), dy.astype(dtype)
    table = ref.rope_table(window, half)
    X, W, DY, R = to_device(queue, x, w, dy, table)
    y, inv = clops.qk_norm_rope(queue, X, W, R if half else None, gemma=gemma)
    wy, winv = ref.qk_norm_rope(x, w, table, gemma=gemma)
    assert_storage_close("y", y, wy, dtype, 1e-6)
    assert inv.dtype == np.float32 and rel_err(inv.get(), winv) <= 1e-6
    base = rnd(hd, 5, 2.0).astype(wdtype)
    (DW,) = to_device(queue, base)
    dx, dw = clops.qk_norm_rope_bwd(queue, X, W, inv, R if half else None, DY, gemma=gemma, dw=DW)
    assert dw is DW
    wdx, wdw = ref.qk_norm_rope_bwd(x, w, inv.get(), table, dy, gemma=gemma)
    assert_storage_close("dx", dx, wdx, dtype, 1e-5)
    _, dw = clops.qk_norm_rope_bwd(queue, X, W, inv, R if half else None, DY, gemma=gemma)
    if wdtype == np.float32:
        assert dw.dtype == np.float32 and rel_err(dw.get(), wdw) <= 1e-5
        assert rel_err(DW.get(), base + wdw) <= 1e-5
    else:
        assert_storage_close("dw", dw, wdw, dtype, 1e-5)
        assert_storage_close("dw (added into)", DW, base.astype(np.float64) + wdw, dtype, 1e-5)
    if case == len(SHAPES):
        assert np.all(y.get()[[0, 7]] == 0) and np.all(y.get()[3, 1] == 0)


def test_narrow_dtypes_are_checked(queue):
    x = cla.to_device(queue, rnd((4, 2, 8), 1).astype(np.float16))
    w16, w32 = cla.to_device(queue, rnd(8, 2).astype(np.float16)), cla.to_device(queue, rnd(8, 2))
    inv = cla.to_device(queue, rnd((4, 2), 3))
    with pytest.raises(TypeError, match="w: dtype must be float16 or float32, got bfloat16"):
        clops.qk_norm_rope(queue, x, cla.zeros(queue, 8, ml_dtypes.bfloat16), None)
    with pytest.raises(TypeError, match="rope: dtype must be float32, got float16"):
        clops.qk_norm_rope(queue, x, w16, cla.zeros(queue, (4, 2, 2), np.float16))
    with pytest.raises(TypeError, match="dw: dtype must be float32, got float16"):
        clops.qk_norm_rope_bwd(queue, x, w32, inv, None, x, dw=cla.zeros(queue, 8, np.float16))
    with pytest.raises(TypeError, match="dw: dtype must be float16, got float32"):
        clops.qk_norm_rope_bwd(queue, x, w16, inv, None, x, dw=cla.zeros(queue, 8, np.float32))
    with pytest.raises(TypeError, match="dx: dtype must be float16, got float32"):
        clops.qk_norm_rope_bwd(queue, x, w16, inv, None, x, dx=cla.zeros(queue, (4, 2, 8), np.float32))
