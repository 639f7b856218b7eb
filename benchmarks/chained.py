"""Chained dispatch (the Pathways paper's -C): one ``@zp.program`` of 128 chained
nodes vs. JAX multi-controller calling the same computation 128 times
(Barham et al., 2022, section 5.1), on a 2-host island of this machine.

Workload: a scalar all-reduce followed by a scalar add, ``psum(x) + 1.`` on a
float64 scalar per device, over 2 processes x 1 device each (as in
benchmarks/island_dispatch.py).

* zpath -C: ``zp.init(islands=1, hosts_per_island=2, devices_per_host=1)``,
  ``f = zp.pmap(lambda x: psum(x, 'i') + 1., axis_name='i', devices=<one device
  per host>)`` and

      @zp.program(dispatch="parallel")
      def chain(x):
          for _ in range(128):
              x = f(x)
          return x

  called ``--programs`` times back to back (each program reads the previous
  one's output), then the final value is fetched (inside the timing) and
  checked. One message per program. The program moves no data between hosts,
  so after its first run (in the warm-up) it runs fused: the controller sends
  each host one ``RunFused`` per program and gets one ``ExecDone`` back, and the
  workers run its 128 computations from the plan they keep (docs/protocol.md,
  "Program templates and fused runs").
  For reference the table also shows the same programs with
  ``dispatch="sequential"`` (chained the same way: a node goes out once the
  node it reads has finished) and zpath -O (128 * programs plain calls
  ``x = f(x)``, one message each).
* JAX multi-controller (MC): two processes joined by jax.distributed (gloo),
  each calling its jitted SPMD computation 128 * programs times in its own
  Python loop -- the -O variant of benchmarks/island_dispatch.py, whose process
  code this script reuses. The time of a run is the slower process's.

Each is warmed up (two runs), then timed ``--repeats`` times, zpath and MC runs
alternating (which goes first alternates too; the idle side uses no CPU to
speak of); the table shows the median computations per second and the ratio
zpath / MC. It also prints where the time goes: CPU time per computation of
every process, and the zpath workers' execution times. This is a benchmark
that prints figures, not a test. ``--mc-load`` adds runs of zpath -C, MC,
and MC beside a load as busy as zpath's control plane in -C, in bursts of one
node's worth of its CPU (see benchmarks/island_dispatch.py).

    python benchmarks/chained.py [--programs 4] [--repeats 5] [--mc-load] [--json out.json] [--png out.png]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ab  # noqa: E402  (benchmarks/ab.py: the machine)
import plots  # noqa: E402  (benchmarks/plots.py)
from island_dispatch import (LOAD_HEAD, LOAD_TITLE, LOOP, McBench, _check, _cpu,  # noqa: E402
                             _summary, _timeline_stats, control_cpu, cpu_line, expected,
                             load_line, mc_with_load, on_sigterm, ratio_ci, timeline_line)

NODES = LOOP         # chained nodes per program (128, as in the paper)
X0 = 0.0             # x_k = 2^k - 1: exact and finite for k < 1024 computations per run
VARIANTS = ("C", "C-seq", "O")


class ZpathChained:
    """A local zpath cluster (1 island x 2 hosts x 1 device), the all-reduce + add
    placed on its 2 devices, and the 128-node programs built from it."""

    def __init__(self, programs: int, warm: int) -> None:
        import jax
        import psutil

        import zpath as zp

        jax.config.update("jax_enable_x64", True)     # float64 values, as described (zpath traces with the caller's setting)
        self.zp = zp
        self.programs = programs
        self.cluster = zp.init(islands=1, hosts_per_island=2, devices_per_host=1)
        try:
            devs = zp.make_virtual_device_set().add_slice(devices=2).devices
            if len(devs) != 2 or {d.host for d in devs} != {0, 1}:
                raise AssertionError(f"expected one device on each of 2 hosts, got {devs}")

            def allreduce_add(x):
                return jax.lax.psum(x, "i") + 1.

            f = self.f = zp.pmap(allreduce_add, axis_name="i", devices=devs)

            def chain(x):
                for _ in range(NODES):
                    x = f(x)
                return x

            self.progs = {"C": zp.program(chain, dispatch="parallel"),
                          "C-seq": zp.program(chain, dispatch="sequential")}
            self.procs = {"client": psutil.Process()}
            for name, p in self.cluster.local.procs:
                self.procs[name] = psutil.Process(p.pid)
            self.cpu = {v: dict.fromkeys(self.procs, 0.0) for v in VARIANTS}
            # controller + workers' I/O threads: (CPU seconds, wall seconds) per variant
            self.control = {v: [0.0, 0.0] for v in VARIANTS}
            for v in VARIANTS:      # twice: a program's fused runs start at its second run
                for _ in range(2):
                    self.run(v, warm, timed=False)
        except BaseException:
            zp.shutdown()
            raise

    def _chain(self, v: str, n: int) -> Any:
        """``n`` programs (or ``n * 128`` plain calls for -O), chained; the final value."""
        x = np.full(2, X0)
        if v == "O":
            for _ in range(n * NODES):
                x = self.f(x)
        else:
            prog = self.progs[v]
            for _ in range(n):
                x = prog(x)
        return x.result(timeout=600)

    def run(self, v: str, n: int | None = None, timed: bool = True) -> float:
        import time

        n = self.programs if n is None else n
        c0, k0 = _cpu(self.procs), control_cpu(self.procs)
        t0 = time.perf_counter()
        got = self._chain(v, n)
        t = time.perf_counter() - t0
        c1, k1 = _cpu(self.procs), control_cpu(self.procs)
        _check(f"zpath -{v} ({n} x {NODES} computations)", got, expected(X0, NODES * n))
        if timed:
            for k in c0:
                self.cpu[v][k] += c1[k] - c0[k]
            self.control[v][0] += k1 - k0
            self.control[v][1] += t
        return t

    def timeline(self) -> dict[str, Any]:
        # a fused run is one record per host: execution of its 128 computations
        return _timeline_stats(self.cluster, f"chain ({NODES} nodes, fused)", self.programs)

    def close(self) -> None:
        self.zp.shutdown()


def measure(z: ZpathChained, mc: McBench, programs: int, repeats: int) -> tuple[dict, dict]:
    comps = programs * NODES
    zres: dict[str, Any] = {}
    zt: dict[str, list[float]] = {v: [] for v in VARIANTS}
    mt: list[float] = []
    for r in range(repeats):
        if r % 2 == 0:
            for v in VARIANTS:
                zt[v].append(z.run(v))
            mt.append(mc.run("O"))
        else:
            mt.append(mc.run("O"))
            for v in VARIANTS[::-1]:
                zt[v].append(z.run(v))
    for v in VARIANTS:
        zres[v] = _summary(zt[v], comps)
        zres[v]["cpu_us_per_comp"] = {k: t / (comps * repeats) * 1e6 for k, t in z.cpu[v].items()}
        zres[v]["ratio_ci"] = ratio_ci(zt[v], mt)
    z.run("C", timed=False)          # one more -C run (untimed), so the timeline shows -C
    zres["C"]["timeline"] = z.timeline()
    zres["timeline_note"] = "worker timeline: one extra untimed -C run after the timed runs"
    mres = _summary(mt, comps)
    mres["sync"] = mc.sync
    mres["cpu_us_per_comp"] = {f"process{i}": t / (comps * repeats) * 1e6 for i, t in enumerate(mc.cpu["O"])}
    return zres, mres


# ---- report -------------------------------------------------------------------
LABELS = {"C": "zpath -C (program, parallel)", "C-seq": "zpath -C (program, sequential)",
          "O": "zpath -O (plain calls, reference)"}


def _table(z: dict[str, Any], mc: dict[str, Any]) -> str:
    head = f"{'variant':<34} {'comp/s':>9} {'us/comp':>9} {'vs MC':>7} {'95% interval':>13}"
    lines = [head, "-" * len(head)]
    for v in VARIANTS:
        a = z[v]
        lo, hi = a["ratio_ci"]
        lines.append(f"{LABELS[v]:<34} {a['comps_per_s']:>9,.0f} {a['us_per_comp']:>9,.1f} "
                     f"{a['comps_per_s'] / mc['comps_per_s']:>7.3f} {lo:>6.3f}-{hi:.3f}")
    lines.append(f"{'JAX multi-controller (MC)':<34} {mc['comps_per_s']:>9,.0f} {mc['us_per_comp']:>9,.1f} "
                 f"{1.0:>7.3f}")
    return "\n".join(lines)


def _breakdown(z: dict[str, Any], mc: dict[str, Any]) -> str:
    out = [cpu_line(f"zpath -{v:<5}", z[v]) for v in VARIANTS]
    out.append(cpu_line("MC          ", mc))
    for host, t in z["C"].get("timeline", {}).items():
        out.append(timeline_line("zpath -C", host, t, "program", f" of {NODES} computations"))
    return "\n".join(out)


def _spread(z: dict[str, Any], mc: dict[str, Any]) -> str:
    out = [f"  zpath -{v:<5} runs (s): " + " ".join(f"{t:.4f}" for t in z[v]["times_s"]) for v in VARIANTS]
    out.append("  MC           runs (s): " + " ".join(f"{t:.4f}" for t in mc["times_s"]))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Chained dispatch (-C): a 128-node @zp.program vs. JAX "
                                            "multi-controller calling the computation 128 times.")
    p.add_argument("--programs", type=int, default=4,
                   help=f"programs of {NODES} chained computations per timed run (default 4; at most 7, "
                        f"so the checked value 2^n - 1 stays finite)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per variant (default 5)")
    p.add_argument("--mc-sync", choices=("end", "each", "auto"), default="auto",
                   help="multi-controller: block only at the end of a run ('end'), after every "
                        "call ('each'), or 'end' and fall back to 'each' on a hang (default auto)")
    p.add_argument("--mc-timeout", type=float, default=120.0,
                   help="seconds the multi-controller processes may take to start or for one run "
                        "(default 120); then they are stopped")
    p.add_argument("--mc-load", action="store_true",
                   help="then run MC again with and without a load process that uses as much CPU "
                        "as zpath's controller and workers' I/O threads did in -C (see "
                        "island_dispatch.py --mc-load)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--png", metavar="PATH", help="also draw the figures here (matplotlib)")
    args = p.parse_args(argv)
    if args.programs < 1 or args.repeats < 1:
        p.error("--programs and --repeats must be at least 1")
    if args.programs * NODES >= 1024:
        p.error(f"--programs must be below {1024 // NODES} (the check value 2^n - 1 overflows float64)")
    comps = args.programs * NODES
    warm = args.programs

    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"chained dispatch (-C) of `psum(x) + 1.` (float64 scalar per device), 1 island x 2 hosts x "
          f"1 device: {args.programs} programs x {NODES} chained nodes = {comps} computations per run, "
          f"median of {args.repeats} runs after a warm-up", flush=True)

    import zpath as zp

    notes: list[str] = []
    zb = ZpathChained(args.programs, warm)   # zpath first: its launcher starts processes before JAX threads
    try:
        syncs = ["end", "each"] if args.mc_sync == "auto" else [args.mc_sync]
        for sync in syncs:
            # the MC processes run -O with `comps` calls per timed run; their -F
            # part (island_dispatch's) is only warmed up, with one call
            mb = McBench(comps, 1, min(comps, 200), 1, sync, args.mc_timeout)
            try:
                z, mc = measure(zb, mb, args.programs, args.repeats)
                load = None
                if args.mc_load:
                    load = mc_with_load(mb, "O", tuple(zb.control["C"]), args.repeats * comps,
                                        args.repeats, comps, lambda: zb.run("C", timed=False))
                break
            except TimeoutError as e:
                if isinstance(e, zp.ZpathError):     # a zpath deadline, not the MC processes
                    raise
                notes.append(str(e))
                print(f"note: {e}; stopped them", flush=True)
                if sync == syncs[-1]:
                    raise
                print("note: retrying with a block after every multi-controller call", flush=True)
                zb.cpu = {v: dict.fromkeys(zb.procs, 0.0) for v in VARIANTS}
                zb.control = {v: [0.0, 0.0] for v in VARIANTS}
            finally:
                mb.close()
    finally:
        zb.close()

    import jax

    machine = ab.machine()
    config = {"programs": args.programs, "nodes": NODES, "computations_per_run": comps,
              "repeats": args.repeats, "mc_sync": mc["sync"], "notes": notes,
              "python": platform.python_version(), "jax": jax.__version__, "cpus": os.cpu_count(),
              "machine": machine}
    print(f"python {platform.python_version()}, jax {jax.__version__}, {machine}; "
          f"zpath: client + controller + 2 workers; multi-controller (MC): 2 processes, "
          f"blocking {'after every call' if mc['sync'] == 'each' else 'at the end of a run'}")
    print()
    print(_table(z, mc))
    print("(comp/s: computations per second, median run; MC time = slower of the 2 processes; "
          "vs MC: throughput ratio zpath / MC,\n with a 95% bootstrap interval over the side-by-side "
          "pairs of runs: how far the ratio moves with the machine's noise)")
    print()
    print("where the time goes (CPU time per computation over all timed runs):")
    print(_breakdown(z, mc))
    print(f"  ({z['timeline_note']})")
    print()
    print(_spread(z, mc))
    if load is not None:
        print()
        print(LOAD_TITLE)
        print(LOAD_HEAD)
        print("-" * len(LOAD_HEAD))
        print(load_line("-C", load))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"zpath": z, "multi_controller": mc, "mc_load": load, "config": config}, f, indent=2)
        print(f"\nwrote {args.json}")
    if args.png:
        plots.dispatch(args.png, ["-" + v for v in VARIANTS], [z[v]["comps_per_s"] for v in VARIANTS],
                       [mc["comps_per_s"]] * len(VARIANTS), [z[v]["ratio_ci"] for v in VARIANTS],
                       title=f"{NODES} chained nodes per program, against JAX multi-controller")
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
