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

import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from acache_jax.decoding.layout import Batch, RequestError, bucket, check_affix
from acache_jax.network.config import SELECTORS
from acache_jax.network.kv import AffixCache, read_set, rows_access
from acache_jax.network.model import ForwardInputs, Model, Structure
from acache_jax.network.sharding import place_kv
from pallas_kernels import rope

Selector = Literal["attention", "hkvd", "hkvd_block", "random", "bottom"]


def build_affix_cache(model: Model, affix_ids, bucketed: bool = False) -> AffixCache:
    """Run the affix alone (positions 0..L-1) once; the result serves any number of requests.

    bucketed: run it padded to `layout.bucket(L)` tokens, the padding masked out, and keep the padded
    rows (`AffixCache`), so that affixes of many lengths share a few compiled programs, here and
    where an engine stores the cache (a server meets a new length with every discovered span). The
    real tokens' K/V are those of the unpadded run up to float summation order; use one setting for
    caches whose results are compared."""
    ids = check_affix(affix_ids, model.config)
    n = len(ids)
    padded = bucket(n) if bucketed else n
    tokens = np.full((1, padded), model.config.pad_token_id, np.int32)
    tokens[0, :n] = ids
    out = model.forward(jnp.asarray(tokens), ForwardInputs(jnp.arange(padded, dtype=jnp.int32)[None],
                                                           jnp.arange(padded)[None] < n if bucketed else None),
                        with_logits=False)
    k, v = _first_rows(out.k, out.v, padded)
    return place_kv(AffixCache(k, v, jnp.asarray(ids, jnp.int32), model.fingerprint), model.mesh)


@functools.partial(jax.jit, static_argnums=2)
def _first_rows(k: tuple[jax.Array, ...], v: tuple[jax.Array, ...], n: int):
    """Row 0's first n tokens of each layer's K and V (one program, not one slice per layer)."""
    return tuple(a[0, :n] for a in k), tuple(a[0, :n] for a in v)


def check_affix_cache(model: Model, affix: AffixCache) -> None:
    if affix.model_fingerprint != model.fingerprint:
        raise RequestError("this affix cache was built with another model (or other weights); rebuild it with "
                           "build_affix_cache(model, affix_ids)")


def affix_positions(batch: Batch) -> jax.Array:
    """[B, L] absolute positions of each row's affix tokens."""
    return jnp.take_along_axis(batch.positions, batch.affix_column_index(), axis=1)


def probe_importance(structure: Structure, params: list[jax.Array], batch: Batch, affix: AffixCache,
                     attn_backend: str | None = None) -> jax.Array:
    """[B, L] anchor-probe importance: the request's non-affix tokens forward against the fixed
    affix K/V; the mask-token queries' softmax over affix keys, summed over queries, heads, layers.

    The non-affix tokens write their K/V into private pool rows and read [those rows; the affix
    rows at the affix's offset], as the engine's folded probe does."""
    mcfg = structure.config
    b, t = batch.tokens.shape
    n = t - batch.affix_len
    cols = jnp.argsort(batch.affix_columns(), axis=1, stable=True)[:, :n]  # non-affix columns (padding too)
    take = lambda a: jnp.take_along_axis(a, cols, axis=1)
    tokens, valid = take(batch.tokens), take(batch.valid)
    first_own = affix.length + jnp.arange(b)[:, None] * n
    own = read_set(first_own + jnp.arange(n)[None], valid, jnp.zeros((b,), jnp.int32))
    shared = read_set(jnp.broadcast_to(jnp.arange(affix.length), (b, affix.length)), jnp.ones((b, affix.length), bool),
                      affix_positions(batch)[:, 0])
    access = rows_access(affix.pool(b * n, mcfg.rope_theta), first_own + jnp.arange(n)[None], (own, shared),
                         valid & (tokens == mcfg.mask_token_id), probe_read=1)
    out = structure.forward(params, tokens.reshape(-1), ForwardInputs(take(batch.positions).reshape(-1), access=access),
                            with_logits=False, attn_backend=attn_backend)
    return out.probe


def affix_deviation(k: tuple[jax.Array, ...], v: tuple[jax.Array, ...], affix_index: jax.Array,
                    cached_k: tuple[jax.Array, ...], cached_v: tuple[jax.Array, ...], rope_theta: float) -> jax.Array:
    """[B, N] CacheBlend-style deviation: per affix token, the L2 norm over all layers of the
    difference between its K/V in a forward of the request (k, v: per layer [B, T, kv_heads,
    head_dim], K before RoPE; `affix_index` [B, N]: its affix's columns) and in the affix cache
    (per layer [N, ...] or [B, N, ...], K rotated at 0..N-1 as pools hold it). The request's K is
    compared rotated at 0..N-1 too: the static path and the engine then score the same values."""
    positions = jnp.broadcast_to(jnp.arange(affix_index.shape[1], dtype=jnp.int32), affix_index.shape)
    at = lambda a: jnp.take_along_axis(a, affix_index[:, :, None, None], axis=1)
    total = 0.0
    for layer_k, layer_v, k_cached, v_cached in zip(k, v, cached_k, cached_v):
        for ours, cached in ((rope(at(layer_k), positions, rope_theta), k_cached), (at(layer_v), v_cached)):
            total = total + jnp.sum((ours.astype(jnp.float32) - cached.astype(jnp.float32)) ** 2, axis=(2, 3))
    return jnp.sqrt(total)


def hkvd_deviation(structure: Structure, params: list[jax.Array], batch: Batch, affix: AffixCache,
                   attn_backend: str | None = None) -> jax.Array:
    """[B, L] `affix_deviation` of one full forward of each row."""
    out = structure.forward(params, batch.tokens, ForwardInputs(batch.positions, batch.valid), with_logits=False,
                            attn_backend=attn_backend)
    theta = structure.config.rope_theta
    return affix_deviation(out.k, out.v, batch.affix_column_index(), affix.rotated_k(theta), affix.kv()[1], theta)


class Ranking(NamedTuple):
    """Per request, its affix indices best first, and how many of the best an anchor mass asks for."""

    order: jax.Array  # [B, N]; ties: the lower index first; a row's invalid entries last
    covering: jax.Array  # [B] int32: the fewest best entries holding the mass (N without a mass)

    def kept(self, k_min, k_max):
        """[B] anchors each request keeps: its covering count within the budget's bounds (numpy or
        jax values alike)."""
        return self.covering.clip(k_min, k_max)


def anchor_ranking(score: jax.Array, valid: jax.Array | None = None, mass: float | None = None) -> Ranking:
    """A request's anchors are the first K of its order, the one ranking rule of every path; under
    an adaptive budget K is `Ranking.kept` (on the host in the engine, in `select_anchors` on the
    static path). Negative scores hold no mass."""
    if valid is not None:
        score = jnp.where(valid, score, -jnp.inf)
    order = jnp.argsort(-score, axis=1, stable=True).astype(jnp.int32)
    if mass is None:
        return Ranking(order, jnp.full(score.shape[:1], score.shape[1], jnp.int32))
    held = jnp.cumsum(jnp.maximum(jnp.take_along_axis(score, order, axis=1), 0.0), axis=1)
    covering = jnp.sum(held < mass * held[:, -1:], axis=1, dtype=jnp.int32) + 1
    return Ranking(order, covering)


# What each anchor selector (config.SELECTORS) ranks the affix by: attention / bottom, the probe's
# attention importance, highest / lowest first (bottom: an ablation); hkvd / hkvd_block, how far a
# dense forward's K/V over the request's text (hkvd_block: and its first block) deviate from the affix
# cache's; random, uniform noise.
PROBE_SIGN = {"attention": 1.0, "bottom": -1.0}
DEVIATION_SELECTORS = ("hkvd", "hkvd_block")


def rank_anchors(structure: Structure, params: list[jax.Array], batch: Batch, affix: AffixCache,
                 selector: Selector, attn_backend: str | None = None, block_length: int = 0,
                 mass: float | jax.Array | None = None) -> Ranking:
    """Per row, the affix ranked by `selector` (best first) and, under an anchor `mass`, how many
    of the best hold it: the costly part of the selection (the probe or hkvd forward), which does
    not depend on how many anchors a row then keeps.

    hkvd_block: hkvd over each request's text and first block only (`block_length` masks, not the
    whole generation): the signal hkvd finds comes from there (docs/RESULTS.md), at the cost of
    one forward over the affix, the prompt and one block."""
    if selector in PROBE_SIGN:
        score = PROBE_SIGN[selector] * probe_importance(structure, params, batch, affix, attn_backend)
    elif selector == "hkvd":
        score = hkvd_deviation(structure, params, batch, affix, attn_backend)
    elif selector == "hkvd_block":
        if not 0 < block_length <= batch.gen_length:
            raise RequestError(f"hkvd_block needs a block length in (0, {batch.gen_length}], got {block_length}")
        score = hkvd_deviation(structure, params, batch.through_block(block_length), affix, attn_backend)
    elif selector == "random":
        score = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 7), (affix.length,)))(
            jax.vmap(jax.random.key)(batch.seeds))
    else:
        raise RequestError(f"unknown anchor selector {selector!r}; choose one of {SELECTORS}")
    return anchor_ranking(score, mass=mass)


# The mass is traced (a sweep over masses or budgets compiles the forward once); None is not.
rank_anchors_jit = jax.jit(rank_anchors, static_argnums=(0, 4, 5, 6))


@functools.partial(jax.jit, static_argnums=1)
def first_anchors(ranking: Ranking, width: int, k: int | jax.Array, k_min: int | jax.Array = 0) -> jax.Array:
    """[B, width] sorted affix-relative anchor indices per row: the first `ranking.kept(k_min, k)`
    of its order (k <= width); the rest of its entries are L (no anchor: sorted last, outside the
    affix). Keyed by the width alone: budgets of one width share the program."""
    kept = ranking.kept(k_min, k)  # k without a mass
    n = ranking.order.shape[1]
    return jnp.sort(jnp.where(jnp.arange(width)[None] < kept[:, None], ranking.order[:, :width], n), axis=1)


def select_anchors(structure: Structure, params: list[jax.Array], batch: Batch, affix: AffixCache,
                   k: int, selector: Selector, attn_backend: str | None = None, block_length: int = 0,
                   mass: float | None = None, k_min: int = 0, width: int | None = None) -> jax.Array:
    """[B, width] (default [B, k]) sorted affix-relative anchor indices per row (`rank_anchors`,
    then `first_anchors`). Under an anchor `mass` a row keeps its covering count, clipped to
    [k_min, k], and the rest of its entries are L. Two programs: the ranking's, compiled once
    whatever k, k_min and the mass's value, and a small one per width."""
    ranking = rank_anchors_jit(structure, params, batch, affix, selector, attn_backend, block_length, mass)
    return first_anchors(ranking, k if width is None else width, k, k_min)
