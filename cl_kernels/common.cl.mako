## Shared OpenCL snippets for clops templates (include with <%namespace>).
## Python string helpers (vtype, vload, vstore) come from clops.program.render.

## A hint to bring the vector at `addr` (a __global pointer expression) into the caches: PTX's
## prefetch.global.L2 with `ptx` (NVIDIA's OpenCL prefetch() does nothing measurable), else OpenCL's
## prefetch. Not a read: neither guarded nor checked.
<%def name="prefetch(addr, ptx)">\
% if ptx:
asm volatile("prefetch.global.L2 [%0];" :: "l"(${addr}))\
% else:
prefetch(${addr}, 1)\
% endif
</%def>

## `var` (a float variable) plus its values in the lanes lane ^ m, for each m of `masks` in turn (PTX
## shfl.sync.bfly: every lane of the warp takes part); over a power of two of lanes, their sum in all of
## them, with the same bits (addition commuting).
<%def name="butterfly_sum(var, masks)">\
% for m in masks:
    {
        float o_;
        asm volatile("shfl.sync.bfly.b32 %0, %1, ${m}, 0x1f, 0xffffffff;" : "=f"(o_) : "f"(${var}));
        ${var} += o_;
    }
% endfor
</%def>

## Sum of `val` over the WG work-items of a group, through `scratch` (WG floats
## of local memory); every work-item gets the result. Call in uniform control
## flow: it holds barriers. Fixed pairing order, so results are deterministic.
## `fence`: the flags of the last barrier (add_rms_norm_fwd's orders the global
## reads before it too).
<%def name="group_sum(result, val, scratch, lid, wg, fence='CLK_LOCAL_MEM_FENCE', ptx=0)">
% if ptx and wg % 32 == 0 and wg >= 64:
    // NVIDIA (ptx): each warp's sum by a butterfly of shuffles (the same bits in all its lanes, addition
    // commuting), then the warps' sums added in warp order from `scratch` by every work-item: two
    // barriers where the tree takes log2(wg) + 2.
    {
        float v_ = ${val};
${butterfly_sum("v_", (16, 8, 4, 2, 1))}\
        if ((${lid} & 31) == 0)
            ${scratch}[${lid} / 32] = v_;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    float ${result} = ${scratch}[0];
    for (uint w_ = 1; w_ < ${wg // 32}; ++w_)
        ${result} += ${scratch}[w_];
    barrier(${fence});
% else:
    ${scratch}[${lid}] = ${val};
    barrier(CLK_LOCAL_MEM_FENCE);
% for s in [2**i for i in range(20, -1, -1) if 2**i < wg]:
    if (${lid} < ${s} && ${lid} + ${s} < ${wg}) ${scratch}[${lid}] += ${scratch}[${lid} + ${s}];
    barrier(CLK_LOCAL_MEM_FENCE);
% endfor
    const float ${result} = ${scratch}[0];
    barrier(${fence});
% endif
</%def>

<%!
def _lanes(vw, v):
    return [v] if vw == 1 else ["%s.s%x" % (v, l) for l in range(vw)]
%>
## Rows outside float32's square range (#19; rms_norm and qk_norm_rope). The
## kernels sum x² in float32 as before, and test the row's q = total/d + eps
## (the float32 mean square plus eps, which they compute anyway) once:
##   - q = inf: a square, a partial sum or q overflowed;
##   - q < 2^−100: squares below 2^−126 are subnormal, each rounded with an
##     absolute error up to 2^−150 (subnormal sums are exact), so total/d is
##     off by at most 2^−150 + 2^−150 (its own rounding) = 2^−149 beyond the
##     usual relative roundings. From q ≥ 2^−100 on that is ≤ 2^−49 of q, far
##     below float32's 2^−24: those rows are right as they are, whatever d.
## A finite q ≥ 2^−100 also means no square or partial sum overflowed (all are
## ≤ total) and inv = 1/sqrt(q) is normal, in [2^−64, 2^50]. Other rows
## (`rescale` true) take a slow path that reads the row again (scaled_sumsq); a row
## of NaN fails both tests and keeps the plain formulas, as does a row whose
## largest |x| is 0 (eps = 0: inv = inf as before) or inf.
<%def name="rescale(q)">(isinf(${q}) || ${q} < 0x1p-100f)</%def>

## The backward's test on a row's inv: |inv| outside [2^−32, 2^32] (0, inf
## included, NaN not), the rows take the scaled form. Inside, x is within about
## 2^32 of rms, so the products dy·w·x, their sum and coef = Σ/d·inv³ (≈
## |dy·w|·inv²) stay far inside float32 for any dy·w between 2^−60 and 2^60.
## (The forward's inv is positive; a given one of either sign and a normal
## magnitude, the bench's, say, keeps the plain formulas and their speed.)
<%def name="bwd_scaled(iv)">(fabs(${iv}) < 0x1p-32f || fabs(${iv}) > 0x1p32f)</%def>

## Slow path, one work-item reading a whole row of `nv` vectors of `vw` lanes
## (`load(j)`: the text of vector j, widened to float), no barriers:
## `${p}_m` the largest |x| (fmax passes NaN over), `${p}_ok` whether it is
## finite and > 0, `${p}_e` its exponent (ilogb, subnormals included) and
## `${p}_s` = Σ (x·2^−e)² in [1, 4·d), compensated (Kahan; no -cl-fast-
## relaxed-math, so the compensation is kept). x·2^−e is exact (ldexp; of a vector
## with an ivec exponent: oclgrind 21.10 scales lane 0 only for a scalar one), and the
## squares that underflow are below 2^−150 of the largest one.
<%def name="scaled_sumsq(p, load, nv, vw)">
    float ${p}_m = 0.0f;
    #pragma unroll 1
    for (uint jj = 0; jj < ${nv}; ++jj) {
        const vec ma = fabs(${load("jj")});
% for l in _lanes(vw, "ma"):
        ${p}_m = fmax(${p}_m, ${l});
% endfor
    }
    const bool ${p}_ok = ${p}_m > 0.0f && ${p}_m <= FLT_MAX;
    const int ${p}_e = ${p}_ok ? ilogb(${p}_m) : 0;
    float ${p}_s = 0.0f;
    if (${p}_ok) {
        float comp = 0.0f;
        #pragma unroll 1
        for (uint jj = 0; jj < ${nv}; ++jj) {
            const vec sa = ldexp(${load("jj")}, (ivec)(-${p}_e));
            const vec sq = sa * sa;
            const float yk = (${" + ".join(_lanes(vw, "sq"))}) - comp;
            const float tk = ${p}_s + yk;
            comp = (tk - ${p}_s) - yk;
            ${p}_s = tk;
        }
    }
</%def>

## The backward's 1/rms = 2^−`${p}_se`·`${p}_ivs` of a row whose inv (`iv`) is
## outside [2^−32, 2^32] (bwd_scaled): (0, inv) where inv is a normal float;
## where it is not (subnormal: rms > 2^126; inf: rms < 2^−128, so eps = 0; 0:
## a row with an inf) again from the row's `nv` vectors of `d` values
## (scaled_sumsq; eps is below 2^−124 of the mean square or 0 there). A row
## whose largest |x| is 0 or inf keeps (0, inv): its results are not finite,
## as the plain formulas' are not.
<%def name="bwd_inv(p, iv, load, nv, vw, d)">
    int ${p}_se = 0;
    float ${p}_ivs = ${iv};
    if (!isnormal(${iv})) {
        ${scaled_sumsq(p, load, nv, vw)}
        if (${p}_ok) {
            ${p}_se = ${p}_e;
            ${p}_ivs = 1.0f / sqrt(${p}_s / ${d});
        }
    }
</%def>

## The forward's 1/rms of a row from scaled_sumsq's (e, s), d values and eps:
## 1/rms = 2^−`${p}_se`·`${p}_ivs` with ivs = 1/sqrt(s/d + eps·4^−e). Where
## eps·4^−e overflows, the mean square (< 4·4^e) is below 2^−126 of eps:
## ivs = 1/sqrt(eps), se = 0.
<%def name="scaled_inv(p, d, eps)">
    int ${p}_se = ${p}_e;
    float ${p}_ivs;
    {
        const float z = ldexp(${eps}, -2 * ${p}_e);
        if (isinf(z)) {
            ${p}_se = 0;
            ${p}_ivs = 1.0f / sqrt(${eps});
        } else {
            ${p}_ivs = 1.0f / sqrt(${p}_s / ${d} + z);
        }
    }
</%def>

## `${p}` = the sum over jj < nv of the lanes of `term(jj)` (the text of a
## vector), compensated as in scaled_sumsq; one work-item, no barriers.
<%def name="kahan_sum(p, term, nv, vw)">
    float ${p} = 0.0f;
    {
        float comp = 0.0f;
        #pragma unroll 1
        for (uint jj = 0; jj < ${nv}; ++jj) {
            const vec pk = ${term("jj")};
            const float yk = (${" + ".join(_lanes(vw, "pk"))}) - comp;
            const float tk = ${p} + yk;
            comp = (tk - ${p}) - yk;
            ${p} = tk;
        }
    }
</%def>

## Checked builds (CLOPS_CHECKED=1; clops.program renders every template with
## `checked` and the helpers `at` and `checked_args`). Unchecked, all three
## render nothing extra: the source is that of a template without guards.
## A template adopts them in three steps:
##   1. `${common.guards()}\` once, before its kernels (defines clops_guard;
##      the backslash keeps the unchecked source free of an empty line);
##   2. each kernel's parameter list ends with `${checked_args("a", "b", ...)}`
##      naming EVERY __global pointer parameter, in declaration order (a build
##      whose list differs fails with BuildError; the host appends each
##      buffer's size in bytes as `<name>_bytes`, plus the error record);
##   3. each global access indexes through `at`: `x[${at("x", "i")}]`, and
##      `${vload(vw, "x", at("x", "i", vw))}` for a vector of vw elements. The
##      index counts elements from the parameter itself (write `x[at("x",
##      "r * d + j")]`, not a pointer offset from x), and `at` takes its text.
## Checked, an access outside its buffer records the first such (site, index)
## in clops_err and is redirected to element 0 (so a vector access to a buffer
## shorter than the vector still overflows); the launch then waits and the
## host raises clops.program.OutOfBoundsError naming the kernel, the site and
## the index (in elements of the parameter's type: vectors for a vector
## pointer). Bounds are the buffers' allocated sizes (a pool may round them
## up). A kernel without checked_args runs unguarded in checked builds too.
## Local-memory accesses are not guarded.
<%def name="guards()">\
% if checked:
ulong clops_guard(ulong i, ulong width, ulong len, uint site, __global uint *err)
{
    if (i + width <= len && i + width >= i)
        return i;
    if (atomic_cmpxchg((volatile __global uint *)err, 0u, 1u) == 0u) {
        err[1] = site;
        err[2] = (uint)i;
        err[3] = (uint)(i >> 32);
    }
    return 0;
}
% endif
</%def>

## 16-bit storage, held as ushort bits (the helpers load/store of clops.program
## write the calls): widening is exact; narrowing rounds to nearest even (bf16
## by integer ops, float16 by vstore_half_rte: no float16 arithmetic, no
## extension), NaN stays a (quiet) NaN, ±Inf stays ±Inf, float16 overflows to
## ±Inf from 65520 and keeps its subnormals. `${common.storage(st, ...)}\` once, before the
## kernels, naming every storage type the template uses; it renders the
## helpers of "half" and "bf16" only when named.
<%def name="storage(*types)">\
<%
    def sel(n, a, b, cond):  # b where cond holds, else a (cond a comparison: 1 or, per lane, -1)
        return "((%s) ? (%s) : (%s))" % (cond, b, a) if n == "" else "select(%s, %s, %s)" % (a, b, cond)
%>\
% for n in (("", 2, 4, 8, 16) if "bf16" in types else ()):
<% f, u = "float%s" % n, "uint%s" % n %>\
${f} clops_bf16_to_float${n}(ushort${n} h) { return as_${f}(convert_${u}(h) << 16); }
ushort${n} clops_float${n}_to_bf16(${f} f)
{
    const ${u} u = as_${u}(f);
    return convert_ushort${n}(${sel(n, "(u + 0x7fffu + ((u >> 16) & 1u)) >> 16", "(u >> 16) | 0x40u", "isnan(f)")});
}
% endfor
% for n in (("", 2, 4, 8, 16) if "half" in types else ()):
## Through a private copy: core OpenCL's vload_half / vstore_half_rte (hardware conversions where
## there are some) on bits the caller loaded or stores as one wide, aligned ushort vector.
${"float%s" % n} clops_half_to_float${n}(ushort${n} h) { return vload_half${n}(0, (const __private half *)&h); }
ushort${n} clops_float${n}_to_half(${"float%s" % n} f)
{
    ushort${n} h;
    vstore_half${n}_rte(f, 0, (__private half *)&h);
    return h;
}
% endfor
</%def>
