// clops attention forward, matrix-unit driver: the same op as attention_fwd.cl.mako (layout,
// variants, arguments, lse), organised for warp-level tile products (tile_products.cl.mako).
//
// Work-group (hg, w, b) computes the GP query heads hg·GP .. of window (sequence) w, which share a
// KV head, for the BQ = 16·NW/SX/GP query rows of block b (blocks in reverse, the heaviest first):
// its row tiles of 16 rows (SX warps each) are the heads' in turn, so that a block of keys staged
// serves GP heads while the group spans BQ positions (under a sliding window, fewer keys outside it).
// Warp wi owns head h = hg·GP + (wi/SX)/(NW/SX/GP) at rows row0 = q0 + 16·((wi/SX) % (NW/SX/GP)) ..
// row0 + 15 (lane = lid % 32, g = lane / 4, t = lane % 4). Per key block
// of BK keys: each warp scores its rows against the K staged in local memory (S = Q·Kᵀ, an
// accumulator tile s[BK/8][4]), masks, scales (and caps) in the log2 domain, takes the online
// softmax (row maxima and sums across the 4 lanes of a quad), then, V staged beside K, each
// warp accumulates O += P·V into acc[HD/8][4] (the head dim in tiles of 8 columns). K and V
// reach local memory without registers (cp.async on the matrix units, plain copies on the
// portable products), with one buffer K during the previous block's P·V and V during Q·Kᵀ, with
// two the next block's K and V during all of this block's products, so global latency hides
// behind the products. Rows past the sequence compute on zero Q and are never stored; keys past
// it are staged as zero and masked.
// In blocks crossing the mask's edges a key a row does not see has P = 0, which a matrix
// product still multiplies by V: if the staged V holds a non-finite value there, the block's
// P·V takes the product's exact masked form instead, so a NaN or Inf of V reaches only the
// rows that see it.
//
// Parameters: NW warps per group, GP query heads a group (dividing both NW/SX and the heads a KV
// head serves), BK keys per block (a multiple of 16), HD head dim (a multiple of 8), ST storage
// type, KIND the tile product (fma, tf32x3, bf16, f16), STAGES buffers of K and V (1, or 2: a
// block's staged during the whole block before it, one barrier a block); FUSE: the score
// coefficient c is positive (the host's test), so that the scale can wait for the softmax's fma.
// CAPREF (softcap at most clops.attn.CAPREF_MAX): cap is every row's reference max, no row maxima.
// AF: the matrix-unit products take the warp's Q fragments once, held in registers (1), or from
// global memory at each key block, L1-cached (2: fewer registers; tf32x3 at hd 256 holds Q and O
// in 256 floats a lane otherwise). SX: 1, or 2 for column halves' pairs (tile_products.pair_share):
// warps 2i and 2i + 1 take the same 16 rows (8·NW rows a group), each half of Q's and O's head-dim
// columns, so that a warp holds half the accumulators: each computes S over its half, adds its
// pair's, and both take the same softmax (the same bits) before P·V over their halves of V.
<%!
    from clops.attn import mask_edges, visible_condition
    from clops.program import ctype
%>\
<%
    narrow = st != "float"
    et = ctype(st)                          # a stored element: float, or ushort bits
    plain = causal and not sliding

    def visible(i, j):                      # query position i sees key position j
        return visible_condition(causal, sliding, i, j) or "1"

    # fuse (c > 0, no softcap): the row max is taken over the raw scores and scaled once a row, and the
    # scale enters the softmax's exponent by one fma (max(x)·c = max(x·c) for c > 0: a multiply a score fewer).
    # softcap: a score is held as −r of softcap_neg_r, increasing with the capped score cap·(1 − 2r); the row
    # max is capped once a row, and the cap enters the exponent by one fma too
    fused = fuse and not softcap

    def score(x):                           # a score in the log2 domain, scaled; raw if fused, −r if capped
        return "softcap_neg_r(%s * cr)" % x if softcap else x if fused else "%s * c" % x
    tok0 = "tok0" if varlen else "w * T"
    kb_first = "0" if plain and not varlen else "kb0"
    edges = mask_edges(causal, sliding, "q0", "k0", "BQ", "BK")
%>\
<%def name="scores(masked)">\
            #pragma unroll
            for (int j = 0; j < BK / 8; ++j) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
% if masked:
                    const uint qi = row0 + g + (e >> 1) * 8, kj = k0 + 8 * j + 2 * t + (e & 1);
                    s[j][e] = (${visible("qi", "kj")} && kj < T) ? ${score("s[j][e]")} : -INFINITY;
% else:
                    s[j][e] = ${score("s[j][e]")};
% endif
% if not capref:
                    mx[e >> 1] = fmax(mx[e >> 1], s[j][e]);
% endif
                }
            }
</%def>\
<%def name="v_landed()">\
## one buffer: V(kb) landed (its flag set) and K(kb) used up, then K(kb + 1) staged during P·V
${tp.landed(kind, 0)}\
%   if edges:
        if (edge) {  // only such a block reads the flag
${tp.scan(st, "vst", "nonfinite[FLAG(kb)]")}\
        }
%   endif
        barrier(CLK_LOCAL_MEM_FENCE);  // V(kb) staged (and its flag set); K(kb) used up${"; the pair's S shared" if sx == 2 else ""}
        if (kb + 1 < nkb) {
${tp.stage(kind, st, "kst", "k", "k0 + BK")}\
        }
${tp.commit(kind)}\
</%def>\
<%namespace name="common" file="common.cl.mako"/>\
<%namespace name="tp" file="tile_products.cl.mako"/>\
${tp.geometry(st, hd, nw, bk, sx, gp)}\
typedef ${idx} idx_t;
${common.guards()}\
${common.storage(st)}\
${tp.decls(kind, st, emulate)}\
#define LAZY_MAX 8.0f  // log2 of how far a score may pass its row's reference max before the max moves
${tp.buffers(stages)}\

__kernel __attribute__((reqd_work_group_size(WG, 1, 1))) WARPS
void attention_fwd(__global const ${et} *restrict q, __global const ${et} *restrict k,
                   __global const ${et} *restrict v, __global ${et} *restrict o, __global float *restrict lse,${"""
                   __global const int *restrict cu,""" if varlen else ""}
                   const uint ${"Tmax" if varlen else "T"}, const uint nh, const uint rep, const float c${", const uint W" if sliding else ""}${", const float cap" if softcap else ""}${checked_args(*["q", "k", "v", "o", "lse"] + ["cu"] * varlen)})
{
    __local ${et} kst[STAGES * BK * KS] __attribute__((aligned(16))), vst[STAGES * BK * KS] __attribute__((aligned(16)));
    __local int nonfinite[STAGES + 1];        // V of block kb holds a NaN or ±Inf: nonfinite[FLAG(kb)]
% if sx == 2:
    __local float xch[NW * 16 * BK];          // each warp's partial S, for its pair
% endif
${tp.locals(kind)}\

    const uint lid = get_local_id(0), lane = lid % 32, wi = lid / 32, g = lane / 4, t = lane % 4;
    const uint tiles = NW / SX / GP;  // row tiles a head
    const uint h = get_group_id(0) * GP + wi / SX / tiles, w = get_group_id(1);
    const uint q0 = (get_num_groups(2) - 1 - get_group_id(2)) * BQ, row0 = q0 + wi / SX % tiles * 16;
    const uint col0 = wi % SX * (HD / SX);  // the warp's first column of Q and O
% if varlen:
    const uint tok0 = cu[${at("cu", "w")}];
%   if af == 2:
    // Where registers are short (Q off them too), the sequence's length T is read from local memory
    // where used: held in a register across the key loop, it tipped tf32x3 at hd 256 into spilling
    // (NVPTX proxy: 324 bytes against 24). An H100, 2026-12-07, varlen forward against causal's 41.7
    // TFLOP/s: qwen-hd256 39.0 against 29.9; at hd 128 and 64 (Q held) 49.6 / 44.0 against 51.3 / 45.3.
    __local uint seq_len;
    if (lid == 0) seq_len = cu[${at("cu", "w + 1")}] - tok0;
    barrier(CLK_LOCAL_MEM_FENCE);
#define T seq_len
%   else:
    const uint T = cu[${at("cu", "w + 1")}] - tok0;
%   endif
% endif
    const uint nkv = nh / rep;
    const uint qstride = nh * HD, kstride = nkv * HD;  // elements
    const idx_t qbase = (idx_t)${tok0} * qstride + h * HD;
    const idx_t kbase = (idx_t)${tok0} * kstride + (h / rep) * HD;
% if plain and not varlen:
    const uint nkb = (min(q0 + BQ, T) - 1) / BK + 1;
% else:
    // the key blocks holding a key that a row of the block sees (none past the sequence's end)
    const uint qlast = min(q0 + BQ, T) - 1;
    const uint kb0 = ${"q0 + 1 > W ? (q0 + 1 - W) / BK : 0" if sliding else "0"};
    const uint nkb = q0 < T ? (${"qlast + 1" if causal else ("min(T, qlast + W)" if sliding else "T")} - 1) / BK + 1 : 0;
% endif

#define NCOL (HD / 8 / SX)  // the warp's column tiles of O
    float acc[NCOL][4];
    #pragma unroll
    for (int n = 0; n < NCOL; ++n) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
    }
% if capref:
    // CAPREF: the capped scores lie below cap, each row's reference max from the start (P = 2^(capped − cap)
    // ≥ 2^(−2·cap) ≥ 2^−100, far from float32's underflow): no row maxima, no rescale of O
    const float m[2] = {cap, cap};
    float l[2] = {0.0f, 0.0f};  // rows g and g + 8
% else:
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g and g + 8
% endif
% if softcap:
    const float cr = c * 2.88539008f, cap2 = 2.0f * cap;  // softcap_neg_r's u = cr·score; capped = fma(cap2, −r, cap)
% endif
<%
    # the warp's columns of Q (and of K and V staged): sx 2 the half from col0
    part = dict(cols="(HD / 2)", base="qbase + col0") if sx == 2 else {}
    kpart, vpart = ("(ks + col0)", "(vs + col0)") if sx == 2 else ("ks", "vs")
    # tf32x3's P·V in one chain where O takes 32 tiles (128 registers): four chains' extra 28
    # registers spill there (qwen-hd256 4.4 % slower on an H100)
    chains = 1 if hd // 8 // sx > 16 else 4
%>\
% if af == 1:
${tp.load_q(kind, st, **part)}\
% endif

% if stages == 1:
    // Each block's K is staged during the previous block's P·V, its V during its own Q·Kᵀ: two
    // barriers a block. After the one that follows V's landing no warp reads K any more (Q·Kᵀ came
    // before it), and after the one that follows K's no warp reads V or the flag of the block before.
    if (lid == 0) nonfinite[0] = nonfinite[1] = 0;
% else:
    // Two buffers of K and V: block kb + 1's are staged during all of block kb's products, one
    // barrier a block, after which no warp reads block kb − 1's buffers (the next to be staged) or
    // its flag; three flags, so that the one zeroed before that barrier is neither read nor set
    // (block kb + 1's scan comes after it) by anyone then.
    if (lid == 0) nonfinite[0] = nonfinite[1] = nonfinite[2] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);  // the flags zeroed before the first block's scan
% endif
    if (${kb_first} < nkb) {
${tp.stage(kind, st, "(kst + BUF(%s))" % kb_first, "k", "%s * BK" % kb_first)}\
% if stages == 2:
${tp.stage(kind, st, "(vst + BUF(%s))" % kb_first, "v", "%s * BK" % kb_first)}\
% endif
    }
${tp.commit(kind)}\
    for (uint kb = ${kb_first}; kb < nkb; ++kb) {
        const uint k0 = kb * BK;
        __local const ${et} *ks = kst + BUF(kb), *vs = vst + BUF(kb);  // the key block's K and V
% if edges:
        const bool edge = ${" || ".join(edges)};  // some row does not see some key of the block
% endif
${tp.landed(kind, 0)}\
% if stages == 1:
        barrier(CLK_LOCAL_MEM_FENCE);  // K(kb) staged; V(kb - 1) used up
        if (lid == 0) nonfinite[FLAG(kb + 1)] = 0;
${tp.stage(kind, st, "vst", "v", "k0")}\
% else:
%   if edges:
        if (edge) {  // only such a block reads the flag
${tp.scan(st, "vs", "nonfinite[FLAG(kb)]")}\
        }
%   endif
        if (lid == 0) nonfinite[FLAG(kb + 1)] = 0;
        barrier(CLK_LOCAL_MEM_FENCE);  // K(kb) and V(kb) staged (V's flag set); block kb − 1's buffers used up
        if (kb + 1 < nkb) {
${tp.stage(kind, st, "(kst + BUF(kb + 1))", "k", "k0 + BK")}\
${tp.stage(kind, st, "(vst + BUF(kb + 1))", "v", "k0 + BK")}\
        }
% endif
${tp.commit(kind)}\
        float s[BK / 8][4];
        #pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
        }
${tp.qk(kind, st, frag=None if af == 2 else "qf", bs=kpart, **part)}\
% if sx == 2:
        // S over all the columns: the pair's partial S added after the barrier that follows V's landing
        // (one buffer), or one of its own (two); the next block's share comes after the next block's
        // first barrier, when both warps have added this one's
${tp.pair_share("s")}\
%   if stages == 1:
${v_landed()}\
%   else:
        PAIR_BARRIER();  // the pair's S shared
%   endif
${tp.pair_add("s")}\
% endif
        // Scale${" (and cap)" if softcap else ""}, masking only in blocks that hold a key some row does not
        // see (uniform across the group)${"" if capref else "; row maxima across the quad"}.
% if not capref:
        float mx[2] = {-INFINITY, -INFINITY};
% endif
        if (${"edge || " if edges else ""}k0 + BK > T) {
${scores(True)}\
        } else {
${scores(False)}\
        }
% if not capref:
${tp.quad(kind, "max", "mx[0]", "mx[1]")}\
% endif
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
% if not capref:
%   if fused:
            mx[r] *= c;
%   elif softcap:
            mx[r] = fma(cap2, mx[r], cap);
%   endif
            // The row's reference m (lse's too) moves only when a score passes it by more than 2^LAZY_MAX,
            // so O's rescale (HD / 2 multiplies a thread) is skipped in most blocks; meanwhile P ≤ 2^LAZY_MAX,
            // far from float32's range, and a 16-bit P keeps its relative precision. m = -inf: any key seen.
            if (mx[r] > m[r] + LAZY_MAX) {
                const float corr = softmax_exp2(m[r] - mx[r]);
                m[r] = mx[r];
                l[r] *= corr;
                #pragma unroll
                for (int n = 0; n < NCOL; ++n) {
                    acc[n][2 * r] *= corr;
                    acc[n][2 * r + 1] *= corr;
                }
            }
%   if sliding:
            // A row may see no key of the first blocks: m stays -inf, and mref = 0 keeps its sums 0.
            const float mref = m[r] == -INFINITY ? 0.0f : m[r];
%   else:
            const float mref = m[r];  // block 0 holds key 0, which every row sees: finite from the first block
%   endif
%   if softcap:
            const float off = cap - mref;
%   endif
% endif
<%
    # P in the log2 domain against the row's reference: with CAPREF, capped − cap = cap2·(−r)
    p_arg = ("s[j][2 * r + x] * cap2" if capref else "fma(s[j][2 * r + x], c, -mref)" if fused
             else "fma(s[j][2 * r + x], cap2, off)" if softcap else "s[j][2 * r + x] - mref")
%>\
            #pragma unroll
            for (int j = 0; j < BK / 8; ++j) {
                #pragma unroll
                for (int x = 0; x < 2; ++x) {
                    s[j][2 * r + x] = softmax_exp2(${p_arg});
                    l[r] += s[j][2 * r + x];
                }
            }
        }
% if stages == 1 and sx == 1:
${v_landed()}\
% endif
% if edges:
        if (edge && nonfinite[FLAG(kb)]) {
${tp.pv(kind, st, True, visible, bs=vpart, ncol="NCOL", chains=chains)}\
        } else {
${tp.pv(kind, st, False, visible, bs=vpart, ncol="NCOL", chains=chains)}\
        }
% else:
${tp.pv(kind, st, False, visible, bs=vpart, ncol="NCOL", chains=chains)}\
% endif
    }
    // Row sums across the quad; rows inside the sequence stored, lse by the quad's first lane.
${tp.quad(kind, "sum", "l[0]", "l[1]")}\
    // O from hd 128 at 16 bits in 16-byte stores (tile_products.store_rows). (An H100, 2026-12-06, bf16,
    // against 4-byte stores, forward TFLOP/s: hd 256 causal 266-269 / 265, softcap 258 / 246, sliding-512
    // 190-191 / 186-188; hd 128 causal 253 / 251; hd 64, 12 registers more, sliding-512 164-166 / 176-178.)
${tp.store_rows(st, "acc", "o", "qbase", "qstride", col0="col0", ncol="NCOL", scale="1.0f / l[r]", wide=narrow and kind != "fma" and hd // sx % 32 == 0 and hd >= 128)}\
    if (t == 0 && col0 == 0) {
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint qi = row0 + g + 8 * r;
            if (qi < T)
                lse[${at("lse", "((idx_t)%s + qi) * nh + h" % tok0)}] = m[r] * M_LN2_F + log(l[r]);
        }
    }
}
