"""Continuous batching: FIFO admission while the pool and the batch have room, immediate freeing.

A request's footprint is fixed at admission (its private columns and its affix never grow), so
admission reserves everything it will ever need and nothing is preempted. Every accepted request
fits into an empty pool, so the queue always drains.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from acache_jax.engine.block_manager import BlockManager
from acache_jax.engine.sequence import Sequence, SequenceStatus
from acache_jax.layout import RequestError


class RequestTooLargeError(RequestError):
    """A request that needs more KV blocks than the whole pool has."""


class Scheduler:
    """Moves sequences from a waiting queue to the running set and back out, reserving their blocks."""

    def __init__(self, block_manager: BlockManager, max_batch: int):
        if max_batch <= 0:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self.block_manager = block_manager
        self.max_batch = max_batch
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []

    @property
    def waiting(self) -> tuple[Sequence, ...]:
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Sequence, ...]:
        return tuple(self._running)

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running

    def _blocks(self, seq: Sequence, k: int) -> tuple[int, int]:
        """(private blocks, affix blocks) the sequence holds while it runs with K anchors."""
        bm = self.block_manager
        affix = bm.blocks_for(seq.affix_len) if seq.shares_affix else 0
        return bm.blocks_for(seq.num_private(k)), affix

    def add(self, seq: Sequence, k: int) -> None:
        """Queue a request with K anchors; reject one that could not run even in an empty pool.

        The affix counts even when it is resident: it stays resident while the request runs.
        """
        assert seq.status is SequenceStatus.WAITING and seq not in self._waiting, f"{seq} was added before"
        k = k if seq.shares_affix else 0
        private, affix = self._blocks(seq, k)
        total = self.block_manager.num_blocks
        if private + affix > total:
            bs = self.block_manager.block_size
            raise RequestTooLargeError(
                f"request {seq.request_id!r} needs {private} private + {affix} affix blocks of {bs} slots "
                f"({seq.num_private(k)} private + {seq.affix_len if affix else 0} affix slots), "
                f"more than the pool's {total} blocks")
        seq.num_anchors = k
        self._waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Admit waiting requests in FIFO order while blocks and batch room suffice; the newly admitted.

        The runner then fills the affix blocks of sequences with `affix_is_new`, probes those with
        `needs_probe` and calls `set_anchors`.
        """
        bm, admitted = self.block_manager, []
        while self._waiting and len(self._running) < self.max_batch:
            seq = self._waiting[0]
            private, affix = self._blocks(seq, seq.num_anchors)
            resident = seq.shares_affix and bm.shared_blocks(seq.affix_key) is not None
            if not bm.can_allocate(private + (0 if resident else affix)):
                break
            self._waiting.popleft()
            shared_slots = None
            if seq.shares_affix:
                shared, seq.affix_is_new = bm.acquire_shared(seq.affix_key, seq.affix_len)
                shared_slots = bm.slots(shared, seq.affix_len, bm.block_size)
            n_private = seq.num_private(seq.num_anchors)
            seq.private_blocks = bm.allocate(n_private)
            seq.set_slots(bm.slots(seq.private_blocks, n_private, bm.block_size), shared_slots)
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            admitted.append(seq)
        return admitted

    def finish(self, seq: Sequence, release_affix: bool = True) -> None:
        """Free the request's private blocks at once and release its affix (or leave that to a later
        `release_affix`, so that a request admitted next can still find the affix resident)."""
        assert seq.status is SequenceStatus.RUNNING, f"{seq} is not running"
        self._running.remove(seq)
        self.block_manager.free(seq.private_blocks)
        seq.private_blocks = []
        seq.status = SequenceStatus.FINISHED
        if release_affix:
            self.release_affix(seq)

    def release_affix(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.FINISHED, f"{seq} has not finished"
        if seq.shares_affix:
            self.block_manager.release_shared(seq.affix_key)

    def split(self, needs_recompute: Callable[[Sequence], bool] = lambda s: s.needs_recompute,
              ) -> tuple[list[Sequence], list[Sequence]]:
        """(running sequences that need a recompute this step, the others), each in admission order."""
        recompute, decoding = [], []
        for seq in self._running:
            (recompute if needs_recompute(seq) else decoding).append(seq)
        return recompute, decoding
