"""One family of errors for everything zpath raises, and the kinds of error
that travel between processes."""
from __future__ import annotations

from enum import StrEnum


class ErrorKind(StrEnum):
    """What went wrong, as it travels in ``ErrorInfo.kind`` (a failed value or
    computation) and ``Error.code`` (a refused message). Both ends use these
    names; the values are the wire strings (a ``str``, so a record holds either).
    A receiver treats a value it does not know as ``REMOTE_ERROR``."""
    # ErrorInfo.kind: why a computation failed or a value cannot be had
    REMOTE_ERROR = "RemoteError"           # a computation raised on a worker (or a bad piece)
    HOST_LOST = "HostLost"                 # a host that held or needed it was lost
    DEADLINE_EXCEEDED = "DeadlineExceeded"  # an input did not arrive in time
    RESOURCE_ERROR = "ResourceError"       # it needs more device memory than a device may hold
    CALL_FAILED = "CallFailed"             # the controller rejected the call or program run
    ABANDONED = "Abandoned"                # its last copy was planned for an abandoned computation
    FUSED_UNKNOWN = "FusedUnknown"         # a worker did not know the fused program it was told to run
    PEER_FAILED = "PeerFailed"             # a collective with other hosts failed (reported to the
    #                                        controller, which finds out whether one of them was lost)
    # Error.code: why a message was refused
    PROTOCOL = "protocol"                  # malformed, unsigned, unknown type or version
    BAD_REQUEST = "bad_request"            # well formed, but not acceptable
    NOT_FOUND = "not_found"                # names a program or buffer that is not known
    NOT_REGISTERED = "not_registered"      # the sender is not (or no longer) a known client
    RESOURCE = "resource"                  # devices or memory cannot be had
    INTERNAL = "internal"                  # the receiver failed handling it (see its log)

    @classmethod
    def of(cls, text: str) -> "ErrorKind":
        """The kind a received string names; REMOTE_ERROR for one not known
        (a newer peer's)."""
        try:
            return cls(text)
        except ValueError:
            return cls.REMOTE_ERROR


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
