"""Requests, the columns of one request (`Row`), and the padded, bucketed batch of the static path.

A request's row is [left tokens][generation: gen_length masks][right tokens], where the affix (if
any) sits in the left part (prefix: [affix][prompt], infix: [prompt][affix][tail]) or is the right
part (suffix: [prompt][masks][affix]). The engine keeps rows as they are; a static batch pads them
to [left pad][left][gen][right][right pad] so that the generation region starts at the same column
in every row and decoding blocks align. Positions count only a row's real tokens, so padding never
changes a row's result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from acache_jax.network.config import InputError, ModelConfig

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


def check_context(max_seq_len: int, within: str = "the model's context", **tokens: int) -> None:
    """A clear error when the named token counts (`prompt=3, affix=20, gen_length=32`) do not fit in
    the model's context (`within` names another limit: an engine's smaller context). Plain
    arithmetic on counts, never on rows: every path (the CLI, JSONL lines, `generate`, `Engine.add`,
    the server, lm-eval, likelihood, affix caches) checks lengths here before any row, buffer or
    program exists, so refusing `gen_length=10**10` costs nothing."""
    total = sum(tokens.values())
    if total <= max_seq_len:
        return
    if len(tokens) == 1:
        (name, n), = tokens.items()
        raise RequestError(f"the {name} has {n} tokens, more than {within} of {max_seq_len}")
    parts = " + ".join(f"{name} {n}" for name, n in tokens.items() if n)
    raise RequestError(f"{parts} = {total} tokens exceeds {within} of {max_seq_len}")


def check_vocabulary(ids: Sequence[int], vocab_size: int, what: str = "token ids") -> None:
    """A clear error naming the first few ids outside [0, vocab_size)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{what} outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def check_affix(affix: Any, mcfg: ModelConfig) -> list[int]:
    """An affix's ids (given as ids or an `AffixCache`), checked once for every request that shares
    it: not empty, within the context on its own, in the vocabulary."""
    ids = affix_token_ids(affix)
    if not ids:
        raise RequestError("the affix is empty")
    check_context(mcfg.max_seq_len, affix=len(ids))
    check_vocabulary(ids, mcfg.vocab_size, "affix token ids")
    return ids


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request. With `affix_position`, the shared affix is placed into it."""

    prompt: Sequence[int]
    tail: Sequence[int] = ()  # infix only: the prompt's part after the affix
    affix_position: AffixPosition | None = None
    seed: int = 0

    def lengths(self, affix_len: int) -> dict[str, int]:
        """Tokens of each given part of its row (prompt, placed affix, prompt tail), counted without
        building the row: what `check_context` adds the generation length to."""
        return {"prompt": len(self.prompt), "affix": affix_len if self.affix_position is not None else 0,
                "prompt_tail": len(self.tail)}

    def row(self, affix: Sequence[int], gen_length: int, mask_id: int) -> Row:
        """This request's columns with `affix` placed (`check_request` refuses an affix without a position)."""
        prompt, tail, affix = list(self.prompt), list(self.tail), list(affix)
        masks = [mask_id] * gen_length
        if self.affix_position is None:
            return Row(np.asarray(prompt + tail + masks, np.int32), len(prompt) + len(tail), gen_length)
        if self.affix_position == "suffix":
            left = prompt + tail
            return Row(np.asarray(left + masks + affix, np.int32), len(left), gen_length, len(left) + gen_length,
                       len(affix))
        left = affix + prompt + tail if self.affix_position == "prefix" else prompt + affix + tail
        start = 0 if self.affix_position == "prefix" else len(prompt)
        return Row(np.asarray(left + masks, np.int32), len(left), gen_length, start, len(affix))


@dataclasses.dataclass(frozen=True)
class Row:
    """The columns of one request: tokens [left][gen_length masks][right], where its generation
    region and its affix (if any) sit. A column's index is its position."""

    tokens: np.ndarray  # [T] int32
    gen_start: int
    gen_length: int
    affix_start: int = 0
    affix_len: int = 0

    @property
    def num_columns(self) -> int:
        return len(self.tokens)

    @property
    def left(self) -> int:
        return self.gen_start

    @property
    def right(self) -> int:
        return self.num_columns - self.gen_start - self.gen_length

    @property
    def affix_columns(self) -> np.ndarray:
        return np.arange(self.affix_start, self.affix_start + self.affix_len, dtype=np.int32)

    def columns_through_block(self, block_length: int) -> np.ndarray:
        """int32: every column but the generation's after its first block (what hkvd_block runs;
        `Batch.through_block` is the same cut of a padded batch)."""
        cols = np.arange(self.num_columns, dtype=np.int32)
        return cols[(cols < self.gen_start + block_length) | (cols >= self.gen_start + self.gen_length)]

    def private_columns(self, anchors: np.ndarray) -> np.ndarray:
        """int32 [T - L + K]: the anchors' columns and every non-affix column, in column order."""
        private = np.ones(self.num_columns, bool)
        private[self.affix_start:self.affix_start + self.affix_len] = False
        private[self.affix_start + np.asarray(anchors, np.int64)] = True
        return np.flatnonzero(private).astype(np.int32)

    def shared_columns(self, anchors: np.ndarray) -> np.ndarray:
        """int32 [L - K]: the affix columns that are not anchors, in column order."""
        shared = np.zeros(self.num_columns, bool)
        shared[self.affix_start:self.affix_start + self.affix_len] = True
        shared[self.affix_start + np.asarray(anchors, np.int64)] = False
        return np.flatnonzero(shared).astype(np.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    """Device inputs of one bucketed batch."""

    tokens: jax.Array  # [B, T] int32 (mask ids in the generation region, pad id in padding)
    positions: jax.Array  # [B, T] int32 (cumulative count of real tokens - 1)
    valid: jax.Array  # [B, T] bool, real token (padding rows and columns: False)
    seeds: jax.Array  # [B] uint32, each row's seed (padding rows: 0)
    affix_start: jax.Array  # [B] int32 column of the affix's first token (rows without one: 0)
    gen_start: int = dataclasses.field(metadata=dict(static=True))  # column of the first generated token
    gen_length: int = dataclasses.field(metadata=dict(static=True))
    affix_len: int = dataclasses.field(default=0, metadata=dict(static=True))

    def affix_columns(self) -> jax.Array:
        """[B, T] bool: the columns holding the affix."""
        col = jnp.arange(self.tokens.shape[1])[None]
        start = self.affix_start[:, None]
        return (col >= start) & (col < start + self.affix_len) & self.valid

    def affix_column_index(self) -> jax.Array:
        """[B, L] int: the column of each row's n-th affix token."""
        return self.affix_start[:, None] + jnp.arange(self.affix_len)[None]

    def through_block(self, block_length: int) -> Batch:
        """The batch without its generation columns after the first block (positions kept): each
        request's text and first block, for a selector that runs them before decoding."""
        end, cut = self.gen_start + block_length, self.gen_start + self.gen_length
        keep = np.r_[0:end, cut:self.tokens.shape[1]]
        after_gen = self.affix_start >= cut  # suffix affixes move left by the dropped columns
        return dataclasses.replace(self, tokens=self.tokens[:, keep], positions=self.positions[:, keep],
                                   valid=self.valid[:, keep], gen_length=block_length,
                                   affix_start=jnp.where(after_gen, self.affix_start - (cut - end), self.affix_start))


def round_up(n: int, step: int) -> int:
    """n rounded up to a multiple of step (the sizes below, and the axes and widths built on them)."""
    return -(-n // step) * step


def bucket(n: int, minimum: int = 16) -> int:
    """Padded size for n: powers of two up to 512, then multiples of 256 (few programs, little waste)."""
    if n <= 0:
        return 0
    size = minimum
    while size < n and size < 512:
        size *= 2
    return size if size >= n else round_up(n, 256)


def batch_bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def token_bucket(n: int, floor: int = 16, ceiling: int | None = 128, per_octave: int = 8) -> int:
    """A packed token axis for n tokens: n rounded up to a multiple of a step that grows with n
    (n / per_octave rounded down to a power of two, within [floor, ceiling]): at most about
    1/per_octave padding, `per_octave` sizes per octave (a power of two) up to per_octave x ceiling
    tokens, a size per `ceiling` tokens beyond (none: per_octave sizes per octave throughout)."""
    step = max(floor, 1 << max(0, n.bit_length() - per_octave.bit_length()))
    step = step if ceiling is None else min(ceiling, step)
    return round_up(max(n, 1), step)


def row_bucket(n: int) -> int:
    """Rows for n requests: powers of two up to 4, then multiples of 4."""
    return batch_bucket(n) if n <= 4 else round_up(n, 4)


def check_request(r: Request, gen_length: int, mcfg: ModelConfig, affix: list[int] | None) -> None:
    """A clear error for a request that cannot run (affix: its ids, already checked by `check_affix`).
    Lengths are checked by arithmetic before anything else that grows with them: the row is never
    built here."""
    if not isinstance(r, Request):
        raise RequestError(f"must be a Request, got {type(r).__name__}")
    if isinstance(gen_length, bool) or not isinstance(gen_length, int) or gen_length <= 0:
        raise RequestError(f"gen_length must be a positive integer, got {gen_length!r}")
    prompt, tail = token_ids(r.prompt, "prompt"), token_ids(r.tail, "tail")
    if not _is_id(r.seed) or not 0 <= r.seed <= MAX_SEED:
        raise RequestError(f"seed must be an integer in [0, {MAX_SEED}], got {r.seed!r}")
    if r.affix_position is not None:
        if r.affix_position not in AFFIX_POSITIONS:
            raise RequestError(f"affix_position must be one of {AFFIX_POSITIONS}, got {r.affix_position!r}")
        if affix is None:
            raise RequestError(f"affix_position {r.affix_position!r} given without an affix")
        if r.affix_position == "infix" and not tail:
            raise RequestError("an infix affix needs a prompt tail after it (prompt_tail)")
    elif affix is not None:  # one rule on every path: an affix given is placed, never dropped
        raise RequestError("an affix was given but the request has no affix_position (prefix / infix / suffix)")
    if tail and r.affix_position != "infix":
        raise RequestError(f"a prompt tail goes after an infix affix; this request's affix position is "
                           f"{r.affix_position!r}")
    if not prompt:
        raise RequestError("empty prompt")
    check_context(mcfg.max_seq_len, **r.lengths(len(affix or ())), gen_length=gen_length)
    check_vocabulary(prompt + tail, mcfg.vocab_size)


def check_requests(requests: Sequence[Request], gen_length: int, mcfg: ModelConfig, affix: Any) -> list[int] | None:
    """Clear errors for requests that cannot run, before anything is built or compiled; an error names
    the request by its index. Returns the affix's ids (None without one)."""
    affix = None if affix is None else check_affix(affix, mcfg)
    for i, r in enumerate(requests):
        try:
            check_request(r, gen_length, mcfg, affix)
        except RequestError as e:
            raise RequestError(f"request {i}: {e}") from None
    return affix


def make_batch(
    requests: Sequence[Request], gen_length: int, mcfg: ModelConfig, affix: Sequence[int] | None = None,
    batch_size: int | None = None,
) -> Batch:
    """Pad the requests' rows into one bucketed batch (left part left-padded, right part right-padded)."""
    rows = [r.row(affix or [], gen_length, mcfg.mask_token_id) for r in requests]
    b = batch_size or batch_bucket(len(requests))
    left = bucket(max(row.left for row in rows))
    right = bucket(max(row.right for row in rows), minimum=8)
    tokens = np.full((b, left + gen_length + right), mcfg.pad_token_id, np.int32)
    valid = np.zeros(tokens.shape, bool)
    affix_start = np.zeros(b, np.int32)
    for i, row in enumerate(rows):
        pad = left - row.left
        tokens[i, pad:pad + row.num_columns] = row.tokens
        valid[i, pad:pad + row.num_columns] = True
        affix_start[i] = pad + row.affix_start
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
    seeds = np.asarray([r.seed for r in requests] + [0] * (b - len(requests)), np.uint32)
    has_affix = any(r.affix_position is not None for r in requests)
    return Batch(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(valid), jnp.asarray(seeds),
                 jnp.asarray(affix_start), left, gen_length, len(affix) if has_affix and affix else 0)
