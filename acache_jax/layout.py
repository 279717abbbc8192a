"""Requests and their padded, bucketed batch layout.

A row is [left pad][left tokens][generation: gen_length masks][right tokens][right pad], where the
affix (if any) sits in the left part (prefix: [affix][prompt], infix: [prompt][affix][tail]) or is
the right part (suffix: [prompt][masks][affix]). The generation region starts at the same column in
every row, so decoding blocks are aligned across the batch; positions count only a row's real
tokens, so padding never changes a row's result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from acache_jax.config import InputError, ModelConfig

AffixPosition = Literal["prefix", "infix", "suffix"]
AFFIX_POSITIONS = ("prefix", "infix", "suffix")
MAX_SEED = 2**32 - 1  # seeds are uint32 (one key per request, the same on every path)


class RequestError(InputError):
    """A request that cannot be laid out or run."""


def _is_id(t: Any) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))


def token_ids(ids: Any, what: str) -> list[int]:
    """`ids` as a list of ints; strings, floats, booleans and nesting are errors naming `what`."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray, jax.Array)):
        raise RequestError(f"{what} must be a list of token ids, got {type(ids).__name__} {ids!r:.60}")
    ids = list(np.asarray(ids).tolist()) if isinstance(ids, (np.ndarray, jax.Array)) else list(ids)
    bad = [t for t in ids if not _is_id(t)]
    if bad:
        raise RequestError(f"{what} must hold integer token ids, found {bad[0]!r}")
    return [int(t) for t in ids]


def as_requests(prompts: Any) -> list[Request]:
    """Prompts (token-id lists or `Request`s) as Requests, with errors that say what was passed instead."""
    if isinstance(prompts, (str, bytes)):
        raise RequestError("prompts must be a list of prompts (token-id lists or Requests), got a string; "
                           "tokenize it first, e.g. [model.tokenizer(text)['input_ids']]")
    if isinstance(prompts, Request):
        raise RequestError("prompts must be a list of prompts; wrap the single Request: [request]")
    if not isinstance(prompts, (Sequence, np.ndarray)):
        raise RequestError(f"prompts must be a list of token-id lists or Requests, got {type(prompts).__name__}")
    prompts = list(prompts)
    if not prompts:
        raise RequestError("no prompts given")
    if all(_is_id(p) for p in prompts):
        raise RequestError(f"prompts is one flat list of token ids; pass a list of prompts: [{prompts[:3]}...]")
    return [p if isinstance(p, Request) else Request(token_ids(p, f"prompt {i}")) for i, p in enumerate(prompts)]


def affix_token_ids(affix: Any) -> list[int]:
    """The ids of an affix given as ids or as an `AffixCache` (anything with `.ids`)."""
    return token_ids(affix.ids if hasattr(affix, "ids") else affix, "the affix")


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request. With `affix_position`, the shared affix is placed into it."""

    prompt: Sequence[int]
    tail: Sequence[int] = ()  # infix only: the prompt's part after the affix
    affix_position: AffixPosition | None = None
    seed: int = 0

    def parts(self, affix: Sequence[int]) -> tuple[list[int], list[int], int]:
        """(left tokens, right tokens, affix offset: index in left, or len(left) + gen for the right)."""
        prompt, tail = list(self.prompt), list(self.tail)
        if self.affix_position is None:
            return prompt + tail, [], -1
        if self.affix_position == "prefix":
            return list(affix) + prompt + tail, [], 0
        if self.affix_position == "infix":
            return prompt + list(affix) + tail, [], len(prompt)
        return prompt + tail, list(affix), -2  # suffix: right after the generation region


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    """Device inputs of one bucketed batch."""

    tokens: jax.Array  # [B, T] int32 (mask ids in the generation region, pad id in padding)
    positions: jax.Array  # [B, T] int32 (cumulative count of real tokens - 1)
    valid: jax.Array  # [B, T] bool, real token (padding rows and columns: False)
    keys: jax.Array  # [B] PRNG keys, one per row
    affix_start: jax.Array  # [B] int32 column of the affix's first token (rows without one: 0)
    gen_start: int = dataclasses.field(metadata=dict(static=True))  # column of the first generated token
    affix_len: int = dataclasses.field(default=0, metadata=dict(static=True))

    def affix_columns(self) -> jax.Array:
        """[B, T] bool: the columns holding the affix."""
        col = jnp.arange(self.tokens.shape[1])[None]
        start = self.affix_start[:, None]
        return (col >= start) & (col < start + self.affix_len) & self.valid

    def affix_column_index(self) -> jax.Array:
        """[B, L] int: the column of each row's n-th affix token."""
        return self.affix_start[:, None] + jnp.arange(self.affix_len)[None]


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


def check_request(r: Request, gen_length: int, mcfg: ModelConfig, affix: list[int] | None) -> None:
    """A clear error for a request that cannot run (affix: its ids, already checked)."""
    if not isinstance(r, Request):
        raise RequestError(f"must be a Request, got {type(r).__name__}")
    token_ids(r.prompt, "prompt")
    token_ids(r.tail, "tail")
    if not _is_id(r.seed) or not 0 <= r.seed <= MAX_SEED:
        raise RequestError(f"seed must be an integer in [0, {MAX_SEED}], got {r.seed!r}")
    if r.affix_position is not None:
        if r.affix_position not in AFFIX_POSITIONS:
            raise RequestError(f"affix_position must be one of {AFFIX_POSITIONS}, got {r.affix_position!r}")
        if affix is None:
            raise RequestError(f"affix_position {r.affix_position!r} given but no affix")
        if r.affix_position == "infix" and len(r.tail) == 0:
            raise RequestError("an infix affix needs a prompt tail after it (prompt_tail)")
    if r.tail and r.affix_position != "infix":
        raise RequestError(f"a prompt tail goes after an infix affix; this request's affix position is "
                           f"{r.affix_position!r}")
    if len(r.prompt) == 0:
        raise RequestError("empty prompt")
    left, right, _ = r.parts(affix or [])
    total = len(left) + len(right) + gen_length
    if total > mcfg.max_seq_len:
        raise RequestError(f"{len(left) + len(right)} prompt and affix tokens + {gen_length} generated = {total} "
                           f"exceeds the model's context of {mcfg.max_seq_len}")
    bad = [t for t in (*left, *right) if not 0 <= t < mcfg.vocab_size]
    if bad:
        raise RequestError(f"token ids outside the vocabulary [0, {mcfg.vocab_size}): {bad[:5]}")


def check_requests(requests: Sequence[Request], gen_length: int, mcfg: ModelConfig, affix: Sequence[int] | None) -> None:
    """Clear errors for requests that cannot run, before anything is compiled."""
    affix = token_ids(affix, "the affix") if affix is not None else None
    if affix is not None and len(affix) == 0:
        raise RequestError("the affix is empty")
    for i, r in enumerate(requests):
        try:
            check_request(r, gen_length, mcfg, affix)
        except RequestError as e:
            raise RequestError(f"request {i}: {e}") from None


def make_batch(
    requests: Sequence[Request], gen_length: int, mcfg: ModelConfig, affix: Sequence[int] | None = None,
    batch_size: int | None = None,
) -> Batch:
    """Pad requests into one bucketed batch (left part left-padded, right part right-padded)."""
    affix = list(affix) if affix is not None else []
    parts = [r.parts(affix) for r in requests]
    b = batch_size or batch_bucket(len(requests))
    left = bucket(max(len(lp) for lp, _, _ in parts))
    right = bucket(max(len(rp) for _, rp, _ in parts), minimum=8)
    g = gen_length
    tokens = np.full((b, left + g + right), mcfg.pad_token_id, np.int32)
    valid = np.zeros(tokens.shape, bool)
    affix_start = np.zeros(b, np.int32)
    for i, (lp, rp, offset) in enumerate(parts):
        tokens[i, left - len(lp):left] = lp
        tokens[i, left:left + g] = mcfg.mask_token_id
        tokens[i, left + g:left + g + len(rp)] = rp
        valid[i, left - len(lp):left + g + len(rp)] = True
        affix_start[i] = left + g if offset == -2 else left - len(lp) + max(offset, 0)
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
    seeds = [r.seed for r in requests] + [0] * (b - len(requests))
    keys = jnp.stack([jax.random.key(s) for s in seeds])
    has_affix = any(r.affix_position is not None for r in requests)
    return Batch(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(valid), keys, jnp.asarray(affix_start), left,
                 len(affix) if has_affix else 0)
