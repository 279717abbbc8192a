"""Load the tokenizer of an HF LLaDA or Dream snapshot (or of our converted checkpoints) without remote code.

LLaDA snapshots ship `tokenizer.json`, which transformers loads as a fast tokenizer. Dream snapshots ship
only a slow byte-level BPE tokenizer as remote code (`tokenization_dream.py` with `vocab.json` and
`merges.txt`, no `tokenizer.json`), which `AutoTokenizer` refuses to load without
`trust_remote_code=True`. Its algorithm is Qwen2's (same pre-tokenization regex, NFC, byte-level BPE), so
for that layout we build transformers' tokenizers-backed `Qwen2Tokenizer` from the vocabulary files and
add the added and special tokens and the chat template from `tokenizer_config.json`, checking every
declared token id. No file of the snapshot is imported or executed.

transformers is imported here with its advisory warnings off, so that a machine without PyTorch does not
get the "PyTorch was not found" line on stderr; other transformers messages are left alone.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

from acache_jax.network.config import ConfigError, InputError, read_json

# What a converter must copy so that the converted directory loads the same way. The snapshot's
# remote code (`tokenization_*.py`) is deliberately absent: it is never run. `tokenizer.model` and
# `chat_template.json` are not read by this loader but are carried for other readers of the directory.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)

# `tokenizer_class` values whose vocab.json + merges.txt layout is Qwen2's byte-level BPE.
QWEN2_STYLE_CLASSES = ("DreamTokenizer", "Qwen2Tokenizer", "Qwen2TokenizerFast")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Settings of tokenizer_config.json passed on to the built tokenizer; the rest (auto_map, tokenizer_class,
# add_prefix_space, add_bos_token, ...) describe the remote class and are dropped.
PASSED_SETTINGS = ("model_max_length", "clean_up_tokenization_spaces", "split_special_tokens", "padding_side",
                   "truncation_side", "model_input_names", "errors")
ADDED_TOKEN_FIELDS = ("single_word", "lstrip", "rstrip", "normalized", "special")


class TokenizerError(InputError):
    """A tokenizer file that is missing, unreadable or inconsistent; the message names the file."""


def import_transformers() -> Any:
    """`import transformers` without its import-time advisory ("PyTorch was not found ...").

    The advisory is a `logger.warning_advice`, which transformers skips while the environment variable
    TRANSFORMERS_NO_ADVISORY_WARNINGS is set; it is set for the import only and then restored.
    """
    if "transformers" in sys.modules:
        return sys.modules["transformers"]
    key = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    previous = os.environ.get(key)
    os.environ[key] = "1"
    try:
        import transformers
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous
    return transformers


def load_tokenizer(path: str | Path) -> Any | None:
    """The tokenizer shipped in directory `path`, or None when it ships none.

    tokenizer.json present: transformers' fast tokenizer from it (as `AutoTokenizer` loads LLaDA).
    Otherwise vocab.json + merges.txt: a Qwen2-style byte-level BPE (the Dream layout).
    Raises TokenizerError, naming the file, for a corrupt or inconsistent tokenizer file.
    """
    path = Path(path)
    if not ships_tokenizer(path):
        return None
    tokenizer = _load_fast(path) if (path / "tokenizer.json").is_file() else _load_byte_level_bpe(path)
    _drop_unusable_chat_template(tokenizer)
    return tokenizer


def ships_tokenizer(path: str | Path) -> bool:
    """Whether directory `path` holds the files `load_tokenizer` builds a tokenizer from."""
    return any((Path(path) / name).is_file() for name in ("tokenizer.json", "vocab.json", "merges.txt"))


class LazyTokenizer:
    """The tokenizer of a model directory, loaded (`load_tokenizer`) at its first use: every
    attribute and call goes to the tokenizer, the first loading it on the calling thread (and
    raising its TokenizerError). Loading it on a thread beside the weights put importing
    transformers (seconds of Python) on `acache_jax.load`'s critical path: in an 8B load on an H200
    that thread took 6.9 s against 3.8 s for the weights (docs/BENCHMARKS.md, fifth real-scale run).
    Loading it on a thread after `load` returned raced the caller's own imports (`datasets` read a
    half-imported transformers module). So a run given token ids loads it only for the answer's
    text (the command line, while it decodes: `load_beside`), and a run given text where it first
    tokenizes."""

    def __init__(self, path: str | Path):
        self._path = Path(path)
        self._lock = threading.Lock()
        self._tokenizer: Any = None

    def loaded(self) -> Any:
        """The tokenizer, loaded by the first call."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self._path)
            return self._tokenizer

    def load_beside(self) -> None:
        """Start loading on a thread of its own; a first use then waits for it. For a caller that
        knows nothing else imports meanwhile (the command line while it decodes: the answer's text
        needs the tokenizer, and importing transformers is seconds of Python that would otherwise
        come after the decode). An error there is left to the first use, which raises it."""
        def run() -> None:
            try:
                self.loaded()
            except Exception:  # noqa: BLE001 - the first use loads again and raises it
                pass
        if self._tokenizer is None:
            threading.Thread(target=run, name="load-tokenizer", daemon=True).start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loaded(), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.loaded()(*args, **kwargs)

    def __len__(self) -> int:  # special methods are looked up on the class, not through __getattr__
        return len(self.loaded())


def loaded_tokenizer(tokenizer: Any) -> Any:
    """`tokenizer` itself, or a LazyTokenizer's, loaded now: where a load error must surface now
    (a server checks its model's tokenizer before it listens)."""
    return tokenizer.loaded() if isinstance(tokenizer, LazyTokenizer) else tokenizer


def _drop_unusable_chat_template(tokenizer: Any) -> None:
    """Forget a chat template whose turn markers (`<|...|>` literals) are not tokens of this vocabulary:
    applied, it would spell each marker out as text. LLaDA-8B-Base ships Instruct's template without
    Instruct's marker tokens, and its authors prompt it with plain text; so do we."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return
    vocab = tokenizer.get_vocab()
    if any(marker not in vocab for marker in set(re.findall(r"<\|[^|<>\s]+\|>", template))):
        tokenizer.chat_template = None


def _read_json(file: Path) -> dict:
    """A JSON object from `file`, or a TokenizerError naming it."""
    try:
        value = read_json(file)
    except ConfigError as e:
        raise TokenizerError(str(e)) from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def _read_text(file: Path) -> str:
    """The UTF-8 text of `file`, or a TokenizerError naming it."""
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{file}: cannot be read: {e}") from e


def _load_fast(path: Path) -> Any:
    """transformers' fast tokenizer from tokenizer.json, tokenizer_config.json and chat_template.jinja."""
    transformers = import_transformers()
    try:
        return transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    except Exception as e:
        raise _culprit(path, e) from e


def _culprit(path: Path, error: Exception) -> TokenizerError:
    """After a failed load, the error naming the file that does not parse (checked only then: it costs a reread)."""
    from tokenizers import Tokenizer

    for name in ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
        if (path / name).is_file():
            try:
                _read_json(path / name)
            except TokenizerError as bad:
                return bad
    if (path / "chat_template.jinja").is_file():
        try:
            _read_text(path / "chat_template.jinja")
        except TokenizerError as bad:
            return bad
    try:
        Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as bad:
        return TokenizerError(f"{path / 'tokenizer.json'}: not a valid tokenizers file: {bad}")
    return TokenizerError(f"{path}: the tokenizer files do not load: {error}")


def _token_content(value: Any, file: Path, key: str) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json write it: a string or a dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{file}: {key} must be a string or an object with a content string, got {value!r}")


def _special_tokens(path: Path, config: dict) -> dict[str, Any]:
    """bos/eos/.../mask and additional_special_tokens: tokenizer_config.json's, else special_tokens_map.json's."""
    sources: list[tuple[Path, dict]] = [(path / "tokenizer_config.json", config)]
    if (path / "special_tokens_map.json").is_file():
        sources.append((path / "special_tokens_map.json", _read_json(path / "special_tokens_map.json")))
    specials: dict[str, Any] = {}
    for file, values in reversed(sources):  # tokenizer_config.json last, so it wins
        for key in SPECIAL_TOKEN_KEYS:
            if key in values:
                specials[key] = _token_content(values[key], file, key)
        extra = values.get("additional_special_tokens", values.get("extra_special_tokens"))
        if extra is not None:
            if not isinstance(extra, list):
                raise TokenizerError(f"{file}: additional_special_tokens must be a list, got {extra!r}")
            specials["additional_special_tokens"] = [
                _token_content(t, file, "additional_special_tokens") for t in extra]
    return specials


def _declared_added_tokens(path: Path, config: dict, specials: dict[str, Any]) -> dict[int, tuple[Any, Path]]:
    """id -> (AddedToken, the file declaring it), from tokenizer_config.json and added_tokens.json."""
    from tokenizers import AddedToken

    config_file = path / "tokenizer_config.json"
    declared: dict[int, tuple[Any, Path]] = {}
    by_content: dict[str, int] = {}
    entries = config.get("added_tokens_decoder") or {}
    if not isinstance(entries, dict):
        raise TokenizerError(f"{config_file}: added_tokens_decoder must be an object of id -> token")
    for key, entry in entries.items():
        try:
            token_id = int(key)
        except ValueError:
            raise TokenizerError(f"{config_file}: added_tokens_decoder key {key!r} is not an integer id") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise TokenizerError(f"{config_file}: added token {token_id} has no content string: {entry!r}")
        if entry["content"] in by_content:
            raise TokenizerError(f"{config_file}: added token {entry['content']!r} is declared twice "
                                 f"(ids {by_content[entry['content']]} and {token_id})")
        fields = {k: bool(entry[k]) for k in ADDED_TOKEN_FIELDS if k in entry}
        declared[token_id] = (AddedToken(entry["content"], **fields), config_file)
        by_content[entry["content"]] = token_id

    added_file = path / "added_tokens.json"
    if added_file.is_file():
        named = {v for k, v in specials.items() if k in SPECIAL_TOKEN_KEYS and v is not None}
        named.update(specials.get("additional_special_tokens") or [])
        for content, token_id in _read_json(added_file).items():
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise TokenizerError(f"{added_file}: the id of {content!r} is not an integer: {token_id!r}")
            if content in by_content and by_content[content] != token_id:
                raise TokenizerError(f"{added_file}: {content!r} has id {token_id}, but {config_file.name} "
                                     f"gives it id {by_content[content]}")
            if token_id in declared and str(declared[token_id][0]) != content:
                raise TokenizerError(f"{added_file}: id {token_id} is {content!r}, but {config_file.name} "
                                     f"gives that id to {str(declared[token_id][0])!r}")
            if content not in by_content:
                special = content in named
                declared[token_id] = (AddedToken(content, special=special, normalized=not special), added_file)
                by_content[content] = token_id
    return declared


def _read_vocab(file: Path) -> dict[str, int]:
    vocab = _read_json(file)
    ids = set()
    for token, token_id in vocab.items():
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise TokenizerError(f"{file}: the id of {token!r} is not a non-negative integer: {token_id!r}")
        if token_id in ids:
            raise TokenizerError(f"{file}: id {token_id} is given to more than one token (one is {token!r})")
        ids.add(token_id)
    return vocab


def _read_merges(file: Path, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """merges.txt: an optional `#version` first line, then one `left right` pair a line."""
    merges = []
    for number, line in enumerate(_read_text(file).splitlines(), start=1):
        line = line.strip()
        if not line or (number == 1 and line.startswith("#version")):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerError(f"{file}: line {number} is not a pair of tokens: {line!r}")
        left, right = parts
        for piece in (left, right, left + right):
            if piece not in vocab:
                raise TokenizerError(f"{file}: line {number} uses {piece!r}, which is not in vocab.json")
        merges.append((left, right))
    return merges


def _load_byte_level_bpe(path: Path) -> Any:
    """The Dream layout: Qwen2's byte-level BPE from vocab.json + merges.txt, tokens and template added."""
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        if not (path / name).is_file():
            raise TokenizerError(f"{path / name}: missing (a tokenizer without tokenizer.json needs vocab.json, "
                                 "merges.txt and tokenizer_config.json)")
    config_file = path / "tokenizer_config.json"
    config = _read_json(config_file)
    tokenizer_class = config.get("tokenizer_class")
    if tokenizer_class not in QWEN2_STYLE_CLASSES:
        raise TokenizerError(f"{config_file}: tokenizer_class {tokenizer_class!r} is not a Qwen2-style byte-level "
                             f"BPE ({', '.join(QWEN2_STYLE_CLASSES)}); without tokenizer.json only those load")
    vocab = _read_vocab(path / "vocab.json")
    merges = _read_merges(path / "merges.txt", vocab)
    specials = _special_tokens(path, config)
    declared = _declared_added_tokens(path, config, specials)
    chat_template = config.get("chat_template")
    if (path / "chat_template.jinja").is_file():  # as in transformers, the file wins over the config entry
        chat_template = _read_text(path / "chat_template.jinja")

    settings = {k: config[k] for k in PASSED_SETTINGS if k in config}
    if chat_template is not None:
        settings["chat_template"] = chat_template
    # Qwen2Tokenizer defaults unk/eos/pad to <|endoftext|>; the config's values, None included, replace them.
    settings.update(specials)
    transformers = import_transformers()
    try:
        # add_prefix_space=False: the slow Dream tokenizer ignores that setting. No add_bos_token either:
        # the slow tokenizer never adds bos/eos when encoding.
        tokenizer = transformers.Qwen2Tokenizer(
            vocab=vocab, merges=merges, add_prefix_space=False,
            added_tokens_decoder={i: token for i, (token, _) in sorted(declared.items())}, **settings)
    except Exception as e:
        raise TokenizerError(f"{path}: the tokenizer files do not load: {e}") from e
    _check_added_tokens(tokenizer, declared)
    return tokenizer


def _check_added_tokens(tokenizer: Any, declared: dict[int, tuple[Any, Path]]) -> None:
    """Every declared added token has its declared id (ids are assigned after vocab.json, in order)."""
    for token_id, (token, file) in sorted(declared.items()):
        got = tokenizer.convert_tokens_to_ids(str(token))
        if got != token_id:
            raise TokenizerError(f"{file}: added token {str(token)!r} is declared with id {token_id}, but it gets "
                                 f"id {got} (added tokens must follow vocab.json's ids without gaps, or be in it "
                                 "with the same id)")
