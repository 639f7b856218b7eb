"""Start-up and compile time: how long ``zp.init()`` takes, and the first and
second run of a small training loop with the workers' persistent compilation
cache cold (an empty directory), warm (the directory the first run filled) and
off, each run a fresh process with a fresh cluster, as a user runs a script twice.

    .venv/bin/python benchmarks/startup.py [--repeats 3] [--steps 20] [--json] [--baseline DIR]

Each run prints (seconds): ``init`` (zp.init(), from the call to a connected
client: controller and worker start, JAX import and device start in the
workers, registration, the client's welcome), its phases measured by the
launcher (``controller``: until the controller listens; ``workers``: from
then until every worker has registered, the workers having started beside the
controller; ``client``: the connection), ``first`` (the first
training step: the client traces and exports the step, the workers compile it,
it runs; until its loss is fetched), ``step`` (median of the next steps, for
scale), ``import`` (of numpy, JAX and zpath in the script) and ``process``
(the whole run, interpreter start to exit). Runs alternate cold, warm, off
over ``--repeats`` rounds; the figures are medians per kind."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np, jax, jax.numpy as jnp
import zpath as zp
from zpath.cluster import launcher

marks = {}
L = launcher.ClusterLauncher
# the controller listens once this returns (_start_controller before the launcher
# started workers beside the controller)
listen = "_await_controller" if hasattr(L, "_await_controller") else "_start_controller"

def marked(fn, key):
    def wrapper(self, *a):
        r = fn(self, *a); marks[key] = time.perf_counter(); return r
    return wrapper

setattr(L, listen, marked(getattr(L, listen), "listening"))
L._wait_registered = marked(L._wait_registered, "registered")
t_imp = time.perf_counter()
t = time.perf_counter()
cluster = zp.init()
end = time.perf_counter()
init = end - t
phases = {"controller": marks["listening"] - t, "workers": marks["registered"] - marks["listening"],
          "client": end - marks["registered"]}
steps = int(sys.argv[1])
devs = zp.make_virtual_device_set().add_slice(devices=2).devices
mesh = zp.Mesh(np.array(devs), ("data",))

def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)

def train_step(params, x, y):
    loss, g = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.tree_util.tree_map(lambda p, d: p - 0.05 * d, params, g), loss

step = zp.jit(train_step, mesh=mesh, in_specs=(zp.P(), zp.P("data"), zp.P("data")),
              out_specs=zp.P())
rng = np.random.default_rng(0)
params = {"w1": rng.normal(size=(32, 64)).astype(np.float32) * 0.1, "b1": np.zeros(64, np.float32),
          "w2": rng.normal(size=(64, 1)).astype(np.float32) * 0.1, "b2": np.zeros(1, np.float32)}
x = rng.normal(size=(256, 32)).astype(np.float32)
y = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)
t = time.perf_counter()
params, loss = step(params, x, y)
float(np.asarray(loss))
first = time.perf_counter() - t
times = []
for _ in range(steps):
    t = time.perf_counter()
    params, loss = step(params, x, y)
    float(np.asarray(loss))
    times.append(time.perf_counter() - t)
zp.shutdown()
print(json.dumps({"import": t_imp - t0, "init": init, **phases, "first": first,
                  "step": sorted(times)[len(times) // 2], "loss": float(np.asarray(loss))}))
"""


def run(kind: str, cache: str, steps: int, baseline: str = "") -> dict:
    env = dict(os.environ, ZPATH_COMPILE_CACHE=cache if kind in ("cold", "warm") else "off")
    if kind == "base":
        env["PYTHONPATH"] = baseline
    for name in ("ZPATH_CONTROLLER", "JAX_COMPILATION_CACHE_DIR"):
        env.pop(name, None)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD, str(steps)], capture_output=True, text=True,
                       timeout=600, env=env)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"{kind} run failed:\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["process"] = wall
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--baseline", default="", metavar="CHECKOUT",
                    help="also run each round with another zpath checkout first on PYTHONPATH "
                         "(e.g. an older commit's worktree): its figures as 'base'")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {"cold": [], "warm": [], "off": []}
    if args.baseline:
        results["base"] = []
    with tempfile.TemporaryDirectory(prefix="zpath-startup-") as root:
        for r in range(args.repeats):
            cache = os.path.join(root, f"cache-{r}")
            for kind in results:
                results[kind].append(run(kind, cache, args.steps, args.baseline))
                print(f"round {r} {kind}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[kind][-1].items()
                                                         if k != "loss"), file=sys.stderr, flush=True)
    keys = ["import", "init", "controller", "workers", "client", "first", "step", "process"]
    table = {kind: {k: statistics.median(r[k] for r in rs) for k in keys} for kind, rs in results.items()}
    if args.json:
        print(json.dumps(table, indent=1))
        return
    print(f"medians of {args.repeats} runs each, seconds (cold: empty compilation cache; warm: the cache "
          "the cold run filled; off: no cache" + (f"; base: {args.baseline}" if args.baseline else "") + ")")
    print(f"{'':6}" + "".join(f"{k:>11}" for k in keys))
    for kind, row in table.items():
        print(f"{kind:6}" + "".join(f"{row[k]:11.3f}" for k in keys))
    losses = {kind: [r["loss"] for r in rs] for kind, rs in results.items()}
    print(f"final losses equal in every run: {len({v for vs in losses.values() for v in vs}) == 1}")


if __name__ == "__main__":
    main()
