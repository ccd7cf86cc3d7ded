// clops RMSNorm family: forward, backward (dx) and the gain gradient.
//
// Layout: x, y, dy, dx are [n, d] row-major of storage type ST (float, half or
// bf16: loads widen, math is float32, stores round to nearest even); w is [d]
// of storage type WST; inv is [n] float (1/rms of each row); dw is [d] of
// storage type DWST. Arrays are read VW elements at a time at vector indices
// (program.loadv / storev), so VW divides d and every row starts on a vector
// boundary (the host picks VW).
//
// Row kernels (kind "rows"): a work-group of WG work-items handles RPG rows;
// TPR = WG/RPG consecutive work-items share a row, work-item t taking the
// vectors t, t + TPR, ... (CH of them), so each step of a row reads one
// contiguous run. A row's sum is a fixed-order local-memory tree
// (common.group_sum over the row's TPR work-items), so results are
// deterministic. With CACHE the row's vectors stay in registers between the
// sum and the write; rows too wide for that (CH > 32) are read twice.
//
// Gain gradient (kind "dw"), two deterministic stages, no atomics:
//   rms_norm_dw_partial: group (c, b) sums dy·x·inv over rows [b·RB, b·RB+RB)
//     for the WG·VW columns of block c (consecutive work-items, consecutive
//     columns) into partial[b, :];
//   column_sum: one work-item per column adds the partial rows in order and
//     writes (or adds into) dw. clops.qk_norm_rope reuses it.
//
// Parameters: WG work-items per group, VW vector width, RPG rows per group,
// CH vectors per work-item per row, CACHE (CH ≤ 32) rows held in registers,
// RB rows per partial block, IDX the index type (uint when every index fits
// 32 bits, else ulong), ST / WST / DWST the storage types above.
<%page args="kind, wg, vw, idx, st, wst, dwst, rpg=None, ch=None, cache=None, rb=None"/>
<%namespace name="common" file="common.cl.mako"/>
${common.guards()}\
${common.storage(st, wst, dwst)}\
#define WG ${wg}
#define VW ${vw}
typedef ${idx} idx_t;
typedef ${vtype(vw)} vec;

<%!
def lanes_sum(vw, v):
    """The sum of the lanes of vector variable v."""
    return v if vw == 1 else " + ".join("%s.s%x" % (v, l) for l in range(vw))
%>

% if kind == "rows":
<% tpr = wg // rpg %>
#define RPG ${rpg}
#define TPR ${tpr}
#define CH ${ch}

## The prologue of a row kernel: this work-item's row, its place in the row,
## and the row's slice of local scratch for the segmented sum.
<%def name="row_setup()">
    __local float scratch[WG];
    const uint lid = get_local_id(0);
    const uint seg = lid / TPR, t = lid - seg * TPR;
    const idx_t row = (idx_t)get_group_id(0) * RPG + seg;
    const bool ok = row < n;
    const idx_t base = row * dv;
    __local float *row_scratch = scratch + seg * TPR;
</%def>

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void rms_norm_fwd(__global ${vptr(st, vw)} *restrict y, __global float *restrict inv_out,
                  __global const ${vptr(st, vw)} *restrict x, __global const ${vptr(wst, vw)} *restrict w, const idx_t n, const uint dv, const float d, const float eps,
                  const float w_offset${checked_args("y", "inv_out", "x", "w")})
{
    ${row_setup()}
% if cache:
    vec xs[CH];
% endif
    float ss = 0.0f;
    for (uint k = 0; k < CH; ++k) {
        const uint j = t + k * TPR;
        const vec v = (ok && j < dv) ? ${loadv(st, vw, "x", "base + j")} : (vec)(0.0f);
% if cache:
        xs[k] = v;
% endif
        const vec sq = v * v;
        ss += ${lanes_sum(vw, "sq")};
    }
    ${common.group_sum("total", "ss", "row_scratch", "t", tpr)}
    // 1/sqrt, not rsqrt: rsqrt's error bound is too loose for the 1e-6 parity.
    const float inv = 1.0f / sqrt(total / d + eps);
    if (!ok)
        return;
    for (uint k = 0; k < CH; ++k) {
        const uint j = t + k * TPR;
        if (j < dv)
            ${storev(st, vw, "%s * inv * (%s + w_offset)" % ("xs[k]" if cache else loadv(st, vw, "x", "base + j"), loadv(wst, vw, "w", "j")), "y", "base + j")};
    }
    if (t == 0)
        inv_out[${at("inv_out", "row")}] = inv;
}

// dx = inv·w·dy − x·inv³/d·Σ dy·w·x  (written, not accumulated); eps only for d = 1
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void rms_norm_bwd(__global ${vptr(st, vw)} *restrict dx, __global const ${vptr(st, vw)} *restrict x,
                  __global const ${vptr(wst, vw)} *restrict w, __global const float *restrict inv,
                  __global const ${vptr(st, vw)} *restrict dy, const idx_t n,
                  const uint dv, const float d, const float eps, const float w_offset${checked_args("dx", "x", "w", "inv", "dy")})
{
    ${row_setup()}
% if cache:
    vec xs[CH], gs[CH];
% endif
    float s = 0.0f;
    for (uint k = 0; k < CH; ++k) {
        const uint j = t + k * TPR;
        const bool live = ok && j < dv;
        const vec xv = live ? ${loadv(st, vw, "x", "base + j")} : (vec)(0.0f);
        const vec gv = live ? ${loadv(st, vw, "dy", "base + j")} * (${loadv(wst, vw, "w", "j")} + w_offset) : (vec)(0.0f);
% if cache:
        xs[k] = xv;
        gs[k] = gv;
% endif
        const vec p = gv * xv;
        s += ${lanes_sum(vw, "p")};
    }
    ${common.group_sum("total", "s", "row_scratch", "t", tpr)}
    if (!ok)
        return;
    const float iv = inv[${at("inv", "row")}];
% if vw == 1:
    if (dv == 1) {
        // One column: inv·g·(1 − x²·inv²) cancels catastrophically in float; 1 − x²·inv² is eps·inv².
        if (t == 0)
            ${storev(st, 1, "iv * (%s * (%s + w_offset)) * (eps * iv * iv)" % (loadv(st, 1, "dy", "base"), loadv(wst, 1, "w", "0")), "dx", "base")};
        return;
    }
% endif
    const float coef = total / d * iv * iv * iv;
    for (uint k = 0; k < CH; ++k) {
        const uint j = t + k * TPR;
        if (j < dv)
% if cache:
            ${storev(st, vw, "iv * gs[k] - xs[k] * coef", "dx", "base + j")};
% else:
            ${storev(st, vw, "iv * (%s * (%s + w_offset)) - %s * coef" % (loadv(st, vw, "dy", "base + j"), loadv(wst, vw, "w", "j"), loadv(st, vw, "x", "base + j")), "dx", "base + j")};
% endif
    }
}

% elif kind == "dw":
#define RB ${rb}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void rms_norm_dw_partial(__global vec *restrict partial, __global const ${vptr(st, vw)} *restrict x,
                         __global const float *restrict inv, __global const ${vptr(st, vw)} *restrict dy, const idx_t n,
                         const uint dv${checked_args("partial", "x", "inv", "dy")})
{
    const uint j = get_group_id(0) * WG + get_local_id(0);
    if (j >= dv)
        return;
    const idx_t r0 = (idx_t)get_group_id(1) * RB;
    const idx_t r1 = min(n, r0 + RB);
    vec acc = (vec)(0.0f);
    for (idx_t r = r0; r < r1; ++r)
        acc += ${loadv(st, vw, "dy", "r * dv + j")} * ${loadv(st, vw, "x", "r * dv + j")} * inv[${at("inv", "r")}];
    partial[${at("partial", "(idx_t)get_group_id(1) * dv + j")}] = acc;
}

// dw[c] (+)= Σ_b partial[b, c], b in order: the same bits on every run; added to a
// given dw in float, then rounded once to its storage type.
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void column_sum(__global ${vptr(dwst, 1)} *restrict dw, __global const float *restrict partial, const uint rows,
                const uint cols, const int accumulate${checked_args("dw", "partial")})
{
    const uint c = get_group_id(0) * WG + get_local_id(0);
    if (c >= cols)
        return;
    float s = 0.0f;
    for (uint b = 0; b < rows; ++b)
        s += partial[${at("partial", "(idx_t)b * cols + c")}];
    ${storev(dwst, 1, "accumulate ? %s + s : s" % loadv(dwst, 1, "dw", "c"), "dw", "c")};
}
% endif
