"""bAbI qa1-style location retrieval (the source of BABILong 0k/qa1).

A story of 2-10 moves by a few people; the question asks where one of them is, so the answer is
that person's last location: earlier moves and other people's moves are distractors.
"""

from __future__ import annotations

import functools

import numpy as np

from eval.tasks.base import BABI, Example, Task, exact_match, pick

NAMES = ("Mary", "John", "Daniel", "Sandra", "Emma", "Peter")
PLACES = ("bathroom", "hallway", "garden", "office", "kitchen", "bedroom", "cellar", "balcony")
VERBS = ("moved to", "went to", "journeyed to", "travelled to", "went back to")
MIN_FACTS, MAX_FACTS = 2, 10


def _example(facts: list[tuple[str, str, str]], who: str) -> Example:
    where = [place for name, _, place in facts if name == who][-1]
    text = " ".join(f"{name} {verb} the {place}." for name, verb, place in facts)
    return Example(f"Story:\n{text}\nQuestion: Where is {who}?", where,
                   functools.partial(exact_match, target=where), BABI)


def story(rng: np.random.Generator) -> Example:
    facts = [(pick(rng, NAMES), pick(rng, VERBS), pick(rng, PLACES))
             for _ in range(int(rng.integers(MIN_FACTS, MAX_FACTS + 1)))]
    return _example(facts, facts[int(rng.integers(len(facts)))][0])


def binding_stories(rng: np.random.Generator, n: int, facts: int, ask_first: bool) -> list[Example]:
    """Stories of `facts` moves by different people to different places, asking about the first
    or the last person: answering the last-mentioned place solves only the second, so the pair
    shows whether a model retrieves by name or by position."""
    examples = []
    for _ in range(n):
        names, places = rng.choice(len(NAMES), facts, replace=False), rng.choice(len(PLACES), facts, replace=False)
        story_facts = [(NAMES[i], pick(rng, VERBS), PLACES[j]) for i, j in zip(names, places)]
        examples.append(_example(story_facts, story_facts[0 if ask_first else -1][0]))
    return examples


def generate(rng: np.random.Generator, n: int) -> list[Example]:
    return [story(rng) for _ in range(n)]


TASK = Task("babi", generate, (*NAMES, *PLACES, *VERBS, "Story: the . Question: Where is ?"))
