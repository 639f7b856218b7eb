"""Object directory and call planner.

The directory knows every logical buffer: its shape, dtype, owner, and where its
shards live. A buffer may have several *layouts* (one per way it has been
sharded); each layout maps regions to the devices holding a copy.

:meth:`Directory.plan` turns one call into actions: for every host it touches an
``Execute`` with that host's part, and ``SendPiece`` orders for the shards that
must move between hosts. It is pure: no sockets."""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from typing import Callable

from zpath import sharding
from zpath.net import messages as m
from zpath.sharding import Region


class PlanError(Exception):
    def __init__(self, code: str, message: str, error: m.ErrorInfo | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.error = error


@dataclasses.dataclass
class Buffer:
    id: int
    shape: tuple[int, ...]
    dtype: str
    owner: int
    layouts: list[dict[Region, list[int]]] = dataclasses.field(default_factory=list)
    error: m.ErrorInfo | None = None


@dataclasses.dataclass
class Plan:
    executes: dict[int, m.Execute]
    sends: list[tuple[int, m.SendPiece]]


class Directory:
    def __init__(self, host_of: Callable[[int], int],
                 address_of: Callable[[int], str] = lambda h: "",
                 jax_id_of: Callable[[int], int] = lambda d: d,
                 route_of: Callable[[int, int], tuple[str, str, str, str]] | None = None) -> None:
        """``host_of`` maps a global device id to its host rank, ``address_of`` a
        host rank to its data address, ``route_of`` (source host, destination
        host) to (channel, data address, destination machine id, CURVE key); without
        it every transfer is plain ICI to ``address_of``."""
        self.buffers: dict[int, Buffer] = {}
        self.host_of = host_of
        self.address_of = address_of
        self.jax_id_of = jax_id_of
        # bytes held per device, each region counted once per device
        self.device_bytes: collections.Counter[int] = collections.Counter()
        self.route_of = route_of or (lambda src, dst: ("ICI", self.address_of(dst), "", ""))
        self._piece_ids = itertools.count(1)
        self._exec_ids = itertools.count(1)

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
        frees: dict[int, list[int]] = {}
        for b in buffer_ids:
            buf = self.buffers.get(b)
            if buf is None or buf.owner != owner:
                continue
            del self.buffers[b]
            self.device_bytes.subtract(_footprint(buf))
            hosts = {self.host_of(d) for lay in buf.layouts for devs in lay.values() for d in devs}
            for h in sorted(hosts):
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
            before = _footprint(buf)
            kept = []
            for lay in buf.layouts:
                left = {r: [d for d in devs if d not in devices] for r, devs in lay.items()}
                if all(left.values()):
                    kept.append(left)
            buf.layouts = kept
            self.device_bytes.subtract(before)
            self.device_bytes.update(_footprint(buf))
            if not kept:
                buf.error = error
                failed.setdefault(buf.owner, []).append(buf.id)
        return failed

    def needs(self, call: m.Call) -> dict[int, int]:
        """Bytes the call would add per device (outputs, client values, input
        copies it must assemble), without changing anything. Calls that cannot be
        planned need nothing (they will fail)."""
        need: dict[int, set] = {}
        try:
            mesh = (call.mesh_shape, call.axis_names)
            for i in call.inputs:
                buf = self.buffers.get(i.buffer)
                for d, r in zip(call.devices, sharding.regions(i.aval.shape, *mesh, i.spec), strict=True):
                    if i.put or buf is None or not any(d in lay.get(r, ()) for lay in buf.layouts):
                        need.setdefault(d, set()).add((i.buffer, r, i.aval.dtype))
            for o in call.outputs:
                for d, r in zip(call.devices, sharding.regions(o.aval.shape, *mesh, o.spec), strict=True):
                    need.setdefault(d, set()).add((o.buffer, r, o.aval.dtype))
        except (ValueError, KeyError):
            return {}
        return {d: sum(sharding.nbytes(r, dt) for _, r, dt in items) for d, items in need.items()}

    def owned(self, owner: int) -> list[int]:
        """Every buffer of an owner (to release them all when it leaves)."""
        return [b for b, buf in self.buffers.items() if buf.owner == owner]

    def plan(self, call: m.Call, owner: int, name: str) -> Plan:
        ndev = math.prod(call.mesh_shape)
        if any(n < 1 for n in call.mesh_shape) or ndev != len(call.devices) \
                or len(call.axis_names) != len(call.mesh_shape):
            raise PlanError("bad_request", f"mesh {call.mesh_shape} {call.axis_names} does not "
                            f"match {len(call.devices)} devices")
        if len(set(call.devices)) != len(call.devices):
            raise PlanError("bad_request", "a device appears twice in the mesh")
        try:
            hosts = [self.host_of(d) for d in call.devices]
        except KeyError as e:
            raise PlanError("bad_request", f"unknown device {e}") from None
        mesh = (call.mesh_shape, call.axis_names)
        for o in call.outputs:
            if o.buffer in self.buffers:
                raise PlanError("bad_request", f"output buffer {o.buffer} already exists")
        # Check every input before changing any state.
        for i in call.inputs:
            buf = self.buffers.get(i.buffer)
            if i.put:
                if buf is not None:
                    raise PlanError("bad_request", f"buffer {i.buffer} already exists")
                continue
            if buf is None or buf.owner != owner:
                raise PlanError("not_found", f"input buffer {i.buffer} is unknown (freed, "
                                "or never produced)")
            if buf.error is not None:
                raise PlanError(buf.error.kind, buf.error.message, buf.error)
            if list(buf.shape) != i.aval.shape or buf.dtype != i.aval.dtype:
                raise PlanError("bad_request", f"input buffer {i.buffer} is {buf.dtype}"
                                f"{list(buf.shape)}, the call expects {i.aval.dtype}{i.aval.shape}")
        try:
            in_regs = [sharding.regions(i.aval.shape, *mesh, i.spec) for i in call.inputs]
            out_regs = [sharding.regions(o.aval.shape, *mesh, o.spec) for o in call.outputs]
        except (ValueError, KeyError) as e:
            raise PlanError("bad_request", f"bad sharding: {e}") from None

        shards: dict[int, list[list[m.ShardInput]]] = {h: [] for h in hosts}
        sends: list[tuple[int, m.SendPiece]] = []
        for i, regs in zip(call.inputs, in_regs, strict=True):
            for h in shards:
                shards[h].append([])
            if i.put:
                layout: dict[Region, list[int]] = {}
                for d, r in zip(call.devices, regs, strict=True):
                    layout.setdefault(r, []).append(d)
                self.buffers[i.buffer] = buf = Buffer(i.buffer, tuple(i.aval.shape), i.aval.dtype,
                                                      owner, [layout])
                self.device_bytes.update(_footprint(buf))
                for d, h, r in zip(call.devices, hosts, regs, strict=True):
                    shards[h][-1].append(m.ShardInput(d, sharding.to_wire(r), []))
                continue
            buf = self.buffers[i.buffer]
            new: dict[Region, list[int]] = {}
            copied = False
            for d, h, r in zip(call.devices, hosts, regs, strict=True):
                if any(d in lay.get(r, ()) for lay in buf.layouts):
                    pieces = []
                else:
                    pieces = self._pieces(buf, r, h, sends)
                    copied = True
                # Every device, not only the copies: _pieces tiles a region from
                # one layout, so each layout must cover the whole array.
                new.setdefault(r, []).append(d)
                shards[h][-1].append(m.ShardInput(d, sharding.to_wire(r), pieces))
            if copied:
                before = _footprint(buf)
                buf.layouts.append(new)
                self.device_bytes.subtract(before)
                self.device_bytes.update(_footprint(buf))
        for o, regs in zip(call.outputs, out_regs, strict=True):
            layout = {}
            for d, r in zip(call.devices, regs, strict=True):
                layout.setdefault(r, []).append(d)
            self.buffers[o.buffer] = buf = Buffer(o.buffer, tuple(o.aval.shape), o.aval.dtype,
                                                  owner, [layout])
            self.device_bytes.update(_footprint(buf))
        exec_id = next(self._exec_ids)
        jax_ids = [self.jax_id_of(d) for d in call.devices]
        outputs = [m.ExecOutput(o.buffer, o.aval, o.spec) for o in call.outputs]
        executes = {}
        for h, per_input in shards.items():
            inputs = [m.ExecInput(i.buffer, i.aval, i.spec, s)
                      for i, s in zip(call.inputs, per_input, strict=True)]
            executes[h] = m.Execute(exec_id, 0, call.program, name, call.mesh_shape, call.axis_names,
                                    call.devices, jax_ids, inputs, outputs)
        return Plan(executes, sends)

    def _pieces(self, buf: Buffer, want: Region, host: int,
                sends: list[tuple[int, m.SendPiece]]) -> list[m.PieceSource]:
        """Pieces that assemble region ``want`` on ``host``, preferring copies on
        the same host, then one copy that covers it whole."""
        def rank(dev: int) -> int:
            return 0 if self.host_of(dev) == host else 1

        covering = [(rank(d), d, r) for lay in buf.layouts for r, devs in lay.items()
                    if sharding.contains(r, want) for d in devs]
        if covering:
            _, dev, reg = min(covering)
            return [self._piece(buf, dev, reg, want, host, sends)]
        # Otherwise the layout with the most copies on this host, tiled.
        lay = min(buf.layouts, key=lambda lay: sum(rank(d) for devs in lay.values() for d in devs))
        pieces = []
        for reg, devs in lay.items():
            sub = sharding.intersect(reg, want)
            if sub is not None:
                pieces.append(self._piece(buf, min(devs, key=rank), reg, sub, host, sends))
        if sum(math.prod(sharding.region_shape(sharding.from_wire(p.sub))) for p in pieces) \
                != math.prod(sharding.region_shape(want)):
            raise PlanError("internal", f"buffer {buf.id}: layout does not cover {want}")
        return pieces

    def _piece(self, buf: Buffer, dev: int, reg: Region, sub: Region, host: int,
               sends: list[tuple[int, m.SendPiece]]) -> m.PieceSource:
        if self.host_of(dev) == host:
            pid = 0
        else:
            pid = next(self._piece_ids)
            src = self.host_of(dev)
            channel, address, machine, key = self.route_of(src, host)
            sends.append((src, m.SendPiece(
                pid, buf.id, dev, sharding.to_wire(reg), sharding.to_wire(sub), host,
                address, channel, machine, key)))
        return m.PieceSource(pid, dev, sharding.to_wire(reg), sharding.to_wire(sub))


def _footprint(buf: Buffer) -> dict[int, int]:
    """Bytes a buffer holds per device: each region once per device."""
    seen: dict[int, set] = {}
    for lay in buf.layouts:
        for r, devs in lay.items():
            for d in devs:
                seen.setdefault(d, set()).add(r)
    return {d: sum(sharding.nbytes(r, buf.dtype) for r in regs) for d, regs in seen.items()}
