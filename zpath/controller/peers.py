"""Peers: workers and clients registering, status and timeline requests,
buffer locations, the programs clients register."""
from __future__ import annotations

import collections
import hashlib
import logging

from zpath import sharding
from zpath.controller.records import Peer, Timeline
from zpath.errors import ErrorKind, ResourceError
from zpath.keys import MAX_CLIENT_ID, seal
from zpath.net import messages as m
from zpath.net.codec import PROTOCOL_VERSION

log = logging.getLogger(__name__)

MAX_WEIGHT = 1e6
MAX_NONCE_BYTES = 64
MAX_PROGRAM_BYTES = 256 << 20
TIMELINE_RECORDS = 100_000
EVENT_RECORDS = 10_000


class Peers:
    """Mixin of ControllerCore: registration, status, timeline."""

    def _init_peers(self) -> None:
        self.peers: dict[bytes, Peer] = {}
        self.worker_ident: dict[int, bytes] = {}
        self.client_ids = 0
        self.host_stores: dict[int, tuple[int, int]] = {}   # rank -> (shards, bytes) from Pong
        self.device_held: dict[int, int] = {}               # device -> bytes its worker holds (Pong)
        # (exec id, error, start, end, waited, host, *InFlight.row) per host
        # report, made into ExecRecords when asked (timeline_records). Plain
        # tuples of numbers and strings, and runs of rows as blocks of arrays
        # (see Timeline): the collector stops tracking them at its first look,
        # so the history (up to TIMELINE_RECORDS) costs it nothing after (a
        # row that held its InFlight kept that and its lists and set alive,
        # walked by every full pass)
        self.timeline = Timeline(TIMELINE_RECORDS)
        # what the controller did and what waited there (plans, waits for
        # memory): (kind, client, name, start, end) as ControllerEvent's fields,
        # made into records when asked (events_records), for the same reason
        self.events: collections.deque[tuple] = collections.deque(maxlen=EVENT_RECORDS)
        self.wall_offset = 0.0     # wall clock - the loop's clock (set by the loop: events are wall time)
        self.programs: dict[str, tuple[str, bytes]] = {}
        self.host_programs: dict[int, set[str]] = {}
        self._ping_seq = 0
        # rank -> when its latest report came (its own, or a row a relay passed
        # on for it): traffic that shows it alive without a Pong (see _pings)
        self.heard: dict[int, float] = {}
        self._pinged_at = float("-inf")     # the last tick's time
        self._not_pinged: set[int] = set()  # the hosts the last tick did not ping

    def event_records(self, limit: int) -> list[m.ControllerEvent]:
        """The last ``limit`` events (``events``), oldest first."""
        recent = list(self.events)[-limit:] if limit > 0 else []
        return [m.ControllerEvent(*e) for e in recent]

    def _pings(self) -> None:
        """One ``Ping`` for the workers of a tick (the loop encodes and signs it
        once), but not for a host that reported since the last tick and was
        pinged then: its reports show it alive (``_check_liveness``). So no
        host goes more than two ticks without a direct message (a worker
        counts only those as word from the controller; a host that only gets
        work through its relay hears nothing else), and a busy host's Pong
        statistics (``Status``) are at most two ticks old. Only with at least
        ``relay_min_hosts`` hosts, where the pings cost: with fewer, every
        host is pinged every tick, so a worker whose controller timeout is as
        short as two ticks is not left on its own."""
        self._ping_seq += 1
        ping = m.Ping(self._ping_seq)
        since, self._pinged_at = self._pinged_at, self.now
        skipped, self._not_pinged = self._not_pinged, set()
        if len(self.worker_ident) < self.config.relay_min_hosts:
            since = float("inf")              # (no report is later: every host pinged)
        heard, not_pinged = self.heard, self._not_pinged
        for rank, ident in self.worker_ident.items():
            if rank not in skipped and heard.get(rank, since) > since:
                not_pinged.add(rank)
            else:
                self.send(ident, ping)

    def seen(self, peer: Peer) -> float:
        """When ``peer`` was last heard from: its own message, or for a worker
        a report row a relay passed on for it."""
        return max(peer.last_seen, self.heard.get(peer.id, peer.last_seen)) if peer.role == "worker" \
            else peer.last_seen

    def _hello(self, ident: bytes, parent: int, msg: m.Hello) -> None:
        if msg.protocol != PROTOCOL_VERSION:
            self.reply_error(ident, parent, ErrorKind.PROTOCOL,
                             f"client speaks protocol {msg.protocol}, controller {PROTOCOL_VERSION}")
            return
        if not 0 < msg.weight <= MAX_WEIGHT:
            self.reply_error(ident, parent, ErrorKind.BAD_REQUEST,
                             f"weight must be > 0 and <= {MAX_WEIGHT:g}, not {msg.weight!r}")
            return
        if ident in self.peers:
            self.reply_error(ident, parent, ErrorKind.BAD_REQUEST, "already connected")
            return
        if len(msg.nonce) > MAX_NONCE_BYTES:
            self.reply_error(ident, parent, ErrorKind.BAD_REQUEST, f"a nonce of more than {MAX_NONCE_BYTES} bytes")
            return
        if self.client_ids >= MAX_CLIENT_ID:
            self.reply_error(ident, parent, ErrorKind.RESOURCE, "no client ids left (restart the controller)")
            return
        self.client_ids += 1
        cid = self.client_ids
        session = self.keys.session(cid)
        self.peers[ident] = Peer("client", cid, msg.name, self.now, ident, msg.weight,
                                 keys=lambda signer: session if signer == cid else None)
        self.tenants.add_client(cid, msg.weight, shared=msg.shared)
        log.info("client %d (%s, weight %g) connected", cid, msg.name, msg.weight)
        self.send(ident, m.Welcome(cid, self._host_infos(), seal(self.keys.clients, msg.nonce, cid, session)),
                  parent)

    def _status(self, ident: bytes, parent: int) -> None:
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
                                  self.tenants.policy, self.relayed_messages), parent)

    def _pong(self, peer: Peer, msg: m.Pong) -> None:
        if peer.role == "worker":
            self.host_stores[peer.id] = (msg.shards, msg.nbytes)
            devices = self.rm.hosts[peer.id].devices
            if len(msg.device_bytes) == len(devices):
                self.device_held.update(zip(devices, msg.device_bytes, strict=True))

    def _alloc_slice(self, ident: bytes, parent: int, msg: m.AllocSlice) -> None:
        try:
            sid, devs = self.rm.alloc_slice(msg.devices, island=msg.island, host=msg.host)
        except ResourceError as e:
            self.reply_error(ident, parent, ErrorKind.RESOURCE, str(e))
            return
        self.send(ident, m.SliceAllocated(sid, [self._device_info(d) for d in devs]), parent)

    def _locate(self, client: int, buffer: int) -> m.Location:
        """A surviving copy of a client's buffer: the first layout whose every
        region is on a live host (the directory forgets copies on lost hosts)."""
        buf = self.directory.buffers.get(buffer)
        if buf is None or buf.owner != client:
            return m.Location(buffer, [], [], m.ErrorInfo(
                ErrorKind.HOST_LOST, f"buffer {buffer} is not known (its last copy may have been lost)", None, "", ""))
        if buf.error is not None:
            return m.Location(buffer, [], [], buf.error)
        for lay in buf.made_layouts():
            devices = [next((d for d in devs if self.rm.hosts[self.rm.devices[d].host].alive), None)
                       for devs in lay.values()]
            if lay and None not in devices:
                return m.Location(buffer, [sharding.to_wire(r) for r in lay], devices, None)
        return m.Location(buffer, [], [], m.ErrorInfo(
            ErrorKind.HOST_LOST, f"no copy of buffer {buffer} is left on a live host", None, "", ""))

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
            self.reply_error(ident, parent, ErrorKind.PROTOCOL,
                             f"worker speaks protocol {msg.protocol}, controller {PROTOCOL_VERSION}")
            return
        if ident in self.peers:
            self.reply_error(ident, parent, ErrorKind.BAD_REQUEST, "already registered")
            return
        try:
            host = self.rm.add_host(name=msg.name, island=msg.island, data_address=msg.data_address,
                                    pid=msg.pid, platform=msg.platform, num_devices=msg.num_devices,
                                    jax_ids=msg.jax_ids,
                                    runtime=msg.coordinator if msg.num_processes > 1 else "",
                                    machine=msg.machine, public_key=msg.public_key,
                                    dcn_address=msg.dcn_address, rank=msg.rank)
        except ResourceError as e:
            self.reply_error(ident, parent, ErrorKind.RESOURCE, str(e))
            return
        self.peers[ident] = Peer("worker", host.rank, msg.name, self.now, ident)
        self.worker_ident[host.rank] = ident
        self.host_programs[host.rank] = set()
        log.info("host %d registered: %s island %d, %d %s devices, data %s", host.rank, msg.name,
                 msg.island, msg.num_devices, msg.platform, msg.data_address)
        self.send(ident, m.Registered(host.rank, [self._device_info(d) for d in host.devices]), parent)

    def _register_program(self, ident: bytes, parent: int, msg: m.RegisterProgram,
                          buffers: list) -> None:
        if len(buffers) != 1 or buffers[0].nbytes > MAX_PROGRAM_BYTES:
            self.reply_error(ident, parent, ErrorKind.BAD_REQUEST, "RegisterProgram needs one buffer "
                             f"of at most {MAX_PROGRAM_BYTES} bytes")
            return
        blob = bytes(buffers[0])
        if hashlib.sha256(blob).hexdigest() != msg.digest:
            self.reply_error(ident, parent, ErrorKind.BAD_REQUEST, f"program {msg.name!r}: sha256 does not "
                             "match its digest")
            return
        self.programs.setdefault(msg.digest, (msg.name, blob))

    def _device_info(self, d: int) -> m.DeviceInfo:
        dev = self.rm.devices[d]
        return m.DeviceInfo(dev.id, dev.host, dev.island, dev.local_index, dev.jax_id,
                            self.rm.hosts[dev.host].platform)

    def _host_infos(self) -> list[m.HostInfo]:
        return [m.HostInfo(h.rank, h.island, h.name, h.data_address,
                           [self._device_info(d) for d in h.devices])
                for h in self.rm.hosts.values() if h.alive]

    def validate_peers(self) -> None:
        """Workers and their idents agree; every live host has its worker."""
        for rank, ident in self.worker_ident.items():
            p = self.peers.get(ident)
            assert p is not None and p.role == "worker" and p.id == rank, f"host {rank}: no worker peer"
            assert self.rm.hosts[rank].alive, f"lost host {rank} still has a worker"
        for p in self.peers.values():
            assert not p.gone, f"{p.role} {p.id} gone but still a peer"
            if p.role == "worker":
                assert self.worker_ident.get(p.id) == p.ident, f"worker {p.id} not in worker_ident"
        for h in self.rm.hosts.values():
            assert not h.alive or h.rank in self.worker_ident, f"live host {h.rank} has no worker"
        # (the alone window rests on this: the clients connected are the scheduler's)
        clients = {p.id for p in self.peers.values() if p.role == "client"}
        assert set(self.tenants.weights) == clients, f"tenant scheduler's clients {sorted(self.tenants.weights)}"
