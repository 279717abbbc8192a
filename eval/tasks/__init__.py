"""Seeded tasks in the paper's spirit, loaders for the real benchmarks, and prompt layouts.

Every example of one evaluation comes from one seeded world: its first MAX_SHOTS examples are the
few-shot affix shared by all its questions (k-shot uses the first k), the rest are the questions.
"""

from __future__ import annotations

import numpy as np

from eval.tasks import arithmetic, babi, codebook
from eval.tasks.base import MAX_SHOTS, Example, Prompt, Task

TASKS: dict[str, Task] = {task.name: task for task in (babi.TASK, babi.ROUTINE_TASK, arithmetic.TASK, codebook.TASK)}
STUDY_TASKS = ("babi", "arithmetic", "codebook")  # what evaluations report by default; routine only trains
_EVAL_STREAM = 1  # training draws from other seed streams (eval/train_data.py), so questions are held out


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)}")
    return TASKS[name]


def eval_split(task: Task, seed: int, n: int) -> tuple[list[Example], list[Example]]:
    """(MAX_SHOTS few-shot examples, n questions), all from one world; the same for the same seed."""
    examples = task.generate(np.random.default_rng([seed, _EVAL_STREAM]), MAX_SHOTS + n)
    return examples[:MAX_SHOTS], examples[MAX_SHOTS:]


__all__ = ["Example", "MAX_SHOTS", "Prompt", "STUDY_TASKS", "TASKS", "Task", "eval_split", "get_task"]
