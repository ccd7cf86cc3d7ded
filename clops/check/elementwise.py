"""Parity cases of the elementwise family, at the seed's test sizes (4097 elements, 17 columns)."""
import pyopencl.array as cla

import clops
from clops import reference as ref
from clops.check import case, compare
from clops.reference import rnd

TOL = 1e-6


def _dev(queue, *arrays):
    return [cla.to_device(queue, a) for a in arrays]


@case("elementwise", "swiglu, gate, add (4097)")
def flat(queue, n=4097):
    a, b, dc = rnd(n, 4, 4.0), rnd(n, 5, 2.0), rnd(n, 6, 1.0)
    da_, db_, dc_ = _dev(queue, a, b, dc)
    shape = f"[{n}]"
    rows = [compare("swiglu", shape, c := clops.swiglu(queue, da_, db_), ref.swiglu(a, b), TOL, c.events)]
    ga, gb = clops.swiglu_bwd(queue, da_, db_, dc_)
    wa, wb = ref.swiglu_bwd(a, b, dc)
    rows += [compare("swiglu_bwd da", shape, ga, wa, TOL, ga.events), compare("swiglu_bwd db", shape, gb, wb, TOL)]
    c = clops.sigmoid_gate(queue, da_, db_)
    rows.append(compare("sigmoid_gate", shape, c, ref.sigmoid_gate(a, b), TOL, c.events))
    ga, gb = clops.sigmoid_gate_bwd(queue, da_, db_, dc_)
    wa, wb = ref.sigmoid_gate_bwd(a, b, dc)
    rows += [compare("sigmoid_gate_bwd da", shape, ga, wa, TOL, ga.events), compare("sigmoid_gate_bwd db", shape, gb, wb, TOL)]
    c = clops.add(queue, da_, db_)
    rows.append(compare("add", shape, c, ref.add(a, b), TOL, c.events))
    return rows


@case("elementwise", "row/column forms (241×17, 17×241)")
def rows_cols(queue, rows=17, width=241):
    a, b, dc = rnd((rows, width), 4, 4.0), rnd((rows, width), 5, 2.0), rnd((rows, width), 6, 1.0)
    gate = rnd(width, 8, 0.5) + 0.6
    rw = abs(rnd(rows, 7, 1.0))
    da_, db_, dc_, g_, rw_ = _dev(queue, a, b, dc, gate, rw)
    shape = f"[{rows}, {width}]"
    out = []
    c = clops.swiglu_gated(queue, da_, db_, g_)
    out.append(compare("swiglu_gated", shape, c, ref.swiglu_gated(a, b, gate), TOL, c.events))
    ga, gb = clops.swiglu_gated_bwd(queue, da_, db_, g_, dc_)
    wa, wb = ref.swiglu_gated_bwd(a, b, gate, dc)
    out += [compare("swiglu_gated_bwd da", shape, ga, wa, TOL, ga.events), compare("swiglu_gated_bwd db", shape, gb, wb, TOL)]
    for limit, scale, weight in ((1.5, 0.75, None), (1.5, 0.75, rw), (0.0, 1.0, None)):
        c = clops.swiglu_limit(queue, da_, db_, limit=limit, scale=scale, row_weight=None if weight is None else rw_)
        label = f"swiglu_limit L={limit} s={scale}" + (" rw" if weight is not None else "")
        out.append(compare(label, shape, c, ref.swiglu_limit(a, b, limit=limit, scale=scale, row_weight=weight), TOL, c.events))
    return out
