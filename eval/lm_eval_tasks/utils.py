"""Data and scoring of the lm-eval tasks in this directory (`--include_path eval/lm_eval_tasks`).

Every task reads local files under $ACACHE_LM_EVAL_DATA (default: out/lm_eval_data, relative to
the working directory):
- babi/, arithmetic/, codebook/: test.jsonl and fewshot.jsonl, written by `python -m eval.lm_eval_data`;
- gsm8k/test.jsonl and gsm8k/train.jsonl (the few-shot pool): GSM8K as published, {question, answer};
- mbpp/mbpp.jsonl: MBPP as published, {task_id, text, code, test_list, test_setup_code}; the test
  split is task ids 11-510, the few-shot pool the prompt split, task ids 1-10;
- babilong/0k/qa1.jsonl (or .json): BABILong-0k/qa1, {input, question, target}; the few-shot
  pool is the same file, as in the paper's evaluation.
Published records are read by eval.tasks.loaders (the paper's templates and normalized answers) and
keep their own fields; every document gains the layout fields (query, query_head, answer_prompt,
shot_answer) that acache_jax.lm_eval's affix mode builds requests from, and `target`. Scores are
the project's (eval.tasks): exact match on words, GSM8K's "The answer is N", MBPP's tests run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import datasets

from eval.tasks.base import answer_number, exact_match, number_match
from eval.tasks.layouts import document_fields
from eval.tasks.loaders import load_babilong, load_gsm8k, load_mbpp, passes_tests, read_records

DATA_ENV = "ACACHE_LM_EVAL_DATA"
DEFAULT_DATA = Path("out/lm_eval_data")


def data_dir() -> Path:
    return Path(os.environ.get(DATA_ENV) or DEFAULT_DATA)


def _file(*parts: str) -> Path:
    """A data file under the data directory, or an error that says where it was looked for."""
    for suffix in (".jsonl", ".json"):
        path = data_dir().joinpath(*parts).with_suffix(suffix)
        if path.is_file():
            return path
    hint = ("write it with `python -m eval.lm_eval_data --out DIR`" if parts[0] in ("babi", "arithmetic", "codebook")
            else "put the published file there")
    raise FileNotFoundError(f"no {Path(*parts)}.jsonl under {data_dir()} (set {DATA_ENV}=DIR; {hint})")


def _splits(**splits: list[dict[str, Any]]) -> datasets.DatasetDict:
    return datasets.DatasetDict({name: datasets.Dataset.from_list(docs) for name, docs in splits.items()})


def generated(source: str, **_metadata: Any) -> datasets.DatasetDict:
    """A seeded task's questions (test) and its world's few-shot examples (fewshot)."""
    return _splits(test=read_records(_file(source, "test")), fewshot=read_records(_file(source, "fewshot")))


def _with_layout(path: Path, loader, target) -> list[dict[str, Any]]:
    """The file's records, each with the layout fields of its example and its scoring target."""
    return [record | document_fields(example) | {"target": target(example, record)}
            for record, example in zip(read_records(path), loader(path), strict=True)]


def gsm8k(**_metadata: Any) -> datasets.DatasetDict:
    docs = lambda split: _with_layout(_file("gsm8k", split), load_gsm8k, lambda ex, _: answer_number(ex.answer))
    return _splits(test=docs("test"), train=docs("train"))


def mbpp(**_metadata: Any) -> datasets.DatasetDict:
    docs = _with_layout(_file("mbpp", "mbpp"), load_mbpp, lambda ex, rec: rec["code"])
    return _splits(test=[d for d in docs if 11 <= d["task_id"] <= 510],
                   prompt=[d for d in docs if 1 <= d["task_id"] <= 10])


def babilong(**_metadata: Any) -> datasets.DatasetDict:
    docs = _with_layout(_file("babilong", "0k", "qa1"), load_babilong, lambda ex, _: ex.answer)
    return _splits(test=docs, fewshot=docs)


def score_exact(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return {"acc": float(exact_match(results[0], doc["target"]))}


def score_number(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return {"acc": float(number_match(results[0], doc["target"]))}


def score_mbpp(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    tests = (doc.get("test_setup_code") or "", *doc["test_list"])
    return {"acc": float(passes_tests(results[0], tests))}
