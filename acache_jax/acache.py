"""ACache: a shared affix cache, per-request anchor selection, and the views selective recompute reads.

The affix cache is the affix run alone through the model (positions 0..L-1), keeping per layer K
before RoPE and V. Because keys are rotated where they are read and RoPE attention depends only on
relative positions, the same cache serves the affix at any offset: prefix, infix or suffix.

Per request, the anchor probe runs the request's non-affix tokens against the fixed affix K/V and
scores each affix token by the attention mass the mask-token queries put on it (softmax over affix
keys only, summed over mask queries, heads and layers, in fp32); the top K = min(ceil(r * L), L)
become anchors. At every block start the decode loop recomputes anchors + all non-affix positions,
reading the other affix K/V from the shared cache (see decode.py).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from acache_jax.attention import KVView
from acache_jax.config import SELECTORS
from acache_jax.layout import Batch, RequestError, affix_token_ids
from acache_jax.model import Model

Selector = Literal["attention", "hkvd", "random", "bottom"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AffixCache:
    """K (before RoPE) and V of an affix computed alone; shared by every request that uses it."""

    k: tuple[jax.Array, ...]  # layers x [L, kv_heads, head_dim]
    v: tuple[jax.Array, ...]  # layers x [L, kv_heads, head_dim]
    ids: jax.Array  # [L] int32 (a leaf, not static: another affix of the same length reuses programs)
    model_fingerprint: str = dataclasses.field(metadata=dict(static=True))

    @property
    def length(self) -> int:
        return self.ids.shape[0]

    def view(self, positions: jax.Array, valid: jax.Array) -> KVView:
        """The cache as every row's external keys: row b reads affix token n at positions[b, n]."""
        slots = jnp.broadcast_to(jnp.arange(self.length, dtype=jnp.int32), positions.shape)
        return KVView(self.k, self.v, positions, valid, slots)


def build_affix_cache(model: Model, affix_ids) -> AffixCache:
    """Run the affix alone (positions 0..L-1) once; the result serves any number of requests."""
    ids = affix_token_ids(affix_ids)
    if not ids:
        raise RequestError("the affix is empty")
    if len(ids) > model.config.max_seq_len:
        raise RequestError(f"the affix has {len(ids)} tokens, more than the model's context of {model.config.max_seq_len}")
    bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
    if bad:
        raise RequestError(f"affix token ids outside the vocabulary [0, {model.config.vocab_size}): {bad[:5]}")
    tokens = jnp.asarray([ids], jnp.int32)
    out = model.forward(tokens, jnp.arange(len(ids), dtype=jnp.int32)[None], with_logits=False)
    return AffixCache(tuple(k[0] for k in out.k), tuple(v[0] for v in out.v), tokens[0], model.fingerprint)


def check_affix_cache(model: Model, affix: AffixCache) -> None:
    if affix.model_fingerprint != model.fingerprint:
        raise RequestError("this affix cache was built with another model (or other weights); rebuild it with "
                           "build_affix_cache(model, affix_ids)")


def _non_affix_view(batch: Batch):
    """Column indices [B, T - L] of every non-affix column in order (padding columns included)."""
    order = jnp.argsort(batch.affix_columns(), axis=1, stable=True)
    return order[:, : batch.tokens.shape[1] - batch.affix_len]


def affix_positions(batch: Batch) -> jax.Array:
    """[B, L] absolute positions of each row's affix tokens."""
    return jnp.take_along_axis(batch.positions, batch.affix_column_index(), axis=1)


def probe_importance(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, affix: AffixCache,
                     mask_id: int, attn_backend: str | None = None) -> jax.Array:
    """[B, L] anchor-probe importance: the request's non-affix tokens forward against the fixed
    affix K/V; the mask-token queries' softmax over affix keys, summed over queries, heads, layers."""
    cols = _non_affix_view(batch)
    take = lambda a: jnp.take_along_axis(a, cols, axis=1)
    tokens, valid = take(batch.tokens), take(batch.valid)
    kv = affix.view(affix_positions(batch), jnp.ones((batch.tokens.shape[0], affix.length), bool))
    out = nnx.merge(graphdef, params)(tokens, take(batch.positions), valid=valid, kv=kv, with_logits=False,
                                      attn_backend=attn_backend, probe=valid & (tokens == mask_id))
    return out.probe


def hkvd_deviation(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, affix: AffixCache,
                   attn_backend: str | None = None) -> jax.Array:
    """[B, L] CacheBlend-style deviation: per affix token, the L2 norm over all layers of the
    difference between its K/V in the full request (one full forward) and in the affix-only cache."""
    out = nnx.merge(graphdef, params)(batch.tokens, batch.positions, valid=batch.valid, with_logits=False,
                                      attn_backend=attn_backend)
    cols = batch.affix_column_index()
    total = 0.0
    for full, cached in ((out.k, affix.k), (out.v, affix.v)):
        for layer_full, layer_cached in zip(full, cached):
            here = jnp.take_along_axis(layer_full, cols[:, :, None, None], axis=1).astype(jnp.float32)
            total = total + jnp.sum((here - layer_cached[None].astype(jnp.float32)) ** 2, axis=(2, 3))
    return jnp.sqrt(total)


def select_anchors(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, affix: AffixCache, k: int,
                   selector: Selector, mask_id: int, attn_backend: str | None = None) -> jax.Array:
    """[B, k] sorted affix-relative anchor indices per row (ties: the lower index ranks first)."""
    b = batch.tokens.shape[0]
    if selector == "attention":
        score = probe_importance(graphdef, params, batch, affix, mask_id, attn_backend)
    elif selector == "bottom":
        score = -probe_importance(graphdef, params, batch, affix, mask_id, attn_backend)
    elif selector == "hkvd":
        score = hkvd_deviation(graphdef, params, batch, affix, attn_backend)
    elif selector == "random":
        score = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 7), (affix.length,)))(batch.keys)
    else:
        raise RequestError(f"unknown anchor selector {selector!r}; choose one of {SELECTORS}")
    top = jnp.argsort(-score, axis=1, stable=True)[:, :k]
    return jnp.sort(top, axis=1).astype(jnp.int32).reshape(b, k)


select_anchors_jit = jax.jit(select_anchors, static_argnums=(0, 4, 5, 6, 7))
