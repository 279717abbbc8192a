"""Decoding speed at LLaDA-8B shape with random bf16 weights: per-call forwards and end-to-end policies.

    python -m eval.bench_decode [--layers 32] [--batches 1,4,16] [--prompts 300,500,900] [--meshes none,1x1] [--out DIR]

1. Per call: the block-start full forward (T = prompt + 256 tokens, logits for one 32-token block,
   K/V of every position returned) and the dual-cache in-block forward (32 tokens against a cached
   K/V of T positions), median time, TFLOP/s and MFU against 800 TFLOP/s (the measured H200 bf16 rate).
2. End to end: the `--policies` over the same prompts with a fixed commit schedule (threshold off,
   `--steps` steps: every policy does the same NFE), tokens/s and MFU. With `--affix N`, every
   request carries the same N-token prefix affix (random ids), and `acache`/`direct` decode from its
   shared cache (anchors selected beforehand; the probe is timed by eval.bench_acache_probe).
All programs are lowered first and compiled in parallel threads, then run one after another.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from acache_jax import compile_cache
from acache_jax.decoding.acache import build_affix_cache, select_anchors
from acache_jax.decoding.decode import anchor_axis, decode_batch
from acache_jax.decoding.layout import Request, make_batch
from acache_jax.network.attention import cudnn_attention, dense_attention
from acache_jax.network.config import DecodeConfig, ModelConfig
from acache_jax.network.files import write_atomic
from acache_jax.network.kv import KVPool, read_set, rows_access
from acache_jax.network.model import ForwardInputs, Model, abstract_transformer
from acache_jax.network.sharding import make_mesh, param_sharding, place_rows, sharded_config, use_mesh
from pallas_kernels import rope

PEAK_TFLOPS = 800.0  # bf16 dense matmul measured on one H200 (8192^3 product, random data)


def llada_8b(layers: int) -> ModelConfig:
    return ModelConfig(family="llada", vocab_size=126464, hidden_size=4096, num_layers=layers, num_heads=32,
                       num_kv_heads=32, head_dim=128, intermediate_size=12288, rope_theta=500000.0,
                       rms_norm_eps=1e-5, max_seq_len=4096, qkv_bias=False, mask_token_id=126336,
                       eos_token_id=126081, pad_token_id=126081)


def random_model(cfg: ModelConfig, seed: int = 0, mesh: Mesh | None = None) -> Model:
    """Random bf16 weights made on the device (std 0.02, norms 1), one small program per distinct
    shape: a single program for every tensor of an 8B model takes minutes to compile. On a mesh,
    each tensor is made in its shards, as `acache_jax.load(..., mesh=)` places them."""
    cfg = sharded_config(cfg, mesh)
    graphdef, abstract = nnx.split(abstract_transformer(cfg, jnp.bfloat16))
    paths, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(abstract))
    keys = jax.random.split(jax.random.key(seed), len(paths))
    params = []
    for key, (path, a) in zip(keys, paths):
        sharding = None if mesh is None else param_sharding(mesh, tuple(k.key for k in path))
        params.append(_ones(a.shape, a.dtype, sharding) if a.ndim == 1 else _normal(key, a.shape, a.dtype, sharding))
    nnx.replace_by_pure_dict(abstract, jax.tree.unflatten(treedef, params))
    return Model(cfg, graphdef, abstract, mesh=mesh)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _ones(shape: tuple[int, ...], dtype, sharding) -> jax.Array:
    x = jnp.ones(shape, dtype)
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key: jax.Array, shape: tuple[int, ...], dtype, sharding) -> jax.Array:
    x = (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def parse_meshes(text: str) -> dict[str, Mesh | None]:
    """`none,1x1,2x1`: no mesh, and meshes of tensor-parallel x data-parallel devices, by label."""
    out = {}
    for part in text.split(","):
        if part == "none":
            out[part] = None
        else:
            tp, dp = (int(x) for x in part.split("x"))
            out[f"tp{tp}dp{dp}"] = make_mesh(tp, dp)
    return out


def pool_from_rows(k: tuple[jax.Array, ...], v: tuple[jax.Array, ...], positions: jax.Array,
                   rope_theta: float) -> KVPool:
    """The pool of a dense forward's K (before RoPE) and V, layers x [B, T, H, D]: row b's token t in
    slot b * T + t, K rotated at `positions` [B, T] (a cached row, as the in-block forwards read it)."""
    flat = lambda a: a.reshape(-1, *a.shape[2:])
    return KVPool(tuple(flat(rope(a, positions, rope_theta)) for a in k), tuple(map(flat, v)))


def forward_flops(cfg: ModelConfig, batch: int, tq: int, tk: int, logit_tokens: int) -> float:
    """Matmul FLOPs of one forward: projections and MLP per query token, attention q.k and p.v, LM head."""
    d, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    per_token = 2 * (2 * d * d + 2 * d * kv + 3 * d * cfg.intermediate_size)
    attention = 4 * tq * tk * cfg.num_heads * cfg.head_dim
    return batch * (cfg.num_layers * (tq * per_token + attention) + 2 * logit_tokens * d * cfg.vocab_size)


def median_seconds(fn, *args, iters: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_attention_backends() -> str:
    """On this device, the cuDNN path must equal the jnp oracle (bf16 tolerance)."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((2, 37, 8, 128), (2, 300, 8, 128), (2, 300, 8, 128)))
    valid = jnp.asarray(rng.random((2, 300)) < 0.8)
    ref = dense_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), valid)
    got = cudnn_attention(q, k, v, valid).astype(jnp.float32)
    err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    assert err < 2e-2, f"cuDNN attention differs from the oracle: relative error {err}"
    return f"cudnn vs jnp oracle: relative L2 error {err:.2e}"


def lower_jobs(model: Model, label: str, args: argparse.Namespace, batches: list[int], prompts: list[int],
               policies: list[str]) -> dict:
    """(label, kind, batch, prompt) -> (lowered program, its inputs) of every case on `model`
    (under its mesh, if any); the same random inputs under every label."""
    cfg, bl, g = model.config, args.block, args.gen
    structure, leaves = model.flat
    rng = np.random.default_rng(0)
    jobs = {}

    def full(params, ids, pos):
        idx = jnp.broadcast_to(pos.shape[1] - g + jnp.arange(bl), (ids.shape[0], bl))
        out = structure.forward(params, ids, ForwardInputs(pos, logit_index=idx), attn_backend=args.backend)
        return out.logits, out.k, out.v

    def block(params, ids, pos, k, v, kpos, kvalid):
        """The block [B, bl] (its positions are its columns) written into its rows' pool, reading
        the cached columns and itself."""
        b, t = kpos.shape
        pool = pool_from_rows(k, v, kpos, cfg.rope_theta)
        rows = jnp.arange(b)[:, None] * t
        write = rows + pos
        in_block = jnp.zeros((b, t), bool).at[jnp.arange(b)[:, None], pos].set(True)
        reads = (read_set(rows + jnp.arange(t)[None], kvalid | in_block, jnp.zeros(b)),)
        inputs = ForwardInputs(pos.reshape(-1), access=rows_access(pool, write, reads))
        return structure.forward(params, ids.reshape(-1), inputs, attn_backend=args.backend).logits

    # ---- lower everything, compile in parallel ----
    affix_ids = rng.integers(0, 126000, args.affix).tolist() if args.affix else None
    affix = build_affix_cache(model, affix_ids) if affix_ids else None
    for b in batches:
        for p in prompts:
            t = p + g + args.affix
            if args.per_call:
                ids = jnp.asarray(rng.integers(0, 126000, (b, t)), jnp.int32)
                pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
                kshape = (jax.ShapeDtypeStruct((b, t, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16),) * cfg.num_layers
                jobs[(label, "full", b, p)] = (jax.jit(full).lower(leaves, ids, pos), (leaves, ids, pos))
                bids, bpos = ids[:, p:p + bl], pos[:, p:p + bl]
                kvalid = jnp.ones((b, t), bool).at[:, p:p + bl].set(False)
                lowered = jax.jit(block).lower(leaves, bids, bpos, kshape, kshape, pos, kvalid)
                jobs[(label, "block", b, p)] = (lowered, (leaves, bids, bpos, None, None, pos, kvalid))
            for policy in policies:
                dcfg = DecodeConfig(gen_length=g, block_length=bl, steps=args.steps, threshold=None, cache=policy,
                                    anchor_ratio=args.ratio, attn_backend=args.backend)
                placement = "prefix" if affix_ids else None
                reqs = [Request(rng.integers(0, 126000, p).tolist(), affix_position=placement, seed=i) for i in range(b)]
                batch = place_rows(make_batch(reqs, g, cfg, affix_ids), model.mesh)
                extra = ()
                if dcfg.selective:
                    k = dcfg.anchors(args.affix)
                    anchors = (select_anchors(structure, leaves, batch, affix, k, "attention", args.backend,
                                              width=anchor_axis(k, args.affix)) if k else
                               jnp.zeros((b, 0), jnp.int32))
                    extra = (affix, anchors)
                lowered = decode_batch.lower(structure, leaves, batch, dcfg, *extra)
                jobs[(label, policy, b, p)] = (lowered, (leaves, batch, *extra))
    return jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--prompts", default="300,500,900")
    parser.add_argument("--policies", default="none,prefix,dual")
    parser.add_argument("--gen", type=int, default=256)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32, help="fixed schedule: gen/steps tokens per forward")
    parser.add_argument("--backend", default="cudnn")
    parser.add_argument("--threads", type=int, default=8, help="parallel compilations")
    parser.add_argument("--affix", type=int, default=0, help="tokens of a shared prefix affix (0: none)")
    parser.add_argument("--ratio", type=float, default=0.2, help="acache anchor ratio")
    parser.add_argument("--per-call", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--meshes", default="none", type=parse_meshes,
                        help="each case under each of: none (no mesh) and TPxDP meshes, e.g. none,1x1")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    compile_cache.enable()  # compiled programs are kept for later runs (acache_jax/compile_cache.py)
    batches = [int(x) for x in args.batches.split(",")]
    prompts = [int(x) for x in args.prompts.split(",")]
    policies = args.policies.split(",")
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    if args.backend == "cudnn":
        print(check_attention_backends(), flush=True)
    cfg = llada_8b(args.layers)
    print(f"model: {cfg.num_params / 1e9:.2f} B parameters (bf16)", flush=True)
    bl, g = args.block, args.gen
    jobs = {}
    for label, mesh in args.meshes.items():
        model = random_model(cfg, mesh=mesh)
        with use_mesh(mesh):
            jobs |= lower_jobs(model, label, args, batches, prompts, policies)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
        compiled = dict(zip(jobs, pool.map(lambda lowered: lowered.compile(), [j[0] for j in jobs.values()])))
    print(f"compiled {len(jobs)} programs in {time.perf_counter() - start:.0f} s", flush=True)

    results = []
    for (label, kind, b, p), exe in compiled.items():
        t = p + g + args.affix
        inputs = jobs[(label, kind, b, p)][1]
        if kind == "full":
            sec = median_seconds(exe, *inputs)
            flops = forward_flops(cfg, b, t, t, bl)
            logits, kcache, vcache = exe(*inputs)
            caches = (kcache, vcache)
        elif kind == "block":
            args_ = list(inputs)
            args_[3], args_[4] = caches  # cache from the full forward of the same shape
            sec = median_seconds(exe, *args_)
            flops = forward_flops(cfg, b, bl, t, bl)
            del caches
        else:
            run = lambda: exe(*inputs)
            jax.block_until_ready(run())
            start = time.perf_counter()
            tokens, stats = jax.block_until_ready(run())
            sec = time.perf_counter() - start
            calls = int(stats.calls)
            nfe_tokens = int(np.asarray(stats.forward_tokens).sum())
            # FLOPs: each forward's tokens through the projections/MLP (attention and LM head omitted: a lower bound)
            flops = forward_flops(cfg, 1, 1, 0, 0) * nfe_tokens
        row = dict(mesh=label, kind=kind, batch=b, prompt=p, seconds=sec, tflops=flops / sec / 1e12)
        row["mfu"] = row["tflops"] / PEAK_TFLOPS
        if kind not in ("full", "block"):
            row.update(tokens_per_s=b * g / sec, nfe=calls)
        results.append(row)
        print(json.dumps(row), flush=True)

    print("\n| mesh | kind | batch | prompt | ms | TFLOP/s | MFU | tokens/s | NFE |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: (r["kind"], r["batch"], r["prompt"])):  # the meshes of a case side by side
        print(f"| {r['mesh']} | {r['kind']} | {r['batch']} | {r['prompt']} | {1e3 * r['seconds']:.1f} | {r['tflops']:.0f} | "
              f"{r['mfu']:.2f} | {r.get('tokens_per_s', float('nan')):.0f} | {r.get('nfe', '')} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / "bench_decode.json", json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
