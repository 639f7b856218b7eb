"""A controller whose gang order is deliberately broken, for the tests that
show the order is what keeps collectives from deadlocking. Run as a script, it
is ``zpath controller`` with that scheduler (same arguments)."""
from __future__ import annotations

import logging
import sys

from zpath.controller.scheduler import GangScheduler
from zpath.net import messages as m

log = logging.getLogger(__name__)


class BrokenGangScheduler(GangScheduler):
    """Gives odd-ranked hosts multi-host computations in a different order
    from the others: each one is held back and sent after the next."""

    def __init__(self) -> None:
        super().__init__()
        self._held: dict[int, m.Execute] = {}
        log.warning("gang order deliberately broken (test mode): collectives may deadlock")

    def _place(self, host: int, ex: m.Execute, hosts: int) -> list[tuple[int, m.Execute]]:
        if hosts > 1 and host % 2 == 1:
            held = self._held.pop(host, None)
            if held is None:
                self._held[host] = ex       # sent after the next one
                return []
            return [(host, ex), (host, held)]
        return [(host, ex)]


if __name__ == "__main__":
    from zpath.controller.server import main
    sys.exit(main(sys.argv[1:], gang=BrokenGangScheduler()))
