// clops elementwise family: SwiGLU and its clamped / row-weighted / column-gated
// forms, the sigmoid output gate, add.
//
// Layout: flat arrays of n elements of storage type ST (float, half or bf16;
// math is float32, loads widen, stores round to nearest even); row/column ops see them as
// [n / width, width] row-major. Work item g of group b handles EPT vectors of
// VW floats at (b·WG·EPT + g)·VW + k·WG·VW, k < EPT, so each of the EPT
// steps of a group reads one contiguous run of WG·VW floats. A vector that
// would cross n is done element by element (the tail).
//
// Parameters: WG work-items per group, VW vector width, EPT vectors per work
// item, IDX the index type (uint when every index fits 32 bits, else ulong), ST
// the activations' storage type, GST that of the gathered gate / row weight,
// ROW_ALIGNED whether the row width is a multiple of VW (0 for the flat ops).
<%namespace name="common" file="common.cl.mako"/>\
#define WG ${wg}
#define VW ${vw}
#define EPT ${ept}
typedef ${idx} idx_t;
${common.guards()}\
${common.storage(st, gst)}\

## One kernel: `outs` written, `ins` read with the same index, `gathers`
## (name, "row" or "col") read per element at its row or column of the
## [n / width, width] view, `body(T)` the math on values of type T (float or
## floatN). A work-item finds the row and column of its first vector with one
## division and steps them with i (per vector or per lane, divisions made 16-bit
## storage compute-bound). With ROW_ALIGNED (width a multiple of VW) a vector lies
## in one row: a row gather is one scalar for the vector and a column gather one
## aligned vector; else each lane steps the column from the first lane's.
<%def name="kernel(name, outs, ins, body, gathers=(), scalars=())">
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void ${name}(${", ".join(["__global %s *restrict %s_out" % (ctype(st), o) for o in outs] + ["__global const %s *restrict %s_in" % (ctype(st), i) for i in ins] + ["__global const %s *restrict %s_src" % (ctype(gst), g) for g, _ in gathers] + ["const idx_t n"] + list(scalars))}${checked_args(*["%s_out" % o for o in outs], *["%s_in" % i for i in ins], *["%s_src" % g for g, _ in gathers])})
{
    const idx_t first = ((idx_t)get_group_id(0) * (WG * EPT) + (idx_t)get_local_id(0)) * VW;
% if gathers:
    idx_t row = first / width, col = first - row * width;  // of element i, stepped with it
%   if ept > 1:
    const idx_t step_rows = (idx_t)(WG * VW) / width, step_cols = (idx_t)(WG * VW) - step_rows * width;
%   endif
% endif
    for (int k = 0; k < EPT; ++k) {
        const idx_t i = first + (idx_t)k * (WG * VW);
        if (i + VW <= n) {
% for x in ins:
            ${vtype(vw)} ${x} = ${load(st, vw, x + "_in", at(x + "_in", "i", vw), aligned=True)};
% endfor
% for g, kind in gathers:
%   if vw == 1 or (row_aligned and kind == "row"):
            const float ${g} = ${load(gst, 1, g + "_src", at(g + "_src", kind))};
%   elif row_aligned:
            const ${vtype(vw)} ${g} = ${load(gst, vw, g + "_src", at(g + "_src", "col", vw), aligned=True)};
%   else:
            ${vtype(vw)} ${g};
            {
                idx_t r = row, c = col;
%     for l in range(vw):
%       if l:
                if (++c == width) {  // the vector crosses into the next row
                    c = 0;
                    ++r;
                }
%       endif
                ${g}.s${"%x" % l} = ${load(gst, 1, g + "_src", at(g + "_src", "r" if kind == "row" else "c"))};
%     endfor
            }
%   endif
% endfor
% for o in outs:
            ${vtype(vw)} ${o};
% endfor
            ${body(vtype(vw))}
% for o in outs:
            ${store(st, vw, o, o + "_out", at(o + "_out", "i", vw), aligned=True)};
% endfor
        } else {
            for (idx_t j = i; j < n; ++j) {
% for x in ins:
                float ${x} = ${load(st, 1, x + "_in", at(x + "_in", "j"))};
% endfor
% for g, kind in gathers:
                float ${g} = ${load(gst, 1, g + "_src", at(g + "_src", "j / width" if kind == "row" else "j % width"))};
% endfor
% for o in outs:
                float ${o};
% endfor
                ${body("float")}
% for o in outs:
                ${store(st, 1, o, o + "_out", at(o + "_out", "j"))};
% endfor
            }
        }
% if gathers and ept > 1:
        col += step_cols;
        row += step_rows;
        if (col >= width) {
            col -= width;
            ++row;
        }
% endif
    }
}
</%def>

<%def name="swiglu(T)">c = a / (1.0f + exp(-a)) * b;</%def>
## σ(−x) as 1/(1 + exp(x)), not 1 − σ(x): that cancels to 0 once σ(x) rounds to 1 (x ≳ 17).
<%def name="swiglu_grad(T)">
    const ${T} s = 1.0f / (1.0f + exp(-a));
    da = dc * b * s * (1.0f + a / (1.0f + exp(a)));
    db = dc * a * s;
</%def>
<%def name="swiglu_limit(T)">
    if (limit > 0.0f) {
        a = min(a, limit);
        b = clamp(b, -limit, limit);
    }
    c = scale * (a / (1.0f + exp(-a)) * b);
</%def>
<%def name="swiglu_limit_rows(T)">
    ${swiglu_limit(T)}
    c *= rw;
</%def>
<%def name="swiglu_gated(T)">c = a / (1.0f + exp(-a)) * b * gate;</%def>
<%def name="swiglu_gated_grad(T)">
    dc *= gate;
    ${swiglu_grad(T)}
</%def>
<%def name="sigmoid_gate(T)">c = a / (1.0f + exp(-b));</%def>
<%def name="sigmoid_gate_grad(T)">
    const ${T} s = 1.0f / (1.0f + exp(-b));
    da = dc * s;
    db = dc * a * s / (1.0f + exp(b));
</%def>
<%def name="add(T)">c = a + b;</%def>

${kernel("swiglu_fwd", ["c"], ["a", "b"], swiglu)}
${kernel("swiglu_bwd", ["da", "db"], ["a", "b", "dc"], swiglu_grad)}
${kernel("swiglu_limit_fwd", ["c"], ["a", "b"], swiglu_limit, scalars=["const float limit", "const float scale"])}
${kernel("swiglu_limit_rows_fwd", ["c"], ["a", "b"], swiglu_limit_rows, gathers=[("rw", "row")], scalars=["const float limit", "const float scale", "const idx_t width"])}
${kernel("swiglu_gated_fwd", ["c"], ["a", "b"], swiglu_gated, gathers=[("gate", "col")], scalars=["const idx_t width"])}
${kernel("swiglu_gated_bwd", ["da", "db"], ["a", "b", "dc"], swiglu_gated_grad, gathers=[("gate", "col")], scalars=["const idx_t width"])}
${kernel("sigmoid_gate_fwd", ["c"], ["a", "b"], sigmoid_gate)}
${kernel("sigmoid_gate_bwd", ["da", "db"], ["a", "b", "dc"], sigmoid_gate_grad)}
${kernel("add", ["c"], ["a", "b"], add)}
