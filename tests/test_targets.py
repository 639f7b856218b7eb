"""Tests of benchmarks/targets.py: the figures it reads per invocation, which
targets they meet, and the invocations it makes in each tree."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import targets  # noqa: E402  (benchmarks/ is not a package)

pytestmark = pytest.mark.timeout(60)


def test_the_workers_figure_is_the_larger_host():
    got = targets.figures({"workers_F_h0": 1.01, "workers_F_h1": 1.2, "F": 0.9})
    assert got == {"workers_F": 1.2, "F": 0.9}


def _record(k: int, name: str, **figures: float) -> dict:
    return {"round": k, "name": name, "tree": f"/{name}", "base": "a", "load": "1.0 1.0 1.0",
            "wall_s": [1.0], "figures": figures}


def _row(text: str, what: str) -> str:
    return next(line for line in text.splitlines() if what in line)


def test_table_counts_the_invocations_that_meet_each_target():
    recs = [_record(0, "a", F=0.97, ici_1K_us=200.0, ctl_O_us=140.0),
            _record(1, "a", F=0.91, ici_1K_us=190.0, ctl_O_us=150.0),
            _record(2, "a", F=1.02, ici_1K_us=149.0)]
    text = targets.table(recs)
    assert _row(text, "-F zpath / MC").endswith("0.97     0.91     1.02  2 of 3")
    assert _row(text, "1 KiB ICI").endswith("1 of 3")
    # a target met at its bound; a figure an invocation did not give is shown, not counted
    assert _row(text, "controller CPU").endswith("140      150        -  2 of 2 (each)")
    assert _row(text, "-C zpath / MC").endswith("-        -        -  0 of 0")


def test_main_alternates_trees_writes_each_invocation_and_compares_them(tmp_path, monkeypatch):
    calls = []

    def run_one(tree, script, args, metrics, timeout):
        calls.append((Path(tree).name, script, args))
        value = 2.0 if Path(tree).name == "new" else 1.0
        return {"metrics": {name: value for name in metrics}, "wall_s": 0.1}

    monkeypatch.setattr(targets.ab, "run_one", run_one)
    (tmp_path / "base").mkdir()
    (tmp_path / "new").mkdir()
    out = tmp_path / "t.jsonl"
    assert targets.main(["--tree", f"base={tmp_path / 'base'}", "--tree", f"new={tmp_path / 'new'}",
                         "--invocations", "2", "--out", str(out)]) == 0
    # every invocation runs the three benchmarks, the trees' order rotating
    assert [c[0] for c in calls] == ["base"] * 3 + ["new"] * 3 + ["new"] * 3 + ["base"] * 3
    assert [c[1] for c in calls[:3]] == [b[0] for b in targets.BENCHMARKS]
    assert calls[0][2] == ["--repeats", "31"]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["round"], r["name"]) for r in recs] == [(0, "base"), (0, "new"), (1, "new"), (1, "base")]
    assert recs[1]["figures"]["workers_F"] == 2.0 and set(recs[0]["figures"]) == {t[0] for t in targets.TARGETS}
    text = targets.summarize(recs)
    assert "new / base" in text and "2 pairs, median 2.000" in text


def test_a_tree_that_is_not_a_directory_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        targets.main(["--tree", f"x={tmp_path / 'missing'}"])
