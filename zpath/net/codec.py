"""Typed records and the signed envelope.

A message on the wire is a list of ZeroMQ frames::

    [signature, header, body, *buffers]

``header`` and ``body`` are msgpack; ``buffers`` are raw tensor bytes.
``signature`` is HMAC-SHA256 over the header, the body and every buffer (each
prefixed by its length), under the key of the signer the header names. The
header is ``[protocol_version, type_id, message_id, parent_id, sender, signer]``:
``signer`` is :data:`CLUSTER` (the worker key, held by the controller and the
workers), :data:`CLIENTS` (the client key, held by every client) or a client id
(that client's session key, see :mod:`zpath.keys`). The body is the
record's fields in declaration order, checked against their annotations on decode.

Every message crosses this module twice, so its common path is kept cheap
(without changing a byte on the wire or what is accepted):

* encoding packs the record itself: msgpack calls :func:`_pack_default` for each
  record it meets, which returns the record's fields as a tuple (one C
  ``attrgetter`` call), so no intermediate lists are built;
* signing copies SHA-256 states already fed the padded key (:class:`_Signer`)
  instead of setting up an HMAC object per message;
* decoding runs a checker generated once per record class from its annotations
  (:func:`_gen_decoder`): straight-line code testing exact msgpack types
  (``type(v) is int``) and building the record without its ``__init__``. It
  carries no field paths; when it refuses a value, the checks compiled by
  :func:`_compile` run again with paths, so the error names the field (and they
  are the definition of what is accepted: the generated checker accepts a subset
  of it, with equal results).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import operator
import struct
import threading
import types
import typing
from typing import Any, Callable, ClassVar, Sequence

import blake3
import msgpack

from zpath.errors import ProtocolError

PROTOCOL_VERSION = 10
MAX_BODY_BYTES = 16 << 20
MAX_HEADER_BYTES = 4096
MAX_BUFFERS = 4096
MAX_BATCH_ITEMS = 262_144     # messages in one Batch (a program's nodes to one host go in groups)
SIG_BYTES = 32
# who signed a message (the header's last item): the worker key, the client key,
# or else a client id (its session key)
CLUSTER = 0
CLIENTS = -1
# a receiver's keys: the key a signer signs with, or None for a signer it does not accept
KeyOf = Callable[[int], "bytes | None"]

_REGISTRY: dict[int, type["Record"]] = {}
_Check = Callable[[Any, str | None], Any]   # (value, path or None) -> checked value


class Record:
    """Base of every wire record. Subclasses are frozen dataclasses built with
    :func:`message` (top-level messages, with a type id) or :func:`record`
    (nested values)."""

    TYPE: ClassVar[int] = -1
    _checks: ClassVar[tuple[tuple[str, _Check], ...]] = ()

    def to_wire(self) -> list[Any]:
        runs = _RUNS_FIELDS.get(type(self), ())
        return [pack_runs(getattr(self, name)) if name in runs else _to_wire(getattr(self, name))
                for name, _ in self._checks]

    @staticmethod
    def _decode(value: Any) -> "Record":
        """The generated checker (set per class by :func:`_finish`): a record
        from a decoded msgpack value, or an empty ProtocolError."""
        raise ProtocolError("")

    @classmethod
    def from_wire(cls, value: Any, where: str | None = "") -> "Record":
        """Check and build a record. ``where`` names it in error messages; with
        ``where=None`` the checks build no paths and a failure raises an empty
        ProtocolError. The generated checker is tried first; whatever it refuses
        is checked again by the annotation checks, with paths."""
        try:
            return cls._decode(value)
        except Exception:
            pass
        checks = cls._checks
        if where is None:
            if type(value) is not list or len(value) != len(checks):
                raise ProtocolError("")
            return cls(*[check(v, None) for (_, check), v in zip(checks, value)])
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


# ---- lists of ints sent as runs ------------------------------------------------------
# A field annotated IntRuns holds a plain list[int] on both sides; on the wire it is
# an array whose items are each an int (one value) or [start, stop, step] (the values
# of Python's range(start, stop, step): step != 0, not empty). A device list of a
# computation over every device (2,048 entries at 512 hosts) is one such triple. A
# plain array of ints is also a valid value, and lists shorter than RUNS_FROM are sent
# so (runs would not pay). Decoding expands them (at most MAX_RUN_INTS values per
# list) and keeps one list per distinct run form recently seen (_RUNS_SEEN): a list
# decoded from runs may be shared by several decoded messages, so it is read only.

class _Runs:
    """The marker of an IntRuns annotation."""

    def __repr__(self) -> str:
        return "RUNS"


RUNS = _Runs()
IntRuns = typing.Annotated[list[int], RUNS]
RUNS_FROM = 16                  # a list shorter than this goes as plain ints (a 2-host mesh's 8
                                # devices are read as fast plain, and a run costs the sender a comparison)
MAX_RUN_INTS = 1 << 20          # values in one decoded IntRuns list
_RUN_MIN = 3                    # a run shorter than this goes as its values
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 63) - 1     # runs' ends kept where msgpack packs them


_PACKED: dict[int, tuple[list, list, Any]] = {}    # id -> (the list, a copy of it, its wire form)
_PACKED_KEEP = 64               # lists remembered (then it starts over)


def pack_runs(v: Any) -> Any:
    """The wire form of an IntRuns value: ``v`` itself when short or not a
    list of ints (then the decoder refuses it as it would a plain list), else
    its runs of at least three equally spaced values as [start, stop, step]
    and the values between them as themselves.

    A list packed before, still equal to the copy kept of it, gets the same
    wire form without the scan: a plan's device lists go in every Execute of
    its nodes, and a 512-host node's JAX ids ([0, 1, 2, 3] for each host) are
    512 runs that take milliseconds to find in Python; comparing with the
    copy takes microseconds."""
    n = len(v)
    if n < RUNS_FROM:
        return v
    hit = _PACKED.get(id(v))
    if hit is not None and hit[0] is v and hit[1] == v:
        return hit[2]
    out = _pack_runs(v, n)
    if len(_PACKED) >= _PACKED_KEEP:
        _PACKED.clear()
    _PACKED[id(v)] = (v, list(v), out)      # (holding v: its id is not reused while kept)
    return out


def _pack_runs(v: Any, n: int) -> Any:
    a, b, z = v[0], v[1], v[-1]
    if type(a) is int and type(b) is int and type(z) is int and a != b:
        step = b - a
        stop = z + step
        if _INT_MIN <= stop <= _INT_MAX and _INT_MIN <= step <= _INT_MAX and z == a + step * (n - 1) \
                and v == list(range(a, stop, step)):
            return [[a, stop, step]]         # (the usual case: one run)
    out: list[Any] = []
    i = 0
    while i < n:
        a = v[i]
        if type(a) is not int:
            return v
        j = i + 1
        if j < n and type(v[j]) is int:
            step = v[j] - a
            if step != 0 and _INT_MIN <= step <= _INT_MAX:
                while j < n and type(v[j]) is int and v[j] - v[j - 1] == step:
                    j += 1
        if j - i >= _RUN_MIN and _INT_MIN <= a + step * (j - i) <= _INT_MAX:
            out.append([a, a + step * (j - i), step])
            i = j
        else:
            out.append(a)
            i += 1
    return out


_RUNS_SEEN: dict[tuple, list[int]] = {}
_RUNS_KEEP = 256                # distinct run forms kept (then it starts over)


def unpack_runs(v: Any) -> list[int]:
    """An IntRuns value from its wire form; ProtocolError (with the reason)
    if it is not one."""
    if type(v) is not list:
        raise ProtocolError(f"expected list, got {type(v).__name__}")
    for x in v:
        if type(x) is not int:
            break
    else:                                    # plain ints (a fresh list: msgpack made it)
        if len(v) > MAX_RUN_INTS:
            raise ProtocolError(f"more than {MAX_RUN_INTS} values")
        return v
    for i, x in enumerate(v):
        if type(x) is not int and (type(x) is not list or len(x) != 3 or type(x[0]) is not int
                                   or type(x[1]) is not int or type(x[2]) is not int):
            raise ProtocolError(f"[{i}]: expected int or [start, stop, step], got {x!r:.40}")
    key = tuple(tuple(x) if type(x) is list else x for x in v)
    got = _RUNS_SEEN.get(key)
    if got is not None:
        return got
    out: list[int] = []
    for i, x in enumerate(v):
        if type(x) is int:
            out.append(x)
        else:
            start, stop, step = x
            if step == 0:
                raise ProtocolError(f"[{i}]: a run's step is 0")
            r = range(start, stop, step)
            if not r:
                raise ProtocolError(f"[{i}]: an empty run {x}")
            # (its length worked out: len() of a range of more than sys.maxsize values raises)
            if len(out) + (abs(stop - start) + abs(step) - 1) // abs(step) > MAX_RUN_INTS:
                raise ProtocolError(f"more than {MAX_RUN_INTS} values")
            out += r
        if len(out) > MAX_RUN_INTS:
            raise ProtocolError(f"more than {MAX_RUN_INTS} values")
    if len(_RUNS_SEEN) >= _RUNS_KEEP:
        _RUNS_SEEN.clear()
    _RUNS_SEEN[key] = out
    return out


def _is_runs(tp: Any) -> bool:
    return typing.get_origin(tp) is typing.Annotated and RUNS in tp.__metadata__


# ---- encoding: records packed by msgpack itself ------------------------------------

# record class -> a function returning its field values in declaration order, as they
# are packed (IntRuns fields as runs)
_FIELDS_OF: dict[type, Callable[[Any], tuple]] = {}
# record class -> its field values as they are (for replace)
_VALUES_OF: dict[type, Callable[[Any], tuple]] = {}
# record class -> its IntRuns fields
_RUNS_FIELDS: dict[type, frozenset[str]] = {}


def _pack_default(obj: Any) -> Any:
    """msgpack's hook for objects it cannot pack: a record becomes the tuple of
    its fields (packed as an array, as :meth:`Record.to_wire`'s list would be)."""
    fields = _FIELDS_OF.get(type(obj))
    if fields is not None:
        return fields(obj)
    if isinstance(obj, Record):
        return obj.to_wire()
    raise TypeError(f"can not serialize {type(obj).__name__!r} object")


def _field_getter(names: Sequence[str], runs: frozenset[str] = frozenset()) -> Callable[[Any], tuple]:
    if runs:
        src = "def get(o):\n    return (" + "".join(
            f"_runs(o.{n}), " if n in runs else f"o.{n}, " for n in names) + ")\n"
        ns: dict[str, Any] = {"_runs": pack_runs}
        exec(compile(src, "<zpath fields>", "exec"), ns)
        return ns["get"]
    if len(names) > 1:
        return operator.attrgetter(*names)       # returns a tuple
    if len(names) == 1:
        get = operator.attrgetter(names[0])
        return lambda obj: (get(obj),)
    return lambda obj: ()


_local = threading.local()


def _packer() -> msgpack.Packer:
    """This thread's packer (a Packer must not be shared between threads: its
    ``default`` hook runs Python code in the middle of a pack)."""
    try:
        return _local.packer
    except AttributeError:
        _local.packer = msgpack.Packer(default=_pack_default, use_bin_type=True, autoreset=True)
        return _local.packer


# ---- decoding: one generated checker per record class -----------------------------

_FAIL = 'raise _Error("")'
_NONE = type(None)


def _top_types(tp: Any) -> frozenset | None:
    """The Python types of the msgpack values ``tp`` can accept (None: any)."""
    if tp is float:
        return frozenset((float, int))
    if tp in (_NONE, bool, int, str, bytes):
        return frozenset((tp,))
    if isinstance(tp, type) and issubclass(tp, Record):
        return frozenset((list,))
    if _is_runs(tp):
        return frozenset((list,))
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return frozenset((list,))
    if origin is dict:
        return frozenset((dict,))
    if origin in (typing.Union, types.UnionType):
        out: frozenset = frozenset()
        for a in typing.get_args(tp):
            top = _top_types(a)
            if top is None:
                return None
            out |= top
        return out
    return None                               # Any


class _Gen:
    """Writes Python source that checks msgpack values against annotations.

    :meth:`check` emits statements that check the local variable ``var`` and
    returns an expression for the checked value; an expression equal to ``var``
    means the value is used as it is (the decoded lists are fresh, so a list
    whose items need no conversion is kept instead of copied)."""

    def __init__(self) -> None:
        self.ns: dict[str, Any] = {"_Error": ProtocolError, "_new": object.__new__}
        self.blocks: list[list[str]] = []
        self.lines: list[str] = []
        self.count = 0

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def bind(self, obj: Any, prefix: str) -> str:
        name = self.name(prefix)
        self.ns[name] = obj
        return name

    def emit(self, indent: int, text: str) -> None:
        self.lines.append("    " * indent + text)

    def nested(self, tp: Any, var: str, indent: int, typed: bool = False) -> tuple[list[str], str]:
        """The statements and expression of :meth:`check`, not yet emitted."""
        saved, self.lines = self.lines, []
        try:
            expr = self.check(tp, var, indent, typed)
            return self.lines, expr
        finally:
            self.lines = saved

    def function(self, tp: Any) -> str:
        """A separate function ``name(v)`` checking one value; returns its name."""
        name = self.name("_check")
        saved, self.lines = self.lines, []
        self.emit(0, f"def {name}(v):")
        self.emit(1, f"return {self.check(tp, 'v', 1)}")
        self.blocks.append(self.lines)
        self.lines = saved
        return name

    def construct(self, cls: type, exprs: list[str], indent: int) -> str:
        """Build a ``cls`` from field expressions; returns the expression."""
        setters = _slot_setters(cls)
        if setters is None:
            return f"{self.bind(cls, '_cls')}({', '.join(exprs)})"
        obj = self.name("o")
        self.emit(indent, f"{obj} = _new({self.bind(cls, '_cls')})")
        for setter, expr in zip(setters, exprs):
            self.emit(indent, f"{self.bind(setter, '_set')}({obj}, {expr})")
        return obj

    def check(self, tp: Any, var: str, indent: int, typed: bool = False) -> str:
        """``typed``: the caller has already tested ``type(var)`` against
        :func:`_top_types` of ``tp``."""
        emit = self.emit
        if tp is Any:
            return var
        if tp is _NONE:
            emit(indent, f"if {var} is not None: {_FAIL}")
            return var
        if tp in (bool, int, str, bytes):
            if not typed:
                emit(indent, f"if type({var}) is not {tp.__name__}: {_FAIL}")
            return var
        if tp is float:
            if typed:
                return f"float({var})"
            out = self.name("f")
            emit(indent, f"if type({var}) is float: {out} = {var}")
            emit(indent, f"elif type({var}) is int: {out} = float({var})")
            emit(indent, f"else: {_FAIL}")
            return out
        if _is_runs(tp):
            return f"{self.bind(unpack_runs, '_runs')}({var})"
        if isinstance(tp, type) and issubclass(tp, Record):
            decode = tp.__dict__.get("_decode")
            fn = decode.__func__ if isinstance(decode, staticmethod) else (
                lambda v, tp=tp: tp.from_wire(v, None))
            return f"{self.bind(fn, '_' + tp.__name__)}({var})"
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):
            return self._union(args, var, indent)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            emit(indent, (f"if len({var}) != {len(args)}: " if typed else
                          f"if type({var}) is not list or len({var}) != {len(args)}: ") + _FAIL)
            items = []
            for i, a in enumerate(args):
                x = self.name("x")
                emit(indent, f"{x} = {var}[{i}]")
                items.append(self.check(a, x, indent))
            return "(" + "".join(f"{e}, " for e in items) + ")"
        if origin is list and args[0] is float:
            # (report times by column: floats as msgpack gives them, kept as they are)
            if not typed:
                emit(indent, f"if type({var}) is not list: {_FAIL}")
            x, out = self.name("x"), self.name("l")
            emit(indent, f"{out} = {var}")
            emit(indent, f"for {x} in {var}:")
            emit(indent + 1, f"if type({x}) is not float:")
            emit(indent + 2, f"{out} = {self.bind(_float_list, '_floats')}({var})")
            emit(indent + 2, "break")
            return out
        if origin in (list, tuple):
            if not typed:
                emit(indent, f"if type({var}) is not list: {_FAIL}")
            x = self.name("x")
            body, expr = self.nested(args[0], x, indent + 1)
            if not body:
                out = var if expr == x else f"[{expr} for {x} in {var}]"
            elif expr == x:
                emit(indent, f"for {x} in {var}:")
                self.lines += body
                out = var
            else:
                out = self.name("l")
                emit(indent, f"{out} = []")
                emit(indent, f"for {x} in {var}:")
                self.lines += body
                emit(indent + 1, f"{out}.append({expr})")
            return f"tuple({out})" if origin is tuple else out
        if origin is dict:
            if not typed:
                emit(indent, f"if type({var}) is not dict: {_FAIL}")
            k, x = self.name("k"), self.name("x")
            kbody, kexpr = self.nested(args[0], k, indent + 1)
            vbody, vexpr = self.nested(args[1], x, indent + 1)
            if kexpr == k and vexpr == x:
                if kbody or vbody:
                    emit(indent, f"for {k}, {x} in {var}.items():")
                    self.lines += kbody + vbody
                return var
            out = self.name("d")
            emit(indent, f"{out} = {{}}")
            emit(indent, f"for {k}, {x} in {var}.items():")
            self.lines += kbody + vbody
            emit(indent + 1, f"{out}[{kexpr}] = {vexpr}")
            return out
        raise TypeError(f"unsupported field type {tp!r}")

    def _union(self, args: tuple, var: str, indent: int) -> str:
        optional = _NONE in args
        alts = [a for a in args if a is not _NONE]
        tops = [_top_types(a) for a in alts]
        disjoint = all(t is not None for t in tops) and \
            sum(len(t) for t in tops) == len(frozenset().union(*tops))
        if not disjoint:
            # a value two alternatives could take: try them in order
            checks = [self.function(a) for a in alts]
            name = self.name("_union")
            saved, self.lines = self.lines, []
            self.emit(0, f"def {name}(v):")
            if optional:
                self.emit(1, "if v is None: return None")
            for c in checks:
                self.emit(1, "try:")
                self.emit(2, f"return {c}(v)")
                self.emit(1, "except _Error:")
                self.emit(2, "pass")
            self.emit(1, _FAIL)
            self.blocks.append(self.lines)
            self.lines = saved
            return f"{name}({var})"
        # Each msgpack type fits one alternative at most, so dispatching on the
        # type is the same as trying the alternatives in order.
        branches = []
        for a, top in zip(alts, tops):
            cond = " or ".join(f"type({var}) is {t.__name__}" for t in sorted(top, key=lambda t: t.__name__))
            branches.append((cond, *self.nested(a, var, indent + 1, typed=True)))
        keep = all(expr == var for _, _, expr in branches)
        out = var if keep else self.name("u")
        word = "if"
        if optional:
            self.emit(indent, f"if {var} is None: " + ("pass" if keep else f"{out} = None"))
            word = "elif"
        for cond, body, expr in branches:
            self.emit(indent, f"{word} {cond}:")
            self.lines += body
            if not keep:
                self.emit(indent + 1, f"{out} = {expr}")
            elif not body:
                self.emit(indent + 1, "pass")
            word = "elif"
        self.emit(indent, f"else: {_FAIL}")
        return out

    def compile(self, name: str, filename: str) -> Callable:
        source = "\n".join("\n".join(block) for block in [*self.blocks, self.lines]) + "\n"
        exec(compile(source, filename, "exec"), self.ns)
        fn = self.ns[name]
        fn.source = source
        return fn


def _float_list(v: list) -> list[float]:
    """A list[float] field's value where not every item is a float: ints
    become floats; anything else is refused."""
    out = []
    for x in v:
        if type(x) is float:
            out.append(x)
        elif type(x) is int:
            out.append(float(x))
        else:
            raise ProtocolError("")
    return out


def _slot_setters(cls: type) -> list[Callable[[Any, Any], None]] | None:
    """The ``__set__`` of each field's slot, to build an instance of a frozen
    slots dataclass without its ``__init__`` (which sets each field through
    ``object.__setattr__`` and does nothing else); None if the class has its
    own ``__init__`` or a ``__post_init__``."""
    if cls.__dict__.get("_custom_init", False) or hasattr(cls, "__post_init__"):
        return None
    setters = []
    for f in dataclasses.fields(cls):
        slot = next((k.__dict__[f.name] for k in cls.__mro__ if f.name in k.__dict__), None)
        if type(slot) is not types.MemberDescriptorType:
            return None
        setters.append(slot.__set__)
    return setters


def _gen_decoder(cls: type, hints: dict[str, Any]) -> Callable[[Any], Record]:
    """The generated checker of one record class (see the module docstring)."""
    g = _Gen()
    fields = dataclasses.fields(cls)
    names = [f"v_{f.name}" for f in fields]
    g.emit(0, "def decode(v):")
    g.emit(1, f"if type(v) is not list or len(v) != {len(fields)}: {_FAIL}")
    if fields:
        g.emit(1, "".join(f"{n}, " for n in names) + "= v")
    exprs = [g.check(hints[f.name], n, 1) for f, n in zip(fields, names)]
    g.emit(1, f"return {g.construct(cls, exprs, 1)}")
    return g.compile("decode", f"<zpath decoder of {cls.__qualname__}>")


def _fast_init(cls: type) -> Callable[..., Any]:
    """``cls(*fields)`` for a frozen slots dataclass, without its ``__init__``."""
    g = _Gen()
    names = [f"v_{f.name}" for f in dataclasses.fields(cls)]
    g.emit(0, f"def init({', '.join(names)}):")
    g.emit(1, f"return {g.construct(cls, names, 1)}")
    return g.compile("init", f"<zpath constructor of {cls.__qualname__}>")


_CONSTRUCTORS: dict[type, Callable[..., Any]] = {}


def constructor(cls: type) -> Callable[..., Any]:
    """``cls(*fields)`` for a record, all fields given in order, without the
    frozen ``__init__``'s cost where the class allows it (see
    :func:`_slot_setters`; made once per class): for per-computation messages."""
    init = _CONSTRUCTORS.get(cls)
    if init is None:
        init = _CONSTRUCTORS[cls] = _fast_init(cls) if _slot_setters(cls) is not None else cls
    return init


# record class -> its constructor without __init__ and each field's position
_REPLACERS: dict[type, tuple[Callable[..., Any], dict[str, int]]] = {}


def replace(msg: Record, **changes: Any) -> Record:
    """``dataclasses.replace(msg, **changes)`` for a record (a new record with
    those fields changed), without the frozen ``__init__``'s cost: what the
    controller does to every computation's ``Execute``."""
    cls = type(msg)
    made = _REPLACERS.get(cls)
    if made is None:
        if _slot_setters(cls) is None or cls not in _VALUES_OF:
            return dataclasses.replace(msg, **changes)
        made = _REPLACERS[cls] = (_fast_init(cls), {f.name: k for k, f in enumerate(dataclasses.fields(cls))})
    init, index = made
    values = list(_VALUES_OF[cls](msg))
    for name, value in changes.items():
        k = index.get(name)
        if k is None:
            raise TypeError(f"{cls.__name__} has no field {name!r}")
        values[k] = value
    return init(*values)


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
    if _is_runs(tp):
        def check_runs(v: Any, w: str | None) -> list[int]:
            try:
                return unpack_runs(v)
            except ProtocolError as e:
                raise ProtocolError("" if w is None else f"{w}{'' if str(e).startswith('[') else ': '}{e}") \
                    from None
        return check_runs
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
    custom_init = "__init__" in cls.__dict__
    cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
    cls._custom_init = custom_init
    hints = typing.get_type_hints(cls, include_extras=True)
    cls._checks = tuple((f.name, _compile(hints[f.name])) for f in dataclasses.fields(cls))
    cls._decode = staticmethod(_gen_decoder(cls, hints))
    names = [f.name for f in dataclasses.fields(cls)]
    runs = frozenset(n for n in names if _is_runs(hints[n]))
    _FIELDS_OF[cls] = _field_getter(names, runs)
    _VALUES_OF[cls] = _field_getter(names)
    if runs:
        _RUNS_FIELDS[cls] = runs
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


class Header(typing.NamedTuple):
    """A message's header (a named tuple: one is made for every item of a
    Batch, and a tuple is made in C)."""
    version: int
    type_id: int
    msg_id: int
    parent: int
    sender: str
    signer: int = CLUSTER


def _header(*fields: Any) -> Header:
    return _new_tuple(Header, fields)


_new_tuple = tuple.__new__


# ---- signature ------------------------------------------------------------------------

_U64 = struct.Struct("<Q").pack
_BLOCK = 64                                   # SHA-256 block size
# A frame of at least BULK_BYTES enters the HMAC as its BLAKE3 digest (32 bytes)
# rather than its bytes: BLAKE3 hashes ~2x faster than SHA-256 on one core and
# uses more cores from THREADED_BYTES, and the HMAC stays a MAC of the whole message.
BULK_BYTES = 1 << 20
THREADED_BYTES = 16 << 20
_IPAD = bytes(x ^ 0x36 for x in range(256))
_OPAD = bytes(x ^ 0x5C for x in range(256))


class _Signer:
    """HMAC-SHA256 under one key (RFC 2104, as :func:`hmac.new`), with the key
    schedule done once: the inner and outer SHA-256 states after the padded key
    are copied for each message. Each frame enters as its length and its bytes,
    or its BLAKE3 digest from BULK_BYTES on."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        key = bytes(key)
        if len(key) > _BLOCK:
            key = hashlib.sha256(key).digest()
        key = key.ljust(_BLOCK, b"\0")
        self._inner = hashlib.sha256(key.translate(_IPAD))
        self._outer = hashlib.sha256(key.translate(_OPAD))

    def sign(self, parts: Sequence[Any]) -> bytes:
        inner = self._inner.copy()
        update = inner.update
        for p in parts:
            n = len(p) if type(p) is bytes else memoryview(p).nbytes
            update(_U64(n))
            update(p if n < BULK_BYTES else bulk_digest(p, n))
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


def bulk_digest(data: Any, n: int) -> bytes:
    """The BLAKE3 digest a frame of ``n`` >= BULK_BYTES bytes is signed as."""
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO if n >= THREADED_BYTES else 1).digest()


_SIGNERS: dict[bytes, _Signer] = {}


def _signer(key: bytes) -> _Signer:
    try:
        return _SIGNERS[key]
    except (KeyError, TypeError):             # TypeError: an unhashable key (bytearray)
        signer = _Signer(key)
        if type(key) is bytes:
            if len(_SIGNERS) >= 64:
                _SIGNERS.clear()
            _SIGNERS[key] = signer
        return signer


def _sign(key: bytes, parts: Sequence[Any]) -> bytes:
    return _signer(key).sign(parts)


# ---- the envelope ---------------------------------------------------------------------

def encode(key: bytes, msg: Record, *, msg_id: int, sender: str, parent: int = 0,
           buffers: Sequence[Any] = (), body: bytes | None = None, signer: int = CLUSTER) -> list[Any]:
    """Frames for one message, signed with ``key`` as ``signer``. ``buffers``
    are bytes-like objects (e.g. contiguous numpy arrays) sent as raw frames.
    ``body``: the message's body if it was already packed (:func:`pack_body`)."""
    if msg.TYPE < 0:
        raise TypeError(f"{type(msg).__name__} is not a top-level message")
    pack = _packer().pack
    header = pack((PROTOCOL_VERSION, msg.TYPE, msg_id, parent, sender, signer))
    if body is None:
        body = pack(msg)
    parts = [header, body, *buffers]
    return [_signer(key).sign(parts), *parts]


# ---- batches ----------------------------------------------------------------------------
# Several messages without buffers to one peer may travel under one signature as
# a Batch (zpath.net.messages.Batch, type BATCH_TYPE): its body is a list of
# [type_id, msg_id, parent, body bytes], each body exactly what the message
# alone would carry. The receiver gets them back as a Batched, in order, each
# with a header of its own (the batch's version and sender).

BATCH_TYPE = 60


def pack_body(msg: Record) -> bytes:
    """A message's body, as :func:`encode` would put it in its frame."""
    return _packer().pack(msg)


class Batched:
    """What :func:`decode` returns for a Batch: its messages, checked, in order,
    as (header, message); an item that did not decode has a ProtocolError in
    place of its message."""

    __slots__ = ("messages",)

    def __init__(self, messages: list[tuple["Header", Record]]) -> None:
        self.messages = messages


def _unbatch(header: "Header", items: list) -> Batched:
    """Each item checked as if it came alone; one that does not decode becomes
    a ProtocolError in its place (the others are still good)."""
    if len(items) > MAX_BATCH_ITEMS:
        raise ProtocolError(f"a Batch of {len(items)} messages (at most {MAX_BATCH_ITEMS})")
    out: list[tuple[Header, Any]] = []
    for i, (type_id, msg_id, parent, body_b) in enumerate(items):
        try:
            out.append((_header(header.version, type_id, msg_id, parent, header.sender, header.signer),
                        _unbatch_item(i, type_id, body_b)))
        except ProtocolError as e:
            out.append((_header(header.version, type_id, msg_id, parent, header.sender, header.signer), e))
    return Batched(out)


def _unbatch_body(header: "Header", body: Any) -> Batched | None:
    """``_unbatch(header, Batch._decode(body).items)`` in one pass over the
    items, each checked as the Batch's decoder checks it; None where that
    decoder (or the size check) would refuse the batch, for ``decode`` to
    refuse it as before."""
    if type(body) is not list or len(body) != 1:
        return None
    items = body[0]
    if type(items) is not list or len(items) > MAX_BATCH_ITEMS:
        return None
    version, sender, signer = header.version, header.sender, header.signer
    new, registry, unpackb = _new_tuple, _REGISTRY, _unpackb
    out: list[tuple[Header, Any]] = []
    append = out.append
    for i, item in enumerate(items):
        if type(item) is not list or len(item) != 4:
            return None
        type_id, msg_id, parent, body_b = item
        if type(type_id) is not int or type(msg_id) is not int or type(parent) is not int \
                or type(body_b) is not bytes:
            return None
        h = new(Header, (version, type_id, msg_id, parent, sender, signer))
        cls = registry.get(type_id)
        if cls is not None and type_id != BATCH_TYPE:      # (the usual case: _unbatch_item's)
            try:
                append((h, cls._decode(unpackb(body_b, raw=False, strict_map_key=False))))
                continue
            except Exception:
                pass
        try:
            append((h, _unbatch_item(i, type_id, body_b)))
        except ProtocolError as e:
            append((h, e))
    return Batched(out)


def _unbatch_item(i: int, type_id: int, body_b: bytes) -> Record:
    cls = _REGISTRY.get(type_id)
    if cls is None or type_id == BATCH_TYPE:
        raise ProtocolError(f"Batch.items[{i}]: {'nested batch' if cls else 'unknown message type'} "
                            f"{type_id}")
    try:
        body = _unpackb(body_b, raw=False, strict_map_key=False)
    except Exception as e:
        raise ProtocolError(f"Batch.items[{i}]: body of {cls.__name__} is not msgpack: {e}") from None
    try:
        return cls._decode(body)
    except Exception:
        return cls.from_wire(body, f"Batch.items[{i}].{cls.__name__}")


def decode_header(frames: Sequence[Any]) -> Header | None:
    """Best-effort header parse used to address an error reply; never raises."""
    try:
        h = msgpack.unpackb(_bytes(frames[1]), raw=False)
        return Header(int(h[0]), int(h[1]), int(h[2]), int(h[3]), str(h[4]),
                      int(h[5]) if len(h) > 5 else CLUSTER)
    except Exception:
        return None


def _bytes(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame


def _nbytes(b: Any) -> int:
    return len(b) if type(b) is bytes else memoryview(b).nbytes


_unpackb = msgpack.unpackb
_BAD_HEADER = "header must be [version, type, id, parent, sender, signer]"


def decode(key: bytes | KeyOf, frames: Sequence[Any]) -> tuple[Header, Any, list[Any]]:
    """Check and decode one message. Raises ProtocolError on anything wrong.
    ``key``: the key every message is signed with, or a function giving the
    key of the signer a header names (None: a signer this receiver refuses).
    Returned buffers are memoryviews (zero-copy for zmq.Frame input). A Batch
    comes back as a :class:`Batched` holding its messages."""
    if len(frames) < 3:
        raise ProtocolError(f"expected at least 3 frames, got {len(frames)}")
    parts = [f if type(f) is bytes else _bytes(f) for f in frames]
    sig, header_b, body_b = parts[0], parts[1], parts[2]
    if len(parts) - 3 > MAX_BUFFERS:
        raise ProtocolError(f"too many buffers ({len(parts) - 3} > {MAX_BUFFERS})")
    if _nbytes(body_b) > MAX_BODY_BYTES:
        raise ProtocolError(f"body too large ({_nbytes(body_b)} bytes)")
    if _nbytes(header_b) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header too large ({_nbytes(header_b)} bytes)")
    # the header names the signer, so it is read before the signature is checked
    # (msgpack of at most MAX_HEADER_BYTES; its problems are reported after the
    # signature's, as before, when the key does not depend on it)
    try:
        h = _unpackb(header_b, raw=False)
        header_error = None
    except Exception as e:
        h, header_error = None, f"header is not msgpack: {e}"
    if type(key) is bytes:
        signer_key: bytes | None = key
    else:
        signer = h[5] if type(h) is list and len(h) == 6 else None
        signer_key = key(signer) if type(signer) is int else None
        if signer_key is None:
            raise ProtocolError("bad signature (no key for its signer)")
    if _nbytes(sig) != SIG_BYTES or not hmac.compare_digest(
            sig if type(sig) is bytes else bytes(sig), _signer(signer_key).sign(parts[1:])):
        raise ProtocolError("bad signature (wrong key or corrupted message)")
    if header_error is not None:
        raise ProtocolError(header_error)
    # msgpack gives exact types: type(x) is int refuses booleans as isinstance would not
    if type(h) is not list or len(h) != 6:
        raise ProtocolError(_BAD_HEADER)
    version, type_id, msg_id, parent, sender, signer = h
    if not (type(version) is int and type(type_id) is int and type(msg_id) is int
            and type(parent) is int and type(sender) is str and type(signer) is int):
        raise ProtocolError(_BAD_HEADER)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} not supported "
                            f"(this side speaks {PROTOCOL_VERSION})")
    cls = _REGISTRY.get(type_id)
    if cls is None:
        raise ProtocolError(f"unknown message type {type_id}")
    try:
        body = _unpackb(body_b, raw=False, strict_map_key=False)
    except Exception as e:
        raise ProtocolError(f"body of {cls.__name__} is not msgpack: {e}") from None
    if type_id == BATCH_TYPE and len(parts) == 3:      # (a Batch carries no buffers)
        header = _new_tuple(Header, (version, type_id, msg_id, parent, sender, signer))
        batched = _unbatch_body(header, body)
        if batched is not None:
            return header, batched, []
    try:
        msg = cls._decode(body)
    except Exception:
        msg = cls.from_wire(body)         # the precise error (or what it accepts)
    buffers = [memoryview(b) for b in parts[3:]] if len(parts) > 3 else []
    header = _header(version, type_id, msg_id, parent, sender, signer)
    if type_id == BATCH_TYPE:
        if buffers:
            raise ProtocolError("a Batch carries no buffers")
        return header, _unbatch(header, msg.items), []
    return header, msg, buffers
