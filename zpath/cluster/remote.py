"""The remote side of an SSH launch: ``python -m zpath.cluster.remote [options] -- WORKER ARGS``.

Run by ``zpath.cluster.ssh.SSHCluster`` as the command of one ssh session per host. It

* reads the cluster key and the worker key from the first two lines of its
  standard input (so neither appears on a command line that ``ps`` shows) and
  passes them to the worker in ``ZPATH_KEY`` and ``ZPATH_WORKER_KEY``;
* sets ``XLA_FLAGS`` for ``--devices`` emulated devices and the ``--setenv``
  variables, and starts ``python -m zpath.worker WORKER ARGS`` as its child;
* prints one line ``zpath-remote: host H pid P worker W`` so the launcher knows
  what to kill over ssh if it ever has to;
* stops the worker (SIGTERM, then SIGKILL after a grace period) as soon as its
  standard input reaches end-of-file — which is what happens when the ssh
  session ends for any reason, the launcher killed included — or when it gets
  SIGTERM/SIGHUP/SIGINT; and exits with the worker's exit code when the worker
  exits by itself.

The worker also dies with this process (``ZPATH_PARENT_PID``, PR_SET_PDEATHSIG),
so a SIGKILL here leaves no orphan either."""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading

from zpath.cluster.launcher import worker_xla_flags
from zpath.process import PARENT_PID_ENV

GRACE_S = 5.0


def _read_key_line() -> str:
    line = b""
    while not line.endswith(b"\n"):
        b = os.read(0, 1)           # unbuffered: the rest of stdin is watched for EOF
        if not b:
            break
        line += b
    return line.decode(errors="replace").strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zpath.cluster.remote")
    p.add_argument("--devices", type=int, default=0, help="emulated devices (XLA_FLAGS); 0: leave as is")
    p.add_argument("--setenv", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("worker_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    worker_args = args.worker_args[1:] if args.worker_args[:1] == ["--"] else args.worker_args
    key, worker_key = _read_key_line(), _read_key_line()
    try:
        bytes.fromhex(key)
        bytes.fromhex(worker_key)
    except ValueError:
        key = ""
    if not key or not worker_key:
        print("zpath-remote: no cluster key and worker key on standard input", file=sys.stderr, flush=True)
        return 2
    env = dict(os.environ)
    for item in args.setenv:
        name, _, value = item.partition("=")
        env[name] = value
    if args.devices:
        env["XLA_FLAGS"] = worker_xla_flags(env, args.devices)
    env["ZPATH_KEY"] = key
    env["ZPATH_WORKER_KEY"] = worker_key
    env[PARENT_PID_ENV] = str(os.getpid())
    for name in ("ZPATH_KEY_FILE", "ZPATH_CONTROLLER"):
        env.pop(name, None)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    worker = subprocess.Popen([sys.executable, "-m", "zpath.worker", *worker_args],
                              stdin=subprocess.DEVNULL, env=env)
    print(f"zpath-remote: host {socket.gethostname()} pid {os.getpid()} worker {worker.pid}", flush=True)

    def watch_stdin() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    while worker.poll() is None and not stop.wait(0.2):
        pass
    if worker.poll() is None:
        worker.terminate()
        try:
            worker.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        print("zpath-remote: worker stopped", flush=True)
    return worker.returncode if worker.returncode >= 0 else 128 - worker.returncode


if __name__ == "__main__":
    sys.exit(main())
