"""Every kernel of every family under the oclgrind simulator, at tiny shapes.

Selected by the `oclgrind` marker (CI runs it as its own step). Each family runs
in a subprocess whose only OpenCL platform is oclgrind (its ICD in a folder of
its own through OCL_ICD_VENDORS), so this process's ICD setup is untouched. The
simulator checks out-of-bounds accesses and barrier divergence always, data
races (OCLGRIND_DATA_RACES), uninitialised values (OCLGRIND_UNINITIALIZED) and
API misuse (OCLGRIND_CHECK_API) on request; it writes what it finds to
OCLGRIND_LOG, which must come back empty. Tile parameters are overridden small
so that every shape covers partial tiles, partial work-groups and vector tails
while the simulator stays within seconds per family. The subprocess also checks
the results against the float64 reference and that every kernel of every
program it built was launched.

Run the subprocess by hand: python tests/test_oclgrind.py <family> (with the
environment `_environment` builds).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

OCLGRIND_ICD = "/usr/lib/oclgrind/liboclgrind-rt-icd.so"
pytestmark = pytest.mark.oclgrind


# ---- runs inside the subprocess: one function per family, every kernel at tiny shapes ----

def _tiles(*configs):
    """The tile overrides a family runs with (None: the device's default).

    oclgrind 21.10's uninitialised-value plugin crashes (SIGSEGV) on vector lane
    extraction (``v.s0 + v.s1``), so the run with that check keeps the vector-width-1
    tiles; the run with the data-race check takes them all.
    """
    if os.environ.get("OCLGRIND_UNINITIALIZED"):
        return [c for c in configs if c is not None and c.get("vw", 1) == 1]
    return list(configs)


NARROW = ("float16", "bfloat16")  # numpy knows bfloat16 by name once ml_dtypes is imported (clops imports it)
NARROW_TOL = 1e-2  # relative L2 of a 16-bit result: its one rounding (bfloat16: at most 2⁻⁸ of each element)


def _expect(name, got, want, tol=1e-5):
    from clops.reference import rel_err

    err = rel_err(got.get(), want)
    if not err <= tol:
        raise AssertionError(f"{name}: relative error {err:.3e} > {tol:.0e} under oclgrind")


def run_elementwise(queue):
    import pyopencl.array as cla

    import clops
    from clops import reference as ref, tuning
    from clops.reference import rnd

    rows, width = 7, 37  # 259 elements: partial groups and a vector tail for every tile below
    a, b, dc = rnd((rows, width), 1, 3.0), rnd((rows, width), 2, 2.0), rnd((rows, width), 3, 1.0)
    gate, rw = rnd(width, 4, 0.5) + 0.6, abs(rnd(rows, 5, 1.0))
    da_, db_, dc_, g_, rw_ = (cla.to_device(queue, x) for x in (a, b, dc, gate, rw))
    for params in _tiles({"wg": 16, "vw": 4, "ept": 2}, {"wg": 8, "vw": 1, "ept": 3}, None):
        tuning.override("elementwise", {}, params)
        _expect("swiglu", clops.swiglu(queue, da_, db_), ref.swiglu(a, b))
        for got, want in zip(clops.swiglu_bwd(queue, da_, db_, dc_), ref.swiglu_bwd(a, b, dc)):
            _expect("swiglu_bwd", got, want)
        _expect("swiglu_limit", clops.swiglu_limit(queue, da_, db_, limit=1.5, scale=0.5),
                ref.swiglu_limit(a, b, limit=1.5, scale=0.5))
        for cut in (width, 36):  # rows of 36: whole vectors of 4 (a row weight per vector, the gate as vectors)
            x, y, z, gt = (np.ascontiguousarray(v) for v in (a[:, :cut], b[:, :cut], dc[:, :cut], gate[:cut]))
            x_, y_, z_, gt_ = (cla.to_device(queue, v) for v in (x, y, z, gt))
            got = clops.swiglu_limit(queue, x_, y_, limit=1.5, scale=0.5, row_weight=rw_)
            _expect("swiglu_limit rows", got, ref.swiglu_limit(x, y, limit=1.5, scale=0.5, row_weight=rw))
            _expect("swiglu_gated", clops.swiglu_gated(queue, x_, y_, gt_), ref.swiglu_gated(x, y, gt))
            for got, want in zip(clops.swiglu_gated_bwd(queue, x_, y_, gt_, z_), ref.swiglu_gated_bwd(x, y, gt, z)):
                _expect("swiglu_gated_bwd", got, want)
        _expect("sigmoid_gate", clops.sigmoid_gate(queue, da_, db_), ref.sigmoid_gate(a, b))
        for got, want in zip(clops.sigmoid_gate_bwd(queue, da_, db_, dc_), ref.sigmoid_gate_bwd(a, b, dc)):
            _expect("sigmoid_gate_bwd", got, want)
        _expect("add", clops.add(queue, da_, db_), ref.add(a, b))


def run_norm(queue):
    import pyopencl.array as cla

    from helpers import ROW_OPS, norm_override

    import clops
    from clops import norm
    from clops import reference as ref
    from clops.reference import rnd

    # (n, d, row tiles, gain-gradient tiles). 7 rows of 40: partial row groups, a partial
    # chunk (rows held in registers), 40 chunks of one (rows read twice; at 600 × 8 by rr 2); the gradient's
    # partial row blocks and column groups. d = 1: the backward's own formula. The one-pass
    # backward takes the row tiles with 1 group per compute unit (groups walk several steps,
    # the last one partial; rpg > 1: the segments' sums combined).
    for n, d, rows, dw in [
        (7, 40, {"wg": 8, "vw": 4, "rpg": 2, "rr": 1}, {"wg": 8, "vw": 4, "rb": 3}),
        (7, 40, {"wg": 4, "vw": 1, "rpg": 4, "rr": 1}, {"wg": 4, "vw": 1, "rb": 2}),
        (7, 40, None, None),
        (5, 1, {"wg": 8, "vw": 1, "rpg": 4, "rr": 1}, {"wg": 4, "vw": 1, "rb": 2}),
        (600, 8, {"wg": 8, "vw": 4, "rpg": 1, "rr": 2}, {"wg": 4, "vw": 4, "rb": 1}),  # 600 partial rows: 18 or 19 a column-sum slice
    ]:
        if rows not in _tiles(rows):
            continue
        x, w, dy = rnd((n, d), 11, 2.0), rnd(d, 12, 0.5), rnd((n, d), 13, 1.0)
        x_, w_, dy_ = (cla.to_device(queue, a) for a in (x, w, dy))
        norm_override(ROW_OPS, d, rows)
        norm_override("rms_norm_dw", d, dw)
        one_pass = None if rows is None else dict(rows, gpc=1, pf=2)
        if one_pass and norm.BWD_DW.render(one_pass, {"d": d})["cache"]:
            one_pass["pf"] = 3  # rows held: the next step's loaded during this one's sum
        norm_override("rms_norm_bwd_dw", d, one_pass)
        norm_override("add_rms_norm_bwd", d, one_pass)
        for gemma in (False, True):
            (y, inv), (wy, winv) = clops.rms_norm(queue, x_, w_, gemma=gemma), ref.rms_norm(x, w, gemma=gemma)
            _expect("rms_norm y", y, wy)
            _expect("rms_norm inv", inv, winv)
            _expect("rms_norm_bwd", clops.rms_norm_bwd(queue, x_, w_, inv, dy_, gemma=gemma),
                    ref.rms_norm_bwd(x, w, winv, dy, gemma=gemma))
        wdw = ref.rms_norm_dw(x, winv, dy)
        _expect("rms_norm_dw", clops.rms_norm_dw(queue, x_, inv, dy_), wdw)
        acc = cla.to_device(queue, w)
        _expect("rms_norm_dw (accumulated)", clops.rms_norm_dw(queue, x_, inv, dy_, dw=acc), wdw + w)
        wdx = ref.rms_norm_bwd(x, w, winv, dy)
        dx, dw1 = clops.rms_norm_bwd(queue, x_, w_, inv, dy_, dw=cla.to_device(queue, w))
        _expect("rms_norm_bwd one pass dx", dx, wdx)
        _expect("rms_norm_bwd one pass dw (accumulated)", dw1, wdw + w)
        s, y, sinv = clops.add_rms_norm(queue, x_, dy_, w_)
        ws, wy, wsinv = ref.add_rms_norm(x, dy, w)
        _expect("add_rms_norm s", s, ws)
        _expect("add_rms_norm y", y, wy)
        _expect("add_rms_norm inv", sinv, wsinv)
        wdx, wdw = ref.add_rms_norm_bwd(s.get(), w, sinv.get(), x, dy)
        dx, dw2 = clops.add_rms_norm_bwd(queue, s, w_, sinv, x_, dy_)
        _expect("add_rms_norm_bwd dx", dx, wdx)
        _expect("add_rms_norm_bwd dw", dw2, wdw)
        if d > 1 and n < 100:
            _norm_narrow(queue, x, w, dy)
        if d == 40 and rows is not None:
            _norm_out_of_range(queue, w, dy)


def _extreme(shape, seed):
    """Rows (first axis) whose squares leave float32 (1e30, 1e-30, a flat 2e38: inv subnormal) and a normal one."""
    from clops.reference import rnd

    u = rnd(shape, seed)
    scales = np.resize([1e30, 1.0, 1e-30, 2e38], shape[0]).reshape((-1,) + (1,) * (len(shape) - 1))
    x = (np.sign(u) * (1 + np.abs(u)) / 2 * scales).astype(np.float32)
    x[3] = np.sign(x[3]) * np.float32(2e38)
    return x


def _norm_out_of_range(queue, w, dy):
    """The row kernels' slow paths (#19): rows outside float32's square range, eps = 0; add_rms_norm in place."""
    import pyopencl.array as cla

    import clops
    from clops import reference as ref

    x = _extreme(dy.shape, 14)
    x_, w_, dy_ = (cla.to_device(queue, a) for a in (x, w, dy))
    y, inv = clops.rms_norm(queue, x_, w_, eps=0.0)
    wy, winv = ref.rms_norm(x, w, eps=0.0)
    _expect("rms_norm y out of range", y, wy)
    wdx, wdw = ref.rms_norm_bwd(x, w, winv, dy), ref.rms_norm_dw(x, winv, dy)
    _expect("rms_norm_bwd out of range", clops.rms_norm_bwd(queue, x_, w_, inv, dy_, eps=0.0), wdx)
    _expect("rms_norm_dw out of range", clops.rms_norm_dw(queue, x_, inv, dy_), wdw)
    dx, dw = clops.rms_norm_bwd(queue, x_, w_, inv, dy_, eps=0.0, want_dw=True)
    _expect("rms_norm_bwd one pass dx out of range", dx, wdx)
    _expect("rms_norm_bwd one pass dw out of range", dw, wdw)
    a_ = cla.to_device(queue, x)
    s, y, inv = clops.add_rms_norm(queue, a_, dy_, w_, eps=0.0, s=a_)  # s in place of a
    ws, wy, winv = ref.add_rms_norm(x, dy, w, eps=0.0)
    _expect("add_rms_norm y out of range (in place)", y, wy)
    wdx, wdw = ref.add_rms_norm_bwd(s.get(), w, winv, dy, x)
    ds_ = cla.to_device(queue, x)
    dx, dw = clops.add_rms_norm_bwd(queue, s, w_, inv, dy_, ds_, eps=0.0, dx=ds_)  # dx in place of ds
    _expect("add_rms_norm_bwd dx out of range", dx, wdx)
    _expect("add_rms_norm_bwd dw out of range", dw, wdw)


def _narrow_dtypes():
    """(activations' dtype, gain's dtype) of the 16-bit runs: half with a float32 gain, bf16 with a bf16 one."""
    import ml_dtypes

    return [(np.dtype(np.float16), np.dtype(np.float32)), (np.dtype(ml_dtypes.bfloat16),) * 2]


def _norm_narrow(queue, x, w, dy):
    """The row and gain-gradient kernels at 16-bit storage (within a few storage ulps of the reference)."""
    import pyopencl.array as cla

    import clops
    from clops import reference as ref

    for dt, wdt in _narrow_dtypes():
        xn, wn, dyn = x.astype(dt), w.astype(wdt), dy.astype(dt)
        x_, w_, dy_ = (cla.to_device(queue, a) for a in (xn, wn, dyn))
        y, inv = clops.rms_norm(queue, x_, w_)
        _expect(f"rms_norm y {dt}", y, ref.rms_norm(xn, wn)[0], 1e-2)
        _expect(f"rms_norm_bwd {dt}", clops.rms_norm_bwd(queue, x_, w_, inv, dy_), ref.rms_norm_bwd(xn, wn, inv.get(), dyn),
                1e-2)
        _expect(f"rms_norm_dw {dt}", clops.rms_norm_dw(queue, x_, inv, dy_), ref.rms_norm_dw(xn, inv.get(), dyn))


def run_qk_norm_rope(queue):
    import pyopencl.array as cla

    from helpers import storage_override

    import clops
    from clops import reference as ref
    from clops.reference import rnd

    n, heads, hd, window = 6, 3, 12, 3  # 18 units of 12: partial unit groups and dw blocks
    x, w, dy = rnd((n, heads, hd), 21, 2.0), rnd(hd, 22, 0.5), rnd((n, heads, hd), 23, 1.0)
    x_, w_, dy_ = (cla.to_device(queue, a) for a in (x, w, dy))
    # 4 work-items a unit over its 2 slots at vw 4 (half 4: a pair and a vector; at half 0 3 vectors), backward
    # groups of several steps; one unit a group; 4 work-items a unit over 8 slots of vw 1, the backward's last
    # sum in 2 slices, two units a segment (crossing rows); the backward's next step loaded during its sum (pf 3)
    # and prefetched (pf 2)
    for params in _tiles({"wg": 8, "vw": 4, "upg": 2, "gpc": 1, "hpw": 1, "pf": 3},
                         {"wg": 4, "vw": 1, "upg": 1, "gpc": 2, "hpw": 1, "pf": 2},
                         {"wg": 32, "vw": 1, "upg": 8, "gpc": 1, "hpw": 2, "pf": 1}, None):
        storage_override("qk_norm_rope", {"hd": hd}, params)
        for half in (4, 0):  # 8 of 12 dims rotated, the rest passed through; then no rotation
            table = ref.rope_table(window, half)
            rope_ = cla.to_device(queue, table) if half else None
            y, inv = clops.qk_norm_rope(queue, x_, w_, rope_)
            wy, winv = ref.qk_norm_rope(x, w, table)
            _expect("qk_norm_rope y", y, wy)
            _expect("qk_norm_rope inv", inv, winv)
            wdx, wdw = ref.qk_norm_rope_bwd(x, w, winv, table, dy)
            dx, dw = clops.qk_norm_rope_bwd(queue, x_, w_, inv, rope_, dy_)
            _expect("qk_norm_rope_bwd dx", dx, wdx)
            _expect("qk_norm_rope_bwd dw", dw, wdw)
        table = ref.rope_table(window, 4)
        rope_ = cla.to_device(queue, table)
        xe = _extreme((n, heads, hd), 24)  # units outside float32's square range (#19), eps = 0: the slow paths
        xe_ = cla.to_device(queue, xe)
        y, inv = clops.qk_norm_rope(queue, xe_, w_, rope_, eps=0.0)
        wy, winv = ref.qk_norm_rope(xe, w, table, eps=0.0)
        _expect("qk_norm_rope y out of range", y, wy)
        wdx, wdw = ref.qk_norm_rope_bwd(xe, w, winv, table, dy)
        dx, dw = clops.qk_norm_rope_bwd(queue, xe_, w_, inv, rope_, dy_)
        _expect("qk_norm_rope_bwd dx out of range", dx, wdx)
        _expect("qk_norm_rope_bwd dw out of range", dw, wdw)
        cu = np.array([0, 2, 2, 3, n], np.int32)  # varlen: lengths 2, 0, 1, 3
        y, inv = clops.qk_norm_rope(queue, x_, w_, rope_, cu_seqlens=cu)
        _expect("qk_norm_rope y varlen", y, ref.qk_norm_rope(x, w, table, cu_seqlens=cu)[0])
        wdx, wdw = ref.qk_norm_rope_bwd(x, w, inv.get(), table, dy, cu_seqlens=cu)
        dx, dw = clops.qk_norm_rope_bwd(queue, x_, w_, inv, rope_, dy_, cu_seqlens=cu)
        _expect("qk_norm_rope_bwd dx varlen", dx, wdx)
        _expect("qk_norm_rope_bwd dw varlen", dw, wdw)
        for dt, wdt in _narrow_dtypes():  # 16-bit storage, the column sum rounding dw to a 16-bit gain's dtype
            xn, wn, dyn = x.astype(dt), w.astype(wdt), dy.astype(dt)
            xn_, wn_, dyn_ = (cla.to_device(queue, a) for a in (xn, wn, dyn))
            y, inv = clops.qk_norm_rope(queue, xn_, wn_, rope_)
            _expect(f"qk_norm_rope y {dt}", y, ref.qk_norm_rope(xn, wn, table)[0], 1e-2)
            wdx, wdw = ref.qk_norm_rope_bwd(xn, wn, inv.get(), table, dyn)
            dx, dw = clops.qk_norm_rope_bwd(queue, xn_, wn_, inv, rope_, dyn_)
            _expect(f"qk_norm_rope_bwd dx {dt}", dx, wdx, 1e-2)
            _expect(f"qk_norm_rope_bwd dw {dt}", dw, wdw, 1e-2)


def run_attention(queue):
    import pyopencl.array as cla

    import clops
    from clops import reference as ref, tuning
    from clops.reference import rnd

    windows, window, nh, nkv = 2, 17, 4, 2  # 17 rows: a partial query and key block in every tile below
    small = {"bq": 8, "rq": 2, "tx": 2, "bk": 8, "vw": 1, "dc": 8, "kc": 4}
    cpu = {"bq": 16, "rq": 4, "tx": 4, "bk": 16, "vw": 4, "dc": 32, "kc": 16}
    # forward dc = 8: Q resident at hd 8, staged in chunks at hd 16; backward: dc = 4 (step 2
    # restages), and the heuristic's dc = hd (step 2 reads step 1's tiles); split = 1 and 2;
    # dQ from stored dS (dqs: a last dS load that only some work-items make) and recomputed
    for hd in (8, 16):
        bwd = {"wg": 8, "bq": 8, "bk": 8, "sq": 2, "sk": 4, "dc": 4, "jc": 4, "tr": 2, "td": hd // 2, "vw": 1, "split": 1}
        halves_kv = dict(bwd, split=2, sk=8, td=hd)  # 2·(8/2)·(8/8) = 2·(8/2)·(hd/hd) = 8 work-items
        halves_q = dict(bwd, split=2, sk=8)  # dq: (8/2)·(hd/(hd/2)) = 8
        stored_q = {"wg": 8, "bq": 4, "jc": 3, "tr": 1, "td": hd // 2, "vw": 1}  # (4/1)·2 = 8; 12 dS per chunk
        n = windows * window
        q, k, v, do = rnd((n, nh, hd), 31, 1.0), rnd((n, nkv, hd), 32, 1.0), rnd((n, nkv, hd), 33, 1.0), rnd(
            (n, nh, hd), 34, 1.0)
        q_, k_, v_, do_ = (cla.to_device(queue, a) for a in (q, k, v, do))
        for fwd, back_kv, back_q in ((small, bwd, bwd), (small, halves_kv, halves_q), (cpu, None, None),
                                     (None, None, None)):
            if fwd not in _tiles(fwd):
                continue
            tuning.override("attention_fwd", {"hd": hd}, fwd)
            tuning.override("attention_bwd_dkv", {"hd": hd}, back_kv)
            tuning.override("attention_bwd_dq", {"hd": hd}, back_q)
            tuning.override("attention_bwd_dqs", {"hd": hd}, back_q and stored_q)
            (o, lse), (wo, wlse) = clops.attention(queue, q_, k_, v_, window=window), ref.attention(
                q, k, v, window=window)
            _expect("attention o", o, wo)
            _expect("attention lse", lse, wlse)
            want = ref.attention_bwd(q, k, v, wo, wlse, do, window=window)
            for store_ds in (True, False) if back_kv else (None,):  # the default tiles: the default way
                grads = clops.attention_bwd(queue, q_, k_, v_, o, lse, do_, window=window, store_ds=store_ds)
                for name, got, w in zip(("dq", "dk", "dv"), grads, want):
                    _expect(f"attention_bwd {name} (store_ds={store_ds})", got, w)
    # bfloat16 q, k, v, o, do and gradients at the loop's last head dim (16): every load and store site
    # at vector width 4, as on GPUs (the cpu forward, the backward's default tiles), both ways to dQ;
    # not under the uninitialised-value check (vector lanes, see _tiles)
    if _tiles(cpu):
        for op in ("attention_fwd", "attention_bwd_dkv", "attention_bwd_dq", "attention_bwd_dqs"):
            tuning.override(op, {"hd": hd}, cpu if op == "attention_fwd" else None)
        q16, k16, v16, do16 = (a.astype("bfloat16") for a in (q, k, v, do))
        q_, k_, v_, do_ = (cla.to_device(queue, a) for a in (q16, k16, v16, do16))
        o, lse = clops.attention(queue, q_, k_, v_, window=window)
        wo, wlse = ref.attention(q16, k16, v16, window=window)
        _expect("attention o bfloat16", o, wo, NARROW_TOL)
        _expect("attention lse bfloat16", lse, wlse)
        want = ref.attention_bwd(q16, k16, v16, o.get(), lse.get(), do16, window=window)
        for store_ds in (True, False):
            grads = clops.attention_bwd(queue, q_, k_, v_, o, lse, do_, window=window, store_ds=store_ds)
            for name, got, w in zip(("dq", "dk", "dv"), grads, want):
                _expect(f"attention_bwd {name} bfloat16 (store_ds={store_ds})", got, w, NARROW_TOL)


def run_attention_variants(queue):
    import numpy as np
    import pyopencl.array as cla

    import clops
    from clops import reference as ref, tuning
    from clops.reference import rnd

    nh, nkv, hd, n = 4, 2, 8, 34
    bwd = {"wg": 8, "bq": 8, "bk": 8, "sq": 2, "sk": 4, "dc": 4, "jc": 4, "tr": 2, "td": hd // 2, "vw": 1, "split": 1}
    halves_kv, halves_q = dict(bwd, split=2, sk=8, td=hd), dict(bwd, split=2, sk=8)  # the softcap's halves
    tuning.override("attention_fwd", {"hd": hd}, {"bq": 8, "rq": 2, "tx": 2, "bk": 8, "vw": 1, "dc": 8, "kc": 4})
    tuning.override("attention_bwd_dqs", {"hd": hd}, {"wg": 8, "bq": 4, "jc": 3, "tr": 1, "td": hd // 2, "vw": 1})
    q, k, v, do = rnd((n, nh, hd), 31, 1.0), rnd((n, nkv, hd), 32, 1.0), rnd((n, nkv, hd), 33, 1.0), rnd(
        (n, nh, hd), 34, 1.0)
    q_, k_, v_, do_ = (cla.to_device(queue, a) for a in (q, k, v, do))
    # equal windows of 17 and sequences (one empty) across the 8-row blocks; every variant flag
    for kw, back_kv, back_q in ((dict(window=17, causal=False, sliding_window=5, softcap=2.0), bwd, bwd),
                                (dict(cu_seqlens=np.array([0, 3, 3, 20, n], np.int32), sliding_window=4, softcap=2.0),
                                 halves_kv, halves_q),
                                (dict(cu_seqlens=np.array([0, 11, n], np.int32), causal=False), halves_kv, bwd)):
        tuning.override("attention_bwd_dkv", {"hd": hd}, back_kv)
        tuning.override("attention_bwd_dq", {"hd": hd}, back_q)
        (o, lse), (wo, wlse) = clops.attention(queue, q_, k_, v_, **kw), ref.attention(q, k, v, **kw)
        _expect("attention o", o, wo)
        _expect("attention lse", lse, wlse)
        want = ref.attention_bwd(q, k, v, wo, wlse, do, **kw)
        for store_ds in (True, False):
            grads = clops.attention_bwd(queue, q_, k_, v_, o, lse, do_, store_ds=store_ds, **kw)
            for name, got, w in zip(("dq", "dk", "dv"), grads, want):
                _expect(f"attention_bwd {name} (store_ds={store_ds})", got, w)


def run_attention_mma(queue):
    import numpy as np
    import pyopencl.array as cla

    import clops
    from clops import mma, reference as ref, tuning
    from clops.reference import rnd

    # The matrix-unit driver with the portable products: two warps of 16 rows and 16-key blocks, one
    # buffer of K and V or two in turn, over windows and sequences of 17-34 rows (partial blocks),
    # every variant flag, a NaN of V in a block crossing the diagonal (the exact masked form),
    # bfloat16 storage; the sequences with Q read at each block (their length in local memory); at
    # hd 16 the warps in column halves' pairs (their partial S shared through local memory); under the
    # sliding windows each warp on a head of its own (gp 2: the two heads of a KV head a group).
    nh, nkv, n = 4, 2, 34
    with mma.using("fma"):
        for i, (hd, dtype, kw) in enumerate(((8, "float32", dict(window=17)), (16, "float32", dict(window=17)),
                                             (8, "float32", dict(window=17, causal=False, sliding_window=5, softcap=2.0)),
                                             (8, "float32", dict(cu_seqlens=np.array([0, 3, 3, 20, n], np.int32),
                                                                 sliding_window=4)),
                                             (16, "bfloat16", dict(window=34)))):
            tuning.override("attention_fwd_mma", {"hd": hd, "st": "float" if dtype == "float32" else "bf16",
                                                  "product": "fma"},
                            {"nw": 2, "bk": 16, "stages": 1 + i % 2, "af": 2 if "cu_seqlens" in kw else 1,
                             "sx": 2 if hd == 16 else 1, "gp": 2 if "sliding_window" in kw else 1})
            q, k, v = (rnd(s, seed, 1.0).astype(dtype) for s, seed in (((n, nh, hd), 31), ((n, nkv, hd), 32),
                                                                        ((n, nkv, hd), 33)))
            (o, lse), (wo, wlse) = clops.attention(queue, *(cla.to_device(queue, a) for a in (q, k, v)), **kw), \
                ref.attention(q, k, v, **kw)
            _expect(f"attention_mma o {kw}", o, wo, 1e-5 if dtype == "float32" else NARROW_TOL)
            _expect(f"attention_mma lse {kw}", lse, wlse)
        v[20, 1, 3] = np.nan  # rows 0-19 of the window must not see it
        o, _ = clops.attention(queue, *(cla.to_device(queue, a) for a in (q, k, v)), window=34)
        if np.isnan(o.get()[:20]).any() or not np.isnan(o.get()[20:, 2:, 3]).all():
            raise AssertionError("attention_mma: a NaN of V reached rows that do not see it")


def run_attention_bwd_mma(queue):
    import numpy as np
    import pyopencl.array as cla

    import clops
    from clops import mma, reference as ref, tuning
    from clops.reference import rnd

    # The matrix-unit backward's passes with the portable products, the forward tour's tiles and
    # shapes, given the reference's o and lse; dS recomputed (dq, dkv), and stored (dkv, dqs) once.
    nh, nkv, n = 4, 2, 34
    with mma.using("fma"):
        for hd, dtype, kw in ((8, "float32", dict(window=17, causal=False, sliding_window=5, softcap=2.0)),
                              (8, "float32", dict(cu_seqlens=np.array([0, 3, 3, 20, n], np.int32), sliding_window=4)),
                              (32, "bfloat16", dict(window=34)), (32, "bfloat16", dict(window=34, store_ds=True))):
            # at hd 32 dkv's column halves are the two warps of a pair (sx), summing S and dP through local memory
            # dq with two buffers of K and V at float32 (the sliding window's edges, sequences), one at bf16
            for spec, tiles in (("attention_bwd_mma_dq", {"af": 1, "stages": 2 if hd == 8 else 1}), ("attention_bwd_mma_dqs", {}),
                                ("attention_bwd_mma_dkv", {"cs": 2, "sx": 2, "af": 1} if hd == 32 else {"cs": 1, "sx": 1, "af": 1})):
                tuning.override(spec, {"hd": hd, "st": "float" if dtype == "float32" else "bf16", "product": "fma"},
                                dict(tiles, nw=2, bk=16))
            q, k, v, do = (rnd(s, seed, 1.0).astype(dtype) for s, seed in (((n, nh, hd), 31), ((n, nkv, hd), 32),
                                                                            ((n, nkv, hd), 33), ((n, nh, hd), 34)))
            fwd = {k: v for k, v in kw.items() if k != "store_ds"}
            wo, wlse = ref.attention(q, k, v, **fwd)
            arrays = (q, k, v, wo.astype(dtype), wlse.astype(np.float32), do)
            grads = clops.attention_bwd(queue, *(cla.to_device(queue, a) for a in arrays), **kw)
            for name, got, w in zip(("dq", "dk", "dv"), grads, ref.attention_bwd(*arrays, **fwd)):
                _expect(f"attention_bwd_mma {name} {kw}", got, w, 1e-5 if dtype == "float32" else NARROW_TOL)


def run_cross_entropy(queue):
    import numpy as np
    import pyopencl.array as cla

    import clops
    from clops import reference as ref, tuning
    from clops.reference import rnd

    x, dloss = rnd((3, 45), 1, 4.0), rnd(3, 2)
    t = np.array([7, -100, 44], np.int32)
    x_, dl_ = cla.to_device(queue, x), cla.to_device(queue, dloss)
    # 45 columns: rows starting off and on a vector boundary, an edge longer than a group of 4, steps of
    # 2 vectors and then of 1, a last step that does not fill the group; the backward's rows in two
    # groups of 4 × 2 vectors, the second part full, the edge over both
    for params, bwd in zip(_tiles({"wg": 4, "unroll": 2}, {"wg": 5, "unroll": 1}, None),
                           _tiles({"wg": 4, "ept": 2}, {"wg": 5, "ept": 1}, None)):
        tuning.override("cross_entropy", {}, params)
        tuning.override("cross_entropy_bwd", {"st": "float"}, bwd)
        for cap in (None, 10.0):
            loss, lse = clops.cross_entropy(queue, x_, t, label_smoothing=0.1, softcap=cap)
            want_loss, want_lse = ref.cross_entropy(x, t, label_smoothing=0.1, softcap=cap)
            _expect("cross_entropy", loss, want_loss, 1e-6)
            _expect("cross_entropy lse", lse, want_lse, 1e-6)
            _expect("cross_entropy_bwd", clops.cross_entropy_bwd(queue, x_, t, lse, dl_, label_smoothing=0.1, softcap=cap),
                    ref.cross_entropy_bwd(x, t, lse.get(), dloss, label_smoothing=0.1, softcap=cap))
    for dtype in NARROW:
        x16 = x.astype(dtype)
        dx16 = cla.to_device(queue, x16)
        loss, lse = clops.cross_entropy(queue, dx16, t)
        _expect(f"cross_entropy lse {dtype}", lse, ref.cross_entropy(x16, t)[1], 1e-6)
        _expect(f"cross_entropy_bwd {dtype}", clops.cross_entropy_bwd(queue, dx16, t, lse, dl_),
                ref.cross_entropy_bwd(x16, t, lse.get(), dloss), NARROW_TOL)
    tuning.override("cross_entropy", {}, None)
    tuning.override("cross_entropy_bwd", {"st": "float"}, None)


def run_adamw(queue):
    import pyopencl.array as cla

    import clops
    from clops import reference as ref, tuning
    from clops.reference import rnd

    p, g, m, v = rnd(37, 1), rnd(37, 2), rnd(37, 3, 0.1), abs(rnd(37, 4, 0.1))
    for params in _tiles({"wg": 4, "vw": 4, "ept": 2}, {"wg": 8, "vw": 1, "ept": 3}, None):  # 37: tails
        tuning.override("adamw", {}, params)
        dp, dg, dm, dv = (cla.to_device(queue, a) for a in (p, g, m, v))
        for got, want in zip(clops.adamw(queue, dp, dg, dm, dv, lr=0.01, step=3, weight_decay=0.1),
                             ref.adamw(p, g, m, v, lr=0.01, step=3, weight_decay=0.1)):
            _expect("adamw", got, want, 1e-6)
    for dtype in NARROW:  # a 16-bit g read, a 16-bit p_half written
        dp, dg, dm, dv = (cla.to_device(queue, a) for a in (p, g.astype(dtype), m, v))
        half = cla.empty(queue, p.shape, dtype)
        clops.adamw(queue, dp, dg, dm, dv, lr=0.01, step=3, weight_decay=0.1, p_half=half)
        _expect(f"adamw p_half {dtype}", half, ref.adamw(p, g.astype(dtype), m, v, lr=0.01, step=3, weight_decay=0.1)[0],
                NARROW_TOL)
    tuning.override("adamw", {}, None)


def run_embedding(queue):
    import numpy as np
    import pyopencl.array as cla

    import clops
    from clops import embed, reference as ref, tuning
    from clops.reference import rnd

    runs = embed.RUNS
    ids = np.random.default_rng(3).integers(-1, 10, 100).astype(np.int32)  # some out of range
    i_ = cla.to_device(queue, ids)
    for d in (5, 8):  # the gradient's rows element by element, then in vectors of 4
        table, dout = rnd((9, d), 1), rnd((100, d), 2)
        t_, d_ = (cla.to_device(queue, a) for a in (table, dout))
        for params in _tiles({"wg": 4}, None):
            # 100 ids, blocks of 32 keys merged into one run (RUNS 1): every kind of sort pass; the device's
            # tiles read their sorted blocks as runs
            embed.RUNS = 1 if params else runs
            tuning.override("embedding", {}, params)
            invalid = cla.to_device(queue, np.zeros(1, np.int32))  # written from the host: initialised for oclgrind
            _expect("embedding", clops.embedding(queue, t_, i_, invalid=invalid), ref.embedding(table, ids), 0)
            _expect("embedding_bwd", clops.embedding_bwd(queue, i_, d_, vocab=9, invalid=invalid),
                    ref.embedding_bwd(ids, dout, 9), 1e-6)
        for dtype in NARROW:
            t16, d16 = table.astype(dtype), dout.astype(dtype)
            _expect(f"embedding {dtype}", clops.embedding(queue, cla.to_device(queue, t16), i_),
                    ref.embedding(t16, ids), 0)
            _expect(f"embedding_bwd {dtype}", clops.embedding_bwd(queue, i_, cla.to_device(queue, d16), vocab=9),
                    ref.embedding_bwd(ids, d16, 9), NARROW_TOL)
    tuning.override("embedding", {}, None)
    embed.RUNS = runs


# family: (runner, the templates whose every kernel the runner must launch)
FAMILIES = {
    "embedding": (run_embedding, ["embedding.cl.mako"]),
    "adamw": (run_adamw, ["adamw.cl.mako"]),
    "cross_entropy": (run_cross_entropy, ["cross_entropy.cl.mako"]),
    "elementwise": (run_elementwise, ["elementwise.cl.mako"]),
    "norm": (run_norm, ["rms_norm.cl.mako"]),
    "qk_norm_rope": (run_qk_norm_rope, ["qk_norm_rope.cl.mako"]),
    "attention": (run_attention, ["attention_fwd.cl.mako", "attention_bwd.cl.mako"]),
    "attention_variants": (run_attention_variants, ["attention_fwd.cl.mako", "attention_bwd.cl.mako"]),
    "attention_mma": (run_attention_mma, ["attention_fwd_mma.cl.mako"]),
    "attention_bwd_mma": (run_attention_bwd_mma, ["attention_bwd_mma.cl.mako"]),
}

# Throwaway kernels, each with one planted fault of a kind the simulator must report.
PLANTED = {
    "out_of_bounds": ("invalid write", """
        __kernel __attribute__((reqd_work_group_size(4, 1, 1))) void planted(__global float *a)
        { a[get_global_id(0) + 1] = 1.0f; }"""),
    "data_race": ("data race", """
        __kernel __attribute__((reqd_work_group_size(4, 1, 1))) void planted(__global float *a)
        { __local float s[4]; s[get_local_id(0)] = 1.0f; a[get_global_id(0)] = s[(get_local_id(0) + 1) % 4]; }"""),
    "uninitialized": ("uninitialized value", """
        __kernel __attribute__((reqd_work_group_size(4, 1, 1))) void planted(__global float *a)
        { __local float s[4]; if (get_local_id(0) > 0) s[get_local_id(0)] = 1.0f; barrier(CLK_LOCAL_MEM_FENCE);
          if (s[0] > 0.0f) a[get_global_id(0)] = s[get_local_id(0)]; }"""),
    "barrier_divergence": ("divergence", """
        __kernel __attribute__((reqd_work_group_size(4, 1, 1))) void planted(__global float *a)
        { if (get_local_id(0) < 2) barrier(CLK_LOCAL_MEM_FENCE); a[get_global_id(0)] = 1.0f; }"""),
}


def run_planted(queue, kind):
    import pyopencl as cl
    import pyopencl.array as cla

    prg = cl.Program(queue.context, PLANTED[kind][1]).build(options=["-cl-std=CL1.2"])
    a = cla.zeros(queue, 4, np.float32)
    prg.planted(queue, (4,), (4,), a.data)


def _subprocess_main(what):
    import pyopencl as cl
    import pyopencl.array as cla

    import clops.program

    (platform,) = cl.get_platforms()  # the environment registers oclgrind only
    assert platform.name == "Oclgrind", platform.name
    queue = cl.CommandQueue(cl.Context(platform.get_devices()))
    if what in PLANTED:
        run_planted(queue, what)
        queue.finish()
        return
    # Every array stays alive for the whole run: oclgrind 21.10's uninitialised-value plugin
    # reports host-written arrays as uninitialised when they reuse a freed array's memory.
    kept, init = [], cla.Array.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        kept.append(self)

    cla.Array.__init__ = keep
    launched = set()
    clops.program.observers["oclgrind-test"] = lambda q, knl, size, evt, start: launched.add((knl.template, knl.name))
    run, templates = FAMILIES[what]
    run(queue)
    queue.finish()
    built = {(k.template, k.name) for progs in clops.program._programs.values() for p in progs.values()
             for k in p.values() if k.template in templates}
    if built - launched:
        raise AssertionError(f"{what}: kernels built but never launched: {sorted(built - launched)}")
    print(f"{what}: {len(launched)} kernels ran: {sorted(n for _, n in launched)}")


# ---- the tests: run a family (or a planted fault) in a subprocess, read oclgrind's log ----

CHECKS = {"races": "OCLGRIND_DATA_RACES", "uninitialized": "OCLGRIND_UNINITIALIZED"}


def _environment(folder, check):
    import clops

    icd_dir = folder / "icd"
    icd_dir.mkdir()
    (icd_dir / "oclgrind.icd").write_text(OCLGRIND_ICD + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYOPENCL_", "CLOPS_", "OCLGRIND_"))}
    # The subprocess imports the clops this process imported, built from source every time.
    root = os.path.dirname(os.path.dirname(os.path.abspath(clops.__file__)))
    env.update(
        OCL_ICD_VENDORS=str(icd_dir), PYTHONPATH=os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")])),
        CLOPS_NO_CACHE="1", OCLGRIND_CHECK_API="1", OCLGRIND_LOG=str(folder / "oclgrind.log"),
        # Unoptimised, the kernels run as written: oclgrind 21.10 lacks some intrinsics clang's
        # optimiser emits (llvm.usub.sat.i32), and its uninitialised-value plugin misreads the
        # optimiser's vectors built lane by lane from `poison` (false reports, seen on a
        # ten-line kernel; attention_fwd's Pᵀ stores).
        OCLGRIND_BUILD_OPTIONS="-cl-opt-disable",
    )
    env[CHECKS[check]] = "1"
    return env


def diagnostics(log):
    """oclgrind's reports in ``log``: each a head line with its indented detail lines.

    pyopencl's build probes a device property oclgrind does not know; the API check
    reports that clGetDeviceInfo call, which is no fault of the kernels and is dropped.
    """
    reports = []
    for line in log.splitlines():
        if line.strip() and not line[0].isspace():
            reports.append(line)
        elif reports and line.strip():
            reports[-1] += "\n" + line
    probe = ("Function: clGetDeviceInfo", "CL_INVALID_VALUE", "'param_name'")
    return [r for r in reports if not all(p in r for p in probe)]


def run_under_oclgrind(tmp_path, what, check, timeout=300):
    """(subprocess result, oclgrind's reports) of running ``what`` in a fresh interpreter.

    Kernel reports go to the log; the API check writes to stderr (its blocks open with "Oclgrind").
    """
    env = _environment(tmp_path, check)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), what], env=env, capture_output=True,
                          text=True, timeout=timeout)
    log = tmp_path / "oclgrind.log"
    reports = diagnostics(log.read_text() if log.exists() else "")
    return proc, reports + [r for r in diagnostics(proc.stderr) if r.startswith("Oclgrind")]


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_is_clean_under_oclgrind(tmp_path, family, check):
    proc, reports = run_under_oclgrind(tmp_path, family, check)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kernels ran" in proc.stdout, proc.stdout + proc.stderr
    assert not reports, "\n\n".join(reports[:5])


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_planted_fault_is_reported(tmp_path, kind):
    """The checks are really on: each planted fault shows up in oclgrind's log."""
    proc, reports = run_under_oclgrind(tmp_path, kind, "uninitialized" if kind == "uninitialized" else "races",
                                       timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert any(PLANTED[kind][0] in r.lower() for r in reports), reports


if __name__ == "__main__":
    _subprocess_main(sys.argv[1])
