"""Futures: handles to values that live on the workers."""
from __future__ import annotations

import numbers
import threading
import time
from typing import Any

import numpy as np

from zpath import sharding
from zpath.errors import DeadlineExceeded, RemoteError, ZpathError


MAX_TIMEOUT_S = 1e7      # (a wait longer than the platform's limit raises OverflowError)


class Future:
    """A value being computed (or already computed) on the cluster.

    ``shape`` and ``dtype`` are known at once. ``result()`` or ``np.asarray()``
    fetch the value from the workers; passing the future to another call does not
    bring it back to this process."""

    __slots__ = ("_client", "buffer", "shape", "dtype", "_devices", "_mesh_shape",
                 "_axis_names", "_spec", "_lock", "_event", "_value", "_error", "_fetch",
                 "_fetch_error",
                 "__weakref__")

    def __init__(self, client: Any, buffer: int, shape: tuple[int, ...], dtype: np.dtype,
                 devices: list[int], mesh_shape: list[int], axis_names: list[str],
                 spec: list) -> None:
        self._client = client
        self.buffer = buffer
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self._devices = devices
        self._mesh_shape = mesh_shape
        self._axis_names = axis_names
        self._spec = spec
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._value: np.ndarray | None = None
        self._error: BaseException | None = None       # the call failed: final
        self._fetch: Any = None                         # the fetch being waited on
        self._fetch_error: BaseException | None = None  # how the last fetch failed

    def __del__(self) -> None:
        try:
            self._client.release(self.buffer)
        except Exception:   # interpreter shutdown, closed client: nothing to free
            pass

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def _regions(self) -> list[sharding.Region]:
        return sharding.regions(self.shape, self._mesh_shape, self._axis_names, self._spec)

    def _fetched(self, fetch: Any, value: np.ndarray | None, error: BaseException | None) -> None:
        """Outcome of one fetch; ignored unless it is the fetch being waited on."""
        with self._lock:
            if fetch is not self._fetch:
                return
            self._fetch = None
            if error is None:
                # the value every later result() returns: read-only, as JAX's
                # np.asarray(array) is, so no caller can change it for the others
                value.flags.writeable = False
                self._value = value
            else:
                self._fetch_error = error
            self._event.set()

    def _fail(self, error: BaseException) -> None:
        """The call that produces this value failed: every fetch raises ``error``."""
        with self._lock:
            if self._value is None:
                self._error = error
            self._fetch = None
            self._event.set()

    def done(self) -> bool:
        """True once the value is here or the call is known to have failed."""
        return self._value is not None or self._error is not None

    def result(self, timeout: float | None = None) -> np.ndarray:
        """Fetch the value. Raises the remote error if the computation failed, and
        :class:`~zpath.DeadlineExceeded` if it is not here within ``timeout``
        seconds (default: the connection's ClientConfig.fetch_timeout_s,
        ``ZPATH_FETCH_TIMEOUT``, 600)."""
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
            if self._fetch is None:
                self._fetch_error = None
                self._event.clear()
                self._fetch = self._client.start_fetch(self, timeout)
            fetch = self._fetch
        arrived = self._event.wait(timeout)
        with self._lock:
            if self._error is not None:
                raise _fresh(self._error)
            if self._value is not None:
                return self._value
            if self._fetch_error is not None and self._fetch is None:
                raise _fresh(self._fetch_error)
            if not arrived and self._fetch is fetch:
                self._fetch = None     # a later result() asks again
            raise DeadlineExceeded(f"value of buffer {self.buffer} ({self.dtype}{list(self.shape)}) "
                                   f"not fetched within {timeout:.1f}s")

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value = self.result()
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
