"""Block diffusion decoding (LLaDA / Dream / Fast-dLLM / ACache) as one jitted, bucketed program.

Rows are laid out by `layout.py`. Per block, a block-start forward commits from its logits and
rebuilds the cache, then in-block steps run until the block has no mask left:
- none: full forward every step;
- prefix: block start = full forward; steps see the window from the block start to the end, keys
  before the block come from the block-start cache;
- dual: block start = full forward; steps see the block only, every other key from the cache;
- acache: block start = selective recompute: anchors + every non-affix position, with the other
  affix K/V read from the shared affix cache; steps as in dual (ratio 1 = dual, ratio 0 = direct);
- direct: acache with no anchors (the shared affix cache as is).
The whole generation (all blocks, all steps) is one compiled program: lax loops, no host sync.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from acache_jax.decoding.acache import build_affix_cache, check_affix_cache, select_anchors
from acache_jax.decoding.layout import Batch, Request, as_requests, check_requests, make_batch, round_up
from acache_jax.decoding.sampling import Commits, SamplerConfig, SamplerValues
from acache_jax.network.config import DecodeConfig, DecodeError, resolve_decode_config
from acache_jax.network.kv import AffixCache, KVPool, flat_index, read_set, reads_affix_in_own_set, rows_access
from acache_jax.network.model import ForwardInputs, Model, Structure
from acache_jax.network.sharding import constrain_kv, place_rows, use_mesh


@dataclasses.dataclass
class GenerateResult:
    """Per request: generated ids, forward calls (NFE), forward tokens, and its batch's wall time."""

    tokens: list[np.ndarray]
    anchors: list[np.ndarray]  # sorted affix-relative anchor indices (empty without selective recompute)
    nfe: np.ndarray  # [n] forward calls in which the request still had masks in its block (+1 for the probe)
    forward_tokens: np.ndarray  # [n] real tokens of the request those calls computed
    seconds: np.ndarray  # [n] wall time of the batch the request ran in (compilation included)
    batch_forward_calls: int  # forward calls over all batches (a batch call counts once)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeStats:
    nfe: jax.Array  # [B] forward calls in which the row still had masks in its block
    forward_tokens: jax.Array  # [B] real tokens of the row those calls computed
    calls: jax.Array  # [] forward calls of the batch


def _decode(structure: Structure, params: list[jax.Array], batch: Batch, cfg: DecodeConfig,
            affix: AffixCache | None = None, anchors: jax.Array | None = None,
            sampler: SamplerValues | None = None) -> tuple[jax.Array, DecodeStats]:
    """The whole generation of one batch. Selective policies need `affix` and `anchors` [B, A]
    (A anchors per row). `sampler`: the sampler's numbers, traced (`cfg` a program key); None: those
    of `cfg`, compiled in.

    Every forward writes its tokens' K/V into one pool and reads its row's keys from it (kv.py):
    full policies own B x T rows; selective ones read the affix from L shared rows (K rotated at
    0..L-1, read at the row's affix offset) and own B x (T - L + A) rows for their private columns.
    """
    mcfg = structure.config
    mask_id, bl, g0 = mcfg.mask_token_id, cfg.block_length, batch.gen_start
    b, t = batch.tokens.shape
    col = jnp.arange(t)[None]
    gen_cols = (col >= g0) & (col < g0 + cfg.gen_length)
    prompt = batch.valid & ~gen_cols  # what classifier-free guidance masks out
    guided = cfg.cfg_scale > 0
    rows = 2 * b if guided else b  # CFG: the unconditional copies (prompt masked) as extra rows
    dup = (lambda a: jnp.concatenate([a, a])) if guided else (lambda a: a)
    take = lambda a, cols: jnp.take_along_axis(a, cols, axis=1)
    zero = jnp.zeros((rows,), jnp.int32)
    positions = dup(batch.positions)

    def run(tokens, pos, write, reads, pool, logit_index, prompt_mask=None):
        """Rows of tokens through the pool; logits [B, Tl, V] (CFG: combined with the copies whose
        `prompt_mask` tokens are masked)."""
        if guided:
            tokens = jnp.concatenate([tokens, jnp.where(prompt_mask, mask_id, tokens)])
        f = tokens.shape[1]
        out = structure.forward(params, tokens.reshape(-1),
                                ForwardInputs(pos.reshape(-1), access=rows_access(pool, write, reads),
                                              logit_index=flat_index(dup(logit_index), f)),
                                attn_backend=cfg.attn_backend)
        logits = out.logits
        if guided:
            cond, uncond = jnp.split(logits, 2)
            logits = uncond + (cfg.cfg_scale + 1) * (cond - uncond)
        return logits, out.pool

    scfg = SamplerConfig.of(cfg, mcfg)
    numbers = SamplerValues.of(cfg) if sampler is None else sampler  # every row's
    numbers = jax.tree.map(lambda v: jnp.full((b,), v, jnp.float32), numbers)

    def commit(x, s, logits, step, nfe, masked_at_start, block_start: bool):
        """x after one commit on its block at column s, and the rows' forward counts."""
        rows_of = lambda value: jnp.full((b,), value)
        block = jax.lax.dynamic_slice_in_dim(x, s, bl, axis=1)
        after = Commits(block, batch.seeds, nfe, rows_of(step), masked_at_start, rows_of(block_start),
                        rows_of(True), numbers).commit(logits, scfg, cfg.steps_per_block)
        return jax.lax.dynamic_update_slice_in_dim(x, after.block, s, axis=1), after.nfe

    window = t - g0  # prefix policy: from the block start to the end, padded on the right
    padded = lambda a, fill: jnp.pad(a, ((0, 0), (0, window)), constant_values=fill)
    row_ids = jnp.arange(rows)[:, None]

    if cfg.selective:
        # Private columns: anchors + every non-affix column (padding included, as invalid tokens):
        # T - L + A per row, in column order, each with its own pool row. A row with fewer anchors
        # (entries = L: none) fills its T - L + A with shared columns, computed but never read.
        L, n_anchors = affix.length, anchors.shape[1]
        n_private = t - L + n_anchors
        is_affix = batch.affix_columns()
        is_anchor = jnp.zeros((b, t), bool).at[row_ids, batch.affix_start[:, None] + anchors].set(True) & is_affix
        shared = is_affix & ~is_anchor  # read from the affix rows, never recomputed
        private = jnp.argsort(shared, axis=1, stable=True)[:, :n_private]
        private_valid = take(batch.valid & ~shared, private)
        compact = jnp.cumsum(~shared, axis=1) - 1  # column -> index among the private columns
        own_slot = L + row_ids * n_private  # a row's first private pool row
        if cfg.drop_non_anchor:
            reads = (read_set(own_slot + jnp.arange(n_private)[None], private_valid, zero),)
        else:
            # A row whose affix starts at position 0 reads every column in one set, in column
            # order; other rows read the shared rows as a second set (`reads_affix_in_own_set`).
            offset = take(batch.positions, batch.affix_start[:, None])[:, 0]
            whole = reads_affix_in_own_set(offset)[:, None]
            slot = jnp.where(shared, col - batch.affix_start[:, None], own_slot + compact)
            anchor_local = jnp.zeros((b, L), bool).at[row_ids, anchors].set(True)
            reads = (read_set(slot, batch.valid & (~shared | whole), zero),
                     read_set(jnp.broadcast_to(jnp.arange(L), (b, L)), ~anchor_local & ~whole, offset))
        pool0 = KVPool(tuple(jnp.zeros((L + b * n_private, *a.shape[1:]), a.dtype).at[:L].set(a)
                             for a in affix.rotated_k(mcfg.rope_theta)),
                       tuple(jnp.zeros((L + b * n_private, *a.shape[1:]), a.dtype).at[:L].set(a)
                             for a in affix.kv()[1]))
    else:
        reads = (read_set(row_ids * t + col, dup(batch.valid), zero),)
        pool0 = KVPool.zeros(mcfg, rows * t, params[0].dtype)
    pool0 = jax.tree.map(constrain_kv, pool0)  # split by KV head under a mesh, as every write keeps it

    def block_start(x, pool, s, idx):
        """Forward at a block start: (logits for the block, the pool, tokens computed per row)."""
        if not cfg.selective:
            logits, pool = run(x, positions, row_ids * t + col, reads, pool, idx, prompt)
            return logits, pool, batch.valid.sum(-1)
        logits, pool = run(take(x, private), take(batch.positions, private),
                               own_slot + jnp.arange(n_private)[None], reads, pool, take(compact, idx))
        return logits, pool, private_valid.sum(-1)

    def block_body(carry):
        blk, x, pool, nfe, ftok, calls = carry
        s = g0 + blk * bl
        masked_at_start = (jax.lax.dynamic_slice_in_dim(x, s, bl, axis=1) == mask_id).sum(-1)
        idx = jnp.broadcast_to(s + jnp.arange(bl), (b, bl))
        logits, pool, width = block_start(x, pool, s, idx)
        x, after = commit(x, s, logits, 0, nfe, masked_at_start, block_start=True)
        nfe, ftok = after, ftok + (after - nfe) * width * (2 if guided else 1)
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a, s, bl, axis=1)

        def step_cond(c):
            return (jax.lax.dynamic_slice_in_dim(c[0], s, bl, axis=1) == mask_id).any()

        def step_body(c):
            x, pool, step, nfe, ftok, calls = c
            block_idx = jnp.broadcast_to(jnp.arange(bl), (b, bl))
            if cfg.cache == "none":
                logits, pool = run(x, positions, row_ids * t + col, reads, pool, idx, prompt)
                width = batch.valid.sum(-1)
            elif cfg.selective:  # the block alone, written to its private rows
                logits, pool = run(sl(x), sl(batch.positions), own_slot + sl(compact), reads, pool, block_idx)
                width = jnp.full((b,), bl)
            elif cfg.cache == "dual":  # the block alone
                logits, pool = run(sl(x), sl(positions), row_ids * t + s + jnp.arange(bl)[None], reads, pool,
                                       block_idx, sl(prompt))
                width = jnp.full((b,), bl)
            else:  # prefix: the window from the block start to the end
                win = lambda a, fill: jax.lax.dynamic_slice_in_dim(padded(a, fill), s, window, axis=1)
                cols = s + jnp.arange(window)[None]
                write = jnp.where(cols < t, row_ids * t + cols, pool.num_slots)
                logits, pool = run(win(x, mask_id), win(positions, 0), write, reads, pool, block_idx,
                                       win(prompt, False))
                width = win(batch.valid, False).sum(-1)
            x, after = commit(x, s, logits, step, nfe, masked_at_start, block_start=False)
            nfe, ftok = after, ftok + (after - nfe) * width * (2 if guided else 1)
            return x, pool, step + 1, nfe, ftok, calls + 1

        x, pool, _, nfe, ftok, calls = jax.lax.while_loop(step_cond, step_body,
                                                          (x, pool, jnp.int32(1), nfe, ftok, calls + 1))
        if cfg.early_stop:  # a block all end-of-text ends the row's generation: the rest is eos, uncomputed
            ended = (sl(x) == mcfg.eos_token_id).all(-1)
            x = jnp.where(ended[:, None] & gen_cols & (col >= s + bl), mcfg.eos_token_id, x)
        return blk + 1, x, pool, nfe, ftok, calls

    def blocks_left(carry):
        """Blocks remain and some row still has masks (early-stopped rows have none)."""
        blk, x = carry[:2]
        return (blk < cfg.num_blocks) & ((x == mask_id) & gen_cols).any()

    zeros = jnp.zeros((b,), jnp.int32)
    init = (jnp.int32(0), batch.tokens, pool0, zeros, zeros, jnp.int32(0))
    _, x, _, nfe, ftok, calls = jax.lax.while_loop(blocks_left, block_body, init)
    return x, DecodeStats(nfe, ftok, calls)


decode_batch = jax.jit(_decode, static_argnums=(0, 3))

# The static loop's anchor axis is K rounded up to a multiple of this (at most the affix length L):
# the loop compiles once per axis width, and a row's entries past its K are L (no anchor), which
# `_decode` already takes (an adaptive budget's rows): those columns join its block-start forwards
# as private columns that nothing reads, so budgets a few anchors apart (a sweep over ratios)
# share one program, at the cost of at most 7 more tokens a row at each block start.
ANCHOR_AXIS_STEP = 8


def anchor_axis(n_anchors: int, affix_len: int) -> int:
    """The static loop's anchor axis for K = n_anchors of an affix of affix_len tokens."""
    return min(round_up(n_anchors, ANCHOR_AXIS_STEP), affix_len)


def _loop_key(config: DecodeConfig) -> DecodeConfig:
    """`config` as the decode loop's static argument: anchors are selected before the loop and
    passed in, so configs that differ only in how they were selected (selector, budget) share one
    compiled loop (a sweep over selectors compiles the loop once per shape)."""
    return dataclasses.replace(config.program_key(), selector=DecodeConfig.selector, anchor_mass=None)


def check_policy(config: DecodeConfig, affix: Sequence[int] | None) -> None:
    """What the cache policy asks of requests: selective recompute needs an affix (placed: every
    path refuses an affix without a position, `layout.check_request`), no CFG."""
    if not config.selective:
        return
    if affix is None:
        raise DecodeError(f"cache policy {config.cache!r} needs an affix (affix ids or an AffixCache)")
    if config.cfg_scale > 0:
        raise DecodeError("classifier-free guidance is not supported with selective recompute")


def generate(
    model: Model,
    prompts: Sequence[Sequence[int]] | Sequence[Request],
    config: DecodeConfig | None = None,
    *,
    affix: AffixCache | Sequence[int] | None = None,
    max_batch: int = 16,
    progress: bool = False,
) -> GenerateResult:
    """Generate for many requests, `max_batch` at a time; results in input order.

    prompts: token-id lists (seed 0 each) or `Request`s. config: default the model's own
    (`model.generation_config`; `model.decode_config(**overrides)` changes some fields). affix: the
    shared affix, as ids or as an `AffixCache` built once with `build_affix_cache` (required by the
    `acache`/`direct` policies; the other policies compute the affix in place like any other
    text). A request's result does not depend on the other requests it is batched with.
    """
    config = resolve_decode_config(config, model.generation_config)
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch <= 0:
        raise DecodeError(f"max_batch must be a positive integer, got {max_batch!r}")
    requests = as_requests(prompts)
    affix_ids = check_requests(requests, config.gen_length, model.config, affix)
    check_policy(config, affix_ids)
    cache, n_anchors = None, 0
    if config.selective:
        cache = affix if isinstance(affix, AffixCache) else build_affix_cache(model, affix_ids)
        check_affix_cache(model, cache)
        n_anchors = config.anchors(cache.length)
    # Sort by length so that each batch pads little; results are put back in input order.
    length = lambda r: sum(r.lengths(len(affix_ids or ())).values())
    order = sorted(range(len(requests)), key=lambda i: length(requests[i]))
    chunks = [order[i:i + max_batch] for i in range(0, len(order), max_batch)]
    if progress:
        from tqdm.auto import tqdm

        chunks = tqdm(chunks, desc="generating", unit="batch")
    tokens: list[Any] = [None] * len(requests)
    anchors_out: list[Any] = [np.zeros(0, np.int32)] * len(requests)
    nfe, ftok, seconds = (np.zeros(len(requests), dtype) for dtype in (np.int64, np.int64, np.float64))
    calls = 0
    probe_forwards = config.selector != "random" and n_anchors > 0
    sampler = SamplerValues.of(config)  # traced: batches at other temperatures share the program
    for chunk in chunks:
        start = time.perf_counter()
        batch = place_rows(make_batch([requests[i] for i in chunk], config.gen_length, model.config, affix_ids),
                           model.mesh)
        with use_mesh(model.mesh):
            if config.selective:
                anchors = (select_anchors(*model.flat, batch, cache, n_anchors,
                                          config.selector, config.attn_backend, config.block_length,
                                          config.anchor_mass, config.min_anchors(cache.length),
                                          anchor_axis(n_anchors, cache.length))
                           if n_anchors > 0 else jnp.zeros((batch.tokens.shape[0], 0), jnp.int32))
                result = decode_batch(*model.flat, batch, _loop_key(config), cache, anchors, sampler)
            else:
                anchors, result = None, decode_batch(*model.flat, batch, _loop_key(config), sampler=sampler)
            (out, stats), anchors = jax.device_get((result, anchors))
        elapsed = time.perf_counter() - start
        g0 = batch.gen_start
        row_nfe, row_tokens, batch_calls = np.asarray(stats.nfe), np.asarray(stats.forward_tokens), int(stats.calls)
        if probe_forwards:  # the probe is one more forward over the request's tokens
            if config.selector == "hkvd":
                probed = batch.valid
            elif config.selector == "hkvd_block":
                probed = batch.through_block(config.block_length).valid
            else:
                probed = batch.valid & ~batch.affix_columns()
            row_nfe, row_tokens, batch_calls = row_nfe + 1, row_tokens + np.asarray(probed.sum(-1)), batch_calls + 1
        for row, i in enumerate(chunk):
            tokens[i] = out[row, g0:g0 + config.gen_length]
            nfe[i], ftok[i], seconds[i] = row_nfe[row], row_tokens[row], elapsed
            if anchors is not None:
                anchors_out[i] = anchors[row][anchors[row] < cache.length]
        calls += batch_calls
    return GenerateResult(tokens, anchors_out, nfe, ftok, seconds, calls)
