"""PoCL 3.1 crashes a process that exits while a launch is pending whose kernel its compiler thread
is still building: the interpreter's exit tears down LLVM's state under that thread (SIGSEGV in
llvm::PMDataManager, from pocl_check_kernel_dlhandle_cache). Plain pyopencl, no clops code.

    python tools/pocl_exit_repro.py [runs]       # children that exit with the launch pending
    python tools/pocl_exit_repro.py [runs] --finish  # the same, queue.finish() before exit

Each child gets a fresh PoCL kernel cache (POCL_CACHE_DIR), so its launch compiles. Seen on Debian
12's PoCL 3.1 (2 cores): 3 of 12 children crashed without --finish, none with it. clops finishes
the queues its ops took at exit (clops.args.finish_queues)."""
import os
import subprocess
import sys
import tempfile

CHILD = """
import numpy as np, pyopencl as cl, pyopencl.array as cla
platform = next(p for p in cl.get_platforms() if "Portable" in p.name)
ctx = cl.Context(platform.get_devices())
q = cl.CommandQueue(ctx)
x = cla.to_device(q, np.ones(4096, np.float32))
src = ("__kernel void f(__global float *x) { float a = x[get_global_id(0)];"
       " for (int i = 0; i < 64; ++i) a = sin(a) * cos(a) + exp(a * 0.001f); x[get_global_id(0)] = a; }")
cl.Program(ctx, src).build().f(q, (4096,), (64,), x.data)
if FINISH:
    q.finish()
"""


def main():
    runs = int(next((a for a in sys.argv[1:] if a.isdigit()), 12))
    finish = "--finish" in sys.argv
    crashed = 0
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as cache:
            rc = subprocess.run([sys.executable, "-c", CHILD.replace("FINISH", str(finish))],
                                env=dict(os.environ, POCL_CACHE_DIR=cache), capture_output=True).returncode
        crashed += rc != 0
    print(f"{crashed} of {runs} children {'with' if finish else 'without'} queue.finish() died")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
