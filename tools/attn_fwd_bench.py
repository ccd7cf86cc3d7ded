"""Time the attention forward at the benchmark shapes, for the tuned default and given variants.

Each variant is first checked against the float64 reference on a small shape of
the same head dim; a wrong or unbuildable one is reported and not timed.

    python3 tools/attn_fwd_bench.py [--variants FILE.json] [--shapes qwen-hd256,...] [--json OUT.json]

FILE.json: {"256": [params, ...], "128": [...], ...} keyed by head dim.
"""
import argparse
import json
import statistics
import sys

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

import clops
from clops import reference as ref
from clops import tuning
from clops.attention import FWD_TEMPLATE, fwd_params
from clops.program import BUILD_OPTIONS, render
from clops.runtime import capability_macros

SHAPES = {  # name: (windows, window, nh, nkv, hd)
    "qwen-hd256": (4, 4096, 16, 2, 256),
    "llama-hd128": (8, 2048, 32, 8, 128),
    "small-hd64": (16, 1024, 12, 12, 64),
}
SMOKE = {"tiny-hd64": (2, 100, 4, 2, 64)}  # --shapes tiny-hd64: a quick run on CPU runtimes


def flops(windows, window, nh, hd):
    return 4 * windows * nh * window * window * hd / 2


def verify(queue, nh, nkv, hd):
    q, k, v = ref.rnd((2 * 193, nh, hd), 1), ref.rnd((2 * 193, nkv, hd), 2), ref.rnd((2 * 193, nkv, hd), 3)
    o, lse = clops.attention(queue, *(cla.to_device(queue, x) for x in (q, k, v)), window=193)
    want_o, want_lse = ref.attention(q, k, v, window=193)
    return max(ref.rel_err(o.get(), want_o), ref.rel_err(lse.get(), want_lse) * 10)


def registers(queue, hd, params):
    """NVIDIA's ptxas line (registers, spills) for the kernel, or ''."""
    if "NVIDIA" not in queue.device.platform.name:
        return ""
    src = capability_macros(queue.device) + render(FWD_TEMPLATE, **params, hd=hd, idx="uint", checked=False)
    prg = cl.Program(queue.context, src).build(options=list(BUILD_OPTIONS) + ["-cl-nv-verbose"])
    log = prg.get_build_info(queue.device, cl.program_build_info.LOG)
    return " | ".join(x.strip() for x in log.splitlines() if "registers" in x or "spill" in x)


def time_shape(queue, shape, reps):
    windows, window, nh, nkv, hd = shape
    n = windows * window
    q = cla.to_device(queue, ref.rnd((n, nh, hd), 1))
    k, v = (cla.to_device(queue, ref.rnd((n, nkv, hd), s)) for s in (2, 3))
    o, lse = clops.attention(queue, q, k, v, window=window)
    ms = []
    for _ in range(reps):
        o, lse = clops.attention(queue, q, k, v, window=window, out=o, lse=lse)
        evt = o.events[-1]
        evt.wait()
        ms.append((evt.profile.end - evt.profile.start) * 1e-6)
    return statistics.median(ms)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    variants = json.load(open(a.variants)) if a.variants else {}
    queue = cl.CommandQueue(clops.default_context(), properties=cl.command_queue_properties.PROFILING_ENABLE)
    print(queue.device.name, queue.device.driver_version, flush=True)
    results = []
    for name in a.shapes.split(","):
        shape = {**SHAPES, **SMOKE}[name]
        windows, window, nh, nkv, hd = shape
        for params in [None] + variants.get(str(hd), []):
            tuning.override("attention_fwd", {"hd": hd}, params)
            row = {"shape": name, "params": fwd_params(queue.device, hd) if params is None else params,
                   "default": params is None}
            try:
                row["err"] = verify(queue, 4, 2 if nkv < nh else 4, hd)
                if not row["err"] <= 1e-5:
                    raise ValueError(f"parity error {row['err']:.2e}")
                row["ms"] = time_shape(queue, shape, a.reps)
                row["tflops"] = flops(windows, window, nh, hd) / row["ms"] * 1e-9
                row["ptxas"] = registers(queue, hd, row["params"])
                print(f"{name:<12} {row['ms']:8.3f} ms {row['tflops']:6.2f} TFLOP/s err {row['err']:.1e} {row['params']}"
                      f" {row['ptxas']}", flush=True)
            except Exception as e:  # a variant that fails is reported, the sweep goes on
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"{name:<12} FAILED {row['params']}: {row['error']}", flush=True)
            results.append(row)
        tuning.override("attention_fwd", {"hd": hd}, None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
