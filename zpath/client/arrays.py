"""Futures and traced values as arrays: Python operators, indexing and the
common array methods, as on a ``jax.Array``.

Each operation runs as a small compiled function on the devices of its first
operand that has devices (a future, or a value inside ``@zp.program``) and
returns a future (or records a node, while a program is traced), as JAX's eager
operations run on a sharded array's devices. The other operands are read where
they are (the controller moves them if they live elsewhere). The output keeps
the first operand's sharding when it has its shape, and is replicated
otherwise. The compiled function of an operation is cached per (operation,
static arguments, input avals, shardings) on the mesh (``Mesh.eager``), so a
loop compiles it once."""
from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
import numpy as np


def _placed(x: Any) -> bool:
    return getattr(x, "_zp_array", False)


def _freeze(v: Any) -> Any:
    """A hashable form of an index or static argument (slices are not
    hashable before Python 3.12)."""
    if isinstance(v, slice):
        return ("slice", v.start, v.stop, v.step)
    if isinstance(v, tuple):
        return tuple(_freeze(e) for e in v)
    if isinstance(v, list):
        return ("list", tuple(_freeze(e) for e in v))
    return v


def apply(name: str, fn: Callable, operands: tuple, static: Any = ()) -> Any:
    """Run ``fn(*operands)`` (``static``: what ``fn`` closes over, part of the
    cache key) on the devices of the first operand that has any."""
    anchor = next(o for o in operands if _placed(o))
    mesh, spec = anchor._placement(name)
    return mesh.eager(name, fn, _freeze(static), operands, anchor, spec)


def _binary(name: str, fn: Callable, reflected: bool = False) -> Callable:
    def method(self: Any, other: Any) -> Any:
        if not _operand(other):
            return NotImplemented
        return apply(name, fn, (other, self) if reflected else (self, other))
    method.__name__ = f"__{'r' if reflected else ''}{name}__"
    return method


def _unary(name: str, fn: Callable) -> Callable:
    def method(self: Any) -> Any:
        return apply(name, fn, (self,))
    method.__name__ = f"__{name}__"
    return method


def _operand(x: Any) -> bool:
    """Whether an operator takes ``x`` as its other operand (an array, a
    number, a future or a traced value)."""
    return _placed(x) or isinstance(x, (int, float, complex, bool, np.ndarray, np.generic)) or \
        hasattr(x, "__array__")


def _split_index(idx: Any) -> tuple[tuple, list]:
    """An index as (its static structure, with None where an array goes,
    and the arrays, futures or traced values in it)."""
    items = idx if isinstance(idx, tuple) else (idx,)
    static, arrays = [], []
    for e in items:
        if e is None or e is Ellipsis or isinstance(e, (int, np.integer, slice)):
            if isinstance(e, slice) and any(_placed(b) for b in (e.start, e.stop, e.step)):
                raise TypeError("a slice's bounds must be Python ints: index with a future or traced "
                                "value as an array index, or use jax.lax.dynamic_slice in a compiled function")
            static.append(("i", int(e)) if isinstance(e, np.integer) else ("i", e))
        else:
            static.append(("a",))
            arrays.append(e)
    return tuple(static), arrays


def _index_fn(static: tuple) -> Callable:
    def index(x: Any, *arrays: Any) -> Any:
        it = iter(arrays)
        return x[tuple(e[1] if e[0] == "i" else next(it) for e in static)]
    return index


class ArrayMethods:
    """The array interface of :class:`~zpath.Future` and of a traced value.
    A subclass gives ``shape``, ``dtype`` and ``_placement(op) -> (mesh, spec)``."""

    __slots__ = ()
    _zp_array = True
    __array_priority__ = 100       # numpy defers to these operators

    shape: tuple[int, ...]
    dtype: np.dtype

    def _placement(self, op: str) -> tuple[Any, list]:
        raise NotImplementedError

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    __add__ = _binary("add", jnp.add)
    __radd__ = _binary("add", jnp.add, True)
    __sub__ = _binary("sub", jnp.subtract)
    __rsub__ = _binary("sub", jnp.subtract, True)
    __mul__ = _binary("mul", jnp.multiply)
    __rmul__ = _binary("mul", jnp.multiply, True)
    __truediv__ = _binary("truediv", jnp.true_divide)
    __rtruediv__ = _binary("truediv", jnp.true_divide, True)
    __floordiv__ = _binary("floordiv", jnp.floor_divide)
    __rfloordiv__ = _binary("floordiv", jnp.floor_divide, True)
    __mod__ = _binary("mod", jnp.mod)
    __rmod__ = _binary("mod", jnp.mod, True)
    __pow__ = _binary("pow", jnp.power)
    __rpow__ = _binary("pow", jnp.power, True)
    __matmul__ = _binary("matmul", jnp.matmul)
    __rmatmul__ = _binary("matmul", jnp.matmul, True)
    __and__ = _binary("and", jnp.bitwise_and)
    __rand__ = _binary("and", jnp.bitwise_and, True)
    __or__ = _binary("or", jnp.bitwise_or)
    __ror__ = _binary("or", jnp.bitwise_or, True)
    __xor__ = _binary("xor", jnp.bitwise_xor)
    __rxor__ = _binary("xor", jnp.bitwise_xor, True)
    __lshift__ = _binary("lshift", jnp.left_shift)
    __rlshift__ = _binary("lshift", jnp.left_shift, True)
    __rshift__ = _binary("rshift", jnp.right_shift)
    __rrshift__ = _binary("rshift", jnp.right_shift, True)
    __lt__ = _binary("lt", jnp.less)
    __le__ = _binary("le", jnp.less_equal)
    __gt__ = _binary("gt", jnp.greater)
    __ge__ = _binary("ge", jnp.greater_equal)
    __eq__ = _binary("eq", jnp.equal)          # type: ignore[assignment]
    __ne__ = _binary("ne", jnp.not_equal)      # type: ignore[assignment]
    __hash__ = object.__hash__                 # (identity, as before: futures stay usable as keys)
    __neg__ = _unary("neg", jnp.negative)
    __pos__ = _unary("pos", jnp.positive)
    __abs__ = _unary("abs", jnp.abs)
    __invert__ = _unary("invert", jnp.invert)

    def __getitem__(self, idx: Any) -> Any:
        static, arrays = _split_index(idx)
        return apply("getitem", _index_fn(static), (self, *arrays), static)

    def __iter__(self) -> Any:
        if not self.shape:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    @property
    def T(self) -> Any:
        return apply("transpose", jnp.transpose, (self,))

    def transpose(self, *axes: Any) -> Any:
        axes = tuple(axes[0]) if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        return apply("transpose", lambda x: jnp.transpose(x, axes or None), (self,), axes)

    def reshape(self, *shape: Any) -> Any:
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return apply("reshape", lambda x: jnp.reshape(x, shape), (self,), shape)

    def astype(self, dtype: Any) -> Any:
        dtype = np.dtype(dtype)
        return apply("astype", lambda x: x.astype(dtype), (self,), dtype.str)

    def ravel(self) -> Any:
        return self.reshape(-1)

    def flatten(self) -> Any:
        return self.reshape(-1)

    def squeeze(self, axis: Any = None) -> Any:
        return apply("squeeze", lambda x: jnp.squeeze(x, axis), (self,), axis)

    def sum(self, axis: Any = None, keepdims: bool = False) -> Any:
        return apply("sum", lambda x: jnp.sum(x, axis, keepdims=keepdims), (self,), (axis, keepdims))

    def mean(self, axis: Any = None, keepdims: bool = False) -> Any:
        return apply("mean", lambda x: jnp.mean(x, axis, keepdims=keepdims), (self,), (axis, keepdims))

    def max(self, axis: Any = None, keepdims: bool = False) -> Any:
        return apply("max", lambda x: jnp.max(x, axis, keepdims=keepdims), (self,), (axis, keepdims))

    def min(self, axis: Any = None, keepdims: bool = False) -> Any:
        return apply("min", lambda x: jnp.min(x, axis, keepdims=keepdims), (self,), (axis, keepdims))

    def argmax(self, axis: Any = None) -> Any:
        return apply("argmax", lambda x: jnp.argmax(x, axis), (self,), axis)

    def argmin(self, axis: Any = None) -> Any:
        return apply("argmin", lambda x: jnp.argmin(x, axis), (self,), axis)
