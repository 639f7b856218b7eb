"""Unmodified JAX on zpath, through the IFRT proxy protocol.

The server side (``zpath up --ifrt-proxy PORT``, ``zp.init(ifrt_proxy=...)``)
is :mod:`zpath.proxy.server`. In the user's process::

    # JAX_PLATFORMS=proxy JAX_BACKEND_TARGET=grpc://HOST:PORT
    import zpath.proxy
    zpath.proxy.initialize()
    import jax
    jax.devices()            # the cluster's devices

This module only re-exports ``initialize`` (:mod:`zpath.proxy.client`), loaded
on first use, so that the CLI imports :mod:`zpath.proxy.launch` without JAX.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["initialize"]


def __getattr__(name: str) -> Any:
    if name != "initialize":
        raise AttributeError(f"module 'zpath.proxy' has no attribute {name!r}")
    value = importlib.import_module("zpath.proxy.client").initialize
    globals()[name] = value            # later lookups skip this function
    return value
