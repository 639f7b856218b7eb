"""The JAX side: registering the IFRT proxy as JAX's ``proxy`` backend."""
from __future__ import annotations

import os

import jax
from jax.extend import backend
from jax.extend.backend import ifrt_proxy


def initialize(connection_timeout_s: int | None = None) -> None:
    """Register the IFRT proxy as JAX's ``proxy`` backend, as pathwaysutils
    does, and nothing else: ``JAX_PLATFORMS=proxy`` then selects it and
    ``JAX_BACKEND_TARGET`` (``grpc://HOST:PORT``) says where the server is.
    ``connection_timeout_s``: how long the client keeps trying to connect
    (jaxlib's default when None).

    Registering includes the client's credential mode for the target it
    registers: zpath's proxy speaks plain gRPC (loopback only unless started
    insecure; docs/design.md: Security model), so for a ``grpc://`` target
    this sets IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS=true, as the client
    needs, unless the user set it already."""

    def make_client() -> object:
        target = jax.config.read("jax_backend_target")
        if target.startswith("grpc://"):
            os.environ.setdefault("IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS", "true")
        options = ifrt_proxy.ClientConnectionOptions()
        if connection_timeout_s is not None:
            options.connection_timeout_in_seconds = int(connection_timeout_s)
        return ifrt_proxy.get_client(target, options)

    backend.register_backend_factory("proxy", make_client, priority=-1)
