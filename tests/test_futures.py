"""Future as a unit: a fake connection answers its fetches from another thread."""
from __future__ import annotations

import threading
import types

import jax
import numpy as np
import pytest

from zpath.client.futures import Future
from zpath.config import ClientConfig
from zpath.errors import DeadlineExceeded, RemoteError, ZpathError

pytestmark = pytest.mark.timeout(30)


class _Conn:
    """What a future asks of its connection: fetches, answered by ``answer``
    from a thread of its own (as the I/O thread does), or never."""

    config = ClientConfig()

    def __init__(self, answer: np.ndarray | BaseException | None) -> None:
        self.answer = answer
        self.fetches: list[object] = []
        self.waits: list[object] = []          # wait-only fetches (block_until_ready of a big value)
        self.threads: list[threading.Thread] = []

    def start_fetch(self, future: Future, timeout: float, wait_only: bool = False,
                    every_shard: bool = False) -> object:
        # (as connection._Fetch: a wait asks every shard, a fetch one per region unless asked)
        fetch = types.SimpleNamespace(every_shard=wait_only or every_shard, relocated=False)
        (self.waits if wait_only else self.fetches).append(fetch)
        if self.answer is not None:
            value, error = (None, self.answer) if isinstance(self.answer, BaseException) else (self.answer, None)
            if wait_only:      # the workers say it is done, and send nothing of it
                value = None
            t = threading.Thread(target=future._fetched, args=(fetch, value, error))
            t.start()
            self.threads.append(t)
        return fetch

    def release(self, buffer: int) -> None:
        pass


def _future(conn: _Conn) -> Future:
    return Future(conn, 7, (2,), np.dtype(np.float32), [0, 1], [2], ["i"], ["i"])


def test_a_fetch_answered_from_another_thread_wakes_the_waiter():
    conn = _Conn(np.array([1.0, 2.0], np.float32))
    fut = _future(conn)
    assert not fut.done()
    np.testing.assert_array_equal(fut.result(timeout=10), [1.0, 2.0])
    assert len(conn.fetches) == 1 and fut.done() and fut.is_ready()
    np.testing.assert_array_equal(fut.result(), [1.0, 2.0])        # kept: no second fetch
    assert len(conn.fetches) == 1
    for t in conn.threads:
        t.join(10)


def test_is_ready_starts_the_fetch_that_result_then_waits_for():
    conn = _Conn(np.array([3.0, 4.0], np.float32))
    fut = _future(conn)
    fut.is_ready()                      # asks the workers; the answer may come before result()
    np.testing.assert_array_equal(fut.result(timeout=10), [3.0, 4.0])
    assert len(conn.fetches) == 1
    for t in conn.threads:
        t.join(10)


def test_copy_to_host_async_starts_one_fetch_without_waiting_and_result_takes_it():
    """As jax.Array.copy_to_host_async: it returns None at once (the answer may
    come later), asks once however often it is called, and result() returns
    the value it fetched; a donated future's raises, as its result() does."""
    silent = _Conn(None)
    fut = _future(silent)
    assert fut.copy_to_host_async() is None and fut.copy_to_host_async() is None
    assert len(silent.fetches) == 1 and not fut.done()         # nothing came: it did not wait
    conn = _Conn(np.array([5.0, 6.0], np.float32))
    fut = _future(conn)
    fut.copy_to_host_async()
    np.testing.assert_array_equal(fut.result(timeout=10), [5.0, 6.0])
    assert len(conn.fetches) == 1
    for t in conn.threads:
        t.join(10)
    gone = _future(_Conn(None))
    gone._donate("f")
    with pytest.raises(ZpathError, match="donated to f"):
        gone.copy_to_host_async()
    with pytest.raises(ZpathError, match="donated to f"):
        gone.result(timeout=1)


def _big(conn: _Conn) -> Future:
    """A future over WAIT_FETCHES_UP_TO bytes."""
    from zpath.client.futures import WAIT_FETCHES_UP_TO
    n = WAIT_FETCHES_UP_TO // 4 + 2
    return Future(conn, 8, (n,), np.dtype(np.float32), [0, 1], [2], ["i"], ["i"])


def test_block_until_ready_of_a_big_value_waits_for_it_without_fetching_it():
    """As jax.Array.block_until_ready, which copies nothing: a value over
    WAIT_FETCHES_UP_TO bytes is waited for with a wait-only fetch (the workers
    say when it is done); a later block_until_ready or is_ready asks nothing
    more, and result() then fetches it. A small value is fetched meanwhile, so
    that a later read has it at once."""
    conn = _Conn(np.zeros(_big(_Conn(None)).shape, np.float32))
    fut = _big(conn)
    assert fut.block_until_ready() is fut and jax.block_until_ready([fut]) == [fut]
    assert (len(conn.waits), len(conn.fetches)) == (1, 0)
    assert fut.is_ready() and not fut.done() and fut._value is None      # nothing came
    assert len(conn.waits) == 1
    np.testing.assert_array_equal(fut.result(timeout=10), np.zeros(fut.shape, np.float32))
    assert (len(conn.waits), len(conn.fetches)) == (1, 1)
    small = _future(conn)
    small.block_until_ready()
    assert (len(conn.waits), len(conn.fetches)) == (1, 2) and small.done()
    for t in conn.threads:
        t.join(10)


def test_one_output_of_a_call_waited_for_says_the_others_are_computed_a_fetch_does_not():
    """A call's outputs share a CallRan (Computation.__call__): once one's
    wait (every shard) is answered, the others' block_until_ready and
    is_ready ask nothing, a small one's included, and nothing is fetched; a
    small one's block_until_ready fetches every shard and says the same. A
    read's fetch (one shard per distinct region), or a wait relocated to a
    copy, says nothing of the others."""
    from zpath.client.futures import CallRan

    def one_call(*futures):
        ran = CallRan()
        for f in futures:
            f._call = ran

    conn = _Conn(np.zeros(1, np.float32))
    first, second = _big(conn), _big(conn)
    small = _future(conn)
    one_call(first, second, small)
    jax.block_until_ready([first, second, small])
    assert (len(conn.waits), len(conn.fetches)) == (1, 0)
    assert second.is_ready() and small.is_ready() and not small.done()
    assert (len(conn.waits), len(conn.fetches)) == (1, 0)
    # a small one first (a step's loss, then its parameters): its fetch asks
    # every shard, and says the same; a read's fetch (one shard per region) does not
    fetched = _Conn(np.zeros(2, np.float32))
    loss, params = _future(fetched), _big(fetched)
    one_call(loss, params)
    jax.block_until_ready((loss, params))
    assert loss.done() and params.is_ready() and fetched.fetches[0].every_shard
    assert (len(fetched.waits), len(fetched.fetches)) == (0, 1)
    a, b = _future(fetched), _big(fetched)
    one_call(a, b)
    a.result(timeout=10)
    assert a.done() and not b._is_computed() and not fetched.fetches[-1].every_shard
    # nor a wait that read a copy the controller located after a host was lost
    c, d = _big(_Conn(None)), _big(_Conn(None))
    one_call(c, d)
    c.is_ready()
    relocated = c._wait = types.SimpleNamespace(every_shard=True, relocated=True)
    c._fetched(relocated, None, None)
    assert c.is_ready() and not d._is_computed()
    for t in conn.threads + fetched.threads:
        t.join(10)


def test_is_ready_of_a_big_value_asks_once_whether_it_is_done_and_a_fetch_on_its_way_is_waited_for():
    silent = _Conn(None)
    fut = _big(silent)
    assert not fut.is_ready() and not fut.is_ready()
    assert (len(silent.waits), len(silent.fetches)) == (1, 0)
    fut._fetched(silent.waits[0], None, None)          # the workers' answer
    assert fut.is_ready() and not fut.done()
    # a fetch already on its way (copy_to_host_async) is what block_until_ready waits for
    conn = _Conn(np.ones(fut.shape, np.float32))
    other = _big(conn)
    other.copy_to_host_async()
    other.block_until_ready()
    assert (len(conn.waits), len(conn.fetches)) == (0, 1) and other.done()
    for t in conn.threads:
        t.join(10)


def test_a_big_values_wait_raises_the_error_and_a_silent_one_runs_out_of_time_then_asks_again():
    failing = _Conn(RemoteError("it failed", host=1, computation="f", remote_traceback=""))
    with pytest.raises(RemoteError, match="it failed"):
        _big(failing).block_until_ready()
    assert (len(failing.waits), len(failing.fetches)) == (1, 0)

    class Patient(_Conn):
        config = ClientConfig(fetch_timeout_s=0.05)
    silent = Patient(None)
    fut = _big(silent)
    with pytest.raises(DeadlineExceeded, match="not computed within"):
        fut.block_until_ready()
    with pytest.raises(DeadlineExceeded):
        fut.block_until_ready()
    assert len(silent.waits) == 2                    # the first wait given up, a second asked
    # the call failing wakes the waiter with its error
    waiting = _big(_Conn(None))
    failed = threading.Timer(0.05, waiting._fail, (RemoteError("the call failed", host=0, computation="g",
                                                               remote_traceback=""),))
    failed.start()
    with pytest.raises(RemoteError, match="the call failed"):
        waiting.block_until_ready()
    failed.join(10)
    for t in failing.threads:
        t.join(10)


class _CountedEvent(threading.Event):
    """An event that tells the test each time a thread begins to wait on it."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Semaphore(0)

    def wait(self, timeout: float | None = None) -> bool:
        self.entered.release()
        return super().wait(timeout)


@pytest.mark.parametrize("how", ["result", "block_until_ready"])
def test_a_fetch_that_fails_while_another_thread_asks_again_is_waited_for_anew(how):
    """A thread's fetch (or a big value's wait) fails, and before that thread
    wakes another asks again (copy_to_host_async, is_ready): the first thread
    waits for the new request instead of raising DeadlineExceeded at once."""
    silent = _Conn(None)
    fut = _future(silent) if how == "result" else _big(silent)
    event = _CountedEvent()
    if how == "result":
        fut._event = event
        asked, again = silent.fetches, fut.copy_to_host_async
    else:
        fut._wait_event = event
        asked, again = silent.waits, fut.is_ready
    fut._lock = threading.RLock()     # (so that the test can fail one and ask again under it)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(_outcome(getattr(fut, how))))
    waiter.start()
    assert event.entered.acquire(timeout=10)        # the first request is out, its thread waiting
    with fut._lock:             # the waiter cannot look before both have happened
        fut._fetched(asked[0], None, RuntimeError("that host was lost"))
        again()
    assert len(asked) == 2
    waited_again = event.entered.acquire(timeout=10)
    value = np.arange(fut.size, dtype=np.float32).reshape(fut.shape)
    fut._fetched(asked[1], value if how == "result" else None, None)
    waiter.join(10)
    assert waited_again and len(got) == 1 and not isinstance(got[0], BaseException), got
    if how == "result":
        np.testing.assert_array_equal(got[0], value)
    else:
        assert fut.is_ready() and len(asked) == 2


def _outcome(call):
    try:
        return call()
    except BaseException as e:        # (returned, to be asserted on by the test's thread)
        return e


class _AllAtOnce(_Conn):
    """Answers no fetch until ``n`` have been asked for, then all of them."""

    config = ClientConfig(fetch_timeout_s=5.0)

    def __init__(self, n: int) -> None:
        super().__init__(None)
        self.n, self.asked = n, []

    def start_fetch(self, future: Future, timeout: float, **kw) -> object:
        fetch = super().start_fetch(future, timeout, **kw)
        self.asked.append((future, fetch))
        if len(self.asked) == self.n:     # (from a thread of its own, as the I/O thread answers)
            t = threading.Thread(target=lambda: [fut._fetched(f, np.full(2, fut.buffer, np.float32), None)
                                                 for fut, f in self.asked])
            t.start()
            self.threads.append(t)
        return fetch


class _FirstThenAll(_Conn):
    """Answers the first request at once, the others only once all ``n`` have
    been asked for (as a program's outputs: leaves after the second wait for
    requests that went out together)."""

    config = ClientConfig(fetch_timeout_s=5.0)

    def __init__(self, n: int) -> None:
        super().__init__(None)
        self.n, self.asked = n, []

    def start_fetch(self, future: Future, timeout: float, wait_only: bool = False, **kw) -> object:
        fetch = super().start_fetch(future, timeout, wait_only=wait_only, **kw)
        self.asked.append((future, fetch, wait_only))
        answer = self.asked[:1] if len(self.asked) == 1 else self.asked[1:] if len(self.asked) == self.n else []
        if answer:
            t = threading.Thread(target=lambda: [
                fut._fetched(f, None if wait else np.zeros(fut.shape, np.float32), None)
                for fut, f, wait in answer])
            t.start()
            self.threads.append(t)
        return fetch


def test_a_program_runs_outputs_are_asked_for_together_once_a_second_one_is_waited_for():
    """A program run's outputs share a RunOutputs (tracer._futures): waiting
    for one asks for nothing more; once block_until_ready is called on a
    second, the others' requests go out together (a small one's fetch, a big
    one's wait), so jax.block_until_ready of the run's tree takes about two
    round trips, not one per leaf. A done, donated or already asked output
    is not asked again."""
    from zpath.client.futures import RunOutputs

    def one_run(*futures):
        run = RunOutputs(list(futures))
        for f in futures:
            f._run = run

    conn = _FirstThenAll(5)
    loss, small, big, big2, big3 = _future(conn), _future(conn), _big(conn), _big(conn), _big(conn)
    one_run(loss, small, big, big2, big3)
    loss.block_until_ready()
    loss.block_until_ready()                      # the same output again: nothing more
    assert len(conn.asked) == 1 and loss.done()
    # (without asking for them together, the third leaf's request would go out
    # only after the second leaf's answer, which needs all five asked: DeadlineExceeded)
    jax.block_until_ready((loss, small, big, big2, big3))
    assert len(conn.asked) == 5 and small.done()
    # the second leaf asked for itself, then for the others; small values fetched, big ones waited for
    assert [(fut, wait) for fut, _, wait in conn.asked] == [
        (loss, False), (small, False), (big, True), (big2, True), (big3, True)]
    assert all(b.is_ready() and not b.done() for b in (big, big2, big3))
    # a donated output, one asked for already or known computed is not asked
    # again; a dropped one is gone
    silent = _Conn(None)
    a, b, c, d, e, f = (_big(silent) for _ in range(6))
    one_run(a, b, c, d, e, f)
    c._donate("f")
    d.copy_to_host_async()                    # its fetch on its way
    f._computed = True                        # (a wait of its own said so)
    del e
    a._run.blocked_on(a)
    a._run.blocked_on(a)
    assert (len(silent.waits), len(silent.fetches)) == (0, 1)
    a._run.blocked_on(b)       # b's block_until_ready: the others asked for (b asks itself)
    assert (len(silent.waits), len(silent.fetches)) == (1, 1) and silent.waits[0] is a._wait
    a._run.blocked_on(d)
    assert (len(silent.waits), len(silent.fetches)) == (1, 1)
    # asking the others is a hint: a closed connection's error is not raised by
    # another output's block_until_ready (a done one's returns), nor stops the asking

    class Closed(_Conn):
        def start_fetch(self, future, timeout, **kw):
            self.fetches.append(future)
            raise ZpathError("this zpath client is closed")
    closed = Closed(None)
    done, g, h = _future(closed), _big(closed), _big(closed)
    one_run(done, g, h)
    done._value = np.zeros(2, np.float32)
    assert done.block_until_ready() is done and closed.fetches == []
    g._computed = True
    assert g.block_until_ready() is g and closed.fetches == [h]      # (h asked, and failed)
    with pytest.raises(ZpathError, match="closed"):
        h.block_until_ready()
    for t in conn.threads:
        t.join(10)


def test_jax_device_get_of_a_tree_of_futures_asks_for_them_all_before_it_waits():
    """jax.device_get calls each leaf's copy_to_host_async first: the fetches
    of a tree's futures go out together instead of one round trip each."""
    conn = _AllAtOnce(3)
    futs = {k: Future(conn, b, (2,), np.dtype(np.float32), [0, 1], [2], ["i"], ["i"])
            for k, b in (("a", 1), ("b", 2), ("c", 3))}
    got = jax.device_get(futs)
    assert {k: v.tolist() for k, v in got.items()} == {"a": [1.0, 1.0], "b": [2.0, 2.0], "c": [3.0, 3.0]}
    assert len(conn.fetches) == 3
    for t in conn.threads:
        t.join(10)


def test_a_failed_call_or_fetch_raises_and_a_silent_one_runs_out_of_time():
    fut = _future(_Conn(None))
    fut._fail(RemoteError("it failed", host=1, computation="f", remote_traceback=""))   # before any fetch
    with pytest.raises(RemoteError, match="it failed"):
        fut.result(timeout=10)
    conn = _Conn(RuntimeError("fetch broke"))
    with pytest.raises(RuntimeError, match="fetch broke"):
        _future(conn).result(timeout=10)
    for t in conn.threads:
        t.join(10)
    silent = _future(_Conn(None))
    with pytest.raises(DeadlineExceeded, match="not fetched within"):
        silent.result(timeout=0.05)
