"""Resource manager: hosts, islands, devices, and virtual slices mapped onto
physical devices. A plain class: no sockets, no threads."""
from __future__ import annotations

import dataclasses
import collections
import itertools

from zpath.errors import ResourceError


class LostHosts(ResourceError):
    """The devices include hosts that were lost."""

    def __init__(self, hosts: list[int]) -> None:
        super().__init__(f"host(s) {hosts} are lost")
        self.hosts = hosts

MAX_DEVICES_PER_HOST = 4096


@dataclasses.dataclass
class Device:
    id: int
    host: int
    island: int
    local_index: int
    jax_id: int = -1         # the device's id in JAX
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
    runtime: str = ""        # the island's jax.distributed coordinator ("" if none)
    alive: bool = True
    lost_why: str = ""       # why it was lost
    machine: str = ""        # machine id: ICI between hosts of one machine uses shared memory
    public_key: str = ""     # CURVE public key for encrypted DCN ("" if off)
    dcn_address: str = ""    # its CURVE-encrypted data port ("" if off)


class ResourceManager:
    def __init__(self) -> None:
        self.hosts: dict[int, Host] = {}
        self.devices: dict[int, Device] = {}
        self.slices: dict[int, list[int]] = {}
        self._ranks = itertools.count()
        self._device_ids = itertools.count()
        self._slice_ids = itertools.count(1)
        # bumped whenever the virtual->physical mapping changes (a host added or
        # lost): what was planned against an older version must be planned again
        self.version = 0
        # device lists that passed check_spmd, and hosts' device counts, at a version
        self._spmd_ok: dict[tuple[int, ...], int] = {}
        self._host_counts: dict[tuple[int, ...], tuple[int, collections.Counter[int]]] = {}

    def add_host(self, *, name: str, island: int, data_address: str, pid: int,
                 platform: str, num_devices: int, jax_ids: list[int] | None = None,
                 runtime: str = "", machine: str = "", public_key: str = "",
                 dcn_address: str = "", rank: int = -1) -> Host:
        """Register a host. Hosts of one island that share a ``runtime`` (a
        jax.distributed coordinator address) can run one SPMD computation together.
        ``rank``: the rank it asks for (its launcher's numbering, so that host
        numbers and names agree whatever order hosts register in); taken, or
        -1: the lowest rank not yet given."""
        if island < 0:
            raise ResourceError(f"island must be >= 0, got {island}")
        if not 1 <= num_devices <= MAX_DEVICES_PER_HOST:
            raise ResourceError(f"a host needs 1 to {MAX_DEVICES_PER_HOST} devices, got {num_devices}")
        if jax_ids is not None and len(jax_ids) != num_devices:
            raise ResourceError(f"{len(jax_ids)} JAX ids for {num_devices} devices")
        if runtime:
            for h in self.hosts.values():
                if h.runtime == runtime and h.island != island:
                    raise ResourceError(f"runtime {runtime} already belongs to island {h.island}")
        if rank < 0 or rank in self.hosts:
            rank = next(r for r in self._ranks if r not in self.hosts)
        ids = []
        for i in range(num_devices):
            d = Device(next(self._device_ids), rank, island, i, jax_ids[i] if jax_ids else i)
            self.devices[d.id] = d
            ids.append(d.id)
        host = Host(rank, island, name, data_address, pid, platform, ids, runtime,
                    machine=machine, public_key=public_key, dcn_address=dcn_address)
        self.hosts[rank] = host
        self.version += 1
        return host

    def lose_host(self, rank: int, why: str = "") -> Host:
        """Mark a host lost (it gets no new work) and bump :attr:`version`."""
        host = self.hosts[rank]
        host.alive = False
        host.lost_why = why
        self.version += 1
        return host

    def route(self, src: int, dst: int) -> tuple[str, str, str, str]:
        """How host ``src`` sends a piece to host ``dst``: (channel, data address,
        destination machine id, destination CURVE key or ""). Same island: ICI;
        otherwise DCN, through the encrypted port when the destination has one."""
        s, d = self.hosts[src], self.hosts[dst]
        if s.island == d.island:
            return "ICI", d.data_address, d.machine, ""
        if d.dcn_address and d.public_key:
            return "DCN", d.dcn_address, d.machine, d.public_key
        return "DCN", d.data_address, d.machine, ""

    def islands(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for h in self.hosts.values():
            if h.alive:
                out.setdefault(h.island, []).append(h.rank)
        return out

    def alloc_slice(self, n: int, *, island: int | None = None,
                    host: int | None = None) -> tuple[int, list[int]]:
        """Place ``n`` virtual devices. A slice that fits on one host goes on one
        host; a larger one spans hosts of one island that share a JAX runtime
        (see :meth:`_alloc_spread`). Among hosts that
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
            if host is not None and self.hosts[host].island != island:
                raise ResourceError(f"host {host} is on island {self.hosts[host].island}, not island {island}")
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
            chosen = self._alloc_spread(n, hosts) if host is None else None
            if chosen is None:
                largest = max((len(h.devices) for h in hosts), default=0)
                where = f"host {host}" if host is not None else "no host"
                if host is not None:
                    raise ResourceError(f"host {host} has {largest} devices, not {n}")
                groups = self._runtimes(hosts)
                if not groups:
                    raise ResourceError(f"{where} has {n} devices (largest host has {largest}), and "
                                        "no island has several hosts to spread a slice over")
                most = max(sum(len(h.devices) for h in g) for g in groups.values())
                raise ResourceError(f"{where} has {n} devices (largest host has {largest}) and no "
                                    f"island runtime has {n} (largest has {most})")
        else:
            chosen = sorted(best[3], key=lambda d: d.local_index)
        for d in chosen:
            d.load += 1
        chosen = sorted(chosen, key=lambda d: (d.host, d.local_index))
        sid = next(self._slice_ids)
        self.slices[sid] = [d.id for d in chosen]
        return sid, self.slices[sid]

    @staticmethod
    def _runtimes(hosts: list[Host]) -> dict[tuple[int, str], list[Host]]:
        groups: dict[tuple[int, str], list[Host]] = {}
        for h in hosts:
            if h.runtime:
                groups.setdefault((h.island, h.runtime), []).append(h)
        return groups

    def _alloc_spread(self, n: int, hosts: list[Host]) -> list[Device] | None:
        """``n`` least-loaded devices of one multi-host island runtime (the least
        loaded runtime that has enough), or None."""
        best: tuple[int, int, list[Device]] | None = None
        for (island, _), group in sorted(self._runtimes(hosts).items()):
            devs = sorted((self.devices[d] for h in group for d in h.devices),
                          key=lambda d: (d.load, d.host, d.local_index))
            if len(group) < 2 or len(devs) < n:
                continue
            cost = (sum(d.load for d in devs[:n]), island)
            if best is None or cost < best[:2]:
                best = (*cost, devs[:n])
        return None if best is None else best[2]

    def check_spmd(self, devices: list[int]) -> None:
        """Raise ResourceError unless one SPMD computation can run on ``devices``:
        all on one live host, or on live hosts of one island sharing a runtime.
        A device list that passed is remembered until the mapping changes."""
        key = tuple(devices)
        if self._spmd_ok.get(key) == self.version:
            return
        self._check_spmd(devices)
        if len(self._spmd_ok) >= 4096:
            self._spmd_ok.clear()
        self._spmd_ok[key] = self.version

    def host_counts(self, devices: list[int]) -> collections.Counter[int]:
        """How many of ``devices`` each host has (remembered per device list
        until the mapping changes; do not modify it)."""
        key = tuple(devices)
        hit = self._host_counts.get(key)
        if hit is not None and hit[0] == self.version:
            return hit[1]
        if len(self._host_counts) >= 4096:
            self._host_counts.clear()
        counts = collections.Counter(self.devices[d].host for d in devices)
        self._host_counts[key] = (self.version, counts)
        return counts

    def _check_spmd(self, devices: list[int]) -> None:
        try:
            hosts = {self.devices[d].host for d in devices}
        except KeyError as e:
            raise ResourceError(f"unknown device {e}") from None
        dead = [h for h in hosts if not self.hosts[h].alive]
        if dead:
            raise LostHosts(sorted(dead))
        if len(hosts) == 1:
            return
        islands = {self.hosts[h].island for h in hosts}
        runtimes = {self.hosts[h].runtime for h in hosts}
        if len(islands) > 1:
            raise ResourceError(f"devices {devices} span islands {sorted(islands)}: one computation "
                                "runs within one island (move values between islands instead)")
        if len(runtimes) > 1 or "" in runtimes:
            raise ResourceError(f"devices {devices} span hosts {sorted(hosts)} that do not share a "
                                "JAX distributed runtime")
