"""Runs computations in the order they were dispatched, per device.

A computation starts once every earlier computation that shares one of its
local devices has finished; computations on disjoint devices run at the same
time, each on its own thread. The controller dispatches in one order per island
(the gang order), so every host of an island runs shared-device computations in
the same order. Each computation runs to completion before the next one on its
devices starts (XLA:CPU collectives must not overlap on the same devices).

Inputs are assembled from local shards and from pieces sent by other hosts; a
failed input poisons the outputs with the same root cause instead of running."""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import logging
import queue
import re
import threading
import time
import traceback
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zpath.errors import ErrorKind
from zpath import sharding
from zpath.config import DEEP_QUEUE, HOLD_DEEP_S, HOLD_SHORT_S, SHORT_COMPUTATION_S
from zpath.net import channels
from zpath.net import messages as m
from zpath.worker.state import IDLE_WAIT_S, FreeOrder, FusedRun
from zpath.worker.store import PieceKey, ShardKey, Store, Unsplit, shard_key

try:       # JAX's array class, whose constructor can skip the checks that
    # make_array_from_single_device_arrays does (an internal name: None if gone)
    from jax._src.array import ArrayImpl as _ArrayImpl
except ImportError:  # pragma: no cover
    _ArrayImpl = None

try:       # what jax.device_put of a numpy array ends in (internal names: see to_device)
    from jax._src.core import shaped_abstractify as _shaped_abstractify
    from jax._src.lib import xla_client as _xc
    from jax._src.config import explicit_device_put_scope as _explicit_device_put
    from jax.sharding import SingleDeviceSharding as _SingleDeviceSharding
    _batched_device_put = _xc.batched_device_put
    jax.config.jax_enable_x64       # (read on every call)
except (ImportError, AttributeError):  # pragma: no cover
    _batched_device_put = None

_SHARDINGS: dict[Any, Any] = {}      # device -> its SingleDeviceSharding
# (shape, dtype, 64-bit types on) -> the aval JAX puts such an array as, or
# None where to_device leaves the array to jax.device_put
_AVALS: dict[tuple, Any] = {}

log = logging.getLogger(__name__)

INPUT_TIMEOUT_S = 300.0
# Held reports (see Executor._loop): a computation that ran for less than
# SHORT_S, followed at once by another that ran for less than that last time,
# is reported with a hold of HOLD_SHORT_S; one that the controller let hold
# (Execute.hold) with at least DEEP_QUEUE computations queued behind it on its
# devices, with up to HOLD_DEEP_S (both in zpath.config: the controller
# needs them too). A long one (at least LONG_S and SHORT_S) that the
# controller let hold, with at least LONG_QUEUE queued behind it, starts a
# batch instead: its report and the next ones wait until half of that queue
# has run (the report that finds so few behind it goes at once and takes the
# batch along), so the controller hears once per batch and tops the queue up
# in one message. The executor releases a batch; HOLD_RELEASED_S, the I/O
# thread's longest sleep (IDLE_WAIT_S), only bounds a batch whose computation
# does not end, and a hold that long does not wake the I/O thread to learn
# its deadline.
SHORT_S = SHORT_COMPUTATION_S
# A streak (Executor._streak) settles what it left, on the executor thread,
# after each computation whose gang order (Execute.seq) is a multiple of this:
# the hosts of a collective then settle after the same computations, not one
# while the other waits for it in the next call (twice as many left, on a
# host whose computations' seqs skip those, settle too)
STREAK_SETTLE = 8
LONG_S = 0.004
LONG_QUEUE = 2
HOLD_RELEASED_S = IDLE_WAIT_S


_SETTLING = object()     # (_run: the settler thread reports this one)


# how a collective's transport reports that the other side went away (gloo on
# CPU, NCCL on GPUs)
_PEER_FAILURE = re.compile(r"\bgloo\b.*\bfailed\b|connection (?:closed|reset|refused) by peer|broken pipe"
                           r"|\bnccl\b.*(?:error|failed)", re.IGNORECASE)


try:       # to name threads for the kernel (Linux): top -H, perf, /proc/<pid>/task/*/comm
    _prctl: Any = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover
    _prctl = None
_PR_SET_NAME = 15


def name_thread(name: str) -> None:
    """Give the calling thread ``name`` (at most 15 bytes kept) where the
    kernel shows it (``/proc/<pid>/task/<tid>/comm``, ``top -H``, ``perf``),
    so a worker's threads can be told apart from outside (Python names its
    threads for itself only). Does nothing where that is not available."""
    if _prctl is not None:
        _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def _as_is(buffer: int) -> int:
    return buffer


class _Made:
    """What a fused run made so far: buffer id -> (array, its sharding, the
    prepared program, output slot and ExecOutput that made it); its
    intermediates, and those of them not in the store."""

    __slots__ = ("arrays", "intermediates", "unstored")

    def __init__(self, intermediates: set[int]) -> None:
        self.arrays: dict[int, tuple] = {}
        self.intermediates = intermediates
        self.unstored: set[int] = set()


class InputError(Exception):
    def __init__(self, error: m.ErrorInfo) -> None:
        super().__init__(error.message)
        self.error = error


class Executor:
    def __init__(self, store: Store, local_devices: dict[int, Any],
                 on_done: Callable[[int, m.ErrorInfo | None, float, float, float], None],
                 input_timeout_s: float = INPUT_TIMEOUT_S, jax_devices: dict[int, Any] | None = None,
                 release_held: Callable[[], None] | None = None) -> None:
        """``on_done(exec_id, error or None, start, end, hold)`` reports a
        finished computation; ``hold`` is how long (seconds, 0 for not at all)
        the report may wait for the next ones (see ``_loop``), and
        ``release_held()`` is called before this executor waits for an input,
        when nothing held should wait any more.
        ``local_devices`` maps global device id -> jax Device; ``jax_devices``
        maps JAX id -> jax Device for every device of this host's island runtime."""
        self.jax = jax
        self.array_impl = _ArrayImpl
        self.store = store
        self.devices = local_devices
        self.jax_devices = jax_devices or {d.id: d for d in local_devices.values()}
        self.gid = {d: g for g, d in local_devices.items()}
        self.on_done = on_done
        self.release_held = release_held
        self.input_timeout_s = input_timeout_s
        self.rank: int | None = None
        self.programs: dict[str, Any] = {}          # digest -> jax.export.Exported
        self.compiled: dict[tuple, _Prepared] = {}  # (digest, devices, specs) -> prepared
        self._by_program: dict[str, list[_Prepared]] = {}   # digest -> its prepared variants
        self._last_prepared: tuple[Any, _Prepared | None] = (None, None)    # see _prepared
        # a batch of long computations' reports held (see _report): it goes
        # once this few wait behind the computation that starts next
        self._release_at: int | None = None
        self._lock = threading.Lock()
        # per local device, the computations dispatched to it and not yet started,
        # in dispatch order; an entry is (Execute, its local devices)
        self._queues: dict[int, collections.deque[tuple[m.Execute, frozenset[int], int]]] = {
            d: collections.deque() for d in local_devices}
        self._busy: set[int] = set()                 # local devices of running computations
        self._last_seq = -1                          # a host belongs to one island: one order
        # arrival indices of computations not finished yet, in arrival order,
        # and frees waiting for every computation that arrived before them
        self._order = FreeOrder()
        # seconds a computation waited for inputs that were not there yet, by exec
        # id, for its report (only those that waited); per thread while it runs
        self.waited: dict[int, float] = {}
        self._waits = threading.local()
        # computations ready to start, taken by the executor threads; at most
        # one computation per device runs at a time, so one thread per device
        self._ready: queue.SimpleQueue[tuple[m.Execute, frozenset[int], int] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, name=f"exec_{i}", daemon=True)
                         for i in range(max(1, len(local_devices)))]
        # plain computations finished but not settled yet (outputs to store,
        # report to give), in order; the settler thread settles them while
        # the computation after each runs (see _run). One settles at a time.
        self._settles: collections.deque[tuple] = collections.deque()
        self._settle_lock = threading.Lock()
        self._settle_wake: queue.SimpleQueue[bool | None] = queue.SimpleQueue()
        self._threads.append(threading.Thread(target=self._settler, name="settle", daemon=True))
        # what waits for an entry here while some are left to settle late
        # wakes the settler (see _settle_late), once
        self._late = False
        store.on_wait = self._settle_soon
        self._stopped = False
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            for q in self._queues.values():
                q.clear()
        for _ in self._threads:
            self._ready.put(None)
        self._settle_wake.put(None)

    def add_program(self, digest: str, blob: bytes) -> None:
        if digest not in self.programs:
            self.programs[digest] = blob     # deserialised lazily on the executor thread

    def submit(self, ex: "m.Execute | FusedRun") -> None:
        """Queue a computation (in dispatch order) and start what can start."""
        with self._lock:
            if ex.seq <= self._last_seq:
                log.warning("computation %d (seq %d) arrived after seq %d: out of gang order",
                            ex.exec_id, ex.seq, self._last_seq)
            self._last_seq = max(self._last_seq, ex.seq)
            entry = (ex, frozenset(d for d in ex.devices if d in self.devices), self._order.arrive())
            for d in entry[1]:
                self._queues[d].append(entry)
            self._try_start(entry)

    def free_after_earlier(self, buffers: list[int], remember: bool = True) -> None:
        """Free these buffers' shards once every computation that arrived before
        now has finished (one of them may still read them); ``remember``: as
        ``Store.free_buffers``."""
        with self._lock:
            self._free(self._order.free_after_earlier(buffers, remember))

    def _free(self, due: list[tuple[list[int], bool]]) -> None:
        """With the lock held: carry out the frees whose predecessors are done."""
        for buffers, remember in due:
            self.store.free_buffers(buffers, remember=remember)

    def _try_start(self, entry: tuple[m.Execute, frozenset[int], int],
                   started: list | None = None) -> None:
        """With the lock held: start ``entry`` if it is first in the queue of
        every one of its devices and none of them is busy: hand it to an
        executor thread, or append it to ``started`` for the caller (an
        executor thread) to run itself."""
        ex, devs, index = entry
        if self._stopped or devs & self._busy or any(self._queues[d][0] is not entry for d in devs):
            return
        for d in devs:
            self._queues[d].popleft()
        self._busy |= devs
        if started is None:
            self._ready.put(entry)
        else:
            started.append(entry)

    # ---- executor threads ----------------------------------------------------
    def _loop(self) -> None:
        """An executor thread: run computations handed over, and those that the
        one it finished lets start (without a hand-off).

        A computation whose message allows it (``hold``: nothing in the
        controller waits for its report) and that leaves at least DEEP_QUEUE
        computations queued behind it on its devices is reported with a
        ``hold`` of half the time those take (by its own time), at most
        HOLD_DEEP_S: its report may wait that long to go out with the next
        ones, while the devices have work. Else (or if that is under twice
        HOLD_SHORT_S) a short computation (under SHORT_S) that the thread
        follows at once with another short one (under SHORT_S last time) is
        reported with HOLD_SHORT_S. A long one (LONG_S or more) that may
        hold with at least LONG_QUEUE queued behind it starts a batch instead:
        its report and the next ones are held, without a deadline of their
        own, until the report that finds at most half of that many behind it,
        which takes them along. So a chain of computations wakes the I/O
        thread and the controller once per group instead of once per node. A
        failure is never held."""
        name_thread(f"zpath-{threading.current_thread().name}")
        while not self._stopped:
            entry = self._ready.get()
            chain = None
            while entry is not None and not self._stopped:
                try:
                    entry, done, chain = self._run(*entry, chain)
                except Exception:      # a bug: keep the thread for the other computations
                    log.exception("executor thread: computation %d", entry[0].exec_id)
                    entry, done, chain = None, None, None
                    self._settle_wake.put(True)    # what the one before left is settled still
                if done is _SETTLING:     # the settler reports it
                    continue
                if done is None:
                    self._release_at = None
                    if self.release_held is not None:    # nothing may stay held now
                        self.release_held()
                    continue
                self._report(entry, done)
            if chain is not None:      # stopped with one left to the settler, which may have gone
                self._drain_settles()

    def _report(self, nxt: tuple | None, done: tuple) -> None:
        """Report a finished computation (``done`` as ``_run`` returns it;
        ``nxt``: the computation its thread went on with, if any), with the
        hold that ``_loop`` describes."""
        exec_id, error, start, end, took, behind, may_hold = done
        hold = 0.0
        release_at, self._release_at = self._release_at, None
        if nxt is not None and error is None:
            if may_hold and took >= LONG_S and took >= SHORT_S and \
                    (release_at is not None or behind >= LONG_QUEUE):
                # a batch: held until half the queue it started with has run
                if release_at is None:
                    release_at = behind // 2
                if behind > release_at:
                    hold, self._release_at = HOLD_RELEASED_S, release_at
            else:
                # (about half the queued work, by this one's time: the
                # controller hears while half of it is left)
                deep = min(HOLD_DEEP_S, behind * took / 2) \
                    if may_hold and behind >= DEEP_QUEUE else 0.0
                if deep >= 2 * HOLD_SHORT_S:
                    hold = deep
                elif took < SHORT_S and self._short(nxt[0]):
                    hold = HOLD_SHORT_S
        try:
            self.on_done(exec_id, error, start, end, hold)
        except Exception:     # the next computation must still run
            log.exception("reporting computation %d", exec_id)

    # ---- settling: storing a computation's outputs and reporting it ---------
    def _settler(self) -> None:
        name_thread("zpath-settle")
        while True:
            token = self._settle_wake.get()
            try:
                self._drain_settles()
            except Exception:      # a bug: keep the thread for the others
                log.exception("settler thread")
            if token is None:      # stop
                return

    def _settle_late(self) -> bool:
        """Whether what is left to settle may wait until the computation this
        thread starts now has run, and be settled here then: a wake-up of the
        settler fewer per computation. Only when nothing waits for it: its
        report may be held (``Execute.hold``: nothing in the controller waits
        for it) and nothing here waits for its outputs (a piece another host
        awaits, a fetch). Something that starts to wait for them later wakes
        the settler (``_settle_soon``): a collective that this thread then sits
        in, waiting for a host that waits for such a piece, is not held up."""
        left = list(self._settles)      # (normally one; a copy: the settler may take it meanwhile)
        late = bool(left) and all(ex.hold for ex, *_ in left) and \
            self._leave_late([o.buffer for ex, *_ in left for o in ex.outputs])
        if not late:
            self._late = False
        return late

    def _leave_late(self, buffers: list[int]) -> bool:
        """Flag what is left to settle as left late, then look whether anything
        here waits for these buffers' shards already: if so, clear the flag and
        return False (the caller wakes the settler). The flag goes up before the
        look: a wait that the look does not see finds it up and wakes the
        settler itself (``_settle_soon``); it is cleared before a drain."""
        self._late = True
        if self.store.awaited(buffers):
            self._late = False
            return False
        return True

    def _settle_soon(self) -> None:
        """Something waits for an entry of the store: what is left to settle
        late is settled now, by the settler (see ``_settle_late``). Only then:
        a settle left to the settler is woken as the next call starts, not
        while this thread makes that one's inputs."""
        if self._late:
            self._late = False
            self._settle_wake.put(True)

    def _drain_settles(self) -> None:
        """Settle, in order, the computations waiting to be (from any thread)."""
        with self._settle_lock:
            self._drain_locked()

    def _drain_locked(self) -> None:
        """Settle what is left, in order (``_settle``; several are left after a
        streak, see ``_streak``), then give their reports."""
        settles = self._settles
        while settles:
            batch = [settles.popleft() for _ in range(len(settles))]
            for entry, done in zip(batch, self._settle(batch), strict=True):
                try:
                    self._report(entry[4], done)
                except Exception:      # a bug: the others are still reported
                    log.exception("reporting computation %d", done[0])

    def _settle(self, batch: list[tuple]) -> list[tuple]:
        """Settle plain computations that ran, in order ((Execute, prepared,
        outputs, arrival index, next, report) each): their outputs stored
        under one lock of the store, then all counted finished (frees waiting
        for them may go) under one of this executor's. Returns their reports,
        with the error of each whose storing failed (its outputs then fail)."""
        shards: list[tuple[ShardKey, Any]] = []
        dones = []
        for ex, prepared, outs, index, nxt, done in batch:
            try:
                error = self._output_shards(ex, prepared, outs, shards)
            except Exception as e:      # a bug: it must still be reported
                log.exception("settling computation %d", ex.exec_id)
                error = m.ErrorInfo(ErrorKind.REMOTE_ERROR, _text(f"{type(e).__name__}: {e}"), self.rank,
                                    ex.name, "")
            dones.append(done if error is None else (done[0], error) + done[2:])
        try:
            self.store.set_many(shards)
        except Exception as e:     # a bug: each of them fails (what was stored stays)
            log.exception("storing the outputs of %d computations", len(batch))
            dones = [done if done[1] is not None else (done[0], self._failed(s[0], done[0], _as_is, e, None))
                     + done[2:] for s, done in zip(batch, dones, strict=True)]
        finally:
            with self._lock:
                for entry in batch:
                    self._free(self._order.finish(entry[3]))
        return dones

    def _output_shards(self, ex: m.Execute, prepared: "_Prepared", outs: Any,
                       shards: list[tuple[ShardKey, Any]]) -> m.ErrorInfo | None:
        """Add the shards of a plain computation's outputs to ``shards``, to be
        stored; returns an error if taking them apart failed: then those of
        the computations before are stored now, and all its outputs fail
        with it, none stored (a client that knows one output of a call done
        takes the others for done too: futures.Future._fetched)."""
        mine = len(shards)
        try:
            for k, (o, out) in enumerate(zip(ex.outputs, outs, strict=True)):
                shards += [(ShardKey(o.buffer, gid, region), data)
                           for gid, region, data in prepared.output_shards(k, o, out, True)]
        except Exception as e:
            del shards[mine:]
            self.store.set_many(shards)     # (in order: what came before, then the error)
            shards.clear()
            return self._failed(ex, ex.exec_id, _as_is, e, None)
        return None

    def _store_output(self, prepared: "_Prepared", k: int, o: m.ExecOutput, buffer: int, out: Any) -> None:
        """Store output ``k`` of a computation (``out``, as ``buffer``), shard by
        shard, split (a fused run's: see ``_Prepared.output_shards``)."""
        store_set = self.store.set
        for gid, region, data in prepared.output_shards(k, o, out):
            store_set(ShardKey(buffer, gid, region), data)

    def _short(self, ex: "m.Execute | FusedRun") -> bool:
        """Whether ``ex`` ran for less than SHORT_S last time."""
        if type(ex) is FusedRun:
            return False
        prepared = self._prepared(ex)
        return prepared is not None and prepared.last_s < SHORT_S

    def _prepared(self, ex: m.Execute) -> "_Prepared | None":
        """The variant already prepared for ``ex``, if any: found by comparing
        the message's lists as they are (building the hashable key costs more
        than the few comparisons of a program's variants). The last one found
        is remembered with its message: ``_report`` asks for the next
        computation's, which ``_run`` then asks for again."""
        last = self._last_prepared
        if last[0] is ex:
            return last[1]
        for prepared in self._by_program.get(ex.program, ()):
            if prepared.matches(ex):
                self._last_prepared = (ex, prepared)
                return prepared
        return None

    def _run(self, ex: "m.Execute | FusedRun", devs: frozenset[int], index: int,
             chain: dict[int, tuple] | None = None) -> tuple:
        """Run one computation (or a fused run's, in order: later ones still run
        after one fails, and fail if they read its outputs); returns the next one
        this thread runs, if any; the report of this one (exec id, first error,
        start, end, seconds it took, how many computations wait on its devices
        once the next ones started, its ``hold``), or _SETTLING; and what the
        next one may read as it is (``chain``: buffer id -> (array, sharding)).

        A plain computation that ran, followed by another plain one that it
        lets start (the head of its devices' queues), is settled (its outputs
        stored, its report given) by the settler thread while that next one
        runs: between the two, this thread only starts the next, and it wakes
        the settler as that one's XLA call starts (``_execute``); or, where
        nothing waits for it and the next one is short, by this thread once
        the next one has run (``_settle_late``: one wake-up fewer). Host work
        there holds up every host of a collective (on this 2-core machine,
        150 us of Python between calls of a collective computation cost about
        300 us per call; the same work beside the call, nothing measurable:
        benchmarks/worker_loop.py --host-us). The next one reads this one's
        outputs as they are when it reads them in the same sharding; before
        it waits for any input that is not there yet (``_wait``), or fails,
        this thread settles what the settler has not yet itself. Reports go
        in order: every report given on this thread first settles those
        pending. A next one that is the same short program reading this
        one's output alone runs on a streak (``_streak``)."""
        start = time.time()
        t0 = time.perf_counter()
        self._waits.s = 0.0
        ran = None
        if type(ex) is FusedRun:
            try:
                error = self._run_fused(ex)
            except Exception as e:      # a bug: the run fails, its devices go on
                error = self._broken(ex, e)
        else:
            try:
                ran = self._execute(ex, _as_is, None, chain)
                error = None
            except Exception as e:
                if chain is not None:     # its inputs from the one before are stored before they fail
                    self._drain_settles()
                try:
                    error = self._failed(ex, ex.exec_id, _as_is, e, None)
                except Exception as e2:  # a bug
                    error = self._broken(ex, e2)
        end = time.time()
        if self._waits.s > 0:            # read (and dropped) by whoever reports it
            self.waited[ex.exec_id] = self._waits.s
        nxt, behind = self._next(devs, index, ran is None)
        done = (ex.exec_id, error, start, end, time.perf_counter() - t0, behind, ex.hold)
        if ran is None:
            self._drain_settles()      # reports go in order (the settler may be at one)
            return nxt, done, None
        prepared, outs = ran
        if nxt is not None and type(nxt[0]) is not FusedRun:
            # the settler is woken as the next one's XLA call starts (_execute)
            self._settles.append((ex, prepared, outs, index, nxt, done))
            if self._streaks(nxt, ex, prepared):
                return self._streak(nxt, ex, prepared, outs[0])
            return nxt, _SETTLING, {o.buffer: (out, prepared.out_shardings[k])
                                    for k, (o, out) in enumerate(zip(ex.outputs, outs, strict=True))}
        return nxt, self._settle_now(ex, prepared, outs, index, done), None

    def _next(self, devs: frozenset[int], index: int, unfinished: bool) -> tuple[tuple | None, int]:
        """The computation on ``devs`` (arrival ``index``) has run: its
        devices are free (with ``unfinished``, it is counted finished here,
        as one that will not be settled), and what may start there starts.
        Returns the one this thread runs next, if any, and how many wait
        behind it on its devices."""
        started: list[tuple[m.Execute, frozenset[int], int]] = []
        with self._lock:
            if unfinished:
                self._free(self._order.finish(index))
            if len(devs) == 1:
                # the usual case, in short: the next one on this device alone
                # starts here, on it (what _try_start would do)
                for d in devs:
                    q = self._queues[d]
                    if q and q[0][1] == devs and not self._stopped:
                        return q.popleft(), len(q)
            self._busy -= devs
            for d in devs:
                q = self._queues[d]
                if q:
                    self._try_start(q[0], started)
            for entry in started[1:]:      # others go to other threads
                self._ready.put(entry)
            behind = min((len(self._queues[d]) for d in devs), default=0)
        return (started[0] if started else None), behind

    def _settle_now(self, ex: m.Execute, prepared: "_Prepared", outs: Any, index: int, done: tuple) -> tuple:
        """Settle ``ex`` on this thread, after those left before it; returns
        its report (``done``, with the error if storing failed)."""
        with self._settle_lock:
            self._drain_locked()
            return self._settle([(ex, prepared, outs, index, None, done)])[0]

    def _streaks(self, entry: tuple, ex: m.Execute, prepared: "_Prepared") -> bool:
        """Whether ``entry``, started after ``ex``, goes on a streak
        (``_streak``): the same short program, on one device here, both held
        (nothing in the controller waits for either report), reading ``ex``'s
        one output alone, as it is."""
        if prepared.streaks is None:
            prepared.streaks = not prepared.donates and len(prepared.in_shardings) == 1 and \
                len(prepared.out_shardings) == 1 and prepared.in_shardings[0] == prepared.out_shardings[0]
        nex = entry[0]
        if not (prepared.streaks and type(nex) is m.Execute and nex.hold and ex.hold and prepared.last_s < SHORT_S
                and len(entry[1]) == 1
                and nex.program == ex.program and len(nex.inputs) == 1 and len(nex.outputs) == 1):
            return False
        inp = nex.inputs[0]
        return inp.buffer == ex.outputs[0].buffer and len(inp.shards) == 1 and not inp.shards[0].pieces \
            and prepared.matches(nex)

    def _streak(self, entry: tuple, ex: m.Execute, prepared: "_Prepared", x: Any) -> tuple:
        """Run ``entry`` and the computations after it while each one goes on
        the streak (``_streaks``): each one's compiled function called on the
        output of the one before, as a fused run's series does, with only its
        queue's bookkeeping between the calls. Their settling is left late
        (``_settle_late``: a wait for their outputs wakes the settler) and done
        here after every STREAK_SETTLE-th computation by gang order. Returns
        what ``_run`` returns for the last one."""
        fn = prepared.fn
        if not self._leave_late([o.buffer for s in list(self._settles) for o in s[0].outputs]):
            self._settle_wake.put(True)
        while True:
            ex, devs, index = entry
            start = time.time()
            t0 = time.perf_counter()
            try:
                outs = fn(x)
                outs[0].block_until_ready()
                error = None
            except Exception as e:
                outs = None
                self._drain_settles()     # (its input, the one before's output, stored before it fails)
                try:
                    error = self._failed(ex, ex.exec_id, _as_is, e, None)
                except Exception as e2:  # a bug
                    error = self._broken(ex, e2)
            took = time.perf_counter() - t0
            end = time.time()
            nxt, behind = self._next(devs, index, outs is None)
            done = (ex.exec_id, error, start, end, took, behind, ex.hold)
            if outs is None:      # (what was left was settled before it failed: reports go in order)
                return nxt, done, None
            prepared.last_s = took
            if nxt is None or type(nxt[0]) is FusedRun or self._stopped:
                return nxt, self._settle_now(ex, prepared, outs, index, done), None
            try:
                self._settles.append((ex, prepared, outs, index, nxt, done))
                if ex.seq % STREAK_SETTLE == 0 or len(self._settles) >= 2 * STREAK_SETTLE:
                    self._drain_settles()
                # something may wait for this one's output already (a SendPiece
                # that came before it ran), and, if a wait cleared the flag, for
                # those left before it: the settler stores them, as this thread
                # may sit in the next one's collective with a host that waits
                # for them
                looked = [ex.outputs[0].buffer] if self._late else \
                    [o.buffer for s in list(self._settles) for o in s[0].outputs]
                if not self._leave_late(looked):
                    self._settle_wake.put(True)
                if not self._streaks(nxt, ex, prepared):
                    return nxt, _SETTLING, {ex.outputs[0].buffer: (outs[0], prepared.out_shardings[0])}
            except Exception:      # a bug: the next one, started, still runs (on this thread, from _ready)
                self._ready.put(nxt)
                raise
            entry, x = nxt, outs[0]

    def _broken(self, ex: "m.Execute | FusedRun", e: Exception) -> m.ErrorInfo:
        """The error of a computation (or fused run) that an exception in the
        executor's own code ended (a bug): logged, and its outputs fail with
        it (those already stored keep their values), so that nothing waits for
        them; ``_run`` then frees its devices and reports it as any failure."""
        log.exception("computation %d (%s): the worker's executor failed", ex.exec_id, ex.name)
        error = m.ErrorInfo(ErrorKind.REMOTE_ERROR, _text(f"the worker's executor failed: {type(e).__name__}: {e}"),
                            self.rank, ex.name, _text(traceback.format_exc()))
        subs = [(sub, ex.buffer) for sub in ex.executes] if type(ex) is FusedRun else [(ex, _as_is)]
        for sub, buffer in subs:
            try:
                self._fail_outputs(sub, buffer, error)
            except Exception:
                log.exception("failing the outputs of computation %d", ex.exec_id)
        return error

    def _run_fused(self, run: FusedRun) -> m.ErrorInfo | None:
        """Run a fused run's computations in order; returns the first error.

        A computation whose inputs were all made earlier in the run, in the
        shardings it reads them in, takes the short way: its compiled function
        is called on those arrays as they are, with what that needs worked out
        once per fused program (``_FusedPlan``); a series of such computations,
        each output read by the next one alone, runs as a JAX loop does
        (``_run_series``). Any other one (it reads the run's inputs, reads a
        value in another sharding, or an input failed) goes through
        ``_execute`` like a plain call."""
        plan = run.plan[0]
        if plan is None:
            plan = run.plan[0] = _FusedPlan(self, run.executes, set(run.release))
        first, error = run.first, None
        made = _Made({run.buffer(c) for c in run.release})
        arrays, unstored = made.arrays, made.unstored
        executes, steps, series = run.executes, plan.steps, plan.series
        i, n = 0, len(executes)
        while i < n:
            one = series.get(i)
            if one is not None and (x := arrays.get(first + one[0])) is not None:
                i, e = self._run_series(run, made, i, one, x[0])
                error = error or e
                continue
            sub, step = executes[i], steps[i]
            i += 1
            if step is not None:
                prepared, ins, outs = step
                try:
                    args = [arrays[first + c][0] for c in ins]
                except KeyError:      # an input failed: _execute fails this one
                    args = None
                if args is not None:
                    try:
                        got = prepared.fn(*args)
                        if len(got) == 1:
                            got[0].block_until_ready()
                        else:
                            self.jax.block_until_ready(got)
                        for k, (c, sharding_k, o, intermediate) in enumerate(outs):
                            b = first + c
                            arrays[b] = (got[k], sharding_k, prepared, k, o)
                            if intermediate:
                                unstored.add(b)
                            else:
                                self._store_output(prepared, k, o, b, got[k])
                    except Exception as e:
                        for c, *_ in outs:       # later ones read the error from the store
                            arrays.pop(first + c, None)
                        e = self._failed(sub, run.exec_id, run.buffer, e, made)
                        error = error or e
                    continue
            e = self._run_one(sub, run.exec_id, run.buffer, made)
            error = error or e
        return error

    def _run_series(self, run: FusedRun, made: "_Made", i: int, series: tuple, x: Any
                    ) -> tuple[int, m.ErrorInfo | None]:
        """Run a series of a fused run's computations (``_FusedPlan.series``)
        from computation ``i`` on ``x``: each one's output is read by the next
        one alone, so it is passed on as it is, not recorded, as a JAX loop
        does. The last one's output is then recorded as the short way records
        one, for the computation after the series. Returns where the run goes
        on, and the error of the one that failed, if any: the ones after it
        then fail as they read its output (``_run_one``)."""
        _, programs, code, sharding_out, o = series
        k = i
        try:
            for prepared in programs:
                x = prepared.fn(x)[0]
                x.block_until_ready()
                k += 1
        except Exception as e:
            return k + 1, self._failed(run.executes[k], run.exec_id, run.buffer, e, made)
        b = run.first + code
        made.arrays[b] = (x, sharding_out, programs[-1], 0, o)
        made.unstored.add(b)
        return k, None

    def _run_one(self, ex: m.Execute, exec_id: int, buffer: Callable[[int], int] = _as_is,
                 made: "_Made | None" = None) -> m.ErrorInfo | None:
        """Run one computation (``buffer``: maps a fused run's codes to buffer
        ids); on failure its outputs, and the input shards it was to assemble,
        fail with the error it returns."""
        try:
            self._execute(ex, buffer, made)
            return None
        except Exception as e:
            return self._failed(ex, exec_id, buffer, e, made)

    def _failed(self, ex: m.Execute, exec_id: int, buffer: Callable[[int], int], e: Exception,
                made: "_Made | None") -> m.ErrorInfo:
        """Settle what computation ``ex`` was to make, or assemble, with the
        error that exception ``e`` stands for, and return that error."""
        peer_failed = False
        if isinstance(e, InputError):
            error = e.error
        else:
            # as UTF-8 can carry it (an exception's text may hold lone surrogates,
            # e.g. a file name; the report must not fail to encode and be lost)
            error = m.ErrorInfo(ErrorKind.REMOTE_ERROR, _text(f"{type(e).__name__}: {e}"), self.rank, ex.name,
                                _text(traceback.format_exc()))
            log.warning("computation %d (%s) failed: %s", exec_id, ex.name, error.message)
            # A collective with another host broke: that host may have died. The
            # controller finds out (it pings them: HostLost names the one that
            # does not answer) and settles a plain computation's outputs here
            # (FailBuffers); a fused run's later computations read its outputs'
            # error from the store, so those fail now.
            peer_failed = bool(_PEER_FAILURE.search(error.message)) \
                and any(d not in self.devices for d in ex.devices)
        if not peer_failed or made is not None or buffer is not _as_is:
            self._fail_outputs(ex, buffer, error)
        self._fail_inputs(ex, buffer, error, made)
        return dataclasses.replace(error, kind=ErrorKind.PEER_FAILED) if peer_failed else error

    def _fail_outputs(self, ex: m.Execute, buffer: Callable[[int], int], error: m.ErrorInfo) -> None:
        for o in ex.outputs:
            self._poison_output(ex, o, buffer(o.buffer), error)

    def _fail_inputs(self, ex: m.Execute, buffer: Callable[[int], int], error: m.ErrorInfo,
                     made: "_Made | None") -> None:
        # input shards it was to assemble: later calls and sends may wait on them
        # (not its fused run's intermediates: the run keeps them, and they have
        # no readers outside it)
        for inp in ex.inputs:
            b = buffer(inp.buffer)
            if made is not None and b in made.intermediates:
                continue
            for s in inp.shards:
                self.store.set(shard_key(b, s.device, s.region), error=error)
                for p in s.pieces:
                    if p.piece_id:
                        # dropped if it came; refused if it comes later (an
                        # error stays), so a late piece is not kept forever
                        self.store.pop(PieceKey(p.piece_id))
                        self.store.set(PieceKey(p.piece_id), error=error)

    def _poison_output(self, ex: m.Execute, o: m.ExecOutput, buffer: int, error: m.ErrorInfo) -> None:
        regs = sharding.regions(o.aval.shape, ex.mesh_shape, ex.axis_names, o.spec)
        for d, r in zip(ex.devices, regs, strict=True):
            if d in self.devices:
                self.store.set(shard_key(buffer, d, r), error=error)

    def _execute(self, ex: m.Execute, buffer: Callable[[int], int] = _as_is,
                 made: "_Made | None" = None, chain: dict[int, tuple] | None = None
                 ) -> "tuple[_Prepared, Any] | None":
        """Run one computation. In a fused run (``made``), an input made earlier
        in the run with the sharding this computation reads it in is passed on
        as the array it is, and the run's intermediates go to the store only if
        something reads them another way (the run frees them afterwards). So is
        an input in ``chain`` (the outputs of the computation just before, not
        stored yet). Outside a fused run (no ``made``) the outputs are not
        stored: returns the prepared program and the outputs, for ``_settle``."""
        prepared = self._prepare(ex)
        if prepared.donates:
            # what the computation before left to the settler is stored first:
            # the buffers this one donates may be its outputs (split out of
            # the arrays this one is then passed)
            self._drain_settles()
            if chain:
                self.store.split(chain)
        args, first_error = [], None
        for k, inp in enumerate(ex.inputs):
            shards = []
            b = buffer(inp.buffer)
            if chain:
                got = chain.get(b)
                if got is not None and (got[1] is prepared.in_shardings[k] or
                                        got[1] == prepared.in_shardings[k]) and \
                        list(got[0].shape) == inp.aval.shape and not any(s.pieces for s in inp.shards):
                    args.append(got[0])
                    continue
            if made is not None:
                got = made.arrays.get(b)
                if got is not None:
                    if got[1] is prepared.in_shardings[k] or got[1] == prepared.in_shardings[k]:
                        args.append(got[0])
                        continue
                    if b in made.unstored:      # read another way: store its shards now
                        made.unstored.discard(b)
                        _, _, source, slot, o = got
                        for gid, region, data in source.output_shards(slot, o, got[0]):
                            self.store.set(ShardKey(b, gid, region), data)
            for s in inp.shards:
                try:
                    shards.append(self._input_shard(b, inp, s))
                except InputError as e:   # keep going: every promised shard gets settled
                    first_error = first_error or e
            if first_error is None:
                args.append(prepared.input_array(k, inp, shards))
        if first_error is not None:
            raise first_error
        t0 = time.perf_counter()
        late = False
        if chain is not None:
            # the one before left its settling: to this thread once this one
            # has run, if this one is short (it was last time) and nothing
            # waits for that (_settle_late); else to the settler, woken now: it
            # works while this thread waits in XLA without the GIL, not while
            # this thread makes the inputs above (it would take the GIL and the
            # core from it); had this one failed, waited for an input or
            # donated one before here, this thread settled that itself (_run,
            # _wait, above)
            late = prepared.last_s < SHORT_S and self._settle_late()
            if not late:
                self._settle_wake.put(True)
        outs = prepared.fn(*args)
        # Run to completion before the next computation: a failure is reported
        # against the computation that caused it, and XLA:CPU collectives never
        # overlap on the same devices (see ARCHITECTURE.md, section 2).
        if len(outs) == 1:
            outs[0].block_until_ready()
        else:
            self.jax.block_until_ready(outs)
        prepared.last_s = time.perf_counter() - t0
        if late:
            self._late = False
            try:
                self._drain_settles()
            except Exception:      # a bug: this one ran all the same
                log.exception("settling the computation before %d", ex.exec_id)
        if made is None:
            return prepared, outs
        for k, (o, out) in enumerate(zip(ex.outputs, outs, strict=True)):
            b = buffer(o.buffer)
            made.arrays[b] = (out, prepared.out_shardings[k], prepared, k, o)
            if b in made.intermediates:
                made.unstored.add(b)
            else:
                self._store_output(prepared, k, o, b, out)

    def _prepare(self, ex: m.Execute) -> "_Prepared":
        """The compiled function and input shardings for this program on these
        devices with these specs, built once."""
        prepared = self._prepared(ex)
        if prepared is not None:
            return prepared
        key = (ex.program, tuple(ex.jax_ids), tuple(ex.mesh_shape), tuple(ex.axis_names),
               tuple(_freeze(i.spec) for i in ex.inputs), tuple(_freeze(o.spec) for o in ex.outputs))
        prepared = self.compiled.get(key)
        if prepared is not None:
            return prepared
        exported = self.programs.get(ex.program)
        if exported is None:
            raise RuntimeError(f"program {ex.program[:12]} was never sent to this host")
        if isinstance(exported, bytes):
            exported = self.programs[ex.program] = self.jax.export.deserialize(bytearray(exported))
        mesh_devices = np.array([self.jax_devices[j] for j in ex.jax_ids], dtype=object)
        mesh = Mesh(mesh_devices.reshape(ex.mesh_shape), tuple(ex.axis_names))
        ins = tuple(NamedSharding(mesh, PartitionSpec(*spec)) for spec in key[4])
        outs = tuple(NamedSharding(mesh, PartitionSpec(*spec)) for spec in key[5])
        call = exported.call
        leaves = self.jax.tree_util.tree_leaves
        # inputs the program donates (the client exports a donating variant only
        # when the value is read by that call alone): XLA reuses their buffers
        donated = donated_inputs(exported)
        fn = self.jax.jit(lambda *a: tuple(leaves(call(*a))), in_shardings=ins, out_shardings=outs,
                          donate_argnums=donated)
        prepared = self.compiled[key] = _Prepared(self, fn, ins, outs, ex)
        prepared.donates = bool(donated)
        self._by_program.setdefault(ex.program, []).append(prepared)
        log.debug("prepared %s for devices %s", ex.name, ex.devices)
        return prepared

    def _input_shard(self, buffer: int, inp: m.ExecInput, s: m.ShardInput) -> Any:
        """The input shard of ``buffer`` for one local device: already stored,
        or assembled from pieces (and then stored, so later calls reuse it)."""
        key = shard_key(buffer, s.device, s.region)
        if not s.pieces and all(a != b for a, b in s.region):    # the common case: stored
            return self._wait(key, buffer)
        region = sharding.from_wire(s.region)
        if 0 in sharding.region_shape(region):    # nothing to wait for or move
            value = to_device(np.empty(sharding.region_shape(region),
                                       np.dtype(self.jax.numpy.dtype(inp.aval.dtype))),
                              self.devices[s.device])
            self.store.set(key, value)
            return value
        if not s.pieces:
            return self._wait(key, buffer)
        dev = self.devices[s.device]
        try:
            if len(s.pieces) == 1 and s.pieces[0].piece_id == 0 and \
                    sharding.from_wire(s.pieces[0].region) == region:
                p = s.pieces[0]        # same region on another local device
                value = to_device(self._wait(shard_key(buffer, p.device, p.region), buffer), dev)
            elif (whole := self._whole_piece(buffer, inp, s, region)) is not None:
                # one piece that is the whole shard, as the channel left it (an
                # XLA-aligned array from channels.recv_buffers for shared
                # memory): XLA:CPU takes it over as the device buffer, no copy
                value = to_device(whole, dev)
            else:
                # assembled in an aligned (pooled) array, which device_put takes over
                out = channels.recv_buffers.get(sharding.region_shape(region), np.dtype(inp.aval.dtype))
                for p in s.pieces:
                    sub = sharding.from_wire(p.sub)
                    if p.piece_id == 0:
                        src = self._wait(shard_key(buffer, p.device, p.region), buffer)
                        data = np.asarray(src)[sharding.local_slices(sub, sharding.from_wire(p.region))]
                    else:
                        data = self._wait(PieceKey(p.piece_id), buffer)
                        self.store.pop(PieceKey(p.piece_id))
                    out[sharding.local_slices(sub, region)] = data
                value = to_device(out, dev)
        except InputError as e:
            self.store.set(key, error=e.error)
            raise
        # (over an error: an earlier reader that was to assemble this copy failed)
        self.store.set(key, value, over_error=True)
        return value

    def _whole_piece(self, buffer: int, inp: m.ExecInput, s: m.ShardInput, region: tuple) -> np.ndarray | None:
        """The array of the shard's only piece when that piece, received from
        another host, is the whole shard with its dtype (else None: assemble)."""
        if len(s.pieces) != 1 or s.pieces[0].piece_id == 0 or \
                sharding.from_wire(s.pieces[0].sub) != region:
            return None
        p = s.pieces[0]
        data = self._wait(PieceKey(p.piece_id), buffer)
        if not isinstance(data, np.ndarray) or data.shape != sharding.region_shape(region) or \
                data.dtype != np.dtype(inp.aval.dtype):
            return None     # left in the store for the assembly below, which copies or fails
        self.store.pop(PieceKey(p.piece_id))
        return data

    def _wait(self, key: ShardKey | PieceKey, buffer: int) -> Any:
        t0 = 0.0
        if not self.store.is_done(key):
            # (it may be an output the settler has yet to store; and reports
            # must not stay held while this waits)
            self._drain_settles()
            self._release_at = None          # held reports go now
            if self.release_held is not None:
                self.release_held()
            t0 = time.monotonic()
        e = self.store.wait(key, self.input_timeout_s)
        if t0:          # the time this computation waited for its inputs (see _run)
            self._waits.s = getattr(self._waits, "s", 0.0) + time.monotonic() - t0
        if not e.done:
            err = m.ErrorInfo(ErrorKind.DEADLINE_EXCEEDED, f"input buffer {buffer} did not arrive within "
                              f"{self.input_timeout_s:.0f}s", self.rank, "", "")
            self.store.set(key, error=err)
        if e.error is not None:
            raise InputError(e.error)
        return e.value


class _FusedPlan:
    """What the runs of one fused program share: per computation, None (it
    goes through ``Executor._execute``) or, when every input is made earlier in
    the run in the sharding it reads it in, (its prepared program, its inputs'
    codes, per output (code, sharding, ExecOutput, whether an intermediate))."""

    __slots__ = ("steps", "series")

    def __init__(self, executor: Executor, executes: list[m.Execute], release: set[int]) -> None:
        made: dict[int, Any] = {}      # code -> the sharding it is made in
        self.steps: list[tuple | None] = []
        for ex in executes:
            try:
                prepared = executor._prepare(ex)
            except Exception:     # it fails when it runs, and says why
                prepared = None
            step = None
            if prepared is not None and all(
                    i.buffer >= 0 and made.get(i.buffer) == prepared.in_shardings[k]
                    for k, i in enumerate(ex.inputs)):
                step = (prepared, [i.buffer for i in ex.inputs],
                        [(o.buffer, prepared.out_shardings[k], o, o.buffer in release)
                         for k, o in enumerate(ex.outputs)])
            self.steps.append(step)
            for k, o in enumerate(ex.outputs):
                made[o.buffer] = prepared.out_shardings[k] if prepared is not None else None
        self.series = self._series(executes)

    def _series(self, executes: list[m.Execute]) -> dict[int, tuple]:
        """The run's series: index of the first computation -> (the code it
        reads, the prepared programs in order, the code of the last one's
        output, that output's sharding and ExecOutput). A series is a longest
        run of short-way computations of one input and one output, each output
        an intermediate that the next computation alone reads, as its only
        input."""
        readers = collections.Counter(i.buffer for ex in executes for i in ex.inputs)
        steps = self.steps

        def feeds_next(j: int) -> bool:
            step = steps[j]
            if step is None or j + 1 >= len(steps) or len(step[1]) != 1 or len(step[2]) != 1:
                return False
            code, _, _, intermediate = step[2][0]
            nxt = executes[j + 1].inputs
            return intermediate and readers[code] == 1 and len(nxt) == 1 and nxt[0].buffer == code
        series: dict[int, tuple] = {}
        j = 0
        while j < len(steps):
            if not feeds_next(j):
                j += 1
                continue
            start, programs = j, []
            while feeds_next(j):
                programs.append(steps[j][0])
                j += 1
            code, sharding_out, o, _ = steps[j - 1][2][0]
            series[start] = (steps[start][1][0], programs, code, sharding_out, o)
        return series


class _Prepared:
    """A program compiled for one device assignment and specs, and what it
    learnt on its first calls to make its input arrays and take its output
    shards apart cheaply (the layouts are the same on every call)."""

    __slots__ = ("executor", "fn", "in_shardings", "out_shardings", "in_fast", "out_fast", "variant", "last_s",
                 "donates", "streaks")

    def __init__(self, executor: Executor, fn: Callable, in_shardings: tuple, out_shardings: tuple,
                 ex: m.Execute) -> None:
        self.executor = executor
        self.fn = fn
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self.last_s = float("inf")     # how long its last run took
        self.donates = False           # whether it donates inputs (see Executor._prepare)
        # what it was built for, as the Execute messages carry it
        self.variant = (list(ex.jax_ids), list(ex.mesh_shape), list(ex.axis_names),
                        [i.spec for i in ex.inputs], [o.spec for o in ex.outputs])
        n_outputs = len(ex.outputs)
        # per input: (shape, dtype, shard shape, device set of each shard in
        # order, global aval) once seen, to build the array without re-checking
        self.in_fast: list[tuple | None] = [None] * len(in_shardings)
        # per output: (shape, [(global device id, region, empty shard's shape or None)]
        # in the order of the array's addressable shards, whether any is empty, the
        # output's sharding: jit gives each call's output the same object)
        self.out_fast: list[tuple | None] = [None] * n_outputs
        # whether a streak of it may run (Executor._streaks; worked out once)
        self.streaks: bool | None = None

    def matches(self, ex: m.Execute) -> bool:
        """Whether ``ex`` runs this program with the same devices and specs."""
        jax_ids, mesh_shape, axis_names, in_specs, out_specs = self.variant
        return ex.jax_ids == jax_ids and ex.mesh_shape == mesh_shape and \
            ex.axis_names == axis_names and [i.spec for i in ex.inputs] == in_specs and \
            [o.spec for o in ex.outputs] == out_specs

    def input_array(self, k: int, inp: m.ExecInput, shards: list) -> Any:
        """The global jax.Array of input ``k`` from this host's shards (in
        the order of ``inp.shards``)."""
        shape = tuple(inp.aval.shape)
        fast = self.in_fast[k]
        if fast is not None and fast[0] == shape and len(shards) == len(fast[3]):
            _, dtype, shard_shape, device_sets, aval = fast
            for a, devs in zip(shards, device_sets, strict=True):
                if a.dtype != dtype or a.shape != shard_shape or a.sharding.device_set != devs:
                    break
            else:   # what make_array_from_single_device_arrays checks holds
                return self.executor.array_impl(aval, self.in_shardings[k], shards, committed=True,
                                                _skip_checks=True)
        jax, array_impl = self.executor.jax, self.executor.array_impl
        arr = jax.make_array_from_single_device_arrays(shape, self.in_shardings[k], shards)
        if array_impl is not None and type(arr) is array_impl and shards:
            # the shards were in the order of the array's (it rearranges them)
            device_sets = tuple(frozenset((sh.device,)) for sh in arr.addressable_shards)
            if device_sets == tuple(a.sharding.device_set for a in shards):
                self.in_fast[k] = (shape, arr.dtype, shards[0].shape, device_sets, arr.aval)
        return arr

    def output_shards(self, k: int, o: m.ExecOutput, out: Any, lazy: bool = False
                      ) -> list[tuple[int, tuple, Any]]:
        """(global device id, region, shard data) of every local shard of output
        ``k``. ValueError if the computation made another shape or dtype than the
        call declared (the declared one is what the controller counts and plans
        with): the computation fails, alone. With ``lazy``, once the layout is
        known, the data are Unsplit (see store.Unsplit): for a plain
        computation's outputs, which only ``Executor._execute``'s chain passes on
        whole (and splits before a donation); a fused run passes its arrays on
        as they are to computations that may donate them, so it splits them now."""
        shape = tuple(o.aval.shape)
        if out.shape != shape or channels.dtype_name(out.dtype) != o.aval.dtype:
            raise ValueError(f"output {k} is {out.dtype.name}{list(out.shape)}, but the call declared "
                             f"{o.aval.dtype}{o.aval.shape}")
        fast = self.out_fast[k]
        if lazy and fast is not None and fast[0] == shape and not fast[2] and out.sharding is fast[3]:
            # the same layout as last time: the shards go to the store unsplit
            return [(gid, region, Unsplit(out, i)) for i, (gid, region, _) in enumerate(fast[1])]
        arrays = getattr(out, "_arrays", None)
        if fast is not None and fast[0] == shape and arrays is not None and len(arrays) == len(fast[1]):
            return [(gid, region, a if empty is None else self._empty(empty, out.dtype, gid))
                    for (gid, region, empty), a in zip(fast[1], arrays, strict=True)]
        gid = self.executor.gid
        plan, result = [], []
        for sh in out.addressable_shards:
            region = sharding.region_from_index(sh.index, shape)
            data, empty = sh.data, None
            if data.size == 0:     # JAX gives empty shards the global shape
                empty = sharding.region_shape(region)
                data = self._empty(empty, out.dtype, gid[sh.device])
            plan.append((gid[sh.device], region, empty))
            result.append((gid[sh.device], region, data))
        if arrays is not None and len(arrays) == len(plan) and \
                all(a is sh.data for a, sh in zip(arrays, out.addressable_shards, strict=True)):
            self.out_fast[k] = (shape, plan, any(e is not None for _, _, e in plan), out.sharding)
        return result

    def _empty(self, shape: tuple, dtype: Any, gid: int) -> Any:
        ex = self.executor
        return to_device(np.empty(shape, dtype), ex.devices[gid])


def to_device(x: Any, device: Any) -> Any:
    """``jax.device_put(x, device)`` for a numpy array ``x`` (or a JAX array,
    below): the same call without JAX's Python path before it. ``jax.device_put`` flattens its
    argument as a tree, checks the target, abstractifies the array and defers
    the transfer to ``pxla.shard_args``, which ends in
    ``xla_client.batched_device_put`` with the array's aval, the device's
    sharding, committed: about 170 µs of Python a call on this project's 2-core
    machine, around a transfer of about 12 (docs/benchmarks.md, opbyop.py).
    This makes that last call itself with the same arguments (the aval as JAX
    makes it, once per shape and dtype), in the scope ``jax.device_put`` sets
    (a transfer guard sees an explicit transfer), so the result is the same: an array
    committed to ``device``, with the buffer semantics JAX uses (XLA:CPU takes
    an aligned array over without a copy: channels.recv_buffers). An array
    whose dtype JAX would change (a 64-bit one with 64-bit types off) or
    replace (float0), that JAX refuses, or a JAX without these internal names,
    takes ``jax.device_put``.

    A JAX array on one device (a shard on another local device) goes the same
    way: ``jax.device_put`` ends in the same call with the array's own aval
    (about 120 µs of Python around a copy of about 20 here), or wraps the
    same buffer when it is already on ``device``."""
    if _batched_device_put is None:
        return jax.device_put(x, device)
    if type(x) is not np.ndarray:
        # (with a SingleDeviceSharding, JAX's aval for it is its own aval)
        if type(x) is not _ArrayImpl or type(x.sharding) is not _SingleDeviceSharding \
                or not x.is_fully_addressable:
            return jax.device_put(x, device)
        with _explicit_device_put():
            if x.devices() == {device}:
                return _ArrayImpl(x.aval, _sharding_of(device), [x], committed=True, _skip_checks=True)
            return _batched_device_put(x.aval, _sharding_of(device), [x], [device], True)
    key = (x.shape, x.dtype, jax.config.jax_enable_x64)
    aval = _AVALS.get(key, _AVALS)
    if aval is _AVALS:           # not seen yet
        try:
            aval = _shaped_abstractify(x)
        except TypeError:        # not an array type JAX takes: it says so
            aval = None
        if aval is not None and (aval.dtype != x.dtype or x.dtype.names is not None):
            aval = None          # (float0 is a structured dtype: JAX puts zeros of bool)
        if len(_AVALS) >= 1024:
            _AVALS.clear()
        _AVALS[key] = aval
    if aval is None:
        return jax.device_put(x, device)
    with _explicit_device_put():     # (as jax.device_put: a transfer guard sees an explicit one)
        return _batched_device_put(aval, _sharding_of(device), [x], [device], True)


def _sharding_of(device: Any) -> Any:
    """``device``'s SingleDeviceSharding, made once."""
    sharding = _SHARDINGS.get(device)
    if sharding is None:
        sharding = _SHARDINGS[device] = _SingleDeviceSharding(device)
    return sharding


def _text(s: str) -> str:
    """``s`` with anything UTF-8 cannot encode (lone surrogates) escaped."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def donated_inputs(exported: Any) -> tuple[int, ...]:
    """The inputs an exported program donates: those its main function marks
    ``jax.buffer_donor`` or ``tf.aliasing_output`` (arguments the module
    dropped as unused are not in its signature: module_kept_var_idx maps)."""
    text = exported.mlir_module()
    at = text.find("func.func public @main(")
    if at < 0:
        return ()
    header = text[at:text.find("\n", at)]
    kept = list(exported.module_kept_var_idx)
    parts = header.split("%arg")[1:]
    if len(parts) != len(kept):      # other arguments (platform index, tokens): leave it be
        return ()
    out = []
    for part in parts:
        number, _, rest = part.partition(":")
        if number.isdigit() and ("jax.buffer_donor" in rest or "tf.aliasing_output" in rest):
            k = int(number)
            if k < len(kept):
                out.append(kept[k])
    return tuple(out)


def _freeze(spec: list) -> tuple:
    return tuple(tuple(e) if isinstance(e, list) else e for e in spec)
