// clops RMSNorm family: forward, backward (dx) and the gain gradient.
//
// Layout: x, y, dy, dx are [n, d] row-major of storage type ST (float, half or
// bf16: loads widen, math is float32, stores round to nearest even); w is [d]
// of storage type WST; inv is [n] float (1/rms of each row); dw is [d] of
// storage type DWST. Arrays are read VW elements at a time at vector indices
// (program.loadv / storev), so VW divides d and every row starts on a vector
// boundary (the host picks VW).
//
// Row kernels (kind "rows": rms_norm_fwd, rms_norm_bwd, add_rms_norm_fwd): a
// work-group of WG work-items handles RPG rows; TPR = WG/RPG consecutive
// work-items share a row, work-item t taking the vectors t, t + TPR, ... (CH
// of them), so each step of a row reads one contiguous run. A row's sum is a
// fixed-order local-memory tree (common.group_sum over the row's TPR
// work-items), so results are deterministic. With CACHE the row's vectors
// stay in registers between the sum and the write; rows too wide for that
// (CH > 32) are read twice.
//
// One-pass backward (kind "rows_dw": rms_norm_bwd_dw, add_rms_norm_bwd): the
// same row layout, but group g of G walks the rows g·RPG, (g + G)·RPG, ... (RPG
// at a time, the host's clops.norm.bwd_dw_groups giving G), so that at any time
// the groups' rows lie close together; each work-item adds dy·x·inv of every row it
// walks into acc (its columns, in row order); the RPG segments' sums are then added in segment order into
// partial[g, :]. dx of each row is the same formula, written in the same
// pass (plus ds for add_rms_norm_bwd). column_sum (kind "dw") finishes dw.
//
// Range (#19): the row kernels test each row once (common.rescale on the
// forward's total/d + eps, common.bwd_scaled on the backward's inv); the rows
// outside float32's square range take a barrier-free slow path, the others
// run the plain formulas with their bits of before. Forward: each work-item
// of the row reads it again (common.scaled_sumsq: its largest exponent e, then
// Σ (x·2^−e)²) and y = (x·2^−e)·ivs·(w + w_offset), inv = 2^−e·ivs rounded
// (subnormal where rms > 2^126, inf where rms < 2^−128); add_rms_norm_fwd's
// work-item 0 does the row alone (s and y may be a or b). Backward (bwd_scale):
// x̂ = x·inv in place of x, 1/rms again from x where inv is not normal. The
// slow paths read the row from memory, not the cached vectors (dead there, so
// they add no registers to the plain path's); the one-pass backward leaves
// such rows to a second walk of its rows after the first.
//
// Gain gradient (kind "dw"), two deterministic stages, no atomics:
//   rms_norm_dw_partial: group (c, b) sums dy·x·inv over rows [b·RB, b·RB+RB)
//     for the WG·VW columns of block c (consecutive work-items, consecutive
//     columns) into partial[b, :];
//   column_sum: group c takes CS_CW consecutive columns; its work-item (s, i)
//     adds the partial rows s, s + CS_S, ... of column c·CS_CW + i in order,
//     then slice 0 adds the CS_S slices' sums in slice order and writes (or
//     adds into) dw. The one-pass backward and clops.qk_norm_rope reuse it.
//
// Parameters: WG work-items per group, VW vector width, RPG rows per group
// (per step), CH vectors per work-item per row, CACHE (CH ≤ 32) rows held in
// registers, PF 2 the one-pass backwards' next rows prefetched (PTX with `ptx`: NVIDIA's
// OpenCL prefetch() does nothing measurable), PF 3 loaded into registers during the step's sum
// (with CACHE), RB rows per partial block, CS_CW × CS_S the column sum's columns × row slices a
// group (clops.norm), IDX the index type (uint when every index fits 32 bits, else ulong), ST /
// WST / DWST the storage types above.
<%page args="kind, wg, vw, idx, st, wst, dwst, rpg=None, ch=None, cache=None, rb=None, pf=None, ptx=0, cs_cw=None, cs_s=None"/>
<%namespace name="common" file="common.cl.mako"/>
${common.guards()}\
${common.storage(st, wst, dwst)}\
#define WG ${wg}
#define VW ${vw}
typedef ${idx} idx_t;
typedef ${vtype(vw)} vec;
typedef ${"int" if vw == 1 else "int%d" % vw} ivec;  // ldexp's exponents of a vec

<%!
def lanes_sum(vw, v):
    """The sum of the lanes of vector variable v."""
    return v if vw == 1 else " + ".join("%s.s%x" % (v, l) for l in range(vw))

def lanes_dot(vw, s, a, b):
    """s + Σ a·b over the lanes of vector variables a, b: a fma for each pair of lanes, then a tree of
    adds (a vector's sum does not wait on the previous one's). Spelt out, as plain_dx: NVIDIA's compiler
    fuses a product into a later add wherever the schedule puts them, and rms_norm_bwd and the one-pass
    backwards must give the same bits (the same operations, nothing left to fuse)."""
    if vw == 1:
        return "fma(%s, %s, %s)" % (a, b, s)
    terms = ["fma(%s.s%x, %s.s%x, %s.s%x * %s.s%x)" % (a, l + 1, b, l + 1, a, l, b, l) for l in range(0, vw, 2)]
    while len(terms) > 1:
        terms = ["(%s + %s)" % (terms[i], terms[i + 1]) for i in range(0, len(terms), 2)]
    return "%s + %s" % (s, terms[0])

def plain_dx(iv, gv, xv):
    """dx = inv·g − x·coef with its roundings spelt out (see lanes_dot)."""
    return "fma(-(%s), coef, %s * %s)" % (xv, iv, gv)

def scaled_dx(vw, p, xv, gv):
    """dx of a row in the scaled form (bwd_scale), from the work-item's vectors x and g = dy·(w + w_offset);
    with VW = 1, d = 1 takes the exact form eps·inv² for 1 − x̂², as the plain formulas do."""
    one = "dv == 1 ? %s * (ldexp(eps, -2 * %s_se) * %s_ivs * %s_ivs) : " % (gv, p, p, p) if vw == 1 else ""
    return "ldexp(%s_ivs * (%sfma(-(ldexp(%s, (ivec)(-%s_se)) * %s_ivs), %s_c, %s)), (ivec)(-%s_se))" % (p, one, xv, p, p, p, gv, p)
%>

% if kind in ("rows", "rows_dw"):
<%
    tpr = wg // rpg
    # The one-pass backward's slow loop over the column sums of its work-item, unrolled: rolled, its
    # indexing would keep that array out of registers for every row (clang 15's NVPTX then put it on the
    # stack).
    unroll_slow = "#pragma unroll" if cache else ""
%>\
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

## The backward's scaled form of a row whose inv (`iv`) is outside [2^−32, 2^32]
## (common.bwd_scaled), barrier-free: x̂ = x·inv = (x·2^−se)·ivs (common.bwd_inv),
## `${p}_c` = Σ g·x̂ / d over the row (each work-item reads it all), g = dy·(w +
## w_offset), from `xload(j)`, `dyload(j)` and `wload(j)`. dx = 2^−se·ivs·(g −
## x̂·c), which is inv·g − x·inv³/d·Σ g·x, and dw's terms are dy·x̂.
<%def name="bwd_scale(p, iv, xload, dyload, wload)">
    ${common.bwd_inv(p, iv, xload, "dv", vw, "d")}
    ${common.kahan_sum(p + "_sum", lambda j: "(%s * (%s + w_offset)) * (ldexp(%s, (ivec)(-%s_se)) * %s_ivs)" % (dyload(j), wload(j), xload(j), p, p), "dv", vw)}
    const float ${p}_c = ${p}_sum / d;
</%def>
% if kind == "rows":

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void rms_norm_fwd(__global ${vptr(st, vw)} *restrict y, __global float *restrict inv_out,
                  __global const ${vptr(st, vw)} *restrict x, __global const ${vptr(wst, vw)} *restrict w,
                  const idx_t n, const uint dv, const float d, const float eps,
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
    ${common.group_sum("total", "ss", "row_scratch", "t", tpr, ptx=ptx)}
    const float q = total / d + eps;
    // 1/sqrt, not rsqrt: rsqrt's error bound is too loose for the 1e-6 parity.
    const float inv = 1.0f / sqrt(q);
    if (!ok)
        return;
    if (${common.rescale("q")}) {
        // Slow path (see common.rescale): each work-item reads the row again, and its vectors from memory
        // (the cached ones are dead here: no registers beyond the plain path's). y = (x·2^−se)·ivs·(w +
        // w_offset); a row whose largest |x| is 0 or inf keeps the plain formula (se = 0, ivs = inv).
        ${common.scaled_sumsq("r", lambda j: loadv(st, vw, "x", "base + " + j), "dv", vw)}
        int se = 0;
        float ivs = inv;
        if (r_ok) {
            ${common.scaled_inv("r", "d", "eps")}
            se = r_se;
            ivs = r_ivs;
        }
        for (uint k = 0; k < CH; ++k) {
            const uint j = t + k * TPR;
            if (j < dv)
                ${storev(st, vw, "ldexp(%s, (ivec)(-se)) * ivs * (%s + w_offset)" % (loadv(st, vw, "x", "base + j"), loadv(wst, vw, "w", "j")), "y", "base + j")};
        }
        if (t == 0)
            inv_out[${at("inv_out", "row")}] = ldexp(ivs, -se);
        return;
    }
    for (uint k = 0; k < CH; ++k) {
        const uint j = t + k * TPR;
        if (j < dv)
            ${storev(st, vw, "%s * inv * (%s + w_offset)" % ("xs[k]" if cache else loadv(st, vw, "x", "base + j"), loadv(wst, vw, "w", "j")), "y", "base + j")};
    }
    if (t == 0)
        inv_out[${at("inv_out", "row")}] = inv;
}

// s = a + b, stored rounded once; y = s·inv·(w + w_offset) and inv = 1/rms(s), both of the
// float sum. Each element of a and b is read before the same work-item writes s and y there
// (rows read twice add a + b again), so s or y may be a or b (in place).
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void add_rms_norm_fwd(__global ${vptr(st, vw)} *restrict s_out, __global ${vptr(st, vw)} *restrict y,
                      __global float *restrict inv_out, __global const ${vptr(st, vw)} *restrict a,
                      __global const ${vptr(st, vw)} *restrict b, __global const ${vptr(wst, vw)} *restrict w,
                      const idx_t n, const uint dv, const float d, const float eps,
                      const float w_offset${checked_args("s_out", "y", "inv_out", "a", "b", "w")})
{
    ${row_setup()}
% if cache:
    vec xs[CH];
% endif
    float ss = 0.0f;
    for (uint k = 0; k < CH; ++k) {
        const uint j = t + k * TPR;
        const vec v = (ok && j < dv) ? ${loadv(st, vw, "a", "base + j")} + ${loadv(st, vw, "b", "base + j")} : (vec)(0.0f);
% if cache:
        xs[k] = v;
% endif
        const vec sq = v * v;
        ss += ${lanes_sum(vw, "sq")};
    }
    // The sum's last barrier also fences global memory: the row's reads of a and b above come
    // before the slow path's writes of s and y there (in place) by another work-item.
    ${common.group_sum("total", "ss", "row_scratch", "t", tpr, "CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE", ptx)}
    const float q = total / d + eps;
    const float inv = 1.0f / sqrt(q);
    if (!ok)
        return;
    if (${common.rescale("q")}) {
        // Slow path (see common.rescale), by work-item 0 of the row alone: s and y may be a or b,
        // so no other work-item may write the row while it is read again.
        if (t != 0)
            return;
<% ab = lambda j: "(%s + %s)" % (loadv(st, vw, "a", "base + " + j), loadv(st, vw, "b", "base + " + j)) %>\
        ${common.scaled_sumsq("r", ab, "dv", vw)}
        if (r_ok) {
            ${common.scaled_inv("r", "d", "eps")}
            for (uint j = 0; j < dv; ++j) {
                const vec v = ${ab("j")};
                ${storev(st, vw, "v", "s_out", "base + j")};
                ${storev(st, vw, "ldexp(v, (ivec)(-r_se)) * r_ivs * (%s + w_offset)" % loadv(wst, vw, "w", "j"), "y", "base + j")};
            }
            inv_out[${at("inv_out", "row")}] = ldexp(r_ivs, -r_se);
            return;
        }
        // A row whose largest |a + b| is 0 or inf: the plain formulas, for the whole row.
        for (uint j = 0; j < dv; ++j) {
            const vec v = ${ab("j")};
            ${storev(st, vw, "v", "s_out", "base + j")};
            ${storev(st, vw, "v * inv * (%s + w_offset)" % loadv(wst, vw, "w", "j"), "y", "base + j")};
        }
        inv_out[${at("inv_out", "row")}] = inv;
        return;
    }
    for (uint k = 0; k < CH; ++k) {
        const uint j = t + k * TPR;
        if (j < dv) {
            const vec v = ${"xs[k]" if cache else "%s + %s" % (loadv(st, vw, "a", "base + j"), loadv(st, vw, "b", "base + j"))};
            ${storev(st, vw, "v", "s_out", "base + j")};
            ${storev(st, vw, "v * inv * (%s + w_offset)" % loadv(wst, vw, "w", "j"), "y", "base + j")};
        }
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
    // Read with the row, not after its sum: the group waits on memory once, not twice.
    const float iv = ok ? inv[${at("inv", "row")}] : 1.0f;
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
        s = ${lanes_dot(vw, "s", "gv", "xv")};
    }
    ${common.group_sum("total", "s", "row_scratch", "t", tpr, ptx=ptx)}
    if (!ok)
        return;
    if (${common.bwd_scaled("iv")}) {
        // Slow path (bwd_scale), the row's vectors read again (the cached ones are dead here).
        ${bwd_scale("r", "iv", lambda j: loadv(st, vw, "x", "base + " + j), lambda j: loadv(st, vw, "dy", "base + " + j), lambda j: loadv(wst, vw, "w", j))}
        for (uint k = 0; k < CH; ++k) {
            const uint j = t + k * TPR;
            if (j < dv)
                ${storev(st, vw, scaled_dx(vw, "r", loadv(st, vw, "x", "base + j"), "(%s * (%s + w_offset))" % (loadv(st, vw, "dy", "base + j"), loadv(wst, vw, "w", "j"))), "dx", "base + j")};
        }
        return;
    }
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
            ${storev(st, vw, plain_dx("iv", "gs[k]", "xs[k]"), "dx", "base + j")};
% else:
            ${storev(st, vw, plain_dx("iv", "(%s * (%s + w_offset))" % (loadv(st, vw, "dy", "base + j"), loadv(wst, vw, "w", "j")), loadv(st, vw, "x", "base + j")), "dx", "base + j")};
% endif
    }
}

% endif
% endif
% if kind == "rows_dw":
## dx (plus ds with `resid`) of group g's rows and their gain gradient's partial sums partial[g, :],
## in one read of x, dy.
## pf 3: the rows of step row `nrow` (this work-item's vectors, zeros past the last row) and their inv
## into xn, dyn (dsn) and ivn.
<%def name="load_step(nrow, resid)">\
        {
            const idx_t nrow = ${nrow};
            const bool nok = nrow < n;
            const idx_t nbase = nrow * dv;
            ivn = nok ? inv[${at("inv", "nrow")}] : 0.0f;
            for (uint k = 0; k < CH; ++k) {
                const uint j = t + k * TPR;
                const bool live = nok && j < dv;
                xn[k] = live ? ${loadv(st, vw, "x", "nbase + j")} : (vec)(0.0f);
                dyn[k] = live ? ${loadv(st, vw, "dy", "nbase + j")} : (vec)(0.0f);
% if resid:
                dsn[k] = live ? ${loadv(st, vw, "ds", "nbase + j")} : (vec)(0.0f);
% endif
            }
        }
</%def>
<%def name="bwd_dw(name, resid)">
<%
    gain = "(%s + w_offset)" % loadv(wst, vw, "w", "j")  # w_eff of the work-item's vector j
%>\
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void ${name}(__global ${vptr(st, vw)} *restrict dx, __global vec *restrict partial,
             __global const ${vptr(st, vw)} *restrict x, __global const ${vptr(wst, vw)} *restrict w,
             __global const float *restrict inv, __global const ${vptr(st, vw)} *restrict dy,
             ${"__global const %s *restrict ds, " % vptr(st, vw) if resid else ""}const idx_t n, const uint dv,
             const float d, const float eps, const float w_offset${checked_args("dx", "partial", "x", "w", "inv", "dy", *(["ds"] if resid else []))})
{
    __local float scratch[WG];
% if rpg > 1:
    __local vec comb[WG];
% endif
    const uint lid = get_local_id(0);
    const uint seg = lid / TPR, t = lid - seg * TPR;
    __local float *row_scratch = scratch + seg * TPR;
    // The rows first, first + stride, ... (an H100, 2026-12-06, bf16 at d = 5120, against a block of
    // consecutive rows a group: rms_norm_bwd_dw 0.211 / 0.219 ms against 0.228 / 0.227, add_rms_norm_bwd
    // 0.306 / 0.307 against 0.312 / 0.309)
    const idx_t first = (idx_t)get_group_id(0) * RPG, stride = (idx_t)get_num_groups(0) * RPG;
    // Registers bound how many rows are in flight: the gain is read where it is used, not held.
    vec acc[CH];
% if cache:
    vec xs[CH], dys[CH]${", dss[CH]" if resid else ""};
% endif
    for (uint k = 0; k < CH; ++k)
        acc[k] = (vec)(0.0f);
    bool slow = false;  // a row of this work-item's is the second walk's
% if pf == 3:
    // Double-buffered: the next step's rows are loaded into registers (xn, dyn, dsn, ivn) while this
    // step waits on its sum, so memory stays busy across the barriers at twice the held registers.
    vec xn[CH], dyn[CH]${", dsn[CH]" if resid else ""};
    float ivn;
${load_step("first + seg", resid)}\
% endif
    // Uniform across the group: the barriers of the sums stay in uniform control flow.
    for (idx_t r0 = first; r0 < n; r0 += stride) {
        const idx_t row = r0 + seg;
        const bool ok = row < n;
        const idx_t base = row * dv;
% if pf == 2:
        // The next step's rows into the caches while this one waits on its sum: memory busy across the
        // barriers (no registers held). A hint: not a read, so neither guarded nor checked.
        if (row + stride < n) {
            for (uint k = 0; k < CH; ++k) {
                const uint j = t + k * TPR;
                if (j < dv) {
%   for a in ["x", "dy"] + (["ds"] if resid else []):
                    ${common.prefetch("%s + base + stride * dv + j" % a, ptx)};
%   endfor
                }
            }
        }
% endif
% if pf == 3:
        const float iv = ivn;
        float s = 0.0f;
        for (uint k = 0; k < CH; ++k) {
            const uint j = t + k * TPR;
            xs[k] = xn[k];
            dys[k] = dyn[k];
%   if resid:
            dss[k] = dsn[k];
%   endif
            const vec gv = (ok && j < dv) ? dys[k] * ${gain} : (vec)(0.0f);
            s = ${lanes_dot(vw, "s", "gv", "xs[k]")};
        }
${load_step("row + stride", resid)}\
% else:
        // Read with the row, not after its sum: a step waits on memory once, not twice.
        const float iv = ok ? inv[${at("inv", "row")}] : 0.0f;
        float s = 0.0f;
        for (uint k = 0; k < CH; ++k) {
            const uint j = t + k * TPR;
            const bool live = ok && j < dv;
            const vec xv = live ? ${loadv(st, vw, "x", "base + j")} : (vec)(0.0f);
            const vec dyv = live ? ${loadv(st, vw, "dy", "base + j")} : (vec)(0.0f);
% if cache:
            xs[k] = xv;
            dys[k] = dyv;
%   if resid:
            // read with x and dy: a load after the row's sum would wait on memory once a row
            dss[k] = live ? ${loadv(st, vw, "ds", "base + j")} : (vec)(0.0f);
%   endif
% endif
            const vec gv = live ? dyv * ${gain} : (vec)(0.0f);
            s = ${lanes_dot(vw, "s", "gv", "xv")};
        }
% endif
        ${common.group_sum("total", "s", "row_scratch", "t", wg // rpg, ptx=ptx)}
        const float coef = total / d * iv * iv * iv;
        // Rows whose inv is outside [2^−32, 2^32] (common.bwd_scaled) are the second walk's, below.
        const bool plain = ok && !${common.bwd_scaled("iv")};
        slow |= ok && !plain;
        for (uint k = 0; k < CH; ++k) {
            const uint j = t + k * TPR;
            if (plain && j < dv) {
                const vec xv = ${"xs[k]" if cache else loadv(st, vw, "x", "base + j")};
                const vec dyv = ${"dys[k]" if cache else loadv(st, vw, "dy", "base + j")};
<%
    val = plain_dx("iv", "(dyv * %s)" % gain, "xv")
    if vw == 1:  # one column: 1 − x²·inv² cancels in float; it is eps·inv² (as rms_norm_bwd)
        val = "(dv == 1 ? iv * (dyv * %s) * (eps * iv * iv) : %s)" % (gain, val)
    if resid:
        val = "%s + %s" % ("dss[k]" if cache else loadv(st, vw, "ds", "base + j"), val)
%>\
                ${storev(st, vw, val, "dx", "base + j")};
                acc[k] += dyv * xv * iv;
            }
        }
    }
    // The second walk (#19): dx and the dw terms of the rows the first one left (rows outside float32's
    // square range; normally none, and then no work-item walks again), barrier-free (bwd_scale: each of
    // the row's work-items reads it again), after the other rows' terms (a fixed order still). Here, not
    // in the first walk, so that the slow path's registers add nothing to the first walk's.
    for (idx_t r0 = first; slow && r0 < n; r0 += stride) {
        const idx_t row = r0 + seg;
        const float iv = row < n ? inv[${at("inv", "row")}] : 1.0f;
        if (${common.bwd_scaled("iv")}) {
            const idx_t base = row * dv;
            ${bwd_scale("r", "iv", lambda j: loadv(st, vw, "x", "base + " + j), lambda j: loadv(st, vw, "dy", "base + " + j), lambda j: loadv(wst, vw, "w", j))}
            ${unroll_slow}
            for (uint k = 0; k < CH; ++k) {
                const uint j = t + k * TPR;
                if (j < dv) {
                    const vec xv = ${loadv(st, vw, "x", "base + j")};
                    const vec dyv = ${loadv(st, vw, "dy", "base + j")};
<% val = scaled_dx(vw, "r", "xv", "(dyv * %s)" % gain) %>\
                    ${storev(st, vw, "%s + %s" % (loadv(st, vw, "ds", "base + j"), val) if resid else val, "dx", "base + j")};
                    acc[k] += dyv * (ldexp(xv, (ivec)(-r_se)) * r_ivs);
                }
            }
        }
    }
% if rpg == 1:
    for (uint k = 0; k < CH; ++k) {
        const uint j = t + k * TPR;
        if (j < dv)
            partial[${at("partial", "(idx_t)get_group_id(0) * dv + j")}] = acc[k];
    }
% else:
    // The segments' sums, added in segment order.
    for (uint k = 0; k < CH; ++k) {
        comb[lid] = acc[k];
        barrier(CLK_LOCAL_MEM_FENCE);
        const uint j = t + k * TPR;
        if (seg == 0 && j < dv) {
            vec sum = comb[t];
            for (uint u = 1; u < RPG; ++u)
                sum += comb[u * TPR + t];
            partial[${at("partial", "(idx_t)get_group_id(0) * dv + j")}] = sum;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
% endif
}
</%def>

// dx = inv·w·dy − x·inv³/d·Σ dy·w·x, partial[g] = Σ_rows dy·x·inv
${bwd_dw("rms_norm_bwd_dw", False)}
// dx = ds + inv·w·dy − s·inv³/d·Σ dy·w·s (s in x), partial[g] = Σ_rows dy·s·inv; dx may be ds (in place:
// each element of ds is read by the work-item that writes dx there, just before)
${bwd_dw("add_rms_norm_bwd", True)}

% elif kind == "dw":
#define RB ${rb}
#define CS_CW ${cs_cw}
#define CS_S ${cs_s}

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
    for (idx_t r = r0; r < r1; ++r) {
        const float iv = inv[${at("inv", "r")}];
        if (${common.bwd_scaled("iv")}) {
            // dy·x·inv as dy·x̂, x̂ = x·inv (see bwd_scale); where inv is not normal, 1/rms again from
            // the row (this work-item reads it all: slow, for such rows only).
            ${common.bwd_inv("r", "iv", lambda i: loadv(st, vw, "x", "r * dv + " + i), "dv", vw, "(float)(dv * VW)")}
            acc += ${loadv(st, vw, "dy", "r * dv + j")} * (ldexp(${loadv(st, vw, "x", "r * dv + j")}, (ivec)(-r_se)) * r_ivs);
            continue;
        }
        acc += ${loadv(st, vw, "dy", "r * dv + j")} * ${loadv(st, vw, "x", "r * dv + j")} * iv;
    }
    partial[${at("partial", "(idx_t)get_group_id(1) * dv + j")}] = acc;
}

// dw[r, c] (+)= Σ_b partial[b, c] over the chunk of rows b in [r·chunk, r·chunk + chunk) of
// group (·, r): slice s adds the rows b ≡ s (mod CS_S) in order, then the slices' sums are
// added in slice order: the same bits on every run. Added to a given dw in float, then
// rounded once to its storage type. Many partial rows take two launches (the host's
// column_sum): chunks into a float scratch, then its rows in one chunk into dw.
__kernel __attribute__((reqd_work_group_size(CS_CW * CS_S, 1, 1)))
void column_sum(__global ${vptr(dwst, 1)} *restrict dw, __global const float *restrict partial, const uint rows,
                const uint cols, const int accumulate, const uint chunk${checked_args("dw", "partial")})
{
    __local float sums[CS_CW * CS_S];
    const uint lid = get_local_id(0);
    const uint i = lid % CS_CW, slice = lid / CS_CW;
    const uint c = get_group_id(0) * CS_CW + i;
    const uint b0 = get_group_id(1) * chunk, b1 = min(rows, b0 + chunk);
    float s = 0.0f;
    if (c < cols) {
        uint b = b0 + slice;
        // Sixteen rows' loads in flight, then added in the same order: one wait on the cache per sixteen.
        for (; b + 15 * CS_S < b1; b += 16 * CS_S) {
            float v[16];
            #pragma unroll
            for (uint u = 0; u < 16; ++u)
                v[u] = partial[${at("partial", "(idx_t)(b + u * CS_S) * cols + c")}];
            #pragma unroll
            for (uint u = 0; u < 16; ++u)
                s += v[u];
        }
        for (; b < b1; b += CS_S)
            s += partial[${at("partial", "(idx_t)b * cols + c")}];
    }
    sums[lid] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (slice == 0 && c < cols) {
        for (uint u = 1; u < CS_S; ++u)
            s += sums[u * CS_CW + i];
        const idx_t o = (idx_t)get_group_id(1) * cols + c;
        ${storev(dwst, 1, "accumulate ? %s + s : s" % loadv(dwst, 1, "dw", "o"), "dw", "o")};
    }
}
% endif
