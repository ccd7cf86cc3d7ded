"""Templates, the program cache and kernel launches.

A program is keyed by a hash of its rendered source, build options, the
device identity (platform, device, driver version) and the clops version.
Built programs live in memory per context (weakly: a dropped context drops
its programs) and on disk through pyopencl's binary cache. Their kernels are
fetched once and launched through :class:`Kernel`, which checks limits once,
serialises argument setting between threads and reports to the profiler.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import warnings
import weakref
from pathlib import Path

import pyopencl as cl
from mako.lookup import TemplateLookup

from . import __version__
from .runtime import capability_macros, device_identity

log = logging.getLogger("clops")

_HERE = Path(__file__).resolve().parent
# Installed wheels carry the templates inside the package; a source tree keeps them beside it.
KERNEL_DIR = next(p for p in (_HERE / "cl_kernels", _HERE.parent / "cl_kernels") if p.is_dir())
_lookup = TemplateLookup(directories=[str(KERNEL_DIR)], strict_undefined=True, input_encoding="utf-8")

BUILD_OPTIONS = ("-cl-std=CL1.2",)


class BuildError(RuntimeError):
    """A template failed to render or a program failed to build."""


class LimitError(ValueError):
    """A parameter set exceeds a device or kernel limit."""


def vtype(vw):
    """The OpenCL type of a vector of ``vw`` floats."""
    return "float" if vw == 1 else f"float{vw}"


def vload(vw, ptr, idx):
    """Element-indexed vector load (vloadn only needs float alignment)."""
    return f"{ptr}[{idx}]" if vw == 1 else f"vload{vw}(0, {ptr} + ({idx}))"


def vstore(vw, val, ptr, idx):
    return f"{ptr}[{idx}] = {val}" if vw == 1 else f"vstore{vw}({val}, 0, {ptr} + ({idx}))"


# String helpers every template sees beside its parameters.
_HELPERS = {"vtype": vtype, "vload": vload, "vstore": vstore}


def render(template, **params):
    """The OpenCL C source of ``template`` rendered with ``params``."""
    try:
        return _lookup.get_template(template).render(**params, **_HELPERS)
    except NameError as e:
        raise BuildError(f"template {template!r}: parameter missing ({e}); given {sorted(params)}") from None
    except Exception as e:
        raise BuildError(f"template {template!r} failed to render with {params}: {type(e).__name__}: {e}") from e


def cache_dir():
    import platformdirs

    return os.path.join(platformdirs.user_cache_dir("clops"), "pyopencl-" + __version__)


def _keep_source(template, key, source):
    path = Path(cache_dir()).parent / "source" / f"{Path(template).stem}-{key[:16]}.cl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return path


stats = {"builds": 0, "hits": 0}
_programs = weakref.WeakKeyDictionary()  # context -> {key: {kernel name: Kernel}}
_lock = threading.RLock()
# Profilers register here (clops.profile); empty, launches pay one dict lookup.
observers = {}


def checked_enabled():
    return os.environ.get("CLOPS_CHECKED", "") not in ("", "0")


def kernels(queue, template, params, *, work_group_size=None):
    """{name: Kernel} of ``template`` rendered with ``params`` for ``queue``'s device.

    ``work_group_size`` (the work-items per group the parameters imply) is
    checked against the device before anything is built.
    """
    dev = queue.device
    if work_group_size is not None and work_group_size > dev.max_work_group_size:
        raise LimitError(
            f"{template} {params}: {work_group_size} work-items per group exceeds the device's "
            f"CL_DEVICE_MAX_WORK_GROUP_SIZE ({dev.max_work_group_size})"
        )
    params = dict(params, checked=checked_enabled())
    source = capability_macros(dev) + render(template, **params)
    ident = "\0".join((source, " ".join(BUILD_OPTIONS), *device_identity(dev), __version__))
    key = hashlib.sha256(ident.encode()).hexdigest()
    with _lock:
        per_ctx = _programs.setdefault(queue.context, {})
        found = per_ctx.get(key)
        if found is not None:
            stats["hits"] += 1
            return found
        found = per_ctx[key] = _build(queue.context, dev, template, params, source, key)
        return found


def _build(ctx, dev, template, params, source, key):
    if os.environ.get("CLOPS_KEEP_SOURCE"):
        kept = _keep_source(template, key, source)
        log.info("kept source of %s at %s", template, kept)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            # Intel's runtime logs progress lines on every build; real warnings are looked for below.
            warnings.simplefilter("ignore", cl.CompilerWarning)
            if os.environ.get("CLOPS_NO_CACHE"):
                # A Program made from a raw _Program takes pyopencl's uncached build path.
                prg = cl.Program(cl._cl._Program(ctx, source)).build(options=list(BUILD_OPTIONS), devices=[dev])
            else:
                prg = cl.Program(ctx, source).build(options=list(BUILD_OPTIONS), devices=[dev], cache_dir=cache_dir())
    except cl.Error as e:
        head = "\n".join(str(e).splitlines()[:30])
        hint = "" if os.environ.get("CLOPS_KEEP_SOURCE") else " (set CLOPS_KEEP_SOURCE=1 to keep the source)"
        raise BuildError(f"building {template} with {params} failed on {dev.name.strip()}{hint}:\n{head}") from None
    build_log = build_warnings(prg, dev)
    if build_log:
        log.warning("%s %s built with warnings on %s:\n%s", template, params, dev.name.strip(), build_log)
    stats["builds"] += 1
    log.info("built %s %s in %.2fs", template, params, time.perf_counter() - start)
    return {k.function_name: Kernel(k, template, params, dev) for k in prg.all_kernels()}


def build_warnings(prg, dev):
    """The lines of ``prg``'s build log on ``dev`` that mention a warning (empty for binary-cache hits)."""
    text = prg.get_build_info(dev, cl.program_build_info.LOG) or ""
    return "\n".join(line for line in text.splitlines() if "warning" in line.lower())


class Kernel:
    """A built kernel with its required work-group size, limits checked once."""

    def __init__(self, knl, template, params, dev):
        self.knl, self.name, self.template, self.params = knl, knl.function_name, template, params
        info = cl.kernel_work_group_info
        self.local_size = tuple(int(s) for s in knl.get_work_group_info(info.COMPILE_WORK_GROUP_SIZE, dev))
        if not any(self.local_size):
            raise BuildError(f"{template}: kernel {self.name} has no reqd_work_group_size attribute")
        wg = 1
        for s in self.local_size:
            wg *= s
        kernel_max = knl.get_work_group_info(info.WORK_GROUP_SIZE, dev)
        if wg > kernel_max:
            raise LimitError(
                f"{template} {params}: kernel {self.name} needs {wg} work-items per group, "
                f"its CL_KERNEL_WORK_GROUP_SIZE on {dev.name.strip()} is {kernel_max}"
            )
        local_bytes = knl.get_work_group_info(info.LOCAL_MEM_SIZE, dev)
        if local_bytes > dev.local_mem_size:
            raise LimitError(
                f"{template} {params}: kernel {self.name} uses {local_bytes} bytes of local memory, "
                f"CL_DEVICE_LOCAL_MEM_SIZE is {dev.local_mem_size}"
            )
        # pyopencl kernels are not safe to share between threads while arguments are set.
        self._lock = threading.Lock()

    def __call__(self, queue, groups, args, wait_for=None):
        """Enqueue over ``groups`` work-groups (a tuple, one per dimension); returns the event."""
        global_size = tuple(g * l for g, l in zip(groups, self.local_size))
        with self._lock:
            evt = self.knl(queue, global_size, self.local_size[: len(global_size)], *args, wait_for=wait_for)
        if observers:
            for observe in list(observers.values()):
                observe(queue, self, global_size, evt)
        return evt
