"""Token embedding: ``embedding`` (the lookup) and ``embedding_bwd`` (its gradient, deterministic).
Template: ``embedding.cl.mako``.

``table [vocab, d]``, ``ids [n]`` int32 (a device array, or a numpy array that is checked on the
host and copied without waiting), ``out``/``dout [n, d]``; table, out and dout share one
dtype, float32, float16 or bfloat16 (the lookup copies the stored values). dtable, the table's
gradient, is float32 when the op makes it (it has no table argument to take a dtype from), float32
or dout's dtype when given; each element is summed in float32, a given dtable's value first, and
rounded once (a given dtable's rows without tokens are left as they are). Ids outside
``[0, vocab)`` are refused when they come from the host; on the device they read nothing (their
output row is zeros, their gradient is dropped) and, when an int32 ``[1]`` device array
``invalid=`` is given, are counted into it. The gradient sorts the (id, token) pairs on the
device (a bitonic sort into at most ``RUNS`` sorted runs of consecutive tokens, no float atomics),
finds each vocab row's tokens in each run, and adds each vocab row's token rows run by run, in token
order: the same bits every run.

Tuning: op ``"embedding"``, shape class ``{}``, parameter ``wg``: work-items per group (a power
of two; the sort works on blocks of ``8·wg`` keys in local memory, and merges them only into runs of
``max(8·wg, NP / RUNS)`` keys, NP the ids rounded up to a power of two).
"""
from __future__ import annotations

import numpy as np
import pyopencl as cl

from .args import (F32, FLOATS, I32, check_array, check_index, check_queue, events, hold, index_type, outputs,
                   positive_int, scratch, storage, upload_index, wrote)
from .spec import Spec


RUNS = 16  # sorted runs the gradient reads at most (merge passes only beyond RUNS blocks of keys)


def heuristic(dev, sc):
    return {"wg": int(min(256 if dev.type & cl.device_type.GPU else 64, dev.max_work_group_size))}


SPEC = Spec("embedding", "embedding.cl.mako", ("wg",), lambda sc: {"wg": [32, 64, 128, 256, 512]}, heuristic,
            rules=lambda p, sc: ((p["wg"] & (p["wg"] - 1) == 0, "wg must be a power of two"),),
            local_bytes=lambda p, sc: 64 * p["wg"],
            render=lambda p, sc: dict(p, st="float", gst="float", unit="uint", vw=1, runs=RUNS),  # each call passes its own
            doc="embedding and embedding_bwd: wg work-items per group")


def _invalid(queue, invalid):
    if invalid is not None:
        check_array("invalid", invalid, queue, shape=(1,), dtype=I32)
    return invalid


def _kernels(queue, invalid, dtype, *sizes, grad_dtype=F32, unit="uint", vw=1):
    p, knl = SPEC.kernels(queue, {}, count=int(invalid is not None), idx=index_type(*sizes), st=storage(dtype),
                          gst=storage(grad_dtype), unit=unit, vw=vw)
    return p["wg"], knl


# The lookup's copy unit: the widest whose size divides a row's bytes.
_UNITS = ((16, "uint4"), (8, "uint2"), (4, "uint"), (2, "ushort"))


def embedding(queue, table, ids, *, out=None, invalid=None, wait_for=None, allocator=None):
    """``out [n, d]``: ``out[i] = table[ids[i]]`` (zeros where the id is out of range, see the module)."""
    check_queue(queue)
    check_array("table", table, queue, ndim=2, dtype=FLOATS)
    vocab, d = table.shape
    if vocab >= 2**31:
        raise ValueError(f"table: {vocab} rows do not fit the int32 ids")
    n = ids.shape[0] if hasattr(ids, "shape") and len(ids.shape) == 1 else -1
    if n < 1:
        raise ValueError(f"ids: expected a non-empty [n] array, got shape {getattr(ids, 'shape', None)}")
    ids = check_index("ids", ids, queue, (n,), below=vocab)
    invalid = _invalid(queue, invalid)
    (out,) = outputs(queue, allocator, [("out", out, (n, d))], [("table", table), ("ids", ids), ("invalid", invalid)],
                     dtype=table.dtype)
    ids = upload_index(queue, ids, allocator)  # a host array's copy, once every argument is checked
    size, unit = next((size, unit) for size, unit in _UNITS if d * table.dtype.itemsize % size == 0)
    units = d * table.dtype.itemsize // size  # per row
    wg, knl = _kernels(queue, invalid, table.dtype, n * units, vocab * units, unit=unit)
    evt = knl["embedding_fwd"](queue, (n,), [out.base_data, table.base_data, ids.base_data] + ([invalid.base_data] if invalid is not None else [])
                               + [np.uint32(vocab), np.uint32(units)], wait_for=events(wait_for, out, table, ids, invalid))
    hold([evt], out, table, ids, invalid)
    if invalid is not None:
        wrote([evt], invalid)
    return wrote([evt], out)[0]


def embedding_bwd(queue, ids, dout, *, vocab, dtable=None, invalid=None, wait_for=None, allocator=None):
    """``dtable [vocab, d]``: row v is the sum of the ``dout`` rows of the tokens whose id is v, in
    token order; float32 when made here, a given ``dtable`` (float32 or ``dout``'s dtype) has the
    gradient added into it."""
    check_queue(queue)
    vocab = positive_int("vocab", vocab)
    if vocab >= 2**31:
        raise ValueError(f"vocab: {vocab} does not fit the int32 ids")
    check_array("dout", dout, queue, ndim=2, dtype=FLOATS)
    n, d = dout.shape
    if n >= 2**31:
        raise ValueError(f"dout: {n} rows are more than the sort takes (2³¹)")
    ids = check_index("ids", ids, queue, (n,), below=vocab)
    invalid = _invalid(queue, invalid)
    accumulate = dtable is not None
    grad_dtypes = (F32, dout.dtype) if dout.dtype != F32 else F32
    if dtable is not None:
        check_array("dtable", dtable, queue, shape=(vocab, d), dtype=grad_dtypes)
    (dtable,) = outputs(queue, allocator, [("dtable", dtable, (vocab, d), F32 if dtable is None else dtable.dtype)],
                        [("ids", ids), ("dout", dout), ("invalid", invalid)])
    ids = upload_index(queue, ids, allocator)  # a host array's copy, once every argument is checked
    # the gradient's vectors: 16 bytes of dtable, or the widest vector that divides d
    vw = next(w for w in (8, 4, 2, 1) if w * dtable.dtype.itemsize <= 16 and d % w == 0)
    wg, knl = _kernels(queue, invalid, dout.dtype, n * d, vocab * d, RUNS * (vocab + 1), grad_dtype=dtable.dtype, vw=vw)
    block = 8 * wg
    padded = max(block, 1 << (n - 1).bit_length())  # a power of two, a multiple of the block
    run = max(block, padded // RUNS)  # keys of a sorted run: merged no further
    runs = padded // run
    keys = scratch(queue, 2 * padded, allocator)  # ulong keys
    start = scratch(queue, runs * (vocab + 1), allocator)  # uint: each vocab row's first key in each run
    evts = [knl["embedding_keys"](queue, (padded // block,), [keys, ids.base_data] + ([invalid.base_data] if invalid is not None else [])
                                  + [np.uint32(n), np.uint32(vocab), np.uint32(run)], wait_for=events(wait_for, ids, invalid))]

    def then(name, groups, *args):  # each kernel waits on the one before
        evts.append(knl[name](queue, groups, [*args], wait_for=evts[-1:]))

    size = 2 * block
    while size <= run:
        stride = size // 2
        while stride >= block:  # two strides a launch while both are ≥ the block
            both = stride // 2 >= block
            then("bitonic_global", (padded // 4 // wg,), keys, np.uint32(size), np.uint32(stride), np.int32(both),
                 np.uint32(run))
            stride //= 4 if both else 2
        then("bitonic_block", (padded // block,), keys, np.uint32(size), np.uint32(run))
        size *= 2
    then("embedding_offsets", (-(-(vocab + 1) // wg), runs), start, keys, np.uint32(run), np.uint32(vocab))
    evt = knl["embedding_accumulate"](queue, (vocab,), [dtable.base_data, dout.base_data, keys, start, np.uint32(d),
                                                        np.int32(accumulate), np.uint32(runs), np.uint32(vocab)],
                                      wait_for=evts[-1:] + events(None, dtable, dout))
    hold([evt], keys, start, ids, dout, dtable, invalid)
    if invalid is not None:
        wrote([evts[0]], invalid)
    return wrote([evt], dtable)[0]
