"""The ``zpath`` command: ``up``, ``status``, ``controller``, ``worker``."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading


def _up(args: argparse.Namespace) -> int:
    from zpath import logs
    from zpath.launcher import LocalCluster

    logs.setup("launcher")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting {args.islands} island(s) x {args.hosts_per_island} host(s) x "
          f"{args.devices_per_host} device(s)...", file=sys.stderr, flush=True)
    cluster = LocalCluster(args.islands, args.hosts_per_island, args.devices_per_host,
                           log_dir=args.log_dir, bind_host=args.bind_host,
                           dcn_latency_ms=args.dcn_latency_ms, dcn_gbps=args.dcn_gbps,
                           dcn_encrypt=args.dcn_encrypt)
    try:
        print(f"zpath cluster up: {cluster.address}", flush=True)
        print(f"  key file: {cluster.key_file}", flush=True)
        print(f"  logs:     {cluster.dir}", flush=True)
        print(f"connect with: ZPATH_KEY_FILE={cluster.key_file} and "
              f"zp.connect({cluster.address!r})  (Ctrl-C stops the cluster)", flush=True)
        while not stop.wait(0.5):
            for name, p in cluster.procs:
                if p.poll() is not None:
                    print(f"{name} exited with code {p.returncode}; stopping the cluster\n"
                          f"{cluster.log_tail(name)}", file=sys.stderr, flush=True)
                    return 1
    finally:
        cluster.stop()
        print("zpath cluster stopped", file=sys.stderr, flush=True)
    return 0


def _status(args: argparse.Namespace) -> int:
    from zpath.client import Client
    from zpath.keys import key_from_env
    from zpath.net import messages as m

    address = args.address or os.environ.get("ZPATH_CONTROLLER")
    if not address:
        print("zpath status: give the controller address or set ZPATH_CONTROLLER", file=sys.stderr)
        return 2
    c = Client(address, key_from_env(), name="status", timeout=args.timeout)
    try:
        st = c.request(m.StatusRequest(True), timeout=args.timeout)
    finally:
        c.close()
    print(f"controller {address}: {len(st.hosts)} host(s), {st.programs} program(s), "
          f"{st.buffers} buffer(s), {st.calls} call(s)")
    stores = {s.rank: s for s in st.stores}
    for h in st.hosts:
        s = stores.get(h.rank)
        held = f", {s.shards} shard(s) {s.nbytes} bytes" if s else ""
        print(f"  island {h.island} host {h.rank} {h.name} devices {[d.id for d in h.devices]} "
              f"data {h.data_address}{held}")
    for h in st.lost:
        print(f"  island {h.island} host {h.rank} {h.name} LOST")
    for cl in st.clients:
        print(f"  client {cl}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from zpath.launcher import default_shape

    shape = default_shape()
    p = argparse.ArgumentParser(prog="zpath", description="zpath: a single-controller runtime for JAX")
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run a local cluster in the foreground")
    up.add_argument("--islands", type=int, default=shape["islands"])
    up.add_argument("--hosts-per-island", type=int, default=shape["hosts_per_island"])
    up.add_argument("--devices-per-host", type=int, default=shape["devices_per_host"])
    up.add_argument("--bind-host", default="127.0.0.1", help="address every process listens on")
    up.add_argument("--log-dir", help="where process logs and the key file go (default: a temp dir)")
    up.add_argument("--dcn-latency-ms", type=float, default=0.0,
                    help="emulated one-way latency of traffic between islands (ms)")
    up.add_argument("--dcn-gbps", type=float, default=0.0,
                    help="emulated bandwidth cap of each host's link between islands (Gbit/s; 0: none)")
    up.add_argument("--dcn-encrypt", action="store_true",
                    help="encrypt traffic between islands with CURVE")
    up.set_defaults(fn=_up)
    st = sub.add_parser("status", help="show a running cluster")
    st.add_argument("address", nargs="?", help="controller address (default $ZPATH_CONTROLLER)")
    st.add_argument("--timeout", type=float, default=10.0)
    st.set_defaults(fn=_status)
    sub.add_parser("controller", help="run a controller (see zpath controller --help)", add_help=False)
    sub.add_parser("worker", help="run a worker (see zpath worker --help)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "controller":
        from zpath.controller.server import main as controller_main
        return controller_main(argv[1:])
    if argv and argv[0] == "worker":
        from zpath.worker.server import main as worker_main
        return worker_main(argv[1:])
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a clear one-line error, not a traceback, for expected failures
        from zpath.errors import ZpathError
        if isinstance(e, ZpathError):
            logging.getLogger("zpath").debug("failed", exc_info=True)
            print(f"zpath {args.command}: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
