"""Runtime: the program cache, template rendering, device selection, CPU-runtime registration,
known compiler faults, and the package as installed from a wheel."""
import ctypes
import importlib.metadata
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pytest

import clops
from clops import program, runtime
from clops.program import BuildError, LimitError, kernels, render

ROOT = Path(__file__).resolve().parents[1]
PARAMS = dict(wg=32, vw=2, ept=1, idx="uint", st="float", gst="float", row_aligned=0)


def test_second_call_builds_nothing(ctx_factory):
    ctx = ctx_factory()
    queue = cl.CommandQueue(ctx)
    before = program.stats["builds"]
    first = kernels(queue, "elementwise.cl.mako", PARAMS)
    assert program.stats["builds"] == before + 1
    again = kernels(queue, "elementwise.cl.mako", dict(PARAMS))
    assert again is first and again["add"] is first["add"]
    assert program.stats["builds"] == before + 1


def test_other_parameters_or_context_build_anew(ctx_factory):
    ctx = ctx_factory()
    queue = cl.CommandQueue(ctx)
    base = kernels(queue, "elementwise.cl.mako", PARAMS)
    before = program.stats["builds"]
    other = kernels(queue, "elementwise.cl.mako", dict(PARAMS, vw=4))
    assert other is not base and program.stats["builds"] == before + 1
    ctx2 = cl.Context(ctx.devices)
    fresh = kernels(cl.CommandQueue(ctx2), "elementwise.cl.mako", PARAMS)
    assert fresh is not base and program.stats["builds"] == before + 2


TWO_DEVICES = """
import numpy as np, pyopencl as cl, pyopencl.array as cla
import clops
from clops import program
plat = next(p for p in cl.get_platforms() if "Portable" in p.name)
devs = plat.get_devices()
assert len(devs) == 2 and devs[0].name == devs[1].name, devs
ctx = cl.Context(devs)
queues = [cl.CommandQueue(ctx, d) for d in devs]
x = [cla.to_device(q, np.arange(9, dtype=np.float32)) for q in queues]
for q, a in zip(queues, x):
    assert np.array_equal(clops.add(q, a, a).get(), 2 * np.arange(9, dtype=np.float32))
built = program.stats["builds"]
(progs,) = program._programs.values()
assert len({dev for dev, _ in progs}) == 2, progs.keys()  # one build per device, not one shared
again = cl.CommandQueue(ctx, devs[1])
b = cla.to_device(again, np.ones(3, np.float32))
clops.add(again, b, b).get()
assert program.stats["builds"] == built  # a new queue on the same context reuses its device's program
print("ok")
"""


def test_two_identical_devices_of_one_context_each_get_their_program():
    """PoCL shows two identical devices when POCL_DEVICES names two (a process of its own: the
    platform is read once)."""
    if not any("Portable" in p.name for p in cl.get_platforms()):
        pytest.skip("needs PoCL, which can show two identical devices")
    env = dict(os.environ, POCL_DEVICES="pthread pthread", CLOPS_NO_CACHE="1")
    res = subprocess.run([sys.executable, "-c", TWO_DEVICES], env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout[-2000:] + res.stderr[-3000:]


def test_render_error_names_template_and_parameter():
    with pytest.raises(BuildError, match=r"elementwise\.cl\.mako.*'vw'"):
        render("elementwise.cl.mako", wg=64, ept=1, idx="uint", st="float", gst="float", checked=False)


def test_build_error_names_template_and_log(ctx_factory, tmp_path, monkeypatch):
    (tmp_path / "broken.cl.mako").write_text("__kernel void broken(__global float *x) { x[0] = undefined_name; }\n")
    monkeypatch.setattr(program._lookup, "directories", [str(tmp_path)] + program._lookup.directories)
    ctx = ctx_factory()
    queue = cl.CommandQueue(ctx)
    with pytest.raises(BuildError, match=r"broken\.cl\.mako.*\{'n': 1"):
        kernels(queue, "broken.cl.mako", {"n": 1})


def test_work_group_limit_rejected_before_build(ctx_factory):
    ctx = ctx_factory()
    queue = cl.CommandQueue(ctx)
    too_many = queue.device.max_work_group_size * 2
    before = program.stats["builds"]
    with pytest.raises(LimitError, match="CL_DEVICE_MAX_WORK_GROUP_SIZE"):
        kernels(queue, "elementwise.cl.mako", dict(PARAMS, wg=too_many), work_group_size=too_many)
    assert program.stats["builds"] == before


@pytest.mark.parametrize("selector", ["0:0", "cpu", "CPU", "portable", "intel", "xeon"])
def test_device_selector(selector):
    names = [(p.name + " " + d.name).lower() for _, _, p, d in runtime.all_devices()]
    if selector == "0:0" or any(selector.lower() in n for n in names):
        dev, reason = runtime.select_device(selector)
        assert selector in reason and dev is not None
    else:
        with pytest.raises(runtime.DeviceError, match="CLOPS_DEVICE"):
            runtime.select_device(selector)


def test_device_selector_rejects_unknown():
    with pytest.raises(runtime.DeviceError, match="matches no platform"):
        runtime.select_device("no-such-device-anywhere")
    with pytest.raises(runtime.DeviceError, match="no platform 99"):
        runtime.select_device("99:0")


def test_registration_writes_icd_folder(tmp_path, monkeypatch):
    lib = tmp_path / "lib" / "libintelocl.so"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    monkeypatch.delenv("OCL_ICD_VENDORS", raising=False)
    monkeypatch.setattr(runtime, "_cpu_runtime_library", lambda: str(lib))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    said = runtime.register_cpu_runtime()
    folder = os.environ["OCL_ICD_VENDORS"]
    assert folder in said and folder.startswith(str(tmp_path / "cache"))
    assert (Path(folder) / "clops-intel-cpu.icd").read_text().strip() == str(lib)
    monkeypatch.setenv("OCL_ICD_VENDORS", "/somewhere")
    assert "set by the user" in runtime.register_cpu_runtime()


def _offline_build():
    """pip's --no-build-isolation where this environment has the build backend pyproject.toml asks for
    (setuptools ≥ 77): the install then needs no package index (the GPU machine has none)."""
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return []
    return ["--no-build-isolation"] if major >= 77 else []


def test_installed_package_renders_every_template(tmp_path):
    """A wheel install carries cl_kernels/ (and the PoCL quarantine's source) inside the package, and every
    op runs from it."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *_offline_build(), "--target", str(site),
                    str(ROOT)], check=True)
    shipped = sorted(p.name for p in (site / "clops" / "cl_kernels").glob("*.mako"))
    assert shipped == sorted(p.name for p in (ROOT / "cl_kernels").glob("*.mako"))
    assert (site / "clops" / "pocl_free_quarantine.c").is_file()
    # the installed clops first; the rest of the path stays (where pyopencl comes from a PYTHONPATH)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    code = ("import clops, clops.program as p; assert p.KERNEL_DIR.is_relative_to(%r), p.KERNEL_DIR; "
            "from clops.cli import main; raise SystemExit(main(['check']))" % str(site))
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert " passed" in res.stdout


def test_default_queue_is_usable():
    queue = clops.default_queue()
    a = cla.to_device(queue, np.arange(5, dtype=np.float32))
    assert np.array_equal(clops.add(queue, a, a).get(), 2 * np.arange(5, dtype=np.float32))


def test_build_warnings_ignore_driver_notes():
    class Log:
        def get_build_info(self, dev, what):
            return ("(): Warning: Function add is a kernel, so overriding noinline attribute. The function may be "
                    "inlined when called.\nsrc.cl:3:5: warning: unused variable 'x'\nCompilation done\n")

    assert program.build_warnings(Log(), None) == "src.cl:3:5: warning: unused variable 'x'"


# platform versions as the runtimes report them (PoCL's, Intel's CPU runtime's, NVIDIA's)
POCL = "OpenCL 3.0 PoCL {}+debian  Linux, None+Asserts, RELOC, SPIR-V, LLVM 18.1.8, SLEEF, DISTRO, POCL_DEBUG"


@pytest.mark.parametrize("version, faulty", [(POCL.format("5.0"), "PoCL 5.x"), (POCL.format("6.0"), "PoCL 6.x"),
                                             (POCL.format("3.1"), None), (POCL.format("7.1"), None),
                                             ("OpenCL 3.0 LINUX", None), ("OpenCL 3.0 CUDA 13.0.88", None)])
def test_compiler_fault_names_pocl_5_and_6(monkeypatch, version, faulty):
    dev = types.SimpleNamespace(platform=types.SimpleNamespace(version=version))
    monkeypatch.setattr(runtime, "QUARANTINED", False)
    fault = runtime.compiler_fault(dev)
    assert fault is None if faulty is None else fault.startswith(faulty) and "README" in fault
    monkeypatch.setattr(runtime, "QUARANTINED", True)  # clops/pocl_free_quarantine.c preloaded
    assert runtime.compiler_fault(dev) is None


def test_preloaded_finds_symbols_of_the_global_scope():
    assert runtime._preloaded("malloc") and not runtime._preloaded("clops_no_such_symbol")


def test_a_compiler_fault_is_told_once_per_platform(ctx_factory, monkeypatch):
    monkeypatch.setattr(program, "compiler_fault", lambda dev: "this compiler builds kernels wrong")
    monkeypatch.setattr(program, "_faults_told", set())
    contexts = [ctx_factory(), ctx_factory()]  # held: Intel's CPU runtime loses an unreferenced one
    with pytest.warns(RuntimeWarning, match="this compiler builds kernels wrong") as told:
        for ctx, params in zip(contexts, (PARAMS, dict(PARAMS, vw=4))):  # two builds
            kernels(cl.CommandQueue(ctx), "elementwise.cl.mako", params)
    assert len([w for w in told if "builds kernels wrong" in str(w.message)]) == 1


def test_default_device_passes_over_a_faulty_compiler(monkeypatch):
    def device(name, version, kind=cl.device_type.CPU):
        plat = types.SimpleNamespace(name=name, version=version)
        return types.SimpleNamespace(name=name + " device", type=kind, platform=plat)

    pocl5, intel = device("Portable Computing Language", POCL.format("5.0")), device("Intel(R) OpenCL", "OpenCL 3.0 LINUX")
    monkeypatch.setattr(runtime, "QUARANTINED", False)
    monkeypatch.setattr(runtime, "found_devices", lambda: [(0, 0, pocl5.platform, pocl5), (1, 0, intel.platform, intel)])
    dev, reason = runtime.select_device()
    assert dev is intel and "passed over for a known compiler fault: Portable Computing Language" in reason
    gpu = device("NVIDIA CUDA", "OpenCL 3.0 CUDA 13.0.88", cl.device_type.GPU)  # a GPU still comes first
    monkeypatch.setattr(runtime, "found_devices", lambda: [(0, 0, pocl5.platform, pocl5), (1, 0, gpu.platform, gpu)])
    assert runtime.select_device() == (gpu, "no selector: first GPU device (GPUs are preferred over CPUs)")
    monkeypatch.setattr(runtime, "found_devices", lambda: [(0, 0, pocl5.platform, pocl5)])  # the only one: taken
    assert runtime.select_device()[0] is pocl5


def test_pocl_quarantine_builds_the_preloadable_library(tmp_path, capsys):
    from clops import cli

    lib = tmp_path / "q" / "quarantine.so"
    assert cli.main(["pocl-quarantine", "--output", str(lib)]) == 0
    assert f"LD_PRELOAD={lib}" in capsys.readouterr().out
    assert hasattr(ctypes.CDLL(str(lib)), "pocl_free_quarantine")  # the symbol clops looks for


def test_pocl_quarantine_names_the_compilers_it_tried(tmp_path, monkeypatch, capsys):
    from clops import cli

    monkeypatch.setattr(runtime, "_c_compilers", lambda: ["clops-no-such-cc"])
    assert cli.main(["pocl-quarantine", "--output", str(tmp_path / "q.so")]) == 1
    assert "clops-no-such-cc (not found)" in capsys.readouterr().err


@pytest.mark.parametrize("value, on", [(None, False), ("", False), ("0", False), ("1", True), ("yes", True)])
def test_switches_read_zero_as_off(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("CLOPS_NO_CACHE", raising=False)
    else:
        monkeypatch.setenv("CLOPS_NO_CACHE", value)
    assert program.env_flag("CLOPS_NO_CACHE") is on
