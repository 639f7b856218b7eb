"""Local launcher: starts a controller and one worker process per host on this
machine, waits until every worker has registered, and stops them all.

Every process it starts is stopped by pid: SIGTERM, then SIGKILL after a grace
period (a process stuck inside XLA may ignore SIGTERM)."""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from zpath.errors import DeadlineExceeded, ZpathError
from zpath.keys import new_key, write_key_file

log = logging.getLogger(__name__)

START_TIMEOUT_S = float(os.environ.get("ZPATH_START_TIMEOUT", "120"))
GRACE_S = 5.0


def die_with_parent() -> None:
    """Called early in a controller or worker started by this launcher: ask the
    kernel for SIGKILL when the launching process dies (Linux), so a crashed
    launcher leaves no orphans. Done in the child, not with ``preexec_fn``, which
    would force a plain fork() of a multithreaded (JAX) parent."""
    parent = os.environ.pop("ZPATH_PARENT_PID", None)
    if not parent:
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):   # the parent died before we asked
        os._exit(1)


def free_port(host: str) -> int:
    """A TCP port that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_shape() -> dict[str, int]:
    """A shape that suits a small machine: two single-host islands with two
    devices each (one worker process per core on a 2-core machine)."""
    return {"islands": 2, "hosts_per_island": 1, "devices_per_host": 2}


class LocalCluster:
    """A controller and ``islands * hosts_per_island`` workers on this machine."""

    def __init__(self, islands: int = 2, hosts_per_island: int = 1, devices_per_host: int = 2, *,
                 log_dir: str | None = None, bind_host: str = "127.0.0.1",
                 start_timeout: float = START_TIMEOUT_S, env: dict[str, str] | None = None,
                 dcn_latency_ms: float = 0.0, dcn_gbps: float = 0.0, dcn_encrypt: bool = False) -> None:
        """``dcn_latency_ms``/``dcn_gbps`` emulate a data-centre network between
        islands (added one-way latency, bandwidth cap of each host's link; 0: none);
        ``dcn_encrypt`` encrypts traffic between islands with CURVE."""
        for name, v in (("islands", islands), ("hosts_per_island", hosts_per_island),
                        ("devices_per_host", devices_per_host)):
            if int(v) < 1:
                raise ValueError(f"{name} must be at least 1, got {v}")
        self.islands, self.hosts_per_island, self.devices_per_host = islands, hosts_per_island, devices_per_host
        if dcn_latency_ms < 0 or dcn_gbps < 0:
            raise ValueError("dcn_latency_ms and dcn_gbps must be >= 0")
        if dcn_encrypt:
            import zmq
            if not zmq.has("curve"):
                raise ZpathError(f"dcn_encrypt needs CURVE, but this libzmq ({zmq.zmq_version()}) "
                                 "was built without it")
        self.dcn_flags = ["--dcn-latency-ms", str(float(dcn_latency_ms)), "--dcn-gbps",
                          str(float(dcn_gbps)), *(["--dcn-encrypt"] if dcn_encrypt else [])]
        self.key = new_key()
        from zpath.net.channels import shm_prefix
        self.shm_prefix = shm_prefix(self.key)    # names of its shared-memory segments
        self._own_dir = log_dir is None
        self.dir = log_dir or tempfile.mkdtemp(prefix="zpath-")
        os.makedirs(self.dir, exist_ok=True)
        self.key_file = os.path.join(self.dir, "cluster.key")
        write_key_file(self.key_file, self.key)
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.address = ""
        self._env = dict(os.environ, **(env or {}))
        self._env["ZPATH_KEY"] = self.key.hex()
        self._env["ZPATH_PARENT_PID"] = str(os.getpid())
        self._env.pop("ZPATH_CONTROLLER", None)
        try:
            self._start(bind_host, start_timeout)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        out = open(os.path.join(self.dir, f"{name}.log"), "ab")
        p = subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env)
        out.close()
        self.procs.append((name, p))
        return p

    def _start(self, bind_host: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        addr_file = os.path.join(self.dir, "controller.address")
        if os.path.exists(addr_file):      # left by an earlier cluster in this directory
            os.unlink(addr_file)
        ctl = self._spawn("controller", ["zpath.controller", "--bind", f"tcp://{bind_host}:0",
                                         "--address-file", addr_file], self._env)
        while not os.path.exists(addr_file):
            self._check_alive(deadline)
            time.sleep(0.02)
        with open(addr_file) as f:
            self.address = f.read().strip()
        wenv = dict(self._env)
        flags = [f for f in wenv.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        wenv["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={self.devices_per_host}"])
        self._worker_env, self.bind_host = wenv, bind_host
        for island in range(self.islands):
            runtime: list[str] = []
            if self.hosts_per_island > 1:   # the island's hosts share one JAX runtime
                runtime = ["--coordinator", f"{bind_host}:{free_port(bind_host)}",
                           "--num-processes", str(self.hosts_per_island)]
            for h in range(self.hosts_per_island):
                self._spawn(f"worker-i{island}-h{h}", ["zpath.worker", "--controller", self.address,
                                                       "--island", str(island), "--bind-host", bind_host,
                                                       "--name", f"local-i{island}-h{h}", *runtime,
                                                       *(["--process-id", str(h)] if runtime else []),
                                                       *self.dcn_flags],
                            wenv)
        self._wait_registered(deadline)
        log.info("local cluster up at %s (pid %d), logs in %s", self.address, ctl.pid, self.dir)

    def add_worker(self, island: int, timeout: float = START_TIMEOUT_S) -> str:
        """Start one more worker (a new host) on a single-host island, e.g. to
        replace a lost one; returns its process name once it has registered."""
        if self.hosts_per_island != 1:
            raise ZpathError("hosts can be added only to single-host islands (a multi-host "
                             "island's JAX runtime has a fixed size)")
        n = sum(1 for name, _ in self.procs if name.startswith(f"worker-i{island}-"))
        name = f"worker-i{island}-h{n}"
        p = self._spawn(name, ["zpath.worker", "--controller", self.address, "--island", str(island),
                               "--bind-host", self.bind_host, "--name", f"local-i{island}-h{n}",
                               *self.dcn_flags],
                        self._worker_env)
        self._wait_registered(time.monotonic() + timeout, extra=1, watch=[(name, p)])
        return name

    def _check_alive(self, deadline: float, watch: list | None = None) -> None:
        for name, p in self.procs if watch is None else watch:
            if p.poll() is not None:
                raise ZpathError(f"{name} exited with code {p.returncode} during start-up:\n"
                                 f"{self.log_tail(name)}")
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"local cluster did not start in time; logs in {self.dir}")

    def _wait_registered(self, deadline: float, extra: int = 0, watch: list | None = None) -> None:
        from zpath.client import Client
        from zpath.net import messages as m

        want = self.islands * self.hosts_per_island + extra
        c = Client(self.address, self.key, name="launcher")
        try:
            while True:
                status = c.request(m.StatusRequest(False))
                if len(status.hosts) + len(status.lost) >= want:
                    return
                self._check_alive(deadline, watch)
                time.sleep(0.1)
        finally:
            c.close()

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            with open(os.path.join(self.dir, f"{name}.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def pids(self) -> list[int]:
        return [p.pid for _, p in self.procs]

    def stop(self, grace: float = GRACE_S) -> None:
        """Stop every process this cluster started: SIGTERM, then SIGKILL."""
        for _, p in reversed(self.procs):
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for name, p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM; killing it", name, p.pid)
                p.kill()
                p.wait(5)
        self.procs.clear()
        # segments of workers that died without cleaning up (SIGKILL)
        from zpath.net.channels import cleanup
        cleanup(self.shm_prefix)
        if self._own_dir and not os.environ.get("ZPATH_KEEP_LOGS"):
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
