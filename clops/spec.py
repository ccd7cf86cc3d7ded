"""Kernel family specs: one declarative object per family, read by the op, ``clops tune``,
``clops check``, the bench and the tests.

A :class:`Spec` holds, in one place, a family's template, its tunable parameters (with the
candidates a sweep tries, in order), the heuristic that picks them without a tuning entry,
the rules a parameter set must obey, and the values derived from it: work-items per group,
bytes of local memory its kernels declare, and the render parameters. ``spec.params(dev, sc)``
resolves the parameters for a device and shape class once (tuning database, else heuristic;
checked) and memoises them; ``spec.kernels(queue, sc, **extra)`` memoises the built kernels,
so a warm op call renders, hashes and reads nothing.

A tuning entry the device cannot run (a stale user file, a shipped entry for another driver)
is not used: clops warns once, naming the entry and the rule it breaks, and takes the
heuristic. A run-time override (``clops.tuning.override``, what ``clops tune`` sets) is used
as given and raises :class:`clops.LimitError` when it breaks a rule.
"""
from __future__ import annotations

import dataclasses
import threading
import warnings
import weakref
from typing import Callable

import numpy as np

from . import tuning
from .program import LimitError, _switches, checked_enabled, kernels


def _no_rules(p, sc):
    return ()


def _group(p, sc):
    return p["wg"]


def _no_local(p, sc):
    return 0


def _as_is(p, sc):
    return dict(p)


_NOT_HOT = (lambda: None, None, None, None)  # matches no queue


class _Table(dict):
    """{op's key: plan} of one context, device and CLOPS_CHECKED; weakly referable, so that the hot
    entry of :meth:`Spec.plan` keeps no dropped context's kernels alive."""
    __slots__ = ("__weakref__",)


@dataclasses.dataclass(eq=False)
class Spec:
    op: str  # the family's name in the tuning database
    template: str
    names: tuple  # the tunable parameters
    space: Callable  # space(sc) -> {parameter: [candidates]}: what a sweep tries, in sweep order
    heuristic: Callable  # heuristic(dev, sc) -> parameters, from the device's limits
    rules: Callable = _no_rules  # rules(p, sc) -> ((holds, text), ...)
    wg: Callable = _group  # wg(p, sc) -> work-items per group
    local_bytes: Callable = _no_local  # local_bytes(p, sc) -> bytes of local memory of the largest kernel
    render: Callable = _as_is  # render(p, sc) -> template parameters (derived values added)
    sweep_derive: Callable = None  # sweep_derive(p, sc) -> p with the parameters fixed by the others
    doc: str = ""

    def __post_init__(self):
        self._params = {}  # (device, shape class) -> render parameters
        self._kernels = weakref.WeakKeyDictionary()  # context -> {(device, shape class, extra): (params, kernels)}
        self._plans = weakref.WeakKeyDictionary()  # context -> {(device, CLOPS_CHECKED): {op's key: plan}}
        self._hot = _NOT_HOT  # (weak context, device, CLOPS_CHECKED, weak table) of the last plan() call
        self._gen = tuning.generation()
        self._lock = threading.Lock()

    def violation(self, dev, sc, p):
        """(rule, detail) of the first rule ``p`` breaks on ``dev`` at ``sc``, or None: the names
        and types, the family's rules, the work-group size, the local memory, in that order."""
        names = self.names
        if sorted(p) != sorted(names) or not all(isinstance(p[x], (int, np.integer)) and not isinstance(p[x], bool)
                                                 and p[x] > 0 for x in names):
            return f"parameters must be positive ints named {names}", ""
        for ok, rule in self.rules(p, sc):
            if not ok:
                return rule, ""
        wg = self.wg(p, sc)
        if wg > dev.max_work_group_size:
            return ("work-items per group ≤ CL_DEVICE_MAX_WORK_GROUP_SIZE",
                    f"{wg} work-items per group exceed the device's CL_DEVICE_MAX_WORK_GROUP_SIZE "
                    f"({dev.max_work_group_size})")
        need = self.local_bytes(p, sc)
        if need > dev.local_mem_size:
            return ("local memory ≤ CL_DEVICE_LOCAL_MEM_SIZE",
                    f"needs {need} bytes of local memory, CL_DEVICE_LOCAL_MEM_SIZE is {dev.local_mem_size}")
        return None

    def check(self, dev, sc, p):
        """``p`` (as ints) if ``dev`` can run the family with it at shape class ``sc``; else LimitError saying why."""
        broken = self.violation(dev, sc, p)
        if broken is not None:
            raise LimitError(f"{self.op} {tuning.shape_key(sc)} {p}: {broken[1] or broken[0]}".replace("  ", " "))
        return {k: int(p[k]) for k in self.names}

    def resolve(self, dev, sc):
        """(checked parameters, where they came from) for ``dev`` at ``sc``, without the memo."""
        found, source = tuning.lookup(dev, self.op, sc)
        if found is not None:
            try:
                return self.check(dev, sc, found), source
            except LimitError as e:
                if source == "override":  # what clops tune is trying: its failure is the answer
                    raise
                warnings.warn(f"tuning entry from {source} not used, the heuristic is: {e}", stacklevel=4)
        return self.check(dev, sc, self.heuristic(dev, sc)), "heuristic"

    def _fresh(self):
        """Forget the memos when the tuning database changed since they were filled."""
        gen = tuning.generation()
        if gen != self._gen:
            with self._lock:
                self._params, self._gen = {}, gen
                self._kernels, self._plans = weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary()
                self._hot = _NOT_HOT

    def params(self, dev, sc):
        """Render parameters for ``dev`` at ``sc`` (memoised until the tuning database changes)."""
        self._fresh()
        key = (dev, tuple(sc.values()))  # a family's shape class has fixed keys
        found = self._params.get(key)
        if found is None:
            found = self.render(self.resolve(dev, sc)[0], sc)
            with self._lock:
                self._params[key] = found
        return found

    def kernels(self, queue, sc, **extra):
        """(render parameters, {name: Kernel}) on ``queue``'s device at ``sc``; ``extra`` are
        render parameters the call adds (index type, flags). Memoised per context and device."""
        self._fresh()
        dev = queue.device
        # Each call site passes the same keys in the same order, so values identify them.
        key = (dev, tuple(sc.values()), tuple(extra.items()), checked_enabled())
        per_ctx = self._kernels.get(queue.context)
        found = per_ctx.get(key) if per_ctx is not None else None
        if found is None:
            p = self.params(dev, sc)
            found = (p, kernels(queue, self.template, dict(p, **extra), work_group_size=self.wg(p, sc)))
            with self._lock:
                self._kernels.setdefault(queue.context, {})[key] = found
        return found

    def plan(self, queue, key, build, *args):
        """What ``build(queue, *args)`` returns (an op's kernel, grid and fixed scalar arguments for
        one shape and dtype, say), memoised per context and device under ``key`` (a tuple that
        determines it) until the tuning database changes: a warm op call pays one lookup for what
        :meth:`params`, :meth:`kernels` and its own arithmetic would cost."""
        if tuning._generation[0] != self._gen:
            self._fresh()
        # The last call's table, when this call has the same context, device and checked switch (identity
        # tests: pyopencl hands out one object per handle; another object for it takes the path below).
        hot = self._hot
        checked = _switches["checked"]
        if hot[0]() is queue.context and hot[1] is queue.device and hot[2] is checked:
            table = hot[3]()
            found = table.get(key) if table is not None else None
            if found is not None:
                return found
        dev = queue.device
        per_ctx = self._plans.get(queue.context)
        table = per_ctx.get((dev, checked)) if per_ctx is not None else None
        found = table.get(key) if table is not None else None
        if found is None:
            found = build(queue, *args)
        with self._lock:  # as _fresh's reset: a table it drops is not made hot again
            table = self._plans.setdefault(queue.context, {}).setdefault((dev, checked), _Table())
            table[key] = found
            self._hot = (weakref.ref(queue.context), dev, checked, weakref.ref(table))
        return found
