"""One paged KV pool: its device arrays and which of their blocks each request holds.

An engine makes its own pool by default. Engines that take turns on one thread share one (a
server runs one engine per decoding setting), so that the device holds one pool however many
settings are running: a request reserves every block it will need when it is admitted
(`Scheduler.admit`), so one engine's admissions never take blocks from another's running requests,
and each engine's steps replace the arrays in turn (the jitted steps donate them). A resident affix
is shared across those engines as within one: its K/V depend on the model and its ids alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from acache_jax.engine.block_manager import BlockManager
from acache_jax.network.kv import KVPool

BLOCK_SIZE = 16  # slots of a pool block, by default


@dataclasses.dataclass
class PagedPool:
    """The K/V of every slot (`kv`, on the device) and who holds each block of them (`blocks`)."""

    blocks: BlockManager
    kv: KVPool

    @classmethod
    def create(cls, model: Any, pool_tokens: int, block_size: int = BLOCK_SIZE) -> PagedPool:
        """An empty pool of at least `pool_tokens` slots, in whole blocks, for `model` (a `Model`)."""
        blocks = BlockManager(-(-pool_tokens // block_size), block_size)
        return cls(blocks, KVPool.zeros(model.config, blocks.num_blocks * block_size, model.dtype, model.mesh))

    @property
    def alive(self) -> bool:
        """The device arrays still exist: a step that failed after taking them (they are donated)
        leaves none, and every request that had K/V in them is lost."""
        return not any(a.is_deleted() for a in jax.tree.leaves(self.kv))
