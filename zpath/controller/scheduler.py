"""Gang scheduler: one total order per island.

Every computation that touches an island gets the next place (``seq``) in that
island's order, whichever client submitted it, and every host it touches gets
its ``Execute`` in that order. Workers run computations that share a device in
the order they arrive, so all hosts of an island run shared-device computations
in one consistent order and SPMD collectives cannot wait on each other in a
cycle. A plain class: events in, actions out."""
from __future__ import annotations

import dataclasses
import logging

from zpath.net import messages as m

log = logging.getLogger(__name__)


class GangScheduler:
    def __init__(self, break_order: bool = False) -> None:
        """``break_order`` is for tests only: it deliberately gives odd-ranked
        hosts multi-host computations in a different order from the others, to show
        that the order is what prevents collectives from deadlocking."""
        self.next_seq: dict[int, int] = {}
        self.break_order = break_order
        self._held: dict[int, m.Execute] = {}
        if break_order:
            log.warning("gang order deliberately broken (test mode): collectives may deadlock")

    def dispatch(self, island: int, executes: dict[int, m.Execute]) -> list[tuple[int, m.Execute]]:
        """Give one computation (its per-host parts) its place in the island's
        order; return the (host, Execute) messages to send, in order."""
        seq = self.next_seq.get(island, 0)
        self.next_seq[island] = seq + 1
        out = []
        for host, ex in sorted(executes.items()):
            ex = dataclasses.replace(ex, seq=seq)
            if self.break_order and len(executes) > 1 and host % 2 == 1:
                held = self._held.pop(host, None)
                if held is None:
                    self._held[host] = ex       # sent after the next one
                    continue
                out += [(host, ex), (host, held)]
                continue
            out.append((host, ex))
        return out
