"""``python -m clops train-demo`` (and ``examples/train_lm.py``): a small GPT-style language model
trained end to end on clops' ops, matmuls through CLBlast (:mod:`clops.blas`).

The model: token embedding; per layer a pre-norm block — RMSNorm, q/k/v projections,
``qk_norm_rope`` of q and k, causal GQA ``attention`` inside each sequence, the output
projection, the residual add and RMSNorm, a SwiGLU MLP (``swiglu`` between two projections),
the residual add — then a final RMSNorm, the vocabulary projection and ``cross_entropy`` (the
mean over tokens). Each residual add and the norm after it are one ``add_rms_norm`` (the first
norm a ``rms_norm``). The backward is written out op by op (each op's ``_bwd``, matmul
transposes; ``add_rms_norm_bwd`` adds the norm's gradient into the residual stream's where it
lies, with the gain's gradient from the same pass), and one ``adamw`` launch updates every
tensor. Everything stays on the device; the loss is read back every ``--log`` steps for the
progress line.

The text is generated (a seeded stream of words from a small vocabulary with a fixed order of
word classes), byte-level tokens. ``--check`` runs the same model in PyTorch (CPU, float64)
from the same weights: it prints the largest relative error of every gradient of the first
step and compares the first 10 losses, and fails beyond float32's tolerance.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
import types

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

import clops

from .args import index_array
from .blas import gemm
from .step import torch_wall_ms


@dataclasses.dataclass
class Config:
    vocab: int = 256  # bytes
    d: int = 128
    layers: int = 2
    nh: int = 4
    nkv: int = 2
    ff: int = 256
    seq: int = 64  # tokens per sequence (the attention window)
    batch: int = 8  # sequences per step
    lr: float = 3e-3
    weight_decay: float = 0.01
    steps: int = 300
    seed: int = 0

    @property
    def hd(self):
        return self.d // self.nh

    @property
    def tokens(self):
        return self.seq * self.batch


TINY = Config(vocab=256, d=32, layers=2, nh=4, nkv=2, ff=48, seq=16, batch=2, steps=10)


def make_text(nbytes, seed=0):
    """A seeded, learnable byte text: sentences of words drawn per word class in a fixed order."""
    rng = np.random.default_rng(seed)
    classes = [["the", "a", "one", "every"], ["cat", "dog", "bird", "kernel", "queue"],
               ["runs", "sees", "builds", "waits", "sorts"], ["fast", "slowly", "here", "again"]]
    out, size = [], 0
    while size < nbytes:
        sentence = " ".join(c[rng.integers(len(c))] for c in classes) + ". "
        out.append(sentence)
        size += len(sentence)
    return np.frombuffer("".join(out).encode()[:nbytes], np.uint8).astype(np.int32)


def init_weights(cfg, seed=0):
    """{name: float32 numpy array}; matrices are [in, out] (y = x @ W)."""
    rng = np.random.default_rng(seed)

    def normal(*shape, std=0.02):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w = {"embed": normal(cfg.vocab, cfg.d, std=0.5), "norm_f": 1 + normal(cfg.d, std=0.1),
         "head": normal(cfg.d, cfg.vocab, std=0.1)}
    for i in range(cfg.layers):
        w.update({f"{i}.norm1": 1 + normal(cfg.d, std=0.1), f"{i}.wq": normal(cfg.d, cfg.nh * cfg.hd, std=0.1),
                  f"{i}.wk": normal(cfg.d, cfg.nkv * cfg.hd, std=0.1), f"{i}.wv": normal(cfg.d, cfg.nkv * cfg.hd, std=0.1),
                  f"{i}.qnorm": normal(cfg.hd, std=0.1), f"{i}.knorm": normal(cfg.hd, std=0.1),
                  f"{i}.wo": normal(cfg.nh * cfg.hd, cfg.d, std=0.1), f"{i}.norm2": 1 + normal(cfg.d, std=0.1),
                  f"{i}.w1": normal(cfg.d, cfg.ff, std=0.1), f"{i}.w3": normal(cfg.d, cfg.ff, std=0.1),
                  f"{i}.w2": normal(cfg.ff, cfg.d, std=0.1)})
    return w


LEAD = 2  # steps the host enqueues ahead of the device at most (Model.step)


def _added_into(name, weight):
    """Whether the op that makes ``name``'s gradient adds it into the array it is given (embedding_bwd,
    the gains' backwards) rather than writing it (gemm)."""
    return name == "embed" or weight.ndim == 1


class Model:
    """The model's weights, gradients and AdamW moments on the device, and one training step.

    Weights, gradients and the two moments each live in one flat buffer, every tensor a sub-buffer of
    it (its start aligned as the device asks): one ``adamw`` launch updates them all, and one fill
    zeroes the gradients that ops add into. The step's activations and gradients are arrays made once
    and given to every op as its outputs, so a step allocates nothing but the ops' scratch: the same
    arrays are written at every step (and the backward's at every layer), so the queue must be in
    order.
    """

    def __init__(self, queue, cfg, weights):
        if queue.properties & cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE:
            raise ValueError("queue: the model writes the same arrays at every step; it needs an in-order queue")
        self.q, self.cfg = queue, cfg
        names = sorted(weights, key=lambda k: not _added_into(k, weights[k]))  # those added into first
        align = queue.device.mem_base_addr_align // 8  # bytes (the device gives bits)
        offsets, size = {}, 0
        for k in names:
            offsets[k] = size
            size += -(-weights[k].nbytes // align) * align
        # the bytes of the gradients added into, zeroed at every step
        self.zeroed = next((offsets[k] for k in names if not _added_into(k, weights[k])), size)
        host = np.zeros(size // 4, np.float32)
        for k in names:
            host[offsets[k] // 4:][:weights[k].size] = weights[k].ravel()
        self.flat = {"p": cla.to_device(queue, host), **{k: cla.zeros(queue, host.shape, np.float32) for k in "gmv"}}

        def views(flat):
            return {k: cla.Array(queue, weights[k].shape, np.float32,
                                 data=flat.base_data.get_sub_region(offsets[k], weights[k].nbytes)) for k in weights}

        self.w, self.g = views(self.flat["p"]), views(self.flat["g"])
        self.rope = cla.to_device(queue, clops.rope_table(cfg.seq, cfg.hd // 2, theta=1e4))
        self.dloss = cla.to_device(queue, np.full(cfg.tokens, 1.0 / cfg.tokens, np.float32))  # d(mean)/d(row)
        self.step_count = 0
        self.done = collections.deque()  # the last kernel of each step not yet waited for
        self.waited = 0.0  # seconds step() has waited for the device
        n, d, ff, nh, nkv, hd = cfg.tokens, cfg.d, cfg.ff, cfg.nh, cfg.nkv, cfg.hd

        def empty(*shape):
            return cla.empty(queue, shape, np.float32)

        def heads(h):  # [n, h·hd] and its [n, h, hd] view
            a = empty(n, h * hd)
            return a, a.reshape(n, h, hd)

        def saved():  # what a layer keeps for its backward; its x is written by the layer before
            s = types.SimpleNamespace(x=empty(n, d), h=empty(n, d), inv1=empty(n), qn=empty(n, nh, hd),
                                      qinv=empty(n, nh), kn=empty(n, nkv, hd), kinv=empty(n, nkv), lse=empty(n, nh),
                                      x2=empty(n, d), h2=empty(n, d), inv2=empty(n), a=empty(n, ff), b=empty(n, ff),
                                      sw=empty(n, ff))
            (s.qr, s.qr3), (s.kr, s.kr3), (s.v, s.v3), (s.o2, s.o) = heads(nh), heads(nkv), heads(nkv), heads(nh)
            return s

        # layers[-1]: the final norm's input, output and inv, in a layer's names (the last layer writes it as one)
        self.layers = [saved() for _ in range(cfg.layers)] + [types.SimpleNamespace(x=empty(n, d), h=empty(n, d),
                                                                                    inv1=empty(n))]
        # the step's other arrays, rewritten at every layer
        t = self.tmp = types.SimpleNamespace(proj=empty(n, d), logits=empty(n, cfg.vocab), loss=empty(n),
                                             lse=empty(n), dh=empty(n, d), dx=empty(n, d), dsw=empty(n, ff),
                                             da=empty(n, ff), db=empty(n, ff), dqn=empty(n, nh, hd),
                                             dkn=empty(n, nkv, hd))
        (t.do, t.do3), (t.dq, t.dq3), (t.dk, t.dk3), (t.dv, t.dv3) = heads(nh), heads(nh), heads(nkv), heads(nkv)

    def forward_backward(self, ids, targets):
        """(per-token loss, {name: gradient}) of one batch; ``ids``/``targets`` int32 [tokens]. The
        arrays are the model's own, written again by the next call."""
        q, c, w, g, t = self.q, self.cfg, self.w, self.g, self.tmp
        if self.zeroed:
            cl.enqueue_fill_buffer(q, self.flat["g"].base_data, np.float32(0), 0, self.zeroed)
        ids = index_array("ids", ids, q, (c.tokens,), below=c.vocab)  # checked and copied once, used twice
        targets = index_array("targets", targets, q, (c.tokens,), below=c.vocab)
        layers = self.layers
        clops.embedding(q, w["embed"], ids, out=layers[0].x)
        clops.rms_norm(q, layers[0].x, w["0.norm1"], out=layers[0].h, inv=layers[0].inv1)
        for i in range(c.layers):
            s, nxt = layers[i], layers[i + 1]
            for p, out in (("wq", s.qr), ("wk", s.kr), ("wv", s.v)):
                gemm(q, s.h, w[f"{i}.{p}"], out=out)
            clops.qk_norm_rope(q, s.qr3, w[f"{i}.qnorm"], self.rope, out=s.qn, inv=s.qinv)
            clops.qk_norm_rope(q, s.kr3, w[f"{i}.knorm"], self.rope, out=s.kn, inv=s.kinv)
            clops.attention(q, s.qn, s.kn, s.v3, window=c.seq, out=s.o, lse=s.lse)
            gemm(q, s.o2, w[f"{i}.wo"], out=t.proj)
            clops.add_rms_norm(q, s.x, t.proj, w[f"{i}.norm2"], s=s.x2, out=s.h2, inv=s.inv2)
            gemm(q, s.h2, w[f"{i}.w1"], out=s.a)
            gemm(q, s.h2, w[f"{i}.w3"], out=s.b)
            clops.swiglu(q, s.a, s.b, out=s.sw)
            gemm(q, s.sw, w[f"{i}.w2"], out=t.proj)
            norm = f"{i + 1}.norm1" if i + 1 < c.layers else "norm_f"
            clops.add_rms_norm(q, s.x2, t.proj, w[norm], s=nxt.x, out=nxt.h, inv=nxt.inv1)
        f = layers[-1]
        gemm(q, f.h, w["head"], out=t.logits)
        clops.cross_entropy(q, t.logits, targets, loss=t.loss, lse=t.lse)
        clops.cross_entropy_bwd(q, t.logits, targets, t.lse, self.dloss, dlogits=t.logits)
        gemm(q, f.h, t.logits, trans_a=True, out=g["head"])
        gemm(q, t.logits, w["head"], trans_b=True, out=t.dh)
        clops.rms_norm_bwd(q, f.x, w["norm_f"], f.inv1, t.dh, dx=t.dx, dw=g["norm_f"])
        for i in reversed(range(c.layers)):  # t.dx: the gradient of the residual stream, updated in place
            s = layers[i]
            gemm(q, s.sw, t.dx, trans_a=True, out=g[f"{i}.w2"])
            gemm(q, t.dx, w[f"{i}.w2"], trans_b=True, out=t.dsw)
            clops.swiglu_bwd(q, s.a, s.b, t.dsw, da=t.da, db=t.db)
            gemm(q, s.h2, t.da, trans_a=True, out=g[f"{i}.w1"])
            gemm(q, s.h2, t.db, trans_a=True, out=g[f"{i}.w3"])
            gemm(q, t.da, w[f"{i}.w1"], trans_b=True, out=t.dh)
            gemm(q, t.db, w[f"{i}.w3"], trans_b=True, beta=1.0, out=t.dh)
            clops.add_rms_norm_bwd(q, s.x2, w[f"{i}.norm2"], s.inv2, t.dh, t.dx, dx=t.dx, dw=g[f"{i}.norm2"])
            gemm(q, s.o2, t.dx, trans_a=True, out=g[f"{i}.wo"])
            gemm(q, t.dx, w[f"{i}.wo"], trans_b=True, out=t.do)
            clops.attention_bwd(q, s.qn, s.kn, s.v3, s.o, s.lse, t.do3, window=c.seq, dq=t.dqn, dk=t.dkn, dv=t.dv3)
            clops.qk_norm_rope_bwd(q, s.qr3, w[f"{i}.qnorm"], s.qinv, self.rope, t.dqn, dx=t.dq3,
                                   dw=g[f"{i}.qnorm"])
            clops.qk_norm_rope_bwd(q, s.kr3, w[f"{i}.knorm"], s.kinv, self.rope, t.dkn, dx=t.dk3,
                                   dw=g[f"{i}.knorm"])
            for p, dp in (("wq", t.dq), ("wk", t.dk), ("wv", t.dv)):
                gemm(q, s.h, dp, trans_a=True, out=g[f"{i}.{p}"])
                gemm(q, dp, w[f"{i}.{p}"], trans_b=True, beta=0.0 if p == "wq" else 1.0, out=t.dh)
            clops.add_rms_norm_bwd(q, s.x, w[f"{i}.norm1"], s.inv1, t.dh, t.dx, dx=t.dx, dw=g[f"{i}.norm1"])
        clops.embedding_bwd(q, ids, t.dx, vocab=c.vocab, dtable=g["embed"])
        return t.loss, g

    def step(self, ids, targets):
        """One training step; returns the per-token loss array (on the device, the model's own: read it
        before the next step). It first waits for the step ``LEAD`` steps back to complete: the host
        enqueues at most ``LEAD`` steps ahead of the device, so the scratch that the ops hold until
        their kernels complete (attention's dS, CLBlast's temporary matrices, …) stays within
        ``LEAD + 1`` steps' worth, whatever the number of steps between two reads of the loss."""
        if len(self.done) == LEAD:
            began = time.perf_counter()
            self.done.popleft().wait()
            self.waited += time.perf_counter() - began
        loss, _ = self.forward_backward(ids, targets)
        self.step_count += 1
        f = self.flat
        p, _, _ = clops.adamw(self.q, f["p"], f["g"], f["m"], f["v"], lr=self.cfg.lr, step=self.step_count,
                              weight_decay=self.cfg.weight_decay)
        self.done.append(p.events[0])  # the step's last kernel
        return loss


def batches(text, cfg, seed=0):
    """Endless (ids, targets) int32 device-ready numpy pairs of ``batch`` random windows of the text."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(text) - cfg.seq - 1, cfg.batch)
        ids = np.concatenate([text[s:s + cfg.seq] for s in starts]).astype(np.int32)
        targets = np.concatenate([text[s + 1:s + cfg.seq + 1] for s in starts]).astype(np.int32)
        yield ids, targets


# ---- the PyTorch twin (CPU, float64) for --check ----

def torch_model(torch, cfg, weights, dtype=None, device="cpu"):
    """(params {name: tensor}, loss_fn(ids, targets)) of the same model in PyTorch (float64 unless told)."""
    F = torch.nn.functional
    dtype = dtype or torch.float64
    p = {k: torch.tensor(v, dtype=dtype, device=device, requires_grad=True) for k, v in weights.items()}
    rope = torch.tensor(clops.rope_table(cfg.seq, cfg.hd // 2, theta=1e4), dtype=dtype, device=device)
    n, hd, half = cfg.tokens, cfg.hd, cfg.hd // 2
    pos = torch.arange(n, device=device) % cfg.seq
    cos, sin = rope[pos, :, 0][:, None, :], rope[pos, :, 1][:, None, :]

    def rms(x, w, gemma=False, eps=1e-6):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * ((1 + w) if gemma else w)

    def norm_rope(x, w):
        y = rms(x, w, gemma=True)
        lo, hi = y[..., :half], y[..., half:2 * half]
        return torch.cat([lo * cos - hi * sin, lo * sin + hi * cos, y[..., 2 * half:]], -1)

    def attend(qh, kh, vh):
        b = cfg.batch
        qh, kh, vh = (t.reshape(b, cfg.seq, -1, hd).transpose(1, 2) for t in (qh, kh, vh))
        kh, vh = (t.repeat_interleave(cfg.nh // cfg.nkv, dim=1) for t in (kh, vh))
        scores = qh @ kh.transpose(-1, -2) / hd ** 0.5
        mask = torch.ones(cfg.seq, cfg.seq, dtype=torch.bool, device=device).tril()
        o = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vh
        return o.transpose(1, 2).reshape(n, cfg.nh * hd)

    def loss_fn(ids, targets):
        x = p["embed"][torch.as_tensor(ids, dtype=torch.long, device=device)]
        for i in range(cfg.layers):
            h = rms(x, p[f"{i}.norm1"])
            qh = norm_rope((h @ p[f"{i}.wq"]).reshape(n, cfg.nh, hd), p[f"{i}.qnorm"])
            kh = norm_rope((h @ p[f"{i}.wk"]).reshape(n, cfg.nkv, hd), p[f"{i}.knorm"])
            vh = (h @ p[f"{i}.wv"]).reshape(n, cfg.nkv, hd)
            x = x + attend(qh, kh, vh) @ p[f"{i}.wo"]
            h2 = rms(x, p[f"{i}.norm2"])
            x = x + (F.silu(h2 @ p[f"{i}.w1"]) * (h2 @ p[f"{i}.w3"])) @ p[f"{i}.w2"]
        logits = rms(x, p["norm_f"]) @ p["head"]
        return F.cross_entropy(logits, torch.as_tensor(targets, dtype=torch.long, device=device))

    return p, loss_fn


def rel(got, want):
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


GRAD_TOL, LOSS_TOL = 1e-5, 1e-6  # float32 kernels and matmuls against float64, relative (the backward's parity tolerance)


def check(queue, cfg, out=print):
    """Gradients of the first step and the first 10 losses against PyTorch float64; True when all agree."""
    try:
        import torch
    except ImportError as e:
        raise SystemExit(f"--check needs PyTorch (pip install torch): {e}")
    weights = init_weights(cfg, cfg.seed)
    text = make_text(20000, cfg.seed)
    model = Model(queue, cfg, weights)
    params, loss_fn = torch_model(torch, cfg, weights)
    opt = torch.optim.AdamW(params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = batches(text, cfg, cfg.seed)
    ok = True
    for step in range(10):
        ids, targets = next(data)
        if step == 0:
            loss, grads = model.forward_backward(ids, targets)
            want = loss_fn(ids, targets)
            want.backward()
            out(f"{'gradient':<10} {'shape':<14} {'rel err':>9}")
            for k in weights:
                err = rel(grads[k].get(), params[k].grad.numpy())
                ok &= err <= GRAD_TOL
                out(f"{k:<10} {str(weights[k].shape):<14} {err:>9.2e}{'' if err <= GRAD_TOL else '  FAIL'}")
            opt.zero_grad()
            out(f"{'step':>4} {'clops loss':>12} {'torch loss':>12} {'rel err':>9}")
        loss = float(model.step(ids, targets).get().mean())
        opt.zero_grad()
        want = loss_fn(ids, targets)
        want.backward()
        opt.step()
        err = abs(loss - want.item()) / abs(want.item())
        ok &= err <= LOSS_TOL
        out(f"{step + 1:>4} {loss:>12.6f} {want.item():>12.6f} {err:>9.2e}{'' if err <= LOSS_TOL else '  FAIL'}")
    out("check " + ("passed" if ok else "FAILED") + f" (gradients ≤ {GRAD_TOL:.0e}, losses ≤ {LOSS_TOL:.0e})")
    return ok


def train(queue, cfg, log=20, plot=None, out=print):
    """Train for ``cfg.steps`` steps; returns the logged (step, mean loss) pairs."""
    text = make_text(200000, cfg.seed)
    model = Model(queue, cfg, init_weights(cfg, cfg.seed))
    data = batches(text, cfg, cfg.seed)
    curve, start = [], time.perf_counter()
    for step in range(1, cfg.steps + 1):
        loss = model.step(*next(data))
        if step == 1 or step % log == 0 or step == cfg.steps:
            mean = float(loss.get().mean())  # the only read-back: once per logged step
            rate = step * cfg.tokens / (time.perf_counter() - start)
            curve.append((step, mean))
            bar = "#" * (30 * step // cfg.steps)
            out(f"\r[{bar:<30}] step {step}/{cfg.steps} loss {mean:.4f} {rate:,.0f} tokens/s", end="")
    out("")
    if plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            out("--plot: matplotlib is not installed, no chart written (pip install matplotlib)")
        else:
            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot(*zip(*curve))
            ax.set_yscale("log")
            ax.set_xlabel("step")
            ax.set_ylabel("mean cross-entropy (nats)")
            ax.set_title(f"clops train-demo: d={cfg.d}, {cfg.layers} layers, {cfg.tokens} tokens/step", fontsize=9)
            fig.tight_layout()
            fig.savefig(plot, dpi=110)
            out(f"loss curve written to {plot}")
    return curve


BENCH = Config(vocab=32000, d=1024, layers=8, nh=16, nkv=4, ff=2816, seq=1024, batch=8)


def bench(queue, cfg=BENCH, steps=5, torch=None, out=print):
    """Tokens/s of training steps at ``cfg`` (profiling queue), the shares of the step in clops'
    kernels, in CLBlast and on the host (what is left of the wall time: the device waiting), the
    launches of a step and the host's time to enqueue one; with ``torch``, the same model in PyTorch
    eager float32 on its GPU. Returns the record."""
    from .profile import Profile

    model = Model(queue, cfg, init_weights(cfg, cfg.seed))
    data = batches(make_text(cfg.tokens * 4, cfg.seed), cfg, cfg.seed)
    for _ in range(LEAD + 1):  # back to back, as timed below: the pool then holds what the timed steps take
        model.step(*next(data))
    queue.finish()
    with Profile(queue) as prof:
        model.step(*next(data))
    blas = [r for r in prof.launches if r.template == "CLBlast"]
    blas_ms = sum(r.ms for r in blas)
    clops_ms = sum(r.ms for r in prof.launches if r.template != "CLBlast")
    enqueue, waited = 0.0, model.waited
    start = time.perf_counter()
    for _ in range(steps):
        batch = next(data)
        began = time.perf_counter()
        model.step(*batch)
        enqueue += time.perf_counter() - began
    queue.finish()
    enqueue -= model.waited - waited  # the host's own time: not its waits for the device
    wall = (time.perf_counter() - start) * 1e3 / steps
    rec = {"config": dataclasses.asdict(cfg), "wall_ms": wall, "tokens_per_s": cfg.tokens / wall * 1e3,
           "clops_ms": clops_ms, "clblast_ms": blas_ms, "host_share": max(0.0, 1 - (clops_ms + blas_ms) / wall),
           "kernels": len(prof.launches) - len(blas), "clblast_calls": len(blas), "enqueue_ms": enqueue * 1e3 / steps}
    out(f"train step d={cfg.d} layers={cfg.layers} T={cfg.seq} batch={cfg.batch} vocab={cfg.vocab}: "
        f"{wall:.2f} ms, {rec['tokens_per_s']:,.0f} tokens/s; clops kernels {clops_ms:.2f} ms "
        f"({clops_ms / wall:.0%}), CLBlast {blas_ms:.2f} ms ({blas_ms / wall:.0%}), host {rec['host_share']:.0%}")
    out(f"    a step: {rec['kernels']} clops kernels and {rec['clblast_calls']} CLBlast calls, enqueued by the host "
        f"in {rec['enqueue_ms']:.2f} ms")
    if torch is not None:
        rec["torch"] = torch_bench(torch, cfg, steps)
        t = rec["torch"]
        out(f"    torch eager float32: {t['wall_ms']:.2f} ms, {t['tokens_per_s']:,.0f} tokens/s; its matmuls "
            f"{t['matmul_ms']:.2f} ms, the rest {t['rest_ms']:.2f} ms (clops' ops: {clops_ms:.2f} ms)")
    return rec


def torch_bench(torch, cfg, steps):
    """The same model and step (forward, backward, AdamW) in PyTorch eager float32 on its GPU, and the
    time of its matmuls (profiler) against the rest."""
    params, loss_fn = torch_model(torch, cfg, init_weights(cfg, cfg.seed), dtype=torch.float32, device="cuda")
    opt = torch.optim.AdamW(params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = batches(make_text(cfg.tokens * 4, cfg.seed), cfg, cfg.seed)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products, as CLBlast's

    def step():
        opt.zero_grad()
        loss_fn(*next(data)).backward()
        opt.step()

    wall = torch_wall_ms(torch, step, steps, warmup=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) / 1e3
    matmul = sum(e.self_device_time_total for e in events if "gemm" in e.key.lower() or "sgemm" in e.key.lower()
                 or "cutlass" in e.key.lower()) / 1e3
    return {"wall_ms": wall, "tokens_per_s": cfg.tokens / wall * 1e3, "matmul_ms": matmul, "rest_ms": total - matmul}


def main(argv=None, queue=None):
    p = argparse.ArgumentParser(prog="python -m clops train-demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=Config.steps)
    p.add_argument("--log", type=int, default=20, help="steps between progress lines (each reads the loss back)")
    p.add_argument("--plot", metavar="PNG", help="save the loss curve (needs matplotlib)")
    p.add_argument("--tiny", action="store_true", help="a tiny model (what --check runs in the tests)")
    p.add_argument("--check", action="store_true",
                   help="compare the first step's gradients and the first 10 losses with PyTorch (CPU, float64)")
    a = p.parse_args(argv)
    cfg = dataclasses.replace(TINY if a.tiny else Config(), steps=a.steps if not a.tiny else max(a.steps, 1))
    queue = queue or clops.default_queue()
    dev = queue.device
    print(f"clops train-demo on {dev.name.strip()}: {cfg}")
    if a.check:
        return 0 if check(queue, cfg) else 1
    train(queue, cfg, a.log, a.plot, out=lambda s, end="\n": print(s, end=end, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
