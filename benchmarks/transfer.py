"""Data-plane throughput: ICI between two hosts of one island on this machine
(shared memory, and plain TCP for comparison) next to a numpy memcpy of the same
size, and DCN between islands with an emulated bandwidth cap (and what loopback
TCP carries through the same path, the most any cap can reach here).

    .venv/bin/python benchmarks/transfer.py [--quick] [--only ici|dcn] [--png transfer.png]

``--png`` draws throughput against size (and the DCN rate against its cap)
with matplotlib (benchmarks/plots.py).

Method: a value of N bytes is produced on host A (``v + 1``) and waited for;
then a trivial consumer on host B (``v[..., :1] * 2``) reads it, which makes A
send the whole value to B as one piece. Each worker stamps the wall clock (one
machine, one clock) when its channel begins a send (before the bytes are cut
out of the shard and copied into shared memory or handed to TCP) and when the
receiver has the piece as an array (after copying it out of shared memory into
the array XLA then takes over as the consumer's input, or once the whole TCP
frame is in); the transfer time is the median over repeats of the difference,
asked from the workers with ChannelStatsRequest. The wall time of the consumer
call (median, minus that of a 4-byte value) is shown too: it adds what lies
outside the channel (scheduling, building the consumer's input). memcpy is
measured in this process while the shm cluster is up, right after the ICI
repeats of the same size: ``np.copyto`` into a preallocated array (warm pages)
and ``a.copy()`` (a new array from the allocator, as the receiver makes one:
fresh pages where the allocator maps new ones, its free not timed), medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
sys.path.insert(0, __file__.rsplit("/", 1)[0])

import plots   # noqa: E402  (benchmarks/plots.py)

import zmq   # noqa: E402

import zpath as zp   # noqa: E402
from zpath.client import session as zp_session   # noqa: E402
from zpath.cluster.launcher import LocalCluster   # noqa: E402
from zpath.net import messages as m   # noqa: E402
from zpath.net.transport import Endpoint   # noqa: E402


class Stats:
    """Asks workers' data ports for their ChannelStats."""

    def __init__(self, key: bytes, hosts: dict) -> None:
        self.ep = Endpoint(key, "client:bench")
        self.ctx = zmq.Context()
        self.socks = {}
        for rank, info in hosts.items():
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(info.data_address)
            self.socks[rank] = s

    def get(self, rank: int, reset: bool = False) -> m.ChannelStats:
        s = self.socks[rank]
        self.ep.send(s, m.ChannelStatsRequest(reset))
        if not s.poll(10_000):
            raise RuntimeError(f"host {rank} does not answer")
        return self.ep.recv(s)[2]

    def close(self) -> None:
        for s in self.socks.values():
            s.close(0)
        self.ctx.term()


def median_time(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def memcpy(nbytes: int, repeats: int) -> tuple[float, float]:
    """(warm, new) median seconds: np.copyto into a preallocated, already
    written array; a.copy() into a new one, kept until after its timing so
    that freeing it (an munmap for large arrays) is not counted."""
    a = np.ones(nbytes, np.uint8)
    b = np.empty_like(a)
    b[:] = 0
    warm = median_time(lambda: np.copyto(b, a), repeats)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        c = a.copy()
        ts.append(time.perf_counter() - t)
        del c
    return warm, statistics.median(ts)


class Mover:
    def __init__(self, a, b) -> None:
        self.produce = zp.pmap(lambda v: v + 1, devices=a)
        self.consume = zp.pmap(lambda v: v[..., :1] * 2, devices=b)
        self.src, self.dst = a[0].host, b[0].host
        self.stats = Stats(zp_session._cluster["current"].key, zp_session._cluster["current"].hosts)

    def time(self, nbytes: int, repeats: int) -> tuple[float, float]:
        """(median channel time, median wall time of the consumer call)."""
        x = np.zeros((1, max(1, nbytes // 4)), np.float32)
        self.consume(self.produce(x)).result()    # compile for this shape, warm the path
        for rank in (self.src, self.dst):         # the warm-up's stamps are not samples
            self.stats.get(rank, reset=True)
        ts, chan = [], []
        for _ in range(repeats):
            src = self.produce(x)
            src.result()
            t = time.perf_counter()
            self.consume(src).result()
            ts.append(time.perf_counter() - t)
            del src
            sent = dict(map(tuple, self.stats.get(self.src, reset=True).sent_at))
            got = dict(map(tuple, self.stats.get(self.dst, reset=True).received_at))
            chan += [got[p] - sent[p] for p in sent if p in got]
        self.samples = chan
        return statistics.median(chan), statistics.median(ts)


SIZES: list[int] = []     # --sizes: only these


def parse_size(text: str) -> int:
    """'1K', '64K', '1M', '4096' -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def sizes(quick: bool) -> list[int]:
    if SIZES:
        return list(SIZES)
    top = 64 << 20 if quick else 256 << 20
    out, n = [], 1 << 10
    while n <= top:
        out.append(n)
        n *= 4
    return out


def repeats_for(n: int) -> int:
    return 30 if n <= 1 << 20 else 12 if n <= 16 << 20 else 7 if n <= 64 << 20 else 5


def ici(quick: bool) -> dict[str, list[float]]:
    """Prints the ICI table; returns GB/s per size (``sizes(quick)``) per path."""
    rows = {}
    for label, env in (("shm", {}), ("tcp", {"ZPATH_SHM": "0"})):
        with LocalCluster(islands=1, hosts_per_island=2, devices_per_host=1, env=env) as c:
            zp.connect(c.address, c.key, name="bench")
            try:
                vds = zp.make_virtual_device_set()
                mv = Mover(vds.add_slice(devices=1, host=0).devices, vds.add_slice(devices=1, host=1).devices)
                base = mv.time(4, 40)[1]
                for n in sizes(quick):
                    chan, wall = mv.time(n, repeats_for(n))
                    rows.setdefault(n, {})[label] = chan
                    rows[n][label + " wall"] = wall - base
                    if label == "shm":    # same conditions as the transfers just timed
                        rows[n]["memcpy"] = memcpy(n, max(5, repeats_for(n)))
                mv.stats.close()
            finally:
                zp.shutdown()
    print("ICI, host 0 -> host 1 of one island on this machine: channel time (worker stamps)")
    print(f"{'size':>9} | {'shm us':>9} {'shm GB/s':>9} {'tcp GB/s':>9} | {'memcpy warm':>11} "
          f"{'memcpy new':>10} | {'shm/warm':>8} {'shm/new':>7} | {'call wall-base shm/tcp GB/s':>27}")
    for n in sizes(quick):
        warm, fresh = rows[n]["memcpy"]
        r = rows[n]
        shm, tcp = n / r["shm"] / 1e9, n / r["tcp"] / 1e9
        mw, mf = n / warm / 1e9, n / fresh / 1e9
        print(f"{_size(n):>9} | {r['shm'] * 1e6:9.0f} {shm:9.2f} {tcp:9.2f} | {mw:11.2f} {mf:10.2f} | "
              f"{shm / mw:8.0%} {shm / mf:7.0%} | {_rate(n, r['shm wall']):>13} / "
              f"{_rate(n, r['tcp wall'])}")
    print("(call wall-base: '-' where the call took no longer than the 4-byte one, within noise)")
    ns = sizes(quick)
    return {"shm (channel)": [n / rows[n]["shm"] / 1e9 for n in ns],
            "tcp (channel)": [n / rows[n]["tcp"] / 1e9 for n in ns],
            "memcpy warm": [n / rows[n]["memcpy"][0] / 1e9 for n in ns],
            "memcpy new": [n / rows[n]["memcpy"][1] / 1e9 for n in ns]}


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}" if seconds > 0 else "-"


# a cap far above what loopback TCP carries: measures the link itself through
# the same shaped (chunked) path
UNCAPPED_GBPS = 1000.0


def dcn(quick: bool) -> list[tuple[float, float]]:
    """Prints the DCN table; returns (cap Gbit/s, achieved Gbit/s) per cap."""
    n = 64 << 20
    rows = {}
    for gbps in (1.0, 4.0, 8.0, UNCAPPED_GBPS):
        with LocalCluster(islands=2, hosts_per_island=1, devices_per_host=1, dcn_gbps=gbps) as c:
            zp.connect(c.address, c.key, name="bench")
            try:
                vds = zp.make_virtual_device_set()
                mv = Mover(vds.add_slice(devices=1, island=0).devices, vds.add_slice(devices=1, island=1).devices)
                base = mv.time(4, 20)[1]
                rows[gbps] = (*mv.time(n, 7 if gbps == UNCAPPED_GBPS else 3 if quick else 5), base)
                if gbps == UNCAPPED_GBPS:
                    fastest = min(mv.samples)
                mv.stats.close()
            finally:
                zp.shutdown()
    # what the link carries: its best uncapped time (or a capped rate, if higher)
    link = max(n * 8 / t / 1e9 for t in [fastest, *(r[0] for r in rows.values())])
    print(f"\nDCN, island 0 -> island 1, {_size(n)} piece, emulated bandwidth cap (fixed cost of a "
          f"call subtracted); loopback carries {link:.2f} Gbit/s through this path "
          f"(best of uncapped, cap {UNCAPPED_GBPS:.0f}), so caps above that are not reachable here")
    print(f"{'cap Gbit/s':>10} | {'expected s':>10} {'channel s':>10} | {'rate Gbit/s':>11} {'of cap':>7}"
          f" | {'call wall-base s':>16} | note")
    for gbps, (t, wall, base) in rows.items():
        if gbps == UNCAPPED_GBPS:
            continue
        expected = n * 8 / (gbps * 1e9)
        rate = n * 8 / t / 1e9
        note = "" if gbps <= link else f"cap not reachable (loopback {link:.2f} Gbit/s)"
        print(f"{gbps:10.1f} | {expected:10.3f} {t:10.3f} | {rate:11.2f} {rate / gbps:7.0%}"
              f" | {wall - base:16.3f} | {note}")
    return [(gbps, n * 8 / t / 1e9) for gbps, (t, _, _) in rows.items() if gbps != UNCAPPED_GBPS]


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="sizes up to 64 MiB, fewer repeats")
    p.add_argument("--only", choices=("ici", "dcn"), help="run only this part")
    p.add_argument("--png", help="also draw the figures here (matplotlib)")
    p.add_argument("--sizes", help="only these piece sizes, e.g. 1K,64K,64M")
    p.add_argument("--json", metavar="PATH", help="also write the ICI figures as JSON here "
                   "({'ici': {bytes: {'shm_us', 'tcp_us', 'memcpy_GBps'}}})")
    args = p.parse_args()
    if args.sizes:
        SIZES[:] = [parse_size(t) for t in args.sizes.split(",")]
    print(__doc__.split("Method:", 1)[1].strip().replace("\n", " ").replace("  ", " ")
          .join(["Method: ", "\n"]))
    series = ici(args.quick) if args.only != "dcn" else {}
    if args.json and series:
        ns = sizes(args.quick)
        with open(args.json, "w") as f:
            json.dump({"ici": {str(n): {"shm_us": n / series["shm (channel)"][i] / 1e3,
                                        "tcp_us": n / series["tcp (channel)"][i] / 1e3,
                                        "shm_GBps": series["shm (channel)"][i],
                                        "memcpy_GBps": series["memcpy warm"][i]}
                               for i, n in enumerate(ns)}}, f)
    caps = dcn(args.quick) if args.only != "ici" else []
    if args.png:
        plots.throughput(args.png, sizes(args.quick) if series else [], series, caps,
                         title="zpath data plane on this machine")
        print(f"\npicture: {args.png}")


if __name__ == "__main__":
    main()
