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
