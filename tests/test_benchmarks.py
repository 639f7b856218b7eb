"""A smoke test of benchmarks/worker_loop.py, which drives the worker's
executor directly (an API the rest of the runtime may change under it): with
a few nodes it runs every variant to the right value and prints its table."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import run_script

pytestmark = pytest.mark.timeout(240)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "worker_loop.py"


def _load(script: Path):
    """A benchmark script as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(script.stem, script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("solo,hold", [(False, False), (True, False), (False, True)])
def test_worker_loop_benchmark_runs_every_variant(tmp_path, solo, hold):
    """(each variant's value is checked by the script: it fails on a wrong one;
    with ``--hold`` the computations may hold their reports, as -O's do)"""
    out_json = tmp_path / "out.json"
    p = run_script([str(SCRIPT), "--nodes", "8", "--repeats", "1", "--json", str(out_json),
                    *(["--solo"] if solo else []), *(["--hold"] if hold else [])], timeout=180)
    out, err = p.stdout, p.stderr
    assert p.returncode == 0, out + err[-3000:]
    variants = ("jax-end", "jax-each", "fused", "fused-steps", "fused-execute", "plain")
    for variant in variants:
        assert any(line.startswith(variant + " ") for line in out.splitlines()), out
    assert ("1 process x 1 CPU device" in out) is solo, out
    assert ("computations held" in out) is hold, out
    got = json.loads(out_json.read_text())
    res = got["results"]
    assert got["solo"] is solo and got["hold"] is hold and set(res) == set(variants)
    assert all(r["us_per_comp"] > 0 and len(r["runs_s"]) == 1 for r in res.values())


def test_core_scale_benchmark_times_the_core_per_node():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "core_scale.py"
    p = run_script([str(script), "--hosts", "2", "8", "--nodes", "3", "--repeats", "1", "--json",
                    "--fused", "3", "--relay-min-hosts", "8"], timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    fused = [r for r in rows if "fused_nodes" in r]
    rows = [r for r in rows if "fused_nodes" not in r]
    assert [r["hosts"] for r in rows] == [2, 8] and [r["devices"] for r in rows] == [8, 32]
    assert all(r["call_us"] > 0 and r["exec_done_us"] > 0 and r["release_us"] > 0 for r in rows)
    # a fused template: its hosts' parts alike, one DefineFused (through relays at 8 hosts)
    assert [(r["hosts"], r["fused_nodes"], r["distinct_define_fused"]) for r in fused] == [(2, 3, 1), (8, 3, 1)]
    assert all(r["fused_run_core_ms"] > 0 and r["fused_run_sent_mb"] > 0 and r["workers_decode_ms"] > 0
               for r in fused)


@pytest.mark.parametrize("hold", [False, True])
def test_controller_opbyop_benchmark_runs_calls_through_a_real_controller(tmp_path, hold):
    """Every call of its chains reaches both fake hosts and is reported (the
    script waits for that; with ``--hold`` the held reports too), and the
    controller's CPU per call is measured."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "controller_opbyop.py"
    out_json = tmp_path / "out.json"
    # (a hold takes a queue of computations long enough to be worth holding for)
    p = run_script([str(script), "--seconds", "0.2", "--repeats", "1", "--chain", "20",
                    *(["--exec-us", "2000", "--core-calls", "0", "--hold"] if hold else
                      ["--exec-us", "100", "--core-calls", "50"]),
                    "--json", str(out_json)], timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    res = json.loads(out_json.read_text())
    assert len(res["runs"]) == 1 and res["calls_per_s"] > 0 and res["hold"] is hold
    assert res["controller_cpu_us"] > 0 and res["main_thread_us"] > 0
    if hold:              # reports were held, and went out (or the script would have waited in vain)
        assert res["held_reports"] > 0
    else:                 # the in-process core ran its calls
        assert res["core_us"] > 0 and res["core_after_sleep_us"] > 0


def test_wake_floor_benchmark_times_every_mechanism():
    """Every message of each gap and kind (a datagram to a sleeping and to a
    polling receiver, ZeroMQ) arrives and is timed (the receiver
    would wait for a missing one, and the script's timeout would fail this)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "wake_floor.py"
    p = run_script([str(script), "--gaps", "0.5,1", "--count", "8", "--json"], timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert set(res["gaps"]) == {"0.5", "1.0"} and res["size"] == 1024
    for row in res["gaps"].values():
        for kind in ("dgram", "dgram-poll", "zmq"):
            r = row[kind]
            assert 0 < r["p25_us"] <= r["median_us"] <= r["p75_us"], row
    # zpath's steps on the piece's path, hot and after each gap: each one timed
    assert set(res["steps"]) == {"hot", "0.5", "1.0"}
    for row in res["steps"].values():
        assert set(row) == {"make and sign", "send and read", "check and decode", "array"}
        assert all(t > 0 for t in row.values()), row
    assert set(res["piece_steps"]) == {"hot", "0.5", "1.0"}
    for row in res["piece_steps"].values():
        assert set(row) == {"make and sign", "send and read", "check, decode, array"}
        assert all(t > 0 for t in row.values()), row
    bad = run_script([str(script), "--gaps", "0"], timeout=60)
    assert bad.returncode == 2 and "--gaps must all be > 0" in bad.stderr


def test_device_put_benchmark_times_each_case_both_ways():
    """benchmarks/device_put.py: a numpy array, a JAX array onto another device
    and onto its own, each put both ways and timed (figures only: no speed is
    asserted here)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "device_put.py"
    p = run_script([str(script), "--calls", "20", "--rounds", "3", "--size", "64", "--json"], timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert res["size_bytes"] == 256 and res["rounds"] == 3
    assert set(res["cases"]) == {"numpy array", "JAX array, another device", "JAX array, its own device"}
    for row in res["cases"].values():
        for way in ("jax.device_put", "to_device"):
            r = row[way]
            assert 0 < r["p25_us"] <= r["median_us"] <= r["p75_us"], row
        assert row["ratio"] == row["to_device"]["median_us"] / row["jax.device_put"]["median_us"]


def test_wake_floor_counts_what_two_workers_run_on_a_piece():
    """--ops: a piece goes from one worker to the other (the script fails if it
    does not come, or is not stored) and both sides' counts come out."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "wake_floor.py"
    p = run_script([str(script), "--ops", "--json"], timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    res = json.loads(p.stdout)
    for side in ("sender", "receiver"):
        c = res[side]
        assert c["bytecodes"] > 0 and c["c_calls"] > 0 and c["py_calls"] >= 1, res
        # the piece format's path: a few calls, not the envelope's (20-24 Python calls)
        assert c["py_calls"] < 15, res


def test_heartbeats_benchmark_measures_the_controller_under_busy_hosts(tmp_path):
    """A chain of SPMD nodes runs over a few simulated hosts and the
    controller's CPU a second and per node come out (the script waits for the
    chain's last output, so a node that never finished would time it out)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "heartbeats.py"
    out_json = tmp_path / "out.json"
    p = run_script([str(script), "--hosts", "8", "--cost-ms", "20", "--nodes", "6", "--json", str(out_json)],
                   timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    r = json.loads(out_json.read_text())
    assert (r["hosts"], r["nodes"]) == (8, 6) and r["wall_s"] >= 6 * 0.020
    # (CPU time from /proc comes in 10 ms ticks: a short chain may read none)
    assert r["ctl_cpu_ms_per_s"] >= 0 and r["ctl_cpu_ms_per_node"] == pytest.approx(r["ctl_cpu_ms_per_s"] * r["wall_s"] / 6)


def test_controller_opbyop_counts_the_cores_bytecodes_on_chained_calls():
    """``--count``'s driver: chains posted ahead of the hosts finish (it
    raises if not), most of their calls are planned on the fast path and
    parked (the alone window no longer than the solo one, as with a second
    client connected), and the count covers the core's functions on that path."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "controller_opbyop.py"
    mod = _load(script)
    calls, parked, by_code = mod.core_chained(chains=3, chain=150, counted_from=1, alone_window_ms=100.0)
    assert calls == 300 and parked > 100
    assert sum(by_code.values()) > 1000 * calls
    assert by_code["FastCalls._fast_call"] > 0 and by_code["TenantScheduler.sent"] > 0


def test_controller_opbyop_counts_the_core_without_a_part_and_puts_it_back():
    """``--count --without``: with the window never full no call parks and the
    count falls; without the tenant scheduler its accounting is not counted;
    the classes are as they were afterwards."""
    from zpath.controller import records, scheduler

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "controller_opbyop.py"
    mod = _load(script)
    before = {name: scheduler.TenantScheduler.__dict__[name] for name in ("can_send_now", "low", "sent")}
    append = records.Timeline.__dict__["append"]
    calls, parked, whole = mod.core_chained(chains=3, chain=150, counted_from=1, alone_window_ms=100.0)
    with mod.without(["window-full"]):
        _, parked_full, full = mod.core_chained(chains=3, chain=150, counted_from=1, alone_window_ms=100.0)
    with mod.without(["scheduler", "timeline"]):
        _, _, bare = mod.core_chained(chains=3, chain=150, counted_from=1, alone_window_ms=100.0)
    assert parked > 100 and parked_full == 0
    assert sum(bare.values()) < sum(full.values()) < sum(whole.values())
    assert full["TenantScheduler._fits"] > 0 and "TenantScheduler.sent" not in bare
    assert "Timeline.append" not in bare
    assert {name: scheduler.TenantScheduler.__dict__[name] for name in before} == before
    assert records.Timeline.__dict__["append"] is append


def test_dispatch_latency_benchmark_times_calls_to_their_start(tmp_path):
    """A few busy-caller calls and chained runs on a local cluster: each
    computation is found on the timeline after its call (the script raises
    if not), and the figures come out in order."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "dispatch_latency.py"
    p = run_script([str(script), "--count", "3", "--busy-ms", "2", "--gap-ms", "2", "--bursts", "2",
                    "--chain", "20", "--json", str(tmp_path / "out.json")], timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    r = json.loads((tmp_path / "out.json").read_text())
    assert "chain of 20: first start" in p.stdout
    for key in ("busy_caller_us", "burst_first_start_us", "burst_run_ms"):
        q = r[key]
        assert 0 < q["p10"] <= q["median"] <= q["p90"], r
    assert r["busy_caller_us"]["n"] == 3 and r["burst_first_start_us"]["n"] == 2


def test_fetch_benchmark_times_fetches_and_round_trips_per_gap(tmp_path):
    """A few fetches and round trips on a local cluster, two gaps: the value
    fetched is checked (the script raises if not), and each gap's figures come
    out in order; a gap under 5 ms is refused."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "fetch.py"
    p = run_script([str(script), "--count", "3", "--gap-ms", "5,8", "--tree", "3", "--big-mib", "0.5",
                    "--json", str(tmp_path / "out.json")], timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    r = json.loads((tmp_path / "out.json").read_text())
    assert "result() of a done value, 8 ms idle" in p.stdout and "jax.device_get of 3 done values" in p.stdout
    assert "block_until_ready, done 0.5 MiB/device, 5 ms idle" in p.stdout and r["big_mib"] == 0.5
    assert "block_until_ready, a program's 4 outputs, 8 ms idle" in p.stdout
    # a donating step waited for with block_until_ready still donates
    assert r["donating_step_us"]["n"] == 3 and r["step_variants_donating"] == [True]
    for key in ("done_us", "round_trip_us", "tree_us", "one_by_one_us", "big_block_us", "big_result_us",
                "big_outputs_us", "program_outputs_us"):
        assert set(r[key]) == {"g5", "g8"}
        for q in r[key].values():
            assert 0 < q["p10"] <= q["median"] <= q["p90"] and q["n"] == 3, r
    bad = run_script([str(script), "--gap-ms", "2"], timeout=60)
    assert bad.returncode == 2 and "--gap-ms" in bad.stderr


def test_newcomer_benchmark_times_a_second_clients_first_calls(tmp_path):
    """One short run: a busy client, then a newcomer whose calls come back,
    timed in order (first call, then the others)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "newcomer.py"
    p = run_script([str(script), "--windows", "100", "--repeats", "1", "--calls", "3", "--lead", "0.5",
                    "--depth", "8", "--size", "32", "--json", str(tmp_path / "out.json")], timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    r = json.loads((tmp_path / "out.json").read_text())
    (run,) = r["runs"]
    assert run["window_ms"] == 100 and run["connect_ms"] > 0 and run["first_ms"] > 0 and run["later_ms"] > 0
    assert r["table"][0]["first_ms"] == run["first_ms"]


def test_mc_noise_benchmark_times_two_multi_controller_pairs_alternately(tmp_path):
    """Two short invocations of the A/A reference: each times both pairs as many
    runs (the processes check every run's value), and its ratio is pair B's
    throughput over pair A's from those runs; the count of invocations that
    reached the level is printed. Bad arguments are refused."""
    import statistics

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "mc_noise.py"
    mod = _load(script)
    p = run_script([str(script), "--invocations", "2", "--repeats", "3", "--calls", "64",
                    "--json", str(tmp_path / "out.json")], timeout=200)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    r = json.loads((tmp_path / "out.json").read_text())
    assert len(r["invocations"]) == 2
    for inv in r["invocations"]:
        assert len(inv["a_s"]) == len(inv["b_s"]) == 3 and min(inv["a_s"] + inv["b_s"]) > 0
        assert inv["ratio"] == pytest.approx(statistics.median(inv["a_s"]) / statistics.median(inv["b_s"]))
        # (its interval: pairs of runs resampled together, as chained.py's)
        assert inv["ratio_ci"] == pytest.approx(list(mod.ratio_ci(inv["b_s"], inv["a_s"])))
    # (the second invocation started pair B's processes first)
    assert [inv["b_started_first"] for inv in r["invocations"]] == [False, True]
    met = sum(inv["ratio"] >= 0.95 for inv in r["invocations"])
    assert f">= 0.95 in {met} of 2" in p.stdout and "invocation 1: B / A" in p.stdout
    assert r["summary"]["invocations"] == 2 and r["summary"]["met"] == met
    assert r["config"]["calls"] == 64 and r["config"]["mc_sync"] == "end"
    bad = run_script([str(script), "--calls", "1024"], timeout=60)
    assert bad.returncode == 2 and "below 1024" in bad.stderr
    bad = run_script([str(script), "--repeats", "0"], timeout=60)
    assert bad.returncode == 2 and "must be at least 1" in bad.stderr
