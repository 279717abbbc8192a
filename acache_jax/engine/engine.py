"""The serving engine: continuous batching of block-diffusion requests over one paged KV pool.

`Engine.step` is schedule -> run -> postprocess: the scheduler admits waiting requests and plans
one packed forward (probes of the new requests, recomputes of those at a block start, one
in-block step of the others, side by side on one token axis), the runner computes it and then
keeps decoding blocks on the device until one finishes, and the scheduler applies the results,
freeing finished requests at once. Per request, the forwards and commits are the static path's
(`acache_jax.decoding.decode`: the same pool writes and reads, the same commit rule), so the same request
decodes to the same tokens in any company and order.

Policies (from `DecodeConfig.cache`): `acache` / `direct` keep the affix K/V once in shared,
reference-counted blocks and recompute only each request's private columns; `dual` is the
Fast-dLLM baseline in the same engine: every request owns all its columns and recomputes them all.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

import numpy as np

from acache_jax.decoding.acache import DEVIATION_SELECTORS, PROBE_SIGN, AffixCache, check_affix_cache
from acache_jax.decoding.layout import Request, check_affix, check_context, check_request, round_up
from acache_jax.decoding.sampling import SamplerValues
from acache_jax.engine.pool import BLOCK_SIZE, PagedPool
from acache_jax.engine.runner import Observer, Runner
from acache_jax.engine.scheduler import Plan, Scheduler, StepOutput
from acache_jax.engine.sequence import SequenceState
from acache_jax.network.config import DecodeConfig, DecodeError, InputError, resolve_decode_config
from acache_jax.network.kv import KVPool
from acache_jax.network.model import Model
from acache_jax.network.sharding import use_mesh

ENGINE_POLICIES = {"dual": "baseline", "acache": "acache", "direct": "acache"}
ENGINE_SELECTORS = (*PROBE_SIGN, *DEVIATION_SELECTORS)  # all but random: a probe or a dense forward ranks

# The default bound on one packed forward's tokens. Its activations grow with the token axis, about
# 330 kB a token at LLaDA-8B shape: unbounded, the baseline's first step of 16 requests with a
# 3,000-token affix (53,248 tokens) needed a 17.5 GiB temporary and ran out of memory on an 80 GB
# card, which ran the case at XLA's default memory fraction with this bound (about 5.4 GiB by that
# rate; docs/BENCHMARKS.md, "Seventh run"). Steps of a few requests stay below it.
DEFAULT_STEP_TOKENS = 16_384


def default_pool_tokens(config: DecodeConfig, max_batch: int, context: int, block_size: int = BLOCK_SIZE) -> int:
    """An engine's KV pool when none is given: `max_batch` requests of `context` tokens, and never
    less than one such request holds. Sharing an affix, a request also holds slots for its anchors,
    and its private and affix slots each round up to a page, so at `max_batch=1` a pool of
    `context` tokens would refuse a request that fits the context."""
    one = context
    if ENGINE_POLICIES[config.cache] != "baseline":  # the affix is shared: two page-rounded segments
        one = round_up(context + config.anchors(context), block_size) + block_size
    return max(max_batch * context, one)


def pool_for(model: Model, configs: Sequence[DecodeConfig], max_batch: int, context: int | None = None,
             pool_tokens: int | None = None, block_size: int = BLOCK_SIZE) -> PagedPool:
    """A KV pool for engines of these configs (one each, stepped from one thread): `pool_tokens`
    slots, else the largest of their `default_pool_tokens` for `context` (default the model's)."""
    context = context or model.config.max_seq_len
    return PagedPool.create(model, pool_tokens or max(default_pool_tokens(c, max_batch, context, block_size)
                                                      for c in configs), block_size)


@dataclasses.dataclass
class EngineResult:
    request_id: int
    tokens: np.ndarray  # the generated region
    anchors: np.ndarray  # sorted affix-relative anchor indices (empty without selective recompute)
    nfe: int  # forward calls that computed the request (the probe included)
    forward_tokens: int  # tokens those forwards computed for it


@dataclasses.dataclass
class EngineUsage:
    running: int
    waiting: int
    blocks_in_use: int  # of the pool's blocks
    blocks: int


@dataclasses.dataclass
class EngineStats:
    """Counters over the engine's life (seconds: wall time inside `step`)."""

    iterations: int = 0
    affix_fills: int = 0
    peak_blocks: int = 0
    peak_kv_bytes: int = 0
    generated_tokens: int = 0
    forward_tokens: int = 0  # tokens the forwards computed, padding excluded
    padded_tokens: int = 0  # tokens the forwards computed, padding included
    seconds: float = 0.0
    device_seconds: float = 0.0  # of `seconds`, inside the jitted calls and the fetch of their results

    @property
    def host_seconds(self) -> float:
        """The rest of `seconds`: host work (scheduling, building the inputs) the device waits for."""
        return self.seconds - self.device_seconds

    def record(self, plan: Plan, out: StepOutput, finished: list[SequenceState], block_bytes: int,
               seconds: float) -> None:
        """Add one iteration: its plan (memory held after admission), the runner's work, the requests
        that finished, and its wall time."""
        self.iterations += 1
        self.peak_blocks = max(self.peak_blocks, plan.blocks_in_use)
        self.peak_kv_bytes = max(self.peak_kv_bytes, plan.blocks_in_use * block_bytes)
        self.affix_fills += out.work.affix_fills
        self.forward_tokens += int(out.forward_tokens.sum())
        self.padded_tokens += out.work.padded_tokens
        self.device_seconds += out.work.device_seconds
        self.generated_tokens += sum(len(seq.generated) for seq in finished)
        self.seconds += seconds

    def summary(self) -> dict:
        return dict(iterations=self.iterations, affix_fills=self.affix_fills, peak_blocks=self.peak_blocks,
                    peak_kv_bytes=self.peak_kv_bytes, generated_tokens=self.generated_tokens,
                    forward_tokens=self.forward_tokens, padded_tokens=self.padded_tokens, seconds=self.seconds,
                    host_seconds=self.host_seconds,
                    tokens_per_s=self.generated_tokens / self.seconds if self.seconds else 0.0)


def check_engine_config(config: DecodeConfig) -> None:
    """The decoding settings the engine runs (a subset of the static path's)."""
    if config.cache not in ENGINE_POLICIES:
        raise DecodeError(f"the engine runs the cache policies {tuple(ENGINE_POLICIES)}, not {config.cache!r}")
    if config.cfg_scale > 0:
        raise DecodeError("classifier-free guidance is not supported by the engine")
    if config.selective and config.selector not in ENGINE_SELECTORS:
        raise DecodeError(f"the engine selects anchors with {ENGINE_SELECTORS}, not {config.selector!r}")


class Engine:
    """Continuous-batching engine over a paged KV pool (see the module docstring).

    observer: benchmark bookkeeping (`runner.Observer`: each forward's work, and when it asks to be
    timed, each jitted call's device time); None, the default and a server's setting, keeps
    nothing per forward.
    fixed_shapes: run every step on programs that do not depend on the traffic (read widths for the
    whole `context`, token axes four per octave), so that `warm_up` can compile them all
    beforehand, as a server wants; otherwise shapes follow the requests (less padding, programs
    compiled as new shapes appear).
    context: prompt + generated tokens of the longest request the engine serves (default, and at
    most, the model's context); a longer request is refused. It sizes the default pool
    (`default_pool_tokens`: max_batch x context, or one request's slots if more) and the fixed
    shapes' read widths: a model whose context is far longer than its requests (Dream's 131072
    tokens) would otherwise get a pool and programs for that length.
    max_step_tokens: the most tokens one iteration's packed forward computes (default
    `DEFAULT_STEP_TOKENS`; None: no bound), which bounds its activations: probes and block starts
    beyond it wait for a later iteration (`Scheduler.schedule`; the oldest waiting one always runs).
    Outputs do not depend on it.
    min_affix_reuse: under `acache` with anchors, a request whose affix tokens times its
    generation blocks fall below this runs as `dual` (exactly the baseline's tokens). Its probe is
    a forward of its own, and a request running alone pays it in full: at one request on a GPU the
    probe costs about what recomputing 400-600 affix tokens does, so a short affix over one block
    saves less than it costs (docs/BENCHMARKS.md, "Twelfth run"). Default 0: every request with an
    affix runs ACache. Outputs of the others do not change.
    pool: a `PagedPool` to run in, shared with other engines stepped from the same thread (a
    server's, one per decoding setting: the device then holds one pool); default: a pool of its
    own of `pool_tokens` slots in blocks of `block_size` (not to be given with `pool`).
    """

    def __init__(self, model: Model, config: DecodeConfig | None = None, *, pool_tokens: int | None = None,
                 block_size: int | None = None, max_batch: int = 16, observer: Observer | None = None,
                 fixed_shapes: bool = False, context: int | None = None,
                 max_step_tokens: int | None = DEFAULT_STEP_TOKENS, min_affix_reuse: int = 0,
                 pool: PagedPool | None = None):
        config = resolve_decode_config(config, model.generation_config)
        for name, value in (("pool_tokens", pool_tokens), ("block_size", block_size), ("max_batch", max_batch),
                            ("context", context), ("max_step_tokens", max_step_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise DecodeError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(min_affix_reuse, bool) or not isinstance(min_affix_reuse, int) or min_affix_reuse < 0:
            raise DecodeError(f"min_affix_reuse must be a non-negative integer, got {min_affix_reuse!r}")
        if context is not None and context > model.config.max_seq_len:
            raise DecodeError(f"context {context} exceeds the model's context of {model.config.max_seq_len} tokens")
        if pool is not None and (pool_tokens is not None or block_size is not None):
            raise DecodeError("pool_tokens and block_size size an engine's own pool: not to be given with `pool`")
        check_engine_config(config)
        self.model, self.config = model, config
        self.policy = ENGINE_POLICIES[config.cache]
        self.min_affix_reuse = min_affix_reuse if config.selective else 0  # no probe to pay for without anchors
        self.context = context or model.config.max_seq_len
        if pool is None:
            pool = pool_for(model, [config], max_batch, self.context, pool_tokens, block_size or BLOCK_SIZE)
        self.block_manager = pool.blocks
        self.scheduler = Scheduler(self.block_manager, max_batch, max_step_tokens)
        self.runner = Runner(model, config, pool, max_batch, self.context, observer, fixed_shapes)
        self.stats = EngineStats()
        self._block_bytes = self.block_manager.block_size * KVPool.slot_bytes(model.config, model.dtype)
        self._mask_id = model.config.mask_token_id
        self._eos = model.config.eos_token_id if config.early_stop else None  # a block all of it ends a request
        self._live: dict[int, SequenceState] = {}  # queued and running requests
        self._held: dict[int, EngineResult] = {}  # finished during generate() but not asked for there
        self._next_id = 0

    # -- requests ---------------------------------------------------------------------------------

    def add(self, request: Request, affix: Sequence[int] | AffixCache | None = None, *,
            gen_length: int | None = None, config: DecodeConfig | None = None) -> int:
        """Queue a request (its affix, if any, as token ids or a built `AffixCache`); returns its id.

        gen_length: this request's own, a multiple of the block length (default that of `config`); it
        decodes as `generate` would with `config.with_gen_length(gen_length)`: the same steps per block.
        config: this request's own settings (default the engine's), which may differ from the
        engine's only where they share programs (`DecodeConfig.engine_key`): the gen length, the
        sampler's numbers (temperature, threshold, ...; each row commits with its own) and the
        anchor ratios; it then decodes as `generate` with that config would.
        Under `acache` / `direct`, a request without an affix shares nothing: it owns and recomputes
        all its columns, exactly as under `dual`, so one engine serves requests with and without one.
        A request that cannot run raises `InputError` naming the problem, and nothing is queued.
        """
        own = self._own(config)
        gen_length = own.gen_length if gen_length is None else gen_length
        return self._queue(request, affix, *self._check(request, affix, gen_length), own)

    def _own(self, config: DecodeConfig | None) -> DecodeConfig:
        """A request's own config, checked to run on this engine's programs."""
        if config is None or config == self.config:
            return self.config
        ours, theirs = self.config.engine_key(), config.engine_key()
        if theirs != ours:
            differ = [f.name for f in dataclasses.fields(DecodeConfig)
                      if getattr(ours, f.name) != getattr(theirs, f.name)]
            raise DecodeError(f"a request's config may differ from its engine's only in its gen length, the sampler's "
                              f"numbers (not in which rules they select) and the anchor ratios; it differs in {differ}")
        return config

    def _check(self, request: Request, affix: Sequence[int] | AffixCache | None, gen_length: int
               ) -> tuple[list[int] | None, int]:
        """(affix ids, gen length) of a request that can run; lengths are checked by arithmetic
        before anything is built or reserved."""
        mcfg = self.model.config
        if isinstance(affix, AffixCache):
            check_affix_cache(self.model, affix)
        affix_ids = None if affix is None else check_affix(affix, mcfg)
        check_request(request, gen_length, mcfg, affix_ids)
        check_context(self.context, "this engine's context", **request.lengths(len(affix_ids or ())),
                      gen_length=gen_length)
        self.request_config(gen_length)  # a multiple of the block length
        return affix_ids, gen_length

    def _queue(self, request: Request, affix: Sequence[int] | AffixCache | None, affix_ids: list[int] | None,
               gen_length: int, cfg: DecodeConfig) -> int:
        """Queue a checked request (`_check`'s results, its own config `_own`); returns its id."""
        mcfg = self.model.config
        policy = "baseline" if self.runs_as_dual(len(affix_ids or ()), gen_length) else self.policy
        seq = SequenceState.from_request(self._next_id, request, affix_ids, gen_length, cfg.block_length,
                                         mcfg.mask_token_id, policy, affix if isinstance(affix, AffixCache) else None,
                                         SamplerValues.of(cfg))
        self.scheduler.add(seq, cfg.anchors(seq.affix_len), cfg.min_anchors(seq.affix_len))
        self.runner.reserve(seq)
        self._live[seq.request_id] = seq
        self._next_id += 1
        return seq.request_id

    def runs_as_dual(self, affix_len: int, gen_length: int) -> bool:
        """A request with an affix of this length runs as `dual` here: its affix tokens times its
        generation blocks fall below `min_affix_reuse`."""
        return affix_len > 0 and affix_len * (gen_length // self.config.block_length) < self.min_affix_reuse

    def cancel(self, request_id: int) -> bool:
        """Stop a queued or running request now, freeing its slots at once; False if it is not live
        (finished, cancelled or unknown). Its result is never handed out."""
        seq = self._live.get(request_id)
        if seq is None:
            return False
        self.scheduler.cancel(seq)
        del self._live[request_id]
        return True

    def partial(self, request_id: int) -> np.ndarray | None:
        """A live request's committed contiguous prefix of its generation (None if it is not live):
        every token of it is final, so it can be shown while the rest decodes."""
        seq = self._live.get(request_id)
        return None if seq is None else seq.committed

    def num_anchors(self, request_id: int) -> int | None:
        """A live request's anchor count: its reserve until its probe has run, then what it kept
        (an adaptive budget keeps fewer); None if it is not live."""
        seq = self._live.get(request_id)
        return None if seq is None else seq.num_anchors

    def has_unfinished(self) -> bool:
        """Requests are queued or running: `step` has work."""
        return not self.scheduler.idle

    def drain(self) -> None:
        """Going idle: the affixes of the last finished requests leave the pool now (they are kept
        for one more admission, which may find them resident)."""
        self.scheduler.drain()

    def usage(self) -> EngineUsage:
        """Requests running and waiting, and the pool's blocks in use, now."""
        bm = self.block_manager
        return EngineUsage(len(self.scheduler.running), len(self.scheduler.waiting), self.scheduler.blocks_in_use,
                           bm.num_blocks)

    def warm_up(self, max_tokens: int, threads: int | None = None, stop: threading.Event | None = None) -> int:
        """Compile every program that steps of up to `max_tokens` tokens run (an engine with
        `fixed_shapes`), `threads` at a time (default: `Runner.warm_up`'s); returns how many it
        compiled. A step of more tokens than that still compiles its own program when it first
        comes. Setting `stop` (from another thread) starts no more compiles: the call returns once
        those in flight end (`Runner.warm_up`)."""
        with use_mesh(self.model.mesh):
            return self.runner.warm_up(max_tokens, threads, stop)

    def request_config(self, gen_length: int) -> DecodeConfig:
        """The static path's config of a request with this gen length: the same schedule per block."""
        return self.config.with_gen_length(gen_length)

    def generate(self, requests: Sequence[Request], affix: Sequence[int] | AffixCache | None = None, *,
                 config: DecodeConfig | None = None) -> list[EngineResult]:
        """Queue `requests` (sharing `affix`) and step until they are done; their results in input order.

        config: the requests' own settings, gen length included (default the engine's), as `add` takes.
        Requests queued earlier with `add` keep running alongside; those that finish meanwhile are
        held for the next `run()`, which hands them out.
        """
        own = self._own(config)
        checked = []
        for i, r in enumerate(requests):  # every request checked before any is queued
            try:
                checked.append(self._check(r, affix, own.gen_length))
            except InputError as e:
                raise type(e)(f"request {i}: {e}") from None
        ids = [self._queue(r, affix, *c, own) for r, c in zip(requests, checked)]
        wanted, got = set(ids), {}
        while len(got) < len(wanted):
            for res in self.step():
                (got if res.request_id in wanted else self._held)[res.request_id] = res
        if not self.has_unfinished():
            self.drain()
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

            usage = self.usage()
            bar = tqdm(total=usage.running + usage.waiting, desc="engine", unit="req")
        while self.has_unfinished():
            finished = self.step()
            done += finished
            if bar is not None:
                bar.update(len(finished))
        self.drain()
        if bar is not None:
            bar.close()
        return sorted(done, key=lambda r: r.request_id)

    # -- one iteration ----------------------------------------------------------------------------

    def step(self) -> list[EngineResult]:
        """schedule -> run -> postprocess; returns the requests that finished."""
        start = time.perf_counter()
        with use_mesh(self.model.mesh):
            plan = self.scheduler.schedule(self._mask_id)
            out = self.runner.run(plan)
            finished = self.scheduler.postprocess(plan, out, self._mask_id, self._eos)
        self.stats.record(plan, out, finished, self._block_bytes, time.perf_counter() - start)
        for seq in finished:
            del self._live[seq.request_id]
        return [EngineResult(s.request_id, s.generated.copy(), s.anchors.copy(), s.nfe + int(s.probed),
                             s.forward_tokens) for s in finished]
