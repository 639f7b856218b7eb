"""GangScheduler as a pure unit: computations in, ordered Execute messages out."""
from __future__ import annotations

import itertools
import random

import pytest

from zpath.controller.scheduler import GangScheduler
from tests.controller_broken_gang import BrokenGangScheduler
from zpath.net import messages as m

pytestmark = pytest.mark.timeout(30)

_ids = itertools.count(1)


def execs(hosts: list[int]) -> dict[int, m.Execute]:
    eid = next(_ids)
    return {h: m.Execute(eid, 0, "p", "f", [len(hosts)], ["i"], list(hosts), list(hosts), [], [])
            for h in hosts}


def per_host_order(sent: list[tuple[int, m.Execute]]) -> dict[int, list[int]]:
    order: dict[int, list[int]] = {}
    for host, ex in sent:
        order.setdefault(host, []).append(ex.exec_id)
    return order


def test_seq_is_one_total_order_per_island():
    s = GangScheduler()
    a = s.dispatch(0, execs([0, 1]))
    b = s.dispatch(1, execs([2]))
    c = s.dispatch(0, execs([1]))
    d = s.dispatch(0, execs([0, 1]))
    assert [ex.seq for _, ex in a] == [0, 0]
    assert [ex.seq for _, ex in b] == [0]          # another island has its own order
    assert [ex.seq for _, ex in c] == [1]
    assert [ex.seq for _, ex in d] == [2, 2]
    # every part of one computation carries the same seq and exec id
    assert len({(ex.exec_id, ex.seq) for _, ex in d}) == 1


def test_every_host_sees_shared_computations_in_the_same_order():
    """Random interleavings of many clients' computations over random host
    subsets: for any two computations that share two hosts, both hosts get them
    in the same relative order (the property that rules out collective deadlock),
    and each host gets its computations in increasing seq."""
    rng = random.Random(0)
    s = GangScheduler()
    sent = []
    for _ in range(500):
        hosts = sorted(rng.sample(range(4), rng.randint(1, 4)))
        sent += s.dispatch(0, execs(hosts))
    order = per_host_order(sent)
    seqs: dict[int, list[int]] = {}
    for host, ex in sent:
        seqs.setdefault(host, []).append(ex.seq)
    for host in seqs:
        assert seqs[host] == sorted(seqs[host]) and len(set(seqs[host])) == len(seqs[host])
    pos = {h: {e: i for i, e in enumerate(ids)} for h, ids in order.items()}
    for h1, h2 in itertools.combinations(order, 2):
        shared = [e for e in order[h1] if e in pos[h2]]
        assert [pos[h2][e] for e in shared] == sorted(pos[h2][e] for e in shared)


def test_broken_order_gives_hosts_different_orders():
    """The test-only switch really produces an inconsistent order (so the
    integration test that relies on it tests what it says)."""
    s = BrokenGangScheduler()
    sent = []
    for _ in range(4):
        sent += s.dispatch(0, execs([0, 1]))
    order = per_host_order(sent)
    assert order[0] != order[1] and sorted(order[0]) == sorted(order[1])
    # single-host computations are not reordered
    single = s.dispatch(0, execs([1]))
    assert [h for h, _ in single] == [1]


# ---- TenantScheduler ------------------------------------------------------------

from zpath.controller.scheduler import SOLO_GRACE_S, Ready, TenantScheduler  # noqa: E402


def _run_backlogged(sched: TenantScheduler, weights: dict[int, float], cost: dict[int, float],
                    steps: int, devices: tuple[int, ...] = (0,)) -> dict[int, float]:
    """Every client always has work waiting; the device runs what the scheduler
    sends, one at a time in the order sent. Returns device-seconds per client."""
    for c, w in weights.items():
        sched.add_client(c, w)
        for _ in range(3):
            sched.add(Ready(c, 0, devices, ("p", c), c))
    ticket = 0
    at_device: list[tuple[int, int]] = []
    used = {c: 0.0 for c in weights}
    for _ in range(steps):
        while (r := sched.pick(0)) is not None:
            ticket += 1
            sched.sent(ticket, r)
            at_device.append((ticket, r.client))
            sched.add(Ready(r.client, 0, devices, ("p", r.client), r.client))   # keep it backlogged
        t, c = at_device.pop(0)
        sched.host_done(t, cost[c], len(devices))
        sched.finished(t)
        used[c] += cost[c] * len(devices)
    return used


def test_share_gives_device_time_in_proportion_to_weight():
    weights = {1: 1, 2: 2, 3: 4, 4: 8}
    cost = {1: 0.004, 2: 0.001, 3: 0.003, 4: 0.002}    # unequal computation sizes
    used = _run_backlogged(TenantScheduler("share"), weights, cost, steps=4000)
    total = sum(used.values())
    for c, w in weights.items():
        assert used[c] / total == pytest.approx(w / 15, rel=0.05), (c, used)


def test_fifo_takes_computations_in_arrival_order():
    s = TenantScheduler("fifo", window_s=1.0, min_window=1, default_cost_s=1.0)   # one at a time
    s.add_client(1, 1)
    s.add_client(2, 100)
    order = [1, 2, 2, 1, 2]
    for k, c in enumerate(order):
        s.add(Ready(c, 0, (0,), "p", k))
    got = []
    for t in range(len(order)):
        r = s.pick(0)
        got.append(r.item)
        s.sent(t, r)
        assert s.pick(0) is None           # the window holds one computation
        s.finished(t)
    assert got == [0, 1, 2, 3, 4]


def test_each_client_keeps_its_own_order_and_idle_time_earns_no_credit():
    s = TenantScheduler("share", window_s=1.0, min_window=1, default_cost_s=1.0)
    s.add_client(1, 1)
    s.add_client(2, 1)
    # client 1 runs alone for a long time
    for t in range(50):
        s.add(Ready(1, 0, (0,), "p", ("a", t)))
        r = s.pick(0)
        assert r.item == ("a", t)
        s.sent(t, r)
        s.host_done(t, 1.0, 1)
        s.finished(t)
    # then both are backlogged: client 2 must not get 50 turns in a row
    for k in range(10):
        s.add(Ready(1, 0, (0,), "p", ("a", 100 + k)))
        s.add(Ready(2, 0, (0,), "p", ("b", k)))
    got = []
    for t in range(100, 120):
        r = s.pick(0)
        got.append(r.item)
        s.sent(t, r)
        s.host_done(t, 1.0, 1)
        s.finished(t)
    assert [x for x in got if x[0] == "a"] == [("a", 100 + k) for k in range(10)]
    assert [x for x in got if x[0] == "b"] == [("b", k) for k in range(10)]
    first_ten = [x[0] for x in got[:10]]
    assert 4 <= first_ten.count("a") <= 6, got


def _fill_device_0(window_s: float, cost_s: float, queued: int) -> tuple[TenantScheduler, int]:
    """Client 1 queues ``queued`` computations on device 0, and what the window
    takes is sent (ticket k for the k-th); returns the scheduler and how many."""
    s = TenantScheduler("share", window_s=window_s, min_window=2, default_cost_s=cost_s)
    s.add_client(1, 1)
    for k in range(queued):
        s.add(Ready(1, 0, (0,), "p", k))
    sent = 0
    while (r := s.pick(0)) is not None:
        sent += 1
        s.sent(sent, r)
    return s, sent


def test_window_bounds_work_at_the_device_and_disjoint_devices_proceed():
    s, sent = _fill_device_0(0.010, 0.004, 10)
    assert sent == 2                           # 2 x 4 ms fit in 10 ms, a third does not
    s.add_client(2, 1)
    s.add(Ready(2, 0, (1,), "q", "other device"))
    r = s.pick(0)
    assert r is not None and r.item == "other device"
    s.finished(1)                              # room frees on device 0
    assert s.pick(0).item == 2


def test_a_large_computation_is_not_starved_by_small_ones():
    s = TenantScheduler("share", window_s=0.010, min_window=2, default_cost_s=0.001)
    s.add_client(1, 1)
    s.add_client(2, 1)
    s._cost["big"] = 0.050                    # learnt: does not fit the window
    s.add(Ready(2, 0, (0,), "big", "big"))
    for k in range(200):
        s.add(Ready(1, 0, (0,), "small", k))
    sent, t = [], 0
    running = []
    while len(sent) < 60:
        while (r := s.pick(0)) is not None:
            t += 1
            s.sent(t, r)
            running.append(t)
            sent.append(r.item)
        done = running.pop(0)
        s.host_done(done, 0.001, 1)
        s.finished(done)
    assert "big" in sent[:10], sent[:10]


def test_remove_client_returns_its_queued_work_and_stops_charging():
    s = TenantScheduler("share", window_s=0.001, min_window=1)
    s.add_client(1, 1)
    s.add_client(2, 1)
    s.add(Ready(1, 0, (0,), "p", "a0"))
    r = s.pick(0)
    s.sent(1, r)
    for k in range(3):
        s.add(Ready(1, 0, (0,), "p", f"a{k + 1}"))
    s.add(Ready(2, 0, (0,), "p", "b0"))
    assert s.queued(1) == 3 and s.queued() == 4
    dropped = s.remove_client(1)
    assert [d.item for d in dropped] == ["a1", "a2", "a3"]
    assert s.queued() == 1
    s.host_done(1, 0.5, 1)
    assert s.finished(1) == (0, 1)            # a running one still finishes and is accounted
    assert s.used[1] == pytest.approx(0.5)
    assert s.pick(0).item == "b0"


def test_bad_policy_and_weight():
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        TenantScheduler("lottery")
    s = TenantScheduler()
    for w in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive"):
            s.add_client(1, w)


def test_a_newcomer_does_not_get_credit_while_the_other_client_is_between_computations():
    """Client 1 ran alone for a long time and is momentarily not waiting when
    client 2 starts: client 2 must not run alone until it has caught up."""
    s = TenantScheduler("share", window_s=1.0, min_window=1, default_cost_s=1.0)
    s.add_client(1, 1)
    s.add_client(2, 1)
    t = 0
    for _ in range(50):                       # client 1 alone, straight through
        t += 1
        r = Ready(1, 0, (0,), "p", "a")
        assert s.can_send_now(r)
        s.sent(t, r)
        s.host_done(t, 1.0, 1)
        s.finished(t)
    for k in range(10):                       # client 2 starts waiting first
        s.add(Ready(2, 0, (0,), "p", "b"))
    for k in range(10):
        s.add(Ready(1, 0, (0,), "p", "a"))
    got = []
    for _ in range(10):
        r = s.pick(0)
        t += 1
        s.sent(t, r)
        s.host_done(t, 1.0, 1)
        s.finished(t)
        got.append(r.item)
    assert 4 <= got.count("a") <= 6, got


def test_the_first_run_of_a_program_does_not_set_its_estimate():
    """The first run compiled: its time is charged but not used as an estimate."""
    s = TenantScheduler("share", default_cost_s=0.001)
    s.add_client(1, 1)
    r = Ready(1, 0, (0,), "p", None)
    s.sent(1, r)
    s.host_done(1, 5.0, 1)                    # compiling took 5 s
    s.finished(1)
    assert s.used[1] == pytest.approx(5.0)
    for t in (2, 3):
        s.sent(t, r)
        s.host_done(t, 0.01, 1)
        s.finished(t)
    assert 0.009 < s._cost["p"] < 0.011


def test_an_idle_client_catches_up_only_with_its_own_devices():
    """Work on device 0 does not move the starting point of a client that
    waits for device 1."""
    s = TenantScheduler("share", window_s=1.0, min_window=1, default_cost_s=1.0)
    for c in (1, 2):
        s.add_client(c, 1)
    for t in range(10):                       # client 1 alone on device 0
        r = Ready(1, 0, (0,), "p", None)
        s.sent(t, r)
        s.host_done(t, 1.0, 1)
        s.finished(t)
    s.add(Ready(2, 0, (1,), "p", None))
    assert s._vt[(0, 2)] == 0.0
    s.add(Ready(1, 0, (0,), "p", None))
    s.add(Ready(2, 0, (0,), "p", None))       # client 2 now also waits for device 0
    assert s.pick(0).devices == (1,)          # its device-1 head goes first (nothing else wants it)


def test_devices_are_low_once_down_to_half_their_window():
    s, sent = _fill_device_0(0.0105, 0.001, 30)
    assert sent == 10 and not s.low((0,))              # a full window: 10 x 1 ms
    lows = []
    for t in range(1, 7):
        s.finished(t)
        lows.append(s.low((0,)))
    # 9, 8, 7, 6 ms left: not low; 5 ms (below half the window) and less: low
    assert lows == [False, False, False, False, True, True]
    assert s.low((1,))                                  # an idle device is always low
    # the whole half window is then sent in one go
    sent = 0
    while (r := s.pick(0)) is not None:
        s.sent(100 + sent, r)
        sent += 1
    assert sent == 6 and not s.low((0,))


def _send_all(s: TenantScheduler, first: int) -> int:
    """Send what island 0's window takes, tickets from ``first`` on; how many."""
    sent = 0
    while (r := s.pick(0)) is not None:
        s.sent(first + sent, r)
        sent += 1
    return sent


def test_a_client_alone_on_an_island_gets_the_solo_window_until_another_comes():
    now = [100.0]
    s = TenantScheduler("share", window_s=0.0105, min_window=2, default_cost_s=0.004,
                        solo_window_s=0.0405, clock=lambda: now[0])
    s._cost["p"] = 0.004                        # measured: 4 ms each

    def finish(t):
        s.host_done(t, 0.004, 1)
        s.finished(t)

    s.add_client(1, 1)
    s.add_client(2, 1)
    for k in range(30):
        s.add(Ready(1, 0, (0,), "p", k))
    assert _send_all(s, 1) == 10                    # 10 x 4 ms in the solo window of 40 ms
    assert s.window(0) == 0.0405
    for t in range(1, 5):                       # 24 ms left: not low
        finish(t)
    assert not s.low((0,), 0)
    finish(5)                                   # 20 ms: half the solo window
    assert s.low((0,), 0) and not s.low((0,))   # (the short window's half is 5 ms)
    # client 2 comes: the island is shared, so the short window holds for both
    s.add(Ready(2, 0, (0,), "p", "b"))
    assert s.window(0) == 0.0105 and s.window(0, 1) == 0.0105
    assert s.pick(0) is None                    # 20 ms sent: nothing more fits
    for t in range(6, 10):
        finish(t)
    r = s.pick(0)                               # 4 ms left: client 2 goes first
    assert r is not None and r.item == "b"
    s.sent(100, r)
    assert s.pick(0) is None                    # 8 ms sent: no room for another 4 ms
    # client 2's computation ends and it sends nothing for a while (it waits for
    # its result, say): it still uses the island for SOLO_GRACE_S
    finish(100)
    finish(10)
    now[0] += SOLO_GRACE_S / 2
    assert s.window(0) == 0.0105
    assert _send_all(s, 200) == 2                   # the short window: 2 x 4 ms
    for t in (200, 201):
        finish(t)
    # once client 2 has had no work there for SOLO_GRACE_S, client 1 is alone again
    now[0] += SOLO_GRACE_S
    assert s.window(0) == 0.0405
    assert _send_all(s, 300) == 10 and s.queued() == 8
    # a client that leaves stops counting at once
    s.add(Ready(2, 0, (1,), "p", "c"))
    assert s.window(0) == 0.0105
    s.remove_client(2)
    assert s.window(0) == 0.0405
    # computations never measured get only the short window
    s.add(Ready(1, 0, (2,), "new", "n1"))
    s.add(Ready(1, 0, (2,), "new", "n2"))
    s.add(Ready(1, 0, (2,), "new", "n3"))
    for t in range(300, 310):
        finish(t)
    sent = []
    while (r := s.pick(0)) is not None:
        s.sent(400 + len(sent), r)
        sent.append(r.item)
    assert [x for x in sent if str(x).startswith("n")] == ["n1", "n2"]   # 2 x 1 ms default: min 2
    # a solo window no larger than the short one changes nothing
    assert TenantScheduler(window_s=0.02, solo_window_s=0.001).window(0) == 0.02


def test_the_only_client_connected_gets_the_alone_window_until_another_connects():
    """A client alone on an island that is also the only one connected gets
    ``alone_window_s``: a second client's connecting (before it has any work
    there) takes the island back to the solo window, its leaving gives the
    alone window back, and a second client's work there the short window."""
    s = TenantScheduler("share", window_s=0.0105, min_window=2, default_cost_s=0.004,
                        solo_window_s=0.0405, alone_window_s=0.2005, clock=lambda: 100.0)
    s._cost["p"] = 0.004                        # measured: 4 ms each

    s.add_client(1, 1)
    for k in range(80):
        s.add(Ready(1, 0, (0,), "p", k))
    assert s.window(0) == s.window(0, 1) == 0.2005
    assert _send_all(s, 1) == 50                    # 50 x 4 ms in the alone window of 200 ms
    assert not s.low((0,), 0)
    for t in range(1, 26):                      # 100 ms left: half the alone window
        s.host_done(t, 0.004, 1)
        s.finished(t)
    assert s.low((0,), 0)
    s.add_client(2, 1)                          # connects, nothing on the island yet
    assert s.window(0) == s.window(0, 1) == 0.0405
    assert not s.low((0,), 0)                   # 100 ms queued: above half the solo window
    assert s.pick(0) is None                    # and no room in it
    s.remove_client(2)
    assert s.window(0) == 0.2005 and _send_all(s, 100) == 25
    assert s.window(1) == s.window(1, 2) == 0.2005    # an island nobody used yet: alone too
    s.add_client(2, 1)
    assert s.window(1) == s.window(1, 2) == 0.0405    # (not remembered: looked at)
    s.remove_client(2)
    s.add_client(3, 1)
    s.add(Ready(3, 0, (0,), "p", "c"))          # another client's work: the short window
    assert s.window(0) == s.window(0, 1) == 0.0105
    # a client that carries others' work (the IFRT proxy) is never alone
    p = TenantScheduler("share", window_s=0.0105, solo_window_s=0.0405, alone_window_s=0.2005)
    p.add_client(7, 1, shared=True)
    p.add(Ready(7, 0, (0,), "p", 0))
    assert p.window(0) == p.window(0, 7) == p.window(1) == 0.0405
    p.remove_client(7)
    p.add_client(8, 1)
    assert p.window(1) == 0.2005
    # the solo window off, the alone one still applies
    off = TenantScheduler(window_s=0.02, solo_window_s=0.02, alone_window_s=0.5)
    off.add_client(1)
    assert off.window(0) == 0.5
    off.add_client(2)
    assert off.window(0) == 0.02
    # an alone window no larger than the solo one is the solo one
    assert TenantScheduler(window_s=0.02, solo_window_s=0.1, alone_window_s=0.05).alone_window_s == 0.1


def test_the_remembered_solo_client_of_an_island_never_goes_stale():
    """``window`` remembers an island's one client (``_sole``) and answers for
    it without looking at the island's work: after every event of a random
    mix of clients, times and islands it gives what the island's clients
    then say (the solo window while at most one client, the asked one
    included, has work sent or queued there or was seen there less than
    SOLO_GRACE_S ago)."""
    rng = random.Random(26)
    now = [100.0]
    s = TenantScheduler("share", window_s=0.01, min_window=2, default_cost_s=0.001,
                        solo_window_s=0.04, clock=lambda: now[0])
    for c in (1, 2, 3):
        s.add_client(c, 1)
    tickets = itertools.count(1)
    running: list[int] = []
    hits = 0

    def expected(island: int, client: int | None) -> float:
        users = {*s._active.get(island, ()), *s._queues.get(island, ())}
        users |= {c for c, t in s._seen.get(island, {}).items() if now[0] - t < SOLO_GRACE_S}
        if client is not None:
            users.add(client)
        return s.solo_window_s if len(users) <= 1 else s.window_s

    for _ in range(3000):
        op = rng.random()
        island = rng.randrange(2)
        if op < 0.35:
            # mostly client 1, as one client alone is the case remembered
            s.add(Ready(rng.choice((1, 1, 1, 2, 3)), island, (island,), "p", None))
        elif op < 0.65:
            r = s.pick(island)
            if r is not None:
                t = next(tickets)
                s.sent(t, r)
                running.append(t)
        elif op < 0.85 and running:
            t = running.pop(rng.randrange(len(running)))
            s.host_done(t, 0.001, 1)
            s.finished(t)
        elif op < 0.97:
            now[0] += rng.choice((0.001, 0.1, SOLO_GRACE_S / 2, SOLO_GRACE_S))
        else:
            c = rng.choice((2, 3))
            s.remove_client(c)
            s.add_client(c, 1)
        for isl in (0, 1):
            for client in (None, 1, 2, 3):
                hits += isl in s._sole and client in (None, s._sole[isl])
                assert s.window(isl, client) == expected(isl, client), (isl, client)
    assert hits > 200           # (the remembered answer was used, and checked)


def test_the_tenant_schedulers_per_device_steps_agree_one_by_one_and_as_arrays(monkeypatch):
    """A computation on a few devices updates the per-device load one element
    at a time, a larger one with numpy arrays: the same events give the same
    decisions and the same state either way (a device named twice counts once)."""
    from zpath.controller import scheduler

    def replay(small: int) -> list:
        monkeypatch.setattr(scheduler, "SMALL_DEVICES", small)
        rng = random.Random(7)
        now = [0.0]
        t = scheduler.TenantScheduler("share", window_s=0.004, solo_window_s=0.02, clock=lambda: now[0])
        for c in (1, 2):
            t.add_client(c, weight=c)
        sets = [(0, 1), (1,), (3, 3, 2), tuple(range(40)), (70, 5)]
        running, seen, tickets = [], [], itertools.count()
        for step in range(400):
            now[0] += 0.0005
            if running and rng.random() < 0.45:
                ticket, devices = running.pop(rng.randrange(len(running)))
                t.host_done(ticket, rng.choice([0.0, 0.001, 0.003]), len(devices))
                seen.append(("done", t.finished(ticket), t.low(devices, 0)))
                continue
            devices = rng.choice(sets)
            ready = scheduler.Ready(rng.choice((1, 2)), 0, devices, (step % 3, devices), step)
            ok = t.can_send_now(ready)
            if ok or rng.random() < 0.3:
                ticket = next(tickets)
                t.sent(ticket, ready)
                running.append((ticket, devices))
            seen.append(("send", ok, t.low(devices, 0), [t.load(d) for d in range(72)]))
        return seen + [sorted(t._vt.items()), [float(x) for x in t._island_clock(0)[:72]]]

    assert replay(16) == replay(0)


@pytest.mark.parametrize("policy", ["fifo", "share"])
def test_a_lone_clients_queue_goes_in_its_order_as_room_frees(policy: str) -> None:
    """One client waits on an island (the usual op-by-op case): its head goes
    while it fits, nothing while it does not (the queue is kept), and the
    island has nothing waiting once it is empty."""
    s = TenantScheduler(policy, window_s=1.0, min_window=1, default_cost_s=1.0)   # one at a time
    s.add_client(1, 1)
    for k in range(3):
        s.add(Ready(1, 0, (0, 1), "p", k))
    got = []
    for t in range(3):
        r = s.pick(0)
        assert r is not None
        got.append(r.item)
        s.sent(t, r)
        assert s.pick(0) is None and s.queued(1) == 2 - t    # no room: nothing taken
        s.finished(t)
    assert got == [0, 1, 2]
    assert s.islands() == [] and s.queued_items() == []
