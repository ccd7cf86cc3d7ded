"""The one-pass norm backward (rms_norm_bwd with dw / want_dw) and the fused residual add + norm
(add_rms_norm, add_rms_norm_bwd): parity at the norm's edge shapes and at every storage dtype, the
bits of the unfused ops where they must be the same, in-place residuals, launch-parameter variants,
deterministic gain gradients, and the dtype and overlap rules.

Tolerances as tests/test_norm.py: float32 storage, relative L2 error against the float64 reference,
1e-6 forward (s, y, inv) and 1e-5 for the gradients (dx, dw); float16 / bfloat16 storage, each stored
16-bit output within 1 ulp of its dtype at the row's scale of the float64 result (of the same rounded
inputs, the device's own inv and stored s) rounded once, plus the float32 tolerance of that scale
(tests/helpers.assert_storage_close); float32 outputs keep the float32 tolerances."""
import types

import ml_dtypes
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pytest

import clops
from clops import norm
from clops import reference as ref
from clops.reference import rel_err, rnd
from helpers import assert_storage_close, norm_override, to_device

SHAPES = [(37, 5120), (7, 1), (5, 3), (3, 4097), (1, 5120), (1, 1), (65, 8), (300, 96)]
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


def _close(name, got, want, dtype, tol):
    """The float32 rule for float32 outputs, the storage rule for 16-bit ones."""
    if got.dtype == np.float32:
        assert rel_err(got.get(), want) <= tol, name
    else:
        assert_storage_close(name, got, want, dtype, tol)


def _data(n, d, dtype, wdtype, scale=3.0):
    x, dy, ds = rnd((n, d), 1, scale).astype(dtype), rnd((n, d), 3).astype(dtype), rnd((n, d), 4).astype(dtype)
    return x, rnd(d, 2, 0.5).astype(wdtype), dy, ds


def _wdtype(dtype, case):
    return dtype if case % 2 else np.dtype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(SHAPES)))
def test_one_pass_backward(queue, dtype, case):
    """dx and dw in one pass: the same dx bits as rms_norm_bwd (the heuristics give both the same row
    layout), dw of w's dtype, added into a given dw in float32 and rounded once."""
    n, d = SHAPES[case]
    gemma, wdtype = case % 3 == 0, _wdtype(dtype, case)
    x, w, dy, _ = _data(n, d, dtype, wdtype)
    X, W, DY = to_device(queue, x, w, dy)
    _, inv = clops.rms_norm(queue, X, W, gemma=gemma)
    winv = ref.rms_norm(x, w, gemma=gemma)[1]
    dx, dw = clops.rms_norm_bwd(queue, X, W, inv, DY, gemma=gemma, want_dw=True)
    assert dw.dtype == wdtype and dx.dtype == dtype
    assert dx.get().tobytes() == clops.rms_norm_bwd(queue, X, W, inv, DY, gemma=gemma).get().tobytes()
    inv_ref = winv if d == 1 else inv.get()  # d = 1: see tests/test_norm.py's test_narrow_storage
    _close("dx", dx, ref.rms_norm_bwd(x, w, inv_ref, dy, gemma=gemma), dtype, 1e-5)
    wdw = ref.rms_norm_dw(x, inv.get(), dy)
    _close("dw", dw, wdw, wdtype, 1e-5)
    base = rnd(d, 5, 2.0).astype(wdtype)
    (DW,) = to_device(queue, base)
    got = clops.rms_norm_bwd(queue, X, W, inv, DY, gemma=gemma, dw=DW)
    assert isinstance(got, tuple) and got[1] is DW
    _close("dw (added into)", DW, base.astype(np.float64) + wdw, wdtype, 1e-5)
    if dtype == np.float32:  # the float32 two-kernel gradient agrees
        assert rel_err(dw.get(), clops.rms_norm_dw(queue, X, inv, DY).get()) <= 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(SHAPES)))
def test_add_rms_norm(queue, dtype, case):
    """s = a + b, y and inv of the float32 sum, then the backward dx = ds + the norm's backward, dw."""
    n, d = SHAPES[case]
    gemma, wdtype = case % 3 == 1, _wdtype(dtype, case + 1)
    a, w, b, ds = _data(n, d, dtype, wdtype)
    if case == len(SHAPES) - 1:
        b[[0, 7]] = -a[[0, 7]]  # rows whose sum is zero
    A, B, W, DS = to_device(queue, a, b, w, ds)
    s, y, inv = clops.add_rms_norm(queue, A, B, W, gemma=gemma)
    ws, wy, winv = ref.add_rms_norm(a, b, w, gemma=gemma)
    assert s.dtype == y.dtype == dtype and inv.dtype == np.float32
    _close("s", s, ws, dtype, 1e-6)
    _close("y", y, wy, dtype, 1e-6)
    assert rel_err(inv.get(), winv) <= 1e-6
    if dtype == np.float32:  # bit for bit rms_norm(add(a, b))
        y2, inv2 = clops.rms_norm(queue, clops.add(queue, A, B), W, gemma=gemma)
        assert y.get().tobytes() == y2.get().tobytes() and inv.get().tobytes() == inv2.get().tobytes()
    if case == len(SHAPES) - 1:
        assert np.all(s.get()[[0, 7]] == 0) and np.all(y.get()[[0, 7]] == 0)
    dy = rnd((n, d), 6).astype(dtype)
    (DY,) = to_device(queue, dy)
    sh = s.get()
    if d == 1:
        # One column: the backward's formula w·dy·eps·inv³ takes inv to be 1/rms(s) of the stored s, and the
        # general formula's float64 value cancels (tests/test_norm.py): both take the inv of the stored s here
        # (the forward's inv is of the unrounded sum).
        inv, inv_ref = clops.rms_norm(queue, s, W, gemma=gemma)[1], ref.rms_norm(sh, w, gemma=gemma)[1]
    else:
        inv_ref = inv.get()
    dx, dw = clops.add_rms_norm_bwd(queue, s, W, inv, DY, DS, gemma=gemma)
    wdx, wdw = ref.add_rms_norm_bwd(sh, w, inv_ref, dy, ds, gemma=gemma)
    assert dx.dtype == dtype and dw.dtype == wdtype
    _close("dx", dx, wdx, dtype, 1e-5)
    _close("dw", dw, ref.rms_norm_dw(sh, inv.get(), dy), wdtype, 1e-5)
    if dtype == np.float32:  # the one-pass rms_norm_bwd's dx plus ds (the compiler may fuse the add), its dw
        nb = clops.rms_norm_bwd(queue, s, W, inv, DY, gemma=gemma, want_dw=True)
        assert rel_err(dx.get(), ds + nb[0].get()) <= 1e-6 and dw.get().tobytes() == nb[1].get().tobytes()


def test_in_place_is_the_residual_stream_only(queue):
    """Only s / out may be a or b and only dx may be ds: inv as a (d = 1, the same bytes) and dw as ds
    (n = 1) are refused, with nothing written."""
    a, w, b, ds = _data(1, 1, np.float32, np.float32)
    A, B, W, DS = to_device(queue, a, b, w, ds)
    with pytest.raises(ValueError, match="inv: shares memory with a"):
        clops.add_rms_norm(queue, A, B, W, inv=A.reshape(1))
    assert A.get().tobytes() == a.tobytes()
    with pytest.raises(ValueError, match="dw: shares memory with ds"):
        clops.add_rms_norm_bwd(queue, A, W, cla.to_device(queue, np.ones(1, np.float32)), B, DS, dw=DS.reshape(1))
    assert DS.get().tobytes() == ds.tobytes()


def test_in_place_residual(queue):
    """add_rms_norm(s=a) and add_rms_norm_bwd(dx=ds) update the residual stream where it lies, with the bits
    of the out-of-place calls, also for rows read twice (the row spec's rows over 32 vectors a work-item)."""
    for n, d, rows in [(9, 300, None), (5, 4097, dict(wg=32, vw=1, rpg=1, rr=1))]:
        if rows:
            norm_override("rms_norm", d, rows)
            norm_override("rms_norm_bwd_dw", d, dict(rows, gpc=2, pf=1))
            norm_override("add_rms_norm_bwd", d, dict(rows, gpc=2, pf=1))
        a, w, b, ds = _data(n, d, np.float32, np.float32)
        A, B, W, DS, DY = to_device(queue, a, b, w, ds, rnd((n, d), 7))
        s, y, inv = (t.get() for t in clops.add_rms_norm(queue, A, B, W))
        assert clops.add_rms_norm(queue, A, B, W, s=A)[0] is A
        assert A.get().tobytes() == s.tobytes()
        A2, = to_device(queue, a)
        assert clops.add_rms_norm(queue, A2, B, W, out=B)[1] is B and B.get().tobytes() == y.tobytes()
        dx, _ = clops.add_rms_norm_bwd(queue, A, W, cla.to_device(queue, inv), DY, DS)
        dx = dx.get()
        assert clops.add_rms_norm_bwd(queue, A, W, cla.to_device(queue, inv), DY, DS, dx=DS)[0] is DS
        assert DS.get().tobytes() == dx.tobytes()


LAYOUTS = [
    (4097, dict(wg=32, vw=1, rpg=1, rr=1, gpc=1, pf=2)),  # 129 vectors per work-item: rows read twice
    (5120, dict(wg=64, vw=8, rpg=2, rr=2, gpc=3, pf=1)),  # two rows a step: the segments' sums combined; read twice
    (6, dict(wg=64, vw=4, rpg=16, rr=1, gpc=8, pf=1)),  # vw capped to 2 (divides 6)
    (129, dict(wg=24, vw=2, rpg=3, rr=1, gpc=2, pf=2)),  # groups not a power of two; the next rows prefetched
    (1, dict(wg=8, vw=1, rpg=4, rr=1, gpc=1, pf=1)),    # one column: the backward's own formula
    (5120, dict(wg=64, vw=8, rpg=1, rr=1, gpc=3, pf=3)),  # the next step's rows loaded during this one's sum
    (129, dict(wg=24, vw=2, rpg=3, rr=1, gpc=2, pf=3)),  # the same, three rows a step
]
F32, BF16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)


# Every layout at float32; at bfloat16 the layouts that hold rows in registers (the template's CACHE), which
# no other test runs at 16 bits (the heuristics read such rows twice there, as the bf16 parity tests do).
@pytest.mark.parametrize("d,params,dtype", [(d, p, F32) for d, p in LAYOUTS] +
                         [(d, p, BF16) for d, p in LAYOUTS if norm.BWD_DW.render(p, {"d": d})["cache"]],
                         ids=lambda v: str(v) if isinstance(v, np.dtype) else None)
def test_launch_parameters(queue, d, params, dtype):
    """Both one-pass backwards at each layout, rows held in registers or read twice."""
    norm_override("rms_norm_bwd_dw", d, params)
    norm_override("add_rms_norm_bwd", d, params)
    n = 37
    x, w, dy, ds = _data(n, d, dtype, np.float32)
    X, W, DY, DS = to_device(queue, x, w, dy, ds)
    _, inv = clops.rms_norm(queue, X, W)
    iv = ref.rms_norm(x, w)[1] if d == 1 else inv.get()  # the stored inv but at d = 1 (test_one_pass_backward)
    dx, dw = clops.rms_norm_bwd(queue, X, W, inv, DY, want_dw=True)
    _close("dx", dx, ref.rms_norm_bwd(x, w, iv, dy), dtype, 1e-5)
    _close("dw", dw, ref.rms_norm_dw(x, iv, dy), np.float32, 1e-5)
    dx, dw = clops.add_rms_norm_bwd(queue, X, W, inv, DY, DS)
    wdx, wdw = ref.add_rms_norm_bwd(x, w, iv, dy, ds)
    _close("dx (add)", dx, wdx, dtype, 1e-5)
    _close("dw (add)", dw, wdw, np.float32, 1e-5)


def test_rows_loaded_ahead_must_be_held(queue):
    """pf 3 loads the next step's rows into the registers that hold rows: refused where rows are read twice."""
    norm_override("rms_norm_bwd_dw", 64, dict(wg=64, vw=4, rpg=1, rr=2, gpc=1, pf=3))
    X, W, DY = to_device(queue, rnd((4, 64), 1), rnd(64, 2), rnd((4, 64), 3))
    _, inv = clops.rms_norm(queue, X, W)
    with pytest.raises(ValueError, match="pf 3 needs rows held"):
        clops.rms_norm_bwd(queue, X, W, inv, DY, want_dw=True)


def test_one_pass_group_count(queue):
    """The grid: at most gpc groups per compute unit, each walking at least MIN_STEPS steps of rpg rows
    (group g the steps g, g + groups, ...), one group where there are fewer steps."""
    dev = queue.device
    for n, rpg, gpc in [(1, 1, 1), (7, 4, 2), (16384, 1, 4), (1000, 3, 8), (5, 8, 1)]:
        groups, steps = norm.bwd_dw_groups(dev, {"rpg": rpg, "gpc": gpc}, n), -(-n // rpg)
        assert 1 <= groups <= max(1, gpc * dev.max_compute_units)
        assert groups == 1 or steps // groups >= norm.MIN_STEPS  # the last group's steps
        if steps >= norm.MIN_STEPS * gpc * dev.max_compute_units:  # enough rows: the cap's groups
            assert groups == gpc * dev.max_compute_units


def test_gain_gradients_are_deterministic(queue):
    n, d = 1000, 96
    x, w, dy, ds = _data(n, d, np.dtype(ml_dtypes.bfloat16), np.float32)
    X, W, DY, DS = to_device(queue, x, w, dy, ds)
    _, inv = clops.rms_norm(queue, X, W)
    first = [t.get().tobytes() for t in (*clops.rms_norm_bwd(queue, X, W, inv, DY, want_dw=True),
                                         *clops.add_rms_norm_bwd(queue, X, W, inv, DY, DS))]
    for _ in range(2):
        again = [t.get().tobytes() for t in (*clops.rms_norm_bwd(queue, X, W, inv, DY, want_dw=True),
                                             *clops.add_rms_norm_bwd(queue, X, W, inv, DY, DS))]
        assert again == first


def test_dtypes_and_overlaps_are_checked(queue):
    n, d = 3, 8
    hb = lambda shape: cla.to_device(queue, rnd(shape, 1).astype(ml_dtypes.bfloat16))  # noqa: E731
    a, b, s = hb((n, d)), hb((n, d)), hb((n, d))
    w32, inv = cla.to_device(queue, rnd(d, 2)), cla.to_device(queue, rnd(n, 3) + 2)
    f32 = cla.to_device(queue, rnd((n, d), 4))
    cases = [
        (TypeError, r"b: dtype must be bfloat16 \(that of a\), got float32", lambda: clops.add_rms_norm(queue, a, f32, w32)),
        (TypeError, "w: dtype must be bfloat16 or float32, got float16",
         lambda: clops.add_rms_norm(queue, a, b, cla.zeros(queue, d, np.float16))),
        (TypeError, "s: dtype must be bfloat16, got float32", lambda: clops.add_rms_norm(queue, a, b, w32, s=f32)),
        (ValueError, "s: shares memory with out", lambda: clops.add_rms_norm(queue, a, b, w32, s=s, out=s)),
        (ValueError, "inv: shares memory with w", lambda: clops.add_rms_norm(queue, a, b, w32, inv=w32[:n])),
        (TypeError, r"ds: dtype must be bfloat16 \(that of s\), got float32",
         lambda: clops.add_rms_norm_bwd(queue, s, w32, inv, a, f32)),
        (TypeError, "dw: dtype must be float32, got bfloat16",
         lambda: clops.add_rms_norm_bwd(queue, s, w32, inv, a, b, dw=hb(d))),
        (ValueError, "dx: shares memory with dy", lambda: clops.add_rms_norm_bwd(queue, s, w32, inv, a, b, dx=a)),
        (TypeError, "dw: dtype must be float32, got bfloat16",
         lambda: clops.rms_norm_bwd(queue, s, w32, inv, a, dw=hb(d))),
        (TypeError, "want_dw", lambda: clops.rms_norm_bwd(queue, s, w32, inv, a, want_dw=1)),
        (ValueError, "dw: expected shape", lambda: clops.rms_norm_bwd(queue, s, w32, inv, a, dw=cla.zeros(queue, d + 1, np.float32))),
    ]
    sentinel = s.get()
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()
    assert s.get().tobytes() == sentinel.tobytes()
    # in place is for the residual stream only: s or out as a or b, dx as ds
    assert clops.add_rms_norm(queue, a, b, w32, s=a, out=b)[0] is a
    assert clops.add_rms_norm_bwd(queue, s, w32, inv, hb((n, d)), b, dx=b)[0] is b


def test_one_pass_heuristics_on_a_gpu():
    """At 16-bit storage on an NVIDIA GPU both passes spread rows over float32's work-items, rms_norm_bwd's
    with dw holding and prefetching them in two groups a compute unit, the one that reads ds reading them
    twice in four; on another GPU both read rows twice, the pass that reads ds over fewer work-items
    (about 16 vectors each).
    float32 takes the same layout for both; on NVIDIA each step's rows are loaded during the previous
    step's sum (pf 3) where rows are held (not for rows too wide for that)."""
    def gpu(platform):
        return types.SimpleNamespace(type=cl.device_type.GPU, max_work_group_size=1024,
                                     platform=types.SimpleNamespace(name=platform))
    nvidia, other = gpu("NVIDIA CUDA"), gpu("AMD Accelerated Parallel Processing")
    bf16, f32 = {"d": 5120, "st": "bf16"}, {"d": 5120, "st": "float"}
    assert norm.ADD_BWD_DW.heuristic(nvidia, bf16) == {"wg": 256, "vw": 8, "rpg": 1, "rr": 2, "gpc": 4, "pf": 1}
    assert norm.BWD_DW.heuristic(nvidia, bf16) == {"wg": 256, "vw": 8, "rpg": 1, "rr": 1, "gpc": 2, "pf": 2}
    assert norm.ADD_BWD_DW.heuristic(other, bf16) == {"wg": 64, "vw": 8, "rpg": 1, "rr": 2, "gpc": 8, "pf": 1}
    assert norm.BWD_DW.heuristic(other, bf16) == {"wg": 256, "vw": 8, "rpg": 1, "rr": 2, "gpc": 4, "pf": 1}
    for dev in (nvidia, other):
        assert norm.ADD_BWD_DW.heuristic(dev, f32) == norm.BWD_DW.heuristic(dev, f32)
        assert norm.BWD_DW.heuristic(dev, f32)["pf"] == (3 if dev is nvidia else 1)
        assert norm.BWD_DW.heuristic(dev, {"d": 65536, "st": "float"})["pf"] == 1  # 64 vectors a work-item
