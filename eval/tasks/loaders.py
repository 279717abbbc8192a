"""Loaders for the real GSM8K, MBPP and BABILong files, for users who have them locally.

Each returns `Example`s with the paper's prompt templates and normalized answers (appendix A).
Files are JSON Lines (one object per line) or JSON (a list of objects); a missing file or a record
without a required field is reported with the file, the record number and the field.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from eval.tasks.base import BABI, GSM8K, MBPP, Example, exact_match, number_match


def read_records(path: str | Path) -> list[dict]:
    """The records of a JSON Lines (.jsonl) or JSON (a list of objects) file, checked."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            records = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid {'JSON Lines' if path.suffix == '.jsonl' else 'JSON'}: {e}") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{path} must hold a list of JSON objects")
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def _field(record: dict, key: str, path: str | Path, n: int, kind: type = str):
    value = record.get(key)
    if not isinstance(value, kind):
        raise ValueError(f"{path}: record {n} needs a {kind.__name__} field {key!r}, got {value!r}")
    return value


def load_gsm8k(path: str | Path) -> list[Example]:
    """GSM8K: {question, answer}; the answer's "#### N" becomes "The answer is N", calculator marks dropped."""
    out = []
    for n, rec in enumerate(read_records(path), 1):
        question, answer = _field(rec, "question", path, n), _field(rec, "answer", path, n)
        if "####" not in answer:
            raise ValueError(f"{path}: record {n}: answer has no '#### N' final answer")
        reasoning, final = answer.rsplit("####", 1)
        final = final.strip().replace(",", "")
        try:
            target = float(final)
        except ValueError:
            raise ValueError(f"{path}: record {n}: final answer {final!r} is not a number") from None
        reasoning = re.sub(r"<<[^>]*>>", "", reasoning).strip()
        out.append(Example(f"Question: {question}", f"{reasoning}\nThe answer is {final}",
                           functools.partial(number_match, target=target), GSM8K))
    return out


def passes_tests(generated: str, tests: tuple[str, ...], timeout: float = 10.0) -> bool:
    """MBPP scoring: the generated code (up to [DONE]) and the asserts run in a fresh interpreter."""
    program = generated.split("[DONE]")[0] + "\n" + "\n".join(tests) + "\n"
    try:
        run = subprocess.run([sys.executable, "-I", "-c", program], capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return run.returncode == 0


def load_mbpp(path: str | Path) -> list[Example]:
    """MBPP: {text, code, test_list[, test_setup_code]}; answers are "{code}\\n[DONE]"."""
    out = []
    for n, rec in enumerate(read_records(path), 1):
        text, code = _field(rec, "text", path, n), _field(rec, "code", path, n)
        tests = _field(rec, "test_list", path, n, list)
        if not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError(f"{path}: record {n}: test_list must be a non-empty list of strings")
        setup = rec.get("test_setup_code") or ""
        question = (f"You are an expert Python programmer, and here is your task: {text} "
                    f"Your code should pass these tests:\n\n" + "\n".join(tests))
        out.append(Example(question, f"{code}\n[DONE]",
                           functools.partial(passes_tests, tests=(setup, *tests)), MBPP))
    return out


def load_babilong(path: str | Path) -> list[Example]:
    """BABILong (e.g. 0k/qa1): {input (the story), question, target}; exact match on the target."""
    out = []
    for n, rec in enumerate(read_records(path), 1):
        story, question = _field(rec, "input", path, n), _field(rec, "question", path, n)
        target = _field(rec, "target", path, n).strip()
        out.append(Example(f"Story:\n{story.strip()}\nQuestion: {question.strip()}", target,
                           functools.partial(exact_match, target=target), BABI))
    return out


LOADERS: dict[str, Callable[[str | Path], list[Example]]] = {
    "gsm8k": load_gsm8k, "mbpp": load_mbpp, "babilong": load_babilong,
}
