"""Shared fixtures: real local clusters of several worker processes.

Every process a fixture starts is stopped by pid (SIGTERM, then SIGKILL after a
grace period) and checked to be gone. The helpers come from zpath's pytest plugin
(zpath/cluster/testing.py), which also provides zpath_cluster, zpath_client, kill_host..."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

# a fetch in a test that goes wrong fails in a minute instead of hanging
os.environ.setdefault("ZPATH_FETCH_TIMEOUT", "60")

import jax
import pytest

from zpath.cluster.testing import assert_gone, connected, running_cluster  # noqa: F401  (used by test modules)


# `make test` runs the modules in two processes (pytest-xdist, --dist loadfile), each
# taking the next whole module when it is free: these, the slowest, go first, so that
# both finish together rather than one waiting on a long module taken last
SLOW_FIRST = ("test_transformer.py", "test_failures.py", "test_tenancy.py", "test_cluster.py",
              "test_simulate.py", "test_islands.py", "test_slurm.py", "test_channels.py", "test_ssh.py",
              "test_codec.py", "test_robustness.py", "test_proxy.py", "test_benchmarks.py", "test_fuzz.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):        # a pytest-xdist worker: every worker sorts alike
        rank = {name: i for i, name in enumerate(SLOW_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module")
def cluster():
    """Two islands, one host each, two devices per host."""
    with running_cluster(islands=2, hosts_per_island=1, devices_per_host=2) as c:
        yield c


@pytest.fixture
def x64():
    """Run a test with JAX's 64-bit types on (``jax_enable_x64``), for tests
    written for float64 values: zpath traces with the caller's setting
    (float32 by default, as JAX; tests/test_jax_fidelity.py checks that)."""
    with jax.enable_x64(True):
        yield


@pytest.fixture
def client(cluster):
    with connected(cluster) as conn:
        yield conn


def run_script(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a Python script (``argv`` after the interpreter) in its own process
    group, capturing its output; on a timeout its whole group is stopped
    (SIGTERM, then SIGKILL), its children too."""
    p = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)
