"""The user-facing API: virtual devices, meshes, and compiled functions placed
on them (``pmap`` and ``jit``)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh
from jax.sharding import NamedSharding as JaxNamedSharding
from jax.sharding import PartitionSpec as P

from zpath import sharding
from zpath.client import tracer
from zpath.client.avals import Aval, aval_of, dtype_name, host_value
from zpath.client.futures import CallRan, Future
from zpath.errors import Closed
from zpath.net import codec
from zpath.net import messages as m

# the records of every call, made without their frozen __init__ (codec.constructor)
_aval = codec.constructor(m.Aval)
_call = codec.constructor(m.Call)
_call_input = codec.constructor(m.CallInput)
_call_output = codec.constructor(m.CallOutput)

_current: dict[str, Any] = {"client": None}
DEFAULT_PMAP_AXIS = "_zp_pmap"      # the mesh axis of a zp.pmap given no axis_name


def current_client() -> Any:
    c = _current["client"]
    if c is None:
        raise Closed("not connected: call zp.init() or zp.connect(address) first")
    return c


LOWERING_PLATFORMS = frozenset({"cpu", "cuda", "rocm", "tpu"})    # what jax.export lowers for


@dataclasses.dataclass(frozen=True)
class VirtualDevice:
    """One device of a slice; ``id`` is the physical device it maps to;
    ``platform`` is what its host's JAX lowers programs for."""
    slice_id: int
    index: int
    id: int
    host: int
    island: int
    client: Any = dataclasses.field(compare=False, repr=False)
    platform: str = dataclasses.field(default="cpu", compare=False)


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
        s = Slice(reply.slice_id, [VirtualDevice(reply.slice_id, i, d.id, d.host, d.island, self.client,
                                                 d.platform)
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
        self._ops: dict[tuple, Computation] = {}      # array operations run here (eager)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.devices.shape

    @property
    def device_ids(self) -> list[int]:
        return [d.id for d in self.devices.flat]

    @property
    def platform(self) -> str:
        """What its computations are lowered for: its devices' platform (this
        process's own, for hosts that run no JAX, such as simulated ones)."""
        found = {d.platform for d in self.devices.flat}
        if len(found) > 1:
            raise ValueError(f"{self!r} mixes devices of platforms {sorted(found)}: one computation "
                             "runs on devices of one platform")
        platform = found.pop()
        return platform if platform in LOWERING_PLATFORMS else jax.export.default_export_platform()

    def __repr__(self) -> str:
        return f"Mesh({dict(zip(self.axis_names, self.shape))}, devices={self.device_ids})"

    def sharding(self, spec: Any) -> "NamedSharding":
        return NamedSharding(self, spec_of(spec))

    def eager(self, name: str, fn: Callable, static: Any, operands: tuple, anchor: Any, spec: list) -> Any:
        """Run one array operation of a future or traced value (zpath/client/arrays.py)
        on this mesh: ``anchor``, the operand it runs for, is read in its
        sharding ``spec``, other operands on this mesh in theirs, anything else
        replicated; the output keeps ``spec`` when it has the anchor's shape.
        The computation is made once per (operation, static, avals, shardings)."""
        specs = tuple(spec_of(o._spec if isinstance(o, Future) else o.where[1])
                      if (o is anchor or _on_mesh(o, self)) else P() for o in operands)
        avals = tuple(_op_aval(o) for o in operands)
        key = (name, static, avals, specs)
        comp = self._ops.get(key)
        if comp is None:
            out = jax.eval_shape(fn, *[jax.ShapeDtypeStruct(s, d, weak_type=w) for s, d, w in avals])
            at = next(i for i, o in enumerate(operands) if o is anchor)      # (== is elementwise)
            out_spec = specs[at] if getattr(out, "shape", None) == anchor.shape else P()

            def op(*xs: Any) -> Any:
                return fn(*xs)
            op.__name__ = op.__qualname__ = name
            comp = self._ops[key] = Computation(op, self, specs, out_spec, None)
        return comp(*operands)


@dataclasses.dataclass(frozen=True)
class NamedSharding:
    """Where a value lives: a ``zp.Mesh`` of virtual devices and a
    PartitionSpec over its axes, as ``jax.sharding.NamedSharding``."""
    mesh: Mesh
    spec: P

    @property
    def device_set(self) -> set[VirtualDevice]:
        return set(self.mesh.devices.flat)

    def devices_indices_map(self, shape: Sequence[int]) -> dict[VirtualDevice, tuple[slice, ...]]:
        """Per device, the index of the block of a ``shape`` array it holds."""
        spec = sharding.normalize_spec(self.spec, len(shape), self.mesh.axis_names)
        regs = sharding.regions(shape, list(self.mesh.shape), list(self.mesh.axis_names), spec)
        return {d: tuple(slice(a, b) for a, b in r) for d, r in zip(self.mesh.devices.flat, regs, strict=True)}


def spec_of(spec: Any) -> P:
    """A PartitionSpec from its wire form (a list of None, axis or axes)."""
    if isinstance(spec, P):
        return spec
    entries = [tuple(e) if isinstance(e, list) else e for e in spec]
    while entries and entries[-1] is None:       # (as the user writes it: P("i"), not P("i", None))
        entries.pop()
    return P(*entries)


def _on_mesh(x: Any, mesh: Mesh) -> bool:
    """Whether a future or traced value lives on ``mesh``."""
    if isinstance(x, Future):
        return x._mesh is mesh
    return getattr(x, "_zp_value", False) and x.where is not None and x.where[0] is mesh


def _op_aval(x: Any) -> tuple:
    """(shape, dtype, weak) of an array operation's operand."""
    if isinstance(x, Future) or getattr(x, "_zp_value", False):
        return (tuple(x.shape), np.dtype(x.dtype), False)
    shape, dtype = aval_of(x)
    return (shape, dtype, type(x) in (int, float, complex))


@dataclasses.dataclass
class _Traced:
    digest: str
    blob: bytes
    in_specs: list[list]
    out_specs: list[list]
    out_avals: list[Aval]
    out_tree: Any
    out_keys: list[str | None]       # per output: the PRNG implementation of a typed key


@dataclasses.dataclass
class _Args:
    """One call's arguments as a compiled function reads them: the dynamic
    ones flattened (``leaves``, ``in_tree`` of ``(args, kwargs)``, static ones
    left out), the static ones by position and name, and per leaf its aval, the
    PRNG implementation of a typed key (passed as its key data) and whether it
    is weakly typed (a Python scalar, as JAX types it)."""
    leaves: list
    in_tree: Any
    static: tuple
    avals: list[Aval]
    keys: list[str | None]
    weak: list[bool]
    n_args: int                    # positional arguments given (static ones included)

    def signature(self) -> tuple:
        return (self.in_tree, self.static, tuple((s, d.str) for s, d in self.avals), tuple(self.keys),
                tuple(self.weak), bool(jax.config.jax_enable_x64))


def _is_arg_leaf(x: Any) -> bool:
    return isinstance(x, Future) or getattr(x, "_zp_value", False)


def _is_axis(x: Any) -> bool:
    return x is None or (isinstance(x, int) and not isinstance(x, bool))


def _key_impl(x: Any) -> str | None:
    """The PRNG implementation of a typed key (or of a future or traced value of one), else None."""
    return x._key if _is_arg_leaf(x) else tracer.key_impl(x)


def _argnums(name: str, what: str, v: Any) -> tuple:
    items = (v,) if isinstance(v, (int, str)) else tuple(v)
    kind = str if what == "names" else int
    if any(isinstance(i, bool) or not isinstance(i, kind) for i in items):
        raise TypeError(f"{name}: static_arg{what} must be {'names' if kind is str else 'integers'}, "
                        f"not {v!r}")
    return items


class Computation:
    """A JAX function placed on a mesh of virtual devices. Call it with numpy
    arrays, scalars, typed PRNG keys or futures (in any pytree, keyword arguments
    too); it returns a pytree of futures at once."""

    def __init__(self, fn: Callable, mesh: Mesh, in_specs: Any, out_specs: Any,
                 pmap_axis: str | None, *, static_argnums: Any = (), static_argnames: Any = (),
                 donate_argnums: Any = (), in_axes: Any = 0, out_axes: Any = 0) -> None:
        self.fn = fn
        self.mesh = mesh
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.pmap_axis = pmap_axis
        self.name = getattr(fn, "__name__", "computation")
        self.static_argnums = _argnums(self.name, "nums", static_argnums)
        self.static_argnames = _argnums(self.name, "names", static_argnames)
        self.donate_argnums = _argnums(self.name, "nums", donate_argnums)
        if set(self.donate_argnums) & set(self.static_argnums):
            raise ValueError(f"{self.name}: an argument cannot be both static and donated "
                             f"(static_argnums={self.static_argnums}, donate_argnums={self.donate_argnums})")
        self.in_axes = in_axes
        self.out_axes = out_axes
        clients = {id(d.client) for d in mesh.devices.flat}
        if len(clients) != 1:
            raise ValueError("all devices of a computation must come from one connection")
        islands = sorted({d.island for d in mesh.devices.flat})
        if len(islands) > 1:
            raise ValueError(f"devices {mesh.device_ids} span islands {islands}: a computation runs "
                             "on one island (values move between islands when computations on "
                             "each read them)")
        self.client = mesh.devices.flat[0].client
        # the mesh as every call's message and futures name it, made once (read only)
        self._device_ids = mesh.device_ids
        self._mesh_shape = list(mesh.shape)
        self._axis_names = list(mesh.axis_names)
        self._cache: dict[Any, _Traced] = {}
        functools.update_wrapper(self, fn)

    # ---- arguments -----------------------------------------------------------
    def _static_positions(self, n: int) -> set[int]:
        out = set()
        for i in self.static_argnums:
            if not -n <= i < n:
                raise ValueError(f"{self.name}: static_argnums names argument {i}, but it was called "
                                 f"with {n} positional argument(s)")
            out.add(i % n)
        return out

    def bind(self, args: tuple, kwargs: dict) -> _Args:
        """Split a call's arguments into static and dynamic ones, flatten the
        dynamic ones and work out their avals (canonical under the caller's
        ``jax_enable_x64``, as jax.jit does)."""
        if not self.static_argnums and not self.static_argnames:     # (the usual case: all dynamic)
            static: tuple = ((), ())
            dyn = (args, dict(kwargs))
        else:
            static_pos = self._static_positions(len(args))
            static = (tuple((i, args[i]) for i in sorted(static_pos)),
                      tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames)))
            for where, v in (*static[0], *static[1]):
                try:
                    hash(v)
                except TypeError:
                    raise TypeError(f"{self.name}: static argument {_arg_name(self.fn, where)} must be "
                                    f"hashable (as for jax.jit), not {type(v).__name__}") from None
            dyn = (tuple(a for i, a in enumerate(args) if i not in static_pos),
                   {k: v for k, v in kwargs.items() if k not in self.static_argnames})
        leaves, in_tree = jax.tree_util.tree_flatten(dyn, is_leaf=_is_arg_leaf)
        keys, avals = [], []
        for x in leaves:
            if type(x) is Future:           # (a future's key and aval, as _key_impl and aval_of give them)
                keys.append(x._key)
                avals.append((x.shape, x.dtype))
                continue
            k = _key_impl(x)
            keys.append(k)
            avals.append(tracer.key_aval(x) if k is not None and not _is_arg_leaf(x) else aval_of(x))
        weak = [type(x) in (int, float, complex) for x in leaves]
        return _Args(leaves, in_tree, static, avals, keys, weak, len(args))

    def _dynamic_positions(self, n: int) -> list[int]:
        static_pos = self._static_positions(n)
        return [i for i in range(n) if i not in static_pos]

    def _leaf_specs(self, bound: _Args) -> list[Any]:
        n = len(bound.leaves)
        dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(bound.in_tree, bound.leaves)
        positions = self._dynamic_positions(bound.n_args)
        if self.pmap_axis is not None:
            axes = self._leaf_axes(bound)
            return [_axis_spec(self.pmap_axis, a, len(s)) for a, (s, _) in zip(axes, bound.avals, strict=True)]
        specs = self.in_specs
        if specs is None or isinstance(specs, P):
            return [specs or P()] * n
        specs = tuple(specs)
        if len(specs) != bound.n_args:
            raise ValueError(f"{self.name}: in_specs has {len(specs)} entries for {bound.n_args} "
                             "positional arguments")
        out = []
        for i, a in zip(positions, dyn_args, strict=True):
            out += _prefix_leaves(specs[i], a, f"{self.name}: in_specs entry {i}",
                                  lambda x: x is None or isinstance(x, P), lambda s: s or P())
        return out + [P()] * len(jax.tree_util.tree_leaves(dyn_kwargs, is_leaf=_is_arg_leaf))

    def _leaf_axes(self, bound: _Args) -> list[int | None]:
        """pmap's mapped axis of every dynamic leaf (``in_axes``: one for all,
        or one per positional argument, a pytree prefix of it; keyword
        arguments are mapped over axis 0, as jax.pmap does)."""
        d_args, d_kwargs = jax.tree_util.tree_unflatten(bound.in_tree, bound.leaves)
        axes = self.in_axes
        if _is_axis(axes):
            per_arg: list = [axes] * len(d_args)
        else:
            axes = tuple(axes)
            if len(axes) != bound.n_args:
                raise ValueError(f"{self.name}: in_axes has {len(axes)} entries for {bound.n_args} "
                                 "positional arguments")
            per_arg = [axes[i] for i in self._dynamic_positions(bound.n_args)]
        out: list[int | None] = []
        for ax, a in zip(per_arg, d_args, strict=True):
            out += _prefix_leaves(ax, a, f"{self.name}: in_axes entry", _is_axis, lambda x: x)
        return out + [0] * len(jax.tree_util.tree_leaves(d_kwargs, is_leaf=_is_arg_leaf))

    # ---- tracing -------------------------------------------------------------
    def _wrapped(self, bound: _Args, out_keys: list) -> Callable:
        """The user's function as JAX traces it here: keyword arguments and
        static ones in place, typed keys rebuilt from their key data on the way
        in, and given back as key data on the way out (their implementations
        noted in ``out_keys``). Its name and signature are the user's, so JAX's
        errors name the function and the argument."""
        fn, static_pos = self.fn, dict(bound.static[0])
        keys, in_tree = bound.keys, bound.in_tree

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            dyn = (tuple(a for i, a in enumerate(args) if i not in static_pos),
                   {k: v for k, v in kwargs.items() if k not in self.static_argnames})
            leaves = jax.tree_util.tree_leaves(dyn)
            leaves = [x if k is None else jax.random.wrap_key_data(x, impl=k)
                      for x, k in zip(leaves, keys, strict=True)]
            d_args, d_kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
            it = iter(d_args)
            full = [static_pos[i] if i in static_pos else next(it) for i in range(len(args))]
            out = fn(*full, **d_kwargs, **{k: v for k, v in kwargs.items() if k in self.static_argnames})
            out_leaves, out_tree = jax.tree_util.tree_flatten(out)
            out_keys[:] = [_key_impl(o) for o in out_leaves]
            return jax.tree_util.tree_unflatten(out_tree, [
                o if k is None else jax.random.key_data(o) for o, k in zip(out_leaves, out_keys, strict=True)])
        return call

    def _trace(self, bound: _Args, donate: bool) -> _Traced:
        am = AbstractMesh(self.mesh.shape, self.mesh.axis_names)
        leaf_specs = self._leaf_specs(bound)
        structs = [jax.ShapeDtypeStruct(s, d, sharding=JaxNamedSharding(am, spec), weak_type=w)
                   for (s, d), spec, w in zip(bound.avals, leaf_specs, bound.weak, strict=True)]
        out_keys: list[str | None] = []
        call = self._wrapped(bound, out_keys)
        static_pos = dict(bound.static[0])
        statics = dict(bound.static[1])
        n = bound.n_args
        platforms = (self.mesh.platform,)

        if self.pmap_axis is not None:
            axis = self.pmap_axis
            in_axes = self._leaf_axes(bound)
            out_axes = self.out_axes
            is_axis = _is_axis

            def per_shard(*blocks: Any) -> Any:
                d_args, d_kwargs = jax.tree_util.tree_unflatten(bound.in_tree, [
                    b if a is None else jnp.squeeze(b, a) for b, a in zip(blocks, in_axes, strict=True)])
                it = iter(d_args)
                full = [static_pos[i] if i in static_pos else next(it) for i in range(n)]
                out = call(*full, **d_kwargs, **statics)
                return jax.tree_util.tree_map(
                    lambda ax, sub: jax.tree_util.tree_map(lambda o: o if ax is None else jnp.expand_dims(o, ax), sub),
                    out_axes, out, is_leaf=is_axis)

            def mapped(*flat: Any) -> Any:
                out_spec = jax.tree_util.tree_map(lambda ax: P() if ax is None else P(*([None] * ax), axis),
                                                  out_axes, is_leaf=is_axis)
                return jax.shard_map(per_shard, mesh=am, in_specs=tuple(leaf_specs), out_specs=out_spec)(*flat)

            functools.update_wrapper(mapped, self.fn)
            jitted = jax.jit(mapped, donate_argnums=self._donated_leaves(bound) if donate else ())
            make = lambda: jax.export.export(jitted, platforms=platforms)(*structs)    # noqa: E731
        else:
            out_specs = self.out_specs if self.out_specs is not None else P()
            out_sh = jax.tree_util.tree_map(lambda s: JaxNamedSharding(am, s), out_specs,
                                            is_leaf=lambda x: isinstance(x, P))
            # (the exported program marks donated inputs, tf.aliasing_output)
            jitted = jax.jit(call, out_shardings=out_sh, static_argnums=tuple(static_pos),
                             static_argnames=tuple(statics),
                             donate_argnums=tuple(sorted(self._donated_positions(n))) if donate else ())
            d_args, d_kwargs = jax.tree_util.tree_unflatten(bound.in_tree, structs)
            it = iter(d_args)
            full = [static_pos[i] if i in static_pos else next(it) for i in range(n)]
            make = lambda: jax.export.export(jitted, platforms=platforms)(*full, **d_kwargs, **statics)  # noqa: E731
        try:
            with jax.sharding.use_abstract_mesh(am):     # for with_sharding_constraint(x, P(...))
                exported = make()
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
        except TypeError as e:       # (JAX's concretization errors are TypeErrors)
            ints = [name for name, x in self._named_leaves(bound) if type(x) is int]
            if ints and ("concrete" in str(e) or isinstance(e, jax.errors.TracerIntegerConversionError)):
                raise TypeError(f"{self.name}: argument(s) {', '.join(ints)} are Python ints, which are "
                                "traced as arrays, as jax.jit does: to use the value, make the argument "
                                f"static (static_argnums= or static_argnames=).\n{e}") from None
            raise
        out_avals = [(tuple(a.shape), np.dtype(a.dtype)) for a in exported.out_avals]
        out_leaf_specs = self._out_leaf_specs(exported.out_tree, len(out_avals))
        names = self.mesh.axis_names
        # the trees stay here (a user's namedtuple or dataclass cannot be serialised);
        # the workers call the program with flat inputs and outputs
        flat = dataclasses.replace(
            exported, in_tree=jax.tree_util.tree_structure((tuple(range(len(structs))), {})),
            out_tree=jax.tree_util.tree_structure(list(range(len(out_avals)))))
        blob = bytes(flat.serialize())
        return _Traced(
            digest=hashlib.sha256(blob).hexdigest(), blob=blob,
            in_specs=[sharding.normalize_spec(s, len(a[0]), names)
                      for s, a in zip(leaf_specs, bound.avals, strict=True)],
            out_specs=[sharding.normalize_spec(s, len(a[0]), names)
                       for s, a in zip(out_leaf_specs, out_avals, strict=True)],
            out_avals=out_avals, out_tree=exported.out_tree, out_keys=list(out_keys))

    def _named_leaves(self, bound: _Args) -> list[tuple[str, Any]]:
        """(the argument's name, leaf) for every dynamic leaf."""
        d_args, d_kwargs = jax.tree_util.tree_unflatten(bound.in_tree, bound.leaves)
        out = []
        for i, a in zip(self._dynamic_positions(bound.n_args), d_args, strict=True):
            out += [(_arg_name(self.fn, i), x) for x in jax.tree_util.tree_leaves(a, is_leaf=_is_arg_leaf)]
        for k, a in d_kwargs.items():
            out += [(repr(k), x) for x in jax.tree_util.tree_leaves(a, is_leaf=_is_arg_leaf)]
        return out

    def _out_leaf_specs(self, out_tree: Any, n: int) -> list[Any]:
        if self.pmap_axis is not None:
            dummy = jax.tree_util.tree_unflatten(out_tree, [0] * n)
            axes = _prefix_leaves(self.out_axes, dummy, f"{self.name}: out_axes", _is_axis, lambda x: x)
            return [P() if a is None else P(*([None] * a), self.pmap_axis) for a in axes]
        if isinstance(self.out_specs, P) or self.out_specs is None:
            return [self.out_specs or P()] * n
        out = jax.tree_util.tree_leaves(self.out_specs, is_leaf=lambda x: isinstance(x, P))
        if len(out) != n:
            raise ValueError(f"{self.name}: out_specs has {len(out)} specs for {n} outputs")
        return out

    def prepare(self, bound: _Args, donate: bool = False) -> _Traced:
        """Check the inputs against the devices and trace/export the function for
        this input signature (once; cached). Errors are raised here, at the call
        site, before anything is dispatched. ``donate``: the variant whose
        program donates the donated arguments (see ``_may_donate``)."""
        key = (bound.signature(), donate)
        traced = self._cache.get(key)
        if traced is None:
            if self.pmap_axis is not None:
                self._check_mapped(bound)
            traced = self._cache[key] = self._trace(bound, donate)
        self.client.register_program(traced.digest, self.name, traced.blob)
        return traced

    def _check_mapped(self, bound: _Args) -> None:
        n = self.mesh.devices.size
        axes = self._leaf_axes(bound)
        names = [name for name, _ in self._named_leaves(bound)]
        for name, a, (shape, _) in zip(names, axes, bound.avals, strict=True):
            if a is None:
                continue
            if not -len(shape) <= a < len(shape) or shape[a] != n:
                which = "a leading axis" if a == 0 else f"an axis {a}"
                raise ValueError(f"{self.name}: pmap over {n} devices needs every mapped input to have "
                                 f"{which} of size {n}; argument {name} has shape {shape}")

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
        dtype = dtype_name(x.dtype)
        # (remembered per shape and spec: each call of a loop puts the same)
        regs = sharding.regions_of(x.shape, self._mesh_shape, self._axis_names, spec)
        for d, r in zip(self._device_ids, regs, strict=True):
            data = sharding.cut(x, r)
            # it goes to the workers later, from the I/O thread: a view of
            # memory the caller may change afterwards (even through a read-only
            # view of it) is copied now; cut copied what was not contiguous already
            if np.may_share_memory(data, x):
                data = data.copy()
            client.put(client.devices[d].host, m.Put(buf, d, sharding.to_wire(r),
                                                     m.Aval(list(data.shape), dtype)), data)

    def call_message(self, traced: _Traced, inputs: list[m.CallInput],
                     out_buffers: list[int], keep: int = 0, call_id: int | None = None) -> m.Call:
        outs = [_call_output(b, _aval(list(shape), dtype_name(dtype)), spec)
                for b, (shape, dtype), spec in zip(out_buffers, traced.out_avals, traced.out_specs, strict=True)]
        return _call(self.client.new_call_id() if call_id is None else call_id, traced.digest, self._mesh_shape,
                     self._axis_names, self._device_ids, inputs, outs, keep)

    def future(self, buffer: int, aval: Aval, spec: list, key: str | None = None) -> Future:
        fut = Future(self.client, buffer, aval[0], aval[1], self._device_ids, self._mesh_shape,
                     self._axis_names, spec, mesh=self.mesh, key=key)
        self.client.track(fut)
        return fut

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if tracer.tracing():
            return tracer.record(self, args, kwargs)
        client = self.client
        began = time.time()
        bound = self.bind(args, kwargs)
        names = None
        for k, x in enumerate(bound.leaves):
            if isinstance(x, Future):
                if x._client is not client:
                    raise ValueError(f"{self.name}: an input future belongs to another connection")
                if x._donated is not None:
                    names = names or self._named_leaves(bound)
                    raise ValueError(f"{self.name}: argument {names[k][0]} is a future that was donated to "
                                     f"{x._donated} (donate_argnums): its buffer is gone")
        traced = self.prepare(bound, self._may_donate(bound))
        in_buffers, puts = [], []
        for x, (shape, dtype), spec, k in zip(bound.leaves, bound.avals, traced.in_specs, bound.keys, strict=True):
            if isinstance(x, Future):
                in_buffers.append(x.buffer)
                puts.append(False)
            else:
                in_buffers.append(self.put(host_value(x, dtype, k), spec))
                puts.append(True)
        out_buffers = [client.new_buffer_id() for _ in traced.out_avals]
        futures = [self.future(b, a, spec, k) for b, a, spec, k in
                   zip(out_buffers, traced.out_avals, traced.out_specs, traced.out_keys, strict=True)]
        if len(futures) > 1:       # one known computed, all are (Future._fetched)
            ran = CallRan()
            for f in futures:
                f._call = ran
        call_id = client.new_call_id()

        def whole(keep: int) -> m.Call:       # (the first call of this form: it goes whole)
            inputs = [_call_input(b, _aval(list(shape), dtype_name(dtype)), spec, put) for b, put, (shape, dtype), spec
                      in zip(in_buffers, puts, bound.avals, traced.in_specs, strict=True)]
            return self.call_message(traced, inputs, out_buffers, keep, call_id)

        # a repeat goes as a CallAgain of the form the controller keeps (Client.post_call)
        msg = client.post_call(traced, tuple(puts), call_id, in_buffers, out_buffers, whole)
        for x in bound.leaves:
            if isinstance(x, Future):
                x._read = True
        if self.donate_argnums:
            self._donate(bound)
        if client.recorder is not None:
            client.recorder.add("call", self.name, began, time.time(), call=msg.call_id, outputs=out_buffers)
        return jax.tree_util.tree_unflatten(traced.out_tree, futures)

    def _may_donate(self, bound: _Args) -> bool:
        """Whether the workers may reuse the donated arguments' buffers: each
        of their futures is read by this call alone (no call or program read
        it before, no fetch for it is out, failed or given up, no wait is out,
        and it is not passed twice), so no transfer or fetch can still be
        reading it; client values put for this call always are. A fetch or
        wait that has been answered reads no more (a worker that still holds a
        view of the shard makes XLA copy that shard instead of reuse it):
        ``jax.block_until_ready(state)`` or a value read before a donating step
        leaves it donating. (Read without a lock: a fetch started by another
        thread while this call is made may race its donation, as in JAX.)"""
        if not self.donate_argnums:
            return False
        donated = self._donated_leaves(bound)
        if not donated:
            return False
        futures = [x for x in bound.leaves if isinstance(x, Future)]
        for k in donated:
            x = bound.leaves[k]
            if isinstance(x, Future) and (x._read or x._fetch is not None or x._wait is not None or
                                          sum(f is x for f in futures) > 1):
                return False
        return True

    def _donated_positions(self, n: int) -> set[int]:
        return {i % n for i in self.donate_argnums if -n <= i < n}

    def _donated_leaves(self, bound: _Args) -> tuple[int, ...]:
        """The indices, among the dynamic leaves, of those of donated arguments."""
        d_args, _ = jax.tree_util.tree_unflatten(bound.in_tree, bound.leaves)
        donated, out, k = self._donated_positions(bound.n_args), [], 0
        for i, a in zip(self._dynamic_positions(bound.n_args), d_args, strict=True):
            count = len(jax.tree_util.tree_leaves(a, is_leaf=_is_arg_leaf))
            if i in donated:
                out += range(k, k + count)
            k += count
        return tuple(out)

    def _donate(self, bound: _Args) -> None:
        """The futures passed in donated arguments are consumed: their buffers
        are released after this call (which reads them) and using them again
        raises."""
        d_args, _ = jax.tree_util.tree_unflatten(bound.in_tree, bound.leaves)
        positions = self._dynamic_positions(bound.n_args)
        donated = self._donated_positions(bound.n_args)
        for i, a in zip(positions, d_args, strict=True):
            if i in donated:
                for x in jax.tree_util.tree_leaves(a, is_leaf=_is_arg_leaf):
                    if isinstance(x, Future):
                        x._donate(self.name)


def _arg_name(fn: Callable, i: int | str) -> str:
    """How the user's function calls its positional argument ``i`` (or keyword ``i``)."""
    if isinstance(i, str):
        return repr(i)
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return repr(params[i].name) if 0 <= i < len(params) else f"#{i}"


def _axis_spec(axis: str, mapped: int | None, ndim: int) -> P:
    """The spec of a pmap input mapped over dimension ``mapped`` (None: not mapped)."""
    if mapped is None:
        return P()
    return P(*([None] * (mapped % ndim if ndim else 0)), axis)


@dataclasses.dataclass(frozen=True)
class _Repeat:
    value: Any
    n: int


def _prefix_leaves(prefix: Any, tree: Any, what: str, is_leaf: Callable[[Any], bool],
                   conv: Callable[[Any], Any]) -> list[Any]:
    """Per leaf of ``tree`` (futures and traced values are leaves), the entry of
    ``prefix`` (a pytree prefix of it, as JAX's in_axes and shardings are) over it."""
    count = lambda sub: len(jax.tree_util.tree_leaves(sub, is_leaf=_is_arg_leaf))    # noqa: E731
    if is_leaf(prefix):
        return [conv(prefix)] * count(tree)
    try:
        reps = jax.tree_util.tree_map(lambda p, sub: _Repeat(conv(p), count(sub)), prefix, tree, is_leaf=is_leaf)
    except (ValueError, TypeError):
        raise ValueError(f"{what} {prefix} does not match argument structure") from None
    return [r.value for r in jax.tree_util.tree_leaves(reps, is_leaf=lambda x: isinstance(x, _Repeat))
            for _ in range(r.n)]


def _devices_list(devices: Any) -> list[VirtualDevice]:
    if isinstance(devices, Slice):
        return list(devices.devices)
    if isinstance(devices, VirtualDevice):
        return [devices]
    return list(devices)


def pmap(fn: Callable, devices: Any, axis_name: str | None = None, *, in_axes: Any = 0,
         out_axes: Any = 0, static_argnums: Any = (), static_broadcasted_argnums: Any = (),
         donate_argnums: Any = ()) -> Computation:
    """Map ``fn`` over an axis of its inputs, one slice per device, like
    ``jax.pmap``. Collectives over ``axis_name`` are allowed. ``in_axes``: the
    mapped axis (None: not mapped, every device sees the whole value) for all
    inputs, or one per positional argument (a pytree prefix of it);
    ``out_axes`` likewise for the outputs. ``static_argnums`` (or JAX's name,
    ``static_broadcasted_argnums``) and ``donate_argnums`` as for :func:`jit`."""
    devs = _devices_list(devices)
    if not devs:
        raise ValueError("pmap needs at least one device")
    axis = axis_name or DEFAULT_PMAP_AXIS
    static = _argnums(getattr(fn, "__name__", "pmap"), "nums", static_argnums) + \
        _argnums(getattr(fn, "__name__", "pmap"), "nums", static_broadcasted_argnums)
    return Computation(fn, Mesh(devs, (axis,)), None, None, axis, in_axes=in_axes, out_axes=out_axes,
                       static_argnums=static, donate_argnums=donate_argnums)


DEVICES_AXIS = "_zp_devices"       # the mesh axis of a zp.jit given devices= instead of a mesh


def jit(fn: Callable, mesh: Mesh | None = None, in_specs: Any = None, out_specs: Any = None, *,
        devices: Any = None, static_argnums: Any = (), static_argnames: Any = (),
        donate_argnums: Any = ()) -> Computation:
    """Run ``fn`` (on global arrays, as with ``jax.jit``) sharded over ``mesh``:
    ``in_specs`` is one PartitionSpec for every input or one per positional
    argument (a pytree prefix of it); ``out_specs`` one for every output or a
    pytree matching the outputs. ``devices=`` instead of a mesh: replicated over
    those devices (one device: on it). ``static_argnums``/``static_argnames``:
    arguments passed as Python values (hashable; a new trace per value), as in
    ``jax.jit``. ``donate_argnums``: arguments whose futures the call consumes (the
    workers reuse their buffers when that call alone reads them: ``_may_donate``)."""
    if devices is not None:
        if mesh is not None:
            raise TypeError(f"{getattr(fn, '__name__', 'zp.jit')}: give mesh= or devices=, not both")
        devs = _devices_list(devices)
        if not devs:
            raise ValueError("zp.jit needs at least one device")
        mesh = Mesh(devs, (DEVICES_AXIS,))
    if not isinstance(mesh, Mesh):
        raise TypeError("zp.jit needs mesh=zp.Mesh(devices, axis_names) or devices=[...]")
    return Computation(fn, mesh, in_specs, out_specs, None, static_argnums=static_argnums,
                       static_argnames=static_argnames, donate_argnums=donate_argnums)


_placements: dict[tuple, Mesh] = {}      # (connection, device ids) -> the mesh device_put uses


def device_put(x: Any, device: Any) -> Any:
    """Place ``x`` (numpy values, futures, a pytree of them) on ``device``: a
    virtual device, a list of them or a slice (replicated on each), or a
    ``zp.NamedSharding`` (sharded as it says); returns futures at once. A
    future moves (or is resharded) where it is to be, without a round trip
    through this process."""
    if isinstance(device, NamedSharding):
        mesh, spec = device.mesh, spec_of(device.spec)
    else:
        devs = _devices_list(device)
        if not devs or any(not isinstance(d, VirtualDevice) for d in devs):
            raise TypeError(f"zp.device_put needs zpath virtual devices or a zp.NamedSharding, not {device!r}")
        where = (id(devs[0].client), tuple(d.id for d in devs))
        mesh = _placements.get(where)
        if mesh is None:
            mesh = _placements[where] = Mesh(devs, (DEVICES_AXIS,))
        spec = P()
    key = ("device_put", spec)
    comp = mesh._ops.get(key)
    if comp is None:
        def device_put(v: Any) -> Any:
            return v
        comp = mesh._ops[key] = Computation(device_put, mesh, spec, spec, None)
    return comp(x)
