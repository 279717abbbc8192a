"""Bidirectional attention over a forward's own tokens plus an optional external KV view.

Keys are stored before RoPE everywhere (caches, affix caches, pools) and rotated here at the
position they are read at, so a cached span can be attended to at any offset.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import anchor_importance, gathered_attention, merge_partials, rope, supported_on_gpu

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


ATTENTION_BACKENDS = ("xla", "cudnn", "pallas")


def default_backend(head_dim: int) -> str:
    """The Pallas kernel on a GPU (where it compiles for this head dim), the plain jnp path elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" and supported_on_gpu(head_dim) else "xla"


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


def _as_pool(k: jax.Array, v: jax.Array, slots: jax.Array | None, positions: jax.Array, valid: jax.Array):
    """The kernel's form of a key set: (k pool, v pool, slot map with valid keys first, their
    positions, lengths, the order applied). A dense [B, N, H, D] set becomes a pool of B * N rows."""
    if slots is None:
        b, n = k.shape[:2]
        slots = jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)
        k, v = k.reshape(b * n, *k.shape[2:]), v.reshape(b * n, *v.shape[2:])
    order = jnp.argsort(~valid, axis=1, stable=True)
    take = lambda a: jnp.take_along_axis(a, order, axis=1)
    return k, v, take(slots), take(positions), valid.sum(axis=1).astype(jnp.int32), order


def attend(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    kv: KVView | None,
    layer: int,
    rope_theta: float,
    backend: str | None = None,
    probe: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Attention of a forward's queries over [external keys; its own keys].

    q, k_new: [B, T, H, D] before RoPE; positions, valid: [B, T] of the forward's own tokens.
    probe: [B, T] bool; when given, also returns the anchor-probe importance of these queries over
    the external keys ([B, N] float32, `pallas_kernels.anchor_importance`).
    The pallas backend reads the external keys in place through their slot map and merges that
    partial result with the one over the forward's own keys.
    """
    backend = backend or default_backend(q.shape[-1])
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")
    q = rope(q, positions, rope_theta)
    kernel_backend = "pallas" if backend == "pallas" else "xla"
    scores = ext = None
    if kv is not None and (backend == "pallas" or probe is not None):
        ext = _as_pool(kv.k[layer], kv.v[layer], kv.slots, kv.positions, kv.valid)
        if probe is not None:
            pool, _, slots, k_pos, lens, order = ext
            sorted_scores = anchor_importance(q, pool, slots, lens, probe, k_positions=k_pos, rope_theta=rope_theta,
                                              backend=kernel_backend)
            scores = jnp.zeros_like(sorted_scores).at[jnp.arange(q.shape[0])[:, None], order].set(sorted_scores)
    if backend == "pallas":
        own = _as_pool(k_new, v_new, None, positions, valid)
        parts = [own] if ext is None else [ext, own]
        results = [gathered_attention(q, k, v, slots, lens, k_positions=k_pos, rope_theta=rope_theta, return_lse=True)
                   for k, v, slots, k_pos, lens, _ in parts]
        return merge_partials(*map(list, zip(*results))), scores
    keys, values, key_valid = rope(k_new, positions, rope_theta), v_new, valid
    if kv is not None:
        k_ext, v_ext = kv.rows(layer)
        keys = jnp.concatenate([rope(k_ext, kv.positions, rope_theta), keys], axis=1)
        values = jnp.concatenate([v_ext, values], axis=1)
        key_valid = jnp.concatenate([kv.valid, key_valid], axis=1)
    if backend == "xla":
        return dense_attention(q, keys, values, key_valid), scores
    return cudnn_attention(q, keys, values, key_valid), scores
