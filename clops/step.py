"""``python -m clops bench --step``: the non-matmul half of a pre-norm transformer block,
forward and backward, and the host cost of one op call.

The step (the matmuls' outputs stand in as inputs): ``rms_norm``,
``qk_norm_rope`` of q and of k, ``attention``, the residual ``add``, ``rms_norm``, ``swiglu``;
then ``swiglu_bwd``, ``rms_norm_bwd`` + ``rms_norm_dw``, the residual ``add``,
``attention_bwd``, two ``qk_norm_rope_bwd`` (with their gain gradients), ``rms_norm_bwd`` +
``rms_norm_dw`` and the last ``add``. Outputs are written into arrays allocated once, as a
training loop does. Reported per step: the wall time of ``STEPS`` steps enqueued back to back
(one ``finish`` at the end), the summed device time of the step's kernels (profiling events),
and the host share ``1 − device / wall`` (0 when the device never waits for Python).
``--peers``: PyTorch eager (float32, autograd) on the same ops, RoPE left out.

The per-call table: the host time of one warm call of each op at a tiny shape with its outputs
given, beside a raw ``pyopencl`` enqueue of clops' ``add`` kernel and ``pyopencl.array``'s
``a + b``: ``ROUNDS`` rounds, each running every one of them ``N_CALLS`` times back to back (the
mean of those), and the least of the rounds kept, so that all are measured under the same load
and a burst of noise in one round does not decide; an op's budget is ``a + b`` times the number
of kernels it enqueues.
"""
from __future__ import annotations

import time
import warnings

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

import clops

from . import elementwise
from .args import index_type
from .profile import Profile

SHAPES = {  # name: (nb, T, nh, nkv, hd, d, ff)
    "1x2048 hd128": (1, 2048, 16, 4, 128, 2048, 5632),
    "4x512 hd64": (4, 512, 8, 2, 64, 512, 1408),
    "small": (2, 128, 4, 2, 32, 256, 704),
}
STEPS, N_CALLS, ROUNDS = 20, 200, 7


class Block:
    """The arrays of one block step at ``shape``, allocated once, and the step itself."""

    def __init__(self, queue, shape, seed=0):
        nb, T, nh, nkv, hd, d, ff = shape
        n = nb * T
        self.queue, self.T = queue, T
        rng = np.random.default_rng(seed)

        def dev(*s, scale=1.0):
            return cla.to_device(queue, (rng.standard_normal(s) * scale).astype(np.float32))

        self.x, self.w1, self.w2 = dev(n, d), dev(d, scale=0.1), dev(d, scale=0.1)
        self.q_raw, self.k_raw, self.v = dev(n, nh, hd), dev(n, nkv, hd), dev(n, nkv, hd)
        self.wq, self.wk = dev(hd, scale=0.1), dev(hd, scale=0.1)
        self.rope = cla.to_device(queue, clops.rope_table(T, hd // 4))
        self.attn_proj, self.a, self.b = dev(n, d), dev(n, ff), dev(n, ff)  # what the matmuls would give
        self.dc, self.dh2, self.dh1, self.do, self.dy = dev(n, ff), dev(n, d), dev(n, d), dev(n, nh, hd), dev(n, d)
        e = self.e = {}
        for name, s in {"h1": (n, d), "inv1": (n,), "q": (n, nh, hd), "qinv": (n, nh), "k": (n, nkv, hd),
                        "kinv": (n, nkv), "o": (n, nh, hd), "lse": (n, nh), "s": (n, d), "h2": (n, d), "inv2": (n,),
                        "c": (n, ff), "da": (n, ff), "db": (n, ff), "ds_norm": (n, d), "ds": (n, d),
                        "dq": (n, nh, hd), "dk": (n, nkv, hd), "dv": (n, nkv, hd), "dq_raw": (n, nh, hd),
                        "dk_raw": (n, nkv, hd), "dx_norm": (n, d), "dx": (n, d), "dw1": (d,), "dw2": (d,),
                        "dwq": (hd,), "dwk": (hd,)}.items():
            # the gains' gradients are added into: zeroed by a fill command (Array.fill builds a kernel,
            # and Intel's runtime logs every build as a CompilerWarning)
            e[name] = (cla.zeros if name in ("dw1", "dw2", "dwq", "dwk") else cla.empty)(queue, s, np.float32)

    def step(self):
        q, e, T = self.queue, self.e, self.T
        clops.rms_norm(q, self.x, self.w1, out=e["h1"], inv=e["inv1"])
        clops.qk_norm_rope(q, self.q_raw, self.wq, self.rope, out=e["q"], inv=e["qinv"])
        clops.qk_norm_rope(q, self.k_raw, self.wk, self.rope, out=e["k"], inv=e["kinv"])
        clops.attention(q, e["q"], e["k"], self.v, window=T, out=e["o"], lse=e["lse"])
        clops.add(q, self.x, self.attn_proj, out=e["s"])
        clops.rms_norm(q, e["s"], self.w2, out=e["h2"], inv=e["inv2"])
        clops.swiglu(q, self.a, self.b, out=e["c"])
        clops.swiglu_bwd(q, self.a, self.b, self.dc, da=e["da"], db=e["db"])
        clops.rms_norm_bwd(q, e["s"], self.w2, e["inv2"], self.dh2, dx=e["ds_norm"])
        clops.rms_norm_dw(q, e["s"], e["inv2"], self.dh2, dw=e["dw2"])
        clops.add(q, e["ds_norm"], self.dy, out=e["ds"])
        clops.attention_bwd(q, e["q"], e["k"], self.v, e["o"], e["lse"], self.do, window=T, dq=e["dq"], dk=e["dk"],
                            dv=e["dv"])
        clops.qk_norm_rope_bwd(q, self.q_raw, self.wq, e["qinv"], self.rope, e["dq"], dx=e["dq_raw"], dw=e["dwq"])
        clops.qk_norm_rope_bwd(q, self.k_raw, self.wk, e["kinv"], self.rope, e["dk"], dx=e["dk_raw"], dw=e["dwk"])
        clops.rms_norm_bwd(q, self.x, self.w1, e["inv1"], self.dh1, dx=e["dx_norm"])
        clops.rms_norm_dw(q, self.x, e["inv1"], self.dh1, dw=e["dw1"])
        clops.add(q, e["dx_norm"], e["ds"], out=e["dx"])


def time_step(queue, shape, steps=STEPS):
    """{wall_ms, device_ms, host_share, kernels} of the block step at ``shape`` (per step)."""
    block = Block(queue, shape)
    for _ in range(3):  # builds, pools and caches warm
        block.step()
    queue.finish()
    with Profile(queue) as prof:
        block.step()
    device_ms = prof.kernel_ms()
    kernels = len(prof.launches)
    queue.finish()
    start = time.perf_counter()
    for _ in range(steps):
        block.step()
    queue.finish()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    return {"wall_ms": wall_ms, "device_ms": device_ms, "host_share": max(0.0, 1 - device_ms / wall_ms),
            "kernels": kernels}


def torch_step(torch, shape, steps=STEPS):
    """Wall ms per step of the same ops in PyTorch eager, float32, forward and backward (RoPE left out)."""
    nb, T, nh, nkv, hd, d, ff = shape
    n = nb * T
    F = torch.nn.functional
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*s, grad=True):
        return torch.randn(s, device="cuda", generator=g).requires_grad_(grad)

    x, w1, w2, wq, wk = rnd(n, d), rnd(d), rnd(d), rnd(hd), rnd(hd)
    q_raw, k_raw, v = rnd(nb, nh, T, hd), rnd(nb, nkv, T, hd), rnd(nb, nkv, T, hd)
    attn_proj, a, b = rnd(n, d), rnd(n, ff), rnd(n, ff)
    grads = [rnd(n, d, grad=False), rnd(nb, nh, T, hd, grad=False), rnd(n, d, grad=False), rnd(n, ff, grad=False)]

    def step():
        h1 = F.rms_norm(x, (d,), w1, 1e-6)
        qn, kn = F.rms_norm(q_raw, (hd,), wq, 1e-6), F.rms_norm(k_raw, (hd,), wk, 1e-6)
        o = F.scaled_dot_product_attention(qn, kn, v, is_causal=True, enable_gqa=True)
        s = x + attn_proj
        h2 = F.rms_norm(s, (d,), w2, 1e-6)
        c = F.silu(a) * b
        torch.autograd.backward([h1, o, h2, c], grads)

    return torch_wall_ms(torch, step, steps)


def torch_wall_ms(torch, step, steps, warmup=3):
    """Wall ms per call of ``step`` (PyTorch on its GPU): ``steps`` calls back to back, one sync."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def _per_call_ms(queue, fn, calls=N_CALLS):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    took = time.perf_counter() - start
    queue.finish()
    return took * 1e3 / calls


def per_call(queue):
    """[(name, kernels, host µs per call)] for the tiny ops, and {raw, array_add} µs."""
    block = Block(queue, (1, 16, 2, 1, 16, 64, 64))
    q, e, T = queue, block.e, block.T
    ops = {
        "add": lambda: clops.add(q, block.x, block.attn_proj, out=e["s"]),
        "swiglu": lambda: clops.swiglu(q, block.a, block.b, out=e["c"]),
        "swiglu_bwd": lambda: clops.swiglu_bwd(q, block.a, block.b, block.dc, da=e["da"], db=e["db"]),
        "rms_norm": lambda: clops.rms_norm(q, block.x, block.w1, out=e["h1"], inv=e["inv1"]),
        "rms_norm_bwd": lambda: clops.rms_norm_bwd(q, block.x, block.w1, e["inv1"], block.dh1, dx=e["dx_norm"]),
        "rms_norm_dw": lambda: clops.rms_norm_dw(q, block.x, e["inv1"], block.dh1, dw=e["dw1"]),
        "qk_norm_rope": lambda: clops.qk_norm_rope(q, block.q_raw, block.wq, block.rope, out=e["q"], inv=e["qinv"]),
        "qk_norm_rope_bwd": lambda: clops.qk_norm_rope_bwd(q, block.q_raw, block.wq, e["qinv"], block.rope, e["dq"],
                                                           dx=e["dq_raw"], dw=e["dwq"]),
        "attention": lambda: clops.attention(q, e["q"], e["k"], block.v, window=T, out=e["o"], lse=e["lse"]),
        "attention_bwd": lambda: clops.attention_bwd(q, e["q"], e["k"], block.v, e["o"], e["lse"], block.do, window=T,
                                                     dq=e["dq"], dk=e["dk"], dv=e["dv"]),
    }
    kernels = {}
    for name, fn in ops.items():
        fn()
        with Profile(queue) as prof:
            fn()
        kernels[name] = len(prof.launches)
    a, out = block.x, e["s"]
    p = elementwise.SPEC.params(queue.device, {})
    per_group = p["wg"] * p["ept"] * p["vw"]
    _, knl = elementwise.SPEC.kernels(queue, {}, idx=index_type(a.size + per_group), st="float", gst="float")
    raw = knl["add"].knl  # the pyopencl kernel itself, without clops around it
    gsize = (-(-a.size // per_group) * p["wg"],)
    args = [out.data, a.data, block.attn_proj.data, np.uint32(a.size)]
    ops["raw"] = lambda: raw(queue, gsize, (p["wg"],), *args)
    ops["array_add"] = lambda: a + block.attn_proj
    with warnings.catch_warnings():  # warm; array_add builds pyopencl's own kernel, whose build log Intel's
        warnings.simplefilter("ignore", cl.CompilerWarning)  # runtime fills on every build (clops ignores it too)
        for fn in ops.values():
            _per_call_ms(queue, fn, 20)
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(ROUNDS):
        for name, fn in ops.items():
            best[name] = min(best[name], _per_call_ms(queue, fn) * 1e3)
    rows = [(name, k, best[name]) for name, k in kernels.items()]
    return rows, {"raw": best["raw"], "array_add": best["array_add"]}


def main(queue, small, peers_torch, out=print):
    """Print the step table and the per-call table; returns the JSON record."""
    rec = {"steps": {}, "per_call": {}}
    out(f"{'block step (nb, T, nh, nkv, hd, d, ff)':<44} {'wall ms':>9} {'device ms':>10} {'host':>6} "
        f"{'kernels':>8}{'  torch eager ms' if peers_torch else ''}")
    for name, shape in SHAPES.items():
        if small and name != "small":
            continue
        r = time_step(queue, shape)
        if peers_torch is not None:
            r["torch_ms"] = torch_step(peers_torch, shape)
        rec["steps"][name] = dict(r, shape=shape)
        out(f"{name + ' ' + str(shape):<44} {r['wall_ms']:>9.3f} {r['device_ms']:>10.3f} {r['host_share']:>6.1%} "
            f"{r['kernels']:>8}" + (f"  {r['torch_ms']:>14.3f}" if "torch_ms" in r else ""))
    rows, base = per_call(queue)
    out(f"per-call host cost, outputs given: raw pyopencl enqueue {base['raw']:.1f} µs, "
        f"pyopencl.array a + b {base['array_add']:.1f} µs")
    out(f"{'op':<20} {'kernels':>8} {'µs/call':>9} {'budget µs':>10}")
    for name, k, us in rows:
        out(f"{name:<20} {k:>8} {us:>9.1f} {k * base['array_add']:>10.1f}{'' if us <= k * base['array_add'] else '  over'}")
        rec["per_call"][name] = {"kernels": k, "us": us, "budget_us": k * base["array_add"]}
    rec["per_call_base_us"] = base
    return rec
