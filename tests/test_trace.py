"""Timelines as Chrome Trace Event JSON (zpath/client/trace.py): ``zp.trace`` and
``zpath trace``. The document built from given cluster answers (no processes); then
a program traced on a real 2-island cluster (every computation once, on its device,
with its client; transfers with channel and bytes, flow arrows); ``zpath trace``
against a running cluster; and a trace of a cluster that loses a host still closes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

import zpath as zp
from zpath.client import trace as tr
from zpath.cluster.testing import connected, running_cluster, wait_until
from zpath.net import messages as m

pytestmark = pytest.mark.timeout(120)


def host(rank: int, island: int, devices: list[int], name: str = "") -> m.HostInfo:
    return m.HostInfo(rank, island, name or f"h{rank}", "tcp://127.0.0.1:1",
                      [m.DeviceInfo(d, rank, island, i, d, "cpu") for i, d in enumerate(devices)])


def stats(sent: list[m.SentPiece], received: list[list[float]], now: float = 0.0) -> m.ChannelStats:
    return m.ChannelStats(0, 0, 0, 0, 0, 0, 0, 0, 0, [[p.piece_id, p.at] for p in sent], received, sent, now)


def status(hosts: list[m.HostInfo], lost: list[m.HostInfo] = ()) -> m.Status:
    return m.Status(hosts, [], [m.ClientStatus(7, "me", 1.0, 0.5, 0, 0)], 0, 0, 0, list(lost), 0, 0, [], "share")


def by(doc: dict, **match) -> list[dict]:
    return [e for e in doc["traceEvents"] if all(e.get(k) == v for k, v in match.items())]


def names(doc: dict) -> dict[tuple, str]:
    """(pid,) -> process name, (pid, tid) -> track name."""
    out = {}
    for e in by(doc, ph="M"):
        if e["name"] == "process_name":
            out[(e["pid"],)] = e["args"]["name"]
        elif e["name"] == "thread_name":
            out[(e["pid"], e["tid"])] = e["args"]["name"]
    return out


# ---- the document, from given answers ---------------------------------------------------
def test_build_places_computations_transfers_and_client_slices():
    begin = 1000.0
    hosts = [host(0, 0, [0, 1], "a"), host(1, 1, [2, 3], "b")]
    # host 1's clock is 0.5 s ahead of ours
    views = {0: tr.HostView(offset=0.0, rtt=0.001,
                            stats=stats([m.SentPiece(41, 1000.30, "DCN", 4096, 1)], [])),
             1: tr.HostView(offset=0.5, rtt=0.001, stats=stats([], [[41, 1000.85]]))}
    records = [m.ExecRecord(1, 1, 0, 0, 7, "f", [0, 1], 1000.10, 1000.20, True),
               m.ExecRecord(2, 2, 1, 1, 7, "g", [2, 3], 1000.90, 1001.00, True),   # host 1's clock
               m.ExecRecord(3, 3, 1, 1, 7, "old", [2, 3], 900.0, 900.1, True)]     # before the trace
    slices = [tr.ClientSlice("program", "p", 1000.05, 1000.06, {"dispatch": "parallel"}),
              tr.ClientSlice("fetch", "float32[2]", 1000.06, 1000.55, {"buffer": 9})]
    doc = tr.build(begin=begin, end=1002.0, status=status(hosts), records=records, views=views,
                   client_id=7, slices=slices, address="tcp://x:1")
    doc = json.loads(json.dumps(doc))          # valid JSON, as written
    n = names(doc)
    assert n[(tr.CONTROLLER_PID,)] == "controller tcp://x:1"
    assert n[(tr.worker_pid(0),)] == "host 0 a (island 0)" and n[(tr.worker_pid(1),)] == "host 1 b (island 1)"
    assert n[(tr.worker_pid(1), 3)] == "device 3"
    assert n[(tr.client_pid(7),)] == "client 7 me (tracing)"
    comps = by(doc, cat="computation")
    assert sorted((e["name"], e["pid"], e["tid"]) for e in comps) == [
        ("f", tr.worker_pid(0), 0), ("f", tr.worker_pid(0), 1),
        ("g", tr.worker_pid(1), 2), ("g", tr.worker_pid(1), 3)]
    g = next(e for e in comps if e["name"] == "g")
    assert g["ts"] == pytest.approx(400_000) and g["dur"] == pytest.approx(100_000)    # offset applied
    assert all(e["args"]["client"] == 7 and e["args"]["client_name"] == "me" for e in comps)
    out = by(doc, cat="transfer", ph="X", tid=tr.TRANSFERS_OUT_TID)
    assert len(out) == 1 and out[0]["args"] == {"piece": 41, "channel": "DCN", "bytes": 4096, "to_host": 1}
    assert out[0]["pid"] == tr.worker_pid(0) and out[0]["ts"] == pytest.approx(300_000)
    assert out[0]["dur"] == pytest.approx(50_000)                    # received at 1000.35 our clock
    into = by(doc, cat="transfer", ph="X", tid=tr.TRANSFERS_IN_TID)
    assert len(into) == 1 and into[0]["pid"] == tr.worker_pid(1) and into[0]["args"]["from_host"] == 0
    s, f = by(doc, ph="s"), by(doc, ph="f")
    assert [e["id"] for e in s] == [e["id"] for e in f] == [41]
    assert (s[0]["pid"], f[0]["pid"]) == (tr.worker_pid(0), tr.worker_pid(1)) and f[0]["bp"] == "e"
    client = by(doc, pid=tr.client_pid(7), ph="X")
    assert [e["name"] for e in client] == ["program p", "fetch float32[2]"]
    assert doc["otherData"]["clock_offsets_s"] == {"0": 0.0, "1": 0.5}


def test_build_places_the_controller_s_planning_memory_waits_and_input_waits():
    hosts = [host(0, 0, [0, 1], "a")]
    views = {0: tr.HostView(offset=0.0, rtt=0.001, stats=stats([], []))}
    # the controller's clock is 2 s ahead of ours
    events = [m.ControllerEvent("plan", 7, "step", 1002.10, 1002.15),
              m.ControllerEvent("memory", 7, "step", 1002.20, 1002.50),
              m.ControllerEvent("plan", 7, "old", 900.0, 900.1)]                 # before the trace
    records = [m.ExecRecord(1, 1, 0, 0, 7, "f", [0, 1], 1000.60, 1000.70, True, 0.04),
               m.ExecRecord(2, 2, 0, 0, 7, "g", [0, 1], 1000.70, 1000.80, True)]
    doc = tr.build(begin=1000.0, end=1001.0, status=status(hosts), records=records, views=views,
                   controller_events=events, controller_offset=2.0)
    doc = json.loads(json.dumps(doc))
    n = names(doc)
    assert n[(tr.CONTROLLER_PID, tr.PLAN_TID)] == "planning and dispatch"
    assert n[(tr.CONTROLLER_PID, tr.MEMORY_TID)] == "waits for memory"
    plan, = by(doc, cat="plan")
    assert (plan["name"], plan["tid"], plan["args"]["client"]) == ("plan step", tr.PLAN_TID, 7)
    assert plan["ts"] == pytest.approx(100_000) and plan["dur"] == pytest.approx(50_000)   # offset applied
    wait, = by(doc, cat="memory")
    assert (wait["name"], wait["tid"]) == ("wait for memory step", tr.MEMORY_TID)
    assert wait["dur"] == pytest.approx(300_000)
    inputs = by(doc, cat="wait")
    assert sorted(e["tid"] for e in inputs) == [0, 1] and all(e["name"] == "wait for inputs" for e in inputs)
    assert all(e["ts"] == pytest.approx(600_000) and e["dur"] == pytest.approx(40_000) for e in inputs)
    assert all(e["args"]["exec_id"] == 1 for e in inputs)     # g did not wait: no slice


def test_build_with_a_lost_and_a_silent_host():
    hosts = [host(0, 0, [0])]
    views = {0: tr.HostView(error="no answer in 2 s")}
    records = [m.ExecRecord(1, 1, 1, 1, 7, "f", [1], 10.5, 10.6, False)]
    doc = tr.build(begin=10.0, end=11.0, status=status(hosts, [host(1, 1, [1])]), records=records, views=views)
    n = names(doc)
    assert n[(tr.worker_pid(1),)] == "host 1 h1 (island 1) LOST"
    assert [e["name"] for e in by(doc, ph="i", pid=tr.CONTROLLER_PID) if "lost" in e["name"]] == ["host 1 h1 lost"]
    assert [(e["pid"], e["tid"]) for e in by(doc, cat="computation")] == [(tr.worker_pid(1), 1)]
    assert doc["otherData"]["unanswered_hosts"] == {"0": "no answer in 2 s"}
    assert doc["otherData"]["lost_hosts"] == [1]


# ---- real clusters ----------------------------------------------------------------------
class _StatusClient:
    """Answers StatusRequests with client 7 running ``counts`` in turn (then the last)."""
    def __init__(self, counts: list[int]) -> None:
        self.counts, self.asked = counts, 0

    def request(self, msg: m.StatusRequest) -> SimpleNamespace:
        assert type(msg) is m.StatusRequest
        n = self.counts[min(self.asked, len(self.counts) - 1)]
        self.asked += 1
        return SimpleNamespace(clients=[m.ClientStatus(7, "c", 1.0, 0.0, n, 0)])


def test_a_trace_ends_once_the_controller_has_its_client_s_reports():
    c = _StatusClient([2, 1, 0, 5])
    tr.settled(c, 7)
    assert c.asked == 3                    # until nothing of client 7 runs at the workers
    c = _StatusClient([1])
    t = time.monotonic()
    tr.settled(c, 7, limit=0.05)           # a report that never comes: at most the limit
    assert 0.05 <= time.monotonic() - t < 5 and c.asked >= 2
    c = _StatusClient([1])
    tr.settled(c, 8)                       # another client's work is not waited for
    tr.settled(c, None)
    assert c.asked == 1


def test_traced_program_every_computation_once_on_its_device(cluster, tmp_path):
    path = tmp_path / "trace.json"
    with connected(cluster, name="tracer") as conn:
        vds = zp.make_virtual_device_set()
        d0 = vds.add_slice(devices=2, island=0).devices
        d1 = vds.add_slice(devices=2, island=1).devices
        def double(v):
            return v * 2.

        def inc(v):
            return v + 1.

        f = zp.pmap(double, devices=d0)
        g = zp.pmap(inc, devices=d1)

        @zp.program
        def step(x):
            return g(f(x))                                   # island 0 -> island 1: DCN

        x = np.arange(2 * 256, dtype=np.float32).reshape(2, 256)
        step(x).result(timeout=60)                           # compiled and warm
        with zp.trace(str(path)):
            outs = [step(x) for _ in range(3)]
            for o in outs:
                np.testing.assert_allclose(o.result(timeout=60), x * 2 + 1)
        me = conn.client.client_id
        hosts = {h.rank: h for h in conn.client.hosts.values()}
    doc = json.loads(path.read_text())
    assert isinstance(doc["traceEvents"], list)
    n = names(doc)
    mine = [e for e in by(doc, cat="computation") if e["args"]["client"] == me]
    # 3 programs x (f on 2 devices of island 0 + g on 2 of island 1), each exec once per device
    per_exec = Counter((e["args"]["exec_id"], e["tid"]) for e in mine)
    assert set(per_exec.values()) == {1}
    assert Counter(e["name"] for e in mine) == {"double": 6, "inc": 6}
    assert len({e["args"]["exec_id"] for e in mine}) == 6
    for e in mine:
        rank = e["pid"] - tr.worker_pid(0)
        assert e["tid"] in {d.id for d in hosts[rank].devices}
        assert n[(e["pid"],)].startswith(f"host {rank} ") and f"(island {hosts[rank].island})" in n[(e["pid"],)]
        assert e["args"]["island"] == hosts[rank].island
    assert {e["name"]: e["args"]["island"] for e in mine} == {"double": 0, "inc": 1}
    # transfers: island 0 -> island 1, DCN, each of the 3 programs moves 2 KiB in pieces
    out = [e for e in by(doc, cat="transfer", ph="X", tid=tr.TRANSFERS_OUT_TID)]
    assert out and all(e["args"]["channel"] == "DCN" for e in out)
    assert sum(e["args"]["bytes"] for e in out) == 3 * x.nbytes
    assert {e["id"] for e in by(doc, ph="s")} == {e["id"] for e in by(doc, ph="f")} == \
        {e["args"]["piece"] for e in out}
    # the client's own slices: 3 programs and the fetches
    client = by(doc, pid=tr.client_pid(me), ph="X")
    assert [e["name"] for e in client if e["cat"] == "program"] == ["program step"] * 3
    assert sum(1 for e in client if e["cat"] == "fetch") == 3
    # the controller planned and dispatched each of them
    plans = [e for e in by(doc, cat="plan") if e["args"]["client"] == me]
    assert [e["name"] for e in plans].count("plan step") >= 3 and all(e["tid"] == tr.PLAN_TID for e in plans)
    # a wait for inputs (island 1 waits for the DCN piece) lies inside its computation
    for w in by(doc, cat="wait"):
        comp = [e for e in mine if e["args"]["exec_id"] == w["args"]["exec_id"] and e["tid"] == w["tid"]]
        assert comp and comp[0]["ts"] <= w["ts"] and w["ts"] + w["dur"] <= comp[0]["ts"] + comp[0]["dur"] + 1
    # and every slice lies inside the trace, in order on each device track
    end_us = (doc["otherData"]["end_unix_s"] - doc["otherData"]["begin_unix_s"]) * 1e6
    assert all(-1e5 < e["ts"] <= end_us + 1e5 for e in mine)


def test_zpath_trace_records_a_running_cluster(cluster, tmp_path):
    path = tmp_path / "cli.json"
    env = dict(os.environ, ZPATH_KEY=cluster.key.hex())
    env.pop("ZPATH_KEY_FILE", None)
    p = subprocess.Popen([sys.executable, "-m", "zpath", "trace", cluster.address, "--seconds", "4",
                          "-o", str(path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "tracing" in p.stderr.readline()              # connected and measuring: the window opens
        with connected(cluster, name="worked") as conn:
            dev = zp.make_virtual_device_set().add_slice(devices=2, island=0).devices
            h = zp.pmap(lambda v: v - 1., devices=dev)
            h(np.ones(2)).result(timeout=60)
            me = conn.client.client_id
            out, err = p.communicate(timeout=60)         # still connected: the trace names it
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait(10)
    assert p.returncode == 0, err
    assert "wrote" in out and "ui.perfetto.dev" in out
    doc = json.loads(path.read_text())
    mine = [e for e in by(doc, cat="computation") if e["args"]["client"] == me]
    assert len(mine) == 2 and {e["tid"] for e in mine} == {d.id for d in dev}
    assert names(doc)[(tr.client_pid(me),)].startswith(f"client {me} worked")


def test_trace_of_a_cluster_that_loses_a_host_still_closes(tmp_path):
    path, path2 = tmp_path / "lost.json", tmp_path / "silent.json"
    with running_cluster(islands=2, hosts_per_island=1, devices_per_host=1, log_dir=str(tmp_path / "logs"),
                         env={"ZPATH_HOST_TIMEOUT": "2"}) as c, connected(c) as conn:
        vds = zp.make_virtual_device_set()
        a = zp.pmap(lambda v: v * 3., devices=vds.add_slice(devices=1, island=0).devices)
        b = zp.pmap(lambda v: v * 5., devices=vds.add_slice(devices=1, island=1).devices)
        a(np.ones(1)).result(timeout=60)
        b(np.ones(1)).result(timeout=60)
        victim = next(p for name, p in c.procs if name == "worker-i1-h0")
        lost = next(h.rank for h in conn.client.hosts.values() if h.name == "local-i1-h0")
        alive = next(h.rank for h in conn.client.hosts.values() if h.name == "local-i0-h0")
        t = time.monotonic()
        with zp.trace(str(path2)):                 # killed, maybe not yet declared lost: silent
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            a(np.ones(1)).result(timeout=60)
        assert time.monotonic() - t < 20
        wait_until(lambda: conn.client.request(m.StatusRequest(False)).lost, 30, what="host 1 lost")
        t = time.monotonic()
        with zp.trace(str(path)):
            a(np.ones(1)).result(timeout=60)
        assert time.monotonic() - t < 20
    silent = json.loads(path2.read_text())
    assert str(lost) in silent["otherData"]["unanswered_hosts"] or silent["otherData"]["lost_hosts"] == [lost]
    assert [e["name"] for e in by(silent, cat="computation") if e["pid"] == tr.worker_pid(alive)] == ["<lambda>"]
    doc = json.loads(path.read_text())
    assert doc["otherData"]["lost_hosts"] == [lost]
    assert names(doc)[(tr.worker_pid(lost),)].endswith("LOST")
    assert [e["name"] for e in by(doc, cat="computation") if e["pid"] == tr.worker_pid(alive)] == ["<lambda>"]
