"""The pytest plugin in zpath/cluster/testing.py: registered through its entry point,
the cluster factory stops what it started, hosts can be paused, resumed and
killed by rank or name."""
from __future__ import annotations


import numpy as np
import psutil
import pytest

import zpath as zp
from zpath.cluster.testing import connected, kill_host, pause_host, resume_host

pytestmark = pytest.mark.timeout(180)


def test_plugin_is_registered(request):
    assert request.config.pluginmanager.hasplugin("zpath")


_pids: list[int] = []


def test_factory_pause_resume_kill(zpath_cluster):
    cluster = zpath_cluster(islands=2, devices_per_host=1,
                            env={"ZPATH_HOST_TIMEOUT": "3", "ZPATH_CLIENT_TIMEOUT": "30"})
    _pids.extend(cluster.pids)
    with connected(cluster):
        d0 = zp.make_virtual_device_set().add_slice(devices=1, island=0).devices
        d1 = zp.make_virtual_device_set().add_slice(devices=1, island=1).devices
        inc1 = zp.pmap(lambda x: x + 1, devices=d1)
        inc1(np.ones(1)).result(timeout=60)                    # compiled before the pause
        pid = pause_host(cluster, d1[0].host)                  # by rank
        assert psutil.Process(pid).status() == psutil.STATUS_STOPPED
        fut = inc1(np.ones(1))
        with pytest.raises(zp.DeadlineExceeded):         # its host is frozen: no value comes
            fut.result(timeout=1.0)
        assert not fut.done()
        resume_host(cluster, "local-i1-h0")                    # by host name
        np.testing.assert_array_equal(fut.result(timeout=60), [2.])
        kill_host(cluster, "worker-i1-h0")                     # by process name
        with pytest.raises(zp.HostLost):
            inc1(np.ones(1)).result(timeout=60)
        np.testing.assert_array_equal(
            zp.pmap(lambda x: x * 2, devices=d0)(np.ones(1)).result(timeout=60), [2.])


def test_factory_stopped_every_process():
    assert _pids
    assert not [p for p in _pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_client_fixture(zpath_client):
    devs = zp.make_virtual_device_set().add_slice(devices=2).devices
    np.testing.assert_array_equal(zp.pmap(lambda x: x * 3, devices=devs)(np.ones(2)).result(timeout=60),
                                  [3., 3.])
