"""Held reports, decided here alone: a worker may hold a computation's
ExecDone back while work is queued behind it (``Execute.hold`` /
``RunFused.hold``), so that reports go out together. It pays only while one
client alone uses an island (the tenant scheduler's solo window, see
``TenantScheduler.window``). Removing the mechanism: ``may_hold`` returns
False, and the solo window goes."""
from __future__ import annotations

from zpath.config import HOLD_DEEP_S
from zpath.controller.scheduler import TenantScheduler


def may_hold(tenants: TenantScheduler, island: int, client: int, sequential: bool,
             memory_limit: int) -> bool:
    """Whether the worker may hold this computation's report. Not when
    something here may wait for it: a sequential program's next nodes, or
    calls waiting for memory (it frees what the run held); and only while the
    island has the solo (or alone) window, one at least twice as long as the
    hold (else the report makes room for others, or is needed to top up)."""
    if sequential or memory_limit:
        return False
    window = tenants.window(island, client)
    return window > tenants.window_s and window >= 2 * HOLD_DEEP_S
