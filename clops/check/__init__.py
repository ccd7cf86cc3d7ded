"""Parity checks of every op against the float64 reference: ``python -m clops check``.

Each family module registers cases with :func:`case`; a case runs its op on a
queue (profiling enabled) and returns :class:`Row` s. The test-suite runs the
same cases on every device it finds.
"""
from __future__ import annotations

import dataclasses
import importlib

import numpy as np

from ..reference import rel_err

FAMILIES = ("elementwise", "norm", "qk_norm_rope", "attention", "training")


@dataclasses.dataclass
class Row:
    op: str
    shape: str
    err: float
    tol: float
    ms: float

    @property
    def ok(self):
        return bool(np.isfinite(self.err)) and self.err <= self.tol


@dataclasses.dataclass
class Case:
    family: str
    name: str
    run: object  # run(queue) -> list[Row]


CASES = []


def case(family, name):
    """Register ``fn(queue) -> list[Row]`` as a parity case."""

    def deco(fn):
        CASES.append(Case(family, name, fn))
        return fn

    return deco


def kernel_ms(events):
    """Summed kernel time of ``events`` (profiling queue), in ms; NaN without profiling."""
    try:
        return sum(e.profile.end - e.profile.start for e in events) * 1e-6
    except Exception:
        return float("nan")


def compare(op, shape, got, want, tol, events=()):
    """A Row for device array (or numpy) ``got`` against reference ``want``."""
    host = got.get() if hasattr(got, "get") else got
    return Row(op, shape, rel_err(host, want), tol, kernel_ms(events))


def all_cases(families=FAMILIES):
    """Every registered case of ``families`` (their modules imported on demand)."""
    for fam in families:
        try:
            importlib.import_module(f"{__name__}.{fam}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{fam}":
                raise
    return [c for c in CASES if c.family in families]


def run_all(queue, families=FAMILIES, out=print):
    """Run every case, print the table, return the rows."""
    rows = []
    out(f"{'op':<33} {'shape':<34} {'rel err':>10} {'tol':>8} {'result':>6} {'kernel ms':>10}")
    for c in all_cases(families):
        for r in c.run(queue):
            rows.append(r)
            out(f"{r.op:<33} {r.shape:<34} {r.err:>10.2e} {r.tol:>8.0e} {'pass' if r.ok else 'FAIL':>6} {r.ms:>10.3f}")
    return rows
