"""The abstract value (shape, dtype) of what a compiled function is given:
shared by direct calls (api) and traced programs (tracer)."""
from __future__ import annotations

from typing import Any

import numpy as np

from zpath.client.futures import Future

Aval = tuple[tuple[int, ...], np.dtype]


def aval_of(x: Any) -> Aval:
    """Shape and dtype of an input: a future's, or a numeric array's or
    scalar's; TypeError for anything else (objects, strings, records...)."""
    if isinstance(x, Future):
        return x.shape, x.dtype
    a = np.asarray(x)
    if a.dtype.kind in "OUSMm" or a.dtype.fields is not None:      # (bfloat16 and float8 are "V")
        raise TypeError(f"cannot pass a {type(x).__name__} (dtype {a.dtype}) to a zpath computation: "
                        "inputs are numeric arrays, scalars or futures")
    return a.shape, a.dtype
