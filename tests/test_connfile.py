"""Connection files (zpath/cluster/connfile.py): how a process of the same user
on the same machine finds a local cluster and its key. Pure: files in a
temporary directory, pids of this process and of one that has exited."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import psutil
import pytest

import zpath as zp
from zpath.cluster import connfile
from zpath.config import ClientConfig, CommonConfig
from zpath.errors import ZpathError

pytestmark = pytest.mark.timeout(30)

KEY = bytes(range(32))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(20)
    return p.pid


def _fake(directory, name: str, **info) -> str:
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    return path


def test_a_written_file_is_private_and_found_by_address(tmp_path):
    run = tmp_path / "run"
    path = connfile.write(str(run), "tcp://127.0.0.1:4321", KEY, os.getpid())
    assert stat.S_IMODE(os.stat(run).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    info = connfile.find(str(run), "tcp://localhost:4321")      # localhost is 127.0.0.1
    assert info is not None and info.key == KEY.hex() and info.pid == os.getpid()
    assert connfile.find(str(run), "tcp://127.0.0.1:4322") is None
    assert connfile.find(str(run), "tcp://10.0.0.1:4321") is None
    assert connfile.client_key("tcp://127.0.0.1:4321", ClientConfig(runtime_dir=str(run)),
                               CommonConfig()) == KEY
    connfile.remove(path)
    assert connfile.find(str(run)) is None


def test_the_newest_live_cluster_wins_and_stale_files_are_ignored_and_removed(tmp_path):
    me = os.getpid()
    born = psutil.Process(me).create_time()
    old = _fake(tmp_path, f"cluster-{me}.json", address="tcp://127.0.0.1:1", key=KEY.hex(), pid=me,
                create_time=born, started=100.0)
    dead = _dead_pid()
    stale = _fake(tmp_path, f"cluster-{dead}.json", address="tcp://127.0.0.1:2", key=KEY.hex(),
                  pid=dead, create_time=born, started=300.0)
    # this process's pid with another start time: a reused pid, not the controller
    reused = _fake(tmp_path, "cluster-1.json", address="tcp://127.0.0.1:3", key=KEY.hex(), pid=me,
                   create_time=born - 1000, started=400.0)
    newer = _fake(tmp_path, "cluster-2.json", address="tcp://127.0.0.1:4", key=KEY.hex(), pid=me,
                  create_time=born, started=200.0)
    other_mode = _fake(tmp_path, "cluster-3.json", address="tcp://127.0.0.1:5", key=KEY.hex(), pid=me,
                       create_time=born, started=500.0)
    os.chmod(other_mode, 0o644)                 # readable by others: never trusted
    _fake(tmp_path, "cluster-4.json", address="tcp://127.0.0.1:6")     # malformed
    assert [i.address for i in connfile.live(str(tmp_path))] == ["tcp://127.0.0.1:4", "tcp://127.0.0.1:1"]
    assert connfile.find(str(tmp_path)).path == newer
    assert not os.path.exists(stale) and not os.path.exists(reused)
    assert os.path.exists(old) and os.path.exists(other_mode)


def test_without_a_local_cluster_the_key_is_required_and_the_error_says_how(tmp_path):
    cfg = ClientConfig(runtime_dir=str(tmp_path))
    with pytest.raises(ZpathError, match=r"no cluster key for tcp://10\.1\.2\.3:5555.*key=.*ZPATH_KEY_FILE"):
        connfile.client_key("tcp://10.1.2.3:5555", cfg, CommonConfig())
    assert connfile.client_key("tcp://10.1.2.3:5555", cfg, CommonConfig(key=KEY.hex())) == KEY


def test_connect_without_an_address_needs_a_local_cluster(tmp_path):
    with pytest.raises(ZpathError, match="no local cluster is running"):
        zp.connect(config=ClientConfig(runtime_dir=str(tmp_path)))
