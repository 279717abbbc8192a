"""The KV types: a pool of K/V rows, the read sets a forward's tokens attend to, and the affix cache.

One representation serves the static path and the engine. A pool holds, per layer, K rotated at
the position it was computed at and V. A forward writes its tokens' K/V into pool rows first, then
each token reads the rows of its segment (a request, or a batch row) through read sets. A read
set is a list of pool rows read at one rotation offset: rows stored rotated at positions p - o
are read by rotating the query by -o as well (RoPE scores depend only on position differences),
so an affix computed alone at positions 0..L-1 serves any placement without rotating a key.
A segment reads at most two sets: its own rows (offset 0) and a shared affix (offset = the
affix's first position in the segment). An affix at position 0 is read at offset 0 as well, so
once its anchors are chosen such a segment reads its shared rows in its own set: one set, one
attention call a layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jax.sharding import Mesh

from acache_jax.network.config import ModelConfig
from acache_jax.network.sharding import kv_sharding
from pallas_kernels import rope


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPool:
    """Per layer, K (rotated at the position it was computed at) and V of every slot."""

    k: tuple[jax.Array, ...]  # layers x [num_slots, kv_heads, head_dim]
    v: tuple[jax.Array, ...]  # layers x [num_slots, kv_heads, head_dim]

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_slots: int, dtype: Any, mesh: Mesh | None = None) -> KVPool:
        """An empty pool; on a mesh, created split by KV head (never whole on one device)."""
        shape = (num_slots, cfg.num_kv_heads, cfg.head_dim)
        device = None if mesh is None else kv_sharding(mesh)
        return cls(*(tuple(jnp.zeros(shape, dtype, device=device) for _ in range(cfg.num_layers)) for _ in range(2)))

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    @staticmethod
    def slot_bytes(cfg: ModelConfig, dtype: Any) -> int:
        """Bytes of one slot (a token's K and V in every layer) of the pool `zeros` makes for this
        config and dtype: what sizes a pool before it exists (a server's budget) and after."""
        return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ReadSet:
    """Pool rows each segment's tokens read at one rotation offset (a segment's real rows first)."""

    slots: jax.Array  # [S, N] int32 pool rows; entries at or past `lens` are ignored
    lens: jax.Array  # [S] int32 rows each segment reads
    offset: jax.Array  # [S] int32: the rows are stored rotated at (their position - offset)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PoolAccess:
    """How a forward's M tokens use a pool: where their K/V go, which segment each token belongs to,
    what each segment reads, and the query tiles attention runs over (each tile one segment's)."""

    pool: KVPool
    write_slots: jax.Array  # [M] int32 pool row of each token's K/V (num_slots: not written, padding)
    segment: jax.Array  # [M] int32 segment of each token (tokens of a segment are contiguous, in order)
    reads: tuple[ReadSet, ...]  # every segment reads each set (a set may give some segments no rows)
    tiles: jax.Array  # [n_tiles, bq] int32 token indices of each query tile (M: an empty place)
    tile_segment: jax.Array  # [n_tiles] int32 the segment of each tile's tokens
    probe_weight: jax.Array | None = None  # [M] float32: weight of each token as an anchor-probe query
    probe_read: int = dataclasses.field(default=0, metadata=dict(static=True))  # the set the probe scores


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AffixCache:
    """K (before RoPE) and V of an affix computed alone at positions 0..L-1; shared by every
    request with that affix (the pools store K rotated at 0..L-1, `rotated_k`).

    A bucketed build (`build_affix_cache(bucketed=True)`, the server's) keeps the rows of its padded
    run: R >= L rows, those past L never read. Its arrays then have the same shapes for every affix
    of a bucket, so the programs that store it in an engine's pool are one per bucket, not one per
    length (a server meets a new length with every discovered span). `kv()` gives the L rows."""

    k: tuple[jax.Array, ...]  # layers x [R, kv_heads, head_dim], R >= L
    v: tuple[jax.Array, ...]  # layers x [R, kv_heads, head_dim]
    ids: jax.Array  # [L] int32 (a leaf, not static: another affix of the same length reuses programs)
    model_fingerprint: str = dataclasses.field(metadata=dict(static=True))

    @property
    def length(self) -> int:
        return self.ids.shape[0]

    def kv(self) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """(K, V) of the affix's L tokens, without a bucketed build's padding rows."""
        n = self.length
        rows = lambda arrays: arrays if arrays[0].shape[0] == n else tuple(a[:n] for a in arrays)
        return rows(self.k), rows(self.v)

    def rotated_k(self, rope_theta: float) -> tuple[jax.Array, ...]:
        """K as pools store it: rotated at the affix's own positions 0..L-1."""
        return rotated_from_zero(self.kv()[0], rope_theta)

    def pool(self, extra_rows: int, rope_theta: float) -> KVPool:
        """A pool whose rows 0..L-1 hold this affix (K rotated at 0..L-1), then `extra_rows` zero rows."""
        grow = lambda a: jnp.concatenate([a, jnp.zeros((extra_rows, *a.shape[1:]), a.dtype)])
        return KVPool(tuple(map(grow, self.rotated_k(rope_theta))), tuple(map(grow, self.kv()[1])))


def rotated_from_zero(k: tuple[jax.Array, ...], rope_theta: float) -> tuple[jax.Array, ...]:
    """Per-layer K [L, kv_heads, head_dim] before RoPE, rotated at positions 0..L-1 (how a pool
    stores a span computed alone, such as an affix)."""
    positions = jnp.arange(k[0].shape[0], dtype=jnp.int32)[None]
    return tuple(rope(a[None], positions, rope_theta)[0] for a in k)


def reads_affix_in_own_set(affix_offset: Any) -> Any:
    """Whether a row whose affix starts at position `affix_offset` (an int, or an array of them)
    reads its shared affix rows in its own read set. Those rows hold K rotated at 0..L-1
    (`rotated_from_zero`): for an affix at position 0 these are the row's own positions, so the
    row reads every column at offset 0 in column order, as the baseline reads its own rows (one
    attention call a layer, where a second set is a second call and a merge: docs/BENCHMARKS.md).
    Any other row reads them as a second set at its offset. The engine (`Runner`) and the static
    path (`decode._decode`) both lay rows out by this rule, so they compute the same tokens."""
    return affix_offset == 0


def read_set(slots: jax.Array, valid: jax.Array, offset: jax.Array) -> ReadSet:
    """A ReadSet from each segment's candidate rows [S, N] in order and which of them it reads
    [S, N]: the read ones moved to the front, their order kept."""
    order = jnp.argsort(~valid, axis=1, stable=True)
    return ReadSet(jnp.take_along_axis(slots, order, axis=1).astype(jnp.int32), valid.sum(axis=1).astype(jnp.int32),
                   offset.astype(jnp.int32))


def rows_access(pool: KVPool, write_slots: jax.Array, reads: tuple[ReadSet, ...],
                probe_weight: jax.Array | None = None, probe_read: int = 0) -> PoolAccess:
    """The PoolAccess of R rows of F tokens each, flattened row-major: row r is segment r and one
    query tile (write_slots, probe_weight: [R, F])."""
    r, f = write_slots.shape
    tiles = jnp.arange(r * f, dtype=jnp.int32).reshape(r, f)
    return PoolAccess(pool, write_slots.reshape(-1).astype(jnp.int32), jnp.repeat(jnp.arange(r, dtype=jnp.int32), f),
                      reads, tiles, jnp.arange(r, dtype=jnp.int32),
                      None if probe_weight is None else probe_weight.reshape(-1).astype(jnp.float32), probe_read)


def flat_index(index: jax.Array, tokens_per_row: int) -> jax.Array:
    """Indices [R, N] into each row's tokens as indices into the rows flattened row-major."""
    return (jnp.arange(index.shape[0], dtype=jnp.int32)[:, None] * tokens_per_row + index).astype(jnp.int32)


def distinct_past_end(index: jax.Array, size: int) -> jax.Array:
    """A scatter's indices into `size` rows with every entry at or past the end (padding, written
    nowhere) made distinct, so that the scatter may promise unique indices (the real ones are: one
    pool row per token or affix row, one tile place per token). Then XLA's GPU scatter stores each
    element; otherwise it updates each bfloat16 element with a compare-and-swap loop on its 32-bit
    word (the pool writes took about 15 µs a layer for 32 tokens on an H100)."""
    return jnp.where(index < size, index, size + jnp.arange(index.shape[0], dtype=index.dtype))
