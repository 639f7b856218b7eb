"""A smoke test of benchmarks/worker_loop.py, which drives the worker's
executor directly (an API the rest of the runtime may change under it): with
a few nodes it runs every variant to the right value and prints its table."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "worker_loop.py"


def test_worker_loop_benchmark_runs_every_variant(tmp_path):
    out_json = tmp_path / "out.json"
    p = subprocess.Popen([sys.executable, str(SCRIPT), "--nodes", "8", "--repeats", "1",
                          "--json", str(out_json)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)          # its two processes too, on timeout
    try:
        out, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    assert p.returncode == 0, out + err[-3000:]
    for variant in ("jax-end", "jax-each", "fused", "plain"):
        assert any(line.startswith(variant + " ") for line in out.splitlines()), out
    import json
    res = json.loads(out_json.read_text())["results"]
    assert all(r["us_per_comp"] > 0 and len(r["runs_s"]) == 1 for r in res.values())
