"""The parity cases of ``python -m clops check``, as tests on every device."""
import pytest

from clops.check import all_cases

CASES = all_cases()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.family}:{c.name}" for c in CASES])
def test_case_matches_reference(queue, case):
    rows = case.run(queue)
    assert rows, f"{case.name}: no rows"
    bad = [f"{r.op} {r.shape}: {r.err:.3e} > {r.tol:.0e}" for r in rows if not r.ok]
    assert not bad, bad
