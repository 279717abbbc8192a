"""Local data for the lm-eval tasks of eval/lm_eval_tasks: the seeded tasks as JSON Lines.

    python -m eval.lm_eval_data --out out/lm_eval_data [-n 64] [--seed 0] [--tasks babi,arithmetic,codebook]

Per task, OUT/TASK/test.jsonl holds the n held-out questions and OUT/TASK/fewshot.jsonl the world's
MAX_SHOTS few-shot examples, drawn exactly as eval.accuracy and eval.affix_sweep draw them
(`eval_split` with this seed): lm-eval then scores the same questions, with the same affix. Each
line holds the layout fields (`eval.tasks.layouts.document_fields`) and the scorer's `target`;
bAbI lines also list the candidate locations (`choices`) for the multiple-choice task. The tasks
read OUT from $ACACHE_LM_EVAL_DATA (default out/lm_eval_data, see eval/lm_eval_tasks/utils.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from acache_jax.network.files import write_atomic
from eval.tasks import STUDY_TASKS, Example, eval_split, get_task
from eval.tasks.babi import PLACES
from eval.tasks.base import answer_number
from eval.tasks.layouts import document_fields


def document(task: str, example: Example) -> dict[str, Any]:
    """One line: the layout fields, the scorer's target (a number for arithmetic) and bAbI's choices."""
    doc: dict[str, Any] = document_fields(example)
    doc["target"] = answer_number(example.answer) if task == "arithmetic" else example.answer
    if task == "babi":
        doc["choices"] = list(PLACES)
    return doc


def write(out: Path, tasks: list[str], n: int, seed: int = 0) -> list[Path]:
    """Write OUT/TASK/{test,fewshot}.jsonl for each task; returns the files written."""
    written = []
    for task in tasks:
        shots, questions = eval_split(get_task(task), seed, n)
        for split, examples in (("test", questions), ("fewshot", shots)):
            lines = "".join(json.dumps(document(task, e)) + "\n" for e in examples)
            written.append(write_atomic(out / task / f"{split}.jsonl", lines))
    return written


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.lm_eval_data", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory to write TASK/{test,fewshot}.jsonl into")
    p.add_argument("--tasks", default=",".join(STUDY_TASKS))
    p.add_argument("-n", type=int, default=64, help="questions per task")
    p.add_argument("--seed", type=int, default=0, help="the world (as eval.accuracy --seed)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    tasks = args.tasks.split(",")
    for task in tasks:
        if task not in STUDY_TASKS:
            p.error(f"unknown task {task!r}; choose from {STUDY_TASKS}")
    if args.n <= 0:
        p.error(f"-n must be positive, got {args.n}")
    for path in write(args.out, tasks, args.n, args.seed):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
