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
OP_SHARDING_REPLICATED, OP_SHARDING_MAXIMAL = 0, 1
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


@dataclasses.dataclass
class Array:
    """One IFRT array: its value is either here (``host``, not yet read by a
    computation) or on the workers (``future``)."""
    shape: tuple[int, ...]
    dtype: np.dtype
    devices: list[int]
    host: np.ndarray | None = None
    future: Future | None = None
    deleted: bool = False


@dataclasses.dataclass
class Executable:
    program: programs.Program
    devices: list[int]


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
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix=f"ifrt-session-{session_id}")
        self.closed = False

    # ---- the request loop ---------------------------------------------------
    def handle(self, req: Any, reply: Callable[[Any], None]) -> None:
        """Answer ``req``: ``reply`` gets its IfrtResponse, now or later."""
        op_id = req.request_metadata.op_id
        which = req.WhichOneof("request")
        resp = self.s.IfrtResponse()
        resp.response_metadata.op_id = op_id
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
        reply(resp)

    def _finish(self, later: Callable[[Any], None], resp: Any, reply: Callable[[Any], None],
                which: str) -> None:
        try:
            later(resp)
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
        self.closed = True
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

    def _sharding_devices(self, proto: Any, shape: tuple[int, ...]) -> list[int]:
        """The devices of an IFRT sharding that holds a whole copy of the array
        on each of them (one device, or replicated); other shardings are not
        supported yet."""
        ser = proto.serialized_sharding
        match ser.type_name:
            case "xla::ifrt::HloSharding":
                hlo = self.s.message("xla.ifrt.HloShardingProto").FromString(ser.data)
                devices = list(hlo.devices.device_ids)
                op = hlo.xla_op_sharding
                if op.type == OP_SHARDING_MAXIMAL and op.tile_assignment_devices:
                    return [devices[op.tile_assignment_devices[0]]]
                if op.type != OP_SHARDING_REPLICATED and len(devices) > 1:
                    raise Unsupported(f"arrays sharded over several devices (HLO sharding type {op.type}) yet")
                return devices
            case "xla::ifrt::SingleDeviceSharding":
                return [self.s.message("xla.ifrt.SingleDeviceShardingProto").FromString(ser.data).device_id]
            case "xla::ifrt::ConcreteEvenSharding":
                ces = self.s.message("xla.ifrt.ConcreteEvenShardingProto").FromString(ser.data)
                devices = list(ces.devices.device_ids)
                if not ces.is_fully_replicated and len(devices) > 1:
                    raise Unsupported("arrays sharded over several devices (ConcreteEvenSharding) yet")
                return devices
            case other:
                raise Unsupported(f"sharding {other}")

    def _sharding_proto(self, devices: list[int], out: Any) -> None:
        """An HloSharding of a whole copy on each of ``devices``."""
        hlo = self.s.message("xla.ifrt.HloShardingProto")()
        hlo.devices.device_ids.extend(devices)
        hlo.memory_kind = MEMORY_KIND
        hlo.xla_op_sharding.type = OP_SHARDING_REPLICATED
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
        devices = self._sharding_devices(req.sharding, shape)
        self._check_devices(devices)
        if req.HasField("byte_strides") and list(req.byte_strides.strides) != _c_strides(shape, dtype):
            raise Unsupported("host buffers with strides other than C order")
        # requests are answered in order, so this one waits for its bytes (the
        # client streams them beside the request)
        data = self.buffers.lookup(req.host_buffer_handle, pop=True)
        value = np.frombuffer(data, dtype=dtype)
        if value.size != int(np.prod(shape)):
            raise Failed(INVALID_ARGUMENT, f"host buffer of {len(data)} bytes for a {dtype}{list(shape)}")
        handle = req.array_handle if req.HasField("array_handle") else self._new_handle()
        self.arrays[handle] = Array(shape, dtype, devices, host=value.reshape(shape))
        resp.make_array_from_host_buffer_response.array_handle = handle

    def _copy_to_host_buffer_request(self, req: Any, resp: Any) -> Callable[[Any], None]:
        array = self._array(req.array_handle)
        if req.HasField("byte_strides") and list(req.byte_strides.strides) != _c_strides(array.shape, array.dtype):
            raise Unsupported("copies to host buffers with strides other than C order")
        host, fut = array.host, array.future

        def copy(resp: Any) -> None:
            value = _value(host, fut)
            self.buffers.store(req.host_buffer_handle, np.asarray(value, dtype=array.dtype).tobytes(order="C"))
            resp.copy_to_host_buffer_response.SetInParent()
        return copy

    def _check_value_ready_request(self, req: Any, resp: Any) -> Callable[[Any], None]:
        values = [(a.host, a.future) for a in map(self._array, req.value_handles)]

        def ready(resp: Any) -> None:
            for host, fut in values:
                _value(host, fut)
            resp.check_value_ready_response.SetInParent()
        return ready

    def _fully_replicated_shard_request(self, req: Any, resp: Any) -> None:
        array = self._array(req.array_handle)
        handle = req.result_handle or self._new_handle()
        self.arrays[handle] = Array(array.shape, array.dtype, array.devices[:1], array.host, array.future)
        resp.fully_replicated_shard_response.array_handle = handle

    def _disassemble_into_single_device_arrays_request(self, req: Any, resp: Any) -> None:
        array = self._array(req.array_handle)
        handles = list(req.result_handles) or [self._new_handle() for _ in array.devices]
        if len(handles) != len(array.devices):
            raise Failed(INVALID_ARGUMENT, f"{len(handles)} handles for {len(array.devices)} shards")
        for h, d in zip(handles, array.devices, strict=True):
            self.arrays[h] = Array(array.shape, array.dtype, [d], array.host, array.future)
        resp.disassemble_into_single_device_arrays_response.array_handles.extend(handles)

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
        missing = [h for h in req.array_handle if self.arrays.pop(h, None) is None]
        if missing:
            raise Failed(NOT_FOUND, f"unknown array handles {missing}")
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
        if program.num_partitions != 1 or build.num_partitions > 1:
            raise Unsupported(f"SPMD programs over {max(program.num_partitions, build.num_partitions)} "
                              "devices yet (milestone 2 of issue 25)")
        da = build.device_assignment
        devices = [d for c in da.computation_devices for d in c.replica_device_ids]
        if not devices:
            devices = [min(self.client.devices)]
        self._check_devices(devices)
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
        for _ in exe.program.in_avals:
            r.parameter_shardings.shardings.add().type = OP_SHARDING_REPLICATED
        for _ in exe.program.out_avals:
            r.output_shardings.shardings.add().type = OP_SHARDING_REPLICATED
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
        mesh, axes = [len(devices)], [AXIS]
        inputs = []
        for a in args:
            aval = m.Aval(list(a.shape), a.dtype.name)
            spec = [None] * len(a.shape)
            if a.future is not None:
                inputs.append(m.CallInput(a.future.buffer, aval, spec, False))
                continue
            if a.host is None:
                raise Failed(INVALID_ARGUMENT, "an argument's host buffer has not arrived")
            fut = self._put(a.host, devices, spec)
            a.future, a.host = fut, None
            inputs.append(m.CallInput(fut.buffer, aval, spec, True))
        handles = list(req.result_array_handle) or [self._new_handle() for _ in prog.out_avals]
        if len(handles) != len(prog.out_avals):
            raise Failed(INVALID_ARGUMENT, f"{len(handles)} result handles for {len(prog.out_avals)} results")
        outputs = []
        r = resp.loaded_executable_execute_response
        for h, (shape, dtype) in zip(handles, prog.out_avals, strict=True):
            buf = self.client.new_buffer_id()
            spec = [None] * len(shape)
            outputs.append(m.CallOutput(buf, m.Aval(list(shape), dtype.name), spec))
            fut = Future(self.client, buf, shape, dtype, devices, mesh, axes, spec)
            self.client.track(fut)
            self.arrays[h] = Array(tuple(shape), dtype, devices, future=fut)
            if not req.result_array_handle:
                o = r.outputs.add()
                self._dtype_proto(dtype, o.dtype)
                o.shape.dims.extend(shape)
                self._sharding_proto(devices, o.sharding)
                o.array_handle = h
        self.client.post(m.Call(self.client.new_call_id(), prog.digest, mesh, axes, devices, inputs, outputs))
        if req.execute_options.fill_status:
            status = req.result_status_handle or self._new_handle()
            self.futures[status] = None
            r.status_handle = status

    def _loaded_executable_fetch_execute_result_request(self, req: Any, resp: Any) -> None:
        if self.futures.pop(req.result_status_handle, 0) is not None:
            raise Failed(NOT_FOUND, f"unknown result status handle {req.result_status_handle}")
        resp.loaded_executable_fetch_execute_result_response.SetInParent()

    def _put(self, value: np.ndarray, devices: list[int], spec: list) -> Future:
        """Send a value to the workers, a whole copy on each device; its future."""
        client = self.client
        buf = client.new_buffer_id()
        regions = sharding.regions(value.shape, [len(devices)], [AXIS], spec)
        for d, region in zip(devices, regions, strict=True):
            data = np.require(sharding.cut(value, region), requirements="C")   # (keeps 0-d as 0-d)
            client.put(client.devices[d].host, m.Put(buf, d, sharding.to_wire(region),
                                                     m.Aval(list(data.shape), value.dtype.name)), data)
        fut = Future(client, buf, value.shape, value.dtype, devices, [len(devices)], [AXIS], spec)
        client.track(fut)
        return fut


def _value(host: np.ndarray | None, fut: Future | None) -> np.ndarray:
    """An array's value: here, or fetched from the workers."""
    if host is not None:
        return host
    if fut is None:
        raise Failed(INVALID_ARGUMENT, "the array was deleted")
    try:
        return fut.result()
    except Exception as e:
        raise Failed(INTERNAL, f"{type(e).__name__}: {e}") from None


def _c_strides(shape: tuple[int, ...], dtype: np.dtype) -> list[int]:
    return list(np.empty(shape, dtype).strides) if shape else []
