"""Train the transformer language model pipelined across hosts of a local zpath
cluster that this script starts (what ``make run`` runs): stage k of the model
lives on host k, every training step is one ``@zp.program`` of GPipe microbatches,
and the loss of each step is shown as it arrives.

    python examples/transformer/train.py [--stages 2] [--steps 300] [--microbatches 4]

The text is generated (a random Markov chain over 64 tokens), so nothing is
downloaded; the lowest loss any model can reach on it is printed at the start."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zpath as zp  # noqa: E402
from transformer import layouts as L  # noqa: E402  (examples/ is not a package)
from transformer import model as M  # noqa: E402


class Progress:
    """A one-line progress bar with the latest loss (a line every ``every``
    steps where the output is not a terminal)."""

    def __init__(self, total: int, tokens_per_step: int, every: int = 25) -> None:
        self.total, self.tokens, self.every = total, tokens_per_step, every
        self.tty = sys.stdout.isatty()
        self.t0 = time.perf_counter()

    def __call__(self, step: int, loss: float) -> None:
        done = step + 1
        rate = done * self.tokens / (time.perf_counter() - self.t0)
        width = 30
        bar = "#" * (width * done // self.total) + "." * (width - width * done // self.total)
        line = f"step {done:>4}/{self.total} [{bar}] loss {loss:.4f}  {rate:,.0f} tokens/s"
        if self.tty:
            print("\r" + line, end="\n" if done == self.total or done % self.every == 0 else "", flush=True)
        elif done == 1 or done == self.total or done % self.every == 0:
            print(line, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=2, help="pipeline stages, one host each (default 2)")
    p.add_argument("--devices-per-host", type=int, default=1, help="devices of each stage (default 1)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    args = p.parse_args()
    cfg = M.Config()
    data = M.batches(cfg, args.steps)
    params = M.init_params(cfg)
    n_params = sum(np.size(x) for x in jax.tree.leaves(params))
    print(f"a decoder-only transformer: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, "
          f"{n_params:,} parameters; batches of {cfg.batch} x {cfg.seq} tokens")
    print(f"the lowest loss any model can reach on this text: {M.entropy_rate(cfg):.4f} "
          f"(a uniform guess: {np.log(cfg.vocab):.4f})")
    t0 = time.perf_counter()
    zp.init(islands=1, hosts_per_island=args.stages, devices_per_host=args.devices_per_host)
    try:
        vds = zp.make_virtual_device_set()
        hosts = [vds.add_slice(devices=args.devices_per_host, host=h).devices for h in range(args.stages)]
        print(f"a local cluster of {args.stages} hosts started in {time.perf_counter() - t0:.1f} s")
        pipe = L.Pipeline(cfg, hosts, microbatches=args.microbatches)
        per = cfg.layers // args.stages
        for k, devs in enumerate(hosts):
            extra = " + embeddings" if k == 0 else " + final norm and unembedding" if k == args.stages - 1 else ""
            print(f"  stage {k} on host {devs[0].host} (devices {[d.id for d in devs]}): "
                  f"layers {k * per}-{(k + 1) * per - 1}{extra}")
        print(f"training: {args.microbatches} microbatches a step, one program a step "
              f"(the first steps trace and compile)")
        t0 = time.perf_counter()
        losses = pipe.train(data, on_loss=Progress(args.steps, cfg.tokens_per_step))
        took = time.perf_counter() - t0
        print(f"trained {args.steps} steps in {took:.1f} s: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    finally:
        zp.shutdown()


if __name__ == "__main__":
    main()
