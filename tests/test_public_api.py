"""The public names of ``zpath`` are pinned: a change to them is a decision."""
import subprocess
import sys

import zpath

PUBLIC = {"init", "connect", "shutdown", "Cluster", "pmap", "jit", "program", "ProgramFunction", "Mesh",
          "P", "make_virtual_device_set", "VirtualDeviceSet", "VirtualDevice", "Slice", "Future",
          "ZpathError", "ProtocolError", "RemoteError", "HostLost", "Closed", "Broken",
          "DeadlineExceeded", "ResourceError"}


def test_public_names_are_pinned():
    assert set(zpath.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(zpath, name) is not None, name


def test_unknown_name_is_an_attribute_error():
    try:
        zpath.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("zpath.no_such_name did not raise")


def test_controller_and_cluster_tools_do_not_import_jax():
    code = ("import sys, zpath, zpath.controller.server, zpath.cluster.cli, zpath.cluster.launcher\n"
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
