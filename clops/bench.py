"""``python -m clops bench``: every op at transformer-sized shapes, against the device's limits.

Memory-bound ops run at n = 16384 tokens, d = 5120 (the SwiGLU family at width
3·d) and report GB/s counting the bytes of every input read and every output
written once, as a fraction of the copy bandwidth measured in the same run (a
device-to-device copy, read + write), and of a copy of the op's own bytes (half
of them read, half written, up to that copy's size: what a kernel of that size
reaches, its start and drain not hidden behind more work). The two-op row
"add+rms_norm" counts the bytes of ``add_rms_norm`` (what the fusion saves shows
as a lower GB/s), and "rms_norm_bwd+dw" (two kernels) those of the one pass.
Attention reports TFLOP/s (forward: 4·windows·nh·window²·hd/2 FLOPs; the backward
2.5 times that; at every dtype, its math being float32) as a fraction of the FP32
peak: clock × compute units × FP32 lanes per compute unit × 2 (FMA), the lanes
taken from a small table by vendor (:func:`fp32_lanes`). Times are device times
from profiling events (the sum of an op's kernels, gaps between them left out):
warm-up, then 7 runs, median kept.

The attention variants (non-causal, softcap 30, varlen: seeded lengths between 1
and 2·window over the shape's tokens, offsets on the device; sliding windows of
512 and 4096 over one sequence of all the shape's tokens) count the FLOPs of
the (query, key) pairs they leave unmasked (:func:`attention_pairs`), forward
4·nh·hd per pair, the backward 2.5 times that. The rows "dS-stored" and "dS-recomputed" time
forward + backward with ``attention_bwd(store_ds=True / False)``, whichever way is the default.

``--dtype float16`` / ``bfloat16`` runs every op that takes 16-bit storage with
its activations (and weights) at that dtype, statistics and master state staying
float32, and counts the bytes actually moved; the other ops are skipped, each
with a line saying so (:data:`NARROW_OPS` says which ops take 16-bit storage).

``--peers`` adds PyTorch's figures for the same shapes, at the same dtype, when
PyTorch with a GPU is importable in this process, and the ratio PyTorch ms /
clops ms (above 1: clops is faster). ``--json PATH`` writes every figure keyed by op name, with
``kernels_ms``: the device time of each of the op's kernels in one more call.
``--small`` uses small shapes, for CPUs. The header (and the JSON's ``clops``) names the clops that
ran: its version, path and ``tree``, a hash of its modules and kernel templates.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
from pathlib import Path

import ml_dtypes
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pyopencl.tools as cl_tools

import clops

from . import program, runtime, step, tuning
from .args import F32
from .profile import Profile, measure
from .tune import attention_flops

RUNS, WARMUP = 7, 2
ATTENTION = {  # name: (windows, window, nh, nkv, hd)
    "qwen-hd256": (4, 4096, 16, 2, 256),
    "llama-hd128": (8, 2048, 32, 8, 128),
    "small-hd64": (16, 1024, 12, 12, 64),
}
ATTENTION_SMALL = {"qwen-hd256": (2, 64, 4, 2, 256), "llama-hd128": (2, 64, 8, 2, 128),
                   "small-hd64": (2, 64, 4, 4, 64)}
SLIDING, SLIDING_SMALL = (512, 4096), (16, 64)  # sliding windows, over one sequence of a shape's tokens
TOKENS, D = 16384, 5120
TOKENS_SMALL, D_SMALL = 256, 512
DTYPES = {"float32": F32, "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}
# The ops that take float16 / bfloat16 storage. A bench runs at a 16-bit dtype when its op (its
# name up to a space or a '+') is here; an op joins the set when it is converted.
NARROW_OPS = frozenset({"swiglu", "swiglu_bwd", "swiglu_limit", "swiglu_gated", "swiglu_gated_bwd", "sigmoid_gate",
                        "sigmoid_gate_bwd", "add", "cross_entropy", "cross_entropy_bwd", "embedding",
                        "embedding_bwd", "adamw", "rms_norm", "rms_norm_bwd", "rms_norm_dw", "qk_norm_rope",
                        "qk_norm_rope_bwd",
                        "add_rms_norm", "add_rms_norm_bwd", "attention", "attention_bwd"})


def bench_op(name):
    """The op a bench is judged by for its dtype: its name up to a space or a '+'."""
    return name.split()[0].split("+")[0]


def fp32_lanes(dev):
    """(FP32 lanes per compute unit, the basis of that number), or (None, why it is unknown)."""
    vendor = tuning.vendor_key(dev)
    if not dev.type & cl.device_type.GPU:
        return None, "unknown for CPUs (SIMD width and FMA units per core are not reported)"
    if vendor == "nvidia":
        try:
            major, minor = dev.compute_capability_major_nv, dev.compute_capability_minor_nv
        except (cl.Error, AttributeError):
            return None, "unknown: NVIDIA GPU without cl_nv_device_attribute_query"
        # CUDA C programming guide, arithmetic throughput per SM: 64 on sm_70/75 and sm_80 (A100), 128 otherwise.
        lanes = 64 if major == 7 or (major, minor) == (8, 0) else 128 if major >= 8 else None
        if lanes is None:
            return None, f"unknown for NVIDIA compute capability {major}.{minor}"
        return lanes, f"NVIDIA sm_{major}{minor}: {lanes} FP32 lanes per SM"
    if vendor == "amd":
        return 64, "AMD: 64 FP32 lanes per CU (RDNA3's dual issue not counted)"
    if vendor == "intel":
        return 8, "Intel GPU: 8 FP32 lanes per EU (compute unit = EU)"
    return None, f"unknown for vendor {dev.vendor.strip()!r}"


def fp32_peak_tflops(dev):
    """(peak TFLOP/s or None, the basis)."""
    lanes, basis = fp32_lanes(dev)
    if lanes is None:
        return None, basis
    peak = dev.max_compute_units * lanes * 2 * dev.max_clock_frequency * 1e6 / 1e12
    return peak, f"{dev.max_compute_units} CUs × {lanes} lanes × 2 FLOP × {dev.max_clock_frequency} MHz ({basis})"


def source_identity():
    """{"version", "path", "tree"}: the clops that runs, and a hash of its Python modules and kernel
    templates, so that figures name the code that made them (a base tree beside a working one, say)."""
    here = Path(clops.__file__).resolve().parent
    digest = hashlib.sha256()
    for f in sorted(here.glob("*.py")) + sorted(program.KERNEL_DIR.glob("*.mako")):
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return {"version": clops.__version__, "path": str(here), "tree": digest.hexdigest()[:12]}


def copy_bandwidth(queue, nbytes):
    """Device-to-device copy of ``nbytes``, GB/s counting read + write (median of RUNS after WARMUP)."""
    ctx = queue.context
    src = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, nbytes)
    dst = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, nbytes)
    cl.enqueue_fill_buffer(queue, src, np.float32(1), 0, nbytes)
    times = []
    for i in range(WARMUP + RUNS):
        evt = cl.enqueue_copy(queue, dst, src)
        evt.wait()
        if i >= WARMUP:
            times.append((evt.profile.end - evt.profile.start) * 1e-9)
    return 2 * nbytes / statistics.median(times) / 1e9


@dataclasses.dataclass
class Bench:
    name: str
    shape: str
    unit: str  # "GB/s" or "TFLOP/s"
    setup: object  # setup(queue, data) -> (fn, work); work in bytes (None: counted from the arrays) or FLOPs
    peers: tuple = ()  # ((label, make(torch, torch dtype) -> callable), ...)


class Data:
    """Seeded random device arrays of the bench's dtype (unless told), shared between benches of the
    same shapes."""

    def __init__(self, queue, dtype=F32):
        self.queue, self.dtype, self.cache = queue, dtype, {}
        self.pool = cl_tools.MemoryPool(cl_tools.ImmediateAllocator(queue))

    def get(self, shape, seed, scale=1.0, dtype=None):
        dtype = self.dtype if dtype is None else dtype
        key = (tuple(shape), seed, scale, dtype)
        if key not in self.cache:
            host = np.random.default_rng(seed).random(shape, dtype=np.float32)
            self.cache[key] = cla.to_device(self.queue, ((host * 2 - 1) * scale).astype(dtype))
        return self.cache[key]

    def clear(self):
        self.cache.clear()
        self.pool.free_held()


def _nbytes(arrays):
    return sum(a.nbytes for a in arrays if a is not None)


def _flat(outs):
    return list(outs) if isinstance(outs, (tuple, list)) else [outs]


def _mem(op, ins, **kw):
    """A memory-bound bench: ``clops.<op>(queue, *ins, **kw)``; bytes = inputs + outputs."""

    def setup(queue, data):
        fn = getattr(clops, op)
        arrays = [data.get(*s) for s in ins]
        # keyword arrays are given as (shape, seed) like the positional ones
        kwargs = {k: data.get(*v) if isinstance(v, tuple) else v for k, v in kw.items()}
        call = lambda: fn(queue, *arrays, allocator=data.pool, **kwargs)  # noqa: E731
        extra = [v for v in kwargs.values() if isinstance(v, cla.Array)]
        return call, _nbytes(arrays) + _nbytes(extra) + _nbytes(_flat(call()))

    return setup


def _norm_bwd(n, d):
    def setup(queue, data):
        x, w, dy = data.get((n, d), 1), data.get((d,), 2), data.get((n, d), 3)
        _, inv = clops.rms_norm(queue, x, w)

        def call():
            return clops.rms_norm_bwd(queue, x, w, inv, dy, allocator=data.pool), \
                clops.rms_norm_dw(queue, x, inv, dy, allocator=data.pool)

        return call, x.dtype.itemsize * 3 * n * d + 4 * n + w.nbytes + 4 * d  # x, dy, dx; inv; w; dw (float32)

    return setup


def _norm_bwd_one_pass(n, d):
    """rms_norm_bwd with the gain gradient in one pass: x, dy, w, inv read, dx, dw written (the one-pass
    minimum, the bytes of the rms_norm_bwd+dw row)."""

    def setup(queue, data):
        x, w, dy = data.get((n, d), 1), data.get((d,), 2), data.get((n, d), 3)
        _, inv = clops.rms_norm(queue, x, w, allocator=data.pool)
        dw = cla.zeros(queue, d, w.dtype)
        call = lambda: clops.rms_norm_bwd(queue, x, w, inv, dy, dw=dw, allocator=data.pool)  # noqa: E731
        return call, _nbytes([x, w, inv, dy, x, dw])

    return setup


def _add_norm(backward, fused, n, d):
    """add_rms_norm (a, b, w read; s, y, inv written), or add then rms_norm timed on those same bytes
    (what the fused op saves shows as GB/s); add_rms_norm_bwd (s, w, inv, dy, ds read; dx, dw written)."""

    def setup(queue, data):
        a, b, w = data.get((n, d), 1, 4.0), data.get((n, d), 2, 2.0), data.get((d,), 2)
        s, y, inv = clops.add_rms_norm(queue, a, b, w, allocator=data.pool)
        if backward:
            dy, ds = data.get((n, d), 3), data.get((n, d), 4)
            dw = cla.zeros(queue, d, w.dtype)
            call = lambda: clops.add_rms_norm_bwd(queue, s, w, inv, dy, ds, dw=dw, allocator=data.pool)  # noqa: E731
            return call, _nbytes([s, w, inv, dy, ds, s, dw])
        if fused:
            call = lambda: clops.add_rms_norm(queue, a, b, w, s=s, out=y, inv=inv)  # noqa: E731
        else:
            call = lambda: (clops.add(queue, a, b, out=s), clops.rms_norm(queue, s, w, out=y, inv=inv))  # noqa: E731
        return call, _nbytes([a, b, w, s, y, inv])

    return setup


def _peer_add_rms(n, d):
    def make(torch, dtype):
        a, b, w = (_t_rand(torch, shape, seed, dtype) for shape, seed in (((n, d), 1), ((n, d), 2), ((d,), 3)))

        def call():
            s = a + b
            return s, torch.nn.functional.rms_norm(s, (d,), w, 1e-6)

        return call

    return make


def _qk(backward, n, window, heads, hd):
    def setup(queue, data):
        x, w, dy = data.get((n, heads, hd), 1), data.get((hd,), 2), data.get((n, heads, hd), 3)
        rope = cla.to_device(queue, clops.rope_table(window, hd // 4))
        y, inv = clops.qk_norm_rope(queue, x, w, rope, allocator=data.pool)
        if backward:
            call = lambda: clops.qk_norm_rope_bwd(queue, x, w, inv, rope, dy, allocator=data.pool)  # noqa: E731
            return call, _nbytes([x, w, inv, dy, x, w])  # reads x, w, inv, dy; writes dx, dw
        return lambda: clops.qk_norm_rope(queue, x, w, rope, allocator=data.pool), _nbytes([x, w, y, inv])

    return setup


def _xent(backward, n, vocab):
    """cross_entropy (bytes: logits read, loss and lse written) or its backward (logits read,
    dlogits written in place, as a training step does)."""

    def setup(queue, data):
        x = data.get((n, vocab), 1, 8.0)
        t = cla.to_device(queue, np.random.default_rng(2).integers(0, vocab, n).astype(np.int32))
        loss, lse = clops.cross_entropy(queue, x, t, allocator=data.pool)
        if not backward:
            return lambda: clops.cross_entropy(queue, x, t, allocator=data.pool), _nbytes([x, t, loss, lse])
        dloss = data.get((n,), 3, dtype=F32)
        return (lambda: clops.cross_entropy_bwd(queue, x, t, lse, dloss, dlogits=x),
                _nbytes([x, t, lse, dloss, x]))

    return setup


def _embedding(backward, n, vocab, d):
    """embedding: ids read, n rows of the table read, out written; embedding_bwd: ids and dout read,
    the whole dtable written."""

    def setup(queue, data):
        ids = cla.to_device(queue, np.random.default_rng(5).integers(0, vocab, n).astype(np.int32))
        if not backward:
            table = data.get((vocab, d), 1)
            return (lambda: clops.embedding(queue, table, ids, allocator=data.pool),
                    ids.nbytes + 2 * table.dtype.itemsize * n * d)
        dout = data.get((n, d), 2)
        return (lambda: clops.embedding_bwd(queue, ids, dout, vocab=vocab, allocator=data.pool),
                ids.nbytes + dout.dtype.itemsize * n * d + 4 * vocab * d)  # dtable: float32

    return setup


def _gemm(m, n, k):
    def setup(queue, data):
        a, b = data.get((m, k), 1), data.get((k, n), 2)
        return (lambda: clops.gemm(queue, a, b, allocator=data.pool)), 2.0 * m * n * k

    return setup


def _peer_gemm(m, n, k):
    def make(torch, dtype):
        a, b = _t_rand(torch, (m, k), 1, dtype), _t_rand(torch, (k, n), 2, dtype)
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 FMA, as CLBlast's SGEMM
        return lambda: a @ b

    return make


def _adamw(n):
    """adamw: reads p, g, m, v and writes p, m, v (float32 master state); at a 16-bit dtype, g is of
    that dtype and the 16-bit copy of p is written too (p_half)."""

    def setup(queue, data):
        p, m, v = (data.get((n,), seed, scale, dtype=F32) for seed, scale in ((1, 1.0), (3, 0.1), (4, 0.1)))
        v = cla.to_device(queue, np.abs(v.get()))  # on the host: a pyopencl kernel's build logs a CompilerWarning on Intel
        g = data.get((n,), 2)
        p_half = None if data.dtype == F32 else cla.empty(queue, (n,), data.dtype, allocator=data.pool)
        return (lambda: clops.adamw(queue, p, g, m, v, lr=1e-4, step=1, weight_decay=0.1, p_half=p_half),
                6 * p.nbytes + _nbytes([g, p_half]))

    return setup


def _peer_adamw(n):
    def make(torch, dtype):
        p = torch.nn.Parameter(_t_rand(torch, (n,), 1, torch.float32))
        g = _t_rand(torch, (n,), 2, dtype)
        opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, fused=True)
        if dtype == torch.float32:
            p.grad = g
            return opt.step
        half = torch.empty_like(g)

        def step():  # clops' work at a 16-bit dtype: the gradient widened, p's 16-bit copy written
            p.grad = g.float()
            opt.step()
            with torch.no_grad():
                half.copy_(p)

        return step

    return make


def _peer_xent(n, vocab, backward):
    def make(torch, dtype):
        x = _t_rand(torch, (n, vocab), 1, dtype) * 8
        t = torch.randint(0, vocab, (n,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
        if not backward:
            return lambda: torch.nn.functional.cross_entropy(x, t, reduction="none")
        x.requires_grad_(True)
        dloss = _t_rand(torch, (n,), 3, dtype)  # torch's loss has the logits' dtype
        return lambda: torch.autograd.grad(torch.nn.functional.cross_entropy(x, t, reduction="none"), x, dloss)

    return make


def _attention(backward, windows, window, nh, nkv, hd, lengths=None, bwd=None, **variant):
    """Attention over equal windows, or (``lengths``) sequences of those lengths, with ``variant``'s
    keywords (``bwd``'s too for the backward); a variant's FLOPs count its visible (query, key)
    pairs (:func:`attention_pairs`)."""
    def setup(queue, data):
        n = windows * window
        q, k, v = data.get((n, nh, hd), 1), data.get((n, nkv, hd), 2), data.get((n, nkv, hd), 3)
        if lengths is None and not variant:
            flops = attention_flops(windows, window, nh, hd)
        else:
            pairs = attention_pairs(lengths or [window] * windows, variant.get("causal", True),
                                    variant.get("sliding_window"))
            flops = 4 * nh * hd * pairs
        if lengths is None:
            kw = dict(variant, window=window)
        else:  # the offsets on the device and max_seqlen given: nothing is read back
            cu = cla.to_device(queue, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
            kw = dict(variant, cu_seqlens=cu, max_seqlen=max(lengths))
        if not backward:
            return lambda: clops.attention(queue, q, k, v, allocator=data.pool, **kw), flops
        do = data.get((n, nh, hd), 4)

        def call():
            o, lse = clops.attention(queue, q, k, v, allocator=data.pool, **kw)
            return clops.attention_bwd(queue, q, k, v, o, lse, do, allocator=data.pool, **kw, **(bwd or {}))

        return call, 3.5 * flops

    return setup


def attention_pairs(lengths, causal=True, sliding_window=None):
    """The (query, key) pairs attention visits unmasked over sequences of ``lengths``."""
    total = 0
    for t in lengths:
        w = t if sliding_window is None else min(sliding_window, t)
        if causal:  # query i sees min(i + 1, w) keys
            total += w * (w + 1) // 2 + (t - w) * w
        else:  # all t² pairs but those with |i − j| ≥ w
            total += t * t - (t - w) * (t - w + 1)
    return total


def varlen_lengths(n, window, seed=5):
    """Seeded sequence lengths drawn between 1 and 2·window, summing to n (the last one cut)."""
    rng, lengths = np.random.default_rng(seed), []
    while sum(lengths) < n:
        lengths.append(min(int(rng.integers(1, 2 * window + 1)), n - sum(lengths)))
    return lengths


# ---- PyTorch peers: each returns a callable that runs the same work on torch's GPU ----

def _t_rand(torch, shape, seed, dtype):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.rand(shape, device="cuda", generator=g) * 2 - 1).to(dtype)


def _peer_swiglu(rows, width):
    def make(torch, dtype):
        a, b = _t_rand(torch, (rows, width), 1, dtype), _t_rand(torch, (rows, width), 2, dtype)
        return lambda: torch.nn.functional.silu(a) * b

    return make


def _peer_rms(n, d, backward):
    def make(torch, dtype):
        x, w = _t_rand(torch, (n, d), 1, dtype), _t_rand(torch, (d,), 2, dtype)
        if not backward:
            return lambda: torch.nn.functional.rms_norm(x, (d,), w, 1e-6)
        x.requires_grad_(True)
        w.requires_grad_(True)
        dy = _t_rand(torch, (n, d), 3, dtype)

        def call():
            y = torch.nn.functional.rms_norm(x, (d,), w, 1e-6)
            return torch.autograd.grad(y, (x, w), dy)

        return call

    return make


def _peer_sdpa(backward, expand, windows, window, nh, nkv, hd):
    def make(torch, dtype):
        q = _t_rand(torch, (windows, nh, window, hd), 1, dtype)
        k, v = (_t_rand(torch, (windows, nkv, window, hd), seed, dtype) for seed in (2, 3))
        if expand:
            k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        kw = {} if expand else {"enable_gqa": True}
        if not backward:
            return lambda: sdpa(q, k, v, is_causal=True, **kw)
        for t in (q, k, v):
            t.requires_grad_(True)
        do = _t_rand(torch, (windows, nh, window, hd), 4, dtype)

        def call():
            return torch.autograd.grad(sdpa(q, k, v, is_causal=True, **kw), (q, k, v), do)

        return call

    return make


def benches(small):
    n, d = (TOKENS_SMALL, D_SMALL) if small else (TOKENS, D)
    w3 = 3 * d
    big, wide = ((n, w3), 1, 4.0), ((n, w3), 2, 2.0)
    dc3, rows3 = ((n, w3), 3), f"[{n}, {w3}]"
    a, b, dc = ((n, d), 1, 4.0), ((n, d), 2, 2.0), ((n, d), 3)
    nd = f"[{n}, {d}]"
    out = [
        Bench("swiglu", rows3, "GB/s", _mem("swiglu", [big, wide]), (("silu(a)·b", _peer_swiglu(n, w3)),)),
        Bench("swiglu_bwd", rows3, "GB/s", _mem("swiglu_bwd", [big, wide, dc3])),
        Bench("swiglu_limit", rows3, "GB/s", _mem("swiglu_limit", [big, wide], limit=7.0, scale=0.5,
                                                   row_weight=((n,), 5))),
        Bench("swiglu_gated", rows3, "GB/s", _mem("swiglu_gated", [big, wide, ((w3,), 6)])),
        Bench("swiglu_gated_bwd", rows3, "GB/s", _mem("swiglu_gated_bwd", [big, wide, ((w3,), 6), dc3])),
        Bench("sigmoid_gate", nd, "GB/s", _mem("sigmoid_gate", [a, b])),
        Bench("sigmoid_gate_bwd", nd, "GB/s", _mem("sigmoid_gate_bwd", [a, b, dc])),
        Bench("add", nd, "GB/s", _mem("add", [a, b])),
        Bench("rms_norm", nd, "GB/s", _mem("rms_norm", [a, ((d,), 2)]), (("F.rms_norm", _peer_rms(n, d, False)),)),
        Bench("rms_norm_bwd", nd, "GB/s", _mem("rms_norm_bwd", [a, ((d,), 2), ((n,), 7, 0.5, F32), dc])),
        Bench("rms_norm_dw", nd, "GB/s", _mem("rms_norm_dw", [a, ((n,), 7, 0.5, F32), dc])),
        Bench("rms_norm_bwd+dw", nd, "GB/s", _norm_bwd(n, d), (("F.rms_norm backward", _peer_rms(n, d, True)),)),
        Bench("rms_norm_bwd dw= one pass", nd, "GB/s", _norm_bwd_one_pass(n, d),
              (("F.rms_norm backward", _peer_rms(n, d, True)),)),
        Bench("add_rms_norm", nd, "GB/s", _add_norm(False, True, n, d), (("a + b, F.rms_norm", _peer_add_rms(n, d)),)),
        Bench("add+rms_norm", nd, "GB/s", _add_norm(False, False, n, d)),
        Bench("add_rms_norm_bwd", nd, "GB/s", _add_norm(True, True, n, d)),
    ]
    g = 256 if small else 4096
    out.append(Bench("gemm", f"{g}×{g}×{g}", "TFLOP/s", _gemm(g, g, g), (("a @ b fp32 (no TF32)", _peer_gemm(g, g, g)),)))
    out.append(Bench("adamw", f"[{n * d}]", "GB/s", _adamw(n * d),
                     (("torch.optim.AdamW (fused)", _peer_adamw(n * d)),)))
    vocab = 5000 if small else 50257
    out += [Bench("embedding", f"[{n}, {d}] of [{vocab}, {d}]", "GB/s", _embedding(False, n, vocab, d)),
            Bench("embedding_bwd", f"[{n}, {d}] into [{vocab}, {d}]", "GB/s", _embedding(True, n, vocab, d))]
    rows_v = f"[{n}, {vocab}]"
    out += [Bench("cross_entropy", rows_v, "GB/s", _xent(False, n, vocab),
                  (("F.cross_entropy", _peer_xent(n, vocab, False)),)),
            Bench("cross_entropy_bwd", rows_v, "GB/s", _xent(True, n, vocab),
                  (("F.cross_entropy fwd+bwd", _peer_xent(n, vocab, True)),))]
    shapes = ATTENTION_SMALL if small else ATTENTION
    for name, (windows, window, nh, nkv, hd) in shapes.items():
        tok = windows * window
        out += [Bench(f"qk_norm_rope {name}", f"[{tok}, {nh}, {hd}]", "GB/s", _qk(False, tok, window, nh, hd)),
                Bench(f"qk_norm_rope_bwd {name}", f"[{tok}, {nh}, {hd}]", "GB/s", _qk(True, tok, window, nh, hd))]
    for name, geo in shapes.items():
        shape = "{}×{} nh={} nkv={} hd={}".format(*geo)
        for backward, label in ((False, "attention"), (True, "attention+attention_bwd")):
            # q, k, v, do at the bench's dtype (lse float32, as attention makes it); FLOPs whatever the dtype
            peers = ((f"SDPA gqa{' fwd+bwd' if backward else ''}", _peer_sdpa(backward, False, *geo)),
                     (f"SDPA expanded K/V{' fwd+bwd' if backward else ''}", _peer_sdpa(backward, True, *geo)))
            out.append(Bench(f"{label} {name}", shape, "TFLOP/s", _attention(backward, *geo), peers))
        for stored in (True, False):  # both of the backward's ways to dQ, whichever is the default here
            way = "dS-stored" if stored else "dS-recomputed"
            out.append(Bench(f"attention+attention_bwd {way} {name}", shape, "TFLOP/s",
                             _attention(True, *geo, bwd={"store_ds": stored})))
    for name, (windows, window, nh, nkv, hd) in shapes.items():
        tok, heads = windows * window, f"nh={nh} nkv={nkv} hd={hd}"
        lengths = varlen_lengths(tok, window)
        variants = [  # (variant name, shape text, geometry, keywords)
            ("non-causal", f"{windows}×{window} {heads}", (windows, window), {"causal": False}),
            ("softcap", f"{windows}×{window} {heads} softcap 30", (windows, window), {"softcap": 30.0}),
            ("varlen", f"{len(lengths)} sequences of 1..{2 * window}, {tok} tokens, {heads}", (windows, window),
             {"lengths": lengths}),
        ] + [(f"sliding-{w}", f"1×{tok} {heads} sliding window {w}", (1, tok), {"sliding_window": w})
             for w in (SLIDING_SMALL if small else SLIDING)]
        for variant, shape, (nw, t), kw in variants:
            for backward, label in ((False, "attention"), (True, "attention+attention_bwd")):
                out.append(Bench(f"{label} {variant} {name}", shape, "TFLOP/s",
                                 _attention(backward, nw, t, nh, nkv, hd, **kw)))
    return out


def torch_gpu():
    """(torch module, None) when PyTorch with a CUDA/ROCm GPU is importable, else (None, why not)."""
    try:
        import torch
    except ImportError as e:
        return None, f"PyTorch is not importable ({e})"
    if not torch.cuda.is_available():
        return None, f"PyTorch {torch.__version__} sees no GPU"
    return torch, None


def time_torch(torch, fn):
    """Median ms of ``fn()`` on torch's current stream, CUDA events around each call."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(RUNS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _figure(unit, work, ms):
    return work / (ms * 1e6) if unit == "GB/s" else work / (ms * 1e9)


def _why(e):
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def run_bench(queue, bench, data, torch, limits, out):
    """Time one bench (and its peers) at ``data``'s dtype; returns its JSON record."""
    rec = {"shape": bench.shape, "unit": bench.unit}
    if data.dtype != F32 and bench_op(bench.name) not in NARROW_OPS:
        rec.update(status="skipped", reason=f"{bench_op(bench.name)} takes float32 only, not {data.dtype}")
        _print_row(bench.name, rec, out)
        return rec
    try:
        fn, work = bench.setup(queue, data)
        ms, times = measure(queue, fn, warmup=WARMUP, runs=RUNS)
        with Profile(queue) as prof:  # one call more: where an op of several kernels spends its time
            fn()
        split = {name: total for name, _, total, _, _ in prof.summary()}
    except (ValueError, RuntimeError, cl.Error) as e:
        rec.update(status="failed", reason=_why(e))
    else:
        fig = _figure(bench.unit, work, ms)
        limit = limits["copy_GBps"] if bench.unit == "GB/s" else limits["fp32_peak_TFLOPs"]
        rec.update(status="ok", ms=ms, times_ms=times, work=work, figure=fig,
                   fraction=None if limit is None else fig / limit, kernels_ms=split)
        if bench.unit == "GB/s":
            # at most the run's own copy size: a larger op is read against that copy (and no more memory is taken)
            try:
                same = copy_bandwidth(queue, min(max(work // 2, 4), limits["copy_bytes"]))
            except cl.Error as e:  # the op's figures stand; the row says why this one is missing
                rec["copy_same_size_failed"] = _why(e)
            else:
                rec.update(copy_same_size_GBps=same, same_size_fraction=fig / same)
    if torch is not None and bench.peers:
        rec["peers"] = {}
        for label, make in bench.peers:
            try:
                pms = time_torch(torch, make(torch, getattr(torch, data.dtype.name)))
            except Exception as e:  # any PyTorch failure (unsupported kernel, out of memory) is reported, not fatal
                rec["peers"][label] = {"status": "failed", "reason": _why(e)}
            else:
                peer = {"status": "ok", "ms": pms}
                if rec["status"] == "ok":
                    peer.update(figure=_figure(bench.unit, rec["work"], pms), ratio=pms / rec["ms"])
                rec["peers"][label] = peer
            torch.cuda.empty_cache()
    _print_row(bench.name, rec, out)
    return rec


def _print_row(name, rec, out):
    head = f"{name:<36} {rec['shape']:<26}"
    if rec["status"] != "ok":
        out(f"{head} {rec['status']}: {rec['reason']}")
    else:
        frac = "unknown" if rec["fraction"] is None else f"{rec['fraction']:.1%}"
        same = (f" {rec['same_size_fraction']:>17.1%}" if "same_size_fraction" in rec else
                f" copy failed: {rec['copy_same_size_failed']}" if "copy_same_size_failed" in rec else "")
        out(f"{head} {rec['ms']:>9.4f} {rec['figure']:>9.4g} {rec['unit']:<7} {frac:>8}{same}")
    for label, peer in rec.get("peers", {}).items():
        if peer["status"] != "ok":
            out(f"    torch {label}: failed: {peer['reason']}")
        elif "ratio" in peer:
            out(f"    torch {label:<36} {peer['ms']:>9.4f} {peer['figure']:>9.4g} {rec['unit']:<7} "
                f"torch/clops time {peer['ratio']:.2f}")
        else:
            out(f"    torch {label:<36} {peer['ms']:>9.4f} ms")


def _train(a, queue, out):
    from . import train_demo

    queue = queue or runtime.default_queue(profiling=True)
    torch, why = torch_gpu() if a.peers else (None, None)
    if a.peers and torch is None:
        out(f"peers: {why}")
    cfg = train_demo.TINY if a.small else train_demo.BENCH
    rec = train_demo.bench(queue, cfg, torch=torch, out=out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rec, device=list(runtime.device_identity(queue.device))), f, indent=1)
        out(f"figures written to {a.json}")
    return 0


def _step(a, queue, out):
    queue = queue or runtime.default_queue(profiling=True)
    torch, why = torch_gpu() if a.peers else (None, None)
    if a.peers and torch is None:
        out(f"peers: {why}")
    rec = step.main(queue, a.small, torch, out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rec, device=list(runtime.device_identity(queue.device))), f, indent=1)
        out(f"figures written to {a.json}")
    return 0


def main(argv=None, queue=None, out=print):
    p = argparse.ArgumentParser(prog="python -m clops bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="small shapes, so a CPU finishes in a minute or two")
    p.add_argument("--peers", action="store_true", help="add PyTorch's figures (needs PyTorch with a GPU)")
    p.add_argument("--json", metavar="PATH", help="write every figure, keyed by op name")
    p.add_argument("--only", action="append", metavar="TEXT", help="only ops whose name contains TEXT (repeatable)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="storage dtype of the activations (ops that take float32 only are skipped at the others)")
    p.add_argument("--step", action="store_true",
                   help="the non-matmul half of a pre-norm block, forward + backward (wall vs device time), and "
                        "the host cost of one op call (clops.step)")
    p.add_argument("--train", action="store_true",
                   help="tokens/s of the train-demo's model at a realistic size (clops.train_demo.BENCH): "
                        "shares of clops' kernels, CLBlast and the host, beside PyTorch eager with --peers")
    a = p.parse_args(argv)
    if (a.step or a.train) and a.dtype != "float32":
        p.error("--dtype: --step and --train run at float32 only")
    if a.step:
        return _step(a, queue, out)
    if a.train:
        return _train(a, queue, out)
    every = benches(a.small)
    unmatched = [t for t in a.only or () if not any(t in b.name for b in every)]
    if unmatched:
        p.error(f"--only {', '.join(unmatched)}: matches no op; the ops: {', '.join(b.name for b in every)}")
    queue = queue or runtime.default_queue(profiling=True)
    dev = queue.device
    torch, why = torch_gpu() if a.peers else (None, None)
    platform, name, driver = runtime.device_identity(dev)
    out(f"clops bench on {name} ({platform}, driver {driver}) at {a.dtype}{', small shapes' if a.small else ''}")
    source = source_identity()
    out(f"clops {source['version']}, tree {source['tree']} ({source['path']})")
    copy_bytes = min(dev.max_mem_alloc_size // 4, (16 if a.small else 1024) * 2**20)
    peak, basis = fp32_peak_tflops(dev)
    limits = {"copy_GBps": copy_bandwidth(queue, copy_bytes), "copy_bytes": copy_bytes, "fp32_peak_TFLOPs": peak,
              "fp32_peak_basis": basis}
    out(f"copy bandwidth (read + write, {copy_bytes // 2**20} MiB device-to-device): {limits['copy_GBps']:.1f} GB/s")
    out(f"FP32 peak: {'unknown' if peak is None else f'{peak:.1f} TFLOP/s'}: {basis}")
    if a.peers:
        out(f"peers: {'PyTorch ' + torch.__version__ + ' on ' + torch.cuda.get_device_name() if torch else why}")
    out(f"{'op':<36} {'shape':<26} {'ms':>9} {'figure':>9} {'unit':<7} {'of limit':>8} {'of same-size copy':>17}")
    data = Data(queue, DTYPES[a.dtype])
    ops = {}
    for bench in every:
        if a.only and not any(t in bench.name for t in a.only):
            continue
        ops[bench.name] = run_bench(queue, bench, data, torch, limits, out)
        if bench.unit == "TFLOP/s":  # attention shapes differ from one bench to the next
            data.clear()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": {"platform": platform, "name": name, "driver": driver}, "clops": source,
                       "small": a.small, "dtype": a.dtype, "limits": limits,
                       "peers": why if a.peers and torch is None else None, "ops": ops}, f, indent=1)
        out(f"figures written to {a.json}")
    return 0 if all(r["status"] in ("ok", "skipped") for r in ops.values()) else 1
