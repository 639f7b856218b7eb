"""One family of errors for everything zpath raises."""
from __future__ import annotations


class ZpathError(Exception):
    """Base class of every error zpath raises."""


class ProtocolError(ZpathError):
    """A message was malformed, unsigned, of an unknown type or a wrong version."""


class RemoteError(ZpathError):
    """A computation failed on a worker. Carries the host, the computation and the
    remote traceback."""

    def __init__(self, message: str, *, host: int | None = None,
                 computation: str = "", remote_traceback: str = "") -> None:
        self.message = message
        self.host = host
        self.computation = computation
        self.remote_traceback = remote_traceback
        where = f" on host {host}" if host is not None else ""
        what = f" in computation {computation!r}" if computation else ""
        text = f"{message}{what}{where}"
        if remote_traceback:
            text += "\n--- remote traceback ---\n" + remote_traceback.rstrip()
        super().__init__(text)


class HostLost(ZpathError):
    """A worker host stopped answering."""


class Closed(ZpathError):
    """The connection or cluster was closed by us."""


class Broken(ZpathError):
    """The peer or the network failed."""


class DeadlineExceeded(ZpathError, TimeoutError):
    """An operation did not finish before its deadline."""


class ResourceError(ZpathError):
    """A request for devices or memory cannot be satisfied."""
