"""An affix-dependent task: decode made-up code words with a codebook that only the examples show.

Every world (one seed) draws a fresh codebook: CODE_SIZE made-up words, each meaning a colour.
Each example asks to decode all of them in a random order, so one few-shot example reveals the
whole codebook, while without examples the answer can only be guessed (1 in 12 per word).
"""

from __future__ import annotations

import functools

import numpy as np

from eval.tasks.base import Example, Prompt, Task, exact_match

CODES = ("dax", "wug", "fep", "blick", "zib", "toma", "lorp", "mib", "nork", "quib", "tupa", "gazz")
MEANINGS = ("red", "blue", "green", "yellow", "black", "white", "pink", "brown", "orange", "purple", "gray", "gold")
CODE_SIZE = 4
CODEBOOK = Prompt("Answer with the meaning of each code word:",
                  "Let's come back to the code words in the beginning and answer with their meanings.")


def generate(rng: np.random.Generator, n: int) -> list[Example]:
    codes = [CODES[i] for i in rng.choice(len(CODES), CODE_SIZE, replace=False)]
    book = dict(zip(codes, (MEANINGS[i] for i in rng.choice(len(MEANINGS), CODE_SIZE, replace=False))))
    examples = []
    for _ in range(n):
        order = [codes[i] for i in rng.permutation(CODE_SIZE)]
        answer = " ".join(f"{code} means {book[code]}." for code in order)
        examples.append(Example("Decode: " + " ".join(order), answer,
                                functools.partial(exact_match, target=answer), CODEBOOK))
    return examples


TASK = Task("codebook", generate, (*CODES, *MEANINGS, "Decode: means ."), needs_affix=True)
