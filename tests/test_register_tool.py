"""tools/nvptx_registers.py: its reading of ptxas' report (the proxy's and NVIDIA's driver's are one format),
and --driver refused, naming why, where no NVIDIA device is."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pyopencl as cl
import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "nvptx_registers.py"

# NVIDIA's driver log with -cl-nv-verbose (an H100, driver 580, 2026-12-06), two entries
LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'add_rms_norm_bwd' for 'sm_90a'
ptxas info    : Function properties for add_rms_norm_bwd
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 208 registers, used 1 barriers, 1028 bytes smem
ptxas info    : Compiling entry function 'rms_norm_bwd_dw' for 'sm_90a'
ptxas info    : Function properties for rms_norm_bwd_dw
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 1028 bytes smem
"""


def _tool():
    spec = importlib.util.spec_from_file_location("nvptx_registers", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ptxas_report_is_read_per_kernel():
    assert _tool().parse_ptxas(LOG) == [
        ("add_rms_norm_bwd", "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"),
        ("add_rms_norm_bwd", "Used 208 registers, used 1 barriers, 1028 bytes smem"),
        ("rms_norm_bwd_dw", "8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads"),
        ("rms_norm_bwd_dw", "Used 128 registers, used 1 barriers, 1028 bytes smem"),
    ]


def test_driver_mode_needs_an_nvidia_device():
    if any("NVIDIA" in p.name.upper() for p in cl.get_platforms()):
        pytest.skip("an NVIDIA OpenCL device is here: --driver builds on it")
    res = subprocess.run([sys.executable, str(TOOL), "rms_norm_bwd_dw", "--class", "d=64", "--driver"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 1 and "--driver: no NVIDIA OpenCL device here" in res.stderr
