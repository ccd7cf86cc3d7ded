"""Time the attention backward at the benchmark shapes, for the tuned default and given variants.

Each variant of a pass ("dkv" or "dq") is set through clops.tuning.override and
run through the public op; it is first checked against the float64 reference on
a small shape of the same head dim (a wrong or unbuildable one is reported and
not timed). The other pass keeps its default. Prints per-kernel times, the
backward's TFLOP/s (2.5 × the forward's FLOPs) for the default and the best
variants, and forward + backward when the forward is timed too.

    python3 tools/attn_bwd_bench.py [--variants FILE.json] [--shapes qwen-hd256,...] [--json OUT.json] [--ptxas]

FILE.json (e.g. tools/attn_bwd_variants.json): {"dkv": {"256": [params, ...], ...}, "dq": {...}} keyed by head dim.
--ptxas also builds each variant with -cl-nv-verbose and prints its register use (NVIDIA only).
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
from clops.attention import BWD_TEMPLATE, bwd_params
from clops.profile import Profile
from clops.program import render
from clops.runtime import capability_macros

SHAPES = {  # name: (windows, window, nh, nkv, hd)
    "qwen-hd256": (4, 4096, 16, 2, 256),
    "llama-hd128": (8, 2048, 32, 8, 128),
    "small-hd64": (16, 1024, 12, 12, 64),
    "tiny-hd64": (2, 100, 4, 2, 64),  # a smoke test for CPU runtimes
}
KERNELS = ("attn_bwd_dsum", "attn_bwd_dkv", "attn_bwd_dq")


def fwd_flops(windows, window, nh, hd):
    return 4 * windows * nh * window * window * hd / 2


def verify(queue, hd, window=77):
    n, nh, nkv = 2 * window, 4, 2
    q, k, v = ref.rnd((n, nh, hd), 1), ref.rnd((n, nkv, hd), 2), ref.rnd((n, nkv, hd), 3)
    do = ref.rnd((n, nh, hd), 4)
    o, lse = (x.astype(np.float32) for x in ref.attention(q, k, v, window=window))
    arrays = (q, k, v, o, lse, do)
    got = clops.attention_bwd(queue, *(cla.to_device(queue, x) for x in arrays), window=window)
    want = ref.attention_bwd(*arrays, window=window)
    return max(ref.rel_err(g.get(), w) for g, w in zip(got, want))


def ptxas(queue, kind, hd, params):
    """The ptxas lines (registers, spills) of the pass's kernels built with -cl-nv-verbose."""
    src = capability_macros(queue.device) + render(BWD_TEMPLATE, **params, kind=kind, hd=hd, idx="uint", checked=False)
    prg = cl.Program(queue.context, src).build(options=["-cl-std=CL1.2", "-cl-nv-verbose"])
    log = prg.get_build_info(queue.device, cl.program_build_info.LOG) or ""
    return " | ".join(line.strip() for line in log.splitlines() if "registers" in line or "spill" in line)


def time_bwd(queue, arrays, window, reps):
    """Median ms per kernel of the backward over ``reps`` calls (after one warm-up)."""
    clops.attention_bwd(queue, *arrays, window=window)
    queue.finish()
    per = {name: [] for name in KERNELS}
    for _ in range(reps):
        with Profile(queue) as prof:
            clops.attention_bwd(queue, *arrays, window=window)
        for launch in prof.launches:
            per[launch.name].append(launch.ms)
    return {name: statistics.median(ms) for name, ms in per.items()}


def time_fwd(queue, q, k, v, window, reps):
    clops.attention(queue, q, k, v, window=window)
    queue.finish()
    ms = []
    for _ in range(reps):
        with Profile(queue) as prof:
            clops.attention(queue, q, k, v, window=window)
        ms.append(prof.span_ms())
    return statistics.median(ms)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants")
    ap.add_argument("--shapes", default="qwen-hd256,llama-hd128,small-hd64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--ptxas", action="store_true")
    a = ap.parse_args()
    variants = json.load(open(a.variants)) if a.variants else {}
    queue = cl.CommandQueue(clops.default_context(), properties=cl.command_queue_properties.PROFILING_ENABLE)
    print(queue.device.name, queue.device.driver_version, flush=True)
    results = []

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)

    for name in a.shapes.split(","):
        windows, window, nh, nkv, hd = SHAPES[name]
        n, flops = windows * window, fwd_flops(windows, window, nh, hd)
        q = cla.to_device(queue, ref.rnd((n, nh, hd), 1))
        k, v = (cla.to_device(queue, ref.rnd((n, nkv, hd), s)) for s in (2, 3))
        do = cla.to_device(queue, ref.rnd((n, nh, hd), 4))
        o, lse = clops.attention(queue, q, k, v, window=window)
        fwd_ms = time_fwd(queue, q, k, v, window, a.reps)
        print(f"{name:<12} forward {fwd_ms:8.3f} ms {flops / fwd_ms * 1e-9:6.2f} TFLOP/s", flush=True)
        arrays = (q, k, v, o, lse, do)
        best = {}
        for kind in ("dkv", "dq"):
            op = "attention_bwd_" + kind
            for params in [None] + variants.get(kind, {}).get(str(hd), []):
                tuning.override(op, {"hd": hd}, params)
                row = {"shape": name, "kind": kind, "params": bwd_params(queue.device, kind, hd) if params is None
                       else params, "default": params is None}
                try:
                    row["err"] = verify(queue, hd)
                    if not row["err"] <= 1e-5:
                        raise ValueError(f"parity error {row['err']:.2e}")
                    if a.ptxas:
                        row["ptxas"] = ptxas(queue, kind, hd, row["params"])
                    row["ms"] = time_bwd(queue, arrays, window, a.reps)
                    mine = row["ms"]["attn_bwd_" + kind]
                    if kind not in best or mine < best[kind][0]:
                        best[kind] = (mine, row["params"], row["ms"])
                    print(f"{name:<12} {kind:<3} {mine:8.3f} ms (all: {sum(row['ms'].values()):8.3f}) "
                          f"err {row['err']:.1e} {row['params']} {row.get('ptxas', '')}", flush=True)
                except Exception as e:  # a variant that fails is reported, the sweep goes on
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"{name:<12} {kind:<3} FAILED {row['params']}: {row['error']}", flush=True)
                results.append(row)
                save()
            tuning.override(op, {"hd": hd}, None)
        if len(best) == 2:
            dsum = best["dkv"][2]["attn_bwd_dsum"]
            bwd = dsum + best["dkv"][0] + best["dq"][0]
            summary = {"shape": name, "fwd_ms": fwd_ms, "bwd_ms": bwd, "bwd_tflops": 2.5 * flops / bwd * 1e-9,
                       "fwd_bwd_tflops": 3.5 * flops / (fwd_ms + bwd) * 1e-9,
                       "best": {kind: best[kind][1] for kind in best}}
            print(f"{name:<12} best backward {bwd:8.3f} ms {summary['bwd_tflops']:6.2f} TFLOP/s; "
                  f"forward+backward {summary['fwd_bwd_tflops']:6.2f} TFLOP/s {summary['best']}", flush=True)
            results.append(summary)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
