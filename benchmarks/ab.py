"""Alternating A/B runs of one benchmark script in several checkouts.

Each round runs the script once in every tree (a fresh process each, with the
working directory and ``PYTHONPATH`` set to the tree, so ``import zpath`` finds
that tree's code), in an order that rotates from round to round; the machine's
load (``/proc/loadavg``) is recorded before and after each invocation, and the
CPU time the hypervisor took from this machine's CPUs meanwhile (steal, from
``/proc/stat``; ``steal_s``, None where the system does not count it). Every
invocation writes its results with ``--json``; the figures named by ``--metric``
are taken from it. The first tree is the base: for every other tree and metric
it prints the ratio other / base per round, their median and a 95% bootstrap
interval of that median over the rounds, and whether the interval excludes 1::

    python benchmarks/ab.py --tree main=/work/main --tree no-hold=/tmp/no-hold \\
        --rounds 8 --metric F=zpath.F.comps_per_s --out ab.jsonl \\
        -- benchmarks/island_dispatch.py --repeats 5

``--metric NAME=PATH`` reads a dotted path in the JSON (a number indexes a list); a final ``+`` sums a
dict's values (``zpath.O.cpu_us_per_comp+``), ``/`` divides two paths
(``zpath.F.comps_per_s/multi_controller.F.comps_per_s``). ``--summarize FILE``
prints the summary of a JSONL file written by ``--out`` without running anything.

A script that prints figures, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

BOOTSTRAP = 10_000


def _path(data: Any, path: str) -> float:
    if "/" in path:
        num, den = path.split("/", 1)
        return _path(data, num) / _path(data, den)
    total = path.endswith("+")
    for key in path.rstrip("+").split("."):
        data = data[int(key)] if isinstance(data, list) else data[key]
    return float(sum(data.values())) if total else float(data)


def machine() -> str:
    """The CPU's model (Linux's /proc/cpuinfo, else what ``platform`` says) and
    count: figures from two machines of one size may differ by their CPUs."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{model or platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def steal_s() -> float | None:
    """CPU seconds the hypervisor has taken from this machine's CPUs since boot,
    all CPUs together (the steal column of /proc/stat's ``cpu`` line), or None
    where there is no such count. On a shared virtual machine it grows while
    other guests run; a run during which it grew ran on less CPU than it saw."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if fields[0] == "cpu" and len(fields) > 8 else None
    except (OSError, ValueError):
        return None


def _grew(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else round(after - before, 2)


def run_one(tree: str, script: str, args: list[str], metrics: dict[str, str],
            timeout: float) -> dict[str, Any]:
    """One invocation of ``script`` (relative to the tree) in ``tree``."""
    env = dict(os.environ, PYTHONPATH=tree)
    check = subprocess.run([sys.executable, "-c", "import zpath; print(zpath.__file__)"],
                           cwd=tree, env=env, check=True, capture_output=True, text=True)
    where = os.path.realpath(os.path.dirname(os.path.dirname(check.stdout.strip())))
    if where != os.path.realpath(tree):
        raise SystemExit(f"{tree}: imports zpath from {where}")
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        before, stolen, t0 = _load(), steal_s(), time.monotonic()
        res = subprocess.run([sys.executable, os.path.join(tree, script), *args, "--json", out],
                             cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        wall, after, stolen = time.monotonic() - t0, _load(), _grew(stolen, steal_s())
        if res.returncode != 0:
            raise SystemExit(f"{tree}: exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        with open(out) as f:
            data = json.load(f)
    finally:
        os.unlink(out)
    return {"tree": tree, "machine": machine(), "load_before": before, "load_after": after,
            "steal_s": stolen, "wall_s": round(wall, 1),
            "metrics": {name: _path(data, p) for name, p in metrics.items()}}


def _ci(ratios: list[float], rng: random.Random) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``ratios``."""
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(BOOTSTRAP))
    return meds[int(0.025 * BOOTSTRAP)], meds[int(0.975 * BOOTSTRAP) - 1]


def summarize(records: list[dict[str, Any]]) -> str:
    """Per tree other than the base, per metric: ratios, median, interval."""
    names = {r["name"]: r["tree"] for r in records}
    base = records[0]["base"]
    rounds = sorted({r["round"] for r in records})
    by = {(r["round"], r["name"]): r for r in records}
    rng = random.Random(0)
    lines = []
    for name in names:
        if name == base:
            continue
        lines.append(f"\n{name} / {base}")
        for metric in records[0]["metrics"]:
            pairs = [(by[(k, base)]["metrics"][metric], by[(k, name)]["metrics"][metric])
                     for k in rounds if (k, base) in by and (k, name) in by]
            ratios = [b / a for a, b in pairs]
            lo, hi = _ci(ratios, rng)
            med = statistics.median(ratios)
            verdict = "excludes 1" if lo > 1 or hi < 1 else "includes 1"
            lines.append(f"  {metric}: ratios " + ", ".join(f"{x:.3f}" for x in ratios))
            lines.append(f"    {len(ratios)} pairs, median {med:.3f}, 95% interval {lo:.3f}-{hi:.3f} "
                         f"({verdict}); above 1 in {sum(x > 1 for x in ratios)}; medians "
                         f"{base} {statistics.median(a for a, _ in pairs):.4g}, "
                         f"{name} {statistics.median(b for _, b in pairs):.4g}")
    if any(r.get("steal_s") is not None for r in records):
        # (a round where it grew ran on less CPU than it saw: read its ratios with that)
        lines.append("\nCPU seconds the hypervisor took during each invocation (steal), by round:")
        for name in names:
            stolen = [by[(k, name)].get("steal_s") for k in rounds if (k, name) in by]
            lines.append(f"  {name}: " + ", ".join("-" if v is None else f"{v:.2f}" for v in stolen))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                   help="a checkout to run (the first is the base)")
    p.add_argument("--rounds", type=int, default=8, help="rounds (each runs every tree once)")
    p.add_argument("--metric", action="append", default=[], metavar="NAME=PATH",
                   help="a figure to compare (see the module docstring)")
    p.add_argument("--first-round", type=int, default=0,
                   help="number of the first round (to add rounds to an --out file)")
    p.add_argument("--out", help="append every invocation's figures here (JSON lines)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one invocation may take")
    p.add_argument("--summarize", metavar="FILE", help="only summarize this --out file")
    p.add_argument("command", nargs="*", help="the script (relative to each tree) and its arguments")
    args = p.parse_args(argv)
    if args.summarize:
        print(summarize(read_records(args.summarize)))
        return 0
    if len(args.tree) < 2 or not args.metric or not args.command:
        p.error("needs two --tree, a --metric and a command")
    trees = [t.split("=", 1) for t in args.tree]
    metrics = dict(m.split("=", 1) for m in args.metric)
    records = alternate(trees, range(args.first_round, args.first_round + args.rounds), args.out,
                        lambda tree: run_one(tree, args.command[0], args.command[1:], metrics, args.timeout))
    print(summarize(records))
    return 0


def read_records(path: str) -> list[dict[str, Any]]:
    """The records of an ``--out`` file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def alternate(trees: list[list[str]], rounds: range, out: str | None,
              run: Callable[[str], dict[str, Any]]) -> list[dict[str, Any]]:
    """Each round, ``run`` in every tree (``[name, dir]``, the first the base),
    in an order that rotates from round to round; each record printed as a JSON
    line and appended to ``out`` as it comes."""
    records = []
    for k in rounds:
        for name, tree in trees[k % len(trees):] + trees[:k % len(trees)]:
            rec = run(os.path.abspath(tree))
            rec.update(round=k, name=name, base=trees[0][0])
            records.append(rec)
            print(json.dumps(rec), flush=True)
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
    return records


if __name__ == "__main__":
    sys.exit(main())
