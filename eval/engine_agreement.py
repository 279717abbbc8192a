"""How often the serving engine decodes to the static path's tokens, per model, dtype and policy.

    python -m eval.engine_agreement [--models DIR,DIR] [--dtype bfloat16] [-n 200] [--shots 1,3] [--json FILE]

The same mixed workload on both paths: held-out task questions (bAbI, arithmetic, codebook, in
turn) with their task's few-shot affix in prefix, infix and suffix position, every request sharing
its task's affix, served by one engine per policy and by `generate`. Reports, per policy, the
fraction of requests whose generated tokens are equal on both paths and how many answers differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from acache_jax import compile_cache
from acache_jax.decoding.decode import generate
from acache_jax.engine import Engine
from acache_jax.network.checkpoint import load
from acache_jax.network.config import SELECTORS
from acache_jax.network.files import check_output_path, write_atomic
from acache_jax.network.model import Model
from eval.tasks import STUDY_TASKS, eval_split, get_task
from eval.tasks.layouts import PLACEMENTS, affix_ids, encoder, request

MODELS = Path(__file__).resolve().parents[1] / "acache_jax" / "models"


def workload(model: Model, n: int, shots: int = 1, seed: int = 0, tasks: tuple[str, ...] = STUDY_TASKS
             ) -> dict[tuple[int, ...], list]:
    """n requests, tasks and placements in turn, grouped by their (task's) affix ids."""
    encode = encoder(model.tokenizer)
    groups: dict[tuple[int, ...], list] = {}
    splits = {task: eval_split(get_task(task), seed, n) for task in tasks}
    for i in range(n):
        task, placement = tasks[i % len(tasks)], PLACEMENTS[1 + i % 3]
        examples, questions = splits[task]
        affix = tuple(affix_ids(encode, examples[:shots], placement))
        groups.setdefault(affix, []).append(request(encode, questions[i // len(tasks)], placement, seed=i))
    return groups


def agreement(model: Model, n: int, policies: list[str], shots: int = 1, tasks: tuple[str, ...] = STUDY_TASKS,
              **settings: Any) -> list[dict[str, Any]]:
    """Per policy: the share of requests with equal tokens on both paths (settings: DecodeConfig
    fields). One engine serves every request, whatever its affix; the static path runs per affix."""
    rows = []
    groups = workload(model, n, shots, tasks=tasks)
    for policy in policies:
        config = model.decode_config(cache=policy, **settings)
        engine = Engine(model, config, max_batch=16)
        ids = {affix: [engine.add(r, list(affix)) for r in requests] for affix, requests in groups.items()}
        served = {res.request_id: res for res in engine.run()}
        same = answers_differ = 0
        for affix, requests in groups.items():
            static = generate(model, requests, config, affix=list(affix), max_batch=64)
            for s, rid in zip(static.tokens, ids[affix]):
                same += bool(np.array_equal(s, served[rid].tokens))
                answers_differ += model.answer_text(s) != model.answer_text(served[rid].tokens)
        rows.append(dict(policy=policy, shots=shots, n=n, **settings, tokens_equal=same / n,
                         answers_differ=answers_differ))
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.engine_agreement", description=__doc__.splitlines()[0])
    p.add_argument("--models", default=f"{MODELS / 'llada-small'},{MODELS / 'dream-small'}")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("-n", type=int, default=200, help="requests per policy")
    p.add_argument("--policies", default="direct,acache,dual")
    p.add_argument("--shots", default="1", help="comma-separated few-shot counts of the affixes")
    p.add_argument("--tasks", default=",".join(STUDY_TASKS), help="comma-separated tasks, taken in turn")
    p.add_argument("--gen-length", type=int, help="default: the model's")
    p.add_argument("--no-early-stop", action="store_true", help="compute every block")
    p.add_argument("--selector", choices=SELECTORS, help="the anchor selector (default: the config's)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    compile_cache.enable()  # compiled programs are kept for later runs (acache_jax/compile_cache.py)
    if args.json:
        check_output_path(args.json)
    rows = []
    for directory in args.models.split(","):
        model = load(directory, dtype=args.dtype)
        for shots in map(int, args.shots.split(",")):
            settings = dict(early_stop=not args.no_early_stop)
            if args.gen_length:
                settings["gen_length"] = args.gen_length
            if args.selector:
                settings["selector"] = args.selector
            for row in agreement(model, args.n, args.policies.split(","), shots, tuple(args.tasks.split(",")),
                                 **settings):
                rows.append(dict(model=Path(directory).name, dtype=args.dtype, **row))
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        write_atomic(args.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
