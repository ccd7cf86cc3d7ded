"""Matrix units: which tile products a device's attention forward takes, and the probe that decides.

The matrix-unit attention driver (``attention_fwd_mma.cl.mako``) multiplies through the tile
products of ``tile_products.cl.mako``: ``"tf32x3"`` (float32 storage: three TF32 products per
float32 product, float32-level accuracy), ``"bf16"`` and ``"f16"`` (16-bit storage, float32
accumulation) by NVIDIA's ``mma.sync`` in inline PTX, and ``"fma"``, the portable products.

:func:`forward_product` gives the product the op takes on a device, or None for the portable
kernel (``attention_fwd.cl.mako``), with the reason. NVIDIA devices take the matrix units, at every
storage type (tf32x3 at float32), once a probe kernel has built there and given the right bits for
all three products (one run per device, on a queue of its own, waited for); every other device, or a
failed probe, keeps the portable kernel. ``CLOPS_MMA=1`` is that default said explicitly,
``CLOPS_MMA=0`` takes none; ``CLOPS_MMA=fma`` runs the
matrix-unit driver with the portable products on any device (how its tests check the driver on
the CPU runtimes); ``CLOPS_MMA=emulate`` runs the matrix-unit products themselves, their PTX
emulated with 32-wide sub-groups (a sub-group a warp; Intel's CPU runtime), at every storage
type, once the probe passes emulated (how their tests check them where no NVIDIA GPU is; slow).
``CLOPS_MMA`` is read when clops is imported (:func:`reload_switch` reads it again).
"""
from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import pyopencl as cl

from . import runtime
from .args import storage_dtype
from .program import BuildError, kernels

PRODUCTS = {"float": "tf32x3", "bf16": "bf16", "half": "f16"}  # storage type -> matrix-unit product
_probed = {}  # (device, emulated) -> (ok, reason)
_lock = threading.Lock()
_mode = [""]  # CLOPS_MMA


def reload_switch():
    """Read ``CLOPS_MMA`` again: it is read when clops is imported, not at every op call."""
    _mode[0] = os.environ.get("CLOPS_MMA", "")


def mode():
    """``CLOPS_MMA`` as read (or as :func:`using` sets it for a block)."""
    return _mode[0]


reload_switch()


def _fragments(a, b):
    """The A (16×k) and B (k×8) operands of one m16n8 tile as the driver's lanes hold them
    (k = 8: one float each; k = 16: two 16-bit values packed in a word, the lower column first),
    and the map from the lanes' accumulators to the 16×8 result."""
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    if a.shape[1] == 8:
        fa = np.stack([a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4]], 1)
        fb = np.stack([b[t, g], b[t + 4, g]], 1)
    else:
        bits = lambda x: x.view(np.uint16).astype(np.uint32)  # noqa: E731
        pair = lambda lo, hi: bits(lo) | (bits(hi) << 16)  # noqa: E731
        fa = np.stack([pair(a[g, 2 * t], a[g, 2 * t + 1]), pair(a[g + 8, 2 * t], a[g + 8, 2 * t + 1]),
                       pair(a[g, 2 * t + 8], a[g, 2 * t + 9]), pair(a[g + 8, 2 * t + 8], a[g + 8, 2 * t + 9])], 1)
        fb = np.stack([pair(b[2 * t, g], b[2 * t + 1, g]), pair(b[2 * t + 8, g], b[2 * t + 9, g])], 1)
    rows = np.stack([g, g, g + 8, g + 8], 1)
    cols = np.stack([2 * t, 2 * t + 1, 2 * t, 2 * t + 1], 1)
    return np.ascontiguousarray(fa), np.ascontiguousarray(fb), (rows, cols)


def _probe_one(queue, st, kind, emulate=False):
    """None if the ``kind`` product (of storage type ``st``; its emulation with ``emulate``) builds on
    ``queue``'s device and gives A·B of a known tile; else why not."""
    rng = np.random.default_rng(7)
    k = 8 if kind == "tf32x3" else 16
    dtype = storage_dtype(st)
    a = rng.standard_normal((16, k)).astype(dtype)
    b = rng.standard_normal((k, 8)).astype(dtype)
    fa, fb, (rows, cols) = _fragments(a, b)
    try:
        knl = kernels(queue, "mma_probe.cl.mako", {"kind": kind, "st": st, "emulate": int(emulate)},
                      work_group_size=32)["mma_probe"]
    except (BuildError, cl.Error) as e:
        return f"{kind}: the probe kernel does not build ({str(e).splitlines()[0][:120]})"
    mf = cl.mem_flags
    ctx = queue.context
    da = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=fa.view(np.uint32))
    db = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=fb.view(np.uint32))
    bn = np.ascontiguousarray(b.T)  # B's rows of n (the 16-bit kinds' cp.async-staged copy)
    dn = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=bn.view(np.uint8))
    out = np.zeros((32, 4), np.float32)
    dd = cl.Buffer(ctx, mf.WRITE_ONLY, out.nbytes)
    knl.knl(queue, (32,), (32,), da, db, dn, dd)  # not an op's launch: no profiler sees it
    cl.enqueue_copy(queue, out, dd)
    want = a.astype(np.float64) @ b.astype(np.float64)
    err = np.abs(out - want[rows, cols]).max() / np.abs(want).max()
    tol = 1e-5  # float32 accumulation of exact products (3xTF32: about 2⁻²⁰ of each; one TF32 product: 2⁻¹⁰)
    return None if err <= tol else f"{kind}: the probe's tile is wrong (relative error {err:.2g})"


def emulated():
    """Whether the matrix-unit products run emulated (``CLOPS_MMA=emulate``)."""
    return _mode[0] == "emulate"


def probe(device, context, emulate=False):
    """(ok, reason): whether ``device`` runs all three matrix-unit products right, or with ``emulate``
    their emulation (run once per device and way)."""
    with _lock:
        found = _probed.get((device, emulate))
        if found is not None:
            return found
        if emulate and "cl_intel_required_subgroup_size" not in device.extensions.split():
            found = (False, "no 32-wide sub-groups to emulate warps with (cl_intel_required_subgroup_size)")
        elif emulate and runtime.faulty_pocl(device) == "5":
            found = (False, "PoCL 5.x's compiler aborts on the emulated sub-group kernels (README: known limitations)")
        elif not emulate and not runtime.nvidia(device):
            found = (False, "not an NVIDIA device (the matrix-unit products are NVIDIA PTX)")
        else:
            queue = cl.CommandQueue(context, device)  # its own queue: the caller's may be gated
            wrong = [why for why in (_probe_one(queue, st, kind, emulate) for st, kind in PRODUCTS.items()) if why]
            done = "emulated with sub-groups, probe passed" if emulate else "NVIDIA, probe passed"
            found = (False, "probe failed: " + "; ".join(wrong)) if wrong else (True, done)
        _probed[device, emulate] = found
        return found


def forward_product(queue, st):
    """(product or None, reason): the tile product of the attention forward at storage type ``st`` on
    ``queue``'s device (None: the portable kernel)."""
    mode = _mode[0]
    if mode == "0":
        return None, "CLOPS_MMA=0"
    if mode == "fma":
        return "fma", "CLOPS_MMA=fma (the matrix-unit driver with portable products)"
    if mode not in ("", "1", "emulate"):
        raise ValueError(f"CLOPS_MMA: expected 0, 1, fma or emulate, got {mode!r}")
    ok, reason = probe(queue.device, queue.context, mode == "emulate")
    return (PRODUCTS[st], reason) if ok else (None, reason)


def backward_product(queue, st):
    """(product or None, reason): the tile product of the attention backward (``store_ds=None``) at
    storage type ``st``: the forward's."""
    return forward_product(queue, st)


@contextlib.contextmanager
def using(mode):
    """Run the block as if ``CLOPS_MMA`` were ``mode`` ("0", "1", "fma" or "emulate"; how ``clops tune``
    and the tests choose the forward's kernel), then restore it. Not for threads that run ops meanwhile."""
    before = _mode[0]
    _mode[0] = mode
    try:
        yield
    finally:
        _mode[0] = before
