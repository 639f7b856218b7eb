"""The ``zpath`` command: ``up``, ``down``, ``status``, ``trace``, ``controller``, ``worker``."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import shlex
import signal
import sys
import threading
from importlib import metadata
from typing import Any

import zmq

from zpath import __version__, logs
from zpath.cluster import state as cluster_state
from zpath.config import DEFAULT_SHAPE, POLICIES, ClientConfig, ClusterConfig, CommonConfig, SlurmJob
from zpath.errors import ZpathError
from zpath.cluster import connfile
from zpath.keys import parse_key
from zpath.proxy.launch import is_loopback, listen_address, start_proxy

# The launchers and the client connection are imported by the subcommands that
# use them (`up`, `status`): they bring the wire protocol and numpy, which take
# most of a second to import, and `zpath down`, `zpath --help` or a usage error
# need neither. `zpath controller`/`zpath worker` import only their own main().


@dataclasses.dataclass(frozen=True)
class Settings:
    """The settings the subcommands read, built from the environment once, in
    ``main()`` (``zpath controller``/``zpath worker`` build their own)."""
    common: CommonConfig
    client: ClientConfig
    cluster: ClusterConfig
    slurm: SlurmJob

    @classmethod
    def from_env(cls) -> "Settings":
        return cls(CommonConfig.from_env(), ClientConfig.from_env(), ClusterConfig.from_env(),
                   SlurmJob.from_env())


def _arg(convert: Any, ok: Any, what: str) -> Any:
    """An argparse type: ``convert(text)`` that must satisfy ``ok``."""
    def parse(text: str) -> Any:
        try:
            v = convert(text)
        except ValueError:
            v = None
        if v is None or not ok(v):
            raise argparse.ArgumentTypeError(f"must be {what}, not {text!r}")
        return v
    return parse


_positive_int = _arg(int, lambda v: v >= 1, "a whole number >= 1")
_non_negative = _arg(float, lambda v: 0 <= v < float("inf"), "a number >= 0")
_positive = _arg(float, lambda v: 0 < v < float("inf"), "a number > 0")
_port = _arg(int, lambda v: 0 <= v <= 65535, "a port number 0-65535 (0: a free one)")


def _up(args: argparse.Namespace, cfg: Settings) -> int:
    logs.setup("launcher", cfg.common.log_level)
    if args.ifrt_proxy:
        try:
            args.ifrt_proxy = listen_address(args.ifrt_proxy)
        except ValueError as e:
            print(f"zpath up: --ifrt-proxy: {e}", file=sys.stderr)
            return 2
        if not args.ifrt_proxy_insecure and not is_loopback(args.ifrt_proxy):
            print(f"zpath up: --ifrt-proxy {args.ifrt_proxy} is not a loopback address and the IFRT proxy "
                  f"has no authentication: anyone who reaches it uses the cluster; pass "
                  f"--ifrt-proxy-insecure to serve it there anyway", file=sys.stderr)
            return 2
    stop = threading.Event()
    caught: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        caught.append(signum)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    state_path = args.state or cluster_state.default_path(cfg.cluster.state)
    # held until this process ends (however it ends): a second `zpath up` with
    # this state file, even one started while this one is still starting, stops here
    lock = cluster_state.lock(state_path)
    if lock is None:
        print(f"zpath up: another `zpath up` is running with state file {state_path}; stop it "
              "with `zpath down` or pass --state", file=sys.stderr)
        return 1
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
               policy=args.policy,
               env={"ZPATH_COMPILE_CACHE": args.compile_cache} if args.compile_cache else None)
    if args.slurm:
        from zpath.cluster.slurm import SlurmCluster, allocation  # lazy: see the top
        tasks = allocation(cfg.slurm, args.islands or 1)
        print(f"starting {len(tasks)} worker(s) as srun steps of job {cfg.slurm.job_id}, "
              f"{len({t.island for t in tasks})} island(s)...", file=sys.stderr, flush=True)
        cluster = SlurmCluster(cfg.slurm, tasks=tasks, devices_per_task=args.devices_per_host or 0,
                               python=args.remote_python, bind_host=args.bind_host,
                               controller_port=args.controller_port, coordinator_port=args.coordinator_port,
                               log_dir=args.log_dir, start_timeout=args.start_timeout, config=cfg.cluster,
                               **dcn)
    elif args.hostfile:
        from zpath.cluster.ssh import SSHCluster, read_hostfile   # lazy: see the top
        hosts = read_hostfile(args.hostfile)
        print(f"starting {len(hosts)} host(s) over ssh...", file=sys.stderr, flush=True)
        cluster = SSHCluster(hosts, bind_host=args.bind_host, controller_port=args.controller_port,
                             coordinator_port=args.coordinator_port,
                             remote_python=args.remote_python or "python3",
                             ssh_options=shlex.split(args.ssh_options or cfg.cluster.ssh_options),
                             connect_timeout=args.connect_timeout, log_dir=args.log_dir,
                             start_timeout=args.start_timeout, config=cfg.cluster, **dcn)
    else:
        from zpath.cluster.launcher import LocalCluster           # lazy: see the top
        args.islands = args.islands or DEFAULT_SHAPE["islands"]
        args.devices_per_host = args.devices_per_host or DEFAULT_SHAPE["devices_per_host"]
        print(f"starting {args.islands} island(s) x {args.hosts_per_island} host(s) x "
              f"{args.devices_per_host} device(s)...", file=sys.stderr, flush=True)
        cluster = LocalCluster(args.islands, args.hosts_per_island, args.devices_per_host,
                               log_dir=args.log_dir, bind_host=args.bind_host or "127.0.0.1",
                               start_timeout=args.start_timeout, controller_port=args.controller_port,
                               config=cfg.cluster, **dcn)
    # Ctrl-C: 130, as a shell reports it; SIGTERM (e.g. from `zpath down`): a clean stop
    interrupted = lambda: 130 if signal.SIGINT in caught else 0  # noqa: E731
    if stop.is_set():                 # interrupted while it started
        cluster.stop()
        print("zpath cluster stopped", file=sys.stderr, flush=True)
        return interrupted()
    try:
        if args.ifrt_proxy:
            served = start_proxy(cluster, args.ifrt_proxy, timeout=args.start_timeout,
                                 insecure=args.ifrt_proxy_insecure)
            print(f"IFRT proxy: JAX_PLATFORMS=proxy JAX_BACKEND_TARGET=grpc://{served} "
                  "(README: Unmodified JAX)", flush=True)
        cluster_state.write_state(state_path, cluster_state.cluster_state(cluster))
        print(f"zpath cluster up: {cluster.address}", flush=True)
        print(f"  key file: {cluster.key_file}", flush=True)
        print(f"  logs:     {cluster.dir}", flush=True)
        print(f"  state:    {state_path}  (`zpath down --state {state_path}` stops it)", flush=True)
        print(f"connect with: ZPATH_KEY_FILE={cluster.key_file} and "
              f"zp.connect({cluster.address!r})  (Ctrl-C stops the cluster)", flush=True)
        # A worker that exits is a lost host: the controller fails what needed
        # it and serves the rest (docs/design.md: Failures), so the cluster stays up.
        # Without its controller there is no cluster: that stops it.
        reported: set[str] = set()
        while not stop.wait(0.5):
            for name, p in cluster.procs:
                if p.poll() is None or name in reported:
                    continue
                reported.add(name)
                what = cluster._describe_exit(name, p).replace("during start-up", "while running")
                if name == "controller":
                    print(f"{what}\nstopping the cluster", file=sys.stderr, flush=True)
                    return 1
                print(f"{what}\n" + ("JAX clients of the IFRT proxy lose it; " if name == "ifrt-proxy" else
                                      "its host is lost; ") + "the rest of the cluster keeps running",
                      file=sys.stderr, flush=True)
    finally:
        cluster.stop()
        cluster_state.remove_state(state_path, os.getpid())
        lock.close()
        print("zpath cluster stopped", file=sys.stderr, flush=True)
    return interrupted()


def _down(args: argparse.Namespace, cfg: Settings) -> int:
    path = args.state or cluster_state.default_path(cfg.cluster.state)
    for line in cluster_state.down(path, timeout=args.timeout, keep_logs=cfg.cluster.keep_logs):
        print(line)
    return 0


def _connect(args: argparse.Namespace, cfg: Settings, command: str, name: str) -> Any:
    """A ``Client`` of the cluster ``args.address`` names, else ZPATH_CONTROLLER,
    else the `zpath up` of the state file (with its key file); None (after saying
    why) when there is none."""
    from zpath.client.connection import Client     # lazy: see the top
    address = args.address or cfg.client.controller
    key = None
    if not address:
        # the cluster a `zpath up` on this machine runs (its state file has both),
        # else the newest this user runs here (its connection file has both)
        path = args.state or cluster_state.default_path(cfg.cluster.state)
        runtime = connfile.runtime_dir(cfg.client.runtime_dir)
        newest = None if args.state or cfg.cluster.state else connfile.find(runtime)
        if newest is not None and not os.path.exists(path):
            # the newest cluster of this user here (zp.init() in another process)
            address = newest.address
        elif not os.path.exists(path):
            print(f"zpath {command}: give the controller address, set ZPATH_CONTROLLER, or run it where "
                  f"a cluster runs (no state file {path}, no local cluster in "
                  f"{runtime})", file=sys.stderr)
            return None
    if not address:
        try:
            st = cluster_state.read_state(path)
            address = st["address"]
        except (OSError, ValueError, KeyError) as e:
            raise ZpathError(f"cannot read the state file {path}: {e}") from None
        up_pid = st.get("launcher_pid")
        if up_pid and not cluster_state.alive(up_pid, st.get("launcher_create_time")):
            raise ZpathError(f"the cluster of state file {path} is not running (its `zpath up`, "
                             f"pid {up_pid}, has exited); `zpath down` cleans up after it")
        if not (cfg.common.key or cfg.common.key_file) and st.get("key_file"):
            try:
                with open(st["key_file"]) as f:
                    key = parse_key(f.read(), f"the key in {st['key_file']}")
            except OSError as e:
                raise ZpathError(f"cannot read the key file {st['key_file']}: {e.strerror}") from None
    _check_address(address)
    return Client(address, key or connfile.client_key(address, cfg.client, cfg.common), name=name,
                  timeout=args.timeout, config=cfg.client)


def _status(args: argparse.Namespace, cfg: Settings) -> int:
    from zpath.net import messages as m           # lazy: see the top
    c = _connect(args, cfg, "status", "status")
    if c is None:
        return 2
    address = c.address
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


def _trace(args: argparse.Namespace, cfg: Settings) -> int:
    from zpath.client.trace import TRANSFERS_OUT_TID, record_cluster  # lazy: see the top
    c = _connect(args, cfg, "trace", "trace")
    if c is None:
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        print(f"tracing {c.address} for {args.seconds:g} s (Ctrl-C ends it sooner)...", file=sys.stderr,
              flush=True)
        doc = record_cluster(c, args.seconds, args.output, stop)
    finally:
        c.close()
    n = sum(1 for e in doc["traceEvents"] if e.get("cat") == "computation")
    t = sum(1 for e in doc["traceEvents"] if e.get("cat") == "transfer" and e["ph"] == "X"
            and e["tid"] == TRANSFERS_OUT_TID)
    print(f"wrote {args.output}: {n} computation slices, {t} transfers "
          "(open it in https://ui.perfetto.dev)")
    return 0


def _check_address(address: str) -> None:
    if not re.match(r"^(tcp|ipc)://\S+$", address):
        raise ZpathError(f"{address!r} is not a controller address: expected tcp://HOST:PORT")


def _friendly(command: str, fn: Any, *args: Any) -> int:
    """Run a subcommand; an expected failure (a zpath error, a bad address or
    file, a port in use) is one line on stderr and exit code 1, not a traceback."""
    try:
        return fn(*args)
    except KeyboardInterrupt:
        return 130
    except (ZpathError, OSError, ValueError, zmq.ZMQError) as e:
        logging.getLogger("zpath").debug("failed", exc_info=True)
        what = str(e) if isinstance(e, ZpathError) else \
            f"{type(e).__name__}: {e} (ZPATH_LOG_LEVEL=DEBUG shows where)"
        print(f"zpath {command}: {what}", file=sys.stderr)
        return 1


def version_line() -> str:
    """What ``zpath --version`` prints: zpath's version and those of what it runs
    on (read from the installed packages' metadata, without importing JAX)."""
    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    parts = ", ".join(f"{name} {installed(name)}" for name in ("jax", "jaxlib", "pyzmq"))
    return f"zpath {__version__} ({parts}, Python {sys.version.split()[0]})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # the controller's and the worker's own main(), imported only to run it: the
    # worker's imports JAX, which no other subcommand needs (nor the controller)
    if argv and argv[0] == "controller":
        from zpath.controller.server import main as controller_main
        return _friendly("controller", controller_main, argv[1:])
    if argv and argv[0] == "worker" and "--simulate" in argv[1:]:
        # simulated hosts (no JAX) for scale work
        from zpath.worker.simulate import main as simulate_main
        return _friendly("worker", simulate_main, argv[1:])
    if argv and argv[0] == "worker":
        from zpath.worker.server import main as worker_main
        return _friendly("worker", worker_main, argv[1:])
    try:
        cfg = Settings.from_env()
    except ZpathError as e:
        print(f"zpath: {e}", file=sys.stderr)
        return 2
    shape = DEFAULT_SHAPE
    p = argparse.ArgumentParser(prog="zpath", description="zpath: a single-controller runtime for JAX")
    p.add_argument("--version", action="version", version=version_line())
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run a cluster (local, over ssh with --hostfile, or in a Slurm "
                        "allocation with --slurm) in the foreground")
    up.add_argument("--islands", type=_positive_int, default=None,
                    help=f"islands (default {shape['islands']}; with --slurm 1: the allocation's tasks "
                         "split into this many equal runs in node order)")
    up.add_argument("--hosts-per-island", type=_positive_int, default=shape["hosts_per_island"])
    up.add_argument("--devices-per-host", type=_positive_int, default=None,
                    help=f"emulated CPU devices per host (default {shape['devices_per_host']}; with "
                         "--slurm: per task, default none set: the nodes' own devices)")
    up.add_argument("--slurm", action="store_true",
                    help="inside a Slurm allocation (salloc, sbatch): one worker per task, each an srun "
                         "step; the controller here (see README: Slurm)")
    up.add_argument("--hostfile", help="start one worker per line over ssh (see README: SSH clusters); "
                    "--islands/--hosts-per-island/--devices-per-host are then ignored")
    up.add_argument("--bind-host", help="address the controller (and local workers) listen on "
                    "(default 127.0.0.1; with --hostfile this machine's address on the route to the first host)")
    up.add_argument("--controller-port", type=_port, default=0, help="controller port (default: a free one)")
    up.add_argument("--coordinator-port", type=_port, default=0,
                    help="with --hostfile/--slurm: base port of multi-host islands' jax.distributed "
                         "coordinators "
                         "(island i uses base+i; default: free/random)")
    up.add_argument("--remote-python", default=None,
                    help="with --hostfile: python on the hosts, unless a line has python= (default "
                         "python3); with --slurm: python on the nodes (default: this one)")
    up.add_argument("--ssh-options", help="with --hostfile: extra ssh arguments, e.g. \"-i KEY\" "
                    "(default $ZPATH_SSH_OPTIONS)")
    up.add_argument("--connect-timeout", type=_positive_int, default=10, help="ssh ConnectTimeout (s)")
    up.add_argument("--start-timeout", type=_positive, default=cfg.cluster.start_timeout_s,
                    help="seconds for every worker to register (default $ZPATH_START_TIMEOUT or 120)")
    up.add_argument("--state", help="state file for `zpath down` (default $ZPATH_STATE or ~/.zpath/cluster.json)")
    up.add_argument("--log-dir", help="where process logs and the key file go (default: a temp dir)")
    up.add_argument("--dcn-latency-ms", type=_non_negative, default=0.0,
                    help="emulated one-way latency of traffic between islands (ms)")
    up.add_argument("--dcn-gbps", type=_non_negative, default=0.0,
                    help="emulated bandwidth cap of each host's link between islands (Gbit/s; 0: none)")
    up.add_argument("--dcn-encrypt", action="store_true",
                    help="encrypt traffic between islands with CURVE")
    up.add_argument("--compile-cache", metavar="DIR",
                    help="the workers' JAX compilation cache: a directory (on each host), or off "
                         "(default $ZPATH_COMPILE_CACHE or ~/.zpath/jax-cache)")
    up.add_argument("--ifrt-proxy", metavar="[HOST:]PORT", default=None,
                    help="also serve the IFRT proxy protocol there, for unmodified JAX clients "
                         "(JAX_PLATFORMS=proxy; needs the 'proxy' extra); loopback only unless "
                         "--ifrt-proxy-insecure")
    up.add_argument("--ifrt-proxy-insecure", action="store_true",
                    help="let --ifrt-proxy serve a non-loopback HOST: its gRPC service has no "
                         "authentication, so anyone who reaches it uses the cluster")
    up.add_argument("--policy", choices=POLICIES, default=None,
                    help="multi-tenant scheduling policy: proportional share by client weight "
                         "(default; $ZPATH_SCHEDULER_POLICY) or fifo")
    up.set_defaults(fn=_up)
    dn = sub.add_parser("down", help="stop the cluster a `zpath up` started")
    dn.add_argument("--state", help="its state file (default $ZPATH_STATE or ~/.zpath/cluster.json)")
    dn.add_argument("--timeout", type=_positive, default=30.0, help="seconds to wait for zpath up to stop")
    dn.set_defaults(fn=_down)
    st = sub.add_parser("status", help="show a running cluster")
    st.add_argument("address", nargs="?", help="controller address (default $ZPATH_CONTROLLER, else the "
                    "cluster of the state file, with its key file)")
    st.add_argument("--state", help="with no address: the state file of `zpath up` "
                    "(default $ZPATH_STATE or ~/.zpath/cluster.json)")
    st.add_argument("--timeout", type=_positive, default=10.0)
    st.set_defaults(fn=_status)
    tr = sub.add_parser("trace", help="record what a running cluster does for a while, as Chrome Trace "
                        "Event JSON (Perfetto)")
    tr.add_argument("address", nargs="?", help="controller address (default as for zpath status)")
    tr.add_argument("--seconds", type=_positive, default=10.0, help="how long to record (default 10)")
    tr.add_argument("-o", "--output", default="trace.json", help="the file to write (default trace.json)")
    tr.add_argument("--state", help="with no address: the state file of `zpath up`")
    tr.add_argument("--timeout", type=_positive, default=10.0)
    tr.set_defaults(fn=_trace)
    sub.add_parser("controller", help="run a controller (see zpath controller --help)", add_help=False)
    sub.add_parser("worker", help="run a worker (see zpath worker --help)", add_help=False)
    args, extra = p.parse_known_args(argv)
    if extra:            # the subcommand's usage, not the top level's
        {"up": up, "down": dn, "status": st, "trace": tr}[args.command].error(
            f"unrecognized arguments: {' '.join(extra)}")
    return _friendly(args.command, args.fn, args, cfg)


if __name__ == "__main__":
    sys.exit(main())
