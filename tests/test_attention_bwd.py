"""The portable attention backward (attention_bwd.cl.mako) against the float64 reference, on every
device: CLOPS_MMA=0 here, as in tests/test_attention.py.

o and lse come from the reference forward (rounded to float32), so these tests
exercise the backward alone.
"""
import math
import types

import numpy as np
import pyopencl.array as cla
import pytest

import clops
from clops import reference as ref
from clops import tuning
from clops.attn import BWD, store_ds_default

TOL = 1e-5

pytestmark = pytest.mark.usefixtures("portable_attention")


@pytest.fixture(params=[True, False], ids=["ds-stored", "ds-recomputed"])
def store_ds(request):
    """Both ways to dQ: from the dS the dK/dV pass stored, or recomputing it."""
    return request.param


def _inputs(windows, window, nh, nkv, hd, scale=None, mag=1.0):
    n = windows * window
    q, k, v = ref.rnd((n, nh, hd), 11, mag), ref.rnd((n, nkv, hd), 12, mag), ref.rnd((n, nkv, hd), 13)
    do = ref.rnd((n, nh, hd), 14)
    o, lse = ref.attention(q, k, v, window=window, scale=scale)
    return q, k, v, o.astype(np.float32), lse.astype(np.float32), do


def _run(queue, arrays, window, **kw):
    dev = [cla.to_device(queue, a) for a in arrays]
    return [g.get() for g in clops.attention_bwd(queue, *dev, window=window, **kw)]


def _check(queue, store_ds, windows, window, nh, nkv, hd, scale=None, mag=1.0):
    arrays = _inputs(windows, window, nh, nkv, hd, scale, mag)
    got = _run(queue, arrays, window, scale=scale, store_ds=store_ds)
    want = ref.attention_bwd(*arrays, window=window, scale=scale)
    errs = [ref.rel_err(g, w) for g, w in zip(got, want)]
    assert max(errs) <= TOL, dict(zip(("dq", "dk", "dv"), errs))
    return got


def test_reference_shape(queue, store_ds):
    _check(queue, store_ds, 2, 37, 6, 2, 256)


@pytest.mark.parametrize("hd", [8, 40, 64, 80, 96, 128, 256])
def test_head_dims(queue, store_ds, hd):
    _check(queue, store_ds, 2, 21, 2, 1, hd)


@pytest.mark.parametrize("window", [15, 16, 17, 100])
@pytest.mark.parametrize("nkv", [1, 2])
def test_windows_and_groups(queue, store_ds, window, nkv):
    _check(queue, store_ds, 2, window, 2, nkv, 32)


@pytest.mark.parametrize("nkv", [1, 2])
def test_window_of_one(queue, store_ds, nkv):
    # One key per window: P = 1 and dS = P·(dP − D) is rounding noise around 0, so dq and dk
    # are checked against the size of their terms, dv (= dO summed over the group) relatively.
    arrays = _inputs(3, 1, 2, nkv, 32)
    dq, dk, dv = _run(queue, arrays, 1, store_ds=store_ds)
    q, k, _, _, _, do = arrays
    _, _, want_dv = ref.attention_bwd(*arrays, window=1)
    assert ref.rel_err(dv, want_dv) <= TOL
    assert np.linalg.norm(dq) <= TOL * np.linalg.norm(do) * np.linalg.norm(k)
    assert np.linalg.norm(dk) <= TOL * np.linalg.norm(do) * np.linalg.norm(q)


def test_explicit_scale(queue, store_ds):
    _check(queue, store_ds, 2, 33, 4, 2, 40, scale=0.37)


def test_large_logits_stay_finite(queue, store_ds):
    # |q·k|·scale reaches ~1e3: P is near one-hot and exp2 arguments are far from 0.
    arrays = _inputs(2, 40, 4, 2, 64, mag=32.0)
    logit = np.abs(arrays[4]).max()
    assert logit > 500
    got = _run(queue, arrays, 40, store_ds=store_ds)
    assert all(np.isfinite(g).all() for g in got)
    # float32 scores of size L carry errors of a few L·2⁻²⁴, which P = exp(S − lse) turns into
    # relative errors: at L ~ 1e3 that is ~5e-5, beyond TOL for any float32 kernel.
    want = ref.attention_bwd(*arrays, window=40)
    assert max(ref.rel_err(g, w) for g, w in zip(got, want)) <= max(TOL, 4 * 2.0**-24 * logit)


def test_given_outputs_are_written(queue):
    arrays = _inputs(2, 9, 2, 1, 16)
    dev = [cla.to_device(queue, a) for a in arrays]
    outs = [cla.zeros(queue, a.shape, np.float32) for a in arrays[:3]]
    got = clops.attention_bwd(queue, *dev, window=9, dq=outs[0], dk=outs[1], dv=outs[2])
    assert all(g is o for g, o in zip(got, outs))
    want = ref.attention_bwd(*arrays, window=9)
    assert max(ref.rel_err(g.get(), w) for g, w in zip(got, want)) <= TOL


def test_deterministic(queue, store_ds):
    arrays = _inputs(2, 45, 4, 2, 64)
    dev = [cla.to_device(queue, a) for a in arrays]
    first = [g.get() for g in clops.attention_bwd(queue, *dev, window=45, store_ds=store_ds)]
    for _ in range(3):
        again = [g.get() for g in clops.attention_bwd(queue, *dev, window=45, store_ds=store_ds)]
        assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(first, again))


# Tile shapes the template must honour: vector widths 1/2/4, tr 1/2/8, odd score tiles,
# several head-dim chunks (dc < hd) and staged row chunks (jc below the block), or the whole
# head dim in one chunk (dc = hd: step 2 reads the tiles step 1 staged); one matrix per
# work-item (split 2), with halves that are not a multiple of any warp or vector width.
VARIANTS = {
    "dkv": [
        {"wg": 20, "bq": 12, "bk": 10, "sq": 3, "sk": 2, "dc": 8, "jc": 4, "tr": 2, "td": 10, "vw": 1, "split": 1},
        {"wg": 40, "bq": 8, "bk": 20, "sq": 2, "sk": 2, "dc": 4, "jc": 2, "tr": 1, "td": 20, "vw": 2, "split": 1},
        {"wg": 10, "bq": 20, "bk": 8, "sq": 4, "sk": 4, "dc": 20, "jc": 10, "tr": 8, "td": 4, "vw": 4, "split": 1},
        {"wg": 20, "bq": 12, "bk": 10, "sq": 3, "sk": 2, "dc": 40, "jc": 4, "tr": 2, "td": 10, "vw": 2, "split": 1},
        {"wg": 40, "bq": 8, "bk": 10, "sq": 2, "sk": 2, "dc": 8, "jc": 4, "tr": 2, "td": 10, "vw": 2, "split": 2},
        {"wg": 20, "bq": 12, "bk": 10, "sq": 6, "sk": 2, "dc": 40, "jc": 4, "tr": 2, "td": 20, "vw": 4, "split": 2},
    ],
    "dq": [
        {"wg": 20, "bq": 10, "bk": 12, "sq": 2, "sk": 3, "dc": 8, "jc": 4, "tr": 2, "td": 10, "vw": 1, "split": 1},
        {"wg": 40, "bq": 20, "bk": 8, "sq": 2, "sk": 2, "dc": 4, "jc": 2, "tr": 1, "td": 20, "vw": 2, "split": 1},
        {"wg": 10, "bq": 8, "bk": 20, "sq": 4, "sk": 4, "dc": 20, "jc": 10, "tr": 8, "td": 4, "vw": 4, "split": 1},
        {"wg": 20, "bq": 10, "bk": 12, "sq": 2, "sk": 3, "dc": 40, "jc": 6, "tr": 2, "td": 10, "vw": 2, "split": 1},
        {"wg": 20, "bq": 10, "bk": 12, "sq": 2, "sk": 6, "dc": 8, "jc": 4, "tr": 1, "td": 20, "vw": 4, "split": 2},
        {"wg": 40, "bq": 20, "bk": 8, "sq": 2, "sk": 4, "dc": 40, "jc": 4, "tr": 2, "td": 10, "vw": 2, "split": 2},
    ],
    # dQ from stored dS: chunks of dS that do not fill the group's last load (bq·jc not a multiple of wg)
    "dqs": [
        {"wg": 20, "bq": 10, "jc": 7, "tr": 2, "td": 10, "vw": 1},
        {"wg": 40, "bq": 20, "jc": 4, "tr": 1, "td": 20, "vw": 2},
        {"wg": 10, "bq": 16, "jc": 3, "tr": 8, "td": 8, "vw": 4},
        {"wg": 4, "bq": 8, "jc": 40, "tr": 4, "td": 20, "vw": 4},
    ],
}


@pytest.mark.parametrize("kind, params", [(k, p) for k, ps in VARIANTS.items() for p in ps],
                         ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}{v}" for k, v in x.items()))
def test_tile_variants(queue, kind, params):
    op = "attention_bwd_" + kind
    tuning.override(op, {"hd": 40}, params)
    try:
        assert BWD[kind].resolve(queue.device, {"hd": 40}) == (params, "override")
        # dkv runs in both ways (it stores dS in one); dq and dqs in theirs
        for store in {"dkv": (True, False), "dq": (False,), "dqs": (True,)}[kind]:
            _check(queue, store, 2, 37, 4, 2, 40)
    finally:
        tuning.override(op, {"hd": 40}, None)


# The halves of tests/test_oclgrind.py (SPLIT = 2) with a chunked head dim (DC < HD): step 2's
# first chunk fetched inside step 1, the dS half writing dS for dK and the stored dQ.
@pytest.mark.parametrize("hd", [8, 16])
def test_split_halves_with_chunked_head_dim(queue, hd):
    tiles = {"wg": 8, "split": 2, "bq": 8, "bk": 8, "sq": 2, "sk": 8, "dc": 4, "jc": 4, "tr": 2, "td": hd, "vw": 1}
    tuning.override("attention_bwd_dkv", {"hd": hd}, tiles)
    try:
        _check(queue, True, 2, 17, 4, 2, hd)
    finally:
        tuning.override("attention_bwd_dkv", {"hd": hd}, None)


def test_store_ds_default_follows_device_memory():
    dev = types.SimpleNamespace(max_mem_alloc_size=2**30, global_mem_size=2**34)
    assert store_ds_default(dev, 2**30) and not store_ds_default(dev, 2**30 + 1)  # one allocation
    dev.global_mem_size = 2**32
    assert store_ds_default(dev, 2**29) and not store_ds_default(dev, 2**29 + 1)  # an eighth of the memory


@pytest.mark.parametrize("store_ds, kernel", [(None, "attn_bwd_dqs"), (True, "attn_bwd_dqs"), (False, "attn_bwd_dq")])
def test_store_ds_picks_the_dq_pass(queue, store_ds, kernel):
    dev = [cla.to_device(queue, a) for a in _inputs(2, 9, 2, 1, 16)]
    with clops.profile(queue) as prof:  # a small scratch: None stores
        clops.attention_bwd(queue, *dev, window=9, store_ds=store_ds)
    assert [r.name for r in prof.launches] == ["attn_bwd_dsum", "attn_bwd_dkv", kernel]


def test_store_ds_beyond_one_allocation_is_refused(queue):
    # one window long enough that its dS triangle (4·T·(T+1)/2 bytes) exceeds CL_DEVICE_MAX_MEM_ALLOC_SIZE
    window = 1 << math.ceil(math.log2(math.sqrt(queue.device.max_mem_alloc_size / 2)) + 1)
    q, k = cla.zeros(queue, (window, 1, 8), np.float32), cla.zeros(queue, (window, 1, 8), np.float32)
    lse = cla.zeros(queue, (window, 1), np.float32)
    with pytest.raises(clops.LimitError, match="^store_ds: .*CL_DEVICE_MAX_MEM_ALLOC_SIZE"):
        clops.attention_bwd(queue, q, k, k, q, lse, q, window=window, store_ds=True)
    with pytest.raises(TypeError, match="^store_ds: "):
        clops.attention_bwd(queue, q, k, k, q, lse, q, window=window, store_ds=1)


GOOD = {"wg": 64, "split": 1, "bq": 16, "bk": 16, "sq": 2, "sk": 2, "dc": 8, "jc": 8, "tr": 1, "td": 4, "vw": 4}


@pytest.mark.parametrize("change, word", [
    ({"wg": 32}, "wg must equal split·(bq/sq)·(bk/sk)"),
    ({"td": 8}, "wg must equal split·(bk/tr)·(hd/td)"),
    ({"split": 3}, "split must be 1 or 2"),
    ({"vw": 3}, "vw must be 1, 2 or 4"),
    ({"tr": 3}, "tr must be 1, 2, 4, 8 or 16"),
    ({"jc": 5}, "jc must divide bq"),
    ({"dc": 6}, "dc must divide hd"),
    ({"sq": 0}, "positive ints"),
    ({"sq": True}, "positive ints"),  # JSON's true is no 1
    ({"bq": 65536, "sq": 8192}, "bytes of local memory"),
])
def test_impossible_params_raise(queue, change, word):
    tuning.override("attention_bwd_dkv", {"hd": 16}, dict(GOOD, **change))
    try:
        with pytest.raises(clops.LimitError, match=word.replace("(", r"\(").replace(")", r"\)")):
            BWD["dkv"].params(queue.device, {"hd": 16})
    finally:
        tuning.override("attention_bwd_dkv", {"hd": 16}, None)


def test_good_params_accepted(queue):
    tuning.override("attention_bwd_dkv", {"hd": 16}, GOOD)
    try:
        assert BWD["dkv"].resolve(queue.device, {"hd": 16}) == (GOOD, "override")
    finally:
        tuning.override("attention_bwd_dkv", {"hd": 16}, None)


@pytest.mark.parametrize("name, bad, exc", [
    ("o", np.zeros((10, 1, 8), np.float32), ValueError),
    ("lse", np.zeros((10, 3), np.float32), ValueError),
    ("lse", np.zeros((10, 2, 1), np.float32), ValueError),
    ("do", np.zeros((10, 2, 16), np.float32), ValueError),
    ("do", np.zeros((10, 2, 8), np.float64), TypeError),
    ("o", np.zeros((10, 2, 8), np.float16), TypeError),
])
def test_bad_inputs_raise_before_enqueue(queue, name, bad, exc):
    names = ("q", "k", "v", "o", "lse", "do")
    arrays = dict(zip(names, _inputs(2, 5, 2, 1, 8)), **{name: bad})
    dev = {k: cla.to_device(queue, a) for k, a in arrays.items()}
    outs = {"dq": cla.to_device(queue, np.full((10, 2, 8), 7, np.float32)),
            "dk": cla.to_device(queue, np.full((10, 1, 8), 7, np.float32)),
            "dv": cla.to_device(queue, np.full((10, 1, 8), 7, np.float32))}
    pending = {k: list(o.events) for k, o in outs.items()}
    with pytest.raises(exc, match=f"^{name}:"):
        clops.attention_bwd(queue, *(dev[k] for k in names), window=5, **outs)
    for k, out in outs.items():
        assert out.events == pending[k]  # nothing enqueued on the outputs
        assert (out.get() == 7).all()
