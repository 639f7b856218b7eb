"""ResourceManager as a pure unit: registrations and slices in, placements out."""
from __future__ import annotations

import pytest

from zpath.controller.resources import ResourceManager
from zpath.errors import ResourceError, ZpathError

pytestmark = pytest.mark.timeout(60)


def add(rm: ResourceManager, island: int = 0, n: int = 4, name: str = "h", runtime: str = ""):
    return rm.add_host(name=name, island=island, data_address=f"tcp://{name}:1", pid=100,
                       platform="cpu", num_devices=n, runtime=runtime)


def hosts_of(rm: ResourceManager, ids: list[int]) -> set[int]:
    return {rm.devices[d].host for d in ids}


def test_registration_assigns_ranks_and_global_device_ids():
    rm = ResourceManager()
    h0 = add(rm, island=0, n=2, name="a")
    h1 = add(rm, island=1, n=3, name="b")
    h2 = add(rm, island=0, n=1, name="c")
    assert [h0.rank, h1.rank, h2.rank] == [0, 1, 2]
    assert h0.devices == [0, 1] and h1.devices == [2, 3, 4] and h2.devices == [5]
    assert sorted(rm.devices) == list(range(6))
    for h in (h0, h1, h2):
        assert rm.hosts[h.rank] is h
        assert [rm.devices[d].local_index for d in h.devices] == list(range(len(h.devices)))
        assert all(rm.devices[d].host == h.rank and rm.devices[d].island == h.island
                   for d in h.devices)
    assert h1.name == "b" and h1.data_address == "tcp://b:1" and h1.platform == "cpu"
    assert rm.islands() == {0: [0, 2], 1: [1]}


def test_a_host_gets_the_rank_it_asks_for_unless_taken():
    """Launchers number their hosts (local-i0-h1 is rank 1): hosts get those
    ranks whatever order they register in; one that asks for none, or for a
    taken one, gets the lowest free rank."""
    rm = ResourceManager()
    late = rm.add_host(name="i1-h0", island=1, data_address="tcp://x:1", pid=1, platform="cpu",
                       num_devices=1, rank=2)
    first = rm.add_host(name="i0-h0", island=0, data_address="tcp://x:2", pid=2, platform="cpu",
                        num_devices=1, rank=0)
    assert (late.rank, first.rank) == (2, 0)
    assert add(rm, name="any").rank == 1
    taken = rm.add_host(name="dup", island=0, data_address="tcp://x:3", pid=3, platform="cpu",
                        num_devices=1, rank=2)
    assert taken.rank == 3 and add(rm, name="next").rank == 4
    assert sorted(rm.hosts) == [0, 1, 2, 3, 4]


def test_registration_rejects_bad_hosts_without_using_a_rank():
    rm = ResourceManager()
    with pytest.raises(ResourceError, match="island must be >= 0, got -1"):
        add(rm, island=-1)
    with pytest.raises(ResourceError, match="1 to 4096 devices, got 0"):
        add(rm, n=0)
    assert rm.hosts == {} and rm.devices == {}
    assert add(rm).rank == 0
    assert issubclass(ResourceError, ZpathError)


def test_slices_spread_over_least_loaded_hosts():
    rm = ResourceManager()
    add(rm, n=4, name="a")           # devices 0-3
    add(rm, n=4, name="b")           # devices 4-7
    placed = [rm.alloc_slice(2) for _ in range(5)]
    ids = [sid for sid, _ in placed]
    assert ids == [1, 2, 3, 4, 5]                         # slice ids increase
    devs = [d for _, d in placed]
    assert devs[0] == [0, 1]                              # tie: lowest rank
    assert devs[1] == [4, 5]                              # host 0 is now loaded
    assert devs[2] == [2, 3]                              # idle devices of host 0
    assert devs[3] == [6, 7]
    assert devs[4] == [0, 1]                              # every device has load 1
    assert [rm.devices[d].load for d in range(8)] == [2, 2, 1, 1, 1, 1, 1, 1]
    assert rm.slices[5] == [0, 1]


def test_slice_prefers_host_with_least_total_load():
    rm = ResourceManager()
    add(rm, n=4, name="a")
    add(rm, n=2, name="b")
    assert rm.alloc_slice(2)[1] == [0, 1]
    assert rm.alloc_slice(2)[1] == [4, 5]
    assert rm.alloc_slice(2)[1] == [2, 3]
    # a 4-device slice only fits on host 0 even though it is more loaded
    assert rm.alloc_slice(4)[1] == [0, 1, 2, 3]
    # single devices go to host 1 (load 1) before host 0 (load 2)
    assert hosts_of(rm, rm.alloc_slice(1)[1]) == {1}


def test_slice_devices_are_on_one_host_and_sorted():
    rm = ResourceManager()
    add(rm, n=3)
    add(rm, n=3)
    for _ in range(6):
        _, devs = rm.alloc_slice(3)
        assert len(hosts_of(rm, devs)) == 1
        assert devs == sorted(devs)
    with pytest.raises(ResourceError, match="no host has 4 devices \\(largest host has 3\\), and no "
                       "island has several hosts to spread a slice over"):
        rm.alloc_slice(4)


def test_island_and_host_constraints():
    rm = ResourceManager()
    add(rm, island=0, n=2)           # host 0: devices 0-1
    add(rm, island=1, n=2)           # host 1: devices 2-3
    add(rm, island=1, n=2)           # host 2: devices 4-5
    for _ in range(4):
        _, devs = rm.alloc_slice(1, island=1)
        assert hosts_of(rm, devs) <= {1, 2}
    for _ in range(3):
        _, devs = rm.alloc_slice(2, host=2)
        assert devs == [4, 5]
    assert rm.alloc_slice(1, island=0)[1] == [0]
    assert rm.alloc_slice(2, island=1, host=1)[1] == [2, 3]
    # host 0 is untouched by island-1 requests except the one above
    assert rm.devices[1].load == 0


def test_impossible_requests_have_clear_errors():
    rm = ResourceManager()
    with pytest.raises(ResourceError, match="largest host has 0"):
        rm.alloc_slice(1)                                  # no hosts at all
    add(rm, island=0, n=2)
    add(rm, island=1, n=4)
    with pytest.raises(ResourceError, match="at least one device, got 0"):
        rm.alloc_slice(0)
    with pytest.raises(ResourceError, match="got -3"):
        rm.alloc_slice(-3)
    with pytest.raises(ResourceError, match="no host has 5 devices \\(largest host has 4\\)"):
        rm.alloc_slice(5)
    with pytest.raises(ResourceError, match="no host has 3 devices \\(largest host has 2\\)"):
        rm.alloc_slice(3, island=0)
    with pytest.raises(ResourceError, match="host 0 has 2 devices, not 3"):
        rm.alloc_slice(3, host=0)
    with pytest.raises(ResourceError, match="no live host on island 7 \\(islands: \\[0, 1\\]\\)"):
        rm.alloc_slice(1, island=7)
    with pytest.raises(ResourceError, match="no live host 9 \\(hosts: \\[0, 1\\]\\)"):
        rm.alloc_slice(1, host=9)
    with pytest.raises(ResourceError, match="host 0 is on island 0, not island 1"):
        rm.alloc_slice(1, island=1, host=0)
    # failed requests placed nothing
    assert rm.slices == {} and all(d.load == 0 for d in rm.devices.values())


def test_dead_hosts_are_skipped():
    rm = ResourceManager()
    add(rm, n=2)
    add(rm, n=2)
    rm.hosts[0].alive = False
    assert rm.islands() == {0: [1]}
    for _ in range(3):
        assert hosts_of(rm, rm.alloc_slice(2)[1]) == {1}
    with pytest.raises(ResourceError, match="no live host 0"):
        rm.alloc_slice(1, host=0)
    rm.hosts[1].alive = False
    with pytest.raises(ResourceError, match="no live host on island 0"):
        rm.alloc_slice(1, island=0)
    with pytest.raises(ResourceError):
        rm.alloc_slice(1)


def test_multi_host_slices_need_a_shared_runtime():
    rm = ResourceManager()
    add(rm, island=0, n=2, runtime="coord:1")       # host 0: devices 0-1
    add(rm, island=0, n=2, runtime="coord:1")       # host 1: devices 2-3
    add(rm, island=1, n=2)                          # host 2: devices 4-5, no runtime
    add(rm, island=1, n=2)                          # host 3: devices 6-7, no runtime
    # fits on one host: stays on one host
    _, devs = rm.alloc_slice(2)
    assert len(hosts_of(rm, devs)) == 1
    # 4 devices: only island 0's runtime can hold them, across both its hosts
    _, devs = rm.alloc_slice(4)
    assert devs == [0, 1, 2, 3]
    with pytest.raises(ResourceError, match="no island runtime has 5"):
        rm.alloc_slice(5)
    with pytest.raises(ResourceError, match="no host has 4"):
        rm.alloc_slice(4, island=1)
    # a computation on devices of two hosts: only within one runtime
    rm.check_spmd([0, 3])
    rm.check_spmd([4, 5])
    with pytest.raises(ResourceError, match="span islands"):
        rm.check_spmd([0, 4])
    with pytest.raises(ResourceError, match="do not share a JAX distributed runtime"):
        rm.check_spmd([4, 6])
    with pytest.raises(ResourceError, match="unknown device"):
        rm.check_spmd([99])
    with pytest.raises(ResourceError, match="already belongs to island 0"):
        add(rm, island=1, runtime="coord:1")


def test_multi_host_slices_spread_load():
    rm = ResourceManager()
    add(rm, island=0, n=2, runtime="a")
    add(rm, island=0, n=2, runtime="a")
    add(rm, island=1, n=2, runtime="b")
    add(rm, island=1, n=2, runtime="b")
    first = rm.alloc_slice(3)[1]
    second = rm.alloc_slice(3)[1]
    assert {rm.devices[d].island for d in first} != {rm.devices[d].island for d in second}


def test_version_changes_with_the_mapping():
    rm = ResourceManager()
    assert rm.version == 0
    add(rm, n=2, name="a")
    add(rm, n=2, name="b")
    assert rm.version == 2                      # every host added
    rm.alloc_slice(2)
    rm.check_spmd([0, 1])
    rm.route(0, 1)
    assert rm.version == 2                      # placing and asking change nothing
    with pytest.raises(ResourceError):
        add(rm, n=0)
    assert rm.version == 2                      # a rejected host is no change
    assert rm.lose_host(0) is rm.hosts[0]
    assert not rm.hosts[0].alive and rm.hosts[1].alive
    assert rm.version == 3
    assert rm.islands() == {0: [1]}
    assert hosts_of(rm, rm.alloc_slice(2)[1]) == {1}
    with pytest.raises(ResourceError, match="lost"):
        rm.check_spmd([0])
    with pytest.raises(KeyError):
        rm.lose_host(7)
    assert rm.version == 3
