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
