"""Slurm launcher: ``zpath up --slurm`` inside an allocation (``salloc``, ``sbatch``).

The controller runs where ``zpath up`` runs (in a batch script: the job's first
node); every task of the allocation runs one worker (a host), started as its own
job step::

    srun --nodes=1 --ntasks=1 --nodelist=NODE --exact [--cpus-per-task=C] \\
         PYTHON -m zpath.cluster.remote --devices=D -- <worker flags>

as the SSH launcher does over ssh (zpath/cluster/ssh.py): the cluster key goes to the
step's standard input (never a command line), ``zpath.cluster.remote`` reads it, runs
the worker and stops it when its standard input closes, which is how ``zpath down``
(or the end of ``zpath up``) stops a step; when the job ends, Slurm ends its steps.

Layout: the tasks in node order (block distribution, SLURM_TASKS_PER_NODE) are split
into ``islands`` equal runs of consecutive tasks; with tasks per node dividing the run,
an island is whole nodes. An island of several tasks joins one ``jax.distributed``
runtime whose coordinator is its first task's worker.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import shlex
import subprocess
import sys

from zpath.cluster.launcher import ClusterLauncher, dcn_flags
from zpath.cluster.ssh import island_coordinators, route_address
from zpath.config import ClusterConfig, SlurmJob
from zpath.errors import ZpathError
from zpath.process import PARENT_PID_ENV

log = logging.getLogger(__name__)

SCONTROL_TIMEOUT_S = 30.0


class SlurmError(ZpathError):
    """Not inside an allocation, or the allocation does not fit the layout."""


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of the allocation and the worker it runs."""
    index: int             # in node order, 0..T-1
    node: str              # Slurm node name
    address: str           # the node's address (NodeAddr)
    island: int
    rank: int              # within its island

    @property
    def name(self) -> str:
        """The worker's host name: node and task (what errors and `zpath status` show)."""
        return f"{self.node}-t{self.index}"


def tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE (``2(x3),1``) as one count per node."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise SlurmError(f"cannot read SLURM_TASKS_PER_NODE={text!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def layout(job_id: str, nodes: list[str], addresses: dict[str, str], per_node: list[int],
           islands: int) -> list[Task]:
    """The tasks of the allocation, split into ``islands`` equal runs in node order."""
    if len(nodes) != len(per_node):
        raise SlurmError(f"job {job_id}: {len(nodes)} nodes but tasks for {len(per_node)} "
                         f"(SLURM_TASKS_PER_NODE)")
    order = [node for node, n in zip(nodes, per_node, strict=True) for _ in range(n)]
    where = f"job {job_id} has {len(order)} task(s) on {len(nodes)} node(s) ({', '.join(nodes)})"
    if islands < 1:
        raise SlurmError("--islands must be at least 1")
    if len(order) < islands:
        raise SlurmError(f"the allocation is too small for {islands} islands: {where}; "
                         f"ask for at least {islands} tasks (sbatch/salloc -n)")
    if len(order) % islands:
        raise SlurmError(f"{islands} islands do not divide the allocation: {where}; ask for a "
                         f"multiple of {islands} tasks")
    size = len(order) // islands
    return [Task(i, node, addresses.get(node, node), i // size, i % size) for i, node in enumerate(order)]


def scontrol(*args: str) -> str:
    try:
        out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except FileNotFoundError:
        raise SlurmError("scontrol is not installed here: zpath up --slurm runs inside a Slurm "
                         "allocation (salloc, sbatch)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"scontrol {' '.join(args)} did not answer in {SCONTROL_TIMEOUT_S:g} s") from None
    if out.returncode != 0:
        raise SlurmError(f"scontrol {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def node_addresses(text: str) -> dict[str, str]:
    """NodeName -> NodeAddr from ``scontrol -o show node`` lines."""
    out = {}
    for line in text.splitlines():
        name = re.search(r"\bNodeName=(\S+)", line)
        addr = re.search(r"\bNodeAddr=(\S+)", line)
        if name:
            out[name.group(1)] = addr.group(1) if addr else name.group(1)
    return out


def allocation(job: SlurmJob, islands: int) -> list[Task]:
    """The tasks of the allocation ``job`` describes, laid out in islands."""
    if not job.job_id or not job.nodelist or not job.tasks_per_node:
        raise SlurmError("not inside a Slurm allocation (no SLURM_JOB_ID, SLURM_JOB_NODELIST and "
                         "SLURM_TASKS_PER_NODE): run zpath up --slurm from salloc or an sbatch script")
    nodes = scontrol("show", "hostnames", job.nodelist).split()
    addresses = node_addresses(scontrol("-o", "show", "node", job.nodelist))
    return layout(job.job_id, nodes, addresses, tasks_per_node(job.tasks_per_node), islands)


class SlurmCluster(ClusterLauncher):
    """A local controller and one worker per task of the allocation, each an srun step."""

    kind = "slurm cluster"

    def __init__(self, job: SlurmJob, *, islands: int = 1, devices_per_task: int = 0,
                 python: str | None = None, srun: str = "srun", bind_host: str | None = None,
                 controller_port: int = 0, coordinator_port: int = 0, log_dir: str | None = None,
                 start_timeout: float | None = None, env: dict[str, str] | None = None,
                 dcn_latency_ms: float = 0.0, dcn_gbps: float = 0.0, dcn_encrypt: bool = False,
                 policy: str | None = None, config: ClusterConfig | None = None,
                 tasks: list[Task] | None = None) -> None:
        """``job``: the allocation (``SlurmJob.from_env()``). ``islands``: how many
        islands the tasks are split into. ``devices_per_task``: emulated CPU
        devices per worker (0: leave XLA_FLAGS alone, e.g. on GPUs). ``python``:
        the interpreter on the nodes (default: this one, as on a shared file
        system). ``bind_host``: the controller's address (default: this
        machine's address on the route to the first node). ``coordinator_port``:
        base port of multi-host islands' coordinators (island i: base + i; 0: a
        free port where the island's first node is this machine, else random
        in 20000-29999). ``tasks``: the layout, when already computed."""
        self.job = job
        self.tasks = tasks if tasks is not None else allocation(job, islands)
        self.dcn_flags = dcn_flags(dcn_latency_ms, dcn_gbps, dcn_encrypt)
        self.devices_per_task = devices_per_task
        self.python = python or sys.executable
        self.srun = srun
        self.coordinator_port = coordinator_port
        self.islands = len({t.island for t in self.tasks})
        self.bind_host = bind_host or route_address(self.tasks[0].address)
        self.task_of: dict[str, Task] = {}        # process name -> task
        super().__init__(log_dir=log_dir, env=env, policy=policy, config=config)
        self._launch(self.bind_host, self.config.start_timeout_s if start_timeout is None else start_timeout,
                     controller_port)

    def srun_argv(self, t: Task, command: list[str]) -> list[str]:
        cpus = [f"--cpus-per-task={self.job.cpus_per_task}"] if self.job.cpus_per_task else []
        return [self.srun, f"--jobid={self.job.job_id}", "--nodes=1", "--ntasks=1",
                f"--nodelist={t.node}", "--exact", *cpus, f"--job-name=zpath-{t.name}",
                "--kill-on-bad-exit=1", *command]

    def _start_workers(self, deadline: float) -> None:
        runtime = island_coordinators(self.tasks, self.coordinator_port, lambda t: t.address)
        env = {k: v for k, v in self._env.items() if k not in ("ZPATH_KEY", "ZPATH_WORKER_KEY", PARENT_PID_ENV)}
        for t in self.tasks:
            name = f"worker-{t.index}-{re.sub(r'[^A-Za-z0-9_.-]', '_', t.name)}"
            worker = ["--controller", self.address, "--island", str(t.island), "--bind-host", t.address,
                      "--name", t.name,
                      "--rank", str(t.index),      # node order, whatever order they register in
                      *runtime.get(t.island, []),
                      *(["--process-id", str(t.rank)] if t.island in runtime else []), *self.dcn_flags]
            command = [self.python, "-m", "zpath.cluster.remote",
                       f"--devices={self.devices_per_task}", "--", *worker]
            self._spawn_with_key(name, self.srun_argv(t, command), env)
            self.expected[name] = t.name
            self.task_of[name] = t

    def _describe_exit(self, name: str, p: subprocess.Popen) -> str:
        t = self.task_of.get(name)
        if t is None:
            return super()._describe_exit(name, p)
        tail = self.log_tail(name, 15)
        missing = re.search(r"No module named '?([\w.]+)", tail)
        if missing and missing.group(1).split(".")[0] == "zpath":
            why = f"zpath is not installed for {self.python} there"
        elif missing:
            why = f"zpath's dependency {missing.group(1)} is not installed for {self.python} there"
        elif "execve" in tail or p.returncode == 127:
            why = f"{self.python} could not be started there"
        elif "srun: error" in tail and "task 0" not in tail:
            why = f"srun could not start the step (exit code {p.returncode})"
        else:
            why = f"its worker exited with code {p.returncode} during start-up"
        return (f"node {t.node} (job {self.job.job_id}, task {t.index}, island {t.island}): {why}\n"
                f"  {shlex.join(self.srun_argv(t, ['...']))}\n{tail}")

    def _ask_to_stop(self, name: str, p: subprocess.Popen) -> None:
        if p.stdin is not None and name in self.task_of:
            p.stdin.close()     # end-of-file in the step: zpath.cluster.remote stops the worker
        else:
            super()._ask_to_stop(name, p)
