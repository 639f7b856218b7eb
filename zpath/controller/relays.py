"""Relays, the controller's side: a message for many hosts goes once per
group of hosts, to the group's relay (docs/design.md, "Scale", "Reports
through relays"; the worker's side: zpath/worker/relay.py).

Groups are fixed per island: its hosts by rank (lost ones keep their place,
so a group changes only when a host registers), ``relay_group`` at a time;
a group's relay is its first live host. Each message of a relayable kind
(``RELAYABLE``) that ``to_hosts`` sends to at least ``relay_min_hosts``
workers goes instead as one ``Relay`` per group it reaches, to the group's
relay (the message's own frames are encoded and signed once by the loop, see
``Inner``). Every other message to a worker goes directly, and the worker is told where each stands in the other path:
a ``Relay`` says, per host, how many direct messages the controller had
sent it before (``after``), and a direct message that follows messages a
relay forwarded to that host goes after an ``Await`` naming how many.
An execution sent through relays keeps its hosts' relays (``InFlight.relay_of``):
a report batch (``ExecDoneBatch``) is taken from a host only for itself and
for the hosts it relays that execution to, and only for hosts still running it."""
from __future__ import annotations

from typing import Any

from zpath.controller.records import Send
from zpath.net import messages as m

# what may go through relays: messages many hosts get alike
RELAYABLE = (m.Execute, m.RunFused, m.Free, m.DropFused)


class Inner:
    """The message a ``Relay`` carries: the loop encodes and signs it (with the
    worker key) once for all the relays it goes to, and sends its frames as
    the ``Relay``'s buffers."""
    __slots__ = ("msg",)

    def __init__(self, msg: Any) -> None:
        self.msg = msg


class Relays:
    """Mixin of ControllerCore: groups, relayed sends, the order counts."""

    def _init_relays(self) -> None:
        self.direct_sent: dict[int, int] = {}                 # host -> direct messages sent (but Registered)
        self.forwarded_via: dict[int, dict[int, int]] = {}    # host -> relay -> messages relayed to it
        self.awaited: dict[int, dict[int, int]] = {}          # host -> relay -> count its last Await named
        self._groups: tuple[int, dict[int, int]] | None = None     # (mapping version, host -> its relay)
        self._address: dict[int, str] = {}                    # host -> its data port
        self.relayed_messages = 0                             # Relay messages sent (for benchmarks)
        self.relay_min = self.config.relay_min_hosts

    def relay_of_hosts(self) -> dict[int, int]:
        """Host -> the relay of its group, for live hosts (a new dict when
        groups or relays change: executions keep the one they were sent with)."""
        version = self.rm.version
        if self._groups is not None and self._groups[0] == version:
            return self._groups[1]
        k = max(1, self.config.relay_group)
        by_island: dict[int, list[int]] = {}
        for rank in sorted(self.rm.hosts):
            by_island.setdefault(self.rm.hosts[rank].island, []).append(rank)
        relay_of: dict[int, int] = {}
        self._address = {r: h.data_address for r, h in self.rm.hosts.items()}
        for ranks in by_island.values():
            for i in range(0, len(ranks), k):
                group = ranks[i:i + k]
                live = [r for r in group if self.rm.hosts[r].alive and r in self.worker_ident]
                for r in live:
                    relay_of[r] = live[0]
        self._groups = (version, relay_of)
        return relay_of

    def _relay(self, messages: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """``to_hosts``'s (host, message) pairs: each message of a relayable
        kind that at least ``relay_min_hosts`` of them get (each host once)
        goes as a ``Relay`` per group; returns the pairs left to send directly."""
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

    def _relay_one(self, msg: Any, ranks: list[int], relay_of: dict[int, int]) -> bool:
        """Send ``msg`` to ``ranks`` through their groups' relays (False: it
        cannot be, a host has no relay; it goes directly)."""
        groups: dict[int, tuple[list[int], list[int]]] = {}
        sent = self.direct_sent
        for h in ranks:
            r = relay_of.get(h)
            if r is None:
                return False
            g = groups.get(r)
            if g is None:
                g = groups[r] = ([], [])
            g[0].append(h)
        via = self.forwarded_via
        address = self._address
        inner = Inner(msg)
        collect = [msg.exec_id] if type(msg) in (m.Execute, m.RunFused) else []
        for r, (hosts, after) in groups.items():
            ident = self.worker_ident[r]
            self._direct(r, ident, msg, relay=True)        # the Relay is a direct message to its relay
            for h in hosts:
                after.append(sent.get(h, 0))
                v = via.get(h)
                if v is None:
                    via[h] = {r: 1}
                else:
                    v[r] = v.get(r, 0) + 1
            self._out.append(Send(ident, m.Relay(hosts, [address[h] for h in hosts], after, collect), 0, inner))
            self.relayed_messages += 1
        if collect and (info := self.in_flight.get(msg.exec_id)) is not None:
            info.relay_of = relay_of
        return True

    def _direct(self, rank: int, ident: bytes, msg: Any, relay: bool = False) -> None:
        """A message goes to host ``rank`` directly (``relay``: a Relay): it is
        counted, after an Await for each relay that forwarded the host messages
        since its last Await (a lost relay's are not awaited: the host goes on
        once it hears of the loss)."""
        if not relay and type(msg) not in m.UNORDERED:
            via = self.forwarded_via.get(rank)
            if via:
                awaited = self.awaited.setdefault(rank, {})
                for r, n in list(via.items()):
                    if not self.rm.hosts[r].alive:
                        del via[r]
                        awaited.pop(r, None)
                    elif awaited.get(r, 0) < n:
                        awaited[r] = n
                        self.direct_sent[rank] = self.direct_sent.get(rank, 0) + 1
                        self._out.append(Send(ident, m.Await(r, n)))
        self.direct_sent[rank] = self.direct_sent.get(rank, 0) + 1

    def _forget_relays_of(self, rank: int) -> None:
        """Host ``rank`` was lost: its counts go (a host registers under a new rank)."""
        self.direct_sent.pop(rank, None)
        self.forwarded_via.pop(rank, None)
        self.awaited.pop(rank, None)

    def validate_relays(self) -> None:
        for rank, via in self.forwarded_via.items():
            for relay, n in via.items():
                assert n > 0, (rank, relay)
                assert self.awaited.get(rank, {}).get(relay, 0) <= n, (rank, relay)
        for rank in self.direct_sent:
            assert rank in self.rm.hosts, f"order counts of unknown host {rank}"
