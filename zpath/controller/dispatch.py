"""Dispatch: planning a call, the parked-node graph (nodes waiting to be sent:
for the computations they read to finish, for parked producers to be sent, or
for their turn in the multi-tenant scheduler), copy repair, and the
computations in flight until every host reported them done."""
from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import operator
from collections.abc import Iterable
from typing import Any

from zpath import sharding
from zpath.controller.report_hold import may_hold
from zpath.controller.admission import SEND_COST
from zpath.controller.records import ParkedNode, InFlight, Peer, Report, call_buffers
from zpath.controller.directory import Directory, Plan, PlanError
from zpath.controller.resources import LostHosts
from zpath.controller.scheduler import Ready
from zpath.errors import ErrorKind, ResourceError
from zpath.ids import client_of
from zpath.net import messages as m


log = logging.getLogger(__name__)

# a batch's rows of one computation, at least this many, are taken as a whole
# (_rows_taken); fewer row by row
RUN_ROWS = 8

# Pieces smaller than this that one computation reads from one host over one
# channel travel together (SendPieces -> Pieces), at most BUCKET_BYTES a message:
# a data-parallel step's gradient of many small leaves crosses the DCN as a few
# messages, not one per leaf.
BUCKET_PIECE_BYTES = 256 << 10
BUCKET_BYTES = 4 << 20
BUCKET_PIECES = 1024          # and at most this many pieces (codec.MAX_BUFFERS per message)


class Dispatch:
    """Mixin of ControllerCore: the parked-node graph, copy repair, pumping the
    tenant scheduler, computations in flight."""

    def _init_dispatch(self) -> None:
        # exec_id -> what it is, until every host reported
        self.in_flight: dict[int, InFlight] = {}
        # parked nodes, by what they wait for: an exec id (it finished) or
        # ("sent", exec id) (that parked node was sent)
        self.waiters: dict[Any, list[ParkedNode]] = {}
        self.parked_outputs: dict[int, int] = {}           # output buffer of a parked node -> its exec id
        # buffers some of whose planned copies were dropped: nodes not sent yet
        # that read them are repaired before they go (until the buffer is freed)
        self.copies_dropped: set[int] = set()
        # buffer -> layouts of its copies that parked nodes (not sent yet) are to make
        self.unsent_copies: dict[int, list[dict]] = {}
        self.unfinished: set[int] = set()   # exec ids of sequential programs' nodes not finished
        # parked nodes whose waits are over, sent by one loop (never by recursion:
        # a chain of thousands of parked nodes would overflow the stack)
        self._released: collections.deque[ParkedNode] = collections.deque()
        self._releasing = False
        self.calls = 0

    def parked_nodes(self) -> list[ParkedNode]:
        """Every node planned and not sent yet (parked)."""
        seen: dict[int, ParkedNode] = {}
        for waiting in self.waiters.values():
            for h in waiting:
                seen[id(h)] = h
        for r in self.tenants.queued_items():
            seen[id(r.item)] = r.item
        for h in self._released:
            seen[id(h)] = h
        return list(seen.values())

    def _plan(self, ident: bytes, peer: Peer, call: m.Call, directory: Directory | None = None
              ) -> tuple[Plan, str] | None:
        """Plan one call, or fail it: its outputs are poisoned and the client is
        told (CallFailed). ``directory`` (a scratch copy) plans without effect."""
        self.calls += directory is None
        prog = self.programs.get(call.program)
        try:
            if prog is None:
                raise PlanError(ErrorKind.NOT_FOUND, f"program {call.program[:12]} is not registered")
            try:
                self.rm.check_spmd(call.devices)
            except LostHosts as e:
                lost = self.rm.hosts[e.hosts[0]]
                raise PlanError(ErrorKind.RESOURCE, str(e), m.ErrorInfo(
                    ErrorKind.HOST_LOST, f"host {lost.rank} ({lost.name}, island {lost.island}) was lost"
                    f"{': ' + lost.lost_why if lost.lost_why else ''}; this computation cannot run there",
                    lost.rank, prog[0], "")) from None
            except ResourceError as e:
                raise PlanError(ErrorKind.RESOURCE, str(e)) from None
            theirs = [b for b in [o.buffer for o in call.outputs] + [i.buffer for i in call.inputs if i.put]
                      if client_of(b) != peer.id]
            if theirs:
                raise PlanError(ErrorKind.BAD_REQUEST, f"buffer ids {theirs[:4]} are not this client's "
                                f"(client {peer.id} names new buffers {peer.id} << 32 | n)")
            return (directory or self.directory).plan(call, peer.id, prog[0]), prog[0]
        except PlanError as e:
            if directory is not None:
                raise
            err = e.error or m.ErrorInfo(ErrorKind.CALL_FAILED, f"call rejected: {e}", None,
                                         prog[0] if prog else "", "")
            self._fail_call(ident, peer.id, call, err)
            self._free_puts(call, peer.id)
            return None

    def _fail_call(self, ident: bytes, client: int, call: m.Call, err: m.ErrorInfo) -> None:
        """Fail a call that will not run: its outputs are poisoned (so consumers fail
        with the same cause) and the client is told. Only outputs that are new and
        in the sender's own id range: never an existing buffer, nor one another
        client may still create."""
        outs = [o.buffer for o in call.outputs if o.buffer not in self.directory.buffers]
        self.directory.poison([b for b in outs if client_of(b) == client], client, err)
        self.send(ident, m.CallFailed(call.call_id, outs, err))

    def _dispatch(self, peer: Peer, call: m.Call, plan: Plan, name: str, hold: bool = False,
                  devices: tuple[int, ...] | None = None) -> int:
        """Send a planned call to its hosts in gang order (``hold``: see
        ``Execute.hold``; ``devices``: the call's devices as a tuple, if made
        already); returns its exec id."""
        drop_after: list[tuple[int, m.DropFused]] = []
        known = self.host_programs
        for digest in plan.programs if plan.programs is not None else [call.program]:
            # the hosts without the program get it first, alike (through relays: relays.py)
            need = [rank for rank in plan.executes if digest not in known[rank]]
            if need:
                pname, blob = self.programs[digest]
                self.to_hosts_alike(need, m.RegisterProgram(digest, pname), [blob])
                for rank in need:
                    known[rank].add(digest)
        if plan.setup is not None:
            # the hosts without the fused program get it, those whose parts are
            # alike one message (through relays: relays.py)
            alike: dict[int, tuple[m.DefineFused, list[int]]] = {}
            for rank in plan.executes:
                define = plan.setup[rank]
                if define.fused not in self.host_fused.setdefault(rank, set()):
                    alike.setdefault(id(define), (define, []))[1].append(rank)
                    if define.fused in self.fused_live:
                        self.host_fused[rank].add(define.fused)
                    else:                 # dropped while this run waited: forgotten after it
                        drop_after.append((rank, m.DropFused([define.fused])))
            for define, ranks in alike.values():
                self.to_hosts_alike(ranks, define)
        sends = plan.sends
        if sends:
            self.to_hosts(self._send_orders(sends))
        island = self.rm.hosts[next(iter(plan.executes))].island
        ordered = self.scheduler.dispatch(island, plan.executes, hold)
        exec_id = next(iter(plan.executes.values())).exec_id
        self.in_flight[exec_id] = InFlight(
            peer.id, peer.ident, name, island, self.scheduler.next_seq[island] - 1,
            tuple(call.devices) if devices is None else devices, set(plan.executes), self.rm.host_counts(call.devices),
            [o.buffer for o in call.outputs],
            [(piece.piece_id, src, piece.dst_host) for src, piece in sends],
            [i.buffer for i in call.inputs if i.put], plan.setup is not None, plan.copies,
            plan.transient)
        self.to_hosts(ordered)
        for rank, drop in drop_after:
            self.to_host(rank, drop)
        return exec_id

    def _send_orders(self, sends: list[tuple[int, m.SendPiece]]) -> list[tuple[int, Any]]:
        """The orders for one computation's pieces: the small ones (under
        BUCKET_PIECE_BYTES) from one host to another over one channel go as
        buckets (``SendPieces``, at most BUCKET_BYTES each), sent as one
        message once all are ready; the computation needs all of them before
        it runs, so none waits longer for it. The others go one by one."""
        out: list[tuple[int, Any]] = []
        buckets: dict[tuple[int, int, str], list[list[m.SendPiece]]] = {}
        filled: dict[tuple[int, int, str], int] = {}       # bytes in each key's last bucket
        for src, piece in sends:
            buf = self.directory.buffers.get(piece.buffer)
            size = sharding.nbytes(piece.sub, buf.dtype) if buf is not None else BUCKET_PIECE_BYTES
            if size >= BUCKET_PIECE_BYTES:
                out.append((src, piece))
                continue
            key = (src, piece.dst_host, piece.channel)
            groups = buckets.setdefault(key, [[]])
            if filled.get(key, 0) + size > BUCKET_BYTES or len(groups[-1]) == BUCKET_PIECES:
                groups.append([])
                filled[key] = 0
            groups[-1].append(piece)
            filled[key] = filled.get(key, 0) + size
        for (src, _, _), groups in buckets.items():
            for pieces in groups:
                if len(pieces) == 1:
                    out.append((src, pieces[0]))
                    continue
                p = pieces[0]
                out.append((src, m.SendPieces([m.PieceOrder(q.piece_id, q.buffer, q.device, q.region, q.sub)
                                                for q in pieces], p.dst_host, p.dst_address, p.channel,
                                               p.dst_machine, p.dst_key)))
        return out

    def _parked_producers(self, call: m.Call) -> set:
        """What a node must wait for before it is sent: the parked nodes whose
        outputs it reads (as ("sent", exec id))."""
        return {("sent", self.parked_outputs[i.buffer]) for i in call.inputs
                if i.buffer in self.parked_outputs}

    def _start(self, node: ParkedNode) -> None:
        """A planned node goes to the multi-tenant scheduler now, or is parked
        until what it waits for has happened."""
        if not node.waits:
            self._ready(node, was_parked=False)
            return
        for w in node.waits:
            self.waiters.setdefault(w, []).append(node)
        self._park(node)

    def _park(self, node: ParkedNode) -> None:
        """A node is not sent yet: buffers it reads or writes are not freed, and
        nodes that read its outputs wait until it is sent."""
        pinned, parked, exec_id = self.pinned, self.parked_outputs, node.exec_id
        for i in node.call.inputs:              # (pinned.update(call_buffers(...)), without a list)
            pinned[i.buffer] += 1
        for o in node.call.outputs:
            pinned[o.buffer] += 1
            parked[o.buffer] = exec_id
        for b, lay in node.planned[0].copies:
            self.unsent_copies.setdefault(b, []).append(lay)

    def _unpark(self, node: ParkedNode) -> None:
        for o in node.call.outputs:
            self.parked_outputs.pop(o.buffer, None)
        for b, lay in node.planned[0].copies:
            left = [u for u in self.unsent_copies.get(b, ()) if u is not lay]
            if left:
                self.unsent_copies[b] = left
            else:
                self.unsent_copies.pop(b, None)
        self._unpin(call_buffers(node.call))

    def _ready(self, node: ParkedNode, was_parked: bool) -> None:
        """A node may go once the multi-tenant scheduler gives it its turn: at
        once when nothing waits on its island and its devices have room, else
        it queues (parked) behind its client's earlier nodes."""
        if node.run.peer.gone:            # its client left meanwhile
            self._abandon(node, was_parked)
            return
        fast = self.fast_parked.get(node.exec_id) if self.fast_parked else None
        if fast is not None:              # (planned by the fast path: its call's devices and cost key)
            ready = Ready(node.run.peer.id, node.island, fast.ready.devices, fast.ready.cost_key, node)
        else:
            call = node.call
            devices = tuple(call.devices)
            ready = Ready(node.run.peer.id, node.island, devices, (call.program, devices), node)
        if self.tenants.can_send_now(ready):
            self._send(ready, was_parked)
            return
        if not was_parked:
            self._park(node)
        self.tenants.add(ready)
        self._pump(node.island)

    def _pump(self, island: int) -> None:
        """Send what the multi-tenant scheduler lets go on an island, as much as
        this event's budget allows (``send_budget``); the rest goes on in a
        later ``resume``, after the loop has looked at its sockets."""
        while (ready := self.tenants.pick(island)) is not None:
            self._send(ready, was_parked=True)
            if self.send_budget <= 0:
                self._pause(("pump", island))
                return

    def _send(self, ready: Ready, was_parked: bool) -> None:
        """Dispatch a node whose turn it is (or fail it, if a host it needs was
        lost while it waited)."""
        node = ready.item
        run = node.run
        # (a call the fast path planned: its Execute is sent as it was made, fastcall.py)
        fast = self.fast_parked.pop(node.exec_id, None) if self.fast_parked else None
        err = self._unsendable(node)
        if err is None and (self.copies_dropped or self.unsent_copies):
            err = self._repair(node)
            fast = None                   # (the plan may have changed)
        if err is not None:
            self._abandon(node, was_parked, err)
            return
        hold = may_hold(self.tenants, node.island, run.peer.id, run.sequential, self.memory_limit)
        exec_id = None if fast is None else self._fast_dispatch(fast, node, hold)
        if exec_id is None:
            exec_id = self._dispatch(run.peer, node.call, *node.planned, hold=hold, devices=ready.devices)
        self.send_budget -= SEND_COST + len(node.planned[0].executes)
        self.tenants.sent(exec_id, ready)
        run.sent += 1
        if was_parked:
            self._unpark(node)
            self._maybe_release(run)
            self._trigger(("sent", exec_id))      # nodes that waited for this one to be sent

    def _drop_copies(self, copies: list[tuple[int, dict]], error: m.ErrorInfo) -> list[int]:
        """Forget copies that will never hold data (``Directory.drop_copies``);
        nodes planned to read them, and not sent yet, read another copy when
        they go (``_send``). Returns the buffers left with no copy."""
        self.copies_dropped.update(b for b, _ in copies if b in self.directory.buffers)
        return self.directory.drop_copies(copies, error)

    def _repair(self, node: ParkedNode) -> m.ErrorInfo | None:
        """A node about to be sent may have been planned to read a copy that
        will never be made, or that a node not sent yet (so queued behind it)
        is to make: it reads those shards from a copy that holds data instead
        (``Directory.repair``). With none left, it cannot run: why."""
        dropped, unsent = self.copies_dropped, self.unsent_copies
        copies = node.planned[0].copies

        def own(b: int, lay: dict) -> bool:
            return any(lay is o for _, o in copies)
        affected = {i.buffer for i in node.call.inputs if i.buffer in dropped or (
            i.buffer in unsent and not all(own(i.buffer, u) for u in unsent[i.buffer]))}
        if not affected:
            return None

        def unusable(b: int, lay: dict) -> bool:
            return any(lay is u for u in unsent.get(b, ())) and not own(b, lay)
        lost = self.directory.repair(node.planned[0], affected, unusable, own)
        if not lost:
            return None
        return m.ErrorInfo(ErrorKind.HOST_LOST, f"buffer {lost[0]} has no copy that holds data left (the copies "
                           "planned for it cannot be made)", None, node.planned[1], "")

    def _unsendable(self, node: ParkedNode) -> m.ErrorInfo | None:
        """Why a node that waited can no longer run: an input failed meanwhile, or
        a host it runs on or reads from was lost."""
        for i in node.call.inputs:
            buf = self.directory.buffers.get(i.buffer)
            if buf is not None and buf.error is not None:
                return buf.error
        plan = node.planned[0]
        hosts = self.rm.hosts
        for h in [*plan.executes, *(src for src, _ in plan.sends)] if plan.sends else plan.executes:
            host = hosts[h]
            if not host.alive:
                return m.ErrorInfo(ErrorKind.HOST_LOST, f"host {h} ({host.name}, island {host.island}) was lost "
                                   "before this computation could run", h, node.planned[1], "")
        return None

    def _abandon(self, node: ParkedNode, was_parked: bool, err: m.ErrorInfo | None = None) -> None:
        """A node that will never be sent: its client left, or it cannot run
        (``err``: its outputs fail with it, so their consumers fail too)."""
        run = node.run
        self.fast_parked.pop(node.exec_id, None)
        self._release_transient(node.planned[0].transient)
        # its plan recorded copies of its inputs it will never make: forget them
        # (an input left with no copy fails)
        lost = self._drop_copies(node.planned[0].copies, err or m.ErrorInfo(
            ErrorKind.ABANDONED, "its last copy was planned for a computation that was abandoned", None, "", ""))
        if err is not None:
            outs = [o.buffer for o in node.call.outputs]
            self.directory.poison(outs, run.peer.id, err)
            # inputs it would have read from a lost host fail too (rather than
            # be read from nowhere)
            gone = [p.buffer for src, p in node.planned[0].sends if not self.rm.hosts[src].alive]
            self.directory.poison(gone, run.peer.id, err)
            if not run.peer.gone:
                self.send(run.peer.ident, m.CallFailed(node.call.call_id, outs + lost, err))
        run.sent += 1
        if was_parked:
            self._unpark(node)
        self._maybe_release(run)
        # nodes waiting for it to be sent, or (sequential) to finish: they go on,
        # and fail with its error when they read its outputs
        self.unfinished.discard(node.exec_id)
        self._trigger(("sent", node.exec_id))
        self._trigger(node.exec_id)

    def _exec_finished(self, exec_id: int, devices: Any = None) -> None:
        """Every host finished a computation: send the parked nodes waiting on it,
        and what the multi-tenant scheduler now has room for (once one of its
        ``devices`` is down to half a window, when they are given)."""
        self.unfinished.discard(exec_id)
        self._trigger(exec_id)
        done = self.tenants.finished(exec_id)
        if done is not None and (devices is None or self.tenants.low(devices, done[0])):
            self._pump(done[0])

    def _trigger(self, key: Any) -> None:
        waiting = self.waiters.pop(key, None)
        if waiting is None and not self._released:
            return                        # (the usual case: nothing waits for it)
        for node in waiting or ():
            node.waits.discard(key)
            if not node.waits:
                self._released.append(node)
        if not self._releasing:           # (else the loop further up the stack sends it)
            self._send_released()

    def _send_released(self) -> None:
        """Send the parked nodes whose waits are over, in order, as much as this
        event's budget allows; the rest goes on in a later ``resume``."""
        self._releasing = True
        try:
            while self._released:
                if self.send_budget <= 0:
                    self._pause(("released",))
                    return
                self._send_parked(self._released.popleft())
        finally:
            self._releasing = False

    def _send_parked(self, node: ParkedNode) -> None:
        if node.run.peer.gone:
            self._abandon(node, was_parked=True)
        else:
            self._ready(node, was_parked=True)

    def _exec_done(self, host: int, msg: m.ExecDone) -> None:
        info = self.in_flight.get(msg.exec_id)
        if msg.error is not None:
            log.info("computation %d failed on host %d: %s", msg.exec_id, host, msg.error.message)
        if info is None:
            return
        if host not in info.hosts:
            # not a host that runs it, or one that reported it already: only the
            # hosts an execution was sent to finish it
            log.warning("host %d reported computation %d, which it does not run (any more)", host, msg.exec_id)
            return
        self._host_done(host, msg, info)

    def _exec_done_batch(self, sender: int, msg: m.ExecDoneBatch) -> None:
        """Reports of several hosts (a relay's group, see relays.py), or a
        host's own rows resent after its relay was lost. A row of another
        host is taken only from the relay that execution was sent to that
        host through; one that is not rejects the whole batch. Rows of
        computations no longer in flight, or of hosts that no longer run
        them (reported already, or lost), are dropped. The rows are taken
        computation by computation, in the order each first appears (a relay
        interleaves the rows of computations in flight together: op by op,
        back to back)."""
        in_flight = self.in_flight
        hosts, exec_ids = msg.hosts, msg.exec_ids
        n = len(hosts)
        if not len(exec_ids) == len(msg.starts) == len(msg.ends) == len(msg.waited) == n or \
                any(not 0 <= e.row < n for e in msg.errors):
            self._batch_rejected(sender, n, "its columns do not agree")
            return
        if not msg.errors and hosts.count(sender) == n:
            self._own_rows(sender, msg)        # (the usual batch: a host's own reports)
            return
        # computation -> its rows (None: every row of the batch)
        rows_of: dict[int, list[int] | None] = {}
        if n and exec_ids.count(exec_ids[0]) == n:
            rows_of[exec_ids[0]] = None
        else:
            for k, x in enumerate(exec_ids):
                rows = rows_of.get(x)
                if rows is None:
                    rows_of[x] = [k]
                else:
                    rows.append(k)
        runs: list[tuple[int, InFlight, list[int] | None, list[int], set[int]]] = []
        for x, rows in rows_of.items():
            info = in_flight.get(x)
            if info is None:
                continue
            run = hosts if rows is None else list(map(hosts.__getitem__, rows))
            distinct = set(run)
            allowed = self.relayed_by(sender, info.relay_of)
            if not distinct <= allowed:
                bad = next(h for h in run if h not in allowed)
                self._batch_rejected(sender, n, f"a row of computation {x} for host {bad}, "
                                                "which it does not relay it to")
                return
            runs.append((x, info, rows, run, distinct))
        heard, now = self.heard, self.now
        for _, _, _, _, distinct in runs:      # rows that show their hosts alive (Peers._pings)
            heard.update(dict.fromkeys(distinct, now))
        errors = {e.row: e.error for e in msg.errors}
        for x, info, rows, run, distinct in runs:
            if x not in in_flight:          # (gone while an earlier computation's rows were taken)
                continue
            if len(run) >= RUN_ROWS and len(distinct) == len(run) and distinct <= info.hosts and \
                    not (errors and (rows is None or any(k in errors for k in rows))):
                if rows is None:
                    self._rows_taken(x, info, run, msg.starts, msg.ends, msg.waited)
                else:
                    self._rows_taken(x, info, run, list(map(msg.starts.__getitem__, rows)),
                                     list(map(msg.ends.__getitem__, rows)), list(map(msg.waited.__getitem__, rows)))
                continue
            self._rows_one_by_one(x, info, msg, range(n) if rows is None else rows, errors)

    def _own_rows(self, host: int, msg: m.ExecDoneBatch) -> None:
        """A batch of ``host``'s own reports, none a failure (a worker sends
        two or more at once so): taken row by row, in order, as the general
        path takes them (rows of computations no longer in flight, or that
        ``host`` reported already, are dropped)."""
        in_flight, fine = self.in_flight, self._host_fine
        for x, start, end, waited in zip(msg.exec_ids, msg.starts, msg.ends, msg.waited, strict=True):
            info = in_flight.get(x)
            if info is not None and host in info.hosts:
                fine(host, x, start, end, waited, info)

    def _batch_rejected(self, sender: int, n: int, why: str) -> None:
        if self.log_limit.allow(None, self.now):
            log.warning("host %d sent a batch of %d reports with %s: rejected", sender, n, why)

    def _rows_taken(self, x: int, info: InFlight, hosts: list[int], starts: list[float], ends: list[float],
                    waited: list[float]) -> None:
        """A run of a batch's rows of computation ``x`` (``info``), all fine,
        of distinct hosts that run it: taken as a whole, as
        ``_rows_one_by_one`` would one by one (a last host finishes it)."""
        n = len(hosts)
        usual = n - 1 if len(info.hosts) == n else n
        self.timeline.add_run(x, starts[:usual], ends[:usual], waited[:usual], hosts[:usual], info.seq,
                              info.island, info.client, info.name, info.devices)
        seconds = [end - start if end > start else 0.0 for start, end in zip(starts[:usual], ends[:usual],
                                                                                strict=True)]
        info.hosts.difference_update(hosts[:usual])
        if seconds:
            self.tenants.hosts_done(x, sum(map(operator.mul, seconds, map(info.host_devices.__getitem__, hosts))),
                                    max(seconds))
        if usual < n:
            self._host_done(hosts[-1], Report(x, None, starts[-1], ends[-1], waited[-1]), info)

    def _rows_one_by_one(self, x: int, info: InFlight, msg: m.ExecDoneBatch, rows: Iterable[int],
                         errors: dict[int, m.ErrorInfo]) -> None:
        """Rows ``rows`` of a batch, of computation ``x`` (``info``), one by
        one. The usual rows (no error, not the computation's last host) are
        charged to the tenant scheduler at once."""
        timeline, hosts_done = self.timeline, self.tenants.hosts_done
        charged, longest = 0.0, 0.0
        for k in rows:
            h, start, stop, waited = msg.hosts[k], msg.starts[k], msg.ends[k], msg.waited[k]
            if h not in info.hosts:
                continue
            if k not in errors and len(info.hosts) > 1:       # (_host_done, the usual case)
                timeline.append((x, None, start, stop, waited, h, info.seq, info.island, info.client, info.name,
                                 info.devices))
                seconds = stop - start if stop > start else 0.0
                charged += seconds * info.host_devices[h]
                if seconds > longest:
                    longest = seconds
                info.hosts.discard(h)
                continue
            if charged or longest:         # before its last host may finish it
                hosts_done(x, charged, longest)
                charged = longest = 0.0
            error = errors.get(k)
            if error is not None:
                log.info("computation %d failed on host %d: %s", x, h, error.message)
            self._host_done(h, Report(x, error, start, stop, waited), info)
            if x not in self.in_flight:
                return
        if charged or longest:
            hosts_done(x, charged, longest)

    def _host_done(self, host: int, msg: m.ExecDone | Report, info: InFlight) -> None:
        """Host ``host`` finished its part of computation ``info`` (``msg``:
        its report)."""
        error = msg.error
        if error is None:              # (the usual report: what the rest does for it)
            self._host_fine(host, msg.exec_id, msg.start, msg.end, msg.waited, info)
            return
        if info.fused and msg.error is not None and msg.error.kind == ErrorKind.FUSED_UNKNOWN:
            # the host did not run it, so nothing there will ever hold its results
            # (it cannot poison what it does not know): they fail here
            mine = [b for b in info.outputs if (buf := self.directory.buffers.get(b)) is not None
                    and any(self.rm.devices[d].host == host for lay in buf.layouts
                            for devs in lay.values() for d in devs)]
            self.directory.poison(mine, info.client, msg.error)
            if mine and info.client_ident in self.peers:
                self.send(info.client_ident, m.CallFailed(0, mine, msg.error))
        if msg.error is not None and msg.error.kind == ErrorKind.PEER_FAILED:
            # its collective failed: a host of it may have died (its outputs
            # there wait for the verdict)
            self._peer_failed(host, info, msg.error)
        # an ExecRecord when asked (see timeline_records)
        self.timeline.append((msg.exec_id, msg.error, msg.start, msg.end, msg.waited, host, info.seq, info.island,
                              info.client, info.name, info.devices))
        self.tenants.host_done(msg.exec_id, msg.end - msg.start, info.host_devices[host])
        info.hosts.discard(host)
        info.error = info.error or (msg.error if msg.error is None or msg.error.kind != ErrorKind.PEER_FAILED
                                    else dataclasses.replace(msg.error, kind=ErrorKind.REMOTE_ERROR))
        if not info.hosts:
            self._all_done(msg.exec_id, info)

    def _host_fine(self, host: int, exec_id: int, start: float, end: float, waited: float,
                   info: InFlight) -> None:
        """``_host_done`` of a report that is not a failure."""
        self.timeline.append((exec_id, None, start, end, waited, host, info.seq, info.island, info.client,
                              info.name, info.devices))
        self.tenants.host_done(exec_id, end - start, info.host_devices[host])
        hosts = info.hosts
        hosts.discard(host)
        if not hosts:
            self._all_done(exec_id, info)

    def _all_done(self, exec_id: int, info: InFlight) -> None:
        """Every host reported computation ``exec_id`` (``info``)."""
        if info.copies:
            if info.error is None:
                self.directory.confirm(info.copies)
            else:
                # a copy of a failed computation may hold its error: nothing
                # reads it (an input left with no copy at all fails with it)
                lost = self._drop_copies(info.copies, info.error)
                if lost and info.client_ident in self.peers:
                    self.send(info.client_ident, m.CallFailed(0, lost, info.error))
        if info.transient:
            self._release_transient(info.transient)
        del self.in_flight[exec_id]
        self._exec_finished(exec_id, info.devices)

    def timeline_records(self, limit: int) -> list[m.ExecRecord]:
        """The last ``limit`` host reports, oldest first."""
        recent = self.timeline.last(limit) if limit > 0 else []
        return [m.ExecRecord(x, seq, island, host, client, name, list(devices), start, end, error is None, waited)
                for x, error, start, end, waited, host, seq, island, client, name, devices in recent]

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
                self.reply_error(ident, parent, ErrorKind.BAD_REQUEST, f"node {k}: {e}")
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

    def validate_dispatch(self) -> None:
        """The parked-node graph is consistent: waiters list parked nodes under
        what they wait for, parked outputs and unsent copies are those of parked
        nodes, and computations in flight run on live hosts."""
        assert not self._releasing
        assert not self._released or ("released",) in self._paused, "released parked nodes left unsent"
        parked = self.parked_nodes()
        by_exec = {h.exec_id: h for h in parked}
        for key, waiting in self.waiters.items():
            assert waiting, f"empty waiter list for {key!r}"
            for h in waiting:
                assert key in h.waits, f"node {h.exec_id} listed under {key!r} it does not wait for"
            if isinstance(key, tuple):
                assert key[0] == "sent" and key[1] in by_exec, f"waits for {key!r}, not a parked node"
            else:
                assert key in self.unfinished, f"waits for computation {key}, which is not unfinished"
        for h in parked:
            for w in h.waits:
                assert any(x is h for x in self.waiters.get(w, ())), \
                    f"node {h.exec_id} waits for {w!r} but is not listed there"
        for b, e in self.parked_outputs.items():
            assert e in by_exec and any(o.buffer == b for o in by_exec[e].call.outputs), \
                f"parked output {b} of {e}: no parked node makes it"
        unsent: collections.Counter[tuple[int, int]] = collections.Counter()
        for h in parked:
            for b, lay in h.planned[0].copies:
                unsent[(b, id(lay))] += 1
        listed = collections.Counter((b, id(lay)) for b, lays in self.unsent_copies.items() for lay in lays)
        assert unsent == listed, "unsent copies differ from the parked nodes' planned copies"
        for exec_id, inf in self.in_flight.items():
            assert inf.hosts, f"computation {exec_id} in flight on no host"
            for h in inf.hosts:
                host = self.rm.hosts.get(h)
                assert host is not None and host.alive, f"computation {exec_id} in flight on lost host {h}"
