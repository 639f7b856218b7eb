"""Relays, the controller's side: a message for many hosts goes once per
group of hosts, to the group's relay (docs/design.md, "Scale", "Reports
through relays"; the worker's side: zpath/worker/relay.py).

Groups are fixed per island: its hosts by rank (lost ones keep their place,
so a group changes only when a host registers), ``relay_group`` at a time;
a group's relay is its first live host. ``route`` looks at what one event
sends: each message of a relayable kind (``RELAYABLE``) that goes to at
least ``relay_min_hosts`` workers goes instead as one ``Relay`` per group it
reaches, to the group's relay (the message's own frames are encoded and
signed once by the loop, see ``Inner``). Every other message to a worker
goes directly, and the worker is told where each stands in the other path:
a ``Relay`` says, per host, how many direct messages the controller had
sent it before (``after``), and a direct message that follows messages a
relay forwarded to that host goes after an ``Await`` naming how many.
An execution sent through relays keeps its hosts' relays (``InFlight.relay_of``):
a report batch (``ExecDoneBatch``) is taken from a host only for itself and
for the hosts it relays that execution to, and only for hosts still running it."""
from __future__ import annotations

import logging
from typing import Any

from zpath.controller.records import Send
from zpath.net import messages as m

log = logging.getLogger(__name__)

# what may go through relays: messages many hosts get alike
RELAYABLE = (m.Execute, m.RunFused, m.Free, m.DropFused)
# what a worker handles whenever it comes (never held for order: see worker/relay.py)
UNORDERED = (m.Ping, m.HostDown, m.Shutdown, m.Relay)


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
        self.relayed_messages = 0                             # Relay messages sent (for benchmarks)

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
        for ranks in by_island.values():
            for i in range(0, len(ranks), k):
                group = ranks[i:i + k]
                live = [r for r in group if self.rm.hosts[r].alive and r in self.worker_ident]
                for r in live:
                    relay_of[r] = live[0]
        self._groups = (version, relay_of)
        return relay_of

    def _route(self, out: list) -> list:
        """What one event sends, with relays (see the module's docstring) and
        the order counts kept."""
        peers = self.peers
        worker_rank: dict[bytes, int] = {}
        minimum = self.config.relay_min_hosts
        many: dict[int, int] = {}
        if minimum > 0 and len(out) >= minimum:
            for e in out:
                if type(e) is Send and type(e.msg) in RELAYABLE:
                    many[id(e.msg)] = many.get(id(e.msg), 0) + 1
            many = {k: n for k, n in many.items() if n >= minimum}
        direct_sent = self.direct_sent
        if not many and not self.forwarded_via:          # nothing relayed, nothing to await
            for e in out:
                if type(e) is Send and type(e.msg) is not m.Registered:
                    peer = peers.get(e.ident)
                    if peer is not None and peer.role == "worker":
                        direct_sent[peer.id] = direct_sent.get(peer.id, 0) + 1
            return out
        relay_of = self.relay_of_hosts() if many else {}
        hosts = self.rm.hosts
        routed: list = []
        # id(message) -> relay -> (its slot in routed, hosts, addresses, afters)
        envelopes: dict[int, dict[int, tuple[int, list[int], list[str], list[int]]]] = {}
        inners: dict[int, tuple[Any, Inner]] = {}
        for e in out:
            if type(e) is not Send or type(e.msg) is m.Registered:
                routed.append(e)
                continue
            rank = worker_rank.get(e.ident)
            if rank is None:
                peer = peers.get(e.ident)
                if peer is None or peer.role != "worker":
                    routed.append(e)
                    continue
                rank = worker_rank[e.ident] = peer.id
            key = id(e.msg)
            relay = relay_of.get(rank) if key in many else None
            if relay is not None:
                groups = envelopes.get(key)
                if groups is None:
                    groups = envelopes[key] = {}
                    inners[key] = (e.msg, Inner(e.msg))
                env = groups.get(relay)
                if env is None:        # the Relay goes where the message first goes
                    env = groups[relay] = (len(routed), [], [], [])
                    routed.append(None)
                    direct_sent[relay] = direct_sent.get(relay, 0) + 1
                env[1].append(rank)
                env[2].append(hosts[rank].data_address)
                env[3].append(direct_sent.get(rank, 0))
                via = self.forwarded_via.setdefault(rank, {})
                via[relay] = via.get(relay, 0) + 1
                continue
            if type(e.msg) not in UNORDERED:
                via = self.forwarded_via.get(rank)
                if via:
                    self._await(rank, via, routed, e.ident)
            direct_sent[rank] = direct_sent.get(rank, 0) + 1
            routed.append(e)
        for key, groups in envelopes.items():
            msg, inner = inners[key]
            collect = [msg.exec_id] if type(msg) in (m.Execute, m.RunFused) else []
            if collect and (info := self.in_flight.get(msg.exec_id)) is not None:
                info.relay_of = relay_of
            for relay, (slot, ranks, addresses, after) in groups.items():
                routed[slot] = Send(self.worker_ident[relay], m.Relay(ranks, addresses, after, collect), 0, inner)
                self.relayed_messages += 1
        return routed

    def _await(self, rank: int, via: dict[int, int], routed: list, ident: bytes) -> None:
        """Before a direct message to host ``rank``: an Await for each relay
        that forwarded it messages since its last Await (a lost relay's are
        not awaited: the host goes on once it hears of the loss)."""
        awaited = self.awaited.setdefault(rank, {})
        for relay, n in list(via.items()):
            if not self.rm.hosts[relay].alive:
                del via[relay]
                awaited.pop(relay, None)
                continue
            if awaited.get(relay, 0) < n:
                routed.append(Send(ident, m.Await(relay, n)))
                awaited[relay] = n
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
