"""Devices: CPU-runtime registration, device choice, capability macros.

Nothing here builds a kernel. ``register_cpu_runtime`` runs at import time
(before pyopencl's ICD loader reads its vendor list) and only writes a small
folder of ``.icd`` files when the ``cpu`` extra is installed but unregistered.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from pathlib import Path

import pyopencl as cl

_SYSTEM_VENDORS = "/etc/OpenCL/vendors"
_choice_lock = threading.Lock()
_default = {}


def _cpu_runtime_library():
    """Absolute path of the pip-installed Intel CPU runtime, or None."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(sys.executable)))):
        path = os.path.join(prefix, "lib", "libintelocl.so")
        if os.path.isfile(path):
            return path
    return None


def _registered_libraries(folder):
    libs = set()
    for icd in glob.glob(os.path.join(folder, "*.icd")):
        try:
            with open(icd) as f:
                libs.add(f.read().strip())
        except OSError:
            pass
    return libs


def register_cpu_runtime():
    """Make the ``cpu`` extra's runtime visible to the ICD loader.

    Respects an explicit ``OCL_ICD_VENDORS``. Otherwise, when
    ``libintelocl.so`` is installed but not listed in the system's vendor
    folder, writes a folder in the user cache dir holding an ``.icd`` with its
    absolute path plus the system's own vendor files, and points
    ``OCL_ICD_VENDORS`` at it. Returns a line saying what was done.
    """
    if os.environ.get("OCL_ICD_VENDORS"):
        return "OCL_ICD_VENDORS set by the user: " + os.environ["OCL_ICD_VENDORS"]
    lib = _cpu_runtime_library()
    if lib is None:
        return "no pip-installed CPU runtime found"
    if lib in _registered_libraries(_SYSTEM_VENDORS):
        return f"{lib} already registered in {_SYSTEM_VENDORS}"
    import platformdirs

    folder = os.path.join(platformdirs.user_cache_dir("clops"), "icd")
    try:
        os.makedirs(folder, exist_ok=True)
        wanted = {"clops-intel-cpu.icd": lib + "\n"}
        for icd in glob.glob(os.path.join(_SYSTEM_VENDORS, "*.icd")):
            with open(icd) as f:
                wanted["system-" + os.path.basename(icd)] = f.read()
        for name in set(os.listdir(folder)) - set(wanted):
            os.remove(os.path.join(folder, name))
        for name, text in wanted.items():
            path = os.path.join(folder, name)
            if not os.path.exists(path) or Path(path).read_text() != text:
                with open(path + ".tmp", "w") as f:
                    f.write(text)
                os.replace(path + ".tmp", path)
    except OSError as e:
        return f"could not register {lib}: {e}"
    os.environ["OCL_ICD_VENDORS"] = folder
    return f"registered {lib} through OCL_ICD_VENDORS={folder}"


REGISTRATION = register_cpu_runtime()


class DeviceError(RuntimeError):
    """No OpenCL device, or none that ``CLOPS_DEVICE`` names: the message says what was found and what to do."""


def _platforms():
    try:
        return cl.get_platforms()
    except cl.Error:  # PLATFORM_NOT_FOUND_KHR: the ICD loader found no vendor file that loads
        return []


def all_devices():
    """[(platform_index, device_index, platform, device)] for every device found (none: [])."""
    out = []
    for pi, plat in enumerate(_platforms()):
        try:
            devs = plat.get_devices()
        except cl.Error:
            continue
        out.extend((pi, di, plat, dev) for di, dev in enumerate(devs))
    return out


# Device types in the order they are preferred, with the names clops prints.
_TYPES = ((cl.device_type.GPU, "GPU"), (cl.device_type.ACCELERATOR, "accelerator"), (cl.device_type.CPU, "CPU"))


def device_kind(dev):
    """'GPU', 'accelerator', 'CPU' or 'other' (drivers may set extra type bits)."""
    return next((name for t, name in _TYPES if dev.type & t), "other")


def _type_rank(dev):
    return next((rank for rank, (t, _) in enumerate(_TYPES) if dev.type & t), len(_TYPES))


def found_devices():
    """:func:`all_devices`, or DeviceError saying what was found and what to install or set."""
    devices = all_devices()
    if devices:
        return devices
    names = [p.name.strip() for p in _platforms()]
    found = f"platforms without devices ({', '.join(names)})" if names else "no OpenCL platform"
    vendors = os.environ.get("OCL_ICD_VENDORS")
    fix = ("install an OpenCL runtime: `pip install 'clops[cpu]'` (Intel's CPU runtime), Debian's "
           "pocl-opencl-icd, or your GPU's driver")
    if REGISTRATION.startswith("OCL_ICD_VENDORS set by the user"):
        fix += f", or unset OCL_ICD_VENDORS (the folder {vendors} is the only one the ICD loader reads)"
    raise DeviceError(f"no OpenCL device: found {found} in the vendor files of {vendors or _SYSTEM_VENDORS}; {fix}")


def _choices(devices):
    listed = "; ".join(f"{pi}:{di} {plat.name.strip()} / {dev.name.strip()}" for pi, di, plat, dev in devices)
    return f"found {listed}. Set CLOPS_DEVICE to part of one of these names or to P:D, or unset it"


def select_device(selector=None):
    """(device, reason) for a ``CLOPS_DEVICE``-style selector.

    The selector is ``"P:D"`` platform/device indices, or a case-insensitive
    substring of the platform or device name. Without one, a GPU is preferred
    over an accelerator over a CPU, then a device whose compiler has no known fault
    (:func:`compiler_fault`), then the platform order.
    """
    devices = found_devices()
    if selector:
        sel = selector.strip()
        if ":" in sel and all(part.strip().isdigit() for part in sel.split(":", 1)):
            p, d = (int(part) for part in sel.split(":", 1))
            for pi, di, _, dev in devices:
                if (pi, di) == (p, d):
                    return dev, f"CLOPS_DEVICE={selector!r} names platform {p}, device {d}"
            raise DeviceError(f"CLOPS_DEVICE={selector!r}: no platform {p} device {d}; {_choices(devices)}")
        for _, _, plat, dev in devices:
            if sel.lower() in plat.name.lower() or sel.lower() in dev.name.lower():
                return dev, f"CLOPS_DEVICE={selector!r} matches {plat.name.strip()} / {dev.name.strip()}"
        raise DeviceError(f"CLOPS_DEVICE={selector!r} matches no platform or device name; {_choices(devices)}")
    _, _, _, dev = min(devices, key=lambda t: (_type_rank(t[3]), compiler_fault(t[3]) is not None, t[0], t[1]))
    passed = [f"{p.name.strip()} / {d.name.strip()}" for _, _, p, d in devices
              if _type_rank(d) == _type_rank(dev) and compiler_fault(d)]
    why = f"; passed over for a known compiler fault: {', '.join(passed)}" if passed and not compiler_fault(dev) else ""
    return dev, f"no selector: first {device_kind(dev)} device (GPUs are preferred over CPUs){why}"


def default_context():
    """The process-wide default context (``CLOPS_DEVICE``, else ``PYOPENCL_CTX``, else the best device)."""
    with _choice_lock:
        if "context" not in _default:
            if os.environ.get("PYOPENCL_CTX") and not os.environ.get("CLOPS_DEVICE"):
                found_devices()
                ctx = cl.create_some_context(interactive=False)
                reason = f"PYOPENCL_CTX={os.environ['PYOPENCL_CTX']!r}"
            else:
                dev, reason = select_device(os.environ.get("CLOPS_DEVICE"))
                ctx = cl.Context([dev])
            _default["context"], _default["reason"] = ctx, reason
        return _default["context"]


def default_queue(profiling=False):
    """A new in-order queue on the default context's device."""
    ctx = default_context()
    props = cl.command_queue_properties.PROFILING_ENABLE if profiling else 0
    return cl.CommandQueue(ctx, properties=props)


def default_reason():
    default_context()
    return _default["reason"]


def device_identity(dev):
    """(platform, device, driver version): the identity cache keys and tuning files use."""
    return (dev.platform.name.strip(), dev.name.strip(), dev.driver_version.strip())


def _preloaded(symbol):
    """Whether a library loaded into the process's global scope (LD_PRELOAD) defines ``symbol``."""
    try:
        return hasattr(ctypes.CDLL(None), symbol)
    except OSError:  # no dlopen(NULL) here
        return False


# clops/pocl_free_quarantine.c, preloaded: PoCL 5.x and 6.x's kernel compiler cannot meet its fault
QUARANTINED = _preloaded("pocl_free_quarantine")
QUARANTINE_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pocl_free_quarantine.c")


def nvidia(dev):
    """Whether ``dev`` is on NVIDIA's OpenCL platform, whose compiler takes inline PTX (``asm``)."""
    return "NVIDIA" in dev.platform.name.upper()


def faulty_pocl(dev):
    """The major version, "5" or "6", where ``dev`` is on PoCL 5.x or 6.x, whose kernel compiler builds kernels that use
    barriers wrong at random (README: known limitations; tools/pocl_vua_repro.py); else None."""
    return next((v for v in ("5", "6") if f" PoCL {v}." in dev.platform.version), None)


def compiler_fault(dev):
    """A line saying that ``dev``'s OpenCL compiler is known to build clops' kernels wrong, or None:
    PoCL 5.x and 6.x (:func:`faulty_pocl`), unless the process runs with clops/pocl_free_quarantine.c
    preloaded."""
    major = faulty_pocl(dev)
    if major is None or QUARANTINED:
        return None
    return (f"PoCL {major}.x ({dev.platform.version.strip()}) builds kernels that use barriers wrong at random, so "
            "results may be wrong (a stale cache in its kernel compiler, fixed in PoCL 7.0): use PoCL 7 or "
            "3, or run `python -m clops pocl-quarantine` and preload the library it builds (README: known "
            "limitations)")


def _c_compilers():
    """C compilers to try: $CC, cc, gcc, clang, then versioned clangs (PoCL's packages depend on one)."""
    versioned = sorted({os.path.basename(f) for d in os.environ.get("PATH", "").split(os.pathsep) if d
                        for f in glob.glob(os.path.join(d, "clang-[0-9]*"))}, reverse=True)
    return [c for c in [os.environ.get("CC"), "cc", "gcc", "clang", *versioned] if c]


def build_quarantine(path):
    """Compile clops/pocl_free_quarantine.c into the shared library ``path`` with the first C compiler
    that succeeds; return the compiler's name, or raise RuntimeError naming those tried."""
    import subprocess

    tried = []
    for cc in _c_compilers():
        try:
            res = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", path, QUARANTINE_SOURCE, "-ldl"],
                                 capture_output=True, text=True)
        except OSError:
            tried.append(f"{cc} (not found)")
            continue
        if res.returncode == 0:
            return cc
        tried.append(f"{cc} ({(res.stderr.strip().splitlines() or ['failed'])[-1]})")
    raise RuntimeError(f"no C compiler built {QUARANTINE_SOURCE}: tried {'; '.join(tried)}; install gcc or "
                       "clang, or set CC")
