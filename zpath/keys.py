"""The per-cluster key that signs every message.

It travels in the environment (``ZPATH_KEY``, hex) or a file named by
``ZPATH_KEY_FILE``, never on a command line where ``ps`` would show it."""
from __future__ import annotations

import os
import secrets

from zpath.errors import ZpathError


def new_key() -> bytes:
    return secrets.token_bytes(32)


def key_from_env() -> bytes:
    if os.environ.get("ZPATH_KEY"):
        try:
            return bytes.fromhex(os.environ["ZPATH_KEY"])
        except ValueError:
            raise ZpathError("ZPATH_KEY is not hex") from None
    path = os.environ.get("ZPATH_KEY_FILE")
    if path:
        with open(path) as f:
            return bytes.fromhex(f.read().strip())
    raise ZpathError("no cluster key: set ZPATH_KEY (hex) or ZPATH_KEY_FILE")


def write_key_file(path: str, key: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
