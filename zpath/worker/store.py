"""The worker's shard of the object store.

Keys are :class:`ShardKey` (buffer, device, region) for shards and
:class:`PieceKey` (piece id) for pieces in transit. An entry is created by
whoever first names it (a waiter or the producer) and is *done* once it has a
value or an error."""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Iterable, NamedTuple

from zpath.ids import client_of
from zpath.net import messages as m

log = logging.getLogger(__name__)


class ShardKey(NamedTuple):
    """One shard of a buffer: the part ``region`` of it on device ``device``."""
    buffer: int
    device: int
    region: tuple[tuple[int, int], ...]


class PieceKey(NamedTuple):
    """A piece of a shard sent by another host, until its reader takes it."""
    piece_id: int


Key = ShardKey | PieceKey


def shard_key(buffer: int, device: int, region: Any) -> ShardKey:
    """The key of a shard, its region given as on the wire (lists)."""
    return ShardKey(buffer, device, tuple(tuple(x) for x in region))


class Unsplit:
    """A shard stored as its computation's output and its index among the
    output's local shards, split out (``array._arrays[index]``: a new jax
    Array, 15-30 us each) only when something reads it. The outputs of a chain
    of computations are passed on whole and freed unread, so most are never
    split."""

    __slots__ = ("array", "index")

    def __init__(self, array: Any, index: int) -> None:
        self.array = array
        self.index = index


def _wake(woken: list[tuple["Entry", threading.Event | None, list]]) -> None:
    """Wake what waits for entries just made done: (entry, its event, its
    callbacks) each, without the store's lock. A callback that raises (a bug
    there) is logged; the other waiters still wake, and what stored the entry
    (an executor, the I/O thread) goes on."""
    for e, event, callbacks in woken:
        if event is not None:
            event.set()
        for cb in callbacks:
            try:
                cb(e)
            except Exception:
                log.exception("a callback of a finished shard failed")


class Entry:
    __slots__ = ("_value", "error", "done", "event", "callbacks")

    def __init__(self) -> None:
        self._value: Any = None
        self.error: m.ErrorInfo | None = None
        self.done = False                          # has a value or an error
        self.event: threading.Event | None = None  # made for the first waiter only
        self.callbacks: list[Callable[["Entry"], None]] = []

    @property
    def value(self) -> Any:
        """The shard's data (an Unsplit one is split now, once: two threads
        that split it at once get the same shard, which jax keeps)."""
        v = self._value
        if type(v) is Unsplit:
            arrays = v.array._arrays
            if arrays is None:      # (jax's answer for a deleted array: Store.split comes first)
                raise RuntimeError(f"the array of this shard was deleted (donated) before it was "
                                   f"split: {v.array.shape} shard {v.index}")
            v = self._value = arrays[v.index]
        return v

    @value.setter
    def value(self, value: Any) -> None:
        self._value = value

    def itemsize(self) -> int | None:
        """Bytes per element of the shard's data, without splitting an Unsplit
        one (None if it has no dtype)."""
        v = self._value
        return getattr(getattr(v.array if type(v) is Unsplit else v, "dtype", None), "itemsize", None)


# How long a freed buffer id is remembered, so that a client's Put that comes in
# after the Free (the two take different connections) is dropped, not kept.
FREED_MEMORY_S = 60.0     # (the race it covers lasts as long as a big Put takes)
FREED_MAX = 65_536


class Store:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Key, Entry] = {}
        self._by_buffer: dict[int, set[ShardKey]] = {}    # buffer -> its shard keys
        self._by_client: dict[int, set[int]] = {}          # client -> its buffers here
        # buffers freed lately, oldest first (buffer ids are never used again)
        self._freed: collections.OrderedDict[int, float] = collections.OrderedDict()
        # buffers that will never come (their client left): their shards fail
        self._failed: dict[int, m.ErrorInfo] = {}
        # called (without the lock) when something starts to wait for an entry
        # that is not done: the executor then stores what it has finished but
        # not stored yet (Executor._settle_late)
        self.on_wait: Callable[[], None] | None = None

    def entry(self, key: Key) -> Entry:
        with self._lock:
            return self._entry(key)

    def _entry(self, key: Key) -> Entry:
        """With the lock held: the entry, made if new."""
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = Entry()
            if type(key) is ShardKey:
                b = key.buffer
                keys = self._by_buffer.get(b)
                if keys is None:
                    keys = self._by_buffer[b] = set()
                    self._by_client.setdefault(client_of(b), set()).add(b)
                keys.add(key)
                if self._failed and b in self._failed:
                    e.error, e.done = self._failed[b], True
        return e

    def split(self, buffers: Iterable[int]) -> None:
        """Split now these buffers' shards that were stored Unsplit: before a
        computation donates the array they are in, which then cannot be split
        (the shards, as arrays, are deleted with it, as if split at once)."""
        with self._lock:
            entries = [self._entries[k] for b in buffers for k in self._by_buffer.get(b, ())]
        for e in entries:
            e.value         # (splits it)

    def fail_buffers(self, buffers: list[int], error: m.ErrorInfo) -> None:
        """These buffers will never come: their shards that are not done fail
        with ``error`` (waiters wake), and so do shards named later, until the
        buffers are freed."""
        failed: list[tuple[Entry, threading.Event | None, list]] = []
        with self._lock:
            for b in buffers:
                if b in self._freed:           # already run and freed here
                    continue
                self._failed[b] = error
                for k in self._by_buffer.get(b, ()):
                    e = self._entries[k]
                    if not e.done:
                        e.error, e.done = error, True
                        failed.append((e, e.event, e.callbacks))
                        e.callbacks = []
        _wake(failed)

    def set(self, key: Key, value: Any = None, error: m.ErrorInfo | None = None,
            unless_freed: int | None = None, over_error: bool = False) -> bool:
        """Give the entry its value or error (once: later ones are ignored,
        except that with ``over_error`` a value replaces an error: a copy
        assembled again after an earlier assembly failed). With
        ``unless_freed`` (a client's shard of that buffer): not if the buffer
        was freed lately (checked under the same lock, so a Free in between
        cannot be missed); returns whether it was stored."""
        with self._lock:
            if unless_freed is not None and unless_freed in self._freed:
                return False
            e = self._entry(key)
            if e.done:
                if over_error and e.error is not None and error is None and \
                        not (type(key) is ShardKey and key.buffer in self._failed):
                    e.value, e.error = value, None
                return True
            e.value, e.error, e.done = value, error, True
            event, callbacks = e.event, e.callbacks
            if callbacks:
                e.callbacks = []
        _wake([(e, event, callbacks)])
        return True

    def set_many(self, items: list[tuple[Key, Any]]) -> None:
        """``set(key, value)`` for each (key, value) of ``items``, under one
        lock: the outputs of several computations settled at once. Waiters
        and callbacks are woken once all are stored, in order."""
        woken = []
        with self._lock:
            for key, value in items:
                e = self._entry(key)
                if e.done:
                    continue
                e.value, e.done = value, True
                if e.event is not None or e.callbacks:
                    woken.append((e, e.event, e.callbacks))
                    e.callbacks = []
        _wake(woken)

    def awaited(self, buffers: Iterable[int]) -> bool:
        """Whether any shard of these buffers is named here and not done (a
        waiter named it: the producer stores it done)."""
        with self._lock:
            by_buffer, entries = self._by_buffer, self._entries
            for b in buffers:       # (loops, not a generator: one per computation on a streak)
                keys = by_buffer.get(b)
                if keys:
                    for k in keys:
                        if not entries[k].done:
                            return True
            return False

    def is_done(self, key: Key) -> bool:
        """Whether the entry has its value or error (without waiting)."""
        e = self._entries.get(key)      # one dict lookup: atomic, no lock needed
        return e is not None and e.done

    def wait(self, key: Key, timeout: float) -> Entry:
        """The entry once it is done, or when ``timeout`` seconds have passed
        (check ``done``)."""
        with self._lock:
            e = self._entry(key)
            if e.done:
                return e
            if e.event is None:
                e.event = threading.Event()
            event = e.event
        if self.on_wait is not None:
            self.on_wait()
        event.wait(timeout)
        return e

    def when_done(self, key: Key, cb: Callable[[Entry], None]) -> None:
        """Call ``cb(entry)`` once the entry is done (now, if it already is)."""
        with self._lock:
            e = self._entry(key)
            waits = not e.done
            if waits:
                e.callbacks.append(cb)
        if not waits:
            _wake([(e, None, [cb])])
        elif self.on_wait is not None:
            self.on_wait()

    def forget(self, key: Key, cb: Callable[[Entry], None]) -> None:
        """``cb`` no longer waits for the entry (a fetch that expired): drop the
        entry too if it is not done and nothing else waits for it, so fetches of
        values that never come (e.g. a failed call's outputs) leave nothing."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.done:
                return
            try:
                e.callbacks.remove(cb)
            except ValueError:
                pass
            if not e.callbacks and e.event is None:
                del self._entries[key]
                keys = self._by_buffer.get(key.buffer) if type(key) is ShardKey else None
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del self._by_buffer[key.buffer]
                        self._unindex(key.buffer)

    def pop(self, key: Key) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def _unindex(self, buffer: int) -> None:
        """With the lock held: ``buffer`` has no shards here any more."""
        client = client_of(buffer)
        mine = self._by_client.get(client)
        if mine is not None:
            mine.discard(buffer)
            if not mine:
                del self._by_client[client]

    def free_buffers(self, buffers: list[int], now: float | None = None, remember: bool = True) -> int:
        """Drop every shard of these buffers; returns how many were dropped.
        The ids are remembered for FREED_MEMORY_S (see ``was_freed``) unless
        ``remember`` is false (their client is gone: its Puts are dropped anyway;
        or a fused run made them: no Put comes for them, Worker._run_fused)."""
        n = 0
        now = time.monotonic() if now is None else now
        with self._lock:
            freed = self._freed
            for b in buffers:
                keys = self._by_buffer.pop(b, None)
                if keys is not None:
                    self._unindex(b)
                    for k in keys:
                        if self._entries.pop(k, None) is not None:
                            n += 1
                self._failed.pop(b, None)
                if remember:
                    freed[b] = now
                    freed.move_to_end(b)
            while freed and (len(freed) > FREED_MAX or next(iter(freed.values())) < now - FREED_MEMORY_S):
                freed.popitem(last=False)
        return n

    def buffers_of(self, client: int) -> list[int]:
        """The buffers of client ``client`` (see zpath.ids) that have shards
        here, or were told they will never come."""
        with self._lock:
            return list(self._by_client.get(client, ())) + \
                [b for b in self._failed if client_of(b) == client and b not in self._by_buffer]

    def was_freed(self, buffer: int) -> bool:
        """Whether this buffer was freed lately: a client's Put for it that comes
        in now (after the Free, over the other connection; e.g. for a call the
        controller rejected) is dropped rather than kept for good."""
        with self._lock:
            return buffer in self._freed

    def stats(self, devices: list[int] = ()) -> tuple[int, int, list[int]]:
        """(number of shards held (done: with a value or an error), bytes they
        hold, those bytes per device of ``devices``)."""
        with self._lock:
            shards = [(k.device, e) for k, e in self._entries.items() if type(k) is ShardKey and e.done]
        per = dict.fromkeys(devices, 0)
        for d, e in shards:
            if d in per:
                per[d] += getattr(e.value, "nbytes", 0)
        nbytes = sum(getattr(e.value, "nbytes", 0) for _, e in shards)
        return len(shards), nbytes, [per[d] for d in devices]
