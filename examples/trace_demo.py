"""Record a timeline of a small program and draw it.

    python examples/trace_demo.py [trace.json] [--png trace.png]

Starts a local cluster of two islands (two hosts each, one device per host), runs a
traced program whose first half runs on island 0 and second half on island 1 (so its
values cross the DCN, and within an island the ICI), inside ``zp.trace``, and writes
the Chrome Trace Event JSON (open it in https://ui.perfetto.dev). With ``--png`` it
also draws the same events with matplotlib (benchmarks/plots.py, the bench extra).
"""
import argparse
import os
import sys

import jax
import numpy as np

import zpath as zp

ap = argparse.ArgumentParser()
ap.add_argument("output", nargs="?", default="trace.json")
ap.add_argument("--png", help="also draw the trace here (matplotlib)")
args = ap.parse_args()

zp.init(islands=2, hosts_per_island=2, devices_per_host=1)
vds = zp.make_virtual_device_set()
first = vds.add_slice(devices=2, island=0).devices
second = vds.add_slice(devices=2, island=1).devices


def layer(v):
    return jax.numpy.tanh(v @ v.T) @ v


def allreduce(v):
    return jax.lax.psum(v, "i")


f = zp.pmap(layer, devices=first)
g = zp.pmap(allreduce, devices=second, axis_name="i")
h = zp.pmap(layer, devices=second)


@zp.program
def step(x):
    return h(g(f(x)))


x = np.random.default_rng(0).standard_normal((2, 256, 256)).astype(np.float32)
step(x).result(timeout=120)             # compiled and warm, outside the trace
with zp.trace(args.output):
    outs = [step(x) for _ in range(3)]
    for o in outs:
        o.result(timeout=120)
zp.shutdown()
print(f"wrote {args.output} (open it in https://ui.perfetto.dev)")
if args.png:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    import json

    import plots
    with open(args.output) as fh:
        plots.trace(args.png, json.load(fh), title="zp.trace of 3 runs of a program over 2 islands")
    print(f"wrote {args.png}")
