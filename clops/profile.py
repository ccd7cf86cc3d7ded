"""Profiling of what clops does on a queue: ``with clops.profile(queue) as prof: ...``.

Recorded while the block runs, for that queue only:

- every kernel clops enqueues (through :class:`clops.program.Kernel`): its name,
  template, template parameters, global and local size, and its device time
  from the profiling events (read when asked, so recording never waits);
- the arrays clops allocates (:func:`clops.args.new_array`: every output an op
  creates and every scratch array): ``buffers`` and ``buffer_bytes``. Ops never
  write from the host or wait on it; work the caller does itself
  (``to_device``, ``.get()``, ``finish``) is not clops's and is not counted.

Off (no block active), a launch pays one empty-dict check and allocation one more.
"""
from __future__ import annotations

import collections
import dataclasses
import statistics

import pyopencl as cl

from . import args, program


@dataclasses.dataclass
class Launch:
    name: str
    template: str
    params: dict
    global_size: tuple
    local_size: tuple
    event: cl.Event
    start: cl.Event = None  # the command the launch's time starts at, when not its own event

    @property
    def began(self):
        return (self.start or self.event).profile.start

    @property
    def ms(self):
        self.event.wait()
        return (self.event.profile.end - self.began) * 1e-6


class Profile:
    """Records kernels and host-side counts; see the module docstring."""

    def __init__(self, queue):
        args.check_queue(queue)
        if not queue.properties & cl.command_queue_properties.PROFILING_ENABLE:
            raise ValueError(
                "profile: the queue was made without profiling; create it with "
                "cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE) "
                "or clops.default_queue(profiling=True)"
            )
        self.queue = queue
        self.launches = []
        self.counts = collections.Counter({"buffers": 0, "buffer_bytes": 0})

    def __enter__(self):
        program.observers[id(self)] = self._on_launch
        args.host_observers[id(self)] = self._on_host
        return self

    def __exit__(self, *exc):
        program.observers.pop(id(self), None)
        args.host_observers.pop(id(self), None)
        return False

    def _on_launch(self, queue, kernel, global_size, evt, start=None):
        if queue == self.queue:
            self.launches.append(Launch(kernel.name, kernel.template, dict(kernel.params), tuple(global_size),
                                        kernel.local_size[: len(global_size)], evt, start))

    def _on_host(self, queue, what, amount):
        if queue == self.queue:
            self.counts[what] += amount

    def _selected(self, kernels):
        """The recorded launches (only of the kernels named in ``kernels``, if given); ValueError if none."""
        launches = [r for r in self.launches if kernels is None or r.name in kernels]
        if not launches:
            raise ValueError(f"profile: no clops kernel{' of ' + ', '.join(kernels) if kernels else ''} "
                             "was enqueued on this queue")
        return launches

    def span_ms(self, kernels=None):
        """Device time from the first recorded kernel's start to the last one's end (only those named in
        ``kernels``, if given)."""
        launches = self._selected(kernels)
        cl.wait_for_events([r.event for r in launches])
        start = min(r.began for r in launches)
        return (max(r.event.profile.end for r in launches) - start) * 1e-6

    def kernel_ms(self, kernels=None):
        """Summed device time of the recorded kernels (only those named in ``kernels``, if given): the
        gaps between kernels, where the device waits for the host to enqueue, are not counted."""
        return sum(r.ms for r in self._selected(kernels))

    def summary(self):
        """[(kernel name, calls, total ms, mean ms, share of all kernel time)], longest first."""
        per = collections.defaultdict(list)
        for r in self.launches:
            per[r.name].append(r.ms)
        total = sum(sum(v) for v in per.values()) or 1.0
        rows = [(name, len(v), sum(v), sum(v) / len(v), sum(v) / total) for name, v in per.items()]
        return sorted(rows, key=lambda row: -row[2])

    def table(self):
        """The per-kernel summary and the host-side counts as text."""
        lines = [f"{'kernel':<28} {'calls':>6} {'total ms':>10} {'mean ms':>10} {'share':>7}"]
        for name, calls, total, mean, share in self.summary():
            lines.append(f"{name:<28} {calls:>6} {total:>10.3f} {mean:>10.4f} {share:>6.1%}")
        c = self.counts
        lines.append(f"buffers created {c['buffers']} ({c['buffer_bytes'] / 2**20:.1f} MiB)")
        return "\n".join(lines)


def profile(queue):
    """``with clops.profile(queue) as prof:`` — see :class:`Profile`."""
    return Profile(queue)


def measure(queue, fn, *, warmup=2, runs=7, kernels=None):
    """Median device time in ms of ``fn()`` (which enqueues clops ops on ``queue``) and the list of times.

    Each call's time is the sum of its kernels' device times (of those named in
    ``kernels``, if given), after ``warmup`` untimed calls. Gaps between
    kernels are left out: they measure how fast Python enqueues, which a
    program that enqueues ahead never waits for.
    """
    for _ in range(warmup):
        fn()
    queue.finish()
    times = []
    for _ in range(runs):
        with Profile(queue) as prof:
            fn()
        times.append(prof.kernel_ms(kernels))
    return statistics.median(times), times
