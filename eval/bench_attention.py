"""Gathered attention on the GPU: correctness against the oracle, then speed against cuDNN and XLA.

    python -m eval.bench_attention [--out DIR] [--skip-check] [--skip-tune] [--batches 1,16 --tks 1024,4096]

Every distinct shape and configuration compiles its own Triton kernel (several seconds each on the
H200 machine), so a call that must fit in minutes narrows the shapes and sets --budget-s.

1. Check: the compiled kernels (attention, anchor importance) against the jnp oracle run at full
   fp32 precision on upcast inputs, over GQA groups 1/4/7, head dims 64/128, fp32/bf16, odd lengths
   and junk slots beyond kv_lens; then a small random LLaDA-shaped model (head dim 64, fp32, its
   LM head scaled up so that every decision has a wide margin) decodes with the xla and the pallas
   backends, static and served, and the tokens must be equal (margins printed where they are not).
2. Tune: kernel configurations (query block, key tile, warps, stages) on representative decode-block
   and recompute shapes; the fastest per regime is used below.
3. Bench: decode-block shapes (Tq 32) and recompute shapes (Tq 256-1024) at LLaDA-8B (32/32 heads)
   and Dream-7B (28/4 heads) attention shapes, D 128, bf16, keys read through a paged slot map:
   - pallas: our kernel (K stored rotated, as the pools hold it; the key range split across
     programs where the batch alone would leave the GPU idle);
   - cudnn: jax.nn.dot_product_attention (cuDNN) on a contiguous copy of the same K/V;
   - xla: the oracle (XLA gather + einsum softmax).
   Each call's output feeds the next call's query inside one compiled loop over several K/V sets
   (more bytes than L2 holds), so times are device times per call without host dispatch.
   Reports time, TFLOP/s (4 B Tq Hq Tk D) and effective bandwidth (K/V bytes read once + q + out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from acache_jax import compile_cache
from acache_jax.network.files import write_atomic
from pallas_kernels import anchor_importance, gathered_attention

PAGE = 16  # slots per pool block in the benchmark's slot maps
HEADS = {"llada": (32, 32), "dream": (28, 4)}  # (query heads, kv heads)
THETA = 500000.0


_START = time.perf_counter()
_BUDGET_S = [float("inf")]


def log(obj: dict) -> None:
    print(json.dumps({"t": round(time.perf_counter() - _START, 1), **obj}), flush=True)


def over_budget() -> bool:
    return time.perf_counter() - _START > _BUDGET_S[0]


def random_inputs(seed, b, tq, hq, hkv, d, tk, dtype, rotations=1, lens=None):
    """q and `rotations` disjoint pool regions with paged, shuffled slot maps; junk beyond kv_lens."""
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    pages = -(-tk // PAGE)
    region = b * pages * PAGE
    q = jax.random.normal(kq, (b, tq, hq, d), jnp.float32).astype(dtype)
    k_pool = jax.random.normal(kk, (rotations * region, hkv, d), jnp.float32).astype(dtype)
    v_pool = jax.random.normal(kv, (rotations * region, hkv, d), jnp.float32).astype(dtype)
    lens = np.full(b, tk) if lens is None else np.asarray(lens)
    maps = []
    for r in range(rotations):
        order = rng.permutation(b * pages).reshape(b, pages)
        slots = (r * region + order[:, :, None] * PAGE + np.arange(PAGE)).reshape(b, -1)[:, :tk]
        slots = np.where(np.arange(tk)[None] < lens[:, None], slots, rng.integers(-(2**20), 2**30, size=(b, tk)))
        maps.append(jnp.asarray(slots, jnp.int32))
    return q, k_pool, v_pool, maps, jnp.asarray(lens, jnp.int32)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def check() -> list[dict]:
    rows = []
    cases = [(1, 4, 64, jnp.float32), (1, 4, 128, jnp.bfloat16), (4, 2, 128, jnp.bfloat16), (4, 2, 64, jnp.float32),
             (7, 4, 128, jnp.bfloat16), (7, 1, 64, jnp.float32)]
    for i, (group, hkv, d, dtype) in enumerate(cases):
        for tq, tk in ((32, 1000), (301, 77)):
            b = 3
            lens = [tk, 1, max(1, tk // 2 + 1)]
            q, kp, vp, maps, lens = random_inputs(i, b, tq, group * hkv, hkv, d, tk, dtype, lens=lens)
            got = gathered_attention(q, kp, vp, maps[0], lens, backend="pallas")
            with jax.default_matmul_precision("highest"):
                up = lambda a: a.astype(jnp.float32)
                want = gathered_attention(up(q), up(kp), up(vp), maps[0], lens, backend="xla")
                weights = (jnp.arange(tq) % 3 == 0).astype(jnp.float32)[None].repeat(b, 0)
                imp_want = anchor_importance(up(q), up(kp), maps[0], lens, weights, backend="xla")
            imp = anchor_importance(q, kp, maps[0], lens, weights, backend="pallas")
            got = np.asarray(got.astype(jnp.float32))
            tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
            row = dict(group=group, hkv=hkv, d=d, dtype=jnp.dtype(dtype).name, tq=tq, tk=tk,
                       attention_rel_err=rel_err(got, want), importance_rel_err=rel_err(imp, imp_want),
                       finite=bool(np.isfinite(got).all()))
            row["ok"] = row["finite"] and row["attention_rel_err"] < tol and row["importance_rel_err"] < tol
            rows.append(row)
            log(row)
    rows.append(check_decode())
    log(rows[-1])
    return rows


PEAK = 30.0  # the check model's LM head is scaled by this: confident, well-separated decisions


def check_decode() -> dict:
    """A random LLaDA-shaped model (head dim 64, fp32) with a peaked LM head decodes the same tokens
    with both backends, static and served; where tokens differ, the decision margin (top-1 minus
    top-2 logit) at the first differing position tells a near-tie from a bug."""
    from flax import nnx

    from acache_jax.decoding.acache import build_affix_cache
    from acache_jax.decoding.decode import generate
    from acache_jax.decoding.layout import Request
    from acache_jax.engine import Engine
    from acache_jax.network.config import DecodeConfig, ModelConfig
    from acache_jax.network.model import Model, Transformer

    cfg = ModelConfig(family="llada", vocab_size=512, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=4,
                      head_dim=64, intermediate_size=512, rope_theta=THETA, rms_norm_eps=1e-5, max_seq_len=1024,
                      qkv_bias=False, mask_token_id=511, eos_token_id=510, pad_token_id=510)
    net = Transformer(cfg, jnp.float32, rngs=nnx.Rngs(0))
    net.lm_head.kernel.value = net.lm_head.kernel.value * PEAK
    model = Model.from_module(net)
    rng = np.random.default_rng(0)
    affix = rng.integers(0, 500, size=90).tolist()
    requests = [Request(rng.integers(0, 500, size=n).tolist(), affix_position=pos, tail=tail)
                for n, pos, tail in ((20, "prefix", ()), (37, "suffix", ()), (11, "infix", (4, 5, 6)))]
    cache = build_affix_cache(model, affix)
    result = {"check": "decode tokens, pallas vs xla backend, static and engine (peaked model)"}
    for policy in ("dual", "acache"):
        runs = {}
        for backend in ("xla", "pallas"):
            config = DecodeConfig(gen_length=64, block_length=16, cache=policy, attn_backend=backend,
                                  early_stop=False)
            runs[backend] = generate(model, requests, config, affix=cache).tokens
            runs[backend + "_engine"] = [r.tokens for r in Engine(model, config, pool_tokens=4096).generate(
                requests, affix)]
        want = runs["xla"]
        entry = {}
        for name, tokens in runs.items():
            same = [bool(np.array_equal(a, b)) for a, b in zip(want, tokens)]
            entry[name] = same
            for i, ok in enumerate(same):
                if not ok:
                    entry.setdefault("margins", []).append(dict(run=name, request=i, **_margin(
                        model, requests[i], affix, want[i], tokens[i])))
        result[policy] = entry
    result["ok"] = all(all(v) for p in ("dual", "acache") for k, v in result[p].items() if k != "margins")
    return result


def _margin(model, request, affix, want, got) -> dict:
    """Top-1 minus top-2 logit of a full forward over the oracle's sequence, at the first position
    where the two decodes differ (small: a near-tie flipped; large: a bug)."""
    row = request.row(affix, len(want), model.config.mask_token_id)
    first = int(np.argmax(np.asarray(want) != np.asarray(got)))
    tokens = row.tokens.copy()
    tokens[row.gen_start:row.gen_start + len(want)] = want
    logits = np.asarray(model.logits(tokens[None]))[0, row.gen_start + first]
    top = np.sort(logits)[-2:]
    return dict(position=first, margin=float(top[1] - top[0]))


def time_chain(fn, q, data, rotations: int, unrolled: bool, target_s: float = 0.03) -> float:
    """Seconds per call of fn(q, r, data) -> q' (r: which K/V set), chained over the sets in one loop.

    data (the K/V sets) is an argument of the compiled loop, never a captured constant: XLA would
    embed hundreds of MB of constants in the program and take many seconds to compile it.
    unrolled: one traced call per set (inputs that must be separate arrays); otherwise r is traced.
    """
    @jax.jit
    def run(q, data, reps):
        def body(i, q):
            if unrolled:
                for r in range(rotations):
                    q = fn(q, r, data)
                return q
            return fn(q, i % rotations, data)
        return jax.lax.fori_loop(0, reps if unrolled else reps * rotations, body, q)

    run(q, data, 1).block_until_ready()
    start = time.perf_counter()
    run(q, data, 1).block_until_ready()
    once = time.perf_counter() - start
    reps = int(min(200, max(2, target_s / max(once, 1e-6))))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        run(q, data, reps).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / (reps * rotations)


def shape_inputs(model: str, b: int, tq: int, tk: int):
    hq, hkv = HEADS[model]
    kv_bytes = 2 * b * tk * hkv * 128 * 2
    rotations = int(min(8, max(2, -(-150e6 // kv_bytes))))
    q, kp, vp, maps, lens = random_inputs(b * 7 + tk, b, tq, hq, hkv, 128, tk, jnp.bfloat16, rotations)
    return q, kp, vp, maps, lens, kv_bytes


def implementations(kp, vp, maps, lens, config):
    """name -> (fn(q, r, data), data, unrolled) for one shape; r selects one of the K/V sets."""
    paged = dict(kp=kp, vp=vp, slots=jnp.stack(maps), lens=lens)
    contiguous = dict(kv=[(kp[m], vp[m]) for m in maps], lens=lens)

    def kernel(backend, **kw):
        return lambda q, r, d: gathered_attention(q, d["kp"], d["vp"], d["slots"][r], d["lens"], backend=backend, **kw)

    cudnn = lambda q, r, d: jax.nn.dot_product_attention(q, *d["kv"][r], key_value_seq_lengths=d["lens"],
                                                         implementation="cudnn")
    return {"pallas": (kernel("pallas", **config), paged, False), "cudnn": (cudnn, contiguous, True),
            "xla": (kernel("xla"), paged, False)}


def measure(model, b, tq, tk, config, names=None) -> dict:
    q, kp, vp, maps, lens, kv_bytes = shape_inputs(model, b, tq, tk)
    hq = q.shape[2]
    flops = 4 * b * tq * hq * tk * 128
    io_bytes = kv_bytes + 2 * q.size * 2
    row = dict(model=model, b=b, tq=tq, tk=tk)
    for name, (fn, data, unrolled) in implementations(kp, vp, maps, lens, config).items():
        if names and name not in names:
            continue
        try:
            seconds = time_chain(fn, q, data, len(maps), unrolled)
            row[name] = dict(us=seconds * 1e6, tflops=flops / seconds / 1e12, tbps=io_bytes / seconds / 1e12)
        except Exception as e:  # noqa: BLE001 (a failing implementation is reported, the others still run)
            row[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    return row


TUNE_CONFIGS = [dict(block_q=bq, block_k=bk, num_warps=w, num_stages=s)
                for bq, bk, w, s in ((128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3),
                                     (128, 128, 8, 2), (64, 32, 4, 2), (128, 32, 8, 4))]
TUNE_SHAPES = {"decode": [("llada", 1, 32, 4096), ("llada", 16, 32, 2048), ("dream", 4, 32, 4096)],
               "recompute": [("llada", 4, 1024, 2048), ("dream", 1, 256, 1024)]}


def tune() -> dict:
    """Each configuration of our kernel on the tuning shapes, against cuDNN on each; the fastest
    per regime by the sum of the shapes' time relative to cuDNN's."""
    best = {}
    for regime, cases in TUNE_SHAPES.items():
        reference = [measure(*case, TUNE_CONFIGS[0], names=("cudnn",))["cudnn"].get("us", 1.0) for case in cases]
        log(dict(regime=regime, shapes=cases, cudnn_us=reference))
        scores = []
        for config in TUNE_CONFIGS:
            us = [measure(*case, config, names=("pallas",))["pallas"].get("us", float("inf")) for case in cases]
            scores.append(sum(u / c for u, c in zip(us, reference)))
            log(dict(regime=regime, config=config, pallas_us=us, over_cudnn=[u / c for u, c in zip(us, reference)]))
        best[regime] = TUNE_CONFIGS[int(np.argmin(scores))]
    log(dict(best=best))
    return best


def bench(best: dict, batches=(1, 4, 16), tks=(512, 1024, 2048, 4096)) -> list[dict]:
    """Decode-block shapes at the shortest and longest Tk first, then recompute shapes, then the
    other Tk, so a run cut short by --budget-s still spans the range."""
    ends = [tk for tk in tks if tk in (min(tks), max(tks))]
    decode = lambda keys: [(m, b, 32, tk, "decode") for tk in keys for b in batches for m in HEADS]
    shapes = decode(ends)
    shapes += [(m, b, tq, tk, "recompute") for tq, tk in ((256, 1024), (1024, 4096), (512, 2048))
               for b in (1, 4) for m in HEADS]
    shapes += decode([tk for tk in tks if tk not in ends])
    rows = []
    for model, b, tq, tk, regime in shapes:
        if over_budget():
            log(dict(stopped="budget", measured=len(rows), of=len(shapes)))
            break
        rows.append(measure(model, b, tq, tk, best[regime]))
        log(rows[-1])
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | B | Tq | Tk | pallas us | TFLOP/s | TB/s | x cuDNN | cuDNN us | TFLOP/s | TB/s | XLA us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for r in rows:
        p, c, x = (r.get(k, {}) for k in ("pallas", "cudnn", "xla"))
        ratio = c.get("us", nan) / p.get("us", nan)
        lines.append(f"| {r['model']} | {r['b']} | {r['tq']} | {r['tk']} | {p.get('us', nan):.1f} | "
                     f"{p.get('tflops', nan):.0f} | {p.get('tbps', nan):.2f} | {ratio:.2f}x | {c.get('us', nan):.1f} | "
                     f"{c.get('tflops', nan):.0f} | {c.get('tbps', nan):.2f} | {x.get('us', nan):.1f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="write bench_attention.json here")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-tune", action="store_true")
    ap.add_argument("--batches", default="1,4,16", help="decode-block batch sizes")
    ap.add_argument("--tks", default="512,1024,2048,4096", help="decode-block key lengths")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="stop adding bench shapes after this")
    args = ap.parse_args(argv)
    compile_cache.enable()  # compiled programs are kept for later runs (acache_jax/compile_cache.py)
    _BUDGET_S[0] = args.budget_s
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    result = {"jax": jax.__version__, "device": jax.devices()[0].device_kind}
    if not args.skip_check:
        result["check"] = check()
    default = TUNE_CONFIGS[0]
    result["best"] = tune() if not args.skip_tune else {"decode": default, "recompute": default}
    result["bench"] = bench(result["best"], [int(b) for b in args.batches.split(",")],
                            [int(t) for t in args.tks.split(",")])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / "bench_attention.json", json.dumps(result, indent=1))
    if "check" in result:
        print("check:", "all ok" if all(r["ok"] for r in result["check"]) else "FAILURES")
    print(table(result["bench"]))


if __name__ == "__main__":
    main()
