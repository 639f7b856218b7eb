"""Pure sharding arithmetic shared by the client and the controller.

A *spec* (PartitionSpec) gives, per array dimension, ``None`` or the mesh axes
that split it. A *region* is the block of the global array one device holds:
``((start, stop), ...)`` per dimension. These functions compute, without any
devices, what ``NamedSharding(mesh, spec).devices_indices_map(shape)`` computes.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Iterable, Sequence

import numpy as np

Region = tuple[tuple[int, int], ...]


def normalize_spec(spec: Any, ndim: int, axis_names: Sequence[str]) -> list[None | str | list[str]]:
    """A PartitionSpec (or sequence) as a wire-ready list of length ``ndim``."""
    entries = list(spec) if spec is not None else []
    if len(entries) > ndim:
        raise ValueError(f"spec {spec} has {len(entries)} entries for an array of rank {ndim}")
    entries += [None] * (ndim - len(entries))
    return [None if not names else names[0] if len(names) == 1 and isinstance(e, str) else names
            for e, names in zip(entries, _spec_axes(entries, axis_names), strict=True)]


def _axes(entry: None | str | Sequence[str]) -> list[str]:
    return [] if entry is None else [entry] if isinstance(entry, str) else list(entry)


def _spec_axes(spec: Sequence[Any], axis_names: Sequence[str]) -> list[list[str]]:
    """The mesh axes of each spec entry; every axis must exist and be used once."""
    out: list[list[str]] = []
    used: set[str] = set()
    for entry in spec:
        axes = _axes(entry)
        for a in axes:
            if a not in axis_names:
                raise ValueError(f"spec {list(spec)} names axis {a!r}; mesh axes are {tuple(axis_names)}")
            if a in used:
                raise ValueError(f"spec {list(spec)} uses axis {a!r} twice")
            used.add(a)
        out.append(axes)
    return out


def regions(shape: Sequence[int], mesh_shape: Sequence[int], axis_names: Sequence[str],
            spec: Sequence[None | str | Sequence[str]]) -> list[Region]:
    """Region of every mesh position (row-major order of the mesh)."""
    sizes = dict(zip(axis_names, mesh_shape, strict=True))
    if any(s < 0 for s in shape):
        raise ValueError(f"shape {list(shape)} has a negative dimension")
    if len(spec) > len(shape):
        raise ValueError(f"spec {list(spec)} has {len(spec)} entries for an array of rank {len(shape)}")
    parts = []
    for d, axes in enumerate(_spec_axes(spec, axis_names)):
        n = math.prod(sizes[a] for a in axes)
        if shape[d] % n:
            raise ValueError(f"dimension {d} of size {shape[d]} is not divisible by "
                             f"{n} (mesh axes {axes})")
        parts.append((axes, n))
    out = []
    for pos in _positions(mesh_shape):
        coord = dict(zip(axis_names, pos, strict=True))
        reg = []
        for d, size in enumerate(shape):
            if d >= len(parts) or not parts[d][0]:
                reg.append((0, size))
                continue
            axes, n = parts[d]
            idx = 0
            for a in axes:
                idx = idx * sizes[a] + coord[a]
            step = size // n
            reg.append((idx * step, (idx + 1) * step))
        out.append(tuple(reg))
    return out


def regions_of(shape: Sequence[int], mesh_shape: Sequence[int], axis_names: Sequence[str],
               spec: Sequence[None | str | Sequence[str]]) -> Sequence[Region]:
    """:func:`regions`, remembered: every host of a computation, and every call
    of a training loop, asks the same. Do not modify the result."""
    return _regions_cached(tuple(shape), tuple(mesh_shape), tuple(axis_names),
                           tuple(a if a is None or isinstance(a, str) else tuple(a) for a in spec))


@functools.lru_cache(maxsize=4096)
def _regions_cached(shape: tuple, mesh_shape: tuple, axis_names: tuple, spec: tuple) -> tuple[Region, ...]:
    return tuple(regions(shape, mesh_shape, axis_names, spec))


def _positions(mesh_shape: Sequence[int]) -> Iterable[tuple[int, ...]]:
    if not mesh_shape:
        yield ()
        return
    total = math.prod(mesh_shape)
    for flat in range(total):
        pos = []
        for s in reversed(mesh_shape):
            pos.append(flat % s)
            flat //= s
        yield tuple(reversed(pos))


def intersect(a: Region, b: Region) -> Region | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def contains(outer: Region, inner: Region) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def local_slices(inner: Region, outer: Region) -> tuple[slice, ...]:
    """Slices that cut ``inner`` out of an array holding ``outer``."""
    return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer, strict=True))


def region_shape(r: Region) -> tuple[int, ...]:
    return tuple(b - a for a, b in r)


def region_from_index(index: Sequence[slice], shape: Sequence[int]) -> Region:
    """Region of a JAX shard index (tuple of slices)."""
    return tuple((s.start or 0, size if s.stop is None else s.stop)
                 for s, size in zip(index, shape, strict=True))


def cut(array: Any, r: Region) -> Any:
    """``array[r]`` as a C-contiguous numpy array of the region's rank (0-d too,
    unlike ``np.ascontiguousarray``, which makes 0-d arrays 1-d)."""
    out = np.asarray(array)[tuple(slice(a, b) for a, b in r) + (Ellipsis,)]
    return out if out.flags.c_contiguous else out.copy(order="C")


@functools.lru_cache(maxsize=256)
def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name (numpy's, or ml_dtypes' like bfloat16);
    remembered (a plan over thousands of devices asks once per shard)."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        import ml_dtypes      # lazy: only dtypes numpy lacks need it (it comes with jax)
        return np.dtype(getattr(ml_dtypes, dtype)).itemsize


def nbytes(r: Region | Sequence[Sequence[int]], dtype: str) -> int:
    return itemsize(dtype) * math.prod(b - a for a, b in r)


def to_wire(r: Region) -> list[list[int]]:
    return [[a, b] for a, b in r]


def from_wire(r: Sequence[Sequence[int]]) -> Region:
    return tuple((int(a), int(b)) for a, b in r)
