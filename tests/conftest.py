"""Shared fixtures: real local clusters of several worker processes.

Every process a fixture starts is stopped by pid (SIGTERM, then SIGKILL after a
grace period) and checked to be gone. The helpers come from zpath's pytest plugin
(zpath/cluster/testing.py), which also provides zpath_cluster, zpath_client, kill_host..."""
from __future__ import annotations

import os

# a fetch in a test that goes wrong fails in a minute instead of hanging
os.environ.setdefault("ZPATH_FETCH_TIMEOUT", "60")

import pytest

from zpath.cluster.testing import assert_gone, connected, running_cluster  # noqa: F401  (used by test modules)


@pytest.fixture(scope="module")
def cluster():
    """Two islands, one host each, two devices per host."""
    with running_cluster(islands=2, hosts_per_island=1, devices_per_host=2) as c:
        yield c


@pytest.fixture
def client(cluster):
    with connected(cluster) as conn:
        yield conn
