"""Bidirectional attention over a forward's own tokens plus an optional external KV view.

Keys are stored before RoPE everywhere (caches, affix caches, pools) and rotated here at the
position they are read at, so a cached span can be attended to at any offset.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Finite stand-in for -inf: a query whose keys are all invalid (a padding row) yields a uniform
# average instead of NaN, and its output is never used.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVView:
    """Keys/values a forward reads besides its own tokens.

    Either a dense per-row cache (`slots` is None; k[layer], v[layer]: [B, N, kv_heads, head_dim]) or
    a pool of rows read through a map (k[layer], v[layer]: [S, kv_heads, head_dim]; logical key n of
    batch row b is pool row `slots[b, n]`), so one shared affix cache can serve every row. k and v
    are indexed by layer: a stacked array or a tuple of per-layer arrays. Keys are stored before
    RoPE and rotated at `positions`; keys with `valid == False` are ignored.
    """

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    positions: jax.Array  # [B, N] int32 absolute position of logical key n
    valid: jax.Array  # [B, N] bool
    slots: jax.Array | None = None  # [B, N] int32 pool row of logical key n, or None (dense)

    def rows(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """This layer's keys and values as [B, N, kv_heads, head_dim]."""
        k, v = self.k[layer], self.v[layer]
        return (k, v) if self.slots is None else (k[self.slots], v[self.slots])


ATTENTION_BACKENDS = ("xla", "cudnn")


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE; x: [B, T, H, D], positions: [B, T]. Computed in fp32 (as LLaDA does)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array) -> jax.Array:
    """Masked softmax attention. q: [B, Tq, Hq, D] (rotated), k/v: [B, Tk, Hkv, D], valid: [B, Tk].

    Query head h reads kv head h // (Hq // Hkv). Scores and softmax in fp32.
    """
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, tq, hkv, hq // hkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    scores = jnp.where(valid[:, None, None, None, :], scores, _MASKED)
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


def probe_scores(q: jax.Array, k: jax.Array, queries: jax.Array) -> jax.Array:
    """Anchor-probe importance of each external key (ACache eq. 4-5, one layer).

    q: [B, Tq, Hq, D] and k: [B, N, Hkv, D], both rotated; queries: [B, Tq] bool, the queries that
    count (mask tokens). Softmax over these N keys only, summed over counted queries and all heads.
    Returns [B, N] float32.
    """
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, tq, hkv, hq // hkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhgqk,bq->bk", probs, queries.astype(jnp.float32))


def attend(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    kv: KVView | None,
    layer: int,
    rope_theta: float,
    backend: str = "xla",
    probe: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Attention of a forward's queries over [external keys; its own keys].

    q, k_new: [B, T, H, D] before RoPE; positions, valid: [B, T] of the forward's own tokens.
    probe: [B, T] bool; when given, also returns `probe_scores` of these queries over the external keys.
    """
    q = rope(q, positions, rope_theta)
    keys, values, key_valid = rope(k_new, positions, rope_theta), v_new, valid
    scores = None
    if kv is not None:
        k_ext, v_ext = kv.rows(layer)
        k_ext = rope(k_ext, kv.positions, rope_theta)
        if probe is not None:
            scores = probe_scores(q, k_ext, probe)
        keys = jnp.concatenate([k_ext, keys], axis=1)
        values = jnp.concatenate([v_ext, values], axis=1)
        key_valid = jnp.concatenate([kv.valid, key_valid], axis=1)
    if backend == "xla":
        return dense_attention(q, keys, values, key_valid), scores
    if backend == "cudnn":
        return cudnn_attention(q, keys, values, key_valid), scores
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")
