"""The fast path of a repeated op-by-op call.

A client that calls one compiled function again and again (op-by-op, e.g.
``x = f(x)``) sends ``Call`` after ``Call`` that differ only in their ids. The
general path (admission.py, dispatch.py) makes and drops per call a
``Submission``, a ``ProgramRun``, a ``ParkedNode`` and a tenant scheduler's
``Ready``, looks its plan up by the plan cache's full key and fills it in.
Here the controller remembers, per (client, program), the last few calls that
the general path sent at once with every input shard in place (no transfer,
no copy): their hosts, island, device assignment, and each new buffer's
layout, bytes per device and layouts key. A later call that matches one (the
same devices, mesh, avals, specs, which inputs are put, and each input
buffer's layouts, at the same mapping version) is planned from it: only its
ids are filled in.

What it still checks on every call, as planning does: each input buffer
exists, is the caller's, has not failed and has that shape and dtype; new ids
are the caller's, distinct and not in use; the program is registered. Then,
if no input is the output of a node not sent yet nor has copies dropped or
not made yet, every host knows the program and the tenant scheduler has room
for it now (``can_send_now``: nothing queued on the island, the window), it
goes at once: it charges the tenant scheduler, takes its place in the
island's gang order, is recorded in flight and the values put for it are
freed, in the same order and with the same messages as the general path.
Otherwise the planned call is parked as the general path parks it
(``Dispatch._start``: it waits for what it reads to be sent, and for its
turn), and goes out through the general machinery. Anything else takes the
general path: a device memory limit or calls waiting for memory, a mapping
change (a host lost or registered), a call that does not match, or any check
that fails (the general path then fails the call with its usual error).
Pure state: no sockets."""
from __future__ import annotations

import dataclasses
from typing import Any

from zpath import sharding
from zpath.controller.admission import SEND_COST
from zpath.controller.directory import Buffer, Plan, footprint_of, layouts_key, new_layout, new_layouts_key
from zpath.controller.records import InFlight, ParkedNode, Peer, ProgramRun, Submission
from zpath.controller.report_hold import may_hold
from zpath.controller.scheduler import Ready
from zpath.ids import CLIENT_SHIFT
from zpath.net import codec
from zpath.net import messages as m

FAST_KEYS = 4096       # (client, program) pairs remembered; past it all are forgotten
FAST_PER_KEY = 4       # calls remembered per pair (the newest)

_execute = codec.constructor(m.Execute)
# the slots of an Execute's place in the gang order and its hold: a parked
# call's Execute, made when it is planned and seen by no one else, gets them
# when it is sent (rather than being made again)
_set_seq = m.Execute.__dict__["seq"].__set__
_set_hold = m.Execute.__dict__["hold"].__set__
_exec_input = codec.constructor(m.ExecInput)
_exec_output = codec.constructor(m.ExecOutput)


@dataclasses.dataclass(eq=False)
class FastCall:
    """A call the general path sent at once, every input in place: what its
    repeats are planned from."""
    peer: Peer
    version: int                 # the mapping's (ResourceManager.version)
    program: str
    name: str
    devices: list[int]
    mesh_shape: list[int]
    axis_names: list[str]
    jax_ids: list[int]
    hosts: list[int]             # sorted: the gang order's
    plan_hosts: list[int]        # in the order of the devices (a plan's executes)
    island: int
    host_devices: Any            # host -> its devices in the call (ResourceManager.host_counts)
    ready: Ready                 # what the tenant scheduler is told (never queued)
    # per input: (shape, dtype, spec, put, shape as a tuple, layouts key of
    # the buffer it reads (None: a value put))
    inputs: list[tuple]
    outputs: list[tuple]         # per output: (shape, dtype, spec)
    # per new buffer, values put then outputs (the general path's order):
    # (is an output, its index, shape, dtype, layout, bytes per device, layouts key)
    new: list[tuple]
    # whether it puts any value (a call matching it puts the same inputs)
    puts: bool = False

    def signature(self) -> tuple:
        return (self.version, self.devices, self.mesh_shape, self.axis_names, self.inputs, self.outputs)


def _fast_execute(e: FastCall, call: m.Call, exec_id: int, seq: int, hold: bool) -> m.Execute:
    """The one Execute of a call planned from ``e`` (its hosts get it alike)."""
    return _execute(exec_id, seq, call.program, e.name, call.mesh_shape, call.axis_names, call.devices, e.jax_ids,
                    [_exec_input(i.buffer, i.aval, i.spec, []) for i in call.inputs],
                    [_exec_output(o.buffer, o.aval, o.spec) for o in call.outputs], hold)


class FastCalls:
    """Mixin of ControllerCore: the fast path of a repeated op-by-op call."""

    def _init_fastcalls(self) -> None:
        self.fast_calls: dict[tuple[int, str], list[FastCall]] = {}
        # exec id of a call planned here and parked -> what it was planned
        # from, until it is sent (``_fast_dispatch``) or abandoned
        self.fast_parked: dict[int, FastCall] = {}
        # calls the fast path sent at once, and those it planned and parked (tests, benchmarks)
        self.fast_sent = 0
        self.fast_planned = 0
        self.fast_unparked = 0         # of those planned, sent by _fast_dispatch

    def _fast_call(self, peer: Peer, call: m.Call) -> bool:
        """Plan a call that repeats one remembered (see the module doc) and
        send it at once, or, when it may not go yet, park it as the general
        path does; False (nothing done) if it does not repeat one, or may
        not go this way."""
        entries = self.fast_calls.get((peer.id, call.program))
        if entries is None or self.memory_limit or self.memory_waiting or peer.gone:
            return False
        rm_version = self.rm.version
        for e in reversed(entries):        # (the newest first)
            if e.version == rm_version and e.peer is peer and call.devices == e.devices \
                    and call.mesh_shape == e.mesh_shape and call.axis_names == e.axis_names \
                    and self._fast_fits(e, call):
                break
        else:
            return False
        prog = self.programs.get(call.program)
        if prog is None or prog[0] != e.name:
            return False
        if self._fast_may_go(e, call):
            self._fast_send(e, peer, call)
            return True
        # it waits (for a node it reads to be sent, or for its turn), or its
        # sending needs a repair or the program registered: planned here,
        # the rest as the general path does (Admission._advance for one call)
        puts = [i.buffer for i in call.inputs if i.put] if e.puts else []
        exec_id = self._fast_plan(e, peer, call)
        plan = Plan(dict.fromkeys(e.plan_hosts, _fast_execute(e, call, exec_id, 0, False)), [], copies=[])
        run = ProgramRun(peer, puts, 1)
        self.fast_parked[exec_id] = e
        self._start(ParkedNode(run, call, (plan, e.name), self._parked_producers(call), exec_id, e.island))
        self._maybe_release(run)
        self.fast_planned += 1
        return True

    def _fast_fits(self, e: FastCall, call: m.Call) -> bool:
        """The call's inputs and outputs are those of ``e``, and the buffers
        pass the checks planning makes (Directory._check_state, the ids'
        owner)."""
        ins, outs = call.inputs, call.outputs
        if len(ins) != len(e.inputs) or len(outs) != len(e.outputs):
            return False
        owner = e.peer.id
        buffers = self.directory.buffers
        for i, (shape, dtype, spec, put, tshape, lkey) in zip(ins, e.inputs, strict=True):
            aval = i.aval
            if i.put != put or aval.shape != shape or aval.dtype != dtype or i.spec != spec:
                return False
            b = i.buffer
            if put:
                if b in buffers or b >> CLIENT_SHIFT != owner:
                    return False
                continue
            buf = buffers.get(b)
            if buf is None or buf.owner != owner or buf.error is not None or buf.dtype != dtype \
                    or buf.shape != tshape:
                return False
            key = buf.lkey if buf.lkey is not None else layouts_key(buf)
            if key is not lkey and key != lkey:
                return False
        for o, (shape, dtype, spec) in zip(outs, e.outputs, strict=True):
            aval = o.aval
            if aval.shape != shape or aval.dtype != dtype or o.spec != spec or o.buffer in buffers \
                    or o.buffer >> CLIENT_SHIFT != owner:
                return False
        if len(ins) == 1 and len(outs) == 1:          # (the usual op-by-op call)
            return ins[0].buffer != outs[0].buffer
        n = len(ins) + len(outs)
        return n < 2 or len({*(i.buffer for i in ins), *(o.buffer for o in outs)}) == n

    def _fast_may_go(self, e: FastCall, call: m.Call) -> bool:
        """A call planned from ``e`` may be sent at once: no input is made by
        a node not sent yet, nor needs a repair (copies dropped or not made
        yet), every host knows the program, and the tenant scheduler has room."""
        parked, dropped, unsent = self.parked_outputs, self.copies_dropped, self.unsent_copies
        if parked or dropped or unsent:
            for i in call.inputs:
                b = i.buffer
                if b in parked or b in dropped or b in unsent:
                    return False
        return self._hosts_know(e, call.program) and self.tenants.can_send_now(e.ready)

    def _hosts_know(self, e: FastCall, program: str) -> bool:
        """Every host of ``e`` has ``program``."""
        host_programs = self.host_programs
        for h in e.hosts:
            known = host_programs.get(h)
            if known is None or program not in known:
                return False
        return True

    def _fast_plan(self, e: FastCall, peer: Peer, call: m.Call) -> int:
        """What planning the call changes (Directory._apply): its new buffers
        in the directory with their bytes per device. Returns its exec id."""
        owner = peer.id
        self._arrivals += 1                # (as a submission counts)
        self.calls += 1
        directory = self.directory
        buffers, held = directory.buffers, directory.device_bytes
        ins, outs = call.inputs, call.outputs
        for is_out, k, shape, dtype, layout, fp, lkey in e.new:
            b = outs[k].buffer if is_out else ins[k].buffer
            buffers[b] = Buffer(b, shape, dtype, owner, [dict(layout)], fp=fp, lkey=lkey)
            held.update(fp)
        return directory.new_exec_id()

    def _fast_send(self, e: FastCall, peer: Peer, call: m.Call) -> None:
        """What the general path does for this call, from ``e``: the new
        buffers in the directory, one Execute for all its hosts in gang order,
        the computation in flight and charged, the values put freed."""
        owner = peer.id
        exec_id = self._fast_plan(e, peer, call)
        island = e.island
        hold = may_hold(self.tenants, island, owner, False, self.memory_limit)
        seq = self.scheduler.take_seq(island)
        puts = [i.buffer for i in call.inputs if i.put] if e.puts else []
        self._fast_fly(e, peer, call, exec_id, seq, _fast_execute(e, call, exec_id, seq, hold), puts)
        self.send_budget -= SEND_COST + len(e.hosts)
        self.tenants.sent(exec_id, e.ready)
        if puts:
            self._release(puts, owner)
        self.fast_sent += 1

    def _fast_dispatch(self, e: FastCall, node: ParkedNode, hold: bool) -> int | None:
        """``_dispatch`` of a call planned from ``e`` that was parked, now
        that it goes: its one Execute (made when it was planned) gets its
        place in the gang order and ``hold``, and the computation is in flight
        as ``_fast_send`` records it. None (nothing done) where the general
        path must send it: the mapping changed, or a host lacks the program."""
        call = node.call
        if e.version != self.rm.version or not self._hosts_know(e, call.program):
            return None
        island = e.island
        seq = self.scheduler.take_seq(island)
        ex = next(iter(node.planned[0].executes.values()))
        _set_seq(ex, seq)
        _set_hold(ex, hold)
        self._fast_fly(e, node.run.peer, call, node.exec_id, seq, ex,
                       [i.buffer for i in call.inputs if i.put] if e.puts else [])
        self.fast_unparked += 1
        return node.exec_id

    def _fast_fly(self, e: FastCall, peer: Peer, call: m.Call, exec_id: int, seq: int, ex: m.Execute,
                  puts: list[int]) -> None:
        """The computation of a call planned from ``e`` in flight, and its one
        Execute to all its hosts in gang order."""
        self.in_flight[exec_id] = InFlight(peer.id, peer.ident, e.name, e.island, seq, e.ready.devices,
                                           set(e.hosts), e.host_devices, [o.buffer for o in call.outputs], [],
                                           puts)
        self.to_hosts(self.scheduler.place_shared(e.hosts, ex))

    def _learn_call(self, peer: Peer, call: m.Call, sub: Submission) -> None:
        """The general path planned a one-call submission: if it was sent at
        once with every input in place, remember it for its repeats."""
        exec_id = sub.exec_ids.get(0)
        info = self.in_flight.get(exec_id) if exec_id is not None else None
        if info is None or info.pieces or info.copies or info.fused or info.transient is not None \
                or info.client != peer.id or self.memory_limit or peer.gone:
            return
        prog = self.programs.get(call.program)
        ins, outs = call.inputs, call.outputs
        ids = [i.buffer for i in ins] + [o.buffer for o in outs]
        if prog is None or len(set(ids)) != len(ids):
            return
        buffers = self.directory.buffers
        inputs = []
        for i in ins:
            key = None
            if not i.put:
                buf = buffers.get(i.buffer)
                if buf is None:
                    return
                key = layouts_key(buf)
            inputs.append((i.aval.shape, i.aval.dtype, i.spec, i.put, tuple(i.aval.shape), key))
        new = []
        try:
            for k, i in enumerate(ins):
                if i.put:
                    new.append((False, k, *self._made(call, i.aval, i.spec)))
            for k, o in enumerate(outs):
                made = self._made(call, o.aval, o.spec)
                buf = buffers.get(o.buffer)
                if buf is None or buf.layouts != [made[2]]:
                    return                 # (not what the directory made: never sent this way)
                new.append((True, k, *made))
        except (ValueError, KeyError):
            return
        rm = self.rm
        devices = tuple(call.devices)
        e = FastCall(peer, rm.version, call.program, prog[0], call.devices, call.mesh_shape, call.axis_names,
                     [rm.devices[d].jax_id for d in call.devices], sorted(info.hosts),
                     list(dict.fromkeys(rm.devices[d].host for d in call.devices)), info.island,
                     info.host_devices, Ready(peer.id, info.island, devices, (call.program, devices), None),
                     inputs, [(o.aval.shape, o.aval.dtype, o.spec) for o in outs], new,
                     any(i.put for i in ins))
        key = (peer.id, call.program)
        entries = self.fast_calls.get(key)
        if entries is None:
            if len(self.fast_calls) >= FAST_KEYS:
                self.fast_calls.clear()
            entries = self.fast_calls[key] = []
        sig = e.signature()
        entries[:] = [x for x in entries if x.version == rm.version and x.peer is peer and x.signature() != sig]
        entries.append(e)
        del entries[:-FAST_PER_KEY]

    def _made(self, call: m.Call, aval: m.Aval, spec: m.Spec) -> tuple:
        """A new buffer's (shape, dtype, layout, bytes per device, layouts
        key) as the directory plans it (Directory._lower)."""
        layout = new_layout(call.devices, sharding.regions(aval.shape, call.mesh_shape, call.axis_names, spec))
        return (tuple(aval.shape), aval.dtype, layout, footprint_of([layout], aval.dtype),
                self.directory.intern(new_layouts_key(layout)))

    def validate_fastcalls(self) -> None:
        """At most FAST_PER_KEY calls remembered per (client, program), each
        of that client and program."""
        for (client, program), entries in self.fast_calls.items():
            assert 0 < len(entries) <= FAST_PER_KEY, f"{len(entries)} fast calls of client {client}"
            for e in entries:
                assert e.peer.id == client and e.program == program, "a fast call kept under another key"
        if self.fast_parked:
            parked = {node.exec_id for node in self.parked_nodes()}
            for exec_id in self.fast_parked:
                assert exec_id in parked, f"fast call {exec_id} remembered as parked, but it is not"
