## Tile products of the matrix-unit attention drivers (include with <%namespace>): the seam
## between a driver (grid, staging, softmax, masking: attention_fwd_mma.cl.mako and
## attention_bwd_mma.cl.mako) and the hardware that multiplies.
##
## A driver works in warps of 32 work-items, each warp on 16 rows (query rows, or keys in the
## backward's dK/dV pass) against a staged block of BK rows of the other side; lane = lid % 32,
## g = lane / 4, t = lane % 4. Accumulator tiles have the layout of NVIDIA's mma.sync m16n8
## C fragment: an array x[N][4] of 16 × 8N floats, x[j][0..3] at (row g, col 8j + 2t),
## (g, 8j + 2t + 1), (g + 8, 8j + 2t), (g + 8, 8j + 2t + 1). Every def below takes or
## produces tiles in that layout, so a product is a drop-in. Two products serve every pass:
## qk (out += A·Bᵀ, A the warp's rows, B the staged block's) and pv (acc += P·B, P a tile of
## coefficients over the block's rows). Kinds:
##   kind "fma"     portable: plain float FMAs, operands read from local (and global) memory,
##                  quad reductions through local memory; any OpenCL device (the drivers'
##                  reference on the CPU runtimes);
##   kind "tf32x3"  NVIDIA mma.sync m16n8k8 TF32 by inline PTX, each float32 operand split into
##                  hi + lo TF32 parts and three products summed (hi·hi + hi·lo + lo·hi), so the
##                  error stays near float32's; float storage;
##   kind "bf16"/"f16"  mma.sync m16n8k16 on the stored 16-bit bits, float32 accumulation; P
##                  (and dS) rounded to the storage type (nearest even) only as an operand; pv's
##                  B operand by ldmatrix.trans from the staged rows.
## The three NVIDIA kinds also render emulated (`emulate`: emulated_warps below, 32-wide sub-groups
## for warps), so their code runs and is tested on a CPU runtime.
## Local tiles: staged rows as stored (float, or ushort bits), KS elements a row.
<%!
    def widen(st, x):
        """A stored element as float."""
        return x if st == "float" else "clops_%s_to_float(%s)" % (st, x)

    def steps16(cols):
        """The k-steps of 16 over `cols` columns (a C expression)."""
        return "HD16" if cols == "HD" else "((%s + 15) / 16)" % cols
%>

<%def name="decls(kind, st, emulate=0)">\
// The softcap's tanh through r = 1/(2^u + 1), u = 2·log2(e)·x: tanh x = 1 − 2r, by one exp2 and one
// reciprocal where OpenCL's tanh costs a dozen more instructions: r's relative error of a few
// 2^-24 on the matrix units (ex2.approx, rcp.approx), so about cap·2^-23 absolute in a capped score,
// where the softmax sees absolute errors only (an H100, bf16: lse within 3.5e-6 at cap 30, 6.3e-6 at
// cap 50; the tests take caps 3, 5 and 50). ±1 past ±9, NaN stays NaN. softcap_neg_r(u) is −r (a
// capped score cap·(1 − 2r) is then one fma); on the matrix units (NVIDIA) by ex2.approx and
// rcp.approx directly: OpenCL's division costs a range check and a slow-path call there, and neither
// input needs it (|1/r| lies in [1, Inf]).
inline float softcap_neg_r(float u)
{
% if kind == "fma" or emulate:
    return -1.0f / (exp2(u) + 1.0f);  // exp2, not native_exp2: Intel's CPU runtime's is far coarser
% else:
    float e, r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(u));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(-e - 1.0f));
    return r;
% endif
}
inline float score_tanh(float x)
{
    return fma(2.0f, softcap_neg_r(x * 2.88539008f), 1.0f);
}
% if kind == "fma" or not emulate:
#define WARPS
% endif
% if kind == "fma" or emulate:
#define softmax_exp2 exp2
% else:
// 2^x for the softmax's P and its rescale: ex2.approx with subnormal results flushed to zero (one
// MUFU.EX2, where exp2 adds a range check and two multiplies): a P below 2^-126 of its row's
// largest adds below float32's resolution to the row's sums.
inline float softmax_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
% endif
// The two warps of a column halves' pair (SX 2) waiting for each other alone: on NVIDIA a hardware
// barrier of their 64 threads (bar.sync 1 + the pair; OpenCL's barrier takes 0), elsewhere the group's.
% if kind == "fma" or emulate:
#define PAIR_BARRIER() barrier(CLK_LOCAL_MEM_FENCE)
% else:
#define PAIR_BARRIER() asm volatile("bar.sync %0, 64;" :: "r"(1 + (uint)get_local_id(0) / 64) : "memory")
% endif
% if kind != "fma" and emulate:
${emulated_warps(kind, st)}\
% elif kind != "fma":
#define CP_ASYNC_STATE
#define CP_ASYNC_COMMIT() asm volatile("cp.async.commit_group;" ::: "memory")
#define CP_ASYNC_WAIT(n) asm volatile("cp.async.wait_group " #n ";" ::: "memory")
// Quad (the 4 lanes of one g) reductions by warp shuffles.
inline float quad_max(float x)
{
    float y;
    asm volatile("shfl.sync.bfly.b32 %0, %1, 1, 0x1f, 0xffffffff;" : "=f"(y) : "f"(x));
    x = fmax(x, y);
    asm volatile("shfl.sync.bfly.b32 %0, %1, 2, 0x1f, 0xffffffff;" : "=f"(y) : "f"(x));
    return fmax(x, y);
}
inline float quad_sum(float x)
{
    float y;
    asm volatile("shfl.sync.bfly.b32 %0, %1, 1, 0x1f, 0xffffffff;" : "=f"(y) : "f"(x));
    x += y;
    asm volatile("shfl.sync.bfly.b32 %0, %1, 2, 0x1f, 0xffffffff;" : "=f"(y) : "f"(x));
    return x + y;
}
// x of lane lane ^ mask of the warp, as bits.
inline uint lane_xor(uint x, uint mask)
{
    uint y;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=r"(y) : "r"(x), "r"(mask));
    return y;
}
// x of lane `src` of the warp.
inline float lane_value(float x, uint src)
{
    float y;
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(y) : "f"(x), "r"(src));
    return y;
}
// Copies global → local without registers (cp.async, sm_80 on): `bytes` of the 16 read, the rest
// zero-filled; complete for the issuing work-item once `landed` leaves fewer groups pending than
// there were after it, for the others after a barrier too. The local address is the __local
// pointer's own value, as for ldmatrix below.
inline void cp_async16(__local void *dst, __global const void *src, uint bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"((uint)(size_t)dst), "l"((ulong)src), "r"(bytes) : "memory");
}
inline void cp_async4(__local void *dst, __global const void *src, uint bytes)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
                 :: "r"((uint)(size_t)dst), "l"((ulong)src), "r"(bytes) : "memory");
}
% if kind == "tf32x3":
inline void mma_tf32(float *d, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1)
{
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
% else:
inline void mma16(float *d, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.${kind}.${kind}.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// Four 8×8 tiles of 16-bit elements in local memory into r[0..3]: lane L gives the address of row
// L % 8 of tile L / 8 (16-byte aligned); lane (g, t) gets elements (g, 2t) and (g, 2t + 1) of each
// tile (ldsm_x4: a B operand word of rows of the other factor, K rows for Q·Kᵀ), or transposed
// (2t, g) and (2t + 1, g) (ldsm_x4_trans: of rows of keys, V rows for P·V). The address is the
// __local pointer's own value: NVIDIA's OpenCL keeps it as an offset in the shared window.
% for name, trans in (("ldsm_x4", ""), ("ldsm_x4_trans", ".trans")):
inline void ${name}(uint *r, __local const ushort *row)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4${trans}.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((uint)(size_t)row) : "memory");
}
% endfor
// lo and hi rounded to nearest even and packed (lo in the low half), as an A or B operand.
inline uint pack2(float lo, float hi)
{
    uint r;
    asm("cvt.rn.${kind}x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
% endif
% endif
% if kind == "tf32x3":
// x = hi + lo to about 20 bits: hi is x itself, which the unit reads truncated to its top 19 bits
// (TF32, toward zero), lo the exact remainder x − trunc(x), read truncated too. Two instructions where
// hi rounded to nearest (a carry into bit 13, then a mask) takes three, cvt.rna.tf32.f32 twice seven
// (sm_90's SASS: a range check, an add, a select, a mask). A NaN x's lo is NaN, and so is every
// product it enters; an infinite x's lo is NaN (∞ − ∞).
inline void split(float x, uint *hi, uint *lo)
{
    *hi = as_uint(x);
    *lo = as_uint(x - as_float(as_uint(x) & 0xffffe000u));
}
% endif
% if kind != "fma":
// A quad's 4 × 4 words transposed: lane t of the quad passes word t of four tiles' rows as w[0..3]
// (a row's 16 bytes of a tile lie across the quad, word s in lane s) and gets tile t's four words in
// order, so that a row leaves in 16-byte stores. Two butterfly stages (lanes t ^ 2, then t ^ 1), two
// shuffles each: every lane of the warp takes part.
inline uint4 quad_transpose(uint *w, uint t)
{
    #pragma unroll
    for (uint bit = 2; bit > 0; bit >>= 1) {
        #pragma unroll
        for (uint j = 0; j < 4; ++j) {
            if (j & bit)
                continue;
            // words j and j + bit: the one whose bit differs from t's goes to the partner, which sends its own back there
            const bool high = (t & bit) != 0;
            const uint lo = w[j], hi = w[j + bit], got = lane_xor(high ? lo : hi, bit);
            w[j] = high ? got : lo;
            w[j + bit] = high ? hi : got;
        }
    }
    return (uint4)(w[0], w[1], w[2], w[3]);
}
% endif
</%def>

## The PTX of `decls` emulated with 32-wide sub-groups (cl_intel_subgroups with
## cl_intel_required_subgroup_size: Intel's CPU runtime), a sub-group a warp: the same functions,
## fragments and lanes, so the matrix-unit kinds' code runs and is tested where no NVIDIA GPU is
## (CLOPS_MMA=emulate). Products are exact and summed in float32 in another order than the
## hardware's; cp.async copies land at their wait (see below); the 16-bit kinds widen and round with
## common.storage's helpers, which the including template renders before.
<%def name="emulated_warps(kind, st)">\
#define WARPS __attribute__((intel_reqd_sub_group_size(32)))
// cp.async: a work-item's copies are queued (CP_ASYNC_STATE, in the kernel: up to CPA_MAX, a copy
// past them lands at once) and land at the wait that needs them, the latest the hardware may: a
// read of local memory before its copies' wait sees the old contents. 16 bytes copy as 4 words,
// 4 as 1; a copy of no bytes lands zeros.
#define CPA_MAX 64
#define CP_ASYNC_STATE __local uint *cpa_dst[CPA_MAX]; __global const uint *cpa_src[CPA_MAX]; \
    uint cpa_words[CPA_MAX], cpa_group[CPA_MAX], cpa_n = 0, cpa_g = 0;
#define CPA_LAND(i) for (uint w = 0; w < cpa_words[i]; ++w) cpa_dst[i][w] = cpa_src[i] ? cpa_src[i][w] : 0u
#define CPA_PUSH(dst, src, bytes, words) do { \
        cpa_dst[cpa_n] = (__local uint *)(dst); \
        cpa_src[cpa_n] = (bytes) ? (__global const uint *)(src) : 0; \
        cpa_words[cpa_n] = (words); \
        cpa_group[cpa_n] = cpa_g; \
        if (cpa_n < CPA_MAX - 1) ++cpa_n; else { CPA_LAND(cpa_n); } \
    } while (0)
#define cp_async16(dst, src, bytes) CPA_PUSH(dst, src, bytes, 4)
#define cp_async4(dst, src, bytes) CPA_PUSH(dst, src, bytes, 1)
#define CP_ASYNC_COMMIT() (++cpa_g)
// committed groups but the newest n land; the copies after the last commit stay queued
#define CP_ASYNC_WAIT(n) do { \
        uint keep = 0; \
        for (uint i = 0; i < cpa_n; ++i) { \
            if (cpa_group[i] + (n) < cpa_g) { \
                CPA_LAND(i); \
            } else { \
                cpa_dst[keep] = cpa_dst[i]; cpa_src[keep] = cpa_src[i]; \
                cpa_words[keep] = cpa_words[i]; cpa_group[keep] = cpa_group[i]; ++keep; \
            } \
        } \
        cpa_n = keep; \
    } while (0)
inline float quad_max(float x)
{
    x = fmax(x, intel_sub_group_shuffle_xor(x, 1u));
    return fmax(x, intel_sub_group_shuffle_xor(x, 2u));
}
inline float quad_sum(float x)
{
    x += intel_sub_group_shuffle_xor(x, 1u);
    return x + intel_sub_group_shuffle_xor(x, 2u);
}
inline uint lane_xor(uint x, uint mask)
{
    return intel_sub_group_shuffle_xor(x, mask);
}
inline float lane_value(float x, uint src)
{
    return intel_sub_group_shuffle(x, src);
}
% if kind == "tf32x3":
// mma.sync m16n8k8 TF32: the unit reads an operand's top 19 bits. Column k of A's rows g, g + 8 is
// in lane 4g + k % 4 (a0, a1 below k = 4, a2, a3 from it); row k of B's column c in lane 4c + k % 4.
__attribute__((noinline)) void mma_tf32(float *d, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1)
{
    const uint lane = get_sub_group_local_id(), g = lane / 4, t = lane % 4;
    for (uint k = 0; k < 8; ++k) {
        const uint from = k % 4;
        const float ag = as_float(intel_sub_group_shuffle(k < 4 ? a0 : a2, 4 * g + from) & 0xffffe000u);
        const float ag8 = as_float(intel_sub_group_shuffle(k < 4 ? a1 : a3, 4 * g + from) & 0xffffe000u);
        const float bc = as_float(intel_sub_group_shuffle(k < 4 ? b0 : b1, 8 * t + from) & 0xffffe000u);
        const float bc1 = as_float(intel_sub_group_shuffle(k < 4 ? b0 : b1, 8 * t + 4 + from) & 0xffffe000u);
        d[0] = fma(ag, bc, d[0]);
        d[1] = fma(ag, bc1, d[1]);
        d[2] = fma(ag8, bc, d[2]);
        d[3] = fma(ag8, bc1, d[3]);
    }
}
% else:
inline float lo16(uint w) { return clops_${st}_to_float((ushort)(w & 0xffffu)); }
inline float hi16(uint w) { return clops_${st}_to_float((ushort)(w >> 16)); }
// mma.sync m16n8k16: columns k = 2s, 2s + 1 of A's rows g, g + 8 are in lane 4g + s % 4 (a0, a1
// below k = 8, a2, a3 from it), rows k of B's column c in lane 4c + s % 4 (b0, then b1).
__attribute__((noinline)) void mma16(float *d, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1)
{
    const uint lane = get_sub_group_local_id(), g = lane / 4, t = lane % 4;
    for (uint s = 0; s < 8; ++s) {
        const uint from = s % 4;
        const uint ag = intel_sub_group_shuffle(s < 4 ? a0 : a2, 4 * g + from);
        const uint ag8 = intel_sub_group_shuffle(s < 4 ? a1 : a3, 4 * g + from);
        const uint bc = intel_sub_group_shuffle(s < 4 ? b0 : b1, 8 * t + from);
        const uint bc1 = intel_sub_group_shuffle(s < 4 ? b0 : b1, 8 * t + 4 + from);
        d[0] = fma(hi16(ag), hi16(bc), fma(lo16(ag), lo16(bc), d[0]));
        d[1] = fma(hi16(ag), hi16(bc1), fma(lo16(ag), lo16(bc1), d[1]));
        d[2] = fma(hi16(ag8), hi16(bc), fma(lo16(ag8), lo16(bc), d[2]));
        d[3] = fma(hi16(ag8), hi16(bc1), fma(lo16(ag8), lo16(bc1), d[3]));
    }
}
// ldmatrix .x4 (and .trans): tile i's rows from the addresses of lanes 8i .. 8i + 7.
inline __local const ushort *lane_row(__local const ushort *row, uint src)
{
    return (__local const ushort *)(size_t)intel_sub_group_shuffle((ulong)(size_t)row, src);
}
__attribute__((noinline)) void ldsm_x4(uint *r, __local const ushort *row)
{
    const uint lane = get_sub_group_local_id(), g = lane / 4, t = lane % 4;
    for (uint i = 0; i < 4; ++i)
        r[i] = *(__local const uint *)(lane_row(row, 8 * i + g) + 2 * t);
}
__attribute__((noinline)) void ldsm_x4_trans(uint *r, __local const ushort *row)
{
    const uint lane = get_sub_group_local_id(), g = lane / 4, t = lane % 4;
    for (uint i = 0; i < 4; ++i)
        r[i] = (uint)lane_row(row, 8 * i + 2 * t)[g] | ((uint)lane_row(row, 8 * i + 2 * t + 1)[g] << 16);
}
inline uint pack2(float lo, float hi)
{
    return (uint)clops_float_to_${st}(lo) | ((uint)clops_float_to_${st}(hi) << 16);
}
% endif
</%def>

## Work-group-wide declarations a product needs (inside the kernel, before any code); `quads`:
## the driver reduces across quads.
<%def name="locals(kind, quads=True)">\
% if kind != "fma":
    CP_ASYNC_STATE
% endif
% if kind == "fma":
    __local float pl[16 * NW * BK];     // P of each warp's rows, for P·V (a pair's twice: SX 2)
% if quads:
    __local float2 quad_red[WG];        // quad reductions
% endif
% endif
</%def>

## The A operand of the warp's 16 rows (row0 = its first row in the sequence), before the block
## loop: rows of `src` from `base` with row stride `stride` (the forward's Q; the backward's dO, K,
## V), held in `frag`. tf32x3: head-dim columns are permuted inside each k-step (a sum over them
## does not care) so that a lane's two B words are adjacent in local memory, one 64-bit load: mma
## k-index t is column 2t, t + 4 is 2t + 1. 16-bit: columns in mma.sync's order (qk's B by ldmatrix).
<%def name="load_q(kind, st, frag='qf', src='q', base='qbase', stride='qstride', cols='HD')">\
% if kind == "bf16" or kind == "f16":
    uint ${frag}[${steps16(cols)}][4];  // A fragments, 16 columns a step; columns past `cols` are zero
    #pragma unroll
    for (int s = 0; s < ${steps16(cols)}; ++s) {
${a_words(frag + "[s]", "s", src, base, stride, cols)}\
    }
% elif kind == "tf32x3":
    float ${frag}[${cols} / 8][4];  // A fragments, 8 columns a step (split when used)
    #pragma unroll
    for (int s = 0; s < ${cols} / 8; ++s) {
${tf32_a(frag + "[s]", "s", src, base, stride)}\
    }
% endif
</%def>

## The four float A values of k-step `s` (8 columns) of the warp's rows into dst[0..3], columns
## permuted as load_q says: (g, 2t), (g + 8, 2t), (g, 2t + 1), (g + 8, 2t + 1) of the step.
<%def name="tf32_a(dst, s, src, base, stride)">\
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
            const uint r = row0 + g + 8 * e;
            const float2 x = r < T ? *(__global const float2 *)(${src} + ${at(src, "%s + (idx_t)r * %s + %s * 8 + 2 * t" % (base, stride, s), 2)}) : (float2)(0.0f);
            ${dst}[e] = x.x;
            ${dst}[2 + e] = x.y;
        }
</%def>

## The four 16-bit A words of k-step `s` (16 columns; columns past HD are zero) of the warp's rows
## into dst[0..3], in mma.sync's layout: (g, 2t..2t+1), (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..).
<%def name="a_words(dst, s, src, base, stride, cols='HD')">\
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
            const uint r = row0 + g + 8 * e, d = ${s} * 16 + 2 * t;
            ${dst}[e] = (r < T && d < ${cols}) ? *(__global const uint *)(${src} + ${at(src, "%s + (idx_t)r * %s + d" % (base, stride), 2)}) : 0u;
            ${dst}[2 + e] = (r < T && d + 8 < ${cols}) ? *(__global const uint *)(${src} + ${at(src, "%s + (idx_t)r * %s + d + 8" % (base, stride), 2)}) : 0u;
        }
</%def>

## out[BK/8][4] += A·Bᵀ, A the warp's rows of load_q (`frag`; the portable kind, and the others
## with frag None, read them from `src` at `base`, row stride `stride`), B staged in bs[key * KS + d] (the driver's row0, T): the
## forward's S = Q·Kᵀ; the backward's dP = dO·Vᵀ, Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ. `cols`: the product over
## the first `cols` columns of A and B only (a partial sum; `base` and `bs` may start mid-row).
<%def name="qk(kind, st, out='s', frag='qf', bs='ks', src='q', base='qbase', stride='qstride', cols='HD')">\
% if kind == "fma":
        #pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const uint r = row0 + g + (e >> 1) * 8, key = 8 * j + 2 * t + (e & 1);
                float dot = 0.0f;
                if (r < T) {
                    for (int d = 0; d < ${cols}; ++d)
                        dot = fma(${widen(st, "%s[%s]" % (src, at(src, "%s + (idx_t)r * %s + d" % (base, stride))))}, ${widen(st, "%s[key * KS + d]" % bs)}, dot);
                }
                ${out}[j][e] += dot;
            }
        }
% elif kind == "tf32x3":
        #pragma unroll
        for (int s8 = 0; s8 < ${cols} / 8; ++s8) {
% if frag is None:
            float a[4];  // read at each step (L1-cached): no registers held across the block loop
${tf32_a("a", "s8", src, base, stride)}\
% endif
            uint ah[4], al[4];
            #pragma unroll
            for (int e = 0; e < 4; ++e) split(${"a" if frag is None else frag + "[s8]"}[e], &ah[e], &al[e]);
            #pragma unroll
            for (int j = 0; j < BK / 8; ++j) {
                const float2 b = *(const __local float2 *)(${bs} + (8 * j + g) * KS + s8 * 8 + 2 * t);
                uint bh[2], bl[2];
                split(b.x, &bh[0], &bl[0]);
                split(b.y, &bh[1], &bl[1]);
                mma_tf32(${out}[j], al[0], al[1], al[2], al[3], bh[0], bh[1]);
                mma_tf32(${out}[j], ah[0], ah[1], ah[2], ah[3], bl[0], bl[1]);
                mma_tf32(${out}[j], ah[0], ah[1], ah[2], ah[3], bh[0], bh[1]);
            }
        }
% else:
<% a = "a" if frag is None else frag + "[s16]" %>\
        #pragma unroll
        for (int s16 = 0; s16 < ${steps16(cols)}; ++s16) {
% if frag is None:
            uint a[4];  // read at each step (L1-cached): no registers held across the block loop
${a_words("a", "s16", src, base, stride, cols)}\
% endif
#if ${cols} % 16 == 0
            // B of two key tiles a load: tiles (keys 8j.., cols 16·s16..), (keys 8j.., 16·s16 + 8..),
            // then the same at keys 8(j + 1) (at 8j again past the last tile)
            #pragma unroll
            for (int j = 0; j < BK / 8; j += 2) {
                const int j2 = j + 1 < BK / 8 ? j + 1 : j;
                uint b[4];
                ldsm_x4(b, ${bs} + (8 * (lane & 16 ? j2 : j) + (lane & 7)) * KS + 16 * s16 + (lane & 8));
                mma16(${out}[j], ${a}[0], ${a}[1], ${a}[2], ${a}[3], b[0], b[1]);
                if (j + 1 < BK / 8)
                    mma16(${out}[j + 1], ${a}[0], ${a}[1], ${a}[2], ${a}[3], b[2], b[3]);
            }
#else
            #pragma unroll
            for (int j = 0; j < BK / 8; ++j) {
                // the row's padding past HD is never staged: read as zero
                const __local ushort *c = ${bs} + (8 * j + g) * KS + s16 * 16 + 2 * t;
                const uint b0 = *(const __local uint *)c, b1 = s16 * 16 + 8 < ${cols} ? *(const __local uint *)(c + 8) : 0u;
                mma16(${out}[j], ${a}[0], ${a}[1], ${a}[2], ${a}[3], b0, b1);
            }
#endif
        }
% endif
</%def>

## Reduce a (row g) and b (row g + 8) across the quad with op (fmax or +), in place. Uniform
## control flow (the portable kind holds barriers).
<%def name="quad(kind, op, a, b)">\
% if kind == "fma":
        quad_red[lid] = (float2)(${a}, ${b});
        barrier(CLK_LOCAL_MEM_FENCE);
        {
            const float2 x0 = quad_red[lid & ~3u], x1 = quad_red[(lid & ~3u) + 1],
                         x2 = quad_red[(lid & ~3u) + 2], x3 = quad_red[(lid & ~3u) + 3];
% if op == "max":
            ${a} = fmax(fmax(x0.x, x1.x), fmax(x2.x, x3.x));
            ${b} = fmax(fmax(x0.y, x1.y), fmax(x2.y, x3.y));
% else:
            ${a} = (x0.x + x1.x) + (x2.x + x3.x);
            ${b} = (x0.y + x1.y) + (x2.y + x3.y);
% endif
        }
        barrier(CLK_LOCAL_MEM_FENCE);
% else:
        ${a} = quad_${op}(${a});
        ${b} = quad_${op}(${b});
% endif
</%def>

## acc[ncol][4] += P·V, P = p[BK/8][4] (accumulator layout), V staged in bs[key * KS + col]: the
## forward's O += P·V; the backward's dQ += dS·K, dV += Pᵀ·dO and dK += dSᵀ·Q. `masked`: the exact
## form for blocks whose masked keys may hold a non-finite V: a key a row does not see
## (visible(row, c0 + key) false) is skipped, not multiplied by its zero P.
## `words` (16-bit kinds, unmasked): P's A words as stored, words[kk] a uint4 of keys 16kk.., in place of p.
<%def name="pv(kind, st, masked, visible, p='s', acc='acc', bs='vs', c0='k0', ncol='HD / 8', words=None, chains=4)">\
% if kind == "fma":
        #pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) pl[(wi * 16 + g + (e >> 1) * 8) * BK + 8 * j + 2 * t + (e & 1)] = ${p}[j][e];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const uint rl = wi * 16 + g + (e >> 1) * 8, r = row0 + g + (e >> 1) * 8;
            for (int key = 0; key < BK; ++key) {
% if masked:
                if (!(${visible("r", "%s + key" % c0)})) continue;
% endif
                const float pk = pl[rl * BK + key];
                #pragma unroll
                for (int n = 0; n < ${ncol}; ++n)
                    ${acc}[n][e] = fma(pk, ${widen(st, "%s[key * KS + 8 * n + 2 * t + (e & 1)]" % bs)}, ${acc}[n][e]);
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
% elif masked:
        // P of every key of the block from the quad's lanes, one key at a time (j and x unrolled:
        // s indexed at run time would live in memory, on every path).
        #pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
            #pragma unroll 1
            for (uint tp = 0; tp < 4; ++tp) {
                #pragma unroll
                for (int x = 0; x < 2; ++x) {
                    const uint key = 8 * j + 2 * tp + x, src = (lane & ~3u) | tp;
                    const float pg = lane_value(${p}[j][x], src), pg8 = lane_value(${p}[j][2 + x], src);
                    const bool seen = ${visible("row0 + g", "%s + key" % c0)}, seen8 = ${visible("row0 + g + 8", "%s + key" % c0)};
                    #pragma unroll
                    for (int n = 0; n < ${ncol}; ++n) {
                        #pragma unroll
                        for (int c = 0; c < 2; ++c) {
                            const float vv = ${widen(st, "%s[key * KS + 8 * n + 2 * t + c]" % bs)};
                            if (seen) ${acc}[n][c] = fma(pg, vv, ${acc}[n][c]);
                            if (seen8) ${acc}[n][2 + c] = fma(pg8, vv, ${acc}[n][2 + c]);
                        }
                    }
                }
            }
        }
% elif kind == "tf32x3":
        // Keys permuted inside each 8: mma k-index t is key 2t, t + 4 is key 2t + 1, so P's
        // accumulator fragment is its A fragment as it stands. The unit rounds its sums toward zero:
        // into acc, which runs over every block, each product would bias it by up to an ulp of acc
        // (an H100, one window of 1024: dV 1.8e-5 from float64), so each column tile's block sum
        // starts from zero and is added to acc, rounded to nearest (dV 4.3e-7; P's split parts held
        // for the block: each k-step's products from zero instead holds fewer, but ran slower).
        // `chains` column tiles at a time, each product of a k-step issued for all of them in turn:
        // that many independent chains of mma.sync where one tile's sum would wait on each product
        // (an H100: the llama-hd128 forward 8.6 % faster at 4 than at 1, qwen-hd256's backward 8.6 %).
        {  // a scope of its own: a pass may take two products in one block
            uint ah[BK / 8][4], al[BK / 8][4];
            #pragma unroll
            for (int j = 0; j < BK / 8; ++j) {
                // A word e holds (g, key 2t), (g + 8, 2t), (g, 2t + 1), (g + 8, 2t + 1): P's elements 0, 2, 1, 3
                #pragma unroll
                for (int e = 0; e < 4; ++e) split(${p}[j][(e & 1) * 2 + (e >> 1)], &ah[j][e], &al[j][e]);
            }
            #pragma unroll
            for (int n0 = 0; n0 < ${ncol}; n0 += ${chains}) {
                float blk[${chains}][4];
                #pragma unroll
                for (int i = 0; i < ${chains}; ++i) blk[i][0] = blk[i][1] = blk[i][2] = blk[i][3] = 0.0f;
                #pragma unroll
                for (int j = 0; j < BK / 8; ++j) {
                    uint bh[${chains}][2], bl[${chains}][2];
                    // (tiles past the last one, n0 + i ≥ ncol, are left out: known when unrolled)
                    #pragma unroll
                    for (int i = 0; i < ${chains}; ++i) {
                        if (n0 + i < ${ncol}) {
                            split(${bs}[(8 * j + 2 * t) * KS + 8 * (n0 + i) + g], &bh[i][0], &bl[i][0]);
                            split(${bs}[(8 * j + 2 * t + 1) * KS + 8 * (n0 + i) + g], &bh[i][1], &bl[i][1]);
                        }
                    }
% for a, b in (("al", "bh"), ("ah", "bl"), ("ah", "bh")):
                    #pragma unroll
                    for (int i = 0; i < ${chains}; ++i)
                        if (n0 + i < ${ncol}) mma_tf32(blk[i], ${a}[j][0], ${a}[j][1], ${a}[j][2], ${a}[j][3], ${b}[i][0], ${b}[i][1]);
% endfor
                }
                #pragma unroll
                for (int i = 0; i < ${chains}; ++i) {
                    if (n0 + i < ${ncol}) {
                        #pragma unroll
                        for (int e = 0; e < 4; ++e) ${acc}[n0 + i][e] += blk[i][e];
                    }
                }
            }
        }
% else:
        #pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
% if words:
            const uint a0 = ${words}[kk].s0, a1 = ${words}[kk].s1, a2 = ${words}[kk].s2, a3 = ${words}[kk].s3;
% else:
            const uint a0 = pack2(${p}[2 * kk][0], ${p}[2 * kk][1]), a1 = pack2(${p}[2 * kk][2], ${p}[2 * kk][3]);
            const uint a2 = pack2(${p}[2 * kk + 1][0], ${p}[2 * kk + 1][1]), a3 = pack2(${p}[2 * kk + 1][2], ${p}[2 * kk + 1][3]);
% endif
            // B of two column tiles a load: tiles (keys 16kk.., cols 8n..), (keys 16kk + 8.., 8n..),
            // then the same at cols 8(n + 1) (at 8n again past the last tile)
            #pragma unroll
            for (int n = 0; n < ${ncol}; n += 2) {
                const int n2 = n + 1 < ${ncol} ? n + 1 : n;
                uint b[4];
                ldsm_x4_trans(b, ${bs} + (16 * kk + (lane & 15)) * KS + 8 * (lane & 16 ? n2 : n));
                mma16(${acc}[n], a0, a1, a2, a3, b[0], b[1]);
                if (n + 1 < ${ncol})
                    mma16(${acc}[n + 1], a0, a1, a2, a3, b[2], b[3]);
            }
        }
% endif
</%def>

## Store accumulator rows row0 + g (+ 8) inside the sequence, columns col0 .. col0 + 8·ncol, each times
## `scale` (a C expression of the row half r, or None), to dst (storage type st) at base, row stride
## `stride`. `wide` (the 16-bit matrix-unit kinds, 32 dividing 8·ncol, col0 a multiple of 8): four tiles'
## words of a row transposed across the quad (quad_transpose), then 16-byte stores, a tile's 8 columns a
## lane; every lane of the warp runs it.
<%def name="store_rows(st, acc, dst, base, stride, col0='0', ncol='HD / 8', scale=None, wide=False)">
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const uint ri = row0 + g + 8 * r;
        const idx_t row = ${base} + (idx_t)ri * ${stride};
% if scale:
        const float sc = ${scale};
<% x = lambda v: "%s * sc" % v %>\
% else:
<% x = lambda v: v %>\
% endif
% if wide:
        #pragma unroll
        for (int c = 0; c < (${ncol}) / 4; ++c) {  // rows past the sequence too: the shuffles take every lane
            uint w[4];
            #pragma unroll
            for (int u = 0; u < 4; ++u)
                w[u] = (uint)clops_float_to_${st}(${x("%s[4 * c + u][2 * r]" % acc)}) |
                       ((uint)clops_float_to_${st}(${x("%s[4 * c + u][2 * r + 1]" % acc)}) << 16);
            const uint4 y = quad_transpose(w, t);
            if (ri < T)
                *(__global uint4 *)(${dst} + ${at(dst, "row + %s + 32 * c + 8 * t" % col0, 8)}) = y;
        }
% else:
        if (ri < T) {
            #pragma unroll
            for (int n = 0; n < ${ncol}; ++n) {
                const float x0 = ${x("%s[n][2 * r]" % acc)}, x1 = ${x("%s[n][2 * r + 1]" % acc)};
%   if st != "float":
                *(__global uint *)(${dst} + ${at(dst, "row + %s + 8 * n + 2 * t" % col0, 2)}) =
                    (uint)clops_float_to_${st}(x0) | ((uint)clops_float_to_${st}(x1) << 16);
%   else:
                *(__global float2 *)(${dst} + ${at(dst, "row + %s + 8 * n + 2 * t" % col0, 2)}) = (float2)(x0, x1);
%   endif
            }
        }
% endif
    }
</%def>

## Staging without registers (the drivers): rows r0 .. r0 + BK - 1 of src (from `base`,
## row stride `stride`; rows past T zero) copied into dst[row * KS + d], 16 bytes a copy, by
## cp.async on the matrix-unit kinds (in flight until `landed`), by plain loads and stores on fma.
## `commit` closes a group of copies (one group a staging step; empty groups count too).
<%def name="stage(kind, st, dst, src, r0, base='kbase', stride='kstride')">
<% ev, per = ("float4", 4) if st == "float" else ("uint4", 8) %>\
        #pragma unroll
        for (int u = 0; u < KN; ++u) {
            const uint e = lid + u * WG, r = e / (HD / ${per}), cv = e % (HD / ${per});
            if (e < BK * (HD / ${per})) {
                const bool in = ${r0} + r < T;
                const idx_t from = ${base} + (idx_t)(in ? ${r0} + r : 0) * ${stride} + cv * ${per};
% if kind == "fma":
                *(__local ${ev} *)(${dst} + r * KS + cv * ${per}) = in ? *(__global const ${ev} *)(${src} + ${at(src, "from", per)}) : (${ev})(0);
% else:
                cp_async16(${dst} + r * KS + cv * ${per}, ${src} + ${at(src, "from", per)}, in ? 16u : 0u);
% endif
            }
        }
</%def>
## n floats src[index(i)] for i < n into dst[i] (0 where `inside(i)` is false), as `stage` copies.
<%def name="stage_floats(kind, dst, src, n, index, inside)">
        for (uint i = lid; i < ${n}; i += WG) {
% if kind == "fma":
            ${dst}[i] = ${inside("i")} ? ${src}[${at(src, index("i"))}] : 0.0f;
% else:
            cp_async4(${dst} + i, ${src} + ${at(src, index("i"))}, ${inside("i")} ? 4u : 0u);
% endif
        }
</%def>
<%def name="commit(kind)">\
% if kind != "fma":
        CP_ASYNC_COMMIT();
% endif
</%def>
## Wait until at most `pending` groups of this work-item's copies are in flight.
<%def name="landed(kind, pending)">\
% if kind != "fma":
        CP_ASYNC_WAIT(${pending});
% endif
</%def>
## Set `flag` when a value that this work-item staged (stage's chunks of dst) is NaN or ±Inf. At
## 16 bits, every element of a word at once: its exponent field all ones, where (word & EXP) + ONE
## carries into the bit above the field (the element's sign bit), never into the next element; the
## sums OR-ed and tested once. (An H100, 2026-12-07, bf16 against a test per element and vector: sliding
## window 512 forward + backward +2-4 % (qwen's forward 196.9 against 188.6 TFLOP/s), causal within
## 1 %. At float32 the same word-wise test ran small-hd64's causal forward at 46.2 against 48.6, twice,
## so float32 keeps the test per vector.)
<%def name="scan(st, dst, flag)">
<%
    ev, per = ("float4", 4) if st == "float" else ("uint4", 8)
    exp_, one = ("0x7f807f80u", "0x00800080u") if st == "bf16" else ("0x7c007c00u", "0x04000400u")  # 16-bit only
%>\
        {
% if st != "float":
            uint4 sums = (uint4)(0u);
% endif
            #pragma unroll
            for (int u = 0; u < KN; ++u) {
                const uint e = lid + u * WG;
                if (e < BK * (HD / ${per})) {
                    const ${ev} x = *(__local const ${ev} *)(${dst} + e / (HD / ${per}) * KS + e % (HD / ${per}) * ${per});
% if st == "float":
                    if (any(isinf(x)) || any(isnan(x))) ${flag} = 1;
% else:
                    sums |= (x & ${exp_}) + ${one};
% endif
                }
            }
% if st != "float":
            if ((sums.x | sums.y | sums.z | sums.w) & 0x80008000u) ${flag} = 1;  // either element's sign bit
% endif
        }
</%def>

## The drivers' staging buffers: STAGES buffers of BK rows for each staged operand (1, or 2: the
## next block staged during the current one's products), block kb in buffer BUF(kb); FLAG(kb) its
## non-finite flag, of STAGES + 1 (so that the flag zeroed for the next block is nobody's then).
<%def name="buffers(stages)">\
#define STAGES ${stages}
#define FLAG(kb) ((kb) % (STAGES + 1))
#define BUF(kb) ((kb) % STAGES * (BK * KS))  // where block kb lies in its operand's buffers
</%def>

## Column halves' pairs (SX 2): warps 2i and 2i + 1 take the same 16 rows, each half of the head
## dim's columns, and complete a product over all the columns by adding the pair's partial tile
## x[BK/8][4] through xch (__local float xch[NW * 16 * BK], lane-minor): pair_share writes the
## warp's, pair_add (after a barrier) adds the pair's, own + pair's in both warps (the same bits:
## the sum commutes).
<%def name="pair_share(x)">\
        #pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) xch[((wi * (BK / 8) + j) * 4 + e) * 32 + lane] = ${x}[j][e];
        }
</%def>
<%def name="pair_add(x)">\
        #pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) ${x}[j][e] += xch[(((wi ^ 1) * (BK / 8) + j) * 4 + e) * 32 + lane];
        }
</%def>

## The drivers' geometry: head dim, warps and rows of a group (SX warps a row tile: 2 in the column
## halves' pairs below; the row tiles split among GP query heads), the staged block of BK rows, its row
## stride (padded against bank conflicts) and the 16-byte vectors each work-item fetches of it.
<%def name="geometry(st, hd, nw, bk, sx=1, gp=1)">\
<% per = 4 if st == "float" else 8 %>\
#define HD ${hd}
#define HD16 ((HD + 15) / 16)
#define NW ${nw}
#define SX ${sx}
#define GP ${gp}
#define BQ (16 * NW / SX / GP)
#define WG (32 * NW)
#define BK ${bk}
#define KS (HD + ${per})
#define KN ((BK * (HD / ${per}) + WG - 1) / WG)
</%def>
