"""An affix-dependent task: decode a made-up code word with a codebook that only the examples show.

Every world (one seed) draws a fresh codebook: CODE_SIZE made-up words, each meaning a colour. A
world's first examples (the shots of any layout, up to MAX_SHOTS) decode the whole codebook in a
random order; the questions after them ask for one word each ("Decode: wug" -> "wug means blue."),
so one few-shot example holds every answer, while without examples the answer is a guess (1 in 12).
Finding the word in the examples is the look-up bAbI needs (the person in the question, then the
place after them in the story). Questions that decode the whole codebook were not learned: the
models copied the colours in the example's order instead, right 1 time in CODE_SIZE (docs/TRAINING.md).
"""

from __future__ import annotations

import functools

import numpy as np

from eval.tasks.base import MAX_SHOTS, Example, Prompt, Task, exact_match

CODES = ("dax", "wug", "fep", "blick", "zib", "toma", "lorp", "mib", "nork", "quib", "tupa", "gazz")
MEANINGS = ("red", "blue", "green", "yellow", "black", "white", "pink", "brown", "orange", "purple", "gray", "gold")
CODE_SIZE = 4
CODEBOOK = Prompt("Answer with the meaning of each code word:",
                  "Let's come back to the code words in the beginning and answer with their meanings.")


def _example(words: list[str], book: dict[str, str]) -> Example:
    answer = " ".join(f"{word} means {book[word]}." for word in words)
    return Example("Decode: " + " ".join(words), answer, functools.partial(exact_match, target=answer), CODEBOOK)


def generate(rng: np.random.Generator, n: int) -> list[Example]:
    """n examples of one world: min(n - 1, MAX_SHOTS) whole-codebook decodings, then one-word questions."""
    codes = [CODES[i] for i in rng.choice(len(CODES), CODE_SIZE, replace=False)]
    book = dict(zip(codes, (MEANINGS[i] for i in rng.choice(len(MEANINGS), CODE_SIZE, replace=False))))
    shots = min(n - 1, MAX_SHOTS)
    return ([_example([codes[i] for i in rng.permutation(CODE_SIZE)], book) for _ in range(shots)]
            + [_example([codes[int(rng.integers(CODE_SIZE))]], book) for _ in range(n - shots)])


TASK = Task("codebook", generate, (*CODES, *MEANINGS, "Decode: means ."), needs_affix=True)
