"""The client side of a connection to a zpath cluster.

One I/O thread owns the sockets: a DEALER to the controller and one DEALER per
worker data port (client values are put straight onto workers, and results
fetched straight from them, so bulk bytes never pass through the controller).
User threads hand it messages through an :class:`~zpath.net.transport.Outbox`.
"""
from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np
import zmq

from zpath import sharding
from zpath.config import ClientConfig
from zpath.errors import (Broken, Closed, DeadlineExceeded, ErrorKind, HostLost, ProtocolError,
                          RemoteError, ResourceError, ZpathError)
from zpath.net import messages as m
from zpath.keys import client_keys
from zpath.net.codec import CLIENTS, PROTOCOL_VERSION, Record, constructor
from zpath.net.transport import BadMessage, Endpoint, Outbox, make_context, readable, unbatched
from zpath.ids import buffer_id

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 60.0
HEARTBEAT_S = 1.0
MAX_TEMPLATES = 1024          # program templates per connection (the controller's limit too)
# submissions that releases made before them may follow (see Client._flush)
_RELEASES_AFTER = (m.Call, m.CallAgain, m.Program, m.RunProgram)
_call_again = constructor(m.CallAgain)


def error_from_info(info: m.ErrorInfo) -> ZpathError:
    """The exception a failed value raises in the user's code."""
    match ErrorKind.of(info.kind):
        case ErrorKind.HOST_LOST:
            return HostLost(info.message)
        case ErrorKind.DEADLINE_EXCEEDED:
            return DeadlineExceeded(info.message)
        case ErrorKind.RESOURCE_ERROR:
            return ResourceError(info.message)
        case _:
            return RemoteError(info.message, host=info.host, computation=info.computation,
                               remote_traceback=info.traceback)


def error_from_reply(reply: m.Error) -> ZpathError:
    """The exception a refused request raises."""
    if ErrorKind.of(reply.code) == ErrorKind.RESOURCE:
        return ResourceError(reply.message)
    return ZpathError(f"controller: {reply.message}")


class _Fetch:
    """One fetch of a whole future: one request per distinct region; or, with
    ``wait_only``, a wait for it to be done: one request per shard, each
    answered without it."""

    def __init__(self, future: Any, regions: dict[int, sharding.Region], hosts: dict[int, int],
                 timeout: float, wait_only: bool = False, every_shard: bool = False) -> None:
        self.future = future
        self.regions = regions                     # request id -> region
        self.hosts = hosts                         # request id -> host asked
        self.parts: dict[int, np.ndarray | None] = {}
        self.timeout = timeout                     # how long a worker waits for a shard
        self.wait_only = wait_only
        # asks every shard (a wait always does), so its success says the call
        # that made the value has ended on every host (Future._ran_everywhere)
        self.every_shard = wait_only or every_shard
        # read from a copy the controller located after a host was lost: a
        # wait then asked the copy's shards, not every one of the value's
        self.relocated = False


def _asked(devices: list[int], regions: list[sharding.Region], every_shard: bool
           ) -> list[tuple[sharding.Region, int]]:
    """The (region, device) shards a fetch asks for: the first device of each
    distinct region; with ``every_shard`` (a wait), every shard (each
    device's copy is made and stored on its own)."""
    if every_shard:
        return list(zip(regions, devices, strict=True))
    seen: dict[sharding.Region, int] = {}
    for d, r in zip(devices, regions, strict=True):
        seen.setdefault(r, d)
    return list(seen.items())


class Client:
    """A connection to a controller. ``config``: its settings (default: the
    defaults, not the environment: ``zp.init``/``zp.connect`` build one from
    it); ``timeout``: seconds to wait for the welcome (default
    ``config.connect_timeout_s``)."""

    def __init__(self, address: str, key: bytes, *, name: str = "client",
                 timeout: float | None = None, weight: float = 1.0,
                 config: ClientConfig | None = None, shared: bool = False) -> None:
        self.address = address
        self.config = ClientConfig() if config is None else config
        if timeout is None:
            timeout = self.config.connect_timeout_s
        self.ctx = make_context()
        # the cluster key signs the Hello; the session key the Welcome brings, the rest
        self.ep = Endpoint(key, f"client:{name}:{os.getpid()}", signer=CLIENTS)
        self.ctl = self.ctx.socket(zmq.DEALER)
        try:
            self.ctl.connect(address)
        except zmq.ZMQError as e:
            self.ctl.close(0)
            self.ctx.term()
            raise ZpathError(f"cannot connect to {address!r}: {e}") from None
        self._closed = False
        self._broken: Broken | None = None       # the controller is gone: why
        try:
            welcome = self._handshake(name, timeout, weight, shared)
        except BaseException:
            self.ctl.close(0)
            self.ctx.term()
            raise
        self.client_id = welcome.client_id
        # from now on it signs with its session key (the controller's messages
        # come under the cluster key, workers' under the session key)
        self.ep.sign_as(*client_keys(key, self._nonce, welcome.client_id, welcome.session_key))
        self.hosts: dict[int, m.HostInfo] = {h.rank: h for h in welcome.hosts}
        self.devices: dict[int, m.DeviceInfo] = {d.id: d for h in welcome.hosts for d in h.devices}
        self._buffer_ids = itertools.count(1)
        self._call_ids = itertools.count(1)
        self._ids_lock = threading.Lock()    # new_buffer_ids replaces the counter
        self._templates = 0                   # numbers given out
        self._templates_live = 0              # of them not dropped
        # call forms the controller keeps for this connection (Call.keep), least
        # recently used first: (id of the traced function, which inputs are
        # put) -> (a weak reference to the traced function, the form's number)
        self._forms: collections.OrderedDict[tuple, tuple[Any, int]] = collections.OrderedDict()
        self._forms_lock = threading.Lock()
        self.programs: set[str] = set()
        # (hurry: the caller's thread goes on running Python after a call)
        self.outbox = Outbox(hurry=True)
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._fetches: dict[int, _Fetch] = {}
        self._locates: dict[int, _Fetch] = {}         # Locate msg_id -> fetch that waits for it
        self._futures: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._data: dict[int, zmq.Socket] = {}
        self._lost: dict[int, str] = {}               # rank -> why (HostDown)
        self.recorder: Any = None       # a zp.trace in progress: calls, programs and fetches go to it
        self._thread = threading.Thread(target=self._loop, name="zpath-client-io", daemon=True)
        self._thread.start()

    def _handshake(self, name: str, timeout: float, weight: float, shared: bool) -> m.Welcome:
        self._nonce = os.urandom(16)
        msg_id = self.ep.send(self.ctl, m.Hello(name, PROTOCOL_VERSION, weight, self._nonce, shared))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.ctl.poll(int(left * 1000)):
                raise DeadlineExceeded(f"no answer from a zpath controller at {self.address} "
                                       f"within {timeout:g}s (is it running, and is the key right?)")
            try:
                _, header, got, buffers = self.ep.recv(self.ctl)
            except BadMessage as e:
                raise ProtocolError(f"controller at {self.address}: {e}") from None
            answers = [(h, r) for h, r, _ in unbatched(header, got, buffers) if h.parent == msg_id]
            if not answers:
                continue
            header, reply = answers[0]
            if isinstance(reply, ProtocolError):
                raise ProtocolError(f"controller at {self.address}: {reply}")
            if isinstance(reply, m.Error):
                raise ProtocolError(f"controller refused connection: {reply.message}")
            if not isinstance(reply, m.Welcome):
                raise ProtocolError(f"expected Welcome, got {type(reply).__name__}")
            return reply

    # ---- API used by the rest of zpath --------------------------------------
    def new_buffer_id(self) -> int:
        with self._ids_lock:
            return buffer_id(self.client_id, next(self._buffer_ids))

    def new_buffer_ids(self, n: int) -> int:
        """The first of ``n`` new buffer ids in a row (a program run's)."""
        with self._ids_lock:
            first = next(self._buffer_ids)
            buffer_id(self.client_id, first + n - 1)      # raises if the last is out of range
            self._buffer_ids = itertools.count(first + n)
        return buffer_id(self.client_id, first)

    def new_template(self) -> int | None:
        """A number for a new program template, or None while this connection
        keeps MAX_TEMPLATES (the controller keeps as many per client)."""
        with self._ids_lock:
            if self._templates_live >= MAX_TEMPLATES:
                return None
            self._templates += 1
            self._templates_live += 1
            return self._templates

    def drop_templates(self, numbers: list[int]) -> None:
        """The controller may forget these templates (their program is gone).
        Safe from any thread, a garbage collector's finalizer included (it takes
        no lock of this client's: the I/O thread sends them and counts them)."""
        if numbers and not self._closed:
            self.outbox.put("drop", None, list(numbers), (), 0)

    def new_call_id(self) -> int:
        return next(self._call_ids)

    def post_call(self, traced: Any, puts: tuple, call_id: int, inputs: list[int], outputs: list[int],
                  make: Callable[[int], m.Call]) -> Record:
        """Post an op-by-op call of ``traced`` (a traced function; ``puts``:
        which inputs are values put for the call): a ``CallAgain`` of the form
        the controller keeps for them, else the ``Call`` that ``make(keep)``
        makes, which has the form kept as number ``keep`` (the least recently
        used number once MAX_CALL_FORMS are kept; none for a call of more than
        MAX_FORM_BUFFERS inputs and outputs). Returns the message posted."""
        if len(inputs) + len(outputs) > m.MAX_FORM_BUFFERS:
            msg = make(0)
            self.post(msg)
            return msg
        key = (id(traced), puts)
        # (under the lock: a number's new form is posted after every call of its old one)
        with self._forms_lock:
            entry = self._forms.get(key)
            if entry is not None and entry[0]() is traced:
                self._forms.move_to_end(key)
                msg = _call_again(call_id, entry[1], inputs, outputs)
            else:
                if entry is not None:                  # (that function is gone, its id taken again)
                    number = entry[1]
                elif len(self._forms) < m.MAX_CALL_FORMS:
                    number = len(self._forms) + 1
                else:
                    number = self._forms.popitem(last=False)[1][1]
                self._forms[key] = (weakref.ref(traced), number)
                self._forms.move_to_end(key)
                msg = make(number)
            self.post(msg)
        return msg

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("this zpath client is closed")
        if self._broken is not None:
            raise Broken(str(self._broken))

    def request(self, msg: Record, timeout: float = REQUEST_TIMEOUT_S) -> Record:
        """Send to the controller and wait for its answer."""
        self._check_open()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        msg_id = self.ep.next_id()
        self._pending[msg_id] = fut
        self.outbox.put("ctl", None, msg, (), msg_id)
        try:
            reply = fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise DeadlineExceeded(f"controller did not answer {type(msg).__name__} within "
                                   f"{timeout:.0f}s") from None
        finally:
            self._pending.pop(msg_id, None)
        if isinstance(reply, m.Error):
            raise error_from_reply(reply)
        return reply

    def learn(self, devices: list[m.DeviceInfo]) -> None:
        """Make sure hosts that joined after we connected are known (their data
        addresses come from the controller's status)."""
        if all(d.host in self.hosts for d in devices):
            for d in devices:
                self.devices.setdefault(d.id, d)
            return
        status = self.request(m.StatusRequest(False))
        for h in status.hosts:
            self.hosts[h.rank] = h
            for d in h.devices:
                self.devices[d.id] = d

    def post(self, msg: Record, buffers: Any = (), body: bytes | None = None) -> None:
        """Send to the controller without waiting (``body``: the message
        already packed, codec.pack_body; it rides where a data message's
        target goes)."""
        self._check_open()
        self.outbox.put("ctl", body, msg, buffers, 0)

    def put(self, host: int, msg: m.Put, data: np.ndarray) -> None:
        self._check_open()
        self.outbox.put("data", host, msg, (data,), 0)

    def register_program(self, digest: str, name: str, blob: bytes) -> None:
        if digest not in self.programs:
            self.post(m.RegisterProgram(digest, name), [blob])
            self.programs.add(digest)

    def track(self, future: Any) -> None:
        self._futures[future.buffer] = future

    def release(self, buffer: int) -> None:
        """A future was dropped: its buffer may be freed. Goes through the outbox
        after every call already queued, so it never overtakes a call using it."""
        if not self._closed and self._broken is None:
            self.outbox.put("rel", None, buffer, (), 0)

    def start_fetch(self, future: Any, timeout: float, wait_only: bool = False,
                    every_shard: bool = False) -> "_Fetch":
        """Ask the workers for every distinct shard of ``future``; the I/O thread
        sets the future's value when all have arrived. With ``wait_only``, ask
        every shard's host to say when it is done, without sending it: the I/O
        thread tells the future once all have. With ``every_shard``, fetch
        from every shard, not one per distinct region."""
        self._check_open()
        fetch = _Fetch(future, {}, {}, timeout, wait_only, every_shard)
        if {self.devices[d].host for d in future._devices} & set(self._lost):
            # a host with its shards is gone: read a copy elsewhere, if there is one
            req = self.ep.next_id()
            self._locates[req] = fetch
            self.outbox.put("ctl", None, m.Locate(future.buffer), (), req)
            return fetch
        asked = {self.ep.next_id(): rd for rd in _asked(future._devices, future._regions(), fetch.every_shard)}
        for req, (r, d) in asked.items():
            fetch.regions[req], fetch.hosts[req] = r, self.devices[d].host
        # every request is the fetch's before any goes: the I/O thread may
        # take the first answer while this thread puts the next request
        for req in asked:
            self._fetches[req] = fetch
        for req, (r, d) in asked.items():
            self.outbox.put("data", self.devices[d].host,
                            m.Fetch(req, future.buffer, d, sharding.to_wire(r), timeout, wait_only), (), req)
        return fetch

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.outbox.put("ctl", None, m.Goodbye("client closed"), (), 0)
        self.outbox.put("stop", None, None, (), 0)
        self._thread.join(5)
        err = Closed("the zpath client was closed")
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(err)
        for fetch in set(self._fetches.values()) | set(self._locates.values()):
            fetch.future._fetched(fetch, None, err)

    # ---- I/O thread ----------------------------------------------------------
    def _data_sock(self, host: int) -> zmq.Socket:
        s = self._data.get(host)
        if s is None:
            if host in self._lost:       # never reopened: what would queue there stays for good
                raise HostLost(self._lost[host])
            s = self.ctx.socket(zmq.DEALER)
            s.connect(self.hosts[host].data_address)
            self._data[host] = s
            self._poller.register(s, zmq.POLLIN)
        return s

    def _loop(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self.ctl, zmq.POLLIN)
        self._poller.register(self.outbox.fd, zmq.POLLIN)
        stop = False
        last_ping = self._last_heard = time.monotonic()
        try:
            while not stop:
                for sock, _ in self._poller.poll(timeout=500):
                    if sock == self.outbox.fd:
                        stop = self._flush()
                        self.outbox.sent()
                    elif not sock.closed:       # (a HostDown just before may have closed it)
                        self._recv(sock)
                now = time.monotonic()
                if now - last_ping >= HEARTBEAT_S and not stop and self._broken is None:
                    # the controller treats a client silent for long as gone (and
                    # answers, so its silence tells us the same)
                    self._send(self.ctl, m.Ping(0), (), 0)
                    last_ping = now
                # a controller silent this long (it answers every heartbeat) is taken to be gone
                if now - self._last_heard > self.config.controller_timeout_s and self._broken is None \
                        and not stop:
                    self._break(f"no answer from the zpath controller at {self.address} for "
                                f"{now - self._last_heard:.0f}s: it is gone or cannot be reached")
        finally:     # (should this thread fail: the GIL's switch interval set back)
            self.outbox.sent()
        for s in [self.ctl, *self._data.values()]:
            s.close(linger=200)
        self.ctx.term()
        self.outbox.close()

    def _flush(self) -> bool:
        """Send what the outbox holds, in order; messages to the controller that
        follow one another go as one Batch (calls made in a burst), and the
        releases among them as one Release after them (but before anything
        else): a release only ever goes later than it was made, never before
        a call that reads what it releases (op-by-op ``x = f(x)`` releases
        each x after the next call)."""
        to_ctl: list[tuple[Record, int, int]] = []
        released: list[int] = []
        for kind, target, msg, buffers, msg_id in self.outbox.drain():
            if kind == "rel":           # batched into one Release, after the calls around it
                released.append(msg)
                continue
            if kind == "drop":          # templates of programs that are gone
                with self._ids_lock:
                    self._templates_live -= len(msg)
                kind, msg = "ctl", m.DropTemplates(msg)
            if released and not (kind == "ctl" and type(msg) in _RELEASES_AFTER):
                to_ctl.append((m.Release(released), 0, 0))
                released = []
            if kind == "ctl" and not buffers:
                to_ctl.append((msg, 0, msg_id) if target is None else (msg, 0, msg_id, target))
                continue
            self._send_ctl(to_ctl)
            to_ctl = []
            if kind == "stop":
                return True
            try:
                sock = self.ctl if kind == "ctl" else self._data_sock(target)
            except HostLost as e:       # its host is gone: what waits on it fails so
                self._unsendable(msg, msg_id, e)
                continue
            self._send(sock, msg, buffers, msg_id)
        if released:
            to_ctl.append((m.Release(released), 0, 0))
        self._send_ctl(to_ctl)
        return False

    def _send_ctl(self, msgs: list[tuple[Record, int, int]]) -> None:
        """Send messages without buffers to the controller, as one Batch; if
        they cannot be sent, fail whatever waits on them."""
        if not msgs:
            return
        try:
            failed = self.ep.send_batch(self.ctl, msgs)
        except Exception as e:    # the socket: what went before may have gone, but nothing is known
            log.error("cannot send %d messages to the controller: %s", len(msgs), e)
            failed = [(msg, msg_id, e) for msg, _, msg_id, *_ in msgs]
        for msg, msg_id, e in failed:
            log.error("cannot send %s: %s", type(msg).__name__, e)
            self._failed(msg, msg_id, e)

    def _send(self, sock: zmq.Socket, msg: Record, buffers: Any, msg_id: int) -> None:
        """Send one message; if it cannot be sent, fail whatever waits on it
        (never the I/O thread itself)."""
        try:
            self.ep.send(sock, msg, buffers=buffers, msg_id=msg_id)
        except Exception as e:
            log.error("cannot send %s: %s", type(msg).__name__, e)
            self._failed(msg, msg_id, e)

    def _failed(self, msg: Record, msg_id: int, e: Exception) -> None:
        err = e if isinstance(e, HostLost) else Broken(f"could not send {type(msg).__name__}: {e}")
        pending = self._pending.get(msg_id)
        if pending is not None and not pending.done():
            pending.set_exception(err)
        fetch = self._fetches.get(msg_id) or self._locates.pop(msg_id, None)
        if fetch is not None:
            self._forget(fetch)
            fetch.future._fetched(fetch, None, err)
        calls = [msg] if isinstance(msg, m.Call) else msg.calls if isinstance(msg, m.Program) else []
        outputs = msg.outputs if isinstance(msg, m.CallAgain) else [o.buffer for c in calls for o in c.outputs]
        for b in outputs:
            fut = self._futures.get(b)
            if fut is not None:
                fut._fail(err)

    def _break(self, why: str, goodbye: bool = True) -> None:
        """The controller is gone: fail every request and fetch that waits, and
        every later use of this client, with Broken (values already fetched stay)."""
        log.error("zpath: %s", why)
        self._broken = err = Broken(why)
        # no more heartbeats; if the controller was only stalled, it frees what we hold
        if goodbye:
            self._send(self.ctl, m.Goodbye("the client gave up on the controller"), (), 0)
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(Broken(why))
        for fetch in set(self._fetches.values()) | set(self._locates.values()):
            self._forget(fetch)
            fetch.future._fetched(fetch, None, err)
        self._locates.clear()

    def _recv(self, sock: zmq.Socket) -> None:
        if sock is self.ctl:
            self._last_heard = time.monotonic()
        while readable(sock):
            try:
                _, header, msg, buffers = self.ep.recv(sock)
            except BadMessage as e:
                log.warning("dropped a bad message: %s", e)
                continue
            for header, msg, buffers in unbatched(header, msg, buffers):
                if isinstance(msg, ProtocolError):
                    log.warning("dropped a bad message: %s", msg)
                    continue
                try:
                    self._handle(header.parent, msg, buffers)
                except Exception:
                    log.exception("error handling %s", type(msg).__name__)

    def _handle(self, parent: int, msg: Record, buffers: list) -> None:
        match msg:
            case m.FetchReply():
                fetch = self._fetches.pop(msg.request, None)
                if fetch is None:
                    return
                if msg.error is not None:
                    self._forget(fetch)
                    fetch.future._fetched(fetch, None, error_from_info(msg.error))
                    return
                try:
                    if fetch.wait_only:
                        if buffers:
                            raise ValueError(f"{len(buffers)} buffers in the answer to a wait")
                        fetch.parts[msg.request] = None
                        if len(fetch.parts) == len(fetch.regions):
                            fetch.future._fetched(fetch, None, None)
                        return
                    want = sharding.region_shape(fetch.regions[msg.request])
                    if len(buffers) != 1 or tuple(msg.aval.shape) != want:
                        raise ValueError(f"shard of shape {msg.aval.shape}, expected {list(want)}")
                    part = np.frombuffer(buffers[0], dtype=np.dtype(fetch.future.dtype)).reshape(want)
                    fetch.parts[msg.request] = part
                    if len(fetch.parts) == len(fetch.regions):
                        self._assemble(fetch)
                except Exception as e:   # never leave a fetch waiting on a bad reply
                    self._forget(fetch)
                    fetch.future._fetched(fetch, None, Broken(f"bad reply from a worker: {e}"))
            case m.HostDown():
                self._lost[msg.rank] = msg.error.message
                # fetches that asked it: ask the controller where a copy is left
                for fetch in {f for f in list(self._fetches.values()) if msg.rank in f.hosts.values()}:
                    self._relocate(fetch)
                sock = self._data.pop(msg.rank, None)
                if sock is not None:          # and what is queued for it (a big Put) goes
                    self._poller.unregister(sock)
                    sock.close(linger=0)
            case m.Error() if msg.code == ErrorKind.NOT_REGISTERED:
                # the controller no longer knows this connection: it heard
                # nothing from it for longer than its client timeout (a process
                # that was stopped, e.g.) and freed everything it held; there is
                # no one to say goodbye to (once: later answers are ignored)
                if self._broken is None:
                    self._break(f"the zpath controller at {self.address} dropped this client "
                                f"({msg.message}): it heard nothing from it for too long "
                                "(ZPATH_CLIENT_TIMEOUT) and freed its values; connect again",
                                goodbye=False)
            case m.Location() if parent in self._locates:
                self._refetch(self._locates.pop(parent), msg)
            case m.Error() if parent in self._locates:
                fetch = self._locates.pop(parent)
                fetch.future._fetched(fetch, None, Broken(f"controller refused Locate: {msg.message}"))
            case m.CallFailed():
                err = error_from_info(msg.error)
                for b in msg.buffers:
                    fut = self._futures.get(b)
                    if fut is not None:
                        fut._fail(err)
            case m.Error() if parent in self._pending:
                self._pending[parent].set_result(msg)
            case m.Error():
                fetch = self._fetches.pop(parent, None)
                if fetch is not None:
                    self._forget(fetch)
                    fetch.future._fetched(fetch, None, Broken(f"worker refused a request: {msg.message}"))
                else:
                    log.warning("zpath: %s: %s", msg.code, msg.message)
            case _ if parent in self._pending:
                self._pending[parent].set_result(msg)
            case m.Ping():
                pass
            case m.Shutdown():
                self._break(f"the zpath controller at {self.address} shut down ({msg.reason})")
            case _:
                log.debug("ignored %s", type(msg).__name__)

    def _unsendable(self, msg: Record, msg_id: int, e: HostLost) -> None:
        """A message for a host known to be lost: a fetch from it (queued before
        its HostDown came) looks for a copy elsewhere; anything else fails."""
        fetch = self._fetches.get(msg_id) if isinstance(msg, m.Fetch) else None
        if fetch is not None:
            self._relocate(fetch)
        else:
            self._failed(msg, msg_id, e)

    def _relocate(self, fetch: _Fetch) -> None:
        """Ask the controller where a copy of the fetch's value is left (the
        answer, a Location, restarts the fetch from there)."""
        self._forget(fetch)
        req = self.ep.next_id()
        self._locates[req] = fetch
        self._send_ctl([(m.Locate(fetch.future.buffer), 0, req)])

    def _refetch(self, fetch: _Fetch, loc: m.Location) -> None:
        """Fetch again, from the copy the controller located (its regions may
        tile the array differently)."""
        if loc.error is not None:
            fetch.future._fetched(fetch, None, error_from_info(loc.error))
            return
        hosts = [self.devices[d].host if d in self.devices else None for d in loc.devices]
        if not loc.regions or None in hosts or set(hosts) & set(self._lost):
            fetch.future._fetched(fetch, None, HostLost(
                f"buffer {loc.buffer}: a host that held its shards was lost, and no copy is left "
                "on a host this client can reach"))
            return
        fetch.regions, fetch.hosts, fetch.parts = {}, {}, {}
        fetch.relocated = True
        regions = [sharding.from_wire(wire) for wire in loc.regions]
        for r, d in _asked(loc.devices, regions, fetch.every_shard):
            req = self.ep.next_id()
            host = self.devices[d].host
            fetch.regions[req], fetch.hosts[req] = r, host
            self._fetches[req] = fetch
            # (hosts are live: _data_sock does not raise; replies come on this thread)
            self._send(self._data_sock(host), m.Fetch(req, fetch.future.buffer, d, sharding.to_wire(r),
                                                      fetch.timeout, fetch.wait_only), (), req)

    def _forget(self, fetch: _Fetch) -> None:
        for req in fetch.regions:
            self._fetches.pop(req, None)

    def _assemble(self, fetch: _Fetch) -> None:
        fut = fetch.future
        if len(fetch.parts) == 1 and next(iter(fetch.regions.values())) == tuple((0, s) for s in fut.shape):
            # the received frame itself (the array keeps it alive), not a copy
            value = next(iter(fetch.parts.values()))
        else:
            value = np.empty(fut.shape, dtype=np.dtype(fut.dtype))
            for req, r in fetch.regions.items():
                value[sharding.local_slices(r, tuple((0, s) for s in fut.shape))] = fetch.parts[req]
        fut._fetched(fetch, value, None)
