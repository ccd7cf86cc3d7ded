"""embedding / embedding_bwd against the float64 reference: repeated ids, every vocab row hit or
not, sizes around the sort's blocks, ids out of range from the device (zeroed, counted) and from
the host (refused), accumulation, bitwise determinism.

float16 / bfloat16 storage (table, out, dout of one dtype; dtable float32, or dout's dtype when
given): the lookup gives the table's
bits; the gradient, from the same rounded dout (and a given dtable's rounded values), is within 1
storage ulp of the float64 sum rounded once, relative to its row's scale (the dtable row's largest
|value|), plus the float32 tolerance (1e-6 of that scale; helpers.narrow_ulps)."""
import ml_dtypes
import numpy as np
import pyopencl.array as cla
import pytest

import clops
from clops import reference as ref, tuning
from clops.reference import rel_err, rnd
from helpers import NARROW, narrow_ulps, to_device


def _ids(n, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


@pytest.mark.parametrize("n, vocab, d, wg", [(1, 1, 3, None), (37, 5, 16, None), (300, 1000, 7, 16),
                                             (1025, 50, 33, 8), (64, 64, 1, 4), (130, 40, 10, 4)])
def test_parity(queue, n, vocab, d, wg):
    table, dout = rnd((vocab, d), 1), rnd((n, d), 2)
    ids = _ids(n, vocab, 3)
    tuning.override("embedding", {}, None if wg is None else {"wg": wg})
    try:
        dt, dd = to_device(queue, table, dout)
        out = clops.embedding(queue, dt, ids)
        assert np.array_equal(out.get(), ref.embedding(table, ids))
        grad = clops.embedding_bwd(queue, cla.to_device(queue, ids), dd, vocab=vocab)
        want = ref.embedding_bwd(ids, dout, vocab)
        assert rel_err(grad.get(), want) <= 1e-6
        again = clops.embedding_bwd(queue, ids, dd, vocab=vocab, dtable=grad)  # added into a given dtable
        assert rel_err(again.get(), 2 * want) <= 1e-6
    finally:
        tuning.override("embedding", {}, None)


def test_gradient_is_deterministic(queue):
    """The same bits every run, and the bits the documented order gives: each vocab row's token rows
    added one by one in token order in float32, onto a given dtable's value (np.add.at adds in index
    order, each sum rounded to float32), not a tree of them."""
    ids = np.zeros(2000, np.int32)  # one row takes every token: the longest sum
    ids[::3] = 7
    ids[5::7] = 2  # a run whose length is not a multiple of the four rows loaded together
    host = rnd((2000, 24), 4, 10.0)
    dout, = to_device(queue, host)
    runs = [clops.embedding_bwd(queue, ids, dout, vocab=9).get().tobytes() for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    want = np.zeros((9, 24), np.float32)
    np.add.at(want, ids, host)
    assert runs[0] == want.tobytes()
    given = rnd((9, 24), 5, 100.0)
    got = clops.embedding_bwd(queue, ids, dout, vocab=9, dtable=to_device(queue, given)[0]).get()
    np.add.at(given, ids, host)
    assert got.tobytes() == given.tobytes()


def test_device_ids_out_of_range_are_zeroed_and_counted(queue):
    table, dout = rnd((6, 5), 5), rnd((5, 5), 6)
    ids = np.array([2, -1, 6, 5, 100], np.int32)
    dt, dd, di = to_device(queue, table, dout, ids)
    invalid = cla.zeros(queue, (1,), np.int32)
    out = clops.embedding(queue, dt, di, invalid=invalid)
    assert np.array_equal(out.get(), ref.embedding(table, ids)) and invalid.get()[0] == 3
    grad = clops.embedding_bwd(queue, di, dd, vocab=6, invalid=invalid)
    assert rel_err(grad.get(), ref.embedding_bwd(ids, dout, 6)) <= 1e-6 and invalid.get()[0] == 6


@pytest.mark.parametrize("dtype", NARROW, ids=str)
@pytest.mark.parametrize("n, vocab, d, wg", [(37, 5, 16, None), (1025, 50, 33, 8)])
def test_narrow_storage(queue, dtype, n, vocab, d, wg):
    """Both ops at 16-bit storage, ids out of range from the device among them, and the gradient
    added into a given 16-bit dtable (made: float32)."""
    table, dout, given = (rnd(shape, seed).astype(dtype) for shape, seed in (((vocab, d), 1), ((n, d), 2),
                                                                              ((vocab, d), 4)))
    ids = _ids(n, vocab, 3)
    ids[[1, 4]] = -1, vocab
    tuning.override("embedding", {}, None if wg is None else {"wg": wg})
    try:
        dt, dd, di, dg = to_device(queue, table, dout, ids, given)
        invalid = cla.zeros(queue, (1,), np.int32)
        out = clops.embedding(queue, dt, di, invalid=invalid)
        assert out.dtype == dtype and out.get().tobytes() == ref.embedding(table, ids).astype(dtype).tobytes()
        want = ref.embedding_bwd(ids, dout, vocab)
        made = clops.embedding_bwd(queue, di, dd, vocab=vocab, invalid=invalid)
        assert made.dtype == np.float32 and ref.rel_err(made.get(), want) <= 1e-6
        grad = clops.embedding_bwd(queue, di, dd, vocab=vocab, dtable=dg)
        want = want + given.astype(np.float64)
        assert grad.dtype == dtype
        assert ref.ulps_off(grad.get(), want, dtype, scale=np.abs(want).max(1, keepdims=True)) <= narrow_ulps(dtype, 1e-6)
        assert invalid.get()[0] == 4
    finally:
        tuning.override("embedding", {}, None)


def test_refusals(queue):
    table, dout = to_device(queue, rnd((6, 5), 5), rnd((3, 5), 6))
    bad = [
        (ValueError, "ids: 6 at index 2 is outside \\[0, 6\\)",
         lambda: clops.embedding(queue, table, np.array([0, 1, 6], np.int32))),
        (TypeError, "ids: dtype must be int32", lambda: clops.embedding(queue, table, np.zeros(3, np.int64))),
        (ValueError, "ids: expected shape", lambda: clops.embedding_bwd(queue, np.zeros(4, np.int32), dout, vocab=6)),
        (ValueError, "ids: 6 at index 1 is outside \\[0, 6\\)",
         lambda: clops.embedding_bwd(queue, np.array([0, 6, 1], np.int32), dout, vocab=6)),
        (ValueError, "ids: expected a non-empty \\[n\\] array, got shape \\(0,\\)",
         lambda: clops.embedding(queue, table, np.zeros(0, np.int32))),
        (ValueError, "vocab: must be positive", lambda: clops.embedding_bwd(queue, np.zeros(3, np.int32), dout, vocab=0)),
        (TypeError, "invalid: dtype must be int32",
         lambda: clops.embedding(queue, table, np.zeros(3, np.int32), invalid=cla.zeros(queue, (1,), np.float32))),
        (TypeError, "dtable: dtype must be float32 or float16, got bfloat16",
         lambda: clops.embedding_bwd(queue, np.zeros(3, np.int32), cla.to_device(queue, rnd((3, 5), 7).astype(np.float16)),
                                     vocab=6, dtable=cla.to_device(queue, rnd((6, 5), 8).astype(ml_dtypes.bfloat16)))),
        (TypeError, "table: dtype must be float32 or float16 or bfloat16, got float64",
         lambda: clops.embedding(queue, cla.to_device(queue, np.zeros((6, 5))), np.zeros(3, np.int32))),
        (ValueError, "out: shares memory with table",
         lambda: clops.embedding(queue, table, np.zeros(6, np.int32), out=table)),
    ]
    for exc, word, call in bad:
        with pytest.raises(exc, match=word):
            call()
