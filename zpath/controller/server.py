"""The controller process: one ROUTER socket that clients and workers connect
to, and a loop that hands each message (with the time it arrived) to the
controller core and sends what the core decides (see core.py)."""
from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import os
import signal
import sys
import time
from typing import Any

import zmq

from zpath import logs
from zpath.config import POLICIES, CommonConfig, ControllerConfig
from zpath.controller.core import ControllerCore, Effect, RemoveSegments, Send
from zpath.controller.relays import Inner
from zpath.controller.scheduler import GangScheduler
from zpath.errors import ProtocolError, ZpathError
from zpath.keys import Keys, key_from_config, worker_key_from_config
from zpath.net import channels, codec
from zpath.net import messages as m
from zpath.net.transport import BadMessage, Endpoint, make_context, readable, unbatched
from zpath.process import die_with_parent

log = logging.getLogger(__name__)

STALL_S = 1.0            # the loop held up longer than this: not the peers' silence
# the largest frame the controller accepts (ZeroMQ MAXMSGSIZE): a program (at
# most MAX_PROGRAM_BYTES) or a body (at most codec.MAX_BODY_BYTES)
MAX_FRAME_BYTES = 272 << 20

# after these, what handling them sends goes out before the next item of a batch
_FLUSH_AFTER = (m.Program, m.RunProgram, m.DefineProgram)
# Calls whose work is sent together while more are waiting (see _recv_all):
# at most this many, and the first held at most this long (wall seconds of
# handling what came after it)
COALESCE_CALLS = 8
COALESCE_S = 0.0005

# The collector's full passes visit every object the controller keeps: ~50-130
# ms while a 10,000-node program is planned (what it collects then: nothing).
# The controller's process (main) leaves them to the loop, which runs one when
# it is idle (its poll timed out, no computation in flight) after FULL_GC_AFTER
# young-generation passes; CPython runs one itself only after FULL_GC_FORCED
# of them (~7M objects made in a loop that is never idle).
FULL_GC_AFTER = 10            # CPython's own default threshold
FULL_GC_FORCED = 1000


class Controller:
    """The socket loop around a ``ControllerCore``: receive, hand to the core,
    send its output without ever blocking."""

    def __init__(self, key: bytes, bind: str = "tcp://127.0.0.1:0",
                 config: ControllerConfig | None = None, gang: GangScheduler | None = None,
                 common: CommonConfig | None = None, worker_key: bytes | None = None) -> None:
        """``key``: the cluster key (clients'); ``worker_key``: the worker key
        (default: the cluster key, which keeps no client apart)."""
        self.config = config if config is not None else ControllerConfig()
        self.common = common if common is not None else CommonConfig()
        self.keys = Keys(key, worker_key if worker_key is not None else key)
        self.ep = Endpoint(self.keys.workers, "controller")
        self.ctx = make_context(min(MAX_FRAME_BYTES, self.common.max_message_bytes))
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if bind.rsplit(":", 1)[-1] in ("0", "*"):
            port = self.sock.bind_to_random_port(bind.rsplit(":", 1)[0])
            self.address = f"{bind.rsplit(':', 1)[0]}:{port}"
        else:
            self.sock.bind(bind)
            self.address = bind
        # lost hosts on this machine: their segments go
        self.core = ControllerCore(self.config, machine=channels.machine_id(self.common.machine_id),
                                   gang=gang, keys=self.keys)
        self.core.wall_offset = time.time() - time.monotonic()     # its events in wall time
        self.running = True
        # messages held while one received message is handled (see _emit):
        # (message, parent, msg_id, body) per peer; a message object sent to
        # several peers is one item (one body, one msg_id) in each of their lists
        self._out: dict[bytes, list[tuple]] = {}
        self._items: dict[int, tuple] = {}      # id(message) -> its item, until the flush
        self._inner: dict[int, tuple] = {}      # id(message) -> (it, its frames) that Relays carry
        self._unreachable: dict[int, str] = {}  # hosts a message was dropped to -> what (see _dropped)

    # ---- sending -------------------------------------------------------------
    def _emit(self, effects: list[Effect]) -> None:
        """Carry out what the core decided. Messages without buffers are held
        and go out at the next ``_flush_out``, one Batch per peer in order: a
        program's nodes reach a host as one message, and an ExecDone's frees
        and next Execute as one. A message with buffers goes at once (after
        what is held for its peer). Sending never blocks the controller: a
        peer that has stopped reading (its queue is full) or is gone loses the
        message, with a log line."""
        for e in effects:
            if isinstance(e, RemoveSegments):
                n = channels.cleanup(channels.shm_prefix(self.ep.key), e.pid, shm_dir=self.common.shm_dir)
                if n:
                    log.info("removed %d shared-memory segments of lost host %d", n, e.rank)
                continue
            if not e.buffers:
                item = self._items.get(id(e.msg))
                if item is None or item[1] != e.parent:
                    try:       # encoded now, so a message that cannot be fails here, alone
                        item = (e.msg, e.parent, self.ep.next_id(), codec.pack_body(e.msg))
                    except Exception:
                        log.exception("cannot encode %s for %r", type(e.msg).__name__, e.ident)
                        continue
                    self._items[id(e.msg)] = item
                self._out.setdefault(e.ident, []).append(item)
                continue
            pending = self._out.pop(e.ident, None)      # keep this peer's order
            if pending:
                self._send_now(e.ident, pending)
            if type(e.buffers) is Inner:         # a Relay: the message it carries, encoded once
                e = Send(e.ident, e.msg, e.parent, self._inner_frames(e.buffers))
            self._send_one(e)

    def _inner_frames(self, inner: Inner) -> list:
        """The frames of a message that Relays carry (with its own buffers),
        signed with the worker key once for all of them (relays.py)."""
        msg = inner.msg
        hit = self._inner.get(id(msg))
        if hit is None or hit[0] is not msg:
            if len(self._inner) > 64:
                self._inner.clear()
            hit = self._inner[id(msg)] = (msg, codec.encode(self.keys.workers, msg, msg_id=self.ep.next_id(),
                                                            sender=self.ep.sender, buffers=inner.buffers,
                                                            signer=codec.CLUSTER))
        return hit[1]

    def _send_one(self, e: Send) -> None:
        try:
            self.ep.send(self.sock, e.msg, to=e.ident, parent=e.parent, buffers=e.buffers, block=False,
                         sign=self.core.sign_for(e.ident))
        except zmq.Again:
            self._dropped(e.ident, type(e.msg).__name__)
        except zmq.ZMQError as err:
            log.warning("cannot send %s to %r: %s", type(e.msg).__name__, e.ident, err)

    def _send_now(self, ident: bytes, msgs: list[tuple]) -> None:
        try:
            for msg, _, e in self.ep.send_batch(self.sock, msgs, to=ident, block=False,
                                                sign=self.core.sign_for(ident)):
                log.error("cannot send %s to %r: %s", type(msg).__name__, ident, e)
        except zmq.Again:
            self._dropped(ident, ", ".join(sorted({type(x[0]).__name__ for x in msgs})))
        except zmq.ZMQError as e:
            log.warning("cannot send %d messages to %r: %s", len(msgs), ident, e)
        except Exception:     # an unencodable message is a bug: lose it, not the loop
            log.exception("cannot send %d messages to %r", len(msgs), ident)

    def _flush_out(self) -> None:
        """Send what ``_emit`` held. Peers that are to get the very same
        messages (a computation's hosts: one Execute, one Free) get the same
        frames, encoded and signed once."""
        out, self._out = self._out, {}
        self._items.clear()
        if len(out) < 2:
            for ident, msgs in out.items():
                self._send_now(ident, msgs)
            if self._unreachable:
                self._lose_unreachable()
            return
        same: dict[tuple[int, ...], tuple[list[tuple], list[bytes]]] = {}
        for ident, msgs in out.items():
            # (a worker and a client never get the same frames: signed with other keys)
            group = same.get(key := (self.core.sign_for(ident)[1], *map(id, msgs)))
            if group is None:
                same[key] = (msgs, [ident])
            else:
                group[1].append(ident)
        for msgs, idents in same.values():
            if len(idents) == 1:
                self._send_now(idents[0], msgs)
            else:
                self._send_to_many(idents, msgs)
        if self._unreachable:
            self._lose_unreachable()

    def _send_to_many(self, idents: list[bytes], msgs: list[tuple]) -> None:
        try:
            messages, failed = self.ep.batch_frames(msgs, sign=self.core.sign_for(idents[0]))
        except Exception:     # an unencodable message is a bug: lose it, not the loop
            log.exception("cannot send %d messages to %d peers", len(msgs), len(idents))
            return
        for msg, _, e in failed:
            log.error("cannot send %s to %d peers: %s", type(msg).__name__, len(idents), e)
        # the bodies as zmq.Frames: ZeroMQ shares one copy between the peers
        messages = [[f if len(f) < 1024 else zmq.Frame(f) for f in frames] for frames in messages]
        for ident in idents:
            try:
                for frames in messages:
                    self.ep.send_frames(self.sock, frames, to=ident, block=False)
            except zmq.Again:
                self._dropped(ident, ", ".join(sorted({type(x[0]).__name__ for x in msgs})))
            except zmq.ZMQError as e:
                log.warning("cannot send %d messages to %r: %s", len(msgs), ident, e)

    def _run(self, effects: list[Effect]) -> None:
        """Carry out an event's effects. Where the core stopped planning at a
        flush point (``busy``), the loop goes on with it once it has sent what
        is ready and handled what came meanwhile (``_plan_slice``)."""
        self._emit(effects)

    def _plan_slice(self) -> None:
        """Read what came (the core defers what the paused client sent), then
        plan one more slice."""
        self._flush_out()
        self._recv_all(budget=1000)
        if self.core.busy:
            client, name = self.core.resume_label()
            t0 = time.time()
            self._emit(self.core.resume(time.monotonic()))
            self.core.events.append(("plan", client, name, t0, time.time()))
            self._flush_out()

    def _dropped(self, ident: bytes, what: str) -> None:
        """A peer's queue is full. A worker that missed a message cannot go on
        in order (a missed Execute never reports, a missed Relay leaves its
        group waiting for what it forwards): it is lost, once this flush is
        done (``_lose_unreachable``)."""
        peer = self.core.peers.get(ident)
        log.error("%s %s is not reading its messages (queue full): dropped %s",
                  peer.role if peer else "peer", peer.id if peer else repr(ident), what)
        if peer is not None and peer.role == "worker":
            self._unreachable.setdefault(peer.id, what)

    def _lose_unreachable(self) -> None:
        while self._unreachable:
            rank, what = self._unreachable.popitem()
            self._emit(self.core.unreachable(time.monotonic(), rank, what))
            self._flush_out()

    # ---- loop ----------------------------------------------------------------
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        next_ping = heard_until = time.monotonic()
        log.info("controller listening on %s", self.address)
        while self.running:
            now = time.monotonic()
            busy = now - heard_until
            if busy > STALL_S:
                # this loop was held up (a huge message, a long plan) and pinged
                # no one: that time, beyond STALL_S, does not count as the peers'
                # silence (so back-to-back long handlings still let it count)
                log.warning("controller loop was busy for %.1fs", busy)
                self.core.stalled(now, busy - STALL_S)
            if now >= next_ping:
                next_ping = now + self.config.ping_interval_s
                if self.core.late(now):
                    # their answers may be waiting behind work that held this loop
                    # up (a huge message, a long plan): read what came before judging
                    self._recv_all(budget=1_000_000)
                    busy, now = time.monotonic() - now, time.monotonic()
                    if busy > STALL_S:         # that reading held the loop up too
                        self.core.stalled(now, busy - STALL_S)
                self._run(self.core.tick(now))
                self._flush_out()
            if self.core.busy:           # planning a long program, a slice at a time
                self._plan_slice()
                heard_until = time.monotonic()
                continue
            due = self.core.suspects_due()     # hosts of a failed collective must answer by then
            if due is not None and now >= due:
                self._run(self.core.check(now))
                self._flush_out()
                due = self.core.suspects_due()
            wake = next_ping if due is None else min(next_ping, due)
            events = dict(poller.poll(timeout=max(1, int((wake - now) * 1000))))
            if not events and not self.core.in_flight and gc.get_count()[2] >= FULL_GC_AFTER:
                gc.collect()           # idle: the full pass it held back (see FULL_GC_AFTER)
            heard_until = time.monotonic()
            for _ in events:
                self._recv_all()
        self._stop_workers("controller shutting down")
        self.sock.close(linger=200)          # those Shutdowns get a moment to leave
        self.ctx.term()

    def _recv_all(self, budget: int = 1000) -> None:
        """Handle waiting messages, at most ``budget`` of them, so the loop gets
        back to its timers (pings) even under a flood; what their handling
        sends of planned nodes is bounded too (``ControllerCore.begin_turn``).

        What handling a message sends goes out coalesced, one Batch per peer
        (see _emit): for a received message (a client's Batch of calls, a
        worker's reports), when it is done; after a Program (or a template's
        definition or run), whose work is sent before the next is planned. A
        Call's work waits while more is waiting (later items of the same
        Batch, or messages readable on the socket), so a burst of op-by-op
        calls reaches each host as one Batch of Executes, but for at most
        COALESCE_CALLS calls and COALESCE_S after the first was handled: the
        first call of a burst is not held back long by the rest, and a call
        with nothing behind it goes at once."""
        core = self.core
        peers = core.peers
        core.begin_turn()
        held = 0                 # calls handled since the last flush
        since = 0.0              # when the first of them was handled
        try:
            while budget > 0:
                if not self.running:
                    return
                try:
                    ident, frames = self.ep.recv_frames(self.sock, router=True, block=False)
                    header, msg, buffers = self.ep.decode(frames, ident, self.core.keys_of(ident))
                except zmq.Again:
                    return
                except BadMessage as e:
                    self._run(self.core.reject(time.monotonic(), e.ident,
                                               e.header.msg_id if e.header else 0, str(e)))
                    self._flush_out()
                    held = 0
                    budget -= 1
                    continue
                msgs = unbatched(header, msg, buffers)
                budget -= len(msgs)
                # the time the event came, for all of a batch's items (they came together)
                now = time.monotonic()
                for header, msg, buffers in msgs:
                    kind = type(msg)
                    if issubclass(kind, ProtocolError):         # one bad item of a batch
                        self._emit(core.reject(now, ident, header.msg_id, str(BadMessage(
                            str(msg), ident, header))))
                        continue
                    if ident not in peers:       # (a known peer passed these checks when it registered)
                        why = core.refuses(ident, header.signer, msg)
                        if why:
                            self._emit(core.reject(now, ident, header.msg_id, why))
                            continue
                    if kind is not m.Call and kind is not m.CallAgain and kind not in _FLUSH_AFTER:
                        self._emit(core.handle(now, ident, header.msg_id, msg, buffers))
                        continue
                    # a submission: its planning on the timeline
                    t0 = time.time()
                    self._emit(core.handle(now, ident, header.msg_id, msg, buffers))
                    t1 = time.time()
                    self._plan_event(ident, msg, t0, t1)
                    if kind is m.Call or kind is m.CallAgain:   # sent, or held while more waits (see above)
                        if not held:
                            since = t0
                        held += 1
                        if held < COALESCE_CALLS and t1 - since < COALESCE_S:
                            continue
                    self._flush_out()
                    held = 0
                more = readable(self.sock)
                if not (held and more) or time.time() - since >= COALESCE_S:
                    self._flush_out()
                    held = 0
                if not more:
                    return
        finally:
            self._flush_out()

    def _plan_event(self, ident: bytes, msg: Any, start: float, end: float) -> None:
        peer = self.core.peers.get(ident)
        kind = type(msg)
        if kind is m.Call:                # (the usual ones: before the match's class patterns)
            name = self.core.program_name(msg.program)
        elif kind is m.CallAgain:         # (its kept form's program; none: it failed)
            form = peer.forms.get(msg.form) if peer is not None else None
            name = self.core.program_name(form.program) if form is not None else f"call form {msg.form}"
        else:
            match msg:
                case m.Program():
                    name = msg.name
                case m.DefineProgram():
                    name = msg.program.name
                case _:          # a template's run: its program's name
                    t = self.core.templates.get((peer.id, msg.template)) if peer else None
                    name = t.name if t is not None else f"template {msg.template}"
        self.core.events.append(("plan", peer.id if peer else -1, name, start, end))

    def stop(self, *_: Any) -> None:
        self.running = False

    def _stop_workers(self, reason: str) -> None:
        """Tell the workers to stop, and the clients that it is over (they fail
        what waits rather than wait for it): best effort, a peer may be gone
        without a word."""
        for e in self.core.farewell(reason):
            if isinstance(e, Send):
                try:
                    self.ep.send(self.sock, e.msg, to=e.ident, block=False, sign=self.core.sign_for(e.ident))
                except zmq.ZMQError:
                    pass


def main(argv: list[str] | None = None, gang: GangScheduler | None = None) -> int:
    """``gang``: the gang scheduler (tests run a controller with one that
    breaks the order)."""
    p = argparse.ArgumentParser(prog="zpath controller", description="Run the zpath controller.")
    p.add_argument("--bind", default="tcp://127.0.0.1:0",
                   help="ZeroMQ address to listen on (port 0: pick a free one)")
    p.add_argument("--address-file", help="write the address here once listening")
    p.add_argument("--policy", choices=POLICIES, default=None,
                   help="multi-tenant scheduling policy (default: $ZPATH_SCHEDULER_POLICY or share)")
    args = p.parse_args(argv)
    die_with_parent()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack
    try:
        common = CommonConfig.from_env()
        config = ControllerConfig.from_env(policy=args.policy)
    except ZpathError as e:
        print(f"zpath controller: {e}", file=sys.stderr, flush=True)
        return 2
    logs.setup("controller", common.log_level)
    key = key_from_config(common)     # a missing key: one line from the CLI, as for the worker
    worker_key = worker_key_from_config(common, key)
    try:
        ctl = Controller(key, args.bind, config, gang=gang, common=common, worker_key=worker_key)
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
    # and the full passes over what the controller keeps wait until the loop is idle
    gc.set_threshold(gc.get_threshold()[0], gc.get_threshold()[1], FULL_GC_FORCED)
    ctl.serve_forever()
    return 0
