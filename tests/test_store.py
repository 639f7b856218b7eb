"""The worker's object store: freed buffer ids are remembered for a while, so a
client's Put that comes after the Free is dropped rather than kept for good."""
import threading
import time

import pytest

from zpath.ids import buffer_id
from zpath.net import messages as m
from zpath.worker import store as st
from zpath.worker.state import IdRanges


def test_freed_buffers_are_remembered_until_they_expire():
    s = st.Store()
    key = st.shard_key(7, 0, [[0, 4]])
    s.set(key, "shard")
    assert s.free_buffers([7, 8], now=100.0) == 1       # 8 was never seen here
    assert s.was_freed(7) and s.was_freed(8) and not s.was_freed(9)
    assert not s.is_done(key)
    s.free_buffers([9], now=100.0 + st.FREED_MEMORY_S + 1)   # expires 7 and 8
    assert not s.was_freed(7) and not s.was_freed(8) and s.was_freed(9)


def test_freed_ids_are_capped(monkeypatch):
    monkeypatch.setattr(st, "FREED_MAX", 3)
    s = st.Store()
    s.free_buffers([1, 2, 3, 4, 5], now=1.0)
    assert [b for b in range(1, 6) if s.was_freed(b)] == [3, 4, 5]


def test_a_forgotten_waiter_leaves_no_entry():
    s = st.Store()
    key, other = st.shard_key(7, 0, [[0, 4]]), st.shard_key(7, 1, [[0, 4]])
    seen = []
    cb1, cb2 = seen.append, lambda e: seen.append(("2", e))
    s.when_done(key, cb1)
    s.when_done(key, cb2)
    s.when_done(other, cb1)
    s.forget(key, cb1)                  # cb2 still waits: the entry stays
    s.set(key, "v")
    assert len(seen) == 1 and seen[0][0] == "2"
    s.forget(other, cb1)                # nothing else waits: gone, and not counted
    assert s.stats() == (1, 0, [])
    s.set(other, "late")                # a value that comes later is kept as usual
    assert s.is_done(other)
    s.forget(other, cb1)                # done: no effect
    assert s.is_done(other)


def test_failed_buffers_fail_their_waiters_and_later_shards():
    s = st.Store()
    err = m.ErrorInfo("RemoteError", "client left", None, "", "")
    key, later = st.shard_key(5, 0, [[0, 2]]), st.shard_key(5, 1, [[0, 2]])
    seen = []
    s.when_done(key, seen.append)
    waited = []
    t = threading.Thread(target=lambda: waited.append(s.wait(key, 10)))
    t.start()
    s.fail_buffers([5], err)
    t.join(10)
    assert seen[0].error is err and waited[0].done and waited[0].error is err
    assert s.wait(later, 0).error is err          # named later: failed at once
    s.set(key, "too late")                          # a value that comes after: ignored
    assert s.entry(key).error is err
    s.free_buffers([5])                             # freed: forgotten
    assert not s.wait(st.shard_key(5, 2, [[0, 2]]), 0).done


def test_a_copy_assembled_again_replaces_an_earlier_error_only():
    s = st.Store()
    err = m.ErrorInfo("RemoteError", "boom", 0, "f", "")
    key = st.shard_key(7, 0, [[0, 4]])
    s.set(key, error=err)
    s.set(key, "late")                          # a value comes only once
    assert s.entry(key).error is err
    s.set(key, "again", over_error=True)        # a copy assembled again
    e = s.entry(key)
    assert e.done and e.error is None and e.value == "again"
    s.set(key, "third", over_error=True)        # over an error only, never over a value
    assert s.entry(key).value == "again"
    s.set(key, error=err, over_error=True)      # an error never replaces a value
    assert s.entry(key).value == "again"
    # a buffer failed as a whole (its client left) stays failed
    s.fail_buffers([8], err)
    key8 = st.shard_key(8, 0, [[0, 4]])
    s.set(key8, "v", over_error=True)
    assert s.entry(key8).error is err


def test_a_clients_buffers_are_found_by_its_id_prefix():
    s = st.Store()
    a, b, c = buffer_id(3, 1), buffer_id(3, 2), buffer_id(4, 1)
    for buf in (a, b, c):
        s.set(st.shard_key(buf, 0, ((0, 1),)), buf)
    s.set(st.shard_key(a, 1, ((1, 2),)), a)
    s.fail_buffers([buffer_id(3, 9)], m.ErrorInfo("RemoteError", "gone", None, "", ""))
    assert sorted(s.buffers_of(3)) == [a, b, buffer_id(3, 9)] and s.buffers_of(4) == [c]
    assert s.buffers_of(5) == []
    # freed without being remembered: gone from the index, a later Put not refused here
    assert s.free_buffers([a, buffer_id(3, 9)], remember=False) == 2
    assert s.buffers_of(3) == [b] and not s.was_freed(a)
    s.free_buffers([b])
    assert s.buffers_of(3) == [] and s.was_freed(b)
    # a waiter that goes away leaves no index entry behind
    key = st.shard_key(buffer_id(6, 1), 0, ((0, 1),))
    s.when_done(key, cb := (lambda e: None))
    assert s.buffers_of(6) == [buffer_id(6, 1)]
    s.forget(key, cb)
    assert s.buffers_of(6) == []


def test_id_ranges_merge_runs_and_answer_membership():
    r = IdRanges()
    for n in (5, 7, 6, 1, 10, 9, 3, 3):
        r.add(n)
    # ranges: [1], [3], [5-7], [9-10]
    r.validate_state()
    assert len(r) == 4
    assert [n for n in range(12) if n in r] == [1, 3, 5, 6, 7, 9, 10]
    r.add(2)                  # joins [1] and [3]
    r.add(8)                  # joins [5-7] and [9-10]
    assert len(r) == 2 and [n for n in range(12) if n in r] == [1, 2, 3, 5, 6, 7, 8, 9, 10]
    r.add(4)
    assert len(r) == 1 and 0 not in r and 11 not in r
    big = IdRanges()
    for n in range(1, 100_001):     # clients leave in order: one range
        big.add(n)
    big.validate_state()
    assert len(big) == 1 and 100_000 in big and 100_001 not in big


def test_an_unsplit_shard_is_split_when_read_and_before_a_donation():
    """A plain computation's output is stored Unsplit (the array and the
    shard's index); reading it gives that shard as a single-device array, once.
    ``split`` does that before the array is donated, so the store then holds
    the shard as it would have been had it been split at once (an array that
    says it was deleted), not an array it can no longer split."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devs = jax.devices()[:2]
    sh = NamedSharding(Mesh(np.array(devs), ("i",)), P("i"))
    s = st.Store()
    out = jax.jit(lambda x: x + 1, out_shardings=sh)(np.arange(2.0 * len(devs)))
    keys = [st.shard_key(5, d.id, [[2 * i, 2 * i + 2]]) for i, d in enumerate(devs)]
    for i, k in enumerate(keys):
        s.set(k, st.Unsplit(out, i))
    first = s.entry(keys[0]).value
    assert first.sharding.device_set == {devs[0]} and np.asarray(first).tolist() == [1.0, 2.0]
    assert s.entry(keys[0]).value is first                  # split once
    assert s.stats()[:2] == (len(devs), out.nbytes)
    other = jax.jit(lambda x: x * 2, out_shardings=sh)(np.arange(2.0 * len(devs)))
    key = st.shard_key(6, devs[0].id, [[0, 2]])
    s.set(key, st.Unsplit(other, 0))
    s.split([6, 7])           # (7: nothing stored)
    assert type(s._entries[key]._value) is not st.Unsplit
    jax.jit(lambda x: x - 1, donate_argnums=0)(other)
    assert other.is_deleted() and s.entry(key).value.is_deleted()
    # not split first: reading it says why it cannot
    third = jax.jit(lambda x: x * 3, out_shardings=sh)(np.arange(2.0 * len(devs)))
    s.set(st.shard_key(8, devs[0].id, [[0, 2]]), st.Unsplit(third, 0))
    jax.jit(lambda x: x - 1, donate_argnums=0)(third)
    with pytest.raises(RuntimeError, match="deleted"):
        s.entry(st.shard_key(8, devs[0].id, [[0, 2]])).value


def test_waiters_are_seen_and_announced():
    """``awaited`` tells whether a waiter named a shard of these buffers that
    is not done yet; ``on_wait`` is called when a wait for an entry that is not
    done starts (not for one already done)."""
    s = st.Store()
    calls = []
    s.on_wait = lambda: calls.append(1)
    key = st.shard_key(5, 0, [[0, 2]])
    assert not s.awaited([5, 6])
    got = []
    s.when_done(key, got.append)
    assert s.awaited([6, 5]) and not s.awaited([6]) and calls == [1]
    assert s.wait(st.shard_key(6, 0, [[0, 2]]), timeout=0.01).done is False and calls == [1, 1]
    s.set(key, "shard")
    assert got and got[0].value == "shard" and not s.awaited([5])
    s.when_done(key, got.append)                  # done already: called at once, nothing announced
    assert len(got) == 2 and s.wait(key, timeout=0.01).done and calls == [1, 1]


def test_set_many_stores_as_set_does_and_wakes_waiters_once_all_are_stored():
    s = st.Store()
    a, b, c = st.shard_key(1, 0, [[0, 1]]), st.shard_key(2, 0, [[0, 1]]), st.shard_key(3, 0, [[0, 1]])
    s.set(c, "first")                     # done already: set_many leaves it
    s.fail_buffers([4], m.ErrorInfo("RemoteError", "gone", 0, "", ""))
    d = st.shard_key(4, 0, [[0, 1]])      # a failed buffer's shard stays failed
    seen = []
    # a callback sees every item of the batch stored, not only its own; one
    # that raises (a bug) is logged, and the others still run
    s.when_done(a, lambda e: 1 / 0)
    s.when_done(a, lambda e: seen.append((e.value, s.is_done(b))))
    waiter = threading.Thread(target=lambda: seen.append(("waited", s.wait(b, 60).value)))
    waiter.start()
    deadline = time.monotonic() + 10
    while not s.awaited([2]):             # the waiter has named b's entry
        assert time.monotonic() < deadline
    s.set_many([(a, "x"), (b, "y"), (c, "z"), (d, "w")])
    waiter.join(10)                       # (woken by the store, not by its own 60 s)
    assert not waiter.is_alive()
    assert sorted(seen, key=str) == [("waited", "y"), ("x", True)]
    assert s.entry(c).value == "first"
    assert s.entry(d).error is not None and s.entry(d).value is None
    assert set(s.buffers_of(0)) >= {1, 2, 3}
