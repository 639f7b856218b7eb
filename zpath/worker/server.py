"""The worker process: registers with the controller, then serves two sockets.

* control: a DEALER to the controller (programs, Execute, SendPiece, Ping).
* data: a ROUTER other workers and clients connect to (Put, Piece, Fetch).

The I/O thread owns both sockets and one DEALER per peer: it receives, hands
each event and the time to the pure state (``state.py``: fused programs,
departed clients, fetch deadlines, controller silence, the shaped DCN queue,
chunked pieces) or to the executor, and sends what they give back. The
executor threads run computations; a fetch is answered once its shard is
done, by the thread that finds it done if the shard is small (as a small
piece is sent: ``channels.INLINE_PIECE_BYTES``), else from a small pool.
Configuration (``WorkerConfig``, ``CommonConfig``) is built in ``main()`` and
passed down (see docs/design.md, "Worker")."""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import faulthandler
import gc
import logging
import math
import os
import queue
import signal
import sys
import socket
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import zmq

from zpath import logs, sharding
from zpath.config import HOLD_SHORT_S, CommonConfig, WorkerConfig
from zpath.errors import ErrorKind, ProtocolError, ZpathError
from zpath.ids import client_of
from zpath.keys import Keys, key_from_config, worker_key_from_config
from zpath.process import die_with_parent
from zpath.net import channels
from zpath.net import codec
from zpath.net import messages as m
from zpath.net.codec import CLIENTS, CLUSTER, PROTOCOL_VERSION, Record
from zpath.net.transport import (LOG_BURST, LOG_RATE, REPLY_BURST, REPLY_RATE, BadMessage, Endpoint, Outbox,
                                 RateLimit, backoff, make_context, raw, readable, unbatched)
from zpath.worker import compile_cache
from zpath.worker import relay as relays
from zpath.worker.executor import Executor, name_thread, to_device
from zpath.worker.state import (IDLE_WAIT_S, Chunks, FusedRun, LocalShards, PendingFetch, ShapedLink,
                                WorkerState, refused_on_data)
from zpath.worker.store import Entry, PieceKey, Store, shard_key

try:       # internal APIs of JAX, to bind gloo (see _gloo_listens_on)
    from jax._src import distributed as _jax_distributed
    from jax._src import xla_bridge as _xla_bridge
    from jax._src.lib import _jax as _jaxlib
except ImportError as e:  # pragma: no cover
    _gloo_missing: Exception | None = e
else:
    _gloo_missing = None

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 60.0
# data-port peers whose signer is remembered (to sign the replies to them)
DATA_PEERS_KEPT = 65_536
# A client with more fetches than this waiting on a host has them answered by
# the sender threads, not by the thread that stores the shard (see
# Worker._answer_fetch): that thread answers few of one client's at a time.
INLINE_FETCHES_WAITING = 64


class Worker:
    def __init__(self, key: bytes, controller: str, island: int, *,
                 bind_host: str = "127.0.0.1", name: str | None = None,
                 coordinator: str = "", num_processes: int = 1, process_id: int = 0,
                 dcn_latency_ms: float = 0.0, dcn_gbps: float = 0.0, dcn_encrypt: bool = False,
                 config: WorkerConfig | None = None, common: CommonConfig | None = None,
                 rank: int = -1, worker_key: bytes | None = None) -> None:
        """``rank``: the host rank to ask the controller for (its launcher's
        numbering; -1: any). ``key``: the cluster key (clients'); ``worker_key``:
        the worker key (default: the cluster key, which keeps no client apart)."""
        self.wanted_rank = rank
        self.config = config = config if config is not None else WorkerConfig()
        self.common = common = common if common is not None else CommonConfig()
        if dcn_encrypt and not zmq.has("curve"):
            raise ZpathError("--dcn-encrypt needs CURVE, but this libzmq was built without it")
        # ValueError if negative
        self.shaped = ShapedLink(channels.Shaper(dcn_latency_ms, dcn_gbps))
        self.state = WorkerState(config.controller_timeout_s, time.monotonic())

        jax.config.update("jax_enable_x64", True)
        self.compile_cache = compile_cache.use(config.compile_cache)
        self.coordinator = coordinator if num_processes > 1 else ""
        self.num_processes, self.process_id = num_processes, process_id
        if self.coordinator:
            # One JAX runtime for the island's hosts, so a computation can span
            # them; CPU collectives go through gloo (GPUs use their own).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            log.info("joining island runtime at %s as process %d of %d", coordinator,
                     process_id, num_processes)
            # the coordinator (process 0) listens on this host's --bind-host,
            # not on every interface (JAX's default)
            jax.distributed.initialize(coordinator, num_processes=num_processes,
                                       process_id=process_id,
                                       initialization_timeout=int(REGISTER_TIMEOUT_S),
                                       coordinator_bind_address=_bind_address(bind_host, coordinator)
                                       if process_id == 0 else None)
            _gloo_listens_on(bind_host, config.collectives_nice)
        self.jax = jax
        self.local = jax.local_devices()
        # what JAX lowers programs for on these devices ("cuda" where the devices
        # say "gpu"): clients export for it, so a client without this accelerator works
        self.platform = jax.export.default_export_platform()
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.island = island
        self.keys = Keys(key, worker_key if worker_key is not None else key)
        # signs with the worker key; checks the controller's and peers' messages
        # with it, clients' with their session keys (the cluster key only for
        # what anyone may ask: ChannelStatsRequest, and the controller's refusal)
        self.ep = Endpoint(self.keys.workers, f"worker:{self.name}", keys=self.keys.of)
        self.data_signer: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.reply_limit = RateLimit(REPLY_RATE, REPLY_BURST)
        self.log_limit = RateLimit(LOG_RATE, LOG_BURST)
        self.ctx = make_context(common.max_message_bytes)
        self.ctl = self.ctx.socket(zmq.DEALER)
        self.ctl.connect(controller)
        self.data = self.ctx.socket(zmq.ROUTER)
        port = self.data.bind_to_random_port(f"tcp://{bind_host}")
        self.data_address = f"tcp://{bind_host}:{port}"
        # DCN traffic may come encrypted on a second port (CURVE server)
        self.dcn: zmq.Socket | None = None
        self.public_key = self.secret_key = b""
        self.dcn_address = ""
        if dcn_encrypt:
            self.public_key, self.secret_key = zmq.curve_keypair()
            self.dcn = self.ctx.socket(zmq.ROUTER)
            self.dcn.curve_server = True
            self.dcn.curve_secretkey = self.secret_key
            self.dcn.curve_publickey = self.public_key
            self.dcn_address = f"tcp://{bind_host}:{self.dcn.bind_to_random_port(f'tcp://{bind_host}')}"
        self.machine = channels.machine_id(common.machine_id)
        self.use_shm = config.shm and channels.shm_available(common.shm_dir)
        self.shm_out = channels.ShmSender(channels.shm_prefix(self.keys.workers), common.shm_dir)
        self.shm_in = channels.ShmReceiver(shm_dir=common.shm_dir)
        # small pieces between workers of this machine: datagrams (see channels)
        self.dgram_prefix = channels.shm_prefix(self.keys.workers)
        self.dgram_in: channels.DgramReceiver | None = None
        self.dgram_out: channels.DgramSender | None = None
        self.dgram_names: dict[str, bytes] = {}      # a peer's data address -> its datagram socket
        # a small piece's own datagram format, under the workers' key (see channels)
        self.piece_dgrams = channels.PieceDatagrams(self.keys.workers)
        if config.shm:
            try:
                self.dgram_in = channels.DgramReceiver(channels.dgram_name(self.dgram_prefix, self.data_address))
                self.dgram_out = channels.DgramSender()
            except OSError as e:
                if self.dgram_in is not None:
                    self.dgram_in.close()
                    self.dgram_in = None
                log.info("no datagram socket for small pieces (%s): they go by ZeroMQ", e)
        # (peer identity, segment) of pieces lent in their segment that nothing
        # refers to any more; filled by finalizers, acknowledged by the I/O thread
        self.freed_segments: queue.SimpleQueue[tuple[bytes, str, int]] = queue.SimpleQueue()
        self.stats = dict.fromkeys(m.ChannelStats.__dataclass_fields__, 0)
        # recent (piece id, wall time) of sends begun and pieces stored, for benchmarks
        self.sent_at: collections.deque = collections.deque(maxlen=256)
        self.received_at: collections.deque = collections.deque(maxlen=256)
        self.sent: collections.deque = collections.deque(maxlen=256)     # m.SentPiece, for traces
        # shaped DCN pieces arriving as PieceChunks
        self.chunks = Chunks(lambda aval, flat: _array(aval, [flat]))
        self.poller = zmq.Poller()
        self.peer_socks: dict[int, zmq.Socket] = {}
        self.peer_addrs: dict[int, tuple[str, str]] = {}   # rank -> (address, CURVE key)
        self.outbox = Outbox()
        self.chaining = False       # held reports: the executor's last report was held
        self.store = Store()
        self.pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="send",
                                                          initializer=name_thread, initargs=("zpath-send",))
        self.rank: int | None = None
        self.executor: Executor | None = None
        self.local_shards: LocalShards | None = None     # with the executor's devices, once registered
        self.device_ids: list[int] = []
        self.running = True
        self.io_thread = 0      # the thread that runs serve_forever (it owns the sockets)
        self.relay = relays.RelayState()     # relays (I/O thread only): see relay.py

    # ---- start-up ------------------------------------------------------------
    def register(self) -> None:
        msg = m.RegisterWorker(self.name, self.island, self.data_address, os.getpid(),
                               self.platform, len(self.local), PROTOCOL_VERSION,
                               [d.id for d in self.local], self.coordinator, self.process_id,
                               self.num_processes, self.machine, self.public_key.decode(),
                               self.dcn_address, self.wanted_rank)
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        attempt = 0
        while time.monotonic() < deadline and self.running:
            self.ep.send(self.ctl, msg)
            if self.ctl.poll(int(min(2.0, 0.5 + backoff(attempt)) * 1000)):
                _, header, got, buffers = self.ep.recv(self.ctl)
                replies = [r for _, r, _ in unbatched(header, got, buffers)
                           if isinstance(r, (m.Registered, m.Error))]
                reply = replies[0] if replies else None
                match reply:
                    case m.Registered():
                        self.rank = self.state.rank = reply.rank
                        devices = {d.id: self.local[d.local_index] for d in reply.devices}
                        self.device_ids = [d.id for d in reply.devices]   # Pong reports in this order
                        self.executor = Executor(self.store, devices, self._exec_done,
                                                 jax_devices={d.id: d for d in self.jax.devices()},
                                                 release_held=self._release_held)
                        self.executor.rank = reply.rank
                        self.local_shards = LocalShards(devices)
                        log.info("registered as host %d with devices %s", reply.rank,
                                 sorted(devices))
                        return
                    case m.Error():
                        raise ZpathError(f"controller refused registration: {reply.message}")
            attempt += 1
        if not self.running:          # SIGTERM or Ctrl-C while it waited
            raise _Stopped()
        raise ZpathError(f"controller did not answer within {REGISTER_TIMEOUT_S:.0f}s")

    # ---- helpers used from any thread ---------------------------------------
    def post_ctl(self, msg: Record) -> None:
        self.outbox.put("ctl", None, msg, (), 0)

    def post_data(self, ident: bytes | None, msg: Record, buffers: Any = (), parent: int = 0) -> None:
        if ident is None:        # it came as a datagram: no way back
            return
        self.outbox.put("data", ident, msg, buffers, parent)

    def post_peer(self, rank: int, msg: Record, buffers: Any = (), dcn: bool = False) -> None:
        self.outbox.put("dcn" if dcn else "peer", rank, msg, buffers, 0)

    def _exec_done(self, exec_id: int, error: m.ErrorInfo | None, start: float, end: float,
                   hold: float) -> None:
        """Report a finished computation; with ``hold`` (seconds) the report
        waits up to that long (less if one held before must go earlier, or until
        one not held) to go to the controller with the next ones, as one Batch."""
        self.chaining = 0 < hold <= HOLD_SHORT_S
        waited = self.executor.waited.pop(exec_id, 0.0) if self.executor is not None else 0.0
        self.outbox.hold(("ctl", None, m.ExecDone(exec_id, error, start, end, waited), (), 0), hold,
                         release=not hold)

    def _release_held(self) -> None:
        """The executor waits (for an input): held reports go now."""
        self.chaining = False
        self.outbox.release()

    # ---- I/O loop ------------------------------------------------------------
    def serve_forever(self) -> None:
        self.io_thread = threading.get_ident()
        poller = self.poller
        poller.register(self.ctl, zmq.POLLIN)
        poller.register(self.data, zmq.POLLIN)
        poller.register(self.outbox.fd, zmq.POLLIN)
        if self.dcn is not None:
            poller.register(self.dcn, zmq.POLLIN)
        dgram = self.dgram_in.fileno() if self.dgram_in is not None else -1
        if self.dgram_in is not None:
            poller.register(dgram, zmq.POLLIN)
        self.state.heard_from_controller(time.monotonic())
        outbox = self.outbox
        outbox_fd = outbox.fd
        while self.running:
            ms = self._poll_ms(self._due())
            events = dict(poller.poll(timeout=ms))
            # data first: a piece or Put that came with the Execute that reads
            # it is then in the store before the executor looks for it
            if dgram in events:
                self._drain_dgram()
            if self.data in events:
                self._drain(self.data, router=True)
            if self.ctl in events:
                self._drain(self.ctl, router=False)
            if self.dcn is not None and self.dcn in events:
                self._drain(self.dcn, router=True)
            if outbox_fd in events or outbox.held_timeout() == 0.0:
                self._flush()
            if not self.freed_segments.empty():
                self._ack_freed()
            for s in self.peer_socks.values():
                if s in events:
                    self._drain_peer(s)
            if self.state.controller_lost(time.monotonic()):
                log.error("no word from the controller for %.0fs: exiting", self.state.controller_timeout_s)
                self.running = False
        try:      # reports still held go out with the rest
            self.outbox.release()
            self._flush()
        except Exception as e:
            log.warning("could not send the last messages: %s", e)
        self.close()

    def _due(self) -> float:
        """Do what is due by now (fetches past their deadline, shaped DCN
        messages, relays' rows and what waited past its time); returns seconds
        until the next is due. With none of them pending (the usual case) it
        reads no clock and calls nothing: this runs on every wake-up."""
        relay = self.relay
        if self.state.fetches or self.shaped.queue or relay.rows or relay.waiting or relay.held \
                or relay.blocked is not None:
            return min(self._expire_fetches(), self._send_shaped(), self._relay_due())
        return IDLE_WAIT_S

    def _poll_ms(self, wait: float) -> int:
        """Milliseconds the loop may wait for its sockets: ``wait`` (seconds,
        at least 1 ms), or less so that held reports go at their deadline."""
        if self.chaining:       # the executor holds short reports: it will hold more
            wait = min(wait, HOLD_SHORT_S)
        # (wait_until before held_timeout: a report held in between wakes us)
        ms = max(1, math.ceil(wait * 1000))
        self.outbox.wait_until = time.monotonic() + ms / 1000
        held = self.outbox.held_timeout()
        if held is not None and held < wait:
            ms = math.ceil(held * 1000)       # 0 when due: just look, then send them
            self.outbox.wait_until = time.monotonic() + ms / 1000
        return ms

    def close(self) -> None:
        if self.executor is not None:
            self.executor.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.shm_out.close()      # unlinks segments of ours that no peer took
        self.shm_in.close()
        if self.dgram_in is not None:
            self.dgram_in.close()
        if self.dgram_out is not None:
            self.dgram_out.close()
        for s in [self.ctl, self.data, *([self.dcn] if self.dcn is not None else []),
                  *self.peer_socks.values()]:
            s.close(0)
        self.ctx.term()
        self.outbox.close()

    def stop(self, *_: Any) -> None:
        self.running = False

    def _flush(self) -> None:
        # messages to the controller go out together, in order, as one Batch
        # (ExecDones of computations that finished while this thread was busy)
        to_ctl: list[tuple[Record, int, int]] = []
        for kind, target, msg, buffers, parent in self.outbox.drain():
            try:
                if kind == "ctl":
                    to_ctl.append((msg, 0, 0))
                elif kind == "data":
                    self.ep.send(self.data, msg, to=target, buffers=buffers, parent=parent, block=False,
                                 sign=self._reply_sign(target))
                elif kind == "dcn" and self.shaped.active:
                    self.shaped.send(target, msg, buffers, time.monotonic())
                else:
                    self.ep.send(self._peer(target), msg, buffers=buffers, block=False)
            except zmq.Again:
                log.error("%s %s is not reading (queue full): dropped %s", kind, target, type(msg).__name__)
            except Exception as e:   # one bad message must not stop the I/O thread
                log.error("cannot send %s: %s", type(msg).__name__, e)
        if to_ctl and self.relay.report_to:
            to_ctl = self._to_relays(to_ctl)
        if len(to_ctl) > 1 and all(type(x[0]) is m.ExecDone and x[0].error is None for x in to_ctl):
            # only reports, none a failure: one ExecDoneBatch (by column) rather than a Batch of them
            to_ctl = [(m.own_batch(self.rank, [x[0] for x in to_ctl]), 0, 0)]
        if to_ctl:
            try:
                for msg, _, e in self.ep.send_batch(self.ctl, to_ctl, block=False):
                    log.error("cannot send %s: %s", type(msg).__name__, e)
            except zmq.Again:
                log.error("the controller is not reading (queue full): dropped %d messages", len(to_ctl))
            except Exception as e:
                log.error("cannot send %d messages to the controller: %s", len(to_ctl), e)

    def _send_shaped(self) -> float:
        """Send the shaped DCN messages that are due; returns seconds to the next."""
        for rank, msg, buffers in self.shaped.take_due(time.monotonic()):
            try:
                self.ep.send(self._peer(rank), msg, buffers=buffers, block=False)
            except zmq.Again:
                log.error("peer %s is not reading (queue full): dropped %s", rank, type(msg).__name__)
            except Exception as e:
                log.error("cannot send %s: %s", type(msg).__name__, e)
        return self.shaped.next_due_in(time.monotonic())

    def _peer(self, rank: int) -> zmq.Socket:
        s = self.peer_socks.get(rank)
        if s is None:
            address, key = self.peer_addrs[rank]
            s = self.ctx.socket(zmq.DEALER)
            if key:
                if self.dcn is None:
                    raise ZpathError(f"host {rank} wants CURVE-encrypted DCN traffic, but this "
                                     "worker was started without --dcn-encrypt")
                s.curve_serverkey = key.encode()
                s.curve_publickey = self.public_key
                s.curve_secretkey = self.secret_key
            s.connect(address)
            self.peer_socks[rank] = s
            self.poller.register(s, zmq.POLLIN)
        return s

    def _drain_peer(self, sock: zmq.Socket) -> None:
        """Answers from a peer's data port: ShmAck, or errors."""
        for _ in range(1000):
            try:
                _, _, msg, _ = self.ep.recv(sock, block=False)
            except zmq.Again:
                return
            except BadMessage as e:
                log.warning("rejected message from a peer: %s", e)
                continue
            match msg:
                case m.ShmAck():
                    for name in msg.segments:
                        self.shm_out.release(name)
                case m.Error():
                    log.warning("peer reported: %s: %s", msg.code, msg.message)
                case _:
                    log.warning("unexpected %s from a peer", type(msg).__name__)
            if not readable(sock):
                return

    def _reply_sign(self, ident: bytes) -> tuple[bytes, int]:
        """What a reply on the data port is signed with: the key its peer signed
        with (a client's session key; the worker key for a peer worker); the
        cluster key for a peer whose messages did not check."""
        signer = self.data_signer.get(ident, CLIENTS)
        return self.keys.of(signer) or self.keys.workers, signer

    def _refuse(self, sock: zmq.Socket, router: bool, ident: bytes | None, parent: int, why: str,
                code: str = ErrorKind.PROTOCOL) -> None:
        """A refused message: a log line and (on a data port) an Error reply,
        each rate-limited."""
        now = time.monotonic()
        n = self.log_limit.allow(None, now)
        if n:
            log.warning("rejected message on %s socket: %s%s", "data" if router else "control", why,
                        f" ({n - 1} more rejected messages not logged)" if n > 1 else "")
        if router and ident is not None and self.reply_limit.allow(ident, now):
            try:
                self.ep.send(sock, m.Error(code, why), to=ident, parent=parent, block=False,
                             sign=self._reply_sign(ident))
            except zmq.ZMQError:
                pass

    def _drain(self, sock: zmq.Socket, router: bool) -> None:
        budget = 1000                # messages (a batch's count each), then back to the loop
        while budget > 0:
            try:
                ident, header, msg, buffers = self.ep.recv(sock, router=router, block=False)
            except zmq.Again:
                return
            except BadMessage as e:
                self._refuse(sock, router, e.ident, e.header.msg_id if e.header else 0, str(e))
                budget -= 1
                continue
            signer = header.signer
            if router:
                if self.data_signer.get(ident) != signer:
                    self.data_signer[ident] = signer
                    if len(self.data_signer) > DATA_PEERS_KEPT:
                        self.data_signer.popitem(last=False)
            elif signer != CLUSTER and type(msg) is not m.Error:
                self._refuse(sock, router, ident, header.msg_id, "the controller signs with the worker key")
                budget -= 1
                continue
            else:
                self.state.heard_from_controller(time.monotonic())
            msgs = unbatched(header, msg, buffers)
            budget -= len(msgs)
            for header, msg, buffers in msgs:
                if isinstance(msg, ProtocolError):       # one bad item of a batch
                    self._refuse(sock, router, ident, header.msg_id, str(msg))
                    continue
                try:
                    if router:
                        why = refused_on_data(signer, msg)
                        if why and type(msg) is m.Fetch:
                            # that fetch fails (its future, as any failed fetch), not the connection
                            if self.reply_limit.allow(ident, time.monotonic()):
                                self.post_data(ident, m.FetchReply(msg.request, m.Aval([], ""), m.ErrorInfo(
                                    ErrorKind.REMOTE_ERROR, why, self.rank, "", "")))
                        elif why:
                            self._refuse(sock, router, ident, header.msg_id, why, ErrorKind.BAD_REQUEST)
                        else:
                            self._handle_data(ident, header.msg_id, msg, buffers)
                    else:
                        for msg, buffers in self.relay.direct(msg, buffers, time.monotonic()):
                            self._handle_ctl(msg, buffers)
                except Exception:
                    log.exception("error handling %s", type(msg).__name__)
            if not readable(sock):
                return

    def _drain_dgram(self) -> None:
        """Datagrams from workers of this machine: pieces only (see channels)."""
        assert self.dgram_in is not None
        for _ in range(1000):
            data = self.dgram_in.recv()
            if data is None:
                return
            if data.startswith(channels.PIECE_MAGIC):        # a piece in its own format
                try:
                    piece_id, arr = self.piece_dgrams.read(data)
                except channels.PieceError as e:
                    self._bad_piece_dgram(e)
                    continue
                self._piece_arrived(piece_id, arr)
                continue
            try:
                header, msg, buffers = self.ep.decode(channels.dgram_frames(data))
                if type(msg) not in (m.Piece, m.Pieces) or header.signer != CLUSTER:
                    raise ValueError(f"{type(msg).__name__} signed by {header.signer}: a datagram "
                                     "carries only pieces from workers")
            except (ValueError, BadMessage) as e:
                n = self.log_limit.allow(None, time.monotonic())
                if n:
                    log.warning("rejected datagram: %s%s", e,
                                f" ({n - 1} more rejected messages not logged)" if n > 1 else "")
                continue
            try:
                if type(msg) is m.Piece and msg.error is None:
                    self._piece_in(None, header.msg_id, msg, buffers)
                else:
                    self._handle_data(None, header.msg_id, msg, buffers)
            except Exception:
                log.exception("error handling %s", type(msg).__name__)

    def _bad_piece_dgram(self, e: channels.PieceError) -> None:
        """A refused piece datagram: a log line, and, when it is authentic but
        not a piece this worker can make, whatever waits for it fails."""
        if e.piece_id is not None:
            self.store.set(PieceKey(e.piece_id), error=m.ErrorInfo(ErrorKind.REMOTE_ERROR, f"bad Piece: {e}",
                                                                   self.rank, "", ""))
        n = self.log_limit.allow(None, time.monotonic())
        if n:
            log.warning("rejected datagram: %s%s", e,
                        f" ({n - 1} more rejected messages not logged)" if n > 1 else "")

    # ---- control messages ----------------------------------------------------
    def _handle_ctl(self, msg: Record, buffers: list) -> None:
        assert self.executor is not None
        match msg:
            case m.Execute():
                assert self.local_shards is not None
                self.executor.submit(self.local_shards(msg))
            case m.RunFused():
                self._run_fused(msg)
            case m.DefineFused():
                self.state.define_fused(msg, self.local_shards)
            case m.DropFused():
                self.state.drop_fused(msg)
            case m.SendPiece():
                self.peer_addrs.setdefault(msg.dst_host, (msg.dst_address, msg.dst_key))
                key = shard_key(msg.buffer, msg.device, msg.region)
                self.store.when_done(key, lambda e, msg=msg: self._piece_ready(msg, e))
            case m.SendPieces():
                self.peer_addrs.setdefault(msg.dst_host, (msg.dst_address, msg.dst_key))
                self._when_all_done(msg)
            case m.RegisterProgram():
                if len(buffers) == 1:
                    self.executor.add_program(msg.digest, bytes(buffers[0]))
            case m.Ping():
                self.post_ctl(m.Pong(msg.seq, *self.store.stats(self.device_ids)))
            case m.Free():
                self.executor.free_after_earlier(msg.buffers)
            case m.ClientGone():
                # what it put that no call took would stay for good otherwise
                self.state.client_gone(msg.client)
                mine = self.store.buffers_of(msg.client)
                if mine:        # (not remembered as freed: its Puts are dropped anyway)
                    self.executor.free_after_earlier(mine, remember=False)
                log.debug("client %d is gone: %d of its buffers freed", msg.client, len(mine))
            case m.Relay():
                self._relay(msg, buffers)
            case m.HostDown():
                self._relay_lost(msg.rank)
                self.shaped.drop_peer(msg.rank, time.monotonic())
                n = self.shm_out.forget(msg.rank)
                self.peer_addrs.pop(msg.rank, None)
                sock = self.peer_socks.pop(msg.rank, None)
                if sock is not None:
                    self.poller.unregister(sock)
                    sock.close(0)
                log.info("host %d was lost: let go of %d shared-memory segments for it", msg.rank, n)
            case m.FailBuffers():
                self.store.fail_buffers(msg.buffers, msg.error)
            case m.FailPieces():
                for piece_id in msg.piece_ids:
                    self.chunks.forget(piece_id)
                    self.store.set(PieceKey(piece_id), error=msg.error)
            case m.Shutdown():
                log.info("controller asked us to exit: %s", msg.reason)
                self.running = False
            case m.Pong() | m.Registered():
                pass
            case m.Error():
                log.warning("controller reported: %s: %s", msg.code, msg.message)
            case _:
                log.warning("unexpected %s from the controller", type(msg).__name__)

    def _run_fused(self, msg: m.RunFused) -> None:
        """Queue a fused program's run as one computation (its place in the gang
        order is the run's), then free its intermediates once it has run."""
        assert self.executor is not None
        run = self.state.run_fused(msg)
        if not isinstance(run, FusedRun):
            now = time.time()
            self.post_ctl(m.ExecDone(msg.exec_id, run, now, now))
            return
        self.executor.submit(run)
        # What the run makes (codes >= 0, all that this controller releases:
        # templates.py) is not remembered as freed (Store.was_freed): the ids
        # are its client's, which puts only slot values, outside the run's
        # block (a program whose put slot falls in it runs as plain calls:
        # controller/fusion.py), so no late Put is to be dropped; a stray Put
        # of the client's lasts until its ClientGone, as one under any id it
        # never names. Remembering a -C run's 127 cost its host ~30-40 us
        # between runs and pushed real Puts' ids out of the memory (FREED_MAX)
        # after ~500 runs (docs/benchmarks.md, "-C's edges"). An input it
        # were to release (code < 0: maybe a Put) is remembered.
        first, release = run.first, run.release
        made = [first + c for c in release if c >= 0]
        if made:
            self.executor.free_after_earlier(made, remember=False)
        if len(made) < len(release):        # (never, from this controller: no second pass)
            self.executor.free_after_earlier([run.buffer(c) for c in release if c < 0])

    def _freed_callback(self, ident: bytes, segment: str, size: int) -> Any:
        """For a piece lent in its segment: once nothing refers to it, queue the
        segment's ShmAck and wake the I/O thread. It runs in whatever thread
        drops the last reference (a finalizer), so it takes no lock."""
        acks, wake = self.freed_segments, self.outbox.wake

        def freed() -> None:
            acks.put((ident, segment, size))
            wake()
        return freed

    def _ack_freed(self) -> None:
        """I/O thread: acknowledge the lent segments nothing refers to any more."""
        by_peer: dict[bytes, list[str]] = {}
        while True:
            try:
                ident, segment, size = self.freed_segments.get_nowait()
            except queue.Empty:
                break
            self.state.returned(size)
            by_peer.setdefault(ident, []).append(segment)
        for ident, segments in by_peer.items():
            try:
                self.ep.send(self.data, m.ShmAck(segments), to=ident, block=False)
            except zmq.ZMQError as e:
                log.warning("cannot acknowledge %d shared-memory segments: %s", len(segments), e)

    def _piece_ready(self, msg: m.SendPiece, e: Entry) -> None:
        """The shard a SendPiece reads is done (``e``), in whatever thread made
        it so. A small piece (or an error) goes at once: from the I/O thread
        straight to the peer's socket, from another thread through the outbox.
        A bigger one is copied out by a sender thread, off the I/O thread."""
        view = None
        if e.error is None:
            region = sharding.from_wire(msg.region)
            local = sharding.local_slices(sharding.from_wire(msg.sub), region)
            # a view on the shard's buffer (no copy on CPU): shared memory copies
            # from it straight into the segment; TCP needs it C-contiguous
            view = np.asarray(e.value)[local + (Ellipsis,)]
            if view.nbytes > channels.INLINE_PIECE_BYTES:
                self.pool.submit(self._send_piece, msg, e, view)
                return
        self._send_piece(msg, e, view, direct=threading.get_ident() == self.io_thread)

    def _send_piece(self, msg: m.SendPiece, e: Entry, view: np.ndarray | None,
                    direct: bool = False) -> None:
        """Send one piece: an error, inline bytes (small, or not on this
        machine, or DCN), or a shared-memory descriptor. ``direct``: this is
        the I/O thread, which may write the peer's socket itself."""
        began = time.time()
        self.sent_at.append([msg.piece_id, began])
        dcn = msg.channel == "DCN"
        if e.error is not None or view is None:
            self._post_piece(msg.dst_host, m.Piece(msg.piece_id, m.Aval([], ""), e.error), (), dcn, direct,
                             self._dgram(msg))
            return
        dgram = self._dgram(msg)
        if dgram is not None and view.nbytes <= channels.INLINE_PIECE_BYTES:
            # a small piece to a worker of this machine: the channel's own datagram
            parts = self.piece_dgrams.frames(msg.piece_id, view)
            if parts is not None:
                if self.dgram_out.send_parts(dgram, parts):       # type: ignore[union-attr]
                    self._count("ici_tcp", view.nbytes)
                    self.sent.append(m.SentPiece(msg.piece_id, began, "ICI-tcp", view.nbytes, msg.dst_host))
                    return
                dgram = None      # (its socket is gone or full: ZeroMQ)
        aval = m.Aval(list(view.shape), channels.dtype_name(view.dtype))
        if (not dcn and self.use_shm and msg.dst_machine == self.machine
                and view.nbytes > channels.INLINE_PIECE_BYTES):
            # ICI on one machine: the bytes go through shared memory
            try:
                name, offset, drop = self.shm_out.write(msg.dst_host, view)
            except OSError as err:     # /dev/shm full or gone: fall back to TCP
                log.warning("shared memory failed (%s); sending piece %d over TCP", err, msg.piece_id)
            else:
                self._count("shm", view.nbytes)
                self.sent.append(m.SentPiece(msg.piece_id, began, "ICI-shm", view.nbytes, msg.dst_host))
                self.post_peer(msg.dst_host, m.ShmPiece(msg.piece_id, aval, name, offset, view.nbytes,
                                                        drop))
                return
        data = _frame(view)
        self._post_piece(msg.dst_host, m.Piece(msg.piece_id, aval, None), [data], dcn, direct, dgram)
        # the bookkeeping after the send: not on the piece's path
        nbytes = view.nbytes
        self._count("dcn" if dcn else "ici_tcp", nbytes)
        self.sent.append(m.SentPiece(msg.piece_id, began, "DCN" if dcn else "ICI-tcp", nbytes, msg.dst_host))

    def _dgram(self, msg: "m.SendPiece | m.SendPieces") -> bytes | None:
        """The datagram socket of the piece's receiver if it is an ICI peer on
        this machine and datagrams are in use (see channels), else None."""
        if self.dgram_out is None or msg.channel == "DCN" or msg.dst_machine != self.machine:
            return None
        name = self.dgram_names.get(msg.dst_address)
        if name is None:
            name = self.dgram_names[msg.dst_address] = channels.dgram_name(self.dgram_prefix, msg.dst_address)
        return name

    def _post_piece(self, rank: int, msg: m.Piece | m.Pieces, buffers: Any, dcn: bool, direct: bool,
                    dgram: bytes | None = None) -> None:
        """Send a piece to the peer's datagram socket ``dgram`` from this
        thread, if given and it can go; else queue it for the I/O thread, or
        (``direct``, in the I/O thread, unless the DCN link is shaped) write
        it to the peer's socket now."""
        if dgram is not None and self.dgram_out is not None:
            ep = self.ep
            try:
                frames = codec.encode(ep.sign_key, msg, msg_id=ep.next_id(), sender=ep.sender,
                                      buffers=[b if type(b) is memoryview else raw(b) for b in buffers],
                                      signer=ep.signer)
            except Exception:       # the ZeroMQ path below reports it, in the same way as ever
                frames = None
            if frames is not None and self.dgram_out.send(dgram, frames):
                return
        if not direct or (dcn and self.shaped.active):
            self.post_peer(rank, msg, buffers, dcn=dcn)
            return
        try:
            self.ep.send(self._peer(rank), msg, buffers=buffers, block=False)
        except zmq.Again:
            log.error("peer %s is not reading (queue full): dropped %s", rank, type(msg).__name__)
        except Exception as err:   # one bad message must not stop the I/O thread
            log.error("cannot send %s: %s", type(msg).__name__, err)

    def _when_all_done(self, msg: m.SendPieces) -> None:
        """Send a bucket of pieces once every source shard is done."""
        entries: list[Entry | None] = [None] * len(msg.pieces)
        left = [len(msg.pieces)]
        lock = threading.Lock()

        def done(k: int, e: Entry) -> None:
            with lock:
                entries[k] = e
                left[0] -= 1
                last = left[0] == 0
            if last:         # as _piece_ready: a small bucket at once, a big one off the I/O thread
                small = sum(sharding.nbytes(sharding.from_wire(p.sub), np.dtype(e.value.dtype).name)
                            for p, e in zip(msg.pieces, entries, strict=True)
                            if e.error is None) <= channels.INLINE_PIECE_BYTES
                if small:
                    self._send_pieces(msg, entries, direct=threading.get_ident() == self.io_thread)
                else:
                    self.pool.submit(self._send_pieces, msg, entries)
        for k, p in enumerate(msg.pieces):
            self.store.when_done(shard_key(p.buffer, p.device, p.region), lambda e, k=k: done(k, e))

    def _send_pieces(self, msg: m.SendPieces, entries: list[Entry], direct: bool = False) -> None:
        """One message (Pieces) for the bucket's pieces; a piece whose shard
        failed goes alone, as a Piece with the error."""
        began = time.time()
        dcn = msg.channel == "DCN"
        ids, avals, datas = [], [], []
        for p, e in zip(msg.pieces, entries, strict=True):
            self.sent_at.append([p.piece_id, began])
            if e.error is not None:
                self._post_piece(msg.dst_host, m.Piece(p.piece_id, m.Aval([], ""), e.error), (), dcn, direct,
                                 self._dgram(msg))
                continue
            region = sharding.from_wire(p.region)
            view = np.asarray(e.value)[sharding.local_slices(sharding.from_wire(p.sub), region) + (Ellipsis,)]
            data = view if view.flags.c_contiguous else view.copy(order="C")
            ids.append(p.piece_id)
            avals.append(m.Aval(list(data.shape), channels.dtype_name(data.dtype)))
            datas.append(data)
        if not ids:
            return
        nbytes = sum(d.nbytes for d in datas)
        self._count("dcn" if dcn else "ici_tcp", nbytes)
        for pid, d in zip(ids, datas, strict=True):
            self.sent.append(m.SentPiece(pid, began, "DCN" if dcn else "ICI-tcp", d.nbytes, msg.dst_host))
        self._post_piece(msg.dst_host, m.Pieces(ids, avals), datas, dcn, direct, self._dgram(msg))

    def _count(self, channel: str, nbytes: int) -> None:
        self.stats[f"sent_{channel}"] += 1      # GIL-atomic enough for counters
        self.stats[f"bytes_{channel}"] += nbytes

    # ---- data messages -------------------------------------------------------
    def _handle_data(self, ident: bytes, msg_id: int, msg: Record, buffers: list) -> None:
        match msg:
            case m.Put() if self.state.put_from_gone_client(msg.buffer):
                log.debug("buffer %d: its client is gone; its Put dropped", msg.buffer)
            case m.Put() if self.store.was_freed(msg.buffer):
                # freed before it came (the Free took the other connection; e.g.
                # the controller rejected its call): keeping it would keep it for good
                log.debug("buffer %d was freed before its Put came: dropped", msg.buffer)
            case m.Piece() if msg.error is None:
                self._piece_in(ident, msg_id, msg, buffers)
            case m.Put():
                key = shard_key(msg.buffer, msg.device, msg.region)
                try:
                    arr = _array(msg.aval, buffers)
                    if self.executor is None or msg.device not in self.executor.devices:
                        raise ValueError(f"device {msg.device} is not on host {self.rank}")
                    shape = sharding.region_shape(sharding.from_wire(msg.region))
                    if arr.shape != shape:
                        raise ValueError(f"shard shape {arr.shape} does not match region {shape}")
                    arr = to_device(arr, self.executor.devices[msg.device])
                except Exception as e:
                    # Reject it, and fail whatever waits on it rather than let it
                    # wait: a bad one (ValueError, TypeError), or one that the
                    # device did not take
                    bad = isinstance(e, (ValueError, TypeError))
                    if not bad:
                        log.exception("Put of buffer %d onto device %d", msg.buffer, msg.device)
                    text = str(e) if bad else f"{type(e).__name__}: {e}"
                    self.post_data(ident, m.Error(ErrorKind.BAD_REQUEST if bad else ErrorKind.REMOTE_ERROR,
                                                  text), parent=msg_id)
                    self.store.set(key, error=m.ErrorInfo(ErrorKind.REMOTE_ERROR, f"bad Put: {text}"
                                                          if bad else f"Put failed: {text}", self.rank, "", ""))
                    return
                if not self.store.set(key, arr, unless_freed=msg.buffer):
                    log.debug("buffer %d was freed while its Put came in: dropped", msg.buffer)
            case m.Piece():
                self.store.set(PieceKey(msg.piece_id), error=msg.error)
            case m.Pieces():
                if not len(msg.piece_ids) == len(msg.avals) == len(buffers):
                    self.post_data(ident, m.Error(ErrorKind.BAD_REQUEST, f"Pieces: {len(msg.piece_ids)} ids, "
                                                  f"{len(msg.avals)} avals, {len(buffers)} buffers"),
                                   parent=msg_id)
                    return
                self.stats["recv_tcp"] += 1
                now = time.time()
                for pid, aval, buf in zip(msg.piece_ids, msg.avals, buffers, strict=True):
                    key = PieceKey(pid)
                    try:
                        arr = _array(aval, [buf])
                    except (ValueError, TypeError) as e:
                        self.store.set(key, error=m.ErrorInfo(ErrorKind.REMOTE_ERROR, f"bad Pieces: {e}",
                                                              self.rank, "", ""))
                        continue
                    self.received_at.append([pid, now])
                    self.store.set(key, arr)
            case m.PieceChunk():
                key = PieceKey(msg.piece_id)
                try:
                    arr = self.chunks.take(msg, buffers)
                except (ValueError, TypeError) as e:
                    self.chunks.refuse(msg.piece_id)
                    self.post_data(ident, m.Error(ErrorKind.BAD_REQUEST, str(e)), parent=msg_id)
                    self.store.set(key, error=m.ErrorInfo(ErrorKind.REMOTE_ERROR, f"bad PieceChunk: {e}",
                                                          self.rank, "", ""))
                    return
                if arr is not None:
                    self.stats["recv_tcp"] += 1
                    self.received_at.append([msg.piece_id, time.time()])
                    self.store.set(key, arr)
            case m.ShmPiece():
                key = PieceKey(msg.piece_id)
                lent = False
                try:
                    if self.state.lend(msg.offset, msg.size):
                        # no copy: the piece stays in the segment, acknowledged
                        # once nothing here refers to it (see _ack_freed)
                        raw = self.shm_in.view(msg.segment, msg.offset, msg.size, msg.drop,
                                               self._freed_callback(ident, msg.segment, msg.size))
                        lent = True
                        self.state.lent(msg.size)
                    else:
                        raw = self.shm_in.take(msg.segment, msg.offset, msg.size, msg.drop)
                except (OSError, ValueError) as err:
                    self.store.set(key, error=m.ErrorInfo(ErrorKind.REMOTE_ERROR, f"bad ShmPiece: {err}",
                                                          self.rank, "", ""))
                    return
                finally:
                    if not lent:
                        self.post_data(ident, m.ShmAck([msg.segment]), parent=msg_id)
                try:
                    arr = _array(msg.aval, [raw])
                except (ValueError, TypeError) as err:
                    self.store.set(key, error=m.ErrorInfo(ErrorKind.REMOTE_ERROR, f"bad ShmPiece: {err}",
                                                          self.rank, "", ""))
                    return
                self.stats["recv_shm"] += 1
                self.received_at.append([msg.piece_id, time.time()])
                self.store.set(key, arr)
            case m.Forwarded():
                self._forwarded(msg, buffers)
            case m.ExecDoneBatch() if msg.relay == self.rank:
                now = time.monotonic()
                try:
                    rows = m.rows_of(msg)
                except ValueError as e:
                    self.post_data(ident, m.Error(ErrorKind.BAD_REQUEST, str(e)), parent=msg_id)
                    return
                for row in rows:
                    self.relay.row_in(row, now)
            case m.ChannelStatsRequest():
                self.stats["segments"] = self.shm_out.live()
                self.post_data(ident, m.ChannelStats(**{**self.stats, "sent_at": list(self.sent_at),
                                                        "received_at": list(self.received_at),
                                                        "sent": list(self.sent), "now": time.time()}),
                               parent=msg_id)
                if msg.reset:
                    self.stats = dict.fromkeys(self.stats, 0)
                    self.sent_at.clear()
                    self.received_at.clear()
                    self.sent.clear()
            case m.Fetch():
                # answered when the shard is done, or with an error at the
                # deadline; no thread waits meanwhile
                pending = self.state.fetch(ident, msg, time.monotonic())
                if pending is None:
                    self.post_data(ident, m.FetchReply(msg.request, m.Aval([], ""), m.ErrorInfo(
                        ErrorKind.RESOURCE_ERROR, f"client {client_of(msg.buffer)} has too many fetches "
                        f"waiting on host {self.rank}", self.rank, "", "")))
                    return
                pending.key = shard_key(msg.buffer, msg.device, msg.region)
                pending.cb = lambda e, p=pending: self._answer_fetch(p, e)
                self.store.when_done(pending.key, pending.cb)
            case _:
                self.post_data(ident, m.Error(ErrorKind.BAD_REQUEST, f"{type(msg).__name__} is not "
                                              "accepted on the data port"), parent=msg_id)

    def _piece_in(self, ident: bytes | None, msg_id: int, msg: m.Piece, buffers: list) -> None:
        """A piece's bytes (a Piece without an error, by ZeroMQ or as a
        datagram): stored as an array for what reads it; a bad one fails it.
        Counters after the store: what waits for the piece wakes first."""
        key = PieceKey(msg.piece_id)
        try:
            arr = _array(msg.aval, buffers)
        except (ValueError, TypeError) as e:
            # Reject it, and fail whatever waits on it rather than let it wait.
            self.post_data(ident, m.Error(ErrorKind.BAD_REQUEST, str(e)), parent=msg_id)
            self.store.set(key, error=m.ErrorInfo(ErrorKind.REMOTE_ERROR, f"bad Piece: {e}", self.rank, "", ""))
            return
        self._piece_arrived(msg.piece_id, arr)

    def _piece_arrived(self, piece_id: int, arr: np.ndarray) -> None:
        """A piece checked and made an array: stored for what reads it."""
        self.received_at.append([piece_id, time.time()])
        self.store.set(PieceKey(piece_id), arr)
        self.stats["recv_tcp"] += 1

    # ---- relays (relay.py) ------------------------------------------------------
    def _relay(self, msg: m.Relay, buffers: list) -> None:
        """As a relay: forward the message to the group's other hosts, from
        this (the I/O) thread, before running it here if it is ours too."""
        why = relays.check_relay(msg, buffers)
        if why:
            log.warning("%s", why)
            return
        frames = [bytes(b) for b in buffers]
        mine, after, forwards = relays.forwards(msg, self.rank, self.data_address)
        for address, fwd in forwards:
            self.peer_addrs.setdefault(fwd.hosts[0], (address, ""))
            self._post_piece(fwd.hosts[0], fwd, frames, False, True)      # straight to its socket
        if msg.collect:
            self.relay.collect(msg.collect, msg.hosts)
        if mine:
            self._run_forwarded(self.rank, self.data_address, after, msg.collect, frames)

    def _forwarded(self, msg: m.Forwarded, buffers: list) -> None:
        why = relays.check_relay(msg, buffers)
        if why:
            log.warning("%s", why)
            return
        for host, after in zip(msg.hosts, msg.after, strict=True):
            if host == self.rank:
                self._run_forwarded(msg.relay, msg.address, after, msg.collect, buffers)

    def _run_forwarded(self, relay: int, address: str, after: int, collect: list[int], frames: list) -> None:
        """A message of the controller that relay ``relay`` forwarded: checked
        as if it came on the control socket, handled in its turn."""
        try:
            header, msg, buffers = self.ep.decode(frames, None, self.keys.of)
        except BadMessage as e:
            log.warning("rejected a message relay %d forwarded: %s", relay, e)
            return
        if header.signer != CLUSTER or type(msg) is m.Batch:
            log.warning("rejected a %s relay %d forwarded: not one message of the controller",
                        type(msg).__name__, relay)
            return
        for item, bufs in self.relay.forwarded(relay, address, after, collect, msg, buffers, time.monotonic()):
            self._handle_ctl(item, bufs)

    def _relay_lost(self, rank: int) -> None:
        """Host ``rank`` was lost: what waited for it as a relay goes on, and
        the rows this host sent it go to the controller."""
        now = time.monotonic()
        for item, bufs in self.relay.relay_lost(rank, now):
            self._handle_ctl(item, bufs)
        rows = self.relay.rows_for_lost(rank, now)
        if rows:
            self.post_ctl(m.batch_of(rows))
        self.relay.forget_host(rank)

    def _to_relays(self, to_ctl: list[tuple[Record, int, int]]) -> list[tuple[Record, int, int]]:
        """Reports of computations that came through a relay go to it (this
        host's own, as a relay, to the rows it collects); the rest, and
        failures too, to the controller."""
        now = time.monotonic()
        rest: list[tuple[Record, int, int]] = []
        rows: dict[int, list[m.ExecRow]] = {}
        for entry in to_ctl:
            msg = entry[0]
            dest = self.relay.route(msg.exec_id) if type(msg) is m.ExecDone else None
            if dest is None or msg.error is not None:
                # (a failure goes straight to the controller as well: it may be
                # the relay's own death that broke a collective)
                rest.append(entry)
                if dest is None:
                    continue
            row = relays.row_of(self.rank, msg)
            if dest[0] == self.rank:
                self.relay.row_in(row, now)
                continue
            self.peer_addrs.setdefault(dest[0], (dest[1], ""))
            rows.setdefault(dest[0], []).append(row)
        for relay, mine in rows.items():
            self._post_piece(relay, m.batch_of(mine, relay), (), False, True)
            for row in mine:
                self.relay.sent_row(relay, row, now)
        return rest

    def _relay_due(self) -> float:
        """Pass on the rows a relay collected once due, and what waited past
        its time; returns seconds until the next is due."""
        now = time.monotonic()
        for item, bufs in self.relay.expire(now):
            self._handle_ctl(item, bufs)
        rows = self.relay.take_rows(now)
        if rows:
            self.post_ctl(m.batch_of(rows))
        due = self.relay.next_due_in(now)
        return relays.IDLE if due is None else due

    def _answer_fetch(self, p: PendingFetch, e: Entry) -> None:
        """Fetch ``p``'s shard is done (``e``), in whatever thread made it so
        (the I/O thread if it was done already). A small one (or an error) is
        answered here, as ``_piece_ready`` sends a small piece: its copy to the
        host costs a few µs on a CPU (on a GPU, a copy of at most 64 KiB from
        the device), the hand-off to a sender thread two thread wake-ups
        (docs/benchmarks.md, fetch.py). A bigger one is copied out by a sender
        thread, so that its copy holds up no computation; so are those of a
        client with more than INLINE_FETCHES_WAITING fetches waiting here,
        so that no client's fetches hold up for long the thread that stores a
        shard they wait for. A ``wait_only`` fetch reads nothing of the shard:
        it is answered as a small one is, without it."""
        try:
            inline = e.error is not None or (
                (p.msg.wait_only or self._fetch_bytes(p, e) <= channels.INLINE_PIECE_BYTES)
                and self.state.pending_fetches.get(client_of(p.msg.buffer), 0) <= INLINE_FETCHES_WAITING)
        except Exception:     # (a bug) the sender thread reads the shard: its failure is answered
            log.exception("sizing a fetch of buffer %d", p.msg.buffer)
            inline = False
        if inline:
            self._reply_fetch(p, e)       # (a bug there is logged by the store: Store._wake)
        else:
            self.pool.submit(self._reply_fetch, p, e)

    @staticmethod
    def _fetch_bytes(p: PendingFetch, e: Entry) -> int:
        """How many bytes fetch ``p`` reads of its shard ``e``, without
        splitting the shard out of its computation's output (``Unsplit``)."""
        itemsize = e.itemsize()
        if itemsize is None:
            return channels.INLINE_PIECE_BYTES + 1
        return itemsize * math.prod(b - a for a, b in p.msg.region)

    def _reply_fetch(self, p: PendingFetch, e: Entry) -> None:
        """Answer a fetch whose shard is done (``_answer_fetch``). It is claimed
        first, so nothing else answers it: a failure to read the shard is
        answered too, with the error, rather than left to the client's deadline."""
        if not p.claim():
            return          # already answered at its deadline
        if e.error is not None or p.msg.wait_only:
            self.post_data(p.ident, m.FetchReply(p.msg.request, m.Aval([], ""), e.error))
            return
        try:
            data = sharding.cut(e.value, ())
            aval = m.Aval(list(data.shape), channels.dtype_name(data.dtype))
        except Exception as ex:
            log.exception("fetch of buffer %d", p.msg.buffer)
            self.post_data(p.ident, m.FetchReply(p.msg.request, m.Aval([], ""), m.ErrorInfo(
                ErrorKind.REMOTE_ERROR, f"reading buffer {p.msg.buffer} on host {self.rank} failed: "
                f"{type(ex).__name__}: {ex}", self.rank, "", "")))
            return
        self.post_data(p.ident, m.FetchReply(p.msg.request, aval, None), [data])

    def _expire_fetches(self) -> float:
        """Answer fetches whose deadline passed; returns seconds to look again."""
        now = time.monotonic()
        for p in self.state.expire_fetches(now):
            self.store.forget(p.key, p.cb)
            self.post_data(p.ident, m.FetchReply(p.msg.request, m.Aval([], ""), self.state.deadline_error(p)))
        return self.state.next_deadline_in(now)


# dtypes by name as JAX knows them (bfloat16 too), remembered: only names that
# were found, and few of them
_DTYPES: dict[str, np.dtype] = {}


def _array(aval: m.Aval, buffers: list) -> np.ndarray:
    if len(buffers) != 1:
        raise ValueError(f"expected one data buffer, got {len(buffers)}")
    dtype = _DTYPES.get(aval.dtype)
    if dtype is None:
        try:
            dtype = np.dtype(jnp.dtype(aval.dtype))
        except TypeError:
            raise ValueError(f"unknown dtype {aval.dtype!r}") from None
        if dtype.kind == "O":
            raise ValueError(f"dtype {aval.dtype!r} cannot be sent")
        if len(_DTYPES) < 64:
            _DTYPES[aval.dtype] = dtype
    shape = tuple(aval.shape)
    if buffers[0].nbytes != dtype.itemsize * math.prod(shape) or min(shape, default=0) < 0:
        raise ValueError(f"{buffers[0].nbytes} bytes do not make a {aval.dtype}{list(shape)}")
    # one call (not frombuffer, then reshape): numpy calls are what a small
    # piece's path costs most on a CPU that was idle (docs/benchmarks.md, transfer.py)
    return np.ndarray(shape, dtype, buffer=buffers[0])


def _frame(view: np.ndarray) -> Any:
    """A piece's bytes as one frame: a flat byte memoryview of a C-contiguous
    array (no copy, and one call where numpy's flags, reshape and view are
    three); a C-ordered uint8 copy of a strided view or of a dtype that has no
    buffer format (bfloat16)."""
    try:
        return memoryview(view).cast("B")
    except (TypeError, ValueError, BufferError):
        return raw(np.ascontiguousarray(view))


def _bind_address(bind_host: str, coordinator: str) -> str:
    """``bind_host`` with the coordinator's port (an IPv6 address in brackets)."""
    port = coordinator.rsplit(":", 1)[1]
    host = f"[{bind_host}]" if ":" in bind_host and not bind_host.startswith("[") else bind_host
    return f"{host}:{port}"


def _gloo_listens_on(address: str, collectives_nice: int = 0) -> None:
    """Make gloo (CPU collectives between an island's hosts) listen on, and tell
    its peers, this worker's address. By default gloo uses the address the host
    name resolves to, which is 127.0.0.1 or 127.0.1.1 on many machines (the
    other hosts then cannot connect) and the same for every network namespace of
    one machine. Must run after ``jax.distributed.initialize`` and before the
    first use of a device; it replaces JAX's CPU backend factory (an internal
    API: if it has changed, gloo keeps its default and a warning says so)."""
    try:
        if _gloo_missing is not None:
            raise _gloo_missing

        def make_cpu_client() -> Any:
            before = _threads()
            collectives = _jaxlib.make_gloo_tcp_collectives(
                distributed_client=_jax_distributed.global_state.client, hostname=address)
            _lower_priority(_threads() - before, collectives_nice)
            return _xla_bridge.make_cpu_client(collectives=collectives)

        _xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)
    except Exception as e:  # noqa: BLE001 (an internal API of another project)
        log.warning("cannot bind gloo to %s (%s: %s); it uses the host name's address",
                    address, type(e).__name__, e)


def _threads() -> set[int]:
    """This process's threads (Linux; empty elsewhere)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _lower_priority(threads: set[int], nice: int) -> None:
    """Add ``nice`` to the niceness of these threads of this process (Linux
    keeps a niceness per thread).

    Used for gloo's network thread: it polls a connection with epoll, and while
    another thread of the process holds that connection's lock (the thread
    running the computation, in the middle of a send or a receive) each event
    it cannot handle comes back at once, so it spins. On a machine with few
    cores that spin takes the core the lock holder needs to finish
    (docs/benchmarks.md, island_dispatch.py: ~170,000 epoll_wait calls a second
    on one host, a third of a core). At a higher niceness it still runs at once
    when a core is free, but yields to the process's other threads, and to
    other processes, while it spins."""
    if not nice:
        return
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        except OSError as e:          # the thread ended, or not allowed here
            log.debug("cannot lower the priority of thread %d: %s", tid, e)
    if threads:
        log.info("CPU collectives' threads %s at niceness +%d", sorted(threads), nice)


class _Stopped(Exception):
    """Asked to stop (SIGTERM, SIGINT) while registering."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zpath worker", description="Run a zpath worker host.")
    p.add_argument("--controller", required=True, help="controller address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--island", type=int, default=0, help="island this host belongs to")
    p.add_argument("--bind-host", default="127.0.0.1", help="address to listen on for data")
    p.add_argument("--name", help="host name shown in status (default hostname:pid)")
    p.add_argument("--rank", type=int, default=-1,
                   help="host rank to ask for (a launcher numbers its hosts so that ranks and names "
                        "agree; default: the next free one)")
    p.add_argument("--coordinator", default="",
                   help="HOST:PORT of the island's jax.distributed coordinator (islands of several hosts)")
    p.add_argument("--num-processes", type=int, default=1, help="hosts in this island's runtime")
    p.add_argument("--process-id", type=int, default=0, help="this host's index in the island runtime")
    p.add_argument("--dcn-latency-ms", type=float, default=0.0,
                   help="emulated one-way latency added to DCN (cross-island) pieces this host sends")
    p.add_argument("--dcn-gbps", type=float, default=0.0,
                   help="emulated bandwidth cap of this host's DCN link in Gbit/s (0: none)")
    p.add_argument("--dcn-encrypt", action="store_true",
                   help="receive DCN pieces on a CURVE-encrypted port and encrypt those sent")
    args = p.parse_args(argv)
    die_with_parent()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack
    try:
        config, common = WorkerConfig.from_env(), CommonConfig.from_env()
    except ZpathError as e:
        print(f"zpath worker: {e}", file=sys.stderr, flush=True)
        return 2
    logs.setup(f"worker[island {args.island}]", common.log_level)
    if not 0 <= args.process_id < args.num_processes:
        p.error(f"--process-id must be in [0, {args.num_processes})")
    if args.num_processes > 1 and not args.coordinator:
        p.error("--num-processes > 1 needs --coordinator")
    if args.dcn_latency_ms < 0 or args.dcn_gbps < 0:
        p.error("--dcn-latency-ms and --dcn-gbps must be >= 0")
    if args.dcn_encrypt and not zmq.has("curve"):
        log.error("--dcn-encrypt needs CURVE, but this libzmq (%s) was built without it",
                  zmq.zmq_version())
        return 2
    key = key_from_config(common)
    w = Worker(key, args.controller, args.island, bind_host=args.bind_host, name=args.name,
               coordinator=args.coordinator, num_processes=args.num_processes,
               process_id=args.process_id, dcn_latency_ms=args.dcn_latency_ms,
               dcn_gbps=args.dcn_gbps, dcn_encrypt=args.dcn_encrypt, config=config, common=common,
               rank=args.rank, worker_key=worker_key_from_config(common, key))
    signal.signal(signal.SIGTERM, w.stop)
    signal.signal(signal.SIGINT, w.stop)
    try:
        w.register()
    except _Stopped:
        log.info("stopped before it registered")
        w.close()
        return 0
    except ZpathError as e:
        log.error("%s", e)
        w.close()
        return 1
    logs.setup(f"worker[host {w.rank}]", common.log_level)
    # What start-up made (JAX, XLA's Python objects: ~100k) lives as long as the
    # process: keep it out of the collector's full passes, which otherwise
    # stall this host for 50-90 ms every second or two of busy work.
    gc.freeze()
    w.serve_forever()
    logging.shutdown()
    # Threads may still wait on shards (fetches, inputs); do not let the
    # interpreter join them at exit.
    os._exit(0)
