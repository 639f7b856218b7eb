"""Tests of benchmarks/targets.py: the figures it reads per invocation, which
targets they meet, and the invocations it makes in each tree."""
import json
import math
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import run_script

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import targets  # noqa: E402  (benchmarks/ is not a package)

pytestmark = pytest.mark.timeout(60)
# every figure an invocation reads: the targets' and the reference's
FIGURES = {t[0] for t in targets.TARGETS + targets.REFERENCES}


def test_the_workers_figure_is_the_larger_host():
    got = targets.figures({"workers_F_h0": 1.01, "workers_F_h1": 1.2, "F": 0.9})
    assert got == {"workers_F": 1.2, "F": 0.9}


def _record(k: int, name: str, **figures: float) -> dict:
    return {"round": k, "name": name, "tree": f"/{name}", "base": "a", "load_before": "1.0 1.0 1.0",
            "runs": [], "figures": figures}


def _row(text: str, what: str) -> str:
    return next(line for line in text.splitlines() if what in line)


def test_table_counts_the_invocations_that_meet_each_target():
    recs = [_record(0, "a", F=0.97, ici_1K_us=200.0, ctl_O_us=140.0),
            _record(1, "a", F=0.91, ici_1K_us=190.0, ctl_O_us=150.0),
            _record(2, "a", F=1.02, ici_1K_us=149.0)]
    recs[1]["machine"] = recs[2]["machine"] = "Some CPU, 2 CPUs"
    recs[1]["steal_s"], recs[2]["steal_s"] = 3.456, 0.0
    text = targets.table(recs)
    # each machine once, in order; a record from before machines were recorded says so
    assert "(machine: not recorded, Some CPU, 2 CPUs)" in text
    # the steal per invocation; one from before steal was recorded shows "-"
    assert "(CPU seconds the hypervisor took during each invocation: -, 3.46, 0.00)" in text
    assert _row(text, "-F zpath / MC").endswith("0.970    0.910    1.020  2 of 3")
    assert _row(text, "1 KiB ICI").endswith("200      190      149  1 of 3")
    # a target met at its bound; a figure an invocation did not give is shown, not counted
    assert _row(text, "controller CPU").endswith("140      150        -  2 of 2 (each)")
    assert _row(text, "-C zpath / MC").endswith("-        -        -  0 of 0")
    # the reference is shown and counted as the targets are, and called what it is
    recs[0]["figures"]["MC_AA"], recs[1]["figures"]["MC_AA"] = 0.94, 1.01
    assert _row(targets.table(recs), "not a target: MC / MC").endswith("0.940    1.010        -  1 of 2")


def _fake_run_one(calls: list, fail: str | None = None):
    def run_one(tree, script, args, metrics, timeout):
        calls.append((Path(tree).name, script, args))
        if fail is not None and script.endswith(fail):
            raise SystemExit(f"{tree}: exit 1")
        value = 2.0 if Path(tree).name == "new" else 1.0
        return {"metrics": {name: value for name in metrics}, "wall_s": 0.1,
                "load_before": "0.5 0.5 0.5", "load_after": "0.6 0.6 0.6", "steal_s": 0.25}
    return run_one


def test_main_alternates_trees_writes_each_invocation_and_compares_them(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(targets.ab, "run_one", _fake_run_one(calls))
    for name in ("base", "new"):      # (checkouts with the reference's script)
        (tmp_path / name / "benchmarks").mkdir(parents=True)
        (tmp_path / name / "benchmarks" / "mc_noise.py").write_text("")
    out = tmp_path / "t.jsonl"
    targets.main(["--tree", f"base={tmp_path / 'base'}", "--tree", f"new={tmp_path / 'new'}",
                  "--invocations", "2", "--out", str(out)])
    # every invocation runs the three benchmarks with the arguments, and the
    # multi-controller A/A reference, the trees' order rotating
    assert [c[0] for c in calls] == ["base"] * 4 + ["new"] * 4 + ["new"] * 4 + ["base"] * 4
    assert [(c[1], c[2]) for c in calls[:4]] == [
        ("benchmarks/island_dispatch.py", ["--repeats", "31"]),
        ("benchmarks/chained.py", ["--programs", "4", "--repeats", "15"]),
        ("benchmarks/transfer.py", ["--only", "ici", "--sizes", "1K,64M"]),
        ("benchmarks/mc_noise.py", ["--invocations", "1", "--repeats", "15"])]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["round"], r["name"]) for r in recs] == [(0, "base"), (0, "new"), (1, "new"), (1, "base")]
    assert recs[1]["figures"]["workers_F"] == 2.0 and set(recs[0]["figures"]) == FIGURES
    assert recs[0]["load_before"] == "0.5 0.5 0.5" and len(recs[0]["runs"]) == 4
    assert recs[0]["machine"] == targets.ab.machine()
    # the steal of an invocation is its four benchmarks' together
    assert recs[0]["steal_s"] == 1.0 and [r["steal_s"] for r in recs[0]["runs"]] == [0.25] * 4
    text = targets.summarize(recs)
    assert f"(machine: {targets.ab.machine()})" in text
    assert "(CPU seconds the hypervisor took during each invocation: 1.00, 1.00)" in text
    assert "new / base" in text and "2 pairs, median 2.000" in text
    # more invocations added to the same file, numbered on
    calls.clear()
    targets.main(["--tree", f"base={tmp_path / 'base'}", "--tree", f"new={tmp_path / 'new'}",
                  "--invocations", "1", "--first-round", "2", "--quick", "--out", str(out)])
    assert calls[0][2] == ["--repeats", "1", "--calls-o", "200", "--calls-f", "1"]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["round"] for r in recs] == [0, 0, 1, 1, 2, 2]


def test_a_failed_benchmark_loses_only_its_figures(tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(targets.ab, "run_one", _fake_run_one(calls, fail="chained.py"))
    (tmp_path / "base").mkdir()
    (tmp_path / "new").mkdir()
    out = tmp_path / "t.jsonl"
    targets.main(["--tree", f"base={tmp_path / 'base'}", "--invocations", "1", "--out", str(out)])
    rec = json.loads(out.read_text())
    assert "C" not in rec["figures"] and rec["figures"]["F"] == 1.0
    assert rec["runs"][1] == {"script": "benchmarks/chained.py", "failed": f"SystemExit: {tmp_path / 'base'}: exit 1"}
    assert _row(capsys.readouterr().out, "-C zpath / MC").endswith("-  0 of 0")
    # compared with a tree that gave it: the ratios leave it out, the table shows both
    recs = [rec, dict(_record(0, "new", **dict.fromkeys(FIGURES, 2.0)), tree="/new")]
    (tmp_path / "two.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    targets.main(["--summarize", str(tmp_path / "two.jsonl")])
    text = capsys.readouterr().out
    assert "new / base" in text and "  C: ratios" not in text and "  F: ratios 2.000" in text


def test_a_checkout_without_the_reference_runs_the_rest_and_ratios_leave_the_reference_out(
        tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(targets.ab, "run_one", _fake_run_one(calls))
    for name in ("base", "new"):
        (tmp_path / name / "benchmarks").mkdir(parents=True)
    (tmp_path / "new" / "benchmarks" / "mc_noise.py").write_text("")   # only new has the script
    out = tmp_path / "t.jsonl"
    targets.main(["--tree", f"base={tmp_path / 'base'}", "--tree", f"new={tmp_path / 'new'}",
                  "--invocations", "1", "--out", str(out)])
    assert [(c[0], Path(c[1]).name) for c in calls if c[1].endswith("mc_noise.py")] == [("new", "mc_noise.py")]
    base, new = (json.loads(line) for line in out.read_text().splitlines())
    assert base["runs"][3] == {"script": "benchmarks/mc_noise.py", "skipped": "not in this checkout"}
    assert "MC_AA" not in base["figures"] and new["figures"]["MC_AA"] == 2.0
    text = capsys.readouterr().out
    assert "no figures" not in text and "  F: ratios 2.000" in text
    # both trees with the reference: the ratios still leave it out (it measures no tree)
    recs = [dict(_record(0, "a", **dict.fromkeys(FIGURES, 1.0)), base="a"),
            dict(_record(0, "b", **dict.fromkeys(FIGURES, 2.0)), base="a")]
    text = targets.summarize(recs)
    assert "  F: ratios 2.000" in text and "MC_AA: ratios" not in text


def test_a_tree_that_is_not_a_directory_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        targets.main(["--tree", f"x={tmp_path / 'missing'}"])


@pytest.mark.timeout(300)
def test_quick_invocation_reads_every_figure_from_the_real_benchmarks(tmp_path):
    """One short invocation of the four benchmarks in this checkout: every
    target's figure is read from their JSON (the paths match what they write)."""
    out = tmp_path / "t.jsonl"
    p = run_script([str(BENCH / "targets.py"), "--quick", "--invocations", "1", "--out", str(out)], timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert set(rec["figures"]) == FIGURES, rec
    assert all(math.isfinite(v) and v >= 0 for v in rec["figures"].values()), rec
    assert rec["figures"]["MC_AA"] > 0
    assert 0 < rec["figures"]["ici_1K_us"] < 1e6 and rec["figures"]["F"] > 0 and rec["figures"]["C"] > 0
    assert "met in" in p.stdout and all(r.get("wall_s") for r in rec["runs"])
    model, _, count = rec["machine"].rpartition(", ")
    assert model.strip() and count == f"{os.cpu_count()} CPUs", rec["machine"]
    if targets.ab.steal_s() is not None:      # (Linux: /proc/stat counts steal)
        assert rec["steal_s"] >= 0 and all(r["steal_s"] >= 0 for r in rec["runs"]), rec
