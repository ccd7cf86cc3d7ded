"""Reproduce PoCL 5.x and 6.x building kernels that use barriers wrong, at random, without clops:
one small kernel built many times (each a new build), each build run and checked.

    python tools/pocl_vua_repro.py [--builds N] [--control]

Prints the wrong builds and exits 1 on an affected PoCL (5.0: about 10 in 100 builds, 6.0: about
5 in 100, on a skylake-avx512 CPU); prints "ok" on PoCL 3.x and 7.x, and under
clops/pocl_free_quarantine.c (LD_PRELOAD; `python -m clops pocl-quarantine`). PoCL's kernel cache is turned off
(POCL_KERNEL_CACHE=0): with it on, the files it writes change what the build reuses and wrong
builds are rarer here (they still happen: clops' test suite met them with the cache on).

The cause, in PoCL's kernel compiler: its uniformity analysis (VariableUniformityAnalysis) keeps
its results in a std::map keyed by llvm::Value address and never drops them (its invalidate()
returns false). It marks each loop's canonical induction variable (a PHI from 0 by 1) uniform;
PHIsToAllocas then erases every PHI, freeing those addresses; the instcombine that PoCL 5.0 and
6.0 run before the work-item loops merges the stores PHIsToAllocas made back into new PHIs
("storemerge"), and a new PHI that the allocator places where an erased induction variable was
inherits "uniform". The work-item loops then keep one copy of that varying value for the whole
work-group, not one per work-item (no context array): every work-item reads the last one's. Here
the values x0..x7 differ per work-item and live across a barrier; the b-loops after it supply
the induction variables. With --control the loops count from 1 (no canonical induction variable)
and every build is right. PoCL 7.0 no longer runs that instcombine (pocl commit 8d08110, "Run lcssa
explicitly drop instcombine"); PoCL 3.x ran none there either.
"""
import argparse
import os

os.environ["POCL_KERNEL_CACHE"] = "0"  # read when PoCL loads: before pyopencl finds the platform

import numpy as np  # noqa: E402
import pyopencl as cl  # noqa: E402

WG, VALUES, LOOPS = 64, 8, 8


def source(start):
    """The kernel: x0..x7 differ per work-item and live across a barrier; the LOOPS loops after it,
    each holding a barrier, count from ``start``."""
    picks = "\n".join(f"    float x{i};\n    if (a[lid] > {i / 10 - 0.5:.1f}f) {{ x{i} = a[lid] * {i + 2}.0f; "
                      f"side[lid] = {i}; }} else x{i} = a[lid + {WG}] + {i}.0f;" for i in range(VALUES))
    loops = "\n".join(f"    for (int i = {start}; i < n + {start}; ++i) {{ tmp[lid] += {j + 1}.0f; "
                      "barrier(CLK_LOCAL_MEM_FENCE); }" for j in range(LOOPS))
    total = " + ".join(f"x{i}" for i in range(VALUES))
    return f"""__kernel __attribute__((reqd_work_group_size({WG}, 1, 1)))
void k(__global const float *a, __global float *out, __global int *side, const int n)
{{
    __local float tmp[{WG}];
    const int lid = get_local_id(0);
{picks}
    tmp[lid] = a[lid];
    barrier(CLK_LOCAL_MEM_FENCE);
    out[lid] = {total} + tmp[{WG - 1} - lid];
{loops}
    out[{WG} + lid] = tmp[lid];
}}
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--builds", type=int, default=300)
    ap.add_argument("--control", action="store_true", help="loops from 1: no canonical induction variable")
    args = ap.parse_args()
    platform = next(p for p in cl.get_platforms() if "Portable" in p.name)
    print(platform.version)
    ctx = cl.Context(platform.get_devices())
    queue = cl.CommandQueue(ctx)
    a = np.random.default_rng(0).standard_normal(2 * WG).astype(np.float32)
    want = sum(np.where(a[:WG] > np.float32(i / 10 - 0.5), a[:WG] * np.float32(i + 2), a[WG:] + np.float32(i))
               for i in range(VALUES)) + a[:WG][::-1]
    mf = cl.mem_flags
    a_buf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a)
    out_buf, side_buf = cl.Buffer(ctx, mf.READ_WRITE, 8 * WG), cl.Buffer(ctx, mf.READ_WRITE, 4 * WG)
    text = source(1 if args.control else 0)
    wrong = []
    for build in range(args.builds):
        prg = cl.Program(ctx, text + f"// build {build}\n").build(cache_dir=False)  # a new source: a new build
        prg.k(queue, (WG,), (WG,), a_buf, out_buf, side_buf, np.int32(3))
        out = np.empty(2 * WG, np.float32)
        cl.enqueue_copy(queue, out, out_buf)
        if not np.allclose(out[:WG], want, rtol=1e-5, atol=1e-5):
            wrong.append(build)
    if wrong:
        print(f"{len(wrong)} of {args.builds} builds computed x wrong: builds {wrong}")
        raise SystemExit(1)
    print("ok")


if __name__ == "__main__":
    main()
