"""A/B of source trees: `python -m clops bench` once per tree per round, the trees in turn, then each
op's figures side by side (the range over the rounds).

    python tools/bench_ab.py [--rounds N] [--out DIR] TREE [TREE ...] -- BENCH_ARGS

A TREE is a directory holding ``clops/`` and ``cl_kernels/``, e.g. a commit's snapshot
(``git archive REV clops cl_kernels | tar -x -C DIR``) or a checkout. Each run starts in its tree,
whose ``clops`` then comes first on ``sys.path`` (``python -m`` puts the working directory there,
ahead of ``PYTHONPATH``: a run started elsewhere imports whatever ``clops`` that directory holds).
The tool checks each run's JSON (``clops.path`` and ``tree``, see ``clops.bench.source_identity``):
a run of any other ``clops`` than its tree's, or two trees of the same code, stop it with an error.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def run_bench(tree, bench_args, json_path, timeout):
    """Runs the bench in `tree`; its output goes beside the JSON. Returns the JSON, or None if it failed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "clops", "bench", *bench_args, "--json", str(json_path)]
    with open(json_path.with_suffix(".txt"), "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        print(f"{json_path.stem}: bench failed ({rc}); its output: {json_path.with_suffix('.txt')}", flush=True)
        return None
    data = json.loads(json_path.read_text())
    ran = Path(data["clops"]["path"]).resolve()
    if not ran.is_relative_to(tree):
        raise SystemExit(f"{json_path.stem}: the bench ran the clops in {ran}, not {tree}'s")
    return data


def table(names, results):
    """Lines: each op's figure per tree, lo-hi over the rounds ('-' where it has none)."""
    ops = list(dict.fromkeys(op for runs in results.values() for d in runs for op in d["ops"]))
    lines = ["%-56s %s" % ("op", " ".join("%22s" % n[-22:] for n in names))]
    for op in ops:
        cells, unit = [], ""
        for n in names:
            recs = [d["ops"].get(op, {}) for d in results[n]]
            figs = sorted(r["figure"] for r in recs if r.get("status") == "ok")
            unit = unit or next((r["unit"] for r in recs if r.get("status") == "ok"), "")
            bad = {r.get("status", "absent") for r in recs} - {"ok"}
            cell = ("%.4g-%.4g" % (figs[0], figs[-1]) if len(figs) > 1 else "%.4g" % figs[0]) if figs else "-"
            cells.append("%22s" % (cell + (" (%s)" % ",".join(sorted(bad))[:8] if bad else "")))
        lines.append("%-56s %s" % ((op + " " + unit)[-56:], " ".join(cells)))
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="tools/bench_ab.py", description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="+", type=Path, help="directories holding clops/ and cl_kernels/")
    p.add_argument("--rounds", type=int, default=2, help="runs of each tree, in turn (default 2)")
    p.add_argument("--out", type=Path, default=Path("bench_ab"), help="the runs' JSON and output (default ./bench_ab)")
    p.add_argument("--timeout", type=float, default=600, help="seconds a run may take (default 600)")
    args = p.parse_args(argv[:cut])
    bench_args = argv[cut + 1:]
    trees = [t.resolve() for t in args.trees]
    for t in trees:
        if not (t / "clops" / "__init__.py").is_file():
            p.error(f"{t} holds no clops/ package")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    names = [t.name if [u.name for u in trees].count(t.name) == 1 else f"{t.name}{i}" for i, t in enumerate(trees)]
    args.out.mkdir(parents=True, exist_ok=True)
    results = {n: [] for n in names}
    hashes = {}
    for r in range(1, args.rounds + 1):
        for n, t in zip(names, trees):
            data = run_bench(t, bench_args, args.out / f"{n}_{r}.json", args.timeout)
            if data is None:
                continue
            results[n].append(data)
            tree_hash = data["clops"]["tree"]
            same = [m for m, h in hashes.items() if h == tree_hash and m != n]
            if same:
                raise SystemExit(f"{n} and {same[0]} are the same code (tree {tree_hash}): nothing to compare")
            hashes[n] = tree_hash
            print(f"{n} round {r}: tree {tree_hash}, copy {data['limits']['copy_GBps']:.0f} GB/s", flush=True)
    print("\n".join(table(names, results)))
    return 0 if all(len(v) == args.rounds for v in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
