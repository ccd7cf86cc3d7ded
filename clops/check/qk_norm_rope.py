"""Parity cases of the per-head q/k RMSNorm + partial RoPE at the seed's test shape:
window 19, 2 windows, 3 heads, hd 256, half 32, gemma gain."""
import pyopencl.array as cla

import clops
from clops import reference as ref
from clops.check import case, compare
from clops.reference import rnd


@case("qk_norm_rope", "qk_norm_rope, bwd (2×19, 3 heads, hd 256, half 32)")
def heads(queue, window=19, windows=2, nh=3, hd=256, half=32):
    n = windows * window
    x, w, dy = rnd((n, nh, hd), 7, 2.0), rnd(hd, 8, 0.3), rnd((n, nh, hd), 9, 1.0)
    table = clops.rope_table(window, half)
    dx_, dw_, ddy, drope = (cla.to_device(queue, a) for a in (x, w, dy, table))
    shape = f"[{n}, {nh}, {hd}] half {half}"
    y, inv = clops.qk_norm_rope(queue, dx_, dw_, drope)
    wy, winv = ref.qk_norm_rope(x, w, table)
    dx, dw = clops.qk_norm_rope_bwd(queue, dx_, dw_, inv, drope, ddy)
    wdx, wdw = ref.qk_norm_rope_bwd(x, w, winv, table, dy)
    return [compare("qk_norm_rope", shape, y, wy, 1e-6, y.events), compare("qk_norm_rope inv", shape, inv, winv, 1e-6),
            compare("qk_norm_rope_bwd dx", shape, dx, wdx, 1e-5, dx.events),
            compare("qk_norm_rope_bwd dw", shape, dw, wdw, 1e-5, dw.events)]
