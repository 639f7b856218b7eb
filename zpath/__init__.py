"""zpath: a single-controller runtime for JAX, after Pathways (Barham et al., 2022).

    import zpath as zp
    zp.init()                                   # start a local cluster
    devs = zp.make_virtual_device_set().add_slice(devices=2).devices
    double = zp.pmap(lambda x: x * 2., devices=devs)
    print(double(np.arange(2.)))                # a future; printing fetches it
    zp.shutdown()

This module only re-exports the public names. They load on first use, so the
controller and the cluster tools, which import ``zpath.*`` modules, do not pay for
JAX (the client library imports it).
"""
from __future__ import annotations

import importlib
from typing import Any

from zpath.errors import (Broken, Closed, DeadlineExceeded, HostLost, ProtocolError, RemoteError,
                          ResourceError, ZpathError)

__version__ = "0.1.0"

# public name -> (module, name there)
_LAZY = {
    "init": ("zpath.client.session", "init"),
    "connect": ("zpath.client.session", "connect"),
    "shutdown": ("zpath.client.session", "shutdown"),
    "trace": ("zpath.client.session", "trace"),
    "Cluster": ("zpath.client.session", "Cluster"),
    "pmap": ("zpath.client.api", "pmap"),
    "jit": ("zpath.client.api", "jit"),
    "Mesh": ("zpath.client.api", "Mesh"),
    "NamedSharding": ("zpath.client.api", "NamedSharding"),
    "device_put": ("zpath.client.api", "device_put"),
    "make_virtual_device_set": ("zpath.client.api", "make_virtual_device_set"),
    "VirtualDeviceSet": ("zpath.client.api", "VirtualDeviceSet"),
    "VirtualDevice": ("zpath.client.api", "VirtualDevice"),
    "Slice": ("zpath.client.api", "Slice"),
    "Future": ("zpath.client.futures", "Future"),
    "program": ("zpath.client.tracer", "program"),
    "ProgramFunction": ("zpath.client.tracer", "ProgramFunction"),
    "P": ("jax.sharding", "PartitionSpec"),
}

__all__ = ["init", "connect", "shutdown", "trace", "Cluster", "pmap", "jit", "program", "ProgramFunction", "Mesh", "P",
           "NamedSharding", "device_put",
           "make_virtual_device_set", "VirtualDeviceSet", "VirtualDevice", "Slice", "Future",
           "ZpathError", "ProtocolError", "RemoteError", "HostLost", "Closed", "Broken",
           "DeadlineExceeded", "ResourceError"]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'zpath' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value            # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
