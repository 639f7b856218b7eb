"""The keys that sign messages, one per role (docs/design.md, "Security").

* the **cluster key** (``ZPATH_KEY`` / ``ZPATH_KEY_FILE``): what every client
  holds. It signs a client's ``Hello`` (and ``StatusRequest``s before one), and
  the controller's messages to clients.
* the **worker key** (``ZPATH_WORKER_KEY``): what
  only the controller and the workers hold. It signs what they send each other
  (registration, control, pieces).
* a **session key** per client: ``HMAC-SHA256(worker key, "zpath session" ‖
  u64le(client id))``. The controller hands it to the client in its ``Welcome``
  (sealed under the cluster key); the client signs with it everything it sends
  after. A worker recomputes it from the client id the message claims, so a
  client can sign only as itself.

Keys travel in the environment or a file, never on a command line where ``ps``
would show them."""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import struct

from zpath.config import CommonConfig
from zpath.errors import ZpathError
from zpath.net.codec import CLIENTS, CLUSTER, KeyOf

log = logging.getLogger(__name__)

# the highest client id (ids are < 2**31: a buffer id, client << 32 | n, stays an int64)
MAX_CLIENT_ID = (1 << 31) - 1
_SESSIONS_KEPT = 4096
_U64 = struct.Struct("<Q").pack


def new_key() -> bytes:
    return secrets.token_bytes(32)


MIN_KEY_BYTES = 16


def parse_key(key: bytes | str, where: str = "the key") -> bytes:
    """A key given as bytes or hex, checked: ZpathError if it is not hex or
    shorter than MIN_KEY_BYTES."""
    if isinstance(key, str):
        try:
            key = bytes.fromhex(key.strip())
        except ValueError:
            raise ZpathError(f"{where} is not hexadecimal") from None
    if not isinstance(key, (bytes, bytearray)):
        raise ZpathError(f"{where} must be bytes or a hex string, not {type(key).__name__}")
    if len(key) < MIN_KEY_BYTES:
        raise ZpathError(f"{where} has {len(key)} bytes; a cluster key has at least {MIN_KEY_BYTES}")
    return bytes(key)


def key_from_config(common: CommonConfig) -> bytes:
    """The cluster key a configuration names: ``key`` (ZPATH_KEY), else the
    file ``key_file`` (ZPATH_KEY_FILE)."""
    if common.key:
        return parse_key(common.key, "ZPATH_KEY")
    path = common.key_file
    if path:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise ZpathError(f"cannot read the key file ZPATH_KEY_FILE={path}: {e.strerror}") from None
        return parse_key(text, f"the key in {path}")
    raise ZpathError("no cluster key: set ZPATH_KEY (hex) or ZPATH_KEY_FILE")


def write_key_file(path: str, key: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")


def worker_key_from_config(common: CommonConfig, cluster_key: bytes) -> bytes:
    """The worker key a configuration names: ``worker_key`` (ZPATH_WORKER_KEY),
    else the cluster key itself (a cluster
    started by hand with one key: clients are then not kept apart, and a warning
    says so)."""
    if common.worker_key:
        return parse_key(common.worker_key, "ZPATH_WORKER_KEY")
    log.warning("no worker key (ZPATH_WORKER_KEY): the cluster key is used instead, so any "
                "client could act as a worker or as another client")
    return cluster_key


class Keys:
    """The keys of the controller or a worker: the cluster key (``clients``),
    the worker key (``workers``) and the session keys derived from it."""

    def __init__(self, clients: bytes, workers: bytes) -> None:
        self.clients = clients
        self.workers = workers
        self._sessions: dict[int, bytes] = {}

    @classmethod
    def random(cls) -> "Keys":
        return cls(new_key(), new_key())

    def session(self, client: int) -> bytes:
        """Client ``client``'s session key."""
        key = self._sessions.get(client)
        if key is None:
            if len(self._sessions) >= _SESSIONS_KEPT:
                self._sessions.clear()
            key = self._sessions[client] = session_key(self.workers, client)
        return key

    def of(self, signer: int) -> bytes | None:
        """The key a signer signs with (``codec.KeyOf``): the worker key, the
        cluster key, or a session key (any client id in range)."""
        if signer == CLUSTER:
            return self.workers
        if signer == CLIENTS:
            return self.clients
        if 0 < signer <= MAX_CLIENT_ID:
            return self.session(signer)
        return None


def session_key(worker_key: bytes, client: int) -> bytes:
    return hmac.new(worker_key, b"zpath session" + _U64(client), hashlib.sha256).digest()


def seal(cluster_key: bytes, nonce: bytes, client: int, session: bytes) -> bytes:
    """``session`` as the ``Welcome`` carries it: XORed with
    HMAC-SHA256(cluster key, "zpath welcome" ‖ nonce ‖ u64le(client)), the
    ``nonce`` the client's ``Hello`` carried. Sealing again opens it."""
    pad = hmac.new(cluster_key, b"zpath welcome" + nonce + _U64(client), hashlib.sha256).digest()
    if len(session) != len(pad):
        raise ZpathError(f"a session key has {len(pad)} bytes, not {len(session)}")
    return bytes(a ^ b for a, b in zip(session, pad, strict=True))


def client_keys(cluster_key: bytes, nonce: bytes, client: int, sealed: bytes) -> tuple[bytes, int, KeyOf]:
    """A client's keys from its ``Welcome`` (its ``client_id`` and sealed
    ``session_key``; ``nonce`` its Hello's): what ``Endpoint.sign_as`` takes —
    the session key, the client id it signs as, and what checks what comes (the
    controller's messages under the cluster key, workers' under the session key)."""
    session = seal(cluster_key, nonce, client, sealed)

    def keys(signer: int) -> bytes | None:
        return cluster_key if signer == CLIENTS else session if signer == client else None
    return session, client, keys
