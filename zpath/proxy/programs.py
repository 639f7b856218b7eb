"""Programs that arrive through the IFRT proxy: a StableHLO module (the
``xla::ifrt::HloProgram`` a jaxlib client serializes) made into the
``jax.export`` artifact zpath workers compile, with its signature."""
from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from typing import Any

import jax
import numpy as np
from jax._src import core
from jax._src.export import _export
from jax._src.interpreters import mlir
from jax._src.lib import _jax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from zpath.client.avals import Aval

# MLIR element types -> numpy dtypes (the ones a jax program's arguments have)
_ELEMENT_TYPES = {
    "i1": np.dtype(bool), "i8": np.dtype(np.int8), "i16": np.dtype(np.int16),
    "i32": np.dtype(np.int32), "i64": np.dtype(np.int64), "ui8": np.dtype(np.uint8),
    "ui16": np.dtype(np.uint16), "ui32": np.dtype(np.uint32), "ui64": np.dtype(np.uint64),
    "f16": np.dtype(np.float16), "f32": np.dtype(np.float32), "f64": np.dtype(np.float64),
    "bf16": np.dtype(jax.numpy.bfloat16), "complex<f32>": np.dtype(np.complex64),
    "complex<f64>": np.dtype(np.complex128),
}


class UnsupportedProgram(ValueError):
    """A program this server cannot run (what is unsupported is in the message)."""


Spec = list      # a zpath spec: per dimension None, an axis name or a list of them


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    digest: str
    blob: bytes                    # the jax.export serialization workers compile
    in_avals: list[Aval]
    out_avals: list[Aval]
    num_partitions: int
    # the mesh its shardings name (its devices are the device assignment, in
    # order) and every argument's and result's spec over it
    mesh_shape: list[int]
    axis_names: list[str]
    in_specs: list[Spec]
    out_specs: list[Spec]


_MESH = re.compile(r'sdy\.mesh @([\w.$-]+) = <\[(.*?)\]')
_MESH_AXIS = re.compile(r'"([^"]+)"=(\d+)')
_SHARDING = re.compile(r'#sdy\.sharding<@([\w.$-]+), \[(.*?)\]')
_DIM = re.compile(r'\{([^{}]*)\}')


def _meshes(text: str) -> dict[str, tuple[list[str], list[int]]]:
    out = {}
    for name, axes in _MESH.findall(text):
        found = _MESH_AXIS.findall(axes)
        out[name] = ([a for a, _ in found], [int(n) for _, n in found])
    return out


def _spec(attrs: Any, ndim: int, meshes: dict, what: str) -> tuple[str | None, Spec]:
    """The mesh a function argument's or result's Shardy sharding names, and its
    spec (all None when it has none: replicated)."""
    if "sdy.sharding" not in attrs:
        if "mhlo.sharding" in attrs and str(attrs["mhlo.sharding"]).strip('"') not in ("{replicated}", ""):
            raise UnsupportedProgram(f"{what} has a GSPMD sharding {attrs['mhlo.sharding']} (only Shardy's)")
        return None, [None] * ndim
    text = str(attrs["sdy.sharding"])
    match = _SHARDING.match(text)
    if match is None or match.group(1) not in meshes:
        raise UnsupportedProgram(f"{what} has a sharding zpath cannot read: {text}")
    dims = _DIM.findall(match.group(2))
    if len(dims) != ndim:
        raise UnsupportedProgram(f"{what}: sharding {text} for rank {ndim}")
    spec: Spec = []
    for d in dims:
        if ":" in d:
            raise UnsupportedProgram(f"{what} is sharded over a sub-axis: {text}")
        axes = [a.strip().strip('"') for a in d.split(",") if a.strip() and a.strip() != "?"]
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return match.group(1), spec


def _aval(t: ir.Type, what: str) -> Aval:
    try:
        rt = ir.RankedTensorType(t)
    except ValueError:
        raise UnsupportedProgram(f"{what} has type {t}, not a ranked tensor") from None
    if not rt.has_static_shape:
        raise UnsupportedProgram(f"{what} has a dynamic shape {t}")
    dtype = _ELEMENT_TYPES.get(str(rt.element_type))
    if dtype is None:
        raise UnsupportedProgram(f"{what} has element type {rt.element_type}")
    return tuple(rt.shape), dtype


def _module(data: bytes) -> ir.Module:
    """The module of a serialized HloProgram: a StableHLO portable artifact,
    else plain MLIR bytecode or text."""
    try:
        return _jax.mlir.deserialize_portable_artifact(data)
    except Exception:
        try:
            return ir.Module.parse(data)
        except Exception as e:
            raise UnsupportedProgram(f"the program is neither a StableHLO portable artifact nor MLIR: "
                                     f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def identity(shape: tuple[int, ...], dtype: np.dtype, mesh_shape: list[int], axis_names: list[str],
             spec: Spec, platform: str) -> Program:
    """A program that returns its one input, read and written in ``spec`` over a
    mesh: running it on other devices moves a value there, worker to worker
    (the controller plans the transfers, as for any input)."""
    am = AbstractMesh(tuple(mesh_shape), tuple(axis_names))
    ps = PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in spec))
    arg = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(am, ps))
    with jax.enable_x64(True):
        exported = jax.export.export(jax.jit(lambda x: x, out_shardings=NamedSharding(am, ps)),
                                     platforms=(platform,))(arg)
    blob = bytes(exported.serialize())
    aval = (tuple(shape), np.dtype(dtype))
    return Program("copy", hashlib.sha256(blob).hexdigest(), blob, [aval], [aval], math.prod(mesh_shape),
                   list(mesh_shape), list(axis_names), [list(spec)], [list(spec)])


def from_hlo_program(data: bytes, platform: str) -> Program:
    """The zpath program of a serialized ``xla::ifrt::HloProgram``."""
    with mlir.make_ir_context():
        module = _module(data)
        main = None
        for op in module.body.operations:
            if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main":
                main = op
        if main is None:
            raise UnsupportedProgram("the program has no main function")
        ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        in_avals = [_aval(t, f"argument {i}") for i, t in enumerate(ftype.inputs)]
        out_avals = [_aval(t, f"result {i}") for i, t in enumerate(ftype.results)]
        meshes = _meshes(str(module))
        arg_attrs = list(ir.ArrayAttr(main.attributes["arg_attrs"])) if "arg_attrs" in main.attributes else []
        res_attrs = list(ir.ArrayAttr(main.attributes["res_attrs"])) if "res_attrs" in main.attributes else []
        ins = [_spec(ir.DictAttr(arg_attrs[i]) if arg_attrs else {}, len(a[0]), meshes, f"argument {i}")
               for i, a in enumerate(in_avals)]
        outs = [_spec(ir.DictAttr(res_attrs[i]) if res_attrs else {}, len(a[0]), meshes, f"result {i}")
                for i, a in enumerate(out_avals)]
        named = {n for n, _ in ins + outs if n is not None}
        if len(named) > 1:
            raise UnsupportedProgram(f"shardings over several meshes {sorted(named)}")
        axis_names, mesh_shape = meshes[named.pop()] if named else ([], [])
        attrs = module.operation.attributes
        parts = ir.IntegerAttr(attrs["mhlo.num_partitions"]).value if "mhlo.num_partitions" in attrs else 1
        replicas = ir.IntegerAttr(attrs["mhlo.num_replicas"]).value if "mhlo.num_replicas" in attrs else 1
        if replicas != 1:
            raise UnsupportedProgram(f"a program with {replicas} replicas (only SPMD partitions are supported)")
        name = ir.StringAttr(attrs["sym_name"]).value if "sym_name" in attrs else "main"
        target = hlo.get_version_from_compatibility_requirement(hlo.StablehloCompatibilityRequirement.WEEK_4)
        serialized = _jax.mlir.serialize_portable_artifact(module, target, False)
    n_in, n_out = len(in_avals), len(out_avals)
    exported = _export.Exported(
        fun_name=name,
        in_tree=jax.tree_util.tree_structure((tuple(range(n_in)), {})),
        in_avals=tuple(core.ShapedArray(s, d) for s, d in in_avals),
        out_tree=jax.tree_util.tree_structure(tuple(range(n_out))),
        out_avals=tuple(core.ShapedArray(s, d) for s, d in out_avals),
        _has_named_shardings=True, _in_named_shardings=(None,) * n_in, _out_named_shardings=(None,) * n_out,
        in_shardings_hlo=(None,) * n_in, out_shardings_hlo=(None,) * n_out,
        nr_devices=parts, platforms=(platform,), ordered_effects=(), unordered_effects=(),
        disabled_safety_checks=(), mlir_module_serialized=serialized,
        calling_convention_version=_export.maximum_supported_calling_convention_version,
        module_kept_var_idx=tuple(range(n_in)), uses_global_constants=False, _get_vjp=None)
    blob = bytes(exported.serialize())
    if not axis_names:               # nothing sharded: one axis over every device
        axis_names, mesh_shape = ["d"], [parts]
    if math.prod(mesh_shape) != parts:
        raise UnsupportedProgram(f"a mesh {dict(zip(axis_names, mesh_shape, strict=True))} of "
                                 f"{math.prod(mesh_shape)} devices for {parts} partitions")
    return Program(name, hashlib.sha256(blob).hexdigest(), blob, in_avals, out_avals, parts,
                   list(mesh_shape), list(axis_names), [s for _, s in ins], [s for _, s in outs])
