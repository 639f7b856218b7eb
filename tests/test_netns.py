"""SSH launch onto hosts with addresses of their own: three network namespaces on
one bridge, each with its own sshd, stand in for three machines.

``zpath up --hostfile`` starts a worker in each over ssh (a 2-host island and a
1-host island), with the controller on this side of the bridge at the address it
picks itself (the route to the first host) and the island's ``jax.distributed``
coordinator on the island's first host. With ``ZPATH_SHM=0`` (passed on to the
workers) the ICI channel between the island's hosts is TCP, as between machines.
The test runs an all-reduce across the island's two hosts, moves values between
its hosts (ICI) and to the other island (DCN), checks the plan names those
channels and the hosts' addresses are their own, then ``zpath down`` leaves
nothing running.

Needs root, ``ip netns`` and /usr/sbin/sshd; skips with the reason otherwise.
Everything it creates (namespaces, bridge, veth pairs, sshd processes) carries
this process's pid in its name and is removed at the end."""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import zpath as zp
from tests.conftest import assert_gone
from tests.test_ssh import SSHD, _skip_reason, cluster_address, sessions, wait_no_sessions

pytestmark = pytest.mark.timeout(240)

PY = sys.executable
NAMES = ("a", "b", "c")


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.213-252.x.0 that no interface or route here uses."""
    used = _ip("-o", "-4", "addr").stdout + _ip("-4", "route").stdout
    nets = [ipaddress.ip_network(w, strict=False) for w in re.findall(r"\b\d+\.\d+\.\d+\.\d+/\d+\b", used)]
    start = os.getpid() % 10000
    for k in range(10000):
        n = (start + k) % 10000
        net = ipaddress.ip_network(f"10.{213 + n // 250}.{n % 250}.0/24")
        if not any(net.overlaps(u) for u in nets):
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet")


class Hosts:
    """A bridge on this side and one namespace per host with a veth on it."""

    def __init__(self) -> None:
        tag = str(os.getpid())
        self.bridge = f"zb{tag}"
        self.ns = {h: f"zpt{tag}{h}" for h in NAMES}
        self.veth = {h: f"zv{tag}{h}" for h in NAMES}
        self.created_ns: list[str] = []
        self.bridge_made = False
        net = _free_subnet()
        hosts = list(net.hosts())
        self.gateway = str(hosts[0])
        self.addr = {h: str(hosts[1 + i]) for i, h in enumerate(NAMES)}
        self.prefix = net.prefixlen

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.bridge_made = True
        _ip("addr", "add", f"{self.gateway}/{self.prefix}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h in NAMES:
            ns, veth = self.ns[h], self.veth[h]
            _ip("netns", "add", ns)
            self.created_ns.append(ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("addr", "add", f"{self.addr[h]}/{self.prefix}", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("route", "add", "default", "via", self.gateway, ns=ns)

    def down(self) -> None:
        for ns in self.created_ns:        # deleting a namespace deletes its veth pair
            _ip("netns", "del", ns, check=False)
        if self.bridge_made:
            _ip("link", "del", self.bridge, check=False)


def _start_sshd(ns: str, address: str, d, log) -> subprocess.Popen:
    cfg = d / f"sshd_config_{ns}"
    cfg.write_text(f"Port 22\nListenAddress {address}\nHostKey {d}/host_key\n"
                   f"PidFile {d}/sshd_{ns}.pid\nAuthorizedKeysFile {d}/authorized_keys\n"
                   "PermitRootLogin yes\nStrictModes no\nPasswordAuthentication no\n"
                   "KbdInteractiveAuthentication no\nUsePAM no\nPubkeyAuthentication yes\n"
                   "MaxStartups 50\nMaxSessions 50\n")
    # `ip netns exec` execs sshd: the pid is sshd's
    return subprocess.Popen(["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _wait_listening(p: subprocess.Popen, address: str, log_path) -> None:
    deadline = time.monotonic() + 20
    while True:
        if p.poll() is not None:
            pytest.fail(f"sshd at {address} exited with {p.returncode}: {log_path.read_text()[-500:]}")
        try:
            socket.create_connection((address, 22), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail(f"sshd at {address} did not listen in 20 s")
            time.sleep(0.1)


@pytest.fixture(scope="module")
def netns_sshd(tmp_path_factory):
    """Three namespaces on a bridge, an sshd in each. Yields (Hosts, ssh
    options, {host: sshd pid})."""
    reason = _skip_reason()
    if not reason and not shutil.which("ip"):
        reason = "the ip command (iproute2) is missing"
    if reason:
        pytest.skip(reason)
    hosts = Hosts()
    sshds: dict[str, subprocess.Popen] = {}
    try:
        try:
            hosts.up()
        except RuntimeError as e:
            pytest.skip(f"cannot make network namespaces here: {e}")
        d = tmp_path_factory.mktemp("netns_sshd")
        for key in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)],
                           check=True, timeout=30)
        shutil.copy(d / "client_key.pub", d / "authorized_keys")
        os.makedirs("/run/sshd", exist_ok=True)
        for h in NAMES:
            with open(d / f"sshd_{h}.log", "wb") as log:
                sshds[h] = _start_sshd(hosts.ns[h], hosts.addr[h], d, log)
        for h in NAMES:
            _wait_listening(sshds[h], hosts.addr[h], d / f"sshd_{h}.log")
        opts = ["-i", str(d / "client_key"), "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
        yield hosts, opts, {h: p.pid for h, p in sshds.items()}
    finally:
        for p in sshds.values():
            p.terminate()
        for p in sshds.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        hosts.down()


def _net_of(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def test_ssh_cluster_on_hosts_with_their_own_addresses(netns_sshd, tmp_path):
    hosts, opts, sshd_pids = netns_sshd
    A, B, C = (hosts.addr[h] for h in NAMES)
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{A} user=root island=0 devices=1 python={PY} name=a\n"
                        f"{B} user=root island=0 devices=1 python={PY} name=b\n"
                        f"{C} user=root island=1 devices=1 python={PY} name=c\n")
    state = tmp_path / "state.json"
    env = dict(os.environ, ZPATH_SHM="0")           # ICI between the island's hosts over TCP
    up = subprocess.Popen([PY, "-m", "zpath", "up", "--hostfile", str(hostfile), "--state", str(state),
                           "--log-dir", str(tmp_path / "logs"), f"--ssh-options={' '.join(opts)}",
                           "--start-timeout", "120"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        address = cluster_address(up)
        # the controller listens on this side of the bridge, the address it picked
        assert address.startswith(f"tcp://{hosts.gateway}:"), address
        # each worker runs in its host's namespace
        workers = {}
        for h in NAMES:
            ws = [p for p in sessions(sshd_pids[h]) if "zpath.worker" in " ".join(p.cmdline())]
            assert len(ws) == 1, (h, [p.cmdline() for p in sessions(sshd_pids[h])])
            workers[h] = ws[0]
            assert _net_of(ws[0].pid) == _net_of(sshd_pids[h]) != _net_of(os.getpid())
        key = (tmp_path / "logs" / "cluster.key").read_text().strip()
        cluster = zp.connect(address, key)
        try:
            # every host registered the data address of its own namespace
            seen = {h.name: h.data_address for h in cluster.hosts.values()}
            assert sorted(seen) == sorted(NAMES), seen
            for h in NAMES:
                assert seen[h].startswith(f"tcp://{hosts.addr[h]}:"), seen

            island = zp.make_virtual_device_set().add_slice(devices=2, island=0).devices
            other = zp.make_virtual_device_set().add_slice(devices=1, island=1).devices
            assert len({d.host for d in island}) == 2
            da, db = sorted(island, key=lambda d: d.host)

            import jax
            allreduce = zp.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i", devices=island)
            np.testing.assert_allclose(allreduce(np.array([1., 2.])).result(timeout=60), [3., 3.])

            on_a = zp.pmap(lambda x: x * 2., devices=[da])
            on_b = zp.pmap(lambda x: x + 1., devices=[db])
            on_c = zp.pmap(lambda x: x - 3., devices=other)

            @zp.program
            def hop(x):
                return on_c(on_b(on_a(x)))                # a -> b (ICI), b -> c (DCN)

            x = np.array([5.])
            plan = hop.explain(x)
            assert re.search(r"\bICI\b", plan) and re.search(r"\bDCN\b", plan), plan
            np.testing.assert_allclose(hop(x).result(timeout=60), [8.])
            np.testing.assert_allclose(on_a(on_c(np.array([1.]))).result(timeout=60), [-4.])  # c -> a
        finally:
            zp.shutdown()
        pids = [p.pid for p in workers.values()] + [p.pid for h in NAMES for p in sessions(sshd_pids[h])]
        down = subprocess.run([PY, "-m", "zpath", "down", "--state", str(state)],
                              capture_output=True, text=True, timeout=60)
        assert down.returncode == 0, down.stdout + down.stderr
        up.wait(30)
        assert_gone(pids + [up.pid])
        for h in NAMES:
            wait_no_sessions(sshd_pids[h])
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
        up.stdout.close()
