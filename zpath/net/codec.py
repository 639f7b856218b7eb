"""Typed records and the signed envelope.

A message on the wire is a list of ZeroMQ frames::

    [signature, header, body, *buffers]

``header`` and ``body`` are msgpack; ``buffers`` are raw tensor bytes.
``signature`` is HMAC-SHA256 over the header, the body and every buffer (each
prefixed by its length), under the cluster key. The header is
``[protocol_version, type_id, message_id, parent_id, sender]``. The body is the
record's fields in declaration order, checked against their annotations on decode.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import struct
import types
import typing
from typing import Any, Callable, ClassVar, Sequence

import msgpack

from zpath.errors import ProtocolError

PROTOCOL_VERSION = 1
MAX_BODY_BYTES = 16 << 20
MAX_BUFFERS = 4096
SIG_BYTES = 32

_REGISTRY: dict[int, type["Record"]] = {}
_Check = Callable[[Any, str | None], Any]   # (value, path or None) -> checked value


class Record:
    """Base of every wire record. Subclasses are frozen dataclasses built with
    :func:`message` (top-level messages, with a type id) or :func:`record`
    (nested values)."""

    TYPE: ClassVar[int] = -1
    _checks: ClassVar[tuple[tuple[str, _Check], ...]] = ()

    def to_wire(self) -> list[Any]:
        return [_to_wire(getattr(self, name)) for name, _ in self._checks]

    @classmethod
    def from_wire(cls, value: Any, where: str | None = "") -> "Record":
        """Check and build a record. ``where`` names it in error messages; with
        ``where=None`` the checks build no paths (the fast path), and a failure
        is retried with paths to produce the precise message."""
        checks = cls._checks
        if where is None:
            if type(value) is not list or len(value) != len(checks):
                raise ProtocolError("")
            return cls(*[check(v, None) for (_, check), v in zip(checks, value)])
        try:
            return cls.from_wire(value, None)
        except ProtocolError:
            pass
        where = where or cls.__name__
        if not isinstance(value, list) or len(value) != len(checks):
            n = len(value) if isinstance(value, list) else type(value).__name__
            raise ProtocolError(f"{where}: expected {len(checks)} fields, got {n}")
        return cls(*[check(v, f"{where}.{name}")
                     for (name, check), v in zip(checks, value, strict=True)])


def _to_wire(v: Any) -> Any:
    if isinstance(v, Record):
        return v.to_wire()
    if isinstance(v, (list, tuple)):
        return [_to_wire(x) for x in v]
    if isinstance(v, dict):
        return {k: _to_wire(x) for k, x in v.items()}
    return v


def _compile(tp: Any) -> _Check:
    """Turn a type annotation into a function that checks (and converts) a
    decoded msgpack value, raising ProtocolError with the field path."""
    if tp is Any:
        return lambda v, w: v
    if tp is type(None):
        def check_none(v: Any, w: str) -> None:
            if v is not None:
                raise ProtocolError(f"{w}: expected nil, got {type(v).__name__}")
        return check_none
    if tp is bool:
        def check_bool(v: Any, w: str) -> bool:
            if not isinstance(v, bool):
                raise ProtocolError(f"{w}: expected bool, got {type(v).__name__}")
            return v
        return check_bool
    if tp is int:
        def check_int(v: Any, w: str) -> int:
            if not isinstance(v, int) or isinstance(v, bool):
                raise ProtocolError(f"{w}: expected int, got {type(v).__name__}")
            return v
        return check_int
    if tp is float:
        def check_float(v: Any, w: str) -> float:
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ProtocolError(f"{w}: expected float, got {type(v).__name__}")
            return float(v)
        return check_float
    if tp in (str, bytes):
        def check_scalar(v: Any, w: str) -> Any:
            if not isinstance(v, tp):
                raise ProtocolError(f"{w}: expected {tp.__name__}, got {type(v).__name__}")
            return v
        return check_scalar
    if isinstance(tp, type) and issubclass(tp, Record):
        return lambda v, w: tp.from_wire(v, w)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        optional = type(None) in args
        checks = [_compile(a) for a in args if a is not type(None)]
        def check_union(v: Any, w: str | None) -> Any:
            if v is None and optional:
                return None
            errors = ["expected nil, got " + type(v).__name__] if optional else []
            for c in checks:
                try:
                    return c(v, w)
                except ProtocolError as e:
                    errors.append(str(e))
            raise ProtocolError(f"{w}: matches no alternative ({'; '.join(errors)})")
        return check_union
    if origin in (list, tuple):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            items = [_compile(a) for a in args]
            def check_fixed(v: Any, w: str) -> tuple:
                if not isinstance(v, list) or len(v) != len(items):
                    raise ProtocolError(f"{w}: expected a list of {len(items)}")
                if w is None:
                    return tuple(c(x, None) for c, x in zip(items, v))
                return tuple(c(x, f"{w}[{i}]") for i, (c, x) in enumerate(zip(items, v, strict=True)))
            return check_fixed
        item = _compile(args[0])
        conv = tuple if origin is tuple else list
        def check_list(v: Any, w: str) -> Any:
            if not isinstance(v, list):
                raise ProtocolError(f"{w}: expected list, got {type(v).__name__}")
            if w is None:
                out = [item(x, None) for x in v]
                return out if conv is list else tuple(out)
            return conv(item(x, f"{w}[{i}]") for i, x in enumerate(v))
        return check_list
    if origin is dict:
        kc, vc = _compile(args[0]), _compile(args[1])
        def check_dict(v: Any, w: str) -> dict:
            if not isinstance(v, dict):
                raise ProtocolError(f"{w}: expected map, got {type(v).__name__}")
            if w is None:
                return {kc(k, None): vc(x, None) for k, x in v.items()}
            return {kc(k, f"{w}.key"): vc(x, f"{w}[{k!r}]") for k, x in v.items()}
        return check_dict
    raise TypeError(f"unsupported field type {tp!r}")


def _finish(cls: type) -> type:
    cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
    hints = typing.get_type_hints(cls)
    cls._checks = tuple((f.name, _compile(hints[f.name])) for f in dataclasses.fields(cls))
    return cls


def record(cls: type) -> type:
    """Decorator for a nested (non top-level) record."""
    return _finish(cls)


def message(type_id: int) -> Callable[[type], type]:
    """Decorator for a top-level message with a unique type id."""
    def wrap(cls: type) -> type:
        if type_id in _REGISTRY:
            raise ValueError(f"type id {type_id} used twice")
        cls = _finish(cls)
        cls.TYPE = type_id
        _REGISTRY[type_id] = cls
        return cls
    return wrap


def registry() -> dict[int, type[Record]]:
    return dict(_REGISTRY)


@dataclasses.dataclass(frozen=True, slots=True)
class Header:
    version: int
    type_id: int
    msg_id: int
    parent: int
    sender: str


def _sign(key: bytes, parts: Sequence[Any]) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        mac.update(struct.pack("<Q", memoryview(p).nbytes))
        mac.update(p)
    return mac.digest()


def encode(key: bytes, msg: Record, *, msg_id: int, sender: str, parent: int = 0,
           buffers: Sequence[Any] = ()) -> list[Any]:
    """Frames for one message. ``buffers`` are bytes-like objects (e.g. contiguous
    numpy arrays) sent as raw frames."""
    if msg.TYPE < 0:
        raise TypeError(f"{type(msg).__name__} is not a top-level message")
    header = msgpack.packb([PROTOCOL_VERSION, msg.TYPE, msg_id, parent, sender])
    body = msgpack.packb(msg.to_wire(), use_bin_type=True)
    parts = [header, body, *buffers]
    return [_sign(key, parts), *parts]


def decode_header(frames: Sequence[Any]) -> Header | None:
    """Best-effort header parse used to address an error reply; never raises."""
    try:
        h = msgpack.unpackb(_bytes(frames[1]), raw=False)
        return Header(int(h[0]), int(h[1]), int(h[2]), int(h[3]), str(h[4]))
    except Exception:
        return None


def _bytes(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame


def decode(key: bytes, frames: Sequence[Any]) -> tuple[Header, Record, list[Any]]:
    """Check and decode one message. Raises ProtocolError on anything wrong.
    Returned buffers are memoryviews (zero-copy for zmq.Frame input)."""
    if len(frames) < 3:
        raise ProtocolError(f"expected at least 3 frames, got {len(frames)}")
    parts = [_bytes(f) for f in frames]
    sig, header_b, body_b, *buffers = parts
    if len(buffers) > MAX_BUFFERS:
        raise ProtocolError(f"too many buffers ({len(buffers)} > {MAX_BUFFERS})")
    if memoryview(body_b).nbytes > MAX_BODY_BYTES:
        raise ProtocolError(f"body too large ({memoryview(body_b).nbytes} bytes)")
    if memoryview(sig).nbytes != SIG_BYTES or not hmac.compare_digest(
            bytes(sig), _sign(key, [header_b, body_b, *buffers])):
        raise ProtocolError("bad signature (wrong cluster key or corrupted message)")
    try:
        h = msgpack.unpackb(header_b, raw=False)
    except Exception as e:
        raise ProtocolError(f"header is not msgpack: {e}") from None
    if (not isinstance(h, list) or len(h) != 5 or not all(isinstance(x, int) and not isinstance(x, bool) for x in h[:4])
            or not isinstance(h[4], str)):
        raise ProtocolError("header must be [version, type, id, parent, sender]")
    header = Header(*h)
    if header.version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {header.version} not supported "
                            f"(this side speaks {PROTOCOL_VERSION})")
    cls = _REGISTRY.get(header.type_id)
    if cls is None:
        raise ProtocolError(f"unknown message type {header.type_id}")
    try:
        body = msgpack.unpackb(body_b, raw=False, strict_map_key=False)
    except Exception as e:
        raise ProtocolError(f"body of {cls.__name__} is not msgpack: {e}") from None
    return header, cls.from_wire(body), [memoryview(b) for b in buffers]
