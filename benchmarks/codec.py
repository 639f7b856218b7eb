"""CPU cost of one message through the envelope (zpath/net/codec.py) and the
socket helpers (zpath/net/transport.py), per message type.

Messages (shaped like the ones an op-by-op call sends):

* ``Execute``  -- controller -> worker: 2 inputs of 1 shard each (one local
  shard, one made of a piece from another host), 1 output, 2-device mesh;
* ``ExecDone`` -- worker -> controller, no error;
* ``Call``     -- client -> controller: 1 input (put), 1 output;
* ``Ping`` / ``Pong`` -- the heartbeat and its answer from a worker.

Measured per message, each as the median over ``--repeats`` batches of
``--batch`` messages (microseconds per message):

* ``encode``  -- ``codec.encode`` (msgpack + HMAC signature);
* ``decode``  -- ``codec.decode`` (signature check + msgpack + field checks);
* ``send``    -- ``Endpoint.send`` from a DEALER (or a ROUTER with ``to=``) over
  inproc: encode + ``send_multipart``;
* ``recv``    -- ``Endpoint.recv`` on the other side: ``recv_multipart`` +
  decode (the messages are already queued, so no waiting is timed).

The zpath it measures is whatever ``import zpath`` finds, so the same script can
time another checkout: ``PYTHONPATH=/tmp/codec-before python benchmarks/codec.py``
(run it from outside /work/main or with ``--compare``). ``--compare A B ...``
runs this script once per tree per round with ``PYTHONPATH`` (and the working
directory) set to each tree in turn, alternating which goes first, and prints
the median over rounds of each tree's medians and the ratios to the first tree
(it checks that each run imported zpath from its tree)::

    git worktree add --detach /tmp/codec-before <older commit>
    .venv/bin/python benchmarks/codec.py --compare /tmp/codec-before /work/main --rounds 7

Measured on the 2-CPU development machine (shared, so alternated; median of 7
rounds), commit a5173e3 -> the codec/transport fast paths, us per message:

    message    encode         decode         send (DEALER/ROUTER)  recv
    Execute    18.8 ->  4.7   23.0 ->  7.9   23.5 ->  5.6          28.0 -> 10.6
    ExecDone    3.8 ->  1.6    5.6 ->  2.4    7.0 ->  2.3          11.7 ->  5.7
    Call        9.2 ->  2.8   12.4 ->  4.6   12.6 ->  3.6          18.7 ->  8.0
    Ping        3.2 ->  1.5    4.8 ->  2.2    7.4 ->  2.3           9.6 ->  4.7
    Pong        4.1 ->  1.6    5.7 ->  2.5    7.3 ->  2.3          11.6 ->  5.8

A script that prints figures, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

KEY = bytes(range(32))
METRICS = ("encode", "decode", "send", "recv")


def messages() -> dict[str, Any]:
    from zpath.net import messages as m

    av = m.Aval([8, 4], "float32")
    execute = m.Execute(
        exec_id=123456, seq=9876, program="ab" * 32, name="jit__lambda_", mesh_shape=[2],
        axis_names=["i"], devices=[0, 1], jax_ids=[0, 1],
        inputs=[m.ExecInput(1 << 32 | 17, av, ["i", None],
                            [m.ShardInput(0, [[0, 4], [0, 4]], [])]),
                m.ExecInput(1 << 32 | 18, av, [None, None],
                            [m.ShardInput(1, [[0, 8], [0, 4]],
                                          [m.PieceSource(77, 3, [[0, 8], [0, 4]], [[0, 8], [0, 4]])])])],
        outputs=[m.ExecOutput(1 << 32 | 19, av, ["i", None])])
    call = m.Call(
        call_id=4242, program="cd" * 32, mesh_shape=[2], axis_names=["i"], devices=[0, 1],
        inputs=[m.CallInput(1 << 32 | 17, av, ["i", None], True)],
        outputs=[m.CallOutput(1 << 32 | 19, av, ["i", None])])
    return {
        "Execute": execute,
        "ExecDone": m.ExecDone(123456, None, 1718000000.125, 1718000000.25),
        "Call": call,
        "Ping": m.Ping(31),
        "Pong": m.Pong(31, 12, 4096, [2048, 2048]),
    }


def _batches(fn: Callable[[int], None], batch: int, repeats: int) -> float:
    """Median over ``repeats`` batches of the microseconds per item of ``fn(batch)``."""
    fn(min(batch, 200))                       # warm up
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(batch)
        per.append((time.perf_counter() - t0) / batch * 1e6)
    return statistics.median(per)


def measure(batch: int, repeats: int) -> dict[str, dict[str, float]]:
    import zmq

    from zpath.net import codec, transport

    out: dict[str, dict[str, float]] = {}
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, b"worker-0")
    router.bind("inproc://codec-bench")
    dealer.connect("inproc://codec-bench")
    a = transport.Endpoint(KEY, "worker:bench")
    b = transport.Endpoint(KEY, "controller")
    try:
        # handshake so the ROUTER knows the DEALER's identity
        a.send(dealer, messages()["Ping"])
        ident, _, _, _ = b.recv(router, router=True)
        for name, msg in messages().items():
            frames = codec.encode(KEY, msg, msg_id=1, sender="worker:bench", parent=7)
            got = codec.decode(KEY, frames)[1]
            assert got == msg, (got, msg)

            def enc(n: int, msg: Any = msg) -> None:
                encode = codec.encode
                for i in range(n):
                    encode(KEY, msg, msg_id=i + 1, sender="worker:bench", parent=7)

            def dec(n: int, frames: Any = frames) -> None:
                decode = codec.decode
                for _ in range(n):
                    decode(KEY, frames)

            # controller-bound messages go DEALER -> ROUTER, the others ROUTER -> DEALER
            upstream = name in ("ExecDone", "Call", "Pong")
            src, dst, to = (dealer, router, None) if upstream else (router, dealer, ident)
            sender, receiver = (a, b) if upstream else (b, a)
            pending = [0]

            def send(n: int, msg: Any = msg) -> None:
                for _ in range(n):
                    sender.send(src, msg, to=to)
                pending[0] += n

            def recv(n: int) -> None:
                for _ in range(n):
                    receiver.recv(dst, router=upstream)
                pending[0] -= n

            r: dict[str, float] = {"encode": _batches(enc, batch, repeats),
                                   "decode": _batches(dec, batch, repeats)}
            # interleave: send a batch, receive it, so queues stay short
            sends, recvs = [], []
            send(200)
            recv(200)
            for _ in range(repeats):
                t0 = time.perf_counter()
                send(batch)
                t1 = time.perf_counter()
                recv(batch)
                t2 = time.perf_counter()
                sends.append((t1 - t0) / batch * 1e6)
                recvs.append((t2 - t1) / batch * 1e6)
            assert pending[0] == 0
            r["send"] = statistics.median(sends)
            r["recv"] = statistics.median(recvs)
            r["body_bytes"] = len(frames[2])
            out[name] = r
    finally:
        router.close()
        dealer.close()
        ctx.term()
    return out


def _table(rows: dict[str, dict[str, float]]) -> str:
    head = f"{'message':<10} {'body B':>7} " + " ".join(f"{k + ' us':>10}" for k in METRICS)
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        lines.append(f"{name:<10} {int(r['body_bytes']):>7} " + " ".join(f"{r[k]:>10.2f}" for k in METRICS))
    return "\n".join(lines)


def compare(trees: list[str], rounds: int, batch: int, repeats: int) -> None:
    """Alternate runs of this script in each tree; print medians over rounds."""
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
    me = os.path.abspath(__file__)
    for rnd in range(rounds):
        order = trees if rnd % 2 == 0 else list(reversed(trees))
        for tree in order:
            env = dict(os.environ, PYTHONPATH=tree)
            res = subprocess.run([sys.executable, me, "--json", "-", "--batch", str(batch),
                                  "--repeats", str(repeats)], cwd=tree, env=env, check=True,
                                 capture_output=True, text=True)
            data = json.loads(res.stdout)
            if os.path.realpath(os.path.dirname(os.path.dirname(os.path.dirname(data["codec"])))) \
                    != os.path.realpath(tree):
                raise SystemExit(f"{tree}: imported {data['codec']} instead")
            runs[tree].append(data["results"])
            print(f"round {rnd + 1}/{rounds} {tree}: "
                  + " ".join(f"{n}:{r['encode']:.1f}/{r['decode']:.1f}/{r['send']:.1f}/{r['recv']:.1f}"
                             for n, r in data["results"].items()), flush=True)
    med = {t: {n: {k: statistics.median(run[n][k] for run in runs[t])
                   for k in (*METRICS, "body_bytes")} for n in runs[t][0]} for t in trees}
    print(f"\nmedian over {rounds} rounds of per-run medians (us per message; "
          f"{repeats} batches of {batch}):")
    for t in trees:
        print(f"\n{t}")
        print(_table(med[t]))
    base = trees[0]
    for t in trees[1:]:
        print(f"\nratio {t} / {base} (below 1: cheaper)")
        head = f"{'message':<10} " + " ".join(f"{k:>10}" for k in METRICS)
        print(head)
        print("-" * len(head))
        for n in med[base]:
            print(f"{n:<10} " + " ".join(f"{med[t][n][k] / med[base][n][k]:>10.2f}" for k in METRICS))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=2000, help="messages per timed batch (default 2000)")
    p.add_argument("--repeats", type=int, default=15, help="timed batches per figure (default 15)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON here ('-': stdout only)")
    p.add_argument("--compare", nargs="+", metavar="TREE",
                   help="time these checkouts alternately (PYTHONPATH=TREE) and compare to the first")
    p.add_argument("--rounds", type=int, default=5, help="with --compare: runs per tree (default 5)")
    args = p.parse_args(argv)
    if args.compare:
        compare([os.path.abspath(t) for t in args.compare], args.rounds, args.batch, args.repeats)
        return 0
    from zpath.net import codec

    results = measure(args.batch, args.repeats)
    if args.json == "-":
        json.dump({"codec": codec.__file__, "results": results}, sys.stdout)
        return 0
    print(f"zpath from {os.path.dirname(os.path.dirname(os.path.dirname(codec.__file__)))}; "
          f"median of {args.repeats} batches of {args.batch} (us per message)")
    print(_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"codec": codec.__file__, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
