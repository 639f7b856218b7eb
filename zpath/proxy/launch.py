"""Starting the IFRT proxy server beside a cluster (``zpath up --ifrt-proxy``,
``zp.init(ifrt_proxy=...)``): a ``python -m zpath.proxy`` process that the
cluster's launcher owns, so it stops with the cluster. Imports neither JAX nor
grpcio (the CLI imports it)."""
from __future__ import annotations

import ipaddress
import os
import sys
import time
from typing import Any

from zpath.errors import ZpathError

PROCESS_NAME = "ifrt-proxy"


def is_loopback(address: str) -> bool:
    """Whether HOST:PORT names this machine's loopback interface only."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_address(listen: str) -> str:
    """HOST:PORT from what the user gave: PORT or :PORT alone is loopback."""
    if ":" not in listen:
        listen = ":" + listen
    host, port = listen.rsplit(":", 1)
    if not port.isdigit():
        raise ValueError(f"ifrt_proxy must be HOST:PORT or PORT, not {listen!r}")
    return f"{host or '127.0.0.1'}:{port}"


def start_proxy(cluster: Any, listen: str, timeout: float = 60.0, platform: str | None = None,
                insecure: bool = False) -> str:
    """Start the IFRT proxy for ``cluster`` (a ClusterLauncher that is up),
    serving at ``listen`` (HOST:PORT, or PORT for 127.0.0.1:PORT; port 0: a
    free one); returns the HOST:PORT it serves at once it listens. A
    non-loopback HOST needs ``insecure`` (the service has no authentication)."""
    listen = listen_address(listen)
    addr_file = os.path.join(cluster.dir, "ifrt-proxy.address")
    if os.path.exists(addr_file):
        os.unlink(addr_file)
    p = cluster._spawn(PROCESS_NAME, [sys.executable, "-m", "zpath.proxy", "--listen", listen,
                                      "--controller", cluster.address, "--address-file", addr_file]
                     + (["--platform", platform] if platform else []) + (["--insecure"] if insecure else []),
                     cluster._env)
    deadline = time.monotonic() + timeout
    while not os.path.exists(addr_file):
        if p.poll() is not None:
            raise ZpathError(f"the IFRT proxy exited ({p.returncode}) while starting:\n"
                             f"{cluster.log_tail(PROCESS_NAME)}")
        if time.monotonic() > deadline:
            raise ZpathError(f"the IFRT proxy did not start within {timeout:g}s:\n{cluster.log_tail(PROCESS_NAME)}")
        time.sleep(0.05)
    with open(addr_file) as f:
        return f.read().strip()
