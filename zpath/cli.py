"""The ``zpath`` command: ``up``, ``down``, ``status``, ``controller``, ``worker``."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading


def _up(args: argparse.Namespace) -> int:
    from zpath import logs
    from zpath import state as cluster_state

    logs.setup("launcher")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    state_path = args.state or cluster_state.default_path()
    if os.path.exists(state_path):
        try:
            old = cluster_state.read_state(state_path)
        except Exception:
            old = {}
        if old.get("launcher_pid") and cluster_state.alive(old["launcher_pid"], old.get("launcher_create_time")):
            print(f"zpath up: a cluster started by pid {old['launcher_pid']} is running with state file "
                  f"{state_path}; stop it with `zpath down` or pass --state", file=sys.stderr)
            return 1
    dcn = dict(dcn_latency_ms=args.dcn_latency_ms, dcn_gbps=args.dcn_gbps, dcn_encrypt=args.dcn_encrypt,
               policy=args.policy)
    if args.hostfile:
        import shlex

        from zpath.ssh import SSHCluster, read_hostfile
        hosts = read_hostfile(args.hostfile)
        print(f"starting {len(hosts)} host(s) over ssh...", file=sys.stderr, flush=True)
        cluster = SSHCluster(hosts, bind_host=args.bind_host, controller_port=args.controller_port,
                             coordinator_port=args.coordinator_port, remote_python=args.remote_python,
                             ssh_options=shlex.split(args.ssh_options or os.environ.get("ZPATH_SSH_OPTIONS", "")),
                             connect_timeout=args.connect_timeout, log_dir=args.log_dir,
                             start_timeout=args.start_timeout, **dcn)
    else:
        from zpath.launcher import LocalCluster
        print(f"starting {args.islands} island(s) x {args.hosts_per_island} host(s) x "
              f"{args.devices_per_host} device(s)...", file=sys.stderr, flush=True)
        cluster = LocalCluster(args.islands, args.hosts_per_island, args.devices_per_host,
                               log_dir=args.log_dir, bind_host=args.bind_host or "127.0.0.1",
                               start_timeout=args.start_timeout, **dcn)
    try:
        cluster_state.write_state(state_path, cluster_state.cluster_state(cluster))
        print(f"zpath cluster up: {cluster.address}", flush=True)
        print(f"  key file: {cluster.key_file}", flush=True)
        print(f"  logs:     {cluster.dir}", flush=True)
        print(f"  state:    {state_path}  (`zpath down --state {state_path}` stops it)", flush=True)
        print(f"connect with: ZPATH_KEY_FILE={cluster.key_file} and "
              f"zp.connect({cluster.address!r})  (Ctrl-C stops the cluster)", flush=True)
        while not stop.wait(0.5):
            for name, p in cluster.procs:
                if p.poll() is not None:
                    print(f"{cluster._describe_exit(name, p).replace('during start-up', 'while running')}\n"
                          "stopping the cluster", file=sys.stderr, flush=True)
                    return 1
    finally:
        cluster.stop()
        cluster_state.remove_state(state_path, os.getpid())
        print("zpath cluster stopped", file=sys.stderr, flush=True)
    return 0


def _down(args: argparse.Namespace) -> int:
    from zpath import state as cluster_state

    path = args.state or cluster_state.default_path()
    for line in cluster_state.down(path, timeout=args.timeout):
        print(line)
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
          f"{st.buffers} buffer(s), {st.calls} call(s); computations running {st.running}, "
          f"queued {st.queued}")
    stores = {s.rank: s for s in st.stores}
    for h in st.hosts:
        s = stores.get(h.rank)
        held = f", {s.shards} shard(s) {s.nbytes} bytes" if s else ""
        print(f"  island {h.island} host {h.rank} {h.name} devices {[d.id for d in h.devices]} "
              f"data {h.data_address}{held}")
    for d in st.devices:
        if d.nbytes or d.held:
            print(f"  device {d.id} (host {d.host}): {d.held} bytes held (worker), "
                  f"{d.nbytes} bytes placed (controller)")
    for h in st.lost:
        print(f"  island {h.island} host {h.rank} {h.name} LOST")
    print(f"  scheduling policy: {st.policy}")
    for cl in st.clients:
        print(f"  client {cl.id} {cl.name}: weight {cl.weight:g}, device time {cl.device_seconds:.3f}s, "
              f"running {cl.running}, queued {cl.queued}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from zpath.launcher import default_shape

    shape = default_shape()
    p = argparse.ArgumentParser(prog="zpath", description="zpath: a single-controller runtime for JAX")
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run a cluster (local, or over ssh with --hostfile) in the foreground")
    up.add_argument("--islands", type=int, default=shape["islands"])
    up.add_argument("--hosts-per-island", type=int, default=shape["hosts_per_island"])
    up.add_argument("--devices-per-host", type=int, default=shape["devices_per_host"])
    up.add_argument("--hostfile", help="start one worker per line over ssh (see README: SSH clusters); "
                    "--islands/--hosts-per-island/--devices-per-host are then ignored")
    up.add_argument("--bind-host", help="address the controller (and local workers) listen on "
                    "(default 127.0.0.1; with --hostfile this machine's address on the route to the first host)")
    up.add_argument("--controller-port", type=int, default=0, help="controller port (default: a free one)")
    up.add_argument("--coordinator-port", type=int, default=0,
                    help="with --hostfile: base port of multi-host islands' jax.distributed coordinators "
                         "(island i uses base+i; default: free/random)")
    up.add_argument("--remote-python", default="python3",
                    help="with --hostfile: python on the hosts, unless a line has python=")
    up.add_argument("--ssh-options", help="with --hostfile: extra ssh arguments, e.g. \"-i KEY\" "
                    "(default $ZPATH_SSH_OPTIONS)")
    up.add_argument("--connect-timeout", type=int, default=10, help="ssh ConnectTimeout (s)")
    up.add_argument("--start-timeout", type=float,
                    default=float(os.environ.get("ZPATH_START_TIMEOUT", "120")),
                    help="seconds for every worker to register")
    up.add_argument("--state", help="state file for `zpath down` (default $ZPATH_STATE or ~/.zpath/cluster.json)")
    up.add_argument("--log-dir", help="where process logs and the key file go (default: a temp dir)")
    up.add_argument("--dcn-latency-ms", type=float, default=0.0,
                    help="emulated one-way latency of traffic between islands (ms)")
    up.add_argument("--dcn-gbps", type=float, default=0.0,
                    help="emulated bandwidth cap of each host's link between islands (Gbit/s; 0: none)")
    up.add_argument("--dcn-encrypt", action="store_true",
                    help="encrypt traffic between islands with CURVE")
    up.add_argument("--policy", choices=("share", "fifo"), default=None,
                    help="multi-tenant scheduling policy: proportional share by client weight "
                         "(default; $ZPATH_SCHEDULER_POLICY) or fifo")
    up.set_defaults(fn=_up)
    dn = sub.add_parser("down", help="stop the cluster a `zpath up` started")
    dn.add_argument("--state", help="its state file (default $ZPATH_STATE or ~/.zpath/cluster.json)")
    dn.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for zpath up to stop")
    dn.set_defaults(fn=_down)
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
