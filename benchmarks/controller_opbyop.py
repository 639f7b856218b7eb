"""The controller alone on op-by-op calls (-O): its CPU per computation.

A real controller process (``python -m zpath.controller``), a real zpath
``Client`` in this process, and two fake workers (one thread here, no JAX) that
register as the two hosts of one island, "run" each ``Execute`` for
``--exec-us`` of wall time, one after another per host, and report ``ExecDone``
(two or more at once as one ``ExecDoneBatch`` of their own rows, as workers do).
The client sends chains of ``--chain`` calls of a 2-device SPMD program
(``x = f(x)``, each call's input the previous call's output, released as
``zp`` releases a dropped future), as ``island_dispatch.py`` -O does, and waits
until both hosts have reported the last one.

Printed per run: calls per second and the controller process's CPU time (user +
system, all its threads) per call, and of that its main thread's (the loop)
and its other threads' (ZeroMQ's I/O thread); the table gives the median over
``--repeats`` runs. The workers' and the client's costs are left out, so this
measures the controller's share of -O without JAX, tracing or the workers on
the same cores. Then the same sequence of events goes to a ``ControllerCore``
in this process (no sockets, no encoding): its CPU per call back to back, and
with the thread asleep for ``--exec-us`` before each call, as the controller's
loop is while the hosts run (the same work, run cold). A benchmark that prints
figures, not a test.

    python benchmarks/controller_opbyop.py [--seconds 4] [--repeats 3] [--exec-us 1200] [--hold]
                                           [--core-calls 2000] [--json out.json]
    python benchmarks/controller_opbyop.py --count 40 [--without window]

With ``--count N`` it only counts the Python bytecodes a ``ControllerCore``
runs per call on -O traffic as ``island_dispatch.py`` makes it (chains of 500
calls posted ahead of two hosts, on a fake clock: deterministic, no
processes; see ``core_chained``) and prints the N costliest functions.
``--without PART`` (repeatable) counts the core with a part taken out for the
count only (``WITHOUT``): a bound on what making it cheaper could save.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import heapq
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Iterator

import psutil
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from zpath.client.connection import Client  # noqa: E402
from zpath.config import DEEP_QUEUE, HOLD_DEEP_S, HOLD_SHORT_S, ControllerConfig  # noqa: E402
from zpath.controller.core import ControllerCore  # noqa: E402
from zpath.net import messages as m  # noqa: E402
from zpath.net.codec import PROTOCOL_VERSION  # noqa: E402
from zpath.net.transport import Endpoint, unbatched  # noqa: E402
from zpath.process import PARENT_PID_ENV  # noqa: E402


class FakeWorkers:
    """Two hosts of one island in a thread: each runs its Executes in order,
    ``exec_s`` of wall time apiece, and reports each as it ends. With ``hold``
    they hold reports back as a worker does (zpath/worker/executor.py): an
    Execute that allows it (``hold``) with at least DEEP_QUEUE queued behind it
    on its host is reported with a hold of half the time those take, at most
    HOLD_DEEP_S, if that is at least twice HOLD_SHORT_S; held reports go out
    as one message with the next one not held, or at the deadline. (A worker's
    short-computation hold does not apply: ``--exec-us`` is above SHORT_S.)"""

    def __init__(self, address: str, worker_key: bytes, exec_s: float, hold: bool = False) -> None:
        self.address, self.key, self.exec_s, self.hold = address, worker_key, exec_s, hold
        self.done = [0, 0]
        self.held = 0                # reports that went out after being held
        self.cv = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def wait_for(self, total: int, timeout: float = 60.0) -> None:
        with self.cv:
            if not self.cv.wait_for(lambda: min(self.done) >= total, timeout=timeout):
                raise RuntimeError(f"the hosts reported {self.done} computations, not {total}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        ctx = zmq.Context()
        socks, eps = [], []
        for n in range(2):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.address)
            ep = Endpoint(self.key, f"worker:{n}")
            ep.send(s, m.RegisterWorker(f"h{n}", 0, f"tcp://127.0.0.1:{40000 + n}", os.getpid(), "cpu", 1,
                                        PROTOCOL_VERSION, [n], "127.0.0.1:1", n, 2, "bench", "", "", n))
            socks.append(s)
            eps.append(ep)
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        free_at = [0.0, 0.0]
        due: list[tuple[float, int, int, bool]] = []    # (when it ends, host, exec id, may hold)
        held: list[list[m.ExecDone]] = [[], []]          # per host: reports held back
        held_due = [float("inf")] * 2                    # when they go at the latest

        def report(n: int) -> None:
            # as a worker sends them: two or more as one batch of its own rows
            eps[n].send_batch(socks[n], [(m.own_batch(n, held[n]), 0, 0)] if len(held[n]) > 1 else
                              [(x, 0, 0) for x in held[n]])
            with self.cv:
                self.done[n] += len(held[n])
                self.cv.notify_all()
            held[n], held_due[n] = [], float("inf")

        while not self._stop.is_set():
            now = time.monotonic()
            while due and due[0][0] <= now:
                _, n, exec_id, may_hold = heapq.heappop(due)
                end = time.time()
                held[n].append(m.ExecDone(exec_id, None, end - self.exec_s, end))
                behind = sum(1 for d in due if d[1] == n)
                hold_s = min(HOLD_DEEP_S, behind * self.exec_s / 2) \
                    if self.hold and may_hold and behind >= DEEP_QUEUE else 0.0
                if hold_s >= 2 * HOLD_SHORT_S:
                    held_due[n] = min(held_due[n], now + hold_s)
                    self.held += 1
                else:
                    report(n)
            for n in range(2):
                if held[n] and held_due[n] <= now:
                    report(n)
            wake = min(due[0][0] if due else now + 0.1, *held_due)
            wait = max(0, int((wake - now) * 1000))
            for s, _ in poller.poll(wait):
                n = socks.index(s)
                while s.poll(0):
                    _, header, msg, buffers = eps[n].recv(s)
                    for h, x, _ in unbatched(header, msg, buffers):
                        if type(x) is m.Execute:
                            free_at[n] = max(time.monotonic(), free_at[n]) + self.exec_s
                            heapq.heappush(due, (free_at[n], n, x.exec_id, x.hold))
                        elif type(x) is m.Ping:
                            eps[n].send(socks[n], m.Pong(x.seq, 0, 0, [0]), parent=h.msg_id)
        for s in socks:
            s.close(0)
        ctx.term()


class _Form:
    """A stand-in for a traced function: the client keeps a call form per one
    (and per which inputs are put)."""


def _cpu(proc: psutil.Process) -> tuple[float, float]:
    """(CPU seconds of all the process's threads, of its main thread)."""
    threads = {t.id: t.user_time + t.system_time for t in proc.threads()}
    return sum(threads.values()), threads.get(proc.pid, 0.0)


def run(args: argparse.Namespace) -> tuple[list[dict[str, float]], int]:
    """The timed runs' figures, and how many reports the fake hosts held back."""
    key, worker_key = os.urandom(32), os.urandom(32)
    tmp = tempfile.mkdtemp()
    # (PARENT_PID_ENV: the controller dies with this process, should it be killed)
    env = dict(os.environ, ZPATH_KEY=key.hex(), ZPATH_WORKER_KEY=worker_key.hex(), **{PARENT_PID_ENV: str(os.getpid())})
    ctl = subprocess.Popen([sys.executable, "-m", "zpath.controller", "--address-file", f"{tmp}/address"],
                           env=env, stdout=subprocess.DEVNULL)
    workers = client = None
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{tmp}/address"):
            if time.monotonic() > deadline or ctl.poll() is not None:
                raise RuntimeError("the controller did not start")
            time.sleep(0.05)
        with open(f"{tmp}/address") as f:
            address = f.read().strip()
        workers = FakeWorkers(address, worker_key, args.exec_us / 1e6, hold=args.hold)
        client = Client(address, key, name="controller_opbyop")
        while len(client.request(m.StatusRequest(False)).hosts) < 2:     # both hosts registered
            if time.monotonic() > deadline:
                raise RuntimeError("the fake hosts did not register")
            time.sleep(0.05)
        blob = b"a program the fake hosts never run" * 4
        digest = hashlib.sha256(blob).hexdigest()
        client.register_program(digest, "psum_plus_one", blob)
        aval = m.Aval([2], "float32")
        issued = 0

        traced = _Form()         # (what the client numbers its call forms by: one function)

        def chain() -> int:
            nonlocal issued
            prev = None
            for _ in range(args.chain):
                out = client.new_buffer_id()
                inp = client.new_buffer_id() if prev is None else prev
                cid = client.new_call_id()

                def whole(keep: int, cid: int = cid, inp: int = inp, out: int = out,
                          put: bool = prev is None) -> m.Call:
                    return m.Call(cid, digest, [2], ["i"], [0, 1], [m.CallInput(inp, aval, ["i"], put)],
                                  [m.CallOutput(out, aval, ["i"])], keep)

                # as zp functions post a call: a repeat as a CallAgain of its kept form
                client.post_call(traced, (prev is None,), cid, [inp], [out], whole)
                if prev is not None:
                    client.release(prev)
                prev = out
            issued += args.chain
            workers.wait_for(issued)
            return prev

        proc = psutil.Process(ctl.pid)
        client.release(chain())              # warm-up: plans cached, hosts given the program
        results = []
        for _ in range(args.repeats):
            (c0, main0), t0, n = _cpu(proc), time.perf_counter(), 0
            while time.perf_counter() - t0 < args.seconds:
                client.release(chain())
                n += args.chain
            wall = time.perf_counter() - t0
            c1, main1 = _cpu(proc)
            results.append({"calls_per_s": n / wall, "controller_cpu_us": (c1 - c0) / n * 1e6,
                            "main_thread_us": (main1 - main0) / n * 1e6,
                            "other_threads_us": ((c1 - c0) - (main1 - main0)) / n * 1e6})
            print("  run: " + ", ".join(f"{k} {v:,.1f}" for k, v in results[-1].items()), flush=True)
        return results, workers.held
    finally:
        if client is not None:
            client.close()
        if workers is not None:
            workers.stop()
        ctl.terminate()
        try:
            ctl.wait(10)
        except subprocess.TimeoutExpired:
            ctl.kill()
            ctl.wait()


class _Blob(bytes):
    """A program's bytes as the core sees a received buffer (it reads nbytes)."""

    @property
    def nbytes(self) -> int:
        return len(self)


def core_alone(calls: int, pause_s: float) -> float:
    """CPU (this thread's) per call of a ``ControllerCore`` handling what the
    controller handles per -O call here (the client's Call and Release, both
    hosts' ExecDone, one computation in flight), ``pause_s`` asleep before
    each call (0: back to back)."""
    core = ControllerCore(ControllerConfig())
    ids = itertools.count(1)
    now = 1000.0
    for n in range(2):
        core.handle(now, b"w%d" % n, next(ids), m.RegisterWorker(
            f"h{n}", 0, f"tcp://127.0.0.1:{40000 + n}", 1, "cpu", 1, PROTOCOL_VERSION, [n], "127.0.0.1:1",
            n, 2, "bench", "", "", n), [])
    core.handle(now, b"client", next(ids), m.Hello("bench", PROTOCOL_VERSION, 1.0, b"n" * 16), [])
    client = core.peers[b"client"].id
    blob = _Blob(b"a program the core never runs" * 4)
    digest = hashlib.sha256(blob).hexdigest()
    core.handle(now, b"client", next(ids), m.RegisterProgram(digest, "psum_plus_one"), [blob])
    aval = m.Aval([2], "float32")
    buffer_ids = itertools.count(1)
    prev: int | None = None
    running: list[tuple[bytes, int]] = []         # (host, exec id) sent, not reported yet
    sent = 0
    cpu = 0.0
    for k in range(2 * calls):                     # the first half warms up
        if pause_s:
            time.sleep(pause_s)
        t0 = time.thread_time()
        now += 0.0012
        out = client << 32 | next(buffer_ids)
        inp = client << 32 | next(buffer_ids) if prev is None else prev
        effects = core.handle(now, b"client", next(ids), m.Call(
            next(ids), digest, [2], ["i"], [0, 1], [m.CallInput(inp, aval, ["i"], prev is None)],
            [m.CallOutput(out, aval, ["i"])]), [])
        while core.busy:
            effects += core.resume(now)
        if prev is not None:
            effects += core.handle(now, b"client", next(ids), m.Release([prev]), [])
        prev = out
        executes = [(e.ident, e.msg.exec_id) for e in effects if type(e.msg) is m.Execute]
        sent += len(executes)
        running += executes
        while len(running) > 2:                    # the hosts finish the one before
            for host, exec_id in running[:2]:
                core.handle(now, host, next(ids), m.ExecDone(exec_id, None, now - 0.0012, now), [])
            del running[:2]
        if k >= calls:
            cpu += time.thread_time() - t0
    if sent != 2 * 2 * calls:
        raise RuntimeError(f"the core sent {sent} Executes for {2 * calls} calls on 2 hosts")
    return cpu / calls * 1e6


def core_chained(chains: int = 8, chain: int = 500, exec_s: float = 0.0012, post_s: float = 0.0002,
                 batch: int = 8, counted_from: int = 2, alone_window_ms: float | None = None
                 ) -> tuple[int, int, collections.Counter]:
    """Python bytecodes per call of a ``ControllerCore`` fed -O traffic as
    ``island_dispatch.py`` makes it, on a fake clock (deterministic): the
    client posts chains of ``chain`` calls (``x = f(x)``, the previous value
    released) one every ``post_s``, ahead of two hosts that run each
    computation for ``exec_s`` in order and report their own rows ``batch``
    at a time (fewer when none are left to run). Counted over the chains
    from ``counted_from`` on (``sys.settrace`` opcode events in the core's
    code, from its entry points: the messages are made before). Returns
    (calls counted, of them planned on the fast path and parked, bytecodes
    per function). ``alone_window_ms``: the controller's alone window
    (default: its setting; the solo window's 100 ms: as with a second
    client connected, more of each chain parks)."""
    core = ControllerCore(ControllerConfig() if alone_window_ms is None
                          else ControllerConfig(alone_window_ms=alone_window_ms))
    ids = itertools.count(1)
    now = 1000.0
    hosts = [b"w0", b"w1"]
    for n in range(2):
        core.handle(now, hosts[n], next(ids), m.RegisterWorker(
            f"h{n}", 0, f"tcp://127.0.0.1:{40000 + n}", 1, "cpu", 1, PROTOCOL_VERSION, [n], "127.0.0.1:1",
            n, 2, "bench", "", "", n), [])
    core.handle(now, b"client", next(ids), m.Hello("bench", PROTOCOL_VERSION, 1.0, b"n" * 16), [])
    client = core.peers[b"client"].id
    rank_of = {ident: rank for rank, ident in core.worker_ident.items()}
    blob = _Blob(b"a program the core never runs" * 4)
    digest = hashlib.sha256(blob).hexdigest()
    core.handle(now, b"client", next(ids), m.RegisterProgram(digest, "psum_plus_one"), [blob])
    aval = m.Aval([2], "float32")
    buffer_ids = itertools.count(1)
    queues: dict[bytes, collections.deque] = {h: collections.deque() for h in hosts}   # (exec id, end)
    free_at = dict.fromkeys(hosts, now)
    by_code: collections.Counter = collections.Counter()
    counting = False

    def trace(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            by_code[frame.f_code.co_qualname] += 1
        return trace

    def handle(ident: bytes, msg: m.Record) -> None:
        # (traced from the core's entry: not the making of the messages
        # here, which the controller's decoder does)
        if counting:
            sys.settrace(trace)
        effects = core.handle(now, ident, next(ids), msg, [])
        while core.busy:
            effects += core.resume(now)
        if counting:
            sys.settrace(None)
        for e in effects:
            if type(e.msg) is m.Execute:
                end = max(free_at[e.ident], now) + exec_s
                free_at[e.ident] = end
                queues[e.ident].append((e.msg.exec_id, end))

    def report() -> None:
        for h in hosts:
            q = queues[h]
            done = sum(1 for _, end in q if end <= now)
            if done and (done >= batch or done == len(q)):
                rows = [q.popleft() for _ in range(done)]
                if done == 1:
                    handle(h, m.ExecDone(rows[0][0], None, rows[0][1] - exec_s, rows[0][1]))
                else:
                    handle(h, m.own_batch(rank_of[h], [m.ExecDone(x, None, end - exec_s, end) for x, end in rows]))

    counted = 0
    planned = 0
    kept: set[int] = set()
    for c in range(chains):
        if c == counted_from:
            planned = core.fast_planned
            counting = True
        prev = None
        for _ in range(chain):
            now += post_s
            report()
            out = client << 32 | next(buffer_ids)
            inp = client << 32 | next(buffer_ids) if prev is None else prev
            # as a client sends them: a form's first call whole, kept as form 1
            # (a value put) or 2, then CallAgains of it
            form = 1 if prev is None else 2
            if form in kept:
                handle(b"client", m.CallAgain(next(ids), form, [inp], [out]))
            else:
                kept.add(form)
                handle(b"client", m.Call(next(ids), digest, [2], ["i"], [0, 1],
                                         [m.CallInput(inp, aval, ["i"], prev is None)],
                                         [m.CallOutput(out, aval, ["i"])], form))
            if prev is not None:
                handle(b"client", m.Release([prev]))
            prev = out
            counted += c >= counted_from
        while any(queues.values()):
            ends = [q[min(batch, len(q)) - 1][1] for q in queues.values() if q]
            now = max(now, min(ends))
            report()
        handle(b"client", m.Release([prev]))
    if core.in_flight or core.directory.buffers:
        raise RuntimeError("the chains did not finish")
    return counted, core.fast_planned - planned, by_code


# what ``--count --without PART`` takes out of the core for the count only (not
# designs: a bound on what making that part cheaper could save)
WITHOUT = {
    "window": "the tenant scheduler's window never full and its checks not made "
              "(can_send_now yes, low no): no call parks",
    "window-full": "the window's checks made, but never full: no call parks",
    "scheduler": "no tenant scheduler at all: no window, no accounting (sent, finished, host_done)",
    "timeline": "no timeline rows",
}


@contextlib.contextmanager
def without(parts: list[str]) -> Iterator[None]:
    """The core with ``parts`` (keys of WITHOUT) replaced, for a count."""
    from zpath.controller import records, scheduler
    T, L = scheduler.TenantScheduler, records.Timeline
    saved = [(cls, name, cls.__dict__[name]) for cls, name in (
        (T, "can_send_now"), (T, "low"), (T, "sent"), (T, "finished"), (T, "host_done"), (T, "hosts_done"),
        (L, "append"), (L, "add_run"))]
    checks, low = T.can_send_now, T.low
    try:
        if "window" in parts or "scheduler" in parts:
            T.can_send_now = lambda self, ready: True
            T.low = lambda self, devices, island=None: False
        elif "window-full" in parts:
            T.can_send_now = lambda self, ready: checks(self, ready) or True
            T.low = lambda self, devices, island=None: low(self, devices, island) and False
        if "scheduler" in parts:
            T.sent = lambda self, ticket, ready: None
            T.finished = lambda self, ticket: None
            T.host_done = lambda self, ticket, seconds, devices: None
            T.hosts_done = lambda self, ticket, device_seconds, longest: None
        if "timeline" in parts:
            L.append = lambda self, row: None
            L.add_run = lambda self, *row: None
        yield
    finally:
        for cls, name, f in saved:
            setattr(cls, name, f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=4.0, help="length of each timed run (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (default 3)")
    p.add_argument("--exec-us", type=float, default=1200.0,
                   help="wall time a fake host spends on each computation (default 1200, about a "
                        "real worker's -O computation on this machine)")
    p.add_argument("--chain", type=int, default=100, help="calls per chain (default 100)")
    p.add_argument("--hold", action="store_true",
                   help="the fake hosts hold reports back as workers do (Execute.hold; default: each "
                        "report goes as its computation ends)")
    p.add_argument("--core-calls", type=int, default=2000,
                   help="calls of the in-process core run, each way (default 2000; 0: none)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--count", type=int, metavar="N", default=None,
                   help="only count the core's Python bytecodes per call on chained -O traffic posted "
                        "ahead of the hosts (deterministic, no processes), and print the N costliest "
                        "functions")
    p.add_argument("--without", action="append", choices=sorted(WITHOUT), default=[], metavar="PART",
                   help="with --count: count the core with this part taken out, for the count only "
                        "(repeatable): " + "; ".join(f"{k}: {v}" for k, v in WITHOUT.items()))
    args = p.parse_args(argv)
    if args.without and args.count is None:
        p.error("--without only goes with --count")
    if args.count is not None:
        with without(args.without):
            calls, planned, by_code = core_chained()
        per_call = sum(by_code.values()) / calls
        print(f"the core per chained -O call: {per_call:,.0f} Python bytecodes ({planned} of {calls} calls "
              f"planned on the fast path and parked)"
              + "".join(f"\n  without: {WITHOUT[k]}" for k in args.without))
        for name, n in by_code.most_common(args.count):
            print(f"{n / calls:9.1f}  {name}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bytecodes_per_call": per_call, "parked": planned,
                           "by_function": {k: v / calls for k, v in by_code.most_common()}}, f, indent=1)
        return 0
    results, held_reports = run(args)
    summary: dict[str, Any] = {k: statistics.median(r[k] for r in results) for k in results[0]}
    print(f"controller per -O call (median of {len(results)}): {summary['controller_cpu_us']:.0f} us CPU "
          f"(main thread {summary['main_thread_us']:.0f}, other threads {summary['other_threads_us']:.0f}); "
          f"{summary['calls_per_s']:,.0f} calls/s" + (f"; {held_reports} reports held back" if args.hold else ""))
    if args.core_calls:
        summary["core_us"] = core_alone(args.core_calls, 0.0)
        summary["core_after_sleep_us"] = core_alone(args.core_calls, args.exec_us / 1e6)
        print(f"the core alone per call: {summary['core_us']:.0f} us CPU back to back, "
              f"{summary['core_after_sleep_us']:.0f} us asleep {args.exec_us:.0f} us before each")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**summary, "runs": results, "exec_us": args.exec_us, "chain": args.chain,
                       "hold": args.hold, "held_reports": held_reports}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
