"""The state file of a running ``zpath up`` and ``zpath down``.

``zpath up`` writes (mode 0600) the cluster's address, key file and log
directory, its own pid, and every process it started: local pids with their
start times (so a reused pid is never killed) and, for SSH workers, the ssh
command that reaches the host and the pid of ``zpath.cluster.remote`` there."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

import psutil

from zpath.errors import ZpathError


def default_path(configured: str = "") -> str:
    """The state file: ``configured`` (ClusterConfig.state, ZPATH_STATE) or
    ~/.zpath/cluster.json."""
    return configured or os.path.join(os.path.expanduser("~"), ".zpath", "cluster.json")


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None


def cluster_state(cluster: Any) -> dict[str, Any]:
    """What ``zpath down`` needs to stop ``cluster`` (a LocalCluster or an
    SSHCluster) without the process that started it."""
    procs = []
    host_of = getattr(cluster, "host_of", {})
    for name, p in cluster.procs:
        entry: dict[str, Any] = {"name": name, "pid": p.pid, "create_time": _create_time(p.pid)}
        if name in host_of:
            entry["remote_pid"] = cluster.remote_pids.get(name, 0)
            entry["ssh"] = cluster.ssh_argv(host_of[name], "")[:-1]
        procs.append(entry)
    return {"address": cluster.address, "key_file": cluster.key_file, "log_dir": cluster.dir,
            "own_log_dir": bool(getattr(cluster, "_own_dir", False)),
            "launcher_pid": os.getpid(), "launcher_create_time": _create_time(os.getpid()),
            "procs": procs}


def lock(path: str) -> Any:
    """Take the lock of state file ``path`` (``path.lock``, created with its
    directory if need be): the open lock file, or None if another process
    holds it. The lock lasts until the file is closed or the process ends,
    however it ends. A path that cannot be used fails here, before anything
    has started."""
    if os.path.isdir(path):
        raise ZpathError(f"the state file {path} is a directory")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        f = open(path + ".lock", "a")
    except OSError as e:
        raise ZpathError(f"cannot use the state file {path}: {e.strerror}") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def write_state(path: str, state: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, path)


def read_state(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ZpathError(f"no cluster state in {path}: {e.strerror}") from None
    except ValueError:
        raise ZpathError(f"{path} is not a zpath state file") from None


def alive(pid: int, create_time: float | None) -> bool:
    try:
        p = psutil.Process(pid)
        return (create_time is None or abs(p.create_time() - create_time) < 1.0) \
            and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def remove_state(path: str, launcher_pid: int | None = None) -> None:
    """Remove the state file (only if it still describes ``launcher_pid``)."""
    try:
        if launcher_pid is not None and read_state(path).get("launcher_pid") != launcher_pid:
            return
        os.unlink(path)
    except (OSError, ZpathError):
        pass


def _made_by_zpath_up(path: str) -> bool:
    """Whether ``path`` looks like the temporary directory a launcher makes
    (``<tmp>/zpath-*`` holding a cluster key): what ``zpath down`` may
    remove, whatever a (perhaps edited) state file says."""
    path = os.path.realpath(path)
    return (os.path.dirname(path) == os.path.realpath(tempfile.gettempdir())
            and os.path.basename(path).startswith("zpath-") and os.path.isdir(path)
            and os.path.isfile(os.path.join(path, "cluster.key")))


def kill_remote(ssh_argv: list[str], pid: int, timeout: float = 20.0) -> bool:
    """SIGTERM the ``zpath.cluster.remote`` process ``pid`` over ssh (checking it is one)."""
    cmd = f"ps -o args= -p {int(pid)} | grep -q zpath.cluster.remote && kill -TERM {int(pid)}"
    try:
        r = subprocess.run([*ssh_argv, cmd], stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=timeout)
    except (subprocess.TimeoutExpired, OSError):
        return False
    return r.returncode == 0


def down(path: str, timeout: float = 30.0, keep_logs: bool = False) -> list[str]:
    """Stop the cluster described in the state file ``path``: ask its ``zpath
    up`` to stop (SIGTERM) and wait for it; if that process is gone or does not
    stop in time, stop the remote workers over ssh and kill the local processes
    listed, and remove the log directory it made unless ``keep_logs``
    (ClusterConfig.keep_logs). Returns what it did, one line each."""
    state = read_state(path)
    done: list[str] = []
    up_pid, up_created = state.get("launcher_pid", 0), state.get("launcher_create_time")
    if up_pid and alive(up_pid, up_created):
        os.kill(up_pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while alive(up_pid, up_created) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not alive(up_pid, up_created):
            done.append(f"stopped zpath up (pid {up_pid}) and the cluster at {state.get('address')}")
            remove_state(path)
            return done
        done.append(f"zpath up (pid {up_pid}) did not stop in {timeout:.0f} s; killing it")
        os.kill(up_pid, signal.SIGKILL)
    for entry in state.get("procs", []):
        if entry.get("remote_pid") and entry.get("ssh"):
            ok = kill_remote(entry["ssh"], entry["remote_pid"])
            done.append(f"{entry['name']}: remote pid {entry['remote_pid']} "
                        f"{'stopped' if ok else 'not running or unreachable'}")
    for entry in state.get("procs", []):
        if alive(entry["pid"], entry.get("create_time")):
            try:
                os.kill(entry["pid"], signal.SIGKILL)
                done.append(f"{entry['name']}: killed local pid {entry['pid']}")
            except ProcessLookupError:
                pass
    remove_state(path)
    # the temporary directory that zpath up made (logs, and the cluster's key),
    # as its own stop would have removed it
    log_dir = state.get("log_dir")
    if state.get("own_log_dir") and log_dir and os.path.isdir(log_dir) \
            and not keep_logs:
        if _made_by_zpath_up(log_dir):
            shutil.rmtree(log_dir, ignore_errors=True)
            done.append(f"removed its log directory {log_dir}")
        else:
            done.append(f"kept its log directory {log_dir}, which holds the cluster key: it is "
                        "not a zpath-* directory in this process's temporary directory")
    if not done:
        done.append("nothing was running")
    return done
