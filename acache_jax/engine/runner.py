"""Device side of the engine: the paged KV pool and the jitted steps over it.

Every step takes per-row inputs padded to bucketed shapes, so a bounded set of programs compiles.
Rows read keys only through slot maps; padding entries are invalid keys, and writes aimed at slot
`num_slots` (one past the end) are dropped, so padding never touches the pool.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from acache_jax import sampling
from acache_jax.acache import AffixCache
from acache_jax.attention import KVView
from acache_jax.config import DecodeConfig, ModelConfig
from pallas_kernels import rope


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPool:
    """Per layer, K and V of every slot: layers x [num_slots, kv_heads, head_dim]. K is stored rotated
    at the position it was computed at (an affix: 0..L-1 of the affix alone; a request's own
    columns: their positions), so reads rotate the query by their offset instead of every key."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def bytes_per_slot(self) -> int:
        return 2 * sum(math.prod(a.shape[1:]) * a.dtype.itemsize for a in self.k)


def new_pool(cfg: ModelConfig, num_slots: int, dtype: Any) -> KVPool:
    shape = (num_slots, cfg.num_kv_heads, cfg.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    return KVPool(zeros(), zeros())


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Rows:
    """The tokens a forward computes, per row [R, N] (padding: valid False)."""

    tokens: jax.Array
    positions: jax.Array
    valid: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Reads:
    """Keys a forward reads from the pool, per row [R, N]: slot, position, valid; and per row [R]
    the offset they are read at (the affix's start for shared affix slots, 0 for private slots)."""

    slots: jax.Array
    positions: jax.Array
    valid: jax.Array
    offset: jax.Array

    def view(self, pool: KVPool) -> KVView:
        return KVView(pool.k, pool.v, self.positions, self.valid, self.slots, self.offset)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CommitInputs:
    """Per row [R]: the block's tokens [R, bl] and what its sampling state is."""

    block: jax.Array
    seeds: jax.Array  # the request's seed: keys are fold_in(key(seed), nfe), as in the static path
    nfe: jax.Array  # forward calls the request has had so far
    step: jax.Array  # in-block step (0 at the block start)
    masked_at_start: jax.Array  # masks in the block at its start (LLaDA's fixed schedule)

    def commit(self, logits: jax.Array, cfg: DecodeConfig, mcfg: ModelConfig, block_start: bool) -> jax.Array:
        keys = jax.vmap(lambda seed, n: jax.random.fold_in(jax.random.key(seed), n))(self.seeds, self.nfe)
        masked0 = jnp.arange(self.block.shape[1])[None] < self.masked_at_start[:, None]
        sched = sampling.llada_schedule(masked0, cfg.steps_per_block)
        return sampling.commit_block(self.block, logits, self.step, keys, sched, cfg.sampler(mcfg),
                                     cfg.steps_per_block, block_start)


@dataclasses.dataclass(frozen=True, eq=False)
class Structure:
    """A model's structure as a static argument of the steps, hashed by identity (hashing a graphdef
    walks the module tree), with the parameters passed as a flat list of arrays (flattening an
    nnx.State runs Python per variable): together milliseconds per call for a 32-layer model."""

    graphdef: nnx.GraphDef
    params: Any  # the parameters' treedef

    def model(self, leaves: list[jax.Array]) -> Any:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.params, leaves))


@functools.cache
def structure(graphdef: nnx.GraphDef, params_treedef: Any) -> Structure:
    """One Structure per distinct model structure, so every engine over a model reuses the compiled steps."""
    return Structure(graphdef, params_treedef)


def _scatter(pool: tuple[jax.Array, ...], new: tuple[jax.Array, ...], slots: jax.Array) -> tuple[jax.Array, ...]:
    """Write rows [R, N, H, D] to pool slots [R, N]; slots past the end are dropped."""
    flat = slots.reshape(-1)
    return tuple(p.at[flat].set(n.reshape(-1, *n.shape[2:]).astype(p.dtype), mode="drop") for p, n in zip(pool, new))


@functools.partial(jax.jit, static_argnums=(3,), donate_argnums=(0,))
def fill_affix(pool: KVPool, affix: AffixCache, slots: jax.Array, rope_theta: float) -> KVPool:
    """Store an affix cache (computed alone, as the static path does) in its shared slots [L], K
    rotated at the affix's own positions 0..L-1."""
    positions = jnp.arange(affix.length)[None]
    k = tuple(rope(a[None], positions, rope_theta) for a in affix.k)
    return KVPool(_scatter(pool.k, k, slots[None]), _scatter(pool.v, tuple(a[None] for a in affix.v), slots[None]))


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def recompute_step(structure: Structure, cfg: DecodeConfig, params: list[jax.Array], pool: KVPool, rows: Rows,
                   reads: Reads | None, write_slots: jax.Array, logit_index: jax.Array,
                   commit: CommitInputs) -> tuple[KVPool, jax.Array]:
    """Block start: forward over each row's private columns (reading its other affix K/V from the
    shared slots), K (rotated at its positions) and V written to the row's private slots, then the
    block-start commit."""
    model = structure.model(params)
    out = model(rows.tokens, rows.positions, valid=rows.valid, kv=None if reads is None else reads.view(pool),
                logit_index=logit_index, attn_backend=cfg.attn_backend)
    k = tuple(rope(a, rows.positions, model.cfg.rope_theta) for a in out.k)
    pool = KVPool(_scatter(pool.k, k, write_slots), _scatter(pool.v, out.v, write_slots))
    return pool, commit.commit(out.logits, cfg, model.cfg, block_start=True)


@functools.partial(jax.jit, static_argnums=(0, 1))
def decode_step(structure: Structure, cfg: DecodeConfig, params: list[jax.Array], pool: KVPool, rows: Rows,
                reads: tuple[Reads, ...], commit: CommitInputs) -> jax.Array:
    """In-block step: forward over each row's block alone, every other column read from the pool
    (one read set per offset: the shared affix, the row's private slots)."""
    model = structure.model(params)
    out = model(rows.tokens, rows.positions, valid=rows.valid, kv=tuple(r.view(pool) for r in reads),
                attn_backend=cfg.attn_backend)
    return commit.commit(out.logits, cfg, model.cfg, block_start=False)


@functools.partial(jax.jit, static_argnums=(0, 1))
def probe_step(structure: Structure, cfg: DecodeConfig, params: list[jax.Array], pool: KVPool, rows: Rows,
               reads: Reads) -> jax.Array:
    """Anchor probe: each row's non-affix columns against its affix read from the shared slots.

    Returns the affix indices [R, L] ranked for selection (best first; padding last); the first K
    of a row are its anchors.
    """
    model = structure.model(params)
    mask_id = model.cfg.mask_token_id
    out = model(rows.tokens, rows.positions, valid=rows.valid, kv=reads.view(pool), with_logits=False,
                attn_backend=cfg.attn_backend, probe=rows.valid & (rows.tokens == mask_id))
    score = out.probe if cfg.selector == "attention" else -out.probe
    score = jnp.where(reads.valid, score, -jnp.inf)
    return jnp.argsort(-score, axis=1, stable=True).astype(jnp.int32)
