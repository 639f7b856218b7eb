"""Connection files: how a process of the same user on the same machine finds a
local cluster and its key without ceremony (as a Jupyter connection file, or
``ray.init(address="auto")``).

A launcher whose controller runs on this machine (``zp.init()``, ``zpath up``)
writes, once every worker has registered, ``<runtime dir>/cluster-<pid>.json``
(mode 0600, in a directory of mode 0700; ``pid`` is the controller's) holding
the address, the key a client signs with, and the controller's pid and start
time; it removes the file when it stops. ``zp.connect(address)`` takes the key
of the live cluster at ``address``; ``zp.connect()`` takes the newest live
cluster. A file whose controller is gone (a launcher killed with SIGKILL) is
ignored, and removed when seen."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import psutil

from zpath.config import ClientConfig, CommonConfig
from zpath.errors import ZpathError
from zpath.keys import key_from_config, parse_key

PREFIX = "cluster-"
SUFFIX = ".json"
# address hosts that name this machine's loopback interface
_LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]"}


def runtime_dir(configured: str = "") -> str:
    """The directory of connection files: ``configured`` (ZPATH_RUNTIME_DIR) or
    ~/.zpath/run."""
    return configured or os.path.join(os.path.expanduser("~"), ".zpath", "run")


@dataclasses.dataclass(frozen=True)
class ConnectionInfo:
    """One live local cluster, as its connection file describes it."""
    address: str
    key: str            # hex
    pid: int            # the controller's
    create_time: float  # the controller's start time (psutil), so a reused pid is not taken
    started: float      # time.time() when the file was written
    path: str = ""


def same_address(a: str, b: str) -> bool:
    """Whether two controller addresses name the same endpoint (``localhost``
    and ``127.0.0.1`` are one host)."""
    return _normal(a) == _normal(b)


def _normal(address: str) -> str:
    scheme, _, rest = address.strip().partition("://")
    host, sep, port = rest.rpartition(":")
    if sep and host in _LOOPBACK:
        host = "127.0.0.1"
    return f"{scheme}://{host}{sep}{port}" if sep else address.strip()


def _alive(pid: int, create_time: float) -> bool:
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - create_time) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def write(directory: str, address: str, key: bytes, pid: int) -> str:
    """Write the connection file of the cluster at ``address`` whose controller
    is process ``pid``; returns its path."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    info = {"address": address, "key": key.hex(), "pid": pid,
            "create_time": psutil.Process(pid).create_time(), "started": time.time()}
    path = os.path.join(directory, f"{PREFIX}{pid}{SUFFIX}")
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)
    return path


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _read(path: str) -> ConnectionInfo | None:
    """The file at ``path`` if it is this user's, well formed, and its
    controller still runs; a stale file (its controller gone) is removed."""
    try:
        st = os.stat(path)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            return None             # not ours, or readable by others: never trusted
        with open(path) as f:
            raw: Any = json.load(f)
        info = ConnectionInfo(str(raw["address"]), str(raw["key"]), int(raw["pid"]),
                              float(raw["create_time"]), float(raw["started"]), path)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not _alive(info.pid, info.create_time):
        remove(path)
        return None
    return info


def live(directory: str) -> list[ConnectionInfo]:
    """The live local clusters of ``directory``, newest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [_read(os.path.join(directory, n)) for n in names
             if n.startswith(PREFIX) and n.endswith(SUFFIX)]
    return sorted((i for i in found if i is not None), key=lambda i: i.started, reverse=True)


def find(directory: str, address: str | None = None) -> ConnectionInfo | None:
    """The live cluster at ``address``, or the newest when ``address`` is None."""
    for info in live(directory):
        if address is None or same_address(info.address, address):
            return info
    return None


def client_key(address: str, config: ClientConfig, common: CommonConfig | None = None) -> bytes:
    """The key a client of the cluster at ``address`` signs with when none is
    given: the connection file of a live local cluster at that address, else
    ``ZPATH_KEY``/``ZPATH_KEY_FILE`` (``common``, default from the
    environment); a ZpathError saying how to pass it when there is none."""
    local = find(runtime_dir(config.runtime_dir), address)
    if local is not None:
        return parse_key(local.key, f"the key in {local.path}")
    common = CommonConfig.from_env() if common is None else common
    if common.key or common.key_file:
        return key_from_config(common)
    raise ZpathError(f"no cluster key for {address}: no cluster of this user on this machine has "
                     "that address, so pass the key: zp.connect(address, key=...) with the hex key, "
                     "or set ZPATH_KEY (hex) or ZPATH_KEY_FILE (the key file `zpath up` prints, "
                     "copied from the machine that runs the cluster)")
