"""The serving engine: continuous batching of block-diffusion requests over one paged KV pool.

Each iteration: admit waiting requests (filling a newly resident affix once, probing the new
requests' anchors in one batched forward), recompute every request that starts a block, then run
one in-block decode step over every request that still has masks in its block; requests that
finish free their blocks at once. Per request, the forwards and commits are the static path's
(`acache_jax.decode`), so the same request decodes to the same tokens in any company and order.

Policies (from `DecodeConfig.cache`): `acache` / `direct` keep the affix K/V once in shared,
reference-counted blocks and recompute only each request's private columns; `dual` is the
Fast-dLLM baseline in the same engine: every request owns all its columns and recomputes them all.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence as Seq

import jax
import numpy as np

from acache_jax.acache import AffixCache, build_affix_cache, check_affix_cache
from acache_jax.config import DecodeConfig, DecodeError, resolve_decode_config
from acache_jax.engine import runner
from acache_jax.engine.block_manager import BlockManager
from acache_jax.engine.scheduler import Scheduler
from acache_jax.engine.sequence import Sequence
from acache_jax.layout import Request, affix_token_ids, batch_bucket, bucket, check_requests
from acache_jax.model import Model

ENGINE_POLICIES = {"dual": "baseline", "acache": "acache", "direct": "acache"}


@dataclasses.dataclass
class EngineResult:
    request_id: int
    tokens: np.ndarray  # the generated region
    anchors: np.ndarray  # sorted affix-relative anchor indices (empty without selective recompute)
    nfe: int  # forward calls that computed the request (the probe included)


@dataclasses.dataclass
class EngineStats:
    """Per-call latencies (seconds, host-timed around each jitted step incl. its result transfer)."""

    recompute: list[float] = dataclasses.field(default_factory=list)
    recompute_rows: list[int] = dataclasses.field(default_factory=list)
    decode: list[float] = dataclasses.field(default_factory=list)
    probe: list[float] = dataclasses.field(default_factory=list)
    affix_fills: int = 0
    peak_blocks: int = 0
    peak_kv_bytes: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0

    def summary(self) -> dict:
        med = lambda xs: float(np.median(xs)) if xs else 0.0
        return dict(recompute_calls=len(self.recompute), recompute_median_s=med(self.recompute),
                    decode_calls=len(self.decode), decode_median_s=med(self.decode), probe_calls=len(self.probe),
                    affix_fills=self.affix_fills, peak_blocks=self.peak_blocks, peak_kv_bytes=self.peak_kv_bytes,
                    generated_tokens=self.generated_tokens, seconds=self.seconds,
                    tokens_per_s=self.generated_tokens / self.seconds if self.seconds else 0.0)


def _pad(rows: list[np.ndarray], width: int, fill, count: int) -> np.ndarray:
    """Stack 1-D rows into [count, width], padded with `fill` (extra rows entirely fill)."""
    out = np.full((count, width), fill, dtype=np.asarray(fill).dtype if not rows else rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _per_row(values: list, count: int, dtype) -> np.ndarray:
    """One value per row as [count], rows past the given ones 0."""
    return np.asarray(list(values) + [0] * (count - len(values)), dtype)


def check_engine_config(config: DecodeConfig) -> None:
    """The decoding settings the engine runs (a subset of the static path's)."""
    if config.cache not in ENGINE_POLICIES:
        raise DecodeError(f"the engine runs the cache policies {tuple(ENGINE_POLICIES)}, not {config.cache!r}")
    if config.cfg_scale > 0:
        raise DecodeError("classifier-free guidance is not supported by the engine")
    if config.selective and config.selector not in ("attention", "bottom"):
        raise DecodeError(f"the engine selects anchors with 'attention' or 'bottom', not {config.selector!r}")


class Engine:
    """Continuous-batching engine over a paged KV pool (see the module docstring)."""

    def __init__(self, model: Model, config: DecodeConfig | None = None, *, pool_tokens: int | None = None,
                 block_size: int = 16, max_batch: int = 16):
        config = resolve_decode_config(config, model.generation_config)
        for name, value in (("pool_tokens", pool_tokens), ("block_size", block_size), ("max_batch", max_batch)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise DecodeError(f"{name} must be a positive integer, got {value!r}")
        check_engine_config(config)
        self.model, self.config = model, config
        self._params, treedef = jax.tree.flatten(model.params)
        self._structure = runner.structure(model.graphdef, treedef)
        self.policy = ENGINE_POLICIES[config.cache]
        pool_tokens = pool_tokens or max_batch * model.config.max_seq_len
        num_blocks = -(-pool_tokens // block_size)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_batch)
        self.pool = runner.new_pool(model.config, num_blocks * block_size, model.dtype)
        self.stats = EngineStats()
        self._affixes: dict[tuple[int, ...], list[int] | AffixCache] = {}
        self._held: dict[int, EngineResult] = {}  # finished during generate() but not asked for there
        self._next_id = 0
        self._finished_last_step: list[Sequence] = []

    # -- requests ---------------------------------------------------------------------------------

    def add(self, request: Request, affix: Seq[int] | AffixCache | None = None) -> int:
        """Queue a request (its affix, if any, as token ids or a built `AffixCache`); returns its id."""
        cfg, mcfg = self.config, self.model.config
        if isinstance(affix, AffixCache):
            check_affix_cache(self.model, affix)
        affix_ids = None if affix is None else affix_token_ids(affix)
        check_requests([request], cfg.gen_length, mcfg, affix_ids)
        if cfg.selective and request.affix_position is None:
            raise DecodeError(f"cache policy {cfg.cache!r}: the request needs an affix_position")
        seq = Sequence.from_request(self._next_id, request, affix_ids if request.affix_position else None,
                                    cfg.gen_length, cfg.block_length, mcfg.mask_token_id, self.policy)
        k = cfg.anchors(seq.affix_len) if seq.shares_affix else 0
        self.scheduler.add(seq, k)
        if seq.shares_affix and not isinstance(self._affixes.get(seq.affix_key), AffixCache):
            self._affixes[seq.affix_key] = affix if isinstance(affix, AffixCache) else affix_ids
        self._next_id += 1
        return seq.request_id

    def generate(self, requests: Seq[Request], affix: Seq[int] | AffixCache | None = None) -> list[EngineResult]:
        """Queue `requests` (sharing `affix`) and step until they are done; their results in input order.

        Requests queued earlier with `add` keep running alongside; those that finish meanwhile are
        held for the next `run()`, which hands them out.
        """
        ids = [self.add(r, affix) for r in requests]
        wanted, got = set(ids), {}
        while len(got) < len(wanted):
            for res in self.step():
                (got if res.request_id in wanted else self._held)[res.request_id] = res
        if self.scheduler.idle:
            self._release_finished()
        return [got[i] for i in ids]

    def run(self, progress: bool = False) -> list[EngineResult]:
        """Step until every queued request is done; every result not yet handed out, in id order.

        The engine keeps no result it has handed out (from here, `generate` or `step`).
        """
        done = list(self._held.values())
        self._held.clear()
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(self.scheduler.waiting) + len(self.scheduler.running), desc="engine", unit="req")
        while not self.scheduler.idle or self._finished_last_step:
            finished = self.step()
            done += finished
            if bar is not None:
                bar.update(len(finished))
        if bar is not None:
            bar.close()
        return sorted(done, key=lambda r: r.request_id)

    # -- one iteration ----------------------------------------------------------------------------

    def step(self) -> list[EngineResult]:
        """Admit, probe, recompute block starts, one decode step; returns the requests that finished."""
        start = time.perf_counter()
        finished = self._step()
        self.stats.seconds += time.perf_counter() - start
        return finished

    def _step(self) -> list[EngineResult]:
        mask_id = self.model.config.mask_token_id
        admitted = self.scheduler.admit()
        self._release_finished()  # their affix stayed resident for this admission
        for seq in admitted:
            if seq.affix_is_new:
                self._fill_affix(seq)
        used = self.block_manager.num_blocks - self.block_manager.num_free_blocks
        self.stats.peak_blocks = max(self.stats.peak_blocks, used)
        self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes,
                                       used * self.block_manager.block_size * self.pool.bytes_per_slot)
        probing = [s for s in admitted if s.needs_probe]
        if probing:
            self._probe(probing)
        recompute, _ = self.scheduler.split()
        if recompute:
            self._recompute(recompute)
        masked = lambda s: (s.token_ids[s.block_columns] == mask_id).any()
        decoding = [s for s in self.scheduler.running if masked(s)]
        if decoding:
            self._decode(decoding)
        finished = []
        eos = self.model.config.eos_token_id
        for seq in list(self.scheduler.running):
            if masked(seq):
                continue
            ended = self.config.early_stop and (seq.token_ids[seq.block_columns] == eos).all()
            if ended:  # the rest of the generation is end-of-text, uncomputed
                seq.token_ids[seq.block_start + seq.block_length:seq.gen_start + seq.gen_length] = eos
            if ended or not seq.advance_block():
                self.scheduler.finish(seq, release_affix=False)
                self._finished_last_step.append(seq)
                finished.append(self._result(seq))
        return finished

    def _release_finished(self) -> None:
        for seq in self._finished_last_step:
            self.scheduler.release_affix(seq)
        self._finished_last_step = []

    def _result(self, seq: Sequence) -> EngineResult:
        cfg = self.config
        tokens = seq.token_ids[seq.gen_start:seq.gen_start + cfg.gen_length].copy()
        self.stats.generated_tokens += len(tokens)
        return EngineResult(seq.request_id, tokens, seq.anchors.copy(), seq.nfe + int(seq.probed))

    def _fill_affix(self, seq: Sequence) -> None:
        affix = self._affixes[seq.affix_key]
        cache = affix if isinstance(affix, AffixCache) else build_affix_cache(self.model, affix)
        self.pool = runner.fill_affix(self.pool, cache, jax.numpy.asarray(seq.shared_slots),
                                      self.model.config.rope_theta)
        self.stats.affix_fills += 1

    @staticmethod
    def _per_column(values: list[np.ndarray], columns: list[np.ndarray], fill, width: int | None = None):
        """(values, positions, valid) of each row's columns, padded to a bucketed [rows, width]."""
        n, width = batch_bucket(len(columns)), width or bucket(max(1, max(len(c) for c in columns)))
        return (_pad(values, width, fill, n), _pad([c.astype(np.int32) for c in columns], width, np.int32(0), n),
                _pad([np.ones(len(c), bool) for c in columns], width, np.False_, n))

    def _rows(self, seqs: list[Sequence], columns: list[np.ndarray], width: int | None = None) -> runner.Rows:
        tokens = [s.token_ids[c] for s, c in zip(seqs, columns)]
        return runner.Rows(*self._per_column(tokens, columns, np.int32(self.model.config.pad_token_id), width))

    def _reads(self, columns: list[np.ndarray], slots: list[np.ndarray], offsets: list[int]) -> runner.Reads:
        offset = _per_row(offsets, batch_bucket(len(columns)), np.int32)
        return runner.Reads(*self._per_column(slots, columns, np.int32(0)), offset)

    def _shared_reads(self, seqs: list[Sequence]) -> runner.Reads | None:
        """Reads of the non-anchor affix columns from the shared slots at each request's affix
        offset; None when no request reads a shared affix (or DropNA drops those columns)."""
        if self.config.drop_non_anchor or not any(s.shares_affix for s in seqs):
            return None
        columns = [s.shared_columns for s in seqs]
        return self._reads(columns, [s.read_slot_map[c] for s, c in zip(seqs, columns)],
                           [s.affix_start for s in seqs])

    def _commit_inputs(self, seqs: list[Sequence]) -> runner.CommitInputs:
        n = batch_bucket(len(seqs))
        col = lambda f, dtype: _per_row([f(s) for s in seqs], n, dtype)
        blocks = _pad([s.token_ids[s.block_columns] for s in seqs], self.config.block_length,
                      np.int32(self.model.config.mask_token_id), n)
        return runner.CommitInputs(blocks, col(lambda s: s.seed, np.uint32), col(lambda s: s.nfe, np.int32),
                                   col(lambda s: s.step, np.int32), col(lambda s: s.masked_at_start, np.int32))

    def _apply(self, seqs: list[Sequence], blocks: np.ndarray) -> None:
        for seq, block in zip(seqs, blocks):
            seq.token_ids[seq.block_columns] = block
            seq.nfe += 1
            seq.step += 1

    def _probe(self, seqs: list[Sequence]) -> None:
        cols = [np.setdiff1d(np.arange(s.num_columns), s.affix_columns) for s in seqs]
        reads = self._reads([s.affix_columns for s in seqs], [s.shared_slots for s in seqs],
                            [s.affix_start for s in seqs])
        start = time.perf_counter()
        order = runner.probe_step(self._structure, self.config, self._params, self.pool,
                                  self._rows(seqs, cols), reads)
        order = np.asarray(order)
        self.stats.probe.append(time.perf_counter() - start)
        for seq, ranked in zip(seqs, order):
            seq.set_anchors(ranked[:seq.num_anchors])
            seq.probed = True

    def _recompute(self, seqs: list[Sequence]) -> None:
        mask_id, n = self.model.config.mask_token_id, batch_bucket(len(seqs))
        for seq in seqs:
            seq.step, seq.masked_at_start = 0, int((seq.token_ids[seq.block_columns] == mask_id).sum())
        cols = [s.private_columns for s in seqs]
        width = bucket(max(len(c) for c in cols))
        write = _pad([s.write_slot_map for s in seqs], width, np.int32(self.pool.num_slots), n)
        logit_index = _pad([np.searchsorted(c, s.block_columns).astype(np.int32) for s, c in zip(seqs, cols)],
                           self.config.block_length, np.int32(0), n)
        reads = self._shared_reads(seqs)
        commit = self._commit_inputs(seqs)
        start = time.perf_counter()
        self.pool, blocks = runner.recompute_step(self._structure, self.config, self._params, self.pool,
                                                  self._rows(seqs, cols), reads, write, logit_index, commit)
        blocks = np.asarray(blocks)
        self.stats.recompute.append(time.perf_counter() - start)
        self.stats.recompute_rows.append(len(seqs))
        self._apply(seqs, blocks)
        for seq in seqs:
            seq.needs_recompute = False

    def _decode(self, seqs: list[Sequence]) -> None:
        # Block columns come from the forward itself; non-anchor affix columns from the shared slots
        # (unless DropNA drops them); the rest from the request's private slots.
        private = [np.setdiff1d(s.private_columns, s.block_columns) for s in seqs]
        shared = self._shared_reads(seqs)
        reads = (self._reads(private, [s.read_slot_map[c] for s, c in zip(seqs, private)], [0] * len(seqs)),)
        reads = reads if shared is None else (shared, *reads)
        commit = self._commit_inputs(seqs)
        start = time.perf_counter()
        blocks = runner.decode_step(self._structure, self.config, self._params, self.pool,
                                    self._rows(seqs, [s.block_columns for s in seqs], self.config.block_length),
                                    reads, commit)
        blocks = np.asarray(blocks)
        self.stats.decode.append(time.perf_counter() - start)
        self._apply(seqs, blocks)

