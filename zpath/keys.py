"""The per-cluster key that signs every message.

It travels in the environment (``ZPATH_KEY``, hex) or a file named by
``ZPATH_KEY_FILE`` (CommonConfig), never on a command line where ``ps`` would
show it."""
from __future__ import annotations

import os
import secrets

from zpath.config import CommonConfig
from zpath.errors import ZpathError


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
