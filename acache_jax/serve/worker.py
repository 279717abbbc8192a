"""The engine thread: the one owner of the engines, the affix index and store; the HTTP side only
sends it commands and reads the events it sends back.

Requests whose decoding knobs differ at most in the sampler's numbers (temperature, threshold)
and the anchor ratios share one `Engine` (one `DecodeConfig.engine_key`: one set of compiled
programs), each decoding with its own numbers; a request with other knobs gets an engine of its
own, at most `max_engines` at
once (an idle one is dropped for a new one; if none is idle the request is refused with 429).
Every engine runs in one KV pool (`PagedPool`), so the device holds one pool however many
settings are running, the one the server's memory check sized. With
`default_engine` set and room for two engines, one place is kept for the server's default
settings and their engine is never dropped: a request with the defaults is never refused for
want of an engine, so a 429 can honestly tell other requests to use the defaults. The
thread steps every engine that has work in turn. After each step, each running request's
committed contiguous prefix (final tokens) is turned into text: new text is sent to its stream,
and a request whose prefix already holds an end-of-text token or a stop string is finished and
cancelled there (the rest of its generation could not change its answer; the server's early stop,
off with `finish_early=False` for measurements). Without an affix of
its own, a request is run against the longest span discovery found in it (`affix_index`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import sys
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from acache_jax.decoding.acache import build_affix_cache
from acache_jax.engine import Engine
from acache_jax.engine.engine import DEFAULT_STEP_TOKENS, pool_for
from acache_jax.engine.pool import PagedPool
from acache_jax.network.config import DecodeConfig, InputError
from acache_jax.network.model import Model
from acache_jax.serve.affix_index import AffixStore, SpanIndex
from acache_jax.serve.protocol import Answer, ApiError, Job, engine_config

Emit = Callable[[tuple], None]  # ("text", str) | ("done", Answer) | ("error", ApiError), from the engine thread


@dataclasses.dataclass
class Settings:
    """The server's engine and discovery flags."""

    max_batch: int = 16
    pool_tokens: int | None = None  # the one pool's (default `default_pool_tokens` of the first engine's knobs)
    context: int | None = None  # prompt + generated tokens of a request (default the model's context)
    max_engines: int = 4
    max_queue: int = 256  # requests queued or running, over every engine
    discovery: bool = True
    min_count: int = 2
    min_tokens: int = 64
    affix_budget_bytes: int = 1 << 30
    finish_early: bool = True  # end a request once its committed prefix holds an end of text
    # > 0: engines run fixed shapes, and `warm_up` compiles every program of steps up to this many
    # tokens before the first request (0: programs compile as the traffic first needs them)
    warmup_tokens: int = 0
    # the most tokens one step computes (Engine's max_step_tokens); None: warmup_tokens when set, so
    # that a burst of new requests runs on warmed-up programs (split over steps), else the engine's
    # default bound
    max_step_tokens: int | None = None
    min_affix_reuse: int = 0  # Engine's: requests of less affix tokens x blocks run as dual
    default_engine: DecodeConfig | None = None  # requests with the server's defaults: their engine is kept


@dataclasses.dataclass
class _Live:
    job: Job
    emit: Emit
    engine: DecodeConfig  # its engine's key
    rid: int
    affix: tuple[int, ...] | None  # the affix it runs with (declared, a suffix or discovered)
    source: str | None  # "declared" | "discovered"
    held: bool  # holds its affix in the store
    hit: bool  # its affix's K/V came from the store: all but the anchors were not computed
    sent: str = ""  # text already streamed: never changes


class Worker:
    """Owns the engines; `submit` / `cancel` / `stop` are safe to call from any thread."""

    def __init__(self, model: Model, settings: Settings):
        self.model, self.settings = model, settings
        self.index = SpanIndex(settings.min_count, settings.min_tokens)
        self.store = AffixStore(settings.affix_budget_bytes)
        self.engines: OrderedDict[DecodeConfig, Engine] = OrderedDict()
        self.pool: PagedPool | None = None  # every engine's, made with the first
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._live: dict[str, _Live] = {}  # by job id
        self._lock = threading.Lock()
        self._inflight = 0
        self._stopping = threading.Event()  # set by `stop`: a warm-up in progress starts no more compiles
        self._warming = False  # the engine thread is in a warm-up, or waits for those in the background
        # engines that requests made, compiling in a thread of their own: not stepped until it ends
        self._compiling: dict[DecodeConfig, threading.Thread] = {}
        self.counters: Counter[str] = Counter()
        self.snapshot: dict[str, float] = {}
        self._publish()
        self._thread = threading.Thread(target=self._run, name="acache-engine", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------------

    def submit(self, job: Job, emit: Emit) -> None:
        """Queue a job; ApiError 429 when the queue is full (nothing is queued then)."""
        with self._lock:
            if self._inflight >= self.settings.max_queue:
                self.counters["rejected"] += 1
                raise ApiError(429, f"the server has {self._inflight} requests queued or running, its limit; "
                                    "retry shortly", code="queue_full", headers={"Retry-After": "1"})
            self._inflight += 1
        self._inbox.put(("submit", job, emit))

    def cancel(self, job_id: str) -> None:
        self._inbox.put(("cancel", job_id))

    def warm_up(self, base: DecodeConfig) -> threading.Event:
        """Compile the engine that requests with the server's default knobs (`base`) run on, for steps
        of up to `settings.warmup_tokens` tokens, before the requests that follow; the event is set
        once it is done."""
        done = threading.Event()
        self._inbox.put(("warm", engine_config(base), done))
        return done

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is left, free every slot and end the thread. A warm-up in progress starts no
        more compiles; the compiles in flight are waited for past `timeout` (a process that exits
        while XLA compiles in its threads aborts), which bounds the wait for anything else."""
        self._stopping.set()
        self._inbox.put(("stop",))
        self._thread.join(timeout)
        if self._thread.is_alive() and self._warming:
            print("acache_jax.serve: waiting for the warm-up's compiles in flight to end", file=sys.stderr, flush=True)
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def inflight(self) -> int:
        """Requests accepted and not yet answered, refused or cancelled: unlike the engine thread's
        snapshot, this includes those it has not taken in yet (it may be compiling a new engine)."""
        with self._lock:
            return self._inflight

    # -- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            busy = any(e.has_unfinished() for k, e in self.engines.items() if k not in self._compiling)
            try:
                command = self._inbox.get(block=not busy)
            except queue.Empty:
                command = None
            commanded = command is not None
            while command is not None:
                if command[0] == "stop":
                    self._shutdown()
                    return
                self._command(command)
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    command = None
            if commanded:
                self._publish()  # what the commands changed (a cancel, a refusal) shows before the next step
            for key in list(self.engines):
                if key in self.engines and key not in self._compiling and self.engines[key].has_unfinished():
                    self._step(key)
            self._publish()

    def _command(self, command: tuple) -> None:
        if command[0] == "warm":
            start, tokens = time.perf_counter(), self.settings.warmup_tokens
            self._warming = True
            try:
                count = self._engine(command[1], compile_ahead=False).warm_up(tokens, stop=self._stopping)
                what = "warm-up stopped with the server, having compiled" if self._stopping.is_set() else "compiled"
                print(f"acache_jax.serve: {what} {count} programs for steps of up to {tokens} tokens in "
                      f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
            except Exception as e:  # the server still serves, compiling as requests need
                print(f"acache_jax.serve: warm-up failed: {e!r}", file=sys.stderr, flush=True)
            finally:
                self._warming = False
                command[2].set()
            return
        if command[0] == "compiled":  # a background warm-up ended: its engine steps from now on
            self._compiling.pop(command[1]).join()
            return
        if command[0] == "cancel":
            live = self._live.get(command[1])
            if live is not None:
                self.engines[live.engine].cancel(live.rid)
                self._end(live)
                self.counters["cancelled"] += 1
            return
        _, job, emit = command
        try:
            self._admit(job, emit)
        except ApiError as e:
            self._refuse(emit, e)
        except InputError as e:
            self._refuse(emit, ApiError(400, str(e)))
        except Exception as e:  # a bad request must not end the thread
            print(f"acache_jax.serve: request {job.id} failed: {e!r}", file=sys.stderr, flush=True)
            self._refuse(emit, ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    def _refuse(self, emit: Emit, error: ApiError) -> None:
        with self._lock:
            self._inflight -= 1
        self.counters["failed"] += 1
        emit(("error", error))

    def _engine(self, config: DecodeConfig, compile_ahead: bool = True) -> Engine:
        """The engine requests of this config run on (made if need be, made with it). With
        `warmup_tokens`, a new engine compiles its programs in a thread of its own before it steps
        (`compile_ahead`): its requests wait for that, and the other engines go on serving, where
        compiling as its first steps needed them would stop every engine for as long (a sampling
        setting's 48 programs took 51-57 s at 8B shapes on an H100, docs/BENCHMARKS.md)."""
        key = config.engine_key()
        engine = self.engines.get(key)
        if engine is None:
            limit, default = self.settings.max_engines, self.settings.default_engine
            kept = default.engine_key() if default is not None and limit > 1 else None  # its place is never taken
            if key != kept:
                others = [k for k in self.engines if k != kept]
                if len(others) >= limit - (kept is not None):
                    idle = next((k for k in others if not self.engines[k].has_unfinished()
                                 and k not in self._compiling), None)
                    if idle is None:
                        advice = ("; retry shortly, or leave the decoding knobs out to run on the server's defaults "
                                  "(one engine is kept for them)") if kept is not None else "; retry shortly"
                        raise ApiError(429, f"{len(others)} other distinct decoding settings are running, the "
                                            f"limit (--max-engines {limit}){advice}", code="too_many_settings",
                                       headers={"Retry-After": "1"})
                    self.engines.pop(idle).drain()  # its last finished requests' affixes leave the pool
            s = self.settings
            if self.pool is None:
                self.pool = pool_for(self.model, [s.default_engine or config], s.max_batch, s.context, s.pool_tokens)
            bound = s.max_step_tokens or s.warmup_tokens or DEFAULT_STEP_TOKENS
            engine = self.engines[key] = Engine(self.model, config, max_batch=s.max_batch,
                                                   fixed_shapes=s.warmup_tokens > 0, context=s.context,
                                                   max_step_tokens=bound, min_affix_reuse=s.min_affix_reuse,
                                                   pool=self.pool)
            if compile_ahead and s.warmup_tokens and key not in self._compiling:
                self._compile_ahead(key, engine)
        self.engines.move_to_end(key)
        return engine

    def _compile_ahead(self, key: DecodeConfig, engine: Engine) -> None:
        """Warm `engine` up in a thread, compiling on half the cores (the others keep serving); the
        engine thread hears of its end from the inbox. The programs are the process's (jax's
        caches), so an engine made again for the key while an earlier one compiles waits for that one."""
        def run() -> None:
            start, tokens = time.perf_counter(), self.settings.warmup_tokens
            try:
                count = engine.warm_up(tokens, threads=max(1, (os.cpu_count() or 2) // 2), stop=self._stopping)
                print(f"acache_jax.serve: compiled {count} programs of another decoding setting for steps of up to "
                      f"{tokens} tokens in {time.perf_counter() - start:.0f} s, while serving", file=sys.stderr,
                      flush=True)
            except Exception as e:  # its steps compile what they need instead
                print(f"acache_jax.serve: warm-up of another decoding setting failed: {e!r}", file=sys.stderr,
                      flush=True)
            finally:
                self._inbox.put(("compiled", key))

        thread = self._compiling[key] = threading.Thread(target=run, name="acache-compile", daemon=True)
        thread.start()

    def _admit(self, job: Job, emit: Emit) -> None:
        engine = self._engine(job.config)
        head, affix, position, tail, source = job.head, job.affix, job.affix_position, job.tail, None
        if affix is not None:
            source = "declared"
        elif self.settings.discovery and job.config.selective:
            span = self.index.observe(job.head)
            if span is not None:
                head, affix, tail, source = job.head[:span.start], span.ids, job.head[span.stop:], "discovered"
                position = "prefix" if span.start == 0 else "infix"
                if position == "prefix":
                    head, tail = tail, []
        cache, held, hit = None, False, False
        if affix is not None and job.config.selective:
            cache = self.store.hold(affix)
            held = hit = cache is not None
            if cache is None:
                cache = build_affix_cache(self.model, list(affix), bucketed=True)
                self.counters[f"affix_builds_{source}"] += 1
                held = self.store.add(affix, cache) and self.store.hold(affix) is not None
        try:
            rid = engine.add(job.request(head, affix, position, tail), cache if cache is not None else affix,
                             gen_length=job.gen_length, config=job.config)
        except BaseException:
            if held:
                self.store.release(affix)
            raise
        self._live[job.id] = _Live(job, emit, job.config.engine_key(), rid, affix, source, held, hit)
        self.counters["prompt_tokens"] += job.prompt_tokens

    def _step(self, key: DecodeConfig) -> None:
        engine = self.engines[key]
        self.counters["engine_iterations"] += 1
        try:
            results = engine.step()
        except Exception as e:  # fail this engine's requests, keep serving the others
            print(f"acache_jax.serve: engine step failed: {e!r}", file=sys.stderr, flush=True)
            # The pool's arrays go into each step (donated): a step that failed after taking them
            # leaves none, and every engine's requests lose their K/V with them.
            lost = self.pool is not None and not self.pool.alive
            for live in [l for l in self._live.values() if lost or l.engine == key]:
                # its blocks go back to the pool (a failure inside postprocess may leave some unfreed)
                with contextlib.suppress(Exception):
                    self.engines[live.engine].cancel(live.rid)
                self._end(live)
                self.counters["failed"] += 1
                live.emit(("error", ApiError(500, f"internal error: {type(e).__name__}: {e}")))
            for dropped in list(self.engines) if lost else [key]:
                with contextlib.suppress(Exception):
                    self.engines.pop(dropped).drain()
            if lost:
                self.pool = None  # the next engine makes a new one
            return
        by_rid = {l.rid: l for l in self._live.values() if l.engine == key}
        for res in results:
            live = by_rid.pop(res.request_id)
            self._progress(live, res.tokens, final=True, nfe=res.nfe, anchors=len(res.anchors))
        for live in by_rid.values():
            self._progress(live, engine.partial(live.rid), final=False)
        if not engine.has_unfinished():
            engine.drain()  # the last finished requests' affixes leave the pool now

    def _progress(self, live: _Live, tokens: Any, final: bool, nfe: int | None = None, anchors: int = 0) -> None:
        """Stream a request's new final text; finish it when its answer is complete."""
        model, ids = self.model, [int(t) for t in tokens]
        stops = model.stop_token_ids
        end = next((i for i, t in enumerate(ids) if t in stops), None)
        answer_ids = ids[:end]
        text = model.tokenizer.decode(answer_ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in live.job.stop) if i >= 0), default=None)
        done = final or cut is not None or (end is not None and self.settings.finish_early)
        if cut is not None:
            text = text[:cut]
        if not done:
            hold = max(map(len, live.job.stop), default=1) - 1  # a stop string may be starting here
            safe = text[:len(text) - hold] if hold else text
            if safe.endswith("\ufffd"):  # a character split across tokens: wait for the rest
                safe = safe.rstrip("\ufffd")
            if live.job.stream and len(safe) > len(live.sent) and safe.startswith(live.sent):
                live.emit(("text", safe[len(live.sent):]))
                live.sent = safe
            return
        if not final:
            engine = self.engines[live.engine]
            anchors = engine.num_anchors(live.rid)
            engine.cancel(live.rid)
            self.counters["answered_early"] += 1
        if not text.startswith(live.sent):  # cannot happen with a prefix-stable detokenizer; never unsend
            print(f"acache_jax.serve: request {live.job.id}: final text does not extend the streamed text",
                  file=sys.stderr, flush=True)
            text = live.sent
        if text != live.sent and live.job.stream:
            live.emit(("text", text[len(live.sent):]))
        self._end(live)
        completion = len(answer_ids) if cut is None else len(model.encode(text, chat=False, special_tokens=False))
        reason = "stop" if end is not None or cut is not None else "length"
        cached = len(live.affix) - anchors if live.hit else 0  # the anchors that request kept, not the reserve
        self.counters["finished"] += 1
        self.counters["completion_tokens"] += completion
        self.counters["cached_tokens"] += cached
        extra = {"affix_tokens": len(live.affix or ()), "affix_source": live.source, "anchors": anchors,
                 "token_ids": answer_ids if cut is None else None, "nfe": nfe}
        live.emit(("done", Answer(text, reason, live.job.prompt_tokens, completion, cached, extra)))

    def _end(self, live: _Live) -> None:
        del self._live[live.job.id]
        if live.held:
            self.store.release(live.affix)
        with self._lock:
            self._inflight -= 1

    def _shutdown(self) -> None:
        if self._compiling:  # none starts another compile (`_stopping`); a process that exits mid-compile aborts
            self._warming = True
            for thread in self._compiling.values():
                thread.join()
            self._compiling.clear()
        for live in list(self._live.values()):
            self.engines[live.engine].cancel(live.rid)
            self._end(live)
            self.counters["cancelled"] += 1
            live.emit(("error", ApiError(503, "the server is shutting down")))
        for engine in self.engines.values():
            engine.drain()
        self._publish()
        used = self.snapshot["pool_blocks_used"]
        print(f"acache_jax.serve: stopped; {used:.0f} KV blocks left allocated", file=sys.stderr, flush=True)
        self.engines.clear()
        self.pool = None  # its device memory goes with it (a process may start another server)
        self.store.drop_unheld()

    def _publish(self) -> None:
        """Numbers for /metrics, replaced whole (the HTTP side reads it without a lock)."""
        engines = list(self.engines.values())
        usage = [e.usage() for e in engines]
        blocks = None if self.pool is None else self.pool.blocks
        snap = {f"requests_{k}_total": float(self.counters[k]) for k in
                ("finished", "cancelled", "failed", "rejected", "answered_early")}
        snap |= {f"{k}_total": float(self.counters[k]) for k in ("prompt_tokens", "cached_tokens", "completion_tokens")}
        snap |= {"affix_builds_discovered_total": float(self.counters["affix_builds_discovered"]),
                 "affix_builds_declared_total": float(self.counters["affix_builds_declared"]),
                 "requests_running": float(sum(u.running for u in usage)),
                 "requests_waiting": float(sum(u.waiting for u in usage)),
                 "pool_blocks_used": float(blocks.num_blocks - blocks.num_free_blocks if blocks else 0),
                 "pool_blocks_capacity": float(blocks.num_blocks if blocks else 0),
                 "engines": float(len(engines)),
                 "engines_compiling": float(len(self._compiling)),
                 "engine_iterations_total": float(self.counters["engine_iterations"]),
                 "affix_caches": float(len(self.store)), "affix_cache_bytes": float(self.store.nbytes),
                 "affix_cache_evictions_total": float(self.store.evictions),
                 "affix_cache_budget_bytes": float(self.store.budget_bytes),
                 "span_index_entries": float(len(self.index)), "span_index_capacity": float(self.index.max_entries),
                 "time": time.time()}
        self.snapshot = snap
