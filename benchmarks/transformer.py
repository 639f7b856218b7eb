"""The paper's model experiments on this machine: the transformer language model
of ``examples/transformer/`` trained in each layout, tokens per second side by
side, and the paper's ratios (Barham et al., 2022, section 5.3 and Table 2):

* pipeline / SPMD on the same devices, for S = 2 and 4 stages;
* two islands / one island with the same total devices, at a DCN of 10 and 1 Gbit/s.

Five local clusters, one after the other, each using 4 devices; the layouts that
share a cluster are alternated on it (which goes first alternates too):

    ici2   1 island x 2 hosts x 2 devices   spmd (2x2 mesh over both hosts), pipeline_s2 (a stage
                                            per host), one_island (data parallel over the 4 devices)
    ici4   1 island x 4 hosts x 1 device    spmd_4hosts (2x2 mesh), pipeline_s4 (a stage per host)
    dcn10  2 islands x 1 host x 2 devices   two_islands (data parallel; gradients over a 10 Gbit/s DCN)
    dcn1   the same, DCN 1 Gbit/s           two_islands_1gbps
    host1  1 island x 1 host x 4 devices    spmd_1host, one_island_1host: the same computations with
                                            no collective between processes

On XLA:CPU the collectives of an island of several hosts (processes) go through
gloo over loopback TCP, which costs far more CPU than collectives within one
process; host1 shows the layouts without that cost.

Each layout trains from the same initial parameters on the same batches: warm-up
steps (tracing, compiling), then ``--repeats`` timed runs of ``--steps`` steps
(each run from its first submission to its last loss fetched); tokens/s is from the
median run. Every step's loss is compared with plain JAX training the same model
in this process (``max_abs_loss_diff``). CPU seconds per step of every process of
the cluster and this client are measured over the timed runs (``/proc`` schedstat),
with the share of the machine's cores they fill: near the number of cores, the layouts compete for
CPU, not for devices or links. ``cpu_bound_ratios`` gives each ratio as the inverse
ratio of CPU seconds per step: what it is when the cores are the limit, which is
steadier than tokens/s on a machine shared with other work.

    .venv/bin/python benchmarks/transformer.py [--quick] [--json] [--steps 10] [--repeats 3]
                                               [--dcn-latency-ms 0.1] [--plot docs/transformer.png]

``--json`` prints one JSON object (``layouts``: name -> ``tokens_per_s``,
``max_abs_loss_diff``, ...; ``ratios``) on stdout and the table on stderr. The plot
needs matplotlib (the ``bench`` extra); without it the plot is skipped, saying so.
This is a benchmark that prints figures, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import zpath as zp   # noqa: E402
from transformer import layouts as L   # noqa: E402  (examples/ is not a package)
from transformer import model as M   # noqa: E402
from pipeline import cpu_seconds   # noqa: E402  (benchmarks/pipeline.py: schedstat run times)

try:           # optional: the bench extra (pip install -e '.[bench]')
    import matplotlib
    import matplotlib.patches
    import matplotlib.pyplot as plt
    matplotlib.use("Agg")
except ImportError:
    plt = None

Builder = Callable[[M.Config, list[list[Any]], int], L.Layout]

# cluster name -> (LocalCluster shape, {layout name: builder(cfg, devices of each host, microbatches)})
CLUSTERS: dict[str, tuple[dict[str, Any], dict[str, Builder]]] = {
    "ici2": (dict(islands=1, hosts_per_island=2, devices_per_host=2), {
        "spmd": lambda cfg, h, mb: L.Spmd(cfg, h[0] + h[1], (2, 2)),
        "pipeline_s2": lambda cfg, h, mb: L.Pipeline(cfg, h[:2], microbatches=mb),
        "one_island": lambda cfg, h, mb: L.Spmd(cfg, h[0] + h[1], (4, 1)),
    }),
    "ici4": (dict(islands=1, hosts_per_island=4, devices_per_host=1), {
        "spmd_4hosts": lambda cfg, h, mb: L.Spmd(cfg, sum(h, []), (2, 2)),
        "pipeline_s4": lambda cfg, h, mb: L.Pipeline(cfg, h, microbatches=mb),
    }),
    "dcn10": (dict(islands=2, hosts_per_island=1, devices_per_host=2, dcn_gbps=10.0), {
        "two_islands": lambda cfg, h, mb: L.TwoIslands(cfg, h),
    }),
    "dcn1": (dict(islands=2, hosts_per_island=1, devices_per_host=2, dcn_gbps=1.0), {
        "two_islands_1gbps": lambda cfg, h, mb: L.TwoIslands(cfg, h),
    }),
    "host1": (dict(islands=1, hosts_per_island=1, devices_per_host=4), {
        "spmd_1host": lambda cfg, h, mb: L.Spmd(cfg, h[0], (2, 2)),
        "one_island_1host": lambda cfg, h, mb: L.Spmd(cfg, h[0], (4, 1)),
    }),
}
CLUSTER_LABELS = {"ici2": "1 island x 2 hosts x 2", "ici4": "1 island x 4 hosts x 1",
                  "dcn10": "2 islands x 1 host x 2, DCN 10 Gbit/s", "dcn1": "the same, DCN 1 Gbit/s",
                  "host1": "1 island x 1 host x 4", "": "plain JAX, this process"}
RATIOS = {"pipeline_s2_over_spmd": ("pipeline_s2", "spmd"),
          "pipeline_s4_over_spmd": ("pipeline_s4", "spmd_4hosts"),
          "two_islands_over_one": ("two_islands", "one_island"),
          "two_islands_1gbps_over_one": ("two_islands_1gbps", "one_island"),
          "two_islands_over_one_host": ("two_islands", "one_island_1host")}

def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def run_cluster(name: str, cfg: M.Config, data: list[np.ndarray], reference: list[float],
                args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    shape, builders = CLUSTERS[name]
    kwargs = dict(shape)
    if "dcn_gbps" in kwargs:
        kwargs["dcn_latency_ms"] = args.dcn_latency_ms
    log(f"\n== cluster {name}: {shape}")
    cluster = zp.init(**kwargs)
    try:
        vds = zp.make_virtual_device_set()
        n_hosts = shape["islands"] * shape["hosts_per_island"]
        hosts = [vds.add_slice(devices=shape["devices_per_host"], host=h).devices for h in range(n_hosts)]
        hosts.sort(key=lambda d: (d[0].island, d[0].host))
        procs = {"client": psutil.Process()}
        for pname, p in cluster.local.procs:
            procs[pname] = psutil.Process(p.pid)
        layouts = {}
        losses: dict[str, list[float]] = {}
        for lname, build in builders.items():
            t0 = time.perf_counter()
            layouts[lname] = build(cfg, hosts, args.microbatches)
            losses[lname] = layouts[lname].train(data[:args.warmup])
            log(f"{lname}: built and warmed up ({args.warmup} steps) in {time.perf_counter() - t0:.1f} s")
        times: dict[str, list[float]] = {k: [] for k in layouts}
        cpu: dict[str, dict[str, float]] = {k: {} for k in layouts}
        order = list(layouts)
        for r in range(args.repeats):
            batch = data[args.warmup + r * args.steps: args.warmup + (r + 1) * args.steps]
            for lname in (order if r % 2 == 0 else order[::-1]):
                c0 = cpu_seconds(procs)
                t0 = time.perf_counter()
                losses[lname] += layouts[lname].train(batch)
                times[lname].append(time.perf_counter() - t0)
                c1 = cpu_seconds(procs)
                for k in c0:
                    cpu[lname][k] = cpu[lname].get(k, 0.0) + c1[k] - c0[k]
                log(f"  repeat {r}: {lname} {times[lname][-1]:.2f} s for {args.steps} steps")
        out = {}
        steps = args.repeats * args.steps
        for lname in layouts:
            med = statistics.median(times[lname])
            per_step = {k: v / steps for k, v in cpu[lname].items()}
            workers = sum(v for k, v in per_step.items() if k.startswith("worker"))
            total = sum(per_step.values())
            wall = sum(times[lname]) / steps
            diff = float(np.max(np.abs(np.array(losses[lname]) - np.array(reference[:len(losses[lname])]))))
            out[lname] = {
                "cluster": name, "tokens_per_s": args.steps * cfg.tokens_per_step / med,
                "ms_per_step": med / args.steps * 1e3, "runs_s": times[lname],
                "max_abs_loss_diff": diff, "final_loss": losses[lname][-1],
                "cpu_s_per_step": {"client": per_step.get("client", 0.0),
                                   "controller": per_step.get("controller", 0.0),
                                   "workers": workers, "total": total},
                "cores_busy": total / wall,
            }
        return out
    finally:
        zp.shutdown()


def plain_jax(cfg: M.Config, data: list[np.ndarray]) -> tuple[list[float], float]:
    """The reference losses (every step), and plain JAX's tokens/s in this
    process (its one CPU device; the median step after the first)."""
    times: list[float] = []
    losses = M.reference_losses(cfg, data, times=times)
    return losses, cfg.tokens_per_step / statistics.median(times[1:])


def plot(results: dict[str, Any], path: Path) -> None:
    """Tokens/s and CPU seconds per step of every layout, coloured by cluster."""
    if plt is None:
        log("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return
    lay = results["layouts"]
    names = list(lay)
    colors = {"ici2": "#4c72b0", "ici4": "#55a868", "dcn10": "#c44e52", "dcn1": "#8172b2",
              "host1": "#dd8452", "": "#999999"}
    bar_colors = [colors[lay[n].get("cluster", "")] for n in names]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    tps = [lay[n]["tokens_per_s"] for n in names]
    ax.bar(names, tps, color=bar_colors)
    for i, v in enumerate(tps):
        ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("tokens / s")
    cpu = [lay[n].get("cpu_s_per_step", {}).get("total", 0.0) for n in names]
    ax2.bar(names, cpu, color=bar_colors)
    for i, v in enumerate(cpu):
        ax2.text(i, v, f"{v:.2f}" if v else "", ha="center", va="bottom", fontsize=7)
    ax2.set_ylabel("CPU seconds per step (all processes)")
    shown = {lay[n].get("cluster", "") for n in names}
    ax2.legend(handles=[matplotlib.patches.Patch(color=colors[c], label=CLUSTER_LABELS[c])
                        for c in colors if c in shown], fontsize=7, loc="upper left",
               bbox_to_anchor=(1.0, 1.0))
    for a in (ax, ax2):
        a.tick_params(axis="x", labelsize=7, rotation=30)
    r, c = results["ratios"], results.get("cpu_bound_ratios", {})
    fig.suptitle(f"transformer ({results['config']['params']:,} params), {results['machine']['cores']} cores, "
                 f"{results['machine']['date']}. Ratios by tokens/s (by CPU s/step): pipeline/SPMD "
                 f"{r['pipeline_s2_over_spmd']:.2f} ({c.get('pipeline_s2_over_spmd', 0):.2f}) S=2, "
                 f"{r['pipeline_s4_over_spmd']:.2f} ({c.get('pipeline_s4_over_spmd', 0):.2f}) S=4; two/one island "
                 f"{r['two_islands_over_one']:.2f} ({c.get('two_islands_over_one', 0):.2f})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description="The transformer example's layouts side by side (tokens/s, ratios)")
    p.add_argument("--quick", action="store_true", help="fewer steps and one repeat (a few minutes)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (the table on stderr)")
    p.add_argument("--steps", type=int, default=10, help="steps per timed run (default 10; --quick: 4)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per layout (default 3; --quick: 1)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps (default 2)")
    p.add_argument("--microbatches", type=int, default=4, help="pipeline microbatches per step (default 4)")
    p.add_argument("--dcn-latency-ms", type=float, default=0.1, help="emulated DCN latency (default 0.1)")
    p.add_argument("--clusters", default=",".join(CLUSTERS), help=f"which to run (default {','.join(CLUSTERS)})")
    p.add_argument("--plot", type=Path, default=None,
                   help="where to draw the figure (default docs/transformer.png; none with --quick)")
    p.add_argument("--replot", type=Path, metavar="JSON",
                   help="only draw the plot (--plot) from the JSON object a run printed")
    args = p.parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.plot or ROOT / "docs" / "transformer.png")
        return
    if args.quick:
        args.steps, args.repeats = min(args.steps, 4), 1
    if args.plot is None and not args.quick:
        args.plot = ROOT / "docs" / "transformer.png"
    cfg = M.Config()
    data = M.batches(cfg, args.warmup + args.repeats * args.steps)
    log(f"model: {cfg}; {sum(x.size for x in jax.tree.leaves(M.init_params(cfg))):,} parameters")
    reference, jax_tps = plain_jax(cfg, data)
    results: dict[str, Any] = {"layouts": {}, "ratios": {}}
    for name in args.clusters.split(","):
        results["layouts"].update(run_cluster(name, cfg, data, reference, args))
    results["layouts"]["plain_jax_1device"] = {"cluster": "", "tokens_per_s": jax_tps, "max_abs_loss_diff": 0.0,
                                               "ms_per_step": cfg.tokens_per_step / jax_tps * 1e3}
    lay = results["layouts"]
    results["cpu_bound_ratios"] = {}
    for r, (a, b) in RATIOS.items():
        if a in lay and b in lay:
            results["ratios"][r] = lay[a]["tokens_per_s"] / lay[b]["tokens_per_s"]
            # what the ratio is when the machine's cores are the limit: CPU seconds per step, inverted
            results["cpu_bound_ratios"][r] = (lay[b]["cpu_s_per_step"]["total"]
                                              / lay[a]["cpu_s_per_step"]["total"])
    results["config"] = {**vars(cfg), "params": sum(x.size for x in jax.tree.leaves(M.init_params(cfg))),
                         "steps": args.steps, "repeats": args.repeats, "warmup": args.warmup,
                         "microbatches": args.microbatches, "dcn_latency_ms": args.dcn_latency_ms}
    results["machine"] = {"cores": os.cpu_count(), "platform": platform.platform(),
                          "load_avg_1m_at_end": os.getloadavg()[0],
                          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    log(f"\n{'layout':<20} {'cluster':<6} {'tokens/s':>9} {'ms/step':>8} {'cpu s/step':>10} "
        f"{'(workers)':>9} {'cores busy':>10} {'max |dloss|':>11}")
    for n, v in lay.items():
        c = v.get("cpu_s_per_step", {})
        log(f"{n:<20} {v['cluster']:<6} {v['tokens_per_s']:>9,.0f} {v.get('ms_per_step', 0):>8.1f} "
            f"{c.get('total', 0):>10.3f} {c.get('workers', 0):>9.3f} {v.get('cores_busy', 0):>10.2f} "
            f"{v['max_abs_loss_diff']:>11.2e}")
    for r, v in results["ratios"].items():
        log(f"{r}: {v:.3f}  (from CPU seconds per step: {results['cpu_bound_ratios'][r]:.3f})")
    if args.plot:
        plot(results, args.plot)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
