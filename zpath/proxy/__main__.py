"""``python -m zpath.proxy``: serve the IFRT proxy protocol for a running
cluster (``zpath up --ifrt-proxy HOST:PORT`` starts it). The cluster key comes
as for any client (ZPATH_KEY / ZPATH_KEY_FILE)."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from zpath import logs
from zpath.client.connection import Client
from zpath.config import ClientConfig, CommonConfig
from zpath.keys import key_from_config
from zpath.process import die_with_parent
from zpath.proxy.schema import SchemaError
from zpath.proxy.server import ProxyServer, cluster_platform


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zpath.proxy", description=__doc__)
    ap.add_argument("--listen", required=True, help="HOST:PORT to serve on (port 0: a free one)")
    ap.add_argument("--controller", required=True, help="the cluster's address, tcp://HOST:PORT")
    ap.add_argument("--platform", default=None,
                    help="the platform JAX clients lower programs for (default: what the cluster's "
                         "workers registered, e.g. cpu or cuda)")
    ap.add_argument("--insecure", action="store_true",
                    help="serve on a non-loopback address: anyone who reaches it uses the cluster")
    ap.add_argument("--address-file", help="write HOST:PORT served here once listening")
    args = ap.parse_args(argv)
    common = CommonConfig.from_env()
    logs.setup("ifrt-proxy", common.log_level)
    die_with_parent()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        client = Client(args.controller, key_from_config(common), name="ifrt-proxy", config=ClientConfig.from_env(),
                        shared=True)      # (its sessions are JAX processes: never the alone window)
        platform = args.platform or cluster_platform(client)
        server = ProxyServer(client, args.listen, platform=platform, insecure=args.insecure).start()
    except (SchemaError, OSError) as e:
        print(f"zpath IFRT proxy: {e}", file=sys.stderr)
        return 1
    if args.address_file:
        tmp = args.address_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(server.address)
        os.replace(tmp, args.address_file)
    print(f"IFRT proxy serving at grpc://{server.address}", flush=True)
    stop.wait()
    server.stop()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
