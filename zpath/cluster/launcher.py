"""Launchers: start a controller on this machine and one worker process per
host (here for ``LocalCluster``, over SSH for ``zpath.cluster.ssh.SSHCluster``), wait
until every worker has registered, and stop them all.

Every process it starts is stopped by pid: SIGTERM, then SIGKILL after a grace
period (a process stuck inside XLA may ignore SIGTERM)."""
from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import zmq

from zpath.client.connection import Client
from zpath.cluster import connfile
from zpath.config import DEFAULT_SHAPE, POLICIES, ClusterConfig
from zpath.errors import DeadlineExceeded, ZpathError
from zpath.keys import new_key, write_key_file
from zpath.net import messages as m
from zpath.net.channels import cleanup, shm_prefix
from zpath.process import PARENT_PID_ENV

log = logging.getLogger(__name__)

GRACE_S = 5.0


def stop_processes(procs: list[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM every still-running process, then SIGKILL those still running
    after ``grace`` seconds (a process stuck in XLA may ignore SIGTERM)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def free_port(host: str) -> int:
    """A TCP port that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# listen_port's ports: at random from here to the kernel's range for outgoing
# connections, this many tries
LISTEN_PORT_MIN = 20_000
LISTEN_PORT_TRIES = 50
# (its own generator: a caller that seeds the random module's does not make two
# processes pick the same ports)
_PORTS = random.Random()


def _outgoing_ports_low() -> int:
    """The lowest port the kernel gives an outgoing connection (Linux's
    ip_local_port_range; 32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def listen_port(host: str, rng: random.Random | None = None) -> int:
    """A TCP port free now, for a process started later to listen on. A port
    the OS picks (``free_port``) comes from the range it also gives outgoing
    connections, so any connection made meanwhile on this machine (another
    cluster's, a test's) may take it first; this one is below that range,
    tried at random, free when checked (any free port where none is found)."""
    rng = rng or _PORTS
    low = _outgoing_ports_low()
    for _ in range(LISTEN_PORT_TRIES if low > LISTEN_PORT_MIN else 0):
        port = rng.randrange(LISTEN_PORT_MIN, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    return free_port(host)


# tries of a launch whose controller port, free when chosen, was taken before the controller listened
BIND_ATTEMPTS = 3


def _free_port_or_zero(host: str) -> int:
    """A port free now on ``host``, or 0 where none can be found that way (the
    controller then picks one, and the workers start once it listens)."""
    try:
        return listen_port(host)
    except OSError:
        return 0


def default_shape() -> dict[str, int]:
    """A shape that suits a small machine: two single-host islands with two
    devices each (one worker process per core on a 2-core machine)."""
    return dict(DEFAULT_SHAPE)


def worker_xla_flags(env: dict[str, str], devices: int) -> str:
    """``XLA_FLAGS`` of ``env`` with the emulated device count set to ``devices``."""
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])


# By default JAX takes 75% of a GPU's memory in each process when it first uses
# the GPU: the processes of a local cluster share the machine's GPUs, and the
# second would find none left. Unless the environment says otherwise, a local
# cluster's processes allocate GPU memory as they need it instead.
SHARED_GPU_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def local_worker_env(env: dict[str, str], devices: int) -> dict[str, str]:
    """The environment of a local cluster's workers: ``env`` with the emulated
    device count set (``worker_xla_flags``) and, where ``env`` does not set it,
    GPU memory allocated as needed (``SHARED_GPU_ENV``: the workers share the
    machine's GPUs)."""
    return {**SHARED_GPU_ENV, **env, "XLA_FLAGS": worker_xla_flags(env, devices)}


def dcn_flags(dcn_latency_ms: float, dcn_gbps: float, dcn_encrypt: bool) -> list[str]:
    """The ``zpath worker`` flags of an emulated DCN; checks the values."""
    if dcn_latency_ms < 0 or dcn_gbps < 0:
        raise ValueError("dcn_latency_ms and dcn_gbps must be >= 0")
    if dcn_encrypt:
        if not zmq.has("curve"):
            raise ZpathError(f"dcn_encrypt needs CURVE, but this libzmq ({zmq.zmq_version()}) "
                             "was built without it")
    return ["--dcn-latency-ms", str(float(dcn_latency_ms)), "--dcn-gbps",
            str(float(dcn_gbps)), *(["--dcn-encrypt"] if dcn_encrypt else [])]


class ClusterLauncher:
    """What the local and the SSH launcher share: the cluster key and its key
    file, the log directory, the controller (always a local process), waiting
    until every worker has registered, and stopping every process started.

    A subclass starts its workers in ``_start_workers`` (each through
    ``_spawn``, recording the worker name it expects in ``self.expected``) and
    may describe a failed process better in ``_describe_exit``."""

    kind = "cluster"

    def __init__(self, *, log_dir: str | None = None, env: dict[str, str] | None = None,
                 policy: str | None = None, config: ClusterConfig | None = None) -> None:
        """``policy``: the controller's multi-tenant scheduling policy, "share"
        (proportional share, the default) or "fifo". ``config``: the launcher's
        settings (default: the defaults, not the environment; ``zpath up``,
        ``zp.init()`` and the pytest plugin build one from it)."""
        if policy is not None and policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r} (choose from {', '.join(POLICIES)})")
        self.config = ClusterConfig() if config is None else config
        self.key = new_key()
        # what only the controller and the workers hold (never written to a file
        # a client reads): a client cannot act as a worker or as another client
        self.worker_key = new_key()
        self.shm_prefix = shm_prefix(self.worker_key)    # names of its shared-memory segments
        self._own_dir = log_dir is None
        self.dir = log_dir or tempfile.mkdtemp(prefix="zpath-")
        os.makedirs(self.dir, exist_ok=True)
        self.key_file = os.path.join(self.dir, "cluster.key")
        write_key_file(self.key_file, self.key)
        self.connection_file = ""     # written once every worker has registered
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.expected: dict[str, str] = {}        # process name -> worker (host) name
        self.address = ""
        self._env = dict(os.environ, **(env or {}))
        self._env["ZPATH_KEY"] = self.key.hex()
        self._env["ZPATH_WORKER_KEY"] = self.worker_key.hex()
        self._env[PARENT_PID_ENV] = str(os.getpid())
        self._env.pop("ZPATH_CONTROLLER", None)
        if policy is not None:
            self._env["ZPATH_SCHEDULER_POLICY"] = policy

    def _launch(self, bind_host: str, timeout: float, controller_port: int = 0) -> None:
        """Start the controller and the workers; wait until all registered.
        Stops what it started if any of it fails.

        The workers start while the controller starts (importing takes each
        process about half a second or more), at the address the controller
        will have: ``controller_port``, or a port free now. Should another
        process take that port first, the controller cannot listen, and the
        launch starts again on another port (``BIND_ATTEMPTS`` in all)."""
        try:
            deadline = time.monotonic() + timeout
            for attempt in range(BIND_ATTEMPTS):
                port = controller_port or _free_port_or_zero(bind_host)
                self.address = ""
                ctl = self._spawn_controller(bind_host, port)
                if port:
                    self.address = f"tcp://{bind_host}:{port}"   # as the controller will say
                    self._start_workers(deadline)
                try:
                    self._await_controller(ctl, deadline)
                except ZpathError:
                    if controller_port or not port or attempt == BIND_ATTEMPTS - 1 \
                            or ctl.poll() is None or "cannot listen" not in self.log_tail("controller"):
                        raise
                    log.info("port %d was taken before the controller could listen; again", port)
                    self.stop(keep_logs=True)
                    self.expected.clear()
                    continue
                if not port:
                    self._start_workers(deadline)
                break
            self._wait_registered(deadline)
            # how a process of this user on this machine finds it (zp.connect())
            self.connection_file = connfile.write(connfile.runtime_dir(self.config.runtime_dir),
                                                  self.address, self.key, ctl.pid)
            log.info("%s up at %s (pid %d), logs in %s", self.kind, self.address, ctl.pid, self.dir)
        except Exception as e:
            self.stop(keep_logs=True)        # for the user to read: the error says where
            if isinstance(e, ZpathError) and self.dir not in str(e):
                e.args = (f"{e.args[0] if e.args else e}\n(logs in {self.dir})", *e.args[1:])
            raise
        except BaseException:                # Ctrl-C: nothing to look at
            self.stop()
            raise

    def _spawn(self, name: str, argv: list[str], env: dict[str, str],
               stdin: Any = subprocess.DEVNULL) -> subprocess.Popen:
        out = open(os.path.join(self.dir, f"{name}.log"), "ab")
        try:
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=stdin, env=env)
        finally:
            out.close()
        self.procs.append((name, p))
        return p

    def _spawn_with_key(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        """``_spawn`` a remote worker (ssh, srun) that reads the cluster key and
        the worker key from its standard input, a line each
        (zpath.cluster.remote): never on a command line."""
        p = self._spawn(name, argv, env, stdin=subprocess.PIPE)
        try:
            p.stdin.write(self.key.hex().encode() + b"\n" + self.worker_key.hex().encode() + b"\n")
            p.stdin.flush()
        except OSError:
            pass           # it already exited: reported by the wait, with its log
        return p

    def _spawn_controller(self, bind_host: str, port: int) -> subprocess.Popen:
        addr_file = os.path.join(self.dir, "controller.address")
        if os.path.exists(addr_file):      # left by an earlier cluster in this directory
            os.unlink(addr_file)
        return self._spawn("controller", [sys.executable, "-m", "zpath.controller", "--bind",
                                          f"tcp://{bind_host}:{port}", "--address-file", addr_file],
                           self._env)

    def _await_controller(self, ctl: subprocess.Popen, deadline: float) -> None:
        """Wait until the controller listens (it writes its address file)."""
        addr_file = os.path.join(self.dir, "controller.address")
        while not os.path.exists(addr_file):
            self._check_alive(deadline)
            time.sleep(0.01)
        with open(addr_file) as f:
            address = f.read().strip()
        if self.address and address != self.address:
            raise ZpathError(f"the controller listens on {address}, not on {self.address} "
                             "where the workers look for it")
        self.address = address

    def _start_workers(self, deadline: float) -> None:
        raise NotImplementedError

    def _describe_exit(self, name: str, p: subprocess.Popen) -> str:
        return f"{name} exited with code {p.returncode} during start-up:\n{self.log_tail(name)}"

    def _check_alive(self, deadline: float, watch: list | None = None, missing: str = "") -> None:
        for name, p in self.procs if watch is None else watch:
            if p.poll() is not None:
                raise ZpathError(self._describe_exit(name, p))
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"{self.kind} did not start in time{missing}; logs in {self.dir}")

    def _wait_registered(self, deadline: float, watch: list | None = None) -> None:
        want = len(self.expected)       # workers added later are in it too
        c = Client(self.address, self.key, name="launcher")
        try:
            while True:
                status = c.request(m.StatusRequest(False))
                if len(status.hosts) + len(status.lost) >= want:
                    return
                seen = {h.name for h in [*status.hosts, *status.lost]}
                missing = [f"{w} ({n})" for n, w in self.expected.items() if w not in seen]
                self._check_alive(deadline, watch,
                                  f"; not registered: {', '.join(missing)}" if missing else "")
                time.sleep(0.1)
        finally:
            c.close()

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            with open(os.path.join(self.dir, f"{name}.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stacks(self, timeout: float = 5.0) -> str:
        """Every thread's stack in each running process of this cluster, for a
        report of a hang: each is sent SIGUSR1 (its faulthandler writes the
        stacks to its log) and what its log gains is returned, once it stops
        growing (at most ``timeout`` s in all)."""
        sizes = {}
        for name, p in self.procs:
            path = os.path.join(self.dir, f"{name}.log")
            if p.poll() is None and os.path.exists(path):
                sizes[name] = (path, os.path.getsize(path), p.pid)
                try:
                    p.send_signal(signal.SIGUSR1)
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        grown: dict[str, int] = {}
        while time.monotonic() < deadline:     # until every log has grown and stopped
            now = {n: os.path.getsize(path) for n, (path, _, _) in sizes.items()}
            if all(now[n] > sizes[n][1] for n in sizes) and now == grown:
                break
            grown = now
            time.sleep(0.2)
        out = []
        for name, (path, start, pid) in sizes.items():
            with open(path, "rb") as f:
                f.seek(start)
                out.append(f"---- {name} (pid {pid})\n"
                           + f.read().decode(errors="replace"))
        return "\n".join(out)

    @property
    def pids(self) -> list[int]:
        return [p.pid for _, p in self.procs]

    def _ask_to_stop(self, name: str, p: subprocess.Popen) -> None:
        p.send_signal(signal.SIGTERM)

    def stop(self, grace: float = GRACE_S, keep_logs: bool = False) -> None:
        """Stop every process this cluster started: SIGTERM, then SIGKILL. The
        log directory goes too if the cluster made it, unless ``keep_logs``
        or ``config.keep_logs`` (ZPATH_KEEP_LOGS). Its connection file goes first."""
        if self.connection_file:
            connfile.remove(self.connection_file)
            self.connection_file = ""
        for name, p in reversed(self.procs):
            if p.poll() is None:
                try:
                    self._ask_to_stop(name, p)
                except (ProcessLookupError, OSError):
                    pass
        deadline = time.monotonic() + grace
        for name, p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM; killing it", name, p.pid)
                p.kill()
                p.wait(5)
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass
        self.procs.clear()
        # segments of workers on this machine that died without cleaning up (SIGKILL)
        cleanup(self.shm_prefix)
        if self._own_dir and not keep_logs and not self.config.keep_logs:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "ClusterLauncher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class LocalCluster(ClusterLauncher):
    """A controller and ``islands * hosts_per_island`` workers on this machine."""

    kind = "local cluster"

    def __init__(self, islands: int = 2, hosts_per_island: int = 1, devices_per_host: int = 2, *,
                 log_dir: str | None = None, bind_host: str = "127.0.0.1",
                 start_timeout: float | None = None, env: dict[str, str] | None = None,
                 dcn_latency_ms: float = 0.0, dcn_gbps: float = 0.0, dcn_encrypt: bool = False,
                 policy: str | None = None, controller_port: int = 0,
                 config: ClusterConfig | None = None) -> None:
        """``dcn_latency_ms``/``dcn_gbps`` emulate a data-centre network between
        islands (added one-way latency, bandwidth cap of each host's link; 0: none);
        ``dcn_encrypt`` encrypts traffic between islands with CURVE; ``policy``
        is the multi-tenant scheduling policy ("share" or "fifo");
        ``controller_port``: the controller's port (0: a free one);
        ``start_timeout``: seconds for every worker to register (default
        ``config.start_timeout_s``)."""
        for name, v in (("islands", islands), ("hosts_per_island", hosts_per_island),
                        ("devices_per_host", devices_per_host)):
            if int(v) < 1:
                raise ValueError(f"{name} must be at least 1, got {v}")
        self.islands, self.hosts_per_island, self.devices_per_host = islands, hosts_per_island, devices_per_host
        self.dcn_flags = dcn_flags(dcn_latency_ms, dcn_gbps, dcn_encrypt)
        super().__init__(log_dir=log_dir, env=env, policy=policy, config=config)
        self.bind_host = bind_host
        self._worker_env = local_worker_env(self._env, devices_per_host)
        self._launch(bind_host, self.config.start_timeout_s if start_timeout is None else start_timeout,
                     controller_port)

    def _spawn_worker(self, island: int, h: int, runtime: list[str], rank: int = -1
                      ) -> tuple[str, subprocess.Popen]:
        name, host = f"worker-i{island}-h{h}", f"local-i{island}-h{h}"
        self.expected[name] = host
        p = self._spawn(name, [sys.executable, "-m", "zpath.worker", "--controller", self.address,
                               "--island", str(island), "--bind-host", self.bind_host,
                               "--name", host, "--rank", str(rank), *runtime, *self.dcn_flags],
                        self._worker_env)
        return name, p

    def _start_workers(self, deadline: float) -> None:
        for island in range(self.islands):
            runtime: list[str] = []
            if self.hosts_per_island > 1:   # the island's hosts share one JAX runtime
                runtime = ["--coordinator", f"{self.bind_host}:{listen_port(self.bind_host)}",
                           "--num-processes", str(self.hosts_per_island)]
            for h in range(self.hosts_per_island):
                # ranks in island and host order, whatever order they register in
                self._spawn_worker(island, h, [*runtime, *(["--process-id", str(h)] if runtime else [])],
                                   rank=island * self.hosts_per_island + h)

    def add_worker(self, island: int, timeout: float | None = None) -> str:
        """Start one more worker (a new host) on a single-host island, e.g. to
        replace a lost one; returns its process name once it has registered
        (within ``timeout`` s, default ``config.start_timeout_s``)."""
        if self.hosts_per_island != 1:
            raise ZpathError("hosts can be added only to single-host islands (a multi-host "
                             "island's JAX runtime has a fixed size)")
        n = sum(1 for name, _ in self.procs if name.startswith(f"worker-i{island}-"))
        name, p = self._spawn_worker(island, n, [])
        timeout = self.config.start_timeout_s if timeout is None else timeout
        self._wait_registered(time.monotonic() + timeout, watch=[(name, p)])
        return name

    def __enter__(self) -> "LocalCluster":
        return self


class SimulatedCluster(ClusterLauncher):
    """A controller and ``hosts`` simulated hosts (``zpath worker --simulate``:
    no JAX, computations occupy their devices for an emulated time) in
    ``processes`` processes on this machine, for scale work. Each process holds
    whole islands (``islands`` must be a multiple of ``processes``), so killing
    one process loses its islands' hosts."""

    kind = "simulated cluster"

    def __init__(self, hosts: int, devices_per_host: int = 4, *, islands: int = 1, processes: int = 1,
                 cost_ms: float = 1.0, transfer_us: float = 0.0, transfer_gbps: float = 0.0,
                 log_dir: str | None = None, start_timeout: float | None = None,
                 env: dict[str, str] | None = None, policy: str | None = None,
                 config: ClusterConfig | None = None) -> None:
        for name, v in (("hosts", hosts), ("devices_per_host", devices_per_host), ("islands", islands),
                        ("processes", processes)):
            if int(v) < 1:
                raise ValueError(f"{name} must be at least 1, got {v}")
        if hosts % islands or islands % processes:
            raise ValueError(f"hosts ({hosts}) must be a multiple of islands ({islands}), and islands "
                             f"a multiple of processes ({processes})")
        self.hosts, self.devices_per_host, self.islands, self.processes = hosts, devices_per_host, islands, processes
        self.sim_flags = ["--devices", str(devices_per_host), "--cost-ms", str(float(cost_ms)),
                          "--transfer-us", str(float(transfer_us)), "--transfer-gbps", str(float(transfer_gbps))]
        super().__init__(log_dir=log_dir, env=env, policy=policy, config=config)
        self._launch("127.0.0.1", self.config.start_timeout_s if start_timeout is None else start_timeout)

    def _start_workers(self, deadline: float) -> None:
        per_proc, islands_per_proc = self.hosts // self.processes, self.islands // self.processes
        for p in range(self.processes):
            name = f"sim-p{p}"
            for h in range(per_proc):
                self.expected[f"{name}/h{h}"] = f"{name}-h{h}"
            self._spawn(name, [sys.executable, "-m", "zpath", "worker", "--simulate", "--controller",
                               self.address, "--hosts", str(per_proc), "--islands", str(islands_per_proc),
                               "--island", str(p * islands_per_proc), "--name", name, *self.sim_flags],
                        self._env)

    def process_of(self, host_name: str) -> subprocess.Popen:
        """The process that runs simulated host ``host_name``."""
        for name, p in self.procs:
            if host_name.startswith(name + "-h"):
                return p
        raise KeyError(host_name)

    def __enter__(self) -> "SimulatedCluster":
        return self
