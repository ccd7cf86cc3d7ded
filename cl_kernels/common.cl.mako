## Shared OpenCL snippets for clops templates (include with <%namespace>).
## Python string helpers (vtype, vload, vstore) come from clops.program.render.

## Sum of `val` over the WG work-items of a group, through `scratch` (WG floats
## of local memory); every work-item gets the result. Call in uniform control
## flow: it holds barriers. Fixed pairing order, so results are deterministic.
<%def name="group_sum(result, val, scratch, lid, wg)">
    ${scratch}[${lid}] = ${val};
    barrier(CLK_LOCAL_MEM_FENCE);
% for s in [2**i for i in range(20, -1, -1) if 2**i < wg]:
    if (${lid} < ${s} && ${lid} + ${s} < ${wg}) ${scratch}[${lid}] += ${scratch}[${lid} + ${s}];
    barrier(CLK_LOCAL_MEM_FENCE);
% endfor
    const float ${result} = ${scratch}[0];
    barrier(CLK_LOCAL_MEM_FENCE);
</%def>

## Sum of squares kept inside float32's range (rms_norm, qk_norm_rope): a
## work-item holds (s, e) meaning s·4^e; e is its values' largest exponent,
## clamped to [−126, 126] so that 2^−e is a normal float. Scaling by powers of
## two is exact, so in range the sums round exactly as unscaled sums would.
##
## `${result}_s`, `${result}_e`: the (s, e) pairs of the WG work-items summed
## through `scratch` (WG floats) and `escratch` (WG ints) in group_sum's
## order; every work-item gets the result. Call in uniform control flow.
<%def name="group_sum_scaled(result, s, e, scratch, escratch, lid, wg)">
    ${scratch}[${lid}] = ${s};
    ${escratch}[${lid}] = ${e};
    barrier(CLK_LOCAL_MEM_FENCE);
% for st in [2**i for i in range(20, -1, -1) if 2**i < wg]:
    if (${lid} < ${st} && ${lid} + ${st} < ${wg}) {
        const int ea = ${escratch}[${lid}], eb = ${escratch}[${lid} + ${st}], em = max(ea, eb);
        ${scratch}[${lid}] = ldexp(${scratch}[${lid}], 2 * (ea - em)) + ldexp(${scratch}[${lid} + ${st}], 2 * (eb - em));
        ${escratch}[${lid}] = em;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
% endfor
    const float ${result}_s = ${scratch}[0];
    const int ${result}_e = ${escratch}[0];
    barrier(CLK_LOCAL_MEM_FENCE);
</%def>

## The exponent e of a float m ≥ 0 clamped to [−126, 126] (0 and subnormals
## give −126, inf and NaN 126), and 2^−e.
<%def name="scale_exp(m)">clamp((int)(as_uint(${m}) >> 23) - 127, -126, 126)</%def>
<%def name="pow2_neg(e)">as_float((uint)(127 - (${e})) << 23)</%def>

## 1/rms of a row of `d` values from its group_sum_scaled result (s, e) and
## eps: `${name}` = 1/sqrt(s·4^e/d + eps) in float32 (inf or subnormal where
## 1/rms is out of range), and (`${name}_sc`, `${name}_iv`) with x·sc·iv =
## x/rms: (1, inv) where inv is normal (the unscaled result, as before), else
## (2^−e, 2^e/rms).
<%def name="inv_rms(name, r, d, eps)">
    float ${name}, ${name}_sc = 1.0f, ${name}_iv;
    {
        const float z = ldexp(${eps}, -2 * ${r}_e);  // eps·4^−e; inf: eps ≫ the mean square
        // 1/sqrt, not rsqrt: rsqrt's error bound is too loose for the 1e-6 parity.
        const float ivs = 1.0f / sqrt(${r}_s / ${d} + z);
        ${name} = isinf(z) ? 1.0f / sqrt(${eps}) : ldexp(ivs, -${r}_e);
        ${name}_iv = ${name};
        if (!isnormal(${name})) {
            ${name}_sc = ${pow2_neg(r + "_e")};
            ${name}_iv = ivs;
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
