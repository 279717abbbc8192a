"""Accuracy of a model on the tasks: one seeded world per task, its few-shot affix in each placement.

python -m eval.accuracy --model DIR [--tasks babi,arithmetic,codebook] [-n 64] [--cache dual] [--binding]
Prints one JSON line per (task, placement, shots) and the whole grid with --json FILE; --binding
adds the bAbI name-binding probe (`binding`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from acache_jax import compile_cache
from acache_jax.decoding.acache import build_affix_cache
from acache_jax.decoding.decode import generate
from acache_jax.network.checkpoint import load
from acache_jax.network.config import CACHE_POLICIES, DecodeConfig, InputError
from acache_jax.network.files import check_output_path, write_atomic
from acache_jax.network.model import Model
from eval.tasks import MAX_SHOTS, STUDY_TASKS, Example, eval_split, get_task
from eval.tasks.babi import binding_stories
from eval.tasks.layouts import PLACEMENTS, Placement, affix_ids, encoder, request


def full_recompute(model: Model) -> DecodeConfig:
    """The reference every policy is measured against: the model's generation defaults with the
    dual cache, which recomputes the affix in place at every block start."""
    return model.decode_config(cache="dual")


class Score(NamedTuple):
    accuracy: float
    anchor_fraction: float | None  # selective policies: the mean share of the affix recomputed as anchors


def _score(model: Model, questions: Sequence[Example], placement: Placement, affix_tokens: list[int] | None,
           config: DecodeConfig, max_batch: int) -> Score:
    encode = encoder(model.tokenizer)
    selective = config.selective and affix_tokens is not None
    affix = build_affix_cache(model, affix_tokens) if selective else affix_tokens
    requests = [request(encode, q, placement, seed=i) for i, q in enumerate(questions)]
    out = generate(model, requests, config, affix=affix, max_batch=max_batch)
    correct = sum(q.score(model.answer_text(t)) for q, t in zip(questions, out.tokens)) / len(questions)
    fraction = float(np.mean([len(a) for a in out.anchors])) / len(affix_tokens) if selective else None
    return Score(correct, fraction)


def _needs_tokenizer(model: Model) -> None:
    if model.tokenizer is None:
        raise ValueError("the model ships no tokenizer; accuracy needs one to lay out and score text")


def score(model: Model, task: str, placement: Placement, shots: int, n: int, seed: int = 0,
          config: DecodeConfig | None = None, max_batch: int = 256) -> Score:
    """Accuracy on n held-out questions with the first `shots` examples as affix (config: default
    `full_recompute(model)`), and how much of the affix a selective policy recomputed."""
    _needs_tokenizer(model)
    config = config or full_recompute(model)
    examples, questions = eval_split(get_task(task), seed, n)
    return _score(model, questions, placement, affix_ids(encoder(model.tokenizer), examples[:shots], placement),
                  config, max_batch)


def accuracy(model: Model, task: str, placement: Placement, shots: int, n: int, seed: int = 0,
             config: DecodeConfig | None = None, max_batch: int = 256) -> float:
    """Fraction of n held-out questions answered correctly (`score`'s accuracy)."""
    return score(model, task, placement, shots, n, seed, config, max_batch).accuracy


def binding(model: Model, facts: Sequence[int] = (2, 3, 5), n: int = 128, seed: int = 0) -> list[dict[str, Any]]:
    """bAbI accuracy (full recompute, no affix) on stories of distinct people, asking about the
    first vs the last one. Answering the last-mentioned place scores 1.0 on "last", 0 on "first"."""
    _needs_tokenizer(model)
    rng = np.random.default_rng([seed, 2])
    return [{"facts": k, "ask": "first" if first else "last", "n": n,
             "accuracy": _score(model, binding_stories(rng, n, k, first), "none", None, full_recompute(model), n).accuracy}
            for k in facts for first in (True, False)]


def grid(model: Model, tasks: Sequence[str], n: int, seed: int = 0, config: DecodeConfig | None = None,
         report=print) -> list[dict[str, Any]]:
    """Every task without affix (unless the policy needs one) and with 1..MAX_SHOTS examples in each placement."""
    config = config or full_recompute(model)
    rows = []
    for task in tasks:
        settings = [("none", 0)] * (not config.selective)
        settings += [(p, k) for p in PLACEMENTS[1:] for k in range(1, MAX_SHOTS + 1)]
        for placement, shots in settings:
            acc = accuracy(model, task, placement, shots, n, seed, config)
            rows.append({"task": task, "placement": placement, "shots": shots, "n": n, "accuracy": acc})
            report(json.dumps(rows[-1]))
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.accuracy", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--tasks", default=",".join(STUDY_TASKS))
    p.add_argument("-n", type=int, default=64, help="questions per setting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", choices=CACHE_POLICIES, default="dual")
    p.add_argument("--json", type=Path, help="also write the grid here")
    p.add_argument("--binding", action="store_true", help="also run the bAbI name-binding probe")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    compile_cache.enable()  # compiled programs are kept for later runs (acache_jax/compile_cache.py)
    try:
        if args.json:
            check_output_path(args.json)
        model = load(args.model)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = grid(model, args.tasks.split(","), args.n, args.seed, model.decode_config(cache=args.cache))
    if args.binding:
        for row in binding(model, n=args.n, seed=args.seed):
            rows.append({"task": "babi-binding", **row})
            print(json.dumps(rows[-1]))
    if args.json:
        write_atomic(args.json, json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
