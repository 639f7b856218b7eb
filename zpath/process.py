"""Process hygiene shared by the controller and the workers: a process the
launcher started dies with it."""
from __future__ import annotations

import ctypes
import os
import signal

# the launcher puts its pid here; a child it started asks to die with it
PARENT_PID_ENV = "ZPATH_PARENT_PID"


def die_with_parent() -> None:
    """Called early in a controller or worker started by this launcher: ask the
    kernel for SIGKILL when the launching process dies (Linux), so a crashed
    launcher leaves no orphans. Done in the child, not with ``preexec_fn``, which
    would force a plain fork() of a multithreaded (JAX) parent."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if not parent:
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):   # the parent died before we asked
        os._exit(1)
