"""JAX's persistent compilation cache on the workers: a program compiled once
(by any run, any cluster of this user, with the same JAX, devices and HLO) is
read back instead of compiled again (WorkerConfig.compile_cache,
ZPATH_COMPILE_CACHE, ``zpath up --compile-cache``).

JAX caches only programs that took at least a second to compile by default;
on CPU most take milliseconds, so the thresholds are lowered to cache every
program. In a multi-host island only JAX process 0 writes entries; every host
reads them (the directory is shared on one machine)."""
from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)

OFF = ("off", "none", "0")


def cache_dir(configured: str = "") -> str:
    """The cache directory of ``configured`` (ZPATH_COMPILE_CACHE): empty means
    ~/.zpath/jax-cache; ``off`` (or ``none``, ``0``) means no cache ("")."""
    if configured.strip().lower() in OFF:
        return ""
    return configured or os.path.join(os.path.expanduser("~"), ".zpath", "jax-cache")


def use(configured: str = "") -> str:
    """Point this process's JAX at the cache ``configured`` names, before
    anything is compiled; returns the directory ("" for none). A directory
    that cannot be made leaves the cache off, with a warning."""
    directory = cache_dir(configured)
    if not directory:
        return ""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as e:
        log.warning("no compilation cache: cannot make %s (%s)", directory, e.strerror)
        return ""
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory
