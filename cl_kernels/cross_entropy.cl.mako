// clops cross-entropy family: per-row loss and log-sum-exp of logits, and the
// logits' gradient.
//
// Layout: logits, dlogits [rows, vocab] row-major, of storage type ST (float,
// half or bf16: loads widen, the gradient's store rounds to nearest even; math is
// float32); targets int32 [rows]; loss, lse, dloss float32 [rows]. A row is
// moved in vectors of VW elements (16 bytes: 4 floats or 8 16-bit values)
// aligned to their size, from its first element at such a boundary (row·vocab
// is on none when vocab is odd); the elements before it and after the last
// whole vector, the row's edge (fewer than 2·VW), go one per work-item.
//
// Forward (KIND "fwd"): one work-group of WG work-items per row. Work-item t
// takes the row's vectors t, t + WG, ..., UNROLL of them per step (each a
// contiguous run of the group), all loaded before their arithmetic. It keeps a
// running max m and a sum s of exp(z − m) (an online softmax: one pass over the
// row): per step the max of its values first, s rescaled once if m grew, then
// one exp per element. The group combines the work-items' (m, s) and their sums
// of z in a fixed-order local-memory tree, so results are deterministic. A logit
// of −∞ adds 0 (a row of them has lse −∞), +∞ makes lse +∞, NaN makes it NaN:
// while m is ±∞ the exps are taken against 0 (−∞ − −∞ would be NaN).
//
// Backward (KIND "bwd"): elementwise given lse, so no pass over a whole row:
// CHUNKS work-groups per row (a kernel argument, ⌈(vocab / VW) / (WG·EPT)⌉),
// group c of the row takes its vectors from c·WG·EPT, work-item t the vectors
// c·WG·EPT + t + u·WG (u < EPT: each u a contiguous run of the group), all EPT
// loaded before any gradient is stored; the edge's elements spread over the
// row's groups. Every element is read before it is written, by the same
// work-item, so dlogits may be logits (in place).
//
// z is the logit, or cap·tanh(logit/cap) with CAP (softcap). With label
// smoothing e (torch.nn.functional.cross_entropy's definition):
//   loss = (1 − e)·(lse − z[t]) + e·(lse − Σ z / vocab)
// (the second term only with SMOOTH, e > 0: else z = −∞ would make it 0·∞);
// 0 where the target is ignore_index, NaN where it is outside [0, vocab).
// The gradient, dloss·(softmax(z) − (1 − e)·[j = t] − e/vocab)·dz/dlogit, is 0 on
// those rows; softmax(z) = exp2((z − lse)·log2(e)).
//
// Parameters: KIND, WG work-items per group, UNROLL (forward) vectors per
// work-item per step, EPT (backward) vectors per work-item, CAP whether a
// softcap is applied, SMOOTH whether there is label smoothing, IDX the index
// type (uint when every index fits 32 bits, else ulong), ST the logits' storage
// type (VW follows from it).
<%page args="kind, wg, idx, st, cap, smooth, unroll=None, ept=None"/>\
<%namespace name="common" file="common.cl.mako"/>\
<%!
    def fold(op, terms):
        """The terms combined pairwise (a fixed tree) with op: "+" or a function of two arguments."""
        while len(terms) > 1:
            pairs = [(terms[i], terms[i + 1]) for i in range(0, len(terms) - 1, 2)]
            terms = [f"({a} + {b})" if op == "+" else f"{op}({a}, {b})" for a, b in pairs] + terms[len(pairs) * 2:]
        return terms[0]

    def lanes(names, n):
        """Every lane of each named value of n lanes (a scalar for n = 1)."""
        return [x if n == 1 else f"{x}.s{l:x}" for x in names for l in range(n)]
%>\
<% vw = 4 if st == "float" else 8 %>\
#define WG ${wg}
#define VW ${vw}
% if kind == "fwd":
#define UNROLL ${unroll}
% else:
#define EPT ${ept}
% endif
typedef ${idx} idx_t;
${common.guards()}\
${common.storage(st)}\

<%def name="capped(z)">\
% if cap:
(cap * tanh((${z}) / cap))\
% else:
(${z})\
% endif
</%def>

## The geometry of row `row`: `base` its first element, `head` elements before the first aligned one,
## `nv` whole vectors from `body`, `edge` = head + the tail's elements.
<%def name="row_split(row)">
    const idx_t row = ${row}, base = row * vocab;
    const uint head = min((uint)((VW - base % VW) % VW), vocab), nv = (vocab - head) / VW, edge = vocab - nv * VW;
    const idx_t body = base + head;
</%def>

## The row's edge elements e = first, first + stride, ...: `each(values, 1)` on each, a value
## (name, column, element index) as over_row's.
<%def name="over_edge(each, first, stride)">
    for (uint e = ${first}; e < edge; e += ${stride}) {
        const uint j = e < head ? e : e + nv * VW;
        const float x = ${load(st, 1, "logits", at("logits", "base + j"))};
        ${each([("x", "j", "base + j")], 1)}
    }
</%def>

% if kind == "fwd":
## The row's elements: `each(values, n)` called on values of n lanes (the edge's one by one, then
## the vectors, UNROLL at a time, all loaded first), each value (name, column of its first lane,
## its element index).
<%def name="over_row(each)">
    ${over_edge(each, "lid", "WG")}
    uint q = lid;  // vector index in the row
% for step in ([unroll] if unroll > 1 else []) + [1]:
<%
    vec = ["q"] + ["(q + %d * WG)" % u for u in range(1, step)]  # the step's vector indices
    vals = [("x%d" % u, "head + %s * VW" % v, "body + (idx_t)%s * VW" % v) for u, v in enumerate(vec)]
%>\
    for (; ${vec[-1]} < nv; q += ${step} * WG) {
%   for x, _, i in vals:
        const ${vtype(vw)} ${x} = ${load(st, vw, "logits", at("logits", i, vw), aligned=True)};
%   endfor
        ${each(vals, vw)}
    }
% endfor
</%def>

## Forward: the values' z into the running (m, s) and zsum.
<%def name="absorb(vals, n)">
%   for x, _, _ in vals:
        const ${vtype(n)} z${x} = ${capped(x)};
%   endfor
        const float top = ${fold("fmax", lanes(["z" + x for x, _, _ in vals], n))};
        if (top > m) {
            s *= exp(m - top);
            m = top;
        }
        const float ref = isinf(m) ? 0.0f : m;
%   for x, _, _ in vals:
        const ${vtype(n)} e${x} = exp(z${x} - ref);
%   endfor
        s += ${fold("+", lanes(["e" + x for x, _, _ in vals], n))};
% if smooth:
        zsum += ${fold("+", lanes(["z" + x for x, _, _ in vals], n))};
% endif
</%def>

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void cross_entropy_fwd(__global float *restrict loss, __global float *restrict lse_out,
                       __global const ${ctype(st)} *restrict logits, __global const int *restrict targets,
                       const uint vocab, const int ignore_index, const float smoothing,
                       const float cap${checked_args("loss", "lse_out", "logits", "targets")})
{
    __local float lm[WG], ls[WG], lz[WG];
    const uint lid = get_local_id(0);
    ${row_split("get_group_id(0)")}
    const int t = targets[${at("targets", "row")}];
    const bool in_row = t != ignore_index && t >= 0 && (uint)t < vocab;
    // the target's z for the loss, read before the row (its latency hidden behind it)
    const float zt = lid == 0 && in_row ? ${capped(load(st, 1, "logits", at("logits", "base + (uint)t")))} : 0.0f;
    float m = -INFINITY, s = 0.0f, zsum = 0.0f;
    ${over_row(absorb)}
    lm[lid] = m;
    ls[lid] = s;
    lz[lid] = zsum;
    barrier(CLK_LOCAL_MEM_FENCE);
% for h in [2**i for i in range(20, -1, -1) if 2**i < wg]:
    if (lid < ${h} && lid + ${h} < WG) {
        const float m1 = lm[lid], m2 = lm[lid + ${h}], mx = fmax(m1, m2), ref = isinf(mx) ? 0.0f : mx;
        ls[lid] = ls[lid] * exp(m1 - ref) + ls[lid + ${h}] * exp(m2 - ref);
        lm[lid] = mx;
        lz[lid] += lz[lid + ${h}];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
% endfor
    if (lid == 0) {
        const float lse = lm[0] + log(ls[0]);
        lse_out[${at("lse_out", "row")}] = lse;
        float l;
        if (t == ignore_index)
            l = 0.0f;
        else if (!in_row)
            l = NAN;
        else
            l = (1.0f - smoothing) * (lse - zt)${"\n                + smoothing * (lse - lz[0] / (float)vocab)" if smooth else ""};
        loss[${at("loss", "row")}] = l;
    }
}
% else:
## Backward: each value's gradient, stored in place of it.
<%def name="gradient(vals, n)">
%   for x, col, i in vals:
    {
%     if cap:
        const ${vtype(n)} th = tanh(${x} / cap), z = cap * th;
%     else:
        const ${vtype(n)} z = ${x};
%     endif
        ${vtype(n)} d = exp2((z - l) * M_LOG2E_F)${" - uniform" if smooth else ""};
        const uint off = (uint)t - (${col});  // the target's lane in this value, if below its lanes
%     if n == 1:
        if (off == 0)
            d -= hit;
%     else:
        if (off < ${n})
            d -= select((${vtype(n)})0.0f, (${vtype(n)})hit, (int${n})(${", ".join(str(l) for l in range(n))}) == (int${n})off);
%     endif
%     if cap:
        d *= 1.0f - th * th;  // d(cap·tanh(x/cap))/dx
%     endif
        ${store(st, n, "valid ? g * d : (%s)0.0f" % vtype(n), "dlogits", at("dlogits", i, n), aligned=True)};
    }
%   endfor
</%def>

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void cross_entropy_bwd(__global ${ctype(st)} *dlogits, __global const ${ctype(st)} *logits, __global const int *restrict targets,
                       __global const float *restrict lse, __global const float *restrict dloss,
                       const uint vocab, const uint chunks, const int ignore_index, const float smoothing,
                       const float cap${checked_args("dlogits", "logits", "targets", "lse", "dloss")})
{
    // dlogits and logits may be the same buffer: no restrict on them, each element read before written
    const uint lid = get_local_id(0), group = get_group_id(0), c = group % chunks;
    ${row_split("group / chunks")}
    const int t = targets[${at("targets", "row")}];
    const bool valid = t != ignore_index && t >= 0 && (uint)t < vocab;
    const float g = valid ? dloss[${at("dloss", "row")}] : 0.0f, l = lse[${at("lse", "row")}];
    const float hit = 1.0f - smoothing${", uniform = smoothing / (float)vocab" if smooth else ""};
    const uint q = c * (WG * EPT) + lid;  // the first of this work-item's vectors in the row
% for u in range(ept):
    const ${vtype(vw)} x${u} = q + ${u} * WG < nv ? ${load(st, vw, "logits", at("logits", "body + (idx_t)(q + %d * WG) * VW" % u, vw), aligned=True)} : (${vtype(vw)})0.0f;
% endfor
% for u in range(ept):
    if (q + ${u} * WG < nv)
        ${gradient([("x%d" % u, "head + (q + %d * WG) * VW" % u, "body + (idx_t)(q + %d * WG) * VW" % u)], vw)}
% endfor
    ${over_edge(gradient, "c * WG + lid", "chunks * WG")}
}
% endif
