"""The worker's decisions, as plain state given ``now``.

No sockets, threads or clocks here: the I/O thread (``server.Worker``) reads
the clock, hands each event and ``now`` to these classes, and carries out what
they return. Everything here is touched by the I/O thread only, except
:meth:`PendingFetch.claim` (any thread: the fetch is answered once).

* :class:`WorkerState` — the fused programs this host knows (DefineFused,
  DropFused, RunFused), the clients that left (their later Puts are dropped),
  the fetches waiting for a shard with their deadlines, when the controller
  was last heard from, and the bytes of shared-memory pieces lent now.
* :class:`ShapedLink` — the emulated DCN link's queue: when each piece (or
  chunk of one) is handed to TCP.
* :class:`Chunks` — shaped DCN pieces arriving as PieceChunks, until whole.
* :class:`IdRanges` — a compact set of ids (the departed clients).

``validate_state()`` checks each one's invariants; tests call it after every
event.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import itertools
import math
import threading
from typing import Any, Callable

import numpy as np

from zpath import sharding
from zpath.errors import ErrorKind
from zpath.ids import client_of
from zpath.net import channels
from zpath.net import messages as m
from zpath.net import codec
from zpath.net.codec import CLUSTER, Record
from zpath.net.transport import raw

# a client's fetch waits at most this long for its shard, whatever it asks
MAX_FETCH_TIMEOUT_S = 3600.0
# the fetch heap is compacted (answered fetches dropped) beyond this many entries
FETCH_HEAP_MIN = 1024
# fetches of one client waiting at once on a host; beyond, a Fetch is refused
MAX_PENDING_FETCHES = 16_384
# the I/O thread looks at its deadlines at least this often (seconds)
IDLE_WAIT_S = 0.5

_exec_input = codec.constructor(m.ExecInput)


def _positions(devices: list[int], local: Any) -> list[int]:
    """The positions in ``devices`` of those in ``local``, in order; found by
    ``list.index`` (in C) when the list is much longer than ``local`` (a
    computation over every device of hundreds of hosts: the controller refuses
    a mesh that names a device twice)."""
    if len(devices) <= 8 * len(local):
        return [p for p, d in enumerate(devices) if d in local]
    out = []
    for d in local:
        try:
            out.append(devices.index(d))
        except ValueError:
            pass
    out.sort()
    return out


class LocalShards:
    """An Execute with the shards of this host's devices (those in ``local``)
    named for every input whose ``shards`` the controller left empty: the one
    Execute it sends every host when each shard is in place at the region the
    input's spec gives its device (docs/protocol.md, Execute). The shard list
    it names for an input is remembered by what it depends on (the
    computation's devices, mesh and axes, the input's shape and spec): op-by-op
    calls ask the same on every call. The lists and their ShardInputs are
    shared by the Executes that get them: read only. At most ``max_entries``
    are kept (then it starts over)."""

    def __init__(self, local: Any, max_entries: int = 4096) -> None:
        self.local = local
        self.max_entries = max_entries
        self._shards: dict[tuple, list[m.ShardInput]] = {}
        # the last list named, with what it depends on as the message had it:
        # found again by comparing the lists as they are, without a key
        self._last: tuple | None = None

    def __len__(self) -> int:
        """How many shard lists it keeps."""
        return len(self._shards)

    def __call__(self, ex: m.Execute) -> m.Execute:
        inputs = ex.inputs
        for inp in inputs:
            if not inp.shards:
                break
        else:
            return ex
        cache = self._shards
        new = []
        for inp in inputs:
            if inp.shards:
                new.append(inp)
                continue
            shape = inp.aval.shape
            last = self._last
            if last is not None and shape == last[3] and inp.spec == last[4] and ex.devices == last[0] \
                    and ex.mesh_shape == last[1] and ex.axis_names == last[2]:
                shards = last[5]
            else:
                key = ((tuple(ex.devices), tuple(ex.mesh_shape), tuple(ex.axis_names)), tuple(shape),
                       tuple(a if a is None or type(a) is str else tuple(a) for a in inp.spec))
                shards = cache.get(key)
                if shards is None:
                    if len(cache) >= self.max_entries:
                        cache.clear()
                    regs = sharding.regions_of(shape, ex.mesh_shape, ex.axis_names, inp.spec)
                    devices = ex.devices
                    shards = cache[key] = [m.ShardInput(devices[p], sharding.to_wire(regs[p]), [])
                                           for p in _positions(devices, self.local)]
                self._last = (list(ex.devices), list(ex.mesh_shape), list(ex.axis_names), list(shape),
                              [a if a is None or type(a) is str else list(a) for a in inp.spec], shards)
            new.append(_exec_input(inp.buffer, inp.aval, inp.spec, shards))
        return codec.replace(ex, inputs=new)      # (dataclasses.replace costs more)


class FreeOrder:
    """When a Free may be carried out: once every computation that arrived
    before it has finished (one of them may still read what it frees).
    Computations are numbered in arrival order (``arrive``); ``finish`` and
    ``free_after_earlier`` return the frees that may go now, as (buffers,
    remember) in order. Not thread-safe: the caller holds its lock."""

    def __init__(self) -> None:
        self.arrived = 0
        self._unfinished: collections.deque[int] = collections.deque()
        self._finished: set[int] = set()
        self._frees: collections.deque[tuple[int, list[int], bool]] = collections.deque()

    def arrive(self) -> int:
        index = self.arrived
        self._unfinished.append(index)
        self.arrived += 1
        return index

    def finish(self, index: int) -> list[tuple[list[int], bool]]:
        self._finished.add(index)
        return self._due()

    def free_after_earlier(self, buffers: list[int], remember: bool) -> list[tuple[list[int], bool]]:
        self._frees.append((self.arrived, buffers, remember))
        return self._due()

    def _due(self) -> list[tuple[list[int], bool]]:
        while self._unfinished and self._unfinished[0] in self._finished:
            self._finished.discard(self._unfinished.popleft())
        oldest = self._unfinished[0] if self._unfinished else self.arrived
        due = []
        while self._frees and self._frees[0][0] <= oldest:
            _, buffers, remember = self._frees.popleft()
            due.append((buffers, remember))
        return due

    def validate_state(self) -> None:
        assert list(self._unfinished) == sorted(self._unfinished)
        assert all(i < self.arrived for i in self._unfinished)
        assert self._finished <= set(self._unfinished)
        assert [f[0] for f in self._frees] == sorted(f[0] for f in self._frees)


class IdRanges:
    """A set of non-negative ints kept as sorted, disjoint, inclusive ranges:
    small when its members mostly come in runs (ids handed out in order, of
    which most are in it, e.g. the clients that have left)."""

    def __init__(self) -> None:
        self._lo: list[int] = []       # range starts, sorted
        self._hi: list[int] = []       # their ends

    def __contains__(self, n: int) -> bool:
        i = bisect.bisect_right(self._lo, n) - 1
        return i >= 0 and n <= self._hi[i]

    def __len__(self) -> int:
        """How many ranges (not members)."""
        return len(self._lo)

    def add(self, n: int) -> None:
        lo, hi = self._lo, self._hi
        i = bisect.bisect_right(lo, n) - 1       # the range starting at or before n
        if i >= 0 and n <= hi[i]:
            return
        joins_left = i >= 0 and hi[i] == n - 1
        joins_right = i + 1 < len(lo) and lo[i + 1] == n + 1
        if joins_left and joins_right:
            hi[i] = hi[i + 1]
            del lo[i + 1], hi[i + 1]
        elif joins_left:
            hi[i] = n
        elif joins_right:
            lo[i + 1] = n
        else:
            lo.insert(i + 1, n)
            hi.insert(i + 1, n)

    def validate_state(self) -> None:
        assert len(self._lo) == len(self._hi)
        for k, (a, b) in enumerate(zip(self._lo, self._hi, strict=True)):
            assert 0 <= a <= b, (a, b)
            if k:
                # disjoint and not adjacent (adjacent ranges are merged)
                assert self._hi[k - 1] + 1 < a, (self._hi[k - 1], a)


class FusedRun:
    """One run of a fused program (this host's part): its computations, in
    order, as ``Execute`` templates whose buffer ids are codes (``n >= 0``:
    ``first + n``; ``n < 0``: ``inputs[-n - 1]``); ``release`` (codes) are its
    intermediates. The executor runs it as one computation on the union of
    their devices, and reports it once. ``plan`` is a one-item list shared by
    the runs of one fused program, where the executor keeps what it worked out
    on the first run (see ``executor._FusedPlan``)."""

    __slots__ = ("exec_id", "seq", "name", "devices", "executes", "inputs", "first", "release", "plan",
                 "hold")

    def __init__(self, exec_id: int, seq: int, name: str, devices: list[int],
                 executes: list[m.Execute], inputs: list[int], first: int, release: list[int],
                 plan: list | None = None, hold: bool = False) -> None:
        self.exec_id, self.seq, self.name, self.devices = exec_id, seq, name, devices
        self.executes, self.inputs, self.first, self.release = executes, inputs, first, release
        self.plan = plan if plan is not None else [None]
        self.hold = hold          # as RunFused.hold

    def buffer(self, code: int) -> int:
        return self.first + code if code >= 0 else self.inputs[-code - 1]


@dataclasses.dataclass
class FusedProgram:
    """A fused program as DefineFused gave it: its definition, the local
    devices its computations use, how many of a run's inputs it reads, and
    what the executor keeps for its runs (``FusedRun.plan``)."""
    definition: m.DefineFused
    devices: list[int]
    reads: int
    plan: list

    @classmethod
    def of(cls, msg: m.DefineFused, local: LocalShards | None = None) -> "FusedProgram":
        """``msg``'s program; with ``local``, its Executes get the shards of
        this host's devices named where the controller left them empty (the
        hosts' parts alike, as for an Execute: LocalShards)."""
        if local is not None and any(not i.shards for ex in msg.executes for i in ex.inputs):
            msg = codec.replace(msg, executes=[local(ex) for ex in msg.executes])
        codes = [c for ex in msg.executes for c in
                 [*(i.buffer for i in ex.inputs), *(o.buffer for o in ex.outputs)]] + msg.release
        lists = {id(ex.devices): ex.devices for ex in msg.executes}     # (decoded runs: often one list)
        devices = sorted(set().union(*lists.values()))
        return cls(msg, devices, max([0, *(-c for c in codes)]), [None])


class PendingFetch:
    """A fetch waiting for its shard; answered once (value, error or
    deadline), by whichever thread claims it first."""

    def __init__(self, ident: bytes, msg: m.Fetch, deadline: float,
                 answered: Callable[[int], None] | None = None) -> None:
        self.ident, self.msg, self.deadline = ident, msg, deadline
        self.key: Any = None                       # the store entry it waits for
        self.cb: Any = None                        # and its callback there
        self._lock = threading.Lock()
        self._answered = False
        self._on_answer = answered                 # told the buffer's client once answered

    @property
    def answered(self) -> bool:
        return self._answered

    def claim(self) -> bool:
        with self._lock:
            if self._answered:
                return False
            self._answered = True
        if self._on_answer is not None:
            self._on_answer(client_of(self.msg.buffer))
        return True


def fetch_timeout(asked: float) -> float:
    """How long a fetch waits: what it asked, within [0, MAX_FETCH_TIMEOUT_S]
    (NaN: 0)."""
    if asked != asked:      # NaN
        return 0.0
    return min(max(asked, 0.0), MAX_FETCH_TIMEOUT_S)


class WorkerState:
    """What the worker's I/O thread decides on: see the module's docstring."""

    def __init__(self, controller_timeout_s: float, now: float) -> None:
        self.rank: int | None = None
        self.controller_timeout_s = controller_timeout_s
        self.last_controller = now
        self.fused: dict[int, FusedProgram] = {}
        self.gone_clients = IdRanges()          # clients that left: their Puts are dropped
        # fetches waiting, as a heap of (deadline, arrival, fetch); answered ones
        # stay until their deadline or the next compaction
        self.fetches: list[tuple[float, int, PendingFetch]] = []
        self.fetch_heap_limit = FETCH_HEAP_MIN
        self._arrivals = itertools.count()
        # unanswered fetches per client (answered in any thread: under the lock)
        self.pending_fetches: dict[int, int] = {}
        self._pending_lock = threading.Lock()
        self.lent_bytes = 0        # of shared-memory pieces lent now (see lend)

    # ---- the controller ------------------------------------------------------
    def heard_from_controller(self, now: float) -> None:
        self.last_controller = now

    def controller_lost(self, now: float) -> bool:
        """Whether the controller has been silent for too long (the worker exits)."""
        return now - self.last_controller > self.controller_timeout_s

    # ---- fused programs ------------------------------------------------------
    def define_fused(self, msg: m.DefineFused, local: LocalShards | None = None) -> None:
        """Keep a fused program (``local``: see ``FusedProgram.of``)."""
        self.fused[msg.fused] = FusedProgram.of(msg, local)

    def drop_fused(self, msg: m.DropFused) -> None:
        for f in msg.fused:
            self.fused.pop(f, None)

    def run_fused(self, msg: m.RunFused) -> FusedRun | m.ErrorInfo:
        """The run to queue (the caller also frees ``run.release`` once it
        has run: Worker._run_fused), or the error to report for it at once."""
        known = self.fused.get(msg.fused)
        if known is None or known.reads > len(msg.inputs):
            why = "is unknown here" if known is None else "reads more inputs than the run gives"
            return m.ErrorInfo(ErrorKind.FUSED_UNKNOWN, f"fused program {msg.fused} {why}", self.rank, "", "")
        d = known.definition
        return FusedRun(msg.exec_id, msg.seq, f"fused program {msg.fused}", known.devices, d.executes,
                        msg.inputs, msg.first_buffer, d.release, known.plan, msg.hold)

    # ---- clients -------------------------------------------------------------
    def client_gone(self, client: int) -> None:
        self.gone_clients.add(client)

    def put_from_gone_client(self, buffer: int) -> bool:
        """Whether a Put of this buffer comes from a client that has left (dropped)."""
        return client_of(buffer) in self.gone_clients

    # ---- shared-memory pieces ------------------------------------------------
    def lend(self, offset: int, size: int) -> bool:
        """Whether a ShmPiece of ``size`` bytes at ``offset`` in its segment is
        taken as it lies there (no copy: XLA adopts it, and the segment is
        acknowledged once nothing refers to it) rather than copied out; the
        caller calls :meth:`lent` once it is."""
        return size >= channels.ZERO_COPY_RECV and offset % channels.XLA_ALIGN == 0 \
            and self.lent_bytes + size <= channels.LEND_MAX_BYTES

    def lent(self, size: int) -> None:
        self.lent_bytes += size

    def returned(self, size: int) -> None:
        """A lent piece is no longer referred to (its segment is acknowledged)."""
        self.lent_bytes -= size

    # ---- fetches -------------------------------------------------------------
    def fetch(self, ident: bytes, msg: m.Fetch, now: float) -> PendingFetch | None:
        """A fetch came: it waits for its shard until its deadline (see
        :meth:`expire_fetches`); None if its client has MAX_PENDING_FETCHES
        waiting already (refused: pending fetches cost memory)."""
        client = client_of(msg.buffer)
        with self._pending_lock:
            n = self.pending_fetches.get(client, 0)
            if n >= MAX_PENDING_FETCHES:
                return None
            self.pending_fetches[client] = n + 1
        if len(self.fetches) > self.fetch_heap_limit:
            # answered fetches stay in the heap until their deadline; drop
            # them now and then (amortised: the limit doubles with what is
            # really pending) so a busy client cannot grow it for long
            self.fetches = [e for e in self.fetches if not e[2].answered]
            heapq.heapify(self.fetches)
            self.fetch_heap_limit = max(FETCH_HEAP_MIN, 2 * len(self.fetches))
        pending = PendingFetch(ident, msg, now + fetch_timeout(msg.timeout_s), self._fetch_answered)
        heapq.heappush(self.fetches, (pending.deadline, next(self._arrivals), pending))
        return pending

    def _fetch_answered(self, client: int) -> None:
        """(any thread) One of the client's fetches was answered."""
        with self._pending_lock:
            n = self.pending_fetches.get(client, 0) - 1
            if n > 0:
                self.pending_fetches[client] = n
            else:
                self.pending_fetches.pop(client, None)

    def expire_fetches(self, now: float) -> list[PendingFetch]:
        """The fetches whose deadline has passed and that nothing answered
        yet, claimed: the caller answers each with :meth:`deadline_error` and
        stops its wait for the shard."""
        out = []
        while self.fetches and self.fetches[0][0] <= now:
            _, _, p = heapq.heappop(self.fetches)
            if p.claim():
                out.append(p)
        return out

    def deadline_error(self, p: PendingFetch) -> m.ErrorInfo:
        return m.ErrorInfo(ErrorKind.DEADLINE_EXCEEDED, f"buffer {p.msg.buffer} was not ready on host "
                           f"{self.rank} within {p.msg.timeout_s:.1f}s", self.rank, "", "")

    def next_deadline_in(self, now: float) -> float:
        """Seconds until the I/O thread must look at its deadlines again."""
        if not self.fetches:
            return IDLE_WAIT_S
        return min(IDLE_WAIT_S, max(0.0, self.fetches[0][0] - now))

    def validate_state(self) -> None:
        self.gone_clients.validate_state()
        for f, p in self.fused.items():
            assert p.definition.fused == f
            assert p.devices == sorted(set(p.devices))
            assert p == dataclasses.replace(FusedProgram.of(p.definition), plan=p.plan), f
            assert len(p.plan) == 1
        h = self.fetches
        for i in range(1, len(h)):
            assert h[(i - 1) // 2][:2] <= h[i][:2], "fetch heap order"
        assert all(e[0] == e[2].deadline for e in h)
        assert self.fetch_heap_limit >= FETCH_HEAP_MIN
        assert len(h) <= self.fetch_heap_limit + 1
        assert 0 <= self.lent_bytes <= channels.LEND_MAX_BYTES
        waiting = collections.Counter(client_of(e[2].msg.buffer) for e in h if not e[2].answered)
        assert waiting == collections.Counter(self.pending_fetches), "pending fetches per client"
        assert all(n <= MAX_PENDING_FETCHES for n in self.pending_fetches.values())


class ShapedLink:
    """The queue of this host's emulated DCN link (``channels.Shaper``): each
    message is handed to TCP when the link would deliver it. A capped piece
    larger than a chunk goes as PieceChunks paced at the cap, so the real
    transfer overlaps the pacing."""

    def __init__(self, shaper: channels.Shaper) -> None:
        self.shaper = shaper
        # heap of (due, seq, rank, message, buffers)
        self.queue: list[tuple[float, int, int, Record, Any]] = []
        self._seq = 0

    @property
    def active(self) -> bool:
        return self.shaper.active

    def send(self, rank: int, msg: Record, buffers: Any, now: float) -> None:
        """Queue a message for host ``rank``."""
        nbytes = channels.piece_nbytes(buffers)
        if not (isinstance(msg, m.Piece) and len(buffers) == 1):
            sends = [(self.shaper.due(nbytes, now), msg, buffers)]
        else:
            plan = self.shaper.chunks(nbytes, now)
            if len(plan) == 1:
                sends = [(plan[0][2], msg, buffers)]
            else:
                flat = raw(buffers[0])          # C-contiguous (see Worker._send_piece): a view
                sends = [(due, m.PieceChunk(msg.piece_id, msg.aval, off, nbytes), [flat[off:off + size]])
                         for off, size, due in plan]
        for due, one, bufs in sends:
            self._seq += 1
            heapq.heappush(self.queue, (due, self._seq, rank, one, bufs))

    def take_due(self, now: float) -> list[tuple[int, Record, Any]]:
        """The (rank, message, buffers) due by ``now``, in order: send them."""
        out = []
        while self.queue and self.queue[0][0] <= now:
            _, _, rank, msg, buffers = heapq.heappop(self.queue)
            out.append((rank, msg, buffers))
        return out

    def next_due_in(self, now: float) -> float:
        """Seconds until the next message is due (IDLE_WAIT_S if none is queued)."""
        return max(0.0, self.queue[0][0] - now) if self.queue else IDLE_WAIT_S

    def drop_peer(self, rank: int, now: float) -> None:
        """Host ``rank`` was lost: what was queued for it goes, and gives back
        the link time it had booked."""
        if any(e[2] == rank for e in self.queue):
            self.queue = self.shaper.repace(self.queue, lambda e: e[2] == rank, now)

    def validate_state(self) -> None:
        h = self.queue
        for i in range(1, len(h)):
            assert h[(i - 1) // 2][:2] <= h[i][:2], "shaped heap order"
        assert all(math.isfinite(e[0]) for e in h)
        assert len({e[1] for e in h}) == len(h), "sequence numbers are unique"


class Chunks:
    """Shaped DCN pieces arriving as PieceChunks (see :class:`ShapedLink`),
    each copied into its piece's array as it comes. ``make(aval, flat)`` types
    a piece's bytes as its array (ValueError or TypeError if it cannot)."""

    def __init__(self, make: Callable[[m.Aval, np.ndarray], np.ndarray]) -> None:
        self.make = make
        # piece id -> [array, its bytes, bytes received], or None once refused
        # (its later chunks are dropped)
        self.partial: dict[int, list | None] = {}

    def take(self, msg: m.PieceChunk, buffers: list) -> np.ndarray | None:
        """Copy a chunk into its piece; the piece's array once it is complete.
        A chunk that does not fit raises ValueError (or TypeError): the caller
        then calls :meth:`refuse`."""
        if msg.piece_id in self.partial and self.partial[msg.piece_id] is None:
            if msg.offset + (buffers[0].nbytes if buffers else 0) >= msg.nbytes:
                del self.partial[msg.piece_id]      # the refused piece's last chunk
            return None
        if len(buffers) != 1:
            raise ValueError(f"expected one data buffer, got {len(buffers)}")
        part = self.partial.get(msg.piece_id)
        if part is None:
            flat = channels.recv_buffers.get(max(msg.nbytes, 0))     # device_put takes it over
            part = self.partial[msg.piece_id] = [self.make(msg.aval, flat), flat, 0]
        arr, flat, got = part
        size = buffers[0].nbytes
        if msg.nbytes != flat.nbytes or msg.offset < 0 or msg.offset + size > flat.nbytes \
                or got + size > flat.nbytes:
            raise ValueError(f"chunk [{msg.offset}, {msg.offset + size}) does not fit piece "
                             f"{msg.piece_id} of {flat.nbytes} bytes ({got} received)")
        flat[msg.offset:msg.offset + size] = np.frombuffer(buffers[0], np.uint8)
        part[2] = got + size
        if part[2] < flat.nbytes:
            return None
        del self.partial[msg.piece_id]
        return arr

    def refuse(self, piece_id: int) -> None:
        """The piece is refused (a bad chunk): its later chunks are dropped."""
        self.partial[piece_id] = None

    def forget(self, piece_id: int) -> None:
        """The piece failed (FailPieces): what came of it goes."""
        self.partial.pop(piece_id, None)

    def validate_state(self) -> None:
        for piece_id, part in self.partial.items():
            if part is not None:
                arr, flat, got = part
                assert 0 <= got < flat.nbytes, (piece_id, got, flat.nbytes)
                assert arr.nbytes == flat.nbytes, piece_id


# what a data port takes from workers only (signed with the worker key)
_FROM_WORKERS = (m.Piece, m.Pieces, m.PieceChunk, m.ShmPiece, m.Forwarded, m.ExecDoneBatch)


def refused_on_data(signer: int, msg: Record) -> str:
    """Why a data port refuses a message from ``signer`` ("" if it takes it): a
    client puts and fetches only its own buffers (ids ``client << 32 | n``,
    signed with its session key); pieces come only from workers (the worker
    key)."""
    if type(msg) in (m.Put, m.Fetch):
        if signer <= 0 or client_of(msg.buffer) != signer:
            return (f"{type(msg).__name__} of buffer {msg.buffer}: not this client's (not the signer's: "
                    f"it is client {client_of(msg.buffer)}'s, signed by {signer})")
        return ""
    if type(msg) in _FROM_WORKERS and signer != CLUSTER:
        return f"{type(msg).__name__} is accepted from workers only"
    return ""
