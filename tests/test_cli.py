"""`python -m clops info` and `python -m clops check` (the main job)."""
import subprocess
import sys

import pytest

from clops import check, cli
from clops.check import Row


def test_info_names_the_chosen_device_and_why():
    res = subprocess.run([sys.executable, "-m", "clops", "info"], capture_output=True, text=True, check=True)
    assert "chosen device:" in res.stdout and "because:" in res.stdout
    assert "local memory" in res.stdout and "extensions:" in res.stdout


def test_check_passes_and_prints_a_table(capsys):
    assert cli.main(["check", "--family", "elementwise"]) == 0
    out = capsys.readouterr().out
    assert "rel err" in out and "swiglu_gated_bwd da" in out and " passed" in out


def test_check_fails_on_a_bad_row(monkeypatch, capsys):
    bad = check.Case("elementwise", "planted failure", lambda queue: [Row("planted", "[1]", 1.0, 1e-6, 0.0)])
    monkeypatch.setattr(check, "CASES", check.CASES + [bad])
    assert cli.main(["check", "--family", "elementwise"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_nan_error_fails():
    assert not Row("x", "[1]", float("nan"), 1e-6, 0.0).ok


def test_unknown_command_is_refused():
    with pytest.raises(SystemExit):
        cli.main(["frobnicate"])
