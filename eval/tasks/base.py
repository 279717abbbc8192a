"""What every task shares: an example, the prompt templates of the paper's appendix A, and scorers.

An `Example` carries its own scoring function and prompt templates, so layouts and evaluation
treat generated tasks and loaded benchmarks alike.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

MAX_SHOTS = 2  # few-shot examples a world's evaluation uses as its affix (its first examples)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """How a benchmark frames its query (paper appendix A)."""

    cue: str  # ends the query message, e.g. "Answer with one location:"
    back: str  # infix layout: after the examples, leads back to the query

    def query(self, question: str) -> str:
        return f"{question}\n{self.cue}"

    def head(self, question: str) -> str:
        """The query header of the infix layout: the examples follow it."""
        return f"{question}\n\nExample(s):"


BABI = Prompt("Answer with one location:",
              "Let's come back to the story and question in the beginning and answer with one location.")
GSM8K = Prompt("Let's think step by step.\nAnswer:",
               "Let's come back to the question in the beginning and think step by step.\nAnswer:")
MBPP = Prompt("[BEGIN]",
              "Let's come back to the task in the beginning and write the Python code.\n"
              "Do not include any explanation, comments outside the code, markdown fences, or test cases.\n[BEGIN]")


@dataclasses.dataclass(frozen=True)
class Example:
    """One question with its reference answer (as few-shot examples show it) and how to score a reply."""

    question: str  # the query body: story + question, problem statement, ...
    answer: str  # the normalized answer (paper appendix A)
    score: Callable[[str], bool]  # generated answer text -> correct?
    prompt: Prompt


@dataclasses.dataclass(frozen=True)
class Task:
    """A seeded generator of examples."""

    name: str
    generate: Callable[[np.random.Generator, int], list[Example]]  # n examples of one world (shared facts)
    vocabulary: tuple[str, ...]  # texts that hold every word `generate` can emit (builds the tokenizer)
    needs_affix: bool = False  # answers come from the few-shot examples: pointless without them


def words(text: str) -> list[str]:
    """Lowercase words and numbers of a text, punctuation and spacing dropped."""
    return re.findall(r"[a-z0-9]+(?:'[a-z]+)?", text.lower())


def exact_match(generated: str, target: str) -> bool:
    """Same words in the same order (case, spacing and punctuation ignored)."""
    return words(generated) == words(target)


_ANSWER = re.compile(r"The answer is\s*(-?[\d,]*\.?\d+)")


def answer_number(text: str) -> float | None:
    """The number after the last "The answer is" (GSM8K's strict match), or None."""
    found = _ANSWER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def number_match(generated: str, target: float) -> bool:
    return answer_number(generated) == target


def pick(rng: np.random.Generator, options: tuple[str, ...]) -> str:
    return options[int(rng.integers(len(options)))]
