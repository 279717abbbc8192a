"""The serving engine, Fast-dLLM dual-cache baseline vs ACache side by side (the paper's tables 1-4).

    python -m eval.bench_engine [--models llada,dream] [--batches 1,4,16] [--shots 1,2,4] [--out DIR]

LLaDA-8B and Dream-7B shapes with random bf16 weights; per (model, shots, batch) both policies
decode the same requests with the same weights: `batch` requests of a shared prefix affix of
`shots` GSM8K-like few-shot examples (SHOT_TOKENS tokens each, about what LLaDA's tokenizer gives
a GSM8K example with its worked answer) + a QUESTION_TOKENS-token question, gen 256, block 32, a
fixed commit schedule (`--steps`; both policies do the same NFE), ratio 0.2. Reported per policy:
median recompute latency per call (block start), end-to-end generated tokens/s, peak KV memory
(pool blocks in use), and MFU (matmul FLOPs performed / time / 800 TFLOP/s).
Every case is compiled first (one warm-up engine iteration per case and policy, several at once in
threads), then the cases are timed one after another on fresh engines.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time
from pathlib import Path

import jax
import numpy as np

from acache_jax.config import ModelConfig
from acache_jax.config import DecodeConfig
from acache_jax.engine import Engine
from acache_jax.layout import Request
from acache_jax.files import write_atomic
from eval.bench_decode import PEAK_TFLOPS, forward_flops, llada_8b, random_model

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


def engine_flops(cfg: ModelConfig, engine: Engine, affix_len: int, policy: str, dcfg: DecodeConfig) -> float:
    """Matmul FLOPs the run performed: recomputes over the private columns, in-block steps over one
    block, both against the whole sequence."""
    total_cols = affix_len + QUESTION_TOKENS + dcfg.gen_length
    private = total_cols if policy == "baseline" else total_cols - affix_len + dcfg.anchors(affix_len)
    flops = sum(forward_flops(cfg, rows, private, total_cols, dcfg.block_length) for rows in engine.stats.recompute_rows)
    rows_per_decode = len(engine.stats.recompute_rows) and sum(engine.stats.recompute_rows) / len(engine.stats.recompute_rows)
    flops += len(engine.stats.decode) * forward_flops(cfg, 1, dcfg.block_length, total_cols, dcfg.block_length) * rows_per_decode
    return flops


def case_configs(cfg: ModelConfig, shots: int, batch: int, args) -> tuple[list[int], list[Request], int, dict]:
    """(affix, requests, pool tokens, policy -> DecodeConfig) of one case."""
    affix, requests = workload(cfg, shots, batch)
    # Sized per case: the warm-up compiles several cases at once, each holding its engine's pool.
    pool_tokens = batch * (len(affix) + QUESTION_TOKENS + args.gen) + len(affix) + 64 * batch
    configs = {p: DecodeConfig(gen_length=args.gen, block_length=args.block, steps=args.steps, threshold=None,
                               cache=c, anchor_ratio=args.ratio, attn_backend=args.backend)
               for p, c in POLICIES.items()}
    return affix, requests, pool_tokens, configs


def warm(model, shots: int, batch: int, policy: str, args) -> None:
    """Compile a case's step functions: one engine iteration (admission, probe, recompute, decode)."""
    affix, requests, pool_tokens, configs = case_configs(model.config, shots, batch, args)
    engine = Engine(model, configs[policy], pool_tokens=pool_tokens, max_batch=batch)
    for r in requests:
        engine.add(r, affix)
    engine.step()


def run_case(model, name: str, shots: int, batch: int, args) -> dict:
    """Both policies on one case, on fresh engines whose step functions are already compiled."""
    cfg = model.config
    affix, requests, pool_tokens, configs = case_configs(cfg, shots, batch, args)
    row = dict(model=name, shots=shots, affix_tokens=len(affix), question_tokens=QUESTION_TOKENS, batch=batch)
    for policy, dcfg in configs.items():
        engine = Engine(model, dcfg, pool_tokens=pool_tokens, max_batch=batch)
        results = engine.generate(requests, affix)
        stats = engine.stats.summary()
        flops = engine_flops(cfg, engine, len(affix), policy, dcfg)
        row[policy] = dict(recompute_ms=1e3 * stats["recompute_median_s"], decode_ms=1e3 * stats["decode_median_s"],
                           probe_ms=1e3 * float(np.median(engine.stats.probe)) if engine.stats.probe else 0.0,
                           tokens_per_s=stats["tokens_per_s"], seconds=stats["seconds"],
                           peak_kv_gb=stats["peak_kv_bytes"] / 1e9, nfe=int(np.mean([r.nfe for r in results])),
                           mfu=flops / stats["seconds"] / (PEAK_TFLOPS * 1e12))
    b, a = row["baseline"], row["acache"]
    row["recompute_reduction"] = 1 - a["recompute_ms"] / b["recompute_ms"]
    row["speedup"] = a["tokens_per_s"] / b["tokens_per_s"]
    row["kv_reduction"] = 1 - a["peak_kv_gb"] / b["peak_kv_gb"]
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | shots (affix tokens) | B | recompute ms base / acache (cut) | tok/s base / acache (speedup) | "
             "peak KV GB base / acache (cut) | MFU base / acache |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        b, a = r["baseline"], r["acache"]
        lines.append(f"| {r['model']} | {r['shots']} ({r['affix_tokens']}) | {r['batch']} | "
                     f"{b['recompute_ms']:.1f} / {a['recompute_ms']:.1f} ({100 * r['recompute_reduction']:.0f}%) | "
                     f"{b['tokens_per_s']:.0f} / {a['tokens_per_s']:.0f} ({r['speedup']:.2f}x) | "
                     f"{b['peak_kv_gb']:.2f} / {a['peak_kv_gb']:.2f} ({100 * r['kv_reduction']:.0f}%) | "
                     f"{100 * b['mfu']:.0f}% / {100 * a['mfu']:.0f}% |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llada,dream")
    ints = lambda text: [int(x) for x in text.split(",")]
    ap.add_argument("--batches", default=[16, 1, 4], type=ints)
    ap.add_argument("--shots", default=[4, 1, 2], type=ints)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (smoke runs); default: the full model")
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--steps", type=int, default=32, help="fixed schedule: gen/steps tokens committed per forward")
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--backend", default=None, help="attention backend (default: pallas on a GPU)")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="stop starting new cases after this")
    ap.add_argument("--compile-threads", type=int, default=8, help="cases compiled in parallel before timing")
    ap.add_argument("--compile-s", type=float, default=None, help="time for compiling (default: half the budget)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    shapes = {"llada": lambda n: llada_8b(n or 32), "dream": lambda n: dream_7b(n or 28)}
    models = {name: random_model(shapes[name](args.layers)) for name in args.models.split(",")}
    cases = [(name, shots, batch) for shots in args.shots for batch in args.batches for name in models]
    # Compile every case first, in parallel threads (compilation is host work); then time the cases
    # one at a time, so no timed run shares the GPU. Cases not compiled by half the budget are left out.
    compile_deadline = start + (args.budget_s / 2 if args.compile_s is None else args.compile_s)
    with concurrent.futures.ThreadPoolExecutor(args.compile_threads) as ex:
        warming = {case: [ex.submit(warm, models[case[0]], case[1], case[2], p, args) for p in POLICIES]
                   for case in cases}
        left = compile_deadline - time.perf_counter()
        concurrent.futures.wait([f for fs in warming.values() for f in fs],
                                timeout=None if left == float("inf") else max(0.0, left))
        ex.shutdown(wait=True, cancel_futures=True)
    ready = [case for case in cases if all(f.done() and not f.cancelled() and f.exception() is None
                                           for f in warming[case])]
    for case in cases:
        errors = [f.exception() for f in warming[case] if f.done() and not f.cancelled() and f.exception()]
        if errors:
            print(json.dumps(dict(case=case, error=repr(errors[0])[:300])), flush=True)
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
        write_atomic(args.out / "bench_engine.json", json.dumps(dict(jax=jax.__version__, rows=rows), indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
