"""Slurm launch against a real Slurm on this machine: Debian's munged, slurmctld and
two slurmd (two node names, zn1 and zn2, on one machine), with a throwaway
configuration in a temporary directory, started and stopped by pid by the fixture.

* ``launch/slurm-job.sh`` under ``sbatch`` on 2 nodes x 1 task: one island
  of 2 hosts x 2 devices across both nodes computes an all-reduce; then nothing is
  left (processes of the job, job steps, shared memory);
* cancelling a job of 2 tasks on one node stops the cluster (2 islands) that
  ``zpath up --slurm`` runs in it;
* an allocation too small for the layout, a node without zpath and a task that
  cannot start fail within a bounded time with an error naming the node.

Needs root and Slurm (``.ci/run`` installs slurmctld, slurmd and munge); skips with
the reason otherwise. The layout rules are tested without Slurm too."""
from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from zpath.cluster.launcher import free_port
from zpath.cluster.slurm import SlurmError, Task, layout, node_addresses, tasks_per_node
from zpath.cluster.testing import wait_until
from zpath.config import CommonConfig
from zpath.keys import parse_key
from zpath.net.channels import shm_prefix

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
DAEMONS = ("munged", "slurmctld", "slurmd")
NODES = ("zn1", "zn2")


# ---- the layout, without Slurm -------------------------------------------------------
def test_tasks_per_node_reads_slurms_compressed_form():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(SlurmError, match="SLURM_TASKS_PER_NODE"):
        tasks_per_node("2(x)")


def test_layout_splits_tasks_in_node_order():
    tasks = layout("7", ["a", "b"], {"a": "10.0.0.1"}, [2, 2], islands=2)
    assert [(t.node, t.address, t.island, t.rank, t.name) for t in tasks] == [
        ("a", "10.0.0.1", 0, 0, "a-t0"), ("a", "10.0.0.1", 0, 1, "a-t1"),
        ("b", "b", 1, 0, "b-t2"), ("b", "b", 1, 1, "b-t3")]
    one = layout("7", ["a", "b"], {}, [1, 1], islands=1)
    assert [(t.island, t.rank) for t in one] == [(0, 0), (0, 1)]
    with pytest.raises(SlurmError, match=r"too small for 3 islands: job 7 has 2 task\(s\) on 2 node\(s\) \(a, b\)"):
        layout("7", ["a", "b"], {}, [1, 1], islands=3)
    with pytest.raises(SlurmError, match="2 islands do not divide the allocation: job 7 has 3 task"):
        layout("7", ["a", "b"], {}, [2, 1], islands=2)


def test_node_addresses_from_scontrol():
    text = ("NodeName=zn1 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.1 NodeHostName=vm\n"
            "NodeName=zn2 Arch=x86_64 NodeAddr=10.1.2.3 NodeHostName=other\n")
    assert node_addresses(text) == {"zn1": "127.0.0.1", "zn2": "10.1.2.3"}
    assert isinstance(Task(0, "zn1", "127.0.0.1", 0, 0).name, str)


# ---- a real Slurm ---------------------------------------------------------------------
def _skip_reason() -> str:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to run slurmctld and slurmd"
    missing = [d for d in DAEMONS if not shutil.which(d) and not os.path.exists(f"/usr/sbin/{d}")]
    missing += [c for c in ("srun", "sbatch", "salloc", "scontrol", "squeue", "scancel") if not shutil.which(c)]
    if missing:
        return f"{', '.join(missing)} missing (apt-get install slurmctld slurmd slurm-client munge)"
    return ""


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _stop(p: subprocess.Popen, grace: float = 10.0) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


class Slurm:
    """The running test Slurm: its environment and helpers."""

    def __init__(self, d: str, env: dict[str, str]) -> None:
        self.dir, self.env = d, env

    def run(self, *argv: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout, **kw)

    def jobs(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def steps(self, job: str) -> list[str]:
        return self.run("squeue", "-h", "-s", "-j", job, "-o", "%i").stdout.split()

    def job_state(self, job: str) -> str:
        m = re.search(r"JobState=(\S+)", self.run("scontrol", "show", "job", job).stdout)
        return m.group(1) if m else ""


@pytest.fixture(scope="module")
def slurm():
    reason = _skip_reason()
    if reason:
        print(f"skipping Slurm tests: {reason}")
        pytest.skip(reason)
    d = tempfile.mkdtemp(prefix="zpath-slurm-")       # 0700, as munged wants its directories
    procs: list[subprocess.Popen] = []
    try:
        munge_dir = os.path.join(d, "munge")
        os.mkdir(munge_dir, 0o700)
        key = os.path.join(munge_dir, "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o400), "wb") as f:
            f.write(os.urandom(1024))
        socket_path = os.path.join(munge_dir, "munge.socket")

        def start(name: str, argv: list[str]) -> subprocess.Popen:
            log = open(os.path.join(d, f"{name}.out"), "wb")
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            log.close()
            procs.append(p)
            return p

        start("munged", [_exe("munged"), "--foreground", "--force", f"--key-file={key}",
                         f"--socket={socket_path}", f"--pid-file={munge_dir}/munged.pid",
                         f"--log-file={munge_dir}/munged.log", f"--seed-file={munge_dir}/munged.seed"])
        wait_until(lambda: os.path.exists(socket_path) or procs[0].poll() is not None, 20, what="munged")
        if procs[0].poll() is not None:
            pytest.skip(f"munged exited: {Path(d, 'munged.out').read_text()[-500:]}")
        host = os.uname().nodename
        ports = [free_port("127.0.0.1") for _ in range(2 + len(NODES))]
        nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[2 + i]} "
                          f"CPUs=2 RealMemory=1000 State=UNKNOWN" for i, n in enumerate(NODES))
        os.mkdir(os.path.join(d, "state"))
        conf = os.path.join(d, "slurm.conf")
        Path(conf).write_text(f"""ClusterName=zpathtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
PlugStackConfig=/dev/null
InactiveLimit=0
KillWait=5
MinJobAge=300
{nodes}
PartitionName=zp Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
        env = dict(os.environ, SLURM_CONF=conf)
        for k in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))]:
            if k != "SLURM_CONF":
                del env[k]                # not the allocation of a Slurm this test runs inside
        for k in ("ZPATH_KEY", "ZPATH_KEY_FILE", "ZPATH_CONTROLLER", "ZPATH_STATE"):
            env.pop(k, None)
        start("slurmctld", [_exe("slurmctld"), "-D", "-i", "-f", conf])
        for n in NODES:
            start(f"slurmd-{n}", [_exe("slurmd"), "-D", "-N", n, "-f", conf])
        s = Slurm(d, env)

        def idle() -> bool:
            dead = [p.args[0] for p in procs if p.poll() is not None]
            if dead:
                pytest.fail(f"{dead} exited: " + "".join(Path(d, f).read_text()[-400:]
                                                         for f in os.listdir(d) if f.endswith(".out")))
            out = s.run("sinfo", "-h", "-N", "-o", "%N %t", timeout=20).stdout.split("\n")
            return sum(1 for line in out if line.endswith(" idle")) == len(NODES)

        wait_until(idle, 30, 0.2, what="both Slurm nodes idle")
        yield s
        for job in s.jobs():
            s.run("scancel", job)
        wait_until(lambda: not s.jobs(), 30, 0.2, what="no job left")
    finally:
        for p in reversed(procs):
            _stop(p)
        shutil.rmtree(d, ignore_errors=True)


def job_processes(job: str) -> list[psutil.Process]:
    """Processes on this machine that belong to Slurm job ``job`` (by their environment)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("SLURM_JOB_ID") == job and p.pid != os.getpid():
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def assert_nothing_left(slurm: Slurm, job: str, key_file: Path) -> None:
    """No process, no job step and no shared memory of the job's cluster is left."""
    wait_until(lambda: not job_processes(job), 30, 0.2, what=f"no process of job {job}")
    wait_until(lambda: not slurm.steps(job), 30, 0.2, what=f"no step of job {job}")
    prefix = shm_prefix(parse_key(key_file.read_text()))
    shm = CommonConfig().shm_dir
    assert not glob.glob(os.path.join(shm, prefix + "*")), "shared memory left"


USER_PROGRAM = r"""
import os, sys
import jax, numpy as np, psutil
import zpath as zp
key = open(os.environ["ZPATH_KEY_FILE"]).read().strip()
zp.init()
vds = zp.make_virtual_device_set().add_slice(devices=4, island=0)   # 2 hosts x 2 devices
f = zp.pmap(lambda v: jax.lax.psum(v, "i"), devices=vds.devices, axis_name="i")
print("allreduce", np.asarray(f(np.arange(4.0)).result(timeout=60)).tolist(), flush=True)
lines = []
for p in psutil.process_iter():
    try:
        lines.append(" ".join(p.cmdline()))
    except psutil.Error:                  # gone, a zombie, or not ours to read
        pass
print("key on a command line:", any(key in line for line in lines), flush=True)
zp.shutdown()
"""


def test_batch_job_runs_a_program_on_a_multi_node_island(slurm, tmp_path):
    program = tmp_path / "user.py"
    program.write_text(USER_PROGRAM)
    logs, out = tmp_path / "logs", tmp_path / "job.out"
    t = time.monotonic()
    r = slurm.run("sbatch", "--parsable", "-N2", "--ntasks-per-node=1", f"--output={out}",
                  f"--export=ALL,ZPATH_PYTHON={PY}", str(ROOT / "launch" / "slurm-job.sh"),
                  "--devices-per-host", "2", "--log-dir", str(logs), "--", PY, str(program))
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    # (sbatch --wait polls with a back-off of up to half a minute; this polls faster)
    state = wait_until(lambda: slurm.job_state(job) not in ("", "PENDING", "RUNNING", "COMPLETING")
                       and slurm.job_state(job), 90, 0.2, what=f"job {job} finished")
    text = out.read_text() if out.exists() else ""
    assert state == "COMPLETED", state + text + "".join(
        f"\n--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted(logs.glob("*.log")))
    assert "allreduce [6.0, 6.0, 6.0, 6.0]" in text, text
    assert "key on a command line: False" in text, text
    assert "zpath cluster stopped" in text, text
    # the workers' names: a task on each node
    workers = sorted(f.name for f in logs.glob("worker-*.log"))
    assert workers == ["worker-0-zn1-t0.log", "worker-1-zn2-t1.log"], workers
    # and their host numbers follow the tasks' order, whichever registered first
    ctl = (logs / "controller.log").read_text()
    assert re.search(r"host 0 registered: zn1-t0 ", ctl) and re.search(r"host 1 registered: zn2-t1 ", ctl), ctl
    assert_nothing_left(slurm, job, logs / "cluster.key")
    print(f"batch job {job}: {time.monotonic() - t:.1f} s")


def test_cancelling_the_job_stops_the_cluster(slurm, tmp_path):
    logs, out = tmp_path / "logs", tmp_path / "job.out"
    script = tmp_path / "up.sh"
    script.write_text(f"#!/bin/sh\nexec {PY} -m zpath up --slurm --islands 2 --devices-per-host 1 "
                      f"--state {tmp_path}/state.json --log-dir {logs}\n")
    r = slurm.run("sbatch", "--parsable", "-N1", "-n2", f"--output={out}", str(script))
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    try:
        wait_until(lambda: out.exists() and "zpath cluster up" in out.read_text(), 60, 0.2,
                   what="the cluster up")
        workers = [p for p in job_processes(job) if "zpath.worker" in _cmdline(p)]
        assert len(workers) == 2
        assert sorted(f.name for f in logs.glob("worker-*.log")) == ["worker-0-zn1-t0.log",
                                                                    "worker-1-zn1-t1.log"]
    finally:
        slurm.run("scancel", job)
    assert_nothing_left(slurm, job, logs / "cluster.key")
    assert not any(_alive(p) for p in workers)


def test_allocation_too_small_for_the_layout(slurm):
    t = time.monotonic()
    r = slurm.run("salloc", "-N1", "-n2", PY, "-m", "zpath", "up", "--slurm", "--islands", "3")
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"zpath up: the allocation is too small for 3 islands: job \d+ has 2 task\(s\) on "
                     r"1 node\(s\) \(zn\d\)", r.stderr), r.stderr
    assert time.monotonic() - t < 30


@pytest.mark.parametrize("broken, why", [
    ("exec /usr/bin/python3 \"$@\"", "zpath is not installed for {wrapper} there"),
    ("exec /nonexistent/python3 \"$@\"", "{wrapper} could not be started there|"
                                         "its worker exited with code 127 during start-up"),
], ids=["node-without-zpath", "task-fails-to-start"])
def test_a_failing_node_is_named(slurm, tmp_path, broken, why):
    if "/usr/bin/python3" in broken and (not os.path.exists("/usr/bin/python3") or subprocess.run(
            ["/usr/bin/python3", "-c", "import zpath"], capture_output=True, cwd="/", timeout=30).returncode == 0):
        pytest.skip("/usr/bin/python3 missing or has zpath")
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\n# zpath is on node zn1 only\nif [ \"$SLURMD_NODENAME\" = zn2 ]; then "
                       f"{broken}; fi\nexec {PY} \"$@\"\n")
    wrapper.chmod(0o755)
    t = time.monotonic()
    r = slurm.run("salloc", "-N2", "-n2", PY, "-m", "zpath", "up", "--slurm", "--devices-per-host", "1",
                  "--remote-python", str(wrapper), "--start-timeout", "60", "--log-dir", str(tmp_path / "logs"),
                  timeout=90, cwd=tmp_path)        # not the checkout: python -m would find zpath there
    assert r.returncode == 1, r.stdout + r.stderr
    job = re.search(r"Granted job allocation (\d+)", r.stderr).group(1)
    assert re.search(rf"zpath up: node zn2 \(job {job}, task 1, island 0\): "
                     rf"({why.format(wrapper=re.escape(str(wrapper)))})", r.stderr), r.stderr
    assert time.monotonic() - t < 45
    assert_nothing_left(slurm, job, tmp_path / "logs" / "cluster.key")
