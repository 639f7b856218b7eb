"""Configuration: one typed, frozen object per role.

Each setting is a field with its environment variable and its documentation.
Nothing reads the environment at import: a config is built once, in ``main()``
(controller, worker, CLI) or ``init()``/``connect()`` (client), by
``from_env()``, and handed down. Code under test builds one directly, or with
``dataclasses.replace``.

``settings()`` lists every setting; ``python -m zpath.config`` prints them as
the markdown table that README.md carries (tests/test_docs.py checks it;
tests/test_config.py checks that every ``ZPATH_*`` name in the code is one of
them, or one of ``INTERNAL_ENV``).
"""
from __future__ import annotations

import dataclasses
import os
from types import MappingProxyType
from typing import Any, Mapping, TypeVar

from zpath.errors import ZpathError

T = TypeVar("T")

# multi-tenant scheduling policies of the controller (ControllerConfig.policy)
POLICIES = ("fifo", "share")

# the shape of a local cluster when none is given (zp.init(), `zpath up`): two
# single-host islands of two devices (one worker process per core on a 2-core machine)
DEFAULT_SHAPE: Mapping[str, int] = MappingProxyType({"islands": 2, "hosts_per_island": 1,
                                                     "devices_per_host": 2})

# ZPATH_* variables that are not settings: set by zpath for its own children
INTERNAL_ENV = {
    "ZPATH_PARENT_PID": "the launcher's pid, put in a child's environment so that it dies "
                        "with the launcher (zpath/process.py)",
}

# How long a worker may hold a finished computation's report to send it with
# the next ones' (one Batch): a short computation followed at once by another
# short one, and at most (half the queued work's time) one that the controller
# let hold (Execute.hold) with a deep queue behind it. Both ends need them: the
# worker holds, the controller leaves room for the hold in its windows.
HOLD_SHORT_S = 0.002
HOLD_DEEP_S = 0.05
# a computation shorter than this is "short" (held reports), and a deep queue
# is at least this many computations (the real and the simulated worker)
SHORT_COMPUTATION_S = 0.001
DEEP_QUEUE = 4

RUNTIME_DIR_DOC = ("where local clusters write their connection files (address and key, mode "
                   "0600), by which zp.connect() finds them (default ~/.zpath/run)")


def setting(default: Any, env: str, doc: str) -> Any:
    """A config field read from ``env`` by ``from_env``."""
    return dataclasses.field(default=default, metadata={"env": env, "doc": doc})


def _parse(kind: Any, env: str, text: str) -> Any:
    try:
        if kind in (bool, "bool"):
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(text)
        if kind in (int, "int"):
            number = float(text)
            if not number.is_integer():
                raise ValueError(text)
            return int(number)
        if kind in (float, "float"):
            return float(text)
        return text
    except ValueError:
        what = {"bool": "boolean (1/0, true/false, yes/no, on/off)", "int": "whole number",
                "float": "number"}.get(getattr(kind, "__name__", kind), str(kind))
        raise ZpathError(f"{env}={text!r} is not a valid {what}") from None


class _FromEnv:
    @classmethod
    def from_env(cls: type[T], environ: Mapping[str, str] | None = None, **overrides: Any) -> T:
        """Defaults, then the environment, then ``overrides`` (those that are
        not None: flags the user gave)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):     # type: ignore[arg-type]
            env = f.metadata.get("env")
            if env and environ.get(env) not in (None, ""):
                values[f.name] = _parse(f.type, env, environ[env])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class ControllerConfig(_FromEnv):
    """The controller's settings."""
    host_timeout_s: float = setting(10.0, "ZPATH_HOST_TIMEOUT",
                                    "seconds a worker may stay silent before its host counts as lost")
    client_timeout_s: float = setting(15.0, "ZPATH_CLIENT_TIMEOUT",
                                      "seconds a client may stay silent before it counts as gone "
                                      "(its work is cancelled, its buffers freed)")
    device_memory_limit: int = setting(0, "ZPATH_DEVICE_MEMORY_LIMIT",
                                       "bytes a device may hold (0: no limit); calls that would "
                                       "exceed it wait for memory")
    policy: str = setting("share", "ZPATH_SCHEDULER_POLICY",
                          "multi-tenant scheduling policy: share (proportional share by client "
                          "weight) or fifo")
    window_ms: float = setting(20.0, "ZPATH_SCHEDULER_WINDOW_MS",
                               "estimated milliseconds of work kept queued at a device under "
                               "the share policy")
    solo_window_ms: float = setting(100.0, "ZPATH_SCHEDULER_SOLO_WINDOW_MS",
                                    "the window while one client alone uses an island (has work "
                                    "there, or had in the last second), for computations whose run "
                                    "time was measured (at least the window)")
    alone_window_ms: float = setting(500.0, "ZPATH_SCHEDULER_ALONE_WINDOW_MS",
                                     "the solo window while that client is also the only one "
                                     "connected to the controller and carries no others' work "
                                     "(not the IFRT proxy); at least the solo window")
    ping_interval_s: float = setting(1.0, "ZPATH_PING_INTERVAL",
                                     "seconds between the controller's pings to its workers")
    relay_min_hosts: int = setting(32, "ZPATH_RELAY_MIN_HOSTS",
                                   "a message for at least this many hosts (a computation's "
                                   "Execute, a Free) goes through relays, one per group of hosts, "
                                   "which also send back the group's reports together (0: never)")
    relay_group: int = setting(32, "ZPATH_RELAY_GROUP",
                               "hosts per relay group (an island's hosts by rank)")

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ZpathError(f"ZPATH_SCHEDULER_POLICY={self.policy!r} is not a policy "
                             f"(choose from {', '.join(POLICIES)})")
        for name in ("host_timeout_s", "client_timeout_s", "window_ms", "ping_interval_s"):
            if not getattr(self, name) > 0:
                raise ZpathError(f"ControllerConfig.{name} must be > 0, not {getattr(self, name)!r}")
        if self.relay_min_hosts < 0 or self.relay_group < 1:
            raise ZpathError(f"ZPATH_RELAY_MIN_HOSTS must be >= 0 and ZPATH_RELAY_GROUP >= 1, not "
                             f"{self.relay_min_hosts} and {self.relay_group}")
        if self.device_memory_limit < 0:
            raise ZpathError(f"ZPATH_DEVICE_MEMORY_LIMIT must be >= 0, not {self.device_memory_limit}")


@dataclasses.dataclass(frozen=True)
class WorkerConfig(_FromEnv):
    """A worker's settings (the rest of its shape comes from its command line)."""
    controller_timeout_s: float = setting(15.0, "ZPATH_CONTROLLER_TIMEOUT",
                                          "seconds without a word from the controller before a "
                                          "worker (or a client) gives up on it")
    shm: bool = setting(True, "ZPATH_SHM",
                        "move same-machine transfers through shared memory (0: over ZeroMQ)")
    compile_cache: str = setting("", "ZPATH_COMPILE_CACHE",
                                 "directory of JAX's persistent compilation cache the workers "
                                 "share, so a program compiled once is not compiled again in a "
                                 "later run (default ~/.zpath/jax-cache; off: none)")
    collectives_nice: int = setting(10, "ZPATH_COLLECTIVES_NICE",
                                    "niceness added to the threads of an island's CPU collectives "
                                    "(gloo's network thread), which spins while the thread running "
                                    "a computation holds its connection; 0: leave them as they are; 19: "
                                    "faster on a machine the cluster has to itself, far slower beside "
                                    "other CPU-bound work")

    def __post_init__(self) -> None:
        if not 0 <= self.collectives_nice <= 19:
            raise ZpathError(f"ZPATH_COLLECTIVES_NICE must be in 0..19 (a niceness to add), "
                             f"not {self.collectives_nice}")


@dataclasses.dataclass(frozen=True)
class ClientConfig(_FromEnv):
    """The client library's settings."""
    controller: str = setting("", "ZPATH_CONTROLLER",
                              "a running cluster's address: zp.init() connects to it instead of "
                              "starting a local cluster (and `zpath status` shows it)")
    connect_timeout_s: float = setting(30.0, "ZPATH_CONNECT_TIMEOUT",
                                       "seconds to wait for the controller's welcome")
    fetch_timeout_s: float = setting(600.0, "ZPATH_FETCH_TIMEOUT",
                                     "seconds a fetch (np.asarray of a future, Future.result()) "
                                     "waits by default")
    controller_timeout_s: float = setting(15.0, "ZPATH_CONTROLLER_TIMEOUT",
                                          "seconds without a word from the controller before a "
                                          "client gives up on it (what waits fails with Broken)")
    runtime_dir: str = setting("", "ZPATH_RUNTIME_DIR", RUNTIME_DIR_DOC)


@dataclasses.dataclass(frozen=True)
class ClusterConfig(_FromEnv):
    """The launchers' and the CLI's settings."""
    start_timeout_s: float = setting(120.0, "ZPATH_START_TIMEOUT",
                                     "seconds `zpath up`, zp.init() and the pytest plugin's "
                                     "clusters wait for every host to register")
    state: str = setting("", "ZPATH_STATE",
                         "the state file of the cluster `zpath up` started "
                         "(default ~/.zpath/cluster.json)")
    keep_logs: bool = setting(False, "ZPATH_KEEP_LOGS",
                              "keep the log folder a cluster made (it holds the key file) after "
                              "it stops, or after `zpath down` stops it")
    ssh_options: str = setting("", "ZPATH_SSH_OPTIONS", "extra options for ssh (`zpath up --hostfile`)")
    runtime_dir: str = setting("", "ZPATH_RUNTIME_DIR", RUNTIME_DIR_DOC)


@dataclasses.dataclass(frozen=True)
class CommonConfig(_FromEnv):
    """Settings every role reads."""
    key: str = setting("", "ZPATH_KEY", "the cluster key, hex (or ZPATH_KEY_FILE); what "
                       "zp.connect() and `zpath status` sign with when given no key")
    key_file: str = setting("", "ZPATH_KEY_FILE", "a file holding the cluster key, hex "
                            "(read when ZPATH_KEY is not set)")
    worker_key: str = setting("", "ZPATH_WORKER_KEY", "the worker key, hex: "
                              "what the controller and the workers, and no client, hold; the "
                              "launchers make one per cluster (unset: the cluster key, and clients "
                              "are not kept apart)")
    max_message_bytes: int = setting(1 << 30, "ZPATH_MAX_MESSAGE_BYTES",
                                     "largest frame a worker or client accepts (ZeroMQ MAXMSGSIZE; "
                                     "a peer that sends a larger one is disconnected); the "
                                     "controller accepts at most 272 MiB")
    log_level: str = setting("INFO", "ZPATH_LOG_LEVEL", "log level of the controller, the workers "
                             "and `zpath up` (DEBUG, INFO, WARNING, ERROR)")
    shm_dir: str = setting("/dev/shm", "ZPATH_SHM_DIR", "where shared-memory segments are made")
    machine_id: str = setting("", "ZPATH_MACHINE_ID",
                              "this machine's identity for shared memory (default: boot id and "
                              "host name); hosts with the same id share segments")


@dataclasses.dataclass(frozen=True)
class SlurmJob(_FromEnv):
    """The Slurm allocation ``zpath up --slurm`` runs inside, as Slurm describes it in
    the environment of ``salloc``/``sbatch`` (not zpath settings: not in ``ROLES``)."""
    job_id: str = setting("", "SLURM_JOB_ID", "the job (allocation) id")
    nodelist: str = setting("", "SLURM_JOB_NODELIST", "the allocated nodes, compressed (n[1-4])")
    tasks_per_node: str = setting("", "SLURM_TASKS_PER_NODE", "tasks per node, e.g. 2(x3),1")
    cpus_per_task: int = setting(0, "SLURM_CPUS_PER_TASK", "CPUs per task (0: not given)")


ROLES = (CommonConfig, ControllerConfig, WorkerConfig, ClientConfig, ClusterConfig)


def settings() -> list[tuple[str, str, Any, str]]:
    """Every setting: (environment variable, role, default, documentation)."""
    out = []
    for cls in ROLES:
        for f in dataclasses.fields(cls):
            out.append((f.metadata["env"], cls.__name__, f.default, f.metadata["doc"]))
    return out


# how the table names the roles that read a setting
_ROLE_NAMES = {"CommonConfig": "all", "ClusterConfig": "launchers, CLI"}


def _default_text(value: Any) -> str:
    if isinstance(value, bool):
        return "`1`" if value else "`0`"
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    if value == "":
        return "(unset)"
    return f"`{value}`"


def markdown_table() -> str:
    """Every setting as a markdown table, one row per environment variable (a
    variable several roles read is one row naming them all): the README's
    Configuration table is exactly this (tests/test_docs.py checks it)."""
    merged: dict[str, tuple[list[str], list[Any], list[str]]] = {}
    for env, role, default, doc in settings():
        roles, defaults, docs = merged.setdefault(env, ([], [], []))
        roles.append(_ROLE_NAMES.get(role, role.removesuffix("Config").lower()))
        if default not in defaults:
            defaults.append(default)
        doc = " ".join(doc.split()).replace("|", "\\|")
        if doc not in docs:
            docs.append(doc)
    lines = ["| variable | read by | default | meaning |", "| --- | --- | --- | --- |"]
    for env, (roles, defaults, docs) in merged.items():
        lines.append(f"| `{env}` | {', '.join(roles)} | {' / '.join(_default_text(d) for d in defaults)} "
                     f"| {'; '.join(docs)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
