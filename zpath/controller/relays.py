"""Relays, the controller's side: a message for many hosts goes once per
group of hosts, to the group's relay (docs/design.md, "Scale", "Reports
through relays"; the worker's side: zpath/worker/relay.py).

Groups are fixed per island: its hosts by rank (lost ones keep their place,
so a group changes only when a host registers), ``relay_group`` at a time;
a group's relay is its first live host. Each message of a relayable kind
(``RELAYABLE``) that ``to_hosts`` sends to at least ``relay_min_hosts``
workers goes instead as one ``Relay`` per group it reaches, to the group's
relay (the message's own frames are encoded and signed once by the loop, see
``Inner``); so does another message that many hosts get alike
(``to_hosts_alike``: a new program's ``RegisterProgram`` with its bytes, a fused
program's ``DefineFused``). Every other message to a worker goes directly, and the worker is told where each stands in the other path:
a ``Relay`` says, per host, how many direct messages the controller had
sent it before (``after``), and a direct message that follows messages a
relay forwarded to that host goes after an ``Await`` naming how many.
An execution sent through relays keeps its hosts' relays (``InFlight.relay_of``):
a report batch (``ExecDoneBatch``) is taken from a host only for itself and
for the hosts it relays that execution to, and only for hosts still running it."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zpath.controller.records import Send
from zpath.net import messages as m

# what may go through relays: messages many hosts get alike
RELAYABLE = (m.Execute, m.RunFused, m.Free, m.DropFused)
# host lists whose split into groups is kept (until the groups change)
SPLITS_KEPT = 256


class Inner:
    """The message a ``Relay`` carries, and its own buffers (a program's
    bytes): the loop encodes and signs it (with the worker key) once for all
    the relays it goes to, and sends its frames as the ``Relay``'s buffers."""
    __slots__ = ("msg", "buffers")

    def __init__(self, msg: Any, buffers: Sequence[Any] = ()) -> None:
        self.msg = msg
        self.buffers = buffers


class _Group:
    """One group of a message's hosts as sent last (cached per host list,
    see ``Relays._split``): its relay, hosts, their data ports, and their
    order counts as of ``epoch``."""
    __slots__ = ("relay", "hosts", "addresses", "pos", "whole", "after", "epoch")

    def __init__(self, relay: int, hosts: list[int], addresses: list[str], whole: bool) -> None:
        self.relay = relay
        self.hosts = hosts
        self.addresses = addresses
        self.pos = hosts.index(relay) if relay in hosts else -1     # the relay's own place in it
        self.whole = whole               # the relay's whole group (its counts are one counter)
        self.after: list[int] = []
        self.epoch = -1


class Relays:
    """Mixin of ControllerCore: groups, relayed sends, the order counts.

    The counts cost per group, not per host, while nothing differs within a
    group: what a relay forwarded to its whole group is one counter
    (``_whole``, made per-host counts when the groups change), and a group's
    ``after`` list is kept until any host is sent a direct message (``_epoch``)
    but for its relay's own count, which each ``Relay`` bumps."""

    def _init_relays(self) -> None:
        self.direct_sent: dict[int, int] = {}                 # host -> direct messages sent (but Registered)
        self.forwarded_via: dict[int, dict[int, int]] = {}    # host -> relay -> messages relayed to it alone
        self.awaited: dict[int, dict[int, int]] = {}          # host -> relay -> count its last Await named
        # (mapping version, host -> its relay, relay -> its group's live hosts by rank)
        self._groups: tuple[int, dict[int, int], dict[int, list[int]]] | None = None
        self._whole: dict[int, int] = {}                      # relay -> messages to its whole group (_groups)
        self._splits: dict[tuple[int, int, int], tuple[list[int], list[_Group]]] = {}
        self._epoch = 0                                       # direct messages sent but Relays
        self._address: dict[int, str] = {}                    # host -> its data port
        self.relayed_messages = 0                             # Relay messages sent (for benchmarks)
        # (id(relay_of), host) -> (relay_of, the hosts whose rows that host may send, see relayed_by)
        self._relayed: dict[tuple[int, int], tuple[dict[int, int] | None, frozenset[int]]] = {}
        self.relay_min = self.config.relay_min_hosts

    def relay_of_hosts(self) -> dict[int, int]:
        """Host -> the relay of its group, for live hosts (a new dict when
        groups or relays change: executions keep the one they were sent with)."""
        version = self.rm.version
        if self._groups is not None and self._groups[0] == version:
            return self._groups[1]
        self._settle()
        self._splits.clear()
        by_island: dict[int, list[int]] = {}
        for rank in sorted(self.rm.hosts):
            by_island.setdefault(self.rm.hosts[rank].island, []).append(rank)
        relay_of: dict[int, int] = {}
        members: dict[int, list[int]] = {}
        self._address = {r: h.data_address for r, h in self.rm.hosts.items()}
        for ranks in by_island.values():
            k = self.group_size(len(ranks))
            for i in range(0, len(ranks), k):
                group = ranks[i:i + k]
                live = [r for r in group if self.rm.hosts[r].alive and r in self.worker_ident]
                if live:
                    members[live[0]] = live
                for r in live:
                    relay_of[r] = live[0]
        self._groups = (version, relay_of, members)
        return relay_of

    def relayed_by(self, sender: int, relay_of: dict[int, int] | None) -> frozenset[int]:
        """The hosts whose report rows of an execution sent with ``relay_of``
        (``InFlight.relay_of``: None, not relayed) host ``sender`` may send:
        itself and those it relayed it to. Kept per (map, sender): an
        execution keeps the map it was sent with, which is never changed."""
        hit = self._relayed.get((id(relay_of), sender))
        if hit is not None and hit[0] is relay_of:
            return hit[1]
        hosts = frozenset([sender, *(h for h, r in relay_of.items() if r == sender)] if relay_of else [sender])
        if len(self._relayed) >= SPLITS_KEPT:
            self._relayed.clear()
        self._relayed[(id(relay_of), sender)] = (relay_of, hosts)
        return hosts

    def group_size(self, hosts: int) -> int:
        """Hosts per group on an island of ``hosts`` hosts."""
        return max(1, self.config.relay_group)

    def forwarded(self, host: int, relay: int) -> int:
        """How many messages ``relay`` forwarded to ``host`` (the count an Await names)."""
        n = self.forwarded_via.get(host, {}).get(relay, 0)
        if self._whole and self._groups is not None and self._groups[1].get(host) == relay:
            n += self._whole.get(relay, 0)
        return n

    def _settle(self) -> None:
        """The groups change: what relays forwarded to their whole groups
        becomes per-host counts (of live hosts: a lost one's counts go)."""
        if self._whole and self._groups is not None:
            members, alive, via = self._groups[2], self.worker_ident, self.forwarded_via
            for r, n in self._whole.items():
                for h in members.get(r, ()):
                    if h in alive:
                        v = via.get(h)
                        if v is None:
                            via[h] = {r: n}
                        else:
                            v[r] = v.get(r, 0) + n
        self._whole = {}

    def _relay(self, messages: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """``to_hosts``'s (host, message) pairs: each message of a relayable
        kind that at least ``relay_min_hosts`` of them get (each host once)
        goes as a ``Relay`` per group; returns the pairs left to send directly."""
        first = messages[0][1]
        if type(first) in RELAYABLE and all(msg is first for _, msg in messages):     # (the usual case)
            ranks = [rank for rank, _ in messages]
            if len(set(ranks)) != len(ranks):
                return messages
            return [] if self._relay_one(first, ranks, self.relay_of_hosts()) else messages
        by: dict[int, tuple[Any, list[int]]] = {}
        for rank, msg in messages:
            if type(msg) in RELAYABLE:
                got = by.get(id(msg))
                if got is None:
                    by[id(msg)] = (msg, [rank])
                else:
                    got[1].append(rank)
        big = [(msg, ranks) for msg, ranks in by.values() if len(ranks) >= self.relay_min]
        if not big or len({rank for rank, _ in messages}) != len(messages):
            return messages          # (a host told two things at once: in order, directly)
        relay_of = self.relay_of_hosts()
        relayed: set[int] = set()
        for msg, ranks in big:
            if self._relay_one(msg, ranks, relay_of):
                relayed.add(id(msg))
        return [(rank, msg) for rank, msg in messages if id(msg) not in relayed]

    def to_hosts_alike(self, ranks: list[int], msg: Any, buffers: Sequence[Any] = ()) -> None:
        """Send hosts ``ranks`` (each once) the same message, with its buffers (a
        program's ``RegisterProgram``; a ``DefineFused``): one ``Relay`` per group, carrying it
        encoded and signed once, from ``relay_min_hosts`` hosts on; else (or
        a host has no relay) to each host directly."""
        if not (self.relay_min and len(ranks) >= self.relay_min and len(buffers) <= m.RELAY_BUFFERS
                and len(set(ranks)) == len(ranks) and self._relay_one(msg, ranks, self.relay_of_hosts(), buffers)):
            for rank in ranks:
                self.to_host(rank, msg, buffers=buffers)

    def _split(self, ranks: list[int], relay_of: dict[int, int]) -> list[_Group] | None:
        """``ranks`` by relay (None: a host has none), cached per host list
        until the groups change."""
        key = (len(ranks), ranks[0], ranks[-1])
        hit = self._splits.get(key)
        if hit is not None and hit[0] == ranks:
            return hit[1]
        by: dict[int, list[int]] = {}
        for h in ranks:
            r = relay_of.get(h)
            if r is None:
                return None
            g = by.get(r)
            if g is None:
                by[r] = [h]
            else:
                g.append(h)
        members, address = self._groups[2] if self._groups is not None else {}, self._address
        groups = [_Group(r, hosts, [address[h] for h in hosts], hosts == members.get(r))
                  for r, hosts in by.items()]
        if len(self._splits) >= SPLITS_KEPT:
            self._splits.clear()
        self._splits[key] = (list(ranks), groups)
        return groups

    def _relay_one(self, msg: Any, ranks: list[int], relay_of: dict[int, int],
                   buffers: Sequence[Any] = ()) -> bool:
        """Send ``msg`` (with its ``buffers``) to ``ranks`` through their
        groups' relays (False: it cannot be, a host has no relay; it goes
        directly)."""
        groups = self._split(ranks, relay_of)
        if groups is None:
            return False
        sent, via, whole, idents = self.direct_sent, self.forwarded_via, self._whole, self.worker_ident
        inner = Inner(msg, buffers)
        collect = [msg.exec_id] if type(msg) in (m.Execute, m.RunFused) else []
        for g in groups:
            r = g.relay
            ident = idents[r]
            self._direct(r, ident, msg, relay=True)        # the Relay is a direct message to its relay
            if g.epoch != self._epoch:
                g.after = [sent.get(h, 0) for h in g.hosts]
                g.epoch = self._epoch
            elif g.pos >= 0:
                g.after = list(g.after)
                g.after[g.pos] = sent[r]
            if g.whole:
                whole[r] = whole.get(r, 0) + 1
            else:
                for h in g.hosts:
                    v = via.get(h)
                    if v is None:
                        via[h] = {r: 1}
                    else:
                        v[r] = v.get(r, 0) + 1
            self._out.append(Send(ident, m.Relay(g.hosts, g.addresses, g.after, collect), 0, inner))
            self.relayed_messages += 1
        if collect and (info := self.in_flight.get(msg.exec_id)) is not None:
            info.relay_of = relay_of
        return True

    def _direct_only_counts(self) -> bool:
        """Whether ``_direct`` for a message that is not a Relay now only
        counts it (``direct_sent`` and the epoch): no relay has forwarded
        anything, so no host is owed an Await (the usual case, without
        relays; ``to_hosts`` counts them itself then)."""
        return not self.forwarded_via and not self._whole

    def _direct(self, rank: int, ident: bytes, msg: Any, relay: bool = False) -> None:
        """A message goes to host ``rank`` directly (``relay``: a Relay): it is
        counted, after an Await for each relay that forwarded the host messages
        since its last Await (a lost relay's are not awaited: the host goes on
        once it hears of the loss)."""
        if not relay:
            self._epoch += 1
            if type(msg) not in m.UNORDERED:
                if self._whole and self._groups is not None and self._groups[0] != self.rm.version:
                    self._settle()
                via = self.forwarded_via.get(rank)
                counts = via
                if self._whole and self._groups is not None:
                    r0 = self._groups[1].get(rank)
                    n0 = self._whole.get(r0, 0) if r0 is not None else 0
                    if n0:
                        counts = dict(via) if via else {}
                        counts[r0] = counts.get(r0, 0) + n0
                if counts:
                    awaited = self.awaited.setdefault(rank, {})
                    for r, n in list(counts.items()):
                        if not self.rm.hosts[r].alive:
                            if via is not None:
                                via.pop(r, None)
                            awaited.pop(r, None)
                        elif awaited.get(r, 0) < n:
                            awaited[r] = n
                            self.direct_sent[rank] = self.direct_sent.get(rank, 0) + 1
                            self._out.append(Send(ident, m.Await(r, n)))
        self.direct_sent[rank] = self.direct_sent.get(rank, 0) + 1

    def _forget_relays_of(self, rank: int) -> None:
        """Host ``rank`` was lost: its counts go (a host registers under a new rank)."""
        if self._groups is not None and self._groups[0] != self.rm.version:
            self._settle()
        self.direct_sent.pop(rank, None)
        self.forwarded_via.pop(rank, None)
        self.awaited.pop(rank, None)

    def validate_relays(self) -> None:
        for rank, via in self.forwarded_via.items():
            for relay, n in via.items():
                assert n > 0, (rank, relay)
        for rank, awaited in self.awaited.items():
            for relay, n in awaited.items():
                assert n <= self.forwarded(rank, relay), (rank, relay)
        for rank in self.direct_sent:
            assert rank in self.rm.hosts, f"order counts of unknown host {rank}"
        if self._whole:
            assert self._groups is not None and set(self._whole) <= set(self._groups[2]), "whole counts of no relay"
