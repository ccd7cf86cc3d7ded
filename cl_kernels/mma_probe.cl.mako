// clops matrix-unit probe: one 16×8 tile D = A·B through the `kind` tile product's instruction
// (tile_products.cl.mako), the operands given as the driver's lanes hold them: a[4] and b[2]
// words per lane (floats for tf32x3, packed 16-bit pairs otherwise), d[4] floats per lane in the
// accumulator layout; the 16-bit kinds take B through local memory and ldmatrix, as the drivers'
// products do, staged by the lanes and by cp.async from `bn` (B's rows of n, k contiguous). One warp
// (`emulate`: tile_products.cl.mako's emulation, one 32-wide sub-group).
<%namespace name="common" file="common.cl.mako"/>\
<%namespace name="tp" file="tile_products.cl.mako"/>\
${common.storage(st)}\
${tp.decls(kind, st, emulate)}\

__kernel __attribute__((reqd_work_group_size(32, 1, 1))) WARPS
void mma_probe(__global const uint *a, __global const uint *b, __global const uint *bn, __global float *d)
{
${tp.locals(kind)}\
    const uint lane = get_local_id(0);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
% if kind == "tf32x3":
    uint ah[4], al[4], bh[2], bl[2];
    for (int e = 0; e < 4; ++e) split(as_float(a[4 * lane + e]), &ah[e], &al[e]);
    for (int e = 0; e < 2; ++e) split(as_float(b[2 * lane + e]), &bh[e], &bl[e]);
    mma_tf32(acc, al[0], al[1], al[2], al[3], bh[0], bh[1]);
    mma_tf32(acc, ah[0], ah[1], ah[2], ah[3], bl[0], bl[1]);
    mma_tf32(acc, ah[0], ah[1], ah[2], ah[3], bh[0], bh[1]);
% else:
    // B through local memory as the drivers stage it, read by ldmatrix (lanes 16-31 read the tiles
    // of lanes 0-15 again): as rows of V ([k][n], transposed, P·V's; stored by the lanes) and as
    // rows of K ([n][k], Q·Kᵀ's; copied by cp.async, 16 bytes a lane); the four products are
    // averaged.
    __local ushort bt[16 * 8] __attribute__((aligned(16))), bk[8 * 16] __attribute__((aligned(16)));
    const uint g = lane / 4, t = lane % 4;
    const uint b0 = b[2 * lane], b1 = b[2 * lane + 1];
    bt[(2 * t) * 8 + g] = b0 & 0xffffu;
    bt[(2 * t + 1) * 8 + g] = b0 >> 16;
    bt[(2 * t + 8) * 8 + g] = b1 & 0xffffu;
    bt[(2 * t + 9) * 8 + g] = b1 >> 16;
    if (lane < 16) cp_async16(bk + 8 * lane, bn + 4 * lane, 16u);
    CP_ASYNC_COMMIT();
    CP_ASYNC_WAIT(0);
    barrier(CLK_LOCAL_MEM_FENCE);
    uint w[4], v[4];
    ldsm_x4_trans(w, bt + (lane & 15) * 8);
    ldsm_x4(v, bk + (lane & 7) * 16 + (lane & 8));
    mma16(acc, a[4 * lane], a[4 * lane + 1], a[4 * lane + 2], a[4 * lane + 3], w[0], w[1]);
    mma16(acc, a[4 * lane], a[4 * lane + 1], a[4 * lane + 2], a[4 * lane + 3], w[2], w[3]);
    mma16(acc, a[4 * lane], a[4 * lane + 1], a[4 * lane + 2], a[4 * lane + 3], v[0], v[1]);
    mma16(acc, a[4 * lane], a[4 * lane + 1], a[4 * lane + 2], a[4 * lane + 3], v[2], v[3]);
    for (int e = 0; e < 4; ++e) acc[e] *= 0.25f;  // exact
% endif
    for (int e = 0; e < 4; ++e) d[4 * lane + e] = acc[e];
}
