"""The worker process: registers with the controller, then serves two sockets.

* control: a DEALER to the controller (programs, Execute, SendPiece, Ping).
* data: a ROUTER other workers and clients connect to (Put, Piece, Fetch).

The I/O thread owns both sockets and one DEALER per peer; the executor thread
runs computations; replies that wait on a shard are sent from a small pool once
the shard is done."""
from __future__ import annotations

import concurrent.futures
import faulthandler
import heapq
import logging
import os
import signal
import socket
import threading
import time
from typing import Any

import numpy as np
import zmq

from zpath import sharding
from zpath.errors import ZpathError
from zpath.net import messages as m
from zpath.net.codec import PROTOCOL_VERSION, Record
from zpath.net.transport import BadMessage, Endpoint, Outbox, backoff, make_context
from zpath.worker.executor import Executor
from zpath.worker.store import Entry, Store, shard_key

log = logging.getLogger(__name__)

CONTROLLER_SILENCE_S = float(os.environ.get("ZPATH_CONTROLLER_TIMEOUT", "15"))
REGISTER_TIMEOUT_S = 60.0
MAX_FETCH_TIMEOUT_S = 3600.0


class Worker:
    def __init__(self, key: bytes, controller: str, island: int, *,
                 bind_host: str = "127.0.0.1", name: str | None = None,
                 coordinator: str = "", num_processes: int = 1, process_id: int = 0) -> None:
        import jax

        jax.config.update("jax_enable_x64", True)
        self.coordinator = coordinator if num_processes > 1 else ""
        self.num_processes, self.process_id = num_processes, process_id
        if self.coordinator:
            # One JAX runtime for the island's hosts, so a computation can span
            # them; CPU collectives go through gloo (GPUs use their own).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            log.info("joining island runtime at %s as process %d of %d", coordinator,
                     process_id, num_processes)
            jax.distributed.initialize(coordinator, num_processes=num_processes,
                                       process_id=process_id,
                                       initialization_timeout=int(REGISTER_TIMEOUT_S))
        self.jax = jax
        self.local = jax.local_devices()
        self.platform = self.local[0].platform
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.island = island
        self.ep = Endpoint(key, f"worker:{self.name}")
        self.ctx = make_context()
        self.ctl = self.ctx.socket(zmq.DEALER)
        self.ctl.connect(controller)
        self.data = self.ctx.socket(zmq.ROUTER)
        port = self.data.bind_to_random_port(f"tcp://{bind_host}")
        self.data_address = f"tcp://{bind_host}:{port}"
        self.peer_socks: dict[int, zmq.Socket] = {}
        self.peer_addrs: dict[int, str] = {}
        self.outbox = Outbox()
        self.store = Store()
        self.pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="send")
        self.rank: int | None = None
        self.executor: Executor | None = None
        self.running = True
        self.last_controller = time.monotonic()
        self.fetch_deadlines: list[tuple[float, int, _PendingFetch]] = []   # heap

    # ---- start-up ------------------------------------------------------------
    def register(self) -> None:
        msg = m.RegisterWorker(self.name, self.island, self.data_address, os.getpid(),
                               self.platform, len(self.local), PROTOCOL_VERSION,
                               [d.id for d in self.local], self.coordinator, self.process_id,
                               self.num_processes)
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        attempt = 0
        while time.monotonic() < deadline and self.running:
            self.ep.send(self.ctl, msg)
            if self.ctl.poll(int(min(2.0, 0.5 + backoff(attempt)) * 1000)):
                _, header, reply, _ = self.ep.recv(self.ctl)
                match reply:
                    case m.Registered():
                        self.rank = reply.rank
                        devices = {d.id: self.local[d.local_index] for d in reply.devices}
                        self.executor = Executor(self.store, devices, self._exec_done,
                                                 jax_devices={d.id: d for d in self.jax.devices()})
                        self.executor.rank = reply.rank
                        self.executor.start()
                        log.info("registered as host %d with devices %s", reply.rank,
                                 sorted(devices))
                        return
                    case m.Error():
                        raise ZpathError(f"controller refused registration: {reply.message}")
            attempt += 1
        raise ZpathError(f"controller did not answer within {REGISTER_TIMEOUT_S:.0f}s")

    # ---- helpers used from any thread ---------------------------------------
    def post_ctl(self, msg: Record) -> None:
        self.outbox.put("ctl", None, msg, (), 0)

    def post_data(self, ident: bytes, msg: Record, buffers: Any = (), parent: int = 0) -> None:
        self.outbox.put("data", ident, msg, buffers, parent)

    def post_peer(self, rank: int, msg: Record, buffers: Any = ()) -> None:
        self.outbox.put("peer", rank, msg, buffers, 0)

    def _exec_done(self, exec_id: int, error: m.ErrorInfo | None, start: float, end: float) -> None:
        self.post_ctl(m.ExecDone(exec_id, error, start, end))

    # ---- I/O loop ------------------------------------------------------------
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        poller.register(self.data, zmq.POLLIN)
        poller.register(self.outbox.fd, zmq.POLLIN)
        self.last_controller = time.monotonic()
        while self.running:
            wait = min(0.5, self._expire_fetches())
            events = dict(poller.poll(timeout=max(1, int(wait * 1000))))
            if self.ctl in events:
                self._drain(self.ctl, router=False)
            if self.data in events:
                self._drain(self.data, router=True)
            if self.outbox.fd in events:
                self._flush()
            if time.monotonic() - self.last_controller > CONTROLLER_SILENCE_S:
                log.error("no word from the controller for %.0fs: exiting", CONTROLLER_SILENCE_S)
                self.running = False
        self.close()

    def close(self) -> None:
        if self.executor is not None:
            self.executor.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        for s in [self.ctl, self.data, *self.peer_socks.values()]:
            s.close(0)
        self.ctx.term()
        self.outbox.close()

    def stop(self, *_: Any) -> None:
        self.running = False

    def _flush(self) -> None:
        for kind, target, msg, buffers, parent in self.outbox.drain():
            try:
                if kind == "ctl":
                    self.ep.send(self.ctl, msg, block=False)
                elif kind == "data":
                    self.ep.send(self.data, msg, to=target, buffers=buffers, parent=parent, block=False)
                else:
                    self.ep.send(self._peer(target), msg, buffers=buffers, block=False)
            except zmq.Again:
                log.error("%s %s is not reading (queue full): dropped %s", kind, target, type(msg).__name__)
            except Exception as e:   # one bad message must not stop the I/O thread
                log.error("cannot send %s: %s", type(msg).__name__, e)

    def _peer(self, rank: int) -> zmq.Socket:
        s = self.peer_socks.get(rank)
        if s is None:
            s = self.ctx.socket(zmq.DEALER)
            s.connect(self.peer_addrs[rank])
            self.peer_socks[rank] = s
        return s

    def _drain(self, sock: zmq.Socket, router: bool) -> None:
        for _ in range(1000):
            try:
                ident, header, msg, buffers = self.ep.recv(sock, router=router)
            except zmq.Again:
                return
            except BadMessage as e:
                log.warning("rejected message on %s socket: %s", "data" if router else "control", e)
                if router and e.ident is not None:
                    self.ep.send(self.data, m.Error("protocol", str(e)), to=e.ident,
                                 parent=e.header.msg_id if e.header else 0)
                continue
            try:
                if router:
                    self._handle_data(ident, header.msg_id, msg, buffers)
                else:
                    self.last_controller = time.monotonic()
                    self._handle_ctl(msg, buffers)
            except Exception:
                log.exception("error handling %s", type(msg).__name__)
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return

    # ---- control messages ----------------------------------------------------
    def _handle_ctl(self, msg: Record, buffers: list) -> None:
        assert self.executor is not None
        match msg:
            case m.Execute():
                self.executor.submit(msg)
            case m.SendPiece():
                self.peer_addrs.setdefault(msg.dst_host, msg.dst_address)
                key = shard_key(msg.buffer, msg.device, msg.region)
                self.store.when_done(key, lambda e, msg=msg: self.pool.submit(self._send_piece, msg, e))
            case m.RegisterProgram():
                if len(buffers) == 1:
                    self.executor.add_program(msg.digest, bytes(buffers[0]))
            case m.Ping():
                self.post_ctl(m.Pong(msg.seq, *self.store.stats()))
            case m.Free():
                self.executor.free_after_earlier(msg.buffers)
            case m.Shutdown():
                log.info("controller asked us to exit: %s", msg.reason)
                self.running = False
            case m.Pong() | m.Registered():
                pass
            case m.Error():
                log.warning("controller reported: %s: %s", msg.code, msg.message)
            case _:
                log.warning("unexpected %s from the controller", type(msg).__name__)

    def _send_piece(self, msg: m.SendPiece, e: Entry) -> None:
        if e.error is not None:
            self.post_peer(msg.dst_host, m.Piece(msg.piece_id, m.Aval([], ""), e.error))
            return
        region = sharding.from_wire(msg.region)
        local = tuple((a.start, a.stop) for a in sharding.local_slices(sharding.from_wire(msg.sub), region))
        data = sharding.cut(e.value, local)
        self.post_peer(msg.dst_host, m.Piece(msg.piece_id, m.Aval(list(data.shape), data.dtype.name),
                                             None), [data])

    # ---- data messages -------------------------------------------------------
    def _handle_data(self, ident: bytes, msg_id: int, msg: Record, buffers: list) -> None:
        match msg:
            case m.Put() | m.Piece() if not getattr(msg, "error", None):
                key = shard_key(msg.buffer, msg.device, msg.region) if isinstance(msg, m.Put) \
                    else ("p", msg.piece_id)
                try:
                    arr = _array(msg.aval, buffers)
                    if isinstance(msg, m.Put):
                        if self.executor is None or msg.device not in self.executor.devices:
                            raise ValueError(f"device {msg.device} is not on host {self.rank}")
                        shape = sharding.region_shape(sharding.from_wire(msg.region))
                        if arr.shape != shape:
                            raise ValueError(f"shard shape {arr.shape} does not match region {shape}")
                        arr = self.jax.device_put(arr, self.executor.devices[msg.device])
                except (ValueError, TypeError) as e:
                    # Reject it, and fail whatever waits on it rather than let it wait.
                    self.post_data(ident, m.Error("bad_request", str(e)), parent=msg_id)
                    self.store.set(key, error=m.ErrorInfo("RemoteError", f"bad {type(msg).__name__}: {e}",
                                                          self.rank, "", ""))
                    return
                self.store.set(key, arr)
            case m.Piece():
                self.store.set(("p", msg.piece_id), error=msg.error)
            case m.Fetch():
                # answered when the shard is done, or with an error at the
                # deadline; no thread waits meanwhile
                key = shard_key(msg.buffer, msg.device, msg.region)
                timeout = msg.timeout_s if msg.timeout_s == msg.timeout_s else 0.0   # NaN
                timeout = min(max(timeout, 0.0), MAX_FETCH_TIMEOUT_S)
                pending = _PendingFetch(ident, msg)
                heapq.heappush(self.fetch_deadlines, (time.monotonic() + timeout, id(pending), pending))
                self.store.when_done(key, lambda e, p=pending: self.pool.submit(self._reply_fetch, p, e))
            case _:
                self.post_data(ident, m.Error("bad_request", f"{type(msg).__name__} is not "
                                              "accepted on the data port"), parent=msg_id)

    def _reply_fetch(self, p: "_PendingFetch", e: Entry) -> None:
        if not p.claim():
            return          # already answered at its deadline
        if e.error is not None:
            self.post_data(p.ident, m.FetchReply(p.msg.request, m.Aval([], ""), e.error))
            return
        data = sharding.cut(e.value, ())
        self.post_data(p.ident, m.FetchReply(p.msg.request, m.Aval(list(data.shape), data.dtype.name),
                                             None), [data])

    def _expire_fetches(self) -> float:
        """Answer fetches whose deadline passed; returns seconds to the next one."""
        now = time.monotonic()
        while self.fetch_deadlines and self.fetch_deadlines[0][0] <= now:
            _, _, p = heapq.heappop(self.fetch_deadlines)
            if p.claim():
                err = m.ErrorInfo("DeadlineExceeded", f"buffer {p.msg.buffer} was not ready on host "
                                  f"{self.rank} within {p.msg.timeout_s:.1f}s", self.rank, "", "")
                self.post_data(p.ident, m.FetchReply(p.msg.request, m.Aval([], ""), err))
        return self.fetch_deadlines[0][0] - now if self.fetch_deadlines else 0.5


class _PendingFetch:
    """A fetch waiting for its shard; answered once (value, error or deadline)."""

    def __init__(self, ident: bytes, msg: m.Fetch) -> None:
        self.ident, self.msg = ident, msg
        self._lock = threading.Lock()
        self._answered = False

    def claim(self) -> bool:
        with self._lock:
            if self._answered:
                return False
            self._answered = True
            return True


def _array(aval: m.Aval, buffers: list) -> np.ndarray:
    import jax.numpy as jnp

    if len(buffers) != 1:
        raise ValueError(f"expected one data buffer, got {len(buffers)}")
    try:
        dtype = np.dtype(jnp.dtype(aval.dtype))
    except TypeError:
        raise ValueError(f"unknown dtype {aval.dtype!r}") from None
    if dtype.kind == "O":
        raise ValueError(f"dtype {aval.dtype!r} cannot be sent")
    shape = tuple(aval.shape)
    if any(s < 0 for s in shape) or buffers[0].nbytes != dtype.itemsize * int(np.prod(shape)):
        raise ValueError(f"{buffers[0].nbytes} bytes do not make a {aval.dtype}{list(shape)}")
    return np.frombuffer(buffers[0], dtype=dtype).reshape(shape)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from zpath import logs
    from zpath.keys import key_from_env

    p = argparse.ArgumentParser(prog="zpath worker", description="Run a zpath worker host.")
    p.add_argument("--controller", required=True, help="controller address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--island", type=int, default=0, help="island this host belongs to")
    p.add_argument("--bind-host", default="127.0.0.1", help="address to listen on for data")
    p.add_argument("--name", help="host name shown in status (default hostname:pid)")
    p.add_argument("--coordinator", default="",
                   help="HOST:PORT of the island's jax.distributed coordinator (islands of several hosts)")
    p.add_argument("--num-processes", type=int, default=1, help="hosts in this island's runtime")
    p.add_argument("--process-id", type=int, default=0, help="this host's index in the island runtime")
    args = p.parse_args(argv)
    from zpath.launcher import die_with_parent
    die_with_parent()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack
    logs.setup(f"worker[island {args.island}]")
    if not 0 <= args.process_id < args.num_processes:
        p.error(f"--process-id must be in [0, {args.num_processes})")
    if args.num_processes > 1 and not args.coordinator:
        p.error("--num-processes > 1 needs --coordinator")
    w = Worker(key_from_env(), args.controller, args.island, bind_host=args.bind_host, name=args.name,
               coordinator=args.coordinator, num_processes=args.num_processes,
               process_id=args.process_id)
    signal.signal(signal.SIGTERM, w.stop)
    signal.signal(signal.SIGINT, w.stop)
    try:
        w.register()
    except ZpathError as e:
        log.error("%s", e)
        w.close()
        return 1
    logs.setup(f"worker[host {w.rank}]")
    w.serve_forever()
    logging.shutdown()
    # Threads may still wait on shards (fetches, inputs); do not let the
    # interpreter join them at exit.
    os._exit(0)
