// clops per-head q/k RMSNorm with partial RoPE: forward and backward (dx and
// the gain gradient's partial sums).
//
// Layout: x, y, dy, dx are [n, heads, HD] row-major of storage type ST (float,
// half or bf16: loads widen, math is float32, stores round to nearest even):
// n·heads units of HD values; w is [HD] of storage type WST; inv is
// [n, heads] float; rope is [window, HALF] float2 (cos, sin). Unit u is token
// row u / heads at position (u / heads) % window.
// Half-split RoPE: dims (i, i + HALF), i < HALF, rotate; dims ≥ 2·HALF pass.
//
// A work-group of WG work-items handles UPG units at a time; TPU = WG/UPG
// consecutive work-items share a unit, work-item t owning the vectors t,
// t + TPU, ... (CH of them) of its unit. The unit's sum of squares is a
// fixed-order tree (common.group_sum over its TPU work-items). The rotation
// pairs dims that other work-items own, so the unit's vectors go through
// local memory (buf) once.
//
// Backward: group b handles units [b·RB, b·RB + RB), UPG at a time; each
// work-item accumulates g·x·inv over its units for the dims it owns, the UPG
// segments are then added in segment order into partial[b, :]. The column sum
// over the partial rows (clops.norm.column_sum) finishes dw: deterministic,
// no atomics.
//
// Parameters: HD head dim, HALF rotary half (0: no rotation, no rope
// argument), WG work-items per group, VW vector width (divides HD), UPG units
// per step, CH vectors per work-item per unit, RB units per backward group,
// IDX the index type, ST / WST the storage types above.
<%page args="hd, half, wg, vw, upg, ch, rb, idx, st, wst, varlen=0"/>
## varlen (a render flag, with HALF only; 0 renders the kernels above as they
## were): the kernels take cu, nseq + 1 int offsets of the sequences, after rope
## and nseq in place of window; unit u's position is the offset of its row in
## its sequence, cu[s] ≤ row < cu[s + 1], s found by a binary search over cu
## (the last sequence starting at or before the row, so empty ones are passed
## over). Nothing is read back to the host for it.
<%namespace name="common" file="common.cl.mako"/>
<% tpu = wg // upg %>
${common.guards()}\
${common.storage(st, wst)}\
#define HD ${hd}
#define HALF ${half}
#define HV (HD / ${vw})
#define WG ${wg}
#define VW ${vw}
#define UPG ${upg}
#define TPU ${tpu}
#define CH ${ch}
#define RB ${rb}
typedef ${idx} idx_t;
typedef ${vtype(vw)} vec;

<%!
def lane(vw, v, l):
    """Lane l of vector variable v as an lvalue."""
    return v if vw == 1 else "%s.s%x" % (v, l)

def lanes_sum(vw, v):
    return " + ".join(lane(vw, v, l) for l in range(vw))
%>
<%def name="rope_arg()">${"__global const float2 *restrict rope, " if half else ""}${"__global const int *restrict cu, " if varlen else ""}</%def>

## The work-item's place: segment (unit slot) and index in it, the segment's
## slices of the reduction scratch and of buf.
<%def name="setup()">
    __local float scratch[WG];
    __local vec buf[UPG * HV];
    const uint lid = get_local_id(0);
    const uint seg = lid / TPU, t = lid - seg * TPU;
    __local float *seg_scratch = scratch + seg * TPU;
    __local vec *seg_buf = buf + seg * HV;
</%def>

## Rotate the vectors v[k] of unit `unit` through seg_buf, forward or inverse.
## Holds a barrier: uniform control flow only. The caller's next barrier
## (the group_sum that follows) separates these reads from later writes to buf.
<%def name="rotate(v, inverse)">
    for (uint k = 0; k < CH; ++k) {
        const uint j = t + k * TPU;
        if (j < HV)
            seg_buf[j] = ${v}[k];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    {
        __local const float *b = (__local const float *)seg_buf;
% if varlen:
        // Units past the end (!ok) have no sequence: position 0 keeps their reads in the table.
        uint pos = 0;
        if (ok) {
            const int row = (int)(unit / heads);
            uint lo = 0, hi = nseq;  // cu[lo] ≤ row < cu[hi]
            while (hi - lo > 1) {
                const uint mid = (lo + hi) / 2;
                if (cu[${at("cu", "mid")}] <= row)
                    lo = mid;
                else
                    hi = mid;
            }
            pos = (uint)(row - cu[${at("cu", "lo")}]);
        }
% else:
        const uint pos = (uint)((unit / heads) % window);
% endif
        for (uint k = 0; k < CH; ++k) {
            const uint j = t + k * TPU;
            if (j < HV && j * VW < 2 * HALF) {
% for l in range(vw):
                {
                    const uint e = j * VW + ${l};
                    if (e < HALF) {
                        const float2 r = rope[${at("rope", "pos * HALF + e")}];
                        ${lane(vw, v + "[k]", l)} = b[e] * r.x ${"+" if inverse else "-"} b[e + HALF] * r.y;
                    } else if (e < 2 * HALF) {
                        const float2 r = rope[${at("rope", "pos * HALF + e - HALF")}];
                        ${lane(vw, v + "[k]", l)} = b[e] * r.x ${"-" if inverse else "+"} b[e - HALF] * r.y;
                    }
                }
% endfor
            }
        }
    }
</%def>

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void qk_norm_rope_fwd(__global ${vptr(st, vw)} *restrict y, __global float *restrict inv_out,
                      __global const ${vptr(st, vw)} *restrict x, __global const ${vptr(wst, vw)} *restrict w,
                      ${rope_arg()}const idx_t units, const uint heads,
                      const uint ${"nseq" if varlen else "window"}, const float eps,
                      const float w_offset${checked_args("y", "inv_out", "x", "w", *(["rope"] if half else []), *(["cu"] if varlen else []))})
{
    ${setup()}
    const idx_t unit = (idx_t)get_group_id(0) * UPG + seg;
    const bool ok = unit < units;
    const idx_t base = unit * HV;
    vec v[CH];
    float ss = 0.0f;
    for (uint k = 0; k < CH; ++k) {
        const uint j = t + k * TPU;
        v[k] = (ok && j < HV) ? ${loadv(st, vw, "x", "base + j")} : (vec)(0.0f);
        const vec sq = v[k] * v[k];
        ss += ${lanes_sum(vw, "sq")};
    }
    ${common.group_sum("total", "ss", "seg_scratch", "t", tpu)}
    // 1/sqrt, not rsqrt: rsqrt's error bound is too loose for the 1e-6 parity.
    const float inv = 1.0f / sqrt(total / HD + eps);
    for (uint k = 0; k < CH; ++k) {
        const uint j = t + k * TPU;
        if (j < HV)
            v[k] = v[k] * inv * (${loadv(wst, vw, "w", "j")} + w_offset);
    }
% if half:
    ${rotate("v", False)}
% endif
    if (!ok)
        return;
    for (uint k = 0; k < CH; ++k) {
        const uint j = t + k * TPU;
        if (j < HV)
            ${storev(st, vw, "v[k]", "y", "base + j")};
    }
    if (t == 0)
        inv_out[${at("inv_out", "unit")}] = inv;
}

// g = R⁻¹·dy; dx = inv·w·g − x·inv³/HD·Σ g·w·x (written); partial[b] = Σ_units g·x·inv.
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void qk_norm_rope_bwd(__global ${vptr(st, vw)} *restrict dx, __global vec *restrict partial,
                      __global const ${vptr(st, vw)} *restrict x, __global const ${vptr(wst, vw)} *restrict w,
                      __global const float *restrict inv, ${rope_arg()}
                      __global const ${vptr(st, vw)} *restrict dy, const idx_t units, const uint heads, const uint ${"nseq" if varlen else "window"},
                      const float w_offset${checked_args("dx", "partial", "x", "w", "inv", *(["rope"] if half else []), *(["cu"] if varlen else []), "dy")})
{
    ${setup()}
    vec we[CH], acc[CH];
    for (uint k = 0; k < CH; ++k) {
        const uint j = t + k * TPU;
        we[k] = j < HV ? ${loadv(wst, vw, "w", "j")} + w_offset : (vec)(0.0f);
        acc[k] = (vec)(0.0f);
    }
    const idx_t first = (idx_t)get_group_id(0) * RB;
    for (uint step = 0; step < RB / UPG; ++step) {
        // Uniform across the group: the barriers below stay in uniform control flow.
        if (first + step * UPG >= units)
            break;
        const idx_t unit = first + step * UPG + seg;
        const bool ok = unit < units;
        const idx_t base = unit * HV;
        vec g[CH], xv[CH];
        for (uint k = 0; k < CH; ++k) {
            const uint j = t + k * TPU;
            g[k] = (ok && j < HV) ? ${loadv(st, vw, "dy", "base + j")} : (vec)(0.0f);
        }
% if half:
        ${rotate("g", True)}
% endif
        float s = 0.0f;
        for (uint k = 0; k < CH; ++k) {
            const uint j = t + k * TPU;
            xv[k] = (ok && j < HV) ? ${loadv(st, vw, "x", "base + j")} : (vec)(0.0f);
            const vec p = g[k] * we[k] * xv[k];
            s += ${lanes_sum(vw, "p")};
        }
        ${common.group_sum("total", "s", "seg_scratch", "t", tpu)}
        const float iv = ok ? inv[${at("inv", "unit")}] : 0.0f;
        const float coef = total / HD * iv * iv * iv;
        for (uint k = 0; k < CH; ++k) {
            const uint j = t + k * TPU;
            if (ok && j < HV)
                ${storev(st, vw, "iv * we[k] * g[k] - xv[k] * coef", "dx", "base + j")};
            acc[k] += g[k] * xv[k] * iv;
        }
    }
    // The segments' sums, added in segment order.
    for (uint k = 0; k < CH; ++k) {
        const uint j = t + k * TPU;
        if (j < HV)
            seg_buf[j] = acc[k];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint j = lid; j < HV; j += WG) {
        vec s = buf[j];
        for (uint u = 1; u < UPG; ++u)
            s += buf[u * HV + j];
        partial[${at("partial", "(idx_t)get_group_id(0) * HV + j")}] = s;
    }
}
