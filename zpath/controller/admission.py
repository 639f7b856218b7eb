"""Admission: submissions (a call, a program, a template's plain calls) are
planned node by node in arrival order; under a per-device memory limit a node
that does not fit waits, with everything behind it, until memory is freed
(``memory_waiting``). What a waiting or parked node reads or writes is pinned: a
release of it is deferred until the node is planned or sent.

A long submission stops at nodes 1, 2, 4, ..., 64, then every SLICE_NODES
nodes or SLICE_HOST_PARTS host parts planned (``_paused``, ``busy``), so that
the loop sends what is ready, the workers start while the rest is planned,
and the loop reads and handles what came meanwhile (other clients' calls are
planned between the slices; the same client's later messages wait until its
submission is planned, see ``ControllerCore.handle``); ``resume`` plans one
more slice, of the paused submissions in turn."""
from __future__ import annotations

import collections
import itertools
from typing import Callable

from zpath.controller.directory import _layouts_key, footprint_of
from zpath.controller.records import ParkedNode, Peer, ProgramRun, Submission, call_buffers
from zpath.errors import ErrorKind
from zpath.ids import client_of
from zpath.net import messages as m

# a paused submission plans at most this many nodes, or nodes with this many
# hosts' parts in all, before the loop gets back to its sockets
SLICE_NODES = 64
SLICE_HOST_PARTS = 2048
# what one event may send of nodes already planned (parked nodes released, the
# tenant queue pumped), in units of SEND_COST per node plus its hosts' parts;
# the rest goes after the loop has looked at its sockets (see Dispatch._pump)
SEND_BUDGET = SLICE_HOST_PARTS
SEND_COST = 32
# calls a client's long programs may hold while their parts come in
MAX_PROGRAM_CALLS = 1 << 18


def release_points(calls: list[m.Call], release: list[int]) -> dict[int, list[int]]:
    """For the buffers a program releases: the index of the node after which
    none reads them (the last that reads or writes each), as node -> buffers.
    A buffer no node names is left to the end of the program."""
    last: dict[int, int] = {}
    for k, call in enumerate(calls):
        for i in call.inputs:
            last[i.buffer] = k
        for o in call.outputs:
            last[o.buffer] = k
    out: dict[int, list[int]] = {}
    for b in release:
        if b in last:
            out.setdefault(last[b], []).append(b)
    return out


class Admission:
    """Mixin of ControllerCore: memory waiting, pins and deferred releases."""

    def _init_admission(self, memory_limit: int) -> None:
        self.memory_limit = memory_limit
        # submissions waiting for device memory, in arrival order (each resumes at
        # its first unplanned node); while any waits, new ones queue behind it
        self.memory_waiting: collections.deque[Submission] = collections.deque()
        self._resuming = False
        # buffers read or written by parked nodes: their release waits until the node is sent
        self.pinned: collections.Counter[int] = collections.Counter()
        self.deferred: dict[int, int] = {}               # pinned buffer -> owner that released it
        self._arrivals = 0
        # planning stopped at a flush point: the submissions to go on with, in
        # turn, None standing for the head of memory_waiting (see busy, resume)
        # and ("pump", island) / ("released",): sending planned nodes, to go on
        self._paused: collections.deque[Submission | tuple | None] = collections.deque()
        self.send_budget = SEND_BUDGET
        # (client, program id) -> the calls and releases of a long program's
        # parts come so far (see Program.more)
        # (None: refused for its size; its later parts are refused too)
        self.program_parts: dict[tuple[bytes, int], tuple[list[m.Call], list[int]] | None] = {}
        # host -> buffers this event frees there, sent as one Free at its end (see _free)
        self.frees_pending: dict[int, list[int]] = {}

    @property
    def busy(self) -> bool:
        """Planning stopped at a flush point: send what was returned, handle
        what came meanwhile, and call ``resume``."""
        return bool(self._paused)

    def _pause(self, sub: Submission | tuple | None) -> None:
        if type(sub) is Submission or sub not in self._paused:
            self._paused.append(sub)

    def paused_client(self, peer: Peer) -> bool:
        """Whether a submission of this client is paused at a flush point (its
        later messages wait until it is planned)."""
        return bool(self._paused) and any(type(s) is Submission and s.peer is peer for s in self._paused)

    def _go_on(self) -> None:
        """Plan one more slice of the paused submission whose turn it is."""
        if not self._paused:
            return
        sub = self._paused.popleft()
        if sub is None:
            self._resume_waiting()
            return
        if type(sub) is tuple:           # sending planned nodes
            if sub[0] == "pump":
                self._pump(sub[1])
            else:
                self._send_released()
            return
        if sub.peer.gone:
            self._drop_waiting(sub)
            return
        done = self._advance(sub)
        if done is None:                 # another flush point: behind the others paused
            self._paused.append(sub)
            return
        if not done:
            self._wait_for_memory(sub)
        elif sub.then is not None:
            sub.then(sub)
        self._replay(sub.ident)

    def _fast_call(self, peer: Peer, call: m.Call) -> bool:
        """Overridden by the core (fastcall.py): send a repeated call."""
        return False

    def _learn_call(self, peer: Peer, call: m.Call, sub: Submission) -> None:
        """Overridden by the core (fastcall.py): remember a call for its repeats."""

    def _replay(self, ident: bytes) -> None:
        """Overridden by the core: handle what this client sent while its
        submission was paused."""

    def _call(self, ident: bytes, peer: Peer, call: m.Call) -> None:
        # a one-node program; the values the client put for it have no future and
        # are freed once it was sent (workers free after it ran). A repeat of
        # one sent before goes the fast path (fastcall.py).
        if self._fast_call(peer, call):
            return
        sub = self._submit(ident, peer, [call], "parallel", [i.buffer for i in call.inputs if i.put])
        self._learn_call(peer, call, sub)

    def _program(self, ident: bytes, peer: Peer, prog: m.Program) -> None:
        """A traced program: plan every node now; send them all at once
        (parallel) or each once the nodes it reads have finished (sequential).
        A long one comes in parts (``Program.more``): kept until the last."""
        key = (ident, prog.program_id)
        if prog.more or key in self.program_parts:
            kept = self.program_parts.pop(key, ([], []))
            if kept is None:             # refused already: so are its later parts
                calls, release, held = list(prog.calls), list(prog.release), 0
            else:
                calls, release = kept
                calls += prog.calls
                release += prog.release
                held = sum(len(p[0]) for (i, _), p in self.program_parts.items() if i == ident and p)
            if kept is None or held + len(calls) > MAX_PROGRAM_CALLS:
                err = m.ErrorInfo(ErrorKind.CALL_FAILED, f"program {prog.name!r} has more than "
                                  f"{MAX_PROGRAM_CALLS} calls waiting for their last part", None, prog.name, "")
                for call in calls:
                    self._fail_call(ident, peer.id, call, err)
                self._release(release, peer.id)
                if prog.more:
                    self.program_parts[key] = None
                return
            if prog.more:
                self.program_parts[key] = (calls, release)
                return
            prog = m.Program(prog.program_id, prog.name, prog.dispatch, calls, release)
        if prog.dispatch not in ("parallel", "sequential"):
            err = m.ErrorInfo(ErrorKind.CALL_FAILED, f"unknown dispatch mode {prog.dispatch!r}", None, prog.name, "")
            for call in prog.calls:
                self._fail_call(ident, peer.id, call, err)
            return
        self._submit(ident, peer, prog.calls, prog.dispatch, prog.release)

    def _submit(self, ident: bytes, peer: Peer, calls: list[m.Call], dispatch: str,
                release: list[int], record: bool = False,
                then: Callable[[Submission], None] | None = None) -> Submission:
        """Plan a submission now, or queue it behind those waiting for memory;
        ``then`` is called once it was planned in full without waiting."""
        self._arrivals += 1
        sub = Submission(ident, peer, calls, dispatch,
                         ProgramRun(peer, release, len(calls), sequential=dispatch == "sequential"),
                         seq=self._arrivals, record=[] if record else None, then=then)
        if self.memory_waiting:          # keep arrival order behind waiting work
            self._pin_waiting(sub)
            self._wait_for_memory(sub)
            return sub
        done = self._advance(sub)
        if done is None:                 # the loop sends what is ready, then resume goes on
            self._pause(sub)
        elif not done:
            self._wait_for_memory(sub)
        elif then is not None:
            then(sub)
        return sub

    def _wait_for_memory(self, sub: Submission) -> None:
        self.memory_waiting.append(sub)
        sub.waiting_since = self.now

    def _memory_wait_over(self, sub: Submission) -> None:
        """A submission left the memory queue: its wait goes on the timeline."""
        if sub.waiting_since is not None:
            name = self.program_name(sub.calls[0].program) if sub.calls else ""
            self.events.append(("memory", sub.peer.id, name, sub.waiting_since + self.wall_offset,
                                self.now + self.wall_offset))
            sub.waiting_since = None

    def _node_done(self, sub: Submission, k: int, call: m.Call) -> None:
        """Node ``k`` of a submission was planned (or failed): it no longer pins
        what it reads and writes for a wait for memory, and the program's buffers
        it was the last to read are released (parked nodes that still read them keep
        them until sent; workers free them after the computations before have run)."""
        if sub.pinned_from is not None and k >= sub.pinned_from:
            self._unpin(call_buffers(call))
        if sub.release_at:
            done = sub.release_at.pop(k, None)
            if done:
                self._release(done, sub.peer.id)

    def _drop_waiting(self, sub: Submission) -> None:
        """A waiting submission of a client that left: free what the client put
        for its calls not planned yet, unpin them, release the program's values."""
        for call in sub.calls[sub.next:]:
            self._free_puts(call, sub.peer.id)
            if sub.pinned_from is not None:
                self._unpin(call_buffers(call))
        sub.run.sent = sub.run.total
        self._maybe_release(sub.run)

    def _pin_waiting(self, sub: Submission) -> None:
        """A submission starts waiting for memory: pin what its calls not
        planned yet read and write, so a release of their inputs or of their
        outputs' futures meanwhile waits until they are planned."""
        if sub.pinned_from is None:
            sub.pinned_from = sub.next
            for call in sub.calls[sub.next:]:
                self.pinned.update(call_buffers(call))

    def _resume_waiting(self) -> None:
        """Memory was freed: continue waiting submissions, oldest first. Not
        re-entered: frees made while a submission advances are seen by the
        outer call (it checks memory again for every node)."""
        if self._resuming:
            return
        self._resuming = True
        try:
            while self.memory_waiting:
                sub = self.memory_waiting[0]
                if sub.peer.gone:
                    self.memory_waiting.popleft()
                    self._drop_waiting(sub)
                    continue
                done = self._advance(sub)
                if done is None:               # stopped at a flush point: resume goes on
                    self._pause(None)
                    return
                if not done:
                    if not self._backfill():
                        return
                    continue                   # memory may have been freed: the head again
                if self.memory_waiting and self.memory_waiting[0] is sub:
                    self.memory_waiting.popleft()
                    self._memory_wait_over(sub)
        finally:
            self._resuming = False

    def _backfill(self) -> bool:
        """The head of the memory queue must wait. A later submission that keeps
        alive a value whose future was dropped (its release waits for it) and
        depends on nothing still waiting (every input it reads exists, or is made
        by its own earlier nodes) goes ahead if it fits: otherwise a head that
        needs that value's memory would wait for ever. Everything else keeps
        arrival order. Returns whether one was planned in full (and left the queue)."""
        for sub in list(self.memory_waiting)[1:]:
            if sub.peer.gone or not self._holds_deferred(sub) or not self._independent(sub):
                continue
            if self._advance(sub, pause=False):
                self.memory_waiting.remove(sub)
                self._memory_wait_over(sub)
                return True
        return False

    def _holds_deferred(self, sub: Submission) -> bool:
        return any(b in self.deferred for call in sub.calls[sub.next:] for b in call_buffers(call))

    def _independent(self, sub: Submission) -> bool:
        made = set()
        for call in sub.calls[sub.next:]:
            for i in call.inputs:
                if not i.put and i.buffer not in made and i.buffer not in self.directory.buffers:
                    return False
            made.update(o.buffer for o in call.outputs)
        return True

    def _fits(self, sub: Submission, call: m.Call) -> str:
        """"ok", "wait" (for memory to be freed), or "failed": a call that can
        never fit under the per-device limit fails at once."""
        if not self.memory_limit:
            return "ok"
        for d in call.devices:
            dev = self.rm.devices.get(d)
            if dev is None or not self.rm.hosts[dev.host].alive:
                return "ok"               # planning rejects it (HostLost), rather than wait for ever
        for i in call.inputs:
            if not i.put:
                buf = self.directory.buffers.get(i.buffer)
                if buf is None or buf.error is not None:
                    return "ok"           # planning rejects it (its input is gone or failed)
        for d, n in self.directory.needs(call).items():
            if n > self.memory_limit:
                err = m.ErrorInfo(ErrorKind.RESOURCE_ERROR, f"call needs {n} bytes on device {d}, more than "
                                  f"the per-device limit of {self.memory_limit} bytes", None, "", "")
                self._fail_call(sub.ident, sub.peer.id, call, err)
                return "failed"
            if self.directory.device_bytes[d] + n > self.memory_limit:
                return "wait"
        return "ok"

    def _advance(self, sub: Submission, pause: bool = True) -> bool | None:
        """Plan a submission's nodes in order and send each when it may go; stop
        (returning False) at a node that must wait for memory. A node is parked
        until every parked node whose output it reads has been sent (so it never
        reaches a worker ahead of its producer), and in sequential mode until the
        nodes of its program it reads have finished. Returns None (``pause``)
        when it stopped at a flush point: after nodes 1, 2, 4, ..., 64 of those
        planned in this pass, then every SLICE_NODES nodes or SLICE_HOST_PARTS
        host parts, what is ready goes out, so the workers start while the
        rest of a long program is planned; calling it again goes on."""
        ident, peer, calls, dispatch, run = sub.ident, sub.peer, sub.calls, sub.dispatch, sub.run
        producer, exec_ids = sub.producer, sub.exec_ids
        if not sub.paused:
            sub.first = sub.slice_from = sub.next
            sub.parts = 0
        sub.paused = False
        if run.release and (self.memory_limit or len(calls) > SLICE_NODES) and len(calls) > 1 \
                and sub.release_at is None:
            # a long program (or any, under a memory limit) frees as it goes:
            # its values are released as their last reader is planned, not all
            # at once at the end (which would hold the loop up)
            sub.release_at = release_points(calls, run.release)
        while sub.next < len(calls):
            k, call = sub.next, calls[sub.next]
            fits = self._fits(sub, call)
            if fits == "wait":
                self._pin_waiting(sub)
                return False
            sub.next += 1
            if fits == "failed":
                self._free_puts(call, sub.peer.id)        # what the client put for it
                run.sent += 1
                self._node_done(sub, k, call)
                continue
            preds = {producer[i.buffer] for i in call.inputs if i.buffer in producer}
            for o in call.outputs:
                producer[o.buffer] = k
            planned = self._plan(ident, peer, call)
            if planned is None:
                run.sent += 1
                self._node_done(sub, k, call)
                continue
            if sub.record is not None:
                sub.record.append(planned[0])
            exec_ids[k] = next(iter(planned[0].executes.values())).exec_id
            waits = self._parked_producers(call)
            if dispatch == "sequential":
                # predecessors that have not finished (after a wait for memory,
                # some may have finished or been abandoned already)
                self.unfinished.add(exec_ids[k])
                waits |= {exec_ids[p] for p in preds if exec_ids.get(p) in self.unfinished}
            plan = planned[0]
            sub.parts += len(plan.executes)
            self._start(ParkedNode(run, call, planned, waits, exec_ids[k],
                                 self.rm.hosts[next(iter(plan.executes))].island))
            self._node_done(sub, k, call)
            done = sub.next - sub.first
            if pause and sub.next < len(calls) and (
                    (done <= SLICE_NODES and done & (done - 1) == 0)
                    or sub.next - sub.slice_from >= SLICE_NODES or sub.parts >= SLICE_HOST_PARTS):
                # (the last group goes with whatever else handling this
                # message sends)
                sub.paused = True
                sub.slice_from, sub.parts = sub.next, 0
                return None
        self._maybe_release(run)
        return True

    def _unpin(self, buffers: list[int]) -> None:
        """Take one pin off each of ``buffers`` (a call may name one twice);
        releases deferred meanwhile go ahead for those no longer pinned."""
        pinned, deferred = self.pinned, self.deferred
        for b in buffers:                 # (Counter.subtract, without its generality)
            pinned[b] -= 1
        ready = []
        for b in buffers:
            n = pinned.get(b)
            if n is not None and n <= 0:
                del pinned[b]
                if b in deferred:
                    ready.append(b)
        for b in ready:
            owner = deferred.pop(b, None)
            if owner is not None:
                self._release([b], owner)

    def _maybe_release(self, run: ProgramRun) -> None:
        """Once every node of a program was sent, free its intermediates and the
        values the client put for it (workers free after the nodes ran)."""
        if run.sent == run.total and not run.released:
            run.released = True
            self._release(run.release, run.peer.id)

    def _release(self, buffers: list[int], owner: int) -> None:
        """Free buffers the owner no longer needs, except those a parked node still
        reads or writes: those wait until it has been sent."""
        if not buffers:
            return                        # (a call that put nothing, sent: the usual op-by-op case)
        now = []
        deferred = False
        for b in buffers:
            if self.pinned.get(b, 0) > 0:
                self.deferred[b] = owner
                deferred = True
            else:
                now.append(b)
        if self.copies_dropped:
            self.copies_dropped.difference_update(now)
        self._free(self.directory.release(now, owner))
        if deferred and self.memory_waiting:
            self._resume_waiting()      # a waiting call that keeps it alive may go ahead

    def _free(self, frees: dict[int, list[int]]) -> None:
        """Tell hosts to free buffers: what one event frees on a host goes as
        one Free, after the event's other messages (``send_frees``), so a
        burst of nodes sent together (each freeing what the one before read)
        costs a host one Free, not one per node. A Free only waits for the
        computations sent before it: later is never wrong, and no message
        of the same event can name a buffer it frees (released buffers
        leave the directory; a node sent later was planned before)."""
        pending = self.frees_pending
        idents = self.worker_ident
        for rank, buffers in frees.items():
            if rank in idents:
                held = pending.get(rank)
                # (the same list object for hosts freed alike: see send_frees)
                pending[rank] = buffers if held is None else held + buffers
        if frees and self.memory_waiting:
            self._resume_waiting()

    def send_frees(self) -> None:
        """Send the Frees the event made (see ``_free``): hosts told the same
        get one message (encoded once)."""
        pending, self.frees_pending = self.frees_pending, {}
        same: dict[tuple[int, ...], m.Free] = {}
        by_list: dict[int, m.Free] = {}     # (the same list object: the same message, at once)
        out = []
        idents = self.worker_ident
        for rank, buffers in pending.items():
            if rank in idents:           # (not lost meanwhile)
                msg = by_list.get(id(buffers))
                if msg is None:
                    key = tuple(buffers)
                    msg = same.get(key)
                    if msg is None:
                        msg = same[key] = m.Free(buffers)
                    by_list[id(buffers)] = msg
                out.append((rank, msg))
        self.to_hosts(out)

    def _free_puts(self, call: m.Call, owner: int) -> None:
        """Shards the client already put for a call that will not run: free them
        where they went. Only the owner's own new ids: a call that names another
        client's next ids frees nothing of that client's."""
        puts = [i.buffer for i in call.inputs
                if i.put and client_of(i.buffer) == owner and i.buffer not in self.directory.buffers]
        hosts = {self.rm.devices[d].host for d in call.devices if d in self.rm.devices}
        if puts:
            self._free({h: puts for h in hosts})

    def validate_admission(self) -> None:
        """Waiting submissions are in arrival order, unfinished, and the pins
        are exactly what parked nodes and waiting submissions read and write."""
        seqs = [s.seq for s in self.memory_waiting]
        assert seqs == sorted(seqs), f"memory_waiting out of arrival order: {seqs}"
        assert not self._resuming
        assert not self.frees_pending, "Frees of an event left unsent"
        for s in self.memory_waiting:
            assert s.next < len(s.calls), "a planned submission still waits for memory"
            assert s.pinned_from is not None and s.pinned_from <= s.next, "a waiting submission is not pinned"
        expected: collections.Counter[int] = collections.Counter()
        for node in self.parked_nodes():
            expected.update(call_buffers(node.call))
        subs = list(self.memory_waiting)
        for ident, _ in self.program_parts:
            assert ident in self.peers, "the parts of a departed client's program are kept"
        paused = [s for s in self._paused if type(s) is Submission]
        assert len({id(s) for s in paused}) == len(paused), "a submission paused twice"
        markers = [s for s in self._paused if type(s) is not Submission]
        assert len(markers) == len(set(markers)), f"a continuation paused twice: {markers}"
        subs += paused
        for s in subs:
            if s.pinned_from is not None:
                for call in s.calls[s.next:]:
                    expected.update(call_buffers(call))
        pinned = collections.Counter({b: n for b, n in self.pinned.items() if n > 0})
        assert +expected == pinned, f"pins {dict(pinned)} != parked and waiting buffers {dict(+expected)}"
        # kept footprints are up to date (the newest 64 buffers: tests validate
        # after every event, and a long program makes thousands)
        for buf in itertools.islice(reversed(self.directory.buffers.values()), 64):
            assert buf.fp is None or buf.fp == footprint_of(buf.layouts, buf.dtype), \
                f"buffer {buf.id}: kept footprint {buf.fp} != {footprint_of(buf.layouts, buf.dtype)}"
            assert buf.lkey is None or buf.lkey == _layouts_key(buf), f"buffer {buf.id}: stale layouts key"
        for b in self.deferred:
            assert self.pinned.get(b, 0) > 0, f"release of buffer {b} deferred but it is not pinned"
