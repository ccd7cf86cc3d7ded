"""The tuning database's search order, parameters in the program cache key, and the sweep tool
(restrictions, wrong and rejected configurations, interruption and resume, refusals, --save)."""
import dataclasses
import json
import types

import pyopencl.array as cla
import pytest

import clops
from clops import mma, program, tune, tuning
from clops.reference import rel_err, rnd


@pytest.fixture
def tuning_dirs(tmp_path, monkeypatch):
    """A temporary user dir (CLOPS_TUNING_DIR) and shipped dir; no overrides before or after."""
    monkeypatch.setenv("CLOPS_TUNING_DIR", str(tmp_path / "user"))
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path / "shipped")
    (tmp_path / "shipped").mkdir()
    monkeypatch.setattr(tuning, "_overrides", {})
    tuning.reload()
    return tmp_path


def _write(path, entries):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"entries": entries}))
    tuning.reload()  # files are read once per process


def test_search_order(tuning_dirs):
    dev = types.SimpleNamespace(name="NVIDIA H200", vendor="NVIDIA Corporation")
    sc = {"hd": 64}
    heuristic = lambda: {"from": "heuristic"}  # noqa: E731
    assert tuning.choose(dev, "op", sc, heuristic) == {"from": "heuristic"}
    layers = [("default", tuning.SHIPPED_DIR / "default.json"), ("vendor", tuning.SHIPPED_DIR / "nvidia.json"),
              ("device", tuning.SHIPPED_DIR / "nvidia-h200.json"), ("user", tuning.user_dir() / "nvidia-h200.json")]
    for source, path in layers:  # each more specific layer shadows the ones written before it
        _write(path, {"op": {"hd=64": {"from": source}, "hd=128": {"from": source + "-128"}}})
        assert tuning.choose(dev, "op", sc, heuristic) == {"from": source}
        assert tuning.lookup(dev, "op", sc)[1].startswith(source)
    tuning.override("op", sc, {"from": "override"})
    assert tuning.lookup(dev, "op", sc) == ({"from": "override"}, "override")
    tuning.override("op", sc, {"from": "device override"}, device=dev)  # a device's own shadows the global one
    other = types.SimpleNamespace(name="NVIDIA A100", vendor="NVIDIA Corporation")
    assert tuning.choose(dev, "op", sc, heuristic) == {"from": "device override"}
    assert tuning.choose(other, "op", sc, heuristic) == {"from": "override"}
    tuning.override("op", sc, None, device=dev)
    assert tuning.choose(dev, "op", sc, heuristic) == {"from": "override"}
    assert tuning.choose(dev, "op", {"hd": 128}, heuristic) == {"from": "user-128"}  # other shape class untouched
    tuning.override("op", sc, None)
    for source, path in reversed(layers):  # removing a layer uncovers the next one down
        assert tuning.choose(dev, "op", sc, heuristic) == {"from": source}
        path.unlink()
        tuning.reload()
    assert tuning.choose(dev, "op", sc, heuristic) == {"from": "heuristic"}


def test_chosen_parameters_are_in_the_cache_key(queue, tuning_dirs):
    a = cla.to_device(queue, rnd(3000, 1))

    def used():
        with clops.profile(queue) as prof:
            clops.add(queue, a, a).get()
        (launch,) = prof.launches
        return launch.params, program.stats["builds"], launch

    tuning.override("elementwise", {}, {"wg": 32, "vw": 2, "ept": 3})
    p1, builds1, l1 = used()
    assert (p1["wg"], p1["vw"], p1["ept"]) == (32, 2, 3) and l1.local_size == (32,)
    tuning.override("elementwise", {}, {"wg": 16, "vw": 1, "ept": 5})
    p2, builds2, l2 = used()
    assert (p2["wg"], p2["vw"], p2["ept"]) == (16, 1, 5) and l2.local_size == (16,)
    assert builds2 == builds1 + 1  # new parameters, new program
    tuning.override("elementwise", {}, {"wg": 32, "vw": 2, "ept": 3})
    assert used()[1] == builds2  # the first parameters' program is found again, not rebuilt


def test_configurations_and_rules():
    dev = types.SimpleNamespace(max_work_group_size=256, local_mem_size=1 << 15)
    fam = tune.FAMILIES["attention_fwd"]
    space = {"bq": [16, 64], "rq": [3, 4], "tx": [8], "bk": [32], "vw": [4], "dc": [32], "kc": [16]}
    kept, left_out = tune.configurations(space, fam.reject, dev, {"hd": 64})
    assert [(p["bq"], p["rq"]) for p in kept] == [(16, 4), (64, 4)] and left_out == {"bq must be a multiple of rq": 2}
    kept, left_out = tune.configurations(dict(space, tx=[32], rq=[1]), fam.reject, dev, {"hd": 64})
    assert kept == [] and left_out == {"work-items per group ≤ CL_DEVICE_MAX_WORK_GROUP_SIZE": 2}
    small = types.SimpleNamespace(max_work_group_size=256, local_mem_size=1 << 12)
    kept, left_out = tune.configurations(dict(space, rq=[4]), fam.reject, small, {"hd": 64})
    assert kept == [] and left_out == {"local memory ≤ CL_DEVICE_LOCAL_MEM_SIZE": 2}


def test_column_pairs_take_at_most_30_warps():
    """sx 2's pairs each wait at a hardware barrier of their own on NVIDIA (ids 1 .. 15): 32 warps refused."""
    dev = types.SimpleNamespace(max_work_group_size=1024, local_mem_size=1 << 20)
    sc = {"hd": 64, "st": "bf16", "product": "bf16"}
    for name, space in (("attention_fwd_mma", {"nw": [30, 32], "bk": [16], "stages": [1], "af": [1], "sx": [2], "gp": [1]}),
                        ("attention_bwd_mma_dkv", {"nw": [30, 32], "bk": [16], "af": [1], "cs": [2], "sx": [2]})):
        kept, left_out = tune.configurations(space, tune.FAMILIES[name].reject, dev, sc)
        assert [p["nw"] for p in kept] == [30], name
        assert list(left_out.values()) == [1] and "at most 30" in next(iter(left_out)), name


def _on_device(queue, fam, sc):
    """Shape class ``sc`` for ``fam`` on ``queue``'s device: the matrix-unit driver's at bfloat16 with
    the device's products, or the portable ones."""
    if "product" not in fam.shape_class:
        return sc
    with mma.using("1"):
        return dict(sc, st="bf16", product=mma.forward_product(queue, "bf16")[0] or "fma")


@pytest.mark.parametrize("name", sorted(tune.FAMILIES))
def test_family_cases_match_the_reference(queue, name):
    """Each family's problem, run with the op's own parameters, agrees with its reference answer."""
    fam = tune.FAMILIES[name]
    sc = _on_device(queue, fam, dict(fam.shape_class, **({"hd": 32} if "hd" in fam.shape_class else {"d": 96}
                                                         if "d" in fam.shape_class else {})))
    problem = {k: min(v, 64) for k, v in fam.problem(sc, True).items()}
    case = fam.prepare(queue, sc, problem)
    outs = case.call()
    assert len(outs) == len(case.want) == len(case.tol) and case.work > 0 and case.unit in ("GB/s", "TFLOP/s")
    for got, want, tol in zip(outs, case.want, case.tol):
        assert rel_err(got.get(), want) <= tol


@pytest.mark.parametrize("st, size", [("float", 4), ("bf16", 2)])
def test_norm_cases_count_the_bytes_moved(queue, st, size):
    """The GB/s of the norm sweeps: rows of x, y (forward) and x, dy, dx (backward) of the storage type,
    float32 gain and inv each pass; rms_norm_dw x, dy, then inv and dw; the one-pass backward x, dy, dx
    (and ds), then w, inv and dw; qk_norm_rope its rows the same way, with dw too."""
    n, d = 8, 96
    rows = tune.FAMILIES["rms_norm"].prepare(queue, {"d": d, "st": st}, {"rows": n})
    rows_bwd = tune.FAMILIES["rms_norm_bwd"].prepare(queue, {"d": d, "st": st}, {"rows": n})
    dw = tune.FAMILIES["rms_norm_dw"].prepare(queue, {"d": d, "st": st}, {"rows": n})
    one_pass = tune.FAMILIES["rms_norm_bwd_dw"].prepare(queue, {"d": d, "st": st}, {"rows": n})
    add_bwd = tune.FAMILIES["add_rms_norm_bwd"].prepare(queue, {"d": d, "st": st}, {"rows": n})
    assert rows.work == 2 * n * d * size + 4 * (d + n)
    assert rows_bwd.work == 3 * n * d * size + 4 * (d + n)
    assert dw.work == 2 * n * d * size + 4 * (n + d)  # x, dy; inv, dw
    assert one_pass.work == 3 * n * d * size + 4 * (2 * d + n)
    assert add_bwd.work == 4 * n * d * size + 4 * (2 * d + n)  # ds read too
    heads, hd = 2, 48  # qk_norm_rope: x, y, then x, dy, dx of the storage type; w, inv, then w, inv, dw float32
    qk = tune.FAMILIES["qk_norm_rope"].prepare(queue, {"hd": hd, "st": st}, {"rows": n, "heads": heads, "window": n})
    assert qk.work == 5 * n * heads * hd * size + 4 * (3 * hd + 2 * n * heads)


ATTN = ["attention_fwd", "--class", "hd=32", "--small", "--size", "windows=1", "--size", "window=40",
        "--param", "bq=16,32", "--param", "rq=3,4", "--param", "tx=4,8", "--param", "bk=16,32",
        "--param", "vw=4", "--param", "dc=32", "--param", "kc=16", "--no-restrictions"]


def _planted_miscompile(monkeypatch):
    """attention_fwd whose output is wrong whenever bk = 32 and bq = 16, as a miscompiled kernel would be."""
    fam = tune.FAMILIES["attention_fwd"]

    def prepare(queue, sc, pb):
        case = fam.prepare(queue, sc, pb)

        def call():
            o, lse = case.call()
            p, _ = tuning.lookup(queue.device, "attention_fwd", sc)
            # doubled on the host: pyopencl.array's own kernel build logs a CompilerWarning on Intel's runtime
            return (cla.to_device(queue, 2 * o.get()) if p is not None and (p["bk"], p["bq"]) == (32, 16) else o), lse

        return dataclasses.replace(case, call=call)

    monkeypatch.setitem(tune.FAMILIES, "attention_fwd", dataclasses.replace(fam, prepare=prepare))


def _current_at(evaluate, ms):
    """``evaluate`` with the op's current configuration (params None) reported at ``ms``."""

    def planted(*a, **kw):
        r = evaluate(*a, **kw)
        return dict(r, ms=ms) if a[4] is None and r["status"] == "ok" else r

    return planted


def test_save_keeps_a_faster_current_configuration(queue, tuning_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tune, "evaluate", _current_at(tune.evaluate, 0.0))
    assert tune.main(ATTN + ["--param", "bq=16", "--param", "rq=2", "--param", "tx=4", "--param", "bk=16",
                             "--out", str(tmp_path / "s.json"), "--save"], queue=queue) == 0
    assert "nothing saved" in capsys.readouterr().out
    assert tuning.lookup(queue.device, "attention_fwd", {"hd": 32}) == (None, None)


def test_attention_sweep_interrupted_resumed_saved(queue, tuning_dirs, tmp_path, monkeypatch, capsys):
    _planted_miscompile(monkeypatch)
    path = tmp_path / "sweep.json"
    args = ATTN + ["--out", str(path)]
    real, calls = tune.evaluate, []

    def interrupted(*a, **kw):
        if a[4] is not None:  # None: the op's current configuration, timed before the sweep
            calls.append(a[4])
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(tune, "evaluate", interrupted)
    assert tune.main(args, queue=queue) == 130
    first = json.loads(path.read_text())
    assert len(first["results"]) == 5 and "resume" in capsys.readouterr().out
    assert first["header"]["params"] == ["bq", "rq", "tx", "bk", "vw", "dc", "kc"]
    assert first["header"]["problem"] == {"windows": 1, "window": 40, "nh": 4, "nkv": 2}

    calls.clear()
    monkeypatch.setattr(tune, "evaluate", _current_at(real, float("inf")))  # any swept configuration beats it
    assert tune.main(args + ["--save", "--plot", str(tmp_path / "sweep.png")], queue=queue) == 0
    out = capsys.readouterr().out
    results = json.loads(path.read_text())["results"]
    assert len(results) == 16 and results[:5] == first["results"]  # resumed, nothing done twice
    assert len({json.dumps(r["params"], sort_keys=True) for r in results}) == 16
    for r in results:
        p = r["params"]
        if p["rq"] == 3:
            assert r["status"] == "failed" and "rq" in r["reason"], r
        elif (p["bk"], p["bq"]) == (32, 16):
            assert r["status"] == "wrong" and "rel err" in r["reason"], r
        else:
            assert r["status"] == "ok" and r["err"] < 1e-5 and r["ms"] > 0 and len(r["times_ms"]) >= 7, r
    assert "8 failed" in out and "2 wrong" in out and "6 correct" in out
    assert "matplotlib" in out or (tmp_path / "sweep.png").stat().st_size > 0

    best = tune.best_result(results)
    assert tuning.lookup(queue.device, "attention_fwd", {"hd": 32}) == (best["params"], "user (" +
                                                                        tuning.user_file(queue.device).name + ")")
    q = cla.to_device(queue, rnd((40, 4, 32), 1))
    k = cla.to_device(queue, rnd((40, 2, 32), 2))
    with clops.profile(queue) as prof:
        clops.attention(queue, q, k, k, window=40)
    used = prof.launches[0].params
    assert {n: used[n] for n in best["params"]} == best["params"]  # the op now runs the saved configuration


def test_check_on_the_small_problem(queue, tuning_dirs, tmp_path, monkeypatch, capsys):
    _planted_miscompile(monkeypatch)
    path = tmp_path / "sweep.json"
    timed = ["--size", "windows=1", "--size", "window=40", "--size", "nh=4", "--size", "nkv=2"]
    assert tune.main([a for a in ATTN if a != "--small"] + timed + ["--check-small", "--out", str(path)],
                     queue=queue) == 0
    data = json.loads(path.read_text())
    assert data["header"]["problem"] == {"windows": 1, "window": 40, "nh": 4, "nkv": 2}
    assert data["header"]["check_problem"] == tune.FAMILIES["attention_fwd"].problem({"hd": 32}, True)
    for r in data["results"]:  # the planted wrong configurations are caught on the check problem
        p = r["params"]
        want = "failed" if p["rq"] == 3 else "wrong" if (p["bk"], p["bq"]) == (32, 16) else "ok"
        assert r["status"] == want, r


def test_resume_refused_on_other_device_or_template(queue, tmp_path, monkeypatch, capsys):
    path = tmp_path / "ew.json"
    args = ["elementwise", "--small", "--size", "rows=4", "--size", "width=100", "--param", "wg=16",
            "--param", "vw=1,2", "--param", "ept=1", "--out", str(path)]
    assert tune.main(args, queue=queue) == 0
    good = path.read_text()
    data = json.loads(good)
    data["header"]["device"]["driver"] = "another driver"
    path.write_text(json.dumps(data))
    assert tune.main(args, queue=queue) == 2
    assert "another driver" in capsys.readouterr().err
    path.write_text(good)
    monkeypatch.setattr(tune, "template_hash", lambda templates: "0" * 64)
    assert tune.main(args, queue=queue) == 2
    assert "template" in capsys.readouterr().err and json.loads(path.read_text()) == json.loads(good)
    assert tune.main(args + ["--fresh"], queue=queue) == 0


def test_template_hash_follows_includes(tmp_path, monkeypatch):
    (tmp_path / "a.cl.mako").write_text('<%namespace name="c" file="b.cl.mako"/>\nA')
    (tmp_path / "b.cl.mako").write_text("B")
    monkeypatch.setattr(tune, "KERNEL_DIR", tmp_path)
    before = tune.template_hash(["a.cl.mako"])
    (tmp_path / "b.cl.mako").write_text("B changed")
    assert tune.template_hash(["a.cl.mako"]) != before


def test_too_few_runs_refused(queue, tmp_path):
    with pytest.raises(ValueError, match="at least 7"):
        tune.sweep(queue, tune.FAMILIES["elementwise"], {}, {"rows": 1, "width": 8}, {"wg": [16]}, tmp_path / "x",
                   runs=3)


@pytest.mark.parametrize("name", sorted(tune.FAMILIES))
def test_every_family_sweeps_through_the_command_line(queue, tuning_dirs, tmp_path, name, capsys):
    """One configuration of each family, through ``clops tune`` as a user runs it (``tune qk_norm_rope``
    once crashed: the package's name for the module was the op)."""
    fam = tune.FAMILIES[name]
    sc = dict(fam.shape_class, **({"hd": 16} if "hd" in fam.shape_class else {"d": 64} if "d" in fam.shape_class
                                  else {}))
    sc = _on_device(queue, fam, dict(sc, st="bf16") if "st" in sc else sc)  # the case's 16-bit storage too
    argv = [name, "--small", "--out", str(tmp_path / "r.json"), "--runs", "7", "--warmup", "0"]
    argv += [f"--class={k}={v}" for k, v in sc.items()]
    current = fam.spec.resolve(queue.device, sc)[0]  # one configuration: the op's own
    if name == "attention_bwd_mma_dq":  # the dkv pass, launched after dq, takes nw, bk and af too: other ones
        dkv = tune.FAMILIES["attention_bwd_mma_dkv"].spec
        tuning.override(dkv.op, sc, dict(dkv.resolve(queue.device, sc)[0], bk=32 if current["bk"] != 32 else 16))
    argv += [f"--param={k}={current[k]}" for k in fam.space(sc)]
    if name.startswith("attention"):
        argv += ["--size", "windows=1", "--size", "window=16", "--size", "nh=2", "--size", "nkv=1"]
    assert tune.main(argv, queue=queue) == 0, capsys.readouterr().out[-2000:]
    out = capsys.readouterr().out
    assert "1 configurations: 1 correct" in out
    # the op's own configuration, not the last kernel's (rms_norm_bwd_dw's column sum has a wg and vw of its own)
    assert "current configuration " + tune._fmt({k: current[k] for k in fam.space(sc)}) in out
