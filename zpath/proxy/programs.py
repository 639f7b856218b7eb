"""Programs that arrive through the IFRT proxy: a StableHLO module (the
``xla::ifrt::HloProgram`` a jaxlib client serializes) made into the
``jax.export`` artifact zpath workers compile, with its signature."""
from __future__ import annotations

import dataclasses
import hashlib

import jax
import numpy as np
from jax._src import core
from jax._src.export import _export
from jax._src.interpreters import mlir
from jax._src.lib import _jax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

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


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    digest: str
    blob: bytes                    # the jax.export serialization workers compile
    in_avals: list[Aval]
    out_avals: list[Aval]
    num_partitions: int


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
    return Program(name, hashlib.sha256(blob).hexdigest(), blob, in_avals, out_avals, parts)
