"""Pipeline dispatch: ``@zp.program`` with parallel vs. sequential dispatch, after
the Pathways paper's pipeline comparison (Barham et al., 2022, section 5).

A program is a chain of S stages, stage k placed on host k (one device each,
every host its own island and its own worker process), each stage a small
computation ``x * 1.0001 + 1.`` on a float64[1024] that reads the previous
stage's output (so every hop moves 8 KiB from host k-1 to host k):

    @zp.program(dispatch=...)
    def pipeline(x):
        for k in range(S):
            x = stage[k](x)
        return x

* parallel   -- the controller sends every node to its host at once; a worker
                waits for its input to arrive from the previous host;
* sequential -- the controller sends a node only after the nodes it reads have
                finished (one controller round trip per hop).

Measured, for each S (``--stages``, default 1,2,4,8) and both modes:

* throughput -- P programs (``--programs``, default 50) submitted back to back,
                then the last output fetched (inside the timing); programs/s.
                Inputs (``--inputs``): ``independent`` (default) -- every program
                reads the same device-resident future on host 0, so programs can
                overlap (stage k of program p+1 may run while stage k+1 of program
                p does); ``chained`` -- each program reads the previous program's
                output (host S-1 -> host 0), so nothing overlaps; ``both``.
* latency    -- one program submitted and its output fetched; median over
                ``--latency-calls`` such round trips.

The cluster is ``zp.init(islands=S_max, hosts_per_island=1, devices_per_host=1)``:
a controller and S_max worker processes, plus this client. Each measurement is
warmed up, then repeated ``--repeats`` times with parallel and sequential runs
alternating (which goes first alternates too), and the table shows medians and
the ratio parallel / sequential. It also prints CPU time per program of the
client, the controller and the workers (summed), measured with psutil over the
timed throughput runs, and the bound that puts on throughput with this
machine's cores. Every output is checked after its run. This is a benchmark
that prints figures, not a test.

    python benchmarks/pipeline.py [--stages 1,2,4,8] [--programs 50] [--repeats 5]
                                  [--inputs independent|chained|both] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from typing import Any

import numpy as np

N = 1024             # float64 elements per stage value
SCALE, SHIFT = 1.0001, 1.0
MODES = ("parallel", "sequential")


def expected(x0: np.ndarray, steps: int) -> np.ndarray:
    x = np.asarray(x0, dtype=np.float64)
    for _ in range(steps):
        x = x * SCALE + SHIFT
    return x


def _check(what: str, got: Any, want: np.ndarray) -> None:
    got = np.asarray(got)
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-12, atol=0):
        raise AssertionError(f"{what}: expected {want.ravel()[:3]}..., got {got.ravel()[:3]}... "
                             f"(shape {got.shape})")


def cpu_seconds(procs: dict[str, Any]) -> dict[str, float]:
    """CPU seconds used so far by each process: the sum of its threads'
    /proc/<pid>/task/*/schedstat run times (nanoseconds; a thread that exited is
    no longer counted), or psutil's user + system (10 ms ticks) where that is
    not readable. The runs here are short, so tick resolution would be coarse."""
    out = {}
    for name, p in procs.items():
        try:
            total = 0
            for tid in os.listdir(f"/proc/{p.pid}/task"):
                try:
                    with open(f"/proc/{p.pid}/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[0])
                except (OSError, ValueError, IndexError):
                    pass              # the thread exited meanwhile
            out[name] = total / 1e9
        except OSError:
            t = p.cpu_times()
            out[name] = t.user + t.system
    return out


def _summary(times: list[float], programs: int) -> dict[str, Any]:
    med = statistics.median(times)
    return {"times_s": times, "median_s": med, "min_s": min(times), "max_s": max(times),
            "programs_per_s": programs / med, "ms_per_program": med / programs * 1e3}


class PipelineBench:
    def __init__(self, max_stages: int) -> None:
        import jax
        import psutil

        import zpath as zp

        jax.config.update("jax_enable_x64", True)     # float64 values, as described (zpath traces with the caller's setting)
        self.zp = zp
        self.cluster = zp.init(islands=max_stages, hosts_per_island=1, devices_per_host=1)
        try:
            vds = zp.make_virtual_device_set()
            self.slices = [vds.add_slice(devices=1, host=k) for k in range(max_stages)]
            hosts = [s.devices[0].host for s in self.slices]
            if hosts != list(range(max_stages)):
                raise AssertionError(f"expected stage k on host k, got hosts {hosts}")

            def stage(x):
                return x * SCALE + SHIFT

            self.stages = [zp.pmap(stage, devices=s.devices) for s in self.slices]
            ident = zp.pmap(lambda x: x, devices=self.slices[0].devices)
            self.x0_host = np.linspace(0.0, 1.0, N).reshape(1, N)
            self.x0 = ident(self.x0_host)            # device-resident on host 0
            _check("input", self.x0, self.x0_host)
            self.programs: dict[tuple[int, str], Any] = {}
            self.procs = {"client": psutil.Process()}
            for name, p in self.cluster.local.procs:
                self.procs[name] = psutil.Process(p.pid)
        except BaseException:
            zp.shutdown()
            raise

    def program(self, stages: int, mode: str) -> Any:
        key = (stages, mode)
        if key not in self.programs:
            fns = self.stages[:stages]

            def pipeline(x):
                for f in fns:
                    x = f(x)
                return x

            pipeline.__name__ = f"pipeline{stages}_{mode}"
            self.programs[key] = self.zp.program(pipeline, dispatch=mode)
        return self.programs[key]

    def throughput_run(self, stages: int, mode: str, programs: int, inputs: str
                       ) -> tuple[float, dict[str, float]]:
        """Submit ``programs`` programs, fetch the last; the wall time and the CPU
        seconds each process used meanwhile. All outputs are checked afterwards
        (untimed, not counted)."""
        prog = self.program(stages, mode)
        outs = []
        c0 = cpu_seconds(self.procs)
        t0 = time.perf_counter()
        x = self.x0
        for _ in range(programs):
            y = prog(x)
            outs.append(y)
            if inputs == "chained":
                x = y
        outs[-1].result(timeout=600)
        t = time.perf_counter() - t0
        c1 = cpu_seconds(self.procs)
        for i, y in enumerate(outs):
            k = stages * (i + 1) if inputs == "chained" else stages
            _check(f"S={stages} {mode} {inputs} program {i}", y.result(timeout=600),
                   expected(self.x0_host, k))
        return t, {k: c1[k] - c0[k] for k in c0}

    def latency_runs(self, stages: int, mode: str, calls: int) -> tuple[list[float], list[list[Any]]]:
        """``calls`` round trips of one program each: their wall times, and for
        each program its stages' execution records (stage k = host k)."""
        prog = self.program(stages, mode)
        want = expected(self.x0_host, stages)
        out = []
        since = time.time()
        for _ in range(calls):
            t0 = time.perf_counter()
            got = prog(self.x0).result(timeout=600)
            out.append(time.perf_counter() - t0)
            _check(f"S={stages} {mode} latency", got, want)
        return out, self._records(since, calls, stages)

    def _records(self, since: float, calls: int, stages: int) -> list[list[Any]]:
        """The execution records of the ``calls`` programs run one at a time since
        ``since`` (wall clock of this machine, which the workers' records use),
        grouped per program. A worker reports a computation after the client may
        have fetched its output, so wait (up to 2 s) for the last reports."""
        from zpath.net import messages as m

        want = calls * stages
        deadline = time.monotonic() + 2.0
        while True:
            recs = [r for r in self.cluster.client.request(m.TimelineRequest(want + 50)).records
                    if r.name == "stage" and r.start >= since]
            if len(recs) >= want or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if len(recs) != want:
            return []
        recs.sort(key=lambda r: r.start)          # programs ran one after another
        return [sorted(recs[i:i + stages], key=lambda r: r.host) for i in range(0, want, stages)]

    def close(self) -> None:
        self.zp.shutdown()


def _hops(programs: list[list[Any]]) -> dict[str, Any]:
    """From the execution records of single programs: the median execution time
    of a stage on its worker (in parallel mode it includes waiting for the input
    to arrive), the median hop (end of stage k to end of stage k+1), and the
    median gap from the end of stage k to the start of stage k+1 (sequential:
    worker -> controller -> worker; parallel: negative when stage k+1 was already
    waiting for its input)."""
    if not programs:
        return {"records": 0}
    execs = [(r.end - r.start) * 1e3 for p in programs for r in p]
    hops = [(b.end - a.end) * 1e3 for p in programs for a, b in zip(p, p[1:])]
    gaps = [(b.start - a.end) * 1e3 for p in programs for a, b in zip(p, p[1:])]
    out = {"records": len(execs), "exec_ms_median": statistics.median(execs)}
    if hops:
        out["hop_ms_median"] = statistics.median(hops)
        out["gap_ms_median"] = statistics.median(gaps)
    return out


def measure(b: PipelineBench, stage_list: list[int], programs: int, repeats: int,
            input_modes: list[str], latency_calls: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for s in stage_list:
        rs: dict[str, Any] = {}
        for inputs in input_modes:
            times: dict[str, list[float]] = {m: [] for m in MODES}
            cpu: dict[str, dict[str, float]] = {m: dict.fromkeys(b.procs, 0.0) for m in MODES}
            for mode in MODES:                       # warm-up: trace, compile, first dispatch
                b.throughput_run(s, mode, min(programs, 10), inputs)
            for r in range(repeats):
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    t, used = b.throughput_run(s, mode, programs, inputs)
                    times[mode].append(t)
                    for k, v in used.items():
                        cpu[mode][k] += v
            entry = {}
            for mode in MODES:
                entry[mode] = _summary(times[mode], programs)
                n = programs * repeats
                per = {k: v / n * 1e3 for k, v in cpu[mode].items()}
                entry[mode]["cpu_ms_per_program"] = {
                    "client": per["client"], "controller": per["controller"],
                    "workers": sum(v for k, v in per.items() if k.startswith("worker")),
                    "per_worker": {k: v for k, v in per.items() if k.startswith("worker")}}
            entry["ratio"] = entry["parallel"]["programs_per_s"] / entry["sequential"]["programs_per_s"]
            rs[inputs] = entry
        lat: dict[str, list[float]] = {m: [] for m in MODES}
        recs: dict[str, list[list[Any]]] = {m: [] for m in MODES}
        for mode in MODES:
            b.latency_runs(s, mode, 3)               # warm-up
        for r in range(repeats):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                t, rec = b.latency_runs(s, mode, max(1, latency_calls // repeats))
                lat[mode] += t
                recs[mode] += rec
        rs["latency"] = {mode: {"times_s": lat[mode], "median_ms": statistics.median(lat[mode]) * 1e3,
                                "min_ms": min(lat[mode]) * 1e3, **_hops(recs[mode])} for mode in MODES}
        res[str(s)] = rs
        print(f"  S={s} done", flush=True)
    return res


# ---- report -------------------------------------------------------------------
def _tput_table(res: dict[str, Any], inputs: str) -> str:
    head = (f"{'stages':>6} {'parallel prog/s':>16} {'sequential prog/s':>18} {'par/seq':>8} "
            f"{'par ms/prog':>12} {'seq ms/prog':>12}")
    lines = [head, "-" * len(head)]
    for s, r in res.items():
        e = r[inputs]
        p, q = e["parallel"], e["sequential"]
        lines.append(f"{s:>6} {p['programs_per_s']:>16,.1f} {q['programs_per_s']:>18,.1f} "
                     f"{e['ratio']:>8.2f} {p['ms_per_program']:>12,.2f} {q['ms_per_program']:>12,.2f}")
    return "\n".join(lines)


def _latency_table(res: dict[str, Any]) -> str:
    def f(d: dict, k: str) -> str:
        return f"{d[k]:>6.2f}" if k in d else f"{'-':>6}"

    head = (f"{'stages':>6} {'parallel ms':>12} {'sequential ms':>14} {'seq/par':>8}   "
            f"{'exec':>6} {'hop':>6} {'gap':>6} | {'exec':>6} {'hop':>6} {'gap':>6}")
    lines = [f"{'':>44}{'parallel (ms)':^22}| {'sequential (ms)':^20}", head, "-" * len(head)]
    for s, r in res.items():
        lp, lq = r["latency"]["parallel"], r["latency"]["sequential"]
        p, q = lp["median_ms"], lq["median_ms"]
        lines.append(f"{s:>6} {p:>12,.2f} {q:>14,.2f} {q / p:>8.2f}   "
                     f"{f(lp, 'exec_ms_median')} {f(lp, 'hop_ms_median')} {f(lp, 'gap_ms_median')} | "
                     f"{f(lq, 'exec_ms_median')} {f(lq, 'hop_ms_median')} {f(lq, 'gap_ms_median')}")
    return "\n".join(lines)


def _cpu_table(res: dict[str, Any], inputs: str, cores: int) -> str:
    head = (f"{'stages':>6} {'mode':<10} {'client':>7} {'ctrl':>7} {'workers':>8} {'total':>7} "
            f"{'wall':>7} {'busy cores':>10} {'bound prog/s':>13}")
    lines = [head, "-" * len(head)]
    for s, r in res.items():
        for mode in MODES:
            e = r[inputs][mode]
            c = e["cpu_ms_per_program"]
            tot = c["client"] + c["controller"] + c["workers"]
            lines.append(f"{s:>6} {mode:<10} {c['client']:>7.2f} {c['controller']:>7.2f} "
                         f"{c['workers']:>8.2f} {tot:>7.2f} {e['ms_per_program']:>7.2f} "
                         f"{tot / e['ms_per_program']:>10.2f} {cores / tot * 1e3:>13,.1f}")
    return "\n".join(lines)


def _spread(res: dict[str, Any], input_modes: list[str]) -> str:
    out = []
    for s, r in res.items():
        for inputs in input_modes:
            for mode in MODES:
                out.append(f"  S={s} {inputs:<11} {mode:<10} runs (s): "
                           + " ".join(f"{t:.3f}" for t in r[inputs][mode]["times_s"]))
    return "\n".join(out)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)     # unwind through the finally that shuts zpath down


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Pipeline of S stages on S hosts: @zp.program parallel "
                                            "vs. sequential dispatch.")
    p.add_argument("--stages", default="1,2,4,8", help="comma-separated stage counts (default 1,2,4,8)")
    p.add_argument("--programs", type=int, default=50, help="programs per timed throughput run (default 50)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (default 5)")
    p.add_argument("--inputs", choices=("independent", "chained", "both"), default="independent",
                   help="throughput runs: every program reads one device-resident input "
                        "(independent, default), or the previous program's output (chained), or both")
    p.add_argument("--latency-calls", type=int, default=20,
                   help="single-program round trips per mode and stage count (default 20)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    try:
        stage_list = [int(s) for s in args.stages.split(",") if s.strip()]
    except ValueError:
        p.error("--stages must be comma-separated integers")
    if not stage_list or min(stage_list) < 1:
        p.error("--stages needs stage counts of at least 1")
    if args.programs < 1 or args.repeats < 1 or args.latency_calls < 1:
        p.error("--programs, --repeats and --latency-calls must be at least 1")
    input_modes = ["independent", "chained"] if args.inputs == "both" else [args.inputs]
    s_max = max(stage_list)

    signal.signal(signal.SIGTERM, _on_sigterm)
    print(f"pipeline of S stages `x * {SCALE} + {SHIFT}` on float64[{N}], stage k on host k "
          f"(1 device, own island, own worker process); S in {stage_list}; {args.programs} programs "
          f"per throughput run ({' and '.join(input_modes)} inputs), median of {args.repeats} runs "
          f"after a warm-up", flush=True)

    b = PipelineBench(s_max)           # starts the cluster before this process starts JAX threads
    try:
        res = measure(b, stage_list, args.programs, args.repeats, input_modes, args.latency_calls)
    finally:
        b.close()

    import jax

    cores = os.cpu_count() or 1
    config = {"stages": stage_list, "programs": args.programs, "repeats": args.repeats,
              "inputs": input_modes, "latency_calls": args.latency_calls, "elements": N,
              "python": platform.python_version(), "jax": jax.__version__, "cpus": cores}
    print(f"python {platform.python_version()}, jax {jax.__version__}, {cores} CPUs; zpath: client + "
          f"controller + {s_max} workers ({s_max} islands x 1 host x 1 device)")
    for inputs in input_modes:
        print()
        what = ("every program reads the same device-resident input on host 0 (programs may overlap)"
                if inputs == "independent" else
                "each program reads the previous program's output (no overlap between programs)")
        print(f"throughput, {inputs} inputs: {what}")
        print(_tput_table(res, inputs))
        print("(prog/s: programs per second, median run of "
              f"{args.programs} programs incl. fetching the last; par/seq: throughput ratio)")
    print()
    print("latency of one program (submit, fetch its output), median; from the workers' records: exec = "
          "a stage's execution on its worker (parallel: includes waiting for its input), hop = end of "
          "stage k to end of stage k+1, gap = end of stage k to start of stage k+1:")
    print(_latency_table(res))
    for inputs in input_modes:
        print()
        print(f"CPU ms per program, {inputs} inputs (summed over the timed runs; workers summed over "
              f"all {s_max} worker processes, idle ones included); busy cores = total CPU / wall; "
              f"bound = {cores} cores / total CPU:")
        print(_cpu_table(res, inputs, cores))
    print()
    print(_spread(res, input_modes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": res, "config": config}, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
