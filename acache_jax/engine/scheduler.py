"""Continuous batching: FIFO admission while the pool and the batch have room, immediate freeing.

A request's footprint is fixed at admission (its private columns and its affix never grow), so
admission reserves everything it will ever need and nothing is preempted. Every accepted request
fits into an empty pool, so the queue always drains.

Each iteration's `Plan` says what the one packed forward computes (probes of newly admitted
requests, recomputes of requests at a block start, one in-block step of the others) and which
requests then keep decoding their blocks on the device; `postprocess` applies what came back.
A bound on a step's tokens (`max_step_tokens`) makes probes and block starts beyond it wait.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from acache_jax.decoding.layout import RequestError
from acache_jax.engine.block_manager import BlockManager
from acache_jax.engine.sequence import SequenceState, SequenceStatus

if TYPE_CHECKING:
    from acache_jax.decoding.acache import Ranking


class RequestTooLargeError(RequestError):
    """A request that needs more KV blocks than the whole pool has."""


@dataclasses.dataclass
class Plan:
    """One iteration: the packed forward's segments, in this order, and the device block loop."""

    fills: list[SequenceState]  # newly resident affixes to write into their shared blocks first
    probe: list[SequenceState]  # admitted, anchors to select (their non-affix columns)
    recompute: list[SequenceState]  # at a block start (their private columns; the block commits)
    decode: list[SequenceState]  # mid-block (their block; one in-block step)
    blocks_in_use: int = 0  # pool blocks held once this iteration's requests were admitted

    @property
    def segments(self) -> list[SequenceState]:
        return self.probe + self.recompute + self.decode

    @property
    def loop(self) -> list[SequenceState]:
        """The requests that go on decoding their block on the device after the packed forward."""
        return self.recompute + self.decode

    @property
    def empty(self) -> bool:
        return not (self.probe or self.recompute or self.decode)


@dataclasses.dataclass
class Work:
    """What an iteration cost beyond each request's tokens (`StepOutput.forward_tokens`): the engine
    adds these into its `EngineStats`."""

    padded_tokens: int = 0  # tokens the forwards computed, padding included
    device_seconds: float = 0.0  # inside the jitted calls and the fetch of their results
    affix_fills: int = 0  # affixes written into their shared blocks


@dataclasses.dataclass
class StepOutput:
    """What the device returns for a plan: per loop request, its block afterwards and counters;
    per probed request, its affix ranked for selection; per segment, the tokens computed for it."""

    blocks: np.ndarray  # [len(plan.loop), block_length]
    nfe: np.ndarray  # [len(plan.loop)] forward calls with masks in the block, this iteration
    steps: np.ndarray  # [len(plan.loop)] in-block commits, this iteration
    ranking: Ranking | None  # per plan.probe request: [N] best first, and the budget's covering count
    # [len(plan.segments)] tokens computed for each this iteration, padding excluded
    forward_tokens: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    work: Work = dataclasses.field(default_factory=Work)


class Scheduler:
    """Moves sequences from a waiting queue to the running set and back out, reserving their blocks."""

    def __init__(self, block_manager: BlockManager, max_batch: int, max_step_tokens: int | None = None):
        if max_batch <= 0:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        if max_step_tokens is not None and max_step_tokens <= 0:
            raise ValueError(f"max_step_tokens must be positive, got {max_step_tokens}")
        self.block_manager = block_manager
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self._iteration = 0  # schedule() calls so far
        self._waiting: deque[SequenceState] = deque()
        self._running: list[SequenceState] = []
        self._finished_last_step: list[SequenceState] = []  # their affix stays resident one admission longer

    @property
    def waiting(self) -> tuple[SequenceState, ...]:
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[SequenceState, ...]:
        return tuple(self._running)

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running

    @property
    def blocks_in_use(self) -> int:
        return self.block_manager.num_blocks - self.block_manager.num_free_blocks

    def _blocks(self, seq: SequenceState, n_anchors: int) -> tuple[int, int]:
        """(private blocks, affix blocks) the sequence holds while it runs with n_anchors anchors."""
        bm = self.block_manager
        affix = bm.blocks_for(seq.affix_len) if seq.shares_affix else 0
        return bm.blocks_for(seq.num_private(n_anchors)), affix

    def add(self, seq: SequenceState, n_anchors: int, min_anchors: int | None = None) -> None:
        """Queue a request with n_anchors anchors (between min_anchors and n_anchors under an
        adaptive budget: n_anchors are reserved, the rest freed once they are known); reject one
        that could not run even in an empty pool.

        The affix counts even when it is resident: it stays resident while the request runs.
        """
        assert seq.status is SequenceStatus.WAITING and seq not in self._waiting, f"{seq} was added before"
        n_anchors = n_anchors if seq.shares_affix else 0
        private, affix = self._blocks(seq, n_anchors)
        total = self.block_manager.num_blocks
        if private + affix > total:
            bs = self.block_manager.block_size
            raise RequestTooLargeError(
                f"request {seq.request_id!r} needs {private} private + {affix} affix blocks of {bs} slots "
                f"({seq.num_private(n_anchors)} private + {seq.affix_len if affix else 0} affix slots), "
                f"more than the pool's {total} blocks")
        seq.num_anchors = n_anchors
        seq.min_anchors = n_anchors if min_anchors is None else min(min_anchors, n_anchors)
        self._waiting.append(seq)

    def admit(self) -> list[SequenceState]:
        """Admit waiting requests in FIFO order while blocks and batch room suffice; the newly admitted."""
        bm, admitted = self.block_manager, []
        while self._waiting and len(self._running) < self.max_batch:
            seq = self._waiting[0]
            private, affix = self._blocks(seq, seq.num_anchors)
            resident = seq.shares_affix and bm.resident(seq.affix_key) is not None
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
            seq.ready_since = self._iteration
            self._running.append(seq)
            admitted.append(seq)
        return admitted

    def schedule(self, mask_id: int) -> Plan:
        """Admit what fits, release affixes of the last finished, and plan the next iteration.

        With `max_step_tokens`, the packed forward computes at most that many tokens: every
        mid-block request (a block each), the request that has waited longest for a probe or a
        block start (always, so that it cannot be passed over for ever), then the others in the
        order they became ready while they fit; the rest wait. A request's tokens do not depend on
        the iteration it runs in, so the bound changes when work runs, never what it computes. It
        bounds a step's activations (a 53,248-token step of LLaDA-8B needed a 17.5 GiB temporary)
        and, with fixed shapes, keeps steps within the programs a warm-up compiled."""
        admitted = self.admit()
        for seq in self._finished_last_step:  # the affix was kept for this admission only
            self.release_affix(seq)
        self._finished_last_step = []
        self._iteration += 1
        plan = Plan([s for s in admitted if s.affix_is_new], [], [], [], self.blocks_in_use)
        ready: list[SequenceState] = []  # waiting for a probe or a block start
        for seq in self._running:
            (ready if seq.needs_probe or seq.needs_recompute else plan.decode).append(seq)
        if self.max_step_tokens is not None and ready:
            tokens = sum(len(s.forward_columns) for s in plan.decode)
            chosen = set()
            for i, seq in enumerate(sorted(ready, key=lambda s: s.ready_since)):  # stable: admission order
                n = len(seq.forward_columns)
                if i == 0 or tokens + n <= self.max_step_tokens:
                    chosen.add(id(seq))
                    tokens += n
            ready = [s for s in ready if id(s) in chosen]
        for seq in ready:
            if seq.needs_probe:
                plan.probe.append(seq)
            else:
                seq.step, seq.masked_at_start = 0, int((seq.tokens[seq.block_columns] == mask_id).sum())
                plan.recompute.append(seq)
        return plan

    def postprocess(self, plan: Plan, out: StepOutput, mask_id: int, eos: int | None) -> list[SequenceState]:
        """Apply an iteration's results; free the requests that finished and return them.

        eos: with early stop, the end-of-text id (a finished block all of it ends the request).
        """
        for seq, n in zip(plan.segments, out.forward_tokens):
            seq.forward_tokens += int(n)
        if out.ranking is not None:
            for seq, order, covering in zip(plan.probe, *out.ranking):
                self._set_anchors(seq, order[:int(covering.clip(seq.min_anchors, seq.num_anchors))])
        for seq in plan.recompute:
            seq.needs_recompute = False
        finished = []
        for seq, block, nfe, steps in zip(plan.loop, out.blocks, out.nfe, out.steps):
            seq.tokens[seq.block_columns] = block
            seq.nfe += int(nfe)
            seq.step += int(steps)
            if (block == mask_id).any():
                continue
            if eos is not None and (block == eos).all():
                seq.end_generation(eos)
            if seq.block == seq.num_gen_blocks or not seq.advance_block():
                self.finish(seq)
                finished.append(seq)
            else:
                seq.ready_since = self._iteration
        return finished

    def _set_anchors(self, seq: SequenceState, anchors: np.ndarray) -> None:
        """The probed request's anchors; blocks reserved for anchors it did not get go back."""
        if len(anchors) < seq.num_anchors:
            seq.fewer_anchors(len(anchors))
            keep = self.block_manager.blocks_for(seq.num_private(seq.num_anchors))
            self.block_manager.free(seq.private_blocks[keep:])
            seq.private_blocks = seq.private_blocks[:keep]
        seq.set_anchors(anchors)
        seq.probed = True

    def finish(self, seq: SequenceState) -> None:
        """Free the request's private blocks at once; its affix is released at the next admission,
        so that a request admitted then can still find the affix resident."""
        assert seq.status is SequenceStatus.RUNNING, f"{seq} is not running"
        self._running.remove(seq)
        self.block_manager.free(seq.private_blocks)
        seq.private_blocks = []
        seq.status = SequenceStatus.FINISHED
        self._finished_last_step.append(seq)

    def cancel(self, seq: SequenceState) -> None:
        """Drop a waiting or running request now: its private blocks are freed and its hold on the
        affix released at once (nothing of it is left for a later admission)."""
        if seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)
        else:
            assert seq.status is SequenceStatus.RUNNING, f"{seq} is neither waiting nor running"
            self._running.remove(seq)
            self.block_manager.free(seq.private_blocks)
            seq.private_blocks = []
            if seq.shares_affix:
                self.block_manager.release_shared(seq.affix_key)
        seq.status = SequenceStatus.FINISHED

    def release_affix(self, seq: SequenceState) -> None:
        assert seq.status is SequenceStatus.FINISHED, f"{seq} has not finished"
        if seq.shares_affix:
            self.block_manager.release_shared(seq.affix_key)

    def drain(self) -> None:
        """Release the affixes of the last finished requests now (the engine is going idle)."""
        for seq in self._finished_last_step:
            self.release_affix(seq)
        self._finished_last_step = []
