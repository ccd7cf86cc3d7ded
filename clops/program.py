"""Templates, the program cache and kernel launches.

A program is keyed by a hash of its rendered source, build options, the
device identity (platform, device, driver version) and the clops version.
Built programs live in memory per context (weakly: a dropped context drops
its programs) and on disk through pyopencl's binary cache. Their kernels are
fetched once and launched through :class:`Kernel`, which checks limits once,
serialises argument setting between threads and reports to the profiler.

Checked builds (``CLOPS_CHECKED=1``) render templates with ``checked=True``:
global accesses written through the ``at`` helper are guarded (see
``cl_kernels/common.cl.mako``), the launch appends an error record and the
buffers' sizes, then WAITS for the kernel and raises :class:`OutOfBoundsError`
on the first out-of-range access. They are built from source (with
``-cl-kernel-arg-info``) under their own cache keys; unchecked sources carry no
trace of the guards.
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

import numpy as np
import pyopencl as cl
from mako.lookup import TemplateLookup

from . import __version__
from .runtime import compiler_fault, device_identity

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


class OutOfBoundsError(RuntimeError):
    """A checked build (``CLOPS_CHECKED=1``) saw a global-memory access outside its buffer."""


def vtype(vw):
    """The OpenCL type of a vector of ``vw`` floats."""
    return "float" if vw == 1 else f"float{vw}"


def vload(vw, ptr, idx):
    """Element-indexed vector load (vloadn only needs float alignment)."""
    return f"{ptr}[{idx}]" if vw == 1 else f"vload{vw}(0, {ptr} + ({idx}))"


def vstore(vw, val, ptr, idx):
    return f"{ptr}[{idx}] = {val}" if vw == 1 else f"vstore{vw}({val}, 0, {ptr} + ({idx}))"


# Storage types: what a buffer holds ("float", "half", "bf16"); math is float32 always. 16-bit
# types are held as ushort bits, moved as ushort vectors and converted in registers by
# common.cl.mako's storage() helpers (no cl_khr_fp16 needed; NVIDIA's vload_half8 straight from
# global memory ran at a third of the bandwidth that aligned ushort8 accesses reach).
def ctype(st):
    """The OpenCL element type of a buffer of storage type ``st`` (pointers are declared with it)."""
    return "float" if st == "float" else "ushort"


def load(st, vw, ptr, idx, aligned=False):
    """``vw`` elements of storage type ``st`` at element ``idx`` of ``ptr``, widened to float(vw).
    ``aligned``: the caller guarantees ``idx`` is a multiple of ``vw`` (and ``vw`` a power of two),
    so the access is one naturally aligned vector (vloadn assumes element alignment only, and
    NVIDIA's driver splits a vload4 of 16-bit elements into narrow loads)."""
    if vw == 1:
        return f"{ptr}[{idx}]" if st == "float" else f"clops_{st}_to_float({ptr}[{idx}])"
    ct = ctype(st)
    raw = f"*(__global const {ct}{vw} *)({ptr} + ({idx}))" if aligned else f"vload{vw}(0, {ptr} + ({idx}))"
    return raw if st == "float" else f"clops_{st}_to_float{vw}({raw})"


def store(st, vw, val, ptr, idx, aligned=False):
    """Round float(vw) ``val`` to nearest even in storage type ``st`` and store it at element ``idx``
    (``aligned`` as for :func:`load`)."""
    if vw == 1:
        return f"{ptr}[{idx}] = {val}" if st == "float" else f"{ptr}[{idx}] = clops_float_to_{st}({val})"
    val = val if st == "float" else f"clops_float{vw}_to_{st}({val})"
    if aligned:
        return f"*(__global {ctype(st)}{vw} *)({ptr} + ({idx})) = {val}"
    return f"vstore{vw}({val}, 0, {ptr} + ({idx}))"


def vptr(st, vw):
    """The element type a buffer of storage type ``st`` is declared with when it is read and written
    ``vw`` elements at a time at vector indices (``loadv`` / ``storev``): floatN, or ushortN bits."""
    return vtype(vw) if st == "float" else "ushort" if vw == 1 else f"ushort{vw}"


# String helpers every template sees beside its parameters.
_HELPERS = {"vtype": vtype, "vload": vload, "vstore": vstore, "ctype": ctype, "load": load, "store": store,
            "vptr": vptr}


def _guard_helpers(checked, sites):
    """``at`` and ``checked_args``, the index-guard helpers of checked builds (see common.cl.mako).

    Unchecked, ``at`` returns the index unchanged and ``checked_args`` nothing, so the
    source is that of a template without guards. Checked, each ``at`` is a numbered
    site; ``sites`` collects their descriptions for the host's error message.
    """

    def at(buf, idx, width=1):
        if not checked:
            return idx
        sites.append((buf, f"{buf}[{idx}]" + (f" (a vector of {width})" if width > 1 else "")))
        return f"clops_guard((ulong)({idx}), {width}, {buf}_bytes / sizeof(*{buf}), {len(sites) - 1}u, clops_err)"

    def checked_args(*bufs):
        if not checked:
            return ""
        return "".join([", __global uint *restrict clops_err"] + [f", const ulong {b}_bytes" for b in bufs])

    # Vector-indexed access (every vector aligned to its size: rows start on vector boundaries) to a
    # buffer declared `vptr(st, vw) *`, guarded through `at`: a floatN array as before, or a ushortN
    # one converted in registers (as load / store with aligned=True).
    def loadv(st, vw, ptr, vidx):
        """``vw`` elements of storage type ``st`` at vector index ``vidx`` of ``ptr``, widened to float(vw)."""
        if st == "float":
            return f"{ptr}[{at(ptr, vidx)}]"
        return f"clops_{st}_to_float{'' if vw == 1 else vw}({ptr}[{at(ptr, vidx)}])"

    def storev(st, vw, val, ptr, vidx):
        """Round float(vw) ``val`` to nearest even in storage type ``st``, store it at vector index ``vidx``."""
        if st == "float":
            return f"{ptr}[{at(ptr, vidx)}] = {val}"
        return f"{ptr}[{at(ptr, vidx)}] = clops_float{'' if vw == 1 else vw}_to_{st}({val})"

    return {"at": at, "checked_args": checked_args, "loadv": loadv, "storev": storev}


def _render(template, params):
    """(source, guard sites) of ``template`` rendered with ``params``."""
    sites = []
    helpers = dict(_HELPERS, **_guard_helpers(params.get("checked", False), sites))
    try:
        return _lookup.get_template(template).render(**params, **helpers), sites
    except NameError as e:
        raise BuildError(f"template {template!r}: parameter missing ({e}); given {sorted(params)}") from None
    except Exception as e:
        raise BuildError(f"template {template!r} failed to render with {params}: {type(e).__name__}: {e}") from e


def render(template, **params):
    """The OpenCL C source of ``template`` rendered with ``params``."""
    return _render(template, params)[0]


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


_switches = {}


def env_flag(name):
    """Whether the switch ``name`` is set in the environment: any value but empty and ``0``."""
    return os.environ.get(name, "") not in ("", "0")


def reload_switches():
    """Read ``CLOPS_CHECKED`` again: it is read when clops is imported, not at every op call."""
    _switches["checked"] = env_flag("CLOPS_CHECKED")


reload_switches()


def notify(queue, kernel, global_size, evt, start=None):
    """Tell the profilers of a launch (``kernel`` has a name, template, params and local_size);
    ``start``: an event enqueued just before, when ``evt`` ends several commands (CLBlast's)."""
    for observe in list(observers.values()):
        observe(queue, kernel, global_size, evt, start)


def checked_enabled():
    return _switches["checked"]


def kernels(queue, template, params, *, work_group_size=None):
    """{name: Kernel} of ``template`` rendered with ``params`` for ``queue``'s device.

    Each call renders and hashes the source: ops reach this through the memo of
    :meth:`clops.spec.Spec.kernels`, which calls it once per configuration.

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
    source, sites = _render(template, params)
    # Checked builds read their kernels' argument names to find the guarded buffers.
    options = BUILD_OPTIONS + (("-cl-kernel-arg-info",) if params["checked"] else ())
    ident = "\0".join((source, " ".join(options), *device_identity(dev), __version__))
    key = hashlib.sha256(ident.encode()).hexdigest()
    with _lock:
        # The device is part of the key: two identical devices of one context each get their own build.
        per_ctx = _programs.setdefault(queue.context, {})
        found = per_ctx.get((dev, key))
        if found is not None:
            stats["hits"] += 1
            return found
        found = per_ctx[dev, key] = _build(queue.context, dev, template, params, source, key, options, sites)
        return found


_faults_told = set()  # platform versions whose compiler fault a warning has named


def _build(ctx, dev, template, params, source, key, options, sites):
    fault = compiler_fault(dev)
    if fault and dev.platform.version not in _faults_told:
        _faults_told.add(dev.platform.version)
        warnings.warn(fault, RuntimeWarning, stacklevel=2)
    if env_flag("CLOPS_KEEP_SOURCE"):
        kept = _keep_source(template, key, source)
        log.info("kept source of %s at %s", template, kept)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            # Intel's runtime logs progress lines on every build; real warnings are looked for below.
            warnings.simplefilter("ignore", cl.CompilerWarning)
            # Checked builds skip the binary cache too: programs loaded from binaries may lack
            # the argument names they read.
            if env_flag("CLOPS_NO_CACHE") or params.get("checked"):
                # A Program made from a raw _Program takes pyopencl's uncached build path.
                prg = cl.Program(cl._cl._Program(ctx, source)).build(options=list(options), devices=[dev])
            else:
                prg = cl.Program(ctx, source).build(options=list(options), devices=[dev], cache_dir=cache_dir())
    except cl.Error as e:
        head = "\n".join(str(e).splitlines()[:30])
        hint = "" if env_flag("CLOPS_KEEP_SOURCE") else " (set CLOPS_KEEP_SOURCE=1 to keep the source)"
        raise BuildError(f"building {template} with {params} failed on {dev.name.strip()}{hint}:\n{head}") from None
    build_log = build_warnings(prg, dev)
    if build_log:
        log.warning("%s %s built with warnings on %s:\n%s", template, params, dev.name.strip(), build_log)
    stats["builds"] += 1
    log.info("built %s %s in %.2fs", template, params, time.perf_counter() - start)
    return {k.function_name: Kernel(k, template, params, dev, sites) for k in prg.all_kernels()}


def build_warnings(prg, dev):
    """The lines of ``prg``'s build log on ``dev`` that mention a warning (empty for binary-cache hits)."""
    text = prg.get_build_info(dev, cl.program_build_info.LOG) or ""
    return "\n".join(line for line in text.splitlines()
                     if "warning" in line.lower() and not any(note in line for note in DRIVER_NOTES))


# Lines drivers log for every kernel whatever its source; not warnings about it.
DRIVER_NOTES = (
    "is a kernel, so overriding noinline attribute",  # NVIDIA's OpenCL compiler, each __kernel
    # Intel's CPU runtime, each kernel whose vec_type_hint names a vector type: what the hint asks for
    # (the kernel is written in vectors; cl_kernels/qk_norm_rope.cl.mako)
    "Kernel can't be vectorized due to unsupported vec type hint",
)


class Kernel:
    """A built kernel with its required work-group size, limits checked once."""

    def __init__(self, knl, template, params, dev, sites=()):
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
        self._typed = False
        self._local = {dims: self.local_size[:dims] for dims in (1, 2, 3)}
        # PoCL 3.x's CPU driver aborts (pocl_release_dlhandle_cache) when one kernel runs on two queues
        # at once at different grid widths (tools/pocl_dlhandle_repro.py): its launches on another
        # queue than the last one wait for the last one.
        self._one_queue = dev.platform.version.startswith("OpenCL 3.0 PoCL 3.")
        self._last = None  # (queue, event) of the last launch, kept on PoCL 3.x only
        self.sites = list(sites)
        self._guarded = self._guarded_buffers() if params.get("checked") else None

    def _guarded_buffers(self):
        """Positions of the buffer arguments a checked launch appends the sizes of; None for a
        kernel without guards. The template must list every buffer, in order (checked_args)."""
        arg = lambda i, what: self.knl.get_arg_info(i, what)  # noqa: E731
        names = self._arg_names = [arg(i, cl.kernel_arg_info.NAME) for i in range(self.knl.num_args)]
        if "clops_err" not in names:
            return None
        err = names.index("clops_err")
        glob = cl.kernel_arg_address_qualifier.GLOBAL
        buffers = [i for i in range(err) if arg(i, cl.kernel_arg_info.ADDRESS_QUALIFIER) == glob]
        if names[err + 1:] != [names[i] + "_bytes" for i in buffers]:
            raise BuildError(
                f"{self.template}: kernel {self.name}: checked_args must name its buffers "
                f"{[names[i] for i in buffers]} in order; the kernel ends with {names[err:]}"
            )
        return buffers

    def __call__(self, queue, groups, args, wait_for=None):
        """Enqueue over ``groups`` work-groups (a tuple, one per dimension); returns the event."""
        local = self.local_size
        if len(groups) == 1:  # the common cases without a loop (this path is per launch)
            global_size = (groups[0] * local[0],)
        elif len(groups) == 2:
            global_size = (groups[0] * local[0], groups[1] * local[1])
        else:
            global_size = tuple([g * l for g, l in zip(groups, local)])
        if self._guarded is not None:
            # Checked build: an error record (flag, site, index low, high) and the buffers' sizes.
            err = cl.Buffer(queue.context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                            hostbuf=np.zeros(4, np.uint32))
            args = [*args, err, *(np.uint64(args[i].size) for i in self._guarded)]
        with self._lock:
            if not self._typed:
                # Scalar types declared once (from the first call's numpy scalars): pyopencl then packs
                # them itself; untyped, setting them cost 60-70 µs a launch on NVIDIA's driver.
                self.knl.set_scalar_arg_dtypes([None if isinstance(a, cl.MemoryObjectHolder) else a.dtype for a in args])
                self._typed = True
            if self._one_queue:
                # `is not`: pyopencl's == on queues costs a C call; another handle of the same queue waits too
                if self._last is not None and self._last[0] is not queue:
                    wait_for = list(wait_for or ()) + [self._last[1]]
            evt = self.knl(queue, global_size, self._local[len(global_size)], *args, wait_for=wait_for)
            if self._one_queue:
                self._last = (queue, evt)
        if observers:
            notify(queue, self, global_size, evt)
        if self._guarded is not None:
            self._raise_recorded(queue, err, evt, args)
        return evt

    def _raise_recorded(self, queue, err, evt, args):
        """Wait for the launch (checked builds only) and raise on a recorded out-of-range access."""
        rec = np.empty(4, np.uint32)
        cl.enqueue_copy(queue, rec, err, wait_for=[evt], is_blocking=True)
        if rec[0]:
            buf, where = self.sites[rec[1]]
            index = int(rec[2]) | int(rec[3]) << 32
            size = args[self._arg_names.index(buf)].size
            raise OutOfBoundsError(
                f"checked build: kernel {self.name} ({self.template}) accessed {where} at index {index}, "
                f"outside {buf} ({size} bytes); the first out-of-range access recorded"
            )
