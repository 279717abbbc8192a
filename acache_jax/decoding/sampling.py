"""Token proposals, confidences and commit rules of the LLaDA, Dream and Fast-dLLM samplers.

All functions act on one decoding block: logits [B, n, V] float32, masked [B, n] bool (positions
still [MASK]). Every row draws its randomness from its own key, so a row's result does not depend
on the other rows of its batch.

Deliberate differences from upstream (documented in docs/DECODING.md):
- LLaDA computes confidences in float64; we compute them in float32 as exp(l - logsumexp(l)).
- Ties (equal confidences) resolve to the lowest index, in top-k and in the forced commit.
- Dream's schedule counts each row's own masks (upstream averages the count over the batch).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from acache_jax.network.config import SAMPLER_VALUES, DecodeConfig, DreamAlg, Family, ModelConfig, Remasking

NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerValues:
    """The sampler's numbers (`SAMPLER_VALUES`) as float32 scalars, or per row [R], that compiled
    programs take traced: configs that differ only in them share programs, whose static config
    keeps only which rules apply (`DecodeConfig.program_key`), and the engine's rows each commit
    with their own request's numbers. An unset number (None) is 0, and unused."""

    temperature: jax.Array
    threshold: jax.Array
    factor: jax.Array
    alg_temp: jax.Array
    top_p: jax.Array

    @classmethod
    def of(cls, cfg: DecodeConfig) -> SamplerValues:
        number = lambda value: np.float32(0.0 if value is None else value)
        return cls(**{name: number(getattr(cfg, name)) for name in SAMPLER_VALUES})

    @classmethod
    def rows(cls, values: list[SamplerValues], n: int, fill: SamplerValues) -> SamplerValues:
        """Per-row numbers [n] (host numpy) of rows with these scalar numbers, then rows of `fill`."""
        column = lambda name: np.asarray([getattr(v, name) for v in values] + [getattr(fill, name)] * (n - len(values)),
                                         np.float32)
        return cls(**{name: column(name) for name in SAMPLER_VALUES})


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """How tokens are proposed and which are committed at each step. Its numbers select the rules;
    where `values` is set (a commit inside a compiled program, built from a program key: each row's
    numbers, `Commits.sampler`) the rules compute with those instead (`value`)."""

    family: Family
    mask_token_id: int
    temperature: float = 0.0
    threshold: float | None = 0.9  # Fast-dLLM: commit every masked token with confidence >= threshold
    factor: float | None = None  # Fast-dLLM factor rule (takes precedence over threshold)
    remasking: Remasking = "low_confidence"  # LLaDA confidence
    alg: DreamAlg = "maskgit_plus"  # Dream confidence
    alg_temp: float = 0.0  # Dream: > 0 samples positions from softmax(confidence / alg_temp)
    top_p: float | None = None  # Dream
    top_k: int | None = None  # Dream
    eps: float = 1e-3  # Dream timestep floor
    values: SamplerValues | None = None

    @classmethod
    def of(cls, cfg: DecodeConfig, mcfg: ModelConfig) -> SamplerConfig:
        """The sampler settings of decoding settings `cfg` for a model of config `mcfg`."""
        return cls(family=mcfg.family, mask_token_id=mcfg.mask_token_id, temperature=cfg.temperature,
                   threshold=cfg.threshold, factor=cfg.factor, remasking=cfg.remasking, alg=cfg.alg,
                   alg_temp=cfg.alg_temp, top_p=cfg.top_p, top_k=cfg.top_k)

    def value(self, name: str, like: jax.Array) -> float | jax.Array:
        """The number `name` of `SAMPLER_VALUES` a rule computes with, shaped to broadcast against
        `like` (rows first) where it is one per row."""
        value = getattr(self if self.values is None else self.values, name)
        if getattr(value, "ndim", 0) == 1:
            value = value.reshape(value.shape + (1,) * (like.ndim - 1))
        return value


def _gumbel(key: jax.Array, shape) -> jax.Array:
    return jax.random.gumbel(key, shape, jnp.float32)


def step_keys(row_keys: jax.Array, nfe: jax.Array) -> jax.Array:
    """Per-row keys [B] of a commit: each request's key (from its seed) folded with its own forward
    count, not the batch's, so that a request draws the same numbers in any company: the static
    path and the engine both draw this way."""
    return jax.vmap(jax.random.fold_in)(row_keys, nfe)


def _row_keys(keys: jax.Array, salt: int) -> jax.Array:
    return jax.vmap(lambda k: jax.random.fold_in(k, salt))(keys)


def propose(logits: jax.Array, keys: jax.Array, cfg: SamplerConfig) -> tuple[jax.Array, jax.Array]:
    """Proposed token x0 [B, n] and its confidence [B, n] (higher = commit first). keys: [B] keys."""
    b, n, v = logits.shape
    logits = logits.astype(jnp.float32)
    # Never propose [MASK] itself: a committed mask would stay masked and its block never finish.
    # (Trained models give it no mass; tiny random ones can.) Confidences still use all logits.
    never_mask = jnp.where(jnp.arange(v) == cfg.mask_token_id, -jnp.inf, 0.0)
    if cfg.family == "llada":
        noisy = logits + never_mask
        if cfg.temperature > 0:  # upstream: exp(l) / (-log u)^T, i.e. argmax of l + T * gumbel
            g = jax.vmap(lambda k: _gumbel(k, (n, v)))(_row_keys(keys, 1))
            noisy = noisy + cfg.value("temperature", g) * g
        x0 = jnp.argmax(noisy, axis=-1).astype(jnp.int32)
        if cfg.remasking == "low_confidence":
            picked = jnp.take_along_axis(logits, x0[..., None], axis=-1)[..., 0]
            conf = jnp.exp(picked - jax.nn.logsumexp(logits, axis=-1))
        elif cfg.remasking == "random":
            conf = jax.vmap(lambda k: jax.random.uniform(k, (n,)))(_row_keys(keys, 2))
        else:
            raise ValueError(f"unknown remasking {cfg.remasking!r}")
        return x0, conf
    # Dream's sample_tokens
    if cfg.temperature > 0:
        logits = logits / cfg.value("temperature", logits)
    if cfg.top_p is not None and cfg.top_p < 1:
        logits = _top_p(logits, cfg.value("top_p", logits))
    if cfg.top_k is not None:
        kth = jax.lax.top_k(logits, min(cfg.top_k, v))[0][..., -1:]
        logits = jnp.where(logits < kth, jnp.finfo(jnp.float32).min, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    if cfg.temperature > 0:
        sample = lambda k, l: jax.random.categorical(k, l + never_mask, axis=-1)
        x0 = jax.vmap(sample)(_row_keys(keys, 3), logits).astype(jnp.int32)
    else:
        x0 = jnp.argmax(logits + never_mask, axis=-1).astype(jnp.int32)
    conf = jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
    if cfg.alg == "topk_margin":
        top2 = jax.lax.top_k(probs, 2)[0]
        conf = top2[..., 0] - top2[..., 1]
    elif cfg.alg == "entropy":
        conf = jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)
    elif cfg.alg not in ("maskgit_plus", "origin"):
        raise ValueError(f"unknown Dream alg {cfg.alg!r}")
    return x0, conf


def _top_p(logits: jax.Array, top_p: float | jax.Array) -> jax.Array:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    remove_sorted = jnp.concatenate([jnp.zeros_like(cum[..., :1], bool), cum[..., :-1] > top_p], axis=-1)
    remove = jnp.zeros_like(remove_sorted).at[  # `order` is a permutation: unique indices (a plain store on a GPU)
        jnp.arange(logits.shape[0])[:, None, None], jnp.arange(logits.shape[1])[None, :, None], order
    ].set(remove_sorted, unique_indices=True)
    return jnp.where(remove, jnp.finfo(jnp.float32).min, logits)


def _ranks(conf: jax.Array, masked: jax.Array) -> jax.Array:
    """Rank of each masked position by descending confidence (0 = most confident; ties: lower index)."""
    order = jnp.argsort(jnp.where(masked, -conf, jnp.inf), axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True)


def top_k_commit(conf: jax.Array, masked: jax.Array, k: jax.Array) -> jax.Array:
    """Commit the k[b] most confident masked positions of each row."""
    return masked & (_ranks(conf, masked) < k[:, None])


def threshold_commit(conf: jax.Array, masked: jax.Array, threshold: float | jax.Array) -> jax.Array:
    """Every masked position with conf >= threshold, and always the most confident one."""
    best = jnp.argmax(jnp.where(masked, conf, NEG_INF), axis=-1)
    forced = jnp.arange(conf.shape[-1])[None] == best[:, None]
    return masked & ((conf >= threshold) | forced)


def factor_commit(conf: jax.Array, masked: jax.Array, factor: float | jax.Array) -> jax.Array:
    """Fast-dLLM's factor rule: with masked confidences sorted descending c_0 >= c_1 >= ..., c_i
    passes if c_i >= 1 - factor / (i + 2) (c_0 always passes); commit the prefix before the first
    failure, except that a failure at the last position (or none) commits all (upstream's edge rule)."""
    n = masked.sum(axis=-1)
    sorted_conf = -jnp.sort(jnp.where(masked, -conf, jnp.inf), axis=-1)
    i = jnp.arange(conf.shape[-1])[None]
    fails = (i >= 1) & (i < n[:, None]) & (sorted_conf < 1 - factor / (i + 2))
    first_fail = jnp.where(fails.any(-1), jnp.argmax(fails, axis=-1), n - 1)
    count = jnp.where(first_fail >= n - 1, n, first_fail)
    return top_k_commit(conf, masked, count)


def llada_schedule(masked_at_block_start: jax.Array, steps_per_block: int) -> jax.Array:
    """Tokens to commit at each step of a block [B, steps]: equal shares, the first ones +1."""
    total = masked_at_block_start.sum(axis=-1, keepdims=True)
    base, rem = total // steps_per_block, total % steps_per_block
    return base + (jnp.arange(steps_per_block)[None] < rem)


def dream_schedule_commit(
    conf: jax.Array, masked: jax.Array, step: jax.Array, steps_per_block: int, keys: jax.Array, cfg: SamplerConfig
) -> jax.Array:
    """Dream's timestep schedule at in-block step `step` (1-based): t, s = ts[step], ts[step+1] with
    ts = linspace(1, eps, steps_per_block + 1); reveal a fraction 1 - s/t of the masks (all at the
    last step): the most confident ones, sampled ones (alg_temp > 0), or random ones (origin)."""
    ts = jnp.linspace(1.0, cfg.eps, steps_per_block + 1)
    step = jnp.broadcast_to(step, masked.shape[:1])  # per row
    t, s = ts[step], ts[jnp.minimum(step + 1, steps_per_block)]
    last = step >= steps_per_block - 1
    n = masked.sum(axis=-1)
    if cfg.alg == "origin":
        u = jax.vmap(lambda k: jax.random.uniform(k, (masked.shape[-1],)))(_row_keys(keys, 4))
        return masked & ((u < (1 - s / t)[:, None]) | last[:, None])
    k = jnp.where(last, n, jnp.floor(n * (1 - s / t)).astype(n.dtype))
    if cfg.alg_temp > 0:  # sampling without replacement = top-k of perturbed log-weights
        g = jax.vmap(lambda key: _gumbel(key, (masked.shape[-1],)))(_row_keys(keys, 5))
        conf = conf / cfg.value("alg_temp", conf) + g
    return top_k_commit(conf, masked, k)


def commit_block(block: jax.Array, logits: jax.Array, step: jax.Array, keys: jax.Array, sched: jax.Array,
                 cfg: SamplerConfig, steps_per_block: int, block_start: bool | jax.Array) -> jax.Array:
    """One commit on the blocks [B, bl] from their logits [B, bl, V]: the block's tokens afterwards.

    step: the in-block step (0 at the block start), a scalar or per row [B]; keys: per-row keys of
    this step; sched: the LLaDA fixed schedule [B, steps] (`llada_schedule`); block_start: whether
    each row (or all) commits from its block-start forward, where Dream commits only the block's
    first token. The one commit rule of the static path and the engine.
    """
    masked = block == cfg.mask_token_id
    x0, conf = propose(logits, keys, cfg)
    step = jnp.broadcast_to(step, block.shape[:1])
    if cfg.factor is not None:
        chosen = factor_commit(conf, masked, cfg.value("factor", conf))
    elif cfg.threshold is not None:
        chosen = threshold_commit(conf, masked, cfg.value("threshold", conf))
    elif cfg.family == "llada":
        k = jnp.take_along_axis(sched, jnp.minimum(step, sched.shape[1] - 1)[:, None], axis=1)[:, 0]
        chosen = top_k_commit(conf, masked, k)
    else:
        chosen = dream_schedule_commit(conf, masked, step, steps_per_block, keys, cfg)
    if cfg.family == "dream":  # Dream commits only the block's first token at the block start
        first = masked & (jnp.arange(block.shape[1]) == 0)[None]
        chosen = jnp.where(jnp.broadcast_to(block_start, block.shape[:1])[:, None], first, chosen)
    return jnp.where(chosen, x0, block)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Commits:
    """Per row [R]: its decoding block [R, bl] and what the next commit needs. `commit` is the one
    commit step of the static path and the engine: the row's key, the schedule, the commit rule, and
    the row's forward count (rows that are not `active`, or have no mask left, keep their block)."""

    block: jax.Array
    seeds: jax.Array  # the request's seed: a commit's keys are fold_in(key(seed), nfe)
    nfe: jax.Array  # forward calls the request has had so far
    step: jax.Array  # in-block step (0 at the block start)
    masked_at_start: jax.Array  # masks in the block at its start (LLaDA's fixed schedule)
    block_start: jax.Array  # [R] bool: commits from its block-start forward
    active: jax.Array  # [R] bool
    sampler: SamplerValues  # [R] each: the row's request's numbers (its config's; `cfg` keeps the rules)

    def commit(self, logits: jax.Array, cfg: SamplerConfig, steps_per_block: int) -> Commits:
        """The rows after one commit from their block logits [R, bl, V]; a row that had a mask
        counts the forward (nfe) and the step."""
        cfg = dataclasses.replace(cfg, values=self.sampler)
        keys = step_keys(jax.vmap(jax.random.key)(self.seeds), self.nfe)
        masked0 = jnp.arange(self.block.shape[1])[None] < self.masked_at_start[:, None]
        sched = llada_schedule(masked0, steps_per_block)
        block = commit_block(self.block, logits, self.step, keys, sched, cfg, steps_per_block, self.block_start)
        moved = self.active & (self.block == cfg.mask_token_id).any(-1)
        return dataclasses.replace(self, block=jnp.where(moved[:, None], block, self.block),
                                   nfe=self.nfe + moved, step=self.step + moved,
                                   block_start=jnp.zeros_like(self.block_start))
