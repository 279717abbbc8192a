"""Block diffusion decoding (LLaDA / Dream / Fast-dLLM) as one jitted, shape-bucketed program.

A batch row is laid out as [left pad][left tokens][generation: gen_length masks][right tokens][right pad]:
the generation region starts at the same column in every row, so blocks are aligned across the batch,
and positions count only a row's real tokens, so padding never changes a row's result.

Per block: a block-start forward (policy `none`/`prefix`/`dual`: full forward; it also rebuilds the
cache) commits from its logits, then in-block steps run until the block has no mask left:
- none: full forward every step;
- prefix: forward over the window from the block start to the end; keys before the block come from
  the block-start cache;
- dual: forward over the block only; every other key comes from the block-start cache.
The whole generation (all blocks, all steps) is one compiled program: lax loops, no host sync.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from acache_jax import sampling
from acache_jax.attention import ATTENTION_BACKENDS, KVView
from acache_jax.config import ModelConfig
from acache_jax.model import Model

CachePolicy = Literal["none", "prefix", "dual"]
CACHE_POLICIES = ("none", "prefix", "dual")


class DecodeError(ValueError):
    """A generation request or setting that cannot be run."""


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Decoding settings (hashable: one compiled program per distinct config and bucket)."""

    gen_length: int = 256
    block_length: int = 32
    steps: int | None = None  # fixed-schedule steps over the whole generation (default gen_length)
    threshold: float | None = 0.9  # Fast-dLLM parallel decoding; None = fixed schedule from `steps`
    factor: float | None = None  # Fast-dLLM factor rule (overrides threshold)
    temperature: float = 0.0
    remasking: sampling.Remasking = "low_confidence"  # LLaDA
    alg: sampling.DreamAlg = "maskgit_plus"  # Dream
    alg_temp: float = 0.0  # Dream
    top_p: float | None = None  # Dream
    top_k: int | None = None  # Dream
    cfg_scale: float = 0.0  # classifier-free guidance (LLaDA)
    cache: CachePolicy = "dual"
    attn_backend: str = "xla"

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return (self.steps or self.gen_length) // self.num_blocks

    def sampler(self, mcfg: ModelConfig) -> sampling.SamplerConfig:
        return sampling.SamplerConfig(
            family=mcfg.family, mask_token_id=mcfg.mask_token_id, temperature=self.temperature, threshold=self.threshold, factor=self.factor,
            remasking=self.remasking, alg=self.alg, alg_temp=self.alg_temp, top_p=self.top_p, top_k=self.top_k,
        )

    def validate(self) -> None:
        def fail(msg):
            raise DecodeError(msg)

        if self.gen_length <= 0 or self.block_length <= 0:
            fail(f"gen_length ({self.gen_length}) and block_length ({self.block_length}) must be positive")
        if self.gen_length % self.block_length:
            fail(f"gen_length ({self.gen_length}) must be a multiple of block_length ({self.block_length})")
        steps = self.steps or self.gen_length
        if steps <= 0 or steps % self.num_blocks:
            fail(f"steps ({steps}) must be a positive multiple of the number of blocks ({self.num_blocks})")
        if self.threshold is not None and not 0 < self.threshold <= 1:
            fail(f"threshold must be in (0, 1], got {self.threshold}")
        if self.factor is not None and self.factor <= 0:
            fail(f"factor must be positive, got {self.factor}")
        if self.temperature < 0 or self.alg_temp < 0 or self.cfg_scale < 0:
            fail("temperature, alg_temp and cfg_scale must be >= 0")
        if self.cache not in CACHE_POLICIES:
            fail(f"unknown cache policy {self.cache!r}; choose one of {CACHE_POLICIES}")
        if self.attn_backend not in ATTENTION_BACKENDS:
            fail(f"unknown attention backend {self.attn_backend!r}; choose one of {ATTENTION_BACKENDS}")
        if self.remasking not in ("low_confidence", "random"):
            fail(f"unknown remasking {self.remasking!r}; choose low_confidence or random")
        if self.alg not in ("origin", "maskgit_plus", "topk_margin", "entropy"):
            fail(f"unknown Dream alg {self.alg!r}")


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request: the tokens before and after the generated span."""

    left: Sequence[int]
    right: Sequence[int] = ()
    seed: int = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    """Device inputs of one bucketed batch."""

    tokens: jax.Array  # [B, T] int32 (mask ids in the generation region, pad id in padding)
    positions: jax.Array  # [B, T] int32 (cumulative count of real tokens - 1)
    valid: jax.Array  # [B, T] bool, real token (padding rows and columns: False)
    keys: jax.Array  # [B] PRNG keys, one per row
    gen_start: int = dataclasses.field(metadata=dict(static=True))  # column of the first generated token


@dataclasses.dataclass
class GenerateResult:
    """Per request: generated ids, forward calls (NFE), forward tokens, and its batch's wall time."""

    tokens: list[np.ndarray]
    nfe: np.ndarray  # [n] forward calls in which the request still had masks in its block
    forward_tokens: np.ndarray  # [n] real tokens of the request those calls computed
    seconds: np.ndarray  # [n] wall time of the batch the request ran in (compilation included)
    batch_forward_calls: int  # forward calls over all batches (a batch call counts once)

    @property
    def total_seconds(self) -> float:
        return float(np.unique(self.seconds).sum())


def bucket(n: int, minimum: int = 16) -> int:
    """Padded size for n: powers of two up to 512, then multiples of 256 (few programs, little waste)."""
    if n <= 0:
        return 0
    size = minimum
    while size < n and size < 512:
        size *= 2
    return size if size >= n else -(-n // 256) * 256


def batch_bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_requests(requests: Sequence[Request], cfg: DecodeConfig, mcfg: ModelConfig) -> None:
    for i, r in enumerate(requests):
        if len(r.left) == 0:
            raise DecodeError(f"request {i}: empty prompt")
        total = len(r.left) + len(r.right) + cfg.gen_length
        if total > mcfg.max_seq_len:
            raise DecodeError(
                f"request {i}: {len(r.left) + len(r.right)} prompt tokens + {cfg.gen_length} generated = {total} "
                f"exceeds the model's context of {mcfg.max_seq_len}"
            )
        bad = [t for t in (*r.left, *r.right) if not 0 <= t < mcfg.vocab_size]
        if bad:
            raise DecodeError(f"request {i}: token ids outside the vocabulary [0, {mcfg.vocab_size}): {bad[:5]}")


def make_batch(requests: Sequence[Request], cfg: DecodeConfig, mcfg: ModelConfig, batch_size: int | None = None) -> Batch:
    """Pad requests into one bucketed batch (left part left-padded, right part right-padded)."""
    b = batch_size or batch_bucket(len(requests))
    left = bucket(max(len(r.left) for r in requests))
    right = bucket(max(len(r.right) for r in requests), minimum=8)
    g = cfg.gen_length
    tokens = np.full((b, left + g + right), mcfg.pad_token_id, np.int32)
    valid = np.zeros(tokens.shape, bool)
    for i, r in enumerate(requests):
        tokens[i, left - len(r.left):left] = r.left
        tokens[i, left:left + g] = mcfg.mask_token_id
        tokens[i, left + g:left + g + len(r.right)] = r.right
        valid[i, left - len(r.left):left + g + len(r.right)] = True
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
    seeds = [r.seed for r in requests] + [0] * (b - len(requests))
    keys = jnp.stack([jax.random.key(s) for s in seeds])
    return Batch(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(valid), keys, left)


# Incremented each time the decode program is traced: tests use it to count compilations.
TRACE_COUNT = {"decode": 0}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeStats:
    nfe: jax.Array  # [B] forward calls in which the row still had masks in its block
    forward_tokens: jax.Array  # [B] real tokens of the row those calls computed
    calls: jax.Array  # [] forward calls of the batch


def _decode(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, cfg: DecodeConfig) -> tuple[jax.Array, DecodeStats]:
    TRACE_COUNT["decode"] += 1
    model = nnx.merge(graphdef, params)
    mcfg: ModelConfig = model.cfg
    scfg = cfg.sampler(mcfg)
    mask_id, bl, g0 = mcfg.mask_token_id, cfg.block_length, batch.gen_start
    b, t = batch.tokens.shape
    gen_cols = (jnp.arange(t) >= g0) & (jnp.arange(t) < g0 + cfg.gen_length)
    prompt = batch.valid & ~gen_cols[None]  # what classifier-free guidance masks out
    guided = cfg.cfg_scale > 0
    dup = (lambda a: jnp.concatenate([a, a])) if guided else (lambda a: a)

    def forward(tokens, positions, valid, prompt_mask, kv=None, logit_index=None):
        """Model forward with CFG's unconditional copy (prompt masked) run as extra batch rows."""
        if guided:
            tokens = jnp.concatenate([tokens, jnp.where(prompt_mask, mask_id, tokens)])
            positions, valid = dup(positions), dup(valid)
            logit_index = None if logit_index is None else dup(logit_index)
        out = model(tokens, positions, valid=valid, kv=kv, logit_index=logit_index, attn_backend=cfg.attn_backend)
        logits = out.logits
        if guided:
            cond, uncond = jnp.split(logits, 2)
            logits = uncond + (cfg.cfg_scale + 1) * (cond - uncond)
        return logits, out.k, out.v

    def step_keys(nfe):
        """Per-row keys for this step, from the row's own forward count (not the batch's)."""
        return jax.vmap(jax.random.fold_in)(batch.keys, nfe)

    def commit(x, s, logits, step, keys, sched, block_start: bool):
        block = jax.lax.dynamic_slice_in_dim(x, s, bl, axis=1)
        masked = block == mask_id
        x0, conf = sampling.propose(logits, keys, scfg)
        if block_start and mcfg.family == "dream":  # Dream commits only the block's first token here
            chosen = masked & (jnp.arange(bl) == 0)[None]
        elif scfg.factor is not None:
            chosen = sampling.factor_commit(conf, masked, scfg.factor)
        elif scfg.threshold is not None:
            chosen = sampling.threshold_commit(conf, masked, scfg.threshold)
        elif mcfg.family == "llada":
            chosen = sampling.top_k_commit(conf, masked, sched[:, jnp.minimum(step, sched.shape[1] - 1)])
        else:
            chosen = sampling.dream_schedule_commit(conf, masked, step, cfg.steps_per_block, keys, scfg)
        return jax.lax.dynamic_update_slice_in_dim(x, jnp.where(chosen, x0, block), s, axis=1)

    col = jnp.arange(t)[None]
    window = t - g0  # prefix policy: from the block start to the end, padded on the right
    padded = lambda a, fill: jnp.pad(a, ((0, 0), (0, window)), constant_values=fill)

    def block_body(blk, carry):
        x, nfe, ftok, calls = carry
        s = g0 + blk * bl
        in_block = (col >= s) & (col < s + bl)
        masked0 = jax.lax.dynamic_slice_in_dim(x, s, bl, axis=1) == mask_id
        sched = sampling.llada_schedule(masked0, cfg.steps_per_block)
        active = masked0.any(-1)
        idx = jnp.broadcast_to(s + jnp.arange(bl), (b, bl))
        logits, k, v = forward(x, batch.positions, batch.valid, prompt, logit_index=idx)
        x = commit(x, s, logits, 0, step_keys(nfe), sched, block_start=True)
        nfe, ftok = nfe + active, ftok + active * batch.valid.sum(-1) * (2 if guided else 1)
        cache_valid = batch.valid & (col < s) if cfg.cache == "prefix" else batch.valid & ~in_block
        kv = KVView(k, v, dup(batch.positions), dup(cache_valid))

        def step_cond(c):
            return (jax.lax.dynamic_slice_in_dim(c[0], s, bl, axis=1) == mask_id).any()

        def step_body(c):
            x, step, nfe, ftok, calls = c
            active = (jax.lax.dynamic_slice_in_dim(x, s, bl, axis=1) == mask_id).any(-1)
            if cfg.cache == "none":
                logits, _, _ = forward(x, batch.positions, batch.valid, prompt, logit_index=idx)
                width = batch.valid.sum(-1)
            elif cfg.cache == "dual":
                sl = lambda a: jax.lax.dynamic_slice_in_dim(a, s, bl, axis=1)
                logits, _, _ = forward(sl(x), sl(batch.positions), sl(batch.valid), sl(prompt), kv=kv)
                width = jnp.full((b,), bl)
            else:  # prefix
                sl = lambda a, fill: jax.lax.dynamic_slice_in_dim(padded(a, fill), s, window, axis=1)
                w_valid = sl(batch.valid, False)
                logits, _, _ = forward(sl(x, mask_id), sl(batch.positions, 0), w_valid, sl(prompt, False), kv=kv,
                                       logit_index=jnp.broadcast_to(jnp.arange(bl), (b, bl)))
                width = w_valid.sum(-1)
            x = commit(x, s, logits, step, step_keys(nfe), sched, block_start=False)
            nfe, ftok = nfe + active, ftok + active * width * (2 if guided else 1)
            return x, step + 1, nfe, ftok, calls + 1

        x, _, nfe, ftok, calls = jax.lax.while_loop(step_cond, step_body, (x, jnp.int32(1), nfe, ftok, calls + 1))
        return x, nfe, ftok, calls

    zeros = jnp.zeros((b,), jnp.int32)
    x, nfe, ftok, calls = jax.lax.fori_loop(0, cfg.num_blocks, block_body, (batch.tokens, zeros, zeros, jnp.int32(0)))
    return x, DecodeStats(nfe, ftok, calls)


decode_batch = jax.jit(_decode, static_argnums=(0, 3))


def generate(
    model: Model,
    prompts: Sequence[Sequence[int]] | Sequence[Request],
    config: DecodeConfig = DecodeConfig(),
    *,
    max_batch: int = 16,
    progress: bool = False,
) -> GenerateResult:
    """Generate for many requests, `max_batch` at a time; results in input order.

    prompts: token-id lists (seed 0 each) or `Request`s. Each request's result is independent of the
    others it is batched with.
    """
    config.validate()
    requests = [p if isinstance(p, Request) else Request(list(p)) for p in prompts]
    if not requests:
        raise DecodeError("no prompts given")
    check_requests(requests, config, model.config)
    # Sort by length so that each batch pads little; results are put back in input order.
    order = sorted(range(len(requests)), key=lambda i: len(requests[i].left) + len(requests[i].right))
    chunks = [order[i:i + max_batch] for i in range(0, len(order), max_batch)]
    if progress:
        from tqdm.auto import tqdm

        chunks = tqdm(chunks, desc="generating", unit="batch")
    tokens: list[Any] = [None] * len(requests)
    nfe, ftok, seconds = (np.zeros(len(requests), dtype) for dtype in (np.int64, np.int64, np.float64))
    calls = 0
    for chunk in chunks:
        start = time.perf_counter()
        batch = make_batch([requests[i] for i in chunk], config, model.config)
        out, stats = jax.device_get(decode_batch(model.graphdef, model.params, batch, config))
        elapsed = time.perf_counter() - start
        g0 = batch.gen_start
        for row, i in enumerate(chunk):
            tokens[i] = out[row, g0:g0 + config.gen_length]
            nfe[i], ftok[i], seconds[i] = stats.nfe[row], stats.forward_tokens[row], elapsed
        calls += int(stats.calls)
    return GenerateResult(tokens, nfe, ftok, seconds, calls)
