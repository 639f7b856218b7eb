"""Timelines anyone can open: Chrome Trace Event JSON, which the Perfetto UI
(ui.perfetto.dev) and chrome://tracing read.

``with zp.trace("trace.json"): ...`` records what this client does inside the block
and, when it ends, asks the cluster what ran meanwhile; ``zpath trace --seconds N -o
trace.json`` does the same for a running cluster, without client-side slices.

What goes in (all of it already recorded by the cluster):

* one process per client, with a track of this client's calls, programs and fetches
  (recorded here, when a trace is active);
* the controller, one process, with an instant per client and lost host, a track of
  its planning and dispatch (a slice per call, program or slice of a long one, the
  loop's own time) and one of the submissions that waited for device memory;
* one process per worker (``host R NAME (island I)``), a track per device with one
  slice per computation the controller's timeline has (``TimelineRequest``: the
  worker's start and end of each), named by the computation, its client in its args,
  and inside it a "wait for inputs" slice for the time its inputs were not there yet
  (``ExecDone.waited``);
* transfers: from the workers' ``ChannelStats`` (the pieces each sent, with channel,
  bytes and destination, and when each was received), a slice on the sender's
  ``transfers out`` track from the send's start to its receipt, an instant on the
  receiver's ``transfers in`` track, and a flow arrow between them.

Clocks: every timestamp is turned into this machine's clock. A worker's offset is
measured when the trace starts (and again when it ends) by asking its data port for
``ChannelStats``, which carries the worker's wall time: offset = its time minus the
middle of the round trip, from the fastest of a few asks. The controller's timeline
carries the workers' own times, corrected the same way, and its answer the
controller's time (``Timeline.now``), which gives the controller's offset.

A host that is lost, or does not answer within ``ASK_TIMEOUT_S``, gives no transfers;
its computations still appear (the controller has them) and the trace still closes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from zpath.net import messages as m
from zpath.net.codec import CLIENTS
from zpath.net.transport import Endpoint

ASK_TIMEOUT_S = 2.0           # per worker and ask
CLOCK_SAMPLES = 3             # asks per worker (and of the controller) when measuring a clock offset
TIMELINE_LIMIT = 1_000_000    # records asked from the controller (it keeps the last 100,000)
SETTLE_S = 2.0                # the longest a trace waits, as it ends, for its client's computations' reports

CONTROLLER_PID = 1
TRANSFERS_OUT_TID = 1_000_000
TRANSFERS_IN_TID = 1_000_001
PLAN_TID, MEMORY_TID = 1, 2           # the controller's tracks (0: the cluster's instants)


def worker_pid(rank: int) -> int:
    return 1000 + rank


def client_pid(client_id: int) -> int:
    return 100_000 + client_id


@dataclasses.dataclass(frozen=True)
class ClientSlice:
    """Something this client did: a call, a program or a fetch (wall times)."""
    kind: str
    name: str
    start: float
    end: float
    args: dict[str, Any]


class Recorder:
    """What a client did while a trace was active (``Client.recorder``)."""

    def __init__(self) -> None:
        self.slices: list[ClientSlice] = []
        self._lock = threading.Lock()

    def add(self, kind: str, name: str, start: float, end: float, **args: Any) -> None:
        with self._lock:
            self.slices.append(ClientSlice(kind, name, start, end, args))


@dataclasses.dataclass
class HostView:
    """What one worker said: its clock offset (its time minus ours) and data-plane records."""
    offset: float = 0.0
    rtt: float = float("inf")
    stats: m.ChannelStats | None = None
    error: str = ""


def ask_workers(key: bytes, hosts: list[m.HostInfo], samples: int = 1,
                timeout: float = ASK_TIMEOUT_S) -> dict[int, HostView]:
    """Ask every host's data port for its ChannelStats ``samples`` times (all hosts
    at once); keep, per host, the answer of the fastest round trip and the clock
    offset it gives. A host that does not answer in ``timeout`` has ``error`` set."""
    ep = Endpoint(key, "client:trace", signer=CLIENTS)  # what anyone with the cluster key may ask
    ctx = zmq.Context.instance()
    views = {h.rank: HostView() for h in hosts}
    socks: dict[int, zmq.Socket] = {}
    try:
        for h in hosts:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(h.data_address)
            socks[h.rank] = s
        for _ in range(samples):
            sent = {}
            for rank, s in socks.items():
                if not views[rank].error:
                    sent[rank] = time.time()
                    ep.send(s, m.ChannelStatsRequest(False))
            poller = zmq.Poller()
            for rank in sent:
                poller.register(socks[rank], zmq.POLLIN)
            waiting, deadline = set(sent), time.monotonic() + timeout
            while waiting and (left := deadline - time.monotonic()) > 0:
                for sock, _ in poller.poll(left * 1000):
                    rank = next(r for r, s in socks.items() if s is sock)
                    _, _, msg, _ = ep.recv(sock)
                    back = time.time()
                    if not isinstance(msg, m.ChannelStats) or rank not in waiting:
                        continue
                    waiting.discard(rank)
                    poller.unregister(sock)
                    v = views[rank]
                    if back - sent[rank] < v.rtt:
                        v.rtt = back - sent[rank]
                        v.offset = msg.now - (sent[rank] + back) / 2 if msg.now else 0.0
                        v.stats = msg
            for rank in waiting:
                views[rank].error = f"no answer in {timeout:g} s"
    finally:
        for s in socks.values():
            s.close(0)
    return views


def build(*, begin: float, end: float, status: m.Status, records: list[m.ExecRecord],
          views: dict[int, HostView], client_id: int | None = None,
          slices: Sequence[ClientSlice] = (), address: str = "",
          controller_events: Sequence[m.ControllerEvent] = (), controller_offset: float = 0.0) -> dict[str, Any]:
    """The Chrome Trace Event document of [begin, end] (this machine's wall clock).
    Pure: what the cluster answered in, the JSON-ready dict out. ``controller_events``:
    the controller's planning and waits for memory (its clock ahead of this one
    by ``controller_offset``)."""
    events: list[dict[str, Any]] = []

    def us(t: float) -> float:
        return round((t - begin) * 1e6, 3)

    def meta(pid: int, name: str, tid: int | None = None, sort: int | None = None) -> None:
        if tid is None:
            events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
            if sort is not None:
                events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": sort}})
        else:
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            if sort is not None:
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                               "args": {"sort_index": sort}})

    names = {c.id: c.name for c in status.clients}
    lost = {h.rank for h in status.lost}
    hosts = {h.rank: h for h in [*status.hosts, *status.lost]}
    device_host = {d.id: h.rank for h in hosts.values() for d in h.devices}

    # processes and tracks
    meta(CONTROLLER_PID, f"controller {address}".strip(), sort=0)
    meta(CONTROLLER_PID, "cluster", tid=0)
    meta(CONTROLLER_PID, "planning and dispatch", tid=PLAN_TID, sort=PLAN_TID)
    meta(CONTROLLER_PID, "waits for memory", tid=MEMORY_TID, sort=MEMORY_TID)
    for rank, h in sorted(hosts.items()):
        pid = worker_pid(rank)
        meta(pid, f"host {rank} {h.name} (island {h.island})" + (" LOST" if rank in lost else ""),
             sort=1000 + rank)
        for d in h.devices:
            meta(pid, f"device {d.id}", tid=d.id, sort=d.id)
        meta(pid, "transfers out", tid=TRANSFERS_OUT_TID, sort=TRANSFERS_OUT_TID)
        meta(pid, "transfers in", tid=TRANSFERS_IN_TID, sort=TRANSFERS_IN_TID)
    clients = {r.client for r in records} | set(names) | ({client_id} if client_id is not None else set())
    for c in sorted(clients):
        who = names.get(c, "")
        meta(client_pid(c), f"client {c} {who}".strip() + (" (tracing)" if c == client_id else ""), sort=10 + c)
        meta(client_pid(c), "calls", tid=0)
    for c in status.clients:
        events.append({"ph": "i", "s": "p", "name": f"client {c.id} {c.name}", "pid": CONTROLLER_PID,
                       "tid": 0, "ts": 0, "args": {"weight": c.weight, "device_seconds": c.device_seconds}})
    for h in status.lost:
        events.append({"ph": "i", "s": "g", "name": f"host {h.rank} {h.name} lost", "pid": CONTROLLER_PID,
                       "tid": 0, "ts": us(end)})

    # the client's own slices
    if client_id is not None:
        for s in slices:
            events.append({"ph": "X", "name": f"{s.kind} {s.name}", "cat": s.kind, "pid": client_pid(client_id),
                           "tid": 0, "ts": us(s.start), "dur": round((s.end - s.start) * 1e6, 3),
                           "args": {k: v for k, v in s.args.items()}})

    # the controller's work and what waited there
    for e in controller_events:
        start, stop = e.start - controller_offset, e.end - controller_offset
        if stop < begin or start > end:
            continue
        plan = e.kind == "plan"
        events.append({"ph": "X", "name": f"{'plan' if plan else 'wait for memory'} {e.name}".strip(),
                       "cat": "plan" if plan else "memory", "pid": CONTROLLER_PID,
                       "tid": PLAN_TID if plan else MEMORY_TID, "ts": us(start),
                       "dur": round(max(0.0, stop - start) * 1e6, 3),
                       "args": {"client": e.client, "client_name": names.get(e.client, "")}})

    # computations: one slice per device of the host that ran that part
    for r in records:
        off = views[r.host].offset if r.host in views else 0.0
        start, stop = r.start - off, r.end - off
        if stop < begin or start > end:
            continue
        for d in r.devices:
            if device_host.get(d) != r.host:
                continue
            events.append({"ph": "X", "name": r.name, "cat": "computation", "pid": worker_pid(r.host), "tid": d,
                           "ts": us(start), "dur": round((stop - start) * 1e6, 3),
                           "args": {"client": r.client, "client_name": names.get(r.client, ""),
                                    "exec_id": r.exec_id, "seq": r.seq, "island": r.island, "ok": r.ok,
                                    "waited_for_inputs_s": r.waited}})
            if r.waited > 0:      # inside it: the time its inputs were not there yet
                events.append({"ph": "X", "name": "wait for inputs", "cat": "wait", "pid": worker_pid(r.host),
                               "tid": d, "ts": us(start), "dur": round(min(r.waited, stop - start) * 1e6, 3),
                               "args": {"exec_id": r.exec_id, "client": r.client}})

    # transfers: sender slice [send began, received], receiver instant, a flow between
    received: dict[int, tuple[int, float]] = {}
    for rank, v in views.items():
        if v.stats is not None:
            for piece, at in v.stats.received_at:
                received[int(piece)] = (rank, at - v.offset)
    for rank, v in sorted(views.items()):
        if v.stats is None:
            continue
        for p in v.stats.sent:
            sent = p.at - v.offset
            got = received.get(p.piece_id)
            if sent > end or (got is None and sent < begin) or (got is not None and got[1] < begin):
                continue
            args = {"piece": p.piece_id, "channel": p.channel, "bytes": p.nbytes, "to_host": p.dst_host}
            dur = max(0.0, got[1] - sent) if got else 0.0
            events.append({"ph": "X", "name": f"{p.channel} {p.nbytes} B -> host {p.dst_host}", "cat": "transfer",
                           "pid": worker_pid(rank), "tid": TRANSFERS_OUT_TID, "ts": us(sent),
                           "dur": round(dur * 1e6, 3), "args": args})
            if got is None:
                continue
            dst, at = got
            events.append({"ph": "X", "name": f"{p.channel} {p.nbytes} B <- host {rank}", "cat": "transfer",
                           "pid": worker_pid(dst), "tid": TRANSFERS_IN_TID, "ts": us(at), "dur": 1.0,
                           "args": {**args, "from_host": rank}})
            events.append({"ph": "s", "id": p.piece_id, "name": "transfer", "cat": "transfer",
                           "pid": worker_pid(rank), "tid": TRANSFERS_OUT_TID, "ts": us(sent)})
            events.append({"ph": "f", "bp": "e", "id": p.piece_id, "name": "transfer", "cat": "transfer",
                           "pid": worker_pid(dst), "tid": TRANSFERS_IN_TID, "ts": us(at)})

    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"begin_unix_s": begin, "end_unix_s": end, "controller": address,
                          "clock_offsets_s": {str(r): v.offset for r, v in views.items() if not v.error},
                          "unanswered_hosts": {str(r): v.error for r, v in views.items() if v.error},
                          "lost_hosts": sorted(lost)}}


def collect(client: Any, begin: float, end: float, at_start: tuple[dict[int, HostView], list[m.ClientStatus]],
            slices: Sequence[ClientSlice] = (), client_id: int | None = None) -> dict[str, Any]:
    """Ask the controller (``client``: a connected ``Client``) and the workers what
    ran in [begin, end]; the trace document. ``at_start``: what ``start`` said."""
    views_at_start, clients_at_start = at_start
    settled(client, client_id)
    status = client.request(m.StatusRequest(True))
    now = {c.id for c in status.clients}
    status = dataclasses.replace(status, clients=[*status.clients,
                                                  *(c for c in clients_at_start if c.id not in now)])
    timeline = client.request(m.TimelineRequest(TIMELINE_LIMIT))
    records = timeline.records
    controller_offset = _controller_offset(client)
    views = ask_workers(client.ep.key, list(status.hosts), samples=1)
    for rank, v in views.items():             # keep the better clock measurement
        first = views_at_start.get(rank)
        if first is not None and first.rtt < v.rtt:
            v.offset, v.rtt = first.offset, first.rtt
    return build(begin=begin, end=end, status=status, records=records, views=views,
                 client_id=client_id, slices=slices, address=client.address,
                 controller_events=timeline.events, controller_offset=controller_offset)


def settled(client: Any, client_id: int | None, limit: float = SETTLE_S) -> None:
    """Wait (up to ``limit`` seconds) until the controller has heard that every
    computation of client ``client_id`` at the workers has finished. A result
    is fetched from the worker that holds it, and the worker's report of the
    computation goes to the controller on its own (and may be held while work
    is queued behind it), so the block can end before the controller's timeline
    has the computation whose result the block waited for."""
    if client_id is None:
        return
    deadline = time.monotonic() + limit
    while True:
        mine = [c for c in client.request(m.StatusRequest(False)).clients if c.id == client_id]
        if not mine or not mine[0].running or time.monotonic() >= deadline:
            return
        time.sleep(0.005)


def _controller_offset(client: Any, samples: int = CLOCK_SAMPLES) -> float:
    """The controller's clock against this one's: the time in its answer to an
    empty TimelineRequest against the middle of the round trip, from the
    quickest of ``samples`` round trips (a slow one, the controller busy or
    this process waiting for a core, can be off by half of it)."""
    best: tuple[float, float] | None = None
    for _ in range(samples):
        asked = time.time()
        answer = client.request(m.TimelineRequest(0))
        answered = time.time()
        if answer.now and (best is None or answered - asked < best[0]):
            best = (answered - asked, answer.now - (asked + answered) / 2)
    return best[1] if best is not None else 0.0


def write(path: str, doc: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(doc, f)


def start(client: Any) -> tuple[dict[int, HostView], list[m.ClientStatus]]:
    """As a trace starts: the workers' clock offsets, and the clients connected
    (their names, should they leave before it ends)."""
    status = client.request(m.StatusRequest(False))
    return ask_workers(client.ep.key, list(status.hosts), samples=CLOCK_SAMPLES), list(status.clients)


@contextlib.contextmanager
def trace(path: str, client: Any) -> Iterator[Recorder]:
    """Record what runs on the cluster while the block runs, and write it to
    ``path`` as Chrome Trace Event JSON (open it in ui.perfetto.dev). Written
    when the block ends, also when it raises. ``client``: a connected ``Client``."""
    if client.recorder is not None:
        raise RuntimeError("a zp.trace is already active on this connection")
    at_start = start(client)
    recorder = Recorder()
    begin = time.time()
    client.recorder = recorder
    try:
        yield recorder
    finally:
        client.recorder = None
        end = time.time()
        write(path, collect(client, begin, end, at_start, recorder.slices, client.client_id))


def record_cluster(client: Any, seconds: float, path: str, stop: threading.Event | None = None) -> dict[str, Any]:
    """``zpath trace``: what runs on the cluster for ``seconds`` (or until ``stop``)."""
    at_start = start(client)
    begin = time.time()
    (stop or threading.Event()).wait(seconds)
    doc = collect(client, begin, time.time(), at_start)
    write(path, doc)
    return doc
