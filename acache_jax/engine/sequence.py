"""One request inside the engine: its row of columns, its slots in the KV pool, its progress.

The row is the request's `layout.Row` ([left][gen_length masks][right]; a column's index is its
position). Under the `acache` policy a request owns pool slots only for its private columns (its
anchors and every non-affix column) and reads the other affix columns from the shared affix
blocks; under `baseline` (Fast-dLLM dual cache) it owns every column and computes its affix in
place. The non-affix columns' slots come first and are fixed at admission (the anchor probe
writes them before the anchors are known); the anchors' slots follow.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Hashable
from typing import TYPE_CHECKING, Literal

import numpy as np

from acache_jax.decoding.layout import Request, RequestError, Row

if TYPE_CHECKING:
    from acache_jax.decoding.sampling import SamplerValues
    from acache_jax.network.kv import AffixCache

Policy = Literal["acache", "baseline"]
POLICIES = ("acache", "baseline")


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


def _memoized(fn):
    """A read-only array property kept until the slots or anchors change: every step reads these."""

    @functools.wraps(fn)
    def get(self):
        if fn.__name__ not in self._columns:
            value = fn(self)
            value.flags.writeable = False
            self._columns[fn.__name__] = value
        return self._columns[fn.__name__]

    return property(get)


class SequenceState:
    """Everything the engine knows about one request: row, policy, slots, anchors, progress."""

    def __init__(self, request_id: Hashable, row: Row, block_length: int, affix_key: Hashable | None = None,
                 policy: Policy = "acache", seed: int = 0, mask_id: int | None = None):
        self.request_id, self.row, self.block_length = request_id, row, block_length
        self.mask_id = mask_id  # the generation region's mask id (needed by `committed`)
        self.affix_key, self.policy, self.seed = affix_key, policy, seed
        self._validate()
        self.tokens = row.tokens.copy()  # [T] the columns as decoded so far
        self.status = SequenceStatus.WAITING
        self.block = 0  # current decoding block
        self.nfe = 0  # forward calls so far in which the request had masks in its block (keys fold this in)
        self.step = 0  # in-block step of the next commit (0 = block start)
        self.masked_at_start = 0  # masks in the block at its start (LLaDA's fixed schedule)
        self.probed = False  # an anchor probe ran for it (one more forward)
        self.needs_recompute = True  # set at admission and at each new block
        self.ready_since = 0  # the scheduler's iteration from which it has waited for a forward of its own
        self.forward_tokens = 0  # tokens the forwards computed for it
        self.num_anchors = 0  # K: reserved by Scheduler.add, final once the anchors are set
        self.min_anchors = 0  # an adaptive budget's lower bound (= K under a fixed one)
        self.private_blocks: list[int] = []
        self.affix_is_new = False  # this admission allocated the affix blocks: the runner must fill them
        self.affix_source: AffixCache | list[int] | None = None  # what the runner fills the affix blocks from
        self.sampler: SamplerValues | None = None  # its commits' numbers: its own config's (the engine's if None)
        self._private_slots: np.ndarray | None = None  # [T - L + K] (baseline: [T])
        self._shared_slots: np.ndarray | None = None  # [L]
        self._anchors: np.ndarray | None = None  # [K] affix-relative, sorted
        self._columns: dict[str, np.ndarray] = {}  # column sets and the slot map, until slots or anchors change

    @classmethod
    def from_request(cls, request_id: Hashable, request: Request, affix: list[int] | None, gen_length: int,
                     block_length: int, mask_id: int, policy: Policy = "acache",
                     affix_cache: AffixCache | None = None, sampler: SamplerValues | None = None) -> SequenceState:
        """The request's row with its affix placed, keyed by the affix ids; the affix's shared pages
        are filled from `affix_cache` when one was built beforehand, else computed from the ids.
        `sampler`: the numbers it commits with (None: the engine's)."""
        row = request.row(affix or [], gen_length, mask_id)
        seq = cls(request_id, row, block_length, tuple(affix) if row.affix_len else None, policy, request.seed,
                  mask_id)
        seq.affix_source = (affix_cache if affix_cache is not None else list(affix)) if row.affix_len else None
        seq.sampler = sampler
        return seq

    def _validate(self) -> None:
        def fail(msg):
            raise RequestError(f"request {self.request_id!r}: {msg}")

        row = self.row
        if self.policy not in POLICIES:
            fail(f"unknown policy {self.policy!r}; choose one of {POLICIES}")
        if row.gen_length <= 0 or self.block_length <= 0 or row.gen_length % self.block_length:
            fail(f"gen_length ({row.gen_length}) must be a positive multiple of block_length ({self.block_length})")
        if (self.affix_key is None) != (row.affix_len == 0):
            fail(f"affix_key ({self.affix_key!r}) and the affix ({row.affix_len} tokens) must be given together")

    @property
    def num_columns(self) -> int:
        return self.row.num_columns

    @property
    def affix_len(self) -> int:
        return self.row.affix_len

    @property
    def shares_affix(self) -> bool:
        """Reads its affix from shared blocks (acache with an affix); baseline computes it in place."""
        return self.policy == "acache" and self.affix_key is not None

    def num_private(self, n_anchors: int) -> int:
        """Columns the request owns slots for: T - L + n_anchors under acache, T under baseline."""
        if not self.shares_affix:
            return self.num_columns
        if not 0 <= n_anchors <= self.affix_len:
            raise RequestError(f"request {self.request_id!r}: {n_anchors} anchors for an affix of {self.affix_len}")
        return self.num_columns - self.affix_len + n_anchors

    @property
    def num_gen_blocks(self) -> int:
        return self.row.gen_length // self.block_length

    @property
    def block_start(self) -> int:
        """Column of the current block's first token (the recompute point)."""
        return self.row.gen_start + self.block * self.block_length

    @property
    def block_columns(self) -> np.ndarray:
        return np.arange(self.block_start, self.block_start + self.block_length, dtype=np.int32)

    @property
    def generated(self) -> np.ndarray:
        return self.tokens[self.row.gen_start:self.row.gen_start + self.row.gen_length]

    @property
    def committed(self) -> np.ndarray:
        """The generated tokens up to the first still-masked one: final, whatever is decoded later
        (a committed token never changes; blocks commit in order)."""
        gen = self.generated
        masked = np.flatnonzero(gen == self.mask_id)
        return gen[:masked[0] if masked.size else len(gen)].copy()

    def advance_block(self) -> bool:
        """Move to the next block (which needs a recompute); False when the generation is complete."""
        assert self.block < self.num_gen_blocks, "advanced past the last block"
        self.block += 1
        self.needs_recompute = True
        return self.block < self.num_gen_blocks

    def end_generation(self, eos: int) -> None:
        """Early stop: every column after the current block becomes end-of-text, uncomputed."""
        self.tokens[self.block_start + self.block_length:self.row.gen_start + self.row.gen_length] = eos
        self.block = self.num_gen_blocks

    # -- slots ------------------------------------------------------------------------------------

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
        self._columns.clear()

    def fewer_anchors(self, n_anchors: int) -> None:
        """An adaptive budget kept fewer anchors than reserved: only the first slots of the reserve
        stay (the anchors' slots follow the fixed ones)."""
        assert self._anchors is None and self.min_anchors <= n_anchors <= self.num_anchors, (n_anchors,
                                                                                             self.num_anchors)
        self.num_anchors = n_anchors
        self.set_slots(self._private_slots[:self.num_private(n_anchors)], self._shared_slots)

    def set_anchors(self, anchors: np.ndarray) -> None:
        """The probe's K affix-relative anchor indices (any order; stored sorted)."""
        anchors = np.sort(np.asarray(anchors, np.int32))
        assert anchors.shape == (self.num_anchors,), f"{anchors.shape} anchors, expected {self.num_anchors}"
        assert len(np.unique(anchors)) == len(anchors), "repeated anchors"
        assert anchors.size == 0 or (anchors[0] >= 0 and anchors[-1] < self.affix_len), "anchor outside the affix"
        self._anchors = anchors
        self._columns.clear()

    @property
    def needs_probe(self) -> bool:
        """Anchors still to select (acache with K > 0, before the probe)."""
        return self._anchors is None and self.num_anchors > 0

    @property
    def anchors(self) -> np.ndarray:
        if self.needs_probe:
            raise RuntimeError(f"request {self.request_id!r}: anchors not selected yet (probe first)")
        return self._anchors if self._anchors is not None else np.zeros(0, np.int32)

    @_memoized
    def own_columns(self) -> np.ndarray:
        """int32: the columns whose slots are fixed at admission (all but the affix when it is shared)."""
        if not self.shares_affix:
            return np.arange(self.num_columns, dtype=np.int32)
        return self.row.private_columns(np.zeros(0, np.int32))

    @_memoized
    def private_columns(self) -> np.ndarray:
        """int32 [P]: the anchors' columns + every non-affix column, in column order (baseline: all)."""
        if not self.shares_affix:
            return np.arange(self.num_columns, dtype=np.int32)
        return self.row.private_columns(self.anchors)

    @_memoized
    def shared_columns(self) -> np.ndarray:
        """int32: the columns read from the shared affix slots (none unless the affix is shared)."""
        if not self.shares_affix:
            return np.zeros(0, np.int32)
        return self.row.shared_columns(self.anchors)

    @property
    def forward_columns(self) -> np.ndarray:
        """int32: the columns the next packed forward computes for this request: before its probe,
        its own columns; at a block start, its private columns; mid-block, its block."""
        if self.needs_probe:
            return self.own_columns
        return self.private_columns if self.needs_recompute else self.block_columns

    @_memoized
    def read_slot_map(self) -> np.ndarray:
        """int32 [T]: column -> slot to read (non-anchor affix columns: the shared affix slots;
        before the probe, every affix column)."""
        assert self._private_slots is not None, "slots not set"
        slots = np.empty(self.num_columns, np.int32)
        own = self.own_columns
        slots[own] = self._private_slots[:len(own)]
        if self.shares_affix:
            affix = self.row.affix_columns
            slots[affix] = self._shared_slots
            if self._anchors is not None:
                slots[affix[self._anchors]] = self._private_slots[len(own):]
        return slots

    def __repr__(self) -> str:
        return (f"SequenceState({self.request_id!r}, {self.status.name}, T={self.num_columns}, "
                f"block={self.block}/{self.num_gen_blocks}, affix={self.affix_key is not None})")
