"""Shared fixtures: real local clusters of several worker processes.

Every process a fixture starts is stopped by pid (SIGTERM, then SIGKILL after a
grace period) and checked to be gone."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

# a fetch in a test that goes wrong fails in a minute instead of hanging
os.environ.setdefault("ZPATH_FETCH_TIMEOUT", "60")

import psutil
import pytest

import zpath as zp
from zpath.launcher import LocalCluster


def assert_gone(pids: list[int], timeout: float = 10.0) -> None:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes still running: {alive}"


@contextlib.contextmanager
def running_cluster(**kwargs) -> Iterator[LocalCluster]:
    """A LocalCluster, stopped at the end; checks every process it started
    (including workers added later) is gone."""
    c = LocalCluster(**kwargs)
    try:
        yield c
    finally:
        pids = c.pids
        c.stop()
        assert_gone(pids)


@contextlib.contextmanager
def connected(cluster: LocalCluster, name: str = "test") -> Iterator[zp.Cluster]:
    conn = zp.connect(cluster.address, cluster.key, name=name)
    try:
        yield conn
    finally:
        zp.shutdown()


@pytest.fixture(scope="module")
def cluster():
    """Two islands, one host each, two devices per host."""
    with running_cluster(islands=2, hosts_per_island=1, devices_per_host=2) as c:
        yield c


@pytest.fixture
def client(cluster):
    with connected(cluster) as conn:
        yield conn
