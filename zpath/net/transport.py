"""Socket helpers shared by the controller, workers and clients.

ZeroMQ sockets are not thread-safe, so each process has one I/O thread that owns
its sockets. Other threads hand it outgoing messages through an :class:`Outbox`,
which wakes the I/O thread through a pipe it polls next to its sockets.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import random
import sys
import threading
import time
from typing import Any, Sequence

import numpy as np
import zmq

from zpath.errors import ProtocolError
from zpath.net import codec
from zpath.net.codec import Header, Record
from zpath.net.messages import Batch

log = logging.getLogger(__name__)

# frames at or above this size are sent without copying
ZERO_COPY_BYTES = 64 << 10
# messages queued per peer before a send would block; a peer this far behind is
# not reading, and processes that must not block drop messages to it instead
SEND_HWM = 100_000
# bytes of message bodies per Batch; more messages start another batch
BATCH_BODY_BYTES = 1 << 20

# plain ints: pyzmq's enum flags are slow to combine and convert per frame
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
# the send of pyzmq's compiled socket class, under zmq.Socket.send (a Python
# wrapper that only adds the DRAFT routing_id/group arguments)
_SEND = zmq.backend.Socket.send
# its get: getsockopt(zmq.EVENTS) costs twice as much (it converts the option)
_GET = zmq.backend.Socket.get
_RECV = zmq.backend.Socket.recv
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def readable(sock: zmq.Socket) -> bool:
    """Whether a message is waiting on ``sock`` (``getsockopt(zmq.EVENTS) &
    zmq.POLLIN``, without pyzmq's conversions)."""
    return bool(_GET(sock, _EVENTS) & _POLLIN)


def raw(buffer: Any) -> Any:
    """A buffer as plain bytes for a frame: numpy arrays of any dtype (bfloat16
    and other ml_dtypes cannot be exported as buffers) become uint8 views."""
    if isinstance(buffer, np.ndarray):
        return buffer.reshape(-1).view(np.uint8)
    return buffer


class Endpoint:
    """Signs, numbers and checks the messages of one process.

    ``key`` signs what it sends, as ``signer`` (the header's signer: see
    ``codec.CLUSTER``, ``codec.CLIENTS``). What it receives is checked against
    ``keys`` (the key of a signer, None for a signer refused) or, without it,
    against ``key`` whatever the signer."""

    def __init__(self, key: bytes, sender: str, *, signer: int = codec.CLUSTER,
                 keys: codec.KeyOf | None = None) -> None:
        if len(key) < 16:
            raise ValueError("cluster key must be at least 16 bytes")
        self.key = key
        self.sender = sender
        self.sign_key = key
        self.signer = signer
        self.keys: bytes | codec.KeyOf = key if keys is None else keys
        self._ids = itertools.count(1)

    def sign_as(self, key: bytes, signer: int, keys: codec.KeyOf | None = None) -> None:
        """Sign from now on with ``key`` as ``signer``, and check what comes
        with ``keys`` if given (a client once it has its session key; ``key``,
        the endpoint's own key, stays what it was)."""
        self.sign_key, self.signer = key, signer
        if keys is not None:
            self.keys = keys

    def next_id(self) -> int:
        return next(self._ids)

    def send(self, sock: zmq.Socket, msg: Record, *, to: bytes | None = None,
             parent: int = 0, buffers: Sequence[Any] = (), msg_id: int = 0,
             block: bool = True, body: bytes | None = None,
             sign: tuple[bytes, int] | None = None) -> int:
        """Send one message. With ``block=False`` a full queue raises zmq.Again
        instead of waiting for the peer. ``body``: the message's body, if it was
        already packed. ``sign``: (key, signer) for this message instead of the
        endpoint's."""
        msg_id = msg_id or self.next_id()
        if buffers:
            buffers = [raw(b) for b in buffers]
        key, signer = sign if sign is not None else (self.sign_key, self.signer)
        frames = codec.encode(key, msg, msg_id=msg_id, sender=self.sender,
                              parent=parent, buffers=buffers, body=body, signer=signer)
        flags = 0 if block else _NOBLOCK
        # Frame by frame, as send_multipart does (ZeroMQ queues a multipart
        # message whole or not at all), with plain int flags (pyzmq's enum
        # flags cost more than the send) and no copy for big buffers only.
        send = _SEND if type(sock) is zmq.Socket else type(sock).send
        more = flags | _SNDMORE
        if to is not None:
            send(sock, to, more)
        if not buffers:
            send(sock, frames[0], more)
            send(sock, frames[1], more)
            send(sock, frames[2], flags)
            return msg_id
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            if i < 3 or memoryview(frame).nbytes < ZERO_COPY_BYTES:
                send(sock, frame, more if i < last else flags)
            else:
                send(sock, frame, more if i < last else flags, copy=False)
        return msg_id

    def send_batch(self, sock: zmq.Socket, msgs: Sequence[tuple], *,
                   to: bytes | None = None, block: bool = True,
                   sign: tuple[bytes, int] | None = None) -> list[tuple[Record, int, Exception]]:
        """Send messages without buffers, given as (message, parent, msg_id or
        0[, its body from codec.pack_body]), in order: one as itself, more as
        Batches (one signature, one ZeroMQ message, one wake-up of the receiver
        for all of them). A message that cannot be encoded is left out, the
        others still go; returns those left out as (message, msg_id, error).
        Errors of the socket itself are raised. ``sign``: as for :meth:`send`."""
        messages, failed = self.batch_frames(msgs, sign=sign)
        for frames in messages:
            self.send_frames(sock, frames, to=to, block=block)
        return failed

    def batch_frames(self, msgs: Sequence[tuple], sign: tuple[bytes, int] | None = None
                     ) -> tuple[list[list[Any]], list[tuple[Record, int, Exception]]]:
        """The ZeroMQ messages (each a list of frames) that :meth:`send_batch`
        sends for ``msgs``, and the messages left out: frames made once can go
        to many peers (:meth:`send_frames`)."""
        failed: list[tuple[Record, int, Exception]] = []
        out: list[list[Any]] = []
        key, signer = sign if sign is not None else (self.sign_key, self.signer)
        sender = self.sender
        if len(msgs) == 1:
            msg, parent, msg_id = msgs[0][:3]
            try:
                out.append(codec.encode(key, msg, msg_id=msg_id or self.next_id(), sender=sender,
                                        parent=parent, body=msgs[0][3] if len(msgs[0]) > 3 else None,
                                        signer=signer))
            except Exception as e:
                failed.append((msg, msg_id, e))
            return out, failed
        items: list[tuple[int, int, int, bytes]] = []
        first: tuple[Record, int] | None = None     # the batch's first message and parent
        size = 0

        def flush() -> None:
            if len(items) == 1:        # alone, as itself (a batch would only add bytes)
                out.append(codec.encode(key, first[0], msg_id=items[0][1], sender=sender,
                                        parent=first[1], body=items[0][3], signer=signer))
            elif items:
                out.append(codec.encode(key, Batch(items), msg_id=self.next_id(), sender=sender,
                                        signer=signer))

        for entry in msgs:
            msg, parent, msg_id = entry[:3]
            msg_id = msg_id or self.next_id()
            try:
                body = entry[3] if len(entry) > 3 else codec.pack_body(msg)
            except Exception as e:       # this one only: the others still go
                failed.append((msg, msg_id, e))
                continue
            if items and size + len(body) > BATCH_BODY_BYTES:
                flush()
                items, size = [], 0
            if not items:
                first = (msg, parent)
            items.append((msg.TYPE, msg_id, parent, body))
            size += len(body)
        flush()
        return out, failed

    def send_frames(self, sock: zmq.Socket, frames: Sequence[Any], *, to: bytes | None = None,
                    block: bool = True) -> None:
        """Send one message's frames as made by :meth:`batch_frames` (or
        ``zmq.Frame`` objects of them, which ZeroMQ shares between the peers
        they go to instead of copying)."""
        flags = 0 if block else _NOBLOCK
        send = _SEND if type(sock) is zmq.Socket else type(sock).send
        more = flags | _SNDMORE
        if to is not None:
            send(sock, to, more)
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            if type(frame) is zmq.Frame:
                send(sock, frame, more if i < last else flags, copy=False)
            else:
                send(sock, frame, more if i < last else flags)

    def recv(self, sock: zmq.Socket, *, router: bool = False, block: bool = True,
             keys: bytes | codec.KeyOf | None = None) -> tuple[bytes | None, Header, Any, list[memoryview]]:
        """Receive one message. On a bad message raises :class:`BadMessage`
        carrying what is known about its sender, so the caller can answer. With
        ``block=False`` an empty queue raises zmq.Again instead of waiting. A
        Batch comes as a ``codec.Batched``: pass the result to :func:`unbatched`.
        ``keys``: what checks the signature (default: the endpoint's ``keys``)."""
        ident, frames = self.recv_frames(sock, router=router, block=block)
        return (ident, *self.decode(frames, ident, keys))

    def decode(self, frames: list[Any], ident: bytes | None = None,
               keys: bytes | codec.KeyOf | None = None) -> tuple[Header, Any, list[memoryview]]:
        """``codec.decode`` of frames from :meth:`recv_frames` (``keys``: as for
        :meth:`recv`); BadMessage, naming ``ident``, if they do not decode."""
        try:
            return codec.decode(self.keys if keys is None else keys, frames)
        except ProtocolError as e:
            raise BadMessage(str(e), ident, codec.decode_header(frames)) from None

    def recv_frames(self, sock: zmq.Socket, *, router: bool = False, block: bool = True
                    ) -> tuple[bytes | None, list[Any]]:
        """Receive one message's frames, not checked yet (``codec.decode`` checks
        them): the sender's identity (on a ROUTER) and the envelope's frames.
        Refuses (BadMessage) a message of more frames than any has."""
        flags = 0 if block else _NOBLOCK
        small = 4 if router else 3
        allowed = small + codec.MAX_BUFFERS        # identity, signature, header, body, buffers
        # the routing identity, signature, header and body come as bytes, and
        # buffers as Frames
        if type(sock) is zmq.Socket:
            # the compiled recv, every frame a zmq.Frame: its ``more`` is read
            # without getsockopt(RCVMORE), which converts the option to an enum
            # each time (the small frames' bytes are then copied out, as recv
            # would)
            recv = _RECV.__get__(sock)
            frame = recv(flags, copy=False)
            frames = [frame.bytes]
            while frame.more:
                if len(frames) >= allowed:
                    raise _too_many(sock, frames, router, allowed)
                frame = recv(flags, copy=False)
                frames.append(frame.bytes if len(frames) < small else frame)
        else:
            recv, more = sock.recv, sock.get
            frames = [recv(flags)]
            while more(_RCVMORE):
                if len(frames) >= allowed:
                    raise _too_many(sock, frames, router, allowed)
                frames.append(recv(flags) if len(frames) < small else recv(flags, copy=False))
        if router:
            return frames[0], frames[1:]
        return None, frames


def _too_many(sock: zmq.Socket, frames: list[Any], router: bool, allowed: int) -> BadMessage:
    """More frames than any message has: the rest is dropped unread into
    objects, and the message refused (cheaply, whatever its sender)."""
    n = _discard_rest(sock)
    ident = frames[0] if router else None
    got, most = len(frames) + n - router, allowed - router
    return BadMessage(f"too many frames ({got}; at most {most})", ident,
                      codec.decode_header(frames[1:] if router else frames))


def _discard_rest(sock: zmq.Socket) -> int:
    """Receive and drop the remaining frames of the current message."""
    n = 0
    buf = bytearray(64)
    while sock.get(_RCVMORE):
        sock.recv_into(buf)          # no object per frame (a truncated copy of at most 64 bytes)
        n += 1
    return n


def unbatched(header: Header, msg: Any, buffers: list) -> Sequence[tuple[Header, Any, list]]:
    """The (header, message, buffers) a receive gave: itself, or each of a
    batch's. A batch's item that did not decode comes as a ProtocolError in
    place of its message (with its own header, so it can be answered)."""
    if type(msg) is codec.Batched:
        return [(h, sub, []) for h, sub in msg.messages]
    return ((header, msg, buffers),)


class BadMessage(ProtocolError):
    def __init__(self, text: str, ident: bytes | None, header: Header | None) -> None:
        super().__init__(text)
        self.ident = ident
        self.header = header


class RateLimit:
    """Token buckets per peer (pure: the time comes in): ``rate`` events per
    second, up to ``burst`` at once. Error replies and log lines about bad
    messages go through one, so a flood of garbage costs its receiver neither
    a reply nor a log line per message. It keeps at most ``peers`` buckets (a
    flood from ever new identities clears them: they start full again)."""

    def __init__(self, rate: float, burst: float, peers: int = 10_000) -> None:
        self.rate, self.burst, self.peers = rate, burst, peers
        self._buckets: dict[Any, list[float]] = {}    # peer -> [tokens, time, refused since last allowed]

    def allow(self, peer: Any, now: float) -> int:
        """0 if this event must be dropped; else 1 + the events of this peer
        dropped since the last one allowed (for a line that counts them)."""
        b = self._buckets.get(peer)
        if b is None:
            if len(self._buckets) >= self.peers:
                self._buckets.clear()
            b = self._buckets[peer] = [self.burst, now, 0]
        b[0] = min(self.burst, b[0] + (now - b[1]) * self.rate)
        b[1] = now
        if b[0] < 1.0:
            b[2] += 1
            return 0
        b[0] -= 1.0
        dropped, b[2] = int(b[2]), 0
        return 1 + dropped


# bad messages: replies per peer, and log lines in all, per second (and bursts)
REPLY_RATE, REPLY_BURST = 10.0, 20.0
LOG_RATE, LOG_BURST = 5.0, 20.0


DUE_SLACK_S = 0.0005

# The GIL while an item waits in an Outbox. The thread that puts it usually
# goes on running Python (a client's caller makes its next call, or prepares
# its next step); the I/O thread, woken by the pipe, must take the GIL to send
# the item, and CPython makes a waiting thread wait a whole switch interval (5
# ms by default) before it asks the running one to let go. So an Outbox made
# with ``hurry`` sets the process's switch interval to HURRY_SWITCH_S when an
# item comes after its consumer has sent nothing for HURRY_IDLE_S, and sets it
# back once the consumer has sent it (``Outbox.sent``) or closes, unless
# someone changed it meanwhile. Only then: in a burst of puts the consumer takes the rest as
# one batch, as before (docs/design.md, "Handing a message to the I/O thread").
# No lock: a put may come from a finalizer, in the middle of any of this.
HURRY_SWITCH_S = 0.0002
HURRY_IDLE_S = 0.001
# the interval a hurry replaced, to set back, and the one it set (as
# sys.getswitchinterval reads it back: CPython keeps whole microseconds)
_switch = [0.0, 0.0]


def _hurry() -> bool:
    """Shorten the switch interval (False: it is that short already)."""
    now = sys.getswitchinterval()
    if now <= HURRY_SWITCH_S:
        return False
    sys.setswitchinterval(HURRY_SWITCH_S + 5e-7)
    _switch[:] = now, sys.getswitchinterval()
    return True


def _unhurry() -> None:
    """Set back the interval ``_hurry`` replaced, if it is still the one it
    set (nobody changed it since). (CPython truncates to whole microseconds:
    half a microsecond more sets back exactly the value read.)"""
    if sys.getswitchinterval() == _switch[1]:
        sys.setswitchinterval(_switch[0] + 5e-7)


if hasattr(os, "register_at_fork"):     # a child forked during a hurry starts with the interval set back
    os.register_at_fork(after_in_child=_unhurry)


class Outbox:
    """Thread-safe queue of outgoing messages, drained by the I/O thread.

    An item may also be *held* (``hold``): it waits, with the items held after
    it, until ``release`` or until ``hold_s`` after the first of them, whichever
    comes first, so that several go out together. The I/O thread learns the
    deadline from ``held_timeout`` and drains when it is due."""

    def __init__(self, hurry: bool = False) -> None:
        """``hurry``: while items wait, shorten the GIL's switch interval (see
        HURRY_SWITCH_S; the consumer then calls ``sent`` after each drain)."""
        self._items: collections.deque[tuple] = collections.deque()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        # a byte is in the pipe (or about to be): set by put, cleared by drain
        # (a plain flag: under the GIL a race costs at most one extra byte)
        self._armed = False
        self._hurry_on = hurry
        self._hurried = False        # it shortened the switch interval (see HURRY_SWITCH_S)
        self._last_sent = 0.0        # time.monotonic() of the consumer's last ``sent``
        self._closed = False
        self._hold_lock = threading.Lock()
        self._held: list[tuple] = []
        self._held_due: float | None = None     # time.monotonic() when the held items go
        # when the consumer's current wait ends at the latest (it sets this
        # before it reads held_timeout and waits): a held item due later than
        # that need not wake it
        self.wait_until = float("inf")

    @property
    def fd(self) -> int:
        return self._r

    def put(self, *item: Any) -> None:
        if self._closed:        # (a finalizer's release after the consumer has gone: nobody reads it)
            return
        self._items.append(item)
        if not self._armed:
            self._armed = True
            # (before the wake-up; set only here, by the producer that shortened
            # it: one that raced another here finds it short and leaves the flag)
            if self._hurry_on and not self._hurried and time.monotonic() - self._last_sent >= HURRY_IDLE_S \
                    and _hurry():
                self._hurried = True
                if self._closed:          # closed meanwhile: nobody will call sent()
                    self._set_back()
            try:
                os.write(self._w, b"x")
            except OSError:       # full (a byte is there already), or closed meanwhile
                pass

    def hold(self, item: tuple, hold_s: float, release: bool = False) -> None:
        """Queue ``item`` after the held ones; they all go out by ``hold_s``
        after now at the latest (at once with ``release``), or earlier if an
        item held before set an earlier deadline."""
        with self._hold_lock:
            self._held.append(item)
            due = time.monotonic() + hold_s
            if release:
                wake, self._held_due = True, 0.0
            elif self._held_due is None or due < self._held_due:
                self._held_due = due
                wake = self.wait_until > due      # it would sleep past the deadline
            else:
                wake = False
        if wake:        # the I/O thread sends them, or learns the deadline
            self.wake()

    def release(self) -> None:
        """Let the held items go out now."""
        with self._hold_lock:
            if not self._held or self._held_due == 0.0:
                return
            self._held_due = 0.0
        self.wake()

    def held_timeout(self) -> float | None:
        """Seconds until the held items are due (0: now), None if none are held.
        Items within DUE_SLACK_S of their deadline count as due (a poll may
        wake a little early; waiting again for so little would cost more)."""
        due = self._held_due
        return None if due is None else max(0.0, due - DUE_SLACK_S - time.monotonic())

    def wake(self) -> None:
        """Wake the I/O thread without an item (it then runs its loop once).
        Takes no lock: safe in a finalizer or a signal handler."""
        if self._closed:        # the fd number may belong to another file by now
            return
        try:
            os.write(self._w, b"x")
        except (BlockingIOError, OSError):
            pass

    def drain(self) -> list[tuple]:
        """The queued items, and the held ones first if they are due."""
        # Order matters: empty the pipe, then disarm, then take the items. An
        # item put after the disarm finds it clear and writes a new byte, which
        # stays in the pipe for the next poll; one put before it is taken now.
        try:       # (a short read empties a pipe: no second read to fail)
            while len(os.read(self._r, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass
        self._armed = False
        out = []
        if self._held_due is not None and self._held_due - DUE_SLACK_S <= time.monotonic():
            with self._hold_lock:
                out, self._held = self._held, []
                self._held_due = None
        while self._items:
            out.append(self._items.popleft())
        return out

    def sent(self) -> None:
        """The consumer has sent what it drained: the GIL's switch interval is
        what it was again (see HURRY_SWITCH_S; not at the drain: a thread that
        puts more while the consumer sends would take the GIL back and keep it
        that long, and what it put waits for the next batch anyway)."""
        self._last_sent = time.monotonic()
        if self._hurried:
            self._set_back()

    def _set_back(self) -> None:
        """The switch interval this outbox shortened, set back."""
        self._hurried = False
        _unhurry()

    def close(self) -> None:
        self._closed = True
        if self._hurried:
            self._set_back()
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


def backoff(attempt: int, base: float = 0.05, cap: float = 2.0) -> float:
    """Capped, jittered exponential backoff in seconds."""
    return random.uniform(0.5, 1.0) * min(cap, base * (2 ** attempt))


def make_context(max_message_bytes: int = 0) -> zmq.Context:
    """A context whose sockets drop no message on close, queue SEND_HWM
    messages per peer, and (``max_message_bytes`` > 0) disconnect a peer that
    sends a frame larger than that (ZeroMQ's MAXMSGSIZE: the frame is refused as
    it arrives, before it is read into memory whole)."""
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    ctx.setsockopt(zmq.SNDHWM, SEND_HWM)
    ctx.setsockopt(zmq.RCVHWM, SEND_HWM)
    if max_message_bytes > 0:
        ctx.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    return ctx
