"""The user-facing API: virtual devices, meshes, and compiled functions placed
on them (``pmap`` and ``jit``)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zpath import sharding
from zpath.client import tracer
from zpath.client.avals import Aval, aval_of
from zpath.client.futures import Future
from zpath.errors import Closed
from zpath.net import messages as m

_current: dict[str, Any] = {"client": None}
DEFAULT_PMAP_AXIS = "_zp_pmap"      # the mesh axis of a zp.pmap given no axis_name


def current_client() -> Any:
    c = _current["client"]
    if c is None:
        raise Closed("not connected: call zp.init() or zp.connect(address) first")
    return c


@dataclasses.dataclass(frozen=True)
class VirtualDevice:
    """One device of a slice; ``id`` is the physical device it maps to."""
    slice_id: int
    index: int
    id: int
    host: int
    island: int
    client: Any = dataclasses.field(compare=False, repr=False)


class Slice:
    def __init__(self, slice_id: int, devices: list[VirtualDevice]) -> None:
        self.id = slice_id
        self.devices = devices

    def __repr__(self) -> str:
        return f"Slice({self.id}, devices={[d.id for d in self.devices]})"


class VirtualDeviceSet:
    """A set of virtual device slices requested from the resource manager."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.slices: list[Slice] = []

    def add_slice(self, devices: int, island: int | None = None, host: int | None = None) -> Slice:
        """Allocate ``devices`` devices on one island (optionally a given island
        or host): the least-loaded devices, on one host when one host has
        enough free, else over several hosts of the island."""
        whole_number("devices", devices, 1)
        for name, v in (("island", island), ("host", host)):
            if v is not None:
                whole_number(name, v, 0)
        reply = self.client.request(m.AllocSlice(int(devices), None if island is None else int(island),
                                                 None if host is None else int(host)))
        self.client.learn(reply.devices)
        s = Slice(reply.slice_id, [VirtualDevice(reply.slice_id, i, d.id, d.host, d.island, self.client)
                                   for i, d in enumerate(reply.devices)])
        self.slices.append(s)
        return s

    @property
    def devices(self) -> list[VirtualDevice]:
        return [d for s in self.slices for d in s.devices]


def whole_number(name: str, v: Any, least: int) -> None:
    """Check that argument ``name`` is a whole number >= ``least`` (not a
    bool, a float or a string)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < least:
        raise ValueError(f"{name} must be a whole number >= {least}, not {v!r}")


def make_virtual_device_set() -> VirtualDeviceSet:
    return VirtualDeviceSet(current_client())


class Mesh:
    """A named n-d arrangement of virtual devices, like ``jax.sharding.Mesh``."""

    def __init__(self, devices: Any, axis_names: Sequence[str]) -> None:
        arr = np.empty(np.shape(np.asarray(devices, dtype=object)), dtype=object)
        arr[...] = np.asarray(devices, dtype=object)
        if any(not isinstance(d, VirtualDevice) for d in arr.flat):
            raise TypeError("Mesh devices must be zpath virtual devices")
        if len({d.id for d in arr.flat}) != arr.size:
            raise ValueError("a device appears twice in the mesh")
        axis_names = tuple(axis_names)
        if arr.ndim != len(axis_names):
            raise ValueError(f"mesh of rank {arr.ndim} needs {arr.ndim} axis names, got {axis_names}")
        self.devices = arr
        self.axis_names = axis_names

    @property
    def shape(self) -> tuple[int, ...]:
        return self.devices.shape

    @property
    def device_ids(self) -> list[int]:
        return [d.id for d in self.devices.flat]

    def __repr__(self) -> str:
        return f"Mesh({dict(zip(self.axis_names, self.shape))}, devices={self.device_ids})"


@dataclasses.dataclass
class _Traced:
    digest: str
    blob: bytes
    in_specs: list[list]
    out_specs: list[list]
    out_avals: list[Aval]
    out_tree: Any


class Computation:
    """A JAX function placed on a mesh of virtual devices. Call it with numpy
    arrays, scalars or futures; it returns a pytree of futures at once."""

    def __init__(self, fn: Callable, mesh: Mesh, in_specs: Any, out_specs: Any,
                 pmap_axis: str | None) -> None:
        self.fn = fn
        self.mesh = mesh
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.pmap_axis = pmap_axis
        self.name = getattr(fn, "__name__", "computation")
        clients = {id(d.client) for d in mesh.devices.flat}
        if len(clients) != 1:
            raise ValueError("all devices of a computation must come from one connection")
        islands = sorted({d.island for d in mesh.devices.flat})
        if len(islands) > 1:
            raise ValueError(f"devices {mesh.device_ids} span islands {islands}: a computation runs "
                             "on one island (values move between islands when computations on "
                             "each read them)")
        self.client = mesh.devices.flat[0].client
        self._cache: dict[Any, _Traced] = {}
        functools.update_wrapper(self, fn)

    def _leaf_specs(self, args: tuple, in_tree: Any, n: int) -> list[Any]:
        if self.pmap_axis is not None:
            return [P(self.pmap_axis)] * n
        specs = self.in_specs
        if specs is None or isinstance(specs, P):
            return [specs or P()] * n
        specs = tuple(specs)
        if len(specs) != len(args):
            raise ValueError(f"{self.name}: in_specs has {len(specs)} entries for {len(args)} arguments")
        out = []
        for a, s in zip(args, specs, strict=True):
            leaves = jax.tree_util.tree_leaves(a, is_leaf=lambda x: isinstance(x, Future))
            if s is None or isinstance(s, P):
                out += [s or P()] * len(leaves)
            else:
                sl = jax.tree_util.tree_leaves(s, is_leaf=lambda x: isinstance(x, P))
                if len(sl) != len(leaves):
                    raise ValueError(f"{self.name}: in_specs entry {s} does not match argument structure")
                out += sl
        return out

    def _trace(self, args: tuple, leaves: list, in_tree: Any,
               avals: list[Aval]) -> _Traced:
        am = AbstractMesh(self.mesh.shape, self.mesh.axis_names)
        leaf_specs = self._leaf_specs(args, in_tree, len(leaves))
        structs = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(am, spec))
                   for (s, d), spec in zip(avals, leaf_specs, strict=True)]
        fn = self.fn

        if self.pmap_axis is not None:
            axis = self.pmap_axis

            def per_shard(*blocks: Any) -> Any:
                out = fn(*jax.tree_util.tree_unflatten(in_tree, [b[0] for b in blocks]))
                return jax.tree_util.tree_map(lambda o: jnp.expand_dims(o, 0), out)

            body = jax.shard_map(per_shard, mesh=am, in_specs=tuple(leaf_specs), out_specs=P(axis))
            jitted = jax.jit(body)
        else:
            out_specs = self.out_specs if self.out_specs is not None else P()

            def flat_fn(*flat: Any) -> Any:
                return fn(*jax.tree_util.tree_unflatten(in_tree, list(flat)))

            out_sh = jax.tree_util.tree_map(lambda s: NamedSharding(am, s), out_specs,
                                            is_leaf=lambda x: isinstance(x, P))
            jitted = jax.jit(flat_fn, out_shardings=out_sh)
        with jax.enable_x64(True):
            try:
                exported = jax.export.export(jitted)(*structs)
            except AssertionError as e:
                if str(e):
                    raise
                # what JAX raises for a collective over an axis the mesh lacks
                if self.pmap_axis == DEFAULT_PMAP_AXIS:
                    names = "none (zp.pmap was given no axis_name=)"
                else:
                    names = ", ".join(repr(a) for a in self.mesh.axis_names)
                raise ValueError(
                    f"{self.name}: JAX failed tracing it with an empty AssertionError, which is what "
                    "it raises for a collective (psum, all_gather, ...) over an axis name the mesh "
                    f"does not have; this computation's axis names: {names}") from e
        out_avals = [(tuple(a.shape), np.dtype(a.dtype)) for a in exported.out_avals]
        if self.pmap_axis is not None:
            out_leaf_specs = [P(self.pmap_axis)] * len(out_avals)
        elif isinstance(self.out_specs, P) or self.out_specs is None:
            out_leaf_specs = [self.out_specs or P()] * len(out_avals)
        else:
            out_leaf_specs = jax.tree_util.tree_leaves(self.out_specs, is_leaf=lambda x: isinstance(x, P))
            if len(out_leaf_specs) != len(out_avals):
                raise ValueError(f"{self.name}: out_specs has {len(out_leaf_specs)} specs for "
                                 f"{len(out_avals)} outputs")
        names = self.mesh.axis_names
        blob = bytes(exported.serialize())
        return _Traced(
            digest=hashlib.sha256(blob).hexdigest(), blob=blob,
            in_specs=[sharding.normalize_spec(s, len(a[0]), names) for s, a in zip(leaf_specs, avals, strict=True)],
            out_specs=[sharding.normalize_spec(s, len(a[0]), names) for s, a in zip(out_leaf_specs, out_avals, strict=True)],
            out_avals=out_avals, out_tree=exported.out_tree)

    def prepare(self, args: tuple, leaves: list, in_tree: Any,
                avals: list[Aval]) -> _Traced:
        """Check the inputs against the devices and trace/export the function for
        this input signature (once; cached). Errors are raised here, at the call
        site, before anything is dispatched."""
        n = self.mesh.devices.size
        if self.pmap_axis is not None:
            for i, (shape, _) in enumerate(avals):
                if not shape or shape[0] != n:
                    raise ValueError(f"{self.name}: pmap over {n} devices needs every input to have a "
                                     f"leading axis of size {n}; input {i} has shape {shape}")
        key = (in_tree, tuple((s, d.str) for s, d in avals))
        traced = self._cache.get(key)
        if traced is None:
            traced = self._cache[key] = self._trace(args, leaves, in_tree, avals)
        self.client.register_program(traced.digest, self.name, traced.blob)
        return traced

    def put(self, x: np.ndarray, spec: list, send: bool = True) -> int:
        """Send a client value straight to the workers, sharded as this
        computation reads it (``spec``); returns its new buffer id. With
        ``send=False`` only the id is made (for a plan that will not run)."""
        buf = self.client.new_buffer_id()
        if send:
            self.send_put(buf, x, spec)
        return buf

    def send_put(self, buf: int, x: np.ndarray, spec: list) -> None:
        """Send a client value to the workers as buffer ``buf`` (see ``put``)."""
        client = self.client
        dtype = x.dtype.name
        regs = sharding.regions(x.shape, list(self.mesh.shape), list(self.mesh.axis_names), spec)
        for d, r in zip(self.mesh.device_ids, regs, strict=True):
            data = sharding.cut(x, r)
            # it goes to the workers later, from the I/O thread: a view of
            # memory the caller may change afterwards (even through a read-only
            # view of it) is copied now; cut copied what was not contiguous already
            if np.may_share_memory(data, x):
                data = data.copy()
            client.put(client.devices[d].host, m.Put(buf, d, sharding.to_wire(r),
                                                     m.Aval(list(data.shape), dtype)), data)

    def call_message(self, traced: _Traced, inputs: list[m.CallInput],
                     out_buffers: list[int]) -> m.Call:
        outs = [m.CallOutput(b, m.Aval(list(shape), dtype.name), spec)
                for b, (shape, dtype), spec in zip(out_buffers, traced.out_avals, traced.out_specs, strict=True)]
        return m.Call(self.client.new_call_id(), traced.digest, list(self.mesh.shape),
                      list(self.mesh.axis_names), self.mesh.device_ids, inputs, outs)

    def future(self, buffer: int, aval: Aval, spec: list) -> Future:
        fut = Future(self.client, buffer, aval[0], aval[1], self.mesh.device_ids,
                     list(self.mesh.shape), list(self.mesh.axis_names), spec)
        self.client.track(fut)
        return fut

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(f"{self.name}: keyword arguments are not supported; pass them positionally")
        if tracer.tracing():
            return tracer.record(self, args)
        client = self.client
        began = time.time()
        leaves, in_tree = jax.tree_util.tree_flatten(args, is_leaf=lambda x: isinstance(x, Future))
        for x in leaves:
            if isinstance(x, Future) and x._client is not client:
                raise ValueError(f"{self.name}: an input future belongs to another connection")
        avals = [aval_of(x) for x in leaves]
        values = [x if isinstance(x, Future) else np.asarray(x) for x in leaves]
        traced = self.prepare(args, leaves, in_tree, avals)
        inputs = []
        for x, (shape, dtype), spec in zip(values, avals, traced.in_specs, strict=True):
            aval = m.Aval(list(shape), dtype.name)
            if isinstance(x, Future):
                inputs.append(m.CallInput(x.buffer, aval, spec, False))
            else:
                inputs.append(m.CallInput(self.put(x, spec), aval, spec, True))
        out_buffers = [client.new_buffer_id() for _ in traced.out_avals]
        futures = [self.future(b, a, spec) for b, a, spec in
                   zip(out_buffers, traced.out_avals, traced.out_specs, strict=True)]
        msg = self.call_message(traced, inputs, out_buffers)
        client.post(msg)
        if client.recorder is not None:
            client.recorder.add("call", self.name, began, time.time(), call=msg.call_id, outputs=out_buffers)
        return jax.tree_util.tree_unflatten(traced.out_tree, futures)


def _devices_list(devices: Any) -> list[VirtualDevice]:
    if isinstance(devices, Slice):
        return list(devices.devices)
    return list(devices)


def pmap(fn: Callable, devices: Any, axis_name: str | None = None) -> Computation:
    """Map ``fn`` over the leading axis of every input, one slice per device,
    like ``jax.pmap``. Collectives over ``axis_name`` are allowed."""
    devs = _devices_list(devices)
    if not devs:
        raise ValueError("pmap needs at least one device")
    axis = axis_name or DEFAULT_PMAP_AXIS
    return Computation(fn, Mesh(devs, (axis,)), None, None, axis)


def jit(fn: Callable, mesh: Mesh, in_specs: Any = None, out_specs: Any = None) -> Computation:
    """Run ``fn`` (on global arrays, as with ``jax.jit``) sharded over ``mesh``:
    ``in_specs`` is one PartitionSpec for every input or one per positional
    argument; ``out_specs`` one for every output or a pytree matching the outputs."""
    if not isinstance(mesh, Mesh):
        raise TypeError("zp.jit needs mesh=zp.Mesh(devices, axis_names)")
    return Computation(fn, mesh, in_specs, out_specs, None)
