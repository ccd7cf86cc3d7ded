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
// Slots: a unit is read VW elements at a time, VW (a power of two ≤ the vw
// asked for) dividing HD and HALF, so a rotation pair is two whole vectors.
// Slot s < NP = HALF/VW is the pair of vectors s (dims [VW·s, VW·s + VW)) and
// s + NP (their partners, HALF further); slot s ≥ NP is the pass-through
// vector s + NP. SLOTS = HD/VW − NP slots cover the unit's vectors once. A
// work-item owns whole slots, so the rotation happens in its registers, with
// one table load (VW float2, read as rvec: cos and sin interleaved) per pair.
//
// A work-group of WG work-items is UPG segments of TPU = WG/UPG consecutive
// work-items, work-item t of a segment owning the slots t, t + TPU, ... (CH of
// them) of each of the segment's HPW units: consecutive units (u, u + 1, ...:
// the heads of a row, but where a row ends), so that the gain's vectors and
// the row's table vectors are loaded once for them (the table again only where
// the next unit's row is at another position). A unit's sum of squares: each
// work-item writes its own to local scratch, one barrier for the segment's
// units, then each adds its unit's TPU values in a fixed order (the same bits
// in all of them); over 32 work-items a unit (HPW 1), a fixed-order tree
// (common.group_sum) instead; at one work-item a unit, its own sum (no
// barrier). On NVIDIA (ptx) a unit of a power of two ≤ 32 work-items adds by a
// butterfly of warp shuffles instead, no barrier.
//
// Backward: group g of G walks the steps g·UPG, (g + G)·UPG, ... of UPG·HPW
// units each (segment u of step u0 the units (u0 + u)·HPW ...; the host's
// clops.norm.bwd_dw_groups giving G), so that at any time the groups'
// units lie close together; each work-item adds
// g·x·inv of every unit it walks for the dims it owns, in unit order; the
// scratch of the per-unit sums alternates between two halves, so a step holds
// one barrier (the tree's own last barrier does it over 32 work-items a unit).
// The gain is read where it is used (cache hits; the same loads for the
// segment's units merged by the compiler, as in the forward), not held. At the end the UPG
// segments' sums are added in segment order
// (SL slices of segments, then the slices in order) into partial[g, :]. The
// column sum over the partial rows (clops.norm.column_sum) finishes dw:
// deterministic, no atomics.
//
// Range (#19): units outside float32's square range take the barrier-free
// slow paths of rms_norm.cl.mako (see its Range comment), the others run the
// formulas below with their bits of before. Forward (common.rescale true):
// each work-item reads the unit again (common.scaled_sumsq), its vectors
// become x·2^−e and inv 2^e/rms, and the formulas below give y. Backward
// (common.bwd_scaled): x̂ = x·inv in place of x in the work-item's vectors
// before the unit's sum, which then is Σ g·w·x̂ (1/rms again from x where inv
// is not a normal float).
//
// The kernels carry vec_type_hint(vec): they are written in vectors already.
// (Intel's CPU runtime otherwise vectorises across work-items, into gathers
// and scatters: its float32 backward ran 3× slower.)
//
// Parameters: HD head dim, HALF rotary half (0: no rotation, no rope
// argument), WG work-items per group, vw the widest vector width wanted, UPG
// segments per group, HPW units a segment (UPG·HPW units a group, per step), PF
// the backward's next step: 1 loaded when it
// comes, 2 prefetched into the caches while this step waits on its sum (PTX
// with `ptx`), 3 loaded into registers then (twice the step's registers), as
// rms_norm.cl.mako's PF; IDX the index type, ST / WST the storage types above.
<%page args="hd, half, wg, vw, upg, idx, st, wst, hpw=1, pf=1, ptx=0, varlen=0"/>
## varlen (a render flag, with HALF only; 0 renders the kernels above as they
## were): the kernels take cu, nseq + 1 int offsets of the sequences, after rope
## and nseq in place of window; unit u's position is the offset of its row in
## its sequence, cu[s] ≤ row < cu[s + 1], s found by a binary search over cu
## (the last sequence starting at or before the row, so empty ones are passed
## over). Nothing is read back to the host for it.
<%namespace name="common" file="common.cl.mako"/>
<%
    v = vw
    while hd % v or (half and half % v):
        v //= 2
    tpu = wg // upg
    np_ = half // v
    slots = hd // v - np_
    ch = -(-slots // tpu)
    tree = tpu > 32
    sl = min(upg, wg // hd)  # slices of the segments in the backward's last sum
    rv = min(2 * v, 16)  # the table's vectors: cos and sin of VW dims (two loads at VW 16)
%>
${common.guards()}\
${common.storage(st, wst)}\
#define HD ${hd}
#define HALF ${half}
#define HV ${hd // v}
#define NP ${np_}
#define SLOTS ${slots}
#define WG ${wg}
#define VW ${v}
#define UPG ${upg}
#define HPW ${hpw}
#define TPU ${tpu}
#define CH ${ch}
typedef ${idx} idx_t;
typedef ${vtype(v)} vec;
typedef ${"int" if v == 1 else "int%d" % v} ivec;  // ldexp's exponents of a vec
% if half:
typedef ${vtype(rv)} rvec;
% endif
// Slot s = t + k·TPU of work-item t: whether it is in the unit, whether it is a pair (constants
// once the loop over k is unrolled, when TPU divides SLOTS and NP), and its first vector.
#define LIVE(k, s) (SLOTS % TPU == 0 || (s) < SLOTS)
#define PAIR(k, s) (NP % TPU == 0 ? (k) < NP / TPU : (s) < NP)
#define FIRST(k, s) ((s) + (PAIR(k, s) ? 0 : NP))

<%!
def lanes_sum(vw, v):
    return v if vw == 1 else " + ".join("%s.s%x" % (v, l) for l in range(vw))

def cos_sin(vw):
    """(cos, sin) of the VW dims of a pair from its table vectors r0 (and r1 at VW 16)."""
    if vw == 1:
        return "r0[k].s0", "r0[k].s1"
    if vw < 16:
        return "r0[k].even", "r0[k].odd"
    return "(float16)(r0[k].even, r1[k].even)", "(float16)(r0[k].odd, r1[k].odd)"
%>
<%def name="rope_arg()">${"__global const rvec *restrict rope, " if half else ""}${"__global const int *restrict cu, " if varlen else ""}</%def>

## uint `name`: the position in the table of unit `unit` (valid: `ok`).
<%def name="position(name, unit, ok)">
% if varlen:
        // Units past the end (!ok) have no sequence: position 0 keeps their reads in the table.
        uint ${name} = 0;
        if (${ok}) {
            const int row = (int)(${unit} / heads);
            uint lo = 0, hi = nseq;  // cu[lo] ≤ row < cu[hi]
            while (hi - lo > 1) {
                const uint mid = (lo + hi) / 2;
                if (cu[${at("cu", "mid")}] <= row)
                    lo = mid;
                else
                    hi = mid;
            }
            ${name} = (uint)(row - cu[${at("cu", "lo")}]);
        }
% else:
        uint ${name} = (uint)((${unit} / heads) % window);
% endif
</%def>

## The table vectors r0[k] (r1[k]) of the work-item's pair slots at `pos`, zero elsewhere: declared
## (`decl`) or loaded again.
<%def name="table(vw, pos, decl=True)">
% if half:
%   if decl:
        rvec r0[CH]${", r1[CH]" if vw == 16 else ""};
%   endif
        #pragma unroll
        for (uint k = 0; k < CH; ++k) {
            const uint s = t + k * TPU;
            const bool p = PAIR(k, s);
%   if vw == 16:
            r0[k] = p ? rope[${at("rope", "(%s * NP + s) * 2" % pos)}] : (rvec)(0.0f);
            r1[k] = p ? rope[${at("rope", "(%s * NP + s) * 2 + 1" % pos)}] : (rvec)(0.0f);
%   else:
            r0[k] = p ? rope[${at("rope", "%s * NP + s" % pos)}] : (rvec)(0.0f);
%   endif
        }
% endif
</%def>

## A later unit of the segment (`unit`, inside the units): the table again if its row's position is
## not `pos` (the segment's units crossed into a row at another position).
<%def name="table_for(vw, unit)">
            ${position("pos_i", unit, "true")}
            if (pos_i != pos) {
                pos = pos_i;
                ${table(vw, "pos", decl=False)}
            }
</%def>

## float result[HPW]: for each of the segment's HPW units, the sum of val[i] over its TPU work-items,
## through `buf` (a __local float * of HPW·WG floats). Uniform control flow (a barrier); `buf` must not
## be written again before a barrier that every work-item passes after this.
<%def name="unit_sums(result, val, buf, tpu)">
% if tpu > 32:
    ## (one unit a segment: the host's rule)
    ${common.group_sum(result + "_", val + "[0]", "(" + buf + " + seg * TPU)", "t", tpu, ptx=ptx)}
    const float ${result}[1] = {${result}_};
% else:
    float ${result}[HPW];
%   if tpu > 1 and not (ptx and tpu & (tpu - 1) == 0):
    #pragma unroll
    for (uint i = 0; i < HPW; ++i)
        ${buf}[i * WG + lid] = ${val}[i];
    barrier(CLK_LOCAL_MEM_FENCE);
%   endif
    #pragma unroll
    for (uint i = 0; i < HPW; ++i) {
%   if tpu == 1:
        ${result}[i] = ${val}[i];
%   elif ptx and tpu & (tpu - 1) == 0:
        // NVIDIA: the unit's work-items, a power of two inside one warp, add by a butterfly of shuffles
        // (the same bits in all of them), no barrier
        ${result}[i] = ${val}[i];
${common.butterfly_sum(result + "[i]", [1 << j for j in range(tpu.bit_length() - 1)])}\
%   else:
        ${result}[i] = ${buf}[i * WG + seg * TPU];
        for (uint j = 1; j < TPU; ++j)
            ${result}[i] += ${buf}[i * WG + seg * TPU + j];
%   endif
    }
% endif
</%def>

## The backward's loads of the units of step `u0` (the segment's HPW units from (u0 + seg)·HPW: this
## work-item's vectors of dy and x, zeros past the units) and their inv, into ga${sfx}[i], xa${sfx}[i]
## (gb${sfx}[i], xb${sfx}[i]) and iv${sfx}[i].
<%def name="load_units(u0, sfx)">
        #pragma unroll
        for (uint i = 0; i < HPW; ++i) {
            const idx_t unit = (${u0} + seg) * HPW + i;
            const bool ok = unit < units;
            const idx_t base = unit * HV;
            #pragma unroll
            for (uint k = 0; k < CH; ++k) {
                const uint s = t + k * TPU;
                const bool live = ok && LIVE(k, s);
                ga${sfx}[i][k] = live ? ${loadv(st, v, "dy", "base + FIRST(k, s)")} : (vec)(0.0f);
                xa${sfx}[i][k] = live ? ${loadv(st, v, "x", "base + FIRST(k, s)")} : (vec)(0.0f);
% if half:
                gb${sfx}[i][k] = live && PAIR(k, s) ? ${loadv(st, v, "dy", "base + s + NP")} : (vec)(0.0f);
                xb${sfx}[i][k] = live && PAIR(k, s) ? ${loadv(st, v, "x", "base + s + NP")} : (vec)(0.0f);
% endif
            }
            iv${sfx}[i] = ok ? inv[${at("inv", "unit")}] : 0.0f;
        }
</%def>

## The backward's stores of dx for unit i (`dx`: its formula of the vectors w{h}, g{h}[i][k],
## x{h}[i][k], h the half a or b).
<%def name="dx_step(dx)">
            #pragma unroll
            for (uint k = 0; k < CH; ++k) {
                const uint s = t + k * TPU;
                if (ok && LIVE(k, s)) {
                    const vec wa = ${loadv(wst, v, "w", "FIRST(k, s)")} + w_offset;
                    ${storev(st, v, dx.format(h="a"), "dx", "base + FIRST(k, s)")};
                }
% if half:
                if (ok && PAIR(k, s)) {
                    const vec wb = ${loadv(wst, v, "w", "s + NP")} + w_offset;
                    ${storev(st, v, dx.format(h="b"), "dx", "base + s + NP")};
                }
% endif
            }
</%def>

<% c, sn = cos_sin(v) %>
__kernel __attribute__((reqd_work_group_size(WG, 1, 1), vec_type_hint(vec)))
void qk_norm_rope_fwd(__global ${vptr(st, v)} *restrict y, __global float *restrict inv_out,
                      __global const ${vptr(st, v)} *restrict x, __global const ${vptr(wst, v)} *restrict w,
                      ${rope_arg()}const idx_t units, const uint heads,
                      const uint ${"nseq" if varlen else "window"}, const float eps,
                      const float w_offset${checked_args("y", "inv_out", "x", "w", *(["rope"] if half else []), *(["cu"] if varlen else []))})
{
% if tpu > 1:
    __local float scratch[HPW * WG];
% endif
    const uint lid = get_local_id(0);
    const uint seg = lid / TPU, t = lid - seg * TPU;
    const idx_t unit0 = ((idx_t)get_group_id(0) * UPG + seg) * HPW;  // the segment's first unit
    vec a[HPW][CH]${", b[HPW][CH]" if half else ""};
    float ss[HPW];
    #pragma unroll
    for (uint i = 0; i < HPW; ++i) {
        const idx_t base = (unit0 + i) * HV;
        const bool ok = unit0 + i < units;
        ss[i] = 0.0f;
        #pragma unroll
        for (uint k = 0; k < CH; ++k) {
            const uint s = t + k * TPU;
            const bool live = ok && LIVE(k, s);
            a[i][k] = live ? ${loadv(st, v, "x", "base + FIRST(k, s)")} : (vec)(0.0f);
% if half:
            b[i][k] = live && PAIR(k, s) ? ${loadv(st, v, "x", "base + s + NP")} : (vec)(0.0f);
            const vec sq = a[i][k] * a[i][k] + b[i][k] * b[i][k];
% else:
            const vec sq = a[i][k] * a[i][k];
% endif
            ss[i] += ${lanes_sum(v, "sq")};
        }
    }
% if half:
    ${position("pos", "unit0", "unit0 < units")}
    ${table(v, "pos")}
% endif
    ${unit_sums("total", "ss", "scratch", tpu)}
    #pragma unroll
    for (uint i = 0; i < HPW; ++i) {
        const idx_t unit = unit0 + i;
        if (unit >= units)
            break;  // and so are the segment's units after it
        const idx_t base = unit * HV;
% if half and hpw > 1:
        if (i > 0) {
${table_for(v, "unit")}\
        }
% endif
        const float q = total[i] / HD + eps;
        // 1/sqrt, not rsqrt: rsqrt's error bound is too loose for the 1e-6 parity.
        float inv = 1.0f / sqrt(q), inv_unit = inv;
        if (${common.rescale("q")}) {
            // Slow path (see common.rescale), no barriers: this work-item reads the unit again.
            ${common.scaled_sumsq("r", lambda j: loadv(st, v, "x", "base + " + j), "HV", v)}
            if (r_ok) {
                ${common.scaled_inv("r", "HD", "eps")}
                #pragma unroll
                for (uint k = 0; k < CH; ++k) {
                    a[i][k] = ldexp(a[i][k], (ivec)(-r_se));
% if half:
                    b[i][k] = ldexp(b[i][k], (ivec)(-r_se));
% endif
                }
                inv = r_ivs;
                inv_unit = ldexp(r_ivs, -r_se);
            }
        }
        // The gain is read where it is used: a later unit's loads are the first's, merged by the compiler
        // (LLVM 15's NVPTX build of hd 64: no gain load added a unit)
        #pragma unroll
        for (uint k = 0; k < CH; ++k) {
            const uint s = t + k * TPU;
            if (!LIVE(k, s))
                continue;
            const vec ya = a[i][k] * inv * (${loadv(wst, v, "w", "FIRST(k, s)")} + w_offset);
% if half:
            if (PAIR(k, s)) {
                const vec yb = b[i][k] * inv * (${loadv(wst, v, "w", "s + NP")} + w_offset);
                const vec c = ${c}, sn = ${sn};
                ${storev(st, v, "ya * c - yb * sn", "y", "base + s")};
                ${storev(st, v, "yb * c + ya * sn", "y", "base + s + NP")};
            } else
                ${storev(st, v, "ya", "y", "base + s + NP")};
% else:
            ${storev(st, v, "ya", "y", "base + s")};
% endif
        }
        if (t == 0)
            inv_out[${at("inv_out", "unit")}] = inv_unit;
    }
}

// g = R⁻¹·dy; dx = inv·w·g − x·inv³/HD·Σ g·w·x (written); partial[g] = Σ_units g·x·inv.
__kernel __attribute__((reqd_work_group_size(WG, 1, 1), vec_type_hint(vec)))
void qk_norm_rope_bwd(__global ${vptr(st, v)} *restrict dx, __global float *restrict partial,
                      __global const ${vptr(st, v)} *restrict x, __global const ${vptr(wst, v)} *restrict w,
                      __global const float *restrict inv, ${rope_arg()}
                      __global const ${vptr(st, v)} *restrict dy, const idx_t units, const uint heads, const uint ${"nseq" if varlen else "window"},
                      const float w_offset${checked_args("dx", "partial", "x", "w", "inv", *(["rope"] if half else []), *(["cu"] if varlen else []), "dy")})
{
% if tpu > 1 or sl > 1:
    __local float scratch[2 * HPW * WG];  // the unit sums' two halves; then the slices of the last sum
% endif
    __local vec buf[UPG * HV];  // the segments' sums of g·x·inv
    const uint lid = get_local_id(0);
    const uint seg = lid / TPU, t = lid - seg * TPU;
    vec acca[CH]${", accb[CH]" if half else ""};
    #pragma unroll
    for (uint k = 0; k < CH; ++k) {
        acca[k] = (vec)(0.0f);
% if half:
        accb[k] = (vec)(0.0f);
% endif
    }
    // Steps over the segments' HPW units at a time: segment u of step u0 takes the units (u0 + u)·HPW
    // and the HPW − 1 after it. The steps first, first + stride, ... (an H100, 2026-12-06, against a block
    // of consecutive units a group: bf16 0.160 / 0.160 ms against 0.163 / 0.164 at hd 256; float32 0.296 /
    // 0.295 against 0.305 / 0.307 at hd 256, 0.300 / 0.299 against 0.306 / 0.307 at hd 128, 0.064 / 0.064
    // against 0.065 at hd 64)
    const idx_t first = (idx_t)get_group_id(0) * UPG, stride = (idx_t)get_num_groups(0) * UPG;
    const idx_t useg = (units + HPW - 1) / HPW;  // the segments' unit blocks
    uint flip = 0;  // the scratch half of this step
% if pf == 3:
    // Double-buffered: the next step's units are loaded into registers (gan, xan, ..., ivn) while this
    // step waits on its sum, so memory stays busy across the barrier.
    vec gan[HPW][CH], xan[HPW][CH]${", gbn[HPW][CH], xbn[HPW][CH]" if half else ""};
    float ivn[HPW];
${load_units("first", "n")}\
% endif
    // Uniform across the group: the barriers of the sums stay in uniform control flow.
    for (idx_t u0 = first; u0 < useg; u0 += stride) {
        const idx_t unit0 = (u0 + seg) * HPW;
        // The gain is read where it is used (cache hits; compilers may hold it), not kept in arrays.
        vec ga[HPW][CH], xa[HPW][CH]${", gb[HPW][CH], xb[HPW][CH]" if half else ""};
        float iv[HPW];
% if pf == 3:
        #pragma unroll
        for (uint i = 0; i < HPW; ++i) {
            #pragma unroll
            for (uint k = 0; k < CH; ++k) {
                ga[i][k] = gan[i][k];
                xa[i][k] = xan[i][k];
%   if half:
                gb[i][k] = gbn[i][k];
                xb[i][k] = xbn[i][k];
%   endif
            }
            iv[i] = ivn[i];
        }
${load_units("u0 + stride", "n")}\
% else:
${load_units("u0", "")}\
% endif
% if pf == 2:
        // The next step's units into the caches while this one waits on its sum: memory busy across the
        // barrier (no registers held). A hint: not a read, so neither guarded nor checked.
        #pragma unroll
        for (uint i = 0; i < HPW; ++i) {
            const idx_t next = unit0 + stride * HPW + i;
            if (next < units) {  // addresses inside the buffers
                const idx_t base = next * HV;
                #pragma unroll
                for (uint k = 0; k < CH; ++k) {
                    const uint s = t + k * TPU;
                    if (LIVE(k, s)) {
%   for a in ("dy", "x"):
                        ${common.prefetch("%s + base + FIRST(k, s)" % a, ptx)};
%     if half:
                        if (PAIR(k, s))
                            ${common.prefetch("%s + base + s + NP" % a, ptx)};
%     endif
%   endfor
                    }
                }
            }
        }
% endif
% if half:
        uint pos;
        rvec r0[CH]${", r1[CH]" if v == 16 else ""};
% endif
        float s_[HPW];
        bool scaled[HPW];
        int se[HPW];
        float ivs[HPW];
        #pragma unroll
        for (uint i = 0; i < HPW; ++i) {
            const idx_t unit = unit0 + i;
            const bool ok = unit < units;
            const idx_t base = unit * HV;
            s_[i] = 0.0f;
            // A unit whose inv is outside [2^−32, 2^32] (common.bwd_scaled) takes x̂ = x·inv = (x·2^−se)·ivs
            // in place of x (rms_norm.cl.mako's bwd_scale), so its sum below is Σ g·w·x̂. No barriers.
            scaled[i] = ok && ${common.bwd_scaled("iv[i]")};
            se[i] = 0;
            ivs[i] = iv[i];
            if (scaled[i]) {
                ${common.bwd_inv("u", "iv[i]", lambda j: loadv(st, v, "x", "base + " + j), "HV", v, "HD")}
                se[i] = u_se;
                ivs[i] = u_ivs;
                #pragma unroll
                for (uint k = 0; k < CH; ++k) {
                    xa[i][k] = ldexp(xa[i][k], (ivec)(-se[i])) * ivs[i];
% if half:
                    xb[i][k] = ldexp(xb[i][k], (ivec)(-se[i])) * ivs[i];
% endif
                }
            }
% if half:
            // the table after the slow path (fewer registers held through it)
            if (i == 0) {
                ${position("pos0", "unit0", "ok")}
                pos = pos0;
                ${table(v, "pos", decl=False)}
            }
%   if hpw > 1:
            else if (ok) {
${table_for(v, "unit")}\
            }
%   endif
% endif
            #pragma unroll
            for (uint k = 0; k < CH; ++k) {
                const uint s = t + k * TPU;
% if half:
                if (PAIR(k, s)) {  // the inverse rotation (a pass-through slot's b vectors stay zeros)
                    const vec c = ${c}, sn = ${sn};
                    const vec lo = ga[i][k], hi = gb[i][k];
                    ga[i][k] = lo * c + hi * sn;
                    gb[i][k] = hi * c - lo * sn;
                }
% endif
                const vec wa = LIVE(k, s) ? ${loadv(wst, v, "w", "FIRST(k, s)")} + w_offset : (vec)(0.0f);
% if half:
                const vec wb = PAIR(k, s) ? ${loadv(wst, v, "w", "s + NP")} + w_offset : (vec)(0.0f);
                const vec p = wa * ga[i][k] * xa[i][k] + wb * gb[i][k] * xb[i][k];
% else:
                const vec p = wa * ga[i][k] * xa[i][k];
% endif
                s_[i] += ${lanes_sum(v, "p")};
            }
        }
% if tpu > 1 and not tree:
        __local float *sums = scratch + flip;
        flip ^= HPW * WG;
% endif
        ${unit_sums("total", "s_", "sums" if tpu > 1 and not tree else "scratch", tpu)}
        #pragma unroll
        for (uint i = 0; i < HPW; ++i) {
            const idx_t unit = unit0 + i;
            const bool ok = unit < units;
            const idx_t base = unit * HV;
            if (scaled[i]) {
                // dx = 2^−se·ivs·(w·g − x̂·c), c = Σ g·w·x̂ / HD (inv·w·g − x·inv³/HD·Σ g·w·x).
                const float c = total[i] / HD;
                ${dx_step("ldexp(ivs[i] * (w{h} * g{h}[i][k] - x{h}[i][k] * c), (ivec)(-se[i]))")}
            } else {
                const float coef = total[i] / HD * iv[i] * iv[i] * iv[i];
                ${dx_step("iv[i] * w{h} * g{h}[i][k] - x{h}[i][k] * coef")}
            }
            // dw's terms g·x·inv, g·x̂ where scaled, out of the branches above
            const float acc_inv = scaled[i] ? 1.0f : iv[i];
            #pragma unroll
            for (uint k = 0; k < CH; ++k) {
                acca[k] += ga[i][k] * xa[i][k] * acc_inv;
% if half:
                accb[k] += gb[i][k] * xb[i][k] * acc_inv;
% endif
            }
        }
    }
    // The segments' sums: each segment's vectors into buf (every vector of a unit is one slot's),
    // then added in segment order, SL slices of them at a time.
    #pragma unroll
    for (uint k = 0; k < CH; ++k) {
        const uint s = t + k * TPU;
        if (LIVE(k, s)) {
            buf[seg * HV + FIRST(k, s)] = acca[k];
% if half:
            if (PAIR(k, s))
                buf[seg * HV + s + NP] = accb[k];
% endif
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    __local const float *part = (__local const float *)buf;
    const idx_t row = (idx_t)get_group_id(0) * HD;
% if sl > 1:
    // Slice i of column c (work-item i·HD + c) adds the segments i, i + SL, ... (the scratch's last
    // reads of the loop above came before the barrier just passed).
    if (lid < ${sl} * HD) {
        const uint i = lid / HD, c = lid - i * HD;
        float sum = part[i * HD + c];
        for (uint u = i + ${sl}; u < UPG; u += ${sl})
            sum += part[u * HD + c];
        scratch[lid] = sum;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid < HD) {
        float sum = scratch[lid];
        for (uint i = 1; i < ${sl}; ++i)
            sum += scratch[i * HD + lid];
        partial[${at("partial", "row + lid")}] = sum;
    }
% else:
    for (uint c = lid; c < HD; c += WG) {
        float sum = part[c];
        for (uint u = 1; u < UPG; ++u)
            sum += part[u * HD + c];
        partial[${at("partial", "row + c")}] = sum;
    }
% endif
}
