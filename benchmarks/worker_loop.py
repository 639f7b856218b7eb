"""The worker's own cost per computation, without the control plane: zpath's
worker executor driven directly in two processes, next to plain JAX in the
same two processes.

Two processes joined by jax.distributed (gloo), one CPU device each, run
``psum(x) + 1.`` on a float64 scalar per device ``--nodes`` times, each call
reading the previous one's output, in these ways (alternated, ``--repeats``
times each after a warm-up):

* ``jax-end``: ``x = f(x)`` in a Python loop, blocking at the end (what each
  JAX multi-controller process does in benchmarks/chained.py);
* ``jax-each``: the same, blocking after every call (what the worker does);
* ``fused``: one ``FusedRun`` of all the nodes submitted to the worker's
  ``Executor`` (the path a fused ``@zp.program`` run takes on each host: all
  nodes but the first and the last form one series, see
  ``Executor._run_series``);
* ``fused-steps``: the same, node by node on the short way, without series
  (how fused runs went before them);
* ``fused-execute``: the same, with every node sent through
  ``Executor._execute`` as a plain call is (how fused runs went before their
  short way, see ``Executor._run_fused``);
* ``plain``: one ``Execute`` per node submitted to the ``Executor`` (the path
  of plain calls on a host, minus the I/O thread and the controller).

With ``--solo`` there is one process with one CPU device and the computation
is ``x + 1.`` (no collective): what is left is the executor's own work per
node, which on two processes and two cores the collective's spread hides.

With ``--hold`` every computation goes with ``Execute.hold`` set, as the
controller sends op-by-op calls (nothing waits for their reports): ``plain``
then takes the path a worker takes in -O (a chain of them runs as a streak,
``Executor._streak``, settled late on the executor thread).

With ``--loop N`` each computation runs ``psum(x) + 1.`` N times in a
``fori_loop`` (``--loop 128`` is the -F computation of
benchmarks/island_dispatch.py). With ``--host-us U`` two more variants show
what host work between two computations costs:

* ``jax-each+host``: ``jax-each`` with U microseconds of Python (a busy loop)
  on the calling thread before every call, as an executor that stores
  outputs and reports before starting the next one does;
* ``jax-each+beside``: the same work on another thread, handed over as each
  call starts (as the worker's settler thread does, see ``Executor._run``).

For each it prints the median wall time per computation, the CPU time per
computation of process 0, and the ratio to ``jax-end``. A fused run waits
for each computation as ``jax-each`` does, so the difference between them is
the worker's own work per node; ``jax-end`` is what multi-controller does (on
this machine's CPU client it was 0-20% faster than ``jax-each``, as JAX
overlaps some of the next call with the current one). This is a benchmark
that prints figures, not a test.

    python benchmarks/worker_loop.py [--nodes 512] [--repeats 10] [--loop 1] [--host-us 0] [--solo] [--hold]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

VARIANTS = ("jax-end", "jax-each", "fused", "fused-steps", "fused-execute", "plain")
HOST_VARIANTS = ("jax-each+host", "jax-each+beside")


def variants(host_us: float) -> tuple[str, ...]:
    return VARIANTS + (HOST_VARIANTS if host_us > 0 else ())


def child(idx: int, port: int, nodes: int, repeats: int, loop: int, host_us: float, solo: bool,
          hold: bool = False) -> None:
    import hashlib
    import queue
    import threading

    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_x64", True)
    if not solo:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=idx,
                                   initialization_timeout=60)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from zpath.net import messages as m
    from zpath.worker.executor import Executor, FusedRun, _FusedPlan
    from zpath.worker.store import Store, shard_key

    devs, local = jax.devices(), jax.local_devices()
    n_dev = 1 if solo else 2
    devs = devs[:n_dev]
    if len(devs) != n_dev or len(local) != 1:
        raise SystemExit(f"expected {n_dev} devices, 1 per process; got {devs}, local {local}")
    mesh = Mesh(np.array(devs), ("i",))
    sh = NamedSharding(mesh, P("i"))

    def step(x):
        return x + 1. if solo else jax.lax.psum(x, "i") + 1.

    def looped(x):
        # (the psum's result cast back to device-varying, so the carry keeps its type)
        return jax.lax.fori_loop(0, loop, lambda i, y: step(y) if solo else
                                 jax.lax.pcast(step(y), "i", to="varying"), x)

    f = jax.jit(jax.shard_map(step if loop == 1 else looped, mesh=mesh,
                              in_specs=P("i"), out_specs=P("i")))
    blob = bytes(jax.export.export(f)(jax.ShapeDtypeStruct((n_dev,), np.float64, sharding=sh)).serialize())
    digest = hashlib.sha256(blob).hexdigest()
    store = Store()
    # reports counted down to one event (as the worker holds reports of short
    # computations rather than waking its I/O thread for each)
    done, left = threading.Event(), [0]
    errors: list[Any] = []

    def on_done(exec_id: int, error: Any, start: float, end: float, hold: bool) -> None:
        if error is not None:
            errors.append(error)
        left[0] -= 1
        if left[0] == 0:
            done.set()

    ex = Executor(store, {idx: local[0]}, on_done, jax_devices={d.id: d for d in devs})
    ex.add_program(digest, blob)
    aval = m.Aval([n_dev], "float64")
    jax_ids = [d.id for d in devs]
    region = [[idx, idx + 1]]

    def execute(exec_id: int, inp: int, out: int) -> m.Execute:
        return m.Execute(exec_id, exec_id, digest, "f", [n_dev], ["i"], list(range(n_dev)), jax_ids,
                         [m.ExecInput(inp, aval, ["i"], [m.ShardInput(idx, region, [])])],
                         [m.ExecOutput(out, aval, ["i"])], hold)

    # a fused run's nodes, with codes for buffer ids: -1 its input, k node k's output
    template = [execute(0, k - 1 if k else -1, k) for k in range(nodes)]
    plan: list = [None]        # what the executor works out on the first run
    no_short_way = _FusedPlan.__new__(_FusedPlan)
    no_short_way.steps, no_short_way.series = [None] * nodes, {}
    no_series: list = [None]       # the short way's plan without its series
    ids = iter(range(1, 1 << 40))

    def put(value: float) -> int:
        b = next(ids)
        store.set(shard_key(b, idx, ((idx, idx + 1),)), jax.device_put(np.full((1,), value), local[0]))
        return b

    def expect(n: int) -> None:
        done.clear()
        left[0] = n

    def wait() -> None:
        if not done.wait(timeout=120):
            raise TimeoutError("the executor did not report in 120 s")
        if errors:
            raise RuntimeError(f"computation failed: {errors[0].message}")

    def fetch(b: int) -> float:
        entry = store.wait(shard_key(b, idx, ((idx, idx + 1),)), 60)
        if not entry.done or entry.error is not None:
            raise RuntimeError(f"no value for buffer {b}: {entry.error}")
        return float(np.asarray(entry.value)[0])

    def make(value: float) -> Any:
        return jax.make_array_from_single_device_arrays(
            (n_dev,), sh, [jax.device_put(np.full((1,), value), local[0])])

    def jax_loop(each: bool) -> float:
        x = make(0.)
        for _ in range(nodes):
            x = f(x)
            if each:
                x.block_until_ready()
        return float(np.asarray(x.addressable_shards[0].data)[0])

    def fused(short_way: bool, series: bool = True) -> float:
        x0, first = put(0.), next(ids)
        for _ in range(nodes):
            next(ids)
        e = next(ids)
        expect(1)
        if short_way and not series and no_series[0] is None:
            no_series[0] = _FusedPlan(ex, template, set(range(nodes - 1)))
            no_series[0].series = {}
        ex.submit(FusedRun(e, e, "chain", list(range(n_dev)), template, [x0], first, list(range(nodes - 1)),
                           (plan if series else no_series) if short_way else [no_short_way]))
        wait()
        return fetch(first + nodes - 1)

    def plain() -> float:
        b = put(0.)
        expect(nodes)
        for _ in range(nodes):
            e, out = next(ids), next(ids)
            ex.submit(execute(e, b, out))
            b = out
        wait()
        return fetch(b)

    def busy(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    work: queue.SimpleQueue[float | None] = queue.SimpleQueue()

    def beside() -> None:
        while (seconds := work.get()) is not None:
            busy(seconds)

    threading.Thread(target=beside, daemon=True).start()

    def host_loop(here: bool) -> float:
        x = make(0.)
        for _ in range(nodes):
            if here:
                busy(host_us * 1e-6)
            else:
                work.put(host_us * 1e-6)
            x = f(x)
            x.block_until_ready()
        return float(np.asarray(x.addressable_shards[0].data)[0])

    runs = {"jax-end": lambda: jax_loop(False), "jax-each": lambda: jax_loop(True),
            "fused": lambda: fused(True), "fused-steps": lambda: fused(True, False),
            "fused-execute": lambda: fused(False), "plain": plain,
            "jax-each+host": lambda: host_loop(True), "jax-each+beside": lambda: host_loop(False)}
    want = np.float64(0.)
    with np.errstate(over="ignore"):
        for _ in range(nodes * loop):
            want = (want if solo else want + want) + np.float64(1.)
    names = variants(host_us)
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in names}
    for r in range(repeats + 1):              # the first round warms up
        for v in (names if r % 2 == 0 else names[::-1]):
            c0, t0 = time.process_time(), time.perf_counter()
            got = runs[v]()
            t, c = time.perf_counter() - t0, time.process_time() - c0
            if got != want:
                raise AssertionError(f"{v}: expected {want}, got {got}")
            if r:
                times[v].append((t, c))
    ex.stop()
    work.put(None)
    if idx == 0:
        print("RESULT " + json.dumps(times), flush=True)
    if not solo:
        jax.distributed.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The worker executor's cost per computation vs. plain JAX.")
    p.add_argument("--nodes", type=int, default=512, help="chained computations per run (default 512)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per variant (default 10)")
    p.add_argument("--loop", type=int, default=1,
                   help="psum + 1 steps per computation, in a fori_loop (default 1; 128 is -F)")
    p.add_argument("--host-us", type=float, default=0.0,
                   help="also run jax-each with this much host work per call, between calls "
                        "and beside them (default 0: not run)")
    p.add_argument("--solo", action="store_true",
                   help="one process with one device, computing x + 1. (no collective): "
                        "the executor's own cost per node")
    p.add_argument("--hold", action="store_true",
                   help="send every computation with Execute.hold, as the controller sends -O's calls "
                        "(nothing waits for their reports): `plain` then runs as a worker runs -O, "
                        "as a streak settled late (docs/design.md)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.nodes < 1 or args.repeats < 1 or args.loop < 1:
        p.error("--nodes, --repeats and --loop must be at least 1")
    if args.host_us < 0:
        p.error("--host-us must be >= 0")
    if args.child:
        child(args.child[0], args.child[1], args.nodes, args.repeats, args.loop, args.host_us, args.solo,
              args.hold)
        return 0

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    sys.path[:0] = [root, here]
    from island_dispatch import on_sigterm
    from zpath.cluster.launcher import free_port, stop_processes, worker_xla_flags

    signal.signal(signal.SIGTERM, on_sigterm)     # unwind through the finally that stops them
    env = dict(os.environ, XLA_FLAGS=worker_xla_flags(os.environ, 1))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    port = free_port("127.0.0.1")
    cmd = [sys.executable, os.path.abspath(__file__), "--nodes", str(args.nodes),
           "--repeats", str(args.repeats), "--loop", str(args.loop), "--host-us", str(args.host_us),
           *(["--solo"] if args.solo else []), *(["--hold"] if args.hold else []), "--child"]
    procs = [subprocess.Popen(cmd + [str(i), str(port)], env=env, stdout=subprocess.PIPE, text=True)
             for i in range(1 if args.solo else 2)]
    try:
        out, _ = procs[0].communicate(timeout=600)
        for proc in procs[1:]:
            proc.wait(timeout=60)
    finally:
        stop_processes(procs, 5.0)
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    if line is None or any(p.returncode for p in procs):
        print(f"the benchmark processes failed (exit codes {[p.returncode for p in procs]})", file=sys.stderr)
        return 1
    times = json.loads(line[len("RESULT "):])
    n = args.nodes
    res = {v: {"us_per_comp": statistics.median(t for t, _ in times[v]) / n * 1e6,
               "cpu_us_per_comp": statistics.median(c for _, c in times[v]) / n * 1e6,
               "runs_s": [t for t, _ in times[v]]} for v in variants(args.host_us)}
    base = res["jax-end"]["us_per_comp"]
    what = "x + 1." if args.solo else "psum(x) + 1."
    what = what if args.loop == 1 else f"{args.loop} x {what} (fori_loop)"
    where = "1 process x 1 CPU device" if args.solo else "2 processes x 1 CPU device (gloo)"
    print(f"{what} chained {n} times, {where}, "
          f"median of {args.repeats} runs per variant"
          + (f"; host work {args.host_us:g} us per call" if args.host_us else "")
          + ("; computations held (Execute.hold, as -O's)" if args.hold else ""))
    head = f"{'variant':<15} {'us/comp':>9} {'CPU us/comp (process 0)':>24} {'vs jax-end':>11}"
    print(head)
    print("-" * len(head))
    for v in variants(args.host_us):
        r = res[v]
        print(f"{v:<15} {r['us_per_comp']:>9.1f} {r['cpu_us_per_comp']:>24.1f} {base / r['us_per_comp']:>11.3f}")
    print("(us/comp: per call; vs jax-end: throughput ratio, higher is better)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"nodes": n, "repeats": args.repeats, "loop": args.loop, "host_us": args.host_us,
                       "solo": args.solo, "hold": args.hold,
                       "results": res}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
