"""Bidirectional attention in two forms, with one backend switch.

- Dense: the rows of a [B, T] batch attend to their own tokens (padding masked): plain forwards
  (`Model.logits`, an affix computed alone, training, the hkvd probe).
- Pool: a forward's tokens write their K (rotated at their positions) and V into a `KVPool`
  first, then every token reads its segment's rows through the read sets of a `PoolAccess`
  (acache_jax/network/kv.py): the static decode loop and the engine's packed steps alike. Queries run in
  tiles of one segment's tokens; each read set is one call of the gathered-attention kernel (or its
  jnp oracle), and the partial results are merged by their log-sum-exp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from acache_jax.network.config import ATTENTION_BACKENDS
from acache_jax.network.kv import PoolAccess, distinct_past_end
from acache_jax.network.sharding import KV_AXES, RULES, constrain_kv, model_axis_size, rows_axis
from pallas_kernels import MASK_VALUE, anchor_importance, gathered_attention, merge_partials, rope, supported_on_gpu

def default_backend(head_dim: int) -> str:
    """The Pallas kernel on a GPU (where it compiles for this head dim), the plain jnp path elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" and supported_on_gpu(head_dim) else "xla"


def resolve_backend(backend: str | None, head_dim: int) -> str:
    """The backend a forward runs: the one asked for (checked), else `default_backend`."""
    backend = backend or default_backend(head_dim)
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")
    return backend


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array) -> jax.Array:
    """Masked softmax attention. q: [B, Tq, Hq, D] (rotated), k/v: [B, Tk, Hkv, D], valid: [B, Tk].

    Query head h reads kv head h // (Hq // Hkv). Scores and softmax in fp32.
    """
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, tq, hkv, hq // hkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    # MASK_VALUE (finite): a query whose keys are all invalid (a padding row) yields a uniform average
    # instead of NaN, and its output is never used.
    scores = jnp.where(valid[:, None, None, None, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, tq, hq, d).astype(q.dtype)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array) -> jax.Array:
    """Same result as `dense_attention` through cuDNN's fused kernel (GPU, bf16).

    cuDNN masks keys only by a per-row length, so valid keys are first moved to the front (attention
    does not depend on key order) and counted.
    """
    order = jnp.argsort(~valid, axis=1, stable=True)
    k = jnp.take_along_axis(k, order[:, :, None, None], axis=1)
    v = jnp.take_along_axis(v, order[:, :, None, None], axis=1)
    lengths = jnp.maximum(valid.sum(axis=1), 1).astype(jnp.int32)
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation="cudnn")


def _gathered(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, slots: jax.Array, lens: jax.Array,
              backend: str, may_be_empty: bool = False) -> tuple[jax.Array, jax.Array]:
    """`gathered_attention` (output, log-sum-exp). Under a mesh the Pallas kernel, which XLA cannot
    split, runs per device over its own query and KV heads (shard_map); the jnp oracle is left to
    the partitioner."""
    attend = lambda *a: gathered_attention(*a, return_lse=True, backend=backend)
    if backend == "xla" and may_be_empty:
        # The jnp path computes every key of a read set, padding included, where the kernel loops
        # over `lens` only. A set no row reads (a fixed-shape engine keeps its second set, empty in
        # a step where no segment needs it) is skipped: its result is that of a set with no keys,
        # a zero output and a log-sum-exp of MASK_VALUE (a constant branch: no second attention
        # to compile).
        empty = lambda q, *_: (jnp.zeros_like(q), jnp.full(q.shape[:3], MASK_VALUE, jnp.float32))
        return jax.lax.cond(lens.any(), attend, empty, q, k_pool, v_pool, slots, lens)
    if backend == "xla" or model_axis_size() == 1:
        return attend(q, k_pool, v_pool, slots, lens)
    rows = rows_axis(q.shape[0])
    heads, kv = P(rows, None, RULES.heads, None), RULES.spec(KV_AXES)
    return jax.shard_map(attend, mesh=jax.sharding.get_abstract_mesh(), in_specs=(heads, kv, kv, P(rows), P(rows)),
                         out_specs=(heads, P(rows, None, RULES.heads)), check_vma=False)(q, k_pool, v_pool, slots, lens)


def _importance(q: jax.Array, k_pool: jax.Array, slots: jax.Array, lens: jax.Array, weights: jax.Array,
                lse: jax.Array | None, backend: str) -> jax.Array:
    """`anchor_importance`; under a mesh the Pallas kernel sums each device's heads, then the
    devices' sums are added (one all-reduce of [rows, keys])."""
    if backend == "xla" or model_axis_size() == 1:
        return anchor_importance(q, k_pool, slots, lens, weights, backend=backend, lse=lse)
    rows = rows_axis(q.shape[0])
    heads, kv = P(rows, None, RULES.heads, None), RULES.spec(KV_AXES)
    args, specs = [q, k_pool, slots, lens, weights], [heads, kv, P(rows), P(rows), P(rows)]
    if lse is not None:
        args.append(lse)
        specs.append(P(rows, None, RULES.heads))

    def local(q, k_pool, slots, lens, weights, lse=None):
        part = anchor_importance(q, k_pool, slots, lens, weights, backend=backend, lse=lse)
        return jax.lax.psum(part, RULES.heads)

    return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(), in_specs=tuple(specs), out_specs=P(rows),
                         check_vma=False)(*args)


def attend_dense(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, valid: jax.Array,
                 rope_theta: float, backend: str | None = None) -> jax.Array:
    """Rows attending to their own tokens. q/k/v: [B, T, H, D] before RoPE; positions, valid: [B, T]."""
    backend = resolve_backend(backend, q.shape[-1])
    q, k = rope(q, positions, rope_theta), rope(k, positions, rope_theta)
    if backend == "xla":
        return dense_attention(q, k, v, valid)
    if backend == "cudnn":
        return cudnn_attention(q, k, v, valid)
    b, t = valid.shape
    order = jnp.argsort(~valid, axis=1, stable=True)  # the kernel reads a row's first `lens` keys
    slots = (jnp.arange(b)[:, None] * t + order).astype(jnp.int32)
    pool = lambda a: a.reshape(b * t, *a.shape[2:])
    return _gathered(q, pool(k), pool(v), slots, valid.sum(axis=1).astype(jnp.int32), backend)[0]


def attend_pool(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, access: PoolAccess,
                rope_theta: float, backend: str | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Write this layer's K/V of the M tokens into the pool, then attend through the read sets.

    q, k, v: [M, H, D] before RoPE; positions: [M]; `access.pool`: this layer's alone (one layer,
    as `Transformer` narrows it). Returns (output [M, Hq, D], the layer's
    updated pool K and V, and when `access.probe_weight` is set the anchor-probe importance
    [S, N] of the probed read set's rows: per row, the probe-weighted sum over queries and heads of
    the softmax over that set's rows alone).
    """
    backend = resolve_backend(backend, q.shape[-1])
    (layer_k,), (layer_v,) = access.pool.k, access.pool.v
    write = distinct_past_end(access.write_slots, layer_k.shape[0])
    pool_k = constrain_kv(layer_k.at[write].set(rope(k[None], positions[None], rope_theta)[0].astype(layer_k.dtype),
                                                mode="drop", unique_indices=True))
    pool_v = constrain_kv(layer_v.at[write].set(v.astype(layer_v.dtype), mode="drop", unique_indices=True))
    m, hq, d = q.shape
    tile = lambda a: jnp.take(a, access.tiles, axis=0, mode="fill", fill_value=0)  # index M: an empty place
    per_tile = lambda a: a[access.tile_segment]
    reads = [(rope(q[None], (positions - rs.offset[access.segment])[None], rope_theta)[0], rs)
             for rs in access.reads]
    importance = None
    if backend == "cudnn":  # one query per token: every set's keys turned to the token's own frame instead
        keys, values, valid = [], [], []
        for _, rs in reads:
            slots, offset = per_tile(rs.slots), per_tile(rs.offset)
            keys.append(rope(pool_k[slots], jnp.broadcast_to(offset[:, None], slots.shape), rope_theta))
            values.append(pool_v[slots])
            valid.append(jnp.arange(slots.shape[1])[None] < per_tile(rs.lens)[:, None])
        q_own = tile(rope(q[None], positions[None], rope_theta)[0])
        out_tiles = cudnn_attention(q_own, jnp.concatenate(keys, 1), jnp.concatenate(values, 1),
                                    jnp.concatenate(valid, 1))
    else:
        parts = [_gathered(tile(q_read), pool_k, pool_v, per_tile(rs.slots), per_tile(rs.lens), backend, i > 0)
                 for i, (q_read, rs) in enumerate(reads)]
        out_tiles = merge_partials(*map(list, zip(*parts)))
    if access.probe_weight is not None:  # the probed set's softmax, from its attention's log-sum-exp
        q_read, rs = reads[access.probe_read]
        lse = None if backend == "cudnn" else parts[access.probe_read][1]
        scores = _importance(tile(q_read), pool_k, per_tile(rs.slots), per_tile(rs.lens), tile(access.probe_weight),
                             lse, "xla" if backend == "xla" else "pallas")
        importance = jax.ops.segment_sum(scores, access.tile_segment, num_segments=rs.slots.shape[0])
    out = jnp.zeros((m, hq, d), q.dtype).at[distinct_past_end(access.tiles.reshape(-1), m)].set(
        out_tiles.reshape(-1, hq, d), mode="drop", unique_indices=True)
    return out, pool_k, pool_v, importance
