"""A host's own reports as one ExecDoneBatch (``messages.own_batch``: what a
worker sends the controller for two or more at once, none a failure) must
decide what the same reports as ExecDones one by one decide: every effect, in
order, and the state after (the Rig of test_controller_tenancy, checked with
``validate_state`` after every event)."""
from __future__ import annotations

import pytest

from zpath.net import messages as m
from tests.test_controller_tenancy import make_rig  # noqa: F401  (fixture)
from tests.test_fastcall import _effects, _rigs, _spmd, _state
from tests.test_worker_server import worker  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)


def _post_chain(rig, a: bytes, n: int, prev: int | None = None) -> int:
    """``x = f(x)`` ``n`` times, posted ahead of the hosts (most calls park)."""
    for _ in range(n):
        call, out = _spmd(rig, a, prev)
        rig.handle(a, call)
        if prev is not None:
            rig.handle(a, m.Release([prev]))
        prev = out
    return prev


def _report(rig, batched: bool, host: int, rows: list[tuple[int, float, float]]) -> None:
    ident = rig.c.worker_ident[host]
    reports = [m.ExecDone(x, None, start, end, 0.25 * k) for k, (x, start, end) in enumerate(rows)]
    if batched and len(reports) > 1:
        rig.handle(ident, m.own_batch(host, reports))
    else:
        for r in reports:
            rig.handle(ident, r)


def test_a_hosts_own_batch_decides_what_its_reports_one_by_one_do(make_rig):
    one, batched = _rigs(make_rig)
    taken: list[int] = []          # rows of the batches the own-rows path took
    own_rows = batched.c._own_rows
    batched.c._own_rows = lambda host, msg: (taken.append(len(msg.exec_ids)), own_rows(host, msg))
    for rig, as_batch in ((one, False), (batched, True)):
        a, _ = rig.client("a")
        rig.handle(a, m.Release([_post_chain(rig, a, 2)]))     # learnt (and the cost measured)
        rig.drain()
        last = _post_chain(rig, a, 60)
        step = 0
        while rig.c.in_flight:
            running = sorted(rig.c.in_flight)
            step += 1
            for host in (0, 1):
                rows = [(x, 1000.0 + x, 1000.0 + x + 0.001 * (host + 1)) for x in running[:1 + step % 4]]
                if step % 3 == 0:
                    rows.append(rows[0])                    # a row it sent already: dropped
                if step % 5 == 0:
                    rows.insert(1, (10 ** 6 + step, 1.0, 2.0))   # not in flight: dropped
                if host == 1 and step % 2:
                    rows.reverse()
                _report(rig, as_batch, host, rows)
        rig.handle(a, m.Release([last]))
        assert rig.idle() and not rig.c.directory.buffers
    assert _effects(one) == _effects(batched)
    assert _state(one) == _state(batched)
    assert one.c.timeline_records(10_000) == batched.c.timeline_records(10_000)
    assert one.c.tenants._cost == batched.c.tenants._cost
    assert len(taken) >= 40 and sum(taken) >= 120


def test_own_batch_is_the_rows_of_the_reports():
    reports = [m.ExecDone(7, None, 1.0, 2.0, 0.5), m.ExecDone(9, None, 3.0, 4.0)]
    batch = m.own_batch(3, reports)
    assert batch.relay == -1 and not batch.errors
    assert m.rows_of(batch) == [m.ExecRow(3, 7, None, 1.0, 2.0, 0.5), m.ExecRow(3, 9, None, 3.0, 4.0, 0.0)]
    assert type(batch).from_wire(batch.to_wire()) == batch


def test_a_worker_sends_its_fine_reports_of_one_flush_as_one_own_batch(worker):  # noqa: F811
    sent: list[list] = []
    worker.ep.send_batch = lambda sock, msgs, **kw: sent.append([x[0] for x in msgs]) or []
    fine = [m.ExecDone(5, None, 1.0, 2.0, 0.5), m.ExecDone(6, None, 2.0, 3.0)]
    failed = m.ExecDone(7, m.ErrorInfo("RemoteError", "boom", 0, "f", ""), 3.0, 4.0)
    for reports in (fine, fine[:1], [fine[0], failed], fine + [m.Pong(1, 0, 0, [])]):
        for r in reports:
            worker.outbox.put("ctl", None, r, (), 0)
        worker._flush()
    assert sent[0] == [m.own_batch(0, fine)]                       # two fine ones: by column
    assert sent[1:] == [fine[:1], [fine[0], failed], fine + [m.Pong(1, 0, 0, [])]]   # else as they are
