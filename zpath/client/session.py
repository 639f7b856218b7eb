"""Connecting to a cluster from the user's process: ``init`` (start a local
cluster and connect), ``connect`` (join a running one), ``shutdown``; ``trace``
(a timeline of what ran, as Chrome Trace Event JSON)."""
from __future__ import annotations

import atexit
import os
import re
import warnings
from contextlib import AbstractContextManager
from typing import Any

from zpath.client import trace as trace_file
from zpath.client.api import _current, current_client, whole_number
from zpath.client.connection import Client
from zpath.cluster import connfile
from zpath.cluster.launcher import SHARED_GPU_ENV, LocalCluster, default_shape
from zpath.config import ClientConfig, ClusterConfig, CommonConfig
from zpath.errors import ZpathError
from zpath.keys import parse_key
from zpath.proxy.launch import start_proxy

__all__ = ["Cluster", "init", "connect", "shutdown", "trace"]


class Cluster:
    """What ``init``/``connect`` return: the connection, and the local cluster
    when ``init`` started one."""

    def __init__(self, client: Any, local: Any = None) -> None:
        self.client = client
        self.local = local
        self.ifrt_proxy: str | None = None     # HOST:PORT of its IFRT proxy (zp.init(ifrt_proxy=))

    @property
    def address(self) -> str:
        return self.client.address

    @property
    def key(self) -> bytes:
        return self.client.ep.key

    @property
    def hosts(self) -> dict:
        return self.client.hosts

    def __repr__(self) -> str:
        kind = "local" if self.local else "remote"
        return f"Cluster({kind}, address={self.address!r}, hosts={len(self.hosts)})"


_cluster: dict[str, Cluster | None] = {"current": None}


def init(islands: int | None = None, hosts_per_island: int | None = None,
         devices_per_host: int | None = None, *, weight: float = 1.0,
         config: ClientConfig | None = None, cluster_config: ClusterConfig | None = None,
         ifrt_proxy: str | None = None, **kwargs: Any) -> Cluster:
    """Start a local cluster (controller + one worker process per host) and
    connect to it with a proportional-share ``weight``. With ``ZPATH_CONTROLLER``
    set, connect to that cluster instead. Other keyword arguments go to
    :class:`zpath.cluster.launcher.LocalCluster` (e.g. ``policy``, ``dcn_gbps``).
    ``config``/``cluster_config``: the client's and the launcher's settings
    (default: from the environment, see ``python -m zpath.config``).
    ``ifrt_proxy``: PORT, or a loopback HOST:PORT (port 0: a free one), where the
    local cluster also serves the IFRT proxy protocol to unmodified JAX clients
    (``JAX_PLATFORMS=proxy``; the served address is ``cluster.ifrt_proxy``; another
    HOST needs ``zpath up --ifrt-proxy-insecure``, docs/design.md: Security model)."""
    if _cluster["current"] is not None:
        raise ZpathError("already initialised: call zp.shutdown() first")
    _check_weight(weight)
    config = ClientConfig.from_env() if config is None else config
    if config.controller:
        given = [k for k, v in (("islands", islands), ("hosts_per_island", hosts_per_island),
                                ("devices_per_host", devices_per_host)) if v is not None] + list(kwargs)
        if ifrt_proxy is not None:
            raise ZpathError("ZPATH_CONTROLLER is set: zp.init() connects to that cluster and cannot "
                             "start an IFRT proxy for it (start it with `zpath up --ifrt-proxy HOST:PORT`)")
        if given:
            warnings.warn(f"ZPATH_CONTROLLER is set: zp.init() connects to that cluster and "
                          f"ignores {', '.join(given)}", stacklevel=2)
        return connect(config.controller, weight=weight, config=config)
    cluster_config = ClusterConfig.from_env() if cluster_config is None else cluster_config
    shape = default_shape()
    for k, v in (("islands", islands), ("hosts_per_island", hosts_per_island),
                 ("devices_per_host", devices_per_host)):
        if v is not None:
            whole_number(k, v, 1)
            shape[k] = v
    # this process shares the machine's GPUs with the cluster's workers (where
    # JAX has not taken its share of one yet: see launcher.SHARED_GPU_ENV)
    for name, value in SHARED_GPU_ENV.items():
        os.environ.setdefault(name, value)
    local = LocalCluster(**shape, config=cluster_config, **kwargs)
    try:
        served = start_proxy(local, ifrt_proxy) if ifrt_proxy is not None else None
        cluster = _attach(local.address, local.key, local, weight=weight, config=config)
        cluster.ifrt_proxy = served
    except BaseException:
        local.stop()
        raise
    if os.getpid() not in _at_exit:     # a script that ends without zp.shutdown() (an
        atexit.register(_shutdown_at_exit, os.getpid())   # uncaught exception, say) still
        _at_exit.append(os.getpid())                        # stops what it started
    return cluster


_at_exit: list[int] = []       # processes that registered the hook (a forked child needs its own)


def _shutdown_at_exit(pid: int) -> None:
    """``shutdown`` when the process that started the cluster exits (not a
    child it forked: the cluster, its files and segments are the parent's)."""
    if os.getpid() == pid:
        shutdown()


def connect(address: str | None = None, key: bytes | str | None = None, *, name: str = "client",
            timeout: float | None = None, weight: float = 1.0,
            config: ClientConfig | None = None) -> Cluster:
    """Connect to a running cluster: the one at ``address``, or with no address
    the newest cluster this user runs on this machine (``zp.init()`` or ``zpath
    up`` in another process). The key comes from ``key`` (bytes or hex), else
    the connection file of a local cluster at ``address`` (no key needed on
    the machine that runs the cluster), else ``ZPATH_KEY`` or
    ``ZPATH_KEY_FILE``. ``weight`` is this client's share of the devices under
    the proportional-share policy (its device time relative to the other
    clients' that keep the same devices busy). ``timeout``: seconds to wait for
    the controller's welcome (default ``config.connect_timeout_s``); ``config``:
    the client's settings (default: from the environment)."""
    if _cluster["current"] is not None:
        raise ZpathError("already connected: call zp.shutdown() first")
    config = ClientConfig.from_env() if config is None else config
    if address is None:
        newest = connfile.find(connfile.runtime_dir(config.runtime_dir))
        if newest is None:
            raise ZpathError("no local cluster is running for this user (none in "
                             f"{connfile.runtime_dir(config.runtime_dir)}): start one with zp.init() "
                             "or `zpath up`, or pass the address of a running one")
        address = newest.address
    if not isinstance(address, str) or not re.match(r"^(tcp|ipc)://\S+$", address):
        raise ZpathError(f"{address!r} is not a cluster address: expected tcp://HOST:PORT "
                         "(as `zpath up` prints it)")
    key = connfile.client_key(address, config) if key is None else parse_key(key)
    return _attach(address, key, None, name=name, timeout=timeout, weight=weight, config=config)


def _check_weight(weight: Any) -> None:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1e6:
        raise ValueError(f"weight must be a number > 0 and <= 1e6, not {weight!r}")


def _attach(address: str, key: bytes, local: Any, *, config: ClientConfig, name: str = "client",
            timeout: float | None = None, weight: float = 1.0) -> Cluster:
    _check_weight(weight)
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, not {timeout!r}")
    client = Client(address, key, name=name, timeout=timeout, weight=float(weight), config=config)
    cluster = Cluster(client, local)
    _cluster["current"] = cluster
    _current["client"] = client
    return cluster


def shutdown() -> None:
    """Disconnect; also stop the local cluster if ``init`` started one."""
    cluster = _cluster["current"]
    _cluster["current"] = None
    _current["client"] = None
    if cluster is None:
        return
    try:
        cluster.client.close()
    finally:
        if cluster.local is not None:
            cluster.local.stop()


def trace(path: str) -> AbstractContextManager[trace_file.Recorder]:
    """``with zp.trace("trace.json"): ...`` writes, when the block ends, a Chrome
    Trace Event JSON file (open it in ui.perfetto.dev) of what ran on the cluster
    meanwhile: this client's calls, programs and fetches, every computation on every
    device (all clients'), transfers with their channel and bytes, clocks aligned
    (zpath/client/trace.py)."""
    return trace_file.trace(path, current_client())
