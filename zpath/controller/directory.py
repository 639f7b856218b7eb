"""Object directory and call planner.

The directory knows every logical buffer: its shape, dtype, owner, and where its
shards live. A buffer may have several *layouts* (one per way it has been
sharded); each layout maps regions to the devices holding a copy.

:meth:`Directory.plan` turns one call into actions: for every host it touches an
``Execute`` with that host's part, and ``SendPiece`` orders for the shards that
must move between hosts. It is pure: no sockets. What it lowers a call to
depends on shapes, devices and where the inputs live, not on buffer ids nor on
the program, so the lowered plan is cached per (call shape, input layouts,
mapping version) and each call only fills in its ids and its program: a new
program over the devices and shardings of one planned before is planned as
cheaply as a repeat."""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from typing import Any, Callable, Collection, Sequence

import numpy as np

from zpath.errors import ErrorKind
from zpath import sharding
from zpath.net import codec
from zpath.net import messages as m
from zpath.sharding import Region


PLAN_CACHE_SIZE = 4096      # lowered plans kept (least recently used first out)
PLAN_CACHE_WEIGHT = 1 << 20  # and their total size, in shards, pieces and layout regions
# a ShardInput without the frozen __init__ (a new plan over thousands of devices makes one each)
_shard_input = codec.constructor(m.ShardInput)


class PlanError(Exception):
    def __init__(self, code: str, message: str, error: m.ErrorInfo | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.error = error


@dataclasses.dataclass(slots=True)
class Buffer:
    id: int
    shape: tuple[int, ...]
    dtype: str
    owner: int
    layouts: list[dict[Region, list[int]]] = dataclasses.field(default_factory=list)
    error: m.ErrorInfo | None = None
    # layouts of copies planned for a computation that has not finished well
    # yet (the copy may never be made: see Directory.confirm)
    unmade: list[dict[Region, list[int]]] = dataclasses.field(default_factory=list)
    # hosts that may hold shards of it outside its layouts (a copy forgotten
    # after its maker failed, shards a re-planned node assembles): freed there too
    stray: frozenset[int] = frozenset()
    # its bytes per device (footprint), once worked out; None whenever the
    # layouts change
    fp: dict[int, int] | None = dataclasses.field(default=None, repr=False, compare=False)
    # its layouts_key, once worked out; None whenever the layouts change
    lkey: tuple | None = dataclasses.field(default=None, repr=False, compare=False)

    def made_layouts(self) -> list[dict[Region, list[int]]]:
        """Its layouts that hold data (or will, once what makes them finishes):
        all but copies not confirmed yet."""
        return [lay for lay in self.layouts if not any(lay is u for u in self.unmade)]


@dataclasses.dataclass(slots=True)
class Plan:
    executes: dict[int, m.Execute]       # or m.RunFused (a fused program's run)
    sends: list[tuple[int, m.SendPiece]]
    programs: list[str] | None = None    # programs its hosts need (None: the call's)
    setup: dict[int, m.DefineFused] | None = None   # per host, sent before its first run
    # copies of inputs it makes: (buffer, the layout recorded for it), to confirm
    # once it has finished without error
    copies: list[tuple[int, dict]] = dataclasses.field(default_factory=list)
    # bytes per device it holds only while it runs (a fused run's
    # intermediates): counted in device_bytes from when it is planned until
    # it has finished or is abandoned
    transient: dict[int, int] | None = None


class Directory:
    def __init__(self, host_of: Callable[[int], int],
                 address_of: Callable[[int], str] = lambda h: "",
                 jax_id_of: Callable[[int], int] = lambda d: d,
                 route_of: Callable[[int, int], tuple[str, str, str, str]] | None = None,
                 mapping_version: Callable[[], int] = lambda: 0,
                 plan_cache_size: int = PLAN_CACHE_SIZE,
                 plan_cache_weight: int = PLAN_CACHE_WEIGHT) -> None:
        """``host_of`` maps a global device id to its host rank, ``address_of`` a
        host rank to its data address, ``route_of`` (source host, destination
        host) to (channel, data address, destination machine id, CURVE key); without
        it every transfer is plain ICI to ``address_of``.

        Lowered plans are cached (at most ``plan_cache_size`` of them and
        ``plan_cache_weight`` shards, pieces and layout regions in all, least
        recently used first out; 0: no cache) per ``mapping_version()``, which
        must change whenever what ``host_of``, ``jax_id_of`` or ``route_of`` answer
        may have changed (ResourceManager.version)."""
        self.buffers: dict[int, Buffer] = {}
        self.host_of = host_of
        self.address_of = address_of
        self.jax_id_of = jax_id_of
        # bytes held per device, each region counted once per device
        self.device_bytes = DeviceBytes()
        self.route_of = route_of or (lambda src, dst: ("ICI", self.address_of(dst), "", ""))
        self._piece_ids = itertools.count(1)
        self._exec_ids = itertools.count(1)
        self.mapping_version = mapping_version
        self._cache: collections.OrderedDict[tuple, _Template] = collections.OrderedDict()
        self._cache_max = max(0, plan_cache_size)
        self._cache_max_weight = plan_cache_weight
        self._cache_weight = 0
        self._cache_version: int | None = None
        self._lkeys: dict[LayoutsKey, LayoutsKey] = {}     # one object per layouts key (see intern)
        self._lkeys_weight = 0
        self.cache_hits = 0
        self.cache_misses = 0

    def poison(self, buffer_ids: list[int], owner: int, error: m.ErrorInfo) -> None:
        """Record buffers whose producing call failed, so consumers fail with the
        same root cause."""
        for b in buffer_ids:
            buf = self.buffers.get(b)
            if buf is None:
                self.buffers[b] = Buffer(b, (), "", owner, error=error)
            else:
                buf.error = error

    def release(self, buffer_ids: list[int], owner: int) -> dict[int, list[int]]:
        """Forget buffers the owner no longer references. Returns, per host, the
        buffers whose shards it must free. Buffers of other owners are ignored."""
        gone: list[tuple[int, tuple[int, ...]]] = []          # (buffer, its hosts in order)
        for b in buffer_ids:
            buf = self.buffers.get(b)
            if buf is None or buf.owner != owner:
                continue
            del self.buffers[b]
            fp = footprint(buf)
            self.device_bytes.subtract(fp)
            hosts = fp.sorted_hosts(self.host_of)
            gone.append((b, tuple(sorted(set(hosts) | buf.stray)) if buf.stray else hosts))
        if gone and all(hosts is gone[0][1] or hosts == gone[0][1] for _, hosts in gone):
            # (the usual case: every host frees the same, one list for all)
            freed = [b for b, _ in gone]
            return {h: freed for h in gone[0][1]}
        frees: dict[int, list[int]] = {}
        for b, hosts in gone:
            for h in hosts:
                frees.setdefault(h, []).append(b)
        return frees

    def drop_devices(self, devices: set[int], error: m.ErrorInfo) -> dict[int, list[int]]:
        """Forget every copy on these (lost) devices. A layout that loses a region
        is dropped (layouts must tile the array); a buffer left with no layout
        fails with ``error``. Returns, per owner, the buffers that failed."""
        failed: dict[int, list[int]] = {}
        for buf in self.buffers.values():
            if buf.error is not None or not buf.layouts:
                continue
            before = footprint(buf)
            kept = []
            for lay in buf.layouts:
                left = {r: [d for d in devs if d not in devices] for r, devs in lay.items()}
                if all(left.values()):
                    lay.update(left)      # in place: a plan's copies keep their identity
                    kept.append(lay)
            buf.layouts = kept
            buf.fp = buf.lkey = None
            buf.unmade = [u for u in buf.unmade if any(u is k for k in kept)]
            self.device_bytes.subtract(before)
            self.device_bytes.update(footprint(buf))
            if not kept:
                buf.error = error
                failed.setdefault(buf.owner, []).append(buf.id)
        return failed

    def drop_copies(self, copies: list[tuple[int, dict]], error: m.ErrorInfo) -> list[int]:
        """Copies planned for a computation that will never run: forget them.
        Returns the buffers left with no copy at all (they fail with ``error``)."""
        failed = []
        for b, lay in copies:
            buf = self.buffers.get(b)
            if buf is None or not any(u is lay for u in buf.layouts):
                continue
            before = footprint(buf)
            buf.layouts = [u for u in buf.layouts if u is not lay]
            buf.fp = buf.lkey = None
            buf.unmade = [u for u in buf.unmade if u is not lay]
            buf.stray = buf.stray.union(self.host_of(d) for devs in lay.values() for d in devs)
            self.device_bytes.subtract(before)
            self.device_bytes.update(footprint(buf))
            if not buf.layouts and buf.error is None:
                buf.error = error
                failed.append(b)
        return failed

    def repair(self, plan: Plan, buffers: Collection[int],
               unusable: Callable[[int, dict], bool] = lambda b, lay: False,
               own: Callable[[int, dict], bool] = lambda b, lay: False) -> list[int]:
        """A plan made while copies of ``buffers`` were planned that it must
        not read now: copies dropped since (their maker failed or was
        abandoned), or copies whose maker has not been sent yet (``unusable``).
        Each input shard of those buffers that reads, or assembles from, a
        shard that no usable layout holds is assembled anew from a usable
        layout, with new ``SendPiece`` orders (those of the old pieces go).
        The plan's ``own`` copies (made by this very computation, from another
        of its inputs) may be read where it was planned to, but are never a
        source. The shards it assembles are not recorded as copies (nothing
        plans to read them, and ``device_bytes`` leaves them out), only their
        hosts, to free them there. Returns the buffers it had to move and could
        not: no layout left is usable (the node cannot run; the plan is left as
        it was for them)."""
        dropped_pieces: set[int] = set()
        stuck: list[int] = []
        for host, ex in list(plan.executes.items()):
            if type(ex) is not m.Execute:      # a fused run moves no data
                continue
            inputs = None
            for k, inp in enumerate(ex.inputs):
                b = inp.buffer
                buf = self.buffers.get(b)
                if b not in buffers or buf is None:
                    continue
                readable = [lay for lay in buf.layouts if not unusable(b, lay)]
                lays = [lay for lay in readable if not own(b, lay)]      # sources

                def held(dev: int, region: list) -> bool:
                    r = sharding.from_wire(region)
                    return any(dev in lay.get(r, ()) for lay in readable)
                shards = None
                current = host_shards(ex, inp, host, self.host_of)
                for j, s in enumerate(current):
                    if (held(s.device, s.region) if not s.pieces
                            else all(held(p.device, p.region) for p in s.pieces)):
                        continue
                    if not lays:
                        stuck.append(b)
                        break
                    sends: list[tuple] = []
                    pieces = self._pieces(lays, b, 0, sharding.from_wire(s.region), host, sends)
                    pids = [next(self._piece_ids) for _ in sends]
                    for pid, (src, _, dev, reg, sub, dst, address, channel, machine, key) in zip(pids, sends):
                        plan.sends.append((src, m.SendPiece(pid, b, dev, reg, sub, dst, address,
                                                            channel, machine, key)))
                    dropped_pieces.update(p.piece_id for p in s.pieces if p.piece_id)
                    buf.stray = buf.stray | {host}
                    shards = shards or list(current)
                    shards[j] = m.ShardInput(s.device, s.region, [
                        m.PieceSource(0 if n < 0 else pids[n], dev, reg, sub) for n, dev, reg, sub in pieces])
                if shards is not None:
                    inputs = inputs or list(ex.inputs)
                    inputs[k] = m.ExecInput(b, inp.aval, inp.spec, shards)
            if inputs is not None:
                plan.executes[host] = dataclasses.replace(ex, inputs=inputs)
        if dropped_pieces:
            plan.sends[:] = [(src, sp) for src, sp in plan.sends if sp.piece_id not in dropped_pieces]
        return stuck

    def confirm(self, copies: list[tuple[int, dict]]) -> None:
        """The computation that made these copies finished without error: they
        hold data now."""
        for b, lay in copies:
            buf = self.buffers.get(b)
            if buf is not None:
                buf.unmade = [u for u in buf.unmade if u is not lay]

    def needs(self, call: m.Call) -> dict[int, int]:
        """Bytes the call would add per device (outputs, client values, input
        copies it must assemble), without changing anything. Calls that cannot be
        planned need nothing (they will fail)."""
        need: dict[int, set] = {}
        try:
            mesh = (call.mesh_shape, call.axis_names)
            for i in call.inputs:
                buf = self.buffers.get(i.buffer)
                for d, r in zip(call.devices, sharding.regions_of(i.aval.shape, *mesh, i.spec), strict=True):
                    if i.put or buf is None or not any(d in lay.get(r, ()) for lay in buf.layouts):
                        need.setdefault(d, set()).add((i.buffer, r, i.aval.dtype))
            for o in call.outputs:
                for d, r in zip(call.devices, sharding.regions_of(o.aval.shape, *mesh, o.spec), strict=True):
                    need.setdefault(d, set()).add((o.buffer, r, o.aval.dtype))
        except (ValueError, KeyError):
            return {}
        return {d: sum(sharding.nbytes(r, dt) for _, r, dt in items) for d, items in need.items()}

    def new_exec_id(self) -> int:
        return next(self._exec_ids)

    def owned(self, owner: int) -> list[int]:
        """Every buffer of an owner (to release them all when it leaves)."""
        return [b for b, buf in self.buffers.items() if buf.owner == owner]

    def plan(self, call: m.Call, owner: int, name: str) -> Plan:
        """Plan one call: per host an ``Execute``, and the ``SendPiece`` orders
        for the shards that move. Checks everything before changing any state.

        The lowered plan (computations, device assignments, transfers) depends on
        the call's shapes and on where its inputs live, not on buffer ids nor on
        the program it runs: it is lowered once per key (see :meth:`_key`) into a
        :class:`_Template`, and each call only fills in its ids and program and
        applies the state changes. Checks that depend on the buffers' current
        state run on every call."""
        key = self._key(call) if self._cache_max else None
        if key is not None:
            t = self._cache.get(key)
            if t is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                self._check_state(call, owner)
                return self._apply(t, call, owner, name)
            self.cache_misses += 1
        hosts = self._check_mesh(call)
        _check_sizes(call)
        self._check_state(call, owner)
        t = self._lower(call, hosts)
        if key is not None:
            self._store(key, t)
        return self._apply(t, call, owner, name)

    # ---- plan cache -------------------------------------------------------------

    def _key(self, call: m.Call) -> tuple | None:
        """Everything a plan depends on except buffer ids and the program:
        devices, mesh, each input's aval, spec, put flag and (not a put) its
        buffer's layouts, each output's aval and spec, which slots name the
        same buffer, and the mapping version. None (not cached) when an input
        cannot be read: the call fails.

        The program (its digest and name) is left out: lowering reads nothing
        of it (``_lower`` and ``_Template`` hold no program; ``_apply`` puts
        the call's own in each Execute), since the controller plans from the
        shapes and shardings the call declares, never from the program's
        code. So a new program's first run over devices and shardings planned
        before (another program's, or a warm-up's) is a cache hit."""
        version = self.mapping_version()
        if version != self._cache_version:
            self._cache.clear()
            self._cache_weight = 0
            self._cache_version = version
        ins = []
        for i in call.inputs:
            if i.put:
                ins.append((tuple(i.aval.shape), i.aval.dtype, spec_key(i.spec)))
                continue
            buf = self.buffers.get(i.buffer)
            if buf is None or buf.error is not None:
                return None
            if buf.lkey is None:
                buf.lkey = self.intern(_layouts_key(buf))
            ins.append((tuple(i.aval.shape), i.aval.dtype, spec_key(i.spec), buf.lkey))
        outs = tuple((tuple(o.aval.shape), o.aval.dtype, spec_key(o.spec)) for o in call.outputs)
        ids = [i.buffer for i in call.inputs] + [o.buffer for o in call.outputs]
        # which slots name one buffer: duplicates change the plan (a second read
        # sees the first one's copy; a second create replaces the first)
        aliases = None if len(set(ids)) == len(ids) else tuple(ids.index(b) for b in ids)
        return (tuple(call.devices), tuple(call.mesh_shape), tuple(call.axis_names), tuple(ins), outs,
                aliases, version)

    def intern(self, key: LayoutsKey) -> LayoutsKey:
        """The one object kept for this layouts key (see ``LayoutsKey``)."""
        kept = self._lkeys.get(key)
        if kept is None:
            weight = sum(len(lay) for lay in key)
            if self._lkeys_weight + weight > LKEYS_REGIONS:
                self._lkeys.clear()
                self._lkeys_weight = 0
            kept = self._lkeys[key] = key
            self._lkeys_weight += weight
        return kept

    def _store(self, key: tuple, t: "_Template") -> None:
        weight = t.weight + sum(len(lay) for k in key[3] if len(k) == 4 for lay in k[3])
        if weight > self._cache_max_weight:
            return
        self._cache[key] = t
        self._cache_weight += weight
        t.cached_weight = weight
        while len(self._cache) > self._cache_max or self._cache_weight > self._cache_max_weight:
            _, old = self._cache.popitem(last=False)
            self._cache_weight -= old.cached_weight

    def cache_info(self) -> dict[str, int]:
        """Plan cache counters: hits, misses, entries, weight."""
        return {"hits": self.cache_hits, "misses": self.cache_misses,
                "entries": len(self._cache), "weight": self._cache_weight}

    # ---- checks ---------------------------------------------------------------------

    def _check_mesh(self, call: m.Call) -> list[int]:
        """Check the mesh and devices; returns each device's host."""
        ndev = math.prod(call.mesh_shape)
        if any(n < 1 for n in call.mesh_shape) or ndev != len(call.devices) \
                or len(call.axis_names) != len(call.mesh_shape):
            raise PlanError(ErrorKind.BAD_REQUEST, f"mesh {call.mesh_shape} {call.axis_names} does not "
                            f"match {len(call.devices)} devices")
        if len(set(call.devices)) != len(call.devices):
            raise PlanError(ErrorKind.BAD_REQUEST, "a device appears twice in the mesh")
        try:
            return [self.host_of(d) for d in call.devices]
        except KeyError as e:
            raise PlanError(ErrorKind.BAD_REQUEST, f"unknown device {e}") from None

    def _check_state(self, call: m.Call, owner: int) -> None:
        """Checks against the buffers' current state (run on every call, cached or
        not, before any state changes)."""
        new = [o.buffer for o in call.outputs] + [i.buffer for i in call.inputs if i.put]
        if len(set(new)) != len(new):
            raise PlanError(ErrorKind.BAD_REQUEST, "the call names a new buffer twice (outputs and "
                            "put inputs need distinct ids)")
        for o in call.outputs:
            if o.buffer in self.buffers:
                raise PlanError(ErrorKind.BAD_REQUEST, f"output buffer {o.buffer} already exists")
        for i in call.inputs:
            buf = self.buffers.get(i.buffer)
            if i.put:
                if buf is not None:
                    raise PlanError(ErrorKind.BAD_REQUEST, f"buffer {i.buffer} already exists")
                continue
            if buf is None or buf.owner != owner:
                raise PlanError(ErrorKind.NOT_FOUND, f"input buffer {i.buffer} is unknown (freed, "
                                "or never produced)")
            if buf.error is not None:
                raise PlanError(buf.error.kind, buf.error.message, buf.error)
            if list(buf.shape) != i.aval.shape or buf.dtype != i.aval.dtype:
                raise PlanError(ErrorKind.BAD_REQUEST, f"input buffer {i.buffer} is {buf.dtype}"
                                f"{list(buf.shape)}, the call expects {i.aval.dtype}{i.aval.shape}")

    # ---- lowering ---------------------------------------------------------------------

    def _lower(self, call: m.Call, hosts: list[int]) -> "_Template":
        """The call's plan with buffers as slots (inputs, then outputs), from the
        current state, changing nothing. The call has passed every check."""
        mesh = (call.mesh_shape, call.axis_names)
        try:
            in_regs = [sharding.regions_of(i.aval.shape, *mesh, i.spec) for i in call.inputs]
            out_regs = [sharding.regions_of(o.aval.shape, *mesh, o.spec) for o in call.outputs]
        except (ValueError, KeyError) as e:
            raise PlanError(ErrorKind.BAD_REQUEST, f"bad sharding: {e}") from None
        shards: dict[int, list[list]] = {h: [] for h in hosts}
        sends: list[tuple] = []
        ops: list[tuple] = []
        # the layouts each input buffer will have once the earlier inputs are read
        layouts_of: dict[int, list[dict[Region, list[int]]]] = {}
        pieces_n = 0
        for k, (i, regs) in enumerate(zip(call.inputs, in_regs, strict=True)):
            for h in shards:
                shards[h].append([])
            if i.put:
                layout = new_layout(call.devices, regs)
                ops.append((_NEW, k, tuple(i.aval.shape), i.aval.dtype, layout,
                            footprint_of([layout], i.aval.dtype)))
                for d, h, r in zip(call.devices, hosts, regs, strict=True):
                    shards[h][-1].append(_shard_input(d, sharding.to_wire(r), []))
                continue
            buf = self.buffers[i.buffer]
            lays = layouts_of.setdefault(i.buffer, list(buf.layouts))
            new: dict[Region, list[int]] = {}
            copied = False
            for d, h, r in zip(call.devices, hosts, regs, strict=True):
                if any(d in lay.get(r, ()) for lay in lays):
                    shard = _shard_input(d, sharding.to_wire(r), [])
                else:
                    pieces = self._pieces(lays, buf.id, k, r, h, sends)
                    pieces_n += len(pieces)
                    shard = (d, sharding.to_wire(r), pieces)
                    copied = True
                # Every device, not only the copies: _pieces tiles a region from
                # one layout, so each layout must cover the whole array.
                new.setdefault(r, []).append(d)
                shards[h][-1].append(shard)
            if copied:
                before = footprint_of(lays, buf.dtype)
                lays.append(new)
                after = footprint_of(lays, buf.dtype)
                ops.append((_ADD, k, new, Footprint({d: n - before.get(d, 0) for d, n in after.items()})))
        for k, (o, regs) in enumerate(zip(call.outputs, out_regs, strict=True), len(call.inputs)):
            layout = new_layout(call.devices, regs)
            ops.append((_NEW, k, tuple(o.aval.shape), o.aval.dtype, layout,
                        footprint_of([layout], o.aval.dtype)))
        # layouts as region -> tuple of devices: a buffer's copy of one is a
        # plain dict copy (its values are never changed in place, only replaced);
        # a new buffer's layouts key (see layouts_key) is made once, here
        ops = [(op[0], op[1], *op[2:4], (lay := {r: tuple(d) for r, d in op[4].items()}), op[5],
                self.intern(new_layouts_key(lay))) if op[0] == _NEW
               else (op[0], op[1], {r: tuple(d) for r, d in op[2].items()}, op[3]) for op in ops]
        jax_ids = [self.jax_id_of(d) for d in call.devices]
        weight = 1 + len(call.devices) * (len(call.inputs) + len(call.outputs) + 1) + pieces_n + len(sends)
        in_place = all(type(s) is m.ShardInput for per in shards.values() for ts in per for s in ts)
        return _Template(list(shards), [shards[h] for h in shards], sends, ops, jax_ids, weight,
                         in_place=in_place)

    def _apply(self, t: "_Template", call: m.Call, owner: int, name: str) -> Plan:
        """Fill a template in with the call's buffer ids and fresh exec and piece
        ids, and apply its state changes."""
        ids = [i.buffer for i in call.inputs] + [o.buffer for o in call.outputs]
        pids = [next(self._piece_ids) for _ in t.sends]
        sends = [(src, m.SendPiece(pid, ids[k], dev, reg, sub, dst, address, channel, machine, key))
                 for pid, (src, k, dev, reg, sub, dst, address, channel, machine, key)
                 in zip(pids, t.sends)]
        copies: list[tuple[int, dict]] = []
        for op in t.ops:
            if op[0] == _NEW:
                _, k, shape, dtype, layout, fp, lkey = op
                self.buffers[ids[k]] = Buffer(ids[k], shape, dtype, owner,
                                              [dict(layout)], fp=fp, lkey=lkey)
                self.device_bytes.update(fp)
            else:
                _, k, layout, delta = op
                buf, lay = self.buffers[ids[k]], dict(layout)
                buf.layouts.append(lay)
                buf.fp = buf.lkey = None
                buf.unmade.append(lay)
                copies.append((ids[k], lay))
                self.device_bytes.update(delta)
        exec_id = next(self._exec_ids)
        outputs = [m.ExecOutput(o.buffer, o.aval, o.spec) for o in call.outputs]
        if t.in_place:
            # every shard in place: one Execute for all hosts, its shards left to
            # the workers (see host_shards), encoded and signed once for all
            ex = m.Execute(exec_id, 0, call.program, name, call.mesh_shape, call.axis_names, call.devices,
                           t.jax_ids, [m.ExecInput(i.buffer, i.aval, i.spec, []) for i in call.inputs], outputs)
            return Plan(dict.fromkeys(t.hosts, ex), sends, copies=copies)
        executes = {}
        for h, per_input in zip(t.hosts, t.shards):
            inputs = []
            for i, tshards in zip(call.inputs, per_input):
                inputs.append(m.ExecInput(i.buffer, i.aval, i.spec, [
                    s if type(s) is m.ShardInput else
                    m.ShardInput(s[0], s[1], [m.PieceSource(0 if n < 0 else pids[n], dev, reg, sub)
                                              for n, dev, reg, sub in s[2]])
                    for s in tshards]))
            executes[h] = m.Execute(exec_id, 0, call.program, name, call.mesh_shape, call.axis_names,
                                    call.devices, t.jax_ids, inputs, outputs)
        return Plan(executes, sends, copies=copies)

    def _pieces(self, layouts: list[dict[Region, list[int]]], buffer: int, slot: int,
                want: Region, host: int, sends: list[tuple]) -> list[tuple]:
        """Pieces that assemble region ``want`` on ``host``, preferring copies on
        the same host, then one copy that covers it whole. A piece is (index into
        ``sends`` or -1 if local, device, region, sub)."""
        def rank(dev: int) -> int:
            return 0 if self.host_of(dev) == host else 1

        covering = [(rank(d), d, r) for lay in layouts for r, devs in lay.items()
                    if sharding.contains(r, want) for d in devs]
        if covering:
            _, dev, reg = min(covering)
            return [self._piece(slot, dev, reg, want, host, sends)]
        # Otherwise the layout with the most copies on this host, tiled.
        lay = min(layouts, key=lambda lay: sum(rank(d) for devs in lay.values() for d in devs))
        pieces = []
        for reg, devs in lay.items():
            sub = sharding.intersect(reg, want)
            if sub is not None:
                pieces.append(self._piece(slot, min(devs, key=rank), reg, sub, host, sends))
        if sum(math.prod(sharding.region_shape(sharding.from_wire(p[3]))) for p in pieces) \
                != math.prod(sharding.region_shape(want)):
            raise PlanError(ErrorKind.INTERNAL, f"buffer {buffer}: layout does not cover {want}")
        return pieces

    def _piece(self, slot: int, dev: int, reg: Region, sub: Region, host: int,
               sends: list[tuple]) -> tuple:
        reg_w, sub_w = sharding.to_wire(reg), sharding.to_wire(sub)
        if self.host_of(dev) == host:
            return (-1, dev, reg_w, sub_w)
        src = self.host_of(dev)
        channel, address, machine, key = self.route_of(src, host)
        sends.append((src, slot, dev, reg_w, sub_w, host, address, channel, machine, key))
        return (len(sends) - 1, dev, reg_w, sub_w)


_NEW, _ADD = 0, 1
# regions in all of the layouts keys the directory keeps one object of
# (beyond: all forgotten; a key is then kept anew)
LKEYS_REGIONS = 1 << 16


@dataclasses.dataclass(eq=False)
class _Template:
    """A lowered call with buffers as slots (inputs, then outputs).

    ``shards[n][k]``: host ``hosts[n]``'s shards of input ``k``, each a ready
    ``ShardInput`` (no pieces: shared by every plan made from the template;
    messages are never modified) or (device, region, pieces), a piece being
    (index into ``sends``, or -1 for a copy on the host, device, region, sub).
    ``sends``: (source host, slot, device, region, sub, destination host,
    address, channel, machine, key). ``ops``: the state changes in order,
    (_NEW, slot, shape, dtype, layout, bytes per device, layouts key) or
    (_ADD, slot, layout, change of bytes per device)."""
    hosts: list[int]
    shards: list[list[list]]
    sends: list[tuple]
    ops: list[tuple]
    jax_ids: list[int]
    weight: int
    cached_weight: int = 0
    # every input shard is in place at the region its spec gives it (no pieces)
    in_place: bool = False


def host_shards(ex: m.Execute, inp: m.ExecInput, host: int, host_of: Callable[[int], int]
                ) -> list[m.ShardInput]:
    """The shards of input ``inp`` on host ``host``'s devices: as ``ex`` lists
    them, or, where it leaves them to the workers (empty: each in place at the
    region the spec gives its device), those regions."""
    if inp.shards:
        return inp.shards
    regs = sharding.regions_of(inp.aval.shape, ex.mesh_shape, ex.axis_names, inp.spec)
    return [m.ShardInput(d, sharding.to_wire(regs[p]), []) for p, d in enumerate(ex.devices)
            if host_of(d) == host]


def spec_key(spec: m.Spec) -> tuple:
    for e in spec:
        if e is not None and type(e) is not str:
            return tuple([e if e is None or type(e) is str else tuple(e) for e in spec])
    return tuple(spec)


def new_layout(devices: Sequence[int], regions: Sequence[Region]) -> dict[Region, tuple[int, ...]]:
    """A new buffer's layout: each region with the devices that hold it, in
    the devices' order."""
    layout: dict[Region, list[int]] = {}
    for d, r in zip(devices, regions, strict=True):
        layout.setdefault(r, []).append(d)
    return {r: tuple(ds) for r, ds in layout.items()}


def new_layouts_key(layout: dict[Region, tuple[int, ...]]) -> LayoutsKey:
    """The layouts key of a new buffer of one layout (``layouts_key``)."""
    return LayoutsKey((tuple(layout.items()),))


def layouts_key(buf: Buffer) -> tuple:
    """Which regions live on which devices, in order (the order picks the
    sources); kept on the buffer until its layouts change."""
    if buf.lkey is None:
        buf.lkey = _layouts_key(buf)
    return buf.lkey


def _layouts_key(buf: Buffer) -> LayoutsKey:
    return LayoutsKey(tuple((r, tuple(devs)) for r, devs in lay.items()) for lay in buf.layouts)


class LayoutsKey(tuple):
    """A buffer's layouts key: a tuple that works its hash out once (over 2,048
    regions that is ~0.15 ms, and the plan cache hashes its key on every
    call). The directory keeps one object per distinct key (``Directory.intern``),
    so the cache's comparison of a key finds the very same object."""

    def __hash__(self) -> int:
        h = self.__dict__.get("hash")
        if h is None:
            h = self.__dict__["hash"] = tuple.__hash__(self)
        return h


def footprint(buf: Buffer) -> dict[int, int]:
    """Bytes a buffer holds per device: each region once per device (do not
    modify it: it is kept)."""
    if buf.fp is None:
        buf.fp = footprint_of(buf.layouts, buf.dtype)
    return buf.fp


# the largest buffer a call may declare (an output, or a value put): what the
# controller counts per device stays far from an int64's range
MAX_BUFFER_BYTES = 1 << 44
MAX_DIMS = 64


def _check_sizes(call: m.Call) -> None:
    """Declared shapes are bounded: no negative dimension, a known dtype, at most
    MAX_BUFFER_BYTES (part of the plan key: a cached plan passed this already)."""
    for what, aval in [*(("output", o.aval) for o in call.outputs),
                       *(("input", i.aval) for i in call.inputs if i.put)]:
        if len(aval.shape) > MAX_DIMS or any(n < 0 for n in aval.shape):
            raise PlanError(ErrorKind.BAD_REQUEST, f"{what} shape {aval.shape[:MAX_DIMS]} is not a shape")
        try:
            size = sharding.itemsize(aval.dtype)
        except Exception:
            raise PlanError(ErrorKind.BAD_REQUEST, f"{what} dtype {aval.dtype[:40]!r} is not known") from None
        for n in aval.shape:
            size *= n
            if size > MAX_BUFFER_BYTES:
                raise PlanError(ErrorKind.BAD_REQUEST, f"{what} {aval.dtype}{aval.shape} is larger than "
                                f"{MAX_BUFFER_BYTES} bytes")


def footprint_of(layouts: list[dict[Region, list[int]]], dtype: str) -> "Footprint":
    if len(layouts) == 1:       # (a new buffer's: each device holds one region, sized once)
        lay = layouts[0]
        one = {d: n for r, devs in lay.items() for n in (sharding.nbytes(r, dtype),) for d in devs}
        if len(one) == sum(map(len, lay.values())):
            return Footprint(one)
    seen: dict[int, set] = {}
    for lay in layouts:
        for r, devs in lay.items():
            for d in devs:
                seen.setdefault(d, set()).add(r)
    return Footprint({d: sum(sharding.nbytes(r, dtype) for r in regs) for d, regs in seen.items()})


class Footprint(dict):
    """Bytes per device (a dict, never changed once made), with what
    :class:`DeviceBytes` and a release need of it worked out once: its devices
    and bytes as arrays, and its hosts. A footprint is kept per buffer and per
    plan template, so a computation over thousands of devices pays for these
    once, not per call."""
    __slots__ = ("_arrays", "_hosts", "_sorted_hosts")

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        try:
            return self._arrays
        except AttributeError:
            self._arrays = (np.fromiter(self.keys(), np.int64, len(self)),
                            np.fromiter(self.values(), np.int64, len(self)))
            return self._arrays

    def hosts(self, host_of: Callable[[int], int]) -> frozenset[int]:
        """The hosts of its devices (the mapping does not change while a
        footprint is kept: a new one means a new plan)."""
        try:
            return self._hosts
        except AttributeError:
            self._hosts = frozenset(host_of(d) for d in self)
            return self._hosts

    def sorted_hosts(self, host_of: Callable[[int], int]) -> tuple[int, ...]:
        """``hosts`` in order (kept likewise)."""
        try:
            return self._sorted_hosts
        except AttributeError:
            self._sorted_hosts = tuple(sorted(self.hosts(host_of)))
            return self._sorted_hosts


# a footprint of at most this many devices is added one element at a time
FEW_DEVICES = 16


class DeviceBytes:
    """Bytes held per device id, as an array: adding or taking a footprint of
    thousands of devices is one step. Reads like a Counter: a device never
    touched holds 0; iteration, ``items()`` and ``dict()`` give the devices
    touched so far."""

    def __init__(self) -> None:
        self._bytes = np.zeros(64, np.int64)
        self._touched = np.zeros(64, bool)

    def __getitem__(self, device: int) -> int:
        return int(self._bytes[device]) if 0 <= device < len(self._bytes) else 0

    def update(self, fp: dict[int, int]) -> None:
        self._add(fp, 1)

    def subtract(self, fp: dict[int, int]) -> None:
        self._add(fp, -1)

    def _add(self, fp: dict[int, int], sign: int) -> None:
        if not fp:
            return
        if len(fp) <= FEW_DEVICES and max(fp) < len(self._bytes):
            # a few devices: one element at a time (numpy's steps cost more here)
            held, touched = self._bytes, self._touched
            for d, n in fp.items():
                held[d] = held.item(d) + sign * n
                touched[d] = True
            return
        if type(fp) is Footprint:
            idx, nbytes = fp.arrays()
        else:
            idx = np.fromiter(fp.keys(), np.int64, len(fp))
            nbytes = np.fromiter(fp.values(), np.int64, len(fp))
        top = int(idx.max())
        if top >= len(self._bytes):
            grow = max(2 * len(self._bytes), top + 1) - len(self._bytes)
            self._bytes = np.concatenate([self._bytes, np.zeros(grow, np.int64)])
            self._touched = np.concatenate([self._touched, np.zeros(grow, bool)])
        if sign > 0:
            self._bytes[idx] += nbytes        # (a footprint names each device once)
        else:
            self._bytes[idx] -= nbytes
        self._touched[idx] = True

    def items(self) -> list[tuple[int, int]]:
        return [(int(d), int(self._bytes[d])) for d in np.flatnonzero(self._touched)]

    def keys(self) -> list[int]:
        return [int(d) for d in np.flatnonzero(self._touched)]

    def values(self) -> list[int]:
        return [n for _, n in self.items()]

    def __iter__(self) -> Any:
        return iter(self.keys())

    def __len__(self) -> int:
        return int(self._touched.sum())

    def __pos__(self) -> dict[int, int]:
        """The devices holding more than nothing (as ``+counter``)."""
        return {d: n for d, n in self.items() if n > 0}
