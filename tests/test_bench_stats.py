"""Tests of the statistics the island-dispatch benchmarks print (the bootstrap
interval of the zpath / multi-controller throughput ratio)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import island_dispatch as bench  # noqa: E402  (benchmarks/ is not a package)


def test_ratio_interval_brackets_the_ratio_of_medians():
    mine = [1.10, 1.30, 1.05, 1.20, 1.60, 1.15, 1.25]
    theirs = [1.00, 1.10, 1.02, 0.95, 1.40, 1.00, 1.05]
    lo, hi = bench.ratio_ci(mine, theirs)
    point = (sorted(theirs)[3]) / (sorted(mine)[3])
    assert lo <= point <= hi
    assert lo < hi                      # noisy runs: a real interval
    assert hi < 1.0                     # every pair says "mine" is slower


def test_ratio_interval_of_identical_runs_is_one_point():
    t = [2.0, 2.0, 2.0, 2.0]
    assert bench.ratio_ci(t, [1.0] * 4) == pytest.approx((0.5, 0.5))


def test_ratio_interval_with_one_run_is_the_ratio():
    assert bench.ratio_ci([2.0], [3.0]) == pytest.approx((1.5, 1.5))


def test_ratio_interval_is_reproducible():
    mine, theirs = [1.0, 1.4, 1.1, 1.3], [1.2, 1.0, 1.1, 0.9]
    assert bench.ratio_ci(mine, theirs) == bench.ratio_ci(mine, theirs)


@pytest.mark.timeout(30)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_thread_meter_attributes_cpu_to_the_thread_that_spent_it():
    """A thread that burns CPU between start and stop shows up under its name
    (the busiest of a group of threads of one name on its own, marked "*"),
    with about the CPU it spent, per computation; a thread that slept on an
    event counts a voluntary context switch."""
    import os
    import threading
    import time

    go, done, woke, finish = (threading.Event() for _ in range(4))

    def burn() -> None:
        go.wait()
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.2:
            pass
        done.set()
        finish.wait(20)       # alive until measured: the meter reads live threads

    def sleeper() -> None:
        go.wait()
        woke.set()
        finish.wait(20)

    threads = [threading.Thread(target=burn), threading.Thread(target=sleeper)]
    for t in threads:
        t.start()
    meter = bench.ThreadMeter({"me": os.getpid()})
    meter.start()
    go.set()
    assert done.wait(20) and woke.wait(20)
    meter.stop()
    finish.set()
    for t in threads:
        t.join(20)
    rows = meter.per_comp(2)["me"]
    names = [r["name"] for r in rows]
    assert rows[0]["name"].endswith("*"), names        # the burner, apart from the sleeper
    assert 0.09 * 1e6 <= rows[0]["cpu_us"] <= 0.5 * 1e6       # 0.2 s over 2 computations
    assert rows[0]["threads"] == 1
    assert any(r["name"] == "main" for r in rows)
    assert sum(r["voluntary"] for r in rows) >= 0.5          # the sleeper woke once: 1 / 2
    assert any(r["name"] + "*" == rows[0]["name"] for r in rows), names     # the others of its name
    assert "rest" in bench.threads_table({"F_threads": {"me": rows}}, {})
    # each variant's table reads its own rows (-O's with --threads too)
    assert "me " in bench.threads_table({"O_threads": {"me": rows}}, {}, v="O")
    assert "me " not in bench.threads_table({"O_threads": {"me": rows}}, {})


def test_timeline_counts_the_computations_held_up_and_their_share_of_the_run():
    """The medians hide a few long computations: the timeline's figures count
    those over SLOW_X times the median and give their share of the run."""
    from types import SimpleNamespace as NS

    def recs(host, durations_us):
        out, t = [], 100.0
        for d in durations_us:
            out.append(NS(host=host, name="f", start=t, end=t + d / 1e6))
            t += d / 1e6 + 20e-6          # 20 us idle between
        return out
    # host 0: 18 of 200 us and 2 of 5 ms; host 1: all even; another name is left out
    got = recs(0, [200.0] * 9 + [5000.0] + [200.0] * 9 + [5000.0]) + recs(1, [200.0] * 20)
    got.append(NS(host=0, name="other", start=0.0, end=50.0))
    cluster = NS(client=NS(request=lambda req: NS(records=got)))
    stats = bench._timeline_stats(cluster, "f", 20)
    h0, h1 = stats["host0"], stats["host1"]
    assert h0["records"] == 20 and h0["exec_us_median"] == pytest.approx(200.0)
    assert h0["slow"] == 2 and h1["slow"] == 0 and h1["slow_share"] == 0.0
    span = 18 * 200 + 2 * 5000 + 19 * 20
    assert h0["slow_share"] == pytest.approx(10000 / span, rel=1e-3)
    assert h0["exec_us_p90"] > 200.0 and h1["exec_us_p90"] == pytest.approx(200.0)
    assert h0["idle_between_us_median"] == pytest.approx(20.0, abs=0.1)
    line = bench.timeline_line("-O zpath", "host0", h0, "call")
    assert "2 over 4x the median, 72% of the run's span" in line, line
    # a few records (chained.py's programs): the 90th percentile stays within them
    got = recs(0, [10.0, 10.0, 10.0, 40.0])
    few = bench._timeline_stats(cluster, "f", 4)["host0"]
    assert few["exec_us_p90"] == pytest.approx(31.0) and few["slow"] == 0
