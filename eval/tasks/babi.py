"""bAbI qa1-style location retrieval (the source of BABILong 0k/qa1), and its training companion.

babi: a story of 2-10 moves by a few people; the question asks where one of them is, so the answer
is that person's last location: earlier moves and other people's moves are distractors.

routine: the same stories, except that every person always goes to the same place (`ROUTINE`).
A place there can be told from the name before it, so a masked place (pretraining rows) rewards
attention from a place back to its sentence's name, and the answer rewards attention from the
answer to the name asked about: each half of bAbI's retrieval with a one-step signal of its own.
bAbI's own loss rewards a half only once the other half works (docs/TRAINING.md).
"""

from __future__ import annotations

import functools

import numpy as np

from eval.tasks.base import BABI, Example, Task, exact_match, pick

NAMES = ("Mary", "John", "Daniel", "Sandra", "Emma", "Peter")
PLACES = ("bathroom", "hallway", "garden", "office", "kitchen", "bedroom", "cellar", "balcony")
VERBS = ("moved to", "went to", "journeyed to", "travelled to", "went back to")
MIN_FACTS, MAX_FACTS = 2, 10
ROUTINE = dict(zip(NAMES, ("kitchen", "garden", "office", "bathroom", "cellar", "balcony")))


def _example(facts: list[tuple[str, str, str]], who: str) -> Example:
    where = [place for name, _, place in facts if name == who][-1]
    text = " ".join(f"{name} {verb} the {place}." for name, verb, place in facts)
    return Example(f"Story:\n{text}\nQuestion: Where is {who}?", where,
                   functools.partial(exact_match, target=where), BABI)


def story(rng: np.random.Generator, routine: bool = False) -> Example:
    facts = []
    for _ in range(int(rng.integers(MIN_FACTS, MAX_FACTS + 1))):  # name, verb, place: the draw order of a seed
        name, verb = pick(rng, NAMES), pick(rng, VERBS)
        facts.append((name, verb, ROUTINE[name] if routine else pick(rng, PLACES)))
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


def generate_routine(rng: np.random.Generator, n: int) -> list[Example]:
    return [story(rng, routine=True) for _ in range(n)]


TASK = Task("babi", generate, (*NAMES, *PLACES, *VERBS, "Story: the . Question: Where is ?"))
ROUTINE_TASK = Task("routine", generate_routine, TASK.vocabulary)
