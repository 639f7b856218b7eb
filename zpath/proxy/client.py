"""The JAX side: registering the IFRT proxy as JAX's ``proxy`` backend."""
from __future__ import annotations

import jax
from jax.extend import backend
from jax.extend.backend import ifrt_proxy


def initialize(connection_timeout_s: int | None = None) -> None:
    """Register the IFRT proxy as JAX's ``proxy`` backend, as pathwaysutils
    does, and nothing else: ``JAX_PLATFORMS=proxy`` then selects it and
    ``JAX_BACKEND_TARGET`` (``grpc://HOST:PORT``) says where the server is.
    ``connection_timeout_s``: how long the client keeps trying to connect
    (jaxlib's default when None)."""

    def make_client() -> object:
        options = ifrt_proxy.ClientConnectionOptions()
        if connection_timeout_s is not None:
            options.connection_timeout_in_seconds = int(connection_timeout_s)
        return ifrt_proxy.get_client(jax.config.read("jax_backend_target"), options)

    backend.register_backend_factory("proxy", make_client, priority=-1)
