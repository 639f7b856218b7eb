"""The controller process: one ROUTER socket that clients and workers connect
to, and a loop that hands each message to the resource manager, the program
registry or the directory, then sends what they decide."""
from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import faulthandler
import gc
import itertools
import logging
import os
import signal
import sys
import time
from typing import Any

import zmq

from zpath import sharding
from zpath.controller.directory import Directory, Plan, PlanError
from zpath.controller.resources import LostHosts, ResourceManager
from zpath.controller.scheduler import POLICIES, GangScheduler, Ready, TenantScheduler
from zpath.controller import templates
from zpath.errors import ProtocolError, ResourceError
from zpath.process import die_with_parent
from zpath.net import channels, codec
from zpath.net import messages as m
from zpath.net.codec import PROTOCOL_VERSION, Header, Record
from zpath.net.transport import BadMessage, Endpoint, make_context, unbatched
from zpath.config import HOLD_DEEP_S

log = logging.getLogger(__name__)

PING_INTERVAL_S = 1.0
STALL_S = 1.0            # the loop held up longer than this: not the peers' silence
# a worker silent this long is lost; a client silent this long has left
HOST_TIMEOUT_S = float(os.environ.get("ZPATH_HOST_TIMEOUT", "10"))
CLIENT_TIMEOUT_S = float(os.environ.get("ZPATH_CLIENT_TIMEOUT", "15"))
# bytes a device may hold (0: no limit); calls that would exceed it wait
DEVICE_MEMORY_LIMIT = int(float(os.environ.get("ZPATH_DEVICE_MEMORY_LIMIT", "0")))
# multi-tenant scheduling: policy, and estimated seconds of work kept queued at a device
POLICY = os.environ.get("ZPATH_SCHEDULER_POLICY", "share")
WINDOW_MS = float(os.environ.get("ZPATH_SCHEDULER_WINDOW_MS", "20"))
SOLO_WINDOW_MS = float(os.environ.get("ZPATH_SCHEDULER_SOLO_WINDOW_MS", "100"))
MAX_WEIGHT = 1e6
MAX_PROGRAM_BYTES = 256 << 20
TIMELINE_RECORDS = 100_000


@dataclasses.dataclass
class Peer:
    role: str                # "worker" or "client"
    id: int                  # host rank or client id
    name: str
    last_seen: float
    ident: bytes = b""
    weight: float = 1.0
    gone: bool = False


@dataclasses.dataclass
class InFlight:
    """A dispatched computation until every host reported it finished."""
    client: int
    client_ident: bytes
    name: str
    island: int
    seq: int
    devices: list[int]
    hosts: set[int]                        # hosts still running it
    host_devices: dict[int, int]           # host -> how many of its devices it uses
    outputs: list[int]
    pieces: list[tuple[int, int, int]]     # (piece id, source host, destination host)
    puts: list[int] = dataclasses.field(default_factory=list)   # inputs its client puts
    fused: bool = False                    # a fused run (its outputs live on several hosts)
    copies: list[tuple[int, dict]] = dataclasses.field(default_factory=list)   # see Plan.copies
    transient: dict[int, int] | None = None                                     # see Plan.transient
    error: m.ErrorInfo | None = None       # the first error a host reported


@dataclasses.dataclass
class _ProgramRun:
    """One submitted program: how many of its nodes have been sent."""
    peer: Peer
    release: list[int]
    total: int
    sent: int = 0
    released: bool = False
    sequential: bool = False          # dispatch="sequential": nodes wait for others' ExecDone


@dataclasses.dataclass
class _Submission:
    """Calls submitted together (a program, or one call), planned in order;
    ``next`` is the first node not planned yet (it waits for memory)."""
    ident: bytes
    peer: Peer
    calls: list[m.Call]
    dispatch: str
    run: _ProgramRun
    next: int = 0
    producer: dict[int, int] = dataclasses.field(default_factory=dict)
    exec_ids: dict[int, int] = dataclasses.field(default_factory=dict)
    # it waited for memory: the outputs of its calls from here on are pinned
    # (a release of one before its call is planned waits for the plan)
    pinned_from: int | None = None
    # under a memory limit: node index -> the program's buffers to release once
    # that node (their last reader) is planned, so a long program frees as it goes
    release_at: dict[int, list[int]] | None = None
    record: list[Plan] | None = None     # its plans, in order (to fuse a template)


@dataclasses.dataclass
class _HeldNode:
    """A node waiting to be sent: for computations it reads to finish
    (sequential programs), for held producers to be sent, or for its turn in
    the multi-tenant scheduler."""
    run: _ProgramRun
    call: m.Call
    planned: tuple[Plan, str]
    waits: set
    exec_id: int
    island: int


def _release_points(calls: list[m.Call], release: list[int]) -> dict[int, list[int]]:
    """For the buffers a program releases: the index of the node after which
    none reads them (the last that reads or writes each), as node -> buffers.
    A buffer no node names is left to the end of the program."""
    last: dict[int, int] = {}
    for k, call in enumerate(calls):
        for i in call.inputs:
            last[i.buffer] = k
        for o in call.outputs:
            last[o.buffer] = k
    out: dict[int, list[int]] = {}
    for b in release:
        if b in last:
            out.setdefault(last[b], []).append(b)
    return out


# after these, what handling them sends goes out before the next item of a batch
_FLUSH_AFTER = (m.Call, m.Program, m.RunProgram, m.DefineProgram)


def _buffers(call: m.Call) -> list[int]:
    return [i.buffer for i in call.inputs] + [o.buffer for o in call.outputs]


class Controller:
    def __init__(self, key: bytes, bind: str = "tcp://127.0.0.1:0", policy: str | None = None,
                 window_ms: float | None = None, solo_window_ms: float | None = None) -> None:
        self.ep = Endpoint(key, "controller")
        self.machine = channels.machine_id()   # lost hosts on this machine: their segments go
        self.ctx = make_context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if bind.rsplit(":", 1)[-1] in ("0", "*"):
            port = self.sock.bind_to_random_port(bind.rsplit(":", 1)[0])
            self.address = f"{bind.rsplit(':', 1)[0]}:{port}"
        else:
            self.sock.bind(bind)
            self.address = bind
        self.rm = ResourceManager()
        self.directory = Directory(lambda d: self.rm.devices[d].host,
                                   lambda h: self.rm.hosts[h].data_address,
                                   lambda d: self.rm.devices[d].jax_id, self.rm.route,
                                   mapping_version=lambda: self.rm.version)
        self.scheduler = GangScheduler(
            break_order=os.environ.get("ZPATH_DEBUG_BREAK_GANG_ORDER") == "1")
        self.tenants = TenantScheduler(POLICY if policy is None else policy,
                                       window_s=(WINDOW_MS if window_ms is None else window_ms) / 1000,
                                       solo_window_s=(SOLO_WINDOW_MS if solo_window_ms is None
                                                      else solo_window_ms) / 1000)
        # exec_id -> (client, name, island, seq, devices), until every host reported
        self.in_flight: dict[int, InFlight] = {}
        self.timeline: collections.deque[m.ExecRecord] = collections.deque(maxlen=TIMELINE_RECORDS)
        # held nodes, by what they wait for: an exec id (it finished) or
        # ("sent", exec id) (that held node was sent)
        self.waiters: dict[Any, list[_HeldNode]] = {}
        self.held_outputs: dict[int, int] = {}           # output buffer of a held node -> its exec id
        # submissions waiting for device memory, in arrival order (each resumes at
        # its first unplanned node); while any waits, new ones queue behind it
        self.memory_waiting: collections.deque[_Submission] = collections.deque()
        # buffers some of whose planned copies were dropped: nodes not sent yet
        # that read them are repaired before they go (until the buffer is freed)
        self.copies_dropped: set[int] = set()
        # buffer -> layouts of its copies that held nodes (not sent yet) are to make
        self.unsent_copies: dict[int, list[dict]] = {}
        self.unfinished: set[int] = set()   # exec ids of sequential programs' nodes not finished
        self.memory_limit = DEVICE_MEMORY_LIMIT
        self._resuming = False
        # held nodes whose waits are over, sent by one loop (never by recursion:
        # a chain of thousands of held nodes would overflow the stack)
        self._released: collections.deque[_HeldNode] = collections.deque()
        self._releasing = False
        # buffers read or written by held nodes: their release waits until the node is sent
        self.pinned: collections.Counter[int] = collections.Counter()
        self.deferred: dict[int, int] = {}               # pinned buffer -> owner that released it
        self.programs: dict[str, tuple[str, bytes]] = {}
        self.host_programs: dict[int, set[str]] = {}
        # (client, template) -> its program template; fused plans sent to each host
        self.templates: dict[tuple[int, int], templates.ProgramTemplate] = {}
        self.host_fused: dict[int, set[int]] = {}
        self.fused_live: set[int] = set()      # fused ids of templates still kept
        self._fused_ids = itertools.count(1)
        self.peers: dict[bytes, Peer] = {}
        self.worker_ident: dict[int, bytes] = {}
        self.client_ids = 0
        self.host_stores: dict[int, tuple[int, int]] = {}   # rank -> (shards, bytes) from Pong
        self.device_held: dict[int, int] = {}               # device -> bytes its worker holds (Pong)
        self.calls = 0
        self.running = True
        # messages held while one received message is handled (see send):
        # (message, parent, 0, body) per peer
        self._out: dict[bytes, list[tuple]] | None = None

    # ---- sending -------------------------------------------------------------
    def send(self, ident: bytes, msg: Record, parent: int = 0, buffers: Any = ()) -> None:
        """Send without ever blocking the controller: a peer that has stopped
        reading (its queue is full) or is gone loses the message, with a log line.

        While a received message is handled (``self._out`` is a dict), messages
        without buffers are held and go out when it is done, one Batch per peer
        in the order they were sent: a program's nodes reach a host as one
        message, and an ExecDone's frees and next Execute as one."""
        out = self._out
        if out is not None:
            if not buffers:
                # encoded now, so a message that cannot be fails here, alone
                item = (msg, parent, 0, codec.pack_body(msg))
                pending = out.get(ident)
                if pending is None:
                    out[ident] = [item]
                else:
                    pending.append(item)
                return
            pending = out.pop(ident, None)      # keep this peer's order
            if pending:
                self._send_now(ident, pending)
        try:
            self.ep.send(self.sock, msg, to=ident, parent=parent, buffers=buffers, block=False)
        except zmq.Again:
            self._dropped(ident, type(msg).__name__)
        except zmq.ZMQError as e:
            log.warning("cannot send %s to %r: %s", type(msg).__name__, ident, e)

    def _send_now(self, ident: bytes, msgs: list[tuple]) -> None:
        try:
            for msg, _, e in self.ep.send_batch(self.sock, msgs, to=ident, block=False):
                log.error("cannot send %s to %r: %s", type(msg).__name__, ident, e)
        except zmq.Again:
            self._dropped(ident, ", ".join(sorted({type(x[0]).__name__ for x in msgs})))
        except zmq.ZMQError as e:
            log.warning("cannot send %d messages to %r: %s", len(msgs), ident, e)
        except Exception:     # an unencodable message is a bug: lose it, not the loop
            log.exception("cannot send %d messages to %r", len(msgs), ident)

    def _flush_out(self) -> None:
        """Send what ``send`` held, and stop holding."""
        out, self._out = self._out, None
        if out:
            for ident, msgs in out.items():
                self._send_now(ident, msgs)

    def _dropped(self, ident: bytes, what: str) -> None:
        peer = self.peers.get(ident)
        log.error("%s %s is not reading its messages (queue full): dropped %s",
                  peer.role if peer else "peer", peer.id if peer else repr(ident), what)

    def reply_error(self, ident: bytes, parent: int, code: str, text: str) -> None:
        self.send(ident, m.Error(code, text), parent)

    def to_host(self, rank: int, msg: Record, buffers: Any = ()) -> None:
        ident = self.worker_ident.get(rank)
        if ident is None:
            log.warning("host %d is gone: %s not sent", rank, type(msg).__name__)
            return
        self.send(ident, msg, buffers=buffers)

    # ---- loop ----------------------------------------------------------------
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        next_ping = heard_until = time.monotonic()
        seq = 0
        log.info("controller listening on %s", self.address)
        while self.running:
            now = time.monotonic()
            busy = now - heard_until
            if busy > STALL_S:
                # this loop was held up (a huge message, a long plan) and pinged
                # no one: that time, beyond STALL_S, does not count as the peers'
                # silence (so back-to-back long handlings still let it count)
                log.warning("controller loop was busy for %.1fs", busy)
                for peer in self.peers.values():
                    peer.last_seen = min(now, peer.last_seen + busy - STALL_S)
            if now >= next_ping:
                seq += 1
                for rank, ident in self.worker_ident.items():
                    self.send(ident, m.Ping(seq))
                next_ping = now + PING_INTERVAL_S
                self._out = {}
                try:
                    self._check_liveness(now)
                except Exception:  # a bug here must not take the controller down
                    log.exception("error while checking hosts and clients")
                finally:
                    self._flush_out()
            events = dict(poller.poll(timeout=max(1, int((next_ping - now) * 1000))))
            heard_until = time.monotonic()
            for _ in events:
                self._recv_all()
        self._stop_workers("controller shutting down")
        self.sock.close(linger=200)          # those Shutdowns get a moment to leave
        self.ctx.term()

    def _recv_all(self, budget: int = 1000) -> None:
        """Handle waiting messages, at most ``budget`` of them, so the loop gets
        back to its timers (pings) even under a flood."""
        while budget > 0:
            if not self.running:
                return
            try:
                ident, header, msg, buffers = self.ep.recv(self.sock, router=True, block=False)
            except zmq.Again:
                return
            except BadMessage as e:
                self._bad(e)
                budget -= 1
                continue
            # What handling a message sends goes out coalesced, one Batch per
            # peer (see send): for a batch, when it is done, except after a
            # Call or Program, whose work is sent before the next is planned
            # (the first call of a burst is not held back by the rest).
            msgs = unbatched(header, msg, buffers)
            budget -= len(msgs)
            self._out = {}
            try:
                for header, msg, buffers in msgs:
                    if isinstance(msg, ProtocolError):      # one bad item of a batch
                        self._bad(BadMessage(str(msg), ident, header))
                        continue
                    self._handle_safely(ident, header, msg, buffers)
                    if type(msg) in _FLUSH_AFTER:
                        self._flush_out()
                        self._out = {}
            finally:
                self._flush_out()
            if not self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return

    def _handle_safely(self, ident: bytes, header: Header, msg: Record, buffers: list) -> None:
        try:
            self.handle(ident, header, msg, buffers)
        except Exception:  # a handler bug must not take the controller down
            log.exception("error handling %s from %s", type(msg).__name__, header.sender)
            if isinstance(msg, m.Call) and ident in self.peers:   # fail its futures, don't leave them waiting
                self._fail_call(ident, self.peers[ident].id, msg, m.ErrorInfo(
                    "RemoteError", "the controller failed planning this call (see its log)", None, "", ""))
            else:
                self.reply_error(ident, header.msg_id, "internal",
                                 f"controller failed handling {type(msg).__name__}")

    def _bad(self, e: BadMessage) -> None:
        who = self.peers.get(e.ident) if e.ident else None
        log.warning("rejected message from %s: %s",
                    f"{who.role} {who.id}" if who else repr(e.ident), e)
        if e.ident is not None:
            self.reply_error(e.ident, e.header.msg_id if e.header else 0, "protocol", str(e))

    def stop(self, *_: Any) -> None:
        self.running = False

    def _stop_workers(self, reason: str) -> None:
        """Tell the workers to stop, and the clients that it is over (they fail
        what waits rather than wait for it)."""
        for ident in self.worker_ident.values():
            self.send(ident, m.Shutdown(reason))
        for peer in self.peers.values():
            if peer.role == "client":
                try:           # best effort: a client may be gone without a word
                    self.ep.send(self.sock, m.Shutdown(reason), to=peer.ident, block=False)
                except zmq.ZMQError:
                    pass

    # ---- handlers ------------------------------------------------------------
    def handle(self, ident: bytes, header: Header, msg: Record, buffers: list) -> None:
        peer = self.peers.get(ident)
        if peer is not None:
            peer.last_seen = time.monotonic()
        parent = header.msg_id
        match msg:
            case m.RegisterWorker():
                self._register_worker(ident, parent, msg)
            case m.Hello():
                if msg.protocol != PROTOCOL_VERSION:
                    self.reply_error(ident, parent, "protocol",
                                     f"client speaks protocol {msg.protocol}, controller {PROTOCOL_VERSION}")
                    return
                if not 0 < msg.weight <= MAX_WEIGHT:
                    self.reply_error(ident, parent, "bad_request",
                                     f"weight must be > 0 and <= {MAX_WEIGHT:g}, not {msg.weight!r}")
                    return
                if ident in self.peers:
                    self.reply_error(ident, parent, "bad_request", "already connected")
                    return
                self.client_ids += 1
                self.peers[ident] = Peer("client", self.client_ids, msg.name, time.monotonic(), ident,
                                         msg.weight)
                self.tenants.add_client(self.client_ids, msg.weight)
                log.info("client %d (%s, weight %g) connected", self.client_ids, msg.name, msg.weight)
                self.send(ident, m.Welcome(self.client_ids, self._host_infos()), parent)
            case m.StatusRequest():
                stores = [m.HostStatus(r, *self.host_stores.get(r, (0, 0))) for r in self.rm.hosts]
                lost = [m.HostInfo(h.rank, h.island, h.name, h.data_address,
                                   [self._device_info(d) for d in h.devices])
                        for h in self.rm.hosts.values() if not h.alive]
                self.send(ident, m.Status(self._host_infos(), stores, self._client_status(),
                                          len(self.directory.buffers), len(self.programs), self.calls,
                                          lost, len(self.in_flight), self._queued(),
                                          [m.DeviceUsage(d.id, d.host, self.directory.device_bytes[d.id],
                                                         self.device_held.get(d.id, 0))
                                           for d in self.rm.devices.values()],
                                          self.tenants.policy), parent)
            case m.Pong() if peer is not None:
                if peer.role == "worker":
                    self.host_stores[peer.id] = (msg.shards, msg.nbytes)
                    devices = self.rm.hosts[peer.id].devices
                    if len(msg.device_bytes) == len(devices):
                        self.device_held.update(zip(devices, msg.device_bytes))
            case m.Ping() if peer is not None:
                self.send(ident, m.Pong(msg.seq, 0, 0, []), parent)
            case m.Goodbye() if peer is None:
                pass            # a connection already dropped: nothing to answer
            case _ if peer is None:
                self.reply_error(ident, parent, "not_registered",
                                 f"{type(msg).__name__} before Hello/RegisterWorker")
            case m.AllocSlice() if peer.role == "client":
                try:
                    sid, devs = self.rm.alloc_slice(msg.devices, island=msg.island, host=msg.host)
                except ResourceError as e:
                    self.reply_error(ident, parent, "resource", str(e))
                    return
                self.send(ident, m.SliceAllocated(sid, [self._device_info(d) for d in devs]), parent)
            case m.RegisterProgram() if peer.role == "client":
                self._register_program(ident, parent, msg, buffers)
            case m.Call() if peer.role == "client":
                self._call(ident, peer, msg)
            case m.Program() if peer.role == "client":
                self._program(ident, peer, msg)
            case m.DefineProgram() if peer.role == "client":
                self._define_program(ident, parent, peer, msg)
            case m.RunProgram() if peer.role == "client":
                self._run_program(ident, peer, msg)
            case m.DropTemplates() if peer.role == "client":
                self._drop_templates(peer, msg.templates)
            case m.ExplainRequest() if peer.role == "client":
                self._explain(ident, parent, peer, msg)
            case m.Locate() if peer.role == "client":
                self.send(ident, self._locate(peer.id, msg.buffer), parent)
            case m.ExecDone() if peer.role == "worker":
                self._exec_done(peer.id, msg)
            case m.TimelineRequest():
                recs = list(self.timeline)[-msg.limit:] if msg.limit > 0 else []
                self.send(ident, m.Timeline(recs), parent)
            case m.Release() if peer.role == "client":
                self._release(msg.buffers, peer.id)
            case m.Goodbye() if peer.role == "client":
                log.info("client %d (%s) disconnected: %s", peer.id, peer.name, msg.reason)
                self._client_left(peer)
            case m.Error():
                log.warning("%s %d reported an error: %s: %s", peer.role, peer.id, msg.code, msg.message)
            case _:
                self.reply_error(ident, parent, "bad_request",
                                 f"{type(msg).__name__} is not accepted from a {peer.role}")

    def _locate(self, client: int, buffer: int) -> m.Location:
        """A surviving copy of a client's buffer: the first layout whose every
        region is on a live host (the directory forgets copies on lost hosts)."""
        buf = self.directory.buffers.get(buffer)
        if buf is None or buf.owner != client:
            return m.Location(buffer, [], [], m.ErrorInfo(
                "HostLost", f"buffer {buffer} is not known (its last copy may have been lost)", None, "", ""))
        if buf.error is not None:
            return m.Location(buffer, [], [], buf.error)
        for lay in buf.made_layouts():
            devices = [next((d for d in devs if self.rm.hosts[self.rm.devices[d].host].alive), None)
                       for devs in lay.values()]
            if lay and None not in devices:
                return m.Location(buffer, [sharding.to_wire(r) for r in lay], devices, None)
        return m.Location(buffer, [], [], m.ErrorInfo(
            "HostLost", f"no copy of buffer {buffer} is left on a live host", None, "", ""))

    def _queued(self, client: int | None = None) -> int:
        held = {id(h) for waiting in self.waiters.values() for h in waiting
                if client is None or h.run.peer.id == client}
        return len(held) + self.tenants.queued(client) + sum(
            len(s.calls) - s.next for s in self.memory_waiting if client is None or s.peer.id == client)

    def _client_status(self) -> list[m.ClientStatus]:
        running = collections.Counter(inf.client for inf in self.in_flight.values())
        return [m.ClientStatus(p.id, p.name, p.weight, self.tenants.used[p.id], running[p.id],
                               self._queued(p.id))
                for p in self.peers.values() if p.role == "client"]

    def _register_worker(self, ident: bytes, parent: int, msg: m.RegisterWorker) -> None:
        if msg.protocol != PROTOCOL_VERSION:
            self.reply_error(ident, parent, "protocol",
                             f"worker speaks protocol {msg.protocol}, controller {PROTOCOL_VERSION}")
            return
        if ident in self.peers:
            self.reply_error(ident, parent, "bad_request", "already registered")
            return
        try:
            host = self.rm.add_host(name=msg.name, island=msg.island, data_address=msg.data_address,
                                    pid=msg.pid, platform=msg.platform, num_devices=msg.num_devices,
                                    jax_ids=msg.jax_ids,
                                    runtime=msg.coordinator if msg.num_processes > 1 else "",
                                    machine=msg.machine, public_key=msg.public_key,
                                    dcn_address=msg.dcn_address)
        except ResourceError as e:
            self.reply_error(ident, parent, "resource", str(e))
            return
        self.peers[ident] = Peer("worker", host.rank, msg.name, time.monotonic(), ident)
        self.worker_ident[host.rank] = ident
        self.host_programs[host.rank] = set()
        log.info("host %d registered: %s island %d, %d %s devices, data %s", host.rank, msg.name,
                 msg.island, msg.num_devices, msg.platform, msg.data_address)
        self.send(ident, m.Registered(host.rank, [self._device_info(d) for d in host.devices]), parent)

    def _register_program(self, ident: bytes, parent: int, msg: m.RegisterProgram,
                          buffers: list) -> None:
        if len(buffers) != 1 or buffers[0].nbytes > MAX_PROGRAM_BYTES:
            self.reply_error(ident, parent, "bad_request", "RegisterProgram needs one buffer "
                             f"of at most {MAX_PROGRAM_BYTES} bytes")
            return
        blob = bytes(buffers[0])
        if hashlib.sha256(blob).hexdigest() != msg.digest:
            self.reply_error(ident, parent, "bad_request", f"program {msg.name!r}: sha256 does not "
                             "match its digest")
            return
        self.programs.setdefault(msg.digest, (msg.name, blob))

    def _plan(self, ident: bytes, peer: Peer, call: m.Call, directory: Directory | None = None
              ) -> tuple[Plan, str] | None:
        """Plan one call, or fail it: its outputs are poisoned and the client is
        told (CallFailed). ``directory`` (a scratch copy) plans without effect."""
        self.calls += directory is None
        prog = self.programs.get(call.program)
        try:
            if prog is None:
                raise PlanError("not_found", f"program {call.program[:12]} is not registered")
            try:
                self.rm.check_spmd(call.devices)
            except LostHosts as e:
                lost = self.rm.hosts[e.hosts[0]]
                raise PlanError("resource", str(e), m.ErrorInfo(
                    "HostLost", f"host {lost.rank} ({lost.name}, island {lost.island}) was lost"
                    f"{': ' + lost.lost_why if lost.lost_why else ''}; this computation cannot run there",
                    lost.rank, prog[0], "")) from None
            except ResourceError as e:
                raise PlanError("resource", str(e)) from None
            theirs = [b for b in [o.buffer for o in call.outputs] + [i.buffer for i in call.inputs if i.put]
                      if b >> 32 != peer.id]
            if theirs:
                raise PlanError("bad_request", f"buffer ids {theirs[:4]} are not this client's "
                                f"(client {peer.id} names new buffers {peer.id} << 32 | n)")
            return (directory or self.directory).plan(call, peer.id, prog[0]), prog[0]
        except PlanError as e:
            if directory is not None:
                raise
            err = e.error or m.ErrorInfo("CallFailed", f"call rejected: {e}", None,
                                         prog[0] if prog else "", "")
            self._fail_call(ident, peer.id, call, err)
            self._free_puts(call)
            return None

    def _free_puts(self, call: m.Call) -> None:
        """Shards the client already put for a call that will not run: free them
        where they went."""
        puts = [i.buffer for i in call.inputs if i.put and i.buffer not in self.directory.buffers]
        hosts = {self.rm.devices[d].host for d in call.devices if d in self.rm.devices}
        if puts:
            self._free({h: puts for h in hosts})

    def _fail_call(self, ident: bytes, client: int, call: m.Call, err: m.ErrorInfo) -> None:
        """Fail a call that will not run: its outputs are poisoned (so consumers fail
        with the same cause) and the client is told. Only outputs that are new and
        in the sender's own id range: never an existing buffer, nor one another
        client may still create."""
        outs = [o.buffer for o in call.outputs if o.buffer not in self.directory.buffers]
        self.directory.poison([b for b in outs if b >> 32 == client], client, err)
        self.send(ident, m.CallFailed(call.call_id, outs, err))

    def _dispatch(self, peer: Peer, call: m.Call, plan: Plan, name: str, hold: bool = False) -> int:
        """Send a planned call to its hosts in gang order (``hold``: see
        ``Execute.hold``); returns its exec id."""
        drop_after: list[tuple[int, m.DropFused]] = []
        for rank in plan.executes:
            for digest in plan.programs if plan.programs is not None else [call.program]:
                if digest not in self.host_programs[rank]:
                    pname, blob = self.programs[digest]
                    self.to_host(rank, m.RegisterProgram(digest, pname), buffers=[blob])
                    self.host_programs[rank].add(digest)
            if plan.setup is not None:
                define = plan.setup[rank]
                if define.fused not in self.host_fused.setdefault(rank, set()):
                    self.to_host(rank, define)
                    if define.fused in self.fused_live:
                        self.host_fused[rank].add(define.fused)
                    else:                 # dropped while this run waited: forgotten after it
                        drop_after.append((rank, m.DropFused([define.fused])))
        for rank, piece in plan.sends:
            self.to_host(rank, piece)
        island = self.rm.hosts[next(iter(plan.executes))].island
        ordered = self.scheduler.dispatch(island, plan.executes, hold)
        exec_id = next(iter(plan.executes.values())).exec_id
        self.in_flight[exec_id] = InFlight(
            peer.id, peer.ident, name, island, self.scheduler.next_seq[island] - 1, call.devices,
            set(plan.executes), collections.Counter(self.rm.devices[d].host for d in call.devices),
            [o.buffer for o in call.outputs],
            [(piece.piece_id, src, piece.dst_host) for src, piece in plan.sends],
            [i.buffer for i in call.inputs if i.put], plan.setup is not None, plan.copies,
            plan.transient)
        for rank, ex in ordered:
            self.to_host(rank, ex)
        for rank, drop in drop_after:
            self.to_host(rank, drop)
        return exec_id

    def _call(self, ident: bytes, peer: Peer, call: m.Call) -> None:
        # a one-node program; the values the client put for it have no future and
        # are freed once it was sent (workers free after it ran)
        self._submit(ident, peer, [call], "parallel", [i.buffer for i in call.inputs if i.put])

    def _program(self, ident: bytes, peer: Peer, prog: m.Program) -> None:
        """A traced program: plan every node now; send them all at once
        (parallel) or each once the nodes it reads have finished (sequential)."""
        if prog.dispatch not in ("parallel", "sequential"):
            err = m.ErrorInfo("CallFailed", f"unknown dispatch mode {prog.dispatch!r}", None, prog.name, "")
            for call in prog.calls:
                self._fail_call(ident, peer.id, call, err)
            return
        self._submit(ident, peer, prog.calls, prog.dispatch, prog.release)

    def _submit(self, ident: bytes, peer: Peer, calls: list[m.Call], dispatch: str,
                release: list[int], record: bool = False) -> "_Submission":
        sub = _Submission(ident, peer, calls, dispatch,
                          _ProgramRun(peer, release, len(calls), sequential=dispatch == "sequential"),
                          record=[] if record else None)
        if self.memory_waiting:          # keep arrival order behind waiting work
            self._pin_waiting(sub)
            self.memory_waiting.append(sub)
        elif not self._advance(sub):
            self.memory_waiting.append(sub)
        return sub

    # ---- program templates and fused runs (see templates.py) ------------------------
    def _define_program(self, ident: bytes, parent: int, peer: Peer, msg: m.DefineProgram) -> None:
        """Keep a program as a template (if it is a valid one), and run it."""
        key = (peer.id, msg.template)
        try:
            if key in self.templates:
                raise templates.TemplateError(f"template {msg.template} is already defined")
            if sum(1 for c, _ in self.templates if c == peer.id) >= templates.MAX_TEMPLATES:
                raise templates.TemplateError(f"a client keeps at most {templates.MAX_TEMPLATES} templates")
            t = templates.ProgramTemplate(msg, peer.id)
        except templates.TemplateError as e:
            self.reply_error(ident, parent, "bad_request", f"program {msg.program.name!r} not kept "
                             f"as template {msg.template}: {e}")
            self._program(ident, peer, msg.program)
            return
        self.templates[key] = t
        self._run_expanded(ident, peer, t, msg.program.program_id, msg.inputs, msg.first_buffer,
                           msg.program.calls, msg.program.release)

    def _run_program(self, ident: bytes, peer: Peer, msg: m.RunProgram) -> None:
        """One run of a template: fused if it can be, else as its plain calls."""
        t = self.templates.get((peer.id, msg.template))
        try:
            if t is None:
                raise templates.TemplateError(f"template {msg.template} is not defined")
            t.check_run(peer.id, msg.inputs, msg.first_buffer)
            taken = next((b for b in range(msg.first_buffer, msg.first_buffer + t.buffers)
                          if b in self.directory.buffers), None)
            if taken is not None:
                raise templates.TemplateError(f"new buffer {taken} exists already")
        except templates.TemplateError as e:
            err = m.ErrorInfo("CallFailed", f"program run rejected: {e}", None, t.name if t else "", "")
            outs = [b for b in msg.outputs if b >> 32 == peer.id and b not in self.directory.buffers]
            self.directory.poison(outs, peer.id, err)
            self.send(ident, m.CallFailed(msg.program_id, outs, err))
            # values the client may have put for it: freed wherever they went
            puts = [b for b in msg.inputs if b >> 32 == peer.id and b not in self.directory.buffers]
            if puts:
                self._free({h.rank: puts for h in self.rm.hosts.values() if h.alive})
            return
        if t.fused is not None and self._run_fused(peer, t, t.fused, msg):
            return
        calls, release = t.expand(msg.program_id, msg.inputs, msg.first_buffer)
        self._run_expanded(ident, peer, t, msg.program_id, msg.inputs, msg.first_buffer, calls, release)

    def _run_expanded(self, ident: bytes, peer: Peer, t: templates.ProgramTemplate, call_id: int,
                      inputs: list[int], first: int, calls: list[m.Call], release: list[int]) -> None:
        """Run a template's plain calls; when it may be fused, record their plans
        and fuse it from them."""
        fuse = self._may_fuse(t)
        before = t.slot_keys(self.directory.buffers, inputs) if fuse else []
        sub = self._submit(ident, peer, calls, "parallel", release, record=fuse)
        if not fuse or sub.next < len(calls):
            return
        t.fuse_tries += 1
        island_of = {h: self.rm.hosts[h].island for p in sub.record for h in p.executes}
        host_of = {d: self.rm.devices[d].host for p in sub.record for ex in p.executes.values()
                   for d in ex.devices}
        t.fused = t.fuse(next(self._fused_ids), self.rm.version, sub.record, island_of, host_of, before,
                         self.directory.buffers, inputs, first)
        if t.fused is not None:
            self.fused_live.add(t.fused.id)
            log.info("client %d: program %s fused (%d nodes on %d hosts)", peer.id, t.name,
                     len(calls), len(t.fused.hosts))

    def _may_fuse(self, t: templates.ProgramTemplate) -> bool:
        """Not while work waits for memory (it keeps its place in line)."""
        if self.memory_waiting:
            return False
        if t.fused is not None and t.fused.version == self.rm.version:
            return False                  # fused, but this run could not use it
        if t.fused is not None:           # the mapping changed: fuse again
            self._drop_fused({t.fused.id})
            t.fused, t.fuse_tries = None, 0
        return t.fuse_tries < templates.FUSE_TRIES

    def _release_transient(self, transient: dict[int, int] | None, resume: bool = True) -> None:
        """What a fused run held only while it ran is free again (``resume``:
        let work that waits for memory go on now)."""
        if transient:
            self.directory.device_bytes.subtract(transient)
            if resume and self.memory_waiting:
                self._resume_waiting()

    def _drop_templates(self, peer: Peer, numbers: list[int]) -> None:
        """The client will not run these templates again: forget them."""
        fused = set()
        for n in numbers:
            t = self.templates.pop((peer.id, n), None)
            if t is not None and t.fused is not None:
                fused.add(t.fused.id)
        self._drop_fused(fused)

    def _drop_fused(self, fused: set[int]) -> None:
        """Hosts that keep these fused programs forget them."""
        self.fused_live -= fused
        for rank, ids in self.host_fused.items():
            drop = ids & fused
            if drop:
                ids -= drop
                if rank in self.worker_ident and self.rm.hosts[rank].alive:
                    self.to_host(rank, m.DropFused(sorted(drop)))

    def _run_fused(self, peer: Peer, t: templates.ProgramTemplate, f: templates.Fused,
                   msg: m.RunProgram) -> bool:
        """Send a run as one fused computation; False (nothing done) if this run
        cannot be: the mapping changed, a host was lost, an input is not where
        the fused plan reads it, a result exists already, or, under a memory
        limit, work waits for memory or the run would not fit (its results, values
        put and intermediates; as plain calls it waits its turn)."""
        if f.version != self.rm.version or self.memory_waiting:
            return False
        if not all(self.rm.hosts[h].alive for h in f.hosts):
            return False
        if t.slot_keys(self.directory.buffers, msg.inputs) != f.slot_keys:
            return False
        if (self.unsent_copies or self.copies_dropped) and any(
                b in self.unsent_copies or b in self.copies_dropped for b in msg.inputs):
            return False          # it may read a copy not made yet: plain calls move it (_send)
        made = templates.fused_buffers(f, peer.id, msg.inputs, msg.first_buffer)
        ids = [buf.id for buf, _ in made]
        if len(set(ids)) != len(ids) or any(msg.first_buffer <= b < msg.first_buffer + t.buffers
                                            for b in ids[:len(f.puts)]):
            return False          # planned as plain calls, which refuse them
        if self.memory_limit:
            need = collections.Counter(f.transient)
            for _, footprint in made:
                need.update(footprint)
            if any(self.directory.device_bytes[d] + n > self.memory_limit for d, n in need.items()):
                return False
        for buf, footprint in made:
            self.directory.buffers[buf.id] = buf
            self.directory.device_bytes.update(footprint)
        self.directory.device_bytes.update(f.transient)     # until it has run
        self.calls += f.nodes
        call = templates.fused_call(f, msg.program_id, msg.inputs, msg.first_buffer)
        exec_id = self.directory.new_exec_id()
        plan = templates.run_plan(f, exec_id, msg.inputs, msg.first_buffer)
        # the values put are released once it is sent (workers free them after it ran)
        run = _ProgramRun(peer, [msg.inputs[s] for s, *_ in f.puts], 1)
        self._start(_HeldNode(run, call, (plan, f"{t.name} ({f.nodes} nodes, fused)"),
                              self._held_producers(call), exec_id, f.island))
        self._maybe_release(run)
        return True

    def _node_done(self, sub: "_Submission", k: int, call: m.Call) -> None:
        """Node ``k`` of a submission was planned (or failed): it no longer pins
        what it reads and writes for a wait for memory, and the program's buffers
        it was the last to read are released (held nodes that still read them keep
        them until sent; workers free them after the computations before have run)."""
        if sub.pinned_from is not None and k >= sub.pinned_from:
            self._unpin(_buffers(call))
        if sub.release_at:
            done = sub.release_at.pop(k, None)
            if done:
                self._release(done, sub.peer.id)

    def _drop_waiting(self, sub: "_Submission") -> None:
        """A waiting submission of a client that left: free what the client put
        for its calls not planned yet, unpin them, release the program's values."""
        for call in sub.calls[sub.next:]:
            self._free_puts(call)
            if sub.pinned_from is not None:
                self._unpin(_buffers(call))
        sub.run.sent = sub.run.total
        self._maybe_release(sub.run)

    def _pin_waiting(self, sub: "_Submission") -> None:
        """A submission starts waiting for memory: pin what its calls not
        planned yet read and write, so a release of their inputs or of their
        outputs' futures meanwhile waits until they are planned."""
        if sub.pinned_from is None:
            sub.pinned_from = sub.next
            for call in sub.calls[sub.next:]:
                self.pinned.update(_buffers(call))

    def _resume_waiting(self) -> None:
        """Memory was freed: continue waiting submissions, oldest first. Not
        re-entered: frees made while a submission advances are seen by the
        outer call (it checks memory again for every node)."""
        if self._resuming:
            return
        self._resuming = True
        try:
            while self.memory_waiting:
                sub = self.memory_waiting[0]
                if sub.peer.gone:
                    self.memory_waiting.popleft()
                    self._drop_waiting(sub)
                    continue
                if not self._advance(sub):
                    if not self._backfill():
                        return
                    continue                   # memory may have been freed: the head again
                if self.memory_waiting and self.memory_waiting[0] is sub:
                    self.memory_waiting.popleft()
        finally:
            self._resuming = False

    def _backfill(self) -> bool:
        """The head of the memory queue must wait. A later submission that keeps
        alive a value whose future was dropped (its release waits for it) and
        depends on nothing still waiting (every input it reads exists, or is made
        by its own earlier nodes) goes ahead if it fits: otherwise a head that
        needs that value's memory would wait for ever. Everything else keeps
        arrival order. Returns whether one was planned in full (and left the queue)."""
        for sub in list(self.memory_waiting)[1:]:
            if sub.peer.gone or not self._holds_deferred(sub) or not self._independent(sub):
                continue
            if self._advance(sub):
                self.memory_waiting.remove(sub)
                return True
        return False

    def _holds_deferred(self, sub: "_Submission") -> bool:
        return any(b in self.deferred for call in sub.calls[sub.next:] for b in _buffers(call))

    def _independent(self, sub: "_Submission") -> bool:
        made = set()
        for call in sub.calls[sub.next:]:
            for i in call.inputs:
                if not i.put and i.buffer not in made and i.buffer not in self.directory.buffers:
                    return False
            made.update(o.buffer for o in call.outputs)
        return True

    def _fits(self, sub: "_Submission", call: m.Call) -> str:
        """"ok", "wait" (for memory to be freed), or "failed": a call that can
        never fit under the per-device limit fails at once."""
        if not self.memory_limit:
            return "ok"
        for d in call.devices:
            dev = self.rm.devices.get(d)
            if dev is None or not self.rm.hosts[dev.host].alive:
                return "ok"               # planning rejects it (HostLost), rather than wait for ever
        for i in call.inputs:
            if not i.put:
                buf = self.directory.buffers.get(i.buffer)
                if buf is None or buf.error is not None:
                    return "ok"           # planning rejects it (its input is gone or failed)
        for d, n in self.directory.needs(call).items():
            if n > self.memory_limit:
                err = m.ErrorInfo("ResourceError", f"call needs {n} bytes on device {d}, more than "
                                  f"the per-device limit of {self.memory_limit} bytes", None, "", "")
                self._fail_call(sub.ident, sub.peer.id, call, err)
                return "failed"
            if self.directory.device_bytes[d] + n > self.memory_limit:
                return "wait"
        return "ok"

    def _advance(self, sub: "_Submission") -> bool:
        """Plan a submission's nodes in order and send each when it may go; stop
        (returning False) at a node that must wait for memory. A node is held
        until every held node whose output it reads has been sent (so it never
        reaches a worker ahead of its producer), and in sequential mode until the
        nodes of its program it reads have finished."""
        ident, peer, calls, dispatch, run = sub.ident, sub.peer, sub.calls, sub.dispatch, sub.run
        producer, exec_ids = sub.producer, sub.exec_ids
        first = sub.next
        if self.memory_limit and run.release and len(calls) > 1 and sub.release_at is None:
            sub.release_at = _release_points(calls, run.release)
        while sub.next < len(calls):
            k, call = sub.next, calls[sub.next]
            fits = self._fits(sub, call)
            if fits == "wait":
                self._pin_waiting(sub)
                return False
            sub.next += 1
            if fits == "failed":
                self._free_puts(call)        # what the client put for it
                run.sent += 1
                self._node_done(sub, k, call)
                continue
            preds = {producer[i.buffer] for i in call.inputs if i.buffer in producer}
            for o in call.outputs:
                producer[o.buffer] = k
            planned = self._plan(ident, peer, call)
            if planned is None:
                run.sent += 1
                self._node_done(sub, k, call)
                continue
            if sub.record is not None:
                sub.record.append(planned[0])
            exec_ids[k] = next(iter(planned[0].executes.values())).exec_id
            waits = self._held_producers(call)
            if dispatch == "sequential":
                # predecessors that have not finished (after a wait for memory,
                # some may have finished or been abandoned already)
                self.unfinished.add(exec_ids[k])
                waits |= {exec_ids[p] for p in preds if exec_ids.get(p) in self.unfinished}
            plan = planned[0]
            self._start(_HeldNode(run, call, planned, waits, exec_ids[k],
                                  self.rm.hosts[next(iter(plan.executes))].island))
            self._node_done(sub, k, call)
            done = sub.next - first
            if done & (done - 1) == 0 and sub.next < len(calls) and self._out is not None:
                # after nodes 1, 2, 4, 8, ... of those planned here: what is
                # ready goes out now, so the workers start while the rest of a
                # long program is planned (the last group goes with whatever
                # else handling this message sends)
                self._flush_out()
                self._out = {}
        self._maybe_release(run)
        return True

    def _held_producers(self, call: m.Call) -> set:
        """What a node must wait for before it is sent: the held nodes whose
        outputs it reads (as ("sent", exec id))."""
        return {("sent", self.held_outputs[i.buffer]) for i in call.inputs
                if i.buffer in self.held_outputs}

    def _start(self, held: "_HeldNode") -> None:
        """A planned node goes to the multi-tenant scheduler now, or is held
        until what it waits for has happened."""
        if not held.waits:
            self._ready(held, holding=False)
            return
        for w in held.waits:
            self.waiters.setdefault(w, []).append(held)
        self._hold(held)

    def _hold(self, held: "_HeldNode") -> None:
        """A node is not sent yet: buffers it reads or writes are not freed, and
        nodes that read its outputs wait until it is sent."""
        self.pinned.update(_buffers(held.call))
        for o in held.call.outputs:
            self.held_outputs[o.buffer] = held.exec_id
        for b, lay in held.planned[0].copies:
            self.unsent_copies.setdefault(b, []).append(lay)

    def _unhold(self, held: "_HeldNode") -> None:
        for o in held.call.outputs:
            self.held_outputs.pop(o.buffer, None)
        for b, lay in held.planned[0].copies:
            left = [u for u in self.unsent_copies.get(b, ()) if u is not lay]
            if left:
                self.unsent_copies[b] = left
            else:
                self.unsent_copies.pop(b, None)
        self._unpin(_buffers(held.call))

    def _unpin(self, buffers: list[int]) -> None:
        """Take one pin off each of ``buffers`` (a call may name one twice);
        releases deferred meanwhile go ahead for those no longer pinned."""
        self.pinned.subtract(buffers)
        ready = []
        for b in dict.fromkeys(buffers):
            if self.pinned.get(b, 0) <= 0:
                self.pinned.pop(b, None)
                if b in self.deferred:
                    ready.append(b)
        for b in ready:
            owner = self.deferred.pop(b, None)
            if owner is not None:
                self._release([b], owner)

    def _ready(self, held: "_HeldNode", holding: bool) -> None:
        """A node may go once the multi-tenant scheduler gives it its turn: at
        once when nothing waits on its island and its devices have room, else
        it queues (held) behind its client's earlier nodes."""
        if held.run.peer.gone:            # its client left meanwhile
            self._abandon(held, holding)
            return
        call = held.call
        ready = Ready(held.run.peer.id, held.island, tuple(call.devices),
                      (call.program, tuple(call.devices)), held)
        if self.tenants.can_send_now(ready):
            self._send(ready, holding)
            return
        if not holding:
            self._hold(held)
        self.tenants.add(ready)
        self._pump(held.island)

    def _pump(self, island: int) -> None:
        """Send what the multi-tenant scheduler lets go on an island."""
        while (ready := self.tenants.pick(island)) is not None:
            self._send(ready, holding=True)

    def _send(self, ready: Ready, holding: bool) -> None:
        """Dispatch a node whose turn it is (or fail it, if a host it needs was
        lost while it waited)."""
        held = ready.item
        run = held.run
        err = self._unsendable(held)
        if err is None and (self.copies_dropped or self.unsent_copies):
            err = self._repair(held)
        if err is not None:
            self._abandon(held, holding, err)
            return
        # the worker may hold its report while work is queued behind it, unless
        # something here may wait for it: a sequential program's next nodes, or
        # calls waiting for memory (it frees what the run held); and only while
        # the island has the solo window, one at least twice as long as the
        # hold (else the report makes room for others, or is needed to top up)
        hold = not run.sequential and not self.memory_limit and \
            self.tenants.solo_window_s >= 2 * HOLD_DEEP_S and \
            self.tenants.window(held.island, run.peer.id) > self.tenants.window_s
        exec_id = self._dispatch(run.peer, held.call, *held.planned, hold=hold)
        self.tenants.sent(exec_id, ready)
        run.sent += 1
        if holding:
            self._unhold(held)
            self._maybe_release(run)
            self._trigger(("sent", exec_id))      # nodes that waited for this one to be sent

    def _drop_copies(self, copies: list[tuple[int, dict]], error: m.ErrorInfo) -> list[int]:
        """Forget copies that will never hold data (``Directory.drop_copies``);
        nodes planned to read them, and not sent yet, read another copy when
        they go (``_send``). Returns the buffers left with no copy."""
        self.copies_dropped.update(b for b, _ in copies if b in self.directory.buffers)
        return self.directory.drop_copies(copies, error)

    def _repair(self, held: "_HeldNode") -> m.ErrorInfo | None:
        """A node about to be sent may have been planned to read a copy that
        will never be made, or that a node not sent yet (so queued behind it)
        is to make: it reads those shards from a copy that holds data instead
        (``Directory.repair``). With none left, it cannot run: why."""
        dropped, unsent = self.copies_dropped, self.unsent_copies
        copies = held.planned[0].copies

        def own(b: int, lay: dict) -> bool:
            return any(lay is o for _, o in copies)
        affected = {i.buffer for i in held.call.inputs if i.buffer in dropped or (
            i.buffer in unsent and not all(own(i.buffer, u) for u in unsent[i.buffer]))}
        if not affected:
            return None

        def unusable(b: int, lay: dict) -> bool:
            return any(lay is u for u in unsent.get(b, ())) and not own(b, lay)
        lost = self.directory.repair(held.planned[0], affected, unusable, own)
        if not lost:
            return None
        return m.ErrorInfo("HostLost", f"buffer {lost[0]} has no copy that holds data left (the copies "
                           "planned for it cannot be made)", None, held.planned[1], "")

    def _unsendable(self, held: "_HeldNode") -> m.ErrorInfo | None:
        """Why a node that waited can no longer run: an input failed meanwhile, or
        a host it runs on or reads from was lost."""
        for i in held.call.inputs:
            buf = self.directory.buffers.get(i.buffer)
            if buf is not None and buf.error is not None:
                return buf.error
        plan = held.planned[0]
        for h in [*plan.executes, *(src for src, _ in plan.sends)]:
            host = self.rm.hosts[h]
            if not host.alive:
                return m.ErrorInfo("HostLost", f"host {h} ({host.name}, island {host.island}) was lost "
                                   "before this computation could run", h, held.planned[1], "")
        return None

    def _abandon(self, held: "_HeldNode", holding: bool, err: m.ErrorInfo | None = None) -> None:
        """A node that will never be sent: its client left, or it cannot run
        (``err``: its outputs fail with it, so their consumers fail too)."""
        run = held.run
        self._release_transient(held.planned[0].transient)
        # its plan recorded copies of its inputs it will never make: forget them
        # (an input left with no copy fails)
        lost = self._drop_copies(held.planned[0].copies, err or m.ErrorInfo(
            "Abandoned", "its last copy was planned for a computation that was abandoned", None, "", ""))
        if err is not None:
            outs = [o.buffer for o in held.call.outputs]
            self.directory.poison(outs, run.peer.id, err)
            # inputs it would have read from a lost host fail too (rather than
            # be read from nowhere)
            gone = [p.buffer for src, p in held.planned[0].sends if not self.rm.hosts[src].alive]
            self.directory.poison(gone, run.peer.id, err)
            if not run.peer.gone:
                self.send(run.peer.ident, m.CallFailed(held.call.call_id, outs + lost, err))
        run.sent += 1
        if holding:
            self._unhold(held)
        self._maybe_release(run)
        # nodes waiting for it to be sent, or (sequential) to finish: they go on,
        # and fail with its error when they read its outputs
        self.unfinished.discard(held.exec_id)
        self._trigger(("sent", held.exec_id))
        self._trigger(held.exec_id)

    def _exec_finished(self, exec_id: int, devices: Any = None) -> None:
        """Every host finished a computation: send the held nodes waiting on it,
        and what the multi-tenant scheduler now has room for (once one of its
        ``devices`` is down to half a window, when they are given)."""
        self.unfinished.discard(exec_id)
        self._trigger(exec_id)
        done = self.tenants.finished(exec_id)
        if done is not None and (devices is None or self.tenants.low(devices, done[0])):
            self._pump(done[0])

    def _trigger(self, key: Any) -> None:
        for held in self.waiters.pop(key, ()):
            held.waits.discard(key)
            if not held.waits:
                self._released.append(held)
        if self._releasing:
            return                        # the loop below, further up the stack, sends it
        self._releasing = True
        try:
            while self._released:
                self._send_held(self._released.popleft())
        finally:
            self._releasing = False

    def _send_held(self, held: "_HeldNode") -> None:
        if held.run.peer.gone:
            self._abandon(held, holding=True)
        else:
            self._ready(held, holding=True)

    def _maybe_release(self, run: "_ProgramRun") -> None:
        """Once every node of a program was sent, free its intermediates and the
        values the client put for it (workers free after the nodes ran)."""
        if run.sent == run.total and not run.released:
            run.released = True
            self._release(run.release, run.peer.id)

    def _release(self, buffers: list[int], owner: int) -> None:
        """Free buffers the owner no longer needs, except those a held node still
        reads or writes: those wait until it has been sent."""
        now = []
        deferred = False
        for b in buffers:
            if self.pinned.get(b, 0) > 0:
                self.deferred[b] = owner
                deferred = True
            else:
                now.append(b)
        if self.copies_dropped:
            self.copies_dropped.difference_update(now)
        self._free(self.directory.release(now, owner))
        if deferred and self.memory_waiting:
            self._resume_waiting()      # a waiting call that keeps it alive may go ahead

    def _explain(self, ident: bytes, parent: int, peer: Peer, req: m.ExplainRequest) -> None:
        """Plan a program on a scratch copy of the directory and describe it."""
        scratch = Directory(self.directory.host_of, self.directory.address_of, self.directory.jax_id_of)
        for call in req.calls:
            for i in call.inputs:
                buf = self.directory.buffers.get(i.buffer)
                if buf is not None and i.buffer not in scratch.buffers:
                    scratch.buffers[i.buffer] = copy.deepcopy(buf)
        nodes = []
        for k, call in enumerate(req.calls):
            try:
                plan, name = self._plan(ident, peer, call, directory=scratch)
            except PlanError as e:
                self.reply_error(ident, parent, "bad_request", f"node {k}: {e}")
                return
            transfers = []
            for src, piece in plan.sends:
                same = self.rm.hosts[src].island == self.rm.hosts[piece.dst_host].island
                transfers.append(m.TransferInfo(piece.buffer, src, piece.dst_host,
                                                sharding.nbytes(piece.sub, scratch.buffers[piece.buffer].dtype),
                                                "ICI" if same else "DCN"))
            for h, ex in plan.executes.items():
                for inp in ex.inputs:
                    for shard in inp.shards:
                        for p in shard.pieces:
                            if p.piece_id == 0:
                                transfers.append(m.TransferInfo(inp.buffer, h, h,
                                                                sharding.nbytes(p.sub, inp.aval.dtype), "local"))
            hosts = sorted(plan.executes)
            nodes.append(m.NodePlan(call.call_id, name, self.rm.hosts[hosts[0]].island, hosts,
                                    call.devices, transfers))
        self.send(ident, m.Explanation(nodes), parent)

    # ---- failures --------------------------------------------------------------
    def _check_liveness(self, now: float) -> None:
        late = [p for p in self.peers.values()
                if now - p.last_seen > (HOST_TIMEOUT_S if p.role == "worker" else CLIENT_TIMEOUT_S)]
        if late:
            # their answers may be waiting behind work that held this loop up
            # (a huge message, a long plan): read what came before judging
            self._recv_all(budget=1_000_000)
            busy, now = time.monotonic() - now, time.monotonic()
            if busy > STALL_S:         # that reading held the loop up too
                for peer in self.peers.values():
                    peer.last_seen = min(now, peer.last_seen + busy - STALL_S)
        for peer in list(self.peers.values()):
            if peer.ident not in self.peers:       # lost meanwhile (with its island)
                continue
            silent = now - peer.last_seen
            if peer.role == "worker" and silent > HOST_TIMEOUT_S:
                self._host_lost(peer.id, f"no answer for {silent:.1f}s")
            elif peer.role == "client" and silent > CLIENT_TIMEOUT_S:
                log.warning("client %d (%s) silent for %.1fs: treating it as gone", peer.id,
                            peer.name, silent)
                self._client_left(peer)

    def _client_left(self, peer: Peer) -> None:
        """A client left (Goodbye) or vanished: its queued work is cancelled and
        everything it holds is freed (computations already at the workers finish)."""
        self.peers.pop(peer.ident, None)
        peer.gone = True
        # its waiting submissions leave the memory queue first (dropping one frees
        # memory, which resumes the queue), and are dropped once its queued nodes
        # are cancelled (so that resuming cannot send one of them)
        waiting_subs = [s for s in self.memory_waiting if s.peer is peer]
        if waiting_subs:
            self.memory_waiting = collections.deque(s for s in self.memory_waiting if s.peer is not peer)
        islands = set(self.tenants.islands())
        cancelled = {id(r.item): r.item for r in self.tenants.remove_client(peer.id)}
        for key, waiting in list(self.waiters.items()):
            mine = [h for h in waiting if h.run.peer is peer]
            if mine:
                cancelled.update((id(h), h) for h in mine)
                rest = [h for h in waiting if h.run.peer is not peer]
                if rest:
                    self.waiters[key] = rest
                else:
                    del self.waiters[key]
        for held in cancelled.values():
            self._abandon(held, holding=True)
        for sub in waiting_subs:
            self._drop_waiting(sub)
        for island in islands:            # heads its queue held back may go now
            self._pump(island)
        if cancelled:
            log.info("client %d left: %d queued computations cancelled", peer.id, len(cancelled))
        # its computations already at the workers may wait for values it was
        # still putting: they fail rather than hold their devices until the
        # input deadline
        err = m.ErrorInfo("RemoteError", f"client {peer.id} ({peer.name}) left before its inputs "
                          "arrived", None, "", "")
        fails: dict[int, list[int]] = {}
        for inf in self.in_flight.values():
            if inf.client == peer.id and inf.puts:
                for rank in inf.hosts:
                    fails.setdefault(rank, []).extend(inf.puts)
        for rank, buffers in fails.items():
            self.to_host(rank, m.FailBuffers(buffers, err))
        self._release(self.directory.owned(peer.id), peer.id)
        # and what it put that no call took (a call this controller refused, or
        # made while it was being dropped): the workers free all of its buffers
        for rank in list(self.worker_ident):
            self.to_host(rank, m.ClientGone(peer.id))
        # its templates, and their fused programs on the hosts
        self._drop_templates(peer, [n for c, n in self.templates if c == peer.id])
        if self.memory_waiting:
            self._resume_waiting()

    def _host_lost(self, rank: int, why: str) -> None:
        """A worker stopped answering: fail what depended on it, keep serving."""
        host = self.rm.lose_host(rank, why)
        ident = self.worker_ident.pop(rank, None)
        if ident is not None:
            self.peers.pop(ident, None)
        self.host_programs.pop(rank, None)
        err = m.ErrorInfo("HostLost", f"host {rank} ({host.name}, island {host.island}) was lost: {why}",
                          rank, "", "")
        log.error("%s", err.message)
        failed: dict[bytes, list[int]] = {}
        broken_pieces: dict[int, list[int]] = {}
        for exec_id, inf in list(self.in_flight.items()):
            if inf.fused and rank in inf.hosts:
                # a fused run's hosts make their results on their own: those of
                # the lost host fail below, with everything that lives only
                # there; the run finishes when the others have reported
                inf.hosts.discard(rank)
                if not inf.hosts:
                    # (what waits for memory goes on below, once the lost
                    # host's copies are forgotten, so it is not planned to
                    # read from there)
                    self._release_transient(inf.transient, resume=False)
                    del self.in_flight[exec_id]
                    self._exec_finished(exec_id)
            elif rank in inf.hosts:        # it was still running there: it fails
                # (outputs the client released stay forgotten)
                self.directory.poison([b for b in inf.outputs if b in self.directory.buffers],
                                      inf.client, err)
                failed.setdefault(inf.client_ident, []).extend(inf.outputs)
                del self.in_flight[exec_id]
                self._exec_finished(exec_id)
            for piece_id, src, dst in inf.pieces:
                if src == rank and dst != rank:   # it will never send these
                    broken_pieces.setdefault(dst, []).append(piece_id)
        for owner, buffers in self.directory.drop_devices(set(host.devices), err).items():
            ident = next((p.ident for p in self.peers.values() if p.role == "client" and p.id == owner), None)
            if ident is not None:
                failed.setdefault(ident, []).extend(buffers)
        for dst, pieces in broken_pieces.items():
            if dst in self.worker_ident:
                self.to_host(dst, m.FailPieces(pieces, err))
        for ident, buffers in failed.items():
            if ident in self.peers:
                self.send(ident, m.CallFailed(0, buffers, err))
        # clients fail their fetches from it; workers let go of what they keep
        # for it (shared-memory segments it held, their connection to it)
        for peer in list(self.peers.values()):
            if peer.role in ("client", "worker"):
                self.send(peer.ident, m.HostDown(rank, err))
        # The hosts that share its island's JAX runtime cannot finish a collective
        # without it (after a hang or a partition nothing tells them): the island
        # is lost as a whole, and they are told to stop.
        if host.runtime:
            for other in list(self.rm.hosts.values()):
                if other.alive and other.runtime == host.runtime and other.island == host.island:
                    ident = self.worker_ident.get(other.rank)
                    if ident is not None:
                        self.send(ident, m.Shutdown(f"host {rank} of island {host.island}'s runtime was lost"))
                    self._host_lost(other.rank, f"it shares island {host.island}'s JAX runtime with "
                                                f"host {rank}, which was lost")
        if self.memory_waiting:           # what waited for memory there fails now
            self._resume_waiting()
        # its shared-memory segments: nobody else would remove them before the
        # cluster stops (mappings peers still hold stay valid after the unlink)
        if host.machine and host.pid and host.machine == self.machine:
            n = channels.cleanup(channels.shm_prefix(self.ep.key), host.pid)
            if n:
                log.info("removed %d shared-memory segments of lost host %d", n, rank)

    def _free(self, frees: dict[int, list[int]]) -> None:
        for rank, buffers in frees.items():
            if rank in self.worker_ident:
                self.to_host(rank, m.Free(buffers))
        if frees and self.memory_waiting:
            self._resume_waiting()

    def _exec_done(self, host: int, msg: m.ExecDone) -> None:
        info = self.in_flight.get(msg.exec_id)
        if msg.error is not None:
            log.info("computation %d failed on host %d: %s", msg.exec_id, host, msg.error.message)
        if info is None:
            return
        if info.fused and msg.error is not None and msg.error.kind == "FusedUnknown":
            # the host did not run it, so nothing there will ever hold its results
            # (it cannot poison what it does not know): they fail here
            mine = [b for b in info.outputs if (buf := self.directory.buffers.get(b)) is not None
                    and any(self.rm.devices[d].host == host for lay in buf.layouts
                            for devs in lay.values() for d in devs)]
            self.directory.poison(mine, info.client, msg.error)
            if mine and info.client_ident in self.peers:
                self.send(info.client_ident, m.CallFailed(0, mine, msg.error))
        self.timeline.append(m.ExecRecord(msg.exec_id, info.seq, info.island, host, info.client,
                                          info.name, info.devices, msg.start, msg.end,
                                          msg.error is None))
        self.tenants.host_done(msg.exec_id, msg.end - msg.start, info.host_devices[host])
        info.hosts.discard(host)
        info.error = info.error or msg.error
        if not info.hosts:
            if info.error is None:
                self.directory.confirm(info.copies)
            elif info.copies:
                # a copy of a failed computation may hold its error: nothing
                # reads it (an input left with no copy at all fails with it)
                lost = self._drop_copies(info.copies, info.error)
                if lost and info.client_ident in self.peers:
                    self.send(info.client_ident, m.CallFailed(0, lost, info.error))
            self._release_transient(info.transient)
            del self.in_flight[msg.exec_id]
            self._exec_finished(msg.exec_id, info.devices)

    def _device_info(self, d: int) -> m.DeviceInfo:
        dev = self.rm.devices[d]
        return m.DeviceInfo(dev.id, dev.host, dev.island, dev.local_index, dev.jax_id)

    def _host_infos(self) -> list[m.HostInfo]:
        return [m.HostInfo(h.rank, h.island, h.name, h.data_address,
                           [self._device_info(d) for d in h.devices])
                for h in self.rm.hosts.values() if h.alive]


def main(argv: list[str] | None = None) -> int:
    import argparse

    from zpath import logs
    from zpath.keys import key_from_env

    p = argparse.ArgumentParser(prog="zpath controller", description="Run the zpath controller.")
    p.add_argument("--bind", default="tcp://127.0.0.1:0",
                   help="ZeroMQ address to listen on (port 0: pick a free one)")
    p.add_argument("--address-file", help="write the address here once listening")
    p.add_argument("--policy", choices=POLICIES, default=None,
                   help=f"multi-tenant scheduling policy (default: $ZPATH_SCHEDULER_POLICY or {POLICY})")
    args = p.parse_args(argv)
    die_with_parent()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack
    logs.setup("controller")
    try:
        ctl = Controller(key_from_env(), args.bind, policy=args.policy)
    except zmq.ZMQError as e:        # the address is taken, or not this machine's
        print(f"zpath controller: cannot listen on {args.bind}: {e}", file=sys.stderr, flush=True)
        return 1
    signal.signal(signal.SIGTERM, ctl.stop)
    signal.signal(signal.SIGINT, ctl.stop)
    if args.address_file:
        tmp = args.address_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(ctl.address + "\n")
        os.replace(tmp, args.address_file)
    print(f"zpath controller listening on {ctl.address}", flush=True)
    # What start-up made (imports: ~100k objects) lives as long as the process:
    # keep it out of the collector's full passes, which otherwise stall every
    # dispatch for ~40 ms every second or two of busy work.
    gc.freeze()
    profile_dir = os.environ.get("ZPATH_PROFILE", "")
    if profile_dir:      # for finding where the controller's CPU goes; it slows it down
        import cProfile
        prof = cProfile.Profile(time.thread_time_ns, 1e-9)    # waits do not count
        prof.runcall(ctl.serve_forever)
        os.makedirs(profile_dir, exist_ok=True)
        prof.dump_stats(os.path.join(profile_dir, "controller.prof"))
    else:
        ctl.serve_forever()
    return 0
