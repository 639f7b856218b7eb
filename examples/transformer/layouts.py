"""The model of ``model.py`` trained on a zpath cluster in three layouts.

* ``Spmd``       -- one ``zp.jit`` per step over a data x model mesh (Megatron-style
                    shardings: attention heads and the MLP's hidden units split over
                    ``model``, the batch over ``data``). With a model axis of 1 it is
                    plain data parallelism on one island.
* ``Pipeline``   -- S stages, stage k on its own host with its parameters and
                    optimizer state living there; GPipe: every step's batch is cut
                    into microbatches, all forwards, then all backwards, then each
                    stage updates itself; one ``@zp.program`` per training step. A
                    stage keeps its forward's residuals (what ``jax.vjp`` saves) for
                    its backward, so nothing is computed twice.
* ``TwoIslands`` -- data parallel over two islands: each computes the gradient of
                    half the batch; the gradients cross the DCN channel packed into
                    a few flat buckets (not one transfer per leaf) and each island
                    applies the same update to its copy; one program per step.

Every layout has ``step(seqs) -> loss future`` (the step's mean loss over the whole
batch) and ``train(data) -> list of losses``; parameters stay on the workers between
steps (futures chain one step to the next)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import zpath as zp

from . import model as M


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _scalar(loss: Any, timeout: float | None) -> float:
    return float(np.asarray(loss.result(timeout=timeout)).ravel()[0])


class Layout:
    """What the layouts share: chaining steps, and fetching their losses."""

    name = "layout"

    def step(self, seqs: np.ndarray) -> Any:
        """Submit one training step; the future of its loss (a scalar, or one
        copy of it per device)."""
        raise NotImplementedError

    def train(self, data: Sequence[np.ndarray], on_loss: Callable[[int, float], None] | None = None,
              timeout: float | None = None) -> list[float]:
        """Train on every batch of ``data``; the per-step losses (``on_loss(step,
        loss)`` is called as each arrives). Step i + 1 is submitted before the
        loss of step i is fetched, so the cluster never waits for this process.
        ``timeout``: seconds to wait for each loss (default: the client's
        fetch timeout)."""
        futures: list[Any] = []
        losses: list[float] = []
        for seqs in data:
            futures.append(self.step(seqs))
            if len(futures) >= 2:
                losses.append(_scalar(futures[-2], timeout))
                if on_loss:
                    on_loss(len(losses) - 1, losses[-1])
        losses.append(_scalar(futures[-1], timeout))
        if on_loss:
            on_loss(len(losses) - 1, losses[-1])
        return losses


# --- SPMD ---------------------------------------------------------------------------------

def megatron_specs(params: M.Params) -> M.Params:
    """Megatron-style shardings over a ("data", "model") mesh: q, k, v and the
    first MLP matrix split by columns (heads, hidden units), the attention output
    and second MLP matrix by rows, the unembedding by vocabulary; the rest
    replicated."""
    def layer(p: M.Params) -> M.Params:
        col, row = P(None, "model"), P("model", None)
        return {"ln1": {"scale": P(), "bias": P()}, "ln2": {"scale": P(), "bias": P()},
                "wq": col, "wk": col, "wv": col, "wo": row,
                "w1": col, "b1": P("model"), "w2": row, "b2": P()}
    return {"embed": P(), "pos": P(), "layers": [layer(p) for p in params["layers"]],
            "ln_f": {"scale": P(), "bias": P()}, "unembed": P(None, "model")}


class Spmd(Layout):
    def __init__(self, cfg: M.Config, devices: Sequence[Any], mesh_shape: tuple[int, int] = (2, 2),
                 seed: int = 0) -> None:
        self.name = f"spmd_{mesh_shape[0]}x{mesh_shape[1]}"
        mesh = zp.Mesh(np.array(list(devices), dtype=object).reshape(mesh_shape), ("data", "model"))
        opt = M.optimizer(cfg)
        params = M.init_params(cfg, seed)
        opt_leaves, opt_tree = M.flat_state(opt, params)
        specs = megatron_specs(params)
        opt_specs = jax.tree.leaves(
            optax.tree_map_params(opt, lambda _, s: s, M.tree_like(opt_tree, opt_leaves), specs,
                                  transform_non_params=lambda _: P(), is_leaf=_is_spec),
            is_leaf=_is_spec)

        def train_step(params: M.Params, opt_leaves: list, seqs: jax.Array) -> tuple:
            loss, grads = jax.value_and_grad(lambda p: M.loss_fn(cfg, p, seqs))(params)
            params, state = M.apply_update(opt, params, M.tree_like(opt_tree, opt_leaves), grads)
            return params, jax.tree.leaves(state), loss

        self.fn = zp.jit(train_step, mesh=mesh, in_specs=(specs, opt_specs, P("data", None)),
                         out_specs=(specs, opt_specs, P()))
        self.state: tuple = (params, opt_leaves)

    def step(self, seqs: np.ndarray) -> Any:
        params, opt_leaves, loss = self.fn(*self.state, seqs)
        self.state = (params, opt_leaves)
        return loss


# --- pipeline -----------------------------------------------------------------------------

def _stacked(tree: Any, n: int) -> Any:
    """Every leaf repeated along a new leading axis of ``n`` (one copy per
    device of a ``zp.pmap``)."""
    return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))).copy(), tree)


def _zeros(shape: tuple[int, ...], dtype: Any, zero: jax.Array) -> jax.Array:
    """Zeros that are a traced value (``zero`` is a traced 0): JAX would
    compute on constant zeros at once, and save other residuals."""
    return jnp.broadcast_to(zero.astype(dtype), shape)


def _zeros_like(tree: Any, zero: jax.Array) -> Any:
    return jax.tree.map(lambda x: _zeros(x.shape, x.dtype, zero), tree)


class Pipeline(Layout):
    """GPipe over ``len(stage_devices)`` stages; stage k runs on the devices
    ``stage_devices[k]`` (one host each, the same number of devices each; a
    microbatch is split over a stage's devices, as ``zp.pmap`` maps)."""

    def __init__(self, cfg: M.Config, stage_devices: Sequence[Sequence[Any]], microbatches: int = 4,
                 seed: int = 0) -> None:
        S = self.stages = len(stage_devices)
        n = self.n = len(stage_devices[0])
        if S < 2 or any(len(d) != n for d in stage_devices):
            raise ValueError("a pipeline needs at least 2 stages, each with the same number of devices")
        if cfg.batch % (microbatches * n):
            raise ValueError(f"batch {cfg.batch} does not split into {microbatches} microbatches "
                             f"over {n} devices")
        self.name = f"pipeline_s{S}"
        self.cfg, self.M = cfg, microbatches
        opt = M.optimizer(cfg)
        stage_params = M.split_stages(M.init_params(cfg, seed), S)
        opt_states = [M.flat_state(opt, p) for p in stage_params]
        shapes = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), p) for p in stage_params]
        total = microbatches * n           # the gradient is the mean over these parts
        last = S - 1

        def apply(k: int) -> Callable[..., jax.Array]:
            if k == 0:
                return lambda p, tokens: M.stage_apply(cfg, p, tokens, first=True)
            return lambda p, x: M.stage_apply(cfg, p, x, first=False)

        def forward(k: int) -> Callable[..., tuple]:
            f = apply(k)
            if k == 0:
                def fwd0(p: M.Params, tokens: jax.Array) -> tuple:
                    y, vjp = jax.vjp(lambda q: f(q, tokens), p)
                    return y, jax.tree.leaves(vjp)
                return fwd0

            def fwd(p: M.Params, x: jax.Array) -> tuple:
                y, vjp = jax.vjp(f, p, x)
                return y, jax.tree.leaves(vjp)
            return fwd

        def backward(k: int, x_shape: tuple[int, ...]) -> Callable[..., Any]:
            """The stage's vjp rebuilt from the residuals its forward saved: the
            structure comes from tracing the forward on zeros, whose computation
            XLA then drops (nothing reads it)."""
            f = apply(k)

            def bwd(residuals: list, g: jax.Array) -> Any:
                zero = g.ravel()[0] * 0      # traced, so that the forward is traced too
                p0 = _zeros_like(shapes[k], zero)
                if k == 0:
                    _, vjp = jax.vjp(lambda q: f(q, _zeros(x_shape, jnp.int32, zero)), p0)
                else:
                    _, vjp = jax.vjp(f, p0, _zeros(x_shape, jnp.float32, zero))
                vjp = jax.tree.unflatten(jax.tree.structure(vjp), residuals)
                return vjp(g)[0] if k == 0 else vjp(g)
            return bwd

        def last_stage(p: M.Params, x: jax.Array, targets: jax.Array) -> tuple:
            def loss(q: M.Params, x: jax.Array) -> jax.Array:
                return M.head_loss(q, apply(last)(q, x), targets)
            value, (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1))(p, x)
            return value, gp, gx

        def update(k: int) -> Callable[..., tuple]:
            opt_tree = opt_states[k][1]

            def upd(p: M.Params, opt_leaves: list, grads: list, losses: list) -> tuple:
                g = jax.tree.map(lambda *gs: jax.lax.psum(sum(gs[1:], gs[0]), "data") / total, *grads)
                p, state = M.apply_update(opt, p, M.tree_like(opt_tree, opt_leaves), g)
                out = (p, jax.tree.leaves(state))
                if losses:
                    out += (jax.lax.psum(sum(losses[1:], losses[0]), "data") / total,)
                return out
            return upd

        mb = cfg.batch // microbatches // n
        devs = [list(d) for d in stage_devices]
        self.fwd = [zp.pmap(forward(k), devices=devs[k], axis_name="data") for k in range(last)]
        self.bwd = [zp.pmap(backward(k, (mb, cfg.seq) if k == 0 else (mb, cfg.seq, cfg.d_model)),
                            devices=devs[k], axis_name="data") for k in range(last)]
        self.last = zp.pmap(last_stage, devices=devs[last], axis_name="data")
        self.upd = [zp.pmap(update(k), devices=devs[k], axis_name="data") for k in range(S)]

        Mb = microbatches

        def train_step(params: list, opts: list, tokens: list, targets: list) -> tuple:
            residuals = [[None] * Mb for _ in range(last)]
            grads: list[list[Any]] = [[None] * Mb for _ in range(S)]
            g_in, losses = [None] * Mb, [None] * Mb
            for m in range(Mb):                          # forwards (the last stage: and its backward)
                x = tokens[m]
                for k in range(last):
                    x, residuals[k][m] = self.fwd[k](params[k], x)
                losses[m], grads[last][m], g_in[m] = self.last(params[last], x, targets[m])
            for m in range(Mb):                          # backwards
                g = g_in[m]
                for k in reversed(range(last)):
                    out = self.bwd[k](residuals[k][m], g)
                    if k:
                        grads[k][m], g = out
                    else:
                        grads[k][m] = out
            new_params, new_opts, loss = [], [], None
            for k in range(S):
                out = self.upd[k](params[k], opts[k], grads[k], losses if k == last else [])
                new_params.append(out[0])
                new_opts.append(out[1])
                if k == last:
                    loss = out[2]
            return new_params, new_opts, loss

        train_step.__name__ = f"pipeline_s{S}_step"
        self.program = zp.program(train_step)
        self.state: tuple = ([_stacked(p, n) for p in stage_params],
                             [_stacked(o[0], n) for o in opt_states])

    def microbatches(self, seqs: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The step's inputs and targets cut into microbatches, each [devices, rows, seq]."""
        parts = np.split(seqs, self.M)
        shape = (self.n, -1, self.cfg.seq)
        return ([np.ascontiguousarray(p[:, :-1]).reshape(shape) for p in parts],
                [np.ascontiguousarray(p[:, 1:]).reshape(shape) for p in parts])

    def step(self, seqs: np.ndarray) -> Any:
        tokens, targets = self.microbatches(seqs)
        params, opts, loss = self.program(*self.state, tokens, targets)
        self.state = (params, opts)
        return loss        # [devices]: the same loss on every device of the last stage

    def explain(self, seqs: np.ndarray) -> str:
        return self.program.explain(*self.state, *self.microbatches(seqs))


# --- two islands --------------------------------------------------------------------------

def buckets_of(tree: Any, bucket_bytes: int) -> list[list[int]]:
    """Leaf indices of ``tree`` grouped, in order, into buckets of at most
    ``bucket_bytes`` (a larger leaf is a bucket of its own)."""
    out: list[list[int]] = [[]]
    size = 0
    for i, leaf in enumerate(jax.tree.leaves(tree)):
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out


class TwoIslands(Layout):
    """Data parallel over two islands (``island_devices[i]``: island i's
    devices; each island data parallel over its own devices)."""

    def __init__(self, cfg: M.Config, island_devices: Sequence[Sequence[Any]],
                 bucket_bytes: int = 1 << 20, seed: int = 0) -> None:
        if len(island_devices) != 2 or len({d.island for ds in island_devices for d in ds}) != 2:
            raise ValueError("TwoIslands needs the devices of two islands")
        self.name = "two_islands"
        self.half = cfg.batch // 2
        opt = M.optimizer(cfg)
        params = M.init_params(cfg, seed)
        opt_leaves, opt_tree = M.flat_state(opt, params)
        tree = jax.tree.structure(params)
        shapes = [np.shape(x) for x in jax.tree.leaves(params)]
        groups = self.groups = buckets_of(params, bucket_bytes)

        n = len(island_devices[0])
        if len(island_devices[1]) != n:
            raise ValueError("TwoIslands needs the same number of devices on both islands")

        def pack(grads: M.Params) -> list[jax.Array]:
            """The gradient as a few flat buckets, each padded to a multiple of
            the island's devices (it is split over them)."""
            leaves = jax.tree.leaves(grads)
            out = []
            for g in groups:
                flat = jnp.concatenate([leaves[i].ravel() for i in g])
                out.append(jnp.pad(flat, (0, -flat.size % n)))
            return out

        def unpack(buckets: list[jax.Array]) -> M.Params:
            leaves: list[Any] = [None] * len(shapes)
            for g, b in zip(groups, buckets, strict=True):
                at = 0
                for i in g:
                    size = int(np.prod(shapes[i]))
                    leaves[i] = b[at:at + size].reshape(shapes[i])
                    at += size
            return jax.tree.unflatten(tree, leaves)

        def grad(params: M.Params, seqs: jax.Array) -> tuple:
            loss, grads = jax.value_and_grad(lambda p: M.loss_fn(cfg, p, seqs))(params)
            return loss, pack(grads)

        def average(buckets0: list, buckets1: list, loss0: jax.Array, loss1: jax.Array) -> tuple:
            return [(a + b) / 2 for a, b in zip(buckets0, buckets1, strict=True)], (loss0 + loss1) / 2

        def update(params: M.Params, opt_leaves: list, buckets: list) -> tuple:
            g = unpack(buckets)
            params, state = M.apply_update(opt, params, M.tree_like(opt_tree, opt_leaves), g)
            return params, jax.tree.leaves(state)

        meshes = [zp.Mesh(np.array(list(d), dtype=object), ("data",)) for d in island_devices]
        # each device of an island sends its own part of every bucket to the
        # device of the same rank on the other island: a bucket crosses the DCN
        # once. ``average`` then makes the mean whole on every device (one
        # all-gather), for ``update``: XLA's partitioner, left to cut the
        # parameters out of split buckets itself, makes the update 3-4x slower.
        split = [P("data")] * len(groups)
        self.grad = [zp.jit(grad, mesh=mh, in_specs=(P(), P("data", None)), out_specs=(P(), split))
                     for mh in meshes]
        self.average = [zp.jit(average, mesh=mh, in_specs=(split, split, P(), P()), out_specs=P())
                        for mh in meshes]
        self.update = [zp.jit(update, mesh=mh, in_specs=P(), out_specs=P()) for mh in meshes]

        def train_step(params: list, opts: list, seqs: list) -> tuple:
            losses, buckets = zip(*(self.grad[i](params[i], seqs[i]) for i in range(2)), strict=True)
            means = [self.average[i](buckets[0], buckets[1], *losses) for i in range(2)]
            outs = [self.update[i](params[i], opts[i], means[i][0]) for i in range(2)]
            return [o[0] for o in outs], [o[1] for o in outs], means[0][1]

        self.program = zp.program(train_step)
        self.state: tuple = ([params, params], [opt_leaves, opt_leaves])

    def halves(self, seqs: np.ndarray) -> list[np.ndarray]:
        return [seqs[:self.half], seqs[self.half:]]

    def step(self, seqs: np.ndarray) -> Any:
        params, opts, loss = self.program(*self.state, self.halves(seqs))
        self.state = (params, opts)
        return loss

    def explain(self, seqs: np.ndarray) -> str:
        return self.program.explain(*self.state, self.halves(seqs))
