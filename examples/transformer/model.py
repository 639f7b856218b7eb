"""A small decoder-only transformer language model in plain JAX, its synthetic
training data, and its training loop in one process (the reference the zpath
layouts are checked against).

Everything is float32 whatever ``jax_enable_x64`` says (zpath traces with the caller's setting):
parameters are made in numpy as float32, and no computation here makes a value of
the default float type.

The model is split into *stages* for the pipeline: stage 0 holds the token and
position embeddings, the last stage the final layer norm and the unembedding, and
the layers are divided evenly. ``join_stages`` puts the stages' parameters back
into the one-process tree, so every layout trains the same numbers."""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

Params = dict[str, Any]
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64          # tokens of the synthetic language
    seq: int = 64            # tokens per sequence
    d_model: int = 128
    heads: int = 4
    layers: int = 4
    d_ff: int = 512
    batch: int = 16          # sequences per training step
    lr: float = 3e-3

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq


# --- data --------------------------------------------------------------------------

def make_language(cfg: Config, seed: int = 0, successors: int = 4) -> np.ndarray:
    """A random first-order Markov chain over the vocabulary: every token has
    ``successors`` likely next tokens. Its transition matrix, float64 [V, V].
    The best achievable loss is the chain's entropy rate, a little above
    ln(successors)."""
    rng = np.random.default_rng(seed)
    trans = np.full((cfg.vocab, cfg.vocab), 0.02 / cfg.vocab)
    for t in range(cfg.vocab):
        nxt = rng.choice(cfg.vocab, size=successors, replace=False)
        trans[t, nxt] += rng.dirichlet(np.ones(successors)) * 0.98
    return trans / trans.sum(axis=1, keepdims=True)


def entropy_rate(cfg: Config) -> float:
    """The language's entropy rate in nats per token: the expected loss of a
    model that knows its transition matrix (the first token aside)."""
    trans = make_language(cfg)
    w, v = np.linalg.eig(trans.T)
    stationary = np.real(v[:, np.argmin(np.abs(w - 1))])
    stationary /= stationary.sum()
    return float(-(stationary[:, None] * trans * np.log(trans)).sum())


def batches(cfg: Config, steps: int, seed: int = 1) -> list[np.ndarray]:
    """``steps`` batches of int32 [batch, seq + 1] sequences sampled from the
    language (inputs are ``[:, :-1]``, targets ``[:, 1:]``)."""
    trans = make_language(cfg)
    cum = np.cumsum(trans, axis=1)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = np.empty((cfg.batch, cfg.seq + 1), dtype=np.int32)
        x[:, 0] = rng.integers(0, cfg.vocab, size=cfg.batch)
        u = rng.random((cfg.batch, cfg.seq))
        for t in range(cfg.seq):
            x[:, t + 1] = np.minimum((cum[x[:, t]] < u[:, t, None]).sum(axis=1), cfg.vocab - 1)
        out.append(x)
    return out


# --- parameters ----------------------------------------------------------------------

def init_params(cfg: Config, seed: int = 0) -> Params:
    """The whole model's parameters, float32 numpy arrays."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    d, f = cfg.d_model, cfg.d_ff
    out_scale = 0.02 / math.sqrt(2 * cfg.layers)
    layers = []
    for _ in range(cfg.layers):
        layers.append({
            "ln1": {"scale": np.ones(d, np.float32), "bias": np.zeros(d, np.float32)},
            "wq": normal(d, d), "wk": normal(d, d), "wv": normal(d, d),
            "wo": normal(d, d, scale=out_scale),
            "ln2": {"scale": np.ones(d, np.float32), "bias": np.zeros(d, np.float32)},
            "w1": normal(d, f), "b1": np.zeros(f, np.float32),
            "w2": normal(f, d, scale=out_scale), "b2": np.zeros(d, np.float32),
        })
    return {"embed": normal(cfg.vocab, d), "pos": normal(cfg.seq, d), "layers": layers,
            "ln_f": {"scale": np.ones(d, np.float32), "bias": np.zeros(d, np.float32)},
            "unembed": normal(d, cfg.vocab)}


def split_stages(params: Params, stages: int) -> list[Params]:
    """The parameters of each of ``stages`` pipeline stages (the layers divided
    evenly; embeddings on the first, final norm and unembedding on the last)."""
    n = len(params["layers"])
    if n % stages:
        raise ValueError(f"{n} layers do not divide into {stages} stages")
    per = n // stages
    out = []
    for k in range(stages):
        p: Params = {"layers": params["layers"][k * per:(k + 1) * per]}
        if k == 0:
            p["embed"], p["pos"] = params["embed"], params["pos"]
        if k == stages - 1:
            p["ln_f"], p["unembed"] = params["ln_f"], params["unembed"]
        out.append(p)
    return out


def join_stages(stages: list[Params]) -> Params:
    """The inverse of ``split_stages``."""
    return {"embed": stages[0]["embed"], "pos": stages[0]["pos"],
            "layers": [layer for s in stages for layer in s["layers"]],
            "ln_f": stages[-1]["ln_f"], "unembed": stages[-1]["unembed"]}


# --- the model -----------------------------------------------------------------------

def layer_norm(p: Params, x: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def block(cfg: Config, p: Params, x: jax.Array) -> jax.Array:
    """One pre-norm transformer layer on activations float32 [batch, seq, d]."""
    b, t, d = x.shape
    hd = d // cfg.heads
    h = layer_norm(p["ln1"], x)
    q, k, v = ((h @ p[w]).reshape(b, t, cfg.heads, hd) for w in ("wq", "wk", "wv"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.float32(math.sqrt(hd))
    causal = np.tril(np.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, np.float32(-1e9))
    att = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
    x = x + o @ p["wo"]
    h = layer_norm(p["ln2"], x)
    return x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def embed(p: Params, tokens: jax.Array) -> jax.Array:
    return p["embed"][tokens] + p["pos"][: tokens.shape[1]]


def head_loss(p: Params, x: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross entropy of activations ``x`` against ``targets``."""
    logits = layer_norm(p["ln_f"], x) @ p["unembed"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def stage_apply(cfg: Config, p: Params, x: jax.Array, first: bool) -> jax.Array:
    """A stage's layers (after the embedding, on the first stage)."""
    if first:
        x = embed(p, x)
    for layer in p["layers"]:
        x = block(cfg, layer, x)
    return x


def loss_fn(cfg: Config, params: Params, seqs: jax.Array) -> jax.Array:
    """The model's loss on int32 [batch, seq + 1] sequences."""
    x = stage_apply(cfg, params, seqs[:, :-1], first=True)
    return head_loss(params, x, seqs[:, 1:])


def optimizer(cfg: Config) -> optax.GradientTransformation:
    """Adam: element-wise, so a stage updating only its own parameters does
    exactly what one update of the whole tree does."""
    return optax.adam(cfg.lr)


def apply_update(opt: optax.GradientTransformation, params: Params, opt_state: Any,
                 grads: Params) -> tuple[Params, Any]:
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


# --- the reference: the same training in one process -----------------------------------

def reference_losses(cfg: Config, data: list[np.ndarray], seed: int = 0,
                     times: list[float] | None = None) -> list[float]:
    """Per-step losses of training on ``data`` with plain JAX in this process
    (with ``times``: each step is waited for, and its seconds appended there)."""
    opt = optimizer(cfg)
    params = jax.tree.map(jnp.asarray, init_params(cfg, seed))
    opt_state = opt.init(params)

    @jax.jit
    def step(params: Params, opt_state: Any, seqs: jax.Array) -> tuple[Params, Any, jax.Array]:
        loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, seqs))(params)
        params, opt_state = apply_update(opt, params, opt_state, grads)
        return params, opt_state, loss

    losses = []
    for seqs in data:
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, seqs)
        losses.append(loss)
        if times is not None:
            loss.block_until_ready()
            times.append(time.perf_counter() - t0)
    return [float(x) for x in losses]


def flat_state(opt: optax.GradientTransformation, params: Params) -> tuple[list[np.ndarray], Any]:
    """The optimizer's initial state as a list of numpy leaves, and its tree
    structure: zpath passes lists of arrays, not optax's named tuples."""
    state = opt.init(jax.tree.map(jnp.asarray, params))
    leaves, tree = jax.tree.flatten(state)
    return [np.asarray(x) for x in leaves], tree


def tree_like(tree: Any, leaves: list[Any]) -> Any:
    return jax.tree.unflatten(tree, list(leaves))

