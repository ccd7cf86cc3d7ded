"""Parity cases of RMSNorm at the seed's test shape (37 rows of 5120), both gain styles."""
import pyopencl.array as cla

import clops
from clops import reference as ref
from clops.check import case, compare
from clops.reference import rnd


@case("norm", "rms_norm, bwd, dw (37×5120)")
def rows(queue, n=37, d=5120):
    x, w, dy = rnd((n, d), 1, 3.0), rnd(d, 2, 0.5), rnd((n, d), 3, 1.0)
    dx_, dw_, ddy = (cla.to_device(queue, a) for a in (x, w, dy))
    shape = f"[{n}, {d}]"
    out = []
    for gemma in (False, True):
        tag = " gemma" if gemma else ""
        y, inv = clops.rms_norm(queue, dx_, dw_, gemma=gemma)
        wy, winv = ref.rms_norm(x, w, gemma=gemma)
        out += [compare("rms_norm" + tag, shape, y, wy, 1e-6, y.events), compare("rms_norm inv" + tag, shape, inv, winv, 1e-6)]
        dx = clops.rms_norm_bwd(queue, dx_, dw_, inv, ddy, gemma=gemma)
        out.append(compare("rms_norm_bwd dx" + tag, shape, dx, ref.rms_norm_bwd(x, w, winv, dy, gemma=gemma), 1e-5, dx.events))
    dw = clops.rms_norm_dw(queue, dx_, inv, ddy)
    out.append(compare("rms_norm_dw", shape, dw, ref.rms_norm_dw(x, winv, dy), 1e-5, dw.events))
    return out


@case("norm", "one-pass backward, add_rms_norm and its backward (37×5120)")
def fused(queue, n=37, d=5120):
    a, b, w, dy, ds = rnd((n, d), 1, 3.0), rnd((n, d), 4, 1.0), rnd(d, 2, 0.5), rnd((n, d), 3, 1.0), rnd((n, d), 5)
    da, db, dw_, ddy, dds = (cla.to_device(queue, t) for t in (a, b, w, dy, ds))
    shape = f"[{n}, {d}]"
    _, inv = clops.rms_norm(queue, da, dw_)
    winv = ref.rms_norm(a, w)[1]
    dx, dw = clops.rms_norm_bwd(queue, da, dw_, inv, ddy, want_dw=True)
    out = [compare("rms_norm_bwd dx (one pass)", shape, dx, ref.rms_norm_bwd(a, w, winv, dy), 1e-5, dx.events),
           compare("rms_norm_bwd dw (one pass)", shape, dw, ref.rms_norm_dw(a, winv, dy), 1e-5)]
    s, y, sinv = clops.add_rms_norm(queue, da, db, dw_, gemma=True)
    ws, wy, wsinv = ref.add_rms_norm(a, b, w, gemma=True)
    out += [compare("add_rms_norm s", shape, s, ws, 1e-6, s.events), compare("add_rms_norm y", shape, y, wy, 1e-6),
            compare("add_rms_norm inv", shape, sinv, wsinv, 1e-6)]
    gx, gw = clops.add_rms_norm_bwd(queue, s, dw_, sinv, ddy, dds, gemma=True)
    wx, ww = ref.add_rms_norm_bwd(s.get(), w, sinv.get(), dy, ds, gemma=True)
    return out + [compare("add_rms_norm_bwd dx", shape, gx, wx, 1e-5, gx.events),
                  compare("add_rms_norm_bwd dw", shape, gw, ww, 1e-5)]
