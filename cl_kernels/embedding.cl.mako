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
// of range) are sorted, so that each vocab row's tokens lie together in
// increasing i. A bitonic sort over NP = n rounded up to a power of two, padded
// with ~0, in blocks of B = 8·WG keys: embedding_keys makes each block's keys
// and sorts it in local memory; then for each size above B, bitonic_global<r>
// takes the strides ≥ B three at a time (r ≤ 3 a launch) and bitonic_block the
// strides below B in local memory. Every pass takes up to three strides at
// once: a work-item holds the 2^r keys they pair in registers and exchanges them
// there (a third of the local-memory traffic and barriers of a stride a pass;
// local memory swizzled so that no pass has bank conflicts). embedding_offsets
// finds each vocab row's first key (a binary search per row: start[v], v ≤ vocab);
// embedding_accumulate streams dtable as one flat run of aligned vectors of VW
// elements (an elementwise op's layout, whatever d is): work-item t of group b
// takes the vectors b·WG·EPT + t + e·WG (e < EPT), and for each adds the dout
// rows of its vocab row's keys in that order (into dtable's own value when acc;
// a row without tokens is then left as it is). The EPT vectors' row offsets,
// first tokens and first dout loads are each issued together (a vocab row of one
// token, the common case, waits on three loads whatever EPT is); further tokens
// four loads in flight. Same bits every run.
//
// Parameters: WG work-items per group, EPT dtable vectors per work-item of the
// gradient's main pass, COUNT whether invalid ids are counted,
// IDX the index type (uint when every index fits 32 bits, else ulong), ST the
// storage type of table, out and dout, GST that of dtable (float32 or ST),
// UNIT the lookup's copy type, VW the gradient's vector width (dividing d).
<%namespace name="common" file="common.cl.mako"/>\
#define WG ${wg}
#define B (8 * WG)
#define VW ${vw}
#define EPT ${ept}
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

## Bitonic passes: a pass takes r ≤ 3 consecutive strides top, top/2, ..., g = top >> (r − 1) of a
## merge of `size` (powers of two; top < size) at once. Its unit p (of NP >> r) holds the 2^r keys
## a + m·g (m < 2^r), a = p with r zero bits put in at g's bit, in registers (k0, k1, ...), and
## exchanges them over the r strides: every pair of each stride exactly once. They lie in one block
## of 2·top ≤ size, so one direction serves them: ascending where (first key's index & size) is 0.
<%!
    def first_key(p, g, r):
        """The index of unit p's first key: p with r zero bits put in at stride g's bit."""
        return f"{p} << {r}" if g == "1" else f"(({p} & ~({g} - 1)) << {r} | ({p} & ({g} - 1)))"

    def network(r):
        """The exchanges of keys k0, ..., k(2^r − 1) over strides 2^(r − 1), ..., 1 of their index: a line a stride."""
        return [" ".join(f"EXCHANGE(k{m}, k{m + 2**j});" for m in range(2**r) if not m >> j & 1)
                for j in reversed(range(r))]
%>\
// k_a, k_b in the direction `up`
#define EXCHANGE(ka, kb) { const ulong x = min(ka, kb), y = max(ka, kb); ka = up ? x : y; kb = up ? y : x; }
## The block's keys in local `s` (key x at SWZ(x): its low four bits XOR the next four, so that the
## 16 8-byte slots of a bank row see distinct keys in each warp access of every pass): the strides
## min(size, B)/2 down to 1 of a merge of `size`, three a pass while three are left, then a pass of
## the last two or one (at g = 1: no bank conflicts).
#define SWZ(x) ((x) ^ ((x) >> 4 & 15))
<%def name="local_pass(r, g, size)">\
            for (uint p = lid; p < (B >> ${r}); p += WG) {
                const uint a = ${first_key("p", g, r)};
                const bool up = ((base + a) & ${size}) == 0;
%   for m in range(2**r):
                ulong k${m} = s[SWZ(a + ${m} * ${g})];
%   endfor
%   for line in network(r):
                ${line}
%   endfor
%   for m in range(2**r):
                s[SWZ(a + ${m} * ${g})] = k${m};
%   endfor
            }
            barrier(CLK_LOCAL_MEM_FENCE);
</%def>
<%def name="local_merge(size)">\
    {
        uint top = min(${size}, (uint)B) / 2;
        for (; top >= 4; top >>= 3) {
            const uint g = top >> 2;
${local_pass(3, "g", size)}\
        }
        if (top == 2) {
${local_pass(2, "1", size)}\
        } else if (top == 1) {
${local_pass(1, "1", size)}\
        }
    }
</%def>

// Each block of B keys made from the ids and sorted (sizes 2 to B).
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void embedding_keys(__global ulong *restrict keys, __global const int *restrict ids${invalid_arg},
                    const uint n, const uint vocab${checked_args("keys", "ids", *(["invalid"] if count else []))})
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
        s[SWZ(p)] = key;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint size = 2; size <= B; size <<= 1)
${local_merge("size")}\
    for (uint p = lid; p < B; p += WG)
        keys[${at("keys", "base + p")}] = s[SWZ(p)];
}

// The strides of merge_size below B, in local memory.
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void bitonic_block(__global ulong *restrict keys, const uint merge_size${checked_args("keys")})
{
    __local ulong s[B];
    const uint lid = get_local_id(0), base = get_group_id(0) * B;
    for (uint p = lid; p < B; p += WG)
        s[SWZ(p)] = keys[${at("keys", "base + p")}];
    barrier(CLK_LOCAL_MEM_FENCE);
${local_merge("merge_size")}\
    for (uint p = lid; p < B; p += WG)
        keys[${at("keys", "base + p")}] = s[SWZ(p)];
}

% for r in (1, 2, 3):
// The ${r} stride${"s" if r > 1 else ""} from `stride` down (all ≥ B) of a merge of `size`: work-item p holds ${2**r} keys.
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void bitonic_global${r}(__global ulong *restrict keys, const uint size, const uint stride${checked_args("keys")})
{
    const uint p = get_global_id(0), g = stride >> ${r - 1};
    const uint a = ${first_key("p", "g", r)};
    const bool up = (a & size) == 0;
%   for m in range(2**r):
    ulong k${m} = keys[${at("keys", "a + %d * g" % m)}];
%   endfor
%   for line in network(r):
    ${line}
%   endfor
%   for m in range(2**r):
    keys[${at("keys", "a + %d * g" % m)}] = k${m};
%   endfor
}

% endfor
// start[v]: the first sorted key whose id is ≥ v, for v ≤ vocab.
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void embedding_offsets(__global uint *restrict start, __global const ulong *restrict keys, const uint np,
                       const uint vocab${checked_args("start", "keys")})
{
    const uint v = get_global_id(0);
    if (v > vocab)
        return;
    uint lo = 0, hi = np;
    while (lo < hi) {
        const uint mid = lo + (hi - lo) / 2;
        if (keys[${at("keys", "mid")}] >> 32 < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    start[${at("start", "v")}] = lo;
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void embedding_accumulate(__global ${ctype(gst)} *restrict dtable, __global const ${ctype(st)} *restrict dout,
                          __global const ulong *restrict keys, __global const uint *restrict start, const uint d,
                          const idx_t total, const int acc${checked_args("dtable", "dout", "keys", "start")})
{
    // dtable as `total` vectors of VW elements, `per` a row; this work-item's vectors f + e·WG (e < EPT)
    const uint per = d / VW, step_rows = WG / per, step_cols = WG - step_rows * per;
    const idx_t f = (idx_t)get_group_id(0) * (WG * EPT) + get_local_id(0);
    idx_t v = f / per;  // the vector's row, and j its vector in the row
    uint j = (uint)(f - v * per);
% for e in range(ept):
%   if e:
    j += step_cols;
    v += step_rows + (j >= per);
    j -= j >= per ? per : 0;
%   endif
    const uint c${e} = j * VW;  // its first column
    const idx_t at${e} = v * d + c${e};  // its first dtable element
    uint lo${e} = 0, hi${e} = 0;  // its row's keys
    if (f + ${e} * WG < total) {
        lo${e} = start[${at("start", "v")}];
        hi${e} = start[${at("start", "v + 1")}];
    }
% endfor
    // each vector's first token's dout and its given dtable value, all loaded before any is added
% for e in range(ept):
    const idx_t first${e} = lo${e} < hi${e} ? (idx_t)(uint)keys[${at("keys", "lo%d" % e)}] * d + c${e} : 0;
% endfor
% for e in range(ept):
    ${vtype(vw)} sum${e} = acc && lo${e} < hi${e} ? ${load(gst, vw, "dtable", at("dtable", "at%d" % e, vw), aligned=True)} : (${vtype(vw)})0.0f;
    const ${vtype(vw)} x${e} = lo${e} < hi${e} ? ${load(st, vw, "dout", at("dout", "first%d" % e, vw), aligned=True)} : (${vtype(vw)})0.0f;
% endfor
% for e in range(ept):
<% token = lambda k: "(idx_t)(uint)keys[%s] * d + c%d" % (at("keys", k), e) %>\
    if (lo${e} < hi${e}) {
        sum${e} += x${e};
        uint k = lo${e} + 1;
        for (; k + 4 <= hi${e}; k += 4) {  // four rows' loads in flight, added in token order
%   for u in range(4):
            const ${vtype(vw)} y${u} = ${load(st, vw, "dout", at("dout", token("k + %d" % u), vw), aligned=True)};
%   endfor
            sum${e} += y0;
            sum${e} += y1;
            sum${e} += y2;
            sum${e} += y3;
        }
        for (; k < hi${e}; ++k)
            sum${e} += ${load(st, vw, "dout", at("dout", token("k"), vw), aligned=True)};
    }
    if (f + ${e} * WG < total && !(acc && lo${e} == hi${e}))  // a given dtable's rows without tokens left as they are
        ${store(gst, vw, "sum%d" % e, "dtable", at("dtable", "at%d" % e, vw), aligned=True)};
% endfor
}
