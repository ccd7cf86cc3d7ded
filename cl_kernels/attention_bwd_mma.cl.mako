// clops attention backward, matrix-unit driver: the gradients of attention_fwd_mma.cl.mako's
// forward (the same op as attention_bwd.cl.mako: layout, variants, arguments), organised for the
// warp-level tile products of tile_products.cl.mako. Rendered once per pass (`pass_`):
//   "dq":  attn_bwd_dq. Work-group (h, w, b) takes query head h of window (sequence) w for the
//          BQ = 16·NW query rows of block b (last blocks first); warp wi owns 16 rows. It first
//          computes D = Σ dO·O of its rows and stores it in `dsum` (for the dkv pass), holds
//          Q and dO as A operands, then per key block of BK keys (K and V staged in local
//          memory): S = Q·Kᵀ, dP = dO·Vᵀ, P = exp2(S·c − lse·log2 e), dS = P·(dP − D)·scale,
//          dQ += dS·K.
//   "dkv": attn_bwd_dkv, enqueued after dq (it reads D). Work-group (g, w, b) takes kv head g
//          of window w for the BQ = 16·NW keys of block b; warp wi owns 16 keys, holding K and V
//          as A operands. For each query head of the kv head and each block of BK queries (Q,
//          dO staged, with their lse and D): Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, Pᵀ and dSᵀ as above,
//          dV += Pᵀ·dO, dK += dSᵀ·Q, summed over the query heads in order; written once.
//          With STORE_DS it also writes dS into `ds` (below), and runs first: D comes from
//          attn_bwd_dsum.
//   "dqs": attn_bwd_dsum (D of every row, before dkv) and attn_bwd_dqs, after dkv with STORE_DS: the
//          groups of "dq", dQ += dS·K from the stored dS, per key block of BK keys (K staged):
//          one product a block pair where "dq" has three.
// The stored dS: tiles of 16 queries × 16 keys, only those holding a pair some query sees (key
// tiles TILE_LO(qt) .. TILE_HI(qt) of query tile qt), each 256 elements in the order the dqs
// lanes take them as A operands: lane l's 8 (16 bytes at 16-bit storage) are (query g, keys 2t,
// 2t + 1), (g + 8, 2t), (g + 8, 2t + 1), then the same at keys + 8. Causal over equal windows,
// the triangle of each window and head (kt ≤ qt); otherwise RT tiles a query tile (a band from
// TILE_LO), query tiles numbered per window, or from tok0 / 16 + w in a sequence of cu_seqlens
// (each sequence's count fits before the next's). dS is stored as the product takes it: rounded
// to the storage type on the 16-bit kinds, float otherwise.
// So every pass is "16 rows a warp × a staged block of BK": BQ the group's rows, BK the block,
// the names tile_products.cl.mako uses. Masked pairs get P = dS = 0 by selection (a NaN of dO,
// V, Q or D stays out of them); a block crossing the mask's edges whose staged B operand (K in
// dq; Q or dO in dkv) holds a NaN or ±Inf takes the products' exact masked form, so that value
// reaches only the gradients that depend on it. Rows and keys past the sequence are zero and
// never stored. Every sum has a fixed order: bitwise reproducible.
//
// Parameters: NW warps per group, BK block size (a multiple of 16), HD head dim (a multiple of
// 8), ST storage type, KIND the tile product (fma, tf32x3, bf16, f16); AF: the matrix-unit products fetch the
// warp's A operands (Q and dO, or K and V) once, held in registers (1), or from global memory at
// each step, L1-cached (2); dkv only, CS: the group computes 1/CS of dK's and dV's head-dim
// columns (CS groups per key block, each computing S and dP: fewer registers for more work); SX
// (with CS 2): 1, or 2 for the two column halves taken by the two warps of a pair in one group
// (8·NW keys a group), each computing S and dP over its half of the columns and adding the
// pair's partial sums through local memory (the same bits in both: the sum commutes). STORE_DS (dkv):
// the stored dS above. STAGES (dq): buffers of K and V, 1 (three barriers a block), or 2 (block
// kb + 1's staged during all of block kb's products, one barrier a block).
<%!
    from clops.attn import dsum_lanes, mask_edges, visible_condition
    from clops.program import ctype
%>\
<%
    narrow = st != "float"
    et = ctype(st)                          # a stored element: float, or ushort bits
    ev = "uint4" if narrow else "float4"    # 16 bytes of them
    tok0 = "tok0" if varlen else "w * T"
    stored = pass_ == "dqs" or store_ds
    dse = st if kind in ("bf16", "f16") else "float"  # a stored dS element: as the product takes it
    band = sliding or varlen or not causal            # the stored dS in rows of RT tiles, not triangles

    def visible(i, j):                      # query position i sees key position j
        return visible_condition(causal, sliding, i, j) or "1"

%>\
<%namespace name="common" file="common.cl.mako"/>\
<%namespace name="tp" file="tile_products.cl.mako"/>\
${tp.geometry(st, hd, nw, bk)}\
#define LOG2E 1.4426950408889634f
typedef ${idx} idx_t;
${common.guards()}\
${common.storage(st)}\
${tp.decls(kind, st, emulate)}\
% if stored:
// key tiles of query tile qt that hold a pair some query sees, and the first element of tile (qt, kt) of head h
#define TILE_LO(qt) ${"(16 * (qt) + 1 > W ? (16 * (qt) + 1 - W) / 16 : 0)" if sliding else "0u"}
#define TILE_HI(qt) ${"(qt)" if causal else ("(min(T - 1, 16 * (qt) + 14 + W) / 16)" if sliding else "((T - 1) / 16)")}
%   if band:
#define DS_TILE(h, qt, kt) ((((idx_t)(${"tok0 / 16 + w" if varlen else "w * ((T + 15) / 16)"} + (qt)) * nh + (h)) * RT + (kt) - TILE_LO(qt)) * 256)
%   else:
#define DS_TILE(h, qt, kt) (((idx_t)(w * nh + (h)) * ((idx_t)((T + 15) / 16) * ((T + 15) / 16 + 1) / 2) + (idx_t)(qt) * ((qt) + 1) / 2 + (kt)) * 256)
%   endif
% endif

## P (into `p`) and dS (into `ds`) of the warp's tile from S in `p` and dP in `ds`, in place:
## element (j, e) is query `qi`, key `kj` (C expressions of j and e); nl2 and dd its query's
## −lse·log2 e and D. Pairs outside the mask or the sequence get 0 when `full` (a C condition,
## uniform across the group: every pair of the block is inside both) is false.
<%def name="coefficients(p, ds, qi, kj, nl2, dd, full)">
        if (${full}) {
${coefficient_loop(p, ds, qi, kj, nl2, dd, False)}\
        } else {
${coefficient_loop(p, ds, qi, kj, nl2, dd, True)}\
        }
</%def>
<%def name="coefficient_loop(p, ds, qi, kj, nl2, dd, masked)">\
            #pragma unroll
            for (int j = 0; j < BK / 8; ++j) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
% if softcap:
                    // the cap's derivative 1 − tanh² folded into dS
                    const float th = score_tanh(${p}[j][e] * c), pe = softmax_exp2(cap * th + ${nl2});
                    const float dse = pe * (1.0f - th * th) * (${ds}[j][e] - ${dd}) * scale;
% else:
                    const float pe = softmax_exp2(${p}[j][e] * c + ${nl2}), dse = pe * (${ds}[j][e] - ${dd}) * scale;
% endif
% if masked:
                    const uint qi = ${qi}, kj = ${kj};
                    const bool seen = ${visible("qi", "kj")} && qi < T && kj < T;
                    ${ds}[j][e] = seen ? dse : 0.0f;
                    ${p}[j][e] = seen ? pe : 0.0f;
% else:
                    ${ds}[j][e] = dse;
                    ${p}[j][e] = pe;
% endif
                }
            }
</%def>

## Zeroed accumulator tiles.
<%def name="zeros(name, cols)">
    float ${name}[${cols}][4];
    #pragma unroll
    for (int n = 0; n < ${cols}; ++n) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) ${name}[n][e] = 0.0f;
    }
</%def>

## dkv: stage block `b`'s dO rows and D (which "dO") or Q rows and lse (which "q"), one group of copies.
<%def name="stage_block(b, which)">
        {
            const uint hb = gk * rep + (${b}) / nqb, qb = qfirst + (${b}) % nqb * BK;
            const idx_t qbb = (idx_t)${tok0} * qstride + hb * HD;
% if which == "dO":
${tp.stage(kind, st, "dst", "dO", "qb", "qbb", "qstride")}\
${tp.stage_floats(kind, "dds", "dsum", "BK", lambda i: "((idx_t)%s + min(qb + %s, T - 1)) * nh + hb" % (tok0, i), lambda i: "qb + %s < T" % i)}\
% else:
${tp.stage(kind, st, "qst", "q", "qb", "qbb", "qstride")}\
${tp.stage_floats(kind, "nl2s", "lse", "BK", lambda i: "((idx_t)%s + min(qb + %s, T - 1)) * nh + hb" % (tok0, i), lambda i: "qb + %s < T" % i)}\
% endif
${tp.commit(kind)}\
        }
</%def>
## dkv: acc += coefficients `p` (transposed) · the staged block `bs` (dV += Pᵀ·dO, dK += dSᵀ·Q), in
## the exact masked form when the block crosses the mask's edges and holds a NaN or ±Inf.
<%def name="flagged(p, acc, bs, masked, seen_t)">\
<% args = dict(p=p, acc=acc, bs="(%s + col0)" % bs, c0="q0", ncol="HD / %d / 8" % cs) %>\
% if masked:
        if (edge && nonfinite[blk & 1]) {
${tp.pv(kind, st, True, seen_t, **args)}\
        } else {
${tp.pv(kind, st, False, seen_t, **args)}\
        }
% else:
${tp.pv(kind, st, False, seen_t, **args)}\
% endif
</%def>
## dq and dqs: the group's query rows (head h of window w, block q0 of BQ rows, warp wi's from row0), the
## rows' and keys' bases, and the key blocks kb0 .. nkb − 1 holding a key that a row of the block sees.
<%def name="query_rows()">\
    const uint lid = get_local_id(0), lane = lid % 32, wi = lid / 32, g = lane / 4, t = lane % 4;
    const uint h = get_group_id(0), w = get_group_id(1);
    const uint q0 = (get_num_groups(2) - 1 - get_group_id(2)) * BQ, row0 = q0 + wi * 16;
% if varlen:
    const uint tok0 = cu[${at("cu", "w")}], T = cu[${at("cu", "w + 1")}] - tok0;
% endif
    const uint nkv = nh / rep;
    const uint qstride = nh * HD, kstride = nkv * HD;  // elements
    const idx_t qbase = (idx_t)${tok0} * qstride + h * HD;
    const idx_t kbase = (idx_t)${tok0} * kstride + (h / rep) * HD;
    // the key blocks holding a key that a row of the block sees (none past the sequence's end)
    const uint qlast = min(q0 + BQ, T) - 1;
    const uint kb0 = ${"q0 + 1 > W ? (q0 + 1 - W) / BK : 0" if sliding else "0"};
    const uint nkb = q0 < T ? (${"qlast + 1" if causal else ("min(T, qlast + W)" if sliding else "T")} - 1) / BK + 1 : 0;
</%def>
% if pass_ == "dq":
${tp.buffers(stages)}\
__kernel __attribute__((reqd_work_group_size(WG, 1, 1))) WARPS
void attn_bwd_dq(__global const ${et} *restrict q, __global const ${et} *restrict k,
                 __global const ${et} *restrict v, __global const ${et} *restrict o,
                 __global const ${et} *restrict dO, __global const float *restrict lse,
                 __global float *restrict dsum, __global ${et} *restrict dq,${"""
                 __global const int *restrict cu,""" if varlen else ""}
                 const uint ${"Tmax" if varlen else "T"}, const uint nh, const uint rep, const float c, const float scale${", const uint W" if sliding else ""}${", const float cap" if softcap else ""}${checked_args(*["q", "k", "v", "o", "dO", "lse", "dsum", "dq"] + ["cu"] * varlen)})
{
    __local ${et} kst[STAGES * BK * KS] __attribute__((aligned(16))), vst[STAGES * BK * KS] __attribute__((aligned(16)));
    __local int nonfinite[STAGES + 1];        // K of block kb holds a NaN or ±Inf: nonfinite[FLAG(kb)]
${tp.locals(kind, quads=False)}\

${query_rows()}

    // D = Σ dO·O of rows g and g + 8, stored for the dkv pass, and −lse·log2 e of the rows, held
    // negated: Intel's CPU runtime, optimising, keeps one copy per work-group of a negation it makes
    // (s·c − l2 contracted to fma(s, c, −l2)) when it lives across barriers, and gave every row the
    // last lane's (README: known limitations). Each lane sums the whole rows (the quad's lanes agree
    // without a reduction).
    float dd[2] = {0.0f, 0.0f}, nl2[2] = {0.0f, 0.0f};
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const uint qi = row0 + g + 8 * r;
        if (qi < T) {
            const idx_t row = qbase + (idx_t)qi * qstride;
            for (uint d = 0; d < HD; d += 4)
                dd[r] += dot(${load(st, 4, "o", at("o", "row + d", 4), aligned=True)}, ${load(st, 4, "dO", at("dO", "row + d", 4), aligned=True)});
            nl2[r] = lse[${at("lse", "((idx_t)%s + qi) * nh + h" % tok0)}] * -LOG2E;
        }
    }
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const uint qi = row0 + g + 8 * r;
        if (qi < T && t == 0) dsum[${at("dsum", "((idx_t)%s + qi) * nh + h" % tok0)}] = dd[r];
    }
% if af == 1:
${tp.load_q(kind, st)}\
${tp.load_q(kind, st, frag="df", src="dO")}\
% endif
${zeros("acc", "HD / 8")}\

<% masked = mask_edges(causal, sliding, "q0", "k0", "BQ", "BK") %>\
% if stages == 1:
    // K and V reach local memory without registers, V(kb) first and K(kb) second: dP = dO·Vᵀ runs
    // while K(kb) lands, the rest of the block while V(kb + 1) does, and the next dP while
    // K(kb + 1) does. Three barriers a block (four crossing the mask's edges).
    if (lid == 0) nonfinite[0] = nonfinite[1] = 0;
% else:
    // Two buffers of K and V: block kb + 1's are staged during all of block kb's products, one
    // barrier a block (the forward's scheme: three flags, the one zeroed before that barrier
    // neither read nor set by anyone then).
    if (lid == 0) nonfinite[0] = nonfinite[1] = nonfinite[2] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);  // the flags zeroed before the first block's scan
% endif
    if (kb0 < nkb) {
${tp.stage(kind, st, "(vst + BUF(kb0))", "v", "kb0 * BK")}\
% if stages == 1:
${tp.commit(kind)}\
% endif
${tp.stage(kind, st, "(kst + BUF(kb0))", "k", "kb0 * BK")}\
${tp.commit(kind)}\
    }
    for (uint kb = kb0; kb < nkb; ++kb) {
        const uint k0 = kb * BK;
        __local const ${et} *ks = kst + BUF(kb), *vs = vst + BUF(kb);  // the key block's K and V
% if masked:
        const bool edge = ${" || ".join(masked)};  // some row does not see some key of the block
% endif
% if stages == 1:
${tp.landed(kind, 1)}\
        barrier(CLK_LOCAL_MEM_FENCE);  // V(kb) staged
        if (lid == 0) nonfinite[FLAG(kb + 1)] = 0;
% else:
${tp.landed(kind, 0)}\
%   if masked:
        if (edge) {  // only such a block reads the flag
${tp.scan(st, "ks", "nonfinite[FLAG(kb)]")}\
        }
%   endif
        if (lid == 0) nonfinite[FLAG(kb + 1)] = 0;
        barrier(CLK_LOCAL_MEM_FENCE);  // K(kb) and V(kb) staged (K's flag set); block kb − 1's buffers used up
        if (kb + 1 < nkb) {
${tp.stage(kind, st, "(vst + BUF(kb + 1))", "v", "k0 + BK")}\
${tp.stage(kind, st, "(kst + BUF(kb + 1))", "k", "k0 + BK")}\
        }
${tp.commit(kind)}\
% endif
${zeros("dp", "BK / 8")}\
${tp.qk(kind, st, out="dp", frag=None if af == 2 else "df", bs="vs", src="dO")}\
% if stages == 1:
${tp.landed(kind, 0)}\
%   if masked:
        if (edge) {  // only such a block reads the flag
${tp.scan(st, "ks", "nonfinite[FLAG(kb)]")}\
        }
%   endif
        barrier(CLK_LOCAL_MEM_FENCE);  // K(kb) staged (and its flag set); V(kb) used up
        if (kb + 1 < nkb) {
${tp.stage(kind, st, "vst", "v", "k0 + BK")}\
        }
${tp.commit(kind)}\
% endif
${zeros("s", "BK / 8")}\
${tp.qk(kind, st, frag=None if af == 2 else "qf")}\
        ${coefficients("s", "dp", "row0 + g + (e >> 1) * 8", "k0 + 8 * j + 2 * t + (e & 1)", "nl2[e >> 1]", "dd[e >> 1]",
                       " && ".join(["!edge"] * bool(masked) + ["q0 + BQ <= T", "k0 + BK <= T"]))}
% if masked:
        if (edge && nonfinite[FLAG(kb)]) {
${tp.pv(kind, st, True, visible, p="dp", bs="ks")}\
        } else {
${tp.pv(kind, st, False, visible, p="dp", bs="ks")}\
        }
% else:
${tp.pv(kind, st, False, visible, p="dp", bs="ks")}\
% endif
% if stages == 1:
        barrier(CLK_LOCAL_MEM_FENCE);  // K(kb) used up
        if (kb + 1 < nkb) {
${tp.stage(kind, st, "kst", "k", "k0 + BK")}\
        }
${tp.commit(kind)}\
% endif
    }
${tp.store_rows(st, "acc", "dq", "qbase", "qstride")}\
}
% elif pass_ == "dkv":
#define KG (16 * NW / ${sx})  // keys a group
__kernel __attribute__((reqd_work_group_size(WG, 1, 1))) WARPS
void attn_bwd_dkv(__global const ${et} *restrict q, __global const ${et} *restrict k,
                  __global const ${et} *restrict v, __global const ${et} *restrict dO,
                  __global const float *restrict lse, __global const float *restrict dsum,
                  __global ${et} *restrict dk, __global ${et} *restrict dv,${" __global %s *restrict ds," % ctype(dse) if store_ds else ""}${"""
                  __global const int *restrict cu,""" if varlen else ""}
                  const uint ${"Tmax" if varlen else "T"}, const uint nh, const uint rep, const float c, const float scale${", const uint W" if sliding else ""}${", const float cap" if softcap else ""}${", const uint RT" if store_ds and band else ""}${checked_args(*["q", "k", "v", "dO", "lse", "dsum", "dk", "dv"] + ["ds"] * store_ds + ["cu"] * varlen)})
{
    __local ${et} qst[BK * KS] __attribute__((aligned(16))), dst[BK * KS] __attribute__((aligned(16)));
    __local const ${et} *qs = qst, *dos = dst;  // the query block's Q and dO
    __local float nl2s[BK], dds[BK];           // their −lse·log2 e (negated: see dq) and D
    __local int nonfinite[2];                  // Q or dO of the block holds a NaN or ±Inf
% if sx == 2:
    __local float xch[NW * 16 * BK];          // each warp's partial Sᵀ or dPᵀ, for its pair
% endif
${tp.locals(kind, quads=False)}\

    const uint lid = get_local_id(0), lane = lid % 32, wi = lid / 32, g = lane / 4, t = lane % 4;
% if sx == 2:
    // warps 2i and 2i + 1 take keys key0 + 16i .. + 15, each half of the columns
    const uint gk = get_group_id(0), w = get_group_id(1);
    const uint col0 = wi % 2 * (HD / 2);  // the warp's first column of dK and dV
    const uint key0 = get_group_id(2) * KG, row0 = key0 + wi / 2 * 16;  // the group's and the warp's first key
% else:
    const uint gk = get_group_id(0) / ${cs}, w = get_group_id(1);
    const uint col0 = get_group_id(0) % ${cs} * (HD / ${cs});  // the group's first column of dK and dV
    const uint key0 = get_group_id(2) * KG, row0 = key0 + wi * 16;  // the group's and the warp's first key
% endif
% if varlen:
    const uint tok0 = cu[${at("cu", "w")}], T = cu[${at("cu", "w + 1")}] - tok0;
% endif
    const uint nkv = nh / rep;
    const uint qstride = nh * HD, kstride = nkv * HD;  // elements
    const idx_t kbase = (idx_t)${tok0} * kstride + gk * HD;
    // the query blocks holding a query that sees a key of the group (none past the sequence's end)
    const uint qfirst = ${"key0 / BK * BK" if causal else ("key0 + 1 > W ? (key0 + 1 - W) / BK * BK : 0" if sliding else "0")};
    const uint qend = key0 < T ? ${"min(T, key0 + KG - 1 + W)" if sliding else "T"} : 0;
<%
    # sx 2: the products Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ over the warp's half of the columns, summed with its pair's
    part = dict(cols="(HD / 2)", base="kbase + col0", stride="kstride") if sx == 2 else dict(base="kbase", stride="kstride")
%>\
% if af == 1:
${tp.load_q(kind, st, frag="kf", src="k", **part)}\
${tp.load_q(kind, st, frag="vf", src="v", **part)}\
% endif
${zeros("dka", "HD / %d / 8" % cs)}\
${zeros("dva", "HD / %d / 8" % cs)}\

<%
    masked = mask_edges(causal, sliding, "q0", "key0", "BK", "KG")
    seen_t = lambda key, query: visible(query, key)  # the products' rows are keys here
%>\
    // Blocks in order of (query head, query block): block b is head gk·rep + b / nqb, queries from
    // qfirst + (b % nqb)·BK. Each reaches local memory without registers, dO and D first, Q and lse
    // second: dPᵀ = V·dOᵀ runs while Q lands, dK += dSᵀ·Q while the next dO does, the next dPᵀ
    // while the next Q does. Four barriers a block, with SX 2 two more of the pair's warps alone.
    const uint nqb = qend > qfirst ? (qend - qfirst + BK - 1) / BK : 0, nblk = rep * nqb;
    if (lid == 0) nonfinite[0] = nonfinite[1] = 0;
    if (nblk > 0) {
${stage_block("0", "dO")}\
${stage_block("0", "q")}\
    }
    for (uint blk = 0; blk < nblk; ++blk) {
        const uint h = gk * rep + blk / nqb, q0 = qfirst + blk % nqb * BK;
% if masked:
        const bool edge = ${" || ".join(masked)};  // some query of the block does not see some key
% endif
${tp.landed(kind, 1)}\
        barrier(CLK_LOCAL_MEM_FENCE);  // dO and D staged
        if (lid == 0) nonfinite[(blk + 1) & 1] = 0;
${zeros("dp", "BK / 8")}\
${tp.qk(kind, st, out="dp", frag=None if af == 2 else "vf", bs="(dos + col0)" if sx == 2 else "dos", src="v", **part)}\
% if sx == 2:
${tp.pair_share("dp")}\
% endif
${tp.landed(kind, 0)}\
        for (uint i = lid; i < BK; i += WG) nl2s[i] *= -LOG2E;  // the entries this work-item staged
% if masked:
        if (edge) {  // only such a block reads the flag
${tp.scan(st, "qst", "nonfinite[blk & 1]")}\
${tp.scan(st, "dst", "nonfinite[blk & 1]")}\
        }
% endif
        barrier(CLK_LOCAL_MEM_FENCE);  // Q and lse staged (and the flag set; the pair's dPᵀ shared)
% if sx == 2:
${tp.pair_add("dp")}\
% endif
${zeros("s", "BK / 8")}\
${tp.qk(kind, st, frag=None if af == 2 else "kf", bs="(qs + col0)" if sx == 2 else "qs", src="k", **part)}\
% if sx == 2:
        PAIR_BARRIER();  // the pair's dPᵀ read
${tp.pair_share("s")}\
        PAIR_BARRIER();  // the pair's Sᵀ shared
${tp.pair_add("s")}\
% endif
        ${coefficients("s", "dp", "q0 + 8 * j + 2 * t + (e & 1)", "row0 + g + (e >> 1) * 8", "nl2s[8 * j + 2 * t + (e & 1)]", "dds[8 * j + 2 * t + (e & 1)]",
                       " && ".join(["!edge"] * bool(masked) + ["q0 + BK <= T", "key0 + KG <= T"]))}
% if store_ds:
        // dS (transposed here) into its tiles, by one warp of a pair or the group of the first columns
        if (col0 == 0) {
            #pragma unroll
            for (int j = 0; j < BK / 8; ++j) {
                const uint qt = (q0 + 8 * j) / 16, kt = row0 / 16;
                if (16 * qt < T && kt >= TILE_LO(qt) && kt <= TILE_HI(qt)) {
                    const idx_t at0 = DS_TILE(h, qt, kt) + (g >> 1) * 8 + 2 * (j & 1) + (g & 1);
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        ds[${at("ds", "at0 + 32 * (2 * t + (e & 1)) + 4 * (e >> 1)")}] = ${"dp[j][e]" if dse == "float" else "clops_float_to_%s(dp[j][e])" % dse};
                }
            }
        }
% endif
${flagged("s", "dva", "dos", masked, seen_t)}\
        barrier(CLK_LOCAL_MEM_FENCE);  // dO and D used up
        if (blk + 1 < nblk) {
${stage_block("blk + 1", "dO")}\
        } else {
${tp.commit(kind)}\
        }
${flagged("dp", "dka", "qs", masked, seen_t)}\
        barrier(CLK_LOCAL_MEM_FENCE);  // Q and lse used up
        if (blk + 1 < nblk) {
${stage_block("blk + 1", "q")}\
        } else {
${tp.commit(kind)}\
        }
    }
${tp.store_rows(st, "dva", "dv", "kbase", "kstride", "col0", "HD / %d / 8" % cs)}\
${tp.store_rows(st, "dka", "dk", "kbase", "kstride", "col0", "HD / %d / 8" % cs)}\
}
% else:
// D = Σ dO·O of each (token, head) row: DL work-items a row reading its vectors side by side (a warp's
// loads coalesced, where one work-item a row strided them by the row), their sums added in lane order.
#define DL ${dsum_lanes(hd)}
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void attn_bwd_dsum(__global const ${et} *restrict o, __global const ${et} *restrict dO, __global float *restrict dsum,
                   const uint rows${checked_args("o", "dO", "dsum")})
{
    __local float part[WG];
    const uint lid = get_local_id(0), lane = lid % DL;
    const idx_t r = (idx_t)get_group_id(0) * (WG / DL) + lid / DL;
    float dd = 0.0f;
    if (r < rows) {
        for (uint d = 4 * lane; d < HD; d += 4 * DL)
            dd += dot(${load(st, 4, "o", at("o", "r * HD + d", 4), aligned=True)}, ${load(st, 4, "dO", at("dO", "r * HD + d", 4), aligned=True)});
    }
    part[lid] = dd;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lane == 0 && r < rows) {
        for (uint l = 1; l < DL; ++l)
            dd += part[lid + l];
        dsum[${at("dsum", "r")}] = dd;
    }
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1))) WARPS
void attn_bwd_dqs(__global const ${et} *restrict k, __global const ${ctype(dse)} *restrict ds, __global ${et} *restrict dq,${"""
                  __global const int *restrict cu,""" if varlen else ""}
                  const uint ${"Tmax" if varlen else "T"}, const uint nh, const uint rep${", const uint W" if sliding else ""}${", const uint RT" if band else ""}${checked_args(*["k", "ds", "dq"] + ["cu"] * varlen)})
{
    __local ${et} kst[2][BK * KS] __attribute__((aligned(16)));  // key blocks kb (even, odd)
    __local int nonfinite[2];                                    // K of block kb holds a NaN or ±Inf: nonfinite[kb & 1]
${tp.locals(kind, quads=False)}\

${query_rows()}
    const uint qt = row0 / 16;  // the warp's query tile
${zeros("acc", "HD / 8")}\

<% masked = mask_edges(causal, sliding, "q0", "k0", "BQ", "BK") %>\
    // K(kb + 1) lands while block kb is multiplied: one barrier a block (two crossing the mask's edges).
    if (lid == 0) nonfinite[0] = nonfinite[1] = 0;
    if (kb0 < nkb) {
${tp.stage(kind, st, "kst[kb0 & 1]", "k", "kb0 * BK")}\
${tp.commit(kind)}\
    }
<%
    words = kind in ("bf16", "f16")  # the stored tiles are the product's A words as they stand
    sv = "uint4" if words else "float8"
    # the warp's rows of stored dS tile kt of block kb as `sv`, 0 past the last block or outside the tiles
    ds_tile = lambda kb, kt: "%s < nkb && row0 < T && %s >= TILE_LO(qt) && %s <= TILE_HI(qt) ? *(__global const %s *)(ds + %s) : (%s)(0)" % (
        kb, kt, kt, sv, at("ds", "DS_TILE(h, qt, %s) + 8 * lane" % kt, 8), sv)
    # dp[BK/8][4]: the block's dS as floats in the accumulator layout (pv's P), from the tiles dsv
    dp_floats = "\n".join([
        "        float dp[BK / 8][4];",
        "        #pragma unroll",
        "        for (int jj = 0; jj < BK / 16; ++jj) {",
        "            const float8 x = %s;" % (("clops_%s_to_float8(as_ushort8(dsv[jj]))" % dse) if words else "dsv[jj]"),
        "            dp[2 * jj][0] = x.s0; dp[2 * jj][1] = x.s1; dp[2 * jj][2] = x.s2; dp[2 * jj][3] = x.s3;",
        "            dp[2 * jj + 1][0] = x.s4; dp[2 * jj + 1][1] = x.s5; dp[2 * jj + 1][2] = x.s6; dp[2 * jj + 1][3] = x.s7;",
        "        }"])
%>\
    ${sv} dsn[BK / 16];  // the warp's rows of the next block's stored dS tiles
    #pragma unroll
    for (int jj = 0; jj < BK / 16; ++jj) dsn[jj] = ${ds_tile("kb0", "kb0 * (BK / 16) + jj")};
    for (uint kb = kb0; kb < nkb; ++kb) {
        const uint k0 = kb * BK;
        __local const ${et} *ks = kst[kb & 1];
${tp.landed(kind, 0)}\
        barrier(CLK_LOCAL_MEM_FENCE);  // K(kb) staged; block kb − 1 done with the other buffer
        if (lid == 0) nonfinite[(kb + 1) & 1] = 0;
        if (kb + 1 < nkb) {
${tp.stage(kind, st, "kst[(kb + 1) & 1]", "k", "k0 + BK")}\
        }
${tp.commit(kind)}\
        // this block's tiles, loaded a block ahead; the next block's in flight during its products
        ${sv} dsv[BK / 16];
        #pragma unroll
        for (int jj = 0; jj < BK / 16; ++jj) {
            dsv[jj] = dsn[jj];
            dsn[jj] = ${ds_tile("kb + 1", "(kb + 1) * (BK / 16) + jj")};
        }
% if not words:
${dp_floats}
% endif
% if masked:
        const bool edge = ${" || ".join(masked)};  // some row does not see some key of the block
        if (edge) {  // only such a block reads the flag
${tp.scan(st, "ks", "nonfinite[kb & 1]")}\
            barrier(CLK_LOCAL_MEM_FENCE);  // the flag set
        }
        if (edge && nonfinite[kb & 1]) {
%   if words:
        // the exact masked form takes dS as floats
${dp_floats}
%   endif
${tp.pv(kind, st, True, visible, p="dp", bs="ks")}\
        } else {
${tp.pv(kind, st, False, visible, p="dp", bs="ks", words="dsv" if words else None)}\
        }
% else:
${tp.pv(kind, st, False, visible, p="dp", bs="ks", words="dsv" if words else None)}\
% endif
    }
${tp.store_rows(st, "acc", "dq", "qbase", "qstride")}\
}
% endif
