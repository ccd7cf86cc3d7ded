// clops attention forward: causal grouped-query flash attention inside windows.
//
// Layout: q [n, nh, HD], k and v [n, nkv, HD], o [n, nh, HD] of storage type ST
// (float, half or bf16: loads widen into the float tiles, o's store rounds to nearest
// even; math is float32), lse [n, nh] float32; row-major; n = windows·T. Work-group (h, w, b) computes query
// head h of window w for the BQ query rows of block b; blocks are numbered
// in reverse so the heaviest (last) blocks start first.
//
// Work-item (ty, tx) owns RQ query rows ty·RQ + i. Per key block of BK keys:
//   1. S = Q·Kᵀ: Q and K are staged DC head-dim columns at a time; the
//      work-item scores keys j·TX + tx (j < RK) of its rows in registers.
//      When one chunk holds the whole head dim, Q is staged once and stays.
//   2. Online softmax in the log2 domain (c = scale·log2 e folded into S):
//      the row max goes through local memory across the TX work-items of a
//      row; each keeps a partial row sum and rescales its own output rows;
//      P is written transposed to local memory.
//   3. O += P·V: V is staged KC keys at a time; the work-item accumulates
//      RQ rows × RDV vectors of VW columns, columns (j·TX + tx)·VW.
// The K (and Q) chunks of step 1 and the Pᵀ and V of steps 2-3 share local
// memory: a barrier lies between the last read of one and the first write of
// the other (the row-max barrier; the first barrier of the next block's step 1).
// Every chunk is fetched into registers one step ahead (the next Q/K chunk,
// the first V chunk, the next block's first Q/K chunk) so global latency
// hides behind the current step's arithmetic.
// Only blocks holding a visible key are visited; masking (key > query, or key
// past the window) is applied to every score, so a partial last block needs no
// separate path; in blocks crossing the diagonal, P·V skips the masked keys
// (0·NaN would carry a NaN of V into earlier rows). Every barrier is in
// uniform control flow.
//
// Parameters: BQ query rows per group, RQ rows per work-item, TX work-items
// across keys/columns, BK keys per block, VW vector width, DC head-dim chunk
// of Q·Kᵀ, KC key chunk of P·V, HD head dim (HDP: padded to TX·VW), ST storage type.
//
// Variants (flags; causal = 1 and the others 0 give the kernel described above):
// causal = 0: every key of the window is seen; sliding: only keys with
// i − W < j (and, not causal, j < i + W), the key blocks outside that band
// skipped; softcap: scores c·tanh(s/c) (kernel argument cap = c·log2 e, and c
// the scale / c); varlen: window w is the sequence cu[w] .. cu[w + 1] (Tmax the
// longest); a group past its sequence's end visits no block and stores nothing
// (it does not return early: PoCL 3.1 and Intel's CPU runtime then stored rows
// past the end of another group's sequence).
<%!
    from clops.attn import visible_condition
%>\
<%
    hdp = -(-hd // (tx * vw)) * (tx * vw)
    resident = dc >= hd
    pw = 4 if rq % 4 == 0 else (2 if rq % 2 == 0 else 1)
    rw = 4 if tx % 4 == 0 else (2 if tx % 2 == 0 else 1)
    comps = [""] if vw == 1 else [".s%d" % e for e in range(vw)]
    plain = causal and not sliding                 # the causal triangle: the kernel without variants

    def visible(i, j):                             # query position i sees key position j (None: always)
        return visible_condition(causal, sliding, i, j)
    tok0 = "tok0" if varlen else "w * T"           # the window's (sequence's) first token
    kb_first = "0" if plain and not varlen else "kb0"  # the first key block visited
    pcomps = [""] if pw == 1 else [".s%d" % e for e in range(pw)]
    rcomps = [""] if rw == 1 else [".s%d" % e for e in range(rw)]
%>
<%namespace name="common" file="common.cl.mako"/>\
#define HD ${hd}
#define HDP ${hdp}
#define BQ ${bq}
#define RQ ${rq}
#define TX ${tx}
#define TY (BQ / RQ)
#define WG (TX * TY)
#define BK ${bk}
#define RK (BK / TX)                 // keys per work-item per block
#define VW ${vw}
#define DC ${dc}
#define NDC ((HD + DC - 1) / DC)     // head-dim chunks of Q·Kᵀ
#define KC ${kc}
#define RDV (HDP / (TX * VW))        // output vectors per work-item per row
#define QKS (DC / VW + 1)            // row stride (vectors) of staged Q/K, padded against bank conflicts
#define VS (HDP / VW + 1)            // row stride (vectors) of staged V
#define PW ${pw}                     // vector width of P rows
#define PS ((BQ + 4) / PW)           // row stride (vectors) of Pᵀ
#define RW ${rw}                     // vector width of reads of per-row partials
#define QN ((BQ * (DC / VW) + WG - 1) / WG)   // vectors each work-item fetches per Q chunk
#define KN ((BK * (DC / VW) + WG - 1) / WG)   // ... per K chunk
#define VN ((KC * (HDP / VW) + WG - 1) / WG)  // ... per V chunk
#define PTV ((BK * PS * PW + VW - 1) / VW)   // Pᵀ size in vectors of VW
// Phase 1 stages K (and Q unless resident), phases 2-3 Pᵀ and V: never live at once, so they share.
#define STAGE_A (${"BK" if resident else "(BQ + BK)"} * QKS)
#define STAGE_C (PTV + KC * VS)
#define STAGE (STAGE_A > STAGE_C ? STAGE_A : STAGE_C)
typedef ${idx} idx_t;
typedef ${vtype(vw)} vec_t;
typedef ${vtype(pw)} pvec_t;
typedef ${vtype(rw)} rvec_t;
${common.guards()}\
${common.storage(st)}\

## Fetch rows [r0, r0 + rows) × vector columns [c0, c0 + cols) of src into registers dst[n];
## rows past the window and columns past the head dim read as zero.
<%def name="fetch(dst, n, rows, cols, src, base, stride, r0, c0)">
            #pragma unroll
            for (int u = 0; u < ${n}; ++u) {
                const uint e = lid + u * WG, r = e / (${cols}), d = (${c0}) + e % (${cols});
                ${dst}[u] = (e < (${rows}) * (${cols}) && (${r0}) + r < T && d < HD / VW)
                    ? ${loadv(st, vw, src, "%s + ((%s) + r) * %s + d" % (base, r0, stride))} : (vec_t)(0.0f);
            }
</%def>
## Store the fetched registers src[n] into local rows of `stride` vectors.
<%def name="put(dst, src, n, rows, cols, stride)">
            #pragma unroll
            for (int u = 0; u < ${n}; ++u) {
                const uint e = lid + u * WG;
                if (e < (${rows}) * (${cols})) ${dst}[e / (${cols}) * ${stride} + e % (${cols})] = ${src}[u];
            }
</%def>

## O += P·V over the KC staged keys. In blocks crossing the mask's edges (`masked`), a key
## a row does not see is skipped rather than multiplied by its zero P, so a NaN in V stays
## out of the rows that cannot see it.
<%def name="pv(masked)">
                #pragma unroll
                for (int kk = 0; kk < KC; ++kk) {
                    float pr[RQ];
                    #pragma unroll
                    for (int i = 0; i < RQ; i += PW) {
                        const pvec_t pv = pt[(cc * KC + kk) * PS + (ty * RQ + i) / PW];
% for e, pc in enumerate(pcomps):
                        pr[i + ${e}] = pv${pc};
% endfor
                    }
                    #pragma unroll
                    for (int j = 0; j < RDV; ++j) {
                        const vec_t vv = vs[kk * VS + j * TX + tx];
                        #pragma unroll
                        for (int i = 0; i < RQ; ++i) {
% if masked:
                            if (${visible("q0 + ty * RQ + i", "k0 + cc * KC + kk")})
% endif
                            acc[i][j] = fma((vec_t)(pr[i]), vv, acc[i][j]);
                        }
                    }
                }
</%def>

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void attention_fwd(__global const ${vptr(st, vw)} *restrict q, __global const ${vptr(st, vw)} *restrict k,
                   __global const ${vptr(st, vw)} *restrict v, __global ${vptr(st, vw)} *restrict o, __global float *restrict lse,${"""
                   __global const int *restrict cu,""" if varlen else ""}
                   const uint ${"Tmax" if varlen else "T"}, const uint nh, const uint rep, const float c${", const uint W" if sliding else ""}${", const float cap" if softcap else ""}${checked_args(*["q", "k", "v", "o", "lse"] + ["cu"] * varlen)})
{
    // K chunks (and Q chunks unless resident), then Pᵀ and V chunks; aligned for Pᵀ's vectors too.
    __local vec_t stage[STAGE] __attribute__((aligned(16)));
    __local pvec_t *pt = (__local pvec_t *)stage;  // Pᵀ: pt[key][row]
    __local vec_t *vs = stage + PTV;
    __local rvec_t red[BQ * TX / RW]; // per-row partials of the TX work-items of a row
    __local float *reds = (__local float *)red;
% if resident:
    __local vec_t qs[BQ * QKS];
    __local vec_t *ks = stage;
% else:
    __local vec_t *qs = stage, *ks = stage + BQ * QKS;
% endif

    const uint lid = get_local_id(0), tx = lid % TX, ty = lid / TX;
    const uint h = get_group_id(0), w = get_group_id(1);
    const uint q0 = (get_num_groups(2) - 1 - get_group_id(2)) * BQ;
% if varlen:
    const uint tok0 = cu[${at("cu", "w")}], T = cu[${at("cu", "w + 1")}] - tok0;
% endif
    const uint nkv = nh / rep;
    // Row strides and bases in vectors.
    const uint qstride = nh * (HD / VW), kstride = nkv * (HD / VW);
    const idx_t qbase = (idx_t)${tok0} * qstride + h * (HD / VW);
    const idx_t kbase = (idx_t)${tok0} * kstride + (h / rep) * (HD / VW);
% if plain and not varlen:
    const uint nkb = (min(q0 + BQ, T) - 1) / BK + 1;
% else:
    // the key blocks holding a key that a row of the block sees (none past the sequence's end)
    const uint qlast = min(q0 + BQ, T) - 1;
    const uint kb0 = ${"q0 + 1 > W ? (q0 + 1 - W) / BK : 0" if sliding else "0"};
    const uint nkb = q0 < T ? (${"qlast + 1" if causal else ("min(T, qlast + W)" if sliding else "T")} - 1) / BK + 1 : 0;
% endif

    vec_t acc[RQ][RDV];
    float m[RQ], l[RQ];
    #pragma unroll
    for (int i = 0; i < RQ; ++i) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        #pragma unroll
        for (int j = 0; j < RDV; ++j) acc[i][j] = (vec_t)(0.0f);
    }

    vec_t qr[QN], kr[KN], vr[VN];
    ${fetch("qr", "QN", "BQ", "DC / VW", "q", "qbase", "qstride", "q0", "0")}
    ${fetch("kr", "KN", "BK", "DC / VW", "k", "kbase", "kstride", "%s * BK" % kb_first if kb_first != "0" else "0", "0")}
    for (uint kb = ${kb_first}; kb < nkb; ++kb) {
        const uint k0 = kb * BK;
        float s[RQ][RK];
        #pragma unroll
        for (int i = 0; i < RQ; ++i) {
            #pragma unroll
            for (int j = 0; j < RK; ++j) s[i][j] = 0.0f;
        }
        for (uint dc = 0; dc < NDC; ++dc) {
            barrier(CLK_LOCAL_MEM_FENCE);
% if resident:
            if (kb == ${kb_first}) {
                ${put("qs", "qr", "QN", "BQ", "DC / VW", "QKS")}
            }
% else:
            ${put("qs", "qr", "QN", "BQ", "DC / VW", "QKS")}
% endif
            ${put("ks", "kr", "KN", "BK", "DC / VW", "QKS")}
            barrier(CLK_LOCAL_MEM_FENCE);
            if (dc + 1 < NDC) {
% if not resident:
                ${fetch("qr", "QN", "BQ", "DC / VW", "q", "qbase", "qstride", "q0", "(dc + 1) * (DC / VW)")}
% endif
                ${fetch("kr", "KN", "BK", "DC / VW", "k", "kbase", "kstride", "k0", "(dc + 1) * (DC / VW)")}
            } else {
                ${fetch("vr", "VN", "KC", "HDP / VW", "v", "kbase", "kstride", "k0", "0")}
            }
            #pragma unroll
            for (int d = 0; d < DC / VW; ++d) {
                vec_t qv[RQ], kv[RK];
                #pragma unroll
                for (int i = 0; i < RQ; ++i) qv[i] = qs[(ty * RQ + i) * QKS + d];
                #pragma unroll
                for (int j = 0; j < RK; ++j) kv[j] = ks[(j * TX + tx) * QKS + d];
                #pragma unroll
                for (int i = 0; i < RQ; ++i) {
                    #pragma unroll
                    for (int j = 0; j < RK; ++j) {
% for e in comps:
                        s[i][j] = fma(qv[i]${e}, kv[j]${e}, s[i][j]);
% endfor
                    }
                }
            }
        }

        // Mask and scale${" (and cap)" if softcap else ""}; partial row maxima to local memory.
        #pragma unroll
        for (int i = 0; i < RQ; ++i) {
            const uint qi = q0 + ty * RQ + i;
            float mx = -INFINITY;
            #pragma unroll
            for (int j = 0; j < RK; ++j) {
                const uint kj = k0 + j * TX + tx;
                s[i][j] = (${" && ".join(x for x in (visible("qi", "kj"), "kj < T") if x)}) ? ${"cap * tanh(s[i][j] * c)" if softcap else "s[i][j] * c"} : -INFINITY;
                mx = fmax(mx, s[i][j]);
            }
            reds[(ty * RQ + i) * TX + tx] = mx;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
% if sliding:
        // A row may see no key of the first blocks (its band starts later): m stays -inf, and
        // mref = 0 keeps its sums at 0 rather than NaN (exp2(-inf - -inf)).
% else:
        // Block 0 always holds key 0, visible to every row, so m is finite from the first block on.
% endif
        float p[RQ][RK];
        #pragma unroll
        for (int i = 0; i < RQ; ++i) {
            float mnew = m[i];
            #pragma unroll
            for (int t = 0; t < TX / RW; ++t) {
                const rvec_t x = red[(ty * RQ + i) * (TX / RW) + t];
% for e in rcomps:
                mnew = fmax(mnew, x${e});
% endfor
            }
% if sliding:
            const float mref = mnew == -INFINITY ? 0.0f : mnew;
% endif
            const float corr = exp2(m[i] - ${"mref" if sliding else "mnew"});
            m[i] = mnew;
            l[i] *= corr;
            #pragma unroll
            for (int j = 0; j < RDV; ++j) acc[i][j] *= corr;
            #pragma unroll
            for (int j = 0; j < RK; ++j) {
                p[i][j] = exp2(s[i][j] - ${"mref" if sliding else "mnew"});
                l[i] += p[i][j];
            }
        }
        #pragma unroll
        for (int j = 0; j < RK; ++j) {
            #pragma unroll
            for (int i = 0; i < RQ; i += PW) {
                pvec_t pv;
% for e, pc in enumerate(pcomps):
                pv${pc} = p[i + ${e}][j];
% endfor
                pt[(j * TX + tx) * PS + (ty * RQ + i) / PW] = pv;
            }
        }

        for (uint cc = 0; cc < BK / KC; ++cc) {
            barrier(CLK_LOCAL_MEM_FENCE);
            ${put("vs", "vr", "VN", "KC", "HDP / VW", "VS")}
            barrier(CLK_LOCAL_MEM_FENCE);
            if (cc + 1 < BK / KC) {
                ${fetch("vr", "VN", "KC", "HDP / VW", "v", "kbase", "kstride", "k0 + (cc + 1) * KC", "0")}
            } else if (kb + 1 < nkb) {
% if not resident:
                ${fetch("qr", "QN", "BQ", "DC / VW", "q", "qbase", "qstride", "q0", "0")}
% endif
                ${fetch("kr", "KN", "BK", "DC / VW", "k", "kbase", "kstride", "k0 + BK", "0")}
            }
<%
            # blocks where some row does not see some key: past the diagonal, before the band, after it
            edges = [x for x in ("k0 + BK - 1 > q0" if causal else None, "q0 + BQ > k0 + W" if sliding else None,
                                 "k0 + BK > q0 + W" if sliding and not causal else None) if x]
%>\
% if edges:
            if (${" || ".join(edges)}) {
                ${pv(True)}
            } else {
                ${pv(False)}
            }
% else:
            ${pv(False)}
% endif
        }
    }

    // Row sums across the TX work-items of a row (red was last read before the P·V barriers).
    #pragma unroll
    for (int i = 0; i < RQ; ++i) reds[(ty * RQ + i) * TX + tx] = l[i];
    barrier(CLK_LOCAL_MEM_FENCE);
    #pragma unroll
    for (int i = 0; i < RQ; ++i) {
        const uint qi = q0 + ty * RQ + i;
        float lt = 0.0f;
        #pragma unroll
        for (int t = 0; t < TX / RW; ++t) {
            const rvec_t x = red[(ty * RQ + i) * (TX / RW) + t];
% for e in rcomps:
            lt += x${e};
% endfor
        }
        if (qi < T) {
            const idx_t row = qbase + qi * qstride;
            #pragma unroll
            for (int j = 0; j < RDV; ++j) {
                if (j * TX + tx < HD / VW) ${storev(st, vw, "acc[i][j] / lt", "o", "row + j * TX + tx")};
            }
            if (tx == 0) lse[${at("lse", "((idx_t)%s + qi) * nh + h" % tok0)}] = m[i] * M_LN2_F + log(lt);
        }
    }
}
