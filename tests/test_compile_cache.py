"""The workers' persistent compilation cache (zpath/worker/compile_cache.py):
the setting's meaning, and that on CPU a program the executor's way compiles
(an exported function under jit with named shardings) is written once and read
back, not compiled again, despite JAX's default one-second threshold."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zpath.worker import compile_cache

pytestmark = pytest.mark.timeout(120)

# the executor's way: a jax.export artifact, deserialized, called under jit on a
# mesh; the second time after clearing JAX's in-memory caches
SCRIPT = """
import json, os, sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from zpath.worker import compile_cache
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
directory = compile_cache.use(sys.argv[1])
exported = jax.export.deserialize(bytearray(jax.export.export(jax.jit(lambda x: jnp.tanh(x @ x.T).sum(0)))(
    jax.ShapeDtypeStruct((8, 8), np.float32)).serialize()))
mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
seen = []
for _ in range(2):
    fn = jax.jit(lambda a: exported.call(a), in_shardings=NamedSharding(mesh, P("i")),
                 out_shardings=NamedSharding(mesh, P()))
    fn(np.ones((8, 8), np.float32)).block_until_ready()
    seen.append(sorted(e.rsplit("/", 1)[1] for e in events if e.endswith(("cache_hits", "cache_misses"))))
    events.clear()
    jax.clear_caches()
print(json.dumps({"dir": directory, "seen": seen, "entries": len(os.listdir(directory))}))
"""


def test_the_setting_names_a_directory_the_default_or_none(tmp_path):
    assert compile_cache.cache_dir(str(tmp_path)) == str(tmp_path)
    assert compile_cache.cache_dir("").endswith(os.path.join(".zpath", "jax-cache"))
    for off in ("off", "OFF", "none", "0"):
        assert compile_cache.cache_dir(off) == ""
        assert compile_cache.use(off) == ""


def test_a_program_compiled_once_is_read_back_from_the_cache(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    cache = tmp_path / "cache"
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(cache)], capture_output=True, text=True, timeout=100, env=env)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["dir"] == str(cache) and out["entries"] >= 1
    assert out["seen"] == [["cache_misses"], ["cache_hits"]]
    assert (cache.stat().st_mode & 0o777) == 0o700
