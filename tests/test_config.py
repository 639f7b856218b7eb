"""Configuration: every setting is a typed field of one role's config in
zpath/config.py, read from the environment only by ``from_env`` (called in
main()/init()), and the code names no ZPATH_* variable that is not one."""
from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import re
import subprocess
import sys

import pytest

from zpath import config, keys, logs
from zpath.config import (INTERNAL_ENV, POLICIES, ROLES, ClientConfig, ClusterConfig, CommonConfig,
                          ControllerConfig, WorkerConfig)
from zpath.errors import ErrorKind, ZpathError

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The files scanned for ZPATH_* names: the client library and the cluster tooling
# (and the modules they share). zpath/controller, zpath/worker and zpath/net are
# being switched to ControllerConfig/WorkerConfig separately; once they are,
# SCANNED becomes ["zpath"] (the whole package).
SCANNED = ["zpath"]
NAME = re.compile(r"ZPATH_[A-Z0-9_]*[A-Z0-9]")


def _files() -> list[pathlib.Path]:
    out: list[pathlib.Path] = []
    for entry in SCANNED:
        path = ROOT / entry
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


def test_every_setting_has_a_variable_a_type_and_a_doc():
    seen: dict[str, tuple] = {}
    for cls in ROLES:
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
        for f in dataclasses.fields(cls):
            env, doc = f.metadata.get("env"), f.metadata.get("doc")
            assert env and NAME.fullmatch(env), (cls.__name__, f.name)
            assert doc and len(doc) > 15, (cls.__name__, f.name)
            assert f.type in ("bool", "int", "float", "str"), (cls.__name__, f.name, f.type)
            assert type(f.default).__name__ == f.type, (cls.__name__, f.name, f.default)
            # one variable means one thing: a setting two roles read has one type and default
            if env in seen:
                assert seen[env] == (f.type, f.default), env
            seen[env] = (f.type, f.default)
    names = [s[0] for s in config.settings()]
    assert set(names) == set(seen)
    assert not set(INTERNAL_ENV) & set(names)


@pytest.mark.parametrize("cls", ROLES, ids=lambda c: c.__name__)
def test_from_env_without_variables_gives_the_defaults(cls):
    assert cls.from_env({}) == cls()
    # an empty variable counts as unset
    assert cls.from_env({f.metadata["env"]: "" for f in dataclasses.fields(cls)}) == cls()


def test_from_env_parses_each_type():
    env = {"ZPATH_CONNECT_TIMEOUT": "2.5", "ZPATH_FETCH_TIMEOUT": "60", "ZPATH_CONTROLLER": "tcp://h:1",
           "ZPATH_CONTROLLER_TIMEOUT": "3"}
    assert ClientConfig.from_env(env) == ClientConfig(controller="tcp://h:1", connect_timeout_s=2.5,
                                                      fetch_timeout_s=60.0, controller_timeout_s=3.0)
    assert ControllerConfig.from_env({"ZPATH_DEVICE_MEMORY_LIMIT": "1e6"}).device_memory_limit == 1_000_000
    assert ControllerConfig.from_env({"ZPATH_DEVICE_MEMORY_LIMIT": "4096"}).device_memory_limit == 4096
    for text, value in [("1", True), ("true", True), ("Yes", True), ("on", True),
                        ("0", False), ("false", False), ("NO", False), ("off", False)]:
        assert ClusterConfig.from_env({"ZPATH_KEEP_LOGS": text}).keep_logs is value, text
        assert WorkerConfig.from_env({"ZPATH_SHM": text}).shm is value, text
    cluster = ClusterConfig.from_env({"ZPATH_STATE": "/tmp/s.json", "ZPATH_SSH_OPTIONS": "-i k",
                                      "ZPATH_START_TIMEOUT": "7"})
    assert (cluster.state, cluster.ssh_options, cluster.start_timeout_s) == ("/tmp/s.json", "-i k", 7.0)
    assert CommonConfig.from_env({"ZPATH_LOG_LEVEL": "DEBUG"}).log_level == "DEBUG"


def test_overrides_win_over_the_environment_unless_none():
    env = {"ZPATH_START_TIMEOUT": "7"}
    assert ClusterConfig.from_env(env, start_timeout_s=3.0).start_timeout_s == 3.0
    assert ClusterConfig.from_env(env, start_timeout_s=None).start_timeout_s == 7.0


@pytest.mark.parametrize("cls, env, text, what", [
    (ClientConfig, "ZPATH_FETCH_TIMEOUT", "soon", "number"),
    (ClusterConfig, "ZPATH_START_TIMEOUT", "2 min", "number"),
    (ControllerConfig, "ZPATH_DEVICE_MEMORY_LIMIT", "lots", "whole number"),
    (ControllerConfig, "ZPATH_DEVICE_MEMORY_LIMIT", "1.5", "whole number"),
    (ClusterConfig, "ZPATH_KEEP_LOGS", "maybe", "boolean"),
    (WorkerConfig, "ZPATH_SHM", "2", "boolean"),
])
def test_from_env_rejects_a_bad_value_naming_the_variable(cls, env, text, what):
    with pytest.raises(ZpathError, match=f"^{env}={text!r} is not a valid {what}"):
        cls.from_env({env: text})


def test_from_env_reads_the_process_environment_by_default(monkeypatch):
    monkeypatch.setenv("ZPATH_CONNECT_TIMEOUT", "4")
    assert ClientConfig.from_env().connect_timeout_s == 4.0
    monkeypatch.delenv("ZPATH_CONNECT_TIMEOUT")
    assert ClientConfig.from_env().connect_timeout_s == ClientConfig().connect_timeout_s


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ClientConfig().fetch_timeout_s = 1.0     # type: ignore[misc]


def test_the_key_comes_from_the_common_config(tmp_path, monkeypatch):
    key = bytes(range(32))
    assert keys.key_from_config(CommonConfig(key=key.hex())) == key
    path = tmp_path / "k"
    keys.write_key_file(str(path), key)
    assert keys.key_from_config(CommonConfig(key_file=str(path))) == key
    with pytest.raises(ZpathError, match="no cluster key"):
        keys.key_from_config(CommonConfig())
    with pytest.raises(ZpathError, match="cannot read the key file ZPATH_KEY_FILE="):
        keys.key_from_config(CommonConfig(key_file=str(tmp_path / "missing")))
    with pytest.raises(ZpathError, match="ZPATH_KEY is not hexadecimal"):
        keys.key_from_config(CommonConfig(key="zz"))
    # what the controller's and worker's main() do
    monkeypatch.delenv("ZPATH_KEY", raising=False)
    monkeypatch.setenv("ZPATH_KEY_FILE", str(path))
    assert keys.key_from_config(CommonConfig.from_env()) == key


def test_the_log_level_comes_from_the_common_config(monkeypatch):
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        monkeypatch.setenv("ZPATH_LOG_LEVEL", "warning")
        logs.setup("test", CommonConfig.from_env().log_level)
        assert root.level == logging.WARNING
        logs.setup("test", "debug")
        assert root.level == logging.DEBUG
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)


def test_policies_are_the_controllers_default_and_choices():
    assert ControllerConfig().policy in POLICIES


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_code_names_only_settings(path):
    """Every ZPATH_* name in the scanned code (string, docstring or comment) is
    a setting of zpath/config.py or one of its documented internal variables."""
    known = {s[0] for s in config.settings()} | set(INTERNAL_ENV)
    unknown = sorted(set(NAME.findall(path.read_text())) - known)
    assert not unknown, f"{path.relative_to(ROOT)} names {unknown}: add them to zpath/config.py"


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_config_reads_the_environment(path):
    """Outside zpath/config.py the scanned code reads no variable from the
    environment (it may copy the environment whole, for a child process)."""
    if path.name == "config.py" or path.name == "process.py":   # (process: ZPATH_PARENT_PID, internal)
        return
    text = path.read_text()
    reads = re.findall(r"os\.environ\s*(?:\.get|\.pop|\[)|os\.getenv|environ\.get\(", text)
    assert not reads, f"{path.relative_to(ROOT)} reads the environment: use zpath/config.py"


def test_python_m_zpath_config_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "zpath.config"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "| variable | read by | default | meaning |"
    rows = [line for line in lines[2:] if line.startswith("| `ZPATH_")]
    assert len(rows) == len(lines) - 2 == len({env for env, _, _, _ in config.settings()})
    for env, _, _, doc in config.settings():
        assert any(r.startswith(f"| `{env}` |") and " ".join(doc.split()) in r for r in rows), env


def test_error_kinds_keep_their_wire_values():
    assert ErrorKind.HOST_LOST == "HostLost" and ErrorKind.BAD_REQUEST == "bad_request"
    assert isinstance(ErrorKind.REMOTE_ERROR, str)
    assert ErrorKind.of("HostLost") is ErrorKind.HOST_LOST
    assert ErrorKind.of("SomethingNewer") is ErrorKind.REMOTE_ERROR
    assert len({k.value for k in ErrorKind}) == len(ErrorKind)


def test_controller_config_rejects_values_it_cannot_run_with():
    with pytest.raises(ZpathError, match="ZPATH_SCHEDULER_POLICY"):
        ControllerConfig.from_env({"ZPATH_SCHEDULER_POLICY": "lottery"})
    with pytest.raises(ZpathError, match="host_timeout_s"):
        ControllerConfig(host_timeout_s=0)
    with pytest.raises(ZpathError, match="ZPATH_DEVICE_MEMORY_LIMIT"):
        ControllerConfig.from_env({"ZPATH_DEVICE_MEMORY_LIMIT": "-1"})


def test_worker_config_takes_a_niceness_to_add_in_0_to_19():
    assert WorkerConfig.from_env({}).collectives_nice == 10
    assert WorkerConfig.from_env({"ZPATH_COLLECTIVES_NICE": "0"}).collectives_nice == 0
    for bad in ("-1", "20"):
        with pytest.raises(ZpathError, match="ZPATH_COLLECTIVES_NICE must be in 0..19"):
            WorkerConfig.from_env({"ZPATH_COLLECTIVES_NICE": bad})


def test_controller_main_reports_a_bad_setting_in_one_line(tmp_path):
    env = dict(os.environ, ZPATH_KEY="ab" * 32, ZPATH_SCHEDULER_POLICY="lottery")
    out = subprocess.run([sys.executable, "-m", "zpath.controller"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 2
    assert "ZPATH_SCHEDULER_POLICY='lottery'" in out.stderr and "Traceback" not in out.stderr
