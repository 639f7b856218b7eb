"""Unmodified JAX on zpath, through the IFRT proxy protocol.

The server side (``zpath up --ifrt-proxy HOST:PORT``, ``zp.init(ifrt_proxy=...)``)
is :mod:`zpath.proxy.server`. In the user's process::

    # JAX_PLATFORMS=proxy JAX_BACKEND_TARGET=grpc://HOST:PORT
    # IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS=true
    import zpath.proxy
    zpath.proxy.initialize()
    import jax
    jax.devices()            # the cluster's devices

This module imports nothing heavy: ``initialize`` imports JAX when called, and
the CLI imports :mod:`zpath.proxy.launch` without JAX.
"""
from __future__ import annotations


def initialize(connection_timeout_s: int | None = None) -> None:
    """Register the IFRT proxy as JAX's ``proxy`` backend, as pathwaysutils
    does, and nothing else: ``JAX_PLATFORMS=proxy`` then selects it and
    ``JAX_BACKEND_TARGET`` (``grpc://HOST:PORT``) says where the server is.
    ``connection_timeout_s``: how long the client keeps trying to connect
    (jaxlib's default when None)."""
    import jax                                       # noqa: PLC0415  (the user's process only)
    from jax.extend import backend                   # noqa: PLC0415
    from jax.extend.backend import ifrt_proxy        # noqa: PLC0415

    def make_client() -> object:
        options = ifrt_proxy.ClientConnectionOptions()
        if connection_timeout_s is not None:
            options.connection_timeout_in_seconds = int(connection_timeout_s)
        return ifrt_proxy.get_client(jax.config.read("jax_backend_target"), options)

    backend.register_backend_factory("proxy", make_client, priority=-1)
