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
// The gradient, without atomics: the keys id·2³² + i (id = vocab for an id
// out of range) are sorted (a bitonic sort over NP = n rounded up to a power of
// two, padded with ~0: embedding_keys, then bitonic_block for every stride
// below 2·WG in local memory and bitonic_global for the larger ones), so each
// vocab row's tokens lie together in increasing i; embedding_accumulate, one
// work-group per vocab row, finds its run by binary search and adds the run's
// dout rows in that order (into dtable's own row when ACC). Same bits every run.
//
// Parameters: WG work-items per group, COUNT whether invalid ids are counted,
// IDX the index type (uint when every index fits 32 bits, else ulong), ST the
// storage type of table, out and dout, GST that of dtable (float32 or ST),
// UNIT the lookup's copy type.
<%namespace name="common" file="common.cl.mako"/>\
#define WG ${wg}
#define B (2 * WG)
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

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void embedding_keys(__global ulong *restrict keys, __global const int *restrict ids${invalid_arg},
                    const uint n, const uint vocab${checked_args("keys", "ids", *(["invalid"] if count else []))})
{
    const uint i = get_global_id(0);  // every key of the padded array
    if (i >= n) {
        keys[${at("keys", "i")}] = ~(ulong)0;
        return;
    }
    const int id = ids[${at("ids", "i")}];
    const bool ok = id >= 0 && (uint)id < vocab;
% if count:
    if (!ok)
        atomic_inc(invalid);
% endif
    keys[${at("keys", "i")}] = (ulong)(ok ? (uint)id : vocab) << 32 | i;
}

// Strides below B within one block of B keys, in local memory: for every size from
// size_first to size_last (powers of two), strides min(size, B)/2 down to 1.
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void bitonic_block(__global ulong *restrict keys, const uint size_first, const uint size_last${checked_args("keys")})
{
    __local ulong s[B];
    const uint lid = get_local_id(0), base = get_group_id(0) * B;
    s[lid] = keys[${at("keys", "base + lid")}];
    s[lid + WG] = keys[${at("keys", "base + lid + WG")}];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint size = size_first; size <= size_last; size <<= 1) {
        for (uint stride = min(size, (uint)B) / 2; stride > 0; stride >>= 1) {
            const uint a = (lid / stride) * 2 * stride + lid % stride, b = a + stride;
            const bool up = ((base + a) & size) == 0;
            const ulong ka = s[a], kb = s[b];
            if ((ka > kb) == up) {
                s[a] = kb;
                s[b] = ka;
            }
            barrier(CLK_LOCAL_MEM_FENCE);
        }
    }
    keys[${at("keys", "base + lid")}] = s[lid];
    keys[${at("keys", "base + lid + WG")}] = s[lid + WG];
}

// One stride (≥ B) of one size over all keys: work-item p compares the pair (a, a + stride).
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void bitonic_global(__global ulong *restrict keys, const uint size, const uint stride${checked_args("keys")})
{
    const uint p = get_global_id(0);
    const uint a = (p / stride) * 2 * stride + p % stride, b = a + stride;
    const bool up = (a & size) == 0;
    const ulong ka = keys[${at("keys", "a")}], kb = keys[${at("keys", "b")}];
    if ((ka > kb) == up) {
        keys[${at("keys", "a")}] = kb;
        keys[${at("keys", "b")}] = ka;
    }
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void embedding_accumulate(__global ${ctype(gst)} *restrict dtable, __global const ${ctype(st)} *restrict dout,
                          __global const ulong *restrict keys, const uint n, const uint d,
                          const int acc${checked_args("dtable", "dout", "keys")})
{
    const uint lid = get_local_id(0);
    const ulong v = get_group_id(0);
    uint lo = 0, hi = n;  // the first sorted key whose id is ≥ v
    while (lo < hi) {
        const uint mid = (lo + hi) / 2;
        if (keys[${at("keys", "mid")}] >> 32 < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    for (uint j = lid; j < d; j += WG) {
        float sum = acc ? ${load(gst, 1, "dtable", at("dtable", "v * d + j"))} : 0.0f;
        for (uint k = lo; k < n; ++k) {
            const ulong key = keys[${at("keys", "k")}];
            if (key >> 32 != v)
                break;
            sum += ${load(st, 1, "dout", at("dout", "(idx_t)(uint)key * d + j"))};
        }
        ${store(gst, 1, "sum", "dtable", at("dtable", "v * d + j"))};
    }
}
