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
    """Keys/values a forward reads besides its own tokens: a pool of rows and, per query row, a map.

    Logical key n of batch row b is pool row `slots[b, n]`, rotated at `positions[b, n]`; keys with
    `valid[b, n] == False` are ignored. A dense per-row cache is the special case built by `dense`;
    a shared affix cache is a pool without a batch axis that every row maps into.
    """

    k: jax.Array  # [layers, S, kv_heads, head_dim] keys before RoPE
    v: jax.Array  # [layers, S, kv_heads, head_dim]
    slots: jax.Array  # [B, N] int32 pool row of logical key n
    positions: jax.Array  # [B, N] int32 absolute position of logical key n
    valid: jax.Array  # [B, N] bool

    @classmethod
    def dense(cls, k: jax.Array, v: jax.Array, positions: jax.Array, valid: jax.Array) -> KVView:
        """View a per-row cache k, v: [layers, B, N, kv_heads, head_dim]."""
        layers, batch, n = k.shape[:3]
        slots = jnp.arange(batch * n, dtype=jnp.int32).reshape(batch, n)
        flat = lambda a: a.reshape(layers, batch * n, *a.shape[3:])
        return cls(flat(k), flat(v), slots, positions.astype(jnp.int32), valid)


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


def attend(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    kv: KVView | None,
    layer: int,
    rope_theta: float,
) -> jax.Array:
    """Attention of a forward's queries over [external keys; its own keys].

    q, k_new: [B, T, H, D] before RoPE; positions, valid: [B, T] of the forward's own tokens.
    """
    q = rope(q, positions, rope_theta)
    keys, values, key_pos, key_valid = k_new, v_new, positions, valid
    if kv is not None:
        keys = jnp.concatenate([kv.k[layer][kv.slots], keys], axis=1)
        values = jnp.concatenate([kv.v[layer][kv.slots], values], axis=1)
        key_pos = jnp.concatenate([kv.positions, key_pos], axis=1)
        key_valid = jnp.concatenate([kv.valid, key_valid], axis=1)
    return dense_attention(q, rope(keys, key_pos, rope_theta), values, key_valid)
