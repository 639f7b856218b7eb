"""GangScheduler as a pure unit: computations in, ordered Execute messages out."""
from __future__ import annotations

import itertools
import random

import pytest

from zpath.controller.scheduler import GangScheduler
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
    s = GangScheduler(break_order=True)
    sent = []
    for _ in range(4):
        sent += s.dispatch(0, execs([0, 1]))
    order = per_host_order(sent)
    assert order[0] != order[1] and sorted(order[0]) == sorted(order[1])
    # single-host computations are not reordered
    single = s.dispatch(0, execs([1]))
    assert [h for h, _ in single] == [1]
