"""acache_jax.network.tokenizer on small synthetic snapshots laid out like LLaDA-8B-Instruct and Dream-v0-Instruct-7B.

Each family gets a tiny byte-level BPE vocabulary written in the file layout of its real snapshot:
LLaDA as `tokenizer.json` (built with the `tokenizers` library) + `tokenizer_config.json` (Llama-3-style chat
template) + `special_tokens_map.json` + `config.json`; Dream as `vocab.json` + `merges.txt` (with its
`#version` header) + `tokenizer_config.json` (added_tokens_decoder, auto_map, Qwen-style chat template) +
`special_tokens_map.json` + `added_tokens.json` + a `tokenization_dream.py` that raises if it is ever run.

References, and how independent they are:
- LLaDA: `AutoTokenizer.from_pretrained(dir)`. For this layout it ends in the same call as our loader
  (`TokenizersBackend.from_pretrained`), so it only shows that we load what transformers loads.
- Dream: `Qwen2Tokenizer.from_pretrained(dir)`, transformers' own reading of tokenizer_config.json and the
  added tokens. It shares the `Qwen2Tokenizer` class (hence the backend pipeline) with our loader.
- So both families are also checked against `reference_ids` / `reference_text` below: byte-level BPE written
  out from its definition (pre-tokenization regex, the reversible byte -> character map, rank-ordered merges,
  added tokens split off first; NFC first for Dream), with the regexes written out here: Qwen2's (which the
  slow Dream tokenizer uses) and GPT-2's (the `tokenizers` ByteLevel pre-tokenizer's). And against token
  sequences worked out by hand, and chat-template renderings written out by hand.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import unicodedata
from pathlib import Path

import pytest
import regex

from acache_jax.network.tokenizer import TOKENIZER_FILES, TokenizerError, import_transformers, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]

QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# The printable bytes stand for themselves; every other byte, in byte order, for chr(256), chr(257), ...
PRINTABLE = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
BYTE_CHAR = {b: chr(b) for b in PRINTABLE}
BYTE_CHAR.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in PRINTABLE)})
CHAR_BYTE = {c: b for b, c in BYTE_CHAR.items()}


def level(data: bytes) -> str:
    return "".join(BYTE_CHAR[b] for b in data)


COMMON_MERGES = [(b" ", b"w"), (b"o", b"r"), (b" w", b"or"), (b"l", b"d"), (b" wor", b"ld"), (b"H", b"e"),
                 (b"l", b"l"), (b"He", b"ll"), (b"Hell", b"o"), (b" ", b" "), (b"  ", b" "), (b"\n", b"\n"),
                 (b"\xc3", b"\xa9"), (b"\xc3", b"\xa0"), (b"\xe4", b"\xbd"), (b"\xe4\xbd", b"\xa0"), (b"'", b"s"),
                 (b"1", b"2"), (b"i", b"t"), (b" ", b"v"), (b" v", b"u")]
DREAM_MERGES = COMMON_MERGES + [(b"\xe5", b"\xa5"), (b"\xe5\xa5", b"\xbd")]  # 好
LLADA_MERGES = COMMON_MERGES + [(b" ", b"t"), (b" t", b"h"), (b" th", b"e")]

DREAM_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<|beginoftext|>",
               "<|mask|>"]
DREAM_NOT_SPECIAL = {"<tool_call>", "</tool_call>"}
DREAM_NAMED = {"bos_token": "<|beginoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
               "mask_token": "<|mask|>"}
DREAM_EXTRA = ["<|im_start|>", "<|im_end|>"]
DREAM_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLADA_ADDED = ["<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>", "<|start_header_id|>", "<|end_header_id|>",
               "<|eot_id|>"]
LLADA_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

TEXTS = ["Hello world!", "Hello  world,\n\n  déjà vu:\t你好 123 it's IT'S",
         "cafe\u0301 — Ünïcödé ✓ 🙂 x\r\ny", "   leading and trailing   \n", "\n\n\n", "12345 1.5e-3"]
DREAM_TEXTS = TEXTS + ["<|im_start|>user\nHé<|im_end|>\n<|mask|><|mask|> <tool_call>x</tool_call><|endoftext|>"]
LLADA_TEXTS = TEXTS + ["<|start_header_id|>user<|end_header_id|>\n\nHé<|eot_id|><|mdm_mask|> <|mdm_mask|>x"]
CHAT = [{"role": "user", "content": "  Hé  there,\n\n你好 ok \n"}]


def bpe_vocab(merges: list[tuple[bytes, bytes]]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The 256 byte characters (printable bytes first, as in the real vocabularies), then one token a merge."""
    order = PRINTABLE + [b for b in range(256) if b not in PRINTABLE]
    vocab = {BYTE_CHAR[b]: i for i, b in enumerate(order)}
    pairs = []
    for left, right in merges:
        pairs.append((level(left), level(right)))
        vocab.setdefault(level(left + right), len(vocab))
    return vocab, pairs


def reference_ids(text: str, vocab: dict[str, int], merges: list[tuple[str, str]], added: dict[str, int],
                  split: str, nfc: bool) -> list[int]:
    """Byte-level BPE by its definition: added tokens split off, regex pieces, byte chars, lowest-rank merges."""
    if nfc:
        text = unicodedata.normalize("NFC", text)
    ranks = {pair: rank for rank, pair in enumerate(merges)}
    parts = regex.split("(" + "|".join(map(regex.escape, sorted(added, key=len, reverse=True))) + ")", text)
    ids = []
    for index, part in enumerate(parts):
        if index % 2:
            ids.append(added[part])
            continue
        for piece in regex.findall(split, part):
            symbols = list(level(piece.encode("utf-8")))
            while len(symbols) > 1:
                rank = min(ranks.get(pair, len(ranks)) for pair in zip(symbols, symbols[1:]))
                if rank == len(ranks):
                    break
                merged, i = [], 0
                while i < len(symbols):
                    if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == merges[rank]:
                        merged.append(symbols[i] + symbols[i + 1])
                        i += 2
                    else:
                        merged.append(symbols[i])
                        i += 1
                symbols = merged
            ids.extend(vocab[s] for s in symbols)
    return ids


def reference_text(ids: list[int], vocab: dict[str, int], added: dict[str, int], skip: set[str]) -> str:
    """Decoding by definition: vocabulary tokens back to bytes (invalid UTF-8 replaced), added tokens verbatim."""
    token_of = {i: t for t, i in vocab.items()}
    added_of = {i: t for t, i in added.items()}
    out, pending = [], bytearray()
    for i in ids:
        if i in added_of:
            out.append(pending.decode("utf-8", "replace"))
            pending = bytearray()
            out.append("" if added_of[i] in skip else added_of[i])
        else:
            pending.extend(CHAR_BYTE[c] for c in token_of[i])
    return "".join(out) + pending.decode("utf-8", "replace")


def added_token(content: str, special: bool = True) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": special}


def write_dream(d: Path) -> Path:
    """vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json, added_tokens.json, remote code."""
    d.mkdir(parents=True, exist_ok=True)
    vocab, merges = bpe_vocab(DREAM_MERGES)
    n = len(vocab)
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (d / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {str(n + i): added_token(c, c not in DREAM_NOT_SPECIAL)
                                 for i, c in enumerate(DREAM_ADDED)},
        "additional_special_tokens": DREAM_EXTRA,
        "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
        "bos_token": DREAM_NAMED["bos_token"], "chat_template": DREAM_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": DREAM_NAMED["eos_token"], "errors": "replace", "mask_token": DREAM_NAMED["mask_token"],
        "model_max_length": 131072, "pad_token": DREAM_NAMED["pad_token"], "split_special_tokens": False,
        "tokenizer_class": "DreamTokenizer", "unk_token": None,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    strip = lambda c: {k: v for k, v in added_token(c).items() if k != "special"}  # noqa: E731
    special_map = {"additional_special_tokens": DREAM_EXTRA, **{k: strip(v) for k, v in DREAM_NAMED.items()}}
    (d / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2), encoding="utf-8")
    (d / "added_tokens.json").write_text(json.dumps({c: n + i for i, c in enumerate(DREAM_ADDED)}, indent=2))
    (d / "tokenization_dream.py").write_text("raise RuntimeError('tokenization_dream.py was executed')\n")
    return d


def write_llada(d: Path) -> Path:
    """tokenizer.json (byte-level BPE, bos template), tokenizer_config.json, special_tokens_map.json, config.json.

    The post-processor prepends the bos token so that add_special_tokens=True/False differ observably.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    d.mkdir(parents=True, exist_ok=True)
    vocab, merges = bpe_vocab(LLADA_MERGES)
    n = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in LLADA_ADDED])
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A", pair="<|startoftext|> $A $B:1", special_tokens=[("<|startoftext|>", n)])
    tok.save(str(d / "tokenizer.json"))
    named = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    config = {"added_tokens_decoder": {str(n + i): added_token(c) for i, c in enumerate(LLADA_ADDED)},
              **named, "chat_template": LLADA_TEMPLATE, "clean_up_tokenization_spaces": False,
              "model_max_length": 1000000000000000019884624838656, "tokenizer_class": "PreTrainedTokenizerFast"}
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (d / "special_tokens_map.json").write_text(json.dumps(named, indent=2), encoding="utf-8")
    (d / "config.json").write_text(json.dumps({
        "model_type": "llada", "architectures": ["LLaDAModelLM"],
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM"}}))
    return d


@pytest.fixture
def dream(tmp_path) -> Path:
    return write_dream(tmp_path / "dream")


@pytest.fixture
def llada(tmp_path) -> Path:
    return write_llada(tmp_path / "llada")


def _ids(tok, text: str, special: bool) -> list[int]:
    return tok(text, add_special_tokens=special)["input_ids"]


def _chat(tok, tokenize: bool):
    return tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=tokenize, return_dict=False)


def test_dream_matches_transformers_and_the_reference(dream):
    tok = load_tokenizer(dream)
    ref = import_transformers().Qwen2Tokenizer.from_pretrained(str(dream))
    vocab, merges = bpe_vocab(DREAM_MERGES)
    added = {c: len(vocab) + i for i, c in enumerate(DREAM_ADDED)}
    assert type(tok).__name__ == "Qwen2Tokenizer" and "tokenization_dream" not in sys.modules
    assert len(tok) == len(vocab) + len(DREAM_ADDED) and tok.added_tokens_decoder == ref.added_tokens_decoder
    assert {k: getattr(tok, k) for k in DREAM_NAMED} == DREAM_NAMED and tok.unk_token is None
    assert tok.mask_token_id == added["<|mask|>"] and tok.eos_token_id == added["<|endoftext|>"]
    skip = set(DREAM_NAMED.values()) | set(DREAM_EXTRA)
    assert set(tok.all_special_tokens) == skip
    for text in DREAM_TEXTS:
        ids = _ids(tok, text, special=False)
        assert ids == _ids(ref, text, special=False) == reference_ids(text, vocab, merges, added, QWEN2_SPLIT, True)
        assert _ids(tok, text, special=True) == ids  # the slow Dream tokenizer adds no bos/eos
        for skip_special in (False, True):
            expected = reference_text(ids, vocab, added, skip if skip_special else set())
            assert tok.decode(ids, skip_special_tokens=skip_special) == expected
            assert ref.decode(ids, skip_special_tokens=skip_special) == expected
        assert tok.decode(ids) == unicodedata.normalize("NFC", text)
    rendered = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                f"<|im_start|>user\n{CHAT[0]['content']}<|im_end|>\n<|im_start|>assistant\n")
    assert _chat(tok, tokenize=False) == _chat(ref, tokenize=False) == rendered
    assert _chat(tok, tokenize=True) == _chat(ref, tokenize=True) == _ids(tok, rendered, special=False)
    assert _chat(tok, tokenize=True) == reference_ids(rendered, vocab, merges, added, QWEN2_SPLIT, True)
    assert tok.decode([vocab[BYTE_CHAR[0xC3]]]) == "\ufffd"  # errors="replace": a lone lead byte


def test_dream_hand_computed(dream):
    """Qwen2's pre-tokenization: "!" takes the newlines after it, digits stand alone; NFC composes é."""
    tok = load_tokenizer(dream)
    ids = _ids(tok, "Hello world!\n\n你好 12 cafe\u0301", special=False)
    assert tok.convert_ids_to_tokens(ids) == [
        "Hello", "Ġworld", "!", "ĊĊ", level("你".encode()), level("好".encode()), "Ġ", "1", "2",
        "Ġ", "c", "a", "f", level("é".encode())]
    vocab, _ = bpe_vocab(DREAM_MERGES)
    assert vocab["Ġ"] == 220 and vocab["!"] == 0  # the byte characters sit where Qwen2's vocabulary has them
    mask, tool_call = len(vocab) + DREAM_ADDED.index("<|mask|>"), len(vocab) + DREAM_ADDED.index("<tool_call>")
    assert _ids(tok, "<|mask|> <tool_call>", special=True) == [mask, 220, tool_call]


def test_dream_pre_tokenizer_is_qwen2s(dream):
    """The built pipeline splits exactly as the regex of the slow Dream tokenizer, then maps bytes to chars."""
    backend = load_tokenizer(dream).backend_tokenizer
    texts = TEXTS + ["I'LL don't we'VE", "a\r\n\r\nb  \n c", "x\t\ty", "  \u00a0 z", "1234567"]
    for text in texts:
        pieces = [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
        assert pieces == [level(p.encode()) for p in regex.findall(QWEN2_SPLIT, text)], text
    assert backend.normalizer.normalize_str("cafe\u0301") == "café"


def test_llada_matches_auto_tokenizer_and_the_reference(llada):
    tok = load_tokenizer(llada)
    ref = import_transformers().AutoTokenizer.from_pretrained(str(llada), trust_remote_code=False)
    vocab, merges = bpe_vocab(LLADA_MERGES)
    added = {c: len(vocab) + i for i, c in enumerate(LLADA_ADDED)}
    bos = added["<|startoftext|>"]
    assert tok.bos_token == "<|startoftext|>" and tok.bos_token_id == bos
    for text in LLADA_TEXTS:
        ids = _ids(tok, text, special=False)
        assert ids == _ids(ref, text, special=False) == reference_ids(text, vocab, merges, added, GPT2_SPLIT, False)
        assert _ids(tok, text, special=True) == _ids(ref, text, special=True) == [bos] + ids
        for skip_special in (False, True):
            expected = reference_text([bos] + ids, vocab, added, set(added) if skip_special else set())
            assert tok.decode([bos] + ids, skip_special_tokens=skip_special) == expected
            assert ref.decode([bos] + ids, skip_special_tokens=skip_special) == expected
    rendered = ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n" + CHAT[0]["content"].strip()
                + "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert _chat(tok, tokenize=False) == _chat(ref, tokenize=False) == rendered
    # tokenize=True does not add a second bos: the template already has one
    assert _chat(tok, tokenize=True) == _chat(ref, tokenize=True) == _ids(tok, rendered, special=False)
    assert _chat(tok, tokenize=True) == reference_ids(rendered, vocab, merges, added, GPT2_SPLIT, False)


def test_llada_hand_computed(llada):
    """GPT-2's pre-tokenization: " 123" is one piece (so the "12" merge applies), newlines stay apart."""
    tok = load_tokenizer(llada)
    ids = _ids(tok, "Hello world!\n\n 123 the", special=True)
    assert tok.convert_ids_to_tokens(ids) == ["<|startoftext|>", "Hello", "Ġworld", "!", "ĊĊ", "Ġ", "12", "3",
                                              "Ġthe"]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_chat_template_jinja_wins(family, tmp_path):
    """chat_template.jinja replaces tokenizer_config.json's template, as transformers does."""
    d = (write_llada if family == "llada" else write_dream)(tmp_path / family)
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                                          "{% if add_generation_prompt %}[assistant]{% endif %}")
    tok = load_tokenizer(d)
    tr = import_transformers()
    ref = (tr.AutoTokenizer.from_pretrained(str(d), trust_remote_code=False) if family == "llada"
           else tr.Qwen2Tokenizer.from_pretrained(str(d)))
    assert _chat(tok, tokenize=False) == _chat(ref, tokenize=False) == f"[user]{CHAT[0]['content']}[assistant]"
    assert _chat(tok, tokenize=True) == _chat(ref, tokenize=True)


def test_auto_tokenizer_wants_remote_code_for_dream(dream):
    """Why the Dream path exists: transformers would have to run tokenization_dream.py."""
    with pytest.raises(ValueError, match="trust_remote_code"):
        import_transformers().AutoTokenizer.from_pretrained(str(dream), trust_remote_code=False)


def test_no_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None


def _corrupt(d: Path, name: str, edit) -> Path:
    file = d / name
    if edit is None:
        file.unlink()
    else:
        file.write_text(edit(file.read_text(encoding="utf-8")), encoding="utf-8")
    return file


def _shift_id(content: str, by: int):
    def edit(text: str) -> str:
        data = json.loads(text)
        if "added_tokens_decoder" in data:
            table = data["added_tokens_decoder"]
            key = next(k for k, v in table.items() if v["content"] == content)
            table[str(int(key) + by)] = table.pop(key)
        else:
            data[content] += by
        return json.dumps(data)
    return edit


# case: (family, file, edit (None: delete the file)); the added token ids are checked against the vocabulary
# when added_tokens.json is absent (as in some snapshots), and against added_tokens.json when it is there.
CORRUPTIONS = {
    "llada truncated tokenizer.json": ("llada", "tokenizer.json", lambda t: t[: len(t) // 2]),
    "llada invalid tokenizer_config.json": ("llada", "tokenizer_config.json", lambda t: t[:-3]),
    "dream invalid tokenizer_config.json": ("dream", "tokenizer_config.json", lambda t: "{'bos_token': 1}"),
    "dream added id in tokenizer_config.json": ("dream", "tokenizer_config.json", _shift_id("<|mask|>", 5)),
    "dream added id in added_tokens.json": ("dream", "added_tokens.json", _shift_id("<|mask|>", 5)),
    "dream truncated vocab.json": ("dream", "vocab.json", lambda t: t[: len(t) // 2]),
    "dream bad merges.txt line": ("dream", "merges.txt", lambda t: t + "H e l\n"),
    "dream merge out of vocab": ("dream", "merges.txt", lambda t: t + "Ġ q\n"),
    "dream no merges.txt": ("dream", "merges.txt", None),
    "dream foreign tokenizer_class": ("dream", "tokenizer_config.json",
                                      lambda t: t.replace('"DreamTokenizer"', '"GPT2Tokenizer"')),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_corrupt_file_is_named(case, tmp_path):
    family, name, edit = CORRUPTIONS[case]
    d = (write_llada if family == "llada" else write_dream)(tmp_path / family)
    if case == "dream added id in tokenizer_config.json":
        (d / "added_tokens.json").unlink()
    file = _corrupt(d, name, edit)
    with pytest.raises(TokenizerError, match=re.escape(str(file))):
        load_tokenizer(d)
    assert issubclass(TokenizerError, ValueError)


def test_a_lazy_tokenizer_loads_beside_its_caller(tmp_path, monkeypatch):
    """`LazyTokenizer.load_beside` (what the command line does while it decodes) loads on a thread of
    its own, once; a first use meanwhile waits for that load and gets its tokenizer. A load that
    fails there is raised by the first use."""
    from acache_jax.network import tokenizer

    load, entered, release, loads = load_tokenizer, threading.Event(), threading.Event(), []

    def slow(path):
        loads.append(threading.current_thread().name)
        entered.set()
        assert release.wait(60)
        return load(path)

    monkeypatch.setattr(tokenizer, "load_tokenizer", slow)
    lazy = tokenizer.LazyTokenizer(write_dream(tmp_path / "dream"))
    lazy.load_beside()
    assert entered.wait(60)  # the thread holds the load
    threading.Timer(0.2, release.set).start()
    assert lazy("a cat")["input_ids"] == load(tmp_path / "dream")("a cat")["input_ids"]
    assert loads == ["load-tokenizer"]
    lazy.load_beside()  # loaded: nothing more
    assert loads == ["load-tokenizer"]

    broken = write_dream(tmp_path / "broken")
    (broken / "merges.txt").unlink()
    lazy = tokenizer.LazyTokenizer(broken)
    lazy.load_beside()
    with pytest.raises(TokenizerError, match="merges"):
        lazy.loaded()


def test_silent_on_stderr(dream):
    """No "PyTorch was not found" advisory (nor anything else) on stderr, and the variable is put back."""
    code = ("import os, sys; from acache_jax.network.tokenizer import load_tokenizer; "
            "assert load_tokenizer('acache_jax/models/llada-small') is not None; "
            "assert load_tokenizer(sys.argv[1]) is not None; "
            "print(os.environ.get('TRANSFORMERS_NO_ADVISORY_WARNINGS'))")
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    proc = subprocess.run([sys.executable, "-c", code, str(dream)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and proc.stdout == "None\n"


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_tokenizer_files_round_trip(family, tmp_path):
    src = (write_llada if family == "llada" else write_dream)(tmp_path / family)
    dst = tmp_path / "converted"
    dst.mkdir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    assert not any(name.endswith(".py") for name in TOKENIZER_FILES) and "generation_config.json" not in TOKENIZER_FILES
    assert sorted(p.name for p in dst.iterdir()) == sorted(
        p.name for p in src.iterdir() if p.suffix != ".py" and p.name != "config.json")
    a, b = load_tokenizer(src), load_tokenizer(dst)
    for text in (LLADA_TEXTS if family == "llada" else DREAM_TEXTS):
        for special in (False, True):
            assert _ids(a, text, special) == _ids(b, text, special)
    assert _chat(a, tokenize=True) == _chat(b, tokenize=True)
    assert a.added_tokens_decoder == b.added_tokens_decoder and a.all_special_tokens == b.all_special_tokens
