"""``python -m clops train-demo`` (and ``examples/train_lm.py``): a small GPT-style language model
trained end to end on clops' ops, matmuls through CLBlast (:mod:`clops.blas`).

The model: token embedding; per layer a pre-norm block — ``rms_norm``, q/k/v projections,
``qk_norm_rope`` of q and k, causal GQA ``attention`` inside each sequence, the output
projection, the residual ``add``, ``rms_norm``, a SwiGLU MLP (``swiglu`` between two
projections), the residual ``add`` — then a final ``rms_norm``, the vocabulary projection and
``cross_entropy`` (the mean over tokens). The backward is written out op by op (each op's
``_bwd``, matmul transposes), and ``adamw`` updates every tensor. Everything stays on the
device; the loss is read back every ``--log`` steps for the progress line.

The text is generated (a seeded stream of words from a small vocabulary with a fixed order of
word classes), byte-level tokens. ``--check`` runs the same model in PyTorch (CPU, float64)
from the same weights: it prints the largest relative error of every gradient of the first
step and compares the first 10 losses, and fails beyond float32's tolerance.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np
import pyopencl.array as cla

import clops

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


class Model:
    """The model's weights, gradients and AdamW moments on the device, and one training step."""

    def __init__(self, queue, cfg, weights):
        self.q, self.cfg = queue, cfg
        self.w = {k: cla.to_device(queue, v) for k, v in weights.items()}
        self.m = {k: cla.zeros_like(v) for k, v in self.w.items()}
        self.v = {k: cla.zeros_like(v) for k, v in self.w.items()}
        self.rope = cla.to_device(queue, clops.rope_table(cfg.seq, cfg.hd // 2, theta=1e4))
        self.dloss = cla.to_device(queue, np.full(cfg.tokens, 1.0 / cfg.tokens, np.float32))  # d(mean)/d(row)
        self.step_count = 0

    def forward_backward(self, ids, targets):
        """(per-token loss, {name: gradient}) of one batch; ``ids``/``targets`` int32 [tokens]."""
        q, c, w = self.q, self.cfg, self.w
        n, nh, nkv, hd = c.tokens, c.nh, c.nkv, c.hd
        x = clops.embedding(q, w["embed"], ids)
        saved = []
        for i in range(c.layers):
            h, inv1 = clops.rms_norm(q, x, w[f"{i}.norm1"])
            qr, kr, v = (gemm(q, h, w[f"{i}.{p}"]) for p in ("wq", "wk", "wv"))
            qn, qinv = clops.qk_norm_rope(q, qr.reshape(n, nh, hd), w[f"{i}.qnorm"], self.rope)
            kn, kinv = clops.qk_norm_rope(q, kr.reshape(n, nkv, hd), w[f"{i}.knorm"], self.rope)
            v3 = v.reshape(n, nkv, hd)
            o, lse = clops.attention(q, qn, kn, v3, window=c.seq)
            x2 = clops.add(q, x, gemm(q, o.reshape(n, nh * hd), w[f"{i}.wo"]))
            h2, inv2 = clops.rms_norm(q, x2, w[f"{i}.norm2"])
            a, b = gemm(q, h2, w[f"{i}.w1"]), gemm(q, h2, w[f"{i}.w3"])
            s = clops.swiglu(q, a, b)
            saved.append((x, h, inv1, qr, kr, qn, qinv, kn, kinv, v3, o, lse, x2, h2, inv2, a, b, s))
            x = clops.add(q, x2, gemm(q, s, w[f"{i}.w2"]))
        hf, invf = clops.rms_norm(q, x, w["norm_f"])
        logits = gemm(q, hf, w["head"])
        loss, lse_v = clops.cross_entropy(q, logits, targets)
        g = {}
        dlogits = clops.cross_entropy_bwd(q, logits, targets, lse_v, self.dloss, dlogits=logits)
        g["head"] = gemm(q, hf, dlogits, trans_a=True)
        dhf = gemm(q, dlogits, w["head"], trans_b=True)
        dx = clops.rms_norm_bwd(q, x, w["norm_f"], invf, dhf)
        g["norm_f"] = clops.rms_norm_dw(q, x, invf, dhf)
        for i in reversed(range(c.layers)):
            x, h, inv1, qr, kr, qn, qinv, kn, kinv, v3, o, lse, x2, h2, inv2, a, b, s = saved[i]
            g[f"{i}.w2"] = gemm(q, s, dx, trans_a=True)
            ds = gemm(q, dx, w[f"{i}.w2"], trans_b=True)
            da, db = clops.swiglu_bwd(q, a, b, ds)
            g[f"{i}.w1"], g[f"{i}.w3"] = gemm(q, h2, da, trans_a=True), gemm(q, h2, db, trans_a=True)
            dh2 = gemm(q, da, w[f"{i}.w1"], trans_b=True)
            dh2 = gemm(q, db, w[f"{i}.w3"], trans_b=True, beta=1.0, out=dh2)
            g[f"{i}.norm2"] = clops.rms_norm_dw(q, x2, inv2, dh2)
            dx2 = clops.add(q, clops.rms_norm_bwd(q, x2, w[f"{i}.norm2"], inv2, dh2), dx)
            g[f"{i}.wo"] = gemm(q, o.reshape(n, nh * hd), dx2, trans_a=True)
            do = gemm(q, dx2, w[f"{i}.wo"], trans_b=True).reshape(n, nh, hd)
            dqn, dkn, dv = clops.attention_bwd(q, qn, kn, v3, o, lse, do, window=c.seq)
            dq, g[f"{i}.qnorm"] = clops.qk_norm_rope_bwd(q, qr.reshape(n, nh, hd), w[f"{i}.qnorm"], qinv, self.rope, dqn)
            dk, g[f"{i}.knorm"] = clops.qk_norm_rope_bwd(q, kr.reshape(n, nkv, hd), w[f"{i}.knorm"], kinv, self.rope,
                                                         dkn)
            dh = None
            for p, dp in (("wq", dq.reshape(n, nh * hd)), ("wk", dk.reshape(n, nkv * hd)),
                          ("wv", dv.reshape(n, nkv * hd))):
                g[f"{i}.{p}"] = gemm(q, h, dp, trans_a=True)
                dh = gemm(q, dp, w[f"{i}.{p}"], trans_b=True, beta=0.0 if dh is None else 1.0, out=dh)
            g[f"{i}.norm1"] = clops.rms_norm_dw(q, x, inv1, dh)
            dx = clops.add(q, clops.rms_norm_bwd(q, x, w[f"{i}.norm1"], inv1, dh), dx2)
        g["embed"] = clops.embedding_bwd(q, ids, dx, vocab=c.vocab)
        return loss, g

    def step(self, ids, targets):
        """One training step; returns the per-token loss array (on the device)."""
        loss, grads = self.forward_backward(ids, targets)
        self.step_count += 1
        for k, p in self.w.items():
            clops.adamw(self.q, p, grads[k], self.m[k], self.v[k], lr=self.cfg.lr, step=self.step_count,
                        weight_decay=self.cfg.weight_decay)
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
    kernels, in CLBlast and on the host; with ``torch``, the same model in PyTorch eager float32 on
    its GPU. Returns the record."""
    from .profile import Profile

    model = Model(queue, cfg, init_weights(cfg, cfg.seed))
    data = batches(make_text(cfg.tokens * 4, cfg.seed), cfg, cfg.seed)
    for _ in range(2):
        model.step(*next(data))
    queue.finish()
    with Profile(queue) as prof:
        model.step(*next(data))
    blas_ms = sum(r.ms for r in prof.launches if r.template == "CLBlast")
    clops_ms = sum(r.ms for r in prof.launches if r.template != "CLBlast")
    start = time.perf_counter()
    for _ in range(steps):
        model.step(*next(data))
    queue.finish()
    wall = (time.perf_counter() - start) * 1e3 / steps
    rec = {"config": dataclasses.asdict(cfg), "wall_ms": wall, "tokens_per_s": cfg.tokens / wall * 1e3,
           "clops_ms": clops_ms, "clblast_ms": blas_ms, "host_share": max(0.0, 1 - (clops_ms + blas_ms) / wall)}
    out(f"train step d={cfg.d} layers={cfg.layers} T={cfg.seq} batch={cfg.batch} vocab={cfg.vocab}: "
        f"{wall:.2f} ms, {rec['tokens_per_s']:,.0f} tokens/s; clops kernels {clops_ms:.2f} ms "
        f"({clops_ms / wall:.0%}), CLBlast {blas_ms:.2f} ms ({blas_ms / wall:.0%}), host {rec['host_share']:.0%}")
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
