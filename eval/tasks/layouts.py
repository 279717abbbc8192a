"""Prompt layouts of the paper's appendix A, as token ids for `acache_jax.decoding.layout.Request`.

prefix: [Ex][Qry][Mask]; infix: [Qry_head][Ex][Ans][Mask]; suffix: [Qry][Mask][Ex]; none: [Qry][Mask].
The affix Ex holds the few-shot examples: chat turns (a user query, then the assistant's answer)
for prefix and suffix, a plaintext block of "Example i:" entries for infix. It is built once per
task world and shared by every request. The chat markers are special tokens of eval/tokenizer.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from acache_jax.decoding.layout import Request
from eval.tasks.base import Example

USER, ASSISTANT, END = "<|user|>", "<|assistant|>", "<|eos|>"  # END closes an answer and pads the generation
Placement = Literal["none", "prefix", "infix", "suffix"]
PLACEMENTS: tuple[Placement, ...] = ("none", "prefix", "infix", "suffix")
GEN_LENGTH = 32  # generation region of training and evaluation: the longest answer plus END

Encode = Callable[[str], list[int]]


def encoder(tokenizer: Any) -> Encode:
    """Plain-span encoding (no BOS, no template) with an HF tokenizer or a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return lambda text: tokenizer.encode(text, add_special_tokens=False).ids
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def _check(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose from {PLACEMENTS}")


def _query(example: Example) -> str:
    return example.prompt.query(example.question)


def affix_text(shots: Sequence[Example], placement: Placement) -> str:
    _check(placement)
    if placement == "infix":
        entries = (f"Example {i}:\n{_query(shot)}\n{shot.answer}" for i, shot in enumerate(shots, 1))
        return "\n\n".join(entries) + "\n\n"
    return "".join(f"{USER} {_query(shot)}\n{ASSISTANT} {shot.answer}{END}\n" for shot in shots)


def request_texts(example: Example, placement: Placement) -> tuple[str, str]:
    """(prompt, tail): the request's own text before and (infix only) after the affix."""
    _check(placement)
    if placement == "infix":
        return f"{USER} {example.prompt.head(example.question)}\n", f"{example.prompt.back}\n{ASSISTANT}"
    return f"{USER} {_query(example)}\n{ASSISTANT}", ""


def document_fields(example: Example) -> dict[str, str]:
    """An example's texts as the fields of an lm-eval document, from which acache_jax.lm_eval's affix
    mode lays out a request (query; infix: query_head, answer_prompt) and a few-shot example (query,
    shot_answer) exactly as `affix_text` and `request_texts` do (the chat markers from the template)."""
    return {"query": _query(example), "query_head": example.prompt.head(example.question),
            "answer_prompt": example.prompt.back, "shot_answer": example.answer}


def affix_ids(encode: Encode, shots: Sequence[Example], placement: Placement) -> list[int] | None:
    """The shared affix of these few-shot examples; None for the no-affix layout."""
    _check(placement)
    if placement == "none":
        return None
    if not shots:
        raise ValueError(f"a {placement} affix needs at least one few-shot example")
    return encode(affix_text(shots, placement))


def request(encode: Encode, example: Example, placement: Placement, seed: int = 0) -> Request:
    prompt, tail = request_texts(example, placement)
    return Request(encode(prompt), encode(tail) if tail else (), None if placement == "none" else placement, seed)


def target_ids(encode: Encode, example: Example, eos_id: int, gen_length: int = GEN_LENGTH) -> list[int]:
    """What the generation region should hold: the answer, then END up to gen_length (as LLaDA's SFT pads)."""
    answer = encode(example.answer)
    if len(answer) >= gen_length:
        raise ValueError(f"answer of {len(answer)} tokens does not fit a generation of {gen_length} with its end "
                         f"token: {example.answer[:60]!r}")
    return answer + [eos_id] * (gen_length - len(answer))
