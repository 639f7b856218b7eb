"""One IFRT proxy session: the requests of one JAX client, carried out on zpath.

A :class:`Session` keeps the client's arrays, executables and futures by the
handles the client gave them. Arrays made from host buffers stay in this process
until a computation reads them; they are then put onto the workers in the
layout that computation reads (as ``zp.jit`` puts its numpy inputs), and from
then on they are zpath buffers (:class:`~zpath.client.futures.Future`).
Executables are the client's StableHLO made into ``jax.export`` artifacts,
registered once with the controller; an execution is one zpath ``Call``.
Dropping or destructing an array releases its buffer; a closed session
releases all of them.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import math
import threading
from typing import Any, Callable

import numpy as np

from zpath import sharding
from zpath.client.futures import Future
from zpath.net import messages as m
from zpath.proxy import programs
from zpath.proxy.schema import Schema

log = logging.getLogger(__name__)

# tensorflow.error.Code values
OK, CANCELLED, INVALID_ARGUMENT, NOT_FOUND, UNIMPLEMENTED, INTERNAL = 0, 1, 3, 5, 12, 13
# handles this server makes (futures, executables) never meet the client's (counted from 1)
SERVER_HANDLES_FROM = 1 << 62
# (jaxlib 0.10 names it XlaProgram; earlier ones HloProgram)
HLO_PROGRAMS = ("xla::ifrt::XlaProgram", "xla::ifrt::HloProgram")
XLA_COMPILE_OPTIONS = "xla::ifrt::XlaCompileOptions"
HLO_SHARDING = "xla::ifrt::HloSharding"
SINGLE_DEVICE_SHARDING = "xla::ifrt::SingleDeviceSharding"
CONCRETE_EVEN_SHARDING = "xla::ifrt::ConcreteEvenSharding"
OP_SHARDING_REPLICATED, OP_SHARDING_MAXIMAL, OP_SHARDING_OTHER = 0, 1, 3
MEMORY_KIND = "device"
AXIS = "d"       # the one axis of the meshes arrays and computations run on


class Unsupported(Exception):
    """A request this server does not carry out (answered UNIMPLEMENTED)."""


class Failed(Exception):
    """A request that cannot be carried out: ``code`` is its status code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


_KINDS = {"PRED": np.dtype(bool), "S8": np.dtype(np.int8), "S16": np.dtype(np.int16),
          "S32": np.dtype(np.int32), "S64": np.dtype(np.int64), "U8": np.dtype(np.uint8),
          "U16": np.dtype(np.uint16), "U32": np.dtype(np.uint32), "U64": np.dtype(np.uint64),
          "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
          "BF16": programs._ELEMENT_TYPES["bf16"], "C64": np.dtype(np.complex64),
          "C128": np.dtype(np.complex128)}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where an array's pieces are, as zpath says it: a mesh of devices and a
    spec over it (an IFRT sharding read into these terms)."""
    mesh_shape: list[int]
    axis_names: list[str]
    devices: list[int]            # mesh positions in row-major order
    spec: list
    ifrt_devices: list[int]       # the IFRT sharding's device list (shard indices count in it)

    def regions(self, shape: tuple[int, ...]) -> list[sharding.Region]:
        return sharding.regions(shape, self.mesh_shape, self.axis_names, self.spec)

    def region_of(self, shape: tuple[int, ...]) -> dict[int, sharding.Region]:
        """Device -> the block of the array it holds."""
        return dict(zip(self.devices, self.regions(shape), strict=True))


def whole_on(devices: list[int], ndim: int) -> Layout:
    """A whole copy on each of ``devices``."""
    return Layout([len(devices)], [AXIS], list(devices), [None] * ndim, list(devices))


@dataclasses.dataclass
class Array:
    """One IFRT array: its value is either here (``host``, not yet read by a
    computation) or on the workers (``future``). ``region``: the array is that
    block of ``future``'s value (one shard of a sharded array)."""
    shape: tuple[int, ...]
    dtype: np.dtype
    layout: Layout
    host: np.ndarray | None = None
    future: Future | None = None
    region: sharding.Region | None = None
    deleted: bool = False

    @property
    def devices(self) -> list[int]:
        return self.layout.devices


@dataclasses.dataclass
class Executable:
    program: programs.Program
    devices: list[int]            # its device assignment: mesh positions in row-major order

    def layout(self, spec: list) -> Layout:
        p = self.program
        return Layout(p.mesh_shape, p.axis_names, self.devices, spec, self.devices)


class HostBuffers:
    """The session's host buffer store: bytes the client stores before a request
    that reads them (MakeArrayFromHostBuffer) and reads after one that writes
    them (CopyToHostBuffer). A lookup waits for a store still on its way."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._data: dict[int, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False

    def store(self, handle: int, data: bytes) -> None:
        with self._cond:
            if handle in self._data:
                raise Failed(INVALID_ARGUMENT, f"host buffer {handle} already exists")
            self._data[handle] = data
            self._cond.notify_all()

    def lookup(self, handle: int, pop: bool = False) -> bytes:
        with self._cond:
            if not self._cond.wait_for(lambda: handle in self._data or self._closed, self.timeout_s):
                raise Failed(NOT_FOUND, f"host buffer {handle} did not arrive within {self.timeout_s:g}s")
            if handle not in self._data:
                raise Failed(CANCELLED, "the session is closed")
            return self._data.pop(handle) if pop else self._data[handle]

    def delete(self, handle: int) -> None:
        with self._cond:
            if self._data.pop(handle, None) is None:
                raise Failed(NOT_FOUND, f"no host buffer {handle}")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._data.clear()
            self._cond.notify_all()


class Session:
    """The state of one client's session; ``handle`` answers one request
    through ``reply`` (at once, or later from a worker thread for requests that
    wait for values)."""

    def __init__(self, session_id: int, schema: Schema, client: Any, platform: str,
                 version: Any, host_timeout_s: float = 60.0) -> None:
        self.id = session_id
        self.s = schema
        self.client = client
        self.platform = platform
        self.version = version
        self.buffers = HostBuffers(host_timeout_s)
        self.arrays: dict[int, Array] = {}
        self.executables: dict[int, Executable] = {}
        self.futures: dict[int, BaseException | None] = {}    # handle -> its error (None: ok)
        self._handles = itertools.count(SERVER_HANDLES_FROM)
        self._copies: dict[tuple, programs.Program] = {}      # identity programs, by signature
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix=f"ifrt-session-{session_id}")

    # ---- the request loop ---------------------------------------------------
    def handle(self, req: Any, reply: Callable[[Any], None]) -> None:
        """Answer ``req``: ``reply`` gets its IfrtResponse, now or later."""
        op_id = req.request_metadata.op_id
        which = req.WhichOneof("request")
        resp = self.s.IfrtResponse()
        resp.response_metadata.op_id = op_id
        log.debug("session %d op %d: %s", self.id, op_id, which)
        handler = getattr(self, f"_{which}", None) if which else None
        if handler is None:
            self._error(resp, UNIMPLEMENTED, f"zpath's IFRT proxy does not support {which or 'an empty request'}")
            reply(resp)
            return
        try:
            later = handler(getattr(req, which), resp)
        except Unsupported as e:
            self._error(resp, UNIMPLEMENTED, f"zpath's IFRT proxy does not support {e}")
        except Failed as e:
            self._error(resp, e.code, str(e))
        except Exception as e:      # a bug or a zpath error: the client sees it, the server goes on
            log.exception("IFRT proxy: %s failed", which)
            self._error(resp, INTERNAL, f"{which}: {type(e).__name__}: {e}")
        else:
            if later is not None:      # finish off the request thread, then answer
                self._pool.submit(self._finish, later, resp, reply, which)
                return
            _mark(resp, which)
        reply(resp)

    def _finish(self, later: Callable[[Any], None], resp: Any, reply: Callable[[Any], None],
                which: str) -> None:
        try:
            later(resp)
            _mark(resp, which)
        except Failed as e:
            self._error(resp, e.code, str(e))
        except Exception as e:
            self._error(resp, INTERNAL, f"{which}: {type(e).__name__}: {e}")
        reply(resp)

    def _error(self, resp: Any, code: int, message: str) -> None:
        which = resp.WhichOneof("response")
        if which:
            resp.ClearField(which)
        resp.response_metadata.status.code = code
        resp.response_metadata.status.message = message

    def close(self) -> None:
        """The client is gone: release everything it held."""
        self.arrays.clear()           # dropping the futures releases their buffers
        self.executables.clear()
        self.futures.clear()
        self.buffers.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- helpers ------------------------------------------------------------
    def _new_handle(self) -> int:
        return next(self._handles)

    def _array(self, handle: int) -> Array:
        a = self.arrays.get(handle)
        if a is None:
            raise Failed(NOT_FOUND, f"unknown array handle {handle}")
        if a.deleted:
            raise Failed(INVALID_ARGUMENT, f"array {handle} was deleted")
        return a

    def _dtype(self, proto: Any) -> np.dtype:
        name = self.s.pool.FindEnumTypeByName("xla.ifrt.DTypeProto.Kind").values_by_number[proto.kind].name
        dtype = _KINDS.get(name.removeprefix("KIND_"))
        if dtype is None:
            raise Unsupported(f"arrays of dtype {name}")
        return dtype

    def _dtype_proto(self, dtype: np.dtype, out: Any) -> None:
        name = next(k for k, v in _KINDS.items() if v == dtype)
        out.kind = self.s.pool.FindEnumTypeByName("xla.ifrt.DTypeProto.Kind").values_by_name[f"KIND_{name}"].number

    def _layout(self, proto: Any, shape: tuple[int, ...]) -> Layout:
        """The zpath layout of an IFRT sharding of an array of ``shape``."""
        ser = proto.serialized_sharding
        match ser.type_name:
            case "xla::ifrt::HloSharding":
                hlo = self.s.message("xla.ifrt.HloShardingProto").FromString(ser.data)
                return op_sharding_layout(hlo.xla_op_sharding, list(hlo.devices.device_ids), len(shape))
            case "xla::ifrt::SingleDeviceSharding":
                device = self.s.message("xla.ifrt.SingleDeviceShardingProto").FromString(ser.data).device_id
                return whole_on([device], len(shape))
            case "xla::ifrt::ConcreteEvenSharding":
                ces = self.s.message("xla.ifrt.ConcreteEvenShardingProto").FromString(ser.data)
                devices = list(ces.devices.device_ids)
                if not ces.is_fully_replicated and len(devices) > 1:
                    raise Unsupported("arrays with a ConcreteEvenSharding over several devices")
                return whole_on(devices, len(shape))
            case other:
                raise Unsupported(f"sharding {other}")

    def _sharding_proto(self, layout: Layout, ndim: int, out: Any) -> None:
        """The HloSharding of ``layout``."""
        hlo = self.s.message("xla.ifrt.HloShardingProto")()
        hlo.devices.device_ids.extend(layout.devices)
        hlo.memory_kind = MEMORY_KIND
        op_sharding_of(layout, ndim, hlo.xla_op_sharding)
        out.serialized_sharding.type_name = HLO_SHARDING
        out.serialized_sharding.data = hlo.SerializeToString()

    def _check_devices(self, devices: list[int]) -> None:
        unknown = [d for d in devices if d not in self.client.devices]
        if unknown:
            raise Failed(INVALID_ARGUMENT, f"unknown device ids {unknown}")

    def _ready_future(self, error: BaseException | None = None) -> int:
        handle = self._new_handle()
        self.futures[handle] = error
        return handle

    # ---- requests -----------------------------------------------------------
    def _init_request(self, req: Any, resp: Any) -> None:
        r = resp.init_response
        r.session_id = self.id
        r.platform_name = self.platform
        r.platform_version = "zpath"
        r.platform_id = 0
        r.process_index = 0
        r.runtime_type = "zpath"
        for d in sorted(self.client.devices.values(), key=lambda d: d.id):
            dev = r.all_devices.add()
            dev.id = d.id
            dev.local_device_id = d.id
            dev.local_hardware_id = d.id
            dev.platform_name = self.platform
            dev.device_kind = self.platform
            dev.default_memory_id = d.id
            dev.memory_ids.append(d.id)
            dev.to_string = f"ZpathDevice(id={d.id}, host={d.host}, island={d.island})"
            dev.debug_string = dev.to_string
            r.addressable_device_ids.append(d.id)
            r.primary_device_ids.append(d.id)
            mem = r.memories.add()
            mem.id = d.id
            mem.memory_space_kind = MEMORY_KIND
            mem.device_ids.append(d.id)
            mem.to_string = mem.debug_string = f"{MEMORY_KIND}({d.id})"

    def _make_array_from_host_buffer_request(self, req: Any, resp: Any) -> None:
        dtype = self._dtype(req.dtype)
        shape = tuple(req.shape.dims)
        layout = self._layout(req.sharding, shape)
        self._check_devices(layout.devices)
        # requests are answered in order, so this one waits for its bytes (the
        # client streams them beside the request)
        value = _host_value(self.buffers.lookup(req.host_buffer_handle, pop=True), dtype, shape,
                            list(req.byte_strides.strides) if req.HasField("byte_strides") else None)
        handle = req.array_handle if req.HasField("array_handle") else self._new_handle()
        self.arrays[handle] = Array(shape, dtype, layout, host=value)
        resp.make_array_from_host_buffer_response.array_handle = handle

    def _make_arrays_from_host_buffer_shards_request(self, req: Any, resp: Any) -> None:
        handles = list(req.array_handles) or [self._new_handle() for _ in req.specs]
        if len(handles) != len(req.specs):
            raise Failed(INVALID_ARGUMENT, f"{len(handles)} handles for {len(req.specs)} arrays")
        made = []
        for spec in req.specs:
            dtype = self._dtype(spec.array_spec.dtype)
            shape = tuple(spec.array_spec.shape.dims)
            layout = self._layout(spec.array_spec.sharding, shape)
            self._check_devices(layout.devices)
            region_of = layout.region_of(shape)
            value = np.zeros(shape, dtype)
            for indices, hb in zip(spec.addressable_shard_indices, spec.host_buffers, strict=True):
                part = _host_value(self.buffers.lookup(hb.host_buffer_handle, pop=True), dtype,
                                   tuple(hb.shape.dims),
                                   list(hb.byte_strides.strides) if hb.HasField("byte_strides") else None)
                for i in indices.indices:
                    value[_slices(region_of[layout.ifrt_devices[i]])] = part
            made.append(Array(shape, dtype, layout, host=value))
        for h, a in zip(handles, made, strict=True):
            self.arrays[h] = a
        resp.make_arrays_from_host_buffer_shards_response.array_handles.extend(handles)

    def _copy_to_host_buffer_request(self, req: Any, resp: Any) -> Callable[[Any], None]:
        array = self._array(req.array_handle)
        if req.HasField("byte_strides") and list(req.byte_strides.strides) != _c_strides(array.shape, array.dtype):
            raise Unsupported("copies to host buffers with strides other than C order")
        host, fut, region = array.host, array.future, array.region

        def copy(resp: Any) -> None:
            value = _value(host, fut, region)
            self.buffers.store(req.host_buffer_handle, np.asarray(value, dtype=array.dtype).tobytes(order="C"))
            resp.copy_to_host_buffer_response.SetInParent()
        return copy

    def _check_value_ready_request(self, req: Any, resp: Any) -> Callable[[Any], None]:
        values = [(a.host, a.future, a.region) for a in map(self._array, req.value_handles)]

        def ready(resp: Any) -> None:
            for host, fut, region in values:
                _value(host, fut, region)
            resp.check_value_ready_response.SetInParent()
        return ready

    def _fully_replicated_shard_request(self, req: Any, resp: Any) -> None:
        a = self._array(req.array_handle)
        handle = req.result_handle or self._new_handle()
        self.arrays[handle] = dataclasses.replace(a, layout=whole_on(a.devices[:1], len(a.shape)))
        resp.fully_replicated_shard_response.array_handle = handle

    def _disassemble_into_single_device_arrays_request(self, req: Any, resp: Any) -> None:
        """One single-device array per device of the array's layout: the block
        that device holds (a view of the same value)."""
        a = self._array(req.array_handle)
        regions = a.layout.regions(a.shape)
        handles = list(req.result_handles) or [self._new_handle() for _ in regions]
        if len(handles) != len(regions):
            raise Failed(INVALID_ARGUMENT, f"{len(handles)} handles for {len(regions)} shards")
        under = a.host.shape if a.host is not None else a.future.shape if a.future is not None else a.shape
        for h, d, r in zip(handles, a.layout.devices, regions, strict=True):
            if a.region is not None:       # a block of a block
                r = tuple((o + b0, o + b1) for (o, _), (b0, b1) in zip(a.region, r, strict=True))
            shape = sharding.region_shape(r)
            self.arrays[h] = Array(shape, a.dtype, whole_on([d], len(shape)), a.host, a.future,
                                   None if r == tuple((0, n) for n in under) else r)
        resp.disassemble_into_single_device_arrays_response.array_handles.extend(handles)

    def _assemble_array_from_single_device_arrays_request(self, req: Any, resp: Any) -> None:
        """An array from single-device ones: the same value again when they are
        the blocks of one value where this sharding puts them, else assembled
        here from their values."""
        shape = tuple(req.shape.dims)
        layout = self._layout(req.sharding, shape)
        parts = [self._array(h) for h in req.single_device_array_handles]
        dtype = self._dtype(req.dtype) if req.HasField("dtype") else parts[0].dtype
        region_of = layout.region_of(shape)
        wanted = [region_of[p.devices[0]] for p in parts]
        whole = tuple((0, n) for n in shape)
        handle = req.result_handle or self._new_handle()
        first = parts[0].future
        if first is not None and first.shape == shape and all(
                p.future is first and (p.region or whole) == r for p, r in zip(parts, wanted, strict=True)):
            self.arrays[handle] = Array(shape, dtype, layout, future=first)
        else:
            value = np.zeros(shape, dtype)
            for p, r in zip(parts, wanted, strict=True):
                value[_slices(r)] = _value(p.host, p.future, p.region)
            self.arrays[handle] = Array(shape, dtype, layout, host=value)
        resp.assemble_array_from_single_device_arrays_response.array_handle = handle

    def _copy_arrays_request(self, req: Any, resp: Any) -> None:
        """The arrays on other devices (the i-th of the new list for the i-th of
        each array's sharding): moved worker to worker."""
        arrays = [self._array(h) for h in req.array_handles]
        if req.HasField("memory_kind") and req.memory_kind not in ("", MEMORY_KIND):
            raise Unsupported(f"memory kind {req.memory_kind!r} (only {MEMORY_KIND!r})")
        handles = list(req.result_handles) or [self._new_handle() for _ in arrays]
        if len(handles) != len(arrays):
            raise Failed(INVALID_ARGUMENT, f"{len(handles)} handles for {len(arrays)} arrays")
        targets = []
        for a in arrays:
            if not req.device_ids:
                targets.append(a.layout)
                continue
            new = list(req.device_ids)
            if len(new) != len(a.layout.ifrt_devices):
                raise Failed(INVALID_ARGUMENT, f"{len(new)} devices for an array on {len(a.layout.ifrt_devices)}")
            self._check_devices(new)
            move = dict(zip(a.layout.ifrt_devices, new, strict=True))
            targets.append(dataclasses.replace(a.layout, devices=[move[d] for d in a.layout.devices],
                                               ifrt_devices=new))
        for h, a, layout in zip(handles, arrays, targets, strict=True):
            self.arrays[h] = self._moved(a, layout)
        resp.copy_arrays_response.array_handles.extend(handles)

    def _reshard_arrays_request(self, req: Any, resp: Any) -> None:
        arrays = [self._array(h) for h in req.array_handles]
        if len(req.array_specs) != len(arrays):
            raise Failed(INVALID_ARGUMENT, f"{len(req.array_specs)} specs for {len(arrays)} arrays")
        handles = list(req.result_handles) or [self._new_handle() for _ in arrays]
        for h, a, spec in zip(handles, arrays, req.array_specs, strict=True):
            if tuple(spec.shape.dims) != a.shape or self._dtype(spec.dtype) != a.dtype:
                raise Unsupported("resharding into another shape or dtype")
            layout = self._layout(spec.sharding, a.shape)
            self._check_devices(layout.devices)
            self.arrays[h] = self._moved(a, layout)
        resp.reshard_arrays_response.array_handles.extend(handles)

    def _moved(self, a: Array, layout: Layout) -> Array:
        """``a`` in ``layout``: a value still here just changes its layout; one on
        the cluster is copied there by an identity computation on the new devices
        (the controller moves the blocks between workers, ICI or DCN)."""
        if a.future is None or a.region is not None:
            return Array(a.shape, a.dtype, layout, host=_value(a.host, a.future, a.region))
        if layout.devices == a.layout.devices and layout.spec == a.layout.spec and \
                layout.mesh_shape == a.layout.mesh_shape:
            return Array(a.shape, a.dtype, layout, future=a.future)
        islands = sorted({self.client.devices[d].island for d in layout.devices})
        if len(islands) > 1:
            raise Unsupported(f"an array over devices of several islands ({islands})")
        key = (a.shape, a.dtype.str, tuple(layout.mesh_shape), tuple(layout.axis_names), repr(layout.spec))
        prog = self._copies.get(key)
        if prog is None:
            prog = self._copies[key] = programs.identity(a.shape, a.dtype, layout.mesh_shape,
                                                         layout.axis_names, layout.spec, self.platform)
            self.client.register_program(prog.digest, prog.name, prog.blob)
        buf = self.client.new_buffer_id()
        aval = m.Aval(list(a.shape), a.dtype.name)
        self.client.post(m.Call(self.client.new_call_id(), prog.digest, layout.mesh_shape, layout.axis_names,
                                layout.devices, [m.CallInput(a.future.buffer, aval, layout.spec, False)],
                                [m.CallOutput(buf, aval, layout.spec)]))
        fut = Future(self.client, buf, a.shape, a.dtype, layout.devices, layout.mesh_shape,
                     layout.axis_names, layout.spec)
        self.client.track(fut)
        return Array(a.shape, a.dtype, layout, future=fut)

    def _delete_array_request(self, req: Any, resp: Any) -> None:
        error = None
        for h in req.array_handle:
            a = self.arrays.get(h)
            if a is None:
                error = Failed(NOT_FOUND, f"unknown array handle {h}")
                continue
            a.deleted = True
            a.host = a.future = None      # its buffer is released now
        resp.delete_array_response.deletion_future_handle = self._ready_future(error)

    def _is_array_deleted_request(self, req: Any, resp: Any) -> None:
        a = self.arrays.get(req.array_handle)
        if a is None:
            raise Failed(NOT_FOUND, f"unknown array handle {req.array_handle}")
        resp.is_array_deleted_response.deleted = a.deleted

    def _destruct_array_request(self, req: Any, resp: Any) -> None:
        # (a handle whose making failed is unknown here: the client destructs it
        # too, in a batch whose answers it cannot tell apart, so that is no error)
        missing = [h for h in req.array_handle if self.arrays.pop(h, None) is None]
        if missing:
            log.debug("session %d: destructed unknown arrays %s", self.id, missing)
        resp.destruct_array_response.SetInParent()

    def _check_future_request(self, req: Any, resp: Any) -> None:
        if req.future_handle not in self.futures:
            raise Failed(NOT_FOUND, f"unknown future handle {req.future_handle}")
        error = self.futures.pop(req.future_handle)
        if error is not None:
            raise error
        resp.check_future_response.SetInParent()

    def _compile_request(self, req: Any, resp: Any) -> None:
        if req.program.type_name not in HLO_PROGRAMS:
            raise Unsupported(f"programs of type {req.program.type_name} (only {' and '.join(HLO_PROGRAMS)})")
        if req.host_callbacks:
            raise Unsupported("host callbacks (jax.debug.print, jax.pure_callback, ...)")
        if req.compile_options.type_name != XLA_COMPILE_OPTIONS:
            raise Unsupported(f"compile options of type {req.compile_options.type_name}")
        opts = self.s.message("xla.ifrt.XlaCompileOptionsProto").FromString(req.compile_options.data)
        build = opts.compile_options.executable_build_options
        try:
            program = programs.from_hlo_program(req.program.data, self.platform)
        except programs.UnsupportedProgram as e:
            raise Unsupported(str(e)) from None
        da = build.device_assignment
        # (replica-major: one replica, so the partitions' devices in order)
        devices = [c.replica_device_ids[0] for c in da.computation_devices if c.replica_device_ids]
        if not devices and program.num_partitions == 1:
            devices = [min(self.client.devices)]
        if len(devices) != program.num_partitions:
            raise Failed(INVALID_ARGUMENT, f"{program.name}: {program.num_partitions} partitions, "
                                           f"device assignment {devices}")
        self._check_devices(devices)
        islands = sorted({self.client.devices[d].island for d in devices})
        if len(islands) > 1:
            raise Unsupported(f"one computation over devices of several islands ({islands}): a computation "
                              "runs on one island")
        self.client.register_program(program.digest, program.name, program.blob)
        handle = self._new_handle()
        self.executables[handle] = Executable(program, devices)
        r = resp.compile_response
        r.loaded_executable_handle = handle
        r.name = program.name
        r.num_devices = len(devices)
        r.device_ids.extend(devices)
        r.addressable_device_ids.extend(devices)
        r.fingerprint_value = program.digest.encode()
        r.ready_future_handle = self._ready_future()

    def _executable(self, handle: int) -> Executable:
        exe = self.executables.get(handle)
        if exe is None:
            raise Failed(NOT_FOUND, f"unknown executable handle {handle}")
        return exe

    def _loaded_executable_metadata_request(self, req: Any, resp: Any) -> None:
        exe = self._executable(req.loaded_executable_handle)
        r = resp.loaded_executable_metadata_response
        prog = exe.program
        for (shape, _), spec in zip(prog.in_avals, prog.in_specs, strict=True):
            op_sharding_of(exe.layout(spec), len(shape), r.parameter_shardings.shardings.add())
        for (shape, _), spec in zip(prog.out_avals, prog.out_specs, strict=True):
            op_sharding_of(exe.layout(spec), len(shape), r.output_shardings.shardings.add())
        for a in exe.program.in_avals:
            r.parameter_layouts_list.layouts.add().minor_to_major.extend(reversed(range(len(a[0]))))
        for a in exe.program.out_avals:
            r.output_layouts_list.layouts.add().minor_to_major.extend(reversed(range(len(a[0]))))
        # one list (the one program's) of every output's memory kind
        r.output_memory_kinds.memory_kind_lists.add().memory_kinds.extend([MEMORY_KIND] * len(exe.program.out_avals))
        r.donated_input_indices.SetInParent()
        r.compiled_memory_stats_error.code = UNIMPLEMENTED
        r.compiled_memory_stats_error.message = "zpath's IFRT proxy does not report memory statistics"

    def _get_default_layout_request(self, req: Any, resp: Any) -> None:
        # a dense row-major layout, in the text form PjRtLayout::Serialize writes: {1,0}
        minor_to_major = ",".join(str(i) for i in reversed(range(len(req.dims))))
        resp.get_default_layout_response.serialized_pjrt_layout = f"{{{minor_to_major}}}".encode()

    def _loaded_executable_destruct_request(self, req: Any, resp: Any) -> None:
        if self.executables.pop(req.loaded_executable_handle, None) is None:
            raise Failed(NOT_FOUND, f"unknown executable handle {req.loaded_executable_handle}")
        resp.loaded_executable_destruct_response.SetInParent()

    def _loaded_executable_execute_request(self, req: Any, resp: Any) -> None:
        exe = self._executable(req.loaded_executable_handle)
        prog = exe.program
        devices = list(req.device_ids) or exe.devices
        self._check_devices(devices)
        args = [self._array(h) for h in req.args_handles]
        if len(args) != len(prog.in_avals):
            raise Failed(INVALID_ARGUMENT, f"{prog.name} takes {len(prog.in_avals)} arguments, got {len(args)}")
        for i, (a, (shape, dtype)) in enumerate(zip(args, prog.in_avals, strict=True)):
            if a.shape != shape or a.dtype != dtype:
                raise Failed(INVALID_ARGUMENT, f"{prog.name}: argument {i} is {a.dtype}{list(a.shape)}, "
                                               f"expected {dtype}{list(shape)}")
        if devices != exe.devices:
            exe = Executable(prog, devices)
        mesh, axes = prog.mesh_shape, prog.axis_names
        inputs = []
        for a, spec in zip(args, prog.in_specs, strict=True):
            aval = m.Aval(list(a.shape), a.dtype.name)
            if a.future is not None and a.region is None:
                inputs.append(m.CallInput(a.future.buffer, aval, spec, False))
                continue
            # a value still here, or one block of a value on the cluster (read
            # back and sent again: rare, and simple)
            fut = self._put(_value(a.host, a.future, a.region), exe.layout(spec))
            if a.region is None:
                a.future, a.host = fut, None
            inputs.append(m.CallInput(fut.buffer, aval, spec, True))
        handles = list(req.result_array_handle) or [self._new_handle() for _ in prog.out_avals]
        if len(handles) != len(prog.out_avals):
            raise Failed(INVALID_ARGUMENT, f"{len(handles)} result handles for {len(prog.out_avals)} results")
        outputs = []
        r = resp.loaded_executable_execute_response
        for h, (shape, dtype), spec in zip(handles, prog.out_avals, prog.out_specs, strict=True):
            buf = self.client.new_buffer_id()
            outputs.append(m.CallOutput(buf, m.Aval(list(shape), dtype.name), spec))
            fut = Future(self.client, buf, shape, dtype, devices, mesh, axes, spec)
            self.client.track(fut)
            layout = exe.layout(spec)
            self.arrays[h] = Array(tuple(shape), dtype, layout, future=fut)
            if not req.result_array_handle:
                o = r.outputs.add()
                self._dtype_proto(dtype, o.dtype)
                o.shape.dims.extend(shape)
                self._sharding_proto(layout, len(shape), o.sharding)
                o.array_handle = h
        call = m.Call(self.client.new_call_id(), prog.digest, mesh, axes, devices, inputs, outputs)
        if any(i.put for i in inputs):
            # a program of one call that frees nothing: the values put for it stay
            # on the cluster as this session's arrays (a plain Call frees them after)
            self.client.post(m.Program(self.client.new_call_id(), prog.name, "parallel", [call], []))
        else:
            self.client.post(call)
        if req.execute_options.fill_status:
            status = req.result_status_handle or self._new_handle()
            self.futures[status] = None
            r.status_handle = status

    def _loaded_executable_fetch_execute_result_request(self, req: Any, resp: Any) -> None:
        if self.futures.pop(req.result_status_handle, 0) is not None:
            raise Failed(NOT_FOUND, f"unknown result status handle {req.result_status_handle}")
        resp.loaded_executable_fetch_execute_result_response.SetInParent()

    def _put(self, value: np.ndarray, layout: Layout) -> Future:
        """Send a value to the workers in ``layout``; its future."""
        client = self.client
        buf = client.new_buffer_id()
        for d, region in zip(layout.devices, layout.regions(value.shape), strict=True):
            data = np.require(sharding.cut(value, region), requirements="C")   # (keeps 0-d as 0-d)
            client.put(client.devices[d].host, m.Put(buf, d, sharding.to_wire(region),
                                                     m.Aval(list(data.shape), value.dtype.name)), data)
        fut = Future(client, buf, value.shape, value.dtype, layout.devices, layout.mesh_shape,
                     layout.axis_names, layout.spec)
        client.track(fut)
        return fut


def op_sharding_layout(op: Any, devices: list[int], ndim: int) -> Layout:
    """The zpath layout of an xla.OpSharding over ``devices`` (its tile
    assignment counts in that list): a mesh with one axis per tile dimension."""
    match op.type:
        case 0:         # REPLICATED
            return Layout([len(devices)], [AXIS], list(devices), [None] * ndim, list(devices))
        case 1:         # MAXIMAL: the whole array on one device
            one = [devices[op.tile_assignment_devices[0]]] if op.tile_assignment_devices else devices[:1]
            return Layout([1], [AXIS], one, [None] * ndim, list(devices))
        case 3:         # OTHER: tiled
            dims = list(op.tile_assignment_dimensions)
            if any(t != OP_SHARDING_REPLICATED for t in op.last_tile_dims):
                raise Unsupported(f"shardings with manual or unreduced subgroups ({list(op.last_tile_dims)})")
            subgroups = len(op.last_tile_dims) or int(op.replicate_on_last_tile_dim)
            if len(dims) - subgroups != ndim:
                raise Unsupported(f"a sharding of {len(dims) - subgroups} dimensions for an array of rank {ndim}")
            n = math.prod(dims)
            if op.tile_assignment_devices:
                tiles = np.asarray(op.tile_assignment_devices, dtype=np.int64).reshape(dims)
            else:
                tiles = np.arange(n).reshape(list(op.iota_reshape_dims) or [n])
                tiles = tiles.transpose(list(op.iota_transpose_perm) or range(tiles.ndim)).reshape(dims)
            names = [f"t{i}" for i in range(len(dims))]
            spec = [names[i] if dims[i] > 1 else None for i in range(ndim)]
            return Layout(dims, names, [devices[j] for j in tiles.flat], spec, list(devices))
        case other:
            raise Unsupported(f"OpSharding type {other}")


def op_sharding_of(layout: Layout, ndim: int, out: Any) -> None:
    """Fill ``out`` (an xla.OpSharding) with the sharding of ``layout``; its tile
    assignment counts in ``layout.ifrt_devices``."""
    spec = list(layout.spec) + [None] * (ndim - len(layout.spec))
    if all(e is None for e in spec):
        out.type = OP_SHARDING_REPLICATED
        return
    sizes = dict(zip(layout.axis_names, layout.mesh_shape, strict=True))
    per_dim = [[] if e is None else [e] if isinstance(e, str) else list(e) for e in spec]
    used = [a for axes in per_dim for a in axes]
    unused = [a for a in layout.axis_names if a not in used]
    order = [layout.axis_names.index(a) for a in used + unused]
    tiles = np.arange(len(layout.devices)).reshape(layout.mesh_shape).transpose(order)
    dims = [math.prod(sizes[a] for a in axes) for axes in per_dim]
    rest = math.prod(sizes[a] for a in unused)
    index = {d: i for i, d in enumerate(layout.ifrt_devices)}
    out.type = OP_SHARDING_OTHER
    out.tile_assignment_dimensions.extend(dims + ([rest] if rest > 1 else []))
    out.tile_assignment_devices.extend(index[layout.devices[p]] for p in tiles.reshape(-1))
    out.replicate_on_last_tile_dim = rest > 1


def _mark(resp: Any, which: str) -> None:
    """Make sure an answer names its kind (an empty response message is still
    one: the client tells answers apart by it)."""
    if resp.WhichOneof("response") is None:
        getattr(resp, which.removesuffix("_request") + "_response").SetInParent()


def _value(host: np.ndarray | None, fut: Future | None, region: sharding.Region | None = None) -> np.ndarray:
    """An array's value (``region`` of it): here, or fetched from the workers."""
    if host is not None:
        value = host
    elif fut is None:
        raise Failed(INVALID_ARGUMENT, "the array was deleted")
    else:
        try:
            value = fut.result()
        except Exception as e:
            raise Failed(INTERNAL, f"{type(e).__name__}: {e}") from None
    return value if region is None else value[_slices(region)]


def _slices(region: sharding.Region) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


def _host_value(data: bytes, dtype: np.dtype, shape: tuple[int, ...], strides: list[int] | None) -> np.ndarray:
    """The array a host buffer holds: C order, or the smallest span of memory
    holding every element at ``strides`` (bytes), as the client sends a view."""
    n = math.prod(shape)
    if strides is None or strides == _c_strides(shape, dtype) or n == 0:
        if len(data) != n * dtype.itemsize:
            raise Failed(INVALID_ARGUMENT, f"host buffer of {len(data)} bytes for a {dtype}{list(shape)}")
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    if len(strides) != len(shape) or any(st < 0 for st in strides):
        raise Unsupported(f"host buffers with byte strides {strides} for shape {list(shape)}")
    span = sum((k - 1) * st for k, st in zip(shape, strides, strict=True)) + dtype.itemsize
    if len(data) < span:
        raise Failed(INVALID_ARGUMENT, f"host buffer of {len(data)} bytes, strides {strides} need {span}")
    raw = np.frombuffer(data, dtype=np.uint8)
    elements = np.lib.stride_tricks.as_strided(raw, shape=(*shape, dtype.itemsize), strides=(*strides, 1))
    return np.ascontiguousarray(elements).view(dtype).reshape(shape)


def _c_strides(shape: tuple[int, ...], dtype: np.dtype) -> list[int]:
    return list(np.empty(shape, dtype).strides) if shape else []
