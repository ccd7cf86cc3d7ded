"""Reproduce Intel's CPU OpenCL runtime (2026.2) building a negated value that lives across a barrier
wrong, without clops: one three-line kernel, built optimised and with -cl-opt-disable.

    python tools/intel_fneg_repro.py

Each work-item negates a value of its own (-(float)lid, or -a[lid]), waits at a barrier and stores
it. Prints "ok" where every build stores -lid and -a[lid]; prints the wrong builds with their first
values and exits 1 where one does not (Intel's CPU runtime 2026.2, optimised builds: garbage or the
last work-item's value in every work-item; with -cl-opt-disable right; PoCL 3.1 right). Runs on
every OpenCL CPU device it finds; where clops is installed, its import registers Intel's
pip-installed runtime with the ICD loader (clops.runtime.register_cpu_runtime), nothing else of it
is used.

The cause, in the runtime's kernel compiler: its barrier passes keep a value that lives across a
barrier in a per-work-item slot only if its WIRelatedValue analysis marks it work-item dependent;
WIRelatedValue::calculateDep dispatches on the instruction class (BinaryOperator, CastInst,
LoadInst, CallInst, PHINode, ...) and has no case for UnaryOperator, LLVM's class of `fneg`, so a
negation keeps its initial "not work-item related": one copy for the whole work-group. In the
optimised build `fneg` survives (x·c − l contracts to fma(x, c, fneg l); a negation of a loop
invariant is hoisted before a loop's barriers); `0.0f - x` (an fsub) and -cl-opt-disable escape it.
"""
import os
import warnings

os.environ["PYOPENCL_NO_CACHE"] = "1"  # every build a real build
try:
    import clops.runtime  # noqa: F401  (registers the pip-installed CPU runtime, before pyopencl loads the ICD)
except ImportError:
    pass

import numpy as np  # noqa: E402
import pyopencl as cl  # noqa: E402

warnings.simplefilter("ignore", cl.CompilerWarning)  # Intel's build logs

WG = 32
SOURCE = """
__kernel __attribute__((reqd_work_group_size(%d, 1, 1)))
void k(__global const float *a, __global float *out)
{
    const uint lid = get_local_id(0);
    const float x = -(float)lid, y = -a[lid];  // fneg: taken for uniform
    barrier(CLK_LOCAL_MEM_FENCE);
    out[lid] = x;
    out[%d + lid] = y;
}
""" % (WG, WG)


def main():
    a = np.random.default_rng(0).standard_normal(WG).astype(np.float32)
    want = np.concatenate([-np.arange(WG, dtype=np.float32), -a])
    wrong = []
    for platform in cl.get_platforms():
        for dev in platform.get_devices(cl.device_type.CPU):
            ctx = cl.Context([dev])
            queue = cl.CommandQueue(ctx)
            mf = cl.mem_flags
            a_buf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a)
            out_buf = cl.Buffer(ctx, mf.READ_WRITE, 8 * WG)
            for options in ([], ["-cl-opt-disable"]):
                prg = cl.Program(ctx, SOURCE).build(options=["-cl-std=CL1.2"] + options)
                prg.k(queue, (WG,), (WG,), a_buf, out_buf)
                out = np.empty(2 * WG, np.float32)
                cl.enqueue_copy(queue, out, out_buf)
                name = f"{platform.name} {dev.driver_version} {' '.join(options) or 'optimised'}"
                print(f"{name}: {'ok' if np.array_equal(out, want) else 'WRONG'}")
                if not np.array_equal(out, want):
                    wrong.append(f"{name}: -lid stored as {out[:4]}..., -a[lid] as {out[WG:WG + 4]}..."
                                 f" (want {want[:4]}..., {want[WG:WG + 4]}...)")
    if wrong:
        print("\n".join(wrong))
        raise SystemExit(1)
    print("ok")


if __name__ == "__main__":
    main()
