"""Training-step throughput of `eval.train` per attention backend, share of pretraining rows and embedding lookup.

python -m eval.bench_train [--family llada] [--batch 256] [--seq-len 320] [--steps 50] [--attn xla,cudnn]
    [--pretrain-fraction 0.5,0] [--embed one-hot,take]

Times `train_step` (sizes `eval.train.SIZES`) on a small pool of real training sequences (the
step's cost does not depend on the pool's size): the first call (compilation) and the steady
steps/s after it, for every combination of the listed settings.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from acache_jax import compile_cache
from acache_jax.network.config import ModelConfig
from eval.tokenizer import build_tokenizer, special_ids
from eval.train import SIZES, Recipe, TrainState, initial_model, model_config, optimizer, train_step
from eval.train_data import Mixture, Pool, build_pool


def steps_per_second(cfg: ModelConfig, batch: int, steps: int, attn: str, pretrain_fraction: float,
                     pool: Pool, one_hot_embed: bool = True) -> tuple[float, float]:
    """(seconds of the first step, steady steps/s)."""
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    recipe = Recipe(steps=steps + 1, batch=batch, compute_dtype=dtype, attn_backend=attn,
                    pretrain_fraction=pretrain_fraction, one_hot_embed=one_hot_embed)
    graphdef, params = nnx.split(initial_model(cfg, recipe, 0))
    state = TrainState(params, optimizer(recipe).init(params), jnp.int32(0))
    key = jax.random.key(0)
    start = time.perf_counter()
    state, loss = train_step(graphdef, recipe, cfg.mask_token_id, state, pool, key)
    loss.block_until_ready()
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        state, loss = train_step(graphdef, recipe, cfg.mask_token_id, state, pool, key)
    loss.block_until_ready()
    return first, steps / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.bench_train", description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(SIZES), default="llada")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=320)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--attn", default="xla,cudnn", help="comma-separated backends")
    p.add_argument("--pretrain-fraction", default=str(Recipe.pretrain_fraction),
                   help="comma-separated shares of pretraining rows (whole sequence maskable)")
    p.add_argument("--embed", default="one-hot", help="comma-separated embedding lookups: one-hot (the recipe's), take")
    args = p.parse_args(argv)
    compile_cache.enable()  # compiled programs are kept for later runs (acache_jax/compile_cache.py)
    lookups = args.embed.split(",")
    if not set(lookups) <= {"one-hot", "take"}:
        p.error(f"--embed takes one-hot and/or take, got {args.embed!r}")
    tokenizer = build_tokenizer()
    ids = special_ids(tokenizer)
    cfg = model_config(args.family, tokenizer.get_vocab_size(), ids)
    pool = jax.device_put(build_pool(tokenizer, 4 * args.batch, args.seq_len, 0, Mixture(), ids["eos_token_id"],
                                     ids["pad_token_id"]))
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; {args.family}, batch {args.batch} x "
          f"{args.seq_len} tokens")
    for attn in args.attn.split(","):
        for fraction in [float(x) for x in args.pretrain_fraction.split(",")]:
            for lookup in lookups:
                first, rate = steps_per_second(cfg, args.batch, args.steps, attn, fraction, pool, lookup == "one-hot")
                print(f"attn {attn}, pretrain fraction {fraction}, embedding {lookup}: first step {first:.1f}s, "
                      f"then {rate:.2f} steps/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
