// clops matrix-unit probe: one 16×8 tile D = A·B through the `kind` tile product's instruction
// (tile_products.cl.mako), the operands given as the driver's lanes hold them: a[4] and b[2]
// words per lane (floats for tf32x3, packed 16-bit pairs otherwise), d[4] floats per lane in the
// accumulator layout. One warp.
<%namespace name="tp" file="tile_products.cl.mako"/>\
${tp.decls(kind, "float")}\

__kernel __attribute__((reqd_work_group_size(32, 1, 1)))
void mma_probe(__global const uint *a, __global const uint *b, __global float *d)
{
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
    mma16(acc, a[4 * lane], a[4 * lane + 1], a[4 * lane + 2], a[4 * lane + 3], b[2 * lane], b[2 * lane + 1]);
% endif
    for (int e = 0; e < 4; ++e) d[4 * lane + e] = acc[e];
}
