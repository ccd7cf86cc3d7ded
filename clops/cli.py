"""``python -m clops``: info, check, bench, tune, train-demo, pocl-quarantine."""
from __future__ import annotations

import argparse
import os
import sys

import platformdirs

import pyopencl as cl

from . import __version__, runtime, tuning
from .check import FAMILIES


def _device_lines(dev):
    yield f"      type {runtime.device_kind(dev)}, OpenCL C {dev.opencl_c_version}, driver {dev.driver_version}"
    yield (f"      {dev.max_compute_units} compute units @ {dev.max_clock_frequency} MHz, "
           f"max work-group {dev.max_work_group_size}, local memory {dev.local_mem_size // 1024} KiB, "
           f"global memory {dev.global_mem_size // 2**20} MiB, max allocation {dev.max_mem_alloc_size // 2**20} MiB")
    yield f"      preferred float vector width {dev.preferred_vector_width_float}"
    yield "      extensions: " + " ".join(sorted(dev.extensions.split()))


def info(args):
    print(f"clops {__version__}, pyopencl {cl.VERSION_TEXT}")
    print(f"CPU runtime registration: {runtime.REGISTRATION}")
    for pi, di, plat, dev in runtime.all_devices():
        if di == 0:
            print(f"platform {pi}: {plat.name.strip()} ({plat.version.strip()})")
            fault = runtime.compiler_fault(dev)
            if fault:
                print(f"  known fault: {fault}")
        print(f"  device {pi}:{di}: {dev.name.strip()}")
        for line in _device_lines(dev):
            print(line)
    dev = runtime.default_context().devices[0]
    print(f"chosen device: {dev.name.strip()} on {dev.platform.name.strip()}")
    print(f"  because: {runtime.default_reason()}")
    from .attn import MMA_STORE_DS_MIN_HD
    from .mma import backward_product, forward_product

    queue = runtime.default_queue()
    for st, name in (("float", "float32"), ("bf16", "bfloat16"), ("half", "float16")):
        for way, choose in (("forward", forward_product), ("backward", backward_product)):
            product, why = choose(queue, st)
            path = "the portable kernels" if product is None else f"the matrix-unit driver, {product} products"
            if way == "backward":  # attention_bwd's store_ds=None
                path += (", dS stored where its scratch fits" if product is None
                         else f", dS stored from hd {MMA_STORE_DS_MIN_HD[product]} where its scratch fits, else recomputed")
            print(f"attention {way} at {name}: {path} ({why})")
    print("kernel parameters there, per family at the shape class clops tune starts from:")
    from .tune import FAMILIES as TUNED

    for name, fam in TUNED.items():
        params, source = fam.spec.resolve(dev, fam.shape_class)
        shown = " ".join(f"{k}={v}" for k, v in params.items())
        print(f"  {name} {tuning.shape_key(fam.shape_class) or '(every shape)'}: {shown} ({source})")
    return 0


def check(args):
    from .check import run_all

    queue = runtime.default_queue(profiling=True)
    dev = queue.device
    print(f"clops check on {dev.name.strip()} ({dev.platform.name.strip()}, driver {dev.driver_version})")
    rows = run_all(queue, tuple(args.family) if args.family else FAMILIES)
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)}/{len(rows)} passed")
    return 1 if failed or not rows else 0


def pocl_quarantine(args):
    path = os.path.abspath(args.output)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        cc = runtime.build_quarantine(path)
    except RuntimeError as e:
        print(f"clops: {e}", file=sys.stderr)
        return 1
    print(f"built {path} with {cc}; run clops' programs as\n  LD_PRELOAD={path} python ...\n"
          "(PoCL 5.x and 6.x then build kernels right; README: known limitations)")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m clops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="platforms, devices, limits, extensions, the chosen device and why")
    p = sub.add_parser("check", help="every op but gemm, at float32, against the float64 reference on the chosen "
                                     "device")
    p.add_argument("--family", action="append", choices=FAMILIES, help="only this op family (repeatable)")
    p = sub.add_parser("pocl-quarantine", help="build the library that keeps PoCL 5.x and 6.x from building kernels "
                       "wrong (preload it: README, known limitations)")
    p.add_argument("--output", default=os.path.join(platformdirs.user_cache_dir("clops"), "pocl_free_quarantine.so"),
                   help="the library to write (default: %(default)s)")
    sub.add_parser("bench", help="benchmarks (see `python -m clops bench --help`)", add_help=False)
    sub.add_parser("tune", help="template-parameter sweeps (see `python -m clops tune --help`)", add_help=False)
    sub.add_parser("train-demo", help="train a small language model on clops (see `python -m clops train-demo --help`)",
                   add_help=False)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        tools = {"bench": "bench", "tune": "tune", "train-demo": "train_demo"}
        if argv and argv[0] in tools:
            import importlib

            return importlib.import_module(f"clops.{tools[argv[0]]}").main(argv[1:])
        args = parser.parse_args(argv)
        return {"info": info, "check": check, "pocl-quarantine": pocl_quarantine}[args.command](args)
    except runtime.DeviceError as e:
        print(f"clops: {e}", file=sys.stderr)
        return 1
