"""Resource manager: hosts, islands, devices, and virtual slices mapped onto
physical devices. A plain class: no sockets, no threads."""
from __future__ import annotations

import dataclasses
import itertools

from zpath.errors import ResourceError


@dataclasses.dataclass
class Device:
    id: int
    host: int
    island: int
    local_index: int
    load: int = 0            # slices placed on this device


@dataclasses.dataclass
class Host:
    rank: int
    island: int
    name: str
    data_address: str
    pid: int
    platform: str
    devices: list[int]
    alive: bool = True


class ResourceManager:
    def __init__(self) -> None:
        self.hosts: dict[int, Host] = {}
        self.devices: dict[int, Device] = {}
        self.slices: dict[int, list[int]] = {}
        self._ranks = itertools.count()
        self._device_ids = itertools.count()
        self._slice_ids = itertools.count(1)

    def add_host(self, *, name: str, island: int, data_address: str, pid: int,
                 platform: str, num_devices: int) -> Host:
        if island < 0:
            raise ResourceError(f"island must be >= 0, got {island}")
        if num_devices < 1:
            raise ResourceError(f"a host needs at least one device, got {num_devices}")
        rank = next(self._ranks)
        ids = []
        for i in range(num_devices):
            d = Device(next(self._device_ids), rank, island, i)
            self.devices[d.id] = d
            ids.append(d.id)
        host = Host(rank, island, name, data_address, pid, platform, ids)
        self.hosts[rank] = host
        return host

    def islands(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for h in self.hosts.values():
            if h.alive:
                out.setdefault(h.island, []).append(h.rank)
        return out

    def alloc_slice(self, n: int, *, island: int | None = None,
                    host: int | None = None) -> tuple[int, list[int]]:
        """Place ``n`` virtual devices. All devices of a slice are on one host
        (SPMD across the hosts of an island is not supported yet). Among hosts that
        satisfy the constraints, picks the one whose ``n`` least-loaded devices
        carry the least load (ties: the host with the least load in all, then the
        lowest rank), so successive slices spread over the cluster's hosts."""
        if n < 1:
            raise ResourceError(f"a slice needs at least one device, got {n}")
        hosts = [h for h in self.hosts.values() if h.alive]
        if host is not None:
            if host not in self.hosts or not self.hosts[host].alive:
                raise ResourceError(f"no live host {host} (hosts: {sorted(self.hosts)})")
            hosts = [self.hosts[host]]
        if island is not None:
            hosts = [h for h in hosts if h.island == island]
            if not hosts:
                raise ResourceError(f"no live host on island {island} "
                                    f"(islands: {sorted(self.islands())})")
        best: tuple[int, int, int, list[Device]] | None = None
        for h in hosts:
            devs = sorted((self.devices[d] for d in h.devices), key=lambda d: (d.load, d.local_index))
            if len(devs) < n:
                continue
            chosen = devs[:n]
            cost = (sum(d.load for d in chosen), sum(d.load for d in devs), h.rank)
            if best is None or cost < best[:3]:
                best = (*cost, chosen)
        if best is None:
            largest = max((len(h.devices) for h in hosts), default=0)
            raise ResourceError(f"no host has {n} devices (largest host has {largest}); "
                                "a slice must fit on one host")
        chosen = sorted(best[3], key=lambda d: d.local_index)
        for d in chosen:
            d.load += 1
        sid = next(self._slice_ids)
        self.slices[sid] = [d.id for d in chosen]
        return sid, self.slices[sid]
