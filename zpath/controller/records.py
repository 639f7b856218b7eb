"""The controller's records: a submission being planned, a program's run,
a node parked before it is sent, a computation in flight."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

from zpath.controller.directory import Plan
from zpath.net import messages as m
from zpath.net.codec import Record



@dataclasses.dataclass
class Peer:
    role: str                # "worker" or "client"
    id: int                  # host rank or client id
    name: str
    last_seen: float
    ident: bytes = b""
    weight: float = 1.0
    gone: bool = False
    # a client's: what checks its messages (its session key, as its own id only)
    keys: Callable[[int], bytes | None] | None = None


@dataclasses.dataclass(slots=True)
class ProgramRun:
    """One submitted program: how many of its nodes have been sent."""
    peer: Peer
    release: list[int]
    total: int
    sent: int = 0
    released: bool = False
    sequential: bool = False          # dispatch="sequential": nodes wait for others' ExecDone


@dataclasses.dataclass
class Submission:
    """Calls submitted together (a program, or one call), planned in order;
    ``next`` is the first node not planned yet (it waits for memory)."""
    ident: bytes
    peer: Peer
    calls: list[m.Call]
    dispatch: str
    run: ProgramRun
    seq: int = 0                      # arrival order
    next: int = 0
    producer: dict[int, int] = dataclasses.field(default_factory=dict)
    exec_ids: dict[int, int] = dataclasses.field(default_factory=dict)
    # it waited for memory: the outputs of its calls from here on are pinned
    # (a release of one before its call is planned waits for the plan)
    pinned_from: int | None = None
    # under a memory limit or for a long program: node index -> the program's
    # buffers to release once that node (their last reader) is planned, so it
    # frees as it goes
    release_at: dict[int, list[int]] | None = None
    record: list[Any] | None = None   # its plans, in order (to fuse a template)
    # planning stopped at a flush point (see _advance); ``first``: the node
    # that planning pass started at
    paused: bool = False
    first: int = 0
    # the node the current slice started at, and the hosts' parts planned in it
    slice_from: int = 0
    parts: int = 0
    # when it began waiting for memory (the loop's clock), while it does
    waiting_since: float | None = None
    # called once it is planned in full without waiting for memory
    then: Callable[[Submission], None] | None = None


@dataclasses.dataclass(slots=True)
class InFlight:
    """A dispatched computation until every host reported it finished."""
    client: int
    client_ident: bytes
    name: str
    island: int
    seq: int
    devices: tuple[int, ...]
    hosts: set[int]                        # hosts still running it
    host_devices: dict[int, int]           # host -> how many of its devices it uses
    outputs: list[int]
    pieces: list[tuple[int, int, int]]     # (piece id, source host, destination host)
    puts: list[int] = dataclasses.field(default_factory=list)   # inputs its client puts
    fused: bool = False                    # a fused run (its outputs live on several hosts)
    copies: list[tuple[int, dict]] = dataclasses.field(default_factory=list)   # see Plan.copies
    transient: dict[int, int] | None = None                                     # see Plan.transient
    error: m.ErrorInfo | None = None       # the first error a host reported
    # sent through relays: host -> its relay, whose report batches may carry its row
    relay_of: dict[int, int] | None = None


class Report(NamedTuple):
    """One host's report of a computation, from a row of an ``ExecDoneBatch``
    (read as an ``ExecDone`` is: the timeline keeps it)."""
    exec_id: int
    error: m.ErrorInfo | None
    start: float
    end: float
    waited: float


@dataclasses.dataclass(slots=True)
class ParkedNode:
    """A node waiting to be sent: for computations it reads to finish
    (sequential programs), for parked producers to be sent, or for its turn in
    the multi-tenant scheduler."""
    run: ProgramRun
    call: m.Call
    planned: tuple[Plan, str]
    waits: set
    exec_id: int
    island: int


def call_buffers(call: m.Call) -> list[int]:
    return [i.buffer for i in call.inputs] + [o.buffer for o in call.outputs]


class Send(NamedTuple):
    """A message for one peer (``parent``: the message it answers). A named
    tuple: the core makes several per computation, and a frozen dataclass's
    ``__init__`` costs several times a tuple's."""
    ident: bytes
    msg: Record
    parent: int = 0
    buffers: Any = ()


@dataclasses.dataclass(frozen=True)
class RemoveSegments:
    """A lost host of this machine: remove the shared-memory segments of its
    process ``pid``."""
    rank: int
    pid: int


Effect = Send | RemoveSegments
