"""Gang scheduler: one total order per island.

Every computation that touches an island gets the next place (``seq``) in that
island's order, whichever client submitted it, and every host it touches gets
its ``Execute`` in that order. Workers run computations that share a device in
the order they arrive, so all hosts of an island run shared-device computations
in one consistent order and SPMD collectives cannot wait on each other in a
cycle. A plain class: events in, actions out."""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable

import numpy as np

from zpath.config import POLICIES
from zpath.net import codec
from zpath.net import messages as m

class GangScheduler:
    def __init__(self) -> None:
        self.next_seq: dict[int, int] = {}

    def dispatch(self, island: int, executes: dict[int, m.Execute], hold: bool = False
                 ) -> list[tuple[int, m.Execute]]:
        """Give one computation (its per-host parts) its place in the island's
        order; return the (host, Execute) messages to send, in order, with
        their ``hold`` set to ``hold``."""
        seq = self.take_seq(island)
        hosts = sorted(executes)
        first = executes[hosts[0]]
        if all(ex is first for ex in executes.values()):     # one message for all (the usual SPMD case)
            return self.place_shared(hosts, codec.replace(first, seq=seq, hold=hold))
        out = []
        placed: dict[int, m.Execute] = {}     # one message per distinct part (a shared one goes once)
        for host in hosts:
            ex = executes[host]
            mine = placed.get(id(ex))
            if mine is None:
                mine = placed[id(ex)] = codec.replace(ex, seq=seq, hold=hold)
            out += self._place(host, mine, len(executes))
        return out

    def take_seq(self, island: int) -> int:
        """The next place in the island's order, taken (see ``place_shared``)."""
        seq = self.next_seq.get(island, 0)
        self.next_seq[island] = seq + 1
        return seq

    def place_shared(self, hosts: list[int], ex: m.Execute) -> list[tuple[int, m.Execute]]:
        """``dispatch`` for a computation whose hosts (sorted) all get one
        message, made with its place from ``take_seq`` (also the fast path of
        a repeated call, fastcall.py)."""
        if type(self)._place is GangScheduler._place:
            return [(host, ex) for host in hosts]
        return [sent for host in hosts for sent in self._place(host, ex, len(hosts))]

    def _place(self, host: int, ex: m.Execute, hosts: int) -> list[tuple[int, m.Execute]]:
        """What to send ``host`` now for its part ``ex`` of a computation on
        ``hosts`` hosts (a test subclass breaks the order here)."""
        return [(host, ex)]


# ---- multi-tenancy ----------------------------------------------------------

# a client counts as using an island for this long after it last had work there
SOLO_GRACE_S = 1.0
# computations on at most this many devices update the per-device arrays one
# element at a time (numpy's whole-array steps cost more on a few elements)
SMALL_DEVICES = 16
# longer device lists whose index arrays are remembered by identity
RECENT_LISTS = 256


@dataclasses.dataclass(slots=True)
class Ready:
    """A computation ready to go to the workers, waiting for its turn."""
    client: int
    island: int
    devices: tuple[int, ...]
    cost_key: Any                    # computations with one key cost about the same
    item: Any                        # what the controller dispatches
    arrival: int = 0


@dataclasses.dataclass(slots=True)
class _Running:
    client: int
    island: int
    devices: tuple[int, ...]
    cost_key: Any
    estimate: float                  # device-seconds charged when it was sent
    wall: float                      # seconds per device estimated when it was sent
    charged: float = 0.0             # device-seconds measured so far (hosts that finished)
    longest: float = 0.0             # longest host's seconds
    few: list[int] | None = None     # its distinct devices, if at most SMALL_DEVICES (_few_devices)


class TenantScheduler:
    """Which client's ready computation goes to an island's workers next.

    Workers run what they were sent in order, so a client that sends a long
    queue of work would hold the devices for as long as that queue lasts. This
    scheduler keeps only a short window of work per device at the workers
    (``window_s`` seconds of estimated run time, always at least ``min_window``
    computations, so the next one is already there when one ends) and queues the
    rest per client. While one client alone uses an island, its devices'
    window is ``solo_window_s`` instead (nobody else waits), so long
    computations go out in groups too; ``alone_window_s`` while that client
    is also the only one connected (added and not removed) and does not
    carry others' work (``shared``: the IFRT proxy's sessions): nobody else
    could be waiting, and one who comes must connect first, which takes the
    island back to ``solo_window_s`` before its first computation. A client
    uses an island while it has computations sent there and not finished,
    or queued there, and for ``SOLO_GRACE_S`` after (so a client that waits
    for each result before its next call still shares the island). A client that arrives at an island
    another uses alone waits behind the other's work already sent (about
    ``solo_window_s`` of it, or ``min_window`` computations if longer); from
    then on the island has the short window. Computations whose run
    time has not been measured yet get only the short window either way (their
    estimate is a guess).
    When room frees it picks the next computation by policy:

    * ``fifo``: the computation that became ready first.
    * ``share``: proportional share. Each client has a virtual time, its
      device-seconds used divided by its weight; the client with the smallest
      goes next (start-time fair queueing). A client that was idle starts no
      earlier than the virtual times at which computations already sent to its
      devices started, so idling earns no credit.

    Device time is measured by the workers (start and end of every computation
    on every host, times the devices it used there) and accounted per client;
    until a computation is measured it is charged an estimate (the running mean
    of computations with the same cost key, leaving out the first, which
    compiled). Each client keeps its own order.
    A plain class: events in, decisions out."""

    def __init__(self, policy: str = "share", window_s: float = 0.02, min_window: int = 2,
                 default_cost_s: float = 1e-3, solo_window_s: float | None = None,
                 alone_window_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r} (choose from {', '.join(POLICIES)})")
        self.policy = policy
        self.window_s = window_s
        self.solo_window_s = window_s if solo_window_s is None else max(window_s, solo_window_s)
        self.alone_window_s = self.solo_window_s if alone_window_s is None else \
            max(self.solo_window_s, alone_window_s)
        self.clock = clock
        # island -> client -> its computations sent there and not finished
        self._active: dict[int, collections.Counter[int]] = {}
        # island -> client -> when it last had work there (clients that use it)
        self._seen: dict[int, dict[int, float]] = {}
        self.min_window = min_window
        self.default_cost_s = default_cost_s
        self.weights: dict[int, float] = {}
        self.used: collections.Counter[int] = collections.Counter()       # device-seconds per client
        self._vt: dict[tuple[int, int], float] = {}                        # (island, client) -> virtual time
        # island -> per device, the largest virtual time a computation sent to it started at
        self._clock: dict[int, np.ndarray] = {}
        self._measured: set[Any] = set()           # cost keys measured once (that run compiled)
        self._queues: dict[int, dict[int, collections.deque[Ready]]] = {}  # island -> client -> ready
        self._cost: dict[Any, float] = {}                                  # cost key -> seconds per device
        self._running: dict[int, _Running] = {}                            # ticket -> running
        # per device (indexed by id): estimated seconds sent and not finished, and
        # how many computations (arrays: a computation over thousands of devices
        # updates them in one step)
        self._load = np.zeros(64)
        self._count = np.zeros(64, dtype=np.int64)
        self._index: dict[tuple[int, ...], np.ndarray] = {}               # device tuple -> its index array
        # the device lists seen last, by identity (a 2,048-device tuple costs ~50 us
        # to make and look up, four times per computation): id -> (list, index array)
        self._recent: dict[int, tuple[Any, np.ndarray]] = {}
        # device tuple of at most SMALL_DEVICES -> its distinct devices (indexed one by one)
        self._few: dict[tuple[int, ...], list[int]] = {}
        self._arrivals = 0
        # island -> the one client that uses it, while it is the only one in its
        # computations sent, queued and seen there (``window``'s answer for it
        # without a look at them): forgotten when another client comes
        # (``_joins``, the only way one comes: add, sent, finished)
        self._sole: dict[int, int] = {}
        self._shared: set[int] = set()           # clients that carry others' work (add_client)
        # the window of an island one client alone uses: alone_window_s while
        # it is the only client connected and not a shared one (_connected)
        self._one_user_window = self.solo_window_s

    # ---- clients ---------------------------------------------------------------
    def add_client(self, client: int, weight: float = 1.0, shared: bool = False) -> None:
        """A client connected (``shared``: it carries others' work, so it is
        never alone)."""
        if not (0 < weight < float("inf")):
            raise ValueError(f"a client's weight must be a positive number, not {weight!r}")
        self.weights[client] = float(weight)
        if shared:
            self._shared.add(client)
        self._connected()

    def _connected(self) -> None:
        """The clients connected changed: the window of an island one of them
        alone uses."""
        alone = len(self.weights) == 1 and not self._shared
        self._one_user_window = self.alone_window_s if alone else self.solo_window_s

    def remove_client(self, client: int) -> list[Ready]:
        """The client left: drop and return its queued computations (its running
        ones finish and are still accounted)."""
        self.weights.pop(client, None)
        self._shared.discard(client)
        self._connected()
        dropped = []
        for island, queues in self._queues.items():
            dropped += queues.pop(client, ())
            self._vt.pop((island, client), None)
        for seen in self._seen.values():
            seen.pop(client, None)
        # (a client that leaves makes no island shared: ``_sole`` stays right)
        return dropped

    # ---- queueing --------------------------------------------------------------
    def islands(self) -> list[int]:
        """Islands with computations waiting."""
        return list(self._queues)

    def queued(self, client: int | None = None) -> int:
        return sum(len(q) for qs in self._queues.values() for c, q in qs.items()
                   if client is None or c == client)

    def queued_items(self) -> list[Ready]:
        """Every computation queued (not sent yet), on every island."""
        return [r for qs in self._queues.values() for q in qs.values() for r in q]

    def can_send_now(self, ready: Ready) -> bool:
        """Nothing waits on its island and there is room on its devices: it may
        skip the queue (the common case of one client)."""
        return not self._queues.get(ready.island) and self._fits(ready)

    def add(self, ready: Ready) -> None:
        """Queue a ready computation behind the client's earlier ones."""
        if ready.client not in self.weights:
            raise KeyError(f"unknown client {ready.client} (not added, or removed)")
        queues = self._queues.setdefault(ready.island, {})
        ready.arrival = self._arrivals
        self._arrivals += 1
        self._joins(ready.island, ready.client)
        q = queues.get(ready.client)
        if q is None:
            q = queues[ready.client] = collections.deque()
            # a client that starts waiting gets no credit for having been idle:
            # it starts no earlier than the computations already sent to its devices
            key = (ready.island, ready.client)
            floor = float(self._island_clock(ready.island)[self._idx(ready.devices)].max()) \
                if ready.devices else 0.0
            self._vt[key] = max(self._vt.get(key, 0.0), floor)
        q.append(ready)

    def pick(self, island: int) -> Ready | None:
        """Take the next computation to send on an island, or None if nothing
        waits or nothing fits the window. The caller sends it and calls ``sent``."""
        queues = self._queues.get(island)
        if not queues:
            return None
        if self.policy == "fifo":
            order = sorted(queues, key=lambda c: queues[c][0].arrival)
        else:
            order = sorted(queues, key=lambda c: (self._vt.get((island, c), 0.0), queues[c][0].arrival))
        # the first in policy order that fits; one that does not fit keeps its
        # devices from later ones (so small computations cannot starve it)
        blocked: set[int] = set()
        chosen = None
        for client in order:
            head = queues[client][0]
            if blocked.isdisjoint(head.devices) and self._fits(head):
                chosen = client
                break
            blocked.update(head.devices)
        if chosen is None:
            return None
        q = queues[chosen]
        ready = q.popleft()
        if not q:
            del queues[chosen]
            if not queues:
                del self._queues[island]
        return ready

    def low(self, devices: Any, island: int | None = None) -> bool:
        """Whether any of these devices (of ``island``) is down to half its
        window (or below the minimum count). The controller tops devices up only
        then, so what waits goes in groups (one message per host) rather than one
        computation per finished one, while devices keep half a window of work."""
        half = (self.window_s if island is None else self.window(island)) / 2
        few = self._few_devices(devices)
        if few is not None:
            count, load, least = self._count, self._load, self.min_window
            for d in few:             # (any(...) without a generator: once per computation)
                if count.item(d) < least or load.item(d) <= half:
                    return True
            return False
        idx = self._idx(devices)
        return bool(((self._count[idx] < self.min_window) | (self._load[idx] <= half)).any())

    def _joins(self, island: int, client: int) -> None:
        """``client`` has work on ``island`` now (it is seen there): where
        another client was its only one, the island's ``_sole`` goes."""
        seen = self._seen.get(island)
        if seen is None:
            seen = self._seen[island] = {}
        seen[client] = self.clock()
        sole = self._sole.get(island)
        if sole is not None and sole != client:
            del self._sole[island]

    def window(self, island: int, client: int | None = None) -> float:
        """The window on ``island``'s devices: ``solo_window_s`` while at most
        one client (``client``, when given) uses the island (``alone_window_s``
        while it is also the only client connected and not a shared one), else
        ``window_s``."""
        if self.alone_window_s == self.window_s:
            return self.window_s
        sole = self._sole.get(island)
        if sole is not None and (client is None or client == sole):
            return self._one_user_window      # (the usual case, one client: no look at its work)
        solo = self._window_of(island, client)
        if not solo:
            return self.window_s
        users = {*self._active.get(island, ()), *self._queues.get(island, ()), *self._seen.get(island, ())}
        if len(users) == 1:
            self._sole[island] = users.pop()
        return self._one_user_window

    def _window_of(self, island: int, client: int | None) -> bool:
        """``window`` looking at the island's clients: whether it is the solo
        one."""
        only = client              # the one client seen to use it so far (None: none)
        for using in (self._active.get(island), self._queues.get(island)):
            if using:
                for c in using:
                    if only is None:
                        only = c
                    elif c != only:
                        return False
        seen = self._seen.get(island)
        if seen:
            if len(seen) == 1 and (only is None or only in seen):
                # (one client: it is the only one whether or not it is stale,
                # so no clock to read; a stale one goes at a later look)
                return True
            now = self.clock()
            for c, t in list(seen.items()):
                if now - t >= SOLO_GRACE_S:
                    del seen[c]
                elif only is None:
                    only = c
                elif c != only:
                    return False               # (the stale ones left go at a later look)
        return True

    def _fits(self, ready: Ready) -> bool:
        est = self._cost.get(ready.cost_key)
        if est is None:           # not measured yet: the short window
            est, window = self.default_cost_s, self.window_s
        else:
            window = self.window(ready.island, ready.client)
        few = self._few_devices(ready.devices)
        if few is not None:
            count, load, least = self._count, self._load, self.min_window
            for d in few:             # (all(...) without a generator: once or twice per computation)
                if count.item(d) >= least and load.item(d) + est > window:
                    return False
            return True
        idx = self._idx(ready.devices)
        return bool(((self._count[idx] < self.min_window) | (self._load[idx] + est <= window)).all())

    def _idx(self, devices: Any) -> np.ndarray:
        """The index array of a device list (remembered: programs reuse theirs)."""
        hit = self._recent.get(id(devices))
        if hit is not None and hit[0] is devices:
            return hit[1]
        key = devices if type(devices) is tuple else tuple(devices)
        idx = self._index.get(key)
        if idx is None:
            idx = np.fromiter(key, dtype=np.int64, count=len(key))
            if len(idx) and idx.max() >= len(self._load):
                grow = max(2 * len(self._load), int(idx.max()) + 1)
                self._load = np.concatenate([self._load, np.zeros(grow - len(self._load))])
                self._count = np.concatenate([self._count, np.zeros(grow - len(self._count), dtype=np.int64)])
                for island, clk in self._clock.items():
                    self._clock[island] = np.concatenate([clk, np.zeros(grow - len(clk))])
            if len(self._index) >= 4096:
                self._index.clear()
            self._index[key] = idx
        if len(devices) > SMALL_DEVICES:
            if len(self._recent) >= RECENT_LISTS:
                self._recent.clear()
            self._recent[id(devices)] = (devices, idx)
        return idx

    def _few_devices(self, devices: Any) -> list[int] | None:
        """The distinct devices of a device list of at most SMALL_DEVICES
        (None for a longer one), the arrays grown to hold them."""
        if len(devices) > SMALL_DEVICES:
            return None
        key = devices if type(devices) is tuple else tuple(devices)
        few = self._few.get(key)
        if few is None:
            self._idx(key)
            if len(self._few) >= 4096:
                self._few.clear()
            few = self._few[key] = list(dict.fromkeys(key))
        return few

    def _island_clock(self, island: int) -> np.ndarray:
        clk = self._clock.get(island)
        if clk is None:
            clk = self._clock[island] = np.zeros(len(self._load))
        return clk

    def load(self, device: int) -> tuple[int, float]:
        """(computations sent to ``device`` and not finished, their estimated seconds)."""
        if device >= len(self._load):
            return 0, 0.0
        return int(self._count[device]), float(self._load[device])

    # ---- accounting ------------------------------------------------------------
    def sent(self, ticket: int, ready: Ready) -> None:
        """A computation went to the workers: charge its estimate."""
        wall = self._cost.get(ready.cost_key, self.default_cost_s)
        estimate = wall * len(ready.devices)
        few = self._few_devices(ready.devices)
        self._running[ticket] = _Running(ready.client, ready.island, ready.devices, ready.cost_key,
                                         estimate, wall, 0.0, 0.0, few)
        active = self._active.get(ready.island)
        if active is None:
            active = self._active[ready.island] = collections.Counter()
        active[ready.client] += 1
        island, client = ready.island, ready.client
        self._joins(island, client)
        key = (island, client)
        vt = self._vt.get(key, 0.0)
        clk = self._clock.get(island)
        if clk is None:
            clk = self._island_clock(island)
        if few is not None:
            load, count = self._load, self._count
            for d in few:
                load[d] = load.item(d) + wall
                count[d] = count.item(d) + 1
                if clk.item(d) < vt:
                    clk[d] = vt
        else:
            idx = self._idx(ready.devices)
            self._load[idx] += wall
            self._count[idx] += 1
            clk[idx] = np.maximum(clk[idx], vt)
        weight = self.weights.get(client)
        if weight is not None:               # (the client's virtual time, read above)
            self._vt[key] = vt + estimate / weight

    def host_done(self, ticket: int, seconds: float, devices: int) -> None:
        """One host finished its part: ``seconds`` of run time on ``devices``
        devices."""
        run = self._running.get(ticket)
        if run is None:
            return
        seconds = max(0.0, seconds)
        run.charged += seconds * devices
        run.longest = max(run.longest, seconds)

    def hosts_done(self, ticket: int, device_seconds: float, longest: float) -> None:
        """Several hosts finished their parts (a relay's batch): what
        ``host_done`` adds up for each, summed by the caller (``device_seconds``:
        each one's run time times its devices; ``longest``: the longest run)."""
        run = self._running.get(ticket)
        if run is None:
            return
        run.charged += device_seconds
        run.longest = max(run.longest, longest)

    def finished(self, ticket: int) -> tuple[int, int] | None:
        """Every host finished (or the computation was abandoned): replace the
        estimate by what was measured and free its room. Returns its (island,
        client), or None for an unknown ticket."""
        run = self._running.pop(ticket, None)
        if run is None:
            return None
        few = run.few
        if few is not None:
            load, count = self._load, self._count
            for d in few:
                n = count.item(d) - 1
                if n <= 0:      # none in flight: no estimate left behind either
                    count[d] = 0
                    load[d] = 0.0
                else:
                    count[d] = n
                    load[d] = load.item(d) - run.wall
        else:
            idx = self._idx(run.devices)
            self._load[idx] -= run.wall
            self._count[idx] -= 1
            idle = idx[self._count[idx] <= 0]
            if len(idle):           # none in flight: no estimate left behind either
                self._count[idle] = 0
                self._load[idle] = 0.0
        island, client = run.island, run.client
        weight = self.weights.get(client)
        if weight is not None:                # (not a client that left)
            self._joins(island, client)
        active = self._active[island]
        n = active[client] - 1
        if n <= 0:
            active.pop(client, None)
            if not active:
                del self._active[island]
        else:
            active[client] = n
        self.used[client] += run.charged
        if weight is not None:                # (the client's virtual time)
            key = (island, client)
            self._vt[key] = self._vt.get(key, 0.0) + (run.charged - run.estimate) / weight
        if run.longest > 0:
            if run.cost_key not in self._measured:
                # the first run of a program on its devices compiled it: not an estimate
                self._measured.add(run.cost_key)
            else:
                old = self._cost.get(run.cost_key)
                self._cost[run.cost_key] = run.longest if old is None else 0.8 * old + 0.2 * run.longest
        return run.island, run.client

    def running(self, client: int) -> int:
        return sum(1 for r in self._running.values() if r.client == client)
