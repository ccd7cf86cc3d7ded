"""Every template builds as OpenCL C 1.2 without a warning on every device.

The oclgrind tour (tests/test_oclgrind.py: every kernel of every family at tile sets of
vector widths 1 and 4, and the device's default) runs here on the device under test with
the binary cache off, so every program is compiled from source and its build log read;
then once more as checked builds (CLOPS_CHECKED=1), whose kernels must all carry the guards.
And the kernel of tools/pocl_vua_repro.py (PoCL 5.x and 6.x's fault, README: known limitations)
computes right on PoCL where its compiler is sound; tools/intel_fneg_repro.py shows the fault of
Intel's CPU runtime that the matrix-unit backward steers clear of.
"""
import subprocess
import sys
from pathlib import Path

import pyopencl as cl
import pytest

import clops.program
from clops import runtime, tuning
from test_oclgrind import FAMILIES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("checked", [False, True], ids=["plain", "checked"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_templates_build_without_warnings(ctx_factory, monkeypatch, family, checked):
    # A context of its own (held: Intel's CPU runtime loses an unreferenced one): programs that
    # other tests built in the shared context would not be rebuilt.
    ctx = ctx_factory()
    queue = cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    monkeypatch.setenv("CLOPS_NO_CACHE", "1")
    monkeypatch.setenv("CLOPS_CHECKED", "1" if checked else "0")
    clops.program.reload_switches()  # CLOPS_CHECKED is read once
    monkeypatch.setattr(tuning, "_overrides", {})  # the tour's tile overrides end with the test
    logs = {}
    real = clops.program.build_warnings

    def record(prg, dev):
        text = real(prg, dev)
        logs[len(logs)] = text
        return text

    monkeypatch.setattr(clops.program, "build_warnings", record)
    run, templates = FAMILIES[family]
    run(queue)
    assert logs, f"{family}: nothing was built (a cached program would hide its build log)"
    warned = [text for text in logs.values() if text]
    assert not warned, "\n\n".join(warned)
    if checked:  # every kernel of the family's templates adopted the guards (cl_kernels/common.cl.mako)
        built = [k for p in clops.program._programs[queue.context].values() for k in p.values()
                 if k.template in templates]
        unguarded = sorted({f"{k.template}:{k.name}" for k in built if k._guarded is None})
        assert not unguarded, f"kernels without index guards: {unguarded}"


def test_a_planted_warning_is_seen(queue):
    """The build log is read on this device: a source with a warning is caught."""
    import warnings

    import pyopencl as cl

    source = "#warning planted\n__kernel void f(__global float *a) { a[0] = 1.0f; }"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cl.CompilerWarning)
        prg = cl.Program(cl._cl._Program(queue.context, source)).build(options=list(clops.program.BUILD_OPTIONS))
    assert "planted" in clops.program.build_warnings(prg, queue.device)


def test_pocl_repro_kernel_is_right_where_the_compiler_is_sound(ctx_factory):
    """tools/pocl_vua_repro.py's kernel computes right on PoCL where its kernel compiler lacks the
    fault: 5 builds on 3.x and 7.x (the reproducer's own reference), 50 on 5.x and 6.x under
    clops/pocl_free_quarantine.c (the reproducer meets the fault in about 2 to 10 builds of 100
    otherwise): a wrong build there is PoCL's."""
    dev = ctx_factory.device
    if "Portable" not in dev.platform.name:
        pytest.skip("the reproducer runs on PoCL")
    if runtime.compiler_fault(dev):
        pytest.skip("PoCL 5.x or 6.x without clops/pocl_free_quarantine.c: the reproducer shows the fault")
    builds = "50" if runtime.faulty_pocl(dev) else "5"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "pocl_vua_repro.py"), "--builds", builds],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.endswith("ok\n"), res.stdout + res.stderr


def test_intel_fneg_fault_reproduces(ctx_factory):
    """Intel's CPU runtime, optimising, keeps one copy per work-group of a negated value that lives
    across a barrier (tools/intel_fneg_repro.py; README: known limitations): the reproducer's
    optimised build is wrong there and its -cl-opt-disable build right. The matrix-unit backward,
    which met the fault, holds −lse·log2 e negated (test_attention_mma.py's portable-product cases
    check it there, optimised). Once a runtime builds the reproducer right, this fails: say so in
    the README."""
    dev = ctx_factory.device
    if not ("Intel" in dev.platform.name and dev.type & cl.device_type.CPU):
        pytest.skip("the fault is Intel's CPU runtime's")
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "intel_fneg_repro.py")],
                         capture_output=True, text=True, timeout=300)
    name = f"{dev.platform.name} {dev.driver_version}"
    assert f"{name} optimised: WRONG" in res.stdout, "the fault is gone: " + res.stdout + res.stderr
    assert f"{name} -cl-opt-disable: ok" in res.stdout and res.returncode == 1, res.stdout + res.stderr
