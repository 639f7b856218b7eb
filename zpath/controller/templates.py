"""Program templates and fused programs.

A client that runs one traced program many times defines it once
(``DefineProgram``) and then sends each run as one small ``RunProgram``: the
buffers in its *slots* (the call inputs not made inside the program: existing
buffers, and values the client puts for the run) and where its new buffers
start. The controller keeps the program's calls with buffer ids as *codes*:
``n >= 0`` is the run's ``first_buffer + n``, ``n < 0`` its ``inputs[-n - 1]``.

A template whose run needs no transfer between hosts (every node reads its
inputs where they already are) on one island is *fused*: each of its hosts
keeps its part of the plan (``DefineFused``, sent once), and a run is one
computation in the island's gang order (``RunFused``), one directory entry
per result and per value put, one ``ExecDone`` per host. Its intermediates
never reach the directory: each host frees them once the run has finished.
Pure state: no sockets."""
from __future__ import annotations

import dataclasses

from zpath import sharding
from zpath.controller.directory import (Buffer, Plan, footprint, footprint_of, host_shards, layouts_key,
                                       spec_key)
from zpath.ids import client_of, serial_of
from zpath.net import messages as m

MAX_TEMPLATES = 1024          # per client (zpath.client.connection.MAX_TEMPLATES)
MAX_TEMPLATE_BUFFERS = 1 << 20
FUSE_TRIES = 3                # runs that may find a template not fusable before it is given up


class TemplateError(ValueError):
    pass


@dataclasses.dataclass
class Fused:
    """A template's plan for one mapping version and one set of input layouts."""
    id: int
    version: int
    island: int
    hosts: list[int]
    defines: dict[int, m.DefineFused]
    programs: list[str]
    devices: list[int]
    nodes: int
    slot_keys: list[tuple]                 # what each slot must be (see slot_keys)
    call_inputs: list[tuple[int, m.Aval, m.Spec, bool]]   # (slot, aval, spec, put), each slot once
    results: list[tuple[int, m.Aval, m.Spec, list[dict], dict[int, int]]]
    # (offset, aval, spec, layouts, bytes per device) per result
    puts: list[tuple[int, m.Aval, dict, dict[int, int]]]
    # (slot, aval, layout, bytes per device) per value put
    transient: dict[int, int] = dataclasses.field(default_factory=dict)
    # bytes per device its intermediates take while it runs (see _transient)


class ProgramTemplate:
    """A client's program kept by the controller (see module doc)."""

    def __init__(self, msg: m.DefineProgram, client: int) -> None:
        prog = msg.program
        if prog.dispatch != "parallel":
            raise TemplateError("only programs with parallel dispatch are kept as templates")
        if not 0 < msg.buffers <= MAX_TEMPLATE_BUFFERS:
            raise TemplateError(f"a template makes 1 to {MAX_TEMPLATE_BUFFERS} buffers, not {msg.buffers}")
        first, n = msg.first_buffer, msg.buffers
        _check_block(client, first, n)
        self.name = prog.name
        made: set[int] = set()
        self.put: list[bool] = []          # per slot: a value the client puts for the run
        # per call: (program, mesh shape, axis names, devices, inputs, outputs),
        # an input or output being (code, aval, spec)
        self.calls: list[tuple] = []
        for call in prog.calls:
            ins = []
            for i in call.inputs:
                if first <= i.buffer < first + n:
                    if i.buffer not in made or i.put:
                        raise TemplateError(f"buffer {i.buffer} is read before a call makes it")
                    ins.append((i.buffer - first, i.aval, i.spec))
                    continue
                slot = len(self.put)
                if slot >= len(msg.inputs) or msg.inputs[slot] != i.buffer:
                    raise TemplateError("the slots do not match the calls' inputs")
                self.put.append(i.put)
                ins.append((-slot - 1, i.aval, i.spec))
            outs = []
            for o in call.outputs:
                if not first <= o.buffer < first + n or o.buffer in made:
                    raise TemplateError(f"output buffer {o.buffer} is not a new one of the template")
                made.add(o.buffer)
                outs.append((o.buffer - first, o.aval, o.spec))
            self.calls.append((call.program, call.mesh_shape, call.axis_names, call.devices, ins, outs))
        if len(self.put) != len(msg.inputs):
            raise TemplateError("the slots do not match the calls' inputs")
        # a value put is read again under its slot's id: which put slot each slot reads
        self.reads_put: list[int | None] = []
        put_slot = {}
        for s, b in enumerate(msg.inputs):
            if self.put[s]:
                if b in put_slot:
                    raise TemplateError(f"buffer {b} is put twice")
                put_slot[b] = s
                self.reads_put.append(None)
            else:
                self.reads_put.append(put_slot.get(b))
        self.release = []
        for b in prog.release:
            if first <= b < first + n:
                self.release.append(b - first)
            elif b in put_slot:
                self.release.append(-put_slot[b] - 1)
            else:
                raise TemplateError("a template releases only its new buffers and the values it puts")
        self.buffers = n
        released = set(self.release)
        self.results = [b - first for b in sorted(made) if b - first not in released]
        self.fused: Fused | None = None
        self.fuse_tries = 0

    def check_run(self, client: int, inputs: list[int], first: int) -> None:
        if len(inputs) != len(self.put):
            raise TemplateError(f"the template has {len(self.put)} slots, the run fills {len(inputs)}")
        _check_block(client, first, self.buffers)
        for s, b in enumerate(inputs):
            if self.put[s] and client_of(b) != client:
                raise TemplateError(f"buffer {b} put for the run is not this client's")
            p = self.reads_put[s]
            if p is not None and inputs[p] != b:
                raise TemplateError(f"slot {s} must read the value put in slot {p}")

    def expand(self, call_id: int, inputs: list[int], first: int) -> tuple[list[m.Call], list[int]]:
        """A run as plain calls, and the buffers to release after it."""
        def buf(code: int) -> int:
            return first + code if code >= 0 else inputs[-code - 1]
        put = self.put
        calls = [m.Call(call_id, program, mesh_shape, axis_names, devices,
                        [m.CallInput(buf(c), aval, spec, c < 0 and put[-c - 1]) for c, aval, spec in ins],
                        [m.CallOutput(first + c, aval, spec) for c, aval, spec in outs])
                 for program, mesh_shape, axis_names, devices, ins, outs in self.calls]
        return calls, [buf(c) for c in self.release]

    def slot_keys(self, buffers: dict[int, Buffer], inputs: list[int]) -> list[tuple | None]:
        """What each slot is now: a value to put (its id must be new), a read
        of a value put in an earlier slot, or an existing buffer (its owner,
        shape, dtype and layouts); None for a slot that cannot be read."""
        keys: list[tuple | None] = []
        for s, b in enumerate(inputs):
            if self.put[s]:
                keys.append(("put",) if b not in buffers else None)
            elif self.reads_put[s] is not None:
                keys.append(("reads", self.reads_put[s]))
            else:
                buf = buffers.get(b)
                keys.append(None if buf is None or buf.error is not None else
                            (buf.owner, tuple(buf.shape), buf.dtype, layouts_key(buf)))
        return keys

    def fuse(self, fused_id: int, version: int, plans: list[Plan], island_of: dict[int, int],
             host_of: dict[int, int], before: list[tuple | None], buffers: dict[int, Buffer],
             inputs: list[int], first: int) -> Fused | None:
        """The fused plan made from one run's plans (``plans[k]`` for call
        ``k``), or None if the run moved data between hosts, spans islands,
        changed where an input lives (``before``: the slot keys before it), or
        uses different devices of one host in different nodes (a fused run is
        one computation on each host: nodes that could run side by side on
        other devices would run one after the other)."""
        if len(plans) != len(self.calls) or any(p.sends for p in plans):
            return None
        groups = _host_groups(plans)
        islands = {island_of[h] for hosts, _ in groups for h in hosts}
        if len(islands) != 1:
            return None
        mine: dict[int, dict[int, frozenset[int]]] = {}     # id of an Execute -> host -> its devices
        for hosts, runs in groups:
            if len({tuple(ex.devices) for _, ex in runs}) <= 1:
                continue                # every node on the same devices: each host uses one set
            for h in hosts:
                local: set[frozenset[int]] = set()
                for _, ex in runs:
                    by_host = mine.get(id(ex))
                    if by_host is None:          # (hosts sent one Execute alike: worked out once)
                        sets: dict[int, list[int]] = {}
                        for d in ex.devices:
                            sets.setdefault(host_of[d], []).append(d)
                        by_host = mine[id(ex)] = {k: frozenset(v) for k, v in sets.items()}
                    local.add(by_host.get(h, frozenset()))
                if len(local) > 1:
                    return None
        after = self.slot_keys(buffers, inputs)
        if any(k is None for k in before) or \
                any(not put and a != b for put, a, b in zip(self.put, after, before, strict=True)):
            return None
        results = []
        for c in self.results:
            buf = buffers.get(first + c)
            if buf is None or buf.error is not None:
                return None
            copied = [{r: list(devs) for r, devs in lay.items()} for lay in buf.layouts]
            results.append((c, *self._output(c), copied, footprint(buf)))
        # one fused Execute per distinct plan Execute (the plan sends hosts one alike
        # where every input is in place), its shards as the plan has them (empty:
        # each worker names its own, as for an Execute)
        devices: set[int] = set()
        seen: dict[int, tuple] = {}
        layouts: dict[int, dict] = {}        # put slot -> its layout
        for (program, _, _, devs, ins, outs), plan in zip(self.calls, plans, strict=True):
            devices.update(devs)
            for c, aval, spec in ins:
                if c < 0 and -c - 1 not in seen:
                    seen[-c - 1] = (-c - 1, aval, spec, self.put[-c - 1])
            put = [(j, c) for j, (c, _, _) in enumerate(ins) if c < 0 and self.put[-c - 1]]
            if not put:
                continue
            done: set[int] = set()
            for h, ex in plan.executes.items():
                first_host = id(ex) not in done
                done.add(id(ex))
                for j, c in put:
                    # a put slot's layout: the shards each host names, or (left to the
                    # workers) every device's region, once per Execute
                    i = ex.inputs[j]
                    if i.shards or first_host:
                        _put_layout(layouts.setdefault(-c - 1, {}), ex, i, h, host_of)
        puts = [(s, aval, layouts[s], footprint_of([layouts[s]], aval.dtype))
                for s, aval, _, put in seen.values() if put]
        transient = _transient(self.calls, plans, {c for c in self.release if c >= 0})
        release = [c for c in self.release if c >= 0]      # the values put are freed as buffers
        # hosts whose node lists are the same get one DefineFused (encoded once, relayed)
        made: dict[int, m.Execute] = {}       # id of a plan's Execute -> the fused one
        by_host: dict[int, m.DefineFused] = {}
        for hosts, runs in groups:
            exs = []
            for k, ex in runs:
                fx = made.get(id(ex))
                if fx is None:
                    ins, outs = self.calls[k][4], self.calls[k][5]
                    fx = made[id(ex)] = m.Execute(
                        0, 0, ex.program, ex.name, ex.mesh_shape, ex.axis_names, ex.devices, ex.jax_ids,
                        [m.ExecInput(c, i.aval, i.spec, i.shards) for (c, _, _), i in zip(ins, ex.inputs, strict=True)],
                        [m.ExecOutput(c, o.aval, o.spec) for (c, _, _), o in zip(outs, ex.outputs, strict=True)])
                exs.append(fx)
            by_host.update(dict.fromkeys(hosts, m.DefineFused(fused_id, exs, release)))
        defines = dict(sorted(by_host.items()))
        return Fused(fused_id, version, islands.pop(), list(defines), defines,
                     sorted({c[0] for c in self.calls}), sorted(devices), len(self.calls), before,
                     list(seen.values()), results, puts, transient)

    def _output(self, code: int) -> tuple[m.Aval, m.Spec]:
        for *_, outs in self.calls:
            for c, aval, spec in outs:
                if c == code:
                    return aval, spec
        raise KeyError(code)


def _host_groups(plans: list[Plan]) -> list[tuple[list[int], list[tuple[int, m.Execute]]]]:
    """Hosts whose node lists are the same, each group with the plan Executes
    they run (call index, Execute), in call order: one group where every node
    sends all the same hosts one Execute (SPMD), else worked out per host."""
    if not plans:
        return []
    hosts = plans[0].executes.keys()
    runs = []
    for k, p in enumerate(plans):
        exs = p.executes.values()
        if p.executes.keys() != hosts or len(set(map(id, exs))) != 1:
            break
        runs.append((k, next(iter(exs))))
    else:
        return [(sorted(hosts), runs)]
    per_host: dict[int, list[tuple[int, m.Execute]]] = {}
    for k, p in enumerate(plans):
        for h, ex in p.executes.items():
            per_host.setdefault(h, []).append((k, ex))
    groups: dict[tuple[int, ...], tuple[list[int], list[tuple[int, m.Execute]]]] = {}
    for h in sorted(per_host):
        mine = per_host[h]
        groups.setdefault(tuple(id(ex) for _, ex in mine), ([], mine))[0].append(h)
    return list(groups.values())


def _put_layout(layout: dict, ex: m.Execute, inp: m.ExecInput, host: int, host_of: dict[int, int]) -> None:
    """Add to a put slot's layout (region -> devices) the shards of ``inp``
    that ``ex`` reads: those it names (one host's), or, where it leaves them
    to the workers, every device's region its spec gives (all its hosts')."""
    if inp.shards:
        for sh in host_shards(ex, inp, host, host_of.__getitem__):
            layout.setdefault(sharding.from_wire(sh.region), []).append(sh.device)
        return
    regs = sharding.regions_of(inp.aval.shape, ex.mesh_shape, ex.axis_names, inp.spec)
    for p, d in enumerate(ex.devices):
        layout.setdefault(regs[p], []).append(d)


def _transient(calls: list[tuple], plans: list[Plan], intermediates: set[int]) -> dict[int, int]:
    """Bytes per device a fused run's intermediates take while it runs (the
    worker keeps them all until the run ends): each intermediate's shards as
    made, and, where a node reads one with other devices or another spec, the
    shards assembled for that node too."""
    per: dict[tuple[int, ...], int] = {}      # devices -> bytes on each
    made: dict[int, tuple] = {}           # intermediate -> (devices, mesh, spec) it was made with

    def add(aval: m.Aval, spec: m.Spec, ex: m.Execute) -> None:
        # one shard per device, all of one size (a spec splits a dimension evenly)
        regions = sharding.regions_of(aval.shape, ex.mesh_shape, ex.axis_names, spec)
        devs = tuple(ex.devices)
        per[devs] = per.get(devs, 0) + sharding.nbytes(regions[0], aval.dtype)

    for (_, _, _, _, ins, outs), plan in zip(calls, plans, strict=True):
        ex = next(iter(plan.executes.values()))
        where = (tuple(ex.devices), tuple(ex.mesh_shape), tuple(ex.axis_names))
        for c, aval, spec in ins:
            if c in intermediates and made.get(c) != (where, spec_key(spec)):
                add(aval, spec, ex)
        for c, aval, spec in outs:
            if c in intermediates:
                made[c] = (where, spec_key(spec))
                add(aval, spec, ex)
    out: dict[int, int] = {}
    for devs, n in per.items():          # (nodes on the same devices: added once)
        for d in devs:
            out[d] = out.get(d, 0) + n
    return out


def _check_block(client: int, first: int, n: int) -> None:
    if client_of(first) != client or client_of(first + n - 1) != client or serial_of(first) == 0:
        raise TemplateError(f"new buffers {first}..{first + n - 1} are not this client's")


def fused_call(f: Fused, call_id: int, inputs: list[int], first: int) -> m.Call:
    """The one call a fused run stands for: what it reads and makes, on the
    union of its devices (for pinning, failing and scheduling it)."""
    return m.Call(call_id, f"fused:{f.id}", [len(f.devices)], ["fused"], f.devices,
                  [m.CallInput(inputs[s], aval, spec, put) for s, aval, spec, put in f.call_inputs],
                  [m.CallOutput(first + c, aval, spec) for c, aval, spec, _, _ in f.results])


def fused_buffers(f: Fused, owner: int, inputs: list[int], first: int
                  ) -> list[tuple[Buffer, dict[int, int]]]:
    """Directory entries for a fused run's values put and results, with their
    bytes per device."""
    out = [(Buffer(inputs[s], tuple(aval.shape), aval.dtype, owner,
                   [{r: list(devs) for r, devs in layout.items()}], fp=fp), fp)
           for s, aval, layout, fp in f.puts]
    out += [(Buffer(first + c, tuple(aval.shape), aval.dtype, owner,
                    [{r: list(devs) for r, devs in lay.items()} for lay in layouts], fp=fp), fp)
            for c, aval, _, layouts, fp in f.results]
    return out


def run_plan(f: Fused, exec_id: int, inputs: list[int], first: int) -> Plan:
    run = m.RunFused(exec_id, 0, f.id, inputs, first)      # the same for every host: encoded once
    return Plan(dict.fromkeys(f.hosts, run), [],
                programs=f.programs, setup=f.defines, transient=f.transient or None)
