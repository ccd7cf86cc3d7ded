"""Reproduce PoCL 3.1's abort ``pocl_release_dlhandle_cache: Assertion 'found->ref_count > 0'``
without clops: one host thread, six queues on one context, the same kernels and work-group size
at different grid widths in flight at once. Run with a fresh cache to make it likely:

    POCL_CACHE_DIR=$(mktemp -d) python tools/pocl_dlhandle_repro.py

Exits 134 (SIGABRT) on an affected PoCL, prints "ok" otherwise. With one queue, or one grid
width, it passes: PoCL's CPU driver keeps a work-group function per (kernel, local size, widest
grid so far) and, on completion, releases the first one matching (kernel, local size), which may
not be the one the command took.
"""
import pyopencl as cl

platform = next(p for p in cl.get_platforms() if "Portable" in p.name)
ctx = cl.Context(platform.get_devices())
source = "".join(f"""
__kernel __attribute__((reqd_work_group_size(64, 1, 1))) void f{k}(__global float *a)
{{
    float s = a[get_global_id(0)];
    for (int i = 0; i < 200; ++i)
        s = s * 0.999f + {k}.0f;
    a[get_global_id(0)] = s;
}}""" for k in range(8))
prg = cl.Program(ctx, source).build()
knls = [cl.Kernel(prg, f"f{k}") for k in range(8)]
queues = [cl.CommandQueue(ctx) for _ in range(6)]
for it in range(40):
    for i, queue in enumerate(queues):
        n = 64 * (1 + 3 * i + it % 5)
        knls[it % 8](queue, (n,), (64,), cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4 * n))
for queue in queues:
    queue.finish()
print("ok")
