"""The benchmarks' pictures, drawn with matplotlib (the optional ``bench`` extra:
``pip install -c constraints.txt -e '.[bench]'``; ``make install`` has it).

Each function draws one figure, writes it to ``path`` (the format follows the
suffix: .png, .svg, .pdf) and returns the matplotlib ``Figure`` so a caller (or
a test) can look at what was drawn. Figures are built with the object API
(``Figure``), never pyplot's global state, so nothing needs a display.

* ``timeline``: one lane per device, one bar per computation, coloured by client
  (multitenancy.py; zpath's own trace rendering in docs/ uses it too).
* ``shares``: each client's device-time share against its target, per policy
  (multitenancy.py).
* ``throughput``: transfer throughput against size, log-log, one line per path
  (transfer.py), and optionally the DCN rate achieved against its cap.
* ``dispatch``: computations per second of zpath and JAX multi-controller per
  variant, with zpath/MC and its interval (island_dispatch.py).
* ``scale``: dispatch throughput, the smallest busy computation and parallel
  against sequential dispatch, against hosts (scale.py).
* ``trace``: a Chrome Trace Event document (``zp.trace``) drawn as Perfetto lays it
  out, for docs/ (examples/trace_demo.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch

# matplotlib's default colour cycle ("tab10"), named so tests and callers agree
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]

Span = tuple[int, float, float, int]        # (lane, start s, end s, colour index)


def colour(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def timeline(path: str, lanes: Sequence[str], spans: Sequence[Span], legend: Sequence[str],
             title: str = "", t0: float | None = None, t1: float | None = None) -> Figure:
    """One horizontal lane per entry of ``lanes`` (top to bottom), one bar per
    span on its lane from start to end, coloured ``colour(index)``; the x axis is
    milliseconds from ``t0``. Spans are clipped to [t0, t1] (default: all of
    them); a span entirely outside is not drawn. ``legend[k]`` names colour k."""
    for lane, *_ in spans:
        if not 0 <= lane < len(lanes):
            raise ValueError(f"span on lane {lane}, but there are {len(lanes)} lanes")
    lo = min((s[1] for s in spans), default=0.0) if t0 is None else t0
    hi = max((s[2] for s in spans), default=lo) if t1 is None else t1
    hi = max(hi, lo + 1e-6)
    fig = Figure(figsize=(12, 1.2 + 0.45 * len(lanes) + 0.25 * len(legend)), layout="constrained")
    ax = fig.add_subplot()
    for lane, start, end, c in spans:
        a, b = max(start, lo), min(end, hi)
        if b < a or (b == a and not lo <= a <= hi):
            continue
        ax.barh(lane, (b - a) * 1e3, left=(a - lo) * 1e3, height=0.7, color=colour(c),
                edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(lanes)), labels=list(lanes))
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(0, (hi - lo) * 1e3)
    ax.set_xlabel("ms")
    if title:
        ax.set_title(title)
    handles = [Patch(color=colour(k), label=text) for k, text in enumerate(legend)]
    if handles:
        fig.legend(handles=handles, loc="outside lower center",
                   ncols=min(2, len(legend)), frameon=False)
    fig.savefig(path, dpi=100)
    return fig


def shares(path: str, policies: dict[str, Sequence[dict[str, Any]]], title: str = "") -> Figure:
    """One panel per policy: per client (rows with ``client``, ``weight``,
    ``share``, ``target``, fractions), its device-time share as a bar and its
    target as a black tick."""
    fig = Figure(figsize=(4.5 * max(1, len(policies)), 3.6), layout="constrained")
    axes = fig.subplots(1, max(1, len(policies)), squeeze=False, sharey=True)[0]
    for ax, (policy, rows) in zip(axes[:len(policies)], policies.items(), strict=True):
        x = range(len(rows))
        ax.bar(x, [100 * r["share"] for r in rows], color=[colour(k) for k in x], label="share")
        ax.scatter(x, [100 * r["target"] for r in rows], marker="_", s=600, color="black",
                   zorder=3, label="target")
        ax.set_xticks(list(x), labels=[f"client {r['client']}\nweight {r['weight']:g}" for r in rows])
        ax.set_title(policy)
        ax.set_ylabel("device-time share (%)")
        ax.legend(loc="upper left", frameon=False)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return fig


def throughput(path: str, sizes: Sequence[int], series: dict[str, Sequence[float]],
               dcn: Sequence[tuple[float, float]] = (), title: str = "") -> Figure:
    """When ``series`` has entries: GB/s against bytes (log-log), one line per
    entry (a value per size). When ``dcn`` has (cap Gbit/s, achieved Gbit/s)
    pairs: achieved against cap, with the cap line for reference, beside it."""
    panels = (1 if series else 0) + (1 if dcn else 0)
    if not panels:
        raise ValueError("nothing to draw: no series and no DCN rates")
    fig = Figure(figsize=(6 * panels, 4), layout="constrained")
    axes = list(fig.subplots(1, panels, squeeze=False)[0])
    if series:
        ax = axes.pop(0)
        for k, (name, values) in enumerate(series.items()):
            if len(values) != len(sizes):
                raise ValueError(f"{name}: {len(values)} values for {len(sizes)} sizes")
            ax.plot(sizes, values, marker="o", color=colour(k), label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per transfer")
        ax.set_ylabel("GB/s")
        ax.set_title("ICI: throughput against size")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(frameon=False)
    if dcn:
        ax = axes.pop(0)
        caps = [c for c, _ in dcn]
        ax.plot(caps, caps, linestyle="--", color="gray", label="cap")
        ax.plot(caps, [r for _, r in dcn], marker="o", color=colour(0), label="achieved")
        ax.set_xlabel("emulated cap (Gbit/s)")
        ax.set_ylabel("Gbit/s")
        ax.set_title("DCN: achieved rate against cap")
        ax.grid(True, alpha=0.3)
        ax.legend(frameon=False)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return fig


def dispatch(path: str, variants: Sequence[str], zpath: Sequence[float], mc: Sequence[float],
             intervals: Sequence[tuple[float, float]] = (), title: str = "") -> Figure:
    """Computations per second per variant, zpath beside multi-controller (log
    scale), each pair labelled with zpath/MC and its 95% interval when given."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    x = list(range(len(variants)))
    ax.bar([i - 0.2 for i in x], zpath, width=0.4, color=colour(0), label="zpath")
    ax.bar([i + 0.2 for i in x], mc, width=0.4, color=colour(1), label="JAX multi-controller")
    for i, (z, m) in enumerate(zip(zpath, mc, strict=True)):
        text = f"{z / m:.2f}x"
        if intervals:
            lo, hi = intervals[i]
            text += f"\n({lo:.2f}-{hi:.2f})"
        ax.annotate(text, (i, max(z, m)), textcoords="offset points", xytext=(0, 4), ha="center")
    ax.set_xticks(x, labels=list(variants))
    ax.set_yscale("log")
    ax.set_ylabel("computations / s")
    ax.margins(y=0.25)
    fig.legend(handles=ax.containers, labels=["zpath", "JAX multi-controller"], loc="outside lower center",
               ncols=2, frameon=False)
    if title:
        ax.set_title(title)
    fig.savefig(path, dpi=100)
    return fig


def scale(path: str, results: Sequence[dict[str, Any]], f_computations: int = 128,
          busy: float = 0.95) -> Figure:
    """The paper's Figures 5-7 shapes from benchmarks/scale.py's results (one
    per host count): computations per second against hosts for -O, -C and -F;
    the smallest computation that keeps the devices busy against hosts
    (measured, and the bound the controller alone sets, beside the paper's two
    points); pipeline stages per second against stages, parallel and
    sequential dispatch."""
    if not results:
        raise ValueError("nothing to draw: no results")
    hosts = [r["hosts"] for r in results]
    fig = Figure(figsize=(16, 4.2), layout="constrained")
    a, b, c = fig.subplots(1, 3)
    for k, (key, label) in enumerate((("spmd_nodes_per_s", "-O (op by op)"),
                                      ("traced_nodes_per_s", "-C (traced program)"),
                                      ("fused_computations_per_s", f"-F ({f_computations} per call)"))):
        a.plot(hosts, [r[key] for r in results], marker="o", color=colour(k), label=label)
    a.set(xscale="log", yscale="log", xlabel="simulated hosts", ylabel="computations / s",
          title="Dispatch throughput (cf. Fig. 5)")
    measured = [(r["hosts"], r["min_busy_computation_ms"]) for r in results if r.get("min_busy_computation_ms")]
    if measured:
        b.plot(*zip(*measured), marker="o", color=colour(0), label="measured (hosts share 2 cores)")
    b.plot(hosts, [r["ctl_bound_min_computation_ms"] for r in results], marker="s", color=colour(1),
           label="controller alone (CPU per node / 0.95)")
    b.plot([16, 512], [2.3, 35.0], "x--", color="black", label="Pathways paper (TPU)")
    b.set(xscale="log", yscale="log", xlabel="simulated hosts", ylabel="ms",
          title=f"Smallest computation keeping devices {busy:.0%} busy (cf. Fig. 6)")
    stages = [r["pipeline_stages"] for r in results]
    for k, mode in enumerate(("parallel", "sequential")):
        c.plot(stages, [r["pipeline_runs_per_s"][mode] * r["pipeline_stages"] for r in results],
               marker="o", color=colour(k), label=f"{mode} dispatch")
    c.plot(stages, [1000.0] * len(stages), ":", color="gray", label="ideal (1 ms stages)")
    c.set(xscale="log", xlabel="pipeline stages (one host each)", ylabel="stages / s",
          title="Parallel and sequential dispatch (cf. Fig. 7)")
    for ax in (a, b, c):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(frameon=False, fontsize=8)
    fig.savefig(path, dpi=100)
    return fig


def trace(path: str, doc: dict[str, Any], title: str = "") -> Figure:
    """A Chrome Trace Event document (``zp.trace``, ``zpath trace``) drawn as
    Perfetto lays it out: one lane per track (process name, then track name, in
    the document's sort order), one bar per complete ("X") event coloured by its
    name, and an arrow per flow (send -> receive)."""
    events = doc["traceEvents"]
    proc: dict[int, tuple[int, str]] = {}
    track: dict[tuple[int, int], tuple[int, str]] = {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e["name"] == "process_name":
            proc[e["pid"]] = (proc.get(e["pid"], (e["pid"], ""))[0], e["args"]["name"])
        elif e["name"] == "process_sort_index":
            proc[e["pid"]] = (e["args"]["sort_index"], proc.get(e["pid"], (0, str(e["pid"])))[1])
        elif e["name"] == "thread_name":
            key = (e["pid"], e["tid"])
            track[key] = (track.get(key, (e["tid"], ""))[0], e["args"]["name"])
        elif e["name"] == "thread_sort_index":
            key = (e["pid"], e["tid"])
            track[key] = (e["args"]["sort_index"], track.get(key, (0, str(e["tid"])))[1])
    used = {(e["pid"], e["tid"]) for e in events if e.get("ph") in ("X", "s", "f")}
    lanes = sorted(used, key=lambda k: (proc.get(k[0], (k[0], ""))[0], track.get(k, (k[1], ""))[0]))
    row = {k: i for i, k in enumerate(lanes)}
    labels = [f"{proc.get(p, (0, str(p)))[1]}: {track.get((p, t), (0, str(t)))[1]}" for p, t in lanes]
    names = sorted({e["name"] for e in events if e.get("ph") == "X"})
    fig = Figure(figsize=(13, 1.5 + 0.42 * len(lanes)), layout="constrained")
    ax = fig.add_subplot()
    for e in events:
        if e.get("ph") == "X":
            ax.barh(row[(e["pid"], e["tid"])], max(e["dur"], 1.0) / 1e3, left=e["ts"] / 1e3, height=0.7,
                    color=colour(names.index(e["name"])), edgecolor="black", linewidth=0.3)
    starts = {e["id"]: e for e in events if e.get("ph") == "s"}
    for f in (e for e in events if e.get("ph") == "f"):
        s = starts.get(f["id"])
        if s is not None:
            ax.annotate("", xy=(f["ts"] / 1e3, row[(f["pid"], f["tid"])]),
                        xytext=(s["ts"] / 1e3, row[(s["pid"], s["tid"])]),
                        arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.8})
    ax.set_yticks(range(len(lanes)), labels=labels)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlabel("ms from the start of the trace")
    ax.grid(True, axis="x", alpha=0.3)
    if title:
        ax.set_title(title)
    legend = [n for n in names if len(n) <= 40][:12]
    if legend:
        fig.legend(handles=[Patch(color=colour(names.index(n)), label=n) for n in legend],
                   loc="outside lower center", ncols=min(4, len(legend)), frameon=False)
    fig.savefig(path, dpi=100)
    return fig
