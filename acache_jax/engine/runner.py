"""Device side of the engine: the KV pool, and a plan turned into device inputs and run.

An iteration is two jitted calls dispatched back to back, each with its inputs in one int32
buffer (`pack`), with one wait for both results:
- the packed forward: every planned segment's tokens side by side on one token axis (probes of new
  requests, recomputes of requests at a block start, one in-block step of the others), padded to
  a token axis (`Runner.token_axis`: `layout.token_bucket`, at most about 1/8 more, or an axis
  already compiled, at most 1.5x), with the block commits and the probes' rankings;
- the block loop: in-block steps of the recomputed and decoding requests, on the device, until
  one of them has finished its block.
Under the hkvd selectors a new request's anchors come from a third call instead of the packed
forward's probe: a dense forward of its text (hkvd_block: and first block) scored against the
affix K/V in its shared slots (`deviation_ranking`).
Tokens write their K/V into the pool and read their request's slots (acache_jax/network/kv.py); padding
tokens write nowhere and sit in no query tile.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import math
import os
import threading
import time
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from acache_jax.decoding.acache import DEVIATION_SELECTORS, PROBE_SIGN, Ranking, affix_deviation, anchor_ranking
from acache_jax.decoding.layout import bucket, round_up, row_bucket, token_bucket
from acache_jax.decoding.sampling import Commits, SamplerConfig, SamplerValues
from acache_jax.engine.pool import PagedPool
from acache_jax.engine.scheduler import Plan, StepOutput, Work
from acache_jax.engine.sequence import SequenceState
from acache_jax.network.attention import resolve_backend
from acache_jax.network.config import DecodeConfig
from acache_jax.network.kv import (AffixCache, KVPool, PoolAccess, ReadSet, distinct_past_end, flat_index,
                                   reads_affix_in_own_set, rotated_from_zero, rows_access)
from acache_jax.network.model import ForwardInputs, Structure

TILE_ROWS = 128  # the kernel's query rows per attention tile (tokens x the query heads of one kv head)
# The jnp attention computes every query row of a tile, padding included, and a segment's last tile
# is partial: a packed step of M tokens in S segments computes up to (M + S x tile) rows. Short
# tiles waste less; each tile gathers its read sets once, so not too short. On a CPU, tiles of 128
# tokens made a packed step of the fixture LLaDA 22 ms (32 tokens: 13 ms) and the soak's server
# (tests/test_soak.py, shipped llada-small) answered 25 requests/s (32 tokens: 35).
XLA_TILE_TOKENS = 32
# A packed step may run on an already compiled token axis up to this many times its tokens long
# rather than compile its own bucket (see Runner.token_axis).
REUSE_PADDING = 1.5
# With fixed shapes, the token axes: four per octave from 128 tokens (at most 1/4 padding, 24 sizes
# up to 16k tokens), so that every program a server can need is known and compiled at start.
FIXED_AXIS = dict(floor=128, ceiling=None, per_octave=4)
FIXED_WIDTH_STEP = 16  # with fixed shapes, the read sets' width: the context rounded up to this
# The block loop is compiled to CUDA graphs on a GPU, its while loop included (conditional nodes):
# an in-block step is some 15 kernels a layer, most of them small, and launched one by one the
# device waits on the host between them. On an H100 the in-block step at B1 went from 7.8-8.4 to 7.4-7.7 ms and
# B1 tokens/s up 2-8% (docs/BENCHMARKS.md, "Command buffers for the block loop"). The packed step is
# left as it is: the same flags process-wide gained nothing in tokens/s. Other backends ignore them.
LOOP_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
                         "xla_gpu_graph_min_graph_size": "1"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedStep:
    """The packed forward's inputs: M tokens of S segments (row S-1 of the read sets is empty:
    padding tiles read it) and the commits of the segments with logits."""

    tokens: jax.Array  # [M]
    positions: jax.Array  # [M]
    write_slots: jax.Array  # [M] (num_slots: padding)
    segment: jax.Array  # [M] (padding: -1)
    tiles: jax.Array  # [n_tiles, bq] token indices (M: empty)
    tile_segment: jax.Array  # [n_tiles]
    reads: tuple[ReadSet, ...]  # [S, N] each: the private rows, then (acache) the shared affix
    logit_index: jax.Array  # [S, bl] token indices of each segment's block (0 where it commits nothing)
    commits: Commits  # [S], each with its request's sampler numbers (the program's config keeps only the rules)
    probe_weight: jax.Array | None  # [M] mask tokens of probed segments (None: no probe this step)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockLoop:
    """The block loop's rows: which segments (S-1: padding), their block's write slots and
    positions."""

    rows: jax.Array  # [R]
    write_slots: jax.Array  # [R, bl]
    positions: jax.Array  # [R, bl]


class Packing(NamedTuple):
    """Where each leaf of a pytree of 32-bit numpy arrays sits in one int32 buffer (static: hashable)."""

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) per leaf, in buffer order


def pack(tree: Any) -> tuple[Packing, np.ndarray]:
    """A step's inputs as one int32 buffer: one host-to-device copy per iteration, not one per leaf
    (each copy of a small array costs the host about as much as a large one)."""
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [np.asarray(a) for a in leaves]
    as_int = lambda a: a.astype(np.int32) if a.dtype == np.bool_ else np.ascontiguousarray(a).view(np.int32)
    buffer = np.concatenate([as_int(a).reshape(-1) for a in leaves])
    return Packing(treedef, tuple((a.shape, a.dtype.str) for a in leaves)), buffer


def unpack(packing: Packing, buffer: jax.Array) -> Any:
    """The pytree `pack` made, on the device (inside the jitted step: the slices are free)."""
    leaves, at = [], 0
    for shape, dtype in packing.leaves:
        n = math.prod(shape)
        part, at = buffer[at:at + n].reshape(shape), at + n
        dtype = np.dtype(dtype)
        leaves.append(part != 0 if dtype == np.bool_ else part if dtype == np.int32
                      else jax.lax.bitcast_convert_type(part, dtype))
    return jax.tree.unflatten(packing.treedef, leaves)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4,))
def packed_step(structure: Structure, cfg: DecodeConfig, packing: Packing, params: list[jax.Array], pool: KVPool,
                buffer: jax.Array) -> tuple[KVPool, Commits, Ranking | None]:
    """(pool after the writes, the segments after their commit, the probed segments' rankings)."""
    step: PackedStep = unpack(packing, buffer)
    probing = step.probe_weight is not None
    access = PoolAccess(pool, step.write_slots, step.segment, step.reads, step.tiles, step.tile_segment,
                        step.probe_weight, probe_read=len(step.reads) - 1)
    out = structure.forward(params, step.tokens, ForwardInputs(step.positions, access=access,
                                                               logit_index=step.logit_index),
                            attn_backend=cfg.attn_backend)
    ranking = None
    if probing:
        score = PROBE_SIGN[cfg.selector] * out.probe
        ranking = anchor_ranking(score, jnp.arange(score.shape[1])[None] < step.reads[-1].lens[:, None],
                                 cfg.anchor_mass)
    commits = step.commits.commit(out.logits, SamplerConfig.of(cfg, structure.config), cfg.steps_per_block)
    return out.pool, commits, ranking


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4,), compiler_options=LOOP_COMPILER_OPTIONS)
def block_loop(structure: Structure, cfg: DecodeConfig, packing: Packing, params: list[jax.Array], pool: KVPool,
               buffer: jax.Array, after: Commits) -> tuple[KVPool, Commits, jax.Array]:
    """In-block steps of the loop rows until one of them has no mask left in its block (the rows
    read what they read in the packed step: the buffer holds the read sets and the `BlockLoop`,
    so the program depends on the read widths and the loop's rows, not on the token bucket).

    Returns the pool, the rows' state and the number of steps run."""
    reads, loop = unpack(packing, buffer)
    mask_id = structure.config.mask_token_id
    rows = jax.tree.map(lambda a: a[loop.rows], after)
    rows = dataclasses.replace(rows, active=rows.active & (loop.rows < reads[0].slots.shape[0] - 1))
    reads = tuple(ReadSet(r.slots[loop.rows], r.lens[loop.rows], r.offset[loop.rows]) for r in reads)
    n, bl = loop.write_slots.shape
    logit_index = flat_index(jnp.broadcast_to(jnp.arange(bl, dtype=jnp.int32), (n, bl)), bl)

    def unfinished(carry):
        state = carry[1]
        masked = (state.block == mask_id).any(-1)
        return (masked | ~state.active).all() & (masked & state.active).any()

    def body(carry):
        pool, state, count = carry
        access = rows_access(pool, loop.write_slots, reads)
        out = structure.forward(params, state.block.reshape(-1), ForwardInputs(loop.positions.reshape(-1),
                                                                                access=access,
                                                                                logit_index=logit_index),
                                attn_backend=cfg.attn_backend)
        commits = state.commit(out.logits, SamplerConfig.of(cfg, structure.config), cfg.steps_per_block)
        return out.pool, commits, count + 1

    pool, rows, count = jax.lax.while_loop(unfinished, body, (pool, rows, jnp.int32(0)))
    return pool, rows, count


@functools.partial(jax.jit, static_argnums=(0, 1))
def deviation_ranking(structure: Structure, cfg: DecodeConfig, params: list[jax.Array], pool: KVPool,
                      tokens: jax.Array, positions: jax.Array, valid: jax.Array, affix_index: jax.Array,
                      shared_slots: jax.Array, affix_valid: jax.Array) -> Ranking:
    """Each probed request's affix indices ([P, N]) best first, by `affix_deviation` of its dense
    forward (tokens [P, T] at `positions`, keys where `valid`; its affix at columns `affix_index`
    [P, N]) against the affix K/V its shared slots [P, N] hold."""
    out = structure.forward(params, tokens, ForwardInputs(positions, valid), with_logits=False,
                            attn_backend=cfg.attn_backend)
    score = affix_deviation(out.k, out.v, affix_index, tuple(k[shared_slots] for k in pool.k),
                            tuple(v[shared_slots] for v in pool.v), structure.config.rope_theta)
    return anchor_ranking(score, affix_valid, cfg.anchor_mass)


def _first(ranking: Ranking, n: int) -> Ranking:
    """The rankings of the first n rows (the probed requests), on the host."""
    return Ranking(*(np.asarray(a)[:n] for a in ranking))


def _store_affix(pool: KVPool, k: tuple[jax.Array, ...], v: tuple[jax.Array, ...], slots: jax.Array,
                 rope_theta: float) -> KVPool:
    """An affix's per-layer K (before RoPE) and V [L, ...] stored in its shared slots [L], K rotated
    at the affix's own positions 0..L-1 (rows whose slot is past the pool are dropped)."""
    slots = distinct_past_end(slots, pool.num_slots)
    put = lambda rows, new: tuple(p.at[slots].set(n.astype(p.dtype), mode="drop", unique_indices=True)
                                  for p, n in zip(rows, new))
    return KVPool(put(pool.k, rotated_from_zero(k, rope_theta)), put(pool.v, v))


@functools.partial(jax.jit, static_argnums=(4,), donate_argnums=(0,))
def fill_affix(pool: KVPool, k: tuple[jax.Array, ...], v: tuple[jax.Array, ...], slots: jax.Array,
               rope_theta: float) -> KVPool:
    """Store an affix cache built beforehand (`build_affix_cache`) in its shared slots: one program
    per shape of the cache's rows (a bucketed cache's padding rows go to slots past the pool)."""
    return _store_affix(pool, k, v, slots, rope_theta)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def compute_affix(structure: Structure, params: list[jax.Array], pool: KVPool, ids: jax.Array,
                  slots: jax.Array) -> KVPool:
    """An affix given as ids [L] run alone at positions 0..L-1 (what `build_affix_cache` computes)
    and stored in its shared slots, in one program: one dispatch where building the cache and
    storing it took three and eager ops between them."""
    out = structure.forward(params, ids[None], ForwardInputs(jnp.arange(ids.shape[0], dtype=jnp.int32)[None]),
                            with_logits=False)
    return _store_affix(pool, tuple(k[0] for k in out.k), tuple(v[0] for v in out.v), slots,
                        structure.config.rope_theta)


def _rows(values: list[np.ndarray], width: int, count: int, fill: int) -> np.ndarray:
    """Stack 1-D int rows into [count, width] padded with `fill`."""
    out = np.full((count, width), fill, np.int32)
    for i, v in enumerate(values):
        out[i, :len(v)] = v
    return out


class Observer(Protocol):
    """Benchmark bookkeeping (eval/bench_engine.py installs one; a server none): the runner reports
    each forward's work to it and, when it asks to be `timed`, each jitted call's device time. The
    runner keeps nothing per forward itself, so that a long-running server's memory stays flat and
    its steps skip the work figures' host arithmetic."""

    timed: bool  # wait for the device after each jitted call to time it (slower: for a breakdown only)

    def forward(self, tokens: int, token_keys: int, logit_rows: int) -> None:
        """One forward, padding excluded: the tokens it computed, the sum over them of the keys
        each read, and the rows it computed logits for."""

    def affix_fill(self, tokens: int) -> None:
        """An affix given as ids run alone to fill its shared slots: one forward of `tokens` tokens,
        each reading all of them, no logits (a built `AffixCache` is stored without a forward)."""

    def call(self, kind: str, steps: int, seconds: float) -> None:
        """(timed only) One jitted call's device time. kind: the packed step's segment kinds joined
        by "+" ("probe+recompute+decode"), "probe" (the hkvd selectors' own forward), "fill" (an
        iteration's affix fills, `steps` of them) or "loop" (the block loop, which ran `steps`
        in-block steps; 1 for the others)."""


class Runner:
    """Runs in a pool's arrays; turns plans into device inputs and runs them (see the module docstring)."""

    def __init__(self, model: Any, config: DecodeConfig, pool: PagedPool, max_batch: int, context: int,
                 observer: Observer | None = None, fixed_shapes: bool = False):
        self.model, self.config, self.max_batch = model, config, max_batch
        self.program_config = config.engine_key()  # the jitted steps' static config
        self.sampler = SamplerValues.of(config)  # the numbers of its rows but those of requests with their own
        self.structure, self.params = model.flat
        self.paged = pool  # its `kv` arrays: `pool`, replaced by every call that writes them
        group = model.config.num_heads // model.config.num_kv_heads
        self.tile_tokens = max(1, TILE_ROWS // (1 << (group - 1).bit_length()))
        if resolve_backend(config.attn_backend, model.config.head_dim) == "xla":
            self.tile_tokens = min(self.tile_tokens, XLA_TILE_TOKENS)
        self.observer = observer
        # Fixed shapes (a server): read widths for the engine's whole context (the longest request it
        # serves) and token axes from FIXED_AXIS, so the programs do not depend on the traffic and
        # `warm_up` can compile them all.
        self.fixed_shapes = fixed_shapes
        # One width for the engine's life, so nothing is gained by rounding it to a bucket; rounding
        # cost the jnp attention (which computes every key of a set, padding included) up to twice
        # the keys: 512 for a context of 266 (docs/BENCHMARKS.md, realistic traffic). The kernel
        # pads to its own key tile.
        width = round_up(context, FIXED_WIDTH_STEP)
        # per read set (private, shared): wide enough for every request queued so far
        self.read_widths = [width, width if config.selective else 0] if fixed_shapes else [0, 0]
        self._token_axes: dict[tuple, list[int]] = {}  # token axes run, per (read widths, probing)

    @property
    def pool(self) -> KVPool:
        return self.paged.kv

    @pool.setter
    def pool(self, kv: KVPool) -> None:
        self.paged.kv = kv

    def _fill_affix(self, affix: AffixCache | list[int], slots: np.ndarray, work: Work) -> None:
        """Store an affix in its shared slots: a built cache as it is, ids computed here. The jitted
        call counts as device time, as the steps' calls do (on a GPU it can return only when the
        affix's forward is done: 18 ms of a 920-token affix at LLaDA-8B shape)."""
        if isinstance(affix, AffixCache):
            padded = np.full(affix.k[0].shape[0], self.pool.num_slots, np.int32)  # padding rows: dropped
            padded[:len(slots)] = slots
            slots = jax.device_put(padded)
            call = lambda: fill_affix(self.pool, affix.k, affix.v, slots, self.model.config.rope_theta)
        else:
            ids, slots = jax.device_put((np.asarray(affix, np.int32), np.asarray(slots, np.int32)))
            call = lambda: compute_affix(self.structure, self.params, self.pool, ids, slots)
            if self.observer is not None:
                self.observer.affix_fill(len(affix))
        called = time.perf_counter()
        self.pool = call()
        work.device_seconds += time.perf_counter() - called
        work.affix_fills += 1

    def reserve(self, seq: SequenceState) -> None:
        """Widen the read sets for a queued request (its private columns; under acache its affix,
        which its probe reads whole). Widths only grow over the runner's life: the rows past a
        segment's length are never read, and a width that changed with every mix of requests would
        compile a program per mix; sized when requests are queued, not when first scheduled, they
        change once for a queue of requests rather than as each longer one starts."""
        if self.fixed_shapes:  # sized for the context, which bounds every request the engine takes
            return
        own = seq.num_columns if self._reads_whole(seq) else seq.num_private(seq.num_anchors)
        needed = (own, seq.affix_len if seq.shares_affix else 0)
        self.read_widths = [max(w, bucket(max(1, n))) for w, n in zip(self.read_widths, needed)]

    def token_axis(self, n: int, probing: bool, sets: int = 2) -> int:
        """The packed axis for a step of n tokens (with fixed shapes: its FIXED_AXIS bucket): the
        shortest one this runner has already run (with these read widths, its first `sets` read
        sets, and the same probe use: one program) that is at most REUSE_PADDING x n long, else
        `token_bucket(n)`. Under traffic the token count changes every iteration; a program per
        bucket would compile for seconds (a minute at 8B) whenever a new count appears, while
        padding costs only the padded tokens' projections and MLP. Deterministic: the same sequence
        of plans picks the same axes."""
        if self.fixed_shapes:
            return token_bucket(n, **FIXED_AXIS)
        sizes = self._token_axes.setdefault((*self.read_widths[:sets], probing), [])
        fit = [m for m in sizes if n <= m <= REUSE_PADDING * n]
        if fit:
            return min(fit)
        sizes.append(token_bucket(n))
        return sizes[-1]

    def _reads_whole(self, seq: SequenceState) -> bool:
        """After its probe, the request reads its shared affix rows in its own read set
        (`kv.reads_affix_in_own_set`; a row's columns are its positions). DropNA reads no shared row."""
        return seq.shares_affix and reads_affix_in_own_set(seq.row.affix_start) and not self.config.drop_non_anchor

    def _read_sets(self, plan: Plan, n_rows: int, second: bool = False) -> tuple[tuple[ReadSet, ...], np.ndarray]:
        """Per segment (then empty rows): its private slots, and under acache its shared affix slots
        (`_reads_whole`: every slot in the first set); and the number of keys each segment reads.
        A step in which no segment reads a second set has none (`second`: an empty one all the
        same, for `warm_up`). An empty set is not free: at LLaDA-8B shape its attention calls and
        merge cost every step about a tenth (docs/BENCHMARKS.md, "Which requests pay")."""
        whole = [self._reads_whole(s) and not s.needs_probe for s in plan.segments]
        maps = [s.read_slot_map for s in plan.segments]
        sets = [([m if w else m[s.own_columns if s.needs_probe else s.private_columns]
                  for s, m, w in zip(plan.segments, maps, whole)], np.zeros(n_rows, np.int32))]
        if self.config.selective:
            shared = [m[s.row.affix_columns] if s.needs_probe else m[:0] if w else m[s.shared_columns]
                      for s, m, w in zip(plan.segments, maps, whole)]
            if self.config.drop_non_anchor:  # DropNA: the probe still reads the whole affix
                shared = [v if s.needs_probe else v[:0] for s, v in zip(plan.segments, shared)]
            offsets = np.zeros(n_rows, np.int32)
            offsets[:len(plan.segments)] = [s.row.affix_start for s in plan.segments]
            if second or any(len(v) for v in shared):
                sets.append((shared, offsets))
        keys = sum(np.asarray([len(x) for x in v]) for v, _ in sets)
        assert all(len(x) <= w for w, (v, _) in zip(self.read_widths, sets) for x in v), "a request was not reserved"
        return tuple(ReadSet(_rows(v, w, n_rows, 0), np.asarray([len(x) for x in v] + [0] * (n_rows - len(v)), np.int32),
                             off) for w, (v, off) in zip(self.read_widths, sets)), keys

    def _packed(self, plan: Plan, reads: tuple[ReadSet, ...], n_rows: int, axis: int | None = None,
                probing: bool | None = None) -> tuple[PackedStep, np.ndarray]:
        """The plan's packed forward, and the tokens it computes for each segment (axis, probing: set
        only to compile an empty plan's program)."""
        cfg, mask_id = self.config, self.model.config.mask_token_id
        bl = cfg.block_length
        seqs = plan.segments
        columns = [s.forward_columns for s in seqs]
        lengths = np.asarray([len(c) for c in columns], np.int64)
        starts = np.cumsum(lengths) - lengths
        m_real = int(lengths.sum())
        probing = bool(plan.probe) if probing is None else probing
        m = axis or self.token_axis(m_real, probing, len(reads))
        tokens = np.full(m, self.model.config.pad_token_id, np.int32)
        positions = np.zeros(m, np.int32)
        write = np.full(m, self.pool.num_slots, np.int32)
        segment = np.full(m, -1, np.int32)
        weight = np.zeros(m, np.float32)
        logit_index = np.zeros((n_rows, bl), np.int32)
        for i, (seq, cols, start) in enumerate(zip(seqs, columns, starts)):
            span = slice(start, start + len(cols))
            tokens[span], positions[span], segment[span] = seq.tokens[cols], cols, i
            write[span] = seq.read_slot_map[cols]
            if seq.needs_probe:
                weight[span] = seq.tokens[cols] == mask_id
            else:
                logit_index[i] = start + np.searchsorted(cols, seq.block_columns)
        # Query tiles of q tokens from each segment's start (its last one partial). As many tiles as
        # any plan with this token bucket and row count can need (each segment adds at most one
        # partial tile), so the tile count adds no program shapes of its own.
        q = self.tile_tokens
        counts = -(-lengths // q)
        n_tiles = m // q + n_rows
        assert counts.sum() <= n_tiles, (counts.sum(), n_tiles)
        first_tile = np.repeat(np.cumsum(counts) - counts, counts)
        tile_start = np.repeat(starts, counts) + q * (np.arange(counts.sum()) - first_tile)
        token_index = tile_start[:, None] + np.arange(q)[None]
        tile_rows = np.full((n_tiles, q), m, np.int32)
        tile_rows[:len(tile_start)] = np.where(token_index < np.repeat(starts + lengths, counts)[:, None], token_index, m)
        tile_seg = np.full(n_tiles, n_rows - 1, np.int32)
        tile_seg[:len(tile_start)] = np.repeat(np.arange(len(seqs)), counts)
        commits = self._commits(seqs, n_rows, block_start=[False] * len(plan.probe) + [True] * len(plan.recompute)
                                + [False] * len(plan.decode), active=[not s.needs_probe for s in seqs])
        return PackedStep(tokens, positions, write, segment, tile_rows, tile_seg, reads, logit_index, commits,
                          weight if probing else None), lengths

    def _commits(self, seqs: list[SequenceState], n_rows: int, block_start: list[bool], active: list[bool]) -> Commits:
        pad = lambda values, dtype: np.asarray(list(values) + [0] * (n_rows - len(values)), dtype)
        blocks = _rows([s.tokens[s.block_columns] for s in seqs], self.config.block_length, n_rows,
                       self.model.config.mask_token_id)
        return Commits(blocks, pad([s.seed for s in seqs], np.uint32), pad([s.nfe for s in seqs], np.int32),
                       pad([s.step for s in seqs], np.int32), pad([s.masked_at_start for s in seqs], np.int32),
                       pad(block_start, bool), pad(active, bool),
                       SamplerValues.rows([self.sampler if s.sampler is None else s.sampler for s in seqs], n_rows,
                                          self.sampler))

    def _loop(self, plan: Plan, n_rows: int, loop_rows: int | None = None) -> BlockLoop:
        """The plan's block loop (loop_rows: set only to compile an empty plan's program)."""
        first = len(plan.probe)  # the loop requests are the packed step's segments from here on
        n = loop_rows or row_bucket(len(plan.loop))
        rows = np.full(n, n_rows - 1, np.int32)
        rows[:len(plan.loop)] = np.arange(first, first + len(plan.loop))
        block = [s.block_columns for s in plan.loop]
        write = _rows([s.read_slot_map[c] for s, c in zip(plan.loop, block)], self.config.block_length, n,
                      self.pool.num_slots)
        return BlockLoop(rows, write, _rows(block, self.config.block_length, n, 0))

    def warm_up(self, max_tokens: int, threads: int | None = None, stop: threading.Event | None = None) -> int:
        """Compile, `threads` at a time (default 8, or the CPU count if fewer: more compiles than
        cores only share them, and the compiles in flight are what a stop waits for), every program
        a fixed-shape runner runs for steps of up to `max_tokens` tokens: the packed step at each
        token axis (with and without a probe; under acache, without one, also with and without a
        second read set) and the block loop at each row count (under acache, with and without a
        second read set). Returns how many it compiled: all of them, unless `stop` was set
        meanwhile (a server stopping). Once `stop` is set, or a compile has failed, no compile
        starts: the call returns (or raises that failure) when those in flight end. A failure would
        otherwise leave every other program to fail in turn (at 8B shapes, minutes of them), and a
        process that exits while XLA compiles in its threads aborts."""
        if not self.fixed_shapes:
            raise ValueError("warm_up needs a runner with fixed shapes (the programs depend on the traffic otherwise)")
        n_rows = row_bucket(self.max_batch) + 1
        empty = Plan([], [], [], [])
        # Under acache, steps that read a second set (probes, rows reading their affix apart) and
        # steps that do not; a probing step always reads one.
        selective = self.config.selective
        sets = [self._read_sets(empty, n_rows, second=second)[0]
                for second in ((False, True) if selective else (False,))]
        axes = [token_bucket(1, **FIXED_AXIS)]
        while axes[-1] < max_tokens:
            axes.append(token_bucket(axes[-1] + 1, **FIXED_AXIS))
        kinds = [(reads, False) for reads in sets] + ([(sets[1], True)] if selective else [])
        programs = []
        for m, (reads, probing) in itertools.product(axes, kinds):
            packing, buffer = pack(self._packed(empty, reads, n_rows, axis=m, probing=probing)[0])
            programs.append((packed_step, self.structure, self.program_config, packing, self.params, self.pool, buffer))
        after = self._commits([], n_rows, [], [])  # what a packed step hands the block loop, as shapes
        for loop_rows, reads in itertools.product(sorted({row_bucket(n) for n in range(1, self.max_batch + 1)}), sets):
            packing, buffer = pack((reads, self._loop(empty, n_rows, loop_rows)))
            programs.append((block_loop, self.structure, self.program_config, packing, self.params, self.pool, buffer,
                             after))
        failed = threading.Event()

        def compile_one(program: tuple) -> bool:
            if failed.is_set() or (stop is not None and stop.is_set()):
                return False
            try:  # lowered from values like those `run` passes: a later call runs the program compiled here
                program[0].lower(*program[1:]).compile()
            except BaseException:
                failed.set()
                raise
            return True

        with concurrent.futures.ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as ex:
            done = list(ex.map(compile_one, programs))  # the first failure raises, once every task has ended
        return sum(done)

    def _deviation_ranking(self, probe: list[SequenceState], work: Work) -> tuple[Ranking, np.ndarray]:
        """Dispatch the hkvd selectors' forward for the newly admitted (their text, hkvd_block: and
        first block, each column at its own position); their rankings (on the device) and the tokens
        it computes for each."""
        cfg, mcfg = self.config, self.model.config
        columns = [s.row.columns_through_block(cfg.block_length) if cfg.selector == "hkvd_block"
                   else np.arange(s.num_columns, dtype=np.int32) for s in probe]
        lengths = np.asarray([len(c) for c in columns])
        n_rows, width = row_bucket(len(probe)), bucket(int(lengths.max()))
        affix_width = bucket(max(seq.affix_len for seq in probe))
        spare = n_rows - len(probe)
        tokens = _rows([s.tokens[c] for s, c in zip(probe, columns)], width, n_rows, mcfg.pad_token_id)
        positions = _rows(columns, width, n_rows, 0)
        valid = np.arange(width)[None] < np.concatenate([lengths, np.ones(spare, np.int64)])[:, None]
        affix_index = _rows([np.searchsorted(c, s.row.affix_columns) for s, c in zip(probe, columns)], affix_width,
                            n_rows, 0)
        shared = _rows([s.shared_slots for s in probe], affix_width, n_rows, 0)
        affix_valid = np.arange(affix_width)[None] < np.asarray([s.affix_len for s in probe] + [0] * spare)[:, None]
        work.padded_tokens += n_rows * width
        if self.observer is not None:
            self.observer.forward(int(lengths.sum()), int((lengths ** 2).sum()), 0)
        inputs = jax.device_put((tokens, positions, valid, affix_index, shared, affix_valid))
        return deviation_ranking(self.structure, self.program_config, self.params, self.pool, *inputs), lengths

    def _no_loop_output(self, ranking: Ranking | None, forward_tokens: np.ndarray, work: Work) -> StepOutput:
        """What an iteration without loop requests returns: only the probed requests' rankings."""
        return StepOutput(np.zeros((0, self.config.block_length), np.int32), np.zeros(0, np.int64),
                          np.zeros(0, np.int64), ranking, forward_tokens, work)

    def run(self, plan: Plan) -> StepOutput:
        """Run one iteration of the plan, its affix fills first; what the host must know. Mutates no
        sequence: what each request got comes back in the output, for the scheduler to apply."""
        work, forward_tokens = Work(), np.zeros(len(plan.segments), np.int64)
        timed = self.observer is not None and self.observer.timed
        start = time.perf_counter()
        for seq in plan.fills:
            self._fill_affix(seq.affix_source, seq.shared_slots, work)
        if timed and plan.fills:  # apart: else the next call's time would hold the fills' forwards
            jax.block_until_ready(self.pool)
            self.observer.call("fill", len(plan.fills), time.perf_counter() - start)
        if plan.empty:
            return self._no_loop_output(None, forward_tokens, work)
        cfg = self.program_config
        probed, ranking = len(plan.probe), None
        if plan.probe and cfg.selector in DEVIATION_SELECTORS:  # ranked by their own call, not the probe
            start = time.perf_counter()
            ranking, forward_tokens[:probed] = self._deviation_ranking(plan.probe, work)
            if timed:
                jax.block_until_ready(ranking)
                self.observer.call("probe", 1, time.perf_counter() - start)
            plan = dataclasses.replace(plan, probe=[])
            if plan.empty:
                called = time.perf_counter()
                ranking = _first(jax.device_get(ranking), probed)
                work.device_seconds += time.perf_counter() - called
                return self._no_loop_output(ranking, forward_tokens, work)
        # Rows for max_batch segments whatever the plan holds (the last row stays empty): the
        # packed step's program then depends on its token bucket alone. Spare rows cost only their
        # block's logits, once per iteration.
        n_rows = row_bucket(self.max_batch) + 1
        reads, keys = self._read_sets(plan, n_rows)
        step, lengths = self._packed(plan, reads, n_rows)
        forward_tokens[-len(lengths):] += lengths
        work.padded_tokens += len(step.tokens)
        if self.observer is not None:
            self.observer.forward(int(lengths.sum()), int((lengths * keys[:len(lengths)]).sum()),
                                  cfg.block_length * len(plan.loop))
        step_packing, step_buffer = pack(step)
        loop_packing, loop_buffer = pack((reads, self._loop(plan, n_rows))) if plan.loop else (None, None)
        step_buffer, loop_buffer = jax.device_put((step_buffer, loop_buffer))  # the inputs, in one call
        start = called = time.perf_counter()
        self.pool, after, probe_ranking = packed_step(self.structure, cfg, step_packing, self.params, self.pool,
                                                      step_buffer)
        ranking = probe_ranking if ranking is None else ranking
        if timed:
            jax.block_until_ready(after)
            kinds = "+".join(k for k, v in (("probe", plan.probe), ("recompute", plan.recompute),
                                            ("decode", plan.decode)) if v)
            self.observer.call(kinds, 1, time.perf_counter() - start)
            start = time.perf_counter()
        rows, count = None, 0
        if plan.loop:
            self.pool, rows, count = block_loop(self.structure, cfg, loop_packing, self.params, self.pool, loop_buffer,
                                                after)
        rows, count, ranking, after = jax.device_get((rows, count, ranking, after))
        work.device_seconds += time.perf_counter() - called
        if timed and plan.loop:
            self.observer.call("loop", int(count), time.perf_counter() - start)
        loop = plan.loop
        ranking = None if ranking is None else _first(ranking, probed)
        if not loop:
            return self._no_loop_output(ranking, forward_tokens, work)
        first = len(plan.probe)
        before_loop = np.asarray(after.nfe)[first:first + len(loop)]
        nfe = np.asarray(rows.nfe)[:len(loop)]
        loop_forwards = nfe - before_loop  # each loop forward with masks left computed its block
        forward_tokens[-len(loop):] += loop_forwards * cfg.block_length
        work.padded_tokens += int(count) * row_bucket(len(loop)) * cfg.block_length
        if self.observer is not None:
            keys = keys[first:first + len(loop)]
            for i in range(int(count)):  # the loop runs while every row still has masks: all rows compute
                rows_left = int((loop_forwards > i).sum())
                self.observer.forward(rows_left * cfg.block_length, int(keys[loop_forwards > i].sum()) * cfg.block_length,
                                      rows_left * cfg.block_length)
        return StepOutput(np.asarray(rows.block)[:len(loop)], nfe - np.asarray([s.nfe for s in loop]),
                          np.asarray(rows.step)[:len(loop)] - np.asarray([s.step for s in loop]), ranking,
                          forward_tokens, work)
