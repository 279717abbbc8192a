"""One request inside the engine: its columns, its slots in the KV pool and its decoding progress.

A request's columns are one row of `layout.make_batch` without padding,
[left tokens][gen_length mask ids][right tokens], so a column's position is its index. Under the
`acache` policy a request owns slots only for its private columns (anchors + every non-affix
column) and reads the other affix columns from the shared affix blocks; under `baseline`
(Fast-dLLM dual cache) it owns every column and computes its affix in place.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable
from typing import Literal

import numpy as np

from acache_jax.layout import Request, RequestError

Policy = Literal["acache", "baseline"]
POLICIES = ("acache", "baseline")


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """Everything the engine knows about one request: columns, policy, slots, anchors, progress."""

    def __init__(self, request_id: Hashable, token_ids: Iterable[int], gen_start: int, gen_length: int,
                 block_length: int, affix_start: int = 0, affix_len: int = 0, affix_key: Hashable | None = None,
                 policy: Policy = "acache", seed: int = 0):
        self.request_id = request_id
        self.token_ids = np.asarray(list(token_ids), np.int32)  # [T] the request's columns before decoding
        self.gen_start, self.gen_length, self.block_length = gen_start, gen_length, block_length
        self.affix_start, self.affix_len, self.affix_key = affix_start, affix_len, affix_key
        self.policy, self.seed = policy, seed
        self._validate()
        self.status = SequenceStatus.WAITING
        self.block = 0  # current decoding block
        self.nfe = 0  # forward calls so far in which the request had masks in its block (keys fold this in)
        self.step = 0  # in-block step of the next commit (0 = block start)
        self.masked_at_start = 0  # masks in the block at its start (LLaDA's fixed schedule)
        self.probed = False  # an anchor probe ran for it (one more forward)
        self.needs_recompute = True  # set at admission and at each new block; the engine clears it
        self.num_anchors = 0  # K, fixed by Scheduler.add
        self.private_blocks: list[int] = []
        self.affix_is_new = False  # this admission allocated the affix blocks: the runner must fill them
        self._private_slots: np.ndarray | None = None  # [P]
        self._shared_slots: np.ndarray | None = None  # [L]
        self._anchors: np.ndarray | None = None  # [K] affix-relative, sorted

    @classmethod
    def from_request(cls, request_id: Hashable, request: Request, affix: Iterable[int] | None, gen_length: int,
                     block_length: int, mask_id: int, policy: Policy = "acache",
                     affix_key: Hashable | None = None) -> Sequence:
        """Lay a `layout.Request` out as `make_batch` does; the affix key defaults to the affix ids."""
        affix = list(affix or [])
        left, right, offset = request.parts(affix)
        gen_start = len(left)
        has_affix = request.affix_position is not None
        return cls(request_id, [*left, *[mask_id] * gen_length, *right], gen_start, gen_length, block_length,
                   affix_start=gen_start + gen_length if offset == -2 else max(offset, 0),
                   affix_len=len(affix) if has_affix else 0,
                   affix_key=(tuple(affix) if affix_key is None else affix_key) if has_affix else None,
                   policy=policy, seed=request.seed)

    def _validate(self) -> None:
        def fail(msg):
            raise RequestError(f"request {self.request_id!r}: {msg}")

        t = len(self.token_ids)
        if self.policy not in POLICIES:
            fail(f"unknown policy {self.policy!r}; choose one of {POLICIES}")
        if self.gen_length <= 0 or self.block_length <= 0 or self.gen_length % self.block_length:
            fail(f"gen_length ({self.gen_length}) must be a positive multiple of block_length ({self.block_length})")
        if not 0 <= self.gen_start <= t - self.gen_length:
            fail(f"generation region [{self.gen_start}, {self.gen_start + self.gen_length}) outside {t} columns")
        if (self.affix_key is None) != (self.affix_len == 0):
            fail(f"affix_key ({self.affix_key!r}) and affix_len ({self.affix_len}) must be given together")
        a0, a1 = self.affix_start, self.affix_start + self.affix_len
        outside_gen = a1 <= self.gen_start or a0 >= self.gen_start + self.gen_length
        if self.affix_len and not (0 <= a0 and a1 <= t and outside_gen):
            fail(f"affix columns [{a0}, {a1}) must lie within {t} columns and outside the generation region")

    @property
    def num_columns(self) -> int:
        return len(self.token_ids)

    @property
    def shares_affix(self) -> bool:
        """Reads its affix from shared blocks (acache with an affix); baseline computes it in place."""
        return self.policy == "acache" and self.affix_key is not None

    def num_private(self, k: int) -> int:
        """Columns the request owns slots for: T - L + K under acache, T under baseline."""
        if self.policy == "baseline":
            return self.num_columns
        if not 0 <= k <= self.affix_len:
            raise RequestError(f"request {self.request_id!r}: {k} anchors for an affix of {self.affix_len}")
        return self.num_columns - self.affix_len + k

    @property
    def num_gen_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def block_start(self) -> int:
        """Column of the current block's first token (the recompute point)."""
        return self.gen_start + self.block * self.block_length

    def advance_block(self) -> bool:
        """Move to the next block (which needs a recompute); False when the generation is complete."""
        assert self.block < self.num_gen_blocks, "advanced past the last block"
        self.block += 1
        self.needs_recompute = True
        return self.block < self.num_gen_blocks

    @property
    def block_columns(self) -> np.ndarray:
        return np.arange(self.block_start, self.block_start + self.block_length)

    @property
    def affix_columns(self) -> np.ndarray:
        return np.arange(self.affix_start, self.affix_start + self.affix_len)

    @property
    def shared_slots(self) -> np.ndarray | None:
        """int32 [L]: the shared affix slots (None when the affix is not shared)."""
        return self._shared_slots

    def set_slots(self, private_slots: np.ndarray, shared_slots: np.ndarray | None) -> None:
        private_slots = np.asarray(private_slots, np.int32)
        assert private_slots.shape == (self.num_private(self.num_anchors),), private_slots.shape
        assert (shared_slots is not None) == self.shares_affix, "shared slots iff the affix is shared"
        if shared_slots is not None:
            shared_slots = np.asarray(shared_slots, np.int32)
            assert shared_slots.shape == (self.affix_len,), shared_slots.shape
        self._private_slots, self._shared_slots = private_slots, shared_slots

    def set_anchors(self, anchors: np.ndarray) -> None:
        """The probe's K affix-relative anchor indices (any order; stored sorted)."""
        anchors = np.sort(np.asarray(anchors, np.int32))
        assert anchors.shape == (self.num_anchors,), f"{anchors.shape} anchors, expected {self.num_anchors}"
        assert len(np.unique(anchors)) == len(anchors), "repeated anchors"
        assert anchors.size == 0 or (anchors[0] >= 0 and anchors[-1] < self.affix_len), "anchor outside the affix"
        self._anchors = anchors

    @property
    def needs_probe(self) -> bool:
        """Anchors still to select (acache with K > 0, before the probe)."""
        return self._anchors is None and self.num_anchors > 0

    @property
    def anchors(self) -> np.ndarray:
        if self.needs_probe:
            raise RuntimeError(f"request {self.request_id!r}: anchors not selected yet (probe first)")
        return self._anchors if self._anchors is not None else np.zeros(0, np.int32)

    @property
    def private_columns(self) -> np.ndarray:
        """int32 [P]: anchors' columns + every non-affix column, in column order (baseline: all)."""
        private = np.ones(self.num_columns, bool)
        if self.shares_affix:
            private[self.affix_start:self.affix_start + self.affix_len] = False
            private[self.affix_start + self.anchors] = True
        return np.flatnonzero(private).astype(np.int32)

    @property
    def shared_columns(self) -> np.ndarray:
        """int32 [S]: the columns read from the shared affix slots (non-anchor affix columns; none
        unless the affix is shared)."""
        return np.setdiff1d(np.arange(self.num_columns, dtype=np.int32), self.private_columns)

    @property
    def write_slot_map(self) -> np.ndarray:
        """int32 [P]: where private column i's recomputed / decoded K/V go."""
        assert self._private_slots is not None, "slots not set"
        return self._private_slots.copy()

    @property
    def read_slot_map(self) -> np.ndarray:
        """int32 [T]: column -> slot to read (non-anchor affix columns: the shared affix slots)."""
        assert self._private_slots is not None, "slots not set"
        slots = np.empty(self.num_columns, np.int32)
        if self.shares_affix:
            slots[self.affix_start:self.affix_start + self.affix_len] = self._shared_slots
        slots[self.private_columns] = self._private_slots
        return slots

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, T={self.num_columns}, "
                f"block={self.block}/{self.num_gen_blocks}, affix={self.affix_key is not None})")
