"""Which affix tokens the anchor selectors pick on the codebook task, and whether they hold the answer.

    python -m eval.anchor_analysis --models DIR[,DIR] [-n 128] [--ratio 0.2] [--json FILE]

A codebook question ("Decode: wug") is answered by one binding of the few-shot examples ("wug means
blue."). Per question, each selector scores every affix token: `attention` by the mask queries'
attention on the cached affix (the anchor probe), `hkvd` by how far the token's K/V in the whole
request lies from its cached K/V. Per model, placement and shots this prints how often the top-K
anchors (K = ceil(ratio * L)) include the answer's colour token, and any token of the asked binding,
and the share of each selector's score that falls on the asked binding's tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

from acache_jax import compile_cache
from acache_jax.decoding.acache import build_affix_cache, hkvd_deviation, probe_importance
from acache_jax.decoding.layout import make_batch
from acache_jax.network.checkpoint import load
from acache_jax.network.config import anchor_count
from acache_jax.network.files import write_atomic
from acache_jax.network.model import Model
from eval.tasks import eval_split, get_task
from eval.tasks.base import words
from eval.tasks.layouts import affix_ids, encoder, request

# Jitted: op by op, each of the probe's hundreds of operations would compile on its own.
_attention_scores = jax.jit(probe_importance, static_argnums=0)
_hkvd_scores = jax.jit(hkvd_deviation, static_argnums=0)

BINDING = 4  # tokens of "wug means blue ."


def _binding_starts(affix: list[int], code: int, means: int) -> list[int]:
    return [i for i in range(len(affix) - 1) if affix[i] == code and affix[i + 1] == means]


def analyse(model: Model, placement: str, shots: int, n: int, ratio: float, seed: int = 0) -> dict[str, Any]:
    encode = encoder(model.tokenizer)
    examples, questions = eval_split(get_task("codebook"), seed, n)
    affix = affix_ids(encode, examples[:shots], placement)
    cache = build_affix_cache(model, affix)
    batch = make_batch([request(encode, q, placement, i) for i, q in enumerate(questions)],
                       model.generation_config.gen_length,
                       model.config, affix)
    scores = {"attention": _attention_scores(*model.flat, batch, cache), "hkvd": _hkvd_scores(*model.flat, batch, cache)}
    k = anchor_count(ratio, len(affix))
    bindings = []  # per question: where the asked binding starts in the affix (once per shot)
    for q in questions:
        code, _, colour = words(q.answer)
        starts = _binding_starts(affix, encode(code)[0], encode("means")[0])
        assert starts and all(affix[i + 2] == encode(colour)[0] for i in starts), "the shots hold the answer"
        bindings.append(starts)
    row: dict[str, Any] = dict(placement=placement, shots=shots, n=n, affix_len=len(affix), anchors=k)
    for name, score in scores.items():
        score = np.asarray(score, np.float64)[:n]
        colour_hits, binding_hits, shares = [], [], []
        for starts, s in zip(bindings, score):
            anchors = set(np.argsort(-s, kind="stable")[:k].tolist())
            colour_hits.append(any(i + 2 in anchors for i in starts))
            binding_hits.append(any(i + j in anchors for i in starts for j in range(BINDING)))
            shares.append(sum(s[i:i + BINDING].sum() for i in starts) / s.sum())
        row[name] = dict(colour_in_anchors=float(np.mean(colour_hits)),
                         binding_in_anchors=float(np.mean(binding_hits)), binding_share=float(np.mean(shares)))
    return row


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.anchor_analysis", description=__doc__.splitlines()[0])
    p.add_argument("--models", required=True, help="comma-separated model directories")
    p.add_argument("--placements", default="prefix,infix,suffix")
    p.add_argument("--shots", default="1,2")
    p.add_argument("-n", type=int, default=128, help="questions per setting")
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the rows here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    compile_cache.enable()  # compiled programs are kept for later runs (acache_jax/compile_cache.py)
    rows = []
    print("| model | placement | shots | K / L | colour in anchors: attention / hkvd | any binding token in "
          "anchors: attention / hkvd | score on the binding: attention / hkvd |\n|---|---|---|---|---|---|---|")
    for model_dir in map(Path, args.models.split(",")):
        model = load(model_dir)
        for placement in args.placements.split(","):
            for shots in map(int, args.shots.split(",")):
                r = analyse(model, placement, shots, args.n, args.ratio, args.seed)
                rows.append(dict(model=model_dir.name, **r))
                a, h = r["attention"], r["hkvd"]
                print(f"| {model_dir.name} | {placement} | {shots} | {r['anchors']} / {r['affix_len']} | "
                      f"{a['colour_in_anchors']:.0%} / {h['colour_in_anchors']:.0%} | "
                      f"{a['binding_in_anchors']:.0%} / {h['binding_in_anchors']:.0%} | "
                      f"{a['binding_share']:.0%} / {h['binding_share']:.0%} |", flush=True)
    if args.json:
        write_atomic(args.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
