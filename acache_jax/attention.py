"""Bidirectional attention over a forward's own tokens plus optional external KV views.

A view's keys are stored either before RoPE and rotated here at the position they are read at, or
already rotated at their own positions with a per-row offset: RoPE scores depend only on position
differences, so such a span is read at offset o by rotating the query by -o instead of every key
(what the engine's pool does: no per-key trigonometry in the kernel). Either way a cached span can
be attended to at any offset.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from acache_jax.config import ATTENTION_BACKENDS
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
    are indexed by layer: a stacked array or a tuple of per-layer arrays. Keys with
    `valid == False` are ignored. Without `offset`, keys are stored before RoPE and rotated at
    `positions`; with it, row b's keys are stored already rotated at `positions - offset[b]`.
    """

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    positions: jax.Array  # [B, N] int32 absolute position of logical key n
    valid: jax.Array  # [B, N] bool
    slots: jax.Array | None = None  # [B, N] int32 pool row of logical key n, or None (dense)
    offset: jax.Array | None = None  # [B] int32: keys stored rotated, read at this offset

    def rows(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """This layer's keys and values as [B, N, kv_heads, head_dim]."""
        k, v = self.k[layer], self.v[layer]
        return (k, v) if self.slots is None else (k[self.slots], v[self.slots])


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


def _kernel_form(view: KVView, layer: int, rope_theta: float):
    """(k pool, v pool, slots, lengths, order, RoPE arguments) of one view for the kernels."""
    k, v, slots, k_pos, lens, order = _as_pool(view.k[layer], view.v[layer], view.slots, view.positions, view.valid)
    rot = dict(k_positions=k_pos, rope_theta=rope_theta) if view.offset is None else {}
    return k, v, slots, lens, order, rot


def attend(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    kv: KVView | tuple[KVView, ...] | None,
    layer: int,
    rope_theta: float,
    backend: str | None = None,
    probe: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Attention of a forward's queries over [external keys of every view; its own keys].

    q, k_new: [B, T, H, D] before RoPE; positions, valid: [B, T] of the forward's own tokens.
    probe: [B, T] bool; when given, also returns the anchor-probe importance of these queries over
    the (single) external view's keys ([B, N] float32, `pallas_kernels.anchor_importance`).
    The pallas backend reads each view in place through its slot map and merges those partial
    results with the one over the forward's own keys.
    """
    backend = backend or default_backend(q.shape[-1])
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")
    views = () if kv is None else (kv,) if isinstance(kv, KVView) else tuple(kv)
    if probe is not None and len(views) != 1:
        raise ValueError(f"the anchor probe reads exactly one external view, got {len(views)}")
    q_rot = rope(q, positions, rope_theta)
    kernel_backend = "pallas" if backend == "pallas" else "xla"
    # A view stored rotated is read with the query rotated back by its offset.
    read_q = [q_rot if view.offset is None else rope(q, positions - view.offset[:, None], rope_theta)
              for view in views]
    needs_pool = backend == "pallas" or probe is not None
    pooled = [_kernel_form(view, layer, rope_theta) for view in views] if needs_pool else []
    scores = None
    if probe is not None:
        pool, _, slots, lens, order, rot = pooled[0]
        sorted_scores = anchor_importance(read_q[0], pool, slots, lens, probe, backend=kernel_backend, **rot)
        scores = jnp.zeros_like(sorted_scores).at[jnp.arange(q.shape[0])[:, None], order].set(sorted_scores)
    if backend == "pallas":
        results = [gathered_attention(q_view, k, v, slots, lens, return_lse=True, **rot)
                   for q_view, (k, v, slots, lens, _, rot) in zip(read_q, pooled)]
        # The forward's own keys are rotated once here, not per query block in the kernel.
        k, v, slots, _, lens, _ = _as_pool(rope(k_new, positions, rope_theta), v_new, None, positions, valid)
        results.append(gathered_attention(q_rot, k, v, slots, lens, return_lse=True))
        return merge_partials(*map(list, zip(*results))), scores
    keys, values, key_valid = [], [], []
    for view in views:
        k_ext, v_ext = view.rows(layer)
        if view.offset is None:
            k_ext = rope(k_ext, view.positions, rope_theta)
        else:  # rotations compose: stored at p - o, turned by o more
            k_ext = rope(k_ext, jnp.broadcast_to(view.offset[:, None], view.positions.shape), rope_theta)
        keys.append(k_ext)
        values.append(v_ext)
        key_valid.append(view.valid)
    keys = jnp.concatenate([*keys, rope(k_new, positions, rope_theta)], axis=1)
    values = jnp.concatenate([*values, v_new], axis=1)
    key_valid = jnp.concatenate([*key_valid, valid], axis=1)
    if backend == "xla":
        return dense_attention(q_rot, keys, values, key_valid), scores
    return cudnn_attention(q_rot, keys, values, key_valid), scores
