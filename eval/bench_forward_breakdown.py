"""Where the time of one forward goes, at LLaDA-8B shape (random bf16 weights), by leaving parts out.

    python -m eval.bench_forward_breakdown [--layers 32]

In-block (dual-cache) forward of 32 tokens at batch 1 against a cache of T keys:
  cudnn / xla      the real forward with each attention backend
  no-cache         the same 32 tokens with no external keys: weights, projections, MLP, LM head
  weights read     a sum over every weight (the memory floor of any forward)
Full forward at batch 16 with and without returning the per-layer K/V (the cache write).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from acache_jax import compile_cache
from acache_jax.network.kv import read_set, rows_access
from acache_jax.network.model import ForwardInputs
from eval.bench_decode import forward_flops, llada_8b, median_seconds, pool_from_rows, random_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--lengths", default="556,1156")
    args = parser.parse_args()
    compile_cache.enable()  # compiled programs are kept for later runs (acache_jax/compile_cache.py)
    cfg = llada_8b(args.layers)
    model = random_model(cfg)
    structure, params = model.flat
    rng = np.random.default_rng(0)
    bytes_weights = sum(x.nbytes for x in jax.tree.leaves(params))
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; weights {bytes_weights / 1e9:.1f} GB")

    # A read of every weight: the sum forces each matrix through memory once.
    sec = median_seconds(jax.jit(lambda p: sum(jnp.sum(l, dtype=jnp.float32) for l in jax.tree.leaves(p))), params)
    print(f"read all weights once: {1e3 * sec:.2f} ms ({bytes_weights / sec / 1e12:.2f} TB/s)")
    for t in [int(x) for x in args.lengths.split(",")]:
        ids = jnp.asarray(rng.integers(0, 126000, (1, t)), jnp.int32)
        pos = jnp.arange(t, dtype=jnp.int32)[None]
        out = jax.jit(lambda p, i, q: structure.forward(p, i, ForwardInputs(q), attn_backend="cudnn"))(params, ids, pos)
        bids, bpos = ids[:, 300:332], pos[:, 300:332]
        reads = (read_set(jnp.arange(t)[None], jnp.ones((1, t), bool), jnp.zeros(1)),)
        for backend in ("pallas", "xla"):
            def fn(p, i, q, k, v, backend=backend):
                access = rows_access(pool_from_rows(k, v, pos, cfg.rope_theta), q, reads)
                return structure.forward(p, i.reshape(-1), ForwardInputs(q.reshape(-1), access=access),
                               attn_backend=backend).logits
            sec = median_seconds(jax.jit(fn), params, bids, bpos, out.k, out.v, iters=20)
            print(f"T={t} in-block forward through the pool, {backend}: {1e3 * sec:.2f} ms")
        fn = jax.jit(lambda p, i, q: structure.forward(p, i, ForwardInputs(q), attn_backend="cudnn").logits)
        sec = median_seconds(fn, params, bids, bpos, iters=20)
        print(f"T={t} in-block forward without cache keys: {1e3 * sec:.2f} ms")
        del out
    b, t = 16, 1156
    ids = jnp.asarray(rng.integers(0, 126000, (b, t)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    idx = jnp.broadcast_to(t - 256 + jnp.arange(32), (b, 32))
    flops = forward_flops(cfg, b, t, t, 32)
    run = lambda p, i, q, backend: structure.forward(p, i, ForwardInputs(q, logit_index=idx), attn_backend=backend)
    with_kv = jax.jit(lambda p, i, q: (lambda o: (o.logits, o.k, o.v))(run(p, i, q, "cudnn")))
    logits_only = jax.jit(lambda p, i, q: run(p, i, q, "cudnn").logits)
    xla = jax.jit(lambda p, i, q: run(p, i, q, "xla").logits)
    for name, fn in (("full forward B16 T1156 returning K/V", with_kv), ("same, logits only", logits_only),
                     ("same, logits only, xla attention", xla)):
        sec = median_seconds(fn, params, ids, pos, iters=5)
        print(f"{name}: {1e3 * sec:.1f} ms, {flops / sec / 1e12:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
