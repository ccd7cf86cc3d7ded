// clops cross-entropy family: per-row loss and log-sum-exp of logits, and the
// logits' gradient.
//
// Layout: logits, dlogits [rows, vocab] row-major, of storage type ST (float,
// half or bf16: loads widen, the gradient's store rounds to nearest even; math is
// float32); targets int32 [rows]; loss, lse, dloss float32 [rows]. One
// work-group of WG work-items per row; work-item t reads the columns t, t + WG,
// ... (each step of the group reads one contiguous run), keeping a running
// max m and a sum s of exp(z − m) (an online softmax: one pass over the row,
// one exp per element). The group combines the work-items' (m, s) and their
// sums of z in a fixed-order local-memory tree, so results are deterministic.
//
// z is the logit, or cap·tanh(logit/cap) with CAP (softcap). With label
// smoothing e (torch.nn.functional.cross_entropy's definition):
//   loss = (1 − e)·(lse − z[t]) + e·(lse − Σ z / vocab);
// 0 where the target is ignore_index, NaN where it is outside [0, vocab).
// The gradient, dloss·(softmax(z) − (1 − e)·[j = t] − e/vocab)·dz/dlogit, is 0 on
// those rows. The backward reads each logit before it writes its gradient, so
// dlogits may be logits (in place).
//
// Parameters: WG work-items per row, CAP whether a softcap is applied, IDX the
// index type (uint when every index fits 32 bits, else ulong), ST the logits'
// storage type.
<%namespace name="common" file="common.cl.mako"/>\
#define WG ${wg}
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

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void cross_entropy_fwd(__global float *restrict loss, __global float *restrict lse_out,
                       __global const ${ctype(st)} *restrict logits, __global const int *restrict targets,
                       const uint vocab, const int ignore_index, const float smoothing,
                       const float cap${checked_args("loss", "lse_out", "logits", "targets")})
{
    __local float lm[WG], ls[WG], lz[WG];
    const uint lid = get_local_id(0);
    const idx_t row = get_group_id(0), base = row * vocab;
    float m = -INFINITY, s = 0.0f, zsum = 0.0f;
    for (uint j = lid; j < vocab; j += WG) {
        const float z = ${capped(load(st, 1, "logits", at("logits", "base + j")))};
        if (z > m) {
            s = s * exp(m - z) + 1.0f;
            m = z;
        } else {
            s += exp(z - m);  // z = −inf adds 0; NaN makes s NaN, as it should
        }
        zsum += z;
    }
    lm[lid] = m;
    ls[lid] = s;
    lz[lid] = zsum;
    barrier(CLK_LOCAL_MEM_FENCE);
% for h in [2**i for i in range(20, -1, -1) if 2**i < wg]:
    if (lid < ${h} && lid + ${h} < WG) {
        const float m1 = lm[lid], m2 = lm[lid + ${h}], mx = fmax(m1, m2);
        // two empty halves (m = −inf) stay empty instead of making NaN from −inf − −inf
        ls[lid] = mx == -INFINITY ? 0.0f : ls[lid] * exp(m1 - mx) + ls[lid + ${h}] * exp(m2 - mx);
        lm[lid] = mx;
        lz[lid] += lz[lid + ${h}];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
% endfor
    if (lid == 0) {
        const float lse = lm[0] + log(ls[0]);
        lse_out[${at("lse_out", "row")}] = lse;
        const int t = targets[${at("targets", "row")}];
        float l;
        if (t == ignore_index)
            l = 0.0f;
        else if (t < 0 || (uint)t >= vocab)
            l = NAN;
        else
            l = (1.0f - smoothing) * (lse - ${capped(load(st, 1, "logits", at("logits", "base + (uint)t")))})
                + smoothing * (lse - lz[0] / (float)vocab);
        loss[${at("loss", "row")}] = l;
    }
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void cross_entropy_bwd(__global ${ctype(st)} *dlogits, __global const ${ctype(st)} *logits, __global const int *restrict targets,
                       __global const float *restrict lse, __global const float *restrict dloss,
                       const uint vocab, const int ignore_index, const float smoothing,
                       const float cap${checked_args("dlogits", "logits", "targets", "lse", "dloss")})
{
    // dlogits and logits may be the same buffer: no restrict on them, each element read before written
    const uint lid = get_local_id(0);
    const idx_t row = get_group_id(0), base = row * vocab;
    const int t = targets[${at("targets", "row")}];
    const bool valid = t != ignore_index && t >= 0 && (uint)t < vocab;
    const float g = valid ? dloss[${at("dloss", "row")}] : 0.0f, l = lse[${at("lse", "row")}];
    const float uniform = smoothing / (float)vocab;
    for (uint j = lid; j < vocab; j += WG) {
        const float x = ${load(st, 1, "logits", at("logits", "base + j"))};
        const float z = ${capped("x")};
        float d = exp(z - l) - uniform - ((int)j == t ? 1.0f - smoothing : 0.0f);
% if cap:
        d *= 1.0f - (z / cap) * (z / cap);  // d(cap·tanh(x/cap))/dx
% endif
        ${store(st, 1, "valid ? g * d : 0.0f", "dlogits", at("dlogits", "base + j"))};
    }
}
