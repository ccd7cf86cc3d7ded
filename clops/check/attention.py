"""Parity cases of the attention family at the seed's shape (2 windows × 37, nh 6, nkv 2, hd 256)."""
import pyopencl.array as cla

import clops
from clops import reference as ref
from clops.check import case, compare
from clops.reference import rnd

O_TOL, LSE_TOL = 1e-5, 1e-6
WINDOWS, WINDOW, NH, NKV, HD = 2, 37, 6, 2, 256
SHAPE = f"{WINDOWS}×{WINDOW} nh{NH} nkv{NKV} hd{HD}"


def inputs(queue):
    """(host arrays, device arrays) of q, k, v, do at the seed's shape and seeds."""
    n = WINDOWS * WINDOW
    host = [rnd((n, NH, HD), 11), rnd((n, NKV, HD), 12), rnd((n, NKV, HD), 13), rnd((n, NH, HD), 14)]
    return host, [cla.to_device(queue, a) for a in host]


@case("attention", "forward (seed shape)")
def forward(queue):
    (q, k, v, _), (dq, dk, dv, _) = inputs(queue)
    o, lse = clops.attention(queue, dq, dk, dv, window=WINDOW)
    want_o, want_lse = ref.attention(q, k, v, window=WINDOW)
    return [compare("attention o", SHAPE, o, want_o, O_TOL, o.events),
            compare("attention lse", SHAPE, lse, want_lse, LSE_TOL)]


def _backward(queue, store_ds, how):
    # The device pipeline (forward, then backward on its o and lse) against the float64 reference.
    (q, k, v, do), (q_, k_, v_, do_) = inputs(queue)
    o, lse = clops.attention(queue, q_, k_, v_, window=WINDOW)
    gq, gk, gv = clops.attention_bwd(queue, q_, k_, v_, o, lse, do_, window=WINDOW, store_ds=store_ds)
    want_o, want_lse = ref.attention(q, k, v, window=WINDOW)
    wq, wk, wv = ref.attention_bwd(q, k, v, want_o, want_lse, do, window=WINDOW)
    return [compare(f"attention_bwd dq ({how})", SHAPE, gq, wq, O_TOL, gq.events),
            compare(f"attention_bwd dk ({how})", SHAPE, gk, wk, O_TOL, gk.events),
            compare(f"attention_bwd dv ({how})", SHAPE, gv, wv, O_TOL)]


@case("attention", "backward, dS stored (seed shape)")
def backward_stored(queue):
    return _backward(queue, True, "dS stored")


@case("attention", "backward, dS recomputed (seed shape)")
def backward_recomputed(queue):
    return _backward(queue, False, "dS recomputed")
