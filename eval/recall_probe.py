"""How fast does a network learn in-context recall? A training-recipe diagnostic on CPU in minutes.

python -m eval.recall_probe [--pairs 2] [--steps 1400] [--net ours|abs|rope] [--shared-embedding 1.0]
    [--aux 0] [--gap 0]
python -m eval.recall_probe --pairs 2,4,8 --steps 1600,1200,2400   # a curriculum: stages of 2, 4, 8 pairs

Each sequence is `k1 v1 ... kP vP q [gap] [mask]`: P distinct keys with random values, one of the
keys, `--gap` fixed filler tokens; the answer is the query's value. This is bAbI's "where is X"
without the story text. With `--aux F` every batch also holds F x batch aux rows: copies of recall
rows whose values are a fixed function of their keys, with one value masked and scored, and the
final mask scored against the query's fixed value. Each rewards one half of the recall circuit on
its own (copy a key into its value's position; fetch the query into the mask's), as
`eval.tasks.babi`'s routine stories do for bAbI. `ours` is the
LLaDA-arch `acache_jax.network.model.Transformer` (2 layers, width 128, RoPE) initialised as
`eval.train.initial_model` does; `abs` and `rope` are an independent plain-jnp pre-norm transformer
of the same size with learned absolute position embeddings or with RoPE instead. Prints the
answer accuracy every 200 steps (chance among the in-context values: 1/P).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from acache_jax import compile_cache
from acache_jax.network.config import ModelConfig
from acache_jax.network.model import ForwardInputs
from pallas_kernels.gathered_attention import rope

VOCAB, MASK, KEYS, VALUES, FILLER = 128, 2, (10, 40), (50, 80), 100
FIXED_VALUE = np.random.default_rng(99).integers(*VALUES, size=KEYS[1])  # key -> value of the aux rows
WIDTH, LAYERS, HEADS = 128, 2, 2


def recall_batch(key: jax.Array, pairs: int, batch: int, gap: int = 0) -> tuple[jax.Array, jax.Array]:
    """(tokens [B, 2P + 2 + gap]: pairs, the query key, `gap` fillers and a mask; answers [B])."""
    k_keys, k_values, k_query = jax.random.split(key, 3)
    keys = jax.vmap(lambda k: jax.random.permutation(k, KEYS[1] - KEYS[0])[:pairs])(jax.random.split(k_keys, batch))
    keys = keys + KEYS[0]
    values = jax.random.randint(k_values, (batch, pairs), *VALUES)
    query = jax.random.randint(k_query, (batch, 1), 0, pairs)
    context = jnp.stack([keys, values], -1).reshape(batch, 2 * pairs)
    fillers = jnp.broadcast_to(FILLER + jnp.arange(gap), (batch, gap))
    tokens = jnp.concatenate([context, jnp.take_along_axis(keys, query, 1), fillers, jnp.full((batch, 1), MASK)], 1)
    return tokens, jnp.take_along_axis(values, query, 1)[:, 0]


def aux_rows(tokens: jax.Array, key: jax.Array, pairs: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Recall rows turned into aux rows: values FIXED_VALUE[key], one of them masked; (tokens, the
    masked column [B], its value [B], the final mask's answer FIXED_VALUE[query] [B])."""
    b = tokens.shape[0]
    keys = tokens[:, 0:2 * pairs:2]
    context = jnp.stack([keys, jnp.asarray(FIXED_VALUE)[keys]], -1).reshape(b, 2 * pairs)
    column = 2 * jax.random.randint(key, (b,), 0, pairs) + 1
    rows = jnp.arange(b)
    tail = tokens[:, 2 * pairs:]
    return (jnp.concatenate([context.at[rows, column].set(MASK), tail], 1), column, context[rows, column],
            jnp.asarray(FIXED_VALUE)[tail[:, 0]])


def ours(shared_embedding: float, seed: int = 0):
    from eval.train import Recipe, initial_model

    cfg = ModelConfig(family="llada", vocab_size=VOCAB, hidden_size=WIDTH, num_layers=LAYERS, num_heads=HEADS,
                      num_kv_heads=HEADS, head_dim=WIDTH // HEADS, intermediate_size=3 * WIDTH, rope_theta=500000.0,
                      rms_norm_eps=1e-5, max_seq_len=512, qkv_bias=False, mask_token_id=MASK, eos_token_id=3,
                      pad_token_id=0)
    graphdef, params = nnx.split(initial_model(cfg, Recipe(shared_embedding=shared_embedding), seed))
    positions = lambda t: jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape)
    return params, lambda p, t: nnx.merge(graphdef, p)(t, ForwardInputs(positions(t))).logits


def reference(absolute: bool, length: int, seed: int = 0):
    """A plain pre-norm transformer (GELU MLP, no norm weights, 0.02 embeddings)."""
    keys = iter(jax.random.split(jax.random.key(seed), 4 + 4 * LAYERS))
    normal = lambda shape, std: jax.random.normal(next(keys), shape) * std
    params = {"embed": normal((VOCAB, WIDTH), 0.02), "pos": normal((length, WIDTH), 0.02),
              "head": normal((WIDTH, VOCAB), WIDTH**-0.5),
              "layers": [{"qkv": normal((WIDTH, 3 * WIDTH), WIDTH**-0.5), "o": normal((WIDTH, WIDTH), WIDTH**-0.5 / 2),
                          "up": normal((WIDTH, 4 * WIDTH), WIDTH**-0.5),
                          "down": normal((4 * WIDTH, WIDTH), (4 * WIDTH) ** -0.5 / 2)} for _ in range(LAYERS)]}
    norm = lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5)

    def apply(p, tokens):
        b, t = tokens.shape
        x = p["embed"][tokens] + (p["pos"][None, :t] if absolute else 0.0)
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        heads = lambda a: a.reshape(b, t, HEADS, -1)
        for layer in p["layers"]:
            q, k, v = map(heads, jnp.split(norm(x) @ layer["qkv"], 3, -1))
            if not absolute:
                q, k = rope(q, positions, 10000.0), rope(k, positions, 10000.0)
            att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]), -1)
            x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, -1) @ layer["o"]
            x = x + jax.nn.gelu(norm(x) @ layer["up"]) @ layer["down"]
        return norm(x) @ p["head"]

    return params, apply


def train_recall(net: str, pairs: int | Sequence[int], steps: int | Sequence[int], shared_embedding: float = 1.0,
                 batch: int = 64, lr: float = 1e-3, aux: float = 0.0, gap: int = 0, report=print) -> list[float]:
    """Recall accuracy over each 200 steps (AdamW, b2 0.95, weight decay 0.1, fresh batches every step);
    `aux`: rows of fixed-function pairs added per recall row, their loss added to the recall loss.
    pairs, steps: one number each, or a curriculum: `steps[i]` steps with `pairs[i]` pairs, in turn."""
    pairs, steps = (tuple(int(x) for x in np.atleast_1d(v)) for v in (pairs, steps))
    if len(pairs) != len(steps):
        raise ValueError(f"a curriculum needs one step count per stage: pairs {pairs}, steps {steps}")
    params, apply = ours(shared_embedding) if net == "ours" else reference(net == "abs", 2 * max(pairs) + 2 + gap)
    opt = optax.adamw(lr, b2=0.95, weight_decay=0.1)
    n_aux = round(aux * batch)

    def loss(p, key, n_pairs):
        tokens, answers = recall_batch(key, n_pairs, batch, gap)
        logits = apply(p, tokens)[:, -1]
        total = optax.softmax_cross_entropy_with_integer_labels(logits, answers).mean()
        if n_aux:
            tokens, column, values, query_values = aux_rows(tokens[:n_aux], jax.random.fold_in(key, 1), n_pairs)
            aux_logits = apply(p, tokens)
            masked_value = jnp.take_along_axis(aux_logits, column[:, None, None], 1)[:, 0]
            total += optax.softmax_cross_entropy_with_integer_labels(masked_value, values).mean()
            total += optax.softmax_cross_entropy_with_integer_labels(aux_logits[:, -1], query_values).mean()
        return total, jnp.argmax(logits, -1) == answers

    @functools.partial(jax.jit, static_argnums=3)
    def step(p, state, i, n_pairs):
        (_, correct), grads = jax.value_and_grad(loss, has_aux=True)(p, jax.random.key(i), n_pairs)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state, jnp.mean(correct)

    state, correct, curve, start, i = opt.init(params), [], [], time.perf_counter(), 0
    for n_pairs, n_steps in zip(pairs, steps):
        for _ in range(n_steps):
            params, state, acc = step(params, state, i, n_pairs)
            correct.append(acc)
            i += 1
            if i % 200 == 0:
                curve.append(float(np.mean(jax.device_get(correct[-200:]))))
                report(f"{net} pairs {n_pairs} step {i}: accuracy {curve[-1]:.3f} ({time.perf_counter() - start:.0f}s)")
    return curve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.recall_probe", description=__doc__.splitlines()[0])
    p.add_argument("--net", choices=["ours", "abs", "rope"], default="ours")
    p.add_argument("--pairs", default="2", help="key-value pairs; comma-separated for a curriculum (2,4,8)")
    p.add_argument("--steps", default="1400", help="steps; comma-separated, one per curriculum stage")
    p.add_argument("--shared-embedding", type=float, default=1.0, help="for --net ours (0: plain init)")
    p.add_argument("--aux", type=float, default=0.0, help="fixed-function rows per recall row (0: none)")
    p.add_argument("--gap", type=int, default=0, help="filler tokens between the query and its mask")
    args = p.parse_args(argv)
    compile_cache.enable()  # compiled programs are kept for later runs (acache_jax/compile_cache.py)
    pairs, steps = ([int(x) for x in v.split(",")] for v in (args.pairs, args.steps))
    try:
        train_recall(args.net, pairs, steps, args.shared_embedding, aux=args.aux, gap=args.gap)
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
