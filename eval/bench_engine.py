"""The serving engine, Fast-dLLM dual-cache baseline vs ACache side by side (the paper's tables 1-4).

    python -m eval.bench_engine [--models llada,dream] [--batches 1,4,16] [--shots 1,2,4] [--repeats 3]
                                [--meshes none,1x1] [--max-step-tokens N] [--affix ids|built] [--cprofile N]
                                [--out DIR]

LLaDA-8B and Dream-7B shapes with random bf16 weights; per (model, shots, batch) both policies
decode the same requests with the same weights: `batch` requests of a shared prefix affix of
`shots` GSM8K-like few-shot examples (SHOT_TOKENS tokens each, about what LLaDA's tokenizer gives
a GSM8K example with its worked answer) + a QUESTION_TOKENS-token question, gen 256, block 32, a
fixed commit schedule (`--steps`; both policies do the same NFE), ratio 0.2.
Every case is compiled first (a whole warm-up run per case and policy, in threads, as many at once
as their KV pools fit the device; one that still runs out of device memory runs again alone:
`warm_up`), then timed on fresh engines, one case at a time: `--repeats` plain runs (the median
run's tokens/s and host time, the time the device waited for the host; the spread of the host
share over the runs) and a profiled run that waits for every jitted call (recompute, probe and
in-block step latencies; the affix fill, timed apart from the probe in the same iteration).
Python's garbage collections inside the plain runs are timed (`gc_ms`), so that a pause is not
mistaken for host work. Reported per policy: those, peak KV memory (pool blocks in use), MFU
(FLOPs of the tokens computed / time / 800 TFLOP/s) and the time model: each forward at
TIME_MODEL_TFLOPS or at the time to read the weights at TIME_MODEL_TBPS, whichever is longer, no
host gaps; ACache's affix fill (the affix run alone, once per run) is one of its forwards, unless
`--affix built` hands its engines the affix cache built beforehand (a server's steady state). It
counts no KV reads, which at long affixes and B16 are more bytes than the weights (docs/BENCHMARKS.md,
eleventh run).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import gc
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

import acache_jax
from acache_jax import compile_cache
from acache_jax.decoding.acache import build_affix_cache
from acache_jax.decoding.layout import Request
from acache_jax.engine import Engine
from acache_jax.engine.engine import DEFAULT_STEP_TOKENS, ENGINE_SELECTORS
from acache_jax.network.config import DecodeConfig, ModelConfig
from acache_jax.network.files import write_atomic
from acache_jax.network.kv import AffixCache, KVPool
from acache_jax.serve.cli import free_device_bytes
from eval.bench_decode import PEAK_TFLOPS, llada_8b, parse_meshes, random_model

SHOT_TOKENS = 230
QUESTION_TOKENS = 80
POLICIES = {"baseline": "dual", "acache": "acache"}


def dream_7b(layers: int) -> ModelConfig:
    return ModelConfig(family="dream", vocab_size=152064, hidden_size=3584, num_layers=layers, num_heads=28,
                       num_kv_heads=4, head_dim=128, intermediate_size=18944, rope_theta=1e6, rms_norm_eps=1e-6,
                       max_seq_len=4096, qkv_bias=True, mask_token_id=151666, eos_token_id=151643,
                       pad_token_id=151643)


def workload(cfg: ModelConfig, shots: int, batch: int, seed: int = 0) -> tuple[list[int], list[Request]]:
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(0, cfg.mask_token_id - 1, size=n).tolist()
    affix = ids(shots * SHOT_TOKENS)
    return affix, [Request(ids(QUESTION_TOKENS), affix_position="prefix", seed=i) for i in range(batch)]


TIME_MODEL_TFLOPS = 700.0  # sustained bf16 matmul rate assumed by the time model
TIME_MODEL_TBPS = 4.0  # HBM read rate assumed by the time model
# Of the device memory free after the weights, the share the warm-ups' pools may hold together; the
# rest is for their activations and the autotuner's buffers (13-shot B16 and B4 side by side ran an
# H100 out of memory, and so did their retries alone).
POOL_SHARE = 0.6


@dataclasses.dataclass
class Recorder:
    """What this benchmark asks of an engine's runner (a `runner.Observer`): each forward's work
    (tokens, sum over them of the keys each read, logit rows; padding excluded) and, when `timed`,
    each jitted call's device time. The engine keeps none of it itself (a server runs without one)."""

    timed: bool = False
    work: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    packed: list[tuple[str, float]] = dataclasses.field(default_factory=list)  # (segment kinds, seconds)
    loop: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (in-block steps, seconds)

    def forward(self, tokens: int, token_keys: int, logit_rows: int) -> None:
        self.work.append((tokens, token_keys, logit_rows))

    def affix_fill(self, tokens: int) -> None:  # work the run does, so the time model counts it
        self.work.append((tokens, tokens * tokens, 0))

    def call(self, kind: str, steps: int, seconds: float) -> None:
        if kind == "loop":
            self.loop.append((steps, seconds))
        else:
            self.packed.append((kind, seconds))

    def seconds(self) -> dict[str, list[float]]:
        """Each timed call's seconds by kind: the packed step's segment kinds, "fill", and "loop"
        (whole block loops), in sorted order."""
        out: dict[str, list[float]] = {}
        for kind, s in self.packed + [("loop", s) for _, s in self.loop]:
            out.setdefault(kind, []).append(s)
        return dict(sorted(out.items()))

    def medians(self) -> dict[str, float]:
        """Median seconds per kind of packed call (`{kind}_median_s`) and per in-block step of the
        block loop (`decode_step_median_s`, present once a loop ran)."""
        out = {f"{kind}_median_s": float(np.median(s)) for kind, s in self.seconds().items() if kind != "loop"}
        if self.loop:
            steps = [s / n for n, s in self.loop if n]
            out["decode_step_median_s"] = float(np.median(steps)) if steps else 0.0
        return out


def forward_costs(cfg: ModelConfig, work: list[tuple[int, int, int]]) -> tuple[float, float]:
    """(FLOPs of every forward in `work` (a `Recorder`'s), the time model's seconds for them)."""
    d, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    per_token = cfg.num_layers * 2 * (2 * d * d + 2 * d * kv + 3 * d * cfg.intermediate_size)
    per_key = cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim
    weight_bytes = 2 * cfg.num_params
    flops, model_s = 0.0, 0.0
    for tokens, token_keys, logits in work:
        f = tokens * per_token + token_keys * per_key + 2 * logits * d * cfg.vocab_size
        flops += f
        model_s += max(f / (TIME_MODEL_TFLOPS * 1e12), weight_bytes / (TIME_MODEL_TBPS * 1e12))
    return flops, model_s


def case_configs(cfg: ModelConfig, shots: int, batch: int, args) -> tuple[list[int], list[Request], int, dict]:
    """(affix, requests, pool tokens, policy -> DecodeConfig) of one case."""
    affix, requests = workload(cfg, shots, batch)
    # Sized per case: the warm-up compiles several cases at once, each holding its engine's pool.
    pool_tokens = batch * (len(affix) + QUESTION_TOKENS + args.gen) + len(affix) + 64 * batch
    configs = {p: DecodeConfig(gen_length=args.gen, block_length=args.block, steps=args.steps, threshold=None,
                               cache=c, anchor_ratio=args.ratio, selector=args.selector, attn_backend=args.backend,
                               early_stop=False)
               for p, c in POLICIES.items()}
    return affix, requests, pool_tokens, configs


def code_path() -> str:
    """The directory of the acache_jax package this process runs, printed and recorded with the
    results: an A/B of two trees runs each from its own directory, since `python -m` puts the
    current directory first on sys.path, ahead of PYTHONPATH."""
    return str(Path(acache_jax.__file__).resolve().parent)


def pool_bytes(model, case: tuple, args) -> int:
    """Device bytes of the KV pool a case's engines hold (`case` = (model name, shots, batch))."""
    _, shots, batch = case
    return case_configs(model.config, shots, batch, args)[2] * KVPool.slot_bytes(model.config, model.dtype)


def new_engine(model, config: DecodeConfig, pool_tokens: int, batch: int, args, observer=None) -> Engine:
    return Engine(model, config, pool_tokens=pool_tokens, max_batch=batch, observer=observer,
                  max_step_tokens=args.max_step_tokens or None)


def served_affix(model, policy: str, affix: list[int], args) -> list[int] | AffixCache:
    """What a policy's engine is given: the affix's ids (its first request computes it: the fill),
    or under `--affix built` ACache gets the cache built beforehand, as a server's affix store
    holds it once built (its engine then only copies it into the pool)."""
    return build_affix_cache(model, affix) if args.affix == "built" and policy == "acache" else affix


def warm(model, shots: int, batch: int, policy: str, args) -> None:
    """Compile a case's programs: one whole run (every iteration's shapes)."""
    affix, requests, pool_tokens, configs = case_configs(model.config, shots, batch, args)
    new_engine(model, configs[policy], pool_tokens, batch, args).generate(requests,
                                                                          served_affix(model, policy, affix, args))


def warm_up(warm_case: Callable[[Any, str], None], cases: list, threads: int, deadline: float,
            case_bytes: Callable[[Any], int] | None = None, budget_bytes: int | None = None) -> list:
    """The cases whose warm-ups (`warm_case(case, policy)`, one per policy) finished by `deadline`,
    in order. They run `threads` at once (compilation is host work), but each holds its engine's
    pool on the device (`case_bytes(case)` bytes), and long affixes at B16 do not fit an 80 GB card
    beside each other. So a warm-up starts only while the pools of those running leave room for its
    own in `budget_bytes` (None: no limit), or when none is running. One that still ran out of
    device memory (activations, the autotuner's buffers) runs again alone, after the others; a case
    with one that fails otherwise is reported and left out."""
    def failure(future) -> str | None:
        if future.cancelled() or future.exception() is None:
            return None
        return repr(future.exception())

    left = lambda: deadline - time.perf_counter()  # noqa: E731
    timeout = lambda: None if deadline == float("inf") else max(0.0, left())  # noqa: E731 - a wait until the deadline
    room = threading.Condition()
    held = 0  # bytes of the pools of the warm-ups running now

    def gated(case, policy) -> None:
        nonlocal held
        need = 0 if budget_bytes is None else case_bytes(case)
        with room:
            if not room.wait_for(lambda: held == 0 or held + need <= budget_bytes, timeout=timeout()):
                raise TimeoutError("no room on the device before the compile deadline")
            held += need
        try:
            warm_case(case, policy)
        finally:
            with room:
                held -= need
                room.notify_all()

    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        warming = {(case, p): ex.submit(gated, case, p) for case in cases for p in POLICIES}
        concurrent.futures.wait(warming.values(), timeout=timeout())
        ex.shutdown(wait=True, cancel_futures=True)
    errors = {key: failure(f) for key, f in warming.items()}
    done = {key for key, f in warming.items() if not f.cancelled() and errors[key] is None}
    # Only their descriptions are kept: an exception's traceback, and the tracebacks of those it was
    # raised while handling, hold the frames of the failed attempt and so its engine's pool.
    del warming
    gc.collect()
    for key, error in errors.items():
        if error is not None and "RESOURCE_EXHAUSTED" in error and left() > 0:
            try:
                warm_case(*key)
                done.add(key)
                errors[key] = None
            except Exception as e:  # noqa: BLE001 - reported below, like the others
                errors[key] = repr(e)
            gc.collect()
    for case in cases:
        if failed := [errors[case, p] for p in POLICIES if errors[case, p] is not None]:
            print(json.dumps(dict(case=case, error=failed[0][:300])), flush=True)
    return [case for case in cases if all((case, p) in done for p in POLICIES)]


def run_case(model, name: str, shots: int, batch: int, args) -> dict:
    """Both policies on one case, on fresh engines whose programs are already compiled."""
    cfg = model.config
    affix, requests, pool_tokens, configs = case_configs(cfg, shots, batch, args)
    row = dict(model=name, shots=shots, affix_tokens=len(affix), question_tokens=QUESTION_TOKENS, batch=batch,
               affix=args.affix)
    for policy, dcfg in configs.items():
        runs = []
        served = served_affix(model, policy, affix, args)  # built once per case, outside the timed runs
        for _ in range(args.repeats):
            recorder = Recorder()
            engine = new_engine(model, dcfg, pool_tokens, batch, args, observer=recorder)
            with collector_pauses() as pauses:
                results = engine.generate(requests, served)
            # Its stats, not the engine: each engine holds a KV pool (28 GB for LLaDA 13-shot B16),
            # and one kept alive beside the next one's would be measured as the engine's memory.
            runs.append((engine.stats, results, sum(pauses), recorder))
            del engine
        runs.sort(key=lambda r: r[0].seconds)
        run_stats, results, gc_s, recorder = runs[len(runs) // 2]  # the median run
        stats = run_stats.summary()
        host_shares = [s.host_seconds / s.seconds for s, *_ in runs]
        flops, model_s = forward_costs(cfg, recorder.work)
        timings = Recorder(timed=True)
        profiled = new_engine(model, dcfg, pool_tokens, batch, args, observer=timings)
        profiled.generate(requests, served)
        prof = profiled.stats.summary() | timings.medians()
        del profiled
        if args.cprofile:
            print(f"{name} {shots}-shot B{batch} {policy}: host profile of a plain run", flush=True)
            host_profile(lambda: new_engine(model, dcfg, pool_tokens, batch, args).generate(requests, served),
                         args.cprofile)
        probe_s = sum(t for kind, t in timings.packed if kind == "probe")
        fill_s = sum(t for kind, t in timings.packed if kind == "fill")
        row[policy] = dict(recompute_ms=1e3 * prof.get("recompute_median_s", 0.0),
                           decode_step_ms=1e3 * prof.get("decode_step_median_s", 0.0),
                           probe_ms=1e3 * probe_s, probe_fraction=probe_s / prof["seconds"],
                           fill_ms=1e3 * fill_s, fill_fraction=fill_s / prof["seconds"],
                           tokens_per_s=stats["tokens_per_s"], seconds=stats["seconds"],
                           host_fraction=stats["host_seconds"] / stats["seconds"],
                           host_fraction_range=[min(host_shares), max(host_shares)], runs=len(runs),
                           gc_ms=1e3 * gc_s,
                           model_seconds=model_s, peak_kv_gb=stats["peak_kv_bytes"] / 1e9,
                           nfe=int(np.mean([r.nfe for r in results])),
                           mfu=flops / stats["seconds"] / (PEAK_TFLOPS * 1e12),
                           padded_over_forward=stats["padded_tokens"] / stats["forward_tokens"],
                           iterations=stats["iterations"])
    b, a = row["baseline"], row["acache"]
    row["recompute_reduction"] = 1 - a["recompute_ms"] / b["recompute_ms"]
    row["speedup"] = a["tokens_per_s"] / b["tokens_per_s"]
    row["kv_reduction"] = 1 - a["peak_kv_gb"] / b["peak_kv_gb"]
    return row


@contextlib.contextmanager
def collector_pauses():
    """Seconds of each garbage collection Python runs inside the block (a list, filled on exit)."""
    pauses, started = [], []

    def timing(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    gc.callbacks.append(timing)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(timing)


def host_profile(run, top: int) -> None:
    """Print the `top` functions by own time of one call of `run` (where the host's time goes)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(run)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def table(rows: list[dict]) -> str:
    lines = ["| model | shots (affix tokens) | B | recompute ms base / acache (cut) | tok/s base / acache (speedup) | "
             "in-block step ms | probe, affix fill, host (% of ACache run; host over the runs, collections) | "
             "peak KV GB (cut) | MFU base / acache | "
             "s: run / time model, base; acache |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, a = r["baseline"], r["acache"]
        lines.append(f"| {r['model']} | {r['shots']} ({r['affix_tokens']}) | {r['batch']} | "
                     f"{b['recompute_ms']:.1f} / {a['recompute_ms']:.1f} ({100 * r['recompute_reduction']:.0f}%) | "
                     f"{b['tokens_per_s']:.0f} / {a['tokens_per_s']:.0f} ({r['speedup']:.2f}x) | "
                     f"{b['decode_step_ms']:.1f} / {a['decode_step_ms']:.1f} | "
                     f"{100 * a['probe_fraction']:.1f}%, {100 * a['fill_fraction']:.1f}%, "
                     f"{100 * a['host_fraction']:.1f}% "
                     f"({100 * a['host_fraction_range'][0]:.1f}-{100 * a['host_fraction_range'][1]:.1f}%, "
                     f"gc {a['gc_ms']:.0f} ms) | "
                     f"{b['peak_kv_gb']:.2f} / {a['peak_kv_gb']:.2f} ({100 * r['kv_reduction']:.0f}%) | "
                     f"{100 * b['mfu']:.0f}% / {100 * a['mfu']:.0f}% | "
                     f"{b['seconds']:.2f} / {b['model_seconds']:.2f}; {a['seconds']:.2f} / {a['model_seconds']:.2f} |")
    return "\n".join(lines)


def add_case_args(ap: argparse.ArgumentParser) -> None:
    """The flags that set how each case decodes (case_configs, new_engine): shared with
    eval.kernel_trace, so that it profiles the runs this benchmark times."""
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--steps", type=int, default=32, help="fixed schedule: gen/steps tokens committed per forward")
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--selector", default="attention", choices=ENGINE_SELECTORS, help="ACache's anchor selector")
    ap.add_argument("--backend", default=None, help="attention backend (default: pallas on a GPU)")
    ap.add_argument("--max-step-tokens", type=int, default=DEFAULT_STEP_TOKENS,
                    help="the engines' bound on one step's tokens (default: the engine's, %(default)s; 0: none); "
                         "outputs do not change")
    ap.add_argument("--affix", choices=["ids", "built"], default="ids",
                    help="ids: each ACache run computes its affix (the fill, counted in its time model); built: "
                         "ACache's engines get the affix cache built once per case, outside the timed runs, as a "
                         "server's affix store serves every request after the first (the fill is then a copy)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llada,dream")
    ints = lambda text: [int(x) for x in text.split(",")]
    ap.add_argument("--batches", default=[16, 1, 4], type=ints)
    ap.add_argument("--shots", default=[4, 1, 2], type=ints)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (smoke runs); default: the full model")
    add_case_args(ap)
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="stop starting new cases after this")
    ap.add_argument("--compile-threads", type=int, default=8,
                    help="cases compiled in parallel before timing (one out of device memory is retried alone)")
    ap.add_argument("--compile-s", type=float, default=None, help="time for compiling (default: half the budget)")
    ap.add_argument("--meshes", default="none", type=parse_meshes,
                    help="each model under each of: none (no mesh) and TPxDP meshes, e.g. none,1x1 (rows model@tp1dp1)")
    ap.add_argument("--repeats", type=int, default=3, help="plain runs per case and policy (the median is reported)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also run each case under cProfile and print its N functions of most own time")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    compile_cache.enable()  # compiled programs are kept for later runs (acache_jax/compile_cache.py)
    start = time.perf_counter()
    package = code_path()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; acache_jax from {package}", flush=True)
    shapes = {"llada": lambda n: llada_8b(n or 32), "dream": lambda n: dream_7b(n or 28)}
    models = {name if label == "none" else f"{name}@{label}": random_model(shapes[name](args.layers), mesh=mesh)
              for name in args.models.split(",") for label, mesh in args.meshes.items()}
    cases = [(name, shots, batch) for shots in args.shots for batch in args.batches for name in models]
    # Compile every case first (then time them one at a time, so no timed run shares the GPU).
    # Cases not compiled by half the budget are left out.
    compile_deadline = start + (args.budget_s / 2 if args.compile_s is None else args.compile_s)
    free = free_device_bytes()
    ready = warm_up(lambda case, policy: warm(models[case[0]], case[1], case[2], policy, args), cases,
                    args.compile_threads, compile_deadline,
                    case_bytes=lambda case: pool_bytes(models[case[0]], case, args),
                    budget_bytes=None if free is None else int(POOL_SHARE * free))
    print(json.dumps(dict(t=round(time.perf_counter() - start, 1), compiled=len(ready), of=len(cases))), flush=True)
    rows = []
    for name, shots, batch in ready:
        if time.perf_counter() - start > args.budget_s:
            print(json.dumps(dict(stopped="budget", measured=len(rows))), flush=True)
            break
        rows.append(run_case(models[name], name, shots, batch, args))
        print(json.dumps({"t": round(time.perf_counter() - start, 1), **rows[-1]}), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / "bench_engine.json",
                     json.dumps(dict(jax=jax.__version__, package=package, rows=rows), indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
