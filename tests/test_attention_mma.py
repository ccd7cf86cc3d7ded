"""The matrix-unit attention forward (attention_fwd_mma.cl.mako) and backward
(attention_bwd_mma.cl.mako) against the float64 reference.

Each driver runs with the portable tile products (``CLOPS_MMA=fma``) on every device, and with the
matrix-unit products where the probe passes (NVIDIA), at the tolerances of tests/test_attention.py
(float32 storage: 3xTF32 keeps them), tests/test_attention_bwd.py and tests/test_attention_narrow.py
(16-bit storage). The backward both ways to dQ: from the dS that the dK/dV pass stored
(``store_ds=True``) and recomputing it (``store_ds=False``, and the default). On
NVIDIA tests/test_attention_variants.py and tests/test_attention_narrow.py's forward run the matrix
units too, the default there at every storage type (tests/test_attention.py, tests/test_attention_bwd.py
and tests/test_attention_narrow.py's backward take the portable kernels by CLOPS_MMA=0).
"""
import types

import ml_dtypes
import numpy as np
import pyopencl as cl
import pytest

import clops
from clops import attn, mma, program, reference as ref, tuning
from clops.args import storage
from clops.attn import BWD_MMA, FWD_MMA
from helpers import assert_storage_close, to_device
from test_attention import LSE_TOL, O_TOL
from test_attention_bwd import TOL
from test_attention_narrow import _grad_scale

BF16 = np.dtype(ml_dtypes.bfloat16)
# The band's edges on the blocks' (16-row multiples): a block's first query sees the previous
# key block's last key, its last query the next block's first key.
WINDOW_2 = {"window": 50, "sliding_window": 2, "causal": False}
CU = np.array([0, 0, 1, 40, 40, 100], np.int32)  # empty sequences, one of a single token
CAUSAL_80, SLIDING_80 = {"window": 80}, {"window": 80, "sliding_window": 9, "causal": False}  # the NaN tests'


@pytest.fixture(params=["fma", "matrix units"])
def product(request, queue):
    """The driver's tile products: the portable ones, or the device's matrix units (where the probe passes;
    float32 storage too, tf32x3)."""
    if request.param != "fma":
        ok, why = mma.probe(queue.device, queue.context)
        if not ok:
            pytest.skip(f"no matrix units: {why}")
    with mma.using("fma" if request.param == "fma" else "1"):
        yield request.param


def _check(queue, n, nh, nkv, hd, dtype=np.float32, tiles=None, qkv=None, **kw):
    """The forward at ``tiles`` (None: the heuristic's) against the reference, on ``qkv`` (of ``dtype``) or
    seeded random q, k, v."""
    q, k, v = qkv or (ref.rnd(s, seed).astype(dtype)
                      for s, seed in (((n, nh, hd), 11), ((n, nkv, hd), 12), ((n, nkv, hd), 13)))
    kw = kw or {"window": n}
    product = mma.forward_product(queue, clops.args.storage(np.dtype(dtype)))[0]
    sc = {"hd": hd, "st": clops.args.storage(np.dtype(dtype)), "product": product}
    tuning.override("attention_fwd_mma", sc, tiles)
    try:
        o, lse = clops.attention(queue, *to_device(queue, q, k, v), **kw)
    finally:
        tuning.override("attention_fwd_mma", sc, None)
    want_o, want_lse = ref.attention(q, k, v, **kw)
    if np.dtype(dtype) == np.float32:
        assert ref.rel_err(o.get(), want_o) <= O_TOL
    else:
        assert_storage_close("o", o, want_o, dtype, O_TOL)
    assert ref.rel_err(lse.get(), want_lse) <= LSE_TOL
    return o.get()


@pytest.mark.parametrize("hd", [8, 40, 128, 256])  # 64: the window and storage tests below
def test_head_dims(queue, product, hd):
    _check(queue, 74, 4, 2, hd, window=37)


@pytest.mark.parametrize("window", [1, 17, 100])
def test_windows_one_kv_head(queue, product, window):
    _check(queue, 2 * window, 4, 1, 64, window=window)


@pytest.mark.parametrize("dtype, hd", [(BF16, 64), (BF16, 40), (np.float16, 64)], ids=["bf16-64", "bf16-40", "f16-64"])
def test_storage_dtypes(queue, product, dtype, hd):
    _check(queue, 74, 4, 2, hd, dtype, window=37)



@pytest.mark.parametrize("kw", [{"window": 50, "causal": False}, {"window": 50, "sliding_window": 5},
                                {"window": 50, "sliding_window": 7, "causal": False}, {"window": 50, "softcap": 3.0},
                                {"window": 50, "softcap": 50.0},
                                {"cu_seqlens": CU, "sliding_window": 20, "softcap": 5.0}, WINDOW_2,
                                {"window": 50, "scale": -0.3}, {"window": 50, "sliding_window": 7, "scale": 0.0}],
                         ids=["non-causal", "sliding", "sliding-non-causal", "softcap", "softcap-50", "varlen",
                              "sliding-2", "negative-scale", "zero-scale"])
def test_variants(queue, product, kw):
    """Each variant; a scale ≤ 0 too, where the forward scales each score before the row max (above 0
    the max is of the raw scores, scaled once a row); a softcap above attn.CAPREF_MAX·ln 2 (50), where the
    matrix-unit forward takes row maxima again (below, the cap is every row's reference)."""
    _check(queue, 100, 4, 2, 32, **kw)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bf16"])
def test_rows_whose_max_grows_block_by_block(queue, product, dtype):
    """Scores growing with the key's position as j³ (a row's largest, in log2, by 0.6, 5, 14, 27, 45
    and 68 from one block of 16 keys to the next: 2^160 in all), so a row's reference max moves in
    some blocks and not in others (the forward rescales O lazily, only past 2^LAZY_MAX), and P would
    overflow float32 if it never moved."""
    n, hd = 96, 32
    rng = np.random.default_rng(7)
    d = np.ones(hd) / np.sqrt(hd)  # scores = (q·d)(k·d)·scale: q·d ≈ 2, k·d grows as j³
    q = 2 * d + 0.05 * rng.standard_normal((n, 2, hd))
    k = (6.47e-5 * np.arange(n) ** 3)[:, None, None] * np.sqrt(hd) * d + 0.05 * rng.standard_normal((n, 1, hd))
    qkv = tuple(x.astype(dtype) for x in (q, k, ref.rnd((n, 1, hd), 3)))
    _check(queue, n, 2, 1, hd, dtype, tiles={"nw": 1, "bk": 16, "stages": 1, "af": 1, "sx": 1, "gp": 1}, qkv=qkv)


@pytest.mark.parametrize("tiles, kw", [
    ({"nw": 1, "bk": 16, "stages": 1, "af": 1, "sx": 1, "gp": 1}, {"window": 50}),
    ({"nw": 3, "bk": 48, "stages": 1, "af": 1, "sx": 1, "gp": 1}, {"window": 50}),
    ({"nw": 2, "bk": 16, "stages": 2, "af": 1, "sx": 1, "gp": 1}, {"window": 50}),
    ({"nw": 2, "bk": 16, "stages": 1, "af": 2, "sx": 1, "gp": 1}, {"cu_seqlens": CU}),
    ({"nw": 2, "bk": 16, "stages": 1, "af": 1, "sx": 2, "gp": 1}, {"window": 50}),
    ({"nw": 4, "bk": 32, "stages": 2, "af": 2, "sx": 2, "gp": 1}, {"cu_seqlens": CU, "sliding_window": 20, "softcap": 5.0})],
    ids=["one-warp", "three-warps-48-keys", "two-stages", "q-read-varlen", "column-pairs",
         "column-pairs-two-stages-q-read-varlen-sliding-softcap"])
def test_tiles(queue, product, tiles, kw):
    """Tiles the heuristics do not take here; Q read at each block with varlen's sequence length in local
    memory (the driver's way with tf32x3 at hd 256); the warps in column halves' pairs (sx 2), with one
    buffer (the pair's S added after V's barrier) and two (a barrier of its own)."""
    _check(queue, 100, 2, 1, 48, tiles=tiles, **kw)


@pytest.mark.parametrize("tiles, nh, nkv, kw", [
    ({"nw": 4, "bk": 16, "stages": 1, "af": 1, "sx": 1, "gp": 2}, 4, 2, {"cu_seqlens": CU, "sliding_window": 20}),
    ({"nw": 4, "bk": 32, "stages": 2, "af": 1, "sx": 1, "gp": 4}, 8, 2, {"window": 50}),
    ({"nw": 4, "bk": 16, "stages": 2, "af": 2, "sx": 2, "gp": 2}, 4, 1, {"window": 50, "sliding_window": 7,
                                                                         "causal": False}),
    ({"nw": 4, "bk": 16, "stages": 1, "af": 1, "sx": 1, "gp": 4}, 2, 1, {"window": 50, "softcap": 5.0}),
    ({"nw": 2, "bk": 16, "stages": 1, "af": 1, "sx": 1, "gp": 2}, 3, 3, {"window": 50})],
    ids=["two-heads-varlen-sliding", "four-heads", "two-heads-column-pairs-sliding-non-causal",
         "four-wanted-two-served", "two-wanted-one-served"])
def test_heads_a_group(queue, product, tiles, nh, nkv, kw):
    """A group on gp query heads of one KV head (its row tiles the heads' in turn); where the heads a KV
    head serves are fewer than gp, or gp does not divide them, the largest power of two that does."""
    _check(queue, 100, nh, nkv, 48, tiles=tiles, **kw)


# float32 with each mask and buffering; each 16-bit type once (the scan's test of its exponent fields);
# column halves' pairs once
@pytest.mark.parametrize("kw, stages, dtype, value, sx", [
    (CAUSAL_80, 1, np.float32, np.nan, 1), (CAUSAL_80, 2, np.float32, np.nan, 1),
    (SLIDING_80, 1, np.float32, np.nan, 1), (SLIDING_80, 2, np.float32, np.nan, 1), (SLIDING_80, 1, BF16, np.inf, 1),
    (CAUSAL_80, 2, np.float16, -np.inf, 1), (SLIDING_80, 1, np.float32, np.nan, 2)],
    ids=["causal", "causal-two-stages", "sliding-non-causal", "sliding-non-causal-two-stages",
         "bf16-inf-sliding-non-causal", "f16-minus-inf-causal-two-stages", "sliding-non-causal-column-pairs"])
def test_non_finite_v_stays_in_the_rows_that_see_it(queue, product, kw, stages, dtype, value, sx):
    """A NaN or ±Inf of V in a block that crosses the mask reaches only the rows whose mask lets its key
    in (a matrix product would multiply it by their zero P), with one buffer of K and V or two (the
    block's flag set before the barrier that the products follow), at each storage type (the scan
    tests each type's exponent field), and in the warps' column halves (sx 2: the column of the NaN is
    in the first half, the second half's rows stay finite)."""
    n, key, col = 80, 37, 5
    q, k, v = (ref.rnd((n, 1, 16), seed).astype(dtype) for seed in (1, 2, 3))
    v[key, 0, col] = value
    st = storage(np.dtype(dtype))
    sc = {"hd": 16, "st": st, "product": mma.forward_product(queue, st)[0]}
    tuning.override("attention_fwd_mma", sc, {"nw": 2, "bk": 16, "stages": stages, "af": 1, "sx": sx, "gp": 1})
    try:
        o, _ = clops.attention(queue, *to_device(queue, q, k, v), **kw)
    finally:
        tuning.override("attention_fwd_mma", sc, None)
    i = np.arange(n)
    sees = key <= i if kw.get("causal", True) else np.abs(i - key) < kw["sliding_window"]
    where = np.zeros((n, 1, 16), bool)
    where[sees, 0, col] = True
    assert (~np.isfinite(o.get().astype(np.float32)) == where).all()


def _check_bwd(queue, product, n, nh, nkv, hd, dtype=np.float32, tiles=None, dkv=None, store_ds=None, **kw):
    """The backward of the matrix-unit driver given the reference's o and lse."""
    dtype = np.dtype(dtype)
    q, k, v, do = (ref.rnd(s, seed).astype(dtype) for s, seed in (((n, nh, hd), 11), ((n, nkv, hd), 12),
                                                                  ((n, nkv, hd), 13), ((n, nh, hd), 14)))
    kw = kw or {"window": n}
    o, lse = ref.attention(q, k, v, **kw)
    arrays = (q, k, v, o.astype(dtype), lse.astype(np.float32), do)
    st = clops.args.storage(dtype)
    sc = {"hd": hd, "st": st, "product": mma.backward_product(queue, st)[0]}
    for pass_, spec in BWD_MMA.items():  # dqs takes the tiles' nw and bk
        extra = dkv if pass_ == "dkv" else None
        p = {k: v for k, v in dict(tiles or {}, **(extra or {})).items() if k in spec.names}
        tuning.override(spec.op, sc, p if tiles else None)
    try:
        got = [g.get() for g in clops.attention_bwd(queue, *to_device(queue, *arrays), store_ds=store_ds, **kw)]
    finally:
        for spec in BWD_MMA.values():
            tuning.override(spec.op, sc, None)
    for name, g, w in zip(("dq", "dk", "dv"), got, ref.attention_bwd(*arrays, **kw)):
        if dtype == np.float32:
            assert ref.rel_err(g, w) <= TOL, name
        else:
            assert_storage_close(name, g, w, dtype, TOL, scale=_grad_scale(w))
    return got


@pytest.mark.parametrize("hd, dtype", [(8, np.float32), (64, np.float32), (40, BF16), (128, BF16), (64, np.float16)],
                         ids=["8", "64", "40-bf16", "128-bf16", "64-f16"])  # hd 128 at float32: the bf16 case's driver
def test_backward_head_dims_and_dtypes(queue, product, hd, dtype):
    _check_bwd(queue, product, 74, 4, 2, hd, dtype, window=37)


@pytest.mark.parametrize("window", [2, 17])  # at window 1 every gradient is 0: nothing to compare relatively
def test_backward_windows_one_kv_head(queue, product, window):
    _check_bwd(queue, product, 2 * window, 4, 1, 32, BF16, window=window)


def test_long_sums_keep_float32_accuracy(queue):
    """Sums over a window of 1536 keys (the forward's O, dQ) and queries (dK, dV) on the matrix units at
    float32 storage, within float32's tolerances: the unit rounds its sums toward zero, so a sum run
    through it over every block drifts by an ulp of the sum each product (dV 1.8e-5 on an H100 at
    1024)."""
    ok, why = mma.probe(queue.device, queue.context)
    if not ok:
        pytest.skip(f"no matrix units: {why}")
    with mma.using("1"):
        _check(queue, 1536, 1, 1, 64)
        _check_bwd(queue, "matrix units", 1536, 1, 1, 64)


@pytest.fixture(params=[True, False], ids=["ds-stored", "ds-recomputed"])
def store_ds(request):
    return request.param


@pytest.mark.parametrize("store_ds, hd, dtype", [(True, 32, BF16), (False, 32, BF16), (None, 32, BF16),
                                                 (None, 128, BF16), (None, 64, np.float32)],
                         ids=["ds-stored", "ds-recomputed", "default", "default-hd128", "default-float32-hd64"])
def test_store_ds_picks_the_passes(queue, product, store_ds, hd, dtype):
    """Stored: D, then dK/dV (storing dS), then dQ from it; recomputed (the default below the product's
    MMA_STORE_DS_MIN_HD: hd 128 at 16 bits, 64 with tf32x3): dQ (storing D), then dK/dV. (hd 32:
    test_backward_windows_one_kv_head's kernels, causal.)"""
    if dtype == np.float32 and product == "fma":
        pytest.skip("float32's own threshold is tf32x3's; the portable products' is the default case's (6 s of builds)")
    q, k, v, do = (ref.rnd(shape, seed).astype(dtype) for shape, seed in (((34, 2, hd), 1), ((34, 1, hd), 2),
                                                                          ((34, 1, hd), 3), ((34, 2, hd), 4)))
    o, lse = ref.attention(q, k, v, window=17)
    with clops.profile(queue) as prof:
        clops.attention_bwd(queue, *to_device(queue, q, k, v, o.astype(dtype), lse.astype(np.float32), do), window=17,
                            store_ds=store_ds)
    min_hd = attn.MMA_STORE_DS_MIN_HD[mma.backward_product(queue, storage(np.dtype(dtype)))[0]]
    stored = store_ds or (store_ds is None and hd >= min_hd)
    passes = ["attn_bwd_dsum", "attn_bwd_dkv", "attn_bwd_dqs"] if stored else ["attn_bwd_dq", "attn_bwd_dkv"]
    assert [r.name for r in prof.launches] == passes


@pytest.mark.parametrize("kw", [{"window": 50, "causal": False}, {"window": 50, "sliding_window": 7, "causal": False},
                                {"cu_seqlens": CU, "sliding_window": 20, "softcap": 5.0}, WINDOW_2],
                         ids=["non-causal", "sliding-non-causal", "varlen-sliding-softcap", "sliding-2"])
def test_backward_variants(queue, product, store_ds, kw):
    _check_bwd(queue, product, 100, 4, 2, 32, BF16, store_ds=store_ds, **kw)


@pytest.mark.parametrize("tiles, sx, hd", [({"nw": 3, "bk": 48, "af": 1, "stages": 1}, 1, 48),
                                           ({"nw": 1, "bk": 16, "af": 2, "stages": 2}, 1, 48),
                                           ({"nw": 2, "bk": 32, "af": 1, "stages": 2}, 2, 64)])
def test_backward_tiles(queue, product, store_ds, tiles, sx, hd):
    """dkv's column split (cs = 2) across groups (sx = 1) or across the warps of a pair (sx = 2), each
    storing dS once; af = 2 reads the A operands at each step; dq's two buffers of K and V."""
    _check_bwd(queue, product, 90, 2, 1, hd, BF16, tiles=tiles, dkv={"cs": 2, "sx": sx}, store_ds=store_ds, window=45)


@pytest.mark.parametrize("n, kw", [(66, {"window": 33}), (66, {"window": 33, "sliding_window": 5, "causal": False}),
                                  (81, {"cu_seqlens": np.array([0, 0, 17, 17, 50, 81], np.int32), "sliding_window": 9})],
                         ids=["causal", "sliding-non-causal", "varlen-sliding"])
def test_stored_ds_stays_inside_its_scratch(queue, monkeypatch, n, kw):
    """Checked builds (every global access guarded) of the stored way at edges: windows not a multiple of
    the 16×16 tiles, empty sequences; the tiles dkv writes and dqs reads lie inside attn.ds_tiles' scratch."""
    monkeypatch.setenv("CLOPS_CHECKED", "1")
    program.reload_switches()  # CLOPS_CHECKED is read once
    with mma.using("fma"):
        _check_bwd(queue, "fma", n, 2, 1, 16, BF16, store_ds=True, **kw)


# float32 with each mask, dq's buffering and both ways to dQ; bf16 once, dS recomputed (its dq pass scans
# K, its dkv pass Q and dO: the 16-bit test at the most sites)
@pytest.mark.parametrize("kw, stages, dtype, store_ds", [
    *((kw, stages, np.float32, store) for kw, stages in ((CAUSAL_80, 1), (SLIDING_80, 1), (SLIDING_80, 2))
      for store in (True, False)),
    (SLIDING_80, 1, BF16, False)],
    ids=[f"{name}-ds-{way}" for name in ("causal", "sliding-non-causal", "sliding-non-causal-two-stages")
         for way in ("stored", "recomputed")] + ["bf16-sliding-non-causal-ds-recomputed"])
def test_backward_nan_stays_in_the_gradients_that_depend_on_it(queue, product, kw, stages, dtype, store_ds):
    """A NaN of K at key 37 reaches dQ only in the rows that see key 37 (and dK, dV of that key); a NaN
    of Q or dO at row 37 reaches dK and dV only at the keys that row 37 sees (and dQ of that row):
    matrix products would multiply it by the zero P or dS of the other pairs. The NaN has every payload
    bit set, as NVIDIA's arithmetic makes them. (stages: dq's buffers of K and V; the override ends
    with the test.) At bf16 it is stored as bf16's quiet NaN (0x7FC0, ml_dtypes' conversion), through
    the scan's test of 16-bit words."""
    st = storage(np.dtype(dtype))
    sc = {"hd": 16, "st": st, "product": mma.backward_product(queue, st)[0]}
    tuning.override("attention_bwd_mma_dq", sc, dict(BWD_MMA["dq"].heuristic(queue.device, sc), stages=stages))
    n, pos, col = 80, 37, 5
    q, k, v, do = (ref.rnd((n, 1, 16), seed).astype(dtype) for seed in (1, 2, 3, 4))
    i = np.arange(n)
    if kw.get("causal", True):
        sees, seen = pos <= i, i <= pos  # rows that see key pos; keys that row pos sees
    else:
        sees = seen = np.abs(i - pos) < kw["sliding_window"]
    o, lse = ref.attention(q, k, v, **kw)
    for name, want in (("k", (sees, i == pos, i == pos)), ("q", (i == pos, seen, seen)), ("do", (i == pos, seen, seen))):
        arrays = {"q": q.copy(), "k": k.copy(), "do": do.copy()}
        arrays[name][pos, 0, col] = np.uint32(0x7FFFFFFF).view(np.float32)
        got = clops.attention_bwd(queue, *to_device(queue, arrays["q"], arrays["k"], v, o.astype(dtype),
                                                    lse.astype(np.float32), arrays["do"]), store_ds=store_ds, **kw)
        for grad, g, w in zip(("dq", "dk", "dv"), got, want):
            assert ((~np.isfinite(g.get().astype(np.float32))).any(-1)[:, 0] == w).all(), f"NaN of {name}: {grad}"


def test_path_choice(queue, monkeypatch):
    with mma.using("0"):
        assert mma.forward_product(queue, "float") == (None, "CLOPS_MMA=0")
    with mma.using("fma"):
        assert mma.forward_product(queue, "bf16")[0] == "fma"
        assert mma.backward_product(queue, "float")[0] == "fma"
    with mma.using("yes"), pytest.raises(ValueError, match="CLOPS_MMA"):
        mma.forward_product(queue, "float")
    monkeypatch.setenv("CLOPS_MMA", "0")  # read at import, and again by reload_switch
    mma.reload_switch()
    try:
        assert mma.mode() == "0"
    finally:
        monkeypatch.delenv("CLOPS_MMA")
        mma.reload_switch()
    ok, why = mma.probe(queue.device, queue.context)
    product, reason = mma.forward_product(queue, "bf16")
    if "NVIDIA" in queue.device.platform.name.upper():
        assert ok and product == "bf16", why  # the probe must pass on NVIDIA's driver
        for mode in ("", "1"):  # the default, and said explicitly
            with mma.using(mode):
                assert [f(queue, st)[0] for f in (mma.forward_product, mma.backward_product)
                        for st in ("bf16", "float")] == ["bf16", "tf32x3"] * 2
    else:
        assert not ok and product is None and reason == why and "not an NVIDIA device" in why
        assert mma.forward_product(queue, "float") == (None, why)


# The matrix-unit products' own code, its PTX emulated with 32-wide sub-groups (tile_products.cl.mako,
# CLOPS_MMA=emulate), through both drivers where a device has such sub-groups (Intel's CPU runtime):
# lean, as each case builds its kernels emulated, seconds apiece: f16 in the forward only (the backward's
# driver is the same for both 16-bit kinds); the backward with dS recomputed (the default below hd 256),
# and stored once; the softcap at 5 (the cap every row's reference) and 50 (row maxima). (way, head dim,
# dtype, keywords)
EMULATED = [("fwd", 128, BF16, {"window": 50}), ("fwd", 40, np.float16, WINDOW_2),
            ("fwd", 32, BF16, {"cu_seqlens": CU, "sliding_window": 20, "softcap": 5.0}),
            ("fwd", 40, np.float32, {"window": 50, "tiles": {"nw": 2, "bk": 16, "stages": 1, "af": 2, "sx": 1, "gp": 1}}),
            ("fwd", 48, BF16, dict(WINDOW_2, tiles={"nw": 2, "bk": 16, "stages": 2, "af": 1, "sx": 1, "gp": 1})),
            ("fwd", 48, np.float32, {"window": 50, "tiles": {"nw": 4, "bk": 16, "stages": 1, "af": 2, "sx": 2, "gp": 1}}),
            ("fwd", 64, BF16, dict(WINDOW_2, tiles={"nw": 2, "bk": 32, "stages": 2, "af": 1, "sx": 2, "gp": 1})),
            ("fwd", 136, np.float32, {"window": 50, "tiles": {"nw": 2, "bk": 16, "stages": 1, "af": 2, "sx": 1, "gp": 1}}),
            ("bwd", 32, BF16, dict(WINDOW_2, tiles={"nw": 2, "bk": 16, "af": 1, "stages": 2}, dkv={"cs": 1, "sx": 1})),
            ("bwd", 32, BF16, dict(WINDOW_2, store_ds=True)),
            ("bwd", 32, np.float32, {"cu_seqlens": CU, "causal": False, "softcap": 50.0})]  # no edge: 2 products a scope


@pytest.mark.parametrize("way, hd, dtype, kw", EMULATED,
                         ids=["bf16-128", "f16-40-sliding-2", "bf16-varlen-softcap", "tf32x3-40-q-read",
                              "bf16-48-sliding-2-two-stages", "tf32x3-48-column-pairs-q-read",
                              "bf16-64-sliding-2-column-pairs-two-stages", "tf32x3-136-one-chain", "bwd-bf16-sliding-2-two-stages",
                              "bwd-bf16-sliding-2-stored", "bwd-tf32x3-varlen-non-causal-softcap"])
def test_emulated_products(queue, way, hd, dtype, kw):
    ok, why = mma.probe(queue.device, queue.context, emulate=True)
    if not ok:
        pytest.skip(why)
    with mma.using("emulate"):
        if way == "fwd":
            _check(queue, 100, 4, 2, hd, dtype, **kw)
        else:
            _check_bwd(queue, "emulated", 100, 4, 2, hd, dtype, **kw)


def test_probe_rejects_a_wrong_tile(queue, monkeypatch):
    """The probe compares against A·B: fragments laid out wrongly are caught."""
    if not mma.probe(queue.device, queue.context)[0]:
        pytest.skip("no matrix units here")
    real = mma._fragments
    monkeypatch.setattr(mma, "_fragments", lambda a, b: (real(a, b)[0][::-1].copy(), *real(a, b)[1:]))
    assert "wrong" in mma._probe_one(queue, "bf16", "bf16")


def test_info_names_the_attention_path(capsys):
    """Each direction's kernels at each storage type, and the backward's way to dQ by default."""
    from clops import runtime
    from clops.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    queue = runtime.default_queue()
    for st, name in (("float", "float32"), ("bf16", "bfloat16"), ("half", "float16")):
        fwd, bwd = (next(x for x in out.splitlines() if x.startswith(f"attention {way} at {name}: "))
                    for way in ("forward", "backward"))
        product = mma.backward_product(queue, st)[0]
        kernels = "the portable kernels" if product is None else f"the matrix-unit driver, {product} products"
        assert fwd.split(": ", 1)[1].startswith(kernels)
        assert bwd.split(": ", 1)[1].startswith(kernels + (", dS stored where its scratch fits" if product is None
                                                           else f", dS stored from hd {attn.MMA_STORE_DS_MIN_HD[product]}"))


def test_two_buffers_where_they_fit():
    """On a GPU of 48 KiB of local memory the 16-bit forward takes two buffers of K and V at hd 64 and 128
    and one at hd 256, where two would not fit; tf32x3 one of 32 keys at hd 128, of 16 at hd 256 (there Q
    held by column halves' pairs)."""
    gpu = types.SimpleNamespace(type=cl.device_type.GPU, local_mem_size=49152, max_work_group_size=1024)
    got = {hd: FWD_MMA.heuristic(gpu, {"hd": hd, "st": "bf16", "product": "bf16"}) for hd in (64, 128, 256)}
    assert got == {64: {"nw": 4, "bk": 64, "stages": 2, "af": 1, "sx": 1, "gp": 2},
                   128: {"nw": 4, "bk": 32, "stages": 2, "af": 1, "sx": 1, "gp": 2},
                   256: {"nw": 4, "bk": 32, "stages": 1, "af": 1, "sx": 1, "gp": 2}}
    assert FWD_MMA.violation(gpu, {"hd": 256, "st": "bf16", "product": "bf16"}, dict(got[256], stages=2))
    for hd, p in got.items():
        FWD_MMA.check(gpu, {"hd": hd, "st": "bf16", "product": "bf16"}, p)
    tf32 = {hd: FWD_MMA.heuristic(gpu, {"hd": hd, "st": "float", "product": "tf32x3"}) for hd in (128, 256)}
    assert tf32 == {128: {"nw": 4, "bk": 32, "stages": 1, "af": 1, "sx": 1, "gp": 1},
                    256: {"nw": 4, "bk": 16, "stages": 1, "af": 1, "sx": 2, "gp": 1}}
    for hd, p in tf32.items():
        FWD_MMA.check(gpu, {"hd": hd, "st": "float", "product": "tf32x3"}, p)


def test_local_memory_spec_fits_every_head_dim(queue):
    for st in ("float", "bf16"):
        for hd in (8, 64, 128, 256):
            for product in ("fma", mma.PRODUCTS[st]):
                sc = {"hd": hd, "st": st, "product": product}
                for spec in (FWD_MMA, *BWD_MMA.values()):
                    spec.check(queue.device, sc, spec.heuristic(queue.device, sc))
