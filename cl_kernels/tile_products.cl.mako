## Tile products of the matrix-unit attention driver (include with <%namespace>): the seam
## between the driver (grid, staging, online softmax, masking) and the hardware that multiplies.
##
## The driver works in warps of 32 work-items, each warp on 16 query rows; lane = lid % 32,
## g = lane / 4, t = lane % 4. Accumulator tiles have the layout of NVIDIA's mma.sync m16n8
## C fragment: an array x[N][4] of 16 × 8N floats, x[j][0..3] at (row g, col 8j + 2t),
## (g, 8j + 2t + 1), (g + 8, 8j + 2t), (g + 8, 8j + 2t + 1). Every def below takes or
## produces tiles in that layout, so a product is a drop-in:
##   kind "fma"     portable: plain float FMAs, operands read from local (and global) memory,
##                  quad reductions through local memory; any OpenCL device (the driver's
##                  reference on the CPU runtimes);
##   kind "tf32x3"  NVIDIA mma.sync m16n8k8 TF32 by inline PTX, each float32 operand split into
##                  hi + lo TF32 parts and three products summed (hi·hi + hi·lo + lo·hi), so the
##                  error stays near float32's; float storage;
##   kind "bf16"/"f16"  mma.sync m16n8k16 on the stored 16-bit bits, float32 accumulation; P
##                  rounded to the storage type (nearest even) only as an operand.
## Local tiles: K and V as stored (float, or ushort bits), KS elements a key.
<%!
    def widen(st, x):
        """A stored element as float."""
        return x if st == "float" else "clops_%s_to_float(%s)" % (st, x)
%>

<%def name="decls(kind, st)">\
% if kind != "fma":
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
// x of lane `src` of the warp.
inline float lane_value(float x, uint src)
{
    float y;
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(y) : "f"(x), "r"(src));
    return y;
}
% endif
% if kind == "tf32x3":
inline uint tf32(float x)
{
    uint r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
// x = hi + lo to about 22 bits: hi its TF32 rounding, lo that of the remainder.
inline void split(float x, uint *hi, uint *lo)
{
    *hi = tf32(x);
    *lo = tf32(x - as_float(*hi));
}
inline void mma_tf32(float *d, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1)
{
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
% elif kind in ("bf16", "f16"):
<% ptx = "bf16" if kind == "bf16" else "f16" %>\
inline void mma16(float *d, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.${ptx}.${ptx}.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// lo and hi rounded to nearest even and packed (lo in the low half), as an A or B operand.
inline uint pack2(float lo, float hi)
{
    uint r;
    asm("cvt.rn.${ptx}x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
% endif
</%def>

## Work-group-wide declarations a product needs (inside the kernel, before any code).
<%def name="locals(kind)">\
% if kind == "fma":
    __local float pl[BQ * BK];          // P of the group's rows, for P·V
    __local float2 quad_red[WG];        // quad reductions
% endif
</%def>

## The Q operand of the warp's 16 rows (row0 = its first row in the sequence), before the key loop.
## Head-dim columns are permuted inside each k-step (the sum Q·Kᵀ does not care) so that a lane's
## two B words of K are adjacent in local memory: one 64-bit load. tf32x3: mma k-index t is column
## 2t, t + 4 is 2t + 1; 16-bit: k-index pair (2t, 2t + 1) is columns 4t, 4t + 1, (2t + 8, 2t + 9)
## is 4t + 2, 4t + 3.
<%def name="load_q(kind, st)">\
% if kind == "bf16" or kind == "f16":
    uint qf[HD16][4];  // A fragments, 16 columns a step; columns past HD are zero
    #pragma unroll
    for (int s = 0; s < HD16; ++s) {
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
            const uint r = row0 + g + 8 * e, d = s * 16 + 4 * t;
            const uint2 x = (r < T && d < HD) ? *(__global const uint2 *)(q + ${at("q", "qbase + (idx_t)r * qstride + d", 4)}) : (uint2)(0u);
            qf[s][e] = x.x;
            qf[s][2 + e] = x.y;
        }
    }
% elif kind == "tf32x3":
    float qf[HD / 8][4];  // A fragments, 8 columns a step (split when used)
    #pragma unroll
    for (int s = 0; s < HD / 8; ++s) {
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
            const uint r = row0 + g + 8 * e;
            const float2 x = r < T ? *(__global const float2 *)(q + ${at("q", "qbase + (idx_t)r * qstride + s * 8 + 2 * t", 2)}) : (float2)(0.0f);
            qf[s][e] = x.x;
            qf[s][2 + e] = x.y;
        }
    }
% endif
</%def>

## s[BK/8][4] += Q·Kᵀ with K staged in ks[key * KS + d] (the driver's names: q, qbase, qstride, row0, T).
<%def name="qk(kind, st)">\
% if kind == "fma":
        #pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const uint r = row0 + g + (e >> 1) * 8, key = 8 * j + 2 * t + (e & 1);
                float dot = 0.0f;
                if (r < T) {
                    for (int d = 0; d < HD; ++d)
                        dot = fma(${widen(st, "q[%s]" % at("q", "qbase + (idx_t)r * qstride + d"))}, ${widen(st, "ks[key * KS + d]")}, dot);
                }
                s[j][e] += dot;
            }
        }
% elif kind == "tf32x3":
        #pragma unroll
        for (int s8 = 0; s8 < HD / 8; ++s8) {
            uint ah[4], al[4];
            #pragma unroll
            for (int e = 0; e < 4; ++e) split(qf[s8][e], &ah[e], &al[e]);
            #pragma unroll
            for (int j = 0; j < BK / 8; ++j) {
                const float2 b = *(const __local float2 *)(ks + (8 * j + g) * KS + s8 * 8 + 2 * t);
                uint bh[2], bl[2];
                split(b.x, &bh[0], &bl[0]);
                split(b.y, &bh[1], &bl[1]);
                mma_tf32(s[j], al[0], al[1], al[2], al[3], bh[0], bh[1]);
                mma_tf32(s[j], ah[0], ah[1], ah[2], ah[3], bl[0], bl[1]);
                mma_tf32(s[j], ah[0], ah[1], ah[2], ah[3], bh[0], bh[1]);
            }
        }
% else:
        #pragma unroll
        for (int s16 = 0; s16 < HD16; ++s16) {
            #pragma unroll
            for (int j = 0; j < BK / 8; ++j) {
                // the row's padding past HD is never staged: read as zero
                const uint2 b = s16 * 16 + 4 * t < HD ? *(const __local uint2 *)(ks + (8 * j + g) * KS + s16 * 16 + 4 * t) : (uint2)(0u);
                mma16(s[j], qf[s16][0], qf[s16][1], qf[s16][2], qf[s16][3], b.x, b.y);
            }
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

## acc[HD/8][4] += P·V, P = s[BK/8][4] (accumulator layout), V staged in vs[key * KS + col].
## `masked`: the exact form for blocks whose masked keys may hold a non-finite V: a key a row
## does not see (visible(row, key) false) is skipped, not multiplied by its zero P.
<%def name="pv(kind, st, masked, visible)">\
% if kind == "fma":
        #pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) pl[(wi * 16 + g + (e >> 1) * 8) * BK + 8 * j + 2 * t + (e & 1)] = s[j][e];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const uint rl = wi * 16 + g + (e >> 1) * 8, r = row0 + g + (e >> 1) * 8;
            for (int key = 0; key < BK; ++key) {
% if masked:
                if (!(${visible("r", "k0 + key")})) continue;
% endif
                const float pk = pl[rl * BK + key];
                #pragma unroll
                for (int n = 0; n < HD / 8; ++n)
                    acc[n][e] = fma(pk, ${widen(st, "vs[key * KS + 8 * n + 2 * t + (e & 1)]")}, acc[n][e]);
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
                    const float pg = lane_value(s[j][x], src), pg8 = lane_value(s[j][2 + x], src);
                    const bool seen = ${visible("row0 + g", "k0 + key")}, seen8 = ${visible("row0 + g + 8", "k0 + key")};
                    #pragma unroll
                    for (int n = 0; n < HD / 8; ++n) {
                        #pragma unroll
                        for (int c = 0; c < 2; ++c) {
                            const float vv = ${widen(st, "vs[key * KS + 8 * n + 2 * t + c]")};
                            if (seen) acc[n][c] = fma(pg, vv, acc[n][c]);
                            if (seen8) acc[n][2 + c] = fma(pg8, vv, acc[n][2 + c]);
                        }
                    }
                }
            }
        }
% elif kind == "tf32x3":
        // Keys permuted inside each 8: mma k-index t is key 2t, t + 4 is key 2t + 1, so P's
        // accumulator fragment is its A fragment as it stands.
        #pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
            uint ah[4], al[4];
            split(s[j][0], &ah[0], &al[0]);
            split(s[j][2], &ah[1], &al[1]);
            split(s[j][1], &ah[2], &al[2]);
            split(s[j][3], &ah[3], &al[3]);
            #pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                const float2 b = (float2)(vs[(8 * j + 2 * t) * KS + 8 * n + g], vs[(8 * j + 2 * t + 1) * KS + 8 * n + g]);
                uint bh[2], bl[2];
                split(b.x, &bh[0], &bl[0]);
                split(b.y, &bh[1], &bl[1]);
                mma_tf32(acc[n], al[0], al[1], al[2], al[3], bh[0], bh[1]);
                mma_tf32(acc[n], ah[0], ah[1], ah[2], ah[3], bl[0], bl[1]);
                mma_tf32(acc[n], ah[0], ah[1], ah[2], ah[3], bh[0], bh[1]);
            }
        }
% else:
        #pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            const uint a0 = pack2(s[2 * kk][0], s[2 * kk][1]), a1 = pack2(s[2 * kk][2], s[2 * kk][3]);
            const uint a2 = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]), a3 = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            #pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                const __local ushort *c = vs + (16 * kk + 2 * t) * KS + 8 * n + g;
                const uint2 b = (uint2)((uint)c[0] | ((uint)c[KS] << 16), (uint)c[8 * KS] | ((uint)c[9 * KS] << 16));
                mma16(acc[n], a0, a1, a2, a3, b.x, b.y);
            }
        }
% endif
</%def>
