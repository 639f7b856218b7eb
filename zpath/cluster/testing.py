"""Test-rig kit: pytest fixtures and helpers for integration tests of programs
that run on zpath. Installed as a pytest plugin (entry point ``pytest11``), so
the fixtures are available in any project with zpath installed:

* ``zpath_cluster`` — a factory: ``zpath_cluster(islands=2, hosts_per_island=1,
  devices_per_host=2, **LocalCluster kwargs)`` starts a local cluster and
  returns it; every cluster it started is stopped when the test ends, and every
  process it started is checked to be gone.
* ``zpath_session_cluster`` — one default cluster shared by the whole session.
* ``zpath_client`` — ``zp.connect`` to ``zpath_target`` (by default the session
  cluster; override the ``zpath_target`` fixture to point it elsewhere), and
  ``zp.shutdown()`` after the test.
* ``kill_host(cluster, host, sig=SIGKILL)``, ``pause_host``/``resume_host``
  (SIGSTOP/SIGCONT): act on one worker, named by its host rank, its host name
  (``local-i1-h0``) or its process name (``worker-i1-h0``).
* ``running_cluster(**kw)`` / ``connected(cluster)``: the same as context
  managers, for use outside fixtures; ``assert_gone(pids)``.

Example::

    import numpy as np, pytest, zpath as zp
    from zpath.cluster.testing import connected, kill_host

    def test_survives_losing_island_1(zpath_cluster):
        cluster = zpath_cluster(islands=2, devices_per_host=1, env={"ZPATH_HOST_TIMEOUT": "3"})
        with connected(cluster):
            d1 = zp.make_virtual_device_set().add_slice(devices=1, island=1).devices
            kill_host(cluster, "worker-i1-h0")
            with pytest.raises(zp.HostLost):
                zp.pmap(lambda x: x + 1, devices=d1)(np.ones(1)).result(timeout=60)
"""
from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from typing import Any, Callable, Iterator

import psutil
import pytest

import zpath as zp
from zpath.client.connection import Client
from zpath.cluster.launcher import LocalCluster, default_shape
from zpath.config import ClusterConfig
from zpath.errors import ZpathError
from zpath.net import messages as m


def assert_gone(pids: list[int], timeout: float = 10.0) -> None:
    """Fail unless every process in ``pids`` has exited within ``timeout`` s."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes still running: {alive}"


@contextlib.contextmanager
def running_cluster(**kwargs: Any) -> Iterator[Any]:
    """A ``LocalCluster(**kwargs)``, stopped at the end; checks that every
    process it started (workers added later included) is gone. Its settings
    (``config``) come from the environment unless given (ZPATH_START_TIMEOUT,
    ZPATH_KEEP_LOGS)."""
    kwargs.setdefault("config", ClusterConfig.from_env())
    c = LocalCluster(**kwargs)
    try:
        yield c
    finally:
        pids = c.pids
        c.stop()
        assert_gone(pids)


@contextlib.contextmanager
def connected(cluster: Any, name: str = "test") -> Iterator[Any]:
    """``zp.connect`` to ``cluster`` (anything with ``address`` and ``key``);
    ``zp.shutdown()`` at the end."""
    conn = zp.connect(cluster.address, cluster.key, name=name)
    try:
        yield conn
    finally:
        zp.shutdown()


def _host_process(cluster: Any, host: int | str) -> tuple[str, subprocess.Popen]:
    """The (process name, Popen) of a worker of a local cluster."""
    names = dict(getattr(cluster, "expected", {}))        # process name -> host name
    if isinstance(host, int):
        c = Client(cluster.address, cluster.key, name="zpath.cluster.testing")
        try:
            st = c.request(m.StatusRequest(False))
        finally:
            c.close()
        by_rank = {h.rank: h.name for h in [*st.hosts, *st.lost]}
        if host not in by_rank:
            raise ZpathError(f"no host with rank {host}; hosts: {sorted(by_rank)}")
        host = by_rank[host]
    for name, p in cluster.procs:
        if host in (name, names.get(name)):
            if getattr(cluster, "host_of", {}).get(name) is not None:
                raise ZpathError(f"{host} runs over ssh; kill_host/pause_host act on local workers only")
            return name, p
    raise ZpathError(f"no worker {host!r}; workers: {sorted(names.items())}")


def kill_host(cluster: Any, host: int | str, sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` (default SIGKILL) to one worker; returns its pid. With
    SIGKILL, waits until the process is gone."""
    name, p = _host_process(cluster, host)
    p.send_signal(sig)
    if sig == signal.SIGKILL:
        p.wait(10)
    return p.pid


def pause_host(cluster: Any, host: int | str, timeout: float = 10.0) -> int:
    """Freeze one worker (SIGSTOP): it stops answering, as a hung machine would.
    Returns once the process is stopped (signals are delivered asynchronously)."""
    pid = kill_host(cluster, host, signal.SIGSTOP)
    _wait_status(pid, lambda st: st == psutil.STATUS_STOPPED, timeout, "stop")
    return pid


def resume_host(cluster: Any, host: int | str, timeout: float = 10.0) -> int:
    """Let a paused worker go on (SIGCONT); returns once it is no longer stopped."""
    pid = kill_host(cluster, host, signal.SIGCONT)
    _wait_status(pid, lambda st: st != psutil.STATUS_STOPPED, timeout, "resume")
    return pid


def _wait_status(pid: int, ok: Callable[[str], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ok(psutil.Process(pid).status()):
                return
        except psutil.NoSuchProcess:
            raise ZpathError(f"process {pid} is gone (cannot {what} it)") from None
        if time.monotonic() > deadline:
            raise ZpathError(f"process {pid} did not {what} within {timeout:.0f}s")
        time.sleep(0.01)


@pytest.fixture
def zpath_cluster() -> Iterator[Callable[..., Any]]:
    """Factory of local clusters, all stopped (and checked gone) after the test."""
    stack = contextlib.ExitStack()

    def start(islands: int = 2, hosts_per_island: int = 1, devices_per_host: int = 2, **kwargs: Any) -> Any:
        return stack.enter_context(running_cluster(islands=islands, hosts_per_island=hosts_per_island,
                                                   devices_per_host=devices_per_host, **kwargs))

    with stack:
        yield start


@pytest.fixture(scope="session")
def zpath_session_cluster() -> Iterator[Any]:
    """One local cluster of the default shape for the whole test session."""
    with running_cluster(**default_shape()) as c:
        yield c


@pytest.fixture
def zpath_target(zpath_session_cluster: Any) -> Any:
    """The cluster ``zpath_client`` connects to; override to choose another."""
    return zpath_session_cluster


@pytest.fixture
def zpath_client(zpath_target: Any) -> Iterator[Any]:
    """A connection (``zp.connect``) to ``zpath_target``, shut down after the test."""
    with connected(zpath_target) as conn:
        yield conn


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1,
               what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something true, and return that;
    fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (got := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached in {timeout} s")
        time.sleep(interval)
    return got
