"""`python -m clops bench` (small shapes, JSON), its device limits, the tune CLI's listing and plot, and
tools/bench_ab.py."""
import json
import re
import shutil
import sys
import types
from pathlib import Path

import pyopencl as cl
import pytest

import clops
from clops import bench, tune

HELPERS = {"BuildError", "LimitError", "default_context", "default_queue", "profile", "rope_table", "memory_pool"}


def test_every_public_op_is_benched():
    names = {op for b in bench.benches(small=True) for op in b.name.split()[0].split("+")}
    ops = set(clops.__all__) - HELPERS
    assert ops <= names, f"ops without a bench: {sorted(ops - names)}"
    assert {"attention", "attention_bwd", "qk_norm_rope_bwd"} <= names  # also those not exported yet


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sliding_window", [None, 1, 3, 7, 40])
def test_attention_pairs_count_the_mask(causal, sliding_window):
    from clops import reference as ref

    lengths = [1, 7, 20]
    want = sum(int(ref.attention_mask(t, causal=causal, sliding_window=sliding_window).sum()) for t in lengths)
    assert bench.attention_pairs(lengths, causal, sliding_window) == want


def test_varlen_lengths():
    lengths = bench.varlen_lengths(1000, 64)
    assert sum(lengths) == 1000 and min(lengths) >= 1 and max(lengths) <= 128 and len(set(lengths)) > 3


def test_bench_small_json(queue, tmp_path):
    path = tmp_path / "bench.json"
    lines = []
    only = ["swiglu_bwd", "rms_norm_dw", "qk_norm_rope small", "attention small-hd64", "dS-recomputed small-hd64"]
    rc = bench.main(["--small", "--json", str(path), "--peers"] + sum((["--only", o] for o in only), []),
                    queue=queue, out=lines.append)
    data = json.loads(path.read_text())
    assert data["limits"]["copy_GBps"] > 0 and data["small"] is True
    assert data["clops"] == bench.source_identity() and data["clops"]["version"] == clops.__version__
    assert f"tree {data['clops']['tree']}" in lines[1]  # the header names the code that ran
    names = {n for n in data["ops"] if any(o in n for o in only)}
    assert names == set(data["ops"]) and "swiglu_bwd" in names and "attention small-hd64" in names
    for name, rec in data["ops"].items():
        assert rec["status"] == "ok" and rec["ms"] > 0 and rec["figure"] > 0 and len(rec["times_ms"]) >= 7, rec
        # the memory-bound rows beside a copy of their own bytes; attention's have no copy to compare with
        assert ("copy_same_size_GBps" in rec) == (rec["unit"] == "GB/s"), name
        if rec["unit"] == "GB/s":
            assert rec["same_size_fraction"] == pytest.approx(rec["figure"] / rec["copy_same_size_GBps"])
    assert data["ops"]["swiglu_bwd"]["work"] == 5 * 4 * 256 * 3 * 512  # a, b, dc read; da, db written
    # each op's kernels, the device time of one call: the gain gradient's two stages apart
    assert set(data["ops"]["rms_norm_dw"]["kernels_ms"]) == {"rms_norm_dw_partial", "column_sum"}
    assert all(t > 0 for rec in data["ops"].values() for t in rec["kernels_ms"].values())
    text = "\n".join(lines)
    assert "copy bandwidth" in text and "swiglu_bwd" in text and "GB/s" in text and "TFLOP/s" in text
    assert "peers:" in text  # PyTorch's state is said, whether or not it is there
    assert rc == (0 if all(r["status"] == "ok" for r in data["ops"].values()) else 1)


def test_a_failed_same_size_copy_leaves_the_op_standing(queue, monkeypatch):
    """The copy of an op's own bytes failing (out of memory, say) is said in its row; the op's figures stand."""
    real = bench.copy_bandwidth

    def copy_bandwidth(queue, nbytes):
        if nbytes < 16 * 2**20:  # the run's own copy (16 MiB at --small) succeeds, the rows' smaller ones fail
            raise cl.MemoryError("clEnqueueCopyBuffer failed: MEM_OBJECT_ALLOCATION_FAILURE")
        return real(queue, nbytes)

    monkeypatch.setattr(bench, "copy_bandwidth", copy_bandwidth)
    lines = []
    assert bench.main(["--small", "--only", "swiglu_bwd"], queue=queue, out=lines.append) == 0
    row = next(line for line in lines if line.startswith("swiglu_bwd"))
    assert "GB/s" in row and "copy failed: MemoryError: clEnqueueCopyBuffer failed" in row


def test_source_identity_changes_with_a_template(tmp_path, monkeypatch):
    """The tree hash covers the kernel templates: a copy hashes the same, one changed line does not."""
    from clops import program

    first = bench.source_identity()
    copy = tmp_path / "cl_kernels"
    shutil.copytree(program.KERNEL_DIR, copy)
    monkeypatch.setattr(program, "KERNEL_DIR", copy)
    assert bench.source_identity() == first
    common = copy / "common.cl.mako"
    common.write_text(common.read_text() + "\n")
    assert bench.source_identity()["tree"] != first["tree"]


def test_bench_at_bfloat16_counts_the_bytes_moved_and_skips_float32_ops(queue, tmp_path):
    path, lines = tmp_path / "bench.json", []
    assert bench.NARROW_OPS <= set(clops.__all__)
    attn = ["attention small-hd64", "attention+attention_bwd small-hd64"]
    rc = bench.main(["--small", "--dtype", "bfloat16", "--json", str(path), "--only", "embedding", "--only", "adamw",
                     "--only", "gemm", "--only", attn[0], "--only", attn[1]], queue=queue, out=lines.append)
    data = json.loads(path.read_text())
    ops, n = data["ops"], bench.TOKENS_SMALL * bench.D_SMALL
    assert rc == 0 and data["dtype"] == "bfloat16" and set(ops) == {"embedding", "embedding_bwd", "adamw", "gemm", *attn}
    windows, window, nh, _, hd = bench.ATTENTION_SMALL["small-hd64"]
    assert all(ops[a]["status"] == "ok" for a in attn)
    assert ops[attn[0]]["work"] == tune.attention_flops(windows, window, nh, hd)  # FLOPs, whatever the dtype
    assert ops["embedding"]["work"] == 4 * bench.TOKENS_SMALL + 2 * 2 * n  # ids; bf16 rows read and written
    assert ops["adamw"]["work"] == (6 * 4 + 2 + 2) * n  # float32 p, m, v read and written; bf16 g read, p_half written
    assert ops["gemm"]["status"] == "skipped" and ops["adamw"]["status"] == "ok"
    assert "gemm takes float32 only, not bfloat16" in "\n".join(lines)


def _dev(**kw):
    base = dict(type=cl.device_type.GPU, vendor="NVIDIA Corporation", max_compute_units=132,
                max_clock_frequency=1980, compute_capability_major_nv=9, compute_capability_minor_nv=0)
    return types.SimpleNamespace(**dict(base, **kw))


def test_fp32_peak_table():
    peak, basis = bench.fp32_peak_tflops(_dev())
    assert abs(peak - 132 * 128 * 2 * 1.98e9 / 1e12) < 1e-9 and "128 lanes" in basis
    assert bench.fp32_lanes(_dev(compute_capability_major_nv=8, compute_capability_minor_nv=0))[0] == 64
    assert bench.fp32_lanes(_dev(vendor="Advanced Micro Devices, Inc."))[0] == 64
    for dev in (_dev(type=cl.device_type.CPU), _dev(vendor="Some Vendor")):
        peak, basis = bench.fp32_peak_tflops(dev)
        assert peak is None and "unknown" in basis


def test_tune_list(capsys):
    assert tune.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in tune.FAMILIES:
        assert name in out


def test_plot_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    head = {"op": "elementwise", "shape_class": {}, "device": {"name": "x"}, "params": ["wg"]}
    ok, message = tune.plot(head, [{"params": {"wg": 1}, "status": "ok", "ms": 1.0}], "never.png")
    assert not ok and "matplotlib is not installed" in message


def test_unknown_op_and_parameter(queue, capsys):
    assert tune.main(["nonsense"], queue=queue) == 2
    assert "unknown op" in capsys.readouterr().err
    assert tune.main(["elementwise", "--param", "tile=4"], queue=queue) == 2
    assert "has no parameter 'tile'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--class", "hd"], ["--size", "rows"]])
def test_bad_pairs(argv):
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        tune.main(["elementwise"] + argv)


def test_step_and_train_benches_run(queue, tmp_path):
    """bench --step (the block step and the per-call table) and bench --train (the demo's model) at
    their small sizes: every figure is there and positive."""
    lines = []
    assert bench.main(["--step", "--small", "--json", str(tmp_path / "s.json")], queue=queue, out=lines.append) == 0
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["steps"]["small"]["device_ms"] > 0 and data["steps"]["small"]["kernels"] == 23
    assert set(data["per_call"]) >= {"add", "rms_norm_dw", "attention_bwd"}
    assert all(r["us"] > 0 for r in data["per_call"].values())
    if blas_available():
        assert bench.main(["--train", "--small", "--json", str(tmp_path / "t.json")], queue=queue,
                          out=lines.append) == 0
        rec = json.loads((tmp_path / "t.json").read_text())
        assert rec["tokens_per_s"] > 0 and rec["clops_ms"] > 0 and rec["clblast_ms"] > 0
        assert rec["kernels"] > 0 and rec["clblast_calls"] > 0 and rec["enqueue_ms"] > 0


def blas_available():
    import ctypes.util
    import os

    return bool(os.environ.get("CLOPS_CLBLAST") or ctypes.util.find_library("clblast"))


def test_bench_ab_runs_each_tree_and_refuses_the_same_code_twice(tmp_path, capsys):
    """tools/bench_ab.py: each run imports its own tree's clops (checked by the tool from the run's JSON);
    two trees of one code, or a directory without clops, stop it with an error."""
    import importlib.util

    from clops import program

    spec = importlib.util.spec_from_file_location("bench_ab", Path(__file__).resolve().parents[1] / "tools" / "bench_ab.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    trees = {}
    for name in ("base", "changed", "copy"):
        trees[name] = tmp_path / name
        shutil.copytree(Path(clops.__file__).parent, trees[name] / "clops", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(program.KERNEL_DIR, trees[name] / "cl_kernels")
    common = trees["changed"] / "cl_kernels" / "common.cl.mako"
    common.write_text(common.read_text() + "\n")
    out = tmp_path / "runs"
    bench_args = ["--", "--small", "--only", "swiglu_bwd"]
    assert tool.main([str(trees["base"]), str(trees["changed"]), "--rounds", "1", "--out", str(out)] + bench_args) == 0
    printed = capsys.readouterr().out
    for name in ("base", "changed"):
        ran = json.loads((out / f"{name}_1.json").read_text())["clops"]
        assert Path(ran["path"]) == trees[name].resolve() / "clops" and f"{name} round 1: tree {ran['tree']}" in printed
    assert re.search(r"swiglu_bwd GB/s +[0-9.]+ +[0-9.]+$", printed, re.M), printed
    with pytest.raises(SystemExit, match="copy and base are the same code"):
        tool.main([str(trees["base"]), str(trees["copy"]), "--rounds", "1", "--out", str(out)] + bench_args)
    with pytest.raises(SystemExit):
        tool.main([str(tmp_path), "--out", str(out)] + bench_args)
    assert "holds no clops/ package" in capsys.readouterr().err
