"""The transformer example (examples/transformer/) trains with the same per-step
losses as plain JAX in one process, in each of its layouts: SPMD over a
data x model mesh spanning two hosts, a pipeline of 2 and of 4 stages (a stage
per host), and data parallel over two islands with the gradients crossing the
DCN in buckets. One small model and one cluster for the module."""
from __future__ import annotations

import re
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np
import pytest

import zpath as zp
from zpath.cluster.testing import connected, running_cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from transformer import layouts as L  # noqa: E402  (examples/ is not a package)
from transformer import model as M  # noqa: E402

pytestmark = pytest.mark.timeout(300)

CFG = M.Config(vocab=32, seq=16, d_model=32, heads=2, layers=4, d_ff=64, batch=8)
STEPS = 10


@pytest.fixture(scope="module")
def data() -> list[np.ndarray]:
    return M.batches(CFG, STEPS)


@pytest.fixture(scope="module")
def reference_run(data: list[np.ndarray]) -> Iterator[Future]:
    """Plain JAX's losses, computed on a thread of this process (its compilation
    leaves a core free) while the cluster starts."""
    with ThreadPoolExecutor(1, thread_name_prefix="reference") as pool:
        yield pool.submit(M.reference_losses, CFG, data)


@pytest.fixture(scope="module")
def reference(reference_run: Future) -> list[float]:
    losses = reference_run.result(timeout=300)
    assert losses[-1] < losses[0] - 0.05, f"the model does not learn: {losses}"
    return losses


@pytest.fixture(scope="module")
def hosts(reference_run: Future) -> Any:
    """Two islands of two hosts, two devices per host, with an emulated DCN;
    the devices of each host (hosts of island 0 first). (The reference is
    under way meanwhile.)"""
    with running_cluster(islands=2, hosts_per_island=2, devices_per_host=2,
                         dcn_gbps=1.0, dcn_latency_ms=0.5) as cluster:
        with connected(cluster):
            vds = zp.make_virtual_device_set()
            devs = [vds.add_slice(devices=2, host=h).devices for h in range(4)]
            yield sorted(devs, key=lambda d: (d[0].island, d[0].host))


def _check(layout: L.Layout, data: list[np.ndarray], reference: list[float]) -> None:
    losses = layout.train(data, timeout=120)
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-5,
                               err_msg=f"{layout.name}: losses differ from plain JAX")


def _transfers(text: str) -> list[tuple[int, int, int, str, str]]:
    """(buffer, source host, destination host, channel, node) of every transfer
    in an ``explain`` text."""
    out, node = [], ""
    for line in text.splitlines():
        if m := re.match(r"\s+node \d+ (\S+):", line):
            node = m.group(1)
        elif m := re.match(r"\s+transfer buffer (\d+): host (\d+) -> host (\d+), \d+ bytes over (\w+)", line):
            out.append((int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4), node))
    return out


def test_spmd_on_a_mesh_over_two_hosts(hosts: Any, data: list[np.ndarray], reference: list[float]) -> None:
    devices = hosts[0] + hosts[1]
    assert len({d.host for d in devices}) == 2
    _check(L.Spmd(CFG, devices, mesh_shape=(2, 2)), data, reference)


@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline(hosts: Any, data: list[np.ndarray], reference: list[float], stages: int) -> None:
    layout = L.Pipeline(CFG, hosts[:stages], microbatches=2)
    _check(layout, data, reference)
    # every stage runs on its own host, and values move only between neighbours
    stage_of = {devs[0].host: k for k, devs in enumerate(hosts[:stages])}
    moves = _transfers(layout.explain(data[0]))
    assert moves, "a pipeline moves activations between its stages"
    for _, src, dst, _, node in moves:
        assert abs(stage_of[src] - stage_of[dst]) == 1, f"{node}: host {src} -> host {dst}"


def test_two_islands_data_parallel(hosts: Any, data: list[np.ndarray], reference: list[float]) -> None:
    islands = [hosts[0], hosts[2]]                 # one host of each island
    assert islands[0][0].island != islands[1][0].island
    layout = L.TwoIslands(CFG, islands, bucket_bytes=16 << 10)
    _check(layout, data, reference)
    # the gradients cross the DCN as a few buckets (and the loss), not leaf by leaf
    leaves = len(jax.tree.leaves(M.init_params(CFG)))
    assert 1 < len(layout.groups) < leaves / 4
    crossing = {b for b, _, _, ch, _ in _transfers(layout.explain(data[0])) if ch == "DCN"}
    assert len(crossing) == 2 * (len(layout.groups) + 1), (len(crossing), len(layout.groups))
