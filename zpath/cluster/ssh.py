"""SSH launcher: the controller runs on this machine, one worker per hostfile
line runs on its host, started over ``ssh``.

Hostfile: one host per line, ``#`` starts a comment::

    # address   [user=U] [port=P] island=I devices=D [python=PATH] [name=N] [bind=ADDR]
    10.0.0.11   user=ml island=0 devices=8 python=/opt/venv/bin/python
    10.0.0.12   user=ml island=0 devices=8 python=/opt/venv/bin/python
    10.0.0.13   user=ml port=2222 island=1 devices=8

Each worker is started as ``ssh -o BatchMode=yes -o ConnectTimeout=T -p P
U@address 'exec PYTHON -m zpath.cluster.remote --devices D -- <worker flags>'``. The
cluster key goes to the ssh process's standard input (never a command line);
``zpath.cluster.remote`` reads it, runs the worker, and stops it when its standard input
closes, so a worker never outlives its ssh session. Hosts that share an island
join one ``jax.distributed`` runtime whose coordinator is the island's first
host."""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import random
import re
import shlex
import socket
import subprocess
from typing import Any, Callable, Sequence

from zpath.cluster.launcher import ClusterLauncher, dcn_flags, free_port
from zpath.config import ClusterConfig
from zpath.errors import ZpathError
from zpath.process import PARENT_PID_ENV

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10
# Local ZPATH_* settings passed on to remote workers (never the key or addresses;
# tests/test_config.py checks that each is a setting of zpath/config.py).
FORWARDED_ENV = ("ZPATH_LOG_LEVEL", "ZPATH_CONTROLLER_TIMEOUT", "ZPATH_SHM", "ZPATH_FETCH_TIMEOUT",
                 "ZPATH_DEVICE_MEMORY_LIMIT", "ZPATH_COMPILE_CACHE", "ZPATH_COLLECTIVES_NICE")


class HostfileError(ZpathError):
    """The hostfile could not be read or a line is malformed."""


@dataclasses.dataclass(frozen=True)
class HostSpec:
    """One hostfile line."""
    address: str
    island: int
    devices: int
    user: str = ""
    port: int = 22
    python: str = ""
    name: str = ""
    bind: str = ""
    line: int = 0

    @property
    def where(self) -> str:
        """How errors name the host: ``user@address:port (hostfile line N)``."""
        user = f"{self.user}@" if self.user else ""
        return f"{user}{self.address}:{self.port} (hostfile line {self.line})"


_KEYS = {"user", "port", "island", "devices", "python", "name", "bind"}


def parse_hostfile(text: str, source: str = "hostfile") -> list[HostSpec]:
    hosts: list[HostSpec] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        address, *fields = line.split()
        opts: dict[str, str] = {}
        for f in fields:
            k, sep, v = f.partition("=")
            if not sep or k not in _KEYS or not v:
                raise HostfileError(f"{source} line {n}: bad field {f!r} (expected one of "
                                    f"{', '.join(sorted(_KEYS))} as key=value)")
            opts[k] = v
        for k in ("island", "devices"):
            if k not in opts:
                raise HostfileError(f"{source} line {n}: {k}= is required")
        try:
            island, devices, port = int(opts["island"]), int(opts["devices"]), int(opts.get("port", 22))
        except ValueError:
            raise HostfileError(f"{source} line {n}: island, devices and port must be integers") from None
        if island < 0 or devices < 1 or not 0 < port < 65536:
            raise HostfileError(f"{source} line {n}: need island >= 0, devices >= 1, 0 < port < 65536")
        hosts.append(HostSpec(address, island, devices, opts.get("user", ""), port,
                              opts.get("python", ""), opts.get("name", ""), opts.get("bind", ""), n))
    if not hosts:
        raise HostfileError(f"{source}: no hosts")
    names = [h.name for h in hosts if h.name]
    if len(names) != len(set(names)):
        raise HostfileError(f"{source}: host names must be unique")
    return hosts


def read_hostfile(path: str) -> list[HostSpec]:
    try:
        with open(path) as f:
            return parse_hostfile(f.read(), path)
    except OSError as e:
        raise HostfileError(f"cannot read hostfile {path}: {e.strerror}") from None


def _is_local(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(address))
    except (OSError, ValueError):
        return False
    if ip.is_loopback:
        return True
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((str(ip), 0))    # only an address of this machine can be bound
        return True
    except OSError:
        return False


def island_coordinators(hosts: Sequence[Any], base_port: int,
                         listen: Callable[[Any], str]) -> dict[int, list[str]]:
    """The ``--coordinator``/``--num-processes`` flags of each island of more
    than one host (``hosts``: objects with ``.island`` and ``.address``, in
    rank order): the island's first host runs the JAX coordinator at
    ``listen(first host)``, on ``base_port + island``, or a free port when the
    host is this machine, or a random one in 20000-29999."""
    runtime: dict[int, list[str]] = {}
    for island in sorted({h.island for h in hosts}):
        members = [h for h in hosts if h.island == island]
        if len(members) == 1:
            continue
        first = members[0]
        address = listen(first)
        if base_port:
            port = base_port + island
        elif _is_local(first.address):
            port = free_port(address)
        else:
            port = random.randint(20000, 29999)
        runtime[island] = ["--coordinator", f"{address}:{port}", "--num-processes", str(len(members))]
    return runtime


def route_address(host: str) -> str:
    """The address of this machine's interface that reaches ``host`` (no packet
    is sent: a UDP socket is only connected)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _resolve(address: str) -> str:
    try:
        return socket.gethostbyname(address)
    except OSError:
        return address


class SSHCluster(ClusterLauncher):
    """A local controller and one worker per ``HostSpec``, each started over ssh."""

    kind = "ssh cluster"

    def __init__(self, hosts: list[HostSpec] | str, *, bind_host: str | None = None,
                 controller_port: int = 0, coordinator_port: int = 0,
                 remote_python: str = "python3", ssh: str = "ssh", ssh_options: list[str] | None = None,
                 connect_timeout: int = CONNECT_TIMEOUT_S, log_dir: str | None = None,
                 start_timeout: float | None = None, env: dict[str, str] | None = None,
                 dcn_latency_ms: float = 0.0, dcn_gbps: float = 0.0, dcn_encrypt: bool = False,
                 policy: str | None = None, config: ClusterConfig | None = None) -> None:
        """``hosts``: parsed hostfile lines or a hostfile path. ``bind_host``: the
        address the controller listens on (default: this machine's address on
        the route to the first host). ``coordinator_port``: base port of the
        ``jax.distributed`` coordinators of multi-host islands (island i uses
        base + i; 0: a free port when the island's first host is this machine,
        else a random one in 20000-29999). ``ssh_options``: extra ssh arguments
        (e.g. ``["-i", "key"]``; ``zpath up`` gives ``config.ssh_options``, ZPATH_SSH_OPTIONS).
        ``start_timeout``: seconds for every worker to register (default
        ``config.start_timeout_s``)."""
        self.hosts = read_hostfile(hosts) if isinstance(hosts, str) else list(hosts)
        self.dcn_flags = dcn_flags(dcn_latency_ms, dcn_gbps, dcn_encrypt)
        self.bind_host = bind_host or route_address(self.hosts[0].address)
        self.coordinator_port = coordinator_port
        self.remote_python = remote_python
        self.ssh = [ssh, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(connect_timeout)}",
                    "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3",
                    *(ssh_options or [])]
        self.islands = len({h.island for h in self.hosts})
        self.host_of: dict[str, HostSpec] = {}     # process name -> host
        self.remote_pids: dict[str, int] = {}      # process name -> pid of zpath.cluster.remote there
        super().__init__(log_dir=log_dir, env=env, policy=policy, config=config)
        self._launch(self.bind_host, self.config.start_timeout_s if start_timeout is None else start_timeout,
                     controller_port)
        for name in self.host_of:
            pid = self._remote_pid(name)
            if pid:
                self.remote_pids[name] = pid

    def ssh_argv(self, h: HostSpec, remote_command: str) -> list[str]:
        dest = f"{h.user}@{h.address}" if h.user else h.address
        return [*self.ssh, "-p", str(h.port), dest, remote_command]

    def _start_workers(self, deadline: float) -> None:
        # where each island's first worker listens (its data port too): the
        # coordinator binds that address only
        runtime = island_coordinators(self.hosts, self.coordinator_port,
                                      lambda h: h.bind or _resolve(h.address))
        rank_in_island: dict[int, int] = {}
        setenv = [f"--setenv={k}={self._env[k]}" for k in FORWARDED_ENV if k in self._env]
        for i, h in enumerate(self.hosts):
            r = rank_in_island.get(h.island, 0)
            rank_in_island[h.island] = r + 1
            host_name = h.name or f"{h.address}-i{h.island}-h{r}"
            name = f"worker-{i}-{re.sub(r'[^A-Za-z0-9_.-]', '_', host_name)}"
            worker = ["--controller", self.address, "--island", str(h.island),
                      "--bind-host", h.bind or _resolve(h.address), "--name", host_name,
                      "--rank", str(i),          # hostfile order, whatever order they register in
                      *runtime.get(h.island, []),
                      *(["--process-id", str(r)] if h.island in runtime else []), *self.dcn_flags]
            python = h.python or self.remote_python
            remote = " ".join(shlex.quote(a) for a in [
                python, "-m", "zpath.cluster.remote", f"--devices={h.devices}", *setenv, "--", *worker])
            env = {k: v for k, v in self._env.items() if k not in ("ZPATH_KEY", "ZPATH_WORKER_KEY", PARENT_PID_ENV)}
            self._spawn_with_key(name, self.ssh_argv(h, "exec " + remote), env)
            self.expected[name] = host_name
            self.host_of[name] = h

    def _describe_exit(self, name: str, p: subprocess.Popen) -> str:
        h = self.host_of.get(name)
        if h is None:
            return super()._describe_exit(name, p)
        tail = self.log_tail(name, 15)
        python = h.python or self.remote_python
        if p.returncode == 255:
            why = "cannot reach it over ssh"
        elif "No module named zpath" in tail or "No module named 'zpath'" in tail:
            why = f"zpath is not installed for {python} there"
        elif p.returncode == 127:
            why = f"{python} was not found there"
        else:
            why = f"its worker exited with code {p.returncode} during start-up"
        return f"host {h.where}: {why}\n{tail}"

    def _remote_pid(self, name: str) -> int:
        try:
            with open(os.path.join(self.dir, f"{name}.log"), errors="replace") as f:
                for line in f:
                    m = re.match(r"zpath-remote: host \S+ pid (\d+)", line)
                    if m:
                        return int(m.group(1))
        except OSError:
            pass
        return 0

    def _ask_to_stop(self, name: str, p: subprocess.Popen) -> None:
        if p.stdin is not None and name in self.host_of:
            p.stdin.close()       # end-of-file there: zpath.cluster.remote stops the worker and exits
        else:
            super()._ask_to_stop(name, p)

    def stop(self, grace: float = 10.0, keep_logs: bool = False) -> None:
        """Close every ssh session (the remote side stops its worker: SIGTERM,
        SIGKILL after 5 s), then stop the controller; SIGKILL what is left."""
        super().stop(grace, keep_logs)
