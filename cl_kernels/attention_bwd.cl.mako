// clops attention backward: FlashAttention-2 style gradients of causal
// grouped-query attention inside windows. Rendered once per pass (`kind`):
//   "dkv": attn_bwd_dsum (D = Σ dO·O per (row, head), `lanes` work-items per
//        row) and attn_bwd_dkv; rendered with store_ds, attn_bwd_dkv also writes the
//        visible entries of dS to `ds`, as it computes them;
//   "dq":  attn_bwd_dq (recomputes S and dP);
//   "dqs": attn_bwd_dqs (dQ = dS·K from the dS that attn_bwd_dkv stored).
//
// Layout: q, o, dO, dq [n, nh, HD]; k, v, dk, dv [n, nkv, HD] of storage type ST
// (float, half or bf16: loads widen into the float tiles, each gradient's store rounds
// to nearest even; math is float32); lse, D [n, nh] and ds float32; row-major;
// n = windows·T; query head h reads kv head h / rep.
//
// Both gradient kernels repeat two steps per (query block, key block) pair:
//   1. S = Q·Kᵀ and dP = dO·Vᵀ (BQ × BK): Q, dO, K, V are staged DC head-dim
//      columns at a time; work-item (tq, tk) owns rows tq + i·(BQ/SQ) and keys
//      tk + j·(BK/SK) of both in registers. Then P = exp2(S·c − lse·log2 e)
//      (c = scale·log2 e) and dS = P·(dP − D)·scale go to local memory.
//   2. A register tile of TR rows × TD head-dim columns per work-item
//      accumulates a product with those coefficients, the other operand
//      staged JC rows (all HD columns) at a time, or, when step 1 staged the
//      whole head dim (DC = HD), read where step 1 left it:
//      dkv: dV += Pᵀ·dO, dK += dSᵀ·Q over the query rows (P, dS as [q][k]);
//      dq:  dQ += dS·K over the keys (dS stored transposed, [k][q]).
// dqs: step 2 alone, over all the keys of a query block, JC at a time, with
// the dS coefficients staged from `ds` beside the K rows.
// `ds` holds, per (window, head), the causal triangle row by row: dS[q][k]
// (k ≤ q) at q·(q+1)/2 + k, after (w·nh + h)·T·(T+1)/2 elements.
// dkv: one group per (key block, window, kv head), key blocks in order so the
// heaviest (first) start first; it loops over the rep query heads of the
// group and the query blocks from the diagonal on, so dK/dV are written once,
// summed over the group, without atomics. dq: one group per (query block,
// window, head), last (heaviest) blocks first, keys from 0 to the diagonal.
// Masks apply only to blocks crossing the diagonal or the window's end, by
// selection (masked pairs are skipped, never multiplied by zero, so a NaN stays
// out of gradients that do not depend on it); rows past the window are staged
// as zeros. Every barrier is in uniform control
// flow; every sum has a fixed order, so results are bitwise reproducible.
//
// Parameters: WG work-items; BQ query rows, BK keys per block; SQ × SK score
// tile per work-item; DC head-dim chunk of step 1; JC rows staged per part of
// step 2; TR × TD accumulator tile (TD a multiple of VW); VW vector width; ST storage type.
// dqs takes WG, BQ, JC, TR, TD and VW only.
// SPLIT = 1: every work-item holds both S and dP tiles (and, in dkv, both dV
// and dK tiles). SPLIT = 2: the first half of the group computes S, the second
// dP (P passes through local memory), and in dkv the first half accumulates dV,
// the second dK: one matrix per work-item, so its tiles can be twice as large
// for the same registers, and fewer local loads feed each multiply-add.
//
// Variants (flags; causal = 1 and the others 0 give the kernels described above):
// causal = 0: every key of the window is seen; sliding: only keys with
// i − W < j (and, not causal, j < i + W), the blocks outside that band skipped;
// softcap: S becomes cap·tanh(S·c2) in the log2 domain (c2 = scale / c, cap =
// c·log2 e) and dS takes the factor 1 − tanh²; varlen: window w is the sequence
// cu[w] .. cu[w + 1] (Tmax the longest); a group past its sequence's end visits
// no block and stores nothing (no early return: see attention_fwd.cl.mako).
// With any variant but softcap alone, `ds` holds R floats per (token, head) row,
// [n, nh, R]: key j of query i at j (R = T or Tmax) or, sliding, at j − i + W − 1
// (R = W causal, 2W − 1 not).
<%!
    import math

    from clops.attn import visible_condition
%>
<%
    # step 1's parameters; dqs has no step 1 (None fails loudly if one is used)
    split, bk, sq, sk, dc = (context[x] for x in ("split", "bk", "sq", "sk", "dc")) if kind != "dqs" else (None,) * 5
    # dkv only: whether attn_bwd_dkv writes dS for dqs; attn_bwd_dsum's work-items per row
    store_ds, lanes = (context["store_ds"], context["lanes"]) if kind == "dkv" else (0, None)
    rows = bk if kind == "dkv" else bq            # accumulator rows of step 2
    nacc = 2 if kind == "dkv" and split == 1 else 1  # accumulator matrices per work-item
    nc2 = hd // td                                 # work-items across head-dim columns in step 2
    nr2 = rows // tr
    # The layouts below arrange work-items for 32-wide warps (coalesced loads on NVIDIA). That is
    # speed only: every exchange between work-items goes through local memory and a barrier, so
    # results do not depend on the device's sub-group width.
    w1 = math.gcd(nc2, 8)                          # step-2 columns of a 32-wide warp...
    h1 = math.gcd(nr2, 32 // w1)                   # ...and its rows
    tdv = td // vw
    comps = [""] if vw == 1 else [".s%x" % e for e in range(vw)]
    nmat = 2 if kind == "dkv" else 1               # matrices accumulated in step 2
    if kind == "dqs":
        nk1 = k1 = q1 = None
        staged_hd = False                          # step 2 stages K itself
        stage = jc * (hd // vw)
    else:
        nk1 = bk // sk
        k1 = math.gcd(nk1, 8)                      # step-1 keys of a warp...
        q1 = math.gcd(bq // sq, 32 // k1)          # ...and its query rows
        staged_hd = dc == hd                       # step 1 leaves the whole head dim in local memory
        stage = max((2 * bq + 2 * bk) * (dc // vw + 1), 0 if staged_hd else nmat * jc * (hd // vw))
    plain = causal and not sliding                 # the causal triangle's masks (the kernels without variants)
    triangle = plain and not varlen                # dS stored as each window's causal triangle
    tp = "Tmax" if varlen else "T"                 # the kernels' length argument

    def visible(i, j):                             # query position i sees key position j (None: always)
        return visible_condition(causal, sliding, i, j)

    def edges(q0, k0, nq, nk):
        """Conditions that some query of [q0, q0 + nq) does not see some key of [k0, k0 + nk)."""
        out = ["%s + %s > %s + 1" % (k0, nk, q0)] if causal else ["%s + %s > T" % (k0, nk)]
        if sliding:
            out.append("%s + %s > %s + W" % (q0, nq, k0))
            if not causal:
                out.append("%s + %s > %s + W" % (k0, nk, q0))
        return out

    def hides(qi, kj):
        """The condition that the pair (qi, kj) of a masked block is hidden."""
        if plain:
            return "%s > %s || %s >= T" % (kj, qi, qi)
        vis = visible(qi, kj)
        return " || ".join(["%s >= T" % qi] + ([] if causal else ["%s >= T" % kj]) + (["!(%s)" % vis] if vis else []))

    row_len = ("W" if causal else "2 * W - 1") if sliding else tp  # R, the floats of a stored dS row

    def ds_at(qi, kj):
        """Where the stored dS of (qi, kj) is (head h, the sequence from tok0)."""
        if triangle:
            return "dsbase + (idx_t)%s * (%s + 1) / 2 + %s" % (qi, qi, kj)
        return "((idx_t)(tok0 + %s) * nh + h) * R + %s" % (qi, ("%s + W - 1 - %s" % (kj, qi)) if sliding else kj)

    def coef(m, i):                                # step 2's coefficient for accumulator row i
        if kind == "dqs":
            return "c%d_%d" % (m, i)
        return "c%d" % m if tr == 1 else "c%d.s%x" % (m, i)
%>
<%namespace name="common" file="common.cl.mako"/>\
#define HD ${hd}
#define HDV (HD / ${vw})             // vectors per row
#define VW ${vw}
#define WG ${wg}
#define BQ ${bq}
% if kind != "dqs":
#define SPLIT ${split}
#define BK ${bk}
#define SQ ${sq}
#define SK ${sk}
#define NQ1 (BQ / SQ)                // step-1 work-items across query rows
#define NK1 (BK / SK)                // step-1 work-items across keys
#define DC ${dc}
#define DCV (DC / VW)
#define DCP (DCV + 1)                // staged row stride (vectors), padded against bank conflicts
% endif
#define JC ${jc}
#define TR ${tr}
#define TD ${td}
#define NC2 ${nc2}                   // step-2 work-items across head-dim vectors
#define STAGE ${stage}
#define LOG2E 1.4426950408889634f
typedef ${idx} idx_t;
typedef ${vtype(vw)} vec_t;
typedef ${vtype(tr)} cvec_t;         // TR coefficients of one staged row
typedef union { cvec_t v; float s[TR]; } coef_t;  // written one score at a time, read TR at a time
${common.guards()}\
${common.storage(st)}\

## Registers f{tag}{m}_{it}: this work-item's share of `rows` × `width` vectors of each
## source (pointer, row expression of `pos`), from row position pos0 and column vector col0;
## rows at or past T read as zeros. `put` stores them to local memory (row stride `stride`).
<%def name="declare(tag, rows, width, nsrc)">
% for it in range(-(-rows * width // wg)):
%   for m in range(nsrc):
        vec_t f${tag}${m}_${it} = (vec_t)(0.0f);
%   endfor
% endfor
</%def>
<%def name="fetch(tag, rows, width, srcs, pos0, col0)">
% for it in range(-(-rows * width // wg)):
        {
            const uint e = lid + ${it * wg}, pos = ${pos0} + e / ${width};
%   for m, (src, rowexpr) in enumerate(srcs):
            f${tag}${m}_${it} = pos < T ? ${loadv(st, vw, src, "(%s) * HDV + %s + e %% %s" % (rowexpr, col0, width))} : (vec_t)(0.0f);
%   endfor
        }
% endfor
</%def>
<%def name="put(tag, rows, width, dsts, stride)">
% for it in range(-(-rows * width // wg)):
%   if (it + 1) * wg > rows * width:
        if (lid + ${it * wg} < ${rows * width})
%   endif
        {
            const uint e = lid + ${it * wg};
%   for m, dst in enumerate(dsts):
            ${dst}[(e / ${width}) * ${stride} + e % ${width}] = f${tag}${m}_${it};
%   endfor
        }
% endfor
</%def>

## Step 1 for query rows q0.. and keys k0..: s{i}_{j}, dp{i}_{j} in registers,
## then P and dS written to local memory at `pidx(q, k)`; `pcoef` is skipped in dq.
## Each chunk is fetched into registers one step ahead, while the previous one is used;
## `step2` (first_chunk's text) fetches step 2's first chunk between the two.
<%def name="scores(pcoef, dscoef, pidx, mask, step2)">
<%
    qsrc = [("q", "(idx_t)(tok0 + pos) * nh + h"), ("dO", "(idx_t)(tok0 + pos) * nh + h")]
    ksrc = [("k", "(idx_t)(tok0 + pos) * nkv + g"), ("v", "(idx_t)(tok0 + pos) * nkv + g")]
%>
<%
    # (accumulator, query-side tile, key-side tile) of each matrix this work-item computes
    mats = [("s", "sq_", "sk_"), ("dp", "sdo", "sv_")] if split == 1 else [("a", "xa", "xb")]
%>\
% for i in range(sq):
%   for j in range(sk):
%     for name, _, _ in mats:
        float ${name}${i}_${j} = 0.0f;
%     endfor
%   endfor
% endfor
% if split == 2:
        // the first half computes S = Q·Kᵀ, the second dP = dO·Vᵀ
        __local const vec_t *const xa = side ? sdo : sq_, *const xb = side ? sv_ : sk_;
% endif
        ${declare("a", bq, dc // vw, 2)}
        ${declare("b", bk, dc // vw, 2)}
        ${fetch("a", bq, dc // vw, qsrc, "q0", "0")}
        ${fetch("b", bk, dc // vw, ksrc, "k0", "0")}
        for (uint d0 = 0; d0 < HDV; d0 += DCV) {
            ${put("a", bq, dc // vw, ["sq_", "sdo"], "DCP")}
            ${put("b", bk, dc // vw, ["sk_", "sv_"], "DCP")}
            barrier(CLK_LOCAL_MEM_FENCE);
            if (d0 + DCV < HDV) {
                ${fetch("a", bq, dc // vw, qsrc, "q0", "d0 + DCV")}
                ${fetch("b", bk, dc // vw, ksrc, "k0", "d0 + DCV")}
            }
            for (uint c = 0; c < DCV; ++c) {
                // the SK key vectors stay in registers while the SQ query rows stream by
% for j in range(sk):
%   for m, (_, _, ks) in enumerate(mats):
                const vec_t kb${m}_${j} = ${ks}[(tk + ${j * (bk // sk)}) * DCP + c];
%   endfor
% endfor
% for i in range(sq):
                {
%   for m, (_, xs, _) in enumerate(mats):
                    const vec_t qa${m} = ${xs}[(tq + ${i * (bq // sq)}) * DCP + c];
%   endfor
%   for j in range(sk):
%     for e in comps:
%       for m, (name, _, _) in enumerate(mats):
                    ${name}${i}_${j} += qa${m}${e} * kb${m}_${j}${e};
%       endfor
%     endfor
%   endfor
                }
% endfor
            }
            barrier(CLK_LOCAL_MEM_FENCE);
        }
${step2}\
<%
    # SPLIT = 1: P and dS in one pass; 2: the S half writes P (to the dS tile where P is
    # not kept), then the dP half reads it back and writes dS in its place.
    phases = ["p", "ds"] if split == 2 else ["p+ds"]
    pbuf = pcoef or dscoef
    sacc, dpacc = mats[0][0], mats[-1][0]          # accumulators of S and of dP
%>\
% for phase in phases:
%   if phase == "ds":
        barrier(CLK_LOCAL_MEM_FENCE);  // P, from the other half
%   endif
%   if split == 2:
        if (side == ${int(phase == "ds")})
%   endif
        {
%   for i in range(sq):
        {
            const uint qi = q0 + tq + ${i * (bq // sq)};
            const idx_t row = (idx_t)(tok0 + min(qi, T - 1)) * nh + h;
%     if phase != "ds":
            const float l2 = lse[${at("lse", "row")}] * LOG2E;
%     endif
%     if phase != "p":
            const float dd = dsum[${at("dsum", "row")}];
%       if store_ds and triangle:
            const idx_t dsrow = dsbase + (idx_t)min(qi, T - 1) * (min(qi, T - 1) + 1) / 2;
%       endif
%     endif
%     for j in range(sk):
            {
                const uint kj = k0 + tk + ${j * (bk // sk)};
                const uint at = ${pidx("(tq + %d)" % (i * (bq // sq)), "(tk + %d)" % (j * (bk // sk)))};
                // masked entries are selected to 0, not multiplied: a NaN of dO, V or D stays out
                const bool hidden = ${mask} && (${hides("qi", "kj")});
%       if phase == "ds":
                const float ${"g" if softcap else "p"} = ${dscoef if softcap else pbuf}[at / TR].s[at % TR];
%       elif softcap:
                // g = P·(1 − tanh²): the cap's derivative folded into P (dS = g·(dP − D)·scale)
                const float t = tanh(${sacc}${i}_${j} * c2);
                const float p = hidden ? 0.0f : exp2(cap * t - l2), g = hidden ? 0.0f : p * (1.0f - t * t);
%       else:
                const float p = hidden ? 0.0f : exp2(${sacc}${i}_${j} * c2 - l2);
%       endif
%       if softcap:
%         if phase != "ds" and pcoef:
                ${pcoef}[at / TR].s[at % TR] = p;
%         endif
%         if phase == "p":
                ${dscoef}[at / TR].s[at % TR] = g;
%         endif
%       elif phase == "p" or (phase == "p+ds" and pcoef):
                ${pbuf}[at / TR].s[at % TR] = p;
%       endif
%       if phase != "p":
                const float dsv = hidden ? 0.0f : ${"g" if softcap else "p"} * (${dpacc}${i}_${j} - dd) * scale;
%         if store_ds:
                // the visible entries, for dqs (stored before the local copy: PoCL 3.1 computed a
                // wrong dS in the other order at one split-2 tile of tests/test_attention_bwd.py)
                if (!hidden)
                    ds[${at("ds", "dsrow + kj" if triangle else ds_at("qi", "kj"))}] = dsv;
%         endif
                ${dscoef}[at / TR].s[at % TR] = dsv;
%       endif
            }
%     endfor
        }
%   endfor
        }
% endfor
</%def>

## Step 2: acc{m}_{i}_{jj} += coef_m[row j][tr·TR + i] · X_m[row j][column vector tc + jj·NC2]
## for rows jlo.. < jhi (from position pos0) of `srcs`, staged JC rows at a time, fetched one step ahead.
## When step 1 staged the whole head dim (DC = HD), X_m is already in local memory (`staged`, rows
## from the block's start, stride DCP) and is read there: no second fetch, no staging barriers.
## Where `masked`, the pairs failing `visible(j, i)` (key after query) are skipped, not multiplied
## by their zero coefficient: 0·NaN would carry a NaN row of X to gradients that do not depend on it.
## first_chunk: step 2's first row `jlo` and, unless step 1 left X in local memory, its first
## chunk fetched into registers. dkv and dq fetch it inside step 1 (scores' `step2`), after the
## last chunk of Q·Kᵀ and before P and dS are computed, so the loads overlap that work.
<%def name="first_chunk(srcs, jlo, pos0)">
        const uint jlo = ${jlo};
% if not staged_hd:
        ${declare("x", jc, hd // vw, len(srcs))}
        ${fetch("x", jc, hd // vw, srcs, pos0 + " + jlo", "0")}
%   if kind == "dqs":
        ${ds_chunk("declare", "jlo")}
%   endif
% endif
</%def>
<%def name="accumulate(coefs, srcs, staged, jlo, jhi, pos0, masked, visible)">
<%
    if kind == "dkv" and split == 2:  # the first half dV (P, dO), the second dK (dS, Q)
        coefs, staged, rowoff = ["(side ? %s : %s)" % (coefs[1], coefs[0])], ["(side ? %s : %s)" % (staged[1], staged[0])], ["side * JC"]
    else:
        rowoff = ["%d" % (m * jc) for m in range(len(coefs))]
%>\
        {
% if kind == "dqs":
        ${first_chunk(srcs, jlo, pos0)}
% endif
        const uint jhi = ${jhi};
% if staged_hd:
<%  xat = lambda m, col: "%s[(j0 + j) * DCP + %s]" % (staged[m], col) %>
        barrier(CLK_LOCAL_MEM_FENCE);  // the coefficients
        for (uint j0 = jlo; j0 < jhi; j0 += JC) {
% else:
<%  xat = lambda m, col: "sx[(%s + j) * HDV + %s]" % (rowoff[m], col) %>
        for (uint j0 = jlo; j0 < jhi; j0 += JC) {
            ${put("x", jc, hd // vw, ["(sx + %d * HDV)" % (m * jc) for m in range(len(srcs))], "HDV")}
%   if kind == "dqs":
            ${ds_chunk("put", "j0")}
%   endif
            barrier(CLK_LOCAL_MEM_FENCE);
            if (j0 + JC < jhi) {
                ${fetch("x", jc, hd // vw, srcs, pos0 + " + j0 + JC", "0")}
%   if kind == "dqs":
                ${ds_chunk("fetch", "j0 + JC")}
%   endif
            }
% endif
% if visible:
            if (${masked}) {
                ${products(coefs, xat, visible)}
            } else {
                ${products(coefs, xat, None)}
            }
% else:
            ${products(coefs, xat, None)}
% endif
% if not staged_hd:
            barrier(CLK_LOCAL_MEM_FENCE);
% endif
        }
% if staged_hd:
        barrier(CLK_LOCAL_MEM_FENCE);  // before step 1 of the next block restages
% endif
        }
</%def>

<%def name="products(coefs, xat, visible)">
            for (uint j = 0; j < JC; ++j) {
% for m, c in enumerate(coefs):
%   if kind == "dqs":
%     for i in range(tr):
                const float ${coef(m, i)} = ${c}[(tr * TR + ${i}) * JCP + j];
%     endfor
%   else:
                const cvec_t c${m} = ${c}[(j0 + j) * (CROW / TR) + tr].v;
%   endif
% endfor
% for jj in range(tdv):
%   for m in range(len(coefs)):
                {
                    const vec_t x = ${xat(m, "tc + %d" % (jj * nc2))};
%     for i in range(tr):
%       if visible:
                    if (${visible("j0 + j", "tr * TR + %d" % i)})
%       endif
                    acc${m}_${i}_${jj} += ${coef(m, i)} * x;
%     endfor
                }
%   endfor
% endfor
            }
</%def>

## dqs: dS[q0 + r][j .. j + JC) for the BQ rows r of the block, from `ds` into registers
## fd{it} ("fetch", zeros where k > q or q ≥ T; "declare": declared and fetched), or from
## them into the padded local tile sds ("put").
<%def name="ds_chunk(what, j)">
% for it in range(-(-bq * jc // wg)):
<%  partial = (it + 1) * wg > bq * jc %>\
%   if what == "put":
%     if partial:
        if (lid + ${it * wg} < BQ * JC)
%     endif
            sds[(lid + ${it * wg}) / JC * JCP + (lid + ${it * wg}) % JC] = fd${it};
%   else:
        ${"float " if what == "declare" else ""}fd${it} = 0.0f;
        {
            const uint e = lid + ${it * wg}, qi = q0 + e / JC, kj = ${j} + e % JC;
            if (${"e < BQ * JC && " if partial else ""}${" && ".join(["qi < T"] + ([] if causal else ["kj < T"]) + ([visible("qi", "kj")] if visible("qi", "kj") else []))})
                fd${it} = ds[${at("ds", ds_at("qi", "kj"))}];
        }
%   endif
% endfor
</%def>

## Per-work-item indices shared by the gradient kernels.
<%def name="prologue()">
    __local vec_t stage[STAGE];
    __local vec_t *const sx = stage;
    const uint lid = get_local_id(0);
<%  lid1, lid2 = ("lid1", "lid1" if kind == "dkv" else "lid") if split == 2 else ("lid", "lid") %>\
% if kind != "dqs":
    __local vec_t *const sq_ = stage, *const sdo = stage + BQ * DCP;
    __local vec_t *const sk_ = stage + 2 * BQ * DCP, *const sv_ = stage + (2 * BQ + BK) * DCP;
%   if split == 2:
    const uint side = lid / (WG / 2), lid1 = lid % (WG / 2);  // which half (matrix), and the place in it
%   endif
    // step 1: warps span ${k1} key groups × ${q1} query-row groups
    const uint k_lo = ${lid1} % ${k1}, q_lo = (${lid1} / ${k1}) % ${q1}, hi1 = ${lid1} / ${k1 * q1};
    const uint tk = (hi1 % ${nk1 // k1}) * ${k1} + k_lo, tq = (hi1 / ${nk1 // k1}) * ${q1} + q_lo;
% endif
    // step 2: warps span ${w1} column groups × ${h1} row groups
    const uint c_lo = ${lid2} % ${w1}, r_lo = (${lid2} / ${w1}) % ${h1}, hi = ${lid2} / ${w1 * h1};
    const uint tc = (hi % ${nc2 // w1}) * ${w1} + c_lo, tr = (hi / ${nc2 // w1}) * ${h1} + r_lo;
% for m in range(nacc):
%   for i in range(tr):
%     for jj in range(tdv):
    vec_t acc${m}_${i}_${jj} = (vec_t)(0.0f);
%     endfor
%   endfor
% endfor
</%def>

## The group's sequence: its first token tok0 and length T.
<%def name="sequence()">${"tok0 = cu[%s], T = cu[%s] - tok0" % (at("cu", "w"), at("cu", "w + 1")) if varlen else "tok0 = w * T"}</%def>\
## kfirst .. kend: the keys that a query of the block q0 .. qlast sees, kfirst rounded down to a
## multiple of `align`; none past the sequence's end.
<%def name="key_range(align)">
<%  first = "q0 + 1 - W" if align == "1" else "(q0 + 1 - W) / %s * %s" % (align, align) %>\
    const uint kfirst = ${"q0 + 1 > W ? %s : 0" % first if sliding else "0"};
    const uint kend = q0 < T ? ${"qlast + 1" if causal else ("min(T, qlast + W)" if sliding else "T")} : 0;
</%def>\
## The variants' trailing kernel parameters (dqs takes no softcap).
<%def name="variant_params()">${", const uint W" if sliding else ""}${", const float cap" if softcap and kind != "dqs" else ""}</%def>\
<%def name="store(m, dst, rowexpr, pos0)">
% for i in range(tr):
    if (${pos0} + tr * TR + ${i} < T) {
        const idx_t at = (${rowexpr.format(pos="(%s + tr * TR + %d)" % (pos0, i))}) * HDV + tc;
%   for jj in range(tdv):
        ${storev(st, vw, "acc%d_%d_%d" % (m, i, jj), dst, "at + %d" % (jj * nc2))};
%   endfor
    }
% endfor
</%def>

% if kind == "dkv":
// LANES work-items per row (consecutive lanes read consecutive vectors), each summing every
// LANES-th vector of it; the row's first lane then adds the LANES sums in order.
#define LANES ${lanes}
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void attn_bwd_dsum(__global const ${vptr(st, vw)} *restrict o, __global const ${vptr(st, vw)} *restrict dO,
                   __global float *restrict dsum, const uint rows${checked_args("o", "dO", "dsum")})
{
    __local float part[WG];
    const uint lid = get_local_id(0), lane = lid % LANES, i = get_group_id(0) * (WG / LANES) + lid / LANES;
    vec_t acc = (vec_t)(0.0f);
    if (i < rows) {
        for (uint c = lane; c < HDV; c += LANES)
            acc += ${loadv(st, vw, "o", "(idx_t)i * HDV + c")} * ${loadv(st, vw, "dO", "(idx_t)i * HDV + c")};
    }
    part[lid] = ${" + ".join("acc" + e for e in comps)};
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lane == 0 && i < rows) {
        float d = part[lid];
        for (uint l = 1; l < LANES; ++l)
            d += part[lid + l];
        dsum[${at("dsum", "i")}] = d;
    }
}

#define CROW BK                      // row length of the P / dS tiles ([q][k])
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void attn_bwd_dkv(__global const ${vptr(st, vw)} *restrict q, __global const ${vptr(st, vw)} *restrict k,
                  __global const ${vptr(st, vw)} *restrict v, __global const ${vptr(st, vw)} *restrict dO,
                  __global const float *restrict lse, __global const float *restrict dsum,
                  __global ${vptr(st, vw)} *restrict dk, __global ${vptr(st, vw)} *restrict dv,${" __global float *restrict ds," if store_ds else ""}${" __global const int *restrict cu," if varlen else ""}
                  const uint ${tp}, const uint nh, const uint nkv, const uint nwin, const float c2, const float scale${variant_params()}${checked_args(*["q", "k", "v", "dO", "lse", "dsum", "dk", "dv"] + ["ds"] * store_ds + ["cu"] * varlen)})
{
    __local coef_t cp[BQ * BK / TR], cds[BQ * BK / TR];
    ${prologue()}
    const uint gid = get_group_id(0), per = nwin * nkv;
    const uint k0 = (gid / per) * BK, w = (gid % per) / nkv, g = (gid % per) % nkv;
    const uint ${sequence()}, rep = nh / nkv;
% if store_ds and not triangle:
    const uint R = ${row_len};
% endif
% if not plain or varlen:
    // the query blocks holding a query that sees a key of the block (none past the sequence's end)
    const uint qend = k0 < T ? ${"min(T, k0 + BK - 1 + W)" if sliding else "T"} : 0;
% endif
    for (uint h = g * rep; h < (g + 1) * rep; ++h) {
% if store_ds and triangle:
        const idx_t dsbase = ((idx_t)w * nh + h) * ((idx_t)T * (T + 1) / 2);
% endif
% if plain and not varlen:
        for (uint q0 = (k0 / BQ) * BQ; q0 < T; q0 += BQ) {
% else:
        for (uint q0 = ${"(k0 / BQ) * BQ" if causal else ("(k0 + 1 > W ? (k0 + 1 - W) / BQ * BQ : 0)" if sliding else "0")}; q0 < qend; q0 += BQ) {
% endif
            const bool masked = ${"q0 < k0 + BK || q0 + BQ > T" if plain else " || ".join(edges("q0", "k0", "BQ", "BK") + ["q0 + BQ > T"])};
<%          xsrc = [("dO", "(idx_t)(tok0 + pos) * nh + h"), ("q", "(idx_t)(tok0 + pos) * nh + h")] %>\
% if causal:
            // query rows above the key block see none of its keys
% endif
            ${scores("cp", "cds", lambda r, c: "%s * BK + %s" % (r, c), "masked",
                     capture(first_chunk, xsrc, "q0 <= k0 ? k0 % BQ / JC * JC : 0" if causal else "0", "q0"))}
            ${accumulate(["cp", "cds"], xsrc, ["sdo", "sq_"], None,
                         "min((uint)BQ, %s - q0)" % ("T" if plain and not varlen else "qend"), "q0", "masked",
                         (lambda j, i: "q0 + %s >= k0 + %s" % (j, i)) if plain else
                         ((lambda j, i: visible("q0 + " + j, "k0 + " + i)) if causal or sliding else None))}
        }
    }
% if split == 2:
    if (side == 0) {
        ${store(0, "dv", "(idx_t)(tok0 + {pos}) * nkv + g", "k0")}
    } else {
        ${store(0, "dk", "(idx_t)(tok0 + {pos}) * nkv + g", "k0")}
    }
% else:
    ${store(0, "dv", "(idx_t)(tok0 + {pos}) * nkv + g", "k0")}
    ${store(1, "dk", "(idx_t)(tok0 + {pos}) * nkv + g", "k0")}
% endif
}
% elif kind == "dq":
#define CROW BQ                      // row length of the dSᵀ tile ([k][q])
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void attn_bwd_dq(__global const ${vptr(st, vw)} *restrict q, __global const ${vptr(st, vw)} *restrict k,
                 __global const ${vptr(st, vw)} *restrict v, __global const ${vptr(st, vw)} *restrict dO,
                 __global const float *restrict lse, __global const float *restrict dsum,
                 __global ${vptr(st, vw)} *restrict dq,${" __global const int *restrict cu," if varlen else ""}
                 const uint ${tp}, const uint nh, const uint nkv, const uint nwin, const float c2, const float scale${variant_params()}${checked_args(*["q", "k", "v", "dO", "lse", "dsum", "dq"] + ["cu"] * varlen)})
{
    __local coef_t cds[BQ * BK / TR];
    ${prologue()}
    const uint gid = get_group_id(0), per = nwin * nh;
    const uint q0 = ((${tp} - 1) / BQ - gid / per) * BQ, w = (gid % per) / nh, h = (gid % per) % nh;
    const uint ${sequence()}, g = h / (nh / nkv);
    const uint qlast = min(q0 + BQ, T) - 1;
% if plain and not varlen:
    for (uint k0 = 0; k0 <= qlast; k0 += BK) {
        const bool masked = k0 + BK - 1 > q0 || q0 + BQ > T;
% else:
    ${key_range("BK")}
    for (uint k0 = kfirst; k0 < kend; k0 += BK) {
        const bool masked = ${"k0 + BK - 1 > q0 || q0 + BQ > T" if plain else " || ".join(edges("q0", "k0", "BQ", "BK") + ["q0 + BQ > T"])};
% endif
<%      ksrc = [("k", "(idx_t)(tok0 + pos) * nkv + g")] %>\
        ${scores(None, "cds", lambda r, c: "%s * BQ + %s" % (c, r), "masked", capture(first_chunk, ksrc, "0", "k0"))}
        // keys past the block's last query (or the window) have dS = 0
        ${accumulate(["cds"], ksrc, ["sk_"], None,
                     "min((uint)BK, qlast + 1 - k0)" if plain and not varlen else "min((uint)BK, kend - k0)", "k0", "masked",
                     (lambda j, i: "k0 + %s <= q0 + %s" % (j, i)) if plain else
                     ((lambda j, i: visible("q0 + " + i, "k0 + " + j)) if causal or sliding else None))}
    }
    ${store(0, "dq", "(idx_t)(tok0 + {pos}) * nh + h", "q0")}
}
% else:
#define JCP (JC + 1)                 // row stride of the staged dS chunk, padded against bank conflicts
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void attn_bwd_dqs(__global const ${vptr(st, vw)} *restrict k, __global const float *restrict ds,
                  __global ${vptr(st, vw)} *restrict dq,${" __global const int *restrict cu," if varlen else ""}
                  const uint ${tp}, const uint nh, const uint nkv, const uint nwin${variant_params()}${checked_args(*["k", "ds", "dq"] + ["cu"] * varlen)})
{
    __local float sds[BQ * JCP];
    ${prologue()}
    const uint gid = get_group_id(0), per = nwin * nh;
    const uint q0 = ((${tp} - 1) / BQ - gid / per) * BQ, w = (gid % per) / nh, h = (gid % per) % nh;
    const uint ${sequence()}, g = h / (nh / nkv);
    const uint qlast = min(q0 + BQ, T) - 1;
% if triangle:
    const idx_t dsbase = ((idx_t)w * nh + h) * ((idx_t)T * (T + 1) / 2);
    // every key up to the block's last query, JC at a time; chunks reaching past q0 are masked
    ${accumulate(["sds"], [("k", "(idx_t)(tok0 + pos) * nkv + g")], None, "0", "qlast + 1", "0",
                  "j0 + JC > q0 + 1", lambda j, i: "%s <= q0 + %s" % (j, i))}
% else:
    const uint R = ${row_len};
    ${key_range("1")}
    // the keys that a row of the block sees, JC at a time; chunks crossing the mask's edges are masked
    ${accumulate(["sds"], [("k", "(idx_t)(tok0 + pos) * nkv + g")], None, "kfirst", "kend", "0",
                  " || ".join(edges("q0", "j0", "BQ", "JC")), (lambda j, i: visible("q0 + " + i, j)) if causal or sliding else None)}
% endif
    ${store(0, "dq", "(idx_t)(tok0 + {pos}) * nh + h", "q0")}
}
% endif
