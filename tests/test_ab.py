"""Tests of benchmarks/ab.py's figures: the metric paths it reads from a
benchmark's JSON and its per-round ratios, medians and intervals."""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ab  # noqa: E402  (benchmarks/ is not a package)


def test_metric_paths_read_sum_and_divide():
    data = {"zpath": {"O": {"comps_per_s": 800.0, "cpu": {"a": 1.0, "b": 2.5}}},
            "mc": {"comps_per_s": 1000}}
    assert ab._path(data, "zpath.O.comps_per_s") == 800.0
    assert ab._path(data, "zpath.O.cpu+") == 3.5
    assert ab._path(data, "zpath.O.comps_per_s/mc.comps_per_s") == pytest.approx(0.8)
    assert ab._path({"tp": [{"n": 1.0}, {"n": 2.0}]}, "tp.1.n") == 2.0


def _records(base: list[float], other: list[float]) -> list[dict]:
    out = []
    for k, (a, b) in enumerate(zip(base, other, strict=True)):
        out.append({"round": k, "name": "A", "tree": "/a", "base": "A", "metrics": {"x": a}})
        out.append({"round": k, "name": "B", "tree": "/b", "base": "A", "metrics": {"x": b}})
    return out


def test_summary_gives_the_ratios_their_median_and_whether_the_interval_excludes_one():
    text = ab.summarize(_records([10.0] * 6, [12.0, 13.0, 12.5, 12.0, 14.0, 13.0]))
    assert "ratios 1.200, 1.300, 1.250, 1.200, 1.400, 1.300" in text
    assert "6 pairs, median 1.275, 95% interval 1.200-1.350 (excludes 1); above 1 in 6" in text


def test_summary_of_mixed_ratios_includes_one_and_skips_unpaired_rounds():
    recs = _records([10.0] * 4, [9.0, 11.0, 10.5, 9.5])
    recs.append({"round": 9, "name": "A", "tree": "/a", "base": "A", "metrics": {"x": 1.0}})
    text = ab.summarize(recs)
    assert "4 pairs, median 1.000" in text and "(includes 1); above 1 in 2" in text


def test_summary_shows_the_steal_of_each_invocation_where_recorded():
    recs = _records([1.0, 1.0], [1.1, 0.9])
    assert "hypervisor" not in ab.summarize(recs)
    for r, v in zip(recs, (0.0, 1.234, None, 0.5), strict=True):
        r["steal_s"] = v
    text = ab.summarize(recs)
    assert "CPU seconds the hypervisor took during each invocation (steal), by round:" in text
    assert "  A: 0.00, -" in text and "  B: 1.23, 0.50" in text


def test_interval_is_reproducible():
    ratios = [0.9, 1.1, 1.05, 0.97, 1.2]
    assert ab.summarize(_records([1.0] * 5, ratios)) == ab.summarize(_records([1.0] * 5, ratios))


def test_the_machine_names_the_cpu_model_and_count():
    got = ab.machine()
    assert got.endswith(f", {os.cpu_count()} CPUs") and got[: -len(f", {os.cpu_count()} CPUs")].strip()
    if os.path.exists("/proc/cpuinfo"):      # (Linux: the model /proc/cpuinfo names)
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        if model:
            assert got.startswith(model)


def test_steal_is_read_from_proc_stat_in_seconds(tmp_path, monkeypatch):
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat here")
    first = ab.steal_s()
    assert first is not None and first >= 0 and ab.steal_s() >= first
    # the eighth column of the cpu line, in clock ticks
    fake = tmp_path / "stat"
    fake.write_text("cpu  10 0 20 3000 4 0 1 250 0 0\ncpu0 5 0 10 1500 2 0 0 125 0 0\n")
    real_open = open

    def fake_open(path, *a, **k):
        return real_open(fake if path == "/proc/stat" else path, *a, **k)
    monkeypatch.setattr("builtins.open", fake_open)
    assert ab.steal_s() == 250 / os.sysconf("SC_CLK_TCK")
    fake.write_text("intr 1 2 3\n")         # no cpu line: not counted
    assert ab.steal_s() is None
    assert ab._grew(1.0, 3.456) == 2.46 and ab._grew(None, 2.0) is None
