"""The worker's shard of the object store.

Keys are ``("s", buffer, device, region)`` for shards and ``("p", piece_id)``
for pieces in transit. An entry is created by whoever first names it (a waiter
or the producer) and is *done* once it has a value or an error."""
from __future__ import annotations

import threading
from typing import Any, Callable, Hashable

from zpath.net import messages as m


class Entry:
    __slots__ = ("value", "error", "done", "event", "callbacks")

    def __init__(self) -> None:
        self.value: Any = None
        self.error: m.ErrorInfo | None = None
        self.done = False                          # has a value or an error
        self.event: threading.Event | None = None  # made for the first waiter only
        self.callbacks: list[Callable[["Entry"], None]] = []


class Store:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Hashable, Entry] = {}
        self._by_buffer: dict[int, set[Hashable]] = {}    # buffer -> its shard keys

    def entry(self, key: Hashable) -> Entry:
        with self._lock:
            return self._entry(key)

    def _entry(self, key: Hashable) -> Entry:
        """With the lock held: the entry, made if new."""
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = Entry()
            if key[0] == "s":
                self._by_buffer.setdefault(key[1], set()).add(key)
        return e

    def set(self, key: Hashable, value: Any = None, error: m.ErrorInfo | None = None) -> None:
        with self._lock:
            e = self._entry(key)
            if e.done:
                return
            e.value, e.error, e.done = value, error, True
            event, callbacks = e.event, e.callbacks
            if callbacks:
                e.callbacks = []
        if event is not None:
            event.set()
        for cb in callbacks:
            cb(e)

    def is_done(self, key: Hashable) -> bool:
        """Whether the entry has its value or error (without waiting)."""
        e = self._entries.get(key)      # one dict lookup: atomic, no lock needed
        return e is not None and e.done

    def wait(self, key: Hashable, timeout: float) -> Entry:
        """The entry once it is done, or when ``timeout`` seconds have passed
        (check ``done``)."""
        with self._lock:
            e = self._entry(key)
            if e.done:
                return e
            if e.event is None:
                e.event = threading.Event()
            event = e.event
        event.wait(timeout)
        return e

    def when_done(self, key: Hashable, cb: Callable[[Entry], None]) -> None:
        """Call ``cb(entry)`` once the entry is done (now, if it already is)."""
        with self._lock:
            e = self._entry(key)
            if not e.done:
                e.callbacks.append(cb)
                return
        cb(e)

    def pop(self, key: Hashable) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def free_buffers(self, buffers: list[int]) -> int:
        """Drop every shard of these buffers; returns how many were dropped."""
        n = 0
        with self._lock:
            for b in buffers:
                for k in self._by_buffer.pop(b, ()):
                    if self._entries.pop(k, None) is not None:
                        n += 1
        return n

    def stats(self, devices: list[int] = ()) -> tuple[int, int, list[int]]:
        """(number of shards, bytes held by done shards, those bytes per device
        of ``devices``)."""
        with self._lock:
            shards = [(k[2], e) for k, e in self._entries.items() if k[0] == "s"]
        per = dict.fromkeys(devices, 0)
        for d, e in shards:
            if e.done and d in per:
                per[d] += getattr(e.value, "nbytes", 0)
        nbytes = sum(getattr(e.value, "nbytes", 0) for _, e in shards if e.done)
        return len(shards), nbytes, [per[d] for d in devices]


def shard_key(buffer: int, device: int, region: Any) -> tuple:
    return ("s", buffer, device, tuple(tuple(x) for x in region))
