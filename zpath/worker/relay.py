"""Relays: a host forwards the controller's messages to its group and sends
the group's reports back as one message (docs/design.md, "Scale", "Reports
through relays"; docs/protocol.md, ``Relay``).

The controller sends a message for many hosts (a computation's ``Execute``,
a ``Free``, a program's ``RegisterProgram``) once per group of hosts, to the
group's relay, as a ``Relay`` whose buffers are the message's own signed
frames (with its own buffers: the program's bytes). The relay forwards those
frames to the group's other hosts over their data ports (``Forwarded``,
signed with the worker key; hosts of one simulated process get one), from
its I/O thread, so forwarding never waits behind its own computations. A
host that got a computation through a relay reports it there
(``ExecDoneBatch`` with its row); the relay sends the controller one
``ExecDoneBatch`` once every host it forwarded that computation to has
reported, or ``RELAY_HOLD_S`` after the first row it holds.

A host now gets the controller's messages on two paths, so each path says
where it stands in the other: a forwarded message carries how many direct
messages the controller had sent that host before it (``after``), and a
direct message that follows forwarded ones comes after an ``Await`` (how
many the relay must have forwarded first). :class:`RelayState` holds either
kind back until its turn; ``Ping``, ``HostDown``, ``Shutdown`` and a
``Relay`` to forward are never held. A relay that is lost (``HostDown``)
releases what waits for it, and its group's hosts send the rows they sent it
in the last ``ROWS_KEPT_S`` seconds to the controller themselves (the
controller takes a host's own rows while it still runs that computation, so
rows the relay did pass on are dropped there). A host to which the
controller could not send a message (its queue full) is lost at once, so
neither it nor its group waits for that message (``ControllerCore.unreachable``);
something held longer than ``ORDER_WAIT_S`` still goes anyway, with a log
line, as a last resort.

Pure state: the I/O thread (``server.Worker``, ``simulate.SimHost``) hands
each event and ``now`` in and carries out what comes back."""
from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

from zpath.config import HOLD_SHORT_S
from zpath.net import messages as m
from zpath.net.codec import Record

log = logging.getLogger(__name__)

# a relay holds rows at most this long for the rest of its group's rows
RELAY_HOLD_S = HOLD_SHORT_S
# a host keeps the rows it sent its relay this long (the relay may die before
# passing them on: then the host sends them itself), at most ROWS_KEPT per relay
ROWS_KEPT_S = 30.0
ROWS_KEPT = 65_536
# a message waits at most this long for its turn (see the module's docstring)
ORDER_WAIT_S = 30.0
# the I/O thread's wait when no relay deadline is near (seconds)
IDLE = 0.5

Item = tuple[Record, list]


class RowBlock(NamedTuple):
    """The rows of one computation from several hosts that ran it over the
    same times (a group of simulated hosts, ``simulate.SimGroup``): one
    record, not a row each (``batch_of`` spreads it into the columns)."""
    exec_id: int
    hosts: list[int]
    start: float
    end: float


def batch_of(rows: list[m.ExecRow | RowBlock], relay: int = -1) -> m.ExecDoneBatch:
    """The ``ExecDoneBatch`` of these rows and blocks (``m.batch_of`` where
    every one is a row)."""
    if all(type(r) is m.ExecRow for r in rows):
        return m.batch_of(rows, relay)     # type: ignore[arg-type]
    exec_ids: list[int] = []
    hosts: list[int] = []
    starts: list[float] = []
    ends: list[float] = []
    waited: list[float] = []
    errors = []
    for r in rows:
        if type(r) is RowBlock:
            n = len(r.hosts)
            exec_ids += [r.exec_id] * n
            hosts += r.hosts
            starts += [r.start] * n
            ends += [r.end] * n
            waited += [0.0] * n          # (a block's hosts did not wait: they ran from their start)
        else:
            if r.error is not None:
                errors.append(m.RowError(len(hosts), r.error))
            exec_ids.append(r.exec_id)
            hosts.append(r.host)
            starts.append(r.start)
            ends.append(r.end)
            waited.append(r.waited)
    return m.ExecDoneBatch(exec_ids, hosts, starts, ends, waited, errors, relay)


class RelayState:
    """One host's side of relays: the order of its control messages, where
    its reports go, and (as a relay) the rows it collects."""

    def __init__(self) -> None:
        # ---- order ----
        self.received = 0          # direct messages received (the controller counts them too)
        # direct messages held behind an Await: (their number, message, buffers)
        self.held: collections.deque[tuple[int, Record, list]] = collections.deque()
        self.blocked: tuple[int, int, float] | None = None    # (relay, count, since) of the Await holding them
        # forwarded messages waiting for their direct predecessors: (after, relay, message, buffers, since)
        self.waiting: collections.deque[tuple[int, int, Record, list, float]] = collections.deque()
        self.forwarded_from: dict[int, int] = {}   # relay -> forwarded messages handed out
        self.lost_relays: set[int] = set()
        # ---- reports (as a group host) ----
        self.report_to: dict[int, tuple[int, str]] = {}     # exec id -> (relay, its data address)
        self.sent_rows: dict[int, collections.deque[tuple[float, m.ExecRow]]] = {}
        # ---- collecting (as a relay) ----
        self.collecting: dict[int, set[int]] = {}     # exec id -> hosts yet to report
        self.rows: list[m.ExecRow | RowBlock] = []    # rows to pass on (batch_of)
        self.rows_since = 0.0                         # when the oldest of them came
        self.complete = False                         # a computation's rows are all in

    # ---- the order of control messages ------------------------------------------
    def direct(self, msg: Record, buffers: list, now: float) -> list[Item]:
        """A message on the control socket: what to handle now, in order."""
        if type(msg) is m.Registered:        # (the controller does not count it)
            return [(msg, buffers)]
        self.received += 1
        if type(msg) is not m.Await and (type(msg) in m.UNORDERED or not (self.held or self.blocked)):
            # (forwarded messages that waited for this one go next)
            return [(msg, buffers), *self._pump(now)] if self.waiting else [(msg, buffers)]
        if self.held or self.blocked is not None:
            self.held.append((self.received, msg, buffers))
            return []
        if not self._awaited(msg.relay, msg.count):
            self.blocked = (msg.relay, msg.count, now)
        return self._pump(now) if self.waiting else []

    def forwarded(self, relay: int, address: str, after: int, collect: list[int], msg: Record,
                  buffers: list, now: float) -> list[Item]:
        """A message a relay forwarded (after the ``after``-th direct one):
        what to handle now, in order. Its computations report to the relay."""
        if relay not in self.lost_relays:
            for exec_id in collect:
                self.report_to[exec_id] = (relay, address)
        if self.take_in_turn(relay, after):
            return [(msg, buffers)]
        self.waiting.append((after, relay, msg, buffers, now))
        return self._pump(now)

    def take_in_turn(self, relay: int, after: int) -> bool:
        """Whether a message relay ``relay`` forwarded (after the ``after``-th
        direct one) is in its turn now, nothing held before it (the usual
        case, every message through the relay); if so it is counted as
        handed out, and the caller handles it at once."""
        if self.waiting or self.blocked is not None or after > self.received:
            return False
        self.forwarded_from[relay] = self.forwarded_from.get(relay, 0) + 1
        return True

    def relay_lost(self, rank: int, now: float) -> list[Item]:
        """Host ``rank`` was lost (HostDown): what waited for it goes now.
        (Its rows: :meth:`rows_for_lost`.)"""
        self.lost_relays.add(rank)
        for exec_id in [e for e, (r, _) in self.report_to.items() if r == rank]:
            del self.report_to[exec_id]
        return self._pump(now)

    def expire(self, now: float) -> list[Item]:
        """What waited past ORDER_WAIT_S goes now (with a log line)."""
        if self.blocked is not None and now - self.blocked[2] > ORDER_WAIT_S:
            log.warning("waited %.0fs for the messages relay %d forwards: going on without them",
                        now - self.blocked[2], self.blocked[0])
            self.blocked = None
        if self.waiting and now - self.waiting[0][4] > ORDER_WAIT_S:
            after, relay, msg, buffers, _ = self.waiting[0]
            log.warning("a %s forwarded by relay %d waited %.0fs for the controller's message %d: "
                        "handled now", type(msg).__name__, relay, now - self.waiting[0][4], after)
            self.waiting[0] = (0, relay, msg, buffers, now)
        return self._pump(now)

    def _prefix(self) -> int:
        """How many direct messages were handled in order (or held by nothing)."""
        return self.held[0][0] - 1 if self.held else self.received

    def _awaited(self, relay: int, count: int) -> bool:
        return relay in self.lost_relays or self.forwarded_from.get(relay, 0) >= count

    def _pump(self, now: float) -> list[Item]:
        out: list[Item] = []
        progress = True
        while progress:
            progress = False
            while self.waiting and self.waiting[0][0] <= self._prefix():
                _, relay, msg, buffers, _ = self.waiting.popleft()
                self.forwarded_from[relay] = self.forwarded_from.get(relay, 0) + 1
                out.append((msg, buffers))
                progress = True
            if self.blocked is not None and self._awaited(*self.blocked[:2]):
                self.blocked = None
            while self.blocked is None and self.held:
                _, msg, buffers = self.held.popleft()
                progress = True
                if type(msg) is m.Await:
                    if not self._awaited(msg.relay, msg.count):
                        self.blocked = (msg.relay, msg.count, now)
                else:
                    out.append((msg, buffers))
        return out

    def next_due_in(self, now: float) -> float | None:
        """Seconds until :meth:`expire` or :meth:`take_rows` has something to do."""
        due = []
        if self.blocked is not None:
            due.append(self.blocked[2] + ORDER_WAIT_S)
        if self.waiting:
            due.append(self.waiting[0][4] + ORDER_WAIT_S)
        if self.rows:
            due.append(now if self.complete else self.rows_since + RELAY_HOLD_S)
        return max(0.0, min(due) - now) if due else None

    # ---- reports (a group host) ------------------------------------------------------
    def route(self, exec_id: int) -> tuple[int, str] | None:
        """Where this host's report of ``exec_id`` goes: (relay, address), or
        None for the controller."""
        return self.report_to.pop(exec_id, None)

    def sent_row(self, relay: int, row: m.ExecRow, now: float) -> None:
        """A row went to ``relay``: kept for a while in case it is lost."""
        kept = self.sent_rows.setdefault(relay, collections.deque(maxlen=ROWS_KEPT))
        kept.append((now, row))
        while kept and now - kept[0][0] > ROWS_KEPT_S:
            kept.popleft()

    def rows_for_lost(self, rank: int, now: float) -> list[m.ExecRow]:
        """The rows this host sent relay ``rank``, which was lost: to send
        the controller directly."""
        kept = self.sent_rows.pop(rank, None) or ()
        return [row for t, row in kept if now - t <= ROWS_KEPT_S]

    # ---- collecting (a relay) ----------------------------------------------------------
    def collect(self, exec_ids: list[int], hosts: list[int]) -> None:
        """This relay forwarded computations ``exec_ids`` to ``hosts``."""
        for exec_id in exec_ids:
            self.collecting.setdefault(exec_id, set()).update(hosts)

    def row_in(self, row: m.ExecRow, now: float) -> None:
        """A group host's row (or this relay's own)."""
        self._arrived(row, row.exec_id, (row.host,), now)

    def rows_in(self, block: RowBlock, now: float) -> None:
        """The rows of a block (a group of simulated hosts: only the
        simulator gives them): as ``row_in`` for each."""
        if block.hosts:
            self._arrived(block, block.exec_id, block.hosts, now)

    def _arrived(self, item: m.ExecRow | RowBlock, exec_id: int, hosts: Iterable[int], now: float) -> None:
        if not self.rows:
            self.rows_since = now
        self.rows.append(item)
        left = self.collecting.get(exec_id)
        if left is not None:
            left.difference_update(hosts)
            if not left:
                del self.collecting[exec_id]
                self.complete = True

    def take_rows(self, now: float) -> list[m.ExecRow | RowBlock]:
        """The rows to pass on now (every host reported a computation, or the
        oldest row held waited RELAY_HOLD_S), or none."""
        if not self.rows or not (self.complete or now - self.rows_since >= RELAY_HOLD_S):
            return []
        rows, self.rows, self.complete = self.rows, [], False
        return rows

    def forget_host(self, rank: int) -> None:
        """Host ``rank`` was lost: its rows will not come."""
        for exec_id in [e for e, left in self.collecting.items() if rank in left]:
            left = self.collecting[exec_id]
            left.discard(rank)
            if not left:
                del self.collecting[exec_id]
                self.complete = self.complete or bool(self.rows)

    def validate_state(self) -> None:
        assert self.received >= 0
        assert [h[0] for h in self.held] == sorted(h[0] for h in self.held)
        assert all(h[0] <= self.received for h in self.held)
        assert not self.held or self.blocked is not None, "held for nothing"
        assert not self.waiting or self.waiting[0][0] > self._prefix(), "a forwarded message waits for nothing"
        assert all(left for left in self.collecting.values())
        assert not self.complete or self.rows
        assert all(r not in self.lost_relays for r, _ in self.report_to.values())


def row_of(rank: int, done: m.ExecDone) -> m.ExecRow:
    """This host's row for its report ``done``."""
    return m.ExecRow(rank, done.exec_id, done.error, done.start, done.end, done.waited)


def forwards(relay: m.Relay, own_rank: int, own_address: str) -> tuple[bool, int, list[tuple[str, m.Forwarded]]]:
    """What a relay does with a ``Relay``: whether it runs the message itself
    (and after how many direct messages), and a ``Forwarded`` per data port
    of the other hosts (hosts of one process share one)."""
    mine = False
    after_mine = 0
    by_address: dict[str, tuple[list[int], list[int]]] = {}
    for host, address, after in zip(relay.hosts, relay.addresses, relay.after, strict=True):
        if host == own_rank:
            mine, after_mine = True, after
            continue
        hosts, afters = by_address.setdefault(address, ([], []))
        hosts.append(host)
        afters.append(after)
    return mine, after_mine, [(address, m.Forwarded(own_rank, own_address, hosts, afters, relay.collect))
                              for address, (hosts, afters) in by_address.items()]


def check_relay(msg: Any, buffers: list) -> str:
    """Why a ``Relay`` or ``Forwarded`` is malformed ("" if it is not)."""
    if not 3 <= len(buffers) <= 3 + m.RELAY_BUFFERS:
        return (f"{type(msg).__name__} needs the frames of one message (3, and at most "
                f"{m.RELAY_BUFFERS} of its buffers), got {len(buffers)}")
    n = len(msg.hosts)
    if type(msg) is m.Relay and not n == len(msg.addresses) == len(msg.after):
        return f"Relay: {n} hosts, {len(msg.addresses)} addresses, {len(msg.after)} counts"
    if type(msg) is m.Forwarded and n != len(msg.after):
        return f"Forwarded: {n} hosts, {len(msg.after)} counts"
    return ""
