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
