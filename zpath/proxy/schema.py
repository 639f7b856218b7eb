"""The IFRT proxy protocol's protobuf schema, as the installed jaxlib speaks it.

jaxlib's ``libjax_common.so`` embeds the serialized ``FileDescriptorProto`` of
every .proto file it was built with (protobuf's generated C++ keeps them for
reflection). :func:`load` finds those of
``xla/python/ifrt_proxy/common/grpc_ifrt_service.proto`` and everything it
imports, builds a descriptor pool from them and returns the message classes, so
the server speaks exactly the version of the protocol the installed client
speaks, with no protoc step.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib
import re
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf import any_pb2, duration_pb2, timestamp_pb2, wrappers_pb2, empty_pb2

SERVICE_FILE = "xla/python/ifrt_proxy/common/grpc_ifrt_service.proto"
# what the service's messages carry as serialized payloads: shardings, compile options
PAYLOAD_FILES = ("xla/python/ifrt/sharding_serdes.proto", "xla/python/pjrt_ifrt/xla_sharding.proto",
                 "xla/python/pjrt_ifrt/xla_compiler.proto")
# protobuf keeps one binary's descriptors together: look this far around the
# service's first (a whole-library scan only when that misses)
NEAR = 8 << 20
SERVICE_NAME = "xla.ifrt.proxy.GrpcIfrtService"
LIBRARY = "libjax_common.so"

# the field numbers (and wire types) a FileDescriptorProto may hold: where the
# embedded bytes stop is where a tag outside these appears
_FILE_FIELDS = {1: 2, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2, 8: 2, 9: 2, 10: 0, 11: 0, 12: 2, 14: 0, 15: 0}
_WELL_KNOWN = {m.DESCRIPTOR.name: m.DESCRIPTOR.serialized_pb
               for m in (any_pb2, duration_pb2, timestamp_pb2, wrappers_pb2, empty_pb2)}


class SchemaError(RuntimeError):
    """The protocol's descriptors could not be found in the installed jaxlib."""


def _varint(data: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        c = data[i]
        i += 1
        result |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return result, i


def _extent(data: bytes, start: int) -> int:
    """The end of the serialized FileDescriptorProto that begins at ``start``:
    its top-level fields are walked until a tag no such message has."""
    i = start
    while i < len(data):
        try:
            tag, j = _varint(data, i)
            field, wire = tag >> 3, tag & 7
            if _FILE_FIELDS.get(field) != wire:
                break
            size, j = _varint(data, j)
            j += size if wire == 2 else 0
        except IndexError:
            break
        if j > len(data):
            break
        i = j
    return i


def find_descriptor(data: bytes, name: str, near: int | None = None) -> descriptor_pb2.FileDescriptorProto:
    """The FileDescriptorProto of ``name`` embedded in ``data``: field 1 (the
    file's name) comes first in protobuf's serialization. With ``near``, the
    bytes within NEAR of that offset are searched first."""
    if near is not None:
        lo = max(0, near - NEAR)
        try:
            return find_descriptor(data[lo:near + NEAR], name)
        except SchemaError:
            pass
    raw = name.encode()
    marker = b"\x0a" + _encode_varint(len(raw)) + raw
    best: descriptor_pb2.FileDescriptorProto | None = None
    for m in re.finditer(re.escape(marker), data):
        fd = descriptor_pb2.FileDescriptorProto()
        try:
            fd.ParseFromString(data[m.start():_extent(data, m.start())])
        except Exception:      # the name alone, in a string table: not a descriptor
            continue
        if fd.name == name and (best is None or fd.ByteSize() > best.ByteSize()):
            best = fd
    if best is None:
        raise SchemaError(f"no descriptor of {name} in the installed jaxlib")
    return best


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def library_path() -> pathlib.Path:
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or spec.origin is None:
        raise SchemaError("jaxlib is not installed")
    path = pathlib.Path(spec.origin).parent / LIBRARY
    if not path.exists():
        raise SchemaError(f"{path} does not exist: this jaxlib has no IFRT proxy client")
    return path


@dataclasses.dataclass(frozen=True)
class Schema:
    pool: descriptor_pool.DescriptorPool
    files: tuple[str, ...]

    def message(self, full_name: str) -> Any:
        return message_factory.GetMessageClass(self.pool.FindMessageTypeByName(full_name))

    def __getattr__(self, name: str) -> Any:
        # proxy messages by short name: schema.IfrtRequest
        return self.message(f"xla.ifrt.proxy.{name}")


def build(data: bytes) -> Schema:
    """The schema of the service from the library bytes ``data``."""
    pool = descriptor_pool.DescriptorPool()
    added: list[str] = []
    first = data.find(b"\x0a" + _encode_varint(len(SERVICE_FILE)) + SERVICE_FILE.encode())
    near = first if first >= 0 else None

    def add(name: str) -> None:
        if name in added:
            return
        if name in _WELL_KNOWN:
            pool.AddSerializedFile(_WELL_KNOWN[name])
            added.append(name)
            return
        fd = find_descriptor(data, name, near)
        for dep in fd.dependency:
            add(dep)
        pool.Add(fd)
        added.append(name)

    add(SERVICE_FILE)
    for name in PAYLOAD_FILES:
        add(name)
    try:
        pool.FindServiceByName(SERVICE_NAME)
    except KeyError:
        raise SchemaError(f"{SERVICE_FILE} in the installed jaxlib has no service {SERVICE_NAME}") from None
    return Schema(pool, tuple(added))


@functools.cache
def load() -> Schema:
    """The schema of the installed jaxlib's IFRT proxy protocol (read once)."""
    return build(library_path().read_bytes())
