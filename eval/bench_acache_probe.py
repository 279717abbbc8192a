"""Anchor-selection cost at LLaDA-8B shape (random bf16 weights), per request, batch 1 and 16.

    python -m eval.bench_acache_probe [--layers 32] [--affix 400] [--prompt 100] [--batches 1,16]
                                      [--selectors attention,hkvd,hkvd_block] [--block-length 32]

The attention probe is one forward over a request's non-affix tokens (prompt + gen_length masks)
against the shared affix K/V, scoring affix keys by the mask queries' attention (see
acache_jax/decoding/acache.py), then top-K; hkvd is one full forward over the request with its affix;
hkvd_block one over the affix, the prompt and the first block's masks only (the request's text and
first block, which are what hkvd's deviation signal comes from, docs/RESULTS.md). Reported
per selector: median time of the jitted selection per batch, per request, and against the attention
probe's (when measured).
"""

from __future__ import annotations

import argparse
import functools
import math

import jax
import numpy as np

from acache_jax import compile_cache
from acache_jax.decoding.acache import build_affix_cache, select_anchors
from acache_jax.decoding.layout import Request, make_batch
from eval.bench_decode import llada_8b, median_seconds, random_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--affix", type=int, default=400, help="affix tokens (about a 2-shot GSM8K prompt)")
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--gen", type=int, default=256)
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--backend", default="cudnn")
    parser.add_argument("--selectors", default="attention", help="comma-separated anchor selectors to time")
    parser.add_argument("--block-length", type=int, default=32, help="hkvd_block's block")
    args = parser.parse_args()
    compile_cache.enable()  # compiled programs are kept for later runs (acache_jax/compile_cache.py)
    cfg = llada_8b(args.layers)
    model = random_model(cfg)
    rng = np.random.default_rng(0)
    affix = build_affix_cache(model, rng.integers(0, 126000, args.affix).tolist())
    k = math.ceil(args.ratio * args.affix)
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; affix {args.affix}, prompt {args.prompt}, "
          f"gen {args.gen}, block {args.block_length}, K {k}")
    print("| selector | B | ms per batch | ms per request | x attention |\n|---|---|---|---|---|")
    for b in [int(x) for x in args.batches.split(",")]:
        reqs = [Request(rng.integers(0, 126000, args.prompt).tolist(), affix_position="prefix") for _ in range(b)]
        batch = make_batch(reqs, args.gen, cfg, [int(t) for t in affix.ids])
        seconds = {}
        for selector in args.selectors.split(","):
            seconds[selector] = sec = median_seconds(functools.partial(
                select_anchors, *model.flat, batch, affix, k, selector, args.backend,
                args.block_length))
            ratio = f"{sec / seconds['attention']:.2f}" if "attention" in seconds else "-"
            print(f"| {selector} | {b} | {1e3 * sec:.1f} | {1e3 * sec / b:.1f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
