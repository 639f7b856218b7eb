"""The floor under a small piece's channel time on this machine: one message of
``--size`` bytes (1 KiB) from one process to another that sleeps waiting for it,
with nothing else in the path.

zpath's ICI channel sends a small piece as one Unix datagram from the thread
that has it to a receiver that sleeps in ``epoll`` (zpath/net/channels.py); its
control messages go through ZeroMQ (an I/O thread on each side). This script
times the bare mechanisms, so that a piece's measured channel time
(benchmarks/transfer.py) can be read against what moving and waking alone
costs here: a sender stamps the wall clock into the message (one machine, one
clock) after ``--gap`` ms of sleep, the receiver stamps it when its wait
returns with the bytes; the one-way time is the difference, median and
quartiles over ``--count`` messages. A gap lets the receiver's core go idle,
as it does between the pieces of a real program: a message after a gap pays
the wake-up of an idle core (and, on a virtual machine, of its virtual CPU),
which back-to-back messages do not. A third kind, "dgram, polled", is the same
datagram to a receiver that knows when the next one is due (the sender's last
stamp plus the gap) and polls its socket without blocking, yielding its core
between tries, from 50 µs before that time for up to ``--spin-us`` (200), then
sleeps in ``epoll``: the floor a receiver that polls while a piece is due would
have (docs/benchmarks.md, transfer.py, has what such a worker measured).

    .venv/bin/python benchmarks/wake_floor.py [--gaps 0.5,2,10] [--count 300] [--spin-us 200] [--json]

It also times, in this one process, the steps zpath adds to a 1 KiB piece's trip
(the sender makes and signs the ``Piece`` and its datagram and sends it; the
receiver reads it, checks and decodes it, and makes the array), one after the
other as on the piece's path: back to back ("hot"), and after each gap of sleep,
when the code and data they touch have left the caches: what each costs on a CPU
that was idle, as the workers' CPUs are between the pieces of a program.

The same steps are timed for the channel's own format of a small piece
(``channels.PieceDatagrams``: a binary header and a keyed BLAKE3 MAC, checked
and made an array in one call), which the workers use where it can go.

``--ops`` instead counts, deterministically, what a worker runs on a 1 KiB
piece's path: Python bytecodes, Python calls and C calls in the sender's
``Worker._send_piece`` (from its stamp through the send) and in the receiver's
``Worker._drain_dgram`` (the datagram read, checked, made an array, stamped and
stored), two workers in this process; run it in each tree to compare.

A script that prints figures, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import struct
import sys
import tempfile
import time

import numpy as np
import zmq

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from zpath.net import channels, codec   # noqa: E402
from zpath.net import messages as m   # noqa: E402
from zpath.net.transport import Endpoint   # noqa: E402

STAMP = struct.Struct("<d")


def _summary(lat: list[float]) -> dict[str, float]:
    lat = sorted(lat)
    n = len(lat)
    return {"median_us": round(statistics.median(lat) * 1e6, 1),
            "p25_us": round(lat[n // 4] * 1e6, 1), "p75_us": round(lat[(3 * n) // 4] * 1e6, 1)}


def _send_all(send, gap_s: float, count: int, size: int) -> None:
    pad = b"\0" * max(0, size - STAMP.size)
    for _ in range(count):
        if gap_s:
            time.sleep(gap_s)
        send(STAMP.pack(time.time()) + pad)


def _receiver(recv, count: int, out: int) -> None:
    """Runs in the child: receives ``count`` messages and writes the one-way times to ``out``."""
    lat = []
    last = 0.0
    for _ in range(count):
        msg = recv(last)
        last = STAMP.unpack_from(msg)[0]
        lat.append(time.time() - last)
    os.write(out, json.dumps(lat).encode())
    os.close(out)


# how long before a polled message is due its receiver starts to poll
POLL_EARLY_S = 50e-6


def _run(kind: str, gap_s: float, count: int, size: int, runtime_dir: str,
         spin_s: float = 0.0) -> dict[str, float]:
    """One-way times of ``count`` messages of ``kind`` ('dgram', 'dgram-poll'
    or 'zmq') after ``gap_s`` each (``spin_s``: how long a 'dgram-poll'
    receiver polls at most)."""
    r, w = os.pipe()
    addr = os.path.join(runtime_dir, f"floor-{os.getpid()}-{kind}")
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:                               # the receiver
        try:
            os.close(r)
            os.close(ready_r)
            if kind in ("dgram", "dgram-poll"):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sock.bind(addr)
                sock.setblocking(False)
                ep = select.epoll()
                ep.register(sock.fileno(), select.EPOLLIN)
                polled = kind == "dgram-poll"

                def recv(last: float) -> bytes:
                    if polled and last:
                        # the next one is due at last + gap: sleep until a
                        # little before, then poll for at most spin_s
                        start = last + gap_s - POLL_EARLY_S
                        if start > time.time():
                            time.sleep(start - time.time())
                        until = time.monotonic() + spin_s
                        while time.monotonic() < until:
                            try:
                                return sock.recv(size + 64)
                            except BlockingIOError:
                                os.sched_yield()
                    ep.poll()
                    return sock.recv(size + 64)
            else:
                ctx = zmq.Context()
                sock = ctx.socket(zmq.PULL)
                sock.bind("ipc://" + addr)

                def recv(last: float) -> bytes:
                    return sock.recv()
            os.write(ready_w, b"x")
            _receiver(recv, count, w)
        finally:
            os._exit(0)
    os.close(w)
    os.close(ready_w)
    try:
        os.read(ready_r, 1)                    # the receiver is bound and waiting
        if kind in ("dgram", "dgram-poll"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            _send_all(lambda b: sock.sendto(b, addr), gap_s, count, size)
            sock.close()
        else:
            ctx = zmq.Context()
            zs = ctx.socket(zmq.PUSH)
            zs.connect("ipc://" + addr)
            time.sleep(0.05)                  # (the connection is made before the first stamp)
            _send_all(zs.send, gap_s, count, size)
            zs.close(linger=1000)
            ctx.term()
        chunks = []
        while chunk := os.read(r, 1 << 16):
            chunks.append(chunk)
        return _summary(json.loads(b"".join(chunks)))
    finally:
        os.close(r)
        os.close(ready_r)
        os.waitpid(pid, 0)
        if os.path.exists(addr):
            os.unlink(addr)


KINDS = ("dgram", "dgram-poll", "zmq")
STEPS = ("make and sign", "send and read", "check and decode", "array")


def _steps(gap_s: float, count: int, size: int) -> dict[str, float]:
    """Median µs of each step of a small piece's path in this process (see the
    module's docstring), after ``gap_s`` of sleep (0: back to back)."""
    ep = Endpoint(b"k" * 32, "worker:bench")
    rx = channels.DgramReceiver(channels.dgram_name("zpath-floor", f"steps-{os.getpid()}"))
    tx = channels.DgramSender()
    value = np.ones((1, size // 4), np.float32)
    times: list[list[float]] = []
    try:
        for _ in range(count):
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            data = memoryview(value).cast("B")
            frames = codec.encode(ep.sign_key, m.Piece(1, m.Aval(list(value.shape), "float32"), None),
                                  msg_id=ep.next_id(), sender=ep.sender, buffers=[data], signer=ep.signer)
            t1 = time.perf_counter()
            if not tx.send(rx.name, frames):
                raise RuntimeError("the datagram did not go")
            got = rx.recv()
            t2 = time.perf_counter()
            _, msg, buffers = ep.decode(channels.dgram_frames(got))
            t3 = time.perf_counter()
            np.ndarray(tuple(msg.aval.shape), np.float32, buffer=buffers[0])
            t4 = time.perf_counter()
            times.append([t1 - t0, t2 - t1, t3 - t2, t4 - t3])
    finally:
        rx.close()
        tx.close()
    return {name: round(statistics.median(t[k] for t in times) * 1e6, 1) for k, name in enumerate(STEPS)}


PIECE_STEPS = ("make and sign", "send and read", "check, decode, array")


def _piece_steps(gap_s: float, count: int, size: int) -> dict[str, float]:
    """As :func:`_steps`, for the channel's own piece format."""
    pieces = channels.PieceDatagrams(b"k" * 32)
    rx = channels.DgramReceiver(channels.dgram_name("zpath-floor", f"psteps-{os.getpid()}"))
    tx = channels.DgramSender()
    value = np.ones((1, size // 4), np.float32)
    times: list[list[float]] = []
    try:
        for _ in range(count):
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            parts = pieces.frames(1, value)
            t1 = time.perf_counter()
            if parts is None or not tx.send_parts(rx.name, parts):
                raise RuntimeError("the datagram did not go")
            got = rx.recv()
            t2 = time.perf_counter()
            pieces.read(got)
            t3 = time.perf_counter()
            times.append([t1 - t0, t2 - t1, t3 - t2])
    finally:
        rx.close()
        tx.close()
    return {name: round(statistics.median(t[k] for t in times) * 1e6, 1) for k, name in enumerate(PIECE_STEPS)}


def _count(fn) -> dict[str, int]:
    """Python bytecodes, Python calls and C calls that ``fn()`` runs."""
    n = {"bytecodes": 0, "py_calls": 0, "c_calls": 0}

    def trace(frame, event, arg):
        if event == "call":
            frame.f_trace_opcodes = True
            n["py_calls"] += 1
        elif event == "opcode":
            n["bytecodes"] += 1
        return trace

    def profile(frame, event, arg):
        if event == "c_call":
            n["c_calls"] += 1

    sys.settrace(trace)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        sys.settrace(None)
    n["py_calls"] -= 1          # fn itself
    return n


def ops(size: int) -> dict[str, dict[str, int]]:
    """What two workers of this process run on a ``size``-byte piece's path
    (see the module's docstring): the counts of the last of a few pieces."""
    # here, not at the top: the timings above need no JAX in the process
    from zpath.config import CommonConfig, WorkerConfig
    from zpath.ids import buffer_id
    from zpath.worker.server import Worker
    from zpath.worker.store import PieceKey, shard_key
    a, b = (Worker(b"k" * 32, "tcp://127.0.0.1:9", 0, config=WorkerConfig(shm=True), common=CommonConfig())
            for _ in range(2))
    try:
        if a.dgram_out is None or b.dgram_in is None:
            raise RuntimeError("no datagram sockets here")
        value = np.ones((1, size // 4), np.float32)
        region = [[0, 1], [0, size // 4]]
        out: dict[str, dict[str, int]] = {}
        for i in range(5):
            key = shard_key(buffer_id(1, i + 1), 0, region)
            a.store.set(key, value)
            order = m.SendPiece(i + 1, buffer_id(1, i + 1), 0, region, region, 1, b.data_address, "ICI",
                                b.machine, "")
            entry = a.store.entry(key)
            view = np.asarray(entry.value)[(slice(0, 1), slice(0, size // 4), Ellipsis)]
            out["sender"] = _count(lambda: a._send_piece(order, entry, view, direct=True))
            if not select.select([b.dgram_in.fileno()], [], [], 5)[0]:
                raise RuntimeError("the piece did not come")
            out["receiver"] = _count(b._drain_dgram)
            if not b.store.is_done(PieceKey(i + 1)):
                raise RuntimeError("the piece was not stored")
        return out
    finally:
        a.close()
        b.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gaps", default="0.5,2,10",
                   help="ms of sleep before each message, comma-separated, each > 0 (back to back, "
                        "the sender outruns the receiver and the times measure a queue)")
    p.add_argument("--count", type=int, default=300, help="messages per gap and kind (default 300)")
    p.add_argument("--size", type=int, default=1024, help="bytes per message (default 1024)")
    p.add_argument("--spin-us", type=float, default=200.0,
                   help="how long a polling receiver polls at most, µs (default 200)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--ops", action="store_true",
                   help="only count what two workers run on a piece's path (bytecodes, calls)")
    args = p.parse_args(argv)
    if args.ops:
        counts = ops(args.size)
        if args.json:
            print(json.dumps(counts))
        else:
            for side, c in counts.items():
                print(f"{side:>9}: {c['bytecodes']} bytecodes, {c['py_calls']} Python calls, "
                      f"{c['c_calls']} C calls")
        return 0
    if args.count < 4 or args.size < STAMP.size:
        p.error(f"--count must be >= 4 and --size >= {STAMP.size}")
    gaps = [float(g) for g in args.gaps.split(",")]
    if min(gaps) <= 0:
        p.error("--gaps must all be > 0")
    runtime_dir = tempfile.gettempdir()
    out: dict = {"size": args.size, "count": args.count, "load": os.getloadavg(), "gaps": {}}
    for g in gaps:
        out["gaps"][str(g)] = {kind: _run(kind, g / 1000, args.count, args.size, runtime_dir,
                                          args.spin_us / 1e6)
                               for kind in KINDS}
    out["steps"] = {"hot": _steps(0.0, max(args.count, 1000), args.size),
                    **{str(g): _steps(g / 1000, args.count, args.size) for g in gaps}}
    out["piece_steps"] = {"hot": _piece_steps(0.0, max(args.count, 1000), args.size),
                          **{str(g): _piece_steps(g / 1000, args.count, args.size) for g in gaps}}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"one-way time of a {args.size}-byte message to a sleeping receiver "
          f"(median [p25-p75] µs over {args.count}; load {out['load'][0]:.1f})")
    print(f"{'gap ms':>7}  {'unix datagram':>22}  {'datagram, polled':>22}  {'ZeroMQ ipc':>22}")
    for g, row in out["gaps"].items():
        cells = [f"{row[k]['median_us']:7.0f} [{row[k]['p25_us']:.0f}-{row[k]['p75_us']:.0f}]" for k in KINDS]
        print(f"{g:>7}  " + "  ".join(f"{c:>22}" for c in cells))
    print(f"\nzpath's steps on a {args.size}-byte piece's path, in this process: median µs, "
          "back to back (hot) and after each gap")
    print(f"{'gap ms':>7}  " + "  ".join(f"{name:>16}" for name in STEPS) + f"  {'all':>6}")
    for g, row in out["steps"].items():
        print(f"{g:>7}  " + "  ".join(f"{row[name]:16.1f}" for name in STEPS) + f"  {sum(row.values()):6.1f}")
    print(f"\nthe same in the channel's own piece format (PieceDatagrams), median µs")
    print(f"{'gap ms':>7}  " + "  ".join(f"{name:>20}" for name in PIECE_STEPS) + f"  {'all':>6}")
    for g, row in out["piece_steps"].items():
        print(f"{g:>7}  " + "  ".join(f"{row[name]:20.1f}" for name in PIECE_STEPS)
              + f"  {sum(row.values()):6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
