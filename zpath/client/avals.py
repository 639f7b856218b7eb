"""The abstract value (shape, dtype) of what a compiled function is given:
shared by direct calls (api) and traced programs (tracer).

Dtypes are JAX's canonical ones under the caller's ``jax_enable_x64`` (read
when the call is made, as jax.jit reads it): float32 and int32 by default, so a
numpy float64 array or a Python float is computed on in float32, as plain JAX
would."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from zpath.client.futures import Future

Aval = tuple[tuple[int, ...], np.dtype]


def aval_of(x: Any) -> Aval:
    """Shape and dtype of an input: a future's or a traced value's, or a
    numeric array's or scalar's (canonical, see the module's docstring);
    TypeError for anything else (objects, strings, records...)."""
    if isinstance(x, Future) or getattr(x, "_zp_value", False):
        return x.shape, x.dtype
    a = np.asarray(x)
    if a.dtype.kind in "OUSMm" or a.dtype.fields is not None:      # (bfloat16 and float8 are "V")
        raise TypeError(f"cannot pass a {type(x).__name__} (dtype {a.dtype}) to a zpath computation: "
                        "inputs are numeric arrays, scalars, typed PRNG keys or futures")
    return a.shape, np.dtype(jax.dtypes.canonicalize_dtype(a.dtype))


_NAMES: dict[Any, str] = {}


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, remembered: numpy works it out anew each time, at a
    cost that shows in every call a client makes."""
    try:
        return _NAMES[dtype]
    except KeyError:
        name = dtype.name
        if len(_NAMES) < 256:
            _NAMES[dtype] = name
        return name
    except TypeError:           # not hashable: not remembered
        return dtype.name


def host_value(x: Any, dtype: np.dtype, key: str | None = None) -> np.ndarray:
    """The array a client value is sent as: its canonical dtype (``dtype``,
    from aval_of), or a typed key's key data."""
    if key is not None:
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x, dtype=dtype)
