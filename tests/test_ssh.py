"""SSH launch against a real sshd on a loopback port: a 2-island cluster started
with ``zpath up --hostfile``, a computation across both islands, ``zpath down``
and no process left; an unreachable host and a host without zpath fail fast
with an error naming the host.

Needs root and /usr/sbin/sshd (``.ci/run`` installs openssh-server); skips with
the reason otherwise."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

import zpath as zp
from zpath.errors import ZpathError
from zpath.cluster.launcher import free_port
from tests.conftest import assert_gone

pytestmark = pytest.mark.timeout(120)

SSHD = "/usr/sbin/sshd"


def _skip_reason() -> str:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to run sshd"
    if not os.path.exists(SSHD):
        return f"{SSHD} missing (apt-get install openssh-server)"
    if not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        return "ssh client missing"
    return ""


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A throwaway sshd on 127.0.0.1:<free port> that lets root in with a
    throwaway client key. Yields (port, ssh options, sshd pid)."""
    reason = _skip_reason()
    if reason:
        print(f"skipping SSH tests: {reason}")
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)],
                       check=True, timeout=30)
    shutil.copy(d / "client_key.pub", d / "authorized_keys")
    port = free_port("127.0.0.1")
    cfg = d / "sshd_config"
    cfg.write_text(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_key\n"
                   f"PidFile {d}/sshd.pid\nAuthorizedKeysFile {d}/authorized_keys\n"
                   "PermitRootLogin yes\nStrictModes no\nPasswordAuthentication no\n"
                   "KbdInteractiveAuthentication no\nUsePAM no\nPubkeyAuthentication yes\n"
                   "MaxStartups 50\nMaxSessions 50\n")
    os.makedirs("/run/sshd", exist_ok=True)     # privilege separation directory
    log = open(d / "sshd.log", "wb")
    p = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL)
    log.close()
    try:
        deadline = time.monotonic() + 20
        while True:
            if p.poll() is not None:
                pytest.skip(f"sshd exited with {p.returncode}: {(d / 'sshd.log').read_text()[-500:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("sshd did not listen in 20 s")
                time.sleep(0.1)
        opts = ["-i", str(d / "client_key"), "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
        yield port, opts, p.pid
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def sessions(sshd_pid: int) -> list[psutil.Process]:
    """Everything running under the sshd: sessions and what they started."""
    try:
        return psutil.Process(sshd_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def wait_no_sessions(sshd_pid: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while sessions(sshd_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [(p.pid, p.cmdline()) for p in sessions(sshd_pid) if p.is_running()]
    assert not left, f"left running under sshd: {left}"


PY = sys.executable


def cluster_address(up: subprocess.Popen) -> str:
    """The address a `zpath up` prints once its cluster is up (fails with its
    output if it exits first)."""
    lines: list[str] = []
    while True:
        line = up.stdout.readline()
        assert line, "zpath up exited:\n" + "".join(lines)
        lines.append(line)
        found = re.match(r"zpath cluster up: (\S+)", line)
        if found:
            return found.group(1)


def test_ssh_cluster_two_islands_compute_and_down(sshd, tmp_path):
    port, opts, sshd_pid = sshd
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"# two islands on this machine, through sshd\n"
                        f"127.0.0.1 user=root port={port} island=0 devices=2 python={PY} name=a\n"
                        f"127.0.0.1 user=root port={port} island=1 devices=2 python={PY}  # b\n")
    state = tmp_path / "state.json"
    up = subprocess.Popen([PY, "-m", "zpath", "up", "--hostfile", str(hostfile), "--state", str(state),
                           "--log-dir", str(tmp_path / "logs"), f"--ssh-options={' '.join(opts)}",
                           "--start-timeout", "60"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        address = cluster_address(up)
        key = (tmp_path / "logs" / "cluster.key").read_text().strip()
        everything = sessions(sshd_pid) + psutil.Process(up.pid).children(recursive=True)
        assert key not in " ".join(" ".join(p.cmdline()) for p in everything), "key on a command line"
        remote = [p for p in sessions(sshd_pid) if "zpath.worker" in " ".join(p.cmdline())]
        assert len(remote) == 2
        zp.connect(address, key)
        try:
            d0 = zp.make_virtual_device_set().add_slice(devices=2, island=0).devices
            d1 = zp.make_virtual_device_set().add_slice(devices=2, island=1).devices
            x = zp.pmap(lambda v: v * 2., devices=d0)(np.array([1., 2.]))
            y = zp.pmap(lambda v: v + 1., devices=d1)(x)            # island 0 -> island 1
            np.testing.assert_allclose(y.result(timeout=60), [3., 5.])
            assert {d.island for d in d0} == {0} and {d.island for d in d1} == {1}
        finally:
            zp.shutdown()
        pids = [p.pid for p in remote] + [p.pid for p in sessions(sshd_pid)]
        t = time.monotonic()
        down = subprocess.run([PY, "-m", "zpath", "down", "--state", str(state)],
                              capture_output=True, text=True, timeout=60)
        assert down.returncode == 0, down.stdout + down.stderr
        assert "stopped zpath up" in down.stdout, down.stdout
        up.wait(30)
        assert_gone(pids + [up.pid])
        wait_no_sessions(sshd_pid)
        assert time.monotonic() - t < 30
        assert not state.exists()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
        up.stdout.close()


def _hosts(port: int, *extra: str) -> list:
    from zpath.cluster.ssh import parse_hostfile
    return parse_hostfile("\n".join([f"127.0.0.1 user=root port={port} island=0 devices=1 python={PY}",
                                     *extra]))


def _remove_logs(error: Exception) -> None:
    """A cluster that failed to start keeps its logs and names them in the error."""
    where = str(error).rsplit("(logs in ", 1)[1].split(")")[0]
    assert os.path.isfile(os.path.join(where, "controller.log")), where
    shutil.rmtree(where)


def test_unreachable_host_fails_fast_naming_it(sshd):
    from zpath.cluster.ssh import SSHCluster
    port, opts, sshd_pid = sshd
    closed = free_port("127.0.0.1")
    t = time.monotonic()
    with pytest.raises(ZpathError, match=rf"host root@127.0.0.1:{closed} \(hostfile line 2\): "
                                          "cannot reach it over ssh") as e:
        SSHCluster(_hosts(port, f"127.0.0.1 user=root port={closed} island=1 devices=1 python={PY}"),
                   ssh_options=opts, connect_timeout=5, start_timeout=60)
    _remove_logs(e.value)
    assert time.monotonic() - t < 30
    wait_no_sessions(sshd_pid)          # the good host's worker was stopped too


def test_host_without_zpath_fails_naming_it(sshd):
    from zpath.cluster.ssh import SSHCluster
    port, opts, sshd_pid = sshd
    bare = "/usr/bin/python3"
    if not os.path.exists(bare) or subprocess.run([bare, "-c", "import zpath"], capture_output=True,
                                                  cwd="/", timeout=30).returncode == 0:
        pytest.skip(f"{bare} missing or has zpath")
    t = time.monotonic()
    with pytest.raises(ZpathError, match=rf"host root@127.0.0.1:{port} \(hostfile line 2\): "
                                          f"zpath is not installed for {bare} there") as e:
        SSHCluster(_hosts(port, f"127.0.0.1 user=root port={port} island=1 devices=1 python={bare}"),
                   ssh_options=opts, connect_timeout=5, start_timeout=60)
    _remove_logs(e.value)
    assert time.monotonic() - t < 30
    wait_no_sessions(sshd_pid)


def test_worker_dying_at_start_is_named(sshd):
    from zpath.cluster.ssh import SSHCluster
    port, opts, sshd_pid = sshd
    with pytest.raises(ZpathError, match=r"host 127.0.0.1:\d+ \(hostfile line 2\): its worker exited "
                                         r"with code \d+ during start-up") as e:
        # the worker cannot bind its data port on an address this machine does not have
        SSHCluster(_hosts(port, f"127.0.0.1 port={port} island=1 devices=1 python={PY} bind=192.0.2.1"),
                   ssh_options=opts, connect_timeout=5, start_timeout=60)
    _remove_logs(e.value)
    wait_no_sessions(sshd_pid)


def test_killed_launcher_leaves_nothing(sshd, tmp_path):
    port, opts, sshd_pid = sshd
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"127.0.0.1 port={port} island=0 devices=1 python={PY}\n"
                        f"127.0.0.1 port={port} island=0 devices=1 python={PY}\n")   # a 2-host island
    state = tmp_path / "state.json"
    up = subprocess.Popen([PY, "-m", "zpath", "up", "--hostfile", str(hostfile), "--state", str(state),
                           f"--ssh-options={' '.join(opts)}", "--start-timeout", "60"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = []
        while not any(line.startswith("zpath cluster up") for line in out):
            line = up.stdout.readline()
            assert line, "zpath up exited:\n" + "".join(out)
            out.append(line)
        children = psutil.Process(up.pid).children(recursive=True)
        pids = [p.pid for p in children + sessions(sshd_pid)]
        assert sum("zpath.worker" in " ".join(p.cmdline()) for p in sessions(sshd_pid)) == 2
        up.send_signal(signal.SIGKILL)
        up.wait(10)
        assert_gone(pids, timeout=20)
        wait_no_sessions(sshd_pid)
        down = subprocess.run([PY, "-m", "zpath", "down", "--state", str(state)],
                              capture_output=True, text=True, timeout=60)
        assert down.returncode == 0 and not state.exists(), down.stdout + down.stderr
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
        up.stdout.close()


def test_down_stops_remote_workers_by_pid_over_ssh(sshd):
    """The fallback of `zpath down` when its `zpath up` is gone: the remote
    zpath.cluster.remote is stopped over ssh by pid, and its worker with it."""
    from zpath.cluster.ssh import SSHCluster
    from zpath.cluster.state import kill_remote
    port, opts, sshd_pid = sshd
    c = SSHCluster(_hosts(port), ssh_options=opts, connect_timeout=5, start_timeout=60)
    try:
        (name, p), = [(n, p) for n, p in c.procs if n in c.host_of]
        remote_pid = c.remote_pids[name]
        worker = [q for q in sessions(sshd_pid) if "zpath.worker" in " ".join(q.cmdline())]
        assert psutil.Process(remote_pid).parent().pid in [q.pid for q in sessions(sshd_pid)]
        assert kill_remote(c.ssh_argv(c.host_of[name], "")[:-1], remote_pid)
        p.wait(20)                                 # the session ends with it
        assert_gone([remote_pid] + [q.pid for q in worker])
        assert not kill_remote(c.ssh_argv(c.host_of[name], "")[:-1], remote_pid)   # gone: no-op
    finally:
        c.stop()
    wait_no_sessions(sshd_pid)


def test_a_two_host_island_whose_first_host_binds_another_address(sshd):
    """The island's jax.distributed coordinator listens where its first host's
    worker binds (bind=), and every host is told to reach it there."""
    from zpath.cluster.ssh import SSHCluster, parse_hostfile
    port, opts, sshd_pid = sshd
    hosts = parse_hostfile(f"127.0.0.1 port={port} island=0 devices=1 python={PY} bind=127.0.0.2\n"
                           f"127.0.0.1 port={port} island=0 devices=1 python={PY}\n")
    c = SSHCluster(hosts, ssh_options=opts, connect_timeout=5, start_timeout=90)
    try:
        zp.connect(c.address, c.key)
        try:
            import jax
            d = zp.make_virtual_device_set().add_slice(devices=2).devices
            out = zp.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i", devices=d)(np.arange(2.))
            np.testing.assert_array_equal(out.result(timeout=60), [1., 1.])
        finally:
            zp.shutdown()
    finally:
        c.stop()
    wait_no_sessions(sshd_pid)


def test_hostfile_parsing():
    from zpath.cluster.ssh import HostfileError, parse_hostfile
    hosts = parse_hostfile("# comment\n\n10.0.0.1 user=ml port=2222 island=1 devices=4 python=/v/py name=a"
                           "  # trailing\n10.0.0.2 island=0 devices=1\n")
    assert [(h.address, h.user, h.port, h.island, h.devices, h.python, h.name, h.line) for h in hosts] == [
        ("10.0.0.1", "ml", 2222, 1, 4, "/v/py", "a", 3), ("10.0.0.2", "", 22, 0, 1, "", "", 4)]
    assert hosts[0].where == "ml@10.0.0.1:2222 (hostfile line 3)"
    for bad, msg in [("h devices=1", "line 1: island= is required"),
                     ("h island=0 devices=x", "must be integers"),
                     ("h island=0 devices=1 colour=red", "bad field 'colour=red'"),
                     ("h island=0 devices=0", "devices >= 1"),
                     ("# nothing\n", "no hosts"),
                     ("a island=0 devices=1 name=x\nb island=0 devices=1 name=x", "unique")]:
        with pytest.raises(HostfileError, match=re.escape(msg)):
            parse_hostfile(bad)
