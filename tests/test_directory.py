"""Directory.plan as a pure unit: Call messages in, Execute and SendPiece out.

Besides checking the plans' shape, :class:`World` plays the plans out on numpy
arrays the way the workers would (SendPiece cuts a piece out of a stored shard
and sends it to a host; an input shard is assembled from local shards and
received pieces) and checks that every input shard ends up holding exactly the
right part of its global array."""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import numpy as np
import pytest

from zpath import sharding
from zpath.controller.directory import Directory, Plan, PlanError, host_shards
from zpath.net import messages as m

pytestmark = pytest.mark.timeout(60)

DEVICES_PER_HOST = 4
HOSTS = 3
HOST_OF = {d: d // DEVICES_PER_HOST for d in range(HOSTS * DEVICES_PER_HOST)}
PROGRAM = "ab" * 32
OTHER = "cd" * 32


def address(h: int) -> str:
    return f"tcp://host{h}:9000"


def new_directory() -> Directory:
    return Directory(HOST_OF.__getitem__, address)


def inp(buf: int, shape: list[int], spec: list, put: bool = False, dtype: str = "float32") -> m.CallInput:
    return m.CallInput(buf, m.Aval(list(shape), dtype), spec, put)


def out(buf: int, shape: list[int], spec: list, dtype: str = "float32") -> m.CallOutput:
    return m.CallOutput(buf, m.Aval(list(shape), dtype), spec)


_call_ids = iter(range(1, 1 << 30))


def call(devices: list[int], inputs: list[m.CallInput], outputs: list[m.CallOutput] = (),
         mesh_shape: list[int] | None = None, axis_names: list[str] | None = None,
         program: str = PROGRAM) -> m.Call:
    mesh_shape = mesh_shape or [len(devices)]
    axis_names = axis_names or ["x", "y", "z"][:len(mesh_shape)]
    return m.Call(next(_call_ids), program, mesh_shape, axis_names, devices, list(inputs), list(outputs))


def R(*pairs: tuple[int, int]) -> list[list[int]]:
    return [list(p) for p in pairs]


class World:
    """A directory plus the shards the workers would hold."""

    def __init__(self) -> None:
        self.d = new_directory()
        self.values: dict[int, np.ndarray] = {}
        self.store: dict[tuple, np.ndarray] = {}
        self._next = 100

    def value(self, buf: int, shape: list[int], dtype: str = "float32") -> np.ndarray:
        if buf not in self.values:
            self._next += 1000
            self.values[buf] = (np.arange(math.prod(shape)) + self._next).astype(dtype).reshape(shape)
        return self.values[buf]

    def holds(self, buf: int, dev: int, region: Any) -> bool:
        return (buf, dev, sharding.from_wire(region)) in self.store

    def run(self, c: m.Call, owner: int = 1) -> Plan:
        # the client puts its values straight onto the workers
        for i in c.inputs:
            if i.put:
                v = self.value(i.buffer, i.aval.shape, i.aval.dtype)
                for dev, r in zip(c.devices, sharding.regions(i.aval.shape, c.mesh_shape, c.axis_names, i.spec),
                                  strict=True):
                    self.store[(i.buffer, dev, r)] = v[sharding.local_slices(r, tuple((0, s) for s in v.shape))]
        plan = self.d.plan(c, owner, "fn")
        self.check_and_play(c, plan)
        return plan

    def check_and_play(self, c: m.Call, plan: Plan) -> None:
        hosts = {HOST_OF[d] for d in c.devices}
        assert set(plan.executes) == hosts
        assert len({ex.exec_id for ex in plan.executes.values()}) == 1
        sends: dict[int, tuple[int, m.SendPiece]] = {}
        for src, sp in plan.sends:
            assert sp.piece_id > 0 and sp.piece_id not in sends, "piece ids are unique and > 0"
            assert HOST_OF[sp.device] == src, "a SendPiece goes to the host of its source device"
            assert sp.dst_host != src, "pieces between devices of one host are not sent"
            assert sp.dst_address == address(sp.dst_host)
            assert sharding.contains(sharding.from_wire(sp.region), sharding.from_wire(sp.sub))
            sends[sp.piece_id] = (src, sp)
        used: set[int] = set()
        for h, ex in plan.executes.items():
            assert (ex.program, ex.name, ex.mesh_shape, ex.axis_names, ex.devices) == \
                (c.program, "fn", c.mesh_shape, c.axis_names, c.devices)
            assert [o.buffer for o in ex.outputs] == [o.buffer for o in c.outputs]
            assert [i.buffer for i in ex.inputs] == [i.buffer for i in c.inputs]
        for k, ci in enumerate(c.inputs):
            regs = sharding.regions(ci.aval.shape, c.mesh_shape, c.axis_names, ci.spec)
            want_of = dict(zip(c.devices, regs, strict=True))
            for h, ex in plan.executes.items():
                ei = ex.inputs[k]
                assert (ei.aval, ei.spec) == (ci.aval, ci.spec)
                # exactly this host's devices, in mesh order
                shards = host_shards(ex, ei, h, HOST_OF.__getitem__)
                assert [s.device for s in shards] == [d for d in c.devices if HOST_OF[d] == h]
                for s in shards:
                    want = sharding.from_wire(s.region)
                    assert want == want_of[s.device]
                    self._assemble(ci, h, s, want, sends, used)
        assert used == set(sends), "every SendPiece is consumed by exactly one shard"
        for o in c.outputs:
            v = self.value(o.buffer, o.aval.shape, o.aval.dtype)
            for dev, r in zip(c.devices, sharding.regions(o.aval.shape, c.mesh_shape, c.axis_names, o.spec),
                              strict=True):
                self.store[(o.buffer, dev, r)] = v[sharding.local_slices(r, tuple((0, n) for n in v.shape))]

    def _assemble(self, ci: m.CallInput, h: int, s: m.ShardInput, want: sharding.Region,
                  sends: dict, used: set) -> None:
        buf = ci.buffer
        glob = self.values[buf]
        expect = glob[sharding.local_slices(want, tuple((0, n) for n in glob.shape))]
        key = (buf, s.device, want)
        if not s.pieces:
            assert key in self.store, f"shard {key} is not there and no pieces were planned"
            np.testing.assert_array_equal(self.store[key], expect)
            return
        value = np.zeros(sharding.region_shape(want), dtype=glob.dtype)
        cover = np.zeros(sharding.region_shape(want), dtype=int)
        for p in s.pieces:
            sub, preg = sharding.from_wire(p.sub), sharding.from_wire(p.region)
            assert sharding.contains(want, sub) and sharding.contains(preg, sub)
            if p.piece_id == 0:
                assert HOST_OF[p.device] == h, "a local piece comes from a device of this host"
                src = self.store[(buf, p.device, preg)]
            else:
                assert p.piece_id not in used
                used.add(p.piece_id)
                src_host, sp = sends[p.piece_id]
                assert sp.dst_host == h and HOST_OF[p.device] != h
                assert (sp.buffer, sp.device, sp.region, sp.sub) == (buf, p.device, p.region, p.sub)
                src = self.store[(buf, sp.device, preg)]
            piece = src[sharding.local_slices(sub, preg)]
            value[sharding.local_slices(sub, want)] = piece
            cover[sharding.local_slices(sub, want)] += 1
        assert (cover == 1).all(), f"pieces of {want} do not tile it exactly"
        np.testing.assert_array_equal(value, expect)
        self.store[key] = value


def lists(layouts: list[dict]) -> list[dict]:
    """Layouts with their device tuples as lists (to compare with literals)."""
    return [{r: list(devs) for r, devs in lay.items()} for lay in layouts]


def shards_of(plan: Plan, host: int, k: int = 0) -> list[m.ShardInput]:
    ex = plan.executes[host]
    return host_shards(ex, ex.inputs[k], host, HOST_OF.__getitem__)


# ---- puts and reuse -----------------------------------------------------------

def test_put_inputs_create_buffers_and_need_no_transfer():
    w = World()
    plan = w.run(call([0, 1], [inp(1, [4, 4], ["x", None], put=True), inp(2, [3], [], put=True)],
                      [out(3, [4], ["x"])]))
    assert plan.sends == []
    assert set(plan.executes) == {0}
    assert all(s.pieces == [] for k in (0, 1) for s in shards_of(plan, 0, k))
    assert [s.region for s in shards_of(plan, 0, 0)] == [R((0, 2), (0, 4)), R((2, 4), (0, 4))]
    b = w.d.buffers[1]
    assert (b.shape, b.dtype, b.owner, b.error) == ((4, 4), "float32", 1, None)
    assert lists(b.layouts) == [{((0, 2), (0, 4)): [0], ((2, 4), (0, 4)): [1]}]
    assert lists(w.d.buffers[2].layouts) == [{((0, 3),): [0, 1]}]
    assert lists(w.d.buffers[3].layouts) == [{((0, 2),): [0], ((2, 4),): [1]}]
    ex = plan.executes[0]
    assert ex.outputs == [m.ExecOutput(3, m.Aval([4], "float32"), ["x"])]


def test_same_layout_consumer_needs_no_pieces():
    w = World()
    w.run(call([0, 1], [inp(1, [8], ["x"], put=True)], [out(2, [8], ["x"])]))
    for buf in (1, 2):          # a put buffer and a computed one
        plan = w.run(call([0, 1], [inp(buf, [8], ["x"])]))
        assert plan.sends == []
        assert all(s.pieces == [] for s in shards_of(plan, 0))
        assert len(w.d.buffers[buf].layouts) == 1


def test_consumer_on_other_devices_of_the_same_host_uses_local_pieces():
    w = World()
    w.run(call([0, 1], [inp(1, [8, 2], ["x"], put=True)]))
    plan = w.run(call([2, 3], [inp(1, [8, 2], ["x"])]))
    assert plan.sends == []
    assert shards_of(plan, 0) == [
        m.ShardInput(2, R((0, 4), (0, 2)), [m.PieceSource(0, 0, R((0, 4), (0, 2)), R((0, 4), (0, 2)))]),
        m.ShardInput(3, R((4, 8), (0, 2)), [m.PieceSource(0, 1, R((4, 8), (0, 2)), R((4, 8), (0, 2)))]),
    ]
    assert lists(w.d.buffers[1].layouts)[1] == {((0, 4), (0, 2)): [2], ((4, 8), (0, 2)): [3]}


def test_consumer_on_another_host_gets_sent_pieces():
    w = World()
    w.run(call([0, 1], [inp(1, [8], ["x"], put=True)]))
    plan = w.run(call([4, 5], [inp(1, [8], ["x"])]))
    assert set(plan.executes) == {1}
    assert len(plan.sends) == 2
    (h0, s0), (h1, s1) = plan.sends
    assert h0 == h1 == 0
    assert (s0.buffer, s0.device, s0.region, s0.sub, s0.dst_host, s0.dst_address) == \
        (1, 0, R((0, 4)), R((0, 4)), 1, address(1))
    assert (s1.device, s1.region, s1.sub) == (1, R((4, 8)), R((4, 8)))
    assert s0.piece_id != s1.piece_id
    assert shards_of(plan, 1) == [
        m.ShardInput(4, R((0, 4)), [m.PieceSource(s0.piece_id, 0, R((0, 4)), R((0, 4)))]),
        m.ShardInput(5, R((4, 8)), [m.PieceSource(s1.piece_id, 1, R((4, 8)), R((4, 8)))]),
    ]


def test_second_identical_consumer_reuses_the_copy():
    w = World()
    w.run(call([0, 1], [inp(1, [8], ["x"], put=True)]))
    first = w.run(call([4, 5], [inp(1, [8], ["x"])]))
    assert len(first.sends) == 2
    layouts = len(w.d.buffers[1].layouts)
    again = w.run(call([4, 5], [inp(1, [8], ["x"])]))
    assert again.sends == []
    assert all(s.pieces == [] for s in shards_of(again, 1))
    assert len(w.d.buffers[1].layouts) == layouts
    # other devices of host 1 now copy from host 1, not from host 0
    near = w.run(call([6, 7], [inp(1, [8], ["x"])]))
    assert near.sends == []
    assert [p.device for s in shards_of(near, 1) for p in s.pieces] == [4, 5]
    assert all(p.piece_id == 0 for s in shards_of(near, 1) for p in s.pieces)


def test_copy_on_a_whole_shard_is_preferred_over_tiling():
    w = World()
    w.run(call([0, 1], [inp(1, [8], ["x"], put=True)]))
    w.run(call([4], [inp(1, [8], [])]))                 # host 1 now has the whole array
    plan = w.run(call([5, 6], [inp(1, [8], ["x"])]))
    assert plan.sends == []
    assert [(p.piece_id, p.device, p.region, p.sub) for s in shards_of(plan, 1) for p in s.pieces] == \
        [(0, 4, R((0, 8)), R((0, 4))), (0, 4, R((0, 8)), R((4, 8)))]


# ---- resharding ---------------------------------------------------------------------

def test_sharded_to_replicated_on_the_same_devices():
    w = World()
    w.run(call([0, 1], [inp(1, [8, 2], ["x", None], put=True)]))
    plan = w.run(call([0, 1], [inp(1, [8, 2], [None, None])]))
    assert plan.sends == []
    for s in shards_of(plan, 0):
        assert s.region == R((0, 8), (0, 2))
        assert sorted((p.device, p.sub[0][0]) for p in s.pieces) == [(0, 0), (1, 4)]
        assert all(p.piece_id == 0 for p in s.pieces)


def test_two_shards_to_four_shards():
    w = World()
    w.run(call([0, 1], [inp(1, [8], ["x"], put=True)]))
    plan = w.run(call([0, 1, 2, 3], [inp(1, [8], ["x"])]))
    assert plan.sends == []
    got = [(s.device, s.region, [(p.device, p.region, p.sub) for p in s.pieces]) for s in shards_of(plan, 0)]
    assert got == [
        (0, R((0, 2)), [(0, R((0, 4)), R((0, 2)))]),
        (1, R((2, 4)), [(0, R((0, 4)), R((2, 4)))]),
        (2, R((4, 6)), [(1, R((4, 8)), R((4, 6)))]),
        (3, R((6, 8)), [(1, R((4, 8)), R((6, 8)))]),
    ]
    # and onto another host: each of 4 shards is one piece cut out of a source shard
    remote = w.run(call([4, 5, 6, 7], [inp(1, [8], ["x"])]))
    assert len(remote.sends) == 4
    assert all(len(s.pieces) == 1 and s.pieces[0].piece_id > 0 for s in shards_of(remote, 1))


def test_four_shards_to_two_on_another_host():
    w = World()
    w.run(call([0, 1, 2, 3], [inp(1, [8, 4], ["x"], put=True)]))
    plan = w.run(call([8, 9], [inp(1, [8, 4], ["x"])]))
    assert len(plan.sends) == 4 and all(h == 0 for h, _ in plan.sends)
    assert all(sp.dst_host == 2 for _, sp in plan.sends)
    assert [len(s.pieces) for s in shards_of(plan, 2)] == [2, 2]


def test_1d_mesh_to_2d_mesh():
    w = World()
    w.run(call([0, 1, 2, 3], [inp(1, [8, 8], ["x", None], put=True)]))
    plan = w.run(call([4, 5, 6, 7], [inp(1, [8, 8], [None, ["a", "b"]])],
                      mesh_shape=[2, 2], axis_names=["a", "b"]))
    # every destination (all rows x 2 columns) needs 4 pieces (2 rows x 2 columns)
    assert [len(s.pieces) for s in shards_of(plan, 1)] == [4, 4, 4, 4]
    assert len(plan.sends) == 16
    assert all(sharding.region_shape(sharding.from_wire(sp.sub)) == (2, 2) for _, sp in plan.sends)
    # and a 2-D blocked layout on the same host as the source
    plan2 = w.run(call([0, 1, 2, 3], [inp(1, [8, 8], ["b", "a"])], mesh_shape=[2, 2], axis_names=["a", "b"]))
    assert plan2.sends == []
    assert [s.region for s in shards_of(plan2, 0)] == [
        R((0, 4), (0, 4)), R((4, 8), (0, 4)), R((0, 4), (4, 8)), R((4, 8), (4, 8))]


def test_partial_copy_layout_is_not_used_to_tile():
    """A consumer that already holds some shards records a copy of only the
    others; a later consumer must still be able to assemble the whole array."""
    w = World()
    w.run(call([0, 1], [inp(1, [8], ["x"], put=True)]))
    w.run(call([0, 2], [inp(1, [8], ["x"])]))          # device 0 already holds its shard
    plan = w.run(call([4, 5], [inp(1, [8], [None])]))   # replicated on host 1
    assert all(len(s.pieces) == 2 for s in shards_of(plan, 1))


def test_same_buffer_twice_in_one_call():
    w = World()
    w.run(call([0, 1], [inp(1, [8], ["x"], put=True)]))
    plan = w.run(call([4, 5], [inp(1, [8], ["x"]), inp(1, [8], [None])]))
    # the first input copies the shards to host 1; the second is tiled from that copy
    assert len(plan.sends) == 2
    assert [[(p.piece_id, p.device) for p in s.pieces] for s in shards_of(plan, 1, 1)] == \
        [[(0, 4), (0, 5)], [(0, 4), (0, 5)]]


def test_random_calls_play_out_correctly():
    rng = random.Random(99)
    w = World()
    ndev = HOSTS * DEVICES_PER_HOST
    live: list[tuple[int, list[int]]] = []
    next_buf = 1
    total_sends = 0

    def random_mesh() -> tuple[list[int], list[int], list[str]]:
        n = rng.choice([1, 2, 4])
        if rng.random() < 0.8:               # one host, like a slice
            h = rng.randrange(HOSTS)
            devs = rng.sample(range(h * DEVICES_PER_HOST, (h + 1) * DEVICES_PER_HOST), n)
        else:
            devs = rng.sample(range(ndev), n)
        if n == 4 and rng.random() < 0.5:
            return devs, [2, 2], ["a", "b"]
        return devs, [n], ["x"]

    def random_spec(shape: list[int], names: list[str]) -> list:
        spec, free = [], list(names)
        for _ in shape:
            choice = rng.random()
            if not free or choice < 0.4:
                spec.append(None)
            elif choice < 0.8 or len(free) == 1:
                spec.append(free.pop(rng.randrange(len(free))))
            else:
                rng.shuffle(free)
                spec.append([free.pop(), free.pop()])
        return spec

    for _ in range(250):
        devs, mesh_shape, names = random_mesh()
        inputs = []
        if not live or rng.random() < 0.25:
            shape = rng.choice([[8], [8, 8], [4, 8, 4]])
            inputs.append(inp(next_buf, shape, random_spec(shape, names), put=True))
            live.append((next_buf, shape))
            next_buf += 1
        # existing buffers (not the one put by this very call)
        existing = [(b, s) for b, s in live if b not in {i.buffer for i in inputs}]
        for _ in range(rng.randrange(1, 3) if existing else 0):
            buf, shape = rng.choice(existing)
            inputs.append(inp(buf, shape, random_spec(shape, names)))
        outputs = []
        if rng.random() < 0.3:
            shape = [8, 4]
            outputs.append(out(next_buf, shape, random_spec(shape, names)))
            live.append((next_buf, shape))
            next_buf += 1
        plan = w.run(call(devs, inputs, outputs, mesh_shape, names))
        total_sends += len(plan.sends)
    assert total_sends > 50         # the loop really moved data between hosts


# ---- rejected calls -------------------------------------------------------------------

def plan_error(d: Directory, c: m.Call) -> PlanError:
    before = {b: (buf.shape, buf.dtype, lists(buf.layouts), buf.error)
              for b, buf in d.buffers.items()}
    with pytest.raises(PlanError) as info:
        d.plan(c, 1, "fn")
    after = {b: (buf.shape, buf.dtype, lists(buf.layouts), buf.error)
             for b, buf in d.buffers.items()}
    assert after == before, "a rejected call must not change the directory"
    return info.value


def test_unknown_input_buffer_is_not_found():
    w = World()
    w.run(call([0, 1], [inp(1, [8], ["x"], put=True)]))
    e = plan_error(w.d, call([0, 1], [inp(5, [8], ["x"], put=True), inp(77, [8], ["x"])], [out(9, [8], [])]))
    assert e.code == "not_found" and "77" in str(e) and e.error is None


def test_poisoned_input_carries_the_root_cause():
    d = new_directory()
    err = m.ErrorInfo("RemoteError", "ZeroDivisionError: boom", 1, "divide", "Traceback ...")
    d.poison([3], 1, err)
    e = plan_error(d, call([0], [inp(3, [2], [])], [out(4, [2], [])]))
    assert e.error is err
    assert e.code == "RemoteError" and str(e) == "ZeroDivisionError: boom"
    # poisoning a known buffer keeps its shape but marks the error
    w = World()
    w.run(call([0], [inp(1, [2], [], put=True)]))
    w.d.poison([1], 1, err)
    assert w.d.buffers[1].shape == (2,) and w.d.buffers[1].error is err
    assert plan_error(w.d, call([0], [inp(1, [2], [])])).error is err


@pytest.mark.parametrize("shape,dtype", [([4], "float32"), ([8, 1], "float32"), ([8], "float64"), ([], "float32")])
def test_wrong_aval_is_bad_request(shape: list[int], dtype: str) -> None:
    w = World()
    w.run(call([0, 1], [inp(1, [8], ["x"], put=True)]))
    e = plan_error(w.d, call([0, 1], [inp(1, shape, [None] * len(shape), dtype=dtype)]))
    assert e.code == "bad_request"
    assert "input buffer 1 is float32[8]" in str(e) and f"expects {dtype}{shape}" in str(e)


def test_output_buffer_reuse_is_bad_request():
    w = World()
    w.run(call([0], [inp(1, [2], [], put=True)], [out(2, [2], [])]))
    for existing in (1, 2):
        e = plan_error(w.d, call([0], [inp(1, [2], [])], [out(existing, [2], [])]))
        assert e.code == "bad_request" and f"output buffer {existing} already exists" in str(e)
    e = plan_error(w.d, call([0], [inp(2, [2], [], put=True)]))
    assert e.code == "bad_request" and "buffer 2 already exists" in str(e)
    # a new id named twice in one call: two outputs, or an output and a put input
    for c in (call([0], [inp(1, [2], [])], [out(7, [2], []), out(7, [2], [])]),
              call([0], [inp(8, [2], [], put=True)], [out(8, [2], [])])):
        e = plan_error(w.d, c)
        assert e.code == "bad_request" and "names a new buffer twice" in str(e)


@pytest.mark.parametrize("devices,mesh_shape,axis_names,pattern", [
    ([0, 1, 2], [2], ["x"], "does not match 3 devices"),
    ([0, 1], [2, 2], ["x", "y"], "does not match 2 devices"),
    ([0, 1], [2], ["x", "y"], "does not match"),
    ([0, 1, 2, 3], [2, 2], ["x"], "does not match"),
    ([0, 0], [2], ["x"], "a device appears twice"),
    ([0, 999], [2], ["x"], "unknown device 999"),
    ([], [0], ["x"], "mesh"),
    ([0], [-1, -1], ["x", "y"], "mesh"),
])
def test_bad_mesh_is_bad_request(devices, mesh_shape, axis_names, pattern) -> None:
    d = new_directory()
    e = plan_error(d, m.Call(1, PROGRAM, mesh_shape, axis_names, devices,
                             [inp(1, [4], [], put=True)], [out(2, [4], [])]))
    assert e.code == "bad_request" and pattern in str(e)
    assert d.buffers == {}


@pytest.mark.parametrize("spec,pattern", [
    (["x"], "not divisible"),              # 6 over 4 devices
    (["q"], "axis 'q'"),
    ([None, "x"], "2 entries for an array of rank 1"),
])
def test_bad_sharding_is_bad_request(spec: list, pattern: str) -> None:
    d = new_directory()
    for put in (True, False):
        e = plan_error(d, call([0, 1, 2, 3], [inp(1, [6], spec, put=put)] if put else [],
                               [] if put else [out(2, [6], spec)]))
        assert e.code == "bad_request" and pattern in str(e)


def test_axis_used_twice_is_bad_request():
    d = new_directory()
    e = plan_error(d, call([0, 1], [inp(1, [4, 4], ["x", "x"], put=True)]))
    assert e.code == "bad_request" and "twice" in str(e)


def test_negative_dimension_is_bad_request():
    d = new_directory()
    e = plan_error(d, call([0, 1], [inp(1, [-4], ["x"], put=True)]))
    assert e.code == "bad_request" and "-4" in str(e)


# ---- release ----------------------------------------------------------------

def test_release_frees_every_copy_on_every_host_and_only_the_owners():
    host_of = {0: 0, 1: 0, 2: 1, 3: 1}.__getitem__
    d = Directory(host_of)
    av = m.Aval([4], "float64")
    put = m.Call(1, "p", [2], ["i"], [0, 1], [m.CallInput(10, av, ["i"], True)],
                 [m.CallOutput(11, av, ["i"])])
    d.plan(put, owner=1, name="f")
    # consume buffer 11 on host 1: it now has copies on both hosts
    d.plan(m.Call(2, "p", [2], ["i"], [2, 3], [m.CallInput(11, av, ["i"], False)],
                  [m.CallOutput(12, av, ["i"])]), owner=1, name="g")
    assert d.release([11, 12], owner=2) == {}           # not the owner: nothing happens
    assert 11 in d.buffers
    assert d.release([11, 99], owner=1) == {0: [11], 1: [11]}
    assert 11 not in d.buffers
    assert d.release([11], owner=1) == {}               # twice: nothing more
    assert sorted(d.owned(1)) == [10, 12] and d.owned(2) == []
    assert d.release(d.owned(1), owner=1) == {0: [10], 1: [12]} and not d.buffers


def test_device_bytes_follow_puts_outputs_copies_and_releases():
    host_of = {0: 0, 1: 0, 2: 1}.__getitem__
    d = Directory(host_of)
    av = m.Aval([4], "float64")                    # 32 bytes; 16 per half
    put = m.Call(1, "p", [2], ["i"], [0, 1], [m.CallInput(10, av, ["i"], True)],
                 [m.CallOutput(11, av, [None])])   # output replicated: 32 bytes on each
    assert d.needs(put) == {0: 16 + 32, 1: 16 + 32}
    d.plan(put, owner=1, name="f")
    assert dict(d.device_bytes) == {0: 48, 1: 48}
    # reading 11 on device 2 (another host) copies it there; on device 0 it is present
    read = m.Call(2, "p", [2], ["i"], [0, 2], [m.CallInput(11, av, [None], False)],
                  [m.CallOutput(12, m.Aval([2], "float32"), ["i"])])
    assert d.needs(read) == {0: 4, 2: 32 + 4}
    d.plan(read, owner=1, name="g")
    assert dict(d.device_bytes) == {0: 52, 1: 48, 2: 36}
    d.release([11], owner=1)
    assert dict(d.device_bytes) == {0: 20, 1: 16, 2: 4}
    d.release([10, 12], owner=1)
    assert all(v == 0 for v in d.device_bytes.values())


# ---- plan cache -----------------------------------------------------------------

def snapshot(d: Directory) -> tuple:
    """Everything observable about a directory's state (zero byte counts too)."""
    return ({b: (x.id, x.shape, x.dtype, x.owner, lists(x.layouts), x.error) for b, x in d.buffers.items()},
            dict(d.device_bytes))


def outcome(d: Directory, c: m.Call, owner: int = 1, name: str = "fn") -> tuple:
    try:
        p = d.plan(c, owner, name)
        return ("ok", p.executes, p.sends)
    except PlanError as e:
        return ("error", e.code, str(e), e.error)


def same_state(a: Directory, b: Directory) -> bool:
    """``snapshot(a) == snapshot(b)``, without copying every buffer's layouts
    after every call: a buffer whose fields are equal as they are has equal
    snapshots, and only one that differs so (a tuple against a list of the same
    devices, say) is compared through ``snapshot``'s form."""
    if a.buffers.keys() != b.buffers.keys() or dict(a.device_bytes) != dict(b.device_bytes):
        return False
    for k, x in a.buffers.items():
        y = b.buffers[k]
        if (x.id, x.shape, x.dtype, x.owner, x.layouts, x.error) != (y.id, y.shape, y.dtype, y.owner, y.layouts, y.error) \
                and (x.id, x.shape, x.dtype, x.owner, lists(x.layouts), x.error) != \
                (y.id, y.shape, y.dtype, y.owner, lists(y.layouts), y.error):
            return False
    return True


def lockstep(c: m.Call, *dirs: Directory, owner: int = 1, name: str = "fn") -> tuple:
    """Plan one call with every directory; plans, errors and states must agree.
    Both draw exec and piece ids in the same order, so even the ids match."""
    got = [outcome(d, c, owner, name) for d in dirs]
    for d, g in zip(dirs[1:], got[1:], strict=True):
        assert g == got[0], f"cached and uncached plans differ for {c}"
        assert same_state(d, dirs[0]), (f"cached and uncached states differ after {c}",
                                         snapshot(d), snapshot(dirs[0]))
    return got[0]


def ids_of(result: tuple) -> list[tuple[str, int]]:
    if result[0] != "ok":
        return []
    _, executes, sends = result
    return [("piece", sp.piece_id) for _, sp in sends] + [("exec", next(iter(executes.values())).exec_id)]


def cached_pair() -> tuple[Directory, Directory]:
    return (Directory(HOST_OF.__getitem__, address, plan_cache_size=0),
            Directory(HOST_OF.__getitem__, address))


def test_cached_plans_equal_uncached_plans():
    plain, cached = cached_pair()
    seen_ids: list[tuple[str, int]] = []
    b = iter(range(1, 1 << 20))
    # each scenario twice on fresh buffers: the second round is planned from the
    # first round's templates
    for _ in range(3):
        x, y, z, w = next(b), next(b), next(b), next(b)
        steps = [
            # puts, sharded and replicated, output on the same devices
            call([0, 1], [inp(x, [8, 4], ["x", None], put=True), inp(y, [3], [], put=True)],
                 [out(z, [8], ["x"])]),
            # local input, same layout: no pieces
            call([0, 1], [inp(z, [8], ["x"]), inp(y, [3], [])], [out(w, [8, 4], [None, "x"])]),
            # other devices of the same host: local pieces
            call([2, 3], [inp(x, [8, 4], ["x", None])]),
            # resharding across hosts (rows to columns), then read back replicated
            call([4, 5], [inp(w, [8, 4], ["x", None])]),
            call([8], [inp(w, [8, 4], [None, None])]),
            # 1-D to a 2-D mesh on another host, and a 2-D blocked layout at home
            call([4, 5, 6, 7], [inp(x, [8, 4], [None, ["a", "b"]])],
                 mesh_shape=[2, 2], axis_names=["a", "b"]),
            call([0, 1, 2, 3], [inp(x, [8, 4], ["b", "a"])], [out(next(b), [4, 4], ["a", "b"])],
                 mesh_shape=[2, 2], axis_names=["a", "b"]),
            # the same buffer twice: the second read is tiled from the first's copy
            call([9, 10], [inp(z, [8], ["x"]), inp(z, [8], [None])]),
            # a mesh spanning hosts
            call([3, 4], [inp(z, [8], [None])], [out(next(b), [2], ["x"])]),
        ]
        for c in steps:
            result = lockstep(c, plain, cached)
            assert result[0] == "ok", result
            seen_ids += ids_of(result)
    assert cached.cache_hits >= 9 * 2 and plain.cache_hits == plain.cache_misses == 0
    assert len(seen_ids) == len(set(seen_ids)), "exec and piece ids are fresh"
    assert sum(kind == "piece" for kind, _ in seen_ids) > 20


def test_cached_plans_equal_uncached_plans_random():
    """Random chains with failures, releases, poisoning and lost devices mixed in."""
    rng = random.Random(7)
    plain, cached = cached_pair()
    slices = [([0, 1], [2], ["x"]), ([4, 5], [2], ["x"]), ([0, 4], [2], ["x"]), ([8], [1], ["x"]),
              ([4, 5, 6, 7], [2, 2], ["x", "y"])]
    live: list[tuple[int, list[int]]] = []
    next_buf = 1
    ok = 0
    for step in range(1200):
        devs, mesh, names = rng.choice(slices)
        specs = [[names[0], None]] * 3 + [[None, names[-1]]]
        inputs, outputs = [], []
        if not live or rng.random() < 0.2:
            inputs.append(inp(next_buf, [8, 8], rng.choice(specs), put=True))
            live.append((next_buf, [8, 8]))
            next_buf += 1
        # mostly the latest value (a chain); sometimes an older one (more layouts)
        readable = [x for x in live[-4:] if x[0] not in {i.buffer for i in inputs}]
        for _ in range(rng.choice([1, 1, 1, 2]) if readable else 0):
            buf, shape = readable[-1] if rng.random() < 0.7 else rng.choice(readable)
            dtype = "float64" if rng.random() < 0.02 else "float32"             # sometimes wrong
            inputs.append(inp(buf, shape, rng.choice(specs), dtype=dtype))
        if rng.random() < 0.02:
            inputs.append(inp(10 ** 9, [8, 8], [None, None]))                # unknown
        if rng.random() < 0.8:
            target = rng.choice(live)[0] if rng.random() < 0.02 else next_buf     # sometimes exists
            outputs.append(out(target, [8, 8], rng.choice(specs)))
            if target == next_buf:
                live.append((next_buf, [8, 8]))
                next_buf += 1
        owner = 2 if rng.random() < 0.02 else 1
        # (another program and name now and then: the same template, their own Executes)
        result = lockstep(call(devs, inputs, outputs, mesh, names, program=rng.choice([PROGRAM, OTHER])),
                          plain, cached, owner=owner, name="g" if rng.random() < 0.1 else "f")
        ok += result[0] == "ok"
        if result[0] != "ok":           # its new buffers do not exist
            new = {i.buffer for i in inputs if i.put} | {o.buffer for o in outputs}
            live = [x for x in live if x[0] not in new or x[0] in plain.buffers] or live[:1]
        r = rng.random()
        if r < 0.03:
            buf = rng.choice(live)[0]
            for d in (plain, cached):
                d.release([buf], 1)
            live = [x for x in live if x[0] != buf] or live[:1]
        elif r < 0.04:
            buf = rng.choice(live)[0]
            for d in (plain, cached):
                d.poison([buf], 1, m.ErrorInfo("RemoteError", "boom", None, "f", ""))
        elif r < 0.045:
            dev = rng.randrange(HOSTS * DEVICES_PER_HOST)
            for d in (plain, cached):
                d.drop_devices({dev}, m.ErrorInfo("HostLost", "lost", dev // DEVICES_PER_HOST, "", ""))
    assert ok > 900
    assert cached.cache_hits > 300, cached.cache_info()


def pmap_call(k: int, devices: list[int] = [0, 4]) -> m.Call:
    """Call k of a chain of pmap-like calls (a scalar per device): reads k, writes k + 1."""
    return call(devices, [inp(k, [len(devices)], ["x"], put=k == 1)], [out(k + 1, [len(devices)], ["x"])])


def test_a_chain_hits_the_cache():
    d = new_directory()
    plans = [d.plan(pmap_call(k), 1, "fn") for k in range(1, 33)]
    # the first call puts its input, the second reads a computed one: then all the same
    assert (d.cache_hits, d.cache_misses) == (30, 2)
    assert d.cache_info() == {"hits": 30, "misses": 2, "entries": 2, "weight": d.cache_info()["weight"]}
    assert [next(iter(p.executes.values())).inputs[0].buffer for p in plans] == list(range(1, 33))
    assert len({ex.exec_id for p in plans for ex in p.executes.values()}) == 32
    assert lists(d.buffers[33].layouts) == [{((0, 1),): [0], ((1, 2),): [4]}]
    # another program (and name) over the same devices and shardings is the
    # same template, with its own program and name in its Executes
    c = pmap_call(33)
    other = d.plan(dataclasses.replace(c, program=OTHER), 1, "other")
    assert (d.cache_hits, d.cache_misses) == (31, 2)
    assert {(ex.program, ex.name) for ex in other.executes.values()} == {(OTHER, "other")}
    assert other.executes[0].inputs[0].buffer == 33 and other.executes[0].outputs[0].buffer == 34
    # with the cache off nothing is counted
    off = Directory(HOST_OF.__getitem__, address, plan_cache_size=0)
    for k in range(1, 5):
        off.plan(pmap_call(k), 1, "fn")
    assert off.cache_info() == {"hits": 0, "misses": 0, "entries": 0, "weight": 0}


def test_a_changed_input_layout_gives_another_plan():
    d = new_directory()
    d.plan(call([0, 1], [inp(1, [8], ["x"], put=True), inp(2, [8], ["x"], put=True)]), 1, "fn")
    d.plan(call([4, 5], [inp(2, [8], ["x"])]), 1, "fn")        # buffer 2 now also on host 1
    far = d.plan(call([6, 7], [inp(1, [8], ["x"])]), 1, "fn")
    near = d.plan(call([6, 7], [inp(2, [8], ["x"])]), 1, "fn")
    assert d.cache_hits == 0
    assert len(far.sends) == 2 and near.sends == []
    assert [p.device for s in shards_of(near, 1) for p in s.pieces] == [4, 5]
    # reading buffer 1 there again: it was copied, so no pieces now (another key again)
    again = d.plan(call([6, 7], [inp(1, [8], ["x"])]), 1, "fn")
    assert d.cache_hits == 0 and again.sends == [] and all(not s.pieces for s in shards_of(again, 1))


def test_state_errors_are_raised_on_cache_hits():
    d = new_directory()
    av64 = m.Aval([2], "float64")
    d.plan(pmap_call(1), 1, "fn")
    d.plan(pmap_call(2), 1, "fn")
    d.plan(pmap_call(3), 1, "fn")
    assert d.cache_hits == 1
    # same key as pmap_call(3) but the output exists
    e = plan_error(d, call([0, 4], [inp(3, [2], ["x"])], [out(2, [2], ["x"])]))
    assert e.code == "bad_request" and "output buffer 2 already exists" in str(e)
    # same key as pmap_call(1) but the put buffer exists
    e = plan_error(d, call([0, 4], [inp(4, [2], ["x"], put=True)], [out(50, [2], ["x"])]))
    assert e.code == "bad_request" and "buffer 4 already exists" in str(e)
    assert d.cache_hits == 3
    # another owner's buffer with the very same layout
    with pytest.raises(PlanError) as info:
        d.plan(call([0, 4], [inp(4, [2], ["x"])], [out(51, [2], ["x"])]), 2, "fn")
    assert info.value.code == "not_found" and d.cache_hits == 4
    # a float64 buffer whose layout matches the float32 ones: the call's key hits,
    # the buffer's dtype does not match
    d.plan(m.Call(9, PROGRAM, [2], ["x"], [0, 4], [m.CallInput(60, av64, ["x"], True)], []), 1, "fn")
    hits = d.cache_hits
    e = plan_error(d, call([0, 4], [inp(60, [2], ["x"])], [out(61, [2], ["x"])]))
    assert d.cache_hits == hits + 1
    assert e.code == "bad_request" and "input buffer 60 is float64[2]" in str(e)
    # a poisoned input fails with its root cause (not looked up: it has no layout to key on)
    err = m.ErrorInfo("RemoteError", "boom", 0, "fn", "")
    d.poison([4], 1, err)
    assert plan_error(d, pmap_call(4)).error is err
    # a released one is unknown
    d.release([4], 1)
    assert plan_error(d, pmap_call(4)).code == "not_found"
    assert 61 not in d.buffers and 51 not in d.buffers and 50 not in d.buffers


def test_mapping_version_change_replans():
    """A template holds hosts, routes and JAX ids: a new mapping version must not
    reuse it even where the call's key is otherwise the same."""
    host_of = dict(HOST_OF)
    version = [0]
    d = Directory(host_of.__getitem__, address, mapping_version=lambda: version[0])
    d.plan(call([0, 1], [inp(1, [8], ["x"], put=True), inp(2, [8], ["x"], put=True)]), 1, "fn")
    first = d.plan(call([4, 5], [inp(1, [8], ["x"])]), 1, "fn")
    assert {sp.dst_host for _, sp in first.sends} == {1} and set(first.executes) == {1}
    # devices 4 and 5 now belong to host 2 (and the version says so)
    host_of[4] = host_of[5] = 2
    version[0] += 1
    moved = d.plan(call([4, 5], [inp(2, [8], ["x"])]), 1, "fn")
    assert (d.cache_hits, d.cache_info()["entries"]) == (0, 1)
    assert {sp.dst_host for _, sp in moved.sends} == {2} and set(moved.executes) == {2}
    assert all(sp.dst_address == address(2) for _, sp in moved.sends)


def test_lost_host_invalidates_cached_plans():
    from zpath.controller.resources import ResourceManager
    rm = ResourceManager()
    for h in range(3):
        rm.add_host(name=f"h{h}", island=0, data_address=address(h), pid=1, platform="cpu", num_devices=4)
    d = Directory(lambda x: rm.devices[x].host, lambda h: rm.hosts[h].data_address,
                  lambda x: rm.devices[x].jax_id, rm.route, mapping_version=lambda: rm.version)
    err = m.ErrorInfo("HostLost", "host 0 was lost", 0, "", "")
    for b in (1, 2):
        # a buffer on host 0, copied to host 1, then read replicated on host 2
        d.plan(call([0, 1], [inp(b, [8], ["x"], put=True)]), 1, "fn")
        d.plan(call([4, 5], [inp(b, [8], ["x"])]), 1, "fn")
    before = d.plan(call([8, 9], [inp(1, [8], [None])]), 1, "fn")
    assert {src for src, _ in before.sends} == {0}          # from the lowest device ids
    assert d.cache_hits == 2                                # buffer 2's put and copy hit
    # host 0 is lost: the version changes and its devices are forgotten
    version = rm.version
    rm.lose_host(0)
    assert rm.version == version + 1
    d.drop_devices(set(rm.hosts[0].devices), err)
    after = d.plan(call([8, 9], [inp(2, [8], [None])]), 1, "fn")
    assert d.cache_hits == 2 and d.cache_info()["entries"] == 1
    assert {src for src, _ in after.sends} == {1}
    assert all(p.device in (4, 5) for s in shards_of(after, 2) for p in s.pieces)
    # even with the layouts unchanged, the old version's templates are gone
    d2 = Directory(lambda x: rm.devices[x].host, mapping_version=lambda: rm.version)
    d2.plan(call([4, 5], [inp(1, [8], ["x"], put=True)]), 1, "fn")
    d2.plan(call([4, 5], [inp(2, [8], ["x"], put=True)]), 1, "fn")
    rm.lose_host(2)
    d2.plan(call([4, 5], [inp(3, [8], ["x"], put=True)]), 1, "fn")
    assert (d2.cache_hits, d2.cache_misses) == (1, 2)


def test_a_new_program_over_planned_shardings_equals_a_fresh_plan():
    """A new program's first run over devices and shardings another program was
    planned over: a cache hit, equal (ids, state and all) to a plan lowered
    anew, with its own program and name; and once a host is lost, a new
    program over those shardings is lowered anew (over the devices left)."""
    from zpath.controller.resources import ResourceManager
    rm = ResourceManager()
    for h in range(3):
        rm.add_host(name=f"h{h}", island=0, data_address=address(h), pid=1, platform="cpu", num_devices=4)
    args = (lambda x: rm.devices[x].host, lambda h: rm.hosts[h].data_address,
            lambda x: rm.devices[x].jax_id, rm.route)
    plain = Directory(*args, mapping_version=lambda: rm.version, plan_cache_size=0)
    cached = Directory(*args, mapping_version=lambda: rm.version)
    programs = [f"{k:02x}" * 32 for k in range(4)]

    def chain(program: str, first: int, devices: list[int], n: int = 4) -> list[tuple]:
        """n calls of a chain over ``devices``: a put, copied to host 2 and read back replicated."""
        got = []
        for k in range(n):
            b = first + k
            ins = [inp(b, [8], ["x"], put=True)] if k == 0 else [inp(b, [8], ["x"] if k % 2 else [None])]
            got.append(lockstep(call(devices if k % 2 == 0 else [8, 9], ins, [out(b + 1, [8], ["x"])],
                                     program=program), plain, cached, name=program[:2]))
        return got
    chain(programs[0], 100, [0, 4])
    misses, hits = cached.cache_misses, cached.cache_hits
    for k, program in enumerate(programs[1:3], 1):
        for result in chain(program, 100 * (k + 1), [0, 4]):
            assert result[0] == "ok"
            assert {(ex.program, ex.name) for ex in result[1].values()} == {(program, program[:2])}
    assert cached.cache_misses == misses and cached.cache_hits == hits + 8
    # host 1 is lost: the mapping changes, and what was cached with it goes
    rm.lose_host(1)
    for d in (plain, cached):
        d.drop_devices(set(rm.hosts[1].devices), m.ErrorInfo("HostLost", "lost", 1, "", ""))
    results = chain(programs[3], 1000, [0, 1])
    assert all(r[0] == "ok" for r in results)
    assert cached.cache_misses == 2 * misses and cached.cache_hits == hits + 8 + 1
    assert all(h != 1 for r in results for h in r[1]) and all(src != 1 for r in results for src, _ in r[2])


def test_plan_cache_is_bounded():
    d = Directory(HOST_OF.__getitem__, address, plan_cache_size=3)

    def put(buf: int, k: int) -> m.Call:
        """Key k: a value of 2 (k + 1) elements put over devices 0 and 1."""
        return call([0, 1], [inp(buf, [2 * (k + 1)], ["x"], put=True)])
    for k in range(10):
        d.plan(put(k + 1, k), 1, "f")
    assert d.cache_info()["entries"] == 3 and d.cache_misses == 10
    # the three most recent are kept; using one keeps it longest
    d.plan(put(100, 7), 1, "f")
    assert d.cache_hits == 1
    d.plan(put(101, 0), 1, "f")        # evicts key 8
    assert d.cache_misses == 11
    d.plan(put(102, 7), 1, "f")
    d.plan(put(103, 9), 1, "f")
    assert d.cache_hits == 3
    d.plan(put(104, 8), 1, "f")
    assert d.cache_misses == 12 and d.cache_info()["entries"] == 3
    # and by size: a plan bigger than the whole budget is not kept, smaller ones
    # push older ones out
    small = Directory(HOST_OF.__getitem__, address, plan_cache_weight=12)
    small.plan(call(list(range(12)), [inp(1, [12], ["x"], put=True)]), 1, "big")
    assert small.cache_info()["entries"] == 0
    for k in range(5):
        small.plan(put(10 + k, k), 1, "f")
        assert 0 < small.cache_info()["weight"] <= 12
    assert small.cache_info()["entries"] == 2


def test_device_bytes_add_a_few_devices_one_by_one_and_many_as_arrays(monkeypatch):
    """A footprint of a few devices is added one element at a time, a larger
    one (or one past the array's end) with numpy steps: the same footprints
    give the same counts either way."""
    from zpath.controller import directory

    def replay(few: int) -> list:
        monkeypatch.setattr(directory, "FEW_DEVICES", few)
        rng = random.Random(3)
        held = directory.DeviceBytes()
        fps = [{0: 8, 1: 8}, {5: 1 << 40}, {d: d + 1 for d in range(40)}, {90: 3, 2: 7},
               directory.Footprint({1: 4, 3: 4}), {200: 1}]
        seen = []
        for _ in range(300):
            fp = rng.choice(fps)
            (held.update if rng.random() < 0.6 else held.subtract)(fp)
            seen.append((held.items(), held[1], held[200], len(held)))
        return seen

    assert replay(16) == replay(0)
