"""`python -m clops info`, `check` (the main job), and the command lines' refusals: no OpenCL platform,
an unknown device, family, bench or tune op; the help texts; the tune sweep's last line and chart."""
import os
import subprocess
import sys
import types
from unittest import mock

import pytest

from clops import bench, check, cli, runtime, tune, tuning
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


def _clops(args, **env):
    """``python <args>`` in a subprocess with ``env`` added to this one's environment."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=dict(os.environ, **env))


@pytest.mark.parametrize("args", [["-m", "clops", "info"], ["-m", "clops", "check"],
                                  ["-c", "import clops; clops.default_queue()"]],
                         ids=["info", "check", "default_queue"])
def test_no_platform_says_what_to_install(tmp_path, args):
    res = _clops(args, OCL_ICD_VENDORS=str(tmp_path))
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and "no OpenCL platform" in last and "pip install 'clops[cpu]'" in last, res.stderr
    assert "OCL_ICD_VENDORS" in last
    if args[0] == "-m":
        assert "Traceback" not in res.stderr


def test_unknown_device_lists_the_devices():
    res = _clops(["-m", "clops", "info"], CLOPS_DEVICE="no-such-device-anywhere")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    first = runtime.all_devices()[0][3].name.strip()
    assert "CLOPS_DEVICE" in res.stderr and first in res.stderr


def _refused(main, argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_unknown_family_is_refused(capsys):
    err = _refused(cli.main, ["check", "--family", "nope"], capsys)
    assert "nope" in err and all(f in err for f in check.FAMILIES)


def test_bench_only_matching_nothing_is_refused(capsys):
    err = _refused(bench.main, ["--only", "swiglu", "--only", "nothing"], capsys)
    assert "--only nothing" in err and "rms_norm_dw" in err


def test_bench_dtype_is_checked(capsys):
    assert "--step and --train run at float32 only" in _refused(bench.main, ["--step", "--dtype", "float16"], capsys)
    assert "invalid choice: 'float64'" in _refused(bench.main, ["--dtype", "float64"], capsys)


def test_tune_without_an_op_says_why(capsys):
    err = _refused(tune.main, [], capsys)
    assert "usage:" in err and "attention_fwd" in err


def test_tune_refuses_a_shape_class_key_the_op_never_reads(capsys):
    # its entries would be saved under a key the op never looks up, and each configuration timed would be the op's own
    assert tune.main(["attention_fwd", "--class", "st=bf16"]) == 2
    assert "--class st: attention_fwd's shape class has no 'st' (it has hd)" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["bench", "--help"], ["tune", "--help"]])
def test_help_cites_no_missing_file(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    out = capsys.readouterr().out
    assert info.value.code == 0 and "usage:" in out and "DESIGN" not in out


def test_tuning_dir_holds_the_files(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOPS_TUNING_DIR", str(tmp_path))
    dev = types.SimpleNamespace(name="Some GPU", platform=types.SimpleNamespace(name="P"), driver_version="1")
    assert tuning.save(dev, "elementwise", {}, {"wg": 64}) == tmp_path / "some-gpu.json"


_HEAD = {"op": "elementwise", "shape_class": {}, "device": {"name": "Some GPU"}, "params": ["wg", "vw"]}
_RESULTS = [{"params": {"wg": 64, "vw": 4}, "status": "ok", "ms": 2.0, "times_ms": [1.5, 2.0, 3.0], "err": 0.0,
             "GB/s": 1.0},
            {"params": {"wg": 128, "vw": 2}, "status": "ok", "ms": 1.0, "times_ms": [0.75, 1.0, 1.25], "err": 0.0,
             "GB/s": 2.0}]
_CURRENT = {"params": None, "status": "ok", "ms": 4.0, "times_ms": [4.0], "err": 0.0, "GB/s": 0.5,
            "used": {"swiglu_fwd": {"wg": 256, "vw": 4, "ept": 8, "idx": "uint"}}}


def test_tune_ends_comparing_the_best_with_the_current(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tune, "sweep", lambda *a, **kw: (_HEAD, _RESULTS, _CURRENT))
    fake = types.SimpleNamespace(device=types.SimpleNamespace(name="Some GPU"))
    assert tune.main(["elementwise", "--out", str(tmp_path / "s.json")], queue=fake) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "best swept wg=128 vw=2: 1.0000 ms" in last and "current configuration wg=256 vw=4: 4.0000 ms" in last
    assert "0.25×" in last


def test_plot_labels_parameters_current_and_spread(monkeypatch):
    fake = mock.MagicMock()
    fig, ax = mock.MagicMock(), mock.MagicMock()
    fake.pyplot.subplots.return_value = (fig, ax)
    monkeypatch.setitem(sys.modules, "matplotlib", fake)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", fake.pyplot)
    assert tune.plot(_HEAD, _RESULTS, "sweep.png", _CURRENT)[0]
    assert ax.set_xticklabels.call_args.args[0] == ["64,4", "128,2"]
    assert "wg,vw" in ax.set_xlabel.call_args.args[0]
    assert ax.axhline.call_args.args[0] == 4.0 and "wg=256 vw=4" in ax.axhline.call_args.kwargs["label"]
    assert ax.errorbar.call_args.kwargs["yerr"] == [[0.5, 0.25], [1.0, 0.25]]
    fig.savefig.assert_called_once()
