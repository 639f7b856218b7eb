"""``@zp.program``: trace a block of Python that calls compiled functions into one
dataflow graph and submit it as one message.

While a program is traced, calling a compiled function records a node (one per
sharded computation, whatever its number of shards) on symbolic values instead
of running it. The trace is cached per input signature; each call of the program
binds the inputs, assigns fresh buffers and sends one ``Program`` message. Values
of the program that it does not return are freed after their last consumer."""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import weakref
from typing import Any, Callable

import jax
import numpy as np

from zpath.client.arrays import ArrayMethods
from zpath.client.avals import aval_of, dtype_name, host_value
from zpath.client.futures import Future, RunOutputs
from zpath.errors import ZpathError
from zpath.net import codec
from zpath.net import messages as m

_state = threading.local()
_define_lock = threading.Lock()    # guards Traced.templates


def _drop(client: Any, templates: dict[tuple, int]) -> None:
    client.drop_templates([t for t in templates.values() if t > 0])


def _futures(traced: "Traced", buffer_of: Callable[[Any], int]) -> list[Future]:
    """The futures of a run's results (``buffer_of``: a result Value's buffer);
    a value returned twice is one future."""
    seen: dict[int, Future] = {}
    for o in traced.outputs:
        if id(o) not in seen:
            node, i = o.origin[1], o.origin[2]
            seen[id(o)] = node.computation.future(buffer_of(o), node.traced.out_avals[i],
                                                  node.traced.out_specs[i], node.traced.out_keys[i])
    if len(seen) > 1:       # jax.block_until_ready of them asks for all together
        run = RunOutputs(list(seen.values()))
        for f in seen.values():
            f._run = run
    return [seen[id(o)] for o in traced.outputs]


def key_impl(x: Any) -> str | None:
    """The PRNG implementation of a typed key array (``jax.random.key``), else None."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(x))
    return None


def key_aval(x: Any) -> tuple[tuple[int, ...], np.dtype]:
    data = jax.random.key_data(x)
    return tuple(data.shape), np.dtype(data.dtype)


def _frozen(spec: list) -> tuple:
    return tuple(tuple(e) if isinstance(e, list) else e for e in spec)


def _check_future(name: str, fut: Future, client: Any) -> None:
    """A future a program's run reads: this connection's and not donated; it
    is read now (see Computation._may_donate)."""
    if fut._client is not client:
        raise ValueError(f"{name}: an input future belongs to another connection")
    if fut._donated is not None:
        raise ValueError(f"{name}: an input is a future that was donated to {fut._donated} "
                         "(donate_argnums): its buffer is gone")
    fut._read = True


def tracing() -> bool:
    return getattr(_state, "trace", None) is not None


class TracerBoolConversionError(ZpathError, TypeError):
    """The truth (or int, float) of a value inside ``@zp.program`` was asked
    for while tracing, as of a JAX tracer (jax.errors.TracerBoolConversionError)."""


class Value(ArrayMethods):
    """A value inside a program being traced: its shape and dtype are known,
    its contents are not. Operators, indexing and array methods on it record
    nodes that run on its devices (zpath/client/arrays.py)."""

    __slots__ = ("shape", "dtype", "origin", "where", "key")
    _zp_value = True

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, origin: tuple,
                 where: tuple | None = None, key: str | None = None) -> None:
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        # ("input", i) | ("node", node, output) | ("future", Future) | ("const", ndarray)
        self.origin = origin
        self.where = where           # (zp.Mesh, spec) it lives on, when known
        self.key = key               # a typed PRNG key's implementation (the value is its key data)

    @property
    def _key(self) -> str | None:
        return self.key

    def _placement(self, op: str) -> tuple[Any, list]:
        if self.where is None:
            raise ZpathError(f"{op} of {self!r}: this value has no devices yet (a client value "
                             "given to the program): place it with zp.device_put first, or pass a future")
        return self.where

    def __array__(self, *a: Any, **k: Any) -> np.ndarray:
        raise ZpathError("a value inside @zp.program has no contents yet; return it from the "
                         "program and fetch the future instead")

    def _concrete(self, what: str) -> Any:
        raise TracerBoolConversionError(
            f"{what} of {self!r}: a value inside @zp.program has no contents while the program is "
            "traced (as with a JAX tracer, TracerBoolConversionError): choose inside a compiled "
            "function (jnp.where, jax.lax.cond), or return the value and fetch it")

    def __bool__(self) -> bool:
        return self._concrete("the truth value")

    def __int__(self) -> int:
        return self._concrete("int()")

    def __float__(self) -> float:
        return self._concrete("float()")

    def __index__(self) -> int:
        return self._concrete("the index value")

    def __repr__(self) -> str:
        return f"<traced {self.dtype}{list(self.shape)} from {self.origin[0]}>"


@dataclasses.dataclass
class Node:
    computation: Any                   # zpath.client.api.Computation
    traced: Any                        # zpath.client.api._Traced
    inputs: list[Value]
    outputs: list[Value]


class _Trace:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.client: Any = None


def _constant(x: Any, dtype: np.dtype, key: str | None) -> np.ndarray:
    """A value from outside a program, as jax.jit takes it: the value it has
    when traced (a copy, unless a JAX array, which cannot change)."""
    a = host_value(x, dtype, key)
    return a if isinstance(x, jax.Array) or a is not x else a.copy()


def _future_value(x: Future) -> Value:
    return Value(x.shape, x.dtype, ("future", x), (x._mesh, x._spec) if x._mesh is not None else None, x._key)


def record(computation: Any, args: tuple, kwargs: dict) -> Any:
    """Called by a compiled function while a program is traced."""
    trace: _Trace = _state.trace
    if trace.client is None:
        trace.client = computation.client
    elif computation.client is not trace.client:
        raise ValueError("every computation of a program must use one connection")
    bound = computation.bind(args, kwargs)
    values = []
    for x, (shape, dtype), key in zip(bound.leaves, bound.avals, bound.keys, strict=True):
        if isinstance(x, Value):
            values.append(x)
        elif isinstance(x, Future):
            values.append(_future_value(x))
        else:
            values.append(Value(shape, dtype, ("const", _constant(x, dtype, key)), None, key))
    bound.leaves = values
    traced = computation.prepare(bound)
    node = Node(computation, traced, values, [])
    node.outputs = [Value(s, d, ("node", node, i), (computation.mesh, traced.out_specs[i]), traced.out_keys[i])
                    for i, (s, d) in enumerate(traced.out_avals)]
    trace.nodes.append(node)
    return jax.tree_util.tree_unflatten(traced.out_tree, node.outputs)


@dataclasses.dataclass
class Traced:
    nodes: list[Node]
    inputs: list[Value]
    outputs: list[Value]
    out_tree: Any
    client: Any
    # the templates the controller keeps of this trace (see ProgramFunction.__call__),
    # per pattern of inputs that are futures (the others are put): 0 for none
    # (the connection has too many)
    templates: dict[tuple, int] = dataclasses.field(default_factory=dict)
    dropping: Any = None          # the finalizer that drops them
    # for RunProgram: the slots' origins, and each node output's position among
    # a run's new buffers (built on first use)
    layout: tuple | None = None


class ProgramFunction:
    """What ``@zp.program`` returns: call it like the function; every call is one
    dataflow graph submitted as one message, and returns a pytree of futures."""

    def __init__(self, fn: Callable, dispatch: str = "parallel") -> None:
        if dispatch not in ("parallel", "sequential"):
            raise ValueError(f"dispatch must be 'parallel' or 'sequential', not {dispatch!r}")
        self.fn = fn
        self.dispatch = dispatch
        self.name = getattr(fn, "__name__", "program")
        self._cache: dict[Any, Traced] = {}

    def trace(self, *args: Any) -> tuple[Traced, list]:
        """The traced graph for these inputs (cached per input signature) and the
        input leaves to bind."""
        if tracing():      # (before its arguments, which have no contents while tracing)
            raise ZpathError("@zp.program functions cannot be nested: call the inner one's "
                             "compiled functions directly")
        leaves, in_tree = jax.tree_util.tree_flatten(args, is_leaf=lambda x: isinstance(x, Future))
        keys = [x._key if isinstance(x, Future) else key_impl(x) for x in leaves]
        avals = [aval_of(x) if k is None or isinstance(x, Future) else key_aval(x)
                 for x, k in zip(leaves, keys, strict=True)]
        bound = [x if isinstance(x, Future) else host_value(x, a[1], k)
                 for x, a, k in zip(leaves, avals, keys, strict=True)]
        # (a future input's devices: operations on it inside the program run there)
        where = tuple((id(x._mesh), _frozen(x._spec)) if isinstance(x, Future) else None for x in leaves)
        key = (in_tree, tuple((s, d.str) for s, d in avals), tuple(keys), where,
               bool(jax.config.jax_enable_x64))
        traced = self._cache.get(key)
        if traced is None:
            inputs = [_future_value(x) if isinstance(x, Future) else Value(s, d, (), None, k)
                      for x, (s, d), k in zip(leaves, avals, keys, strict=True)]
            for i, v in enumerate(inputs):
                v.origin = ("input", i)
            _state.trace = trace = _Trace()
            try:
                out = self.fn(*jax.tree_util.tree_unflatten(in_tree, inputs))
            finally:
                _state.trace = None
            out_leaves, out_tree = jax.tree_util.tree_flatten(out, is_leaf=lambda x: isinstance(x, Value))
            for o in out_leaves:
                if not isinstance(o, Value) or o.origin[0] != "node":
                    raise ZpathError(f"{self.name}: a program must return values computed by "
                                     f"compiled functions inside it, not {o!r}")
            if not trace.nodes:
                raise ZpathError(f"{self.name}: the program calls no compiled function")
            traced = self._cache[key] = Traced(trace.nodes, inputs, out_leaves, out_tree, trace.client)
        return traced, bound

    def _lower(self, traced: Traced, bound: list, first: int | None = None,
               slots: list[int] | None = None) -> tuple[list[m.Call], list[int], list[Future], list[tuple]]:
        """Calls with fresh buffer ids for one invocation, the buffers to free
        after it (intermediates and client values), the output futures, and the
        client values to put, as (computation, buffer, value, spec): none is
        sent yet (see ``_send``). With ``first``, the
        calls' outputs are numbered ``first, first + 1, ...`` in order, and the
        buffer of every input not made inside the program is appended to
        ``slots`` in order (a template's slots; see DefineProgram)."""
        client = traced.client
        buffers: dict[int, int] = {}               # id(Value) -> buffer id
        put_by: dict[int, int] = {}                # id(Value) -> the node that put it
        puts: list[tuple] = []
        calls = []
        new_id = client.new_buffer_id if first is None else itertools.count(first).__next__
        for n, node in enumerate(traced.nodes):
            inputs = []
            for v, spec in zip(node.inputs, node.traced.in_specs, strict=True):
                aval = m.Aval(list(v.shape), dtype_name(v.dtype))
                kind = v.origin[0]
                source = bound[v.origin[1]] if kind == "input" else v.origin[1] if kind in ("future", "const") else None
                if isinstance(source, Future):
                    _check_future(self.name, source, client)
                    inputs.append(m.CallInput(source.buffer, aval, spec, False))
                elif id(v) in buffers and put_by.get(id(v)) != n:
                    inputs.append(m.CallInput(buffers[id(v)], aval, spec, False))
                elif kind == "node":
                    raise ZpathError(f"{self.name}: internal error: value used before it is produced")
                else:
                    # a client value: put it as its first consumer reads it (a
                    # call cannot read what it puts: one that reads it twice puts it twice)
                    buf = buffers[id(v)] = node.computation.put(source, spec, send=False)
                    puts.append((node.computation, buf, source, spec))
                    put_by[id(v)] = n
                    inputs.append(m.CallInput(buf, aval, spec, True))
                if slots is not None and kind != "node":
                    slots.append(inputs[-1].buffer)
            outs = []
            for o in node.outputs:
                buffers[id(o)] = new_id()
                outs.append(buffers[id(o)])
            calls.append(node.computation.call_message(node.traced, inputs, outs))
        returned = {id(o) for o in traced.outputs}
        intermediates = [buffers[id(o)] for n in traced.nodes for o in n.outputs if id(o) not in returned]
        return (calls, intermediates + [p[1] for p in puts], _futures(traced, lambda o: buffers[id(o)]),
                puts)

    def _send(self, client: Any, msg: Any, puts: list[tuple]) -> None:
        """Send a program's client values, then the program: first checked
        against the size one message may carry, so that a program too large
        fails here, having sent nothing, rather than at the controller."""
        parts = m.program_parts(msg) if type(msg) is m.Program else [msg]
        bodies = [codec.pack_body(p) for p in parts]
        if any(len(body) > codec.MAX_BODY_BYTES for body in bodies):
            raise ZpathError(
                f"{self.name}: this program's plan takes {max(map(len, bodies)) / 2**20:.1f} MiB in one "
                f"message, more than one may carry ({codec.MAX_BODY_BYTES >> 20} MiB): split it into "
                f"smaller programs")
        for computation, buf, value, spec in puts:
            computation.send_put(buf, value, spec)
        for part, body in zip(parts, bodies, strict=True):      # a long program in parts
            client.post(part, body=body)

    def __call__(self, *args: Any) -> Any:
        began = time.time()
        traced, bound = self.trace(*args)
        out = self._submit(traced, bound)
        if traced.client.recorder is not None:
            traced.client.recorder.add("program", self.name, began, time.time(), dispatch=self.dispatch)
        return out

    def _submit(self, traced: Traced, bound: list) -> Any:
        client = traced.client
        if self.dispatch == "parallel":
            pattern = tuple(isinstance(b, Future) for b in bound)
            with _define_lock:
                template = traced.templates.get(pattern)
                if template is None:                  # this thread defines it
                    traced.templates[pattern] = -1
            if template is None:
                number = client.new_template()
                if number:
                    return self._define_template(traced, bound, pattern, number)
                traced.templates[pattern] = 0         # the connection keeps too many
            elif template > 0:
                return self._run_template(traced, bound, template)
            # else no template: too many, or another thread is defining it
        calls, release, futures, puts = self._lower(traced, bound)
        self._send(client, m.Program(client.new_call_id(), self.name, self.dispatch, calls, release), puts)
        return jax.tree_util.tree_unflatten(traced.out_tree, futures)

    def _define_template(self, traced: Traced, bound: list, pattern: tuple, number: int) -> Any:
        """The first run of a pattern: a whole Program, kept by the controller as
        template ``number`` (DefineProgram). The template is recorded only once
        that message is posted, so no run of it can reach the controller first."""
        client = traced.client
        try:
            slots: list[int] = []
            n = sum(len(node.outputs) for node in traced.nodes)
            first = client.new_buffer_ids(n)
            calls, release, futures, puts = self._lower(traced, bound, first=first, slots=slots)
            self._send(client, m.DefineProgram(number, slots, first, n, m.Program(
                client.new_call_id(), self.name, self.dispatch, calls, release)), puts)
        except BaseException:
            with _define_lock:
                del traced.templates[pattern]         # the next run tries again
            client.drop_templates([number])
            raise
        with _define_lock:
            if not traced.dropping:
                # the controller forgets the trace's templates once it is collected
                traced.dropping = weakref.finalize(traced, _drop, client, traced.templates)
            traced.templates[pattern] = number
        return jax.tree_util.tree_unflatten(traced.out_tree, futures)

    def _run_template(self, traced: Traced, bound: list, template: int) -> Any:
        """Run a defined template again: one small RunProgram message (the
        buffers of its slots, in order, and where its new buffers start).
        Client values are put as their first reader reads them, as _lower does."""
        client = traced.client
        if traced.layout is None:
            slots, position = [], {}
            for n, node in enumerate(traced.nodes):
                for v, spec in zip(node.inputs, node.traced.in_specs, strict=True):
                    if v.origin[0] != "node":
                        slots.append((id(v), v.origin[0], v.origin[1], node.computation, spec, n))
                for o in node.outputs:
                    position[id(o)] = len(position)
            traced.layout = (slots, position)
        slots, position = traced.layout
        inputs: list[int] = []
        put: dict[int, tuple[int, int]] = {}       # as in _lower: (buffer, node that put it)
        for key, kind, source, computation, spec, node in slots:
            value = bound[source] if kind == "input" else source
            if isinstance(value, Future):
                _check_future(self.name, value, client)
                inputs.append(value.buffer)
            elif key in put and put[key][1] != node:
                inputs.append(put[key][0])
            else:
                put[key] = (computation.put(value, spec), node)
                inputs.append(put[key][0])
        first = client.new_buffer_ids(len(position))
        futures = _futures(traced, lambda o: first + position[id(o)])
        client.post(m.RunProgram(client.new_call_id(), template, inputs, first,
                                 list(dict.fromkeys(f.buffer for f in futures))))
        return jax.tree_util.tree_unflatten(traced.out_tree, futures)

    def explain(self, *args: Any, file: Any = None) -> str:
        """Print (and return) the plan of this program for these inputs: nodes,
        devices, and the transfers between hosts with their bytes and channel."""
        traced, bound = self.trace(*args)
        calls, _, _, _ = self._lower(traced, bound)
        reply = traced.client.request(m.ExplainRequest(calls))
        lines = [f"program {self.name}: {len(reply.nodes)} node(s), dispatch={self.dispatch}"]
        for k, n in enumerate(reply.nodes):
            lines.append(f"  node {k} {n.name}: island {n.island}, hosts {n.hosts}, devices {n.devices}")
            for t in n.transfers:
                lines.append(f"    transfer buffer {t.buffer}: host {t.src_host} -> host {t.dst_host}, "
                             f"{t.nbytes} bytes over {t.channel}")
        text = "\n".join(lines)
        print(text, file=file)
        return text


def program(fn: Callable | None = None, *, dispatch: str = "parallel") -> Any:
    """Decorator: ``@zp.program`` or ``@zp.program(dispatch="sequential")``."""
    if fn is None:
        return lambda f: ProgramFunction(f, dispatch)
    return ProgramFunction(fn, dispatch)
