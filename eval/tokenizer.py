"""A word-level tokenizer over the task vocabulary, saved as HF files (`PreTrainedTokenizerFast`).

Every word, number and punctuation mark that the tasks and layouts can emit is one token, so answers
are short and numbers are single tokens. Ids follow sorted text, not corpus frequencies: the same
tasks always give the same tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from eval.tasks import MAX_SHOTS, TASKS
from eval.tasks.layouts import ASSISTANT, END, PLACEMENTS, USER, affix_text, request_texts

MASK, PAD, UNK = "<|mask|>", "<|pad|>", "<|unk|>"
SPECIALS = (PAD, UNK, MASK, END, USER, ASSISTANT)  # the mask id must be > 0 (LLaDA config reader)
# Chat turns exactly as the layouts write them, so `--prompt` in the generate CLI matches training.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}" + USER + " {{ m['content'] }}\n"
    "{% else %}" + ASSISTANT + " {{ m['content'] }}" + END + "\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Words (with an apostrophe suffix: "Let's"), numbers and single punctuation marks."""
    return pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                    pre_tokenizers.Split(Regex(r"\w+(?:'\w+)?|[^\w\s]"), "isolated")])


def corpus() -> list[str]:
    """Texts that hold every word: each task's vocabulary and one example of it in every layout."""
    texts = [text for task in TASKS.values() for text in task.vocabulary]
    for task in TASKS.values():
        *shots, example = task.generate(np.random.default_rng(0), MAX_SHOTS + 1)
        for placement in PLACEMENTS:
            texts += [affix_text(shots, placement), *request_texts(example, placement), example.answer]
    return texts


def build_tokenizer() -> Tokenizer:
    pre = _pre_tokenizer()
    pieces = set()
    for text in corpus():
        for special in SPECIALS:
            text = text.replace(special, " ")
        pieces.update(piece for piece, _ in pre.pre_tokenize_str(text))
    vocab = {token: i for i, token in enumerate((*SPECIALS, *sorted(pieces)))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words, no space before . , ?
    tokenizer.add_special_tokens(list(SPECIALS))
    return tokenizer


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The ids a model config needs: mask, eos (ends answers, pads the generation) and pad."""
    return {"mask_token_id": tokenizer.token_to_id(MASK), "eos_token_id": tokenizer.token_to_id(END),
            "pad_token_id": tokenizer.token_to_id(PAD)}


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path) -> None:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json, loadable by PreTrainedTokenizerFast."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    special = {"mask_token": MASK, "eos_token": END, "pad_token": PAD, "unk_token": UNK,
               "additional_special_tokens": [USER, ASSISTANT]}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "chat_template": CHAT_TEMPLATE,
              "clean_up_tokenization_spaces": False, "model_max_length": 512}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
