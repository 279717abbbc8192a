"""Log-likelihood of a continuation under a masked diffusion model: the Monte-Carlo estimate that
LLaDA's own evaluation (its lm-eval wrapper) uses, batched and jitted.

For a prompt and a continuation of L tokens, one sample masks x of the continuation tokens (the
prompt is never masked), runs the model over the whole sequence and takes the cross-entropy of the
masked tokens, each weighted L / x. Samples come in groups of `group` (LLaDA's batch): a group draws
k ~ U{1..L} and gives its row i the mask count x_i = ((round(linspace(k, k + (b-1) L/b, b))_i - 1)
mod L) + 1, so a group's rows spread over the mask ratios (stratified); each row masks x_i
positions chosen uniformly at random. The estimate is minus the mean over all `mc_num` rows of
the row's weighted loss sum (LLaDA: each group's loss sum / b, averaged over the mc_num / b groups:
the same number).

Masks are drawn on the host from a generator seeded by (seed, the pair's token ids), so a pair's
estimate depends on neither the other pairs nor their order. Rows of any pairs are packed
`rows` at a time into one forward (right-padded to a bucketed length: one compiled program per
(rows, length, continuation) bucket, padding never attended to); rows are made as they are
consumed, so memory does not grow with mc_num times the number of pairs.
Classifier-free guidance (cfg_scale > 0) adds the unconditional copy (prompt masked) as in LLaDA.
Dream's logit shift happens inside the model's forward.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from acache_jax.decoding.layout import bucket, check_context, check_vocabulary, token_ids
from acache_jax.network.config import InputError
from acache_jax.network.model import ForwardInputs, Model, Structure


def mask_counts(rng: np.random.Generator, length: int, group: int) -> np.ndarray:
    """[group] stratified mask counts in 1..length for one group of samples."""
    k = int(rng.integers(1, length + 1))
    x = np.round(np.linspace(k, k + (group - 1) * (length / group), group)).astype(np.int64)
    return (x - 1) % length + 1


def sample_masks(rng: np.random.Generator, length: int, mc_num: int, group: int) -> np.ndarray:
    """[mc_num, length] bool: which continuation tokens each sample masks (groups of `group` rows)."""
    masks = np.zeros((mc_num, length), bool)
    for g in range(mc_num // group):
        for i, x in enumerate(mask_counts(rng, length, group)):
            masks[g * group + i] = rng.permutation(length) < x  # x positions, uniformly at random
    return masks


def _pair_rng(seed: int, prompt: list[int], continuation: list[int]) -> np.random.Generator:
    digest = hashlib.sha256(np.asarray([*prompt, -1, *continuation], np.int64).tobytes()).digest()
    return np.random.default_rng([seed, int.from_bytes(digest[:8], "little")])


def _row_losses(structure: Structure, params: list[jax.Array], tokens: jax.Array, valid: jax.Array,
                prompt: jax.Array, index: jax.Array, target: jax.Array, weight: jax.Array, *,
                mask_id: int, cfg_scale: float, attn_backend: str | None) -> jax.Array:
    """[R] sum over each row's continuation of weight * cross-entropy (weight 0: not scored).

    tokens, valid, prompt: [R, T] (masked tokens already replaced by the mask id; prompt: the
    positions guidance masks out); index, target, weight: [R, C] continuation positions, their
    true ids and weights.
    """
    r, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (r, t))
    if cfg_scale > 0:
        tokens = jnp.concatenate([tokens, jnp.where(prompt, mask_id, tokens)])
        positions, valid, index = (jnp.concatenate([a, a]) for a in (positions, valid, index))
    logits = structure.forward(params, tokens, ForwardInputs(positions, valid, logit_index=index),
                               attn_backend=attn_backend).logits
    if cfg_scale > 0:
        cond, uncond = jnp.split(logits, 2)
        logits = uncond + (cfg_scale + 1) * (cond - uncond)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * weight, axis=-1)


row_losses = jax.jit(_row_losses, static_argnums=0, static_argnames=("mask_id", "cfg_scale", "attn_backend"))


def check_pairs(model: Model, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]
                ) -> list[tuple[list[int], list[int]]]:
    """The pairs as id lists; a clear error naming the pair for one that cannot be scored."""
    out = []
    cfg = model.config
    for n, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InputError(f"pair {n}: expected (prompt ids, continuation ids), got {type(pair).__name__}")
        prompt, continuation = token_ids(pair[0], f"pair {n} prompt"), token_ids(pair[1], f"pair {n} continuation")
        if not continuation:
            raise InputError(f"pair {n}: the continuation is empty (nothing to score)")
        try:
            check_context(cfg.max_seq_len, prompt=len(prompt), continuation=len(continuation))
            check_vocabulary([*prompt, *continuation], cfg.vocab_size)
        except InputError as e:
            raise InputError(f"pair {n}: {e}") from None
        out.append((prompt, continuation))
    return out


def loglikelihood(model: Model, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, mc_num: int = 128,
                  group: int = 32, rows: int | None = None, seed: int = 0, cfg_scale: float = 0.0,
                  attn_backend: str | None = None) -> np.ndarray:
    """[len(pairs)] float64 estimates of log p(continuation | prompt), `mc_num` samples each.

    group: samples per stratified group (LLaDA's batch size; mc_num must be a multiple of it);
    rows: rows per forward (default: group), filled with the samples of any pairs.
    """
    for name, value in (("mc_num", mc_num), ("group", group), ("rows", rows or group)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    if mc_num % group:
        raise InputError(f"mc_num ({mc_num}) must be a multiple of the sample group ({group})")
    rows = rows or group
    pairs = check_pairs(model, pairs)
    mask_id = model.config.mask_token_id

    def samples():
        """(pair, sequence with its masks applied, prompt length, weights) of every sample, pairs in
        order of length so that a forward's rows are alike; made as they are consumed."""
        for p in sorted(range(len(pairs)), key=lambda p: sum(map(len, pairs[p]))):
            prompt, continuation = pairs[p]
            for mask in sample_masks(_pair_rng(seed, prompt, continuation), len(continuation), mc_num, group):
                seq = np.asarray(prompt + continuation, np.int32)
                seq[len(prompt):][mask] = mask_id
                yield p, seq, len(prompt), mask * (len(continuation) / mask.sum())

    pending = []  # (pairs of the rows, their losses still on the device): no host sync per forward
    stream = samples()
    while chunk := list(itertools.islice(stream, rows)):
        t = bucket(max(len(s[1]) for s in chunk))
        c = bucket(max(len(s[3]) for s in chunk), minimum=8)
        tokens = np.full((rows, t), model.config.pad_token_id, np.int32)
        valid, prompt_cols = np.zeros((rows, t), bool), np.zeros((rows, t), bool)
        index, target = np.zeros((rows, c), np.int32), np.zeros((rows, c), np.int32)
        weight = np.zeros((rows, c), np.float32)
        for i, (p, seq, n_prompt, w) in enumerate(chunk):
            tokens[i, :len(seq)], valid[i, :len(seq)], prompt_cols[i, :n_prompt] = seq, True, True
            index[i, :len(w)] = n_prompt + np.arange(len(w))
            target[i, :len(w)] = pairs[p][1]
            weight[i, :len(w)] = w
        inputs = (jnp.asarray(a) for a in (tokens, valid, prompt_cols, index, target, weight))
        losses = row_losses(*model.flat, *inputs, mask_id=mask_id, cfg_scale=float(cfg_scale),
                            attn_backend=attn_backend)
        pending.append(([s[0] for s in chunk], losses))
    totals = np.zeros(len(pairs), np.float64)
    for owners, losses in pending:
        np.add.at(totals, owners, np.asarray(losses)[:len(owners)])
    return -totals / mc_num


__all__ = ["check_pairs", "loglikelihood", "mask_counts", "row_losses", "sample_masks"]
