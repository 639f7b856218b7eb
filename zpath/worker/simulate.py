"""Simulated hosts: the worker protocol without JAX, many hosts in one process.

``zpath worker --simulate --hosts N --devices D`` registers N hosts of D devices
each with the controller, and each speaks the whole worker protocol on its own
control connection: it queues ``Execute`` and ``RunFused`` in gang order per
device, "runs" a computation by occupying its devices for an emulated time (an
accelerator that uses no host CPU: nothing computes, a timer fires), waits for
the inputs it names (client ``Put``s, pieces from other hosts), records its
outputs with their declared sizes, carries out ``SendPiece`` after an emulated
transfer time, reports ``ExecDone`` (holding reports while more work is queued
when the controller allows it, as a real worker does), answers ``Ping``, frees
what ``Free``/``ClientGone`` name, and answers ``Fetch`` with zeros of the
shard's shape. Values are not computed: sizes are.

The time a computation takes comes from its program: a program registered
with the bytes of :func:`sim_program` costs what they say; any other program
(a real ``jax.export`` serialisation) costs ``--cost-ms``.

One thread serves every host of the process: each host's control socket (a
DEALER to the controller, so the controller sees N hosts), one data port (a
ROUTER shared by the process's hosts: ``Put`` and ``Fetch`` name a device, so
the host they are for is known), and a timer heap for emulated computations
and transfers (computations due at the same time share an entry). The loop
waits on the sockets' ``ZMQ_FD``s with epoll, so a turn costs what is ready,
not what is open, and flushes only the hosts with something to send. Pieces
between hosts of one process never touch a socket. A message that reaches
several hosts of the process with the same bytes (the controller sends a
computation of many hosts once, see docs/protocol.md) is checked and decoded
once. Relays (zpath/worker/relay.py) work as on real workers, except that a
relay hands what it forwards to hosts of its own process without a socket (one
``Forwarded`` per other process, checked and decoded once for all its hosts),
and their reports reach it the same way. Hosts that a relay gives the same
computations are kept as one record (``SimGroup``: one queue, clock and timer,
what their runs made kept once, their rows as one block) until a message for
one of them alone splits it off (docs/design.md, "Simulated hosts").

Kill the process (SIGKILL) to lose all its hosts at once, as a crashed
machine; pause it (SIGSTOP) as a hung one; ``SimHost.kill`` loses one host.
"""
from __future__ import annotations

import argparse
import collections
import copy
import gc
import heapq
import itertools
import json
import logging
import math
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any, Callable, NamedTuple

import zmq

from zpath import logs, sharding
from zpath.config import (DEEP_QUEUE, HOLD_DEEP_S, HOLD_SHORT_S, SHORT_COMPUTATION_S, CommonConfig,
                          WorkerConfig)
from zpath.errors import ErrorKind, ProtocolError, ZpathError
from zpath.ids import client_of
from zpath.keys import Keys, key_from_config, worker_key_from_config
from zpath.net import codec
from zpath.net import messages as m
from zpath.net.codec import PROTOCOL_VERSION, Record
from zpath.net.transport import BadMessage, Endpoint, make_context, unbatched
from zpath.process import die_with_parent
from zpath.worker import relay as relays
from zpath.worker.state import FreeOrder, IdRanges, refused_on_data
from zpath.worker.store import Entry, PieceKey, ShardKey, Store, shard_key

log = logging.getLogger(__name__)

SIM_MAGIC = b"zpath-sim-program\n"
REGISTER_TIMEOUT_S = 60.0
# messages decoded once for every host of the process they reach (by signature)
DECODE_CACHE = 512


def sim_program(cost_ms: float, name: str = "") -> bytes:
    """The bytes of a simulated program that takes ``cost_ms`` milliseconds of
    device time per run (register them as a program with the controller)."""
    if not (cost_ms >= 0 and math.isfinite(cost_ms)):
        raise ValueError(f"cost_ms must be a finite number >= 0, got {cost_ms!r}")
    return SIM_MAGIC + json.dumps({"cost_ms": float(cost_ms), "name": name}).encode()


def program_cost_s(blob: bytes, default_s: float) -> float:
    """Seconds one run of the program ``blob`` occupies its devices."""
    if not blob.startswith(SIM_MAGIC):
        return default_s
    try:
        cost = float(json.loads(blob[len(SIM_MAGIC):])["cost_ms"])
    except (ValueError, KeyError, TypeError):
        return default_s
    return cost / 1000 if cost >= 0 and math.isfinite(cost) else default_s


class SimValue:
    """A shard or piece that exists only as its size, and the (monotonic)
    time it was made on its device."""
    __slots__ = ("shape", "dtype", "nbytes", "made", "parts", "per_device")

    def __init__(self, shape: tuple[int, ...], dtype: str, made: float = 0.0, size: int = -1,
                 parts: tuple[tuple[int, int], ...] = ()) -> None:
        """``size``: the number of elements, if known; ``parts``: for a host's
        whole part of a buffer (see ``whole_key``), (device, elements) of each
        of its shards."""
        self.shape, self.dtype, self.made, self.parts = shape, dtype, made, parts
        self.nbytes = (math.prod(shape) if size < 0 else size) * (_ITEMSIZE.get(dtype) or _itemsize(dtype))
        self.per_device: tuple[tuple[int, int], ...] | None = None    # (device, bytes) of parts, once asked

    def device_bytes(self) -> tuple[tuple[int, int], ...]:
        """(device, bytes) of each of ``parts`` (worked out once: every Pong asks)."""
        if self.per_device is None:
            item = _itemsize(self.dtype)
            self.per_device = tuple((d, size * item) for d, size in self.parts)
        return self.per_device


def whole_key(buffer: int, host_index: int) -> ShardKey:
    """The store key of a host's whole part of a buffer that a computation made
    (one entry for all of its devices' shards, where a real worker keeps one per
    shard; a client's Put is kept per shard)."""
    return ShardKey(buffer, -1 - host_index, ())


_ITEMSIZE: dict[str, int] = {}


def _itemsize(dtype: str) -> int:
    n = _ITEMSIZE.get(dtype)
    if n is None:
        try:
            n = sharding.itemsize(dtype)
        except (TypeError, ValueError):
            n = 1
        if len(_ITEMSIZE) < 256:
            _ITEMSIZE[dtype] = n
    return n


class Placed(NamedTuple):
    """A host's shards of a value: (device, region) each, its elements in all,
    and (device, elements) each."""
    shards: list[tuple[int, tuple]]
    size: int
    parts: tuple[tuple[int, int], ...]


NOWHERE = Placed([], 0, ())


class _Run:
    """One queued computation of a host: an Execute or a fused run
    (``release``: a fused run's own outputs, freed unremembered once it ran)."""
    __slots__ = ("exec_id", "devices", "needs", "outputs", "cost", "hold", "index", "release",
                 "start", "end", "arrived", "waiting", "waits")

    def __init__(self, exec_id: int, devices: frozenset[int], needs: list, outputs: list,
                 cost: float, hold: bool, index: int, release: list[int]) -> None:
        self.exec_id, self.devices, self.needs, self.outputs = exec_id, devices, needs, outputs
        self.cost, self.hold, self.index, self.release = cost, hold, index, release
        self.start = self.end = self.arrived = 0.0
        self.waiting = False
        self.waits: list[tuple] = []      # (store, key, callback) of what it waits for


class Timers:
    """Callbacks due at monotonic times (one heap for the process). Callbacks
    due at the same time (an SPMD computation's hosts of this process, which
    start together) share one heap entry and run in the order they were set."""

    def __init__(self) -> None:
        self._heap: list[float] = []
        self._due: dict[float, list[Callable[[], None]]] = {}

    def at(self, when: float, fn: Callable[[], None]) -> None:
        fns = self._due.get(when)
        if fns is None:
            self._due[when] = [fn]
            heapq.heappush(self._heap, when)
        else:
            fns.append(fn)

    def run_due(self, now: float) -> None:
        heap, due = self._heap, self._due
        while heap and heap[0] <= now:
            for fn in due.pop(heapq.heappop(heap)):
                fn()

    def next_in(self, now: float) -> float | None:
        return max(0.0, self._heap[0] - now) if self._heap else None


class SimHost:
    """One simulated host: its control socket, devices, store and queues."""

    def __init__(self, proc: "SimProcess", index: int, island: int, process_id: int,
                 num_processes: int, runtime: str) -> None:
        self.proc = proc
        self.index = index
        self.island = island
        self.name = f"{proc.name}-h{index}"
        self.process_id, self.num_processes, self.runtime = process_id, num_processes, runtime
        self.ctl = proc.ctx.socket(zmq.DEALER)
        self.ctl.connect(proc.controller)
        self.ep = Endpoint(proc.keys.workers, f"worker:{self.name}", keys=proc.keys.of)
        self.rank: int | None = None
        self.device_ids: list[int] = []
        self.store = Store()
        self.costs: dict[str, float] = {}          # program digest -> seconds
        self.fused: dict[int, m.DefineFused] = {}
        self.gone_clients = IdRanges()
        self.queues: dict[int, collections.deque[_Run]] = {}
        self.busy: set[int] = set()
        self.free_at: dict[int, float] = {}         # device -> when its last computation ends
        self.order = FreeOrder()
        self.held: list[Record] = []               # reports held (see _report)
        self.held_due = 0.0                        # when they go at the latest
        self.out: list[Record] = []                # control messages to send at the next flush
        self.alive = True
        self.relay = relays.RelayState()
        # the group whose computations this host runs with others (SimGroup), if any
        self.group: SimGroup | None = None
        # messages that came after its Registered while other hosts registered
        self.early: list[tuple[Record, list]] = []                          # device-seconds of emulated computation run

    # ---- start-up ------------------------------------------------------------
    def register_message(self, devices: int) -> m.RegisterWorker:
        jax_ids = [self.process_id * devices + i for i in range(devices)]
        return m.RegisterWorker(self.name, self.island, self.proc.data_address, os.getpid(), "sim",
                                devices, PROTOCOL_VERSION, jax_ids, self.runtime, self.process_id,
                                self.num_processes, self.proc.machine, "", "")

    def registered(self, reply: m.Registered) -> None:
        self.rank = reply.rank
        self.device_ids = [d.id for d in reply.devices]
        self.queues = {d: collections.deque() for d in self.device_ids}

    def kill(self) -> None:
        """Lose this host as a crashed machine would: its connection closes
        without a word and nothing it had is answered again."""
        self.alive = False
        if self.group is not None:
            self.group.split(self, self.proc.now)
        self.proc.forget(self)
        self.ctl.close(0)

    # ---- control messages ----------------------------------------------------
    def from_controller(self, msg: Record, buffers: list, now: float) -> None:
        """A message on the control socket, handled in its turn (relay.py)."""
        for item, bufs in self.relay.direct(msg, buffers, now):
            self.handle_ctl(item, bufs, now)
        if self.relay.blocked is not None:      # (held: expires in _relay_due)
            self.proc.relaying.add(self)

    def forwarded(self, relay: int, address: str, after: int, collect: list[int], msg: Record,
                  buffers: list, now: float) -> None:
        """A message of the controller that relay ``relay`` forwarded (checked
        and decoded once for the process's hosts: ``SimProcess.forwarded``),
        handled in its turn."""
        for item, bufs in self.relay.forwarded(relay, address, after, collect, msg, buffers, now):
            self.handle_ctl(item, bufs, now)
        if self.relay.waiting:
            self.proc.relaying.add(self)

    def _relay(self, msg: m.Relay, buffers: list, now: float) -> None:
        """As a relay: forward to the group's other hosts (those of this
        process without a socket), then run it here if it is ours too."""
        why = relays.check_relay(msg, buffers)
        if why:
            log.warning("host %s: %s", self.rank, why)
            return
        frames = [bytes(b) for b in buffers]
        proc = self.proc
        mine, after, forwards = relays.forwards(msg, self.rank, proc.data_address)
        if msg.collect:
            self.relay.collect(msg.collect, msg.hosts)
        hosts, afters = ([self.rank], [after]) if mine else ([], [])
        for address, fwd in forwards:
            if address == proc.data_address:       # (this process's other hosts: no socket)
                hosts += fwd.hosts
                afters += fwd.after
            else:
                proc._send_peer(address, fwd, frames)
        if hosts:
            got = proc.forwarded_message(self.rank, frames)
            if got is not None:
                proc.deliver(self.rank, proc.data_address, hosts, afters, msg.collect, *got)

    def _relay_lost(self, rank: int, now: float) -> None:
        for item, bufs in self.relay.relay_lost(rank, now):
            self.handle_ctl(item, bufs, now)
        rows = self.relay.rows_for_lost(rank, now)
        if rows:
            self.out.append(m.batch_of(rows))
            self.proc.outgoing.add(self)
        self.relay.forget_host(rank)
        if self.relay.rows:
            self.proc.relaying.add(self)

    def idle(self) -> bool:
        """Nothing queued, running or held here (it may join a group)."""
        return not self.busy and not self.held and not any(self.queues.values())

    def handle_ctl(self, msg: Record, buffers: list, now: float) -> None:
        if self.group is not None and type(msg) in SPLITS:
            self.group.split(self, now)         # (a message for this host alone)
        match msg:
            case m.Execute():
                self._submit(self._run_of(msg), now)
            case m.RunFused():
                self._run_fused(msg, now)
            case m.DefineFused():
                self.fused[msg.fused] = msg
            case m.DropFused():
                for f in msg.fused:
                    self.fused.pop(f, None)
            case m.SendPiece():
                self.proc.send_piece(self, msg)
            case m.SendPieces():          # a bucket: emulated piece by piece
                for p in msg.pieces:
                    self.proc.send_piece(self, m.SendPiece(p.piece_id, p.buffer, p.device, p.region, p.sub,
                                                           msg.dst_host, msg.dst_address, msg.channel,
                                                           msg.dst_machine, msg.dst_key))
            case m.RegisterProgram():
                if len(buffers) == 1:
                    self.costs[msg.digest] = self.proc.program_cost(msg.digest, bytes(buffers[0]))
            case m.Ping():
                self.out.append(m.Pong(msg.seq, *self.stats()))
                self.proc.outgoing.add(self)
            case m.Free():
                self._free_after_earlier(msg.buffers, True)
            case m.ClientGone():
                self.gone_clients.add(msg.client)
                mine = self.store.buffers_of(msg.client)
                if mine:
                    self._free_after_earlier(mine, False)
            case m.FailBuffers():
                self.store.fail_buffers(msg.buffers, msg.error)
            case m.FailPieces():
                for p in msg.piece_ids:
                    self.proc.piece_failed(p, msg.error)
            case m.Relay():
                self._relay(msg, buffers, now)
            case m.HostDown():
                self._relay_lost(msg.rank, now)     # (nothing else is kept per peer host)
            case m.Shutdown():
                log.info("host %s: controller asked us to exit: %s", self.rank, msg.reason)
                self.alive = False
                self.proc.forget(self)
            case m.Pong() | m.Registered():
                pass
            case m.Error():
                log.warning("host %s: controller reported: %s: %s", self.rank, msg.code, msg.message)
            case _:
                log.warning("host %s: unexpected %s from the controller", self.rank, type(msg).__name__)

    def stats(self) -> tuple[int, int, list[int]]:
        """As ``Store.stats``: shards held, their bytes, bytes per device."""
        per = dict.fromkeys(self.device_ids, 0)
        shards = nbytes = 0
        for k, e in list(self.store._entries.items()):
            if type(k) is not ShardKey or not e.done:
                continue
            v = e.value
            if k.device >= 0:
                shards += 1
                n = getattr(v, "nbytes", 0)
                nbytes += n
                if k.device in per:
                    per[k.device] += n
            elif v is not None:
                shards += len(v.parts)
                nbytes += v.nbytes
                for d, n in v.per_device or v.device_bytes():
                    if d in per:
                        per[d] += n
        if self.group is not None:        # (what its group made, kept once for all its hosts)
            for made in self.group.made.values():
                if self in made.copies:
                    continue
                got = made.placed.get(self.index)
                if got is not None and got.shards:
                    item = _itemsize(made.dtype)
                    shards += len(got.parts)
                    nbytes += got.size * item
                    for d, n in got.parts:
                        if d in per:
                            per[d] += n * item
        return shards, nbytes, [per[d] for d in self.device_ids]

    def when_shard(self, buffer: int, device: int, region: Any,
                   cb: Callable[[Entry], None]) -> Callable[[], bool] | None:
        """Call ``cb(entry)`` once, with the entry that holds shard (buffer,
        device, region) of this host: the shard itself (put) or the host's
        whole part (made here), whichever is done first. Returns None if it
        was called now, else a function that cancels the wait (True if it
        was still waiting)."""
        if self.group is not None:
            self.group.expose(self, buffer)
        keys = (shard_key(buffer, device, region), whole_key(buffer, self.index))
        for k in keys:
            e = self.store._entries.get(k)
            if e is not None and e.done:
                cb(e)
                return None
        state = [True]

        def once(e: Entry) -> None:
            if state[0]:
                cancel()
                cb(e)

        def cancel() -> bool:
            was, state[0] = state[0], False
            for k in keys:
                self.store.forget(k, once)
            waiting = self.proc.wanted.get(buffer)
            if waiting is not None:
                waiting.discard(self)
                if not waiting:
                    del self.proc.wanted[buffer]
            return was

        for k in keys:
            self.store.when_done(k, once)
        # (a group it is in, or joins, keeps what it makes out of the hosts'
        # stores: it puts this host's part there when it makes it, see SimGroup)
        self.proc.wanted.setdefault(buffer, set()).add(self)
        return cancel

    def _cost(self, program: str) -> float:
        return self.costs.get(program, self.proc.default_cost_s)

    def _run_of(self, ex: m.Execute, buffer: Callable[[int], int] = int,
                index: int = -1) -> _Run:
        place = self.proc.placement
        local = self.proc.local(ex).get(self.index, ())
        needs: list = []
        outputs: list = []
        for inp in ex.inputs:
            b = buffer(inp.buffer)
            if inp.shards:
                for s in inp.shards:
                    if not s.pieces:
                        needs.append(shard_key(b, s.device, s.region))
                        continue
                    for p in s.pieces:
                        needs.append(shard_key(b, p.device, p.region) if p.piece_id == 0
                                     else PieceKey(p.piece_id))
                    # the assembled shard is kept (later calls read it in place)
                    outputs.append((shard_key(b, s.device, s.region),
                                    SimValue(sharding.region_shape(sharding.from_wire(s.region)),
                                             inp.aval.dtype)))
            else:          # every shard in place: the host's whole part, or each shard put
                needs.append((b, place(ex, inp, self.index)))
        for o in ex.outputs:
            got = place(ex, o, self.index)
            if got.shards:
                outputs.append((whole_key(buffer(o.buffer), self.index),
                                SimValue((got.size,), o.aval.dtype, 0.0, got.size, got.parts)))
        return _Run(ex.exec_id, frozenset(local), needs, outputs, self._cost(ex.program),
                    ex.hold, index, [])

    def _run_fused(self, msg: m.RunFused, now: float) -> None:
        define = self.fused.get(msg.fused)
        if define is None:
            t = time.time()
            self.out.append(m.ExecDone(msg.exec_id, m.ErrorInfo(
                ErrorKind.FUSED_UNKNOWN, f"fused program {msg.fused} is not defined on this host",
                self.rank, "", ""), t, t))
            self.proc.outgoing.add(self)
            return

        def buffer(code: int) -> int:
            return msg.first_buffer + code if code >= 0 else msg.inputs[-code - 1]

        made: set = set()
        needs: list = []
        outputs: list = []
        devices: set[int] = set()
        cost = 0.0
        for ex in define.executes:
            r = self._run_of(ex, buffer)
            needs += [k for k in r.needs if (k[0] if type(k) is tuple else k) not in made]
            outputs += r.outputs
            made.update(k.buffer if k.device < 0 else k for k, _ in r.outputs)
            devices |= r.devices
            cost += r.cost
        run = _Run(msg.exec_id, frozenset(devices), needs, outputs, cost, msg.hold, -1,
                   [buffer(c) for c in define.release if c >= 0])
        self._submit(run, now)
        if len(run.release) < len(define.release):       # (remembered: one may be a Put)
            self._free_after_earlier([buffer(c) for c in define.release if c < 0], True)

    def _submit(self, run: _Run, now: float) -> None:
        run.arrived = now
        run.index = self.order.arrive()
        for d in run.devices:
            self.queues[d].append(run)
        if run.release:       # a fused run's own outputs: not remembered (Worker._run_fused)
            self._free_after_earlier(run.release, False)
        self._try_start(run, now)

    def _try_start(self, run: _Run, now: float) -> None:
        """Start ``run`` if it is first in the queue of each of its devices and
        its inputs are there. Time is emulated: it starts when its devices
        became free, its inputs were made and its message came, whichever is
        last (an accelerator runs its queue back to back, whenever this loop
        gets to notice), so a late timer delays reports, not the devices."""
        if run.waiting or run.devices & self.busy:
            return
        queues = self.queues
        for d in run.devices:
            q = queues[d]
            if not q or q[0] is not run:
                return
        start = run.arrived
        errors = []
        shards, pieces = self.store._entries, self.proc.pieces._entries     # (read without the lock: one thread)
        for need in run.needs:
            if type(need) is tuple:           # (buffer, placement): in place on this host
                got = self._in_place(need)
                if type(got) is not list:     # the key to wait for
                    run.waiting = True
                    self._wait(run, got)
                    if got.device >= 0:       # put shard by shard, or made whole: either may come
                        self._wait(run, whole_key(need[0], self.index))
                    self._release_held()      # nothing may stay held while it waits
                    return
                entries = got
            else:
                e = (pieces if type(need) is PieceKey else shards).get(need)
                if e is None or not e.done:
                    run.waiting = True
                    self._wait(run, need)
                    self._release_held()
                    return
                entries = (e,)
            for e in entries:
                if e.error is not None:
                    errors.append(e.error)
                elif type(e.value) is SimValue and e.value.made > start:
                    start = e.value.made
        if run.waits:
            self._unwait(run)
        for d in run.devices:
            self.queues[d].popleft()
            start = max(start, self.free_at.get(d, 0.0))
        self.busy |= run.devices
        run.start = start
        if errors:            # a failed input: the outputs carry its error, nothing runs
            run.end = start
            self._finish(run, errors[0], now)
            return
        run.end = start + run.cost
        self.proc.timers.at(run.end, lambda: self._finish(run, None, self.proc.now))

    def _input_came(self, run: _Run) -> None:
        run.waiting = False
        self._try_start(run, self.proc.now)

    def _in_place(self, need: tuple) -> list | ShardKey:
        """The entries of an input in place on this host: its whole part (made
        here), or each of its shards (put); else the key to wait for."""
        b, placed = need
        shards = self.store._entries
        e = shards.get(whole_key(b, self.index))
        if e is not None and e.done:
            return [e]
        got = []
        for d, r in placed.shards:
            key = ShardKey(b, d, r)
            e = shards.get(key)
            if e is None or not e.done:
                return key
            got.append(e)
        return got

    def _wait(self, run: _Run, key: Any) -> None:
        store = self.proc.pieces if type(key) is PieceKey else self.store
        cb = lambda _e, run=run: self._input_came(run)  # noqa: E731
        run.waits.append((store, key, cb))
        store.when_done(key, cb)

    def _unwait(self, run: _Run) -> None:
        """Drop what a run waited for and no longer needs (the other of two keys
        either of which would do), so no entry is left behind."""
        for store, key, cb in run.waits:
            store.forget(key, cb)
        run.waits.clear()

    def _finish(self, run: _Run, error: m.ErrorInfo | None, now: float) -> None:
        if not self.alive:
            return
        for key, value in run.outputs:
            if error is not None:
                self.store.set(key, error=error)
            else:
                value.made = run.end
                self.store.set(key, value)
        for key in run.needs:
            if type(key) is PieceKey:
                self.proc.pieces.pop(key)
        self.busy -= run.devices
        for d in run.devices:
            self.free_at[d] = run.end
        self._free(self.order.finish(run.index))
        wall = time.time() - time.monotonic()
        nxt = None
        tried: list[_Run] = []          # (the heads: usually one, an SPMD run on all the devices)
        for d in run.devices:
            q = self.queues[d]
            if q and (head := q[0]) not in tried:
                tried.append(head)
                self._try_start(head, now)
                if nxt is None and head.devices <= self.busy and not head.waiting:
                    nxt = head
        self._report(m.ExecDone(run.exec_id, error, run.start + wall, run.end + wall), run, nxt, now)

    def _report(self, done: m.ExecDone, run: _Run, nxt: _Run | None, now: float) -> None:
        """Send the report now or hold it, as a real worker's executor does
        (``Executor._report``): when the devices went on at once with ``nxt``,
        a run the controller let hold (``hold``) with DEEP_QUEUE or more queued
        behind it waits up to half their time (at most HOLD_DEEP_S), and a
        short run followed by a short one up to HOLD_SHORT_S, to go with the
        next reports; a report not held takes those held with it."""
        hold = 0.0
        if nxt is not None and done.error is None:
            behind = max(len(self.queues[d]) for d in run.devices) + 1 if run.hold else 0
            hold = hold_for(run.hold, run.cost, behind, nxt.cost)
        if not hold:
            self.out += self.held
            self.held = []
            self.out.append(done)
            self.proc.outgoing.add(self)
            return
        due = now + hold
        if not self.held or due < self.held_due:
            self.held_due = due
            self.proc.timers.at(due, self._release_due)
        self.held.append(done)

    def _release_due(self) -> None:
        if self.held and self.proc.now >= self.held_due - 1e-6:
            self._release_held()

    def _release_held(self) -> None:
        if self.held:
            self.out += self.held
            self.held = []
            self.proc.outgoing.add(self)

    def _free_after_earlier(self, buffers: list[int], remember: bool) -> None:
        self._free(self.order.free_after_earlier(buffers, remember))

    def _free(self, due: list[tuple[list[int], bool]]) -> None:
        for buffers, remember in due:
            self.store.free_buffers(buffers, remember=remember)

    # ---- data port -------------------------------------------------------------
    def put(self, msg: m.Put, buffers: list) -> str | None:
        """A client's shard; returns an error text if it is refused."""
        from_gone = client_of(msg.buffer) in self.gone_clients
        if from_gone or self.store.was_freed(msg.buffer):
            return None
        shape = sharding.region_shape(sharding.from_wire(msg.region))
        if list(shape) != list(msg.aval.shape):
            return f"shard shape {tuple(msg.aval.shape)} does not match region {shape}"
        value = SimValue(shape, msg.aval.dtype)
        if len(buffers) != 1 or memoryview(buffers[0]).nbytes != value.nbytes:
            return f"a Put of {msg.aval.dtype}{list(shape)} needs one buffer of {value.nbytes} bytes"
        self.store.set(shard_key(msg.buffer, msg.device, msg.region), value, unless_freed=msg.buffer)
        return None

    def to_relays(self, now: float) -> None:
        """Reports of computations that came through a relay go to it (the
        relay's rows, if it is a host of this process)."""
        rest: list[Record] = []
        sent: dict[int, tuple[str, list[m.ExecRow]]] = {}
        for msg in self.out:
            dest = self.relay.route(msg.exec_id) if type(msg) is m.ExecDone else None
            if dest is None or msg.error is not None:
                rest.append(msg)           # (a failure goes to the controller as well)
                if dest is None:
                    continue
            row = relays.row_of(self.rank, msg)
            local = self.proc.by_rank.get(dest[0])
            if local is not None and local.alive:
                local.relay.row_in(row, now)
                self.proc.relaying.add(local)
            else:
                sent.setdefault(dest[0], (dest[1], []))[1].append(row)
        for relay, (address, rows) in sent.items():
            self.proc._send_peer(address, m.batch_of(rows, relay), [])
            for row in rows:
                self.relay.sent_row(relay, row, now)
        self.out = rest

    def flush(self) -> None:
        if not self.out or not self.alive:
            return
        out, self.out = self.out, []
        try:
            self.ep.send_batch(self.ctl, [(x, 0, 0) for x in out], block=False)
        except zmq.ZMQError as e:
            log.error("host %s: cannot send %d messages to the controller: %s", self.rank, len(out), e)


def _index(h: SimHost) -> int:
    return h.index


def hold_for(may_hold: bool, cost: float, behind: int, next_cost: float) -> float:
    """How long a report may wait for the next ones, as a real worker's
    executor decides (``Executor._report``), when its devices went on at once
    with a run of ``next_cost`` seconds: a run the controller let hold
    (``may_hold``) with DEEP_QUEUE or more queued behind it (``behind``, itself
    counted) up to half their time (at most HOLD_DEEP_S), and a short run
    followed by a short one up to HOLD_SHORT_S; else 0 (it goes now)."""
    deep = min(HOLD_DEEP_S, behind * cost / 2) if may_hold and behind >= DEEP_QUEUE else 0.0
    if deep >= 2 * HOLD_SHORT_S:
        return deep
    if cost < SHORT_COMPUTATION_S and next_cost < SHORT_COMPUTATION_S:
        return HOLD_SHORT_S
    return 0.0


# messages that make a host of a group leave it (they are for it alone, or
# change its order of computations and frees): see SimGroup
SPLITS = (m.Execute, m.RunFused, m.Free, m.ClientGone, m.FailBuffers, m.HostDown)
# messages a relay forwards that a group handles once for its hosts
GROUPED = (m.Execute, m.Free)


class _Made:
    """A buffer a group's computation made: each host's part is where the
    placement puts it (``placed``: host index -> Placed), made at ``made``;
    ``copies``: the hosts that also hold it in their own store (asked for it
    alone: a Fetch, a SendPiece)."""
    __slots__ = ("made", "dtype", "placed", "copies")

    def __init__(self, made: float, dtype: str, placed: dict[int, "Placed"]) -> None:
        self.made, self.dtype, self.placed = made, dtype, placed
        self.copies: set[SimHost] = set()

    def value(self, host: int) -> "SimValue | None":
        got = self.placed.get(host)
        if got is None or not got.shards:
            return None
        return SimValue((got.size,), self.dtype, self.made, got.size, got.parts)


class _GroupRun:
    """One computation on every host of a group: one record, one timer."""
    __slots__ = ("ex", "hosts", "cost", "index", "arrived", "start", "end", "route", "waiting", "waits")

    def __init__(self, ex: m.Execute, hosts: list[SimHost], cost: float, index: int, arrived: float,
                 route: tuple[int, str] | None) -> None:
        self.ex, self.hosts, self.cost, self.index, self.arrived = ex, hosts, cost, index, arrived
        self.route = route                  # (relay, its data address) the reports go to, or None
        self.start = self.end = 0.0
        self.waiting = False
        self.waits: list[tuple] = []        # (store, key, callback) of what it waits for


class SimGroup:
    """Hosts of this process that run the same computations in the same
    order (a relay forwarded each to all of them, and only to them), kept as
    one record: one queue of runs, one device clock, one order of frees, one
    timer per run, what its runs made (``made``: once, not in each host's
    store) and one block of rows per report. Each host still answers on the
    wire as a lone one would (its Pong, its Fetch, its row of the relay's
    ``ExecDoneBatch``); what it holds alone (a client's Put, a part it was
    asked for: ``expose``) stays in its own store.

    A group forms when a relay's message reaches hosts of this process that
    all have nothing queued, running or held; a message for some of them
    only, or one that changes a host's own order (``SPLITS``), first splits
    that host off: its part of the group's queued and running computations
    becomes its own (``split``). A failed input splits every host, which then
    goes on alone. Every host of a computation starts it at the same time,
    the latest at which any of them could: its message came, its devices
    were free and its inputs made (on a group these are the same for all
    hosts, except when it forms from hosts whose last outputs were made at
    different times)."""

    def __init__(self, proc: "SimProcess", hosts: list[SimHost]) -> None:
        self.proc = proc
        self.members = list(hosts)
        self.queue: collections.deque[_GroupRun] = collections.deque()
        self.running: _GroupRun | None = None
        self.free_at = max((t for h in hosts for t in h.free_at.values()), default=0.0)
        self.order = FreeOrder()
        self.held: list[tuple[_GroupRun, relays.RowBlock]] = []     # reports held (see hold_for)
        self.held_due = 0.0
        # what the group's computations made, once for all its hosts (not in
        # their stores; see expose)
        self.made: dict[int, _Made] = {}
        # (program, devices) -> the cost of an Execute that runs alike on every host
        self.fits: dict[tuple, float] = {}
        for h in hosts:
            h.group = self

    def execute(self, ex: m.Execute, cost: float, route: tuple[int, str] | None, now: float) -> None:
        run = _GroupRun(ex, list(self.members), cost, self.order.arrive(), now, route)
        self.queue.append(run)
        self.proc.group_runs += 1
        self.try_start(now)

    def free(self, buffers: list[int]) -> None:
        """A Free to every host: once the computations before it finished."""
        self._free(self.order.free_after_earlier(buffers, True))

    def _free(self, due: list[tuple[list[int], bool]]) -> None:
        made = self.made
        for buffers, remember in due:
            rest = []
            for b in buffers:
                got = made.pop(b, None)
                if got is None:
                    rest.append(b)         # (a client's Put, or made before the group formed)
                else:
                    for h in got.copies:
                        h.store.free_buffers([b], remember=False)
            if rest:
                for h in self.members:
                    h.store.free_buffers(rest, remember=remember)

    def expose(self, h: SimHost, buffer: int) -> None:
        """Host ``h`` asks for its part of ``buffer`` alone: if the group made
        it, it goes into the host's store now, or once it is made."""
        got = self.made.get(buffer)
        if got is not None:
            if h not in got.copies:
                v = got.value(h.index)
                if v is not None:
                    got.copies.add(h)
                    h.store.set(whole_key(buffer, h.index), v)

    def try_start(self, now: float) -> None:
        """Start the first queued run if its inputs are on every host (as
        ``SimHost._try_start``)."""
        if self.running is not None or not self.queue or self.queue[0].waiting:
            return
        run = self.queue[0]
        start = run.arrived
        ex = run.ex
        for inp in ex.inputs:
            b = inp.buffer
            made = self.made.get(b)
            if made is not None:              # (made here for every host: it was a group then too)
                if made.made > start:
                    start = made.made
                continue
            for h in self.members:
                e = h.store._entries.get(whole_key(b, h.index))      # (one thread: no lock)
                if e is not None and e.done:
                    entries: Any = (e,)
                else:
                    entries = h._in_place((b, self.proc.placement(ex, inp, h.index)))
                    if type(entries) is not list:       # the key to wait for
                        run.waiting = True
                        self._wait(run, h, entries)
                        if entries.device >= 0:
                            self._wait(run, h, whole_key(b, h.index))
                        self.release_held()
                        return
                for e in entries:
                    if e.error is not None:         # each host goes on alone (SimHost._try_start)
                        self.dissolve(now)
                        return
                    v = e.value
                    if type(v) is SimValue and v.made > start:
                        start = v.made
        for store, key, cb in run.waits:
            store.forget(key, cb)
        run.waits.clear()
        self.queue.popleft()
        run.start = start = max(start, self.free_at)
        run.end = start + run.cost
        self.running = run
        self.proc.timers.at(run.end, lambda: self._finish(run))

    def _wait(self, run: _GroupRun, h: SimHost, key: ShardKey) -> None:
        cb = lambda _e, run=run: self._input_came(run)  # noqa: E731
        run.waits.append((h.store, key, cb))
        h.store.when_done(key, cb)

    def _input_came(self, run: _GroupRun) -> None:
        if run.waiting:
            run.waiting = False
            self.try_start(self.proc.now)

    def _finish(self, run: _GroupRun) -> None:
        if self.running is not run:          # (every host split off before it ended)
            return
        now = self.proc.now
        hosts = [h for h in run.hosts if h.group is self and h.alive]
        ex, end = run.ex, run.end
        for o in ex.outputs:
            b = o.buffer
            self.made[b] = _Made(end, o.aval.dtype, self.proc.placements(ex, o))
            waiting = self.proc.wanted.get(b)
            if waiting:          # (hosts that wait for their part alone: SimHost.when_shard)
                for h in list(waiting):
                    if h.group is self and h.alive:
                        self.expose(h, b)
        self.running = None
        self.free_at = end
        self._free(self.order.finish(run.index))
        self.try_start(now)
        wall = time.time() - time.monotonic()
        rows = relays.RowBlock(ex.exec_id, [h.rank for h in hosts], run.start + wall, end + wall)
        nxt = self.running
        hold = 0.0
        if nxt is not None:             # (the devices went on at once)
            hold = hold_for(ex.hold, run.cost, len(self.queue) + 1, nxt.cost)
        if not hold:
            self.release_held()
            self._send(run, rows)
            return
        due = now + hold
        if not self.held or due < self.held_due:
            self.held_due = due
            self.proc.timers.at(due, self._release_due)
        self.held.append((run, rows))

    def _release_due(self) -> None:
        if self.held and self.proc.now >= self.held_due - 1e-6:
            self.release_held()

    def release_held(self) -> None:
        held, self.held = self.held, []
        for run, rows in held:
            self._send(run, rows)

    def _send(self, run: _GroupRun, block: relays.RowBlock) -> None:
        """A run's rows to its relay (the relay's own rows, if it is a host of
        this process), or each host's report to the controller."""
        proc, now = self.proc, self.proc.now
        if not block.hosts:
            return
        if run.route is None:
            for rank in block.hosts:
                h = proc.by_rank[rank]
                h.out.append(m.ExecDone(block.exec_id, None, block.start, block.end))
                proc.outgoing.add(h)
            return
        relay, address = run.route
        local = proc.by_rank.get(relay)
        if local is not None and local.alive:
            local.relay.rows_in(block, now)
            proc.relaying.add(local)
            return
        proc._send_peer(address, relays.batch_of([block], relay), [])
        for rank in block.hosts:           # (kept in case that relay is lost before it passes them on)
            proc.by_rank[rank].relay.sent_row(relay, m.ExecRow(rank, block.exec_id, None, block.start,
                                                               block.end), now)

    def split(self, h: SimHost, now: float) -> None:
        """Host ``h`` goes on alone: its part of the group's queued and
        running computations becomes its own, in the same order."""
        self.release_held()
        self.members.remove(h)
        h.group = None
        running, queued = self.running, list(self.queue)
        made = list(self.made.items())
        if not self.members:              # (nothing left to run as a group)
            self.queue.clear()
            self.running = None
            self.made = {}
        if not h.alive:
            return
        for b, got in made:               # what it holds goes into its own store
            if h in got.copies:
                got.copies.discard(h)      # (its own now: freed by its own order)
            else:
                v = got.value(h.index)
                if v is not None:
                    h.store.set(whole_key(b, h.index), v)
        h.order = copy.deepcopy(self.order)
        for d in h.device_ids:
            h.free_at[d] = max(h.free_at.get(d, 0.0), self.free_at)
        for run in ([running] if running is not None else []) + queued:
            r = h._run_of(run.ex)
            r.index, r.arrived, r.cost = run.index, run.arrived, run.cost
            if run.route is not None:
                h.relay.report_to[run.ex.exec_id] = run.route
            if run is running:
                r.start, r.end = run.start, run.end
                h.busy |= r.devices
                h.proc.timers.at(r.end, lambda r=r: h._finish(r, None, h.proc.now))
            else:
                for d in r.devices:
                    h.queues[d].append(r)
        if not h.busy:
            heads = {id(q[0]): q[0] for q in h.queues.values() if q}
            for r in heads.values():
                h._try_start(r, now)

    def dissolve(self, now: float) -> None:
        """Every host goes on alone."""
        for h in list(self.members):
            self.split(h, now)


class SimProcess:
    """The hosts of one process and the loop that serves them."""

    def __init__(self, key: bytes, controller: str, hosts: int, devices: int, *,
                 islands: int = 1, island: int = 0, cost_ms: float = 1.0, name: str | None = None,
                 bind_host: str = "127.0.0.1", transfer_us: float = 0.0, transfer_gbps: float = 0.0,
                 move_bytes: bool = False, controller_timeout_s: float = 60.0,
                 worker_key: bytes | None = None, groups: bool = True) -> None:
        if hosts < 1 or devices < 1 or islands < 1 or hosts % islands:
            raise ZpathError(f"--hosts ({hosts}) must be a positive multiple of --islands ({islands}), "
                             f"--devices ({devices}) positive")
        if transfer_us < 0 or transfer_gbps < 0 or cost_ms < 0:
            raise ZpathError("--cost-ms, --transfer-us and --transfer-gbps must be >= 0")
        self.key, self.controller, self.devices = key, controller, devices
        self.keys = Keys(key, worker_key if worker_key is not None else key)
        self.name = name or f"sim-{socket.gethostname()}-{os.getpid()}"
        self.machine = f"sim:{socket.gethostname()}:{os.getpid()}"
        self.default_cost_s = cost_ms / 1000
        self._program_costs: dict[str, tuple[bytes, float]] = {}     # digest -> (its bytes, their cost)
        self.transfer_s, self.transfer_gbps, self.move_bytes = transfer_us / 1e6, transfer_gbps, move_bytes
        self.controller_timeout_s = controller_timeout_s
        self.groups = groups          # hosts that run the same computations as one record (SimGroup)
        self.group_runs = 0           # computations run so (once for several hosts)
        self.ctx = make_context()
        self.ep = Endpoint(self.keys.workers, f"worker:{self.name}", keys=self.keys.of)
        self.data = self.ctx.socket(zmq.ROUTER)
        port = self.data.bind_to_random_port(f"tcp://{bind_host}")
        self.data_address = f"tcp://{bind_host}:{port}"
        self.timers = Timers()
        # where a computation's shards are, per host: by device list and
        # shape, and by the decoded message (hosts of one process share it)
        self._local_of: dict[tuple, dict[int, list[int]]] = {}
        self._placement: dict[tuple, dict[int, list]] = {}
        self._local: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._placed: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        # a number per distinct device list (a 2,048-entry tuple costs microseconds
        # to hash at each lookup): by value, and by the list object (decoded runs
        # are one list for many messages); numbers are never reused
        self._device_lists: dict[tuple, int] = {}
        self._device_list_of: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._device_list_numbers = itertools.count()
        self.now = time.monotonic()
        per = hosts // islands
        self.hosts: list[SimHost] = []
        for i in range(hosts):
            isl = island + i // per
            self.hosts.append(SimHost(self, i, isl, i % per, per, f"sim://{self.name}/island{isl}"))
        self.by_sock: dict[zmq.Socket, SimHost] = {h.ctl: h for h in self.hosts}
        self.by_rank: dict[int, SimHost] = {}
        self.by_device: dict[int, SimHost] = {}
        # pieces on their way to a host of this process (piece ids are the
        # controller's, unique in the cluster), until the computation that reads
        # them has run
        self.pieces = Store()
        # hosts with something due in their RelayState (rows to pass on, messages held)
        self.relaying: set[SimHost] = set()
        # hosts with messages in ``out`` (sent at the next flush)
        self.outgoing: set[SimHost] = set()
        self.peer_socks: dict[str, zmq.Socket] = {}
        # the loop waits on the sockets' ZMQ_FDs with epoll (a zmq poll over N
        # sockets costs ~1.5 us per socket per turn: 0.8 ms at 512 hosts)
        self.selector: selectors.BaseSelector | None = None
        self._fd_of: dict[zmq.Socket, int] = {}
        self._check: set[zmq.Socket] = set()      # sockets whose ZMQ_EVENTS the next turn reads
        self._draining: set[SimHost] = set()       # hosts whose control socket is being read
        # buffer -> hosts that wait for their part of it alone (SimHost.when_shard)
        self.wanted: dict[int, set[SimHost]] = {}
        self._decoded: collections.OrderedDict[bytes, tuple] = collections.OrderedDict()
        self.heard = time.monotonic()
        self.running = True

    # ---- start-up ------------------------------------------------------------
    def register(self, timeout_s: float = REGISTER_TIMEOUT_S) -> None:
        msgs = {h: h.register_message(self.devices) for h in self.hosts}
        for h, msg in msgs.items():
            h.ep.send(h.ctl, msg)
        waiting = set(self.hosts)
        poller = zmq.Poller()
        for h in self.hosts:
            poller.register(h.ctl, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        next_try = time.monotonic() + 2.0
        while waiting and self.running:
            now = time.monotonic()
            if now > deadline:
                raise ZpathError(f"{len(waiting)} of {len(self.hosts)} simulated hosts got no answer "
                                 f"from the controller within {timeout_s:.0f}s")
            if now > next_try:           # the controller may have started after us
                for h in waiting:
                    h.ep.send(h.ctl, msgs[h])
                next_try = now + 2.0
            for sock, _ in poller.poll(500):
                h = self.by_sock[sock]
                try:
                    _, header, got, buffers = h.ep.recv(sock, block=False)
                except (zmq.Again, BadMessage):
                    continue
                for _, reply, bufs in unbatched(header, got, buffers):
                    if isinstance(reply, m.Registered) and h in waiting:
                        h.registered(reply)
                        waiting.discard(h)
                    elif isinstance(reply, m.Error) and h in waiting:
                        raise ZpathError(f"controller refused simulated host {h.name}: {reply.message}")
                    elif h not in waiting:
                        # already registered: handled once serving (an Error here answers its
                        # registration sent again while the controller was slow to answer the first)
                        h.early.append((reply, bufs))
        if waiting:
            raise ZpathError("stopped while registering")
        for h in self.hosts:
            self.by_rank[h.rank] = h
            for d in h.device_ids:
                self.by_device[d] = h
        log.info("%d simulated hosts registered (ranks %d..%d), %d devices each", len(self.hosts),
                 min(self.by_rank), max(self.by_rank), self.devices)

    def program_cost(self, digest: str, blob: bytes) -> float:
        """``program_cost_s`` of a program's bytes, worked out once for the
        process's hosts (each host gets the program, the same bytes)."""
        hit = self._program_costs.get(digest)
        if hit is None or hit[0] != blob:
            hit = (blob, program_cost_s(blob, self.default_cost_s))
            self._remember(self._program_costs, digest, hit)
        return hit[1]

    def local(self, ex: m.Execute) -> dict[int, list[int]]:
        """Host index -> its devices among those of ``ex`` (remembered: every
        host of a computation asks, with the same decoded message)."""
        hit = self._local.get(id(ex))
        if hit is not None and hit[0] is ex:
            return hit[1]
        key = self.devices_key(ex.devices)
        got = self._local_of.get(key)
        if got is None:
            got = {}
            for d in ex.devices:
                h = self.by_device.get(d)
                if h is not None:
                    got.setdefault(h.index, []).append(d)
            self._remember(self._local_of, key, got)
        self._local[id(ex)] = (ex, got)
        if len(self._local) > 64:
            self._local.popitem(last=False)
        return got

    def placement(self, ex: m.Execute, value: Any, host: int) -> "Placed":
        """The shards of an input or output of ``ex`` on host ``host``'s devices,
        each where the spec puts it."""
        return self.placements(ex, value).get(host, NOWHERE)

    def placements(self, ex: m.Execute, value: Any) -> dict[int, "Placed"]:
        """Host index -> the shards of an input or output of ``ex`` on that
        host's devices (hosts with none are left out)."""
        hit = self._placed.get(id(value))
        if hit is not None and hit[0] is value and hit[1] is ex:
            return hit[2]
        spec = tuple(a if a is None or type(a) is str else tuple(a) for a in value.spec)
        key = (self.devices_key(ex.devices), tuple(value.aval.shape), tuple(ex.mesh_shape), tuple(ex.axis_names),
               spec)
        got = self._placement.get(key)
        self._placed[id(value)] = (value, ex, got)
        if len(self._placed) > 256:
            self._placed.popitem(last=False)
        if got is None:
            regs = sharding.regions_of(value.aval.shape, ex.mesh_shape, ex.axis_names, value.spec)
            shards: dict[int, list[tuple[int, tuple]]] = {}
            for p, d in enumerate(ex.devices):
                h = self.by_device.get(d)
                if h is not None:
                    shards.setdefault(h.index, []).append((d, regs[p]))
            got = {}
            for index, mine in shards.items():
                parts = tuple((d, math.prod(sharding.region_shape(r))) for d, r in mine)
                got[index] = Placed(mine, sum(n for _, n in parts), parts)
            self._remember(self._placement, key, got)
            self._placed[id(value)] = (value, ex, got)
        return got

    def devices_key(self, devices: list[int]) -> int:
        """The number of a device list (equal lists, equal numbers)."""
        hit = self._device_list_of.get(id(devices))
        if hit is not None and hit[0] is devices:
            return hit[1]
        t = tuple(devices)
        n = self._device_lists.get(t)
        if n is None:
            n = next(self._device_list_numbers)
            self._remember(self._device_lists, t, n)
        self._device_list_of[id(devices)] = (devices, n)
        if len(self._device_list_of) > 256:
            self._device_list_of.popitem(last=False)
        return n

    @staticmethod
    def _remember(cache: dict, key: Any, value: Any) -> None:
        if len(cache) >= 4096:
            cache.clear()
        cache[key] = value

    def forget(self, host: SimHost) -> None:
        if host.ctl in self.by_sock:
            fd = self._fd_of.pop(host.ctl, None)
            if fd is not None and self.selector is not None:
                self.selector.unregister(fd)
            self._check.discard(host.ctl)
            del self.by_sock[host.ctl]
        if not self.by_sock:
            self.running = False

    # ---- transfers -----------------------------------------------------------
    def transfer_time(self, nbytes: int) -> float:
        t = self.transfer_s
        if self.transfer_gbps > 0:
            t += nbytes * 8 / (self.transfer_gbps * 1e9)
        return t

    def send_piece(self, src: SimHost, msg: m.SendPiece) -> None:
        src.when_shard(msg.buffer, msg.device, msg.region, lambda e: self._piece_ready(src, msg, e))

    def _piece_ready(self, src: SimHost, msg: m.SendPiece, e: Entry) -> None:
        value = None
        made = self.now
        if e.error is None:
            made = max(getattr(e.value, "made", 0.0), made - 1.0)
            value = SimValue(sharding.region_shape(sharding.from_wire(msg.sub)),
                             getattr(e.value, "dtype", "uint8"))
        nbytes = value.nbytes if value is not None else 0
        arrives = made + self.transfer_time(nbytes)
        if value is not None:
            value.made = arrives
        dst = self.by_rank.get(msg.dst_host)
        if dst is not None and dst.alive:
            self.timers.at(arrives, lambda: self.pieces.set(PieceKey(msg.piece_id), value, e.error))
            return
        # another process's host: over its data port
        aval = m.Aval(list(value.shape), value.dtype) if value is not None else m.Aval([], "")
        buffers = [] if value is None else [bytes(nbytes) if self.move_bytes else b""]
        self.timers.at(arrives, lambda: self._send_peer(
            msg.dst_address, m.Piece(msg.piece_id, aval, e.error), buffers))

    def _send_peer(self, address: str, msg: Record, buffers: list) -> None:
        s = self.peer_socks.get(address)
        if s is None:
            s = self.peer_socks[address] = self.ctx.socket(zmq.DEALER)
            s.connect(address)
        try:
            self.ep.send(s, msg, buffers=buffers, block=False)
        except zmq.ZMQError as err:
            log.error("cannot send %s to %s: %s", type(msg).__name__, address, err)

    def forwarded_message(self, relay: int, frames: list) -> tuple[Record, list] | None:
        """The controller's message in the frames relay ``relay`` forwarded,
        checked and decoded (once for all the process's hosts it reaches), or
        None if it is refused."""
        try:
            header, msg, buffers = self._decode(frames)
        except ProtocolError as e:
            log.warning("rejected a message relay %d forwarded: %s", relay, e)
            return None
        if header.signer != codec.CLUSTER or type(msg) is m.Batch:
            log.warning("rejected a %s relay %d forwarded", type(msg).__name__, relay)
            return None
        return msg, buffers

    def forwarded(self, fwd: m.Forwarded, frames: list) -> None:
        """A relay forwarded a message to hosts of this process."""
        got = self.forwarded_message(fwd.relay, frames)
        if got is None:
            return
        self.deliver(fwd.relay, fwd.address, fwd.hosts, fwd.after, fwd.collect, *got)

    def deliver(self, relay: int, address: str, hosts: list[int], afters: list[int], collect: list[int],
                msg: Record, buffers: list) -> None:
        """The message relay ``relay`` forwarded to ``hosts`` of this process
        (each after its ``afters``-th direct message), decoded: to their group
        once where it can be (``to_group``), else to each host."""
        now = self.now
        if self.groups and type(msg) in GROUPED and len(hosts) > 1 and \
                self.to_group(relay, address, hosts, afters, collect, msg, now):
            return
        by_rank = self.by_rank
        for host, after in zip(hosts, afters, strict=True):
            h = by_rank.get(host)
            if h is not None and h.alive:
                h.forwarded(relay, address, after, collect, msg, buffers, now)

    def _fits(self, ex: m.Execute, hs: list[SimHost]) -> tuple[float, bool] | None:
        """The cost of ``ex`` if it runs alike on each of ``hs`` (on all of each
        host's devices, at the same cost), and whether every host has its
        program (so the cost is for good); None if not."""
        local = self.local(ex)
        program = ex.program
        cost = hs[0]._cost(program)
        known = True
        for h in hs:
            if len(local.get(h.index, ())) != len(h.device_ids) or h._cost(program) != cost:
                return None
            known = known and program in h.costs
        return cost, known

    def to_group(self, relay: int, address: str, hosts: list[int], afters: list[int], collect: list[int],
                 msg: Record, now: float) -> bool:
        """Hand an ``Execute`` or ``Free`` to the group of exactly these hosts
        (formed now if they are all idle) if it is every host's turn for it and
        each would handle it alike; False (nothing done) if not."""
        for host, after in zip(hosts, afters, strict=True):
            h = self.by_rank.get(host)
            if h is not None and h.alive and after > h.relay.received and h not in self._draining:
                # the direct messages it comes after were sent first: most likely
                # they wait on the host's socket (read the relay's first)
                self._drain_ctl(h)
                if h.alive:
                    self._check.add(h.ctl)
        hs: list[SimHost] = []
        turns: list[int] = []
        by_rank = self.by_rank
        for host, after in zip(hosts, afters, strict=True):
            h = by_rank.get(host)
            if h is None or not h.alive:
                continue
            rs = h.relay
            if rs.waiting or rs.blocked is not None or after > rs.received or relay in rs.lost_relays:
                return False
            hs.append(h)
            turns.append(after)
        if len(hs) < 2:
            return False
        g = hs[0].group
        same = g is not None and len(g.members) == len(hs) and all(h.group is g for h in hs)
        cost = 0.0
        if type(msg) is m.Execute:
            if any(inp.shards for inp in msg.inputs):        # pieces to assemble: per host
                return False
            key = (msg.program, self.devices_key(msg.devices))
            got = g.fits.get(key) if same else None
            if got is None:
                fit = self._fits(msg, hs)
                if fit is None:
                    return False
                got = fit[0]
                if same and fit[1]:
                    g.fits[key] = got
            cost = got
        if not same:
            for h in hs:
                if h.group is not None:
                    h.group.split(h, now)
            if not all(h.idle() for h in hs):
                return False
            g = SimGroup(self, hs)
        for h, after in zip(hs, turns, strict=True):
            h.relay.take_in_turn(relay, after)          # (its turn: checked above)
        if type(msg) is m.Execute:
            g.execute(msg, cost, (relay, address) if msg.exec_id in collect else None, now)
        else:
            g.free(msg.buffers)
        return True

    def _relay_due(self) -> float | None:
        """Relays pass on the rows due; what waited past its time goes on.
        Returns seconds until the next is due."""
        due = None
        for h in list(self.relaying):
            if h.alive:
                for item, bufs in h.relay.expire(self.now):
                    h.handle_ctl(item, bufs, self.now)
                rows = h.relay.take_rows(self.now)
                if rows:
                    h.out.append(relays.batch_of(rows))
                    self.outgoing.add(h)
                d = h.relay.next_due_in(self.now)
            else:
                d = None
            if d is None:
                self.relaying.discard(h)
            else:
                due = d if due is None else min(due, d)
        return due

    def piece_failed(self, piece_id: int, error: m.ErrorInfo) -> None:
        self.pieces.set(PieceKey(piece_id), error=error)

    # ---- loop ----------------------------------------------------------------
    def serve_forever(self) -> None:
        sel = self.selector = selectors.DefaultSelector()
        for sock in [*self.by_sock, self.data]:
            fd = self._fd_of[sock] = sock.getsockopt(zmq.FD)
            sel.register(fd, selectors.EVENT_READ, sock)
        check = self._check
        check.update(self._fd_of)            # (what came before the loop started)
        self.heard = time.monotonic()
        for h in self.hosts:
            for msg, bufs in h.early:
                h.from_controller(msg, bufs, time.monotonic())
            h.early.clear()
        while self.running:
            self.now = time.monotonic()
            self.timers.run_due(self.now)
            self._flush()
            wait = self.timers.next_in(time.monotonic())
            if self.relaying:
                due = self._relay_due()
                self._flush()
                if due is not None:
                    wait = due if wait is None else min(wait, due)
            # A ZMQ_FD only says that the socket's events may have changed (a
            # recv or send may take that word with it): a socket is readable if
            # its ZMQ_EVENTS says so, read for every socket the FD woke, drained
            # or sent on since the last turn.
            check.add(self.data)          # (answers may have gone from timers)
            ready = [sock for sock in check if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN]
            check.clear()
            timeout = 0.0 if ready else 0.5 if wait is None else min(0.5, wait)
            for key, _ in sel.select(timeout):
                sock = key.data
                if sock not in ready and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    ready.append(sock)
            self.now = time.monotonic()
            for sock in ready:
                if sock is self.data:
                    self._drain_data()
                    check.add(sock)
                else:
                    h = self.by_sock.get(sock)
                    if h is not None:
                        self._drain_ctl(h)
                        self.heard = self.now
                        if h.alive:
                            check.add(sock)
            if self.now - self.heard > self.controller_timeout_s:
                log.error("no word from the controller for %.0fs: exiting", self.controller_timeout_s)
                self.running = False
        self._flush()
        self.close()

    def _flush(self) -> None:
        """Send what the hosts with something to send have (``outgoing``):
        reports through relays to them first, then each host's messages."""
        now = self.now
        outgoing = self.outgoing
        for h in list(outgoing):
            if h.out and h.relay.report_to:
                h.to_relays(now)
        if self.relaying:
            for h in list(self.relaying):
                rows = h.relay.take_rows(now)
                if rows:
                    h.out.append(relays.batch_of(rows))
                    outgoing.add(h)
        if outgoing:
            self.outgoing = set()
            for h in sorted(outgoing, key=_index):
                if h.out and h.alive:
                    h.flush()
                    self._check.add(h.ctl)

    def _decode(self, frames: list) -> tuple:
        """Check and decode a control message, once per distinct message: the
        same frames reaching several hosts are decoded for the first only."""
        if len(frames) == 3:
            sig = frames[0]
            hit = self._decoded.get(sig)
            if hit is not None and hit[0] == frames[1] and hit[1] == frames[2]:
                return hit[2]
        got = codec.decode(self.keys.of, frames)
        if len(frames) == 3:
            self._decoded[frames[0]] = (frames[1], frames[2], got)
            if len(self._decoded) > DECODE_CACHE:
                self._decoded.popitem(last=False)
        return got

    def _drain_ctl(self, h: SimHost) -> None:
        self._draining.add(h)
        try:
            self._drain_ctl_of(h)
        finally:
            self._draining.discard(h)

    def _drain_ctl_of(self, h: SimHost) -> None:
        sock = h.ctl
        for _ in range(1000):
            if not h.alive:
                return
            try:
                _, frames = h.ep.recv_frames(sock, block=False)
                header, msg, buffers = self._decode(frames)
            except zmq.Again:
                return
            except ProtocolError as e:
                log.warning("host %s: rejected message on the control socket: %s", h.rank, e)
                continue
            self.now = time.monotonic()        # (a message arrives when it is read)
            for _, item, bufs in unbatched(header, msg, buffers):
                if isinstance(item, ProtocolError):
                    log.warning("host %s: rejected message on the control socket: %s", h.rank, item)
                    continue
                try:
                    h.from_controller(item, bufs, self.now)
                except Exception:
                    log.exception("host %s: error handling %s", h.rank, type(item).__name__)

    def _drain_data(self) -> None:
        for _ in range(1000):
            try:
                ident, header, msg, buffers = self.ep.recv(self.data, router=True, block=False)
            except zmq.Again:
                return
            except BadMessage as e:
                log.warning("rejected message on the data port: %s", e)
                if e.ident is not None:
                    self.ep.send(self.data, m.Error(ErrorKind.PROTOCOL, str(e)), to=e.ident,
                                 parent=e.header.msg_id if e.header else 0, block=False)
                continue
            # replies are signed with the key the asker signed with (a client's session key)
            sign = (self.keys.of(header.signer) or self.keys.workers, header.signer)
            for h_, item, bufs in unbatched(header, msg, buffers):
                why = refused_on_data(header.signer, item) if not isinstance(item, ProtocolError) else ""
                if why:
                    self.ep.send(self.data, m.Error(ErrorKind.BAD_REQUEST, why), to=ident, parent=h_.msg_id,
                                 block=False, sign=sign)
                    continue
                try:
                    self._handle_data(ident, h_.msg_id, item, bufs, sign)
                except zmq.ZMQError as err:
                    log.error("cannot answer %s: %s", type(item).__name__, err)

    def _handle_data(self, ident: bytes, msg_id: int, msg: Any, buffers: list,
                     sign: tuple[bytes, int] | None = None) -> None:
        def error(kind: str, text: str) -> None:
            self.ep.send(self.data, m.Error(kind, text), to=ident, parent=msg_id, block=False, sign=sign)

        match msg:
            case ProtocolError():
                error(ErrorKind.PROTOCOL, str(msg))
            case m.Put():
                h = self.by_device.get(msg.device)
                if h is None or not h.alive:
                    error(ErrorKind.BAD_REQUEST, f"device {msg.device} is not on a host of this process")
                    return
                text = h.put(msg, buffers)
                if text is not None:
                    error(ErrorKind.BAD_REQUEST, text)
                    h.store.set(shard_key(msg.buffer, msg.device, msg.region), error=m.ErrorInfo(
                        ErrorKind.REMOTE_ERROR, f"bad Put: {text}", h.rank, "", ""))
            case m.Piece():
                value = None if msg.error is not None else SimValue(tuple(msg.aval.shape), msg.aval.dtype)
                self.pieces.set(PieceKey(msg.piece_id), value, msg.error)
            case m.Forwarded():
                why = relays.check_relay(msg, buffers)
                if why:
                    error(ErrorKind.BAD_REQUEST, why)
                    return
                self.forwarded(msg, [bytes(b) for b in buffers])
            case m.ExecDoneBatch():
                h = self.by_rank.get(msg.relay)
                if h is None or not h.alive:
                    error(ErrorKind.BAD_REQUEST, f"host {msg.relay} is not a host of this process")
                    return
                try:
                    rows = m.rows_of(msg)
                except ValueError as e:
                    error(ErrorKind.BAD_REQUEST, str(e))
                    return
                for row in rows:
                    h.relay.row_in(row, self.now)
                self.relaying.add(h)
            case m.Pieces():
                for pid, aval in zip(msg.piece_ids, msg.avals, strict=True):
                    self.pieces.set(PieceKey(pid), SimValue(tuple(aval.shape), aval.dtype), None)
            case m.Fetch():
                h = self.by_device.get(msg.device)
                if h is None:
                    error(ErrorKind.BAD_REQUEST, f"device {msg.device} is not on a host of this process")
                    return
                deadline = self.now + max(0.0, min(msg.timeout_s, 3600.0))
                shape = sharding.region_shape(sharding.from_wire(msg.region))

                def reply(e: Entry) -> None:
                    if e.error is not None or msg.wait_only:
                        self.ep.send(self.data, m.FetchReply(msg.request, m.Aval([], ""), e.error),
                                     to=ident, block=False, sign=sign)
                        return
                    dtype = e.value.dtype
                    self.ep.send(self.data, m.FetchReply(msg.request, m.Aval(list(shape), dtype), None),
                                 to=ident, buffers=[bytes(math.prod(shape) * _itemsize(dtype))], block=False,
                                 sign=sign)

                def expire() -> None:
                    self.ep.send(self.data, m.FetchReply(msg.request, m.Aval([], ""), m.ErrorInfo(
                        ErrorKind.DEADLINE_EXCEEDED, f"buffer {msg.buffer} was not ready within "
                        f"{msg.timeout_s:.0f}s", h.rank, "", "")), to=ident, block=False, sign=sign)

                cancel = h.when_shard(msg.buffer, msg.device, msg.region, reply)
                if cancel is not None:
                    self.timers.at(deadline, lambda: cancel() and expire())
            case m.ChannelStatsRequest():
                self.ep.send(self.data, m.ChannelStats(0, 0, 0, 0, 0, 0, 0, 0, 0, [], []), to=ident,
                             parent=msg_id, block=False, sign=sign)
            case _:
                error(ErrorKind.BAD_REQUEST, f"{type(msg).__name__} is not accepted on a simulated "
                      "host's data port")

    def stop(self, *_: Any) -> None:
        self.running = False

    def close(self) -> None:
        if self.selector is not None:
            self.selector.close()
        for h in self.hosts:
            h.ctl.close(0)
        for s in [self.data, *self.peer_socks.values()]:
            s.close(0)
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zpath worker --simulate",
                                description="Run simulated zpath hosts (no JAX) for scale work.")
    p.add_argument("--simulate", action="store_true", required=True, help=argparse.SUPPRESS)
    p.add_argument("--controller", required=True, help="controller address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--hosts", type=int, default=1, help="simulated hosts in this process (default 1)")
    p.add_argument("--devices", type=int, default=4, help="devices per host (default 4)")
    p.add_argument("--islands", type=int, default=1,
                   help="split the hosts evenly into this many islands (default 1)")
    p.add_argument("--island", type=int, default=0, help="number of the first island (default 0)")
    p.add_argument("--cost-ms", type=float, default=1.0,
                   help="device time of a computation whose program declares none (default 1 ms)")
    p.add_argument("--transfer-us", type=float, default=0.0, help="emulated latency of every piece")
    p.add_argument("--transfer-gbps", type=float, default=0.0,
                   help="emulated bandwidth of every piece in Gbit/s (0: no limit)")
    p.add_argument("--move-bytes", action="store_true",
                   help="pieces to other processes carry their declared bytes (zeros)")
    p.add_argument("--bind-host", default="127.0.0.1", help="address of the data port")
    p.add_argument("--name", help="prefix of the host names (default sim-<hostname>-<pid>)")
    args = p.parse_args(argv)
    die_with_parent()
    try:
        config, common = WorkerConfig.from_env(), CommonConfig.from_env()
    except ZpathError as e:
        print(f"zpath worker: {e}", file=sys.stderr, flush=True)
        return 2
    logs.setup("sim", common.log_level)
    try:
        key = key_from_config(common)
        proc = SimProcess(key, args.controller, args.hosts, args.devices,
                          islands=args.islands, island=args.island, cost_ms=args.cost_ms, name=args.name,
                          bind_host=args.bind_host, transfer_us=args.transfer_us,
                          transfer_gbps=args.transfer_gbps, move_bytes=args.move_bytes,
                          controller_timeout_s=config.controller_timeout_s,
                          worker_key=worker_key_from_config(common, key))
    except ZpathError as e:
        p.error(str(e))
    signal.signal(signal.SIGTERM, proc.stop)
    signal.signal(signal.SIGINT, proc.stop)
    try:
        proc.register()
    except ZpathError as e:
        log.error("%s", e)
        proc.close()
        return 1
    print(f"zpath simulated hosts registered: {len(proc.hosts)}", flush=True)
    # what start-up left (every host's records and sockets) stays out of the
    # collector's full passes, as in a worker's process: at 512 hosts a full
    # pass over it took 60-200 ms, during which no emulated device finished
    gc.collect()
    gc.freeze()
    proc.serve_forever()
    return 0
