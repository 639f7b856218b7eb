"""The command line and the connection API fail clearly on ordinary mistakes:
usage errors exit with 2, other errors print one line (no traceback) and exit
with 1; none of these needs a running cluster."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import zpath as zp

pytestmark = pytest.mark.timeout(120)
KEY = "00112233445566778899aabbccddeeff"


def zpath_cmd(*args: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("ZPATH_")}
    e.update(env)
    return subprocess.run([sys.executable, "-m", "zpath", *args], capture_output=True, text=True,
                          timeout=60, env=e)


@pytest.mark.parametrize("args,code,says", [
    (["up", "--islands", "0"], 2, "--islands: must be a whole number >= 1"),
    (["up", "--dcn-gbps", "-1"], 2, "--dcn-gbps: must be a number >= 0"),
    (["up", "--controller-port", "70000"], 2, "must be a port number"),
    (["up", "--ifrt-proxy", "0.0.0.0:5000"], 2, "pass --ifrt-proxy-insecure to serve it there anyway"),
    (["up", "--ifrt-proxy", "host:port"], 2, "--ifrt-proxy: ifrt_proxy must be HOST:PORT or PORT"),
    (["up", "--bogus"], 2, "zpath up: error: unrecognized arguments: --bogus"),
    (["status", "localhost:5555"], 1, "is not a controller address: expected tcp://HOST:PORT"),
    (["controller", "--bind", "foo"], 1, "zpath controller: cannot listen on foo"),
    (["worker", "--controller", "tcp://127.0.0.1:1"], 1, "zpath worker: no cluster key"),
])
def test_cli_errors_are_one_line(args, code, says):
    r = zpath_cmd(*args, ZPATH_KEY=KEY) if "worker" not in args else zpath_cmd(*args)
    assert r.returncode == code, r.stdout + r.stderr
    assert says in r.stderr
    assert "Traceback" not in r.stderr


def test_status_without_an_address_or_state_file(tmp_path):
    r = zpath_cmd("status", ZPATH_STATE=str(tmp_path / "none.json"))
    assert r.returncode == 2 and "no state file" in r.stderr, r.stderr


def test_missing_or_bad_key_files(tmp_path):
    r = zpath_cmd("status", "tcp://127.0.0.1:1", ZPATH_KEY_FILE=str(tmp_path / "nope"))
    assert r.returncode == 1 and "cannot read the key file" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.key"
    bad.write_text("not hex\n")
    r = zpath_cmd("status", "tcp://127.0.0.1:1", ZPATH_KEY_FILE=str(bad))
    assert r.returncode == 1 and "is not hexadecimal" in r.stderr, r.stderr


def test_init_checks_the_cluster_shape_before_starting_anything(monkeypatch):
    monkeypatch.delenv("ZPATH_CONTROLLER", raising=False)
    for bad in ("1", 1.5, 0, True):
        with pytest.raises(ValueError, match="islands must be a whole number >= 1"):
            zp.init(islands=bad)
    with pytest.raises(ValueError, match="devices_per_host must be a whole number >= 1"):
        zp.init(devices_per_host=-2)


def test_connect_checks_its_arguments_before_connecting():
    with pytest.raises(zp.ZpathError, match="is not a cluster address"):
        zp.connect("127.0.0.1:5555", KEY)
    with pytest.raises(zp.ZpathError, match="is not hexadecimal"):
        zp.connect("tcp://127.0.0.1:1", "xyz")
    with pytest.raises(zp.ZpathError, match="has 4 bytes; a cluster key has at least 16"):
        zp.connect("tcp://127.0.0.1:1", b"abcd")
    with pytest.raises(ValueError, match="timeout must be"):
        zp.connect("tcp://127.0.0.1:1", KEY, timeout=0)
    with pytest.raises(ValueError, match="weight must be"):
        zp.init(weight=0)                   # before starting anything
    with pytest.raises(zp.DeadlineExceeded, match="within 0.5s"):
        zp.connect("tcp://127.0.0.1:1", KEY, timeout=0.5)


def test_version_names_zpath_and_what_it_runs_on():
    """``zpath --version`` prints one line on stdout and exits 0, as CLIs do,
    with the versions a bug report needs."""
    from importlib import metadata

    r = zpath_cmd("--version")
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert line.startswith(f"zpath {zp.__version__} (") and "\n" not in line
    assert f"jax {metadata.version('jax')}" in line and f"jaxlib {metadata.version('jaxlib')}" in line
    assert f"Python {sys.version.split()[0]}" in line
