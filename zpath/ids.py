"""Ids with structure, packed and unpacked in one place.

A buffer id names its client: ``client << 32 | n``, where ``n`` (from 1) counts
the buffers that client named. So a worker can tell whose buffer a Put or
Fetch names, and free or refuse a departed client's buffers by its id alone.
"""
from __future__ import annotations

from zpath.errors import ZpathError

CLIENT_SHIFT = 32
SERIAL_MASK = (1 << CLIENT_SHIFT) - 1


def buffer_id(client: int, n: int) -> int:
    """The id of buffer ``n`` (1 <= n < 2**32) of client ``client``: a counter
    past its range would name another client's buffers, so it raises instead."""
    if not 0 < n <= SERIAL_MASK:
        raise ZpathError(f"client {client} has used all its {SERIAL_MASK} buffer ids (reconnect)")
    return (client << CLIENT_SHIFT) | n


def client_of(buffer: int) -> int:
    """The client that named this buffer."""
    return buffer >> CLIENT_SHIFT


def serial_of(buffer: int) -> int:
    """The buffer's number among its client's (``n`` of :func:`buffer_id`)."""
    return buffer & SERIAL_MASK
