"""GSM8K-like word problems: a starting count changed by 1-3 operations, small numbers.

Answers follow GSM8K's normalized form: one equation per step, then "The answer is N". Every
number stays in 0..MAX_NUMBER so that a word-level vocabulary holds each one as a single token.
"""

from __future__ import annotations

import functools

import numpy as np

from eval.tasks.base import GSM8K, Example, Task, number_match, pick

PEOPLE = (("Tom", "He"), ("Ann", "She"), ("Ben", "He"), ("Lily", "She"), ("Sam", "He"), ("Kate", "She"))
ITEMS = ("apples", "books", "marbles", "stickers", "coins", "cookies", "pencils", "cards")
ADD = ("buys {n} more", "finds {n} more", "gets {n} more")
SUB = ("gives {n} to a friend", "loses {n}", "sells {n}")
MUL = {2: "doubles the {items}", 3: "triples the {items}"}
MAX_NUMBER = 99


def _step(rng: np.random.Generator, value: int, items: str) -> tuple[str, str, int]:
    """(sentence fragment, equation, new value) of one operation that keeps values in range."""
    kinds = ["add"] * (value < MAX_NUMBER) + ["sub"] * (value > 1) + ["mul"] * (value * 2 <= MAX_NUMBER)
    kind = pick(rng, tuple(kinds))
    if kind == "add":
        n = int(rng.integers(1, min(10, MAX_NUMBER - value) + 1))
        return pick(rng, ADD).format(n=n), f"{value} + {n} = {value + n}.", value + n
    if kind == "sub":
        n = int(rng.integers(1, min(10, value - 1) + 1))
        return pick(rng, SUB).format(n=n), f"{value} - {n} = {value - n}.", value - n
    factor = 3 if value * 3 <= MAX_NUMBER and rng.random() < 0.5 else 2
    return MUL[factor].format(items=items), f"{value} * {factor} = {value * factor}.", value * factor


def problem(rng: np.random.Generator) -> Example:
    name, pronoun = PEOPLE[int(rng.integers(len(PEOPLE)))]
    items = pick(rng, ITEMS)
    value = int(rng.integers(2, 21))
    sentences, equations = [f"{name} has {value} {items}."], []
    for _ in range(int(rng.integers(1, 4))):
        fragment, equation, value = _step(rng, value, items)
        sentences.append(f"Then {pronoun.lower()} {fragment}.")
        equations.append(equation)
    sentences.append(f"How many {items} does {name} have now?")
    answer = " ".join(equations) + f"\nThe answer is {value}"
    return Example("Question: " + " ".join(sentences), answer, functools.partial(number_match, target=value), GSM8K)


def generate(rng: np.random.Generator, n: int) -> list[Example]:
    return [problem(rng) for _ in range(n)]


TASK = Task("arithmetic", generate, (
    *(f"{name} {pronoun} {pronoun.lower()}" for name, pronoun in PEOPLE), *ITEMS,
    *(fragment.format(n=1) for fragment in ADD + SUB), *(fragment.format(items="") for fragment in MUL.values()),
    " ".join(str(i) for i in range(MAX_NUMBER + 1)),
    "Question: has . Then How many does have now ? + - * = The answer is",
))
