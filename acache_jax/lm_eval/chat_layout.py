"""The paper's affix layouts (appendix A) through a model's chat template, as token ids.

A few-shot example is a (query, answer) pair of texts; a request brings its query and, for infix,
its query header and answer prompt. Every prompt is a conversation of the model's chat template:
- prefix `[Ex][Qry][Mask]`: the affix is the examples' turns (user query, assistant answer); the
  request is the query's user turn and the generation prompt as they follow those turns;
- infix `[Qry_head][Ex][Ans][Mask]`: one user turn `{head}\\n{Ex}{answer prompt}` whose affix is the
  plaintext block "Example i:\\n{query}\\n{answer}", examples separated and followed by a blank line;
- suffix `[Qry][Mask][Ex]`: the request is the query's turn and the generation prompt; the affix is
  the examples' turns as they follow a user turn, and sits after the generation.
Texts are cut out of one rendering, so template markers (BOS, role headers) land where a whole
conversation has them, then tokenized as plain spans that join exactly. For the shipped models
this gives exactly eval.tasks.layouts' token ids.
"""

from __future__ import annotations

import dataclasses

from acache_jax.decoding.layout import AFFIX_POSITIONS, Request
from acache_jax.network.config import InputError
from acache_jax.network.model import Model

_HOLE = "\ue000affix\ue000"  # where the infix affix goes while the template renders the turn around it


@dataclasses.dataclass(frozen=True)
class ChatAffix:
    """Few-shot examples serialized as one placement's shared affix."""

    placement: str
    text: str
    turns: tuple[tuple[str, str], ...]  # (role, content) of the examples' chat turns
    ids: list[int]


def _render(model: Model, turns, generation: bool) -> str:
    messages = [{"role": role, "content": content} for role, content in turns]
    return model.tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)


def _span(model: Model, text: str) -> list[int]:
    return model.encode(text, chat=False, special_tokens=False)


def _after(model: Model, first, turns) -> str:
    """The rendering of `turns` when they follow `first`."""
    head, both = _render(model, first, False), _render(model, [*first, *turns], False)
    if not both.startswith(head):
        raise InputError("the chat template renders a turn differently once others follow it, so the few-shot "
                         "examples cannot be cut out of the conversation as an affix")
    return both[len(head):]


def check(model: Model, placement: str) -> None:
    if placement not in AFFIX_POSITIONS:
        raise InputError(f"placement must be one of {AFFIX_POSITIONS}, got {placement!r}")
    if model.tokenizer is None or not getattr(model.tokenizer, "chat_template", None):
        raise InputError("the paper's layouts serialize prompts with the model's chat template; this model's "
                         "tokenizer has none")


def affix(model: Model, placement: str, shots: list[tuple[str, str]]) -> ChatAffix:
    """The shared affix of these (query, answer) examples in this placement."""
    check(model, placement)
    if not shots:
        raise InputError("an affix needs at least one few-shot example")
    turns = tuple((role, text) for query, answer in shots for role, text in (("user", query), ("assistant", answer)))
    if placement == "infix":
        text = "\n\n".join(f"Example {i}:\n{q}\n{a}" for i, (q, a) in enumerate(shots, 1)) + "\n\n"
    elif placement == "prefix":
        text = _render(model, turns, False)
    else:
        text = _after(model, [("user", "Q")], turns)
    return ChatAffix(placement, text, turns, _span(model, text))


def request(model: Model, shared: ChatAffix, query: str, head: str | None = None, answer_prompt: str | None = None,
            seed: int = 0) -> Request:
    """A request around the shared affix: its query (infix: its query header and answer prompt)."""
    user = [("user", query)]
    if shared.placement == "infix":
        if head is None or answer_prompt is None:
            raise InputError("an infix request needs its query header and answer prompt")
        before, after = _render(model, [("user", f"{head}\n{_HOLE}{answer_prompt}")], True).split(_HOLE)
        return Request(_span(model, before), _span(model, after), "infix", seed)
    own = _render(model, user, True)
    if shared.placement == "prefix":
        full = _render(model, [*shared.turns, *user], True)
        if not full.startswith(shared.text):
            raise InputError("the chat template renders the few-shot turns differently once the query follows them, "
                             "so they cannot be cut out as a prefix")
        own = full[len(shared.text):]
    elif _after(model, user, shared.turns) != shared.text:
        raise InputError("the chat template renders the few-shot turns after this query differently than after "
                         "others, so the suffix affix would not be shared")
    return Request(_span(model, own), (), shared.placement, seed)
