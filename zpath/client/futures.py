"""Futures: handles to values that live on the workers."""
from __future__ import annotations

import numbers
import threading
import time
import weakref
from typing import Any

import jax
import numpy as np

from zpath import sharding
from zpath.client.arrays import ArrayMethods
from zpath.errors import DeadlineExceeded, RemoteError, ZpathError


MAX_TIMEOUT_S = 1e7      # (a wait longer than the platform's limit raises OverflowError)
# block_until_ready() and is_ready() of a value up to this size fetch it (a later
# read then has it at once); of a bigger one they ask the workers only whether
# it is done, so that waiting for a model's parameters copies none of them
WAIT_FETCHES_UP_TO = 64 * 1024


class CallRan:
    """What the outputs of one call share (``Future._call``): whether the call
    is known to have run to its end on every host (``Future._fetched``)."""

    __slots__ = ("ran",)

    def __init__(self) -> None:
        self.ran = False


class RunOutputs:
    """What the distinct outputs of one program run share (``Future._run``).
    They come from several computations, so one done says nothing of another
    (unlike a call's, ``CallRan``); but ``jax.block_until_ready`` of the run's
    tree waits for its leaves one after another, a round trip each. So once
    ``block_until_ready`` is called on a second output of the run, the
    others' requests (what their own ``block_until_ready`` would send) go out
    together, and the leaves after it find theirs on the way: a tree costs
    about two round trips, and waiting for one output (a loss) asks for
    nothing more."""

    __slots__ = ("_outputs", "_first", "_asked")

    def __init__(self, outputs: list["Future"]) -> None:
        # (weak: the outputs hold this record, and must be freed when the user drops them)
        self._outputs = [weakref.ref(f) for f in outputs]
        self._first: int | None = None     # id() of the first output waited for
        self._asked = False

    def blocked_on(self, future: "Future") -> None:
        """``future``'s block_until_ready was called (done or not: a tree's
        first leaf may be a loss read before)."""
        if self._asked:
            return
        if self._first is None or self._first == id(future):
            self._first = id(future)
            return
        # (racing calls may ask more than once, or not at all: each ask does
        # nothing where a request is out already)
        self._asked = True
        for ref in self._outputs:
            other = ref()
            if other is not None and other is not future:
                try:
                    other._ask_ready()
                except ZpathError:     # (a closed connection: a hint lost; its own wait says why)
                    pass


class Future(ArrayMethods):
    """A value being computed (or already computed) on the cluster, used as a
    ``jax.Array`` is: operators, indexing and array methods run on its devices
    and return futures (zpath/client/arrays.py); ``jax.block_until_ready``
    waits for it.

    ``shape`` and ``dtype`` are known at once. ``result()`` or ``np.asarray()``
    fetch the value from the workers; passing the future to another call does not
    bring it back to this process. A typed PRNG key's future holds its key
    data (``shape``/``dtype`` are the data's); ``result()`` gives the key."""

    __slots__ = ("_client", "buffer", "shape", "dtype", "_devices", "_mesh_shape",
                 "_axis_names", "_spec", "_lock", "_event", "_value", "_error", "_fetch",
                 "_fetch_error", "_mesh", "_key", "_donated", "_read",
                 "_wait", "_wait_event", "_wait_error", "_computed", "_call", "_run", "__weakref__")

    def __init__(self, client: Any, buffer: int, shape: tuple[int, ...], dtype: np.dtype,
                 devices: list[int], mesh_shape: list[int], axis_names: list[str],
                 spec: list, *, mesh: Any = None, key: str | None = None) -> None:
        self._client = client
        self.buffer = buffer
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self._devices = devices
        self._mesh_shape = mesh_shape
        self._axis_names = axis_names
        self._spec = spec
        self._lock = threading.Lock()
        # made by the first fetch (a threading.Event costs more than the rest
        # of a future: most futures of an op-by-op chain are never waited on)
        self._event: threading.Event | None = None
        self._value: np.ndarray | None = None
        self._error: BaseException | None = None       # the call failed: final
        self._fetch: Any = None                         # the fetch being waited on
        self._fetch_error: BaseException | None = None  # how the last fetch failed
        self._mesh = mesh            # the zp.Mesh it lives on (None: made by hand, see tests)
        self._key = key              # a typed PRNG key's implementation: the value is its key data
        self._donated: str | None = None      # the function it was donated to
        # read by a call or a program, or by a fetch that failed or was given up
        # (a worker may still read it): Computation._may_donate then copies it, as
        # it does while a fetch or wait is out; an answered one, or a wait that
        # failed (a wait reads nothing), leaves it free to be donated
        self._read = False
        # a wait for it to be done without its value (block_until_ready of a big one)
        self._wait: Any = None                          # the wait in flight
        self._wait_event: threading.Event | None = None
        self._wait_error: BaseException | None = None   # how the last wait failed
        self._computed = False                          # a wait said it is done
        # shared by the outputs of the call that made it (Computation.__call__), or None
        self._call: CallRan | None = None
        # shared by the outputs of the program run that made it (tracer._futures), or None
        self._run: RunOutputs | None = None

    def __del__(self) -> None:
        if self._donated is not None:
            return          # released when it was donated
        try:
            self._client.release(self.buffer)
        except Exception:   # interpreter shutdown, closed client: nothing to free
            pass

    def _donate(self, to: str) -> None:
        """Donated to the call of ``to`` just made: its buffer is released
        after that call, and the future can no longer be used."""
        with self._lock:
            if self._donated is not None:
                return
            self._donated = to
        self._client.release(self.buffer)

    def _placement(self, op: str) -> tuple[Any, list]:
        if self._mesh is None:
            raise ZpathError(f"{op}: this future has no mesh to run on")
        if self._donated is not None:
            raise ZpathError(f"{op}: this future was donated to {self._donated} (donate_argnums)")
        return self._mesh, self._spec

    @property
    def sharding(self) -> Any:
        """Its ``zp.NamedSharding`` (mesh of virtual devices, PartitionSpec)."""
        return self._mesh.sharding(self._spec)

    def devices(self) -> set[Any]:
        """The virtual devices that hold it."""
        return set(self._mesh.devices.flat)

    def block_until_ready(self) -> "Future":
        """Wait until the value is computed, as ``jax.Array.block_until_ready``;
        raises the remote error if the computation failed. Returns the future.
        A value of at most WAIT_FETCHES_UP_TO bytes is fetched meanwhile (a
        worker answers a fetch once its shard is done; a later read has it at
        once); of a bigger one the workers only say when each shard is done,
        and nothing is copied. Once one output of a call is known computed,
        so are the others: the call's one computation has ended on every host
        (``_fetched``), and they return at once. Once it is called on a
        second output of a program run, the run's other outputs are asked
        for together (``RunOutputs``)."""
        small = self._small() and not self._is_computed()
        if small or self._run is not None:
            self._check_kept()
            self._ask_ready()              # its own request (a run's output: before its siblings')
            if self._run is not None:
                self._run.blocked_on(self)
        if small:
            self._array()
        else:
            self._wait_done()
        return self

    def copy_to_host_async(self) -> None:
        """Start fetching the value without waiting for it, as
        ``jax.Array.copy_to_host_async``: a later ``result()`` or
        ``np.asarray()`` returns it at once if it has come meanwhile (a loss
        read after the next step is then on its way while that step is
        called)."""
        self._check_kept()
        with self._lock:
            self._start_fetch()

    def is_ready(self) -> bool:
        """Whether the value is computed (or its computation is known to have
        failed), without waiting. The first call asks the workers for it, as
        ``block_until_ready`` does: fetches a small value, and asks only whether
        a bigger one is done (``WAIT_FETCHES_UP_TO``)."""
        if self._is_computed() or self.done():
            return True
        self._ask_ready()
        return self._is_computed() or self.done()

    def _ask_ready(self) -> None:
        """Send what ``block_until_ready`` would, without waiting (is_ready,
        RunOutputs): a small value's fetch, a bigger one's wait, unless it is
        known done, asked for already or donated."""
        with self._lock:
            if self.done() or self._is_computed() or self._donated is not None:
                return
            if self._small():
                self._start_fetch(self._call is not None)
            elif self._fetch is None:
                self._start_wait()

    def _is_computed(self) -> bool:
        """Known computed without its value: a wait of its own said so, or one
        of another output of its call (``_fetched``)."""
        return self._computed or (self._call is not None and self._call.ran)

    def _small(self) -> bool:
        return self.size * self.dtype.itemsize <= WAIT_FETCHES_UP_TO

    def _start_fetch(self, every_shard: bool = False) -> None:
        """Fetch the value unless it is here, failed, being fetched or donated
        (under ``_lock``); with ``every_shard``, from every shard, not one per
        distinct region (block_until_ready of a call's small output: its
        answer then says the call's other outputs are computed too)."""
        if self._value is None and self._error is None and self._fetch is None and self._donated is None:
            self._fetch_error = None
            self._waiting().clear()
            self._fetch = self._client.start_fetch(self, self._client.config.fetch_timeout_s,
                                                   every_shard=every_shard)

    def _start_wait(self) -> threading.Event:
        """Ask the workers to say when the value is done unless a wait is in
        flight (under ``_lock``); returns the event its outcome sets."""
        if self._wait_event is None:
            self._wait_event = threading.Event()
        if self._wait is None:
            self._wait_error = None
            self._wait_event.clear()
            # (while it is out a call does not donate it, Computation._may_donate;
            # once answered, it may)
            self._wait = self._client.start_fetch(self, self._client.config.fetch_timeout_s, wait_only=True)
        return self._wait_event

    def _wait_done(self) -> None:
        """Wait until the value is computed without fetching it (a fetch
        already on its way is waited for instead: it says as much)."""
        self._check_kept()
        timeout = self._client.config.fetch_timeout_s
        with self._lock:
            if self._error is not None:
                raise _fresh(self._error)
            if self._value is not None or self._is_computed():
                return
            fetching = self._fetch is not None
            if not fetching:
                event = self._start_wait()
                wait = self._wait
        if fetching:
            self._array(timeout)
            return
        recorder, began = getattr(self._client, "recorder", None), time.time()
        deadline = time.monotonic() + timeout
        try:
            while True:
                arrived = event.wait(max(0.0, deadline - time.monotonic()))
                with self._lock:
                    if self._error is not None:
                        raise _fresh(self._error)
                    if self._value is not None or self._is_computed():
                        return
                    if self._wait_error is not None and self._wait is None:
                        raise _fresh(self._wait_error)
                    if self._wait is not None and self._wait is not wait and time.monotonic() < deadline:
                        wait = self._wait         # ours failed and another thread asked again
                        continue
                    if not arrived and self._wait is wait:
                        self._wait = None     # a later wait asks again
                    raise DeadlineExceeded(f"buffer {self.buffer} ({self.dtype}{list(self.shape)}) was "
                                           f"not computed within {timeout:.1f}s")
        finally:
            if recorder is not None:
                recorder.add("wait", f"{self.dtype}{list(self.shape)}", began, time.time(),
                             buffer=self.buffer)

    def _waiting(self) -> threading.Event:
        """The event a fetch's outcome sets, made now if need be (under ``_lock``)."""
        if self._event is None:
            self._event = threading.Event()
        return self._event

    def _regions(self) -> list[sharding.Region]:
        return sharding.regions(self.shape, self._mesh_shape, self._axis_names, self._spec)

    def _fetched(self, fetch: Any, value: np.ndarray | None, error: BaseException | None) -> None:
        """Outcome of one fetch (or wait: ``value`` None); ignored unless it is
        the fetch or wait in flight."""
        with self._lock:
            if fetch is self._wait and fetch is not None:
                self._wait = None
                if error is None:
                    self._computed = True
                    self._ran_everywhere(fetch)
                else:
                    self._wait_error = error
                self._wait_event.set()
            elif fetch is self._fetch:
                self._fetch = None
                if error is None:
                    # the value every later result() returns: read-only, as JAX's
                    # np.asarray(array) is, so no caller can change it for the others
                    value.flags.writeable = False
                    self._value = value
                    self._ran_everywhere(fetch)
                else:
                    self._fetch_error = error
                    # (other hosts may still read their shards for it: no call donates it)
                    self._read = True
                if self._event is not None:
                    self._event.set()

    def _ran_everywhere(self, fetch: Any) -> None:
        """A fetch or wait of this value succeeded: if it asked every shard,
        its call has run to its end on every host, and the call's other
        outputs are computed too (said before its waiter wakes, so that the
        next leaf of a tree finds them so). A call's outputs are made on each
        host by one computation and stored, all or none, once it has run to
        its end (Executor._settle, _output_shards). A fetch of one shard per
        distinct region, or a wait sent to a copy after a host was lost
        (``relocated``), says less."""
        if self._call is not None and fetch.every_shard and not fetch.relocated:
            self._call.ran = True      # (only ever set)

    def _fail(self, error: BaseException) -> None:
        """The call that produces this value failed: every fetch raises ``error``."""
        with self._lock:
            if self._value is None:
                self._error = error
            self._fetch = self._wait = None
            for event in (self._event, self._wait_event):
                if event is not None:
                    event.set()

    def done(self) -> bool:
        """True once the value is here or the call is known to have failed."""
        return self._value is not None or self._error is not None

    def result(self, timeout: float | None = None) -> Any:
        """Fetch the value (a read-only numpy array; a typed PRNG key for a
        key's future). Raises the remote error if the computation failed, and
        :class:`~zpath.DeadlineExceeded` if it is not here within ``timeout``
        seconds (default: the connection's ClientConfig.fetch_timeout_s,
        ``ZPATH_FETCH_TIMEOUT``, 600)."""
        value = self._array(timeout)
        return value if self._key is None else jax.random.wrap_key_data(value, impl=self._key)

    def _check_kept(self) -> None:
        """Raise if the future was donated: its value is gone."""
        if self._donated is not None:
            raise ZpathError(f"this future was donated to {self._donated} (donate_argnums): its value "
                             "is gone; use what that call returned")

    def _array(self, timeout: float | None = None) -> np.ndarray:
        self._check_kept()
        if timeout is None:
            timeout = self._client.config.fetch_timeout_s
        elif isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) \
                or not 0 < timeout <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout must be a number of seconds > 0 and <= {MAX_TIMEOUT_S:g} "
                             f"(or None), not {timeout!r}")
        timeout = float(timeout)
        with self._lock:
            if self._error is not None:
                raise _fresh(self._error)
            if self._value is not None:
                return self._value
        recorder, began = getattr(self._client, "recorder", None), time.time()
        try:
            return self._result(timeout)
        finally:
            if recorder is not None:
                recorder.add("fetch", f"{self.dtype}{list(self.shape)}", began, time.time(),
                             buffer=self.buffer)

    def _result(self, timeout: float) -> np.ndarray:
        with self._lock:
            if self._error is not None:
                raise _fresh(self._error)
            if self._value is not None:
                return self._value
            event = self._waiting()
            if self._fetch is None:
                self._fetch_error = None
                event.clear()
                self._fetch = self._client.start_fetch(self, timeout)
            fetch = self._fetch
        deadline = time.monotonic() + timeout
        while True:
            arrived = event.wait(max(0.0, deadline - time.monotonic()))
            with self._lock:
                if self._error is not None:
                    raise _fresh(self._error)
                if self._value is not None:
                    return self._value
                if self._fetch_error is not None and self._fetch is None:
                    raise _fresh(self._fetch_error)
                if self._fetch is not None and self._fetch is not fetch and time.monotonic() < deadline:
                    fetch = self._fetch       # ours failed and another thread asked again
                    continue
                if not arrived and self._fetch is fetch:
                    self._fetch = None     # a later result() asks again
                    self._read = True      # (its workers may still read it: no call donates it)
                raise DeadlineExceeded(f"value of buffer {self.buffer} ({self.dtype}{list(self.shape)}) "
                                       f"not fetched within {timeout:.1f}s")

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value = self._array()
        if dtype is not None:
            return value.astype(dtype)
        return value.copy() if copy else value

    def __repr__(self) -> str:
        try:
            return repr(self.result())
        except ZpathError as e:
            return f"<zpath.Future {self.dtype}{list(self.shape)} failed: {type(e).__name__}>"

    def __bool__(self) -> bool:
        """The truth of the value (fetched), as for a numpy array."""
        return bool(self.result())

    def __int__(self) -> int:
        return int(self._array())

    def __float__(self) -> float:
        return float(self._array())

    def __complex__(self) -> complex:
        return complex(self._array())

    def __index__(self) -> int:
        return self._array().__index__()

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d future")
        return self.shape[0]


def _fresh(error: BaseException) -> BaseException:
    """A new exception equal to ``error``: raising the stored one would attach a
    traceback that refers back to this future (a reference cycle that keeps it,
    and its buffer, alive until the cyclic collector runs)."""
    if isinstance(error, RemoteError):
        return RemoteError(error.message, host=error.host, computation=error.computation,
                           remote_traceback=error.remote_traceback)
    try:
        return type(error)(*error.args)
    except Exception:
        return error
