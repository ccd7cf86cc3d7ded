// clops embedding family: the lookup of token rows and its deterministic gradient.
//
// Layout: table, dtable [vocab, d]; ids int32 [n]; out, dout [n, d]; all
// row-major of storage type ST (float, half or bf16) but ids. The lookup copies
// the stored bits; the gradient widens to float32, sums there and rounds each
// dtable element once. An id outside [0, vocab) reads nothing: its output
// row is zeros, its gradient row is dropped, and with COUNT it adds 1 to
// invalid[0] (an integer atomic; no float atomics anywhere).
//
// embedding_fwd: one work-group per token row, work-items across the row's
// bits in units of UNIT (the widest of uint4, uint2, uint, ushort that divides
// a row's bytes: a 16-bit row moves 16 bytes per access as a float32 one does).
// The gradient, without atomics: the keys id·2³² + i (id = vocab for an id out
// of range) are sorted in runs of RUN consecutive tokens, so that in each run a
// vocab row's tokens lie together in increasing i. A bitonic sort over NP = n
// rounded up to a power of two, padded with ~0, in blocks of B = 8·WG keys:
// embedding_keys makes each block's keys and sorts it in local memory; then for
// each size above B up to RUN (a power of two, at least B, NP / RUN ≤ RUNS
// runs), bitonic_global takes the strides ≥ B two at a time (four keys per
// work-item) and bitonic_block the strides below B in local memory; sizes of
// RUN sort ascending, smaller ones alternate as bitonic merging needs.
// embedding_offsets finds, in each run c, each vocab row's first key (a binary
// search per run and row: start[c·(vocab + 1) + v], v ≤ vocab);
// embedding_accumulate, one work-group per vocab row, adds the dout rows of its
// keys run by run, so in token order (into dtable's own row when acc; a row
// without tokens is then left as it is) in vectors of VW elements, aligned,
// four tokens' loads in flight: the main pass streams whole rows of dtable.
// Same bits every run, and those of a full sort: no merge passes at all while
// NP ≤ RUNS·B.
//
// Parameters: WG work-items per group, COUNT whether invalid ids are counted,
// IDX the index type (uint when every index fits 32 bits, else ulong), ST the
// storage type of table, out and dout, GST that of dtable (float32 or ST),
// UNIT the lookup's copy type, VW the gradient's vector width (dividing d),
// RUNS the most sorted runs the gradient reads.
<%namespace name="common" file="common.cl.mako"/>\
#define WG ${wg}
#define B (8 * WG)
#define VW ${vw}
#define RUNS ${runs}
typedef ${idx} idx_t;
${common.guards()}\
${common.storage(st, gst)}\
<% invalid_arg = ", __global int *restrict invalid" if count else "" %>

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void embedding_fwd(__global ${unit} *restrict out, __global const ${unit} *restrict table, __global const int *restrict ids${invalid_arg},
                   const uint vocab, const uint d${checked_args("out", "table", "ids", *(["invalid"] if count else []))})
{
    const uint lid = get_local_id(0);
    const idx_t i = get_group_id(0);
    const int id = ids[${at("ids", "i")}];
    const bool ok = id >= 0 && (uint)id < vocab;
% if count:
    if (!ok && lid == 0)
        atomic_inc(invalid);
% endif
    for (uint j = lid; j < d; j += WG)  // d counts units here; the stored bits copied, 0 is +0 in every type
        out[${at("out", "i * d + j")}] = ok ? table[${at("table", "(idx_t)id * d + j")}] : (${unit})0;
}

## Every size from `first` to `last` (powers of two), strides min(size, B)/2 down to 1, over the
## block of keys in local `s`; sizes of `run` keys or more ascending.
<%def name="block_sort(first, last)">\
    for (uint size = ${first}; size <= ${last}; size <<= 1) {
        for (uint stride = min(size, (uint)B) / 2; stride > 0; stride >>= 1) {
            for (uint p = lid; p < B / 2; p += WG) {
                const uint a = (p & ~(stride - 1)) << 1 | (p & (stride - 1)), b = a + stride;  // strides: powers of two
                const bool up = size >= run || ((base + a) & size) == 0;
                const ulong ka = s[a], kb = s[b];
                if ((ka > kb) == up) {
                    s[a] = kb;
                    s[b] = ka;
                }
            }
            barrier(CLK_LOCAL_MEM_FENCE);
        }
    }
</%def>

// Each block of B keys made from the ids and sorted (sizes 2 to B).
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void embedding_keys(__global ulong *restrict keys, __global const int *restrict ids${invalid_arg},
                    const uint n, const uint vocab, const uint run${checked_args("keys", "ids", *(["invalid"] if count else []))})
{
    __local ulong s[B];
    const uint lid = get_local_id(0), base = get_group_id(0) * B;
    for (uint p = lid; p < B; p += WG) {
        const uint i = base + p;
        ulong key = ~(ulong)0;
        if (i < n) {
            const int id = ids[${at("ids", "i")}];
            const bool ok = id >= 0 && (uint)id < vocab;
% if count:
            if (!ok)
                atomic_inc(invalid);
% endif
            key = (ulong)(ok ? (uint)id : vocab) << 32 | i;
        }
        s[p] = key;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
${block_sort("2", "B")}\
    for (uint p = lid; p < B; p += WG)
        keys[${at("keys", "base + p")}] = s[p];
}

// The strides of merge_size below B, in local memory.
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void bitonic_block(__global ulong *restrict keys, const uint merge_size, const uint run${checked_args("keys")})
{
    __local ulong s[B];
    const uint lid = get_local_id(0), base = get_group_id(0) * B;
    for (uint p = lid; p < B; p += WG)
        s[p] = keys[${at("keys", "base + p")}];
    barrier(CLK_LOCAL_MEM_FENCE);
${block_sort("merge_size", "merge_size")}\
    for (uint p = lid; p < B; p += WG)
        keys[${at("keys", "base + p")}] = s[p];
}

// Stride `stride` (≥ B) of `size`, and with `both` gap = stride/2 after it: work-item p holds the
// keys a, a + gap, a + stride, a + stride + gap in registers.
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void bitonic_global(__global ulong *restrict keys, const uint size, const uint stride, const int both,
                    const uint run${checked_args("keys")})
{
    const uint p = get_global_id(0), gap = stride / 2;
    const uint a = (p & ~(gap - 1)) << 2 | (p & (gap - 1));  // (p / gap)·2·stride + p % gap, gap a power of two
    const bool up = size >= run || (a & size) == 0;  // the same for all four: one block of 2·stride ≤ size
    ulong k[4];
    for (int r = 0; r < 4; ++r)
        k[r] = keys[${at("keys", "a + r * gap")}];
    for (int r = 0; r < 2; ++r)
        if ((k[r] > k[r + 2]) == up) {
            const ulong t = k[r];
            k[r] = k[r + 2];
            k[r + 2] = t;
        }
    if (both)
        for (int r = 0; r < 4; r += 2)
            if ((k[r] > k[r + 1]) == up) {
                const ulong t = k[r];
                k[r] = k[r + 1];
                k[r + 1] = t;
            }
    for (int r = 0; r < 4; ++r)
        keys[${at("keys", "a + r * gap")}] = k[r];
}

// start[c·(vocab + 1) + v]: the first key of run c whose id is ≥ v, for v ≤ vocab.
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void embedding_offsets(__global uint *restrict start, __global const ulong *restrict keys, const uint run,
                       const uint vocab${checked_args("start", "keys")})
{
    const uint v = get_global_id(0), c = get_global_id(1);
    if (v > vocab)
        return;
    uint lo = c * run, hi = lo + run;
    while (lo < hi) {
        const uint mid = lo + (hi - lo) / 2;
        if (keys[${at("keys", "mid")}] >> 32 < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    start[${at("start", "(idx_t)c * (vocab + 1) + v")}] = lo;
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void embedding_accumulate(__global ${ctype(gst)} *restrict dtable, __global const ${ctype(st)} *restrict dout,
                          __global const ulong *restrict keys, __global const uint *restrict start, const uint d,
                          const int acc, const uint runs, const uint vocab${checked_args("dtable", "dout", "keys", "start")})
{
    __local uint range[2 * RUNS];  // the row's keys in each run: [range[2c], range[2c + 1])
    const uint lid = get_local_id(0), v = get_group_id(0);
    for (uint e = lid; e < 2 * runs; e += WG)
        range[e] = start[${at("start", "(idx_t)(e / 2) * (vocab + 1) + v + e % 2")}];
    barrier(CLK_LOCAL_MEM_FENCE);
    uint count = 0;
    for (uint c = 0; c < runs; ++c)
        count += range[2 * c + 1] - range[2 * c];
    if (acc && count == 0)
        return;  // nothing to add (uniform across the group)
    for (uint j = lid * VW; j < d; j += WG * VW) {
        ${vtype(vw)} sum = acc ? ${load(gst, vw, "dtable", at("dtable", "(idx_t)v * d + j", vw), aligned=True)} : (${vtype(vw)})0.0f;
        for (uint c = 0; c < runs; ++c) {  // runs in token order
            uint k = range[2 * c];
            const uint hi = range[2 * c + 1];
            for (; k + 4 <= hi; k += 4) {  // four rows' loads in flight, added in token order
%   for u in range(4):
                const ${vtype(vw)} x${u} = ${load(st, vw, "dout", at("dout", "(idx_t)(uint)keys[%s] * d + j" % at("keys", "k + %d" % u), vw), aligned=True)};
%   endfor
                sum += x0;
                sum += x1;
                sum += x2;
                sum += x3;
            }
            for (; k < hi; ++k)
                sum += ${load(st, vw, "dout", at("dout", "(idx_t)(uint)keys[%s] * d + j" % at("keys", "k"), vw), aligned=True)};
        }
        ${store(gst, vw, "sum", "dtable", at("dtable", "(idx_t)v * d + j", vw), aligned=True)};
    }
}
