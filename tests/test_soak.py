"""A long-running server keeps its memory flat.

The soak: a few thousand small requests through the real server (a subprocess on 127.0.0.1 serving
the shipped llada-small); afterwards its resident memory, its KV pool and its affix store are where
they were after a warm-up. The traffic mixes what makes a server keep things per request: prompts
with one of several recurring prefixes (online discovery builds their affix caches; the store's
budget holds only some of them, so it evicts), the same prefixes declared as affixes, unique
prompts (each adds runs to the span index), chat turns, streams, and clients that hang up
mid-stream (cancellations, on an engine of their own: other knobs).

RSS is coarse: it moves by megabytes with every program XLA compiles, so a leak of a few hundred
bytes per request (what `Runner.work` was: a tuple per forward, kept forever) hides in it. The
engine test measures the Python heap instead, which such a leak fails at once, and the last test
checks that the benchmark's per-forward bookkeeping goes only to an observer it installs.
"""

from __future__ import annotations

import gc
import json
import random
import signal
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

import acache_jax
from acache_jax.decoding.layout import Request
from acache_jax.engine import Engine
from acache_jax.network.config import DecodeConfig
from tests.cli_process import rss_mb
from tests.test_serve import _settle, start_server

AFFIX_BUDGET_MB = 1  # --affix-memory-mb: 5 of the 16 prefixes' caches fit (197 kB each: 32 rows for 18 tokens, bf16)
MIN_TOKENS = 16  # --affix-min-tokens: a prefix (2 lines, 18 tokens) qualifies, one line of it does not
CLIENTS = 8  # concurrent clients, each on its own keep-alive connection
# Small, cheap requests: one block of 8 tokens in two forwards (a fixed schedule: the same work per
# request whatever the weights predict), at most 8 decoded together.
SERVER_FLAGS = ("--max-batch", "8", "--max-queue", "64", "--gen-length", "8", "--block-length", "8", "--steps", "2",
                "--threshold", "none", "--affix-min-tokens", str(MIN_TOKENS), "--affix-memory-mb", str(AFFIX_BUDGET_MB))
WARMUP_REQUESTS = 300  # compile what the mix needs most, fill the store and the allocator's pools
SOAK_REQUESTS = 1000  # in tenths, the server's RSS and memory maps read after each
# A tenth whose memory maps grew by more than this compiled a program (XLA's CPU programs map their
# code: the compilations seen during soaks added 250-350 at once); otherwise the count moves by a few.
COMPILE_MAPS = 20
# RSS bounds, from measurements on 2 shared CPU cores. Programs still compile after the warm-up:
# the packed step's token axes follow the traffic (their number is bounded, not the order in which
# the traffic first needs them; how requests batch depends on the machine's load), in 1-2 tenths
# of a soak on a quiet machine, 3-6 under a load of 4-5. A tenth that compiled added 8-60 MB with
# 250-880 maps: 0.03-0.13 MB per map (a leak of large arrays would add a map per array and far more
# per map). The tenths that compiled nothing grew 1-13 MB in all over soaks of 2000 (in steps of up
# to 5 MB: the allocator), and 2.4 MB over the last 6400 of 8000 requests: flat. Over 1000 requests
# STEADY catches anything kept per request from about 24 kB a request up (an affix cache is 197 kB);
# the engine test below catches the small things.
STEADY_GROWTH_BOUND_MB = 24  # the tenths that compiled nothing, together
COMPILE_MB_PER_MAP = 0.2  # the tenths that compiled, together, per memory map they added

# Words of the model's word-level vocabulary (an unknown word is one <|unk|> token: texts that differ
# only there would tokenize alike and recur); numbers make each question unique.
NAMES = "Mary John Sandra Daniel Emma Peter Kate Tom".split()
PLACES = "garden office kitchen bathroom bedroom hallway cellar balcony".split()
# 16 recurring prefixes of 18 tokens: the store holds 9, so the three hot ones stay stored and the
# cold ones evict each other.
PREFIXES = [f"Story {i} : Mary moved to the {PLACES[i % 8]} .\nExample {i} : the answer is the location .\n"
            for i in range(16)]
PREFIX_WEIGHTS = [30, 30, 30] + [1] * 13
KINDS = {"shared": 40, "declared": 10, "plain": 25, "chat": 10, "stream": 14, "hangup": 1}  # kind: weight


def _maps(pid: int) -> int:
    """The process's memory mappings: on a CPU every program XLA compiles adds some (45 for an
    affix fill), so a count that stays put says nothing compiled."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for _ in f)


def _traffic(count: int, seed: int) -> list[tuple[str, str, dict]]:
    """count requests (kind, path, body), one block of answer each but the hang-ups'; the first
    ones are one of each kind, so that a warm-up meets them all (the hang-ups' own engine too)."""
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        question = f"Question {seed} {i // 100} {i % 100} : Where is {rng.choice(NAMES)} ?\n"
        kind = list(KINDS)[i] if i < len(KINDS) else rng.choices(list(KINDS), list(KINDS.values()))[0]
        prefix = rng.choices(PREFIXES, PREFIX_WEIGHTS)[0]
        body = {"max_tokens": 8, "seed": i}
        path = "/v1/completions"
        if kind in ("shared", "stream"):
            body["prompt"] = prefix + question + "Answer :"
        elif kind == "declared":
            body |= {"prompt": question + "Answer :", "affix": prefix}
        elif kind == "plain":  # a unique line: new runs for the span index, never recurring
            note = f"Note {seed} {i // 100} {i % 100} : {rng.choice(NAMES)} went to the {rng.choice(PLACES)} .\n"
            body["prompt"] = note + question + "Answer :"
        elif kind == "chat":
            path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": question}]}
        else:  # near-uniform sampling, several blocks: the client leaves after the first chunk
            body |= {"prompt": prefix + question, "max_tokens": 64, "temperature": 5.0}
        jobs.append((kind, path, body))
    return jobs


def _send(client: httpx.Client, job: tuple[str, str, dict]) -> str:
    """Run one request; its finish reason ("hangup" for a client that left)."""
    kind, path, body = job
    if kind in ("stream", "hangup"):
        finish = None
        with client.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if kind == "hangup" and line:
                    return "hangup"
                if line.startswith("data: {"):
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        return finish
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["finish_reason"]


def _run(url: str, jobs: list) -> list[str]:
    """The jobs over CLIENTS connections, in order within each client; every finish reason."""
    finishes: list[str] = []
    lock = threading.Lock()

    def client(part: list) -> None:
        # plain HTTP to 127.0.0.1: no CA bundle to load (about 40 ms of CPU a client)
        with httpx.Client(base_url=url, timeout=120, verify=False) as c:
            for job in part:
                finish = _send(c, job)
                with lock:
                    finishes.append(finish)

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(client, [jobs[i::CLIENTS] for i in range(CLIENTS)]))
    return finishes


def test_a_long_run_keeps_the_server_memory_flat():
    """After a warm-up, SOAK_REQUESTS requests: the server's RSS grows within the bounds above (its
    growth is the programs compiled late, and little else), every KV block is free again, the affix
    store is within its budget and the span index within its capacity; every request was answered
    or cancelled."""
    proc, url = start_server(*SERVER_FLAGS)
    errors: list[str] = []  # the server's stderr, drained so that a full pipe never blocks it
    drain = threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)
    drain.start()
    try:
        start = time.perf_counter()
        finishes = _run(url, _traffic(WARMUP_REQUESTS, seed=0))
        warm = _settle(url)
        rss_warm, maps_warm, warm_s = rss_mb(proc.pid), _maps(proc.pid), time.perf_counter() - start
        jobs, samples = _traffic(SOAK_REQUESTS, seed=1), []
        for part in range(0, SOAK_REQUESTS, SOAK_REQUESTS // 10):
            finishes += _run(url, jobs[part:part + SOAK_REQUESTS // 10])
            samples.append((round(rss_mb(proc.pid), 1), _maps(proc.pid)))
        end = _settle(url)
        rss_end, soak_s = rss_mb(proc.pid), time.perf_counter() - start - warm_s
        steps = list(zip([(rss_warm, maps_warm)] + samples, samples))
        compiled = [(b - a, mb - ma) for (a, ma), (b, mb) in steps if mb - ma >= COMPILE_MAPS]
        steady = sum(b - a for (a, ma), (b, mb) in steps if mb - ma < COMPILE_MAPS)
        print(f"\nsoak: warm-up {WARMUP_REQUESTS} requests in {warm_s:.0f} s, then {SOAK_REQUESTS} in "
              f"{soak_s:.0f} s ({SOAK_REQUESTS / soak_s:.0f} req/s, {CLIENTS} clients). RSS MB (memory maps): after "
              f"the warm-up {rss_warm:.1f} ({maps_warm}), each tenth {samples}, at the end {rss_end:.1f}: "
              f"{rss_end - rss_warm:+.1f} MB, {steady:+.1f} MB of it in the {10 - len(compiled)} tenths that compiled "
              f"nothing. Affix caches {warm['acache_affix_caches']:.0f} -> {end['acache_affix_caches']:.0f} "
              f"({end['acache_affix_cache_bytes'] / 1e3:.0f} kB), {end['acache_affix_cache_evictions_total']:.0f} "
              f"evictions, {end['acache_affix_builds_discovered_total']:.0f} discovered builds; span index "
              f"{warm['acache_span_index_entries']:.0f} -> {end['acache_span_index_entries']:.0f}; "
              f"{end['acache_requests_cancelled_total']:.0f} cancelled")
        total = WARMUP_REQUESTS + SOAK_REQUESTS
        assert len(finishes) == total and all(f in ("stop", "length", "hangup") for f in finishes), set(finishes)
        answered = end["acache_requests_finished_total"] + end["acache_requests_cancelled_total"]
        assert answered == total and end["acache_requests_failed_total"] == 0, end
        assert warm["acache_pool_blocks_used"] == end["acache_pool_blocks_used"] == 0  # the idle count
        assert end["acache_requests_running"] == end["acache_requests_waiting"] == end["acache_requests_inflight"] == 0
        assert end["acache_affix_cache_bytes"] <= end["acache_affix_cache_budget_bytes"] == AFFIX_BUDGET_MB << 20
        assert end["acache_affix_caches"] <= len(PREFIXES)
        assert end["acache_affix_cache_evictions_total"] > warm["acache_affix_cache_evictions_total"]  # it was full
        assert end["acache_cached_tokens_total"] > warm["acache_cached_tokens_total"]  # served from the store
        assert warm["acache_span_index_entries"] < end["acache_span_index_entries"] <= end["acache_span_index_capacity"]
        assert steady < STEADY_GROWTH_BOUND_MB, (rss_warm, maps_warm, samples)
        # (a soak in which nothing compiled after the warm-up has nothing here: 0 <= 0)
        assert sum(mb for mb, _ in compiled) <= COMPILE_MB_PER_MAP * sum(n for _, n in compiled), (rss_warm, samples)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        drain.join(5)
    assert "Traceback" not in "".join(errors), "".join(errors)[-3000:]


def test_an_engine_keeps_nothing_per_request(fixtures_dir):
    """The Python heap of an engine serving requests (with and without an affix, two affixes
    shared, arrivals while others run) stops growing: tracemalloc over 320 requests, on fixed shapes
    compiled beforehand (nothing compiles while measuring), after 640 traced requests in which
    caches of small buffers settle (they look like 28 kB of growth over the first 120 requests, 3 kB
    over the fifth 120, about nothing from the tenth on). Measured: 6-24 kB now over the 320 (24 kB
    in a full run on a loaded machine); 62 kB with the old per-forward `Runner.work` tuples (about
    190 bytes a request, kept forever). The bound sits between the two."""
    model = acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")
    cfg = DecodeConfig(gen_length=16, block_length=8, cache="acache", threshold=None, steps=4)
    engine = Engine(model, cfg, pool_tokens=1024, block_size=8, max_batch=4, fixed_shapes=True)
    engine.warm_up(64)
    affixes = [list(range(30, 53)), list(range(60, 90))]

    def serve(n: int, seed: int) -> None:
        rng, done = np.random.default_rng(seed), 0
        for i in range(n):  # arrivals while others run: one step per 4 requests queued
            affix = affixes[i % 3] if i % 3 < 2 else None
            engine.add(Request(rng.integers(3, 100, size=int(rng.integers(2, 12))).tolist(),
                               affix_position="prefix" if affix else None, seed=i), affix)
            if i % 4 == 3:
                done += len(engine.step())
        assert done + len(engine.run()) == n

    serve(80, 0)  # the affix fills compile here
    tracemalloc.start()
    try:
        for seed in range(1, 9):
            serve(80, seed)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for seed in range(9, 13):
            serve(80, seed)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert engine.usage().blocks_in_use == 0 and not engine._live
    assert grown < 40_000, f"the engine's heap grew {grown} bytes over 320 requests"


def test_benchmark_bookkeeping_is_opt_in(fixtures_dir):
    """Per-forward work and per-call timings reach an observer the benchmark installs
    (`eval.bench_engine.Recorder`) and nowhere else: the work adds up to the engine's own count of
    computed tokens, a timed recorder gets the latency medians bench_engine reports, and an engine
    without an observer has nothing of it."""
    from eval.bench_engine import Recorder, forward_costs

    model = acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")
    cfg = DecodeConfig(gen_length=16, block_length=8, cache="acache", threshold=None, steps=8)
    requests = [Request([5, 17, 33, 2, 90], affix_position="prefix", seed=s) for s in range(3)]
    affix = list(range(30, 53))
    work, timed = Recorder(), Recorder(timed=True)
    engine = Engine(model, cfg, max_batch=4, observer=work)
    engine.generate(requests, affix)
    # the packed forwards' tokens, and the affix's own forward once (it fills the shared slots)
    assert engine.stats.affix_fills == 1 and work.work.count((len(affix), len(affix) ** 2, 0)) == 1
    assert sum(tokens for tokens, _, _ in work.work) == engine.stats.forward_tokens + len(affix)
    assert not work.packed and not work.loop and forward_costs(model.config, work.work)[0] > 0
    Engine(model, cfg, max_batch=4, observer=timed).generate(requests, affix)
    medians = timed.medians()  # the fill timed apart from the probe of the same iteration
    assert {"fill_median_s", "probe_median_s", "recompute_median_s", "decode_step_median_s"} <= set(medians)
    assert [kind for kind, _ in timed.packed][:2] == ["fill", "probe"]
    plain = Engine(model, cfg, max_batch=4)
    plain.generate(requests, affix)
    assert plain.runner.observer is None and not hasattr(plain.runner, "work")
