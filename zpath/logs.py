"""Logging set-up: every line carries the process role and host rank."""
from __future__ import annotations

import logging


def setup(role: str, level: str) -> None:
    """Log to stderr, each line naming ``role``, at ``level`` (a process's
    CommonConfig.log_level, ZPATH_LOG_LEVEL)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s {role} %(name)s %(levelname)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level.upper())
