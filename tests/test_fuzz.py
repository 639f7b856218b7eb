"""A bounded fuzz of the message decoders of a running controller and workers.

For a bounded time and number of messages, a background thread sends the
controller's ROUTER and every worker's data port, from several raw DEALER
sockets: random frames (a few of them several MiB), valid frames with bits
flipped, truncated, dropped, duplicated or extra frames, messages with bad
signatures, wrong protocol versions and malformed headers, and correctly
*signed* messages whose bodies are wrong: unknown type ids, fields of the
wrong type, negative sizes, huge shapes, unknown devices, buffers and
programs, bad dtype names, nested garbage. Meanwhile a correct client keeps
calling compiled functions (within an island and across islands, so pieces
move worker to worker) and checks every result; afterwards the controller and
workers must still be running, answer StatusRequest, and serve a new client.

The run is reproducible: the seed is printed (``-s`` shows it) and can be set
with ``ZPATH_FUZZ_SEED``; ``ZPATH_FUZZ_SECONDS`` sets the fuzzing time.

The fuzz is a client like any other (docs/protocol.md, section 2a): two of
its controller sockets say Hello and sign with their session keys; the data
ports get messages signed with one of those, the cluster key, or garbage.
Its ``Put``s and ``Fetch``es name its own ids, the correct client's, or any
(a worker refuses those of others), its pieces any id (refused: they come from
workers only), and its ``RegisterWorker``s are refused (they need the worker
key, which it does not hold).
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import math
import os
import random
import signal
import struct
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

import zpath as zp
from zpath.client.connection import Client
from zpath.keys import client_keys
from zpath.net import codec
from zpath.net import messages as m
from zpath.cluster.testing import connected, wait_until

pytestmark = pytest.mark.timeout(240)

FUZZ_SECONDS = float(os.environ.get("ZPATH_FUZZ_SECONDS", "12"))
MAX_MESSAGES = 30_000        # upper bound on fuzz messages, whatever the time
MAX_BIG = 6                  # frames of 1 to 4 MiB (the CI machine has 2 cores)
MIN_CALLS = 200              # iterations of the correct client, at least
SAFE_ID = 1 << 40            # piece/buffer ids at or above this are never used by the cluster

KINDS = ("random", "big", "mutated", "badsig", "version", "header", "typeid", "values", "semantic")


# ---- building messages -------------------------------------------------------

def sign(key: bytes, parts: list[bytes]) -> bytes:
    """The envelope signature as docs/protocol.md defines it (written from the
    page, not taken from the codec)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        mac.update(struct.pack("<Q", len(p)))
        mac.update(p)
    return mac.digest()


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def frames_for(key: bytes, header, body, buffers=()) -> list[bytes]:
    """Signed frames from a header and body given as Python values (or bytes)."""
    h = header if isinstance(header, bytes) else pack(header)
    b = body if isinstance(body, bytes) else pack(body)
    parts = [h, b, *[bytes(x) for x in buffers]]
    return [sign(key, parts), *parts]


def aval(shape, dtype="float32"):
    return m.Aval(list(shape), dtype)


def templates(rng: random.Random, devices: list[int], garbage_digest: str) -> dict[str, list]:
    """Plausible messages of every kind, as (Record, buffers), for each target."""
    # ids the cluster never uses, and others' (the correct client is 1 or 2)
    ids = [rng.choice([SAFE_ID, rng.randrange(1, 4) << 32]) + rng.randrange(1 << 20) for _ in range(8)]
    dev = rng.choice(devices)
    f32 = np.arange(4, dtype=np.float32).tobytes()
    call = m.Call(rng.randrange(1 << 30), "0" * 64, [1], ["i"], [dev],
                  [m.CallInput(ids[0], aval([4]), ["i"], False)],
                  [m.CallOutput(ids[1], aval([4]), ["i"])])
    # the fuzz client's own garbage program: planned and sent to a worker, which
    # must fail the computation (the blob is not a jax.export serialisation)
    garbage_call = m.Call(rng.randrange(1 << 30), garbage_digest, [1], ["i"], [dev], [],
                          [m.CallOutput(ids[2], aval([2]), [None])])
    err = m.ErrorInfo("RemoteError", "fuzz", None, "", "")
    execute = m.Execute(1, 0, "0" * 64, "f", [1], ["i"], [dev], [dev],
                        [m.ExecInput(ids[0], aval([4]), [None], [m.ShardInput(dev, [[0, 4]], [])])],
                        [m.ExecOutput(ids[1], aval([4]), [None])])
    common = [
        (m.Ping(1), ()), (m.Pong(1, 0, 0, []), ()), (m.Error("protocol", "fuzz"), ()),
        (m.StatusRequest(True), ()), (execute, ()), (m.Free([ids[3]]), ()),
        (m.SendPiece(ids[4], ids[0], dev, [[0, 4]], [[0, 2]], 0, "tcp://127.0.0.1:1", "ICI", "", ""), ()),
        (m.ExecDone(1, err, 0.0, 1.0), ()), (m.FailPieces([ids[4]], err), ()),
    ]
    controller = common + [
        (m.Hello("fuzz", codec.PROTOCOL_VERSION, 1.0), ()),
        (m.RegisterWorker("fuzz", 0, "tcp://127.0.0.1:1", 1, "cpu", 1, codec.PROTOCOL_VERSION + 1,
                          [0], "", 0, 1, "", "", ""), ()),
        (m.AllocSlice(1, None, None), ()), (m.AllocSlice(1, 0, 0), ()),
        (m.RegisterProgram("0" * 64, "fuzz"), (b"not a program",)),
        (call, ()), (garbage_call, ()),
        (m.Program(7, "fuzz", "parallel", [call], [ids[5]]), ()),
        (m.Program(8, "fuzz", "sequential", [garbage_call], []), ()),
        (m.ExplainRequest([call, garbage_call]), ()), (m.Release([ids[0], ids[1]]), ()),
        (m.TimelineRequest(10), ()), (m.Goodbye("fuzz"), ()),
    ]
    data = common + [
        (m.Put(ids[6], dev, [[0, 4]], aval([4])), (f32,)),
        (m.Piece(ids[7], aval([4]), None), (f32,)), (m.Piece(ids[7] + 1, aval([]), err), ()),
        (m.Fetch(ids[0], ids[0], dev, [[0, 4]], 0.5), ()),
        (m.PieceChunk(ids[7] + 2, aval([4]), 0, 16), (f32[:8],)),
        (m.ShmPiece(ids[7] + 3, aval([4]), "zpath-00000000-1-1", 0, 16, []), ()),
        (m.ShmAck(["zpath-00000000-1-1"]), ()), (m.ChannelStatsRequest(False), ()),
    ]
    return {"controller": controller, "data": data}


def semantic(rng: random.Random, target: str, devices: list[int], garbage_digest: str):
    """Well-typed (they decode) but meaningless or hostile values."""
    huge = rng.choice([2 ** 40, 2 ** 62, 2 ** 63 - 1, 2 ** 64 - 1])
    neg = rng.choice([-1, -2 ** 31, -2 ** 63])
    dev = rng.choice(devices + [huge, neg, 12345])
    bid = rng.choice([SAFE_ID, rng.randrange(1, 8) << 32]) + rng.randrange(1 << 30)
    dtype = rng.choice(["float32", "notadtype", "", "object", "V8", "S4", "<U3", "(2,)f4", "O", "float32,int8",
                        "M8[ns]", "m8", "complex256", "bfloat16", "int4", "float8_e4m3fn", "bool"])
    shape = rng.choice([[huge], [neg], [2 ** 40, 2 ** 40], [0], [3, neg], [], [1] * 64, [2 ** 32] * 3])
    region = rng.choice([[[0, huge]], [[neg, 4]], [[4, 0]], [], [[0, 1]] * 40, [[0, 4]]])
    nbytes = rng.choice([0, 1, 16, 1 << 20, huge, neg])
    data = rng.randbytes(rng.choice([0, 1, 16, 4096]))
    if target == "data":
        msgs = [
            (m.Put(bid, dev, region, m.Aval(shape, dtype)), (data,)),
            (m.Put(bid, rng.choice(devices), [[0, 4]], m.Aval([4], dtype)), (rng.randbytes(16),)),
            (m.Put(bid, rng.choice(devices), [[0, 4]], aval([4])), ()),
            (m.Put(bid, rng.choice(devices), [[0, 4]], aval([4])), (b"x" * 16, b"y" * 16)),
            (m.Piece(bid, m.Aval(shape, dtype), None), (data,)),
            (m.Fetch(rng.randrange(1 << 40), bid, dev, region,
                     rng.choice([0.0, -1.0, math.nan, math.inf, -math.inf, 0.2, 1e300])), ()),
            (m.PieceChunk(bid, m.Aval(shape, dtype), rng.choice([0, 8, neg, huge]), nbytes), (data,)),
            (m.PieceChunk(bid, aval([4]), 0, 16), ()),
            (m.ShmPiece(bid, m.Aval(shape, dtype),
                        rng.choice(["", "../../etc/passwd", "zpath-00000000-1-1", "/dev/zero", "x" * 300]),
                        rng.choice([0, neg, huge]), nbytes, rng.choice([[], ["zpath-1-2-3"], ["../x"]])), ()),
            (m.ChannelStatsRequest(rng.random() < 0.5), ()),
        ]
    else:
        call = m.Call(rng.randrange(1 << 30), rng.choice(["0" * 64, garbage_digest, "", "z" * 1000]),
                      rng.choice([[1], [huge], [neg], [0], [2 ** 32, 2 ** 32], []]),
                      rng.choice([["i"], [], ["i", "i"], [""]]), rng.choice([[dev], [], [dev, dev], devices]),
                      [m.CallInput(rng.choice([bid, neg, huge]), m.Aval(shape, dtype),
                                   rng.choice([["i"], [None], [["i", "j"]], ["nope"], []]), False)],
                      [m.CallOutput(rng.choice([bid, neg, huge, 0]), m.Aval(shape, dtype),
                                    rng.choice([["i"], [None], ["nope"], []]))])
        msgs = [
            (m.AllocSlice(rng.choice([huge, neg, 0, 4097]), rng.choice([None, huge, neg]),
                          rng.choice([None, huge, neg])), ()),
            (m.RegisterWorker("fuzz", rng.choice([0, neg]), "tcp://127.0.0.1:1", 1, "cpu",
                              rng.choice([0, neg, huge, 4097]), codec.PROTOCOL_VERSION,
                              [0] * rng.choice([0, 1, 3]), "", 0, 1, "", "", ""), ()),
            (m.RegisterProgram(rng.choice(["", "0" * 64, garbage_digest]), "fuzz"),
             rng.choice([(), (b"a",), (b"a", b"b")])),
            (call, ()),
            (m.Program(1, "fuzz", rng.choice(["parallel", "sequential", "", "chaotic"]), [call] * 3,
                       [bid, neg]), ()),
            (m.ExplainRequest([call] * rng.choice([0, 1, 5])), ()),
            (m.TimelineRequest(rng.choice([huge, neg, 0, 2 ** 63 - 1])), ()),
            (m.Release([bid, neg, huge] * 10), ()),
            (m.Hello("fuzz", rng.choice([0, 2, neg, huge]), 1.0), ()),
            (m.Ping(huge), ()), (m.Pong(neg, huge, neg, [neg, huge]), ()),
        ]
    return rng.choice(msgs)


WEIRD_STRINGS = ["", "x" * 1000, "\x00", "é☃", "float32", "notadtype", "object", "V8", "(2,)f4",
                 "parallel", "i", "tcp://", "../../x"]


def weird(rng: random.Random, depth: int = 0):
    """A value of any msgpack type, often one that breaks an assumption."""
    r = rng.random()
    if r < 0.35:
        return rng.choice([0, 1, -1, 2 ** 31, -2 ** 31, 2 ** 32, 2 ** 40, 2 ** 62, 2 ** 63 - 1, -2 ** 63,
                           2 ** 64 - 1, rng.randrange(-1000, 1000)])
    if r < 0.45:
        return rng.choice([0.0, -0.0, 0.5, -1.5, math.nan, math.inf, -math.inf, 1e308])
    if r < 0.55:
        return rng.choice([None, True, False])
    if r < 0.7:
        return rng.choice(WEIRD_STRINGS)
    if r < 0.78:
        return rng.randbytes(rng.choice([0, 1, 8, 32]))
    if r < 0.85:
        return {rng.choice(["a", 1, b"k"]): weird(rng, depth + 1) for _ in range(rng.randrange(3))}
    if r < 0.9:
        deep = weird(rng, depth + 1) if depth < 3 else 0
        for _ in range(rng.randrange(1, 60)):
            deep = [deep]
        return deep
    if depth > 3:
        return []
    return [weird(rng, depth + 1) for _ in range(rng.randrange(5))]


def like(rng: random.Random, v):
    """A value of the same msgpack type as ``v``, but extreme."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        v = rng.choice([0, -1, -2 ** 63, 2 ** 63 - 1, 2 ** 64 - 1, 2 ** 40, v + 1, -v])
        return min(max(v, -2 ** 63), 2 ** 64 - 1)          # what msgpack can carry
    if isinstance(v, float):
        return rng.choice([math.nan, math.inf, -math.inf, -1.0, 1e300])
    if isinstance(v, str):
        return rng.choice(WEIRD_STRINGS)
    if isinstance(v, bytes):
        return rng.randbytes(rng.randrange(64))
    if isinstance(v, list):
        return rng.choice([[], v * rng.randrange(2, 50), v[:-1], v + [weird(rng)]])
    return weird(rng)


def mutate(rng: random.Random, body):
    """Replace one node of a wire value (a nested list) by a weird or extreme one."""
    if not isinstance(body, list) or not body or rng.random() < 0.1:
        return like(rng, body) if rng.random() < 0.5 else weird(rng)
    body = list(body)
    i = rng.randrange(len(body))
    body[i] = mutate(rng, body[i]) if isinstance(body[i], list) and rng.random() < 0.6 else \
        (like(rng, body[i]) if rng.random() < 0.6 else weird(rng))
    return body


def make_safe(rng: random.Random, type_id: int, body):
    """Make a RegisterWorker invalid too (it is refused anyway: the fuzz does
    not hold the worker key)."""
    if not isinstance(body, list):
        return body
    body = list(body)
    if type_id == m.RegisterWorker.TYPE and len(body) >= 7:
        choice = rng.randrange(3)
        if choice == 0:
            body[6] = rng.choice([0, codec.PROTOCOL_VERSION + 1, -1, 2 ** 40])   # protocol
        elif choice == 1:
            body[5] = rng.choice([0, -1, 4097, 2 ** 63 - 1])   # num_devices
        else:
            body[1] = rng.choice([-1, -2 ** 63])               # island
    return body


class Fuzzer(threading.Thread):
    def __init__(self, key: bytes, controller: str, data_ports: list[str], devices: list[int],
                 seed: int, seconds: float) -> None:
        super().__init__(name="fuzzer", daemon=True)
        self.key, self.seed, self.seconds = key, seed, seconds
        # what the message being made is signed with: its socket's key and signer
        self.sign_key, self.signer = key, codec.CLIENTS
        self.sign_of: dict[zmq.Socket, tuple[bytes, int]] = {}
        self.sessions: dict[int, bytes] = {}     # the fuzz clients' ids and session keys
        self.rng = random.Random(seed)
        self.garbage_blob = b"not a jax.export serialisation " + bytes(self.rng.randrange(256) for _ in range(64))
        self.garbage_digest = hashlib.sha256(self.garbage_blob).hexdigest()
        self.targets = [("controller", controller)] + [("data", a) for a in data_ports]
        self.devices = devices
        self.sent: collections.Counter = collections.Counter()       # kind -> messages
        self.by_target: collections.Counter = collections.Counter()
        self.replies: collections.Counter = collections.Counter()    # Error code or reply type
        self.bad_replies: list[str] = []     # replies that were not correctly signed messages
        self.dropped = 0                     # sends refused because the socket's queue was full
        self.big_sent = 0
        self.error: BaseException | None = None
        self.msg_id = 0
        self.stop_now = threading.Event()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:    # reported by the test
            self.error = e

    def _run(self) -> None:
        ctx = zmq.Context()
        socks = []
        try:
            for target, address in self.targets:
                for n in range(3 if target == "controller" else 2):
                    s = ctx.socket(zmq.DEALER)
                    s.setsockopt(zmq.LINGER, 0)
                    s.setsockopt(zmq.SNDHWM, 1000)
                    s.connect(address)
                    socks.append((target, s))
                    self.sign_of[s] = (self.key, codec.CLIENTS)
                    if target == "controller" and n < 2:
                        # a registered client: its messages, signed with its session
                        # key, reach the handlers
                        self.sign_of[s] = self._hello(s, f"fuzz{n}")
                        self.sign_key, self.signer = self.sign_of[s]
                        self._send(s, target, "semantic",
                                   *self._signed(m.RegisterProgram(self.garbage_digest, "garbage"),
                                                 [self.garbage_blob]))
            sessions = [(k, cid) for cid, k in self.sessions.items()]
            for target, s in socks:        # data ports: as one of the fuzz clients, or the cluster key
                if target == "data" and sessions and self.rng.random() < 0.7:
                    self.sign_of[s] = self.rng.choice(sessions)
            tmpl = templates(self.rng, self.devices, self.garbage_digest)
            deadline = time.monotonic() + self.seconds
            count = 0
            while time.monotonic() < deadline and count < MAX_MESSAGES and not self.stop_now.is_set():
                target, s = self.rng.choice(socks)
                kind = self.rng.choice(KINDS)
                if kind == "big" and self.big_sent >= MAX_BIG:
                    kind = "random"
                self.sign_key, self.signer = self.sign_of[s]
                frames = self._make(kind, target, tmpl[target])
                self._send(s, target, kind, frames)
                count += 1
                if count % 8 == 0:
                    self._drain(socks)
                    time.sleep(0.004)       # leave the 2 cores some time for the cluster
            # the last replies, for a fixed time on purpose: how many of the
            # fuzz messages get one is not known, so there is no event to wait on
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                self._drain(socks)
                time.sleep(0.05)
        finally:
            for _, s in socks:
                s.close(0)
            ctx.term()

    def _hello(self, s: zmq.Socket, name: str) -> tuple[bytes, int]:
        """Connect as a client (signed with the cluster key); its session key and id."""
        nonce = os.urandom(16)
        self.sign_key, self.signer = self.key, codec.CLIENTS
        s.send_multipart(*self._signed(m.Hello(name, codec.PROTOCOL_VERSION, 1.0, nonce)))
        assert s.poll(30_000), "no Welcome"
        _, welcome, _ = codec.decode(self.key, s.recv_multipart())
        session, cid, _ = client_keys(self.key, nonce, welcome.client_id, welcome.session_key)
        self.sessions[cid] = session
        return session, cid

    def _send(self, s: zmq.Socket, target: str, kind: str, frames: list[bytes]) -> None:
        try:
            s.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            return
        self.sent[kind] += 1
        self.by_target[target] += 1

    def _drain(self, socks) -> None:
        """Read (and count) every waiting reply, so no queue fills."""
        for _, s in socks:
            while True:
                try:
                    frames = s.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    _, msg, _ = codec.decode(
                        lambda signer: self.key if signer == codec.CLIENTS else self.sessions.get(signer), frames)
                except Exception as e:
                    self.bad_replies.append(repr(e))
                    continue
                self.replies[f"Error({msg.code})" if isinstance(msg, m.Error) else type(msg).__name__] += 1

    def _signed(self, msg, buffers=(), *, version=codec.PROTOCOL_VERSION, type_id=None, body=None):
        self.msg_id += 1
        tid = msg.TYPE if type_id is None else type_id
        wire = msg.to_wire() if body is None else body
        wire = make_safe(self.rng, tid, wire)
        return (frames_for(self.sign_key, [version, tid, self.msg_id, 0, "fuzz", self.signer], wire, buffers),)

    def _make(self, kind: str, target: str, tmpl: list) -> list[bytes]:
        rng = self.rng
        msg, buffers = rng.choice(tmpl)
        if kind == "random":
            return [rng.randbytes(rng.choice([0, 1, 2, 8, 32, 33, 100, 4096])) for _ in range(rng.randrange(1, 7))]
        if kind == "big":
            self.big_sent += 1
            big = rng.randbytes(rng.randrange(1 << 20, 4 << 20))
            if rng.random() < 0.5:
                return [big]                                       # one huge garbage frame
            # a correctly signed message with a huge buffer or body
            if rng.random() < 0.5:
                return self._signed(msg, [big])[0]
            return frames_for(self.sign_key, [1, msg.TYPE, 1, 0, "fuzz", self.signer], big, buffers)
        if kind == "mutated":
            frames = [bytearray(f) for f in self._signed(msg, buffers)[0]]
            for _ in range(rng.randrange(1, 4)):
                op = rng.randrange(6)
                f = rng.randrange(len(frames))
                if op == 0 and frames[f]:                           # flip bits
                    for _ in range(rng.randrange(1, 8)):
                        i = rng.randrange(len(frames[f]))
                        frames[f][i] ^= 1 << rng.randrange(8)
                elif op == 1:                                       # truncate
                    del frames[f][rng.randrange(len(frames[f]) + 1):]
                elif op == 2:                                       # extra frames
                    frames.insert(rng.randrange(len(frames) + 1), bytearray(rng.randbytes(rng.randrange(64))))
                elif op == 3 and len(frames) > 1:                   # drop a frame
                    del frames[f]
                elif op == 4:                                       # duplicate a frame
                    frames.insert(f, bytearray(frames[f]))
                else:                                               # append garbage
                    frames[f] += rng.randbytes(rng.randrange(1, 16))
            return [bytes(f) for f in frames]
        if kind == "badsig":
            frames = self._signed(msg, buffers)[0]
            sig = rng.choice([rng.randbytes(32), b"", rng.randbytes(31), rng.randbytes(33), frames[0][:16],
                              sign(rng.randbytes(32), frames[1:]), sign(self.sign_key, frames[1:] + [b""]),
                              sign(self.sign_key, frames[2:])])
            return [sig, *frames[1:]]
        if kind == "version":
            version = rng.choice([0, 2, -1, 255, 2 ** 32, 2 ** 63 - 1, -2 ** 63])
            return self._signed(msg, buffers, version=version)[0]
        if kind == "header":
            header = rng.choice([
                [1, msg.TYPE, 1, 0], [1, msg.TYPE, 1, 0, "fuzz", 6, 7], {"version": 1}, "hello", 1, None,
                [True, msg.TYPE, 1, 0, "x"], [1, msg.TYPE, 1.5, 0, "x"], [1, msg.TYPE, 1, 0, b"x"],
                [1.0, msg.TYPE, 1, 0, "x"], [1, str(msg.TYPE), 1, 0, "x"], [1, msg.TYPE, -1, -1, "x"],
                [1, msg.TYPE, 2 ** 64 - 1, 2 ** 64 - 1, "x" * 10000], [[1], msg.TYPE, 1, 0, "x"],
            ])
            hbytes = rng.choice([pack(header), rng.randbytes(rng.randrange(1, 20)), b"", b"\xc1", b"\x95"])
            return frames_for(self.sign_key, hbytes, msg.to_wire(), buffers)
        if kind == "typeid":
            tid = rng.choice([0, 10, 19, 24, 45, 49, 59, 99, 255, -1, 2 ** 40, 2 ** 63 - 1,
                              *codec.registry()])
            body = rng.choice([msg.to_wire(), weird(rng), [weird(rng) for _ in range(rng.randrange(12))]])
            return self._signed(msg, buffers, type_id=tid, body=body)[0]
        if kind == "values":
            body = msg.to_wire()
            for _ in range(rng.randrange(1, 4)):
                body = mutate(rng, body)
            if rng.random() < 0.2:      # raw msgpack damage under a good signature
                raw = bytearray(pack(body))
                if raw:
                    raw[rng.randrange(len(raw))] = rng.randrange(256)
                return frames_for(self.sign_key, [1, msg.TYPE, 1, 0, "fuzz", self.signer], bytes(raw), buffers)
            bufs = buffers if rng.random() < 0.8 else [rng.randbytes(rng.randrange(64))
                                                       for _ in range(rng.randrange(4))]
            return self._signed(msg, bufs, body=body)[0]
        assert kind == "semantic"
        msg, buffers = semantic(rng, target, self.devices, self.garbage_digest)
        return self._signed(msg, buffers)[0]


# ---- the test ------------------------------------------------------------------

def _alive(cluster) -> dict[str, int | None]:
    return {name: p.poll() for name, p in cluster.procs}


def test_fuzzed_decoders_keep_serving_a_correct_client(zpath_cluster):
    seed = int(os.environ.get("ZPATH_FUZZ_SEED", random.SystemRandom().randrange(2 ** 32)))
    print(f"\nfuzz seed {seed} (set ZPATH_FUZZ_SEED={seed} to repeat)")
    log_dir = os.environ.get("ZPATH_FUZZ_LOG_DIR")     # keep the processes' logs there
    cluster = zpath_cluster(islands=2, hosts_per_island=1, devices_per_host=1,
                            **({"log_dir": log_dir} if log_dir else {}))
    started = {name: p.pid for name, p in cluster.procs}
    with connected(cluster, name="correct") as conn:
        c = conn.client
        d0 = zp.make_virtual_device_set().add_slice(devices=1, island=0).devices
        d1 = zp.make_virtual_device_set().add_slice(devices=1, island=1).devices
        double = zp.pmap(lambda x: x * 2.0, devices=d0)
        inc = zp.pmap(lambda x: x + 1.0, devices=d1)       # on the other island: a DCN piece
        step = zp.pmap(lambda x: x + 3.0, devices=d0)
        np.testing.assert_array_equal(np.asarray(inc(double(np.ones((1, 2))))), [[3., 3.]])
        status = c.request(m.StatusRequest(False))
        hosts_before = sorted(h.rank for h in status.hosts)
        device_ids = [d.id for h in status.hosts for d in h.devices]

        fuzz = Fuzzer(cluster.key, cluster.address, [h.data_address for h in c.hosts.values()],
                      device_ids, seed, FUZZ_SECONDS)
        fuzz.start()
        calls = 0
        acc, acc_expect = step(np.zeros((1, 2))), 3.0          # a chain never fetched until the end
        deadline = time.monotonic() + FUZZ_SECONDS + 120    # bounded, generous on a loaded machine
        try:
            while (fuzz.is_alive() or calls < MIN_CALLS) and time.monotonic() < deadline:
                x = np.array([[calls, -calls]], dtype=np.float64)
                y = double(x)
                z = inc(y)
                acc, acc_expect = step(acc), acc_expect + 3.0
                np.testing.assert_array_equal(z.result(timeout=60), x * 2 + 1, err_msg=f"call {calls}")
                if calls % 10 == 0:
                    np.testing.assert_array_equal(y.result(timeout=60), x * 2, err_msg=f"call {calls}")
                calls += 1
        except BaseException:
            # the stacks of every thread of every process, into their logs
            dumping = {}
            for name, p in cluster.procs:
                if p.poll() is None:
                    log_file = os.path.join(cluster.dir, f"{name}.log")
                    dumping[log_file] = os.path.getsize(log_file)
                    p.send_signal(signal.SIGUSR1)
            with contextlib.suppress(pytest.fail.Exception):   # bounded, and the failure above is the one
                wait_until(lambda: all(os.path.getsize(f) > n for f, n in dumping.items()), timeout=5,
                           interval=0.05, what="the stack dumps in the logs")
            print(f"failed after {calls} iterations; fuzz sent {dict(fuzz.sent)}; logs in {cluster.dir}")
            raise
        finally:
            fuzz.stop_now.set()
            fuzz.join(60)
        assert not fuzz.is_alive(), "the fuzz thread did not finish"
        np.testing.assert_array_equal(acc.result(timeout=60), [[acc_expect, acc_expect]])
        print(f"correct client: {calls} iterations ({3 * calls} calls) checked during the fuzz")
        print(f"fuzz messages sent: {sum(fuzz.sent.values())} {dict(sorted(fuzz.sent.items()))}; "
              f"per target {dict(fuzz.by_target)}; big frames {fuzz.big_sent}; "
              f"not sent (queue full) {fuzz.dropped}")
        print(f"replies to the fuzz sockets: {dict(sorted(fuzz.replies.items()))}")
        if fuzz.error is not None:
            raise fuzz.error
        assert calls >= MIN_CALLS
        assert sum(fuzz.sent.values()) > 500, fuzz.sent
        assert not fuzz.bad_replies, fuzz.bad_replies[:5]
        # both kinds of receiver answered the garbage (not just dropped it)
        assert fuzz.replies["Error(protocol)"] > 0 and fuzz.replies["Error(bad_request)"] > 0, fuzz.replies

        # A bad message that is the last one queued on a worker's data port must
        # not leave the worker's I/O thread waiting in recv on that socket (it
        # would stop reading its control socket: no Execute, no Pong, and the
        # host is declared lost). Nothing else touches that data port here: the
        # computation is on a value already on the device, and is seen finished
        # in the controller's timeline, without a fetch.
        mine = lambda: sum(r.client == c.client_id for r in c.request(m.TimelineRequest(100_000)).records)
        before = mine()
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(c.hosts[c.devices[d0[0].id].host].data_address)
        try:
            s.send_multipart([b"garbage"])
            assert s.poll(30_000), "no Error reply to garbage"
            s.recv_multipart()
            # on purpose, not a wait for an event: give the worker's I/O thread
            # time to go back to its loop after that reply (where a stuck recv
            # would hold it; nothing outside shows that moment) before the next
            # call is sent to it
            time.sleep(0.2)
            acc, acc_expect = step(acc), acc_expect + 3.0
            t = time.monotonic()
            while mine() == before:
                assert time.monotonic() - t < 8, "a worker stopped serving after a bad last message"
                time.sleep(0.05)
        finally:
            s.close()
            ctx.term()
        np.testing.assert_array_equal(acc.result(timeout=60), [[acc_expect, acc_expect]])

        # every process is still the one we started, and running
        assert {name: p.pid for name, p in cluster.procs} == started
        assert all(rc is None for rc in _alive(cluster).values()), _alive(cluster)
        status = c.request(m.StatusRequest(True))
        assert sorted(h.rank for h in status.hosts) == hosts_before     # no fake host joined
        assert not status.lost
        np.testing.assert_array_equal(np.asarray(inc(double(np.full((1, 2), 5.0)))), [[11., 11.]])

    # a fresh client connects and computes, on both islands and between them
    other = Client(cluster.address, cluster.key, name="after-fuzz")
    other.close()
    with connected(cluster, name="fresh") as conn:
        e0 = zp.make_virtual_device_set().add_slice(devices=1, island=0).devices
        e1 = zp.make_virtual_device_set().add_slice(devices=1, island=1).devices
        f = zp.pmap(lambda x: x - 1.0, devices=e0)
        g = zp.pmap(lambda x: x * 10.0, devices=e1)
        np.testing.assert_array_equal(np.asarray(g(f(np.arange(3.0)[None]))), [[-10., 0., 10.]])
    assert all(rc is None for rc in _alive(cluster).values()), _alive(cluster)
