"""Registers, spills and stack of a kernel family as an NVIDIA sm_90 build would give them, on a machine
without an NVIDIA GPU: the family's template rendered at its GPU heuristic's tiles (or --param ones) for
an H200-like device, then OpenCL C → LLVM IR (clang, target nvptx64--nvidiacl, libclc's builtins) →
PTX (llc) → ``ptxas -arch=sm_90 -v``.

A proxy: NVIDIA's driver compiles OpenCL C with its own front end, so its counts differ; what the
proxy shows is a change's direction (registers, spills) before a GPU can measure it. Needs clang,
llvm-link, opt and llc of one LLVM (Debian: clang-15 llvm-15 libclc-15; ``--llvm 15``) and CUDA's
ptxas on the PATH.

    python tools/nvptx_registers.py attention_fwd_mma --class hd=128 --class st=bf16 --flag softcap=1
    python tools/nvptx_registers.py rms_norm_bwd_dw --class d=5120 --class st=bf16

With ``--driver``, on a machine with NVIDIA's OpenCL driver, the same source is built by the driver
(``-cl-nv-verbose``) and its own ptxas lines are printed: the counts the GPU runs with (an H100,
2026-12-06: the one pass at bf16 114 registers where the proxy gives 109; with pf 3, 158 against 161).
"""
import argparse
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyopencl as cl

from clops import attn, norm, program, qk_rope, runtime, tune
from clops.tune import _value

# An H200 as the heuristics see it (clops info on the H200: 132 compute units, 48 KiB of local memory)
H200 = types.SimpleNamespace(type=cl.device_type.GPU, vendor="NVIDIA Corporation", name="NVIDIA H200",
                             platform=types.SimpleNamespace(name="NVIDIA CUDA"),
                             max_compute_units=132, local_mem_size=49152, max_work_group_size=1024)
VARIANT = {"causal": 1, "sliding": 0, "softcap": 0, "varlen": 0}  # the attention drivers' flags
FAMILIES = {  # name: (spec, the render extras every build of it takes besides idx and checked)
    "attention_fwd_mma": (attn.FWD_MMA, dict(VARIANT, emulate=0, fuse=1)),
    **{spec.op: (spec, dict(VARIANT, emulate=0, store_ds=0)) for spec in attn.BWD_MMA.values()},
    "rms_norm": (norm.ROWS, {"wst": "float"}),
    "rms_norm_bwd": (norm.ROWS_BWD, {"wst": "float"}),
    "rms_norm_bwd_dw": (norm.BWD_DW, {"wst": "float", "ptx": 1}),  # its prefetch as NVIDIA's builds take it
    "qk_norm_rope": (qk_rope.SPEC, {"wst": "float", "ptx": 1, "varlen": 0}),  # half: the bench's hd / 4
}


def _pairs(items, what):
    """["k=v", ...] → {k: v}, as clops tune reads its --class and --param (numbers as numbers)."""
    return {k: _value(v) for k, v in tune._pairs(items, what).items()}


def render(family, sc, params, flags):
    """The OpenCL C source of ``family`` at shape class ``sc``: the H200 heuristic's parameters updated by
    ``params``, the render extras by ``flags``."""
    spec, extra = FAMILIES[family]
    sc.setdefault("st", "float")
    if "hd" in sc:  # the attention drivers: the H200's products at that storage
        sc.setdefault("product", "tf32x3" if sc["st"] == "float" else sc["st"])
    if spec is qk_rope.SPEC:
        extra = dict(extra, half=sc["hd"] // 4)
    p = dict(spec.heuristic(H200, sc), **params)
    params = dict(spec.render(p, sc), **dict(extra, **flags), st=sc["st"], idx="uint", checked=False)
    return program.render(spec.template, **params), p


def registers(source, llvm):
    """[(kernel, ptxas's line)] of an sm_90 build of OpenCL C ``source``."""
    libclc = "/usr/lib/clc/nvptx64--nvidiacl.bc"
    with tempfile.TemporaryDirectory() as tmp:
        cl_file = Path(tmp) / "k.cl"
        cl_file.write_text(source)
        steps = [  # NVIDIA's compiler unrolls the drivers' fixed-count loops: a high threshold does too
            [f"clang-{llvm}", "-x", "cl", "-cl-std=CL1.2", "-target", "nvptx64--nvidiacl", "-Xclang",
             "-finclude-default-header", "-Dasm=__asm__", "-O3", "-mllvm", "-unroll-threshold=20000", "-emit-llvm",
             "-c", str(cl_file), "-o", f"{tmp}/k.bc"],
            [f"llvm-link-{llvm}", f"{tmp}/k.bc", libclc, "-o", f"{tmp}/l.bc"],
            [f"opt-{llvm}", "-O3", "-unroll-threshold=20000", f"{tmp}/l.bc", "-o", f"{tmp}/o.bc"],
            [f"llc-{llvm}", "-mcpu=sm_80", "-mattr=+ptx70", f"{tmp}/o.bc", "-o", f"{tmp}/k.ptx"],
            ["ptxas", "-arch=sm_90", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
        ]
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(f"{cmd[0]} failed:\n{done.stderr[-3000:]}")
    return parse_ptxas(done.stderr)


def parse_ptxas(text):
    """[(kernel, usage line)] of ``ptxas -v``'s report: each entry's name, then its usage lines."""
    found, name = [], None
    for line in text.splitlines():
        if m := re.search(r"entry function '(\w+)'", line):
            name = m.group(1)
        elif name and ("registers" in line or "stack frame" in line):
            # "ptxas info    : Used ..." and the driver's "ptxas         .     0 bytes stack frame, ..."
            found.append((name, re.sub(r"^ptxas\s+(info\s*:|\.)\s*", "", line.strip())))
    return found


def driver_registers(source):
    """[(kernel, usage line)] of NVIDIA's OpenCL driver building ``source`` (its first device)."""
    devices = [d for p in cl.get_platforms() for d in p.get_devices() if runtime.nvidia(d)]
    if not devices:
        raise SystemExit("--driver: no NVIDIA OpenCL device here (the proxy, without --driver, needs none)")
    ctx = cl.Context(devices[:1])
    prg = cl.Program(ctx, source).build(options=[*program.BUILD_OPTIONS, "-cl-nv-verbose"])
    return parse_ptxas(prg.get_build_info(devices[0], cl.program_build_info.LOG) or "")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=sorted(FAMILIES))
    ap.add_argument("--class", dest="sc", action="append", default=[], help="shape class entry, e.g. hd=128")
    ap.add_argument("--param", action="append", default=[], help="a tile parameter in place of the heuristic's")
    ap.add_argument("--flag", action="append", default=[], help="a render extra, e.g. softcap=1 or store_ds=1")
    ap.add_argument("--llvm", default="15", help="the LLVM version suffix of clang, llc, ... (default 15)")
    ap.add_argument("--driver", action="store_true", help="NVIDIA's OpenCL driver builds it (its counts)")
    a = ap.parse_args(argv)
    sc, flags = _pairs(a.sc, "--class"), _pairs(a.flag, "--flag")
    source, p = render(a.family, dict(sc), _pairs(a.param, "--param"), flags)
    print(f"{a.family} {sc} {p} {flags or ''}".rstrip())
    for kernel, line in driver_registers(source) if a.driver else registers(source, a.llvm):
        print(f"  {kernel}: {line}")


if __name__ == "__main__":
    main()
