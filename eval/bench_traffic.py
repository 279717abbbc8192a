"""The serving engine under realistic traffic, Fast-dLLM dual-cache baseline vs ACache side by side.

    python -m eval.bench_traffic --model acache_jax/models/llada-small [--requests 200] [--rate 4,14]
    python -m eval.bench_traffic --shape llada --requests 256 --rate 40,160   # 8B-shaped random weights

Requests arrive as a Poisson process (`--rate` per second; several rates run one after another)
and mix three shared affixes, each placed as prefix, infix or suffix at random, with requests that
have none (`--no-affix`, a fraction) and generation lengths drawn from `--gen-lengths`. With a
model directory (the shipped models): held-out questions of the three tasks with their task's
few-shot affix, decoded with the model's threshold; with `--shape`: random ids in the LLaDA-8B /
Dream-7B shapes (affixes of 230, 460 and 920 tokens, 80-token questions) and a fixed schedule of
`--tokens-per-step` (random weights give no useful confidences).

The engines run as the server runs them (`python -m acache_jax.serve --warmup-tokens N`): fixed
shapes, and every program of a step of up to the workload's largest step compiled before the
measured passes, so that a pass measures the engine, not the compiler (each pass reports what it
still compiled: 0 expected). ACache's affixes are built once beforehand, as a server's affix store
holds them, and one request of each primes its fill. Both policies serve the same requests at the
same arrival times. `--min-affix-reuse N` adds an ACache pass per N whose engines run as dual
every request whose affix tokens x generation blocks fall below N (`Engine(min_affix_reuse=)`).
Reports generated tokens/s over the whole pass and request latency (arrival to finish) p50 / p99,
in all and per kind of request (affix length, generation length, run as dual): JSON lines on stdout
(and the whole result with `--json`), the same as a table on stderr. `--timed` adds a
pass per policy at the first rate whose every jitted call waits for the device and is timed: the
device seconds per kind of call (which segments a packed step held, the affix fills, the block
loop), where a policy's time goes.
At 8B shape on an H100 the baseline saturates near 40 requests/s (docs/BENCHMARKS.md): 4 and 16
are low load there, 160 is past saturation for both policies.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from acache_jax import compile_cache
from acache_jax.decoding.acache import build_affix_cache
from acache_jax.decoding.layout import AFFIX_POSITIONS, Request
from acache_jax.engine import Engine
from acache_jax.network.checkpoint import load
from acache_jax.network.files import check_output_path, write_atomic
from eval.bench_engine import Recorder

def _placement(rng: np.random.Generator, no_affix: float) -> str:
    return "none" if rng.random() < no_affix else AFFIX_POSITIONS[int(rng.integers(3))]


def task_workload(model, n: int, gen_lengths: list[int], rng: np.random.Generator, no_affix: float):
    """(affix ids or None, request, gen length) per request, from the seeded tasks (a world per task)."""
    from eval.tasks import STUDY_TASKS, eval_split, get_task
    from eval.tasks.layouts import affix_ids, encoder, request

    encode = encoder(model.tokenizer)
    worlds = {task: eval_split(get_task(task), 0, n) for task in STUDY_TASKS}
    out = []
    for i in range(n):
        task = STUDY_TASKS[int(rng.integers(len(STUDY_TASKS)))]
        placement = _placement(rng, no_affix)
        examples, questions = worlds[task]
        out.append((affix_ids(encode, examples, placement), request(encode, questions[i], placement, seed=i),
                    int(rng.choice(gen_lengths))))
    return out


def random_workload(cfg, n: int, gen_lengths: list[int], rng: np.random.Generator, no_affix: float):
    ids = lambda k: rng.integers(0, cfg.mask_token_id - 1, size=k).tolist()
    affixes = [ids(k) for k in (230, 460, 920)]
    out = []
    for i in range(n):
        placement = _placement(rng, no_affix)
        if placement == "none":
            out.append((None, Request(ids(80), seed=i), int(rng.choice(gen_lengths))))
            continue
        tail = ids(8) if placement == "infix" else ()
        out.append((affixes[int(rng.integers(3))], Request(ids(80), tail, placement, seed=i),
                    int(rng.choice(gen_lengths))))
    return out


def with_affix_caches(model, workload):
    """The workload with each distinct affix built once (`build_affix_cache`, bucketed as the server
    builds them) and shared by its requests: a server holds the affixes it has seen in its store."""
    caches = {}
    for affix, _, _ in workload:
        if affix is not None and tuple(affix) not in caches:
            caches[tuple(affix)] = build_affix_cache(model, affix, bucketed=True)
    return [(None if affix is None else caches[tuple(affix)], request, gen) for affix, request, gen in workload]


def first_of_each_affix(workload) -> list[int]:
    """The index of the first request of each distinct affix (and of the first without one)."""
    first: dict = {}
    for i, (affix, _, _) in enumerate(workload):
        first.setdefault(None if affix is None else tuple(affix), i)
    return list(first.values())


def row_length(workload) -> int:
    """Columns of the workload's longest row (prompt, affix, tail and generation)."""
    return max(sum(request.lengths(len(affix or ())).values()) + gen for affix, request, gen in workload)


def shaped_model(shape: str, layers: int | None = None):
    """Random bf16 weights in the LLaDA-8B or Dream-7B shape (all their layers unless `layers`)."""
    from eval.bench_decode import llada_8b, random_model
    from eval.bench_engine import dream_7b

    return random_model((llada_8b if shape == "llada" else dream_7b)(layers or (32 if shape == "llada" else 28)))


_COMPILED = dict(compiles=0, compile_s=0.0)  # every XLA compilation of this process so far


def _count_compile(event: str, seconds: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILED["compiles"] += 1
        _COMPILED["compile_s"] += seconds


@functools.cache
def _listen() -> None:
    """One listener for the process: nothing to unregister."""
    import jax

    jax.monitoring.register_event_duration_secs_listener(_count_compile)


@contextlib.contextmanager
def counting_compiles() -> Iterator[dict]:
    """Counts the XLA compilations (and their seconds) while the block runs: a pass that compiles
    measures the compiler, not the engine, so each pass reports what it compiled."""
    _listen()
    before = dict(_COMPILED)
    seen = {}
    try:
        yield seen
    finally:
        seen.update((k, _COMPILED[k] - before[k]) for k in ("compiles", "compile_s"))


def serve(engine: Engine, workload, arrivals: np.ndarray, groups: list[str] | None = None) -> dict:
    """Feed requests to an idle engine at their arrival times; returns throughput and latency
    percentiles, and with `groups` (a label per request) the latency of each label's requests."""
    start = time.perf_counter()
    pending, index, latency = 0, {}, {}  # index: request id -> its place in the workload
    while len(latency) < len(workload):
        now = time.perf_counter() - start
        while pending < len(workload) and arrivals[pending] <= now:
            affix, request, gen = workload[pending]
            index[engine.add(request, affix, gen_length=gen)] = pending
            pending += 1
        if not engine.has_unfinished():  # nothing to do before the next arrival
            time.sleep(max(0.0, arrivals[pending] - now))
            continue
        for res in engine.step():
            i = index[res.request_id]
            latency[i] = time.perf_counter() - start - arrivals[i]
    seconds = time.perf_counter() - start
    engine.drain()
    lat = np.asarray([latency[i] for i in range(len(workload))])
    generated = sum(gen for _, _, gen in workload)
    stats = engine.stats
    result = dict(seconds=seconds, tokens_per_s=generated / seconds, p50_s=float(np.percentile(lat, 50)),
                  p99_s=float(np.percentile(lat, 99)), iterations=stats.iterations, affix_fills=stats.affix_fills,
                  forward_tokens=stats.forward_tokens,
                  padded_over_forward=stats.padded_tokens / max(1, stats.forward_tokens),
                  host_fraction=stats.host_seconds / stats.seconds)
    if groups is not None:
        result["groups"] = by_group(lat, groups)
    return result


def device_time(recorder: Recorder) -> dict:
    """A timed pass's jitted calls per kind (the packed step's segment kinds, "fill", "loop"): how
    many, their device seconds in all and the median call's."""
    return {kind: dict(n=len(t), seconds=float(np.sum(t)), median_s=float(np.median(t)))
            for kind, t in recorder.seconds().items()}


def by_group(latency: np.ndarray, groups: list[str]) -> dict:
    """Per label: how many requests, and their latency p50 / p99 in seconds."""
    labels, out = np.asarray(groups), {}
    for g in sorted(set(groups)):
        lat = latency[labels == g]
        out[g] = dict(n=len(lat), p50_s=float(np.percentile(lat, 50)), p99_s=float(np.percentile(lat, 99)))
    return out


AS_DUAL = ", as dual"


def group_label(affix_len: int, gen: int, as_dual: bool) -> str:
    """A request's kind for the per-group latencies: its affix's length, its generation length, and
    whether a `min_affix_reuse` rule ran it as dual."""
    return f"affix {affix_len:4d}, gen {gen:3d}" + (AS_DUAL if as_dual else "")


def add_common_flags(p: argparse.ArgumentParser, *, model_help: str, model_required: bool, requests: int) -> None:
    """The flags of both traffic benchmarks (this one and eval.bench_serve): what model, how many
    requests, the schedule under --shape, the batch, the seed and where the result goes."""
    src = p.add_mutually_exclusive_group(required=model_required)
    src.add_argument("--model", type=Path, help=model_help)
    src.add_argument("--shape", choices=["llada", "dream"], help="8B-shaped random weights (fixed schedule)")
    p.add_argument("--layers", type=int, help="--shape: fewer layers (smoke runs)")
    p.add_argument("--requests", type=int, default=requests)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--tokens-per-step", type=int, default=8, help="--shape: the fixed schedule")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the result here")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.bench_traffic", description=__doc__.splitlines()[0])
    add_common_flags(p, model_help="a model directory (threshold decoding on task questions)", model_required=True,
                     requests=200)
    p.add_argument("--rate", default="4,14", help="arrivals per second (Poisson); comma-separated: one pass each")
    p.add_argument("--gen-lengths", default="32,64", help="comma-separated, drawn uniformly per request")
    p.add_argument("--no-affix", type=float, default=0.25, help="the fraction of requests without an affix")
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--timed", action="store_true",
                   help="after the passes, one more per policy at the first rate with every jitted call timed "
                        "(each waits for the device: a breakdown of where the pass's time goes, not a latency)")
    p.add_argument("--min-affix-reuse", default="",
                   help="comma-separated: one more ACache pass per value, its requests of fewer affix tokens x "
                        "blocks run as dual")
    return p


def policies(min_affix_reuse: str) -> dict[str, tuple[str, int]]:
    """The passes: name -> (cache policy, min_affix_reuse)."""
    out = {"baseline": ("dual", 0), "acache": ("acache", 0)}
    for value in filter(None, min_affix_reuse.split(",")):
        out[f"acache_min_reuse_{int(value)}"] = ("acache", int(value))
    return out


def report(result: dict) -> str:
    """The result as a table to read: per rate, each pass's tokens/s and latency p50 / p99 in ms over
    all requests and per kind of request; a cell marked * is a kind that pass's rule ran as dual."""
    names = [n for n, v in result.items() if isinstance(v, dict) and "passes" in v]
    width = max(18, *(len(n) for n in names))
    cell = lambda row, mark=" ": f"{row['p50_s'] * 1e3:.1f} / {row['p99_s'] * 1e3:.1f}{mark}"
    line = lambda label, cells: f"{label:30s}" + "".join(f"  {c:>{width}}" for c in cells).rstrip()
    lines = []
    for rate in result[names[0]]["passes"]:
        runs = [result[n]["passes"][rate] for n in names]
        lines += [line(f"rate {float(rate):g}/s: p50 / p99 ms", [f"{n} " for n in names]),
                  line("tokens/s", [f"{r['tokens_per_s']:.1f} " for r in runs]),
                  line("all requests", [cell(r) for r in runs])]
        for kind in sorted({g.removesuffix(AS_DUAL) for r in runs for g in r["groups"]}):
            rows = [r["groups"].get(kind) or r["groups"][kind + AS_DUAL] for r in runs]
            marks = ["*" if kind + AS_DUAL in r["groups"] else " " for r in runs]
            lines.append(line(f"{kind} (n={rows[0]['n']})", [cell(row, m) for row, m in zip(rows, marks)]))
    return "\n".join(lines + ["* run as dual by the pass's min_affix_reuse rule"])


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    compile_cache.enable()  # compiled programs are kept for later runs (acache_jax/compile_cache.py)
    if args.json:
        check_output_path(args.json)
    rng = np.random.default_rng(args.seed)
    gens = [int(g) for g in args.gen_lengths.split(",")]
    rates = [float(r) for r in args.rate.split(",")]
    if args.model:
        model = load(args.model)
        workload = task_workload(model, args.requests, gens, rng, args.no_affix)
        base = model.decode_config(gen_length=max(gens), block_length=args.block)
    else:
        model = shaped_model(args.shape, args.layers)
        workload = random_workload(model.config, args.requests, gens, rng, args.no_affix)
        steps = max(gens) // args.tokens_per_step
        base = model.decode_config(gen_length=max(gens), block_length=args.block, steps=steps, threshold=None)
    context = row_length(workload)
    # As the server sizes itself: the default pool for max_batch of the longest rows, and steps of up
    # to that many tokens compiled at start (new requests' probes cover their whole rows).
    settings = dict(max_batch=args.max_batch, fixed_shapes=True, context=context)
    result = dict(model=str(args.model or args.shape), requests=args.requests, no_affix=args.no_affix,
                  gen_lengths=gens, context=context)
    passes = policies(args.min_affix_reuse)
    arrivals_at = lambda rate: np.cumsum(np.random.default_rng(args.seed).exponential(1.0 / rate, size=args.requests))
    for name, (cache, reuse) in passes.items():
        config = base.replace(cache=cache, anchor_ratio=args.ratio)
        served = with_affix_caches(model, workload) if config.selective else workload
        engine_settings = dict(settings, min_affix_reuse=reuse)
        start = time.perf_counter()
        with counting_compiles() as compiled:
            warm = Engine(model, config, **engine_settings)
            warm.warm_up(args.max_batch * context)
            duals = [warm.runs_as_dual(len(affix or ()), gen) for affix, _, gen in workload]
            groups = [group_label(len(affix or ()), gen, dual) for (affix, _, gen), dual in zip(workload, duals)]
            del warm  # its pool: one engine's at a time on the device
            firsts = [served[i] for i in first_of_each_affix(workload)]
            serve(Engine(model, config, **engine_settings), firsts, np.zeros(len(firsts)))  # each affix's fill
        result[name] = dict(warm_up=dict(compiled, seconds=time.perf_counter() - start), min_affix_reuse=reuse,
                            requests_as_dual=sum(duals), passes={})
        for rate in rates:
            with counting_compiles() as compiled:
                run = serve(Engine(model, config, **engine_settings), served, arrivals_at(rate), groups)
            result[name]["passes"][str(rate)] = dict(run, **compiled)
            print(json.dumps({name: {"rate": rate, **run, **compiled}}), flush=True)
        if args.timed:
            recorder = Recorder(timed=True)
            run = serve(Engine(model, config, observer=recorder, **engine_settings), served, arrivals_at(rates[0]))
            result[name]["timed"] = dict(rate=rates[0], seconds=run["seconds"], calls=device_time(recorder))
            print(json.dumps({name: result[name]["timed"]}), flush=True)
    result["speedup"] = {name: {str(rate): result[name]["passes"][str(rate)]["tokens_per_s"]
                                / result["baseline"]["passes"][str(rate)]["tokens_per_s"] for rate in rates}
                         for name in passes if name != "baseline"}
    print(json.dumps(result))
    print(report(result), file=sys.stderr)
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
