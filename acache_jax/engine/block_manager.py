"""Blocks of the paged KV pool: private blocks per request, shared affix blocks with refcounts.

The pool is, per layer, [num_slots, kv_heads, head_dim]; block b owns slots
b * block_size ... b * block_size + block_size - 1. Every block is either free, private to one
request, or shared under one affix key; the sets are disjoint, which is what keeps one request
from ever writing (or reading) another request's K/V.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Hashable

import numpy as np


class PoolFullError(RuntimeError):
    """Not enough free blocks for an allocation (the scheduler checks first, so this is a bug)."""


@dataclasses.dataclass
class _Shared:
    blocks: list[int]
    n_slots: int
    refcount: int


class BlockManager:
    """Free / private / shared state of every block of the pool (ids only; the K/V live on device)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._private: set[int] = set()
        self._shared: dict[Hashable, _Shared] = {}
        self._shared_ids: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, n_slots: int) -> int:
        return -(-n_slots // self.block_size)

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= len(self._free)

    def _take(self, n_slots: int) -> list[int]:
        n = self.blocks_for(n_slots)
        if not self.can_allocate(n):
            raise PoolFullError(f"{n} blocks needed for {n_slots} slots, {len(self._free)} of {self.num_blocks} free")
        return [self._free.popleft() for _ in range(n)]

    def allocate(self, n_slots: int) -> list[int]:
        """Private blocks holding n_slots slots."""
        blocks = self._take(n_slots)
        self._private.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Give private blocks back; all or nothing, so a bad call leaves the pool unchanged."""
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"free({blocks}): a block is listed twice")
        shared = [b for b in blocks if b in self._shared_ids]
        if shared:
            raise ValueError(f"free: blocks {shared} belong to a shared affix; release it with release_shared")
        unowned = [b for b in blocks if b not in self._private]
        if unowned:
            raise ValueError(f"free: blocks {unowned} are not allocated (double free?)")
        self._private.difference_update(blocks)
        self._free.extend(blocks)

    def acquire_shared(self, key: Hashable, n_slots: int) -> tuple[list[int], bool]:
        """The blocks of affix `key`, refcount + 1; True when newly allocated (the runner must fill them)."""
        entry = self._shared.get(key)
        if entry is not None:
            if entry.n_slots != n_slots:
                raise ValueError(f"affix {key!r} is resident with {entry.n_slots} slots, asked for {n_slots}")
            entry.refcount += 1
            return list(entry.blocks), False
        blocks = self._take(n_slots)
        self._shared[key] = _Shared(blocks, n_slots, 1)
        self._shared_ids.update(blocks)
        return list(blocks), True

    def release_shared(self, key: Hashable) -> None:
        """Refcount - 1; the blocks are freed when the last user releases them."""
        entry = self._shared.get(key)
        if entry is None:
            raise ValueError(f"release_shared({key!r}): no such resident affix")
        entry.refcount -= 1
        if entry.refcount == 0:
            del self._shared[key]
            self._shared_ids.difference_update(entry.blocks)
            self._free.extend(entry.blocks)

    def resident(self, key: Hashable) -> tuple[list[int], int] | None:
        """Affix `key`'s blocks and how many requests hold them; None when it is not resident."""
        entry = self._shared.get(key)
        return None if entry is None else (list(entry.blocks), entry.refcount)

    @staticmethod
    def slots(blocks: list[int], n: int, block_size: int) -> np.ndarray:
        """int32 [n]: the first n slots of `blocks`, in block order."""
        if n > len(blocks) * block_size:
            raise ValueError(f"{n} slots asked of {len(blocks)} blocks of {block_size}")
        ids = np.asarray(blocks, np.int64)[:, None] * block_size + np.arange(block_size)
        return ids.reshape(-1)[:n].astype(np.int32)
