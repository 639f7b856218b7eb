"""The worker hot path's targets, checked the way they are stated: each in every
one of several invocations.

One invocation runs, in a fresh process each, ``island_dispatch.py --repeats 31``,
``chained.py --programs 4 --repeats 15``, ``transfer.py --only ici --sizes
1K,64M`` and ``mc_noise.py --invocations 1 --repeats 15`` (``ab.run_one``: the
working directory and ``PYTHONPATH`` set to the tree), and reads from their
``--json`` output:

===========  ==============================================================  ========
figure       what                                                            target
===========  ==============================================================  ========
workers_F    the workers' CPU per -F computation / a multi-controller        <= 1.05
             process's, the larger of the two hosts
F            -F throughput, zpath / multi-controller                         >= 0.95
C            -C throughput (a 128-node program), zpath / multi-controller    >= 0.95
ici_1K_us    a 1 KiB ICI piece's channel time, µs                            <= 150
ici_64M      a 64 MiB ICI piece's throughput / a warm memcpy's               >= 0.80
O            -O throughput, zpath / multi-controller                         >= 0.40
ctl_O_us     the controller's CPU per -O computation, µs                     <= 150
===========  ==============================================================  ========

and, as a reference beside -C rather than a target, ``MC_AA``: one
multi-controller pair's throughput against another's, timed as ``chained.py``
times -C against multi-controller (``mc_noise.py``). It is the ratio a runtime
exactly as fast as multi-controller would score in that invocation, so the
count of invocations in which it reached 0.95 says how often this machine lets
a ratio at parity meet -C's target.

It prints each figure per invocation, and in how many it met its target. With
several ``--tree``, every invocation runs each tree in turn (the order rotating,
as ``ab.py`` does) and the ratios to the first tree follow::

    python benchmarks/targets.py                        # this checkout, 3 invocations
    python benchmarks/targets.py --tree base=/path/to/before --tree new=. --invocations 3
    python benchmarks/targets.py --summarize targets.jsonl     # a --out file again

The workers' figure pairs host k with multi-controller process k: each holds
device k of the same two-device collective. ``--quick`` shortens
``island_dispatch.py``, ``chained.py`` and ``mc_noise.py`` (to try the script,
not to quote). A benchmark that fails or lacks a figure loses only its figures,
shown as ``-``; a checkout from before ``mc_noise.py`` existed runs without the
reference. With several trees the ratios to the first leave the reference out: it
measures no tree.
Records are numbered by invocation (``round``, as ``ab.py``'s); ``--first-round``
continues an ``--out`` file. A script that prints figures, not a test.
"""
from __future__ import annotations

import argparse
import operator
import os
import subprocess
import sys
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ab  # noqa: E402  (benchmarks/ab.py)

F_CPU = "zpath.F.cpu_us_per_comp.worker-i0-h{0}/multi_controller.F.cpu_us_per_comp.process{0}"
# (name, what, the comparison, the target, how its figures print)
TARGETS: list[tuple[str, str, Callable[[float, float], bool], float, str]] = [
    ("workers_F", "workers' CPU per -F computation / MC's (larger host)", operator.le, 1.05, ".3f"),
    ("F", "-F zpath / MC", operator.ge, 0.95, ".3f"),
    ("C", "-C zpath / MC", operator.ge, 0.95, ".3f"),
    ("ici_1K_us", "1 KiB ICI piece, channel time (µs)", operator.le, 150.0, ".0f"),
    ("ici_64M", "64 MiB ICI piece / warm memcpy", operator.ge, 0.80, ".3f"),
    ("O", "-O zpath / MC", operator.ge, 0.40, ".3f"),
    ("ctl_O_us", "controller CPU per -O computation (µs)", operator.le, 150.0, ".0f"),
]
# (name, what, the comparison, the level counted, how its figures print): not targets
REFERENCES: list[tuple[str, str, Callable[[float, float], bool], float, str]] = [
    ("MC_AA", "reference for -C, not a target: MC / MC (mc_noise.py)", operator.ge, 0.95, ".3f"),
]
REFERENCE_KEYS = frozenset(ref[0] for ref in REFERENCES)
# per benchmark: its arguments (full, --quick) and the figures read from its JSON
BENCHMARKS: list[tuple[str, list[str], list[str], dict[str, str]]] = [
    ("benchmarks/island_dispatch.py", ["--repeats", "31"],
     ["--repeats", "1", "--calls-o", "200", "--calls-f", "1"],
     {"workers_F_h0": F_CPU.format(0), "workers_F_h1": F_CPU.format(1),
      "F": "zpath.F.comps_per_s/multi_controller.F.comps_per_s",
      "O": "zpath.O.comps_per_s/multi_controller.O.comps_per_s",
      "ctl_O_us": "zpath.O.cpu_us_per_comp.controller"}),
    ("benchmarks/chained.py", ["--programs", "4", "--repeats", "15"], ["--programs", "1", "--repeats", "1"],
     {"C": "zpath.C.comps_per_s/multi_controller.comps_per_s"}),
    ("benchmarks/transfer.py", ["--only", "ici", "--sizes", "1K,64M"], ["--only", "ici", "--sizes", "1K,64M"],
     {"ici_1K_us": "ici.1024.shm_us", "ici_64M": "ici.67108864.shm_GBps/ici.67108864.memcpy_GBps"}),
    ("benchmarks/mc_noise.py", ["--invocations", "1", "--repeats", "15"],
     ["--invocations", "1", "--repeats", "1", "--calls", "128"], {"MC_AA": "invocations.0.ratio"}),
]


def figures(metrics: dict[str, float]) -> dict[str, float]:
    """The targets' figures from one invocation's metrics (the workers' figure:
    the larger host's)."""
    out = {k: v for k, v in metrics.items() if not k.startswith("workers_F_h")}
    hosts = [v for k, v in metrics.items() if k.startswith("workers_F_h")]
    if hosts:
        out["workers_F"] = max(hosts)
    return out


def table(records: list[dict[str, Any]]) -> str:
    """Per tree: each target's figure per invocation, and in how many it was met."""
    lines = []
    for name in dict.fromkeys(r["name"] for r in records):
        mine = sorted((r for r in records if r["name"] == name), key=lambda r: r["round"])
        lines.append(f"\n{name} ({mine[0]['tree']}), {len(mine)} invocation(s)")
        head = f"  {'figure':<54}{'target':>9}  " + " ".join(f"{'#' + str(r['round']):>8}" for r in mine)
        lines += [head + "  met in", "  " + "-" * (len(head) + 6)]
        for key, what, ok, target, fmt in TARGETS + REFERENCES:
            values = [r["figures"].get(key) for r in mine]
            met = sum(v is not None and ok(v, target) for v in values)
            shown = " ".join(f"{'-':>8}" if v is None else f"{v:>8{fmt}}" for v in values)
            sign = "<=" if ok is operator.le else ">="
            measured = sum(v is not None for v in values)
            verdict = f"{met} of {measured}" + (" (each)" if measured and met == measured else "")
            lines.append(f"  {what:<54}{sign:>3} {target:<5g}  {shown}  {verdict}")
        loads = ", ".join(r["load_before"] for r in mine)
        lines.append(f"  (load average before each invocation: {loads})")
        # (records written before steal was recorded, or where it is not counted, have none)
        steals = ", ".join("-" if r.get("steal_s") is None else f"{r['steal_s']:.2f}" for r in mine)
        lines.append(f"  (CPU seconds the hypervisor took during each invocation: {steals})")
        # (records written before the machine was recorded have none)
        machines = ", ".join(dict.fromkeys(r.get("machine", "not recorded") for r in mine))
        lines.append(f"  (machine: {machines})")
    return "\n".join(lines)


def summarize(records: list[dict[str, Any]]) -> str:
    """The table, and with several trees the ratios to the first (ab.py's summary)."""
    text = table(records)
    if len({r["name"] for r in records}) > 1:
        # (the figures every invocation gave: ab.py pairs each of them)
        # (not the reference: it measures the machine, not a tree)
        common = [k for k in records[0]["figures"]
                  if k not in REFERENCE_KEYS and all(k in r["figures"] for r in records)]
        # (the table shows each invocation's steal already)
        text += "\n" + ab.summarize([dict(r, metrics={k: r["figures"][k] for k in common}, steal_s=None)
                                     for r in records])
    return text


def invoke(tree: str, quick: bool, timeout: float) -> dict[str, Any]:
    """One invocation of the four benchmarks in ``tree``: their figures, and per
    benchmark the load before and after, the steal during it and the seconds it
    took (or why it gave no figures: the others still run); the invocation's
    steal is the sum of its benchmarks'."""
    metrics: dict[str, float] = {}
    runs = []
    for script, full, short, paths in BENCHMARKS:
        if set(paths) <= REFERENCE_KEYS and not os.path.exists(os.path.join(tree, script)):
            runs.append({"script": script, "skipped": "not in this checkout"})
            continue
        try:
            rec = ab.run_one(tree, script, short if quick else full, paths, timeout)
        except (SystemExit, KeyError, subprocess.TimeoutExpired) as e:
            # (a failed run, or JSON without a figure: ab.run_one says which)
            why = f"{type(e).__name__}: {e}"
            print(f"{script} in {tree}: no figures ({why[-2000:]})", file=sys.stderr, flush=True)
            runs.append({"script": script, "failed": why[-2000:]})
            continue
        metrics.update(rec["metrics"])
        runs.append({"script": script, "load_before": rec["load_before"], "load_after": rec["load_after"],
                     "steal_s": rec.get("steal_s"), "wall_s": rec["wall_s"]})
    load = next((r["load_before"] for r in runs if "load_before" in r), "-")
    steals = [r["steal_s"] for r in runs if r.get("steal_s") is not None]
    return {"tree": tree, "machine": ab.machine(), "load_before": load,
            "steal_s": round(sum(steals), 2) if steals else None, "runs": runs, "figures": figures(metrics)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                   help="a checkout to run (the first is the base; default: this one)")
    p.add_argument("--invocations", type=int, default=3, help="invocations of each tree (default 3)")
    p.add_argument("--quick", action="store_true", help="short benchmarks: to try the script, not to quote")
    p.add_argument("--out", help="append every invocation's figures here (JSON lines)")
    p.add_argument("--first-round", type=int, default=0,
                   help="number of the first invocation (to add invocations to an --out file)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds one benchmark's invocation may take")
    p.add_argument("--summarize", metavar="FILE", help="only summarize this --out file")
    args = p.parse_args(argv)
    if args.summarize:
        print(summarize(ab.read_records(args.summarize)))
        return 0
    if args.invocations < 1:
        p.error("--invocations must be at least 1")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [t.split("=", 1) for t in args.tree] or [["this", here]]
    if any(len(t) != 2 or not os.path.isdir(t[1]) for t in trees):
        p.error("--tree takes NAME=DIR, DIR a checkout")
    records = ab.alternate(trees, range(args.first_round, args.first_round + args.invocations), args.out,
                           lambda tree: invoke(tree, args.quick, args.timeout))
    print(summarize(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
