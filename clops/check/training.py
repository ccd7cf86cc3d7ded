"""Parity cases of the training ops: cross-entropy at GPT-2's vocab, embedding, AdamW."""
import numpy as np
import pyopencl.array as cla

import clops
from clops import reference as ref
from clops.check import case, compare
from clops.reference import rnd


@case("training", "cross_entropy, label smoothing 0.1 (8 × 50257)")
def cross_entropy(queue, n=8, vocab=50257):
    x, dloss = rnd((n, vocab), 1, 8.0), rnd(n, 2)
    t = np.random.default_rng(3).integers(0, vocab, n).astype(np.int32)
    t[2] = -100
    x_, dl_ = cla.to_device(queue, x), cla.to_device(queue, dloss)
    shape = f"[{n}, {vocab}]"
    loss, lse = clops.cross_entropy(queue, x_, t, label_smoothing=0.1)
    want_loss, want_lse = ref.cross_entropy(x, t, label_smoothing=0.1)
    grad = clops.cross_entropy_bwd(queue, x_, t, lse, dl_, label_smoothing=0.1)
    return [compare("cross_entropy loss", shape, loss, want_loss, 1e-6, loss.events),
            compare("cross_entropy lse", shape, lse, want_lse, 1e-6),
            compare("cross_entropy_bwd", shape, grad, ref.cross_entropy_bwd(x, t, lse.get(), dloss, label_smoothing=0.1),
                    1e-5, grad.events)]


@case("training", "embedding and its gradient (300 ids of 1000 × 64)")
def embedding(queue, n=300, vocab=1000, d=64):
    table, dout = rnd((vocab, d), 4), rnd((n, d), 5)
    ids = np.random.default_rng(6).integers(0, vocab, n).astype(np.int32)
    t_, d_ = cla.to_device(queue, table), cla.to_device(queue, dout)
    out = clops.embedding(queue, t_, ids)
    grad = clops.embedding_bwd(queue, ids, d_, vocab=vocab)
    return [compare("embedding", f"[{n}] of [{vocab}, {d}]", out, ref.embedding(table, ids), 0.0, out.events),
            compare("embedding_bwd", f"[{n}, {d}]", grad, ref.embedding_bwd(ids, dout, vocab), 1e-6, grad.events)]


@case("training", "adamw, step 3 (4099)")
def adamw(queue, n=4099):
    p, g, m, v = rnd(n, 7), rnd(n, 8), rnd(n, 9, 0.1), abs(rnd(n, 10, 0.1))
    dev = [cla.to_device(queue, a) for a in (p, g, m, v)]
    kw = dict(lr=1e-2, step=3, weight_decay=0.1)
    got = clops.adamw(queue, *dev, **kw)
    return [compare(f"adamw {name}", f"[{n}]", a, want, 1e-6, a.events)
            for name, a, want in zip("pmv", got, ref.adamw(p, g, m, v, **kw))]
