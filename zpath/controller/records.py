"""The controller's records: a submission being planned, a program's run,
a node parked before it is sent, a computation in flight."""
from __future__ import annotations

import collections
import dataclasses
from array import array
from typing import Any, Callable, Iterator, NamedTuple, Sequence

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
    # a client's call forms kept for CallAgain (Call.keep): number -> the Call
    forms: dict[int, m.Call] = dataclasses.field(default_factory=dict)


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


class Timeline:
    """The host reports kept for ``TimelineRequest``s: the newest ``max_rows``
    at least, oldest first. A row is (exec id, error, start, end, waited, host,
    seq, island, client, name, devices), as ``ExecRecord``'s fields.

    A run of a batch's rows of one computation, all fine (``add_run``: the
    usual case at scale, a row per host of a relay's group), is kept as one
    block whose starts, ends, waits and hosts are packed (bytes of float64s
    and int64s), which the collector never tracks. Kept as a row per host, every report made a tuple that the
    young passes walked once before they stopped tracking it; the history is
    full in a long run, so each new row frees an old one, and the collector
    counts allocations net of frees: its young passes came rarely and walked
    tens of thousands of rows at once (20-30 ms of the controller's CPU in one
    pass at 512 hosts, a stall in dispatch)."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._entries: collections.deque[tuple] = collections.deque()
        self._rows = 0

    def __len__(self) -> int:
        """Rows kept."""
        return self._rows

    def __iter__(self) -> Iterator[tuple]:
        """What is kept: rows, and blocks (a row whose start, end, waited and
        host fields are packed, one float64 or int64 per host)."""
        return iter(self._entries)

    def append(self, row: tuple) -> None:
        self._entries.append(row)
        self._rows += 1
        if self._rows > self.max_rows:
            self._trim()

    def add_run(self, exec_id: int, starts: Sequence[float], ends: Sequence[float], waited: Sequence[float],
                hosts: Sequence[int], seq: int, island: int, client: int, name: str,
                devices: tuple[int, ...]) -> None:
        """The rows of hosts ``hosts`` (fine, of one computation), as one block."""
        if not hosts:
            return
        self._entries.append((exec_id, None, array("d", starts).tobytes(), array("d", ends).tobytes(),
                              array("d", waited).tobytes(), array("q", hosts).tobytes(), seq, island, client,
                              name, devices))
        self._rows += len(hosts)
        if self._rows > self.max_rows:
            self._trim()

    def _trim(self) -> None:
        entries = self._entries
        while self._rows > self.max_rows and entries:
            old = entries.popleft()
            self._rows -= len(old[5]) // 8 if type(old[5]) is bytes else 1

    def last(self, limit: int) -> list[tuple]:
        """The newest ``limit`` rows, oldest first."""
        out: list[tuple] = []
        for e in reversed(self._entries):
            if len(out) >= limit:
                break
            if type(e[5]) is not bytes:
                out.append(e)
                continue
            x, error, *columns, seq, island, client, name, devices = e
            rest = (seq, island, client, name, devices)
            starts, ends, waited = (memoryview(c).cast("d") for c in columns[:3])
            hosts = memoryview(columns[3]).cast("q")
            for k in range(len(hosts) - 1, -1, -1):
                out.append((x, error, starts[k], ends[k], waited[k], hosts[k], *rest))
        del out[limit:]
        out.reverse()
        return out


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
