"""HF snapshots of the published LLaDA and Dream checkpoints in their exact file layouts, with random
weights: `write_snapshot(directory, "llada" | "dream" | a checkpoint of CHECKPOINTS, layers=..., hidden=...)`.
What follows describes the two each family is built on (LLaDA-8B-Instruct, Dream-v0-Instruct-7B);
`CHECKPOINTS` says, per checkpoint, how its files differ and where each fact was read.

Why: no model hub is reachable from where the tests and the real-scale check (eval/real_scale.py) run, and
the checkpoints are 15-16 GB. Loading, converting, tokenizing and serving must still be exercised on what a
user downloads: the same file names and shard split, every key of config.json, tokenizer_config.json,
special_tokens_map.json, added_tokens.json and generation_config.json as published, the special and added
tokens at their real ids, the real chat templates, the remote-code files our loader must never run, and
bf16 weights at 8B size. Only the weights (random) and the bulk of the vocabularies (filler tokens) are not
the published ones. Tiny models prove logic; this proves the layout.

What is written, per family (file lists of the published repositories, both as downloaded):
- LLaDA-8B-Instruct: .gitattributes, README.md, config.json, configuration_llada.py, generation_config.json,
  model-0000{1..6}-of-00006.safetensors, model.safetensors.index.json, modeling_llada.py,
  special_tokens_map.json, tokenizer.json, tokenizer_config.json.
- Dream-v0-Instruct-7B: .gitattributes, README.md, added_tokens.json, config.json, configuration_dream.py,
  generation_config.json, generation_utils.py, merges.txt, model-0000{1..4}-of-00004.safetensors,
  model.safetensors.index.json, modeling_dream.py, special_tokens_map.json, tokenization_dream.py,
  tokenizer_config.json, vocab.json.
The remote-code files (*.py) are stubs that raise if executed; README.md and .gitattributes are short
stand-ins. At the published size (no `layers`/`hidden`/`intermediate`), config.json, generation_config.json,
special_tokens_map.json, tokenizer_config.json, added_tokens.json and model.safetensors.index.json are
byte-identical to the published files (tests/test_hf_snapshot.py checks their sha256 digests).

Where each fact was read (public copies of the hub repositories; facts only, no code):
- LLaDA config.json, generation_config.json, special_tokens_map.json, tokenizer_config.json (269 added
  tokens at ids 126080..126348, chat template, tokenizer_class PreTrainedTokenizerFast),
  model.safetensors.index.json (6 shards, total_size 16031162368): GitHub yinj66/support_basis
  `LLaDA-8B-Instruct-B&S-light/` and monash-yann/dllm-research `models/LLaDA-8B-Instruct/`; the two copies
  are byte-identical (same git blobs). Their tokenizer.json is absent from both copies (too large to be
  mirrored), so its pipeline could not be read; see the LLaDA tokenizer below.
- LLaDA token ids in real encodings: a LLaDA generate.py copy whose comment prints the ids of the chat prompt
  (`<|startoftext|><|start_header_id|>user<|end_header_id|>\\n\\nLily can run 12 ...`: 126080, 126346, 3840,
  126347, 198, 198, 86059, 560, 2001, 220, 16, 17, ...; one BOS only although `tokenizer(prompt)` was called
  with its default add_special_tokens=True), and a jailbreak-harness test's ground truth for
  GSAI-ML/LLaDA-8B-Instruct ("Hello, how are you?" -> 14455, 11, 1099, 449, 362, 30; user turn header
  126346, 3840, 126347, 198, 198; assistant header 126348, 126346, 598, 10450, 126347, 198, 198). Both are
  third-party code found through the code search; neither is the published tokenizer itself.
- Dream config.json, generation_config.json, special_tokens_map.json, tokenizer_config.json (chat template,
  added_tokens_decoder 151643..151666, auto_map to tokenization_dream.DreamTokenizer), added_tokens.json,
  model.safetensors.index.json (4 shards, total_size 15231233024), vocab.json (151643 entries, indent 2,
  sorted keys) and merges.txt ("#version: 0.2" + 151387 merges): monash-yann/dllm-research
  `models/Dream-7B-Instruct/` (one copy). The 39 merges and 39 token ids pinned below were read from that
  vocab.json / merges.txt, and the Dream encodings the tests expect were computed with our loader from those
  real files.
- Shard assignment: the published indexes are reproduced exactly by HF's greedy sharding (a new shard when
  the next tensor would pass the limit) over the tensors in the order below, with limits of 3e9 (LLaDA) and
  5e9 (Dream) bytes. The LLaDA order (type-major: wte, ln_f, every attn_out, the LM head, every ff_out, the
  norms, q, k, v, ff_proj, up_proj) is inferred from its index; Dream's is Qwen2's module order.

The tokenizers, built so that the special and added tokens sit at their real ids:
- Byte-level BPE whose ids 0..255 are the 256 byte symbols in the GPT-2 / Qwen2 order (printable bytes
  first), as in both real vocabularies (Dream: read; LLaDA: "\\n" = 198, " " = 220, "1" = 16, "?" = 30,
  "!" = 0 in the real encodings above). Then a few real merges and tokens at their real ids: Dream, the
  tokens of its default system prompt, the role names, "hi" and "Hello, how are you?" with their whole
  merge derivations (so the chat encodings equal the real tokenizer's); LLaDA, "user", "ass" + "istant",
  and "Hello, how are you?" at their observed ids (intermediate merge tokens at free ids: the real ones are
  unknown). Every other id below the added tokens holds an unreachable filler `<|synthetic_N|>`, so that the
  vocabulary has the real size and the added tokens land at their real ids.
- LLaDA's tokenizer.json: the real pipeline is unknown; ours is a Qwen2-style split (single digits, as the
  real " 12" -> 220, 16, 17 shows) followed by byte-level mapping, no normalizer, and a post-processor that
  adds no BOS (as observed). "\\n\\n" encodes as 198, 198 as observed (no such merge in our vocabulary).
- Dream: vocab.json + merges.txt as the real files are laid out, read by our loader as Qwen2's BPE.

Weights: every tensor our loader expects (acache_jax.network.hf_checkpoint.key_map), bf16, matrices and biases
~N(0, 0.02), norms ~1 + N(0, 0.1). At 8B size nothing is drawn per value: one pool of ~64 MB of random bf16
values is drawn once and every tensor is written as slices of it from a random offset (a prime pool length,
so rows of a matrix never repeat). Each shard is streamed to disk tensor by tensor under a hand-written
safetensors header (tensors sorted by name, as the safetensors library orders them), so host memory stays
at the pool's size whatever the snapshot's. Every file goes to a temporary name renamed into place, and
config.json is written last: a directory with a config.json holds a complete snapshot.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Literal

import ml_dtypes
import numpy as np

from acache_jax.network.config import ModelConfig
from acache_jax.network.files import write_atomic
from acache_jax.network.hf_checkpoint import INDEX_FILE, key_map

Family = Literal["llada", "dream"]
BF16 = np.dtype(ml_dtypes.bfloat16)
POOL_ELEMENTS = 33_554_393  # a prime near 2**25: 64 MB of bf16 values every weight is cut from
NORM_POOL_ELEMENTS = 1 << 20

# -- published files: LLaDA-8B-Instruct --------------------------------------------------------------

LLADA_CONFIG: dict[str, Any] = {  # config.json, keys in the published order (auto_map is not sorted there)
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
    "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                 "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                 "AutoModel": "modeling_llada.LLaDAModelLM"},
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 4096,
    "embedding_dropout": 0.0, "embedding_size": 126464, "eos_token_id": 126081, "flash_attention": False,
    "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
    "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
    "layer_norm_with_affine": True, "mask_token_id": 126336, "max_sequence_length": 4096,
    "mlp_hidden_size": 12288, "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None,
    "n_heads": 32, "n_kv_heads": 32, "n_layers": 32, "pad_token_id": 126081, "precision": "amp_bf16",
    "residual_dropout": 0.0, "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True,
    "rope_theta": 500000.0, "scale_logits": False, "transformers_version": "4.46.3", "use_cache": False,
    "vocab_size": 126464, "weight_tying": False,
}
LLADA_GENERATION_CONFIG: dict[str, Any] = {
    "_from_model_config": True, "bos_token_id": 126080, "eos_token_id": 126081, "transformers_version": "4.38.2",
}
LLADA_FIRST_ADDED_ID = 126080  # ids 0..126079 are the BPE vocabulary, then 269 added tokens


def _llada_added_tokens(chat_markers: bool = True) -> list[str]:
    """The added tokens in id order from 126080 (all special): <|mdm_mask|> takes reserved token 252's place.
    chat_markers: the chat template's three markers at 126346..126348 (Instruct and 1.5; Base lacks them)."""
    tokens = ["<|startoftext|>", "<|endoftext|>", "[CLS]", "[gMASK]"]
    tokens += [f"<|reserved_token_{k}|>" for k in range(256)]
    tokens += ["<role>", "</role>", "<|arithmetic_start|>", "<|arithmetic_end|>", "<|number_start|>",
               "<|number_end|>"]
    if chat_markers:
        tokens += ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tokens[126336 - LLADA_FIRST_ADDED_ID] = "<|mdm_mask|>"
    return tokens


LLADA_EXTRA_SPECIAL = ["<role>", "</role>", "<|arithmetic_start|>", "<|arithmetic_end|>", "<|number_start|>",
                       "<|number_end|>"]
# Published as is: every turn trimmed, bos before the first, and the assistant header ALWAYS appended
# (there is no add_generation_prompt condition in LLaDA's template).
LLADA_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>'"
    " + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 =="
    " 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
)


def _named(content: str) -> dict[str, Any]:
    """A special token as special_tokens_map.json writes it."""
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def _added(content: str, special: bool = True) -> dict[str, Any]:
    """An added token as tokenizer_config.json's added_tokens_decoder writes it."""
    return {**_named(content), "special": special}


def _llada_special_tokens_map() -> dict[str, Any]:
    return {"additional_special_tokens": LLADA_EXTRA_SPECIAL, "bos_token": _named("<|startoftext|>"),
            "cls_token": _named("[CLS]"), "eos_token": _named("<|endoftext|>"), "pad_token": _named("<|endoftext|>")}


def _llada_base_special_tokens_map() -> bytes:
    """LLaDA-8B-Base's special_tokens_map.json as published: Instruct's with "<|mdm_mask|>" first in
    additional_special_tokens and no comma after it, so NOT valid JSON (transformers never reads the
    file when tokenizer_config.json declares the added tokens, so the model loads there)."""
    text = _json(_llada_special_tokens_map(), 2, True).decode()
    opening = '"additional_special_tokens": [\n'
    return text.replace(opening, opening + '    "<|mdm_mask|>"\n', 1).encode()


def _llada_tokenizer_config(chat_markers: bool = True) -> dict[str, Any]:
    added = _llada_added_tokens(chat_markers)
    extra = LLADA_EXTRA_SPECIAL if chat_markers else ["<|mdm_mask|>", *LLADA_EXTRA_SPECIAL]
    return {
        "add_bos_token": False, "add_eos_token": False,
        "added_tokens_decoder": {str(LLADA_FIRST_ADDED_ID + i): _added(t) for i, t in enumerate(added)},
        "additional_special_tokens": extra, "bos_token": "<|startoftext|>",
        "chat_template": LLADA_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "cls_token": "[CLS]",
        "eos_token": "<|endoftext|>", "fast_tokenizer": True, "gmask_token": "[gMASK]", "merges_file": None,
        "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 1000000000000000019884624838656,
        "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast", "trust_remote_code": True,
        "vocab_file": None,
    }


# -- published files: Dream-v0-Instruct-7B -----------------------------------------------------------

DREAM_CONFIG: dict[str, Any] = {
    "_name_or_path": "Dream-org/Dream-v0-Instruct-7B", "architectures": ["DreamModel"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "mask_token_id": 151666,
    "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "Dream", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "pad_token_id": 151643, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.46.2", "use_cache": True, "use_mrope": False,
    "use_sliding_window": False, "vocab_size": 152064,
}
DREAM_GENERATION_CONFIG: dict[str, Any] = {
    "_from_model_config": True, "alg": "origin", "alg_temp": None, "bos_token_id": 151643, "eos_token_id": 151643,
    "eps": 0.001, "mask_token_id": None, "output_history": False, "pad_token_id": 151643, "steps": 512,
    "temperature": 0.0, "top_k": None, "top_p": None, "transformers_version": "4.46.2",
}
DREAM_FIRST_ADDED_ID = 151643  # vocab.json holds ids 0..151642, then 24 added tokens
DREAM_ADDED = [  # (content, special) in id order from 151643
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<|beginoftext|>", True), ("<|mask|>", True),
]
DREAM_CHAT_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are a helpful assistant.' }}\n"
    "    {%- endif %}\n    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- for message in messages %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not "
    "loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}\n        {{- '<|im_start|>' + "
    "message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n        {%- if message.content %}\n            {{- '\\n' + "
    "message.content }}\n        {%- endif %}\n        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role "
    "!= \"tool\") %}\n            {{- '<|im_start|>user' }}\n        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)


DLM_PAD = "<|dlm_pad|>"  # DiffuCoder-Instruct's pad token, after <|mask|>: the fill after an answer


def _dream_added(dlm_pad: bool) -> list[tuple[str, bool]]:
    return [*DREAM_ADDED, (DLM_PAD, True)] if dlm_pad else DREAM_ADDED


def _dream_special_tokens_map(dlm_pad: bool = False) -> dict[str, Any]:
    return {"additional_special_tokens": ["<|beginoftext|>", "<|mask|>"], "bos_token": _named("<|beginoftext|>"),
            "eos_token": _named("<|endoftext|>"), "mask_token": _named("<|mask|>"),
            "pad_token": _named(DLM_PAD if dlm_pad else "<|endoftext|>")}


def _dream_tokenizer_config(dlm_pad: bool = False, template_file: bool = False) -> dict[str, Any]:
    config = {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": {str(DREAM_FIRST_ADDED_ID + i): _added(t, s)
                                 for i, (t, s) in enumerate(_dream_added(dlm_pad))},
        "additional_special_tokens": ["<|beginoftext|>", "<|mask|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
        "bos_token": "<|beginoftext|>", "chat_template": DREAM_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>", "errors": "replace", "mask_token": "<|mask|>", "model_max_length": 131072,
        "pad_token": DLM_PAD if dlm_pad else "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "DreamTokenizer", "unk_token": None,
    }
    if template_file:  # the template ships as chat_template.jinja instead
        del config["chat_template"]
    return config


# -- vocabularies ------------------------------------------------------------------------------------

# Byte-level BPE: the printable bytes stand for themselves, every other byte (in byte order) for chr(256 + k).
# Ids 0..255 hold these symbols, printable bytes first, as in GPT-2's, Qwen2's and LLaDA's vocabularies.
_PRINTABLE = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
_OTHER = [b for b in range(256) if b not in _PRINTABLE]
BYTE_SYMBOL = {**{b: chr(b) for b in _PRINTABLE}, **{b: chr(256 + i) for i, b in enumerate(_OTHER)}}
BYTE_SYMBOLS = [BYTE_SYMBOL[b] for b in [*_PRINTABLE, *_OTHER]]  # index = token id

# Dream: real merges (in their real rank order) deriving the tokens of the default system prompt, the role
# names, "hi" and "Hello, how are you?", and the real ids of every token they produce (read from the
# published merges.txt / vocab.json).
DREAM_MERGES = [
    ("e", "r"), ("Ġ", "a"), ("r", "e"), ("s", "t"), ("a", "n"), ("o", "u"), ("a", "s"), ("e", "l"), ("Ġ", "h"),
    ("e", "m"), ("u", "s"), ("u", "l"), ("o", "w"), ("Ġ", "y"), ("i", "st"), ("l", "o"), ("as", "s"), ("Ġa", "s"),
    ("Ġy", "ou"), ("an", "t"), ("Ġa", "re"), ("y", "st"), ("yst", "em"), ("us", "er"), ("Ġas", "s"), ("Ġh", "ow"),
    ("f", "ul"), ("el", "p"), ("Ġh", "elp"), ("Y", "ou"), ("el", "lo"), ("h", "i"), ("Ġass", "ist"),
    ("s", "ystem"), ("H", "ello"), ("Ġhelp", "ful"), ("ist", "ant"), ("Ġassist", "ant"), ("ass", "istant"),
]
DREAM_PINNED = {
    "er": 261, "Ġa": 264, "re": 265, "st": 267, "an": 276, "ou": 283, "as": 300, "el": 301, "Ġh": 305, "em": 336,
    "us": 355, "ul": 360, "ow": 363, "Ġy": 379, "ist": 380, "lo": 385, "ass": 395, "Ġas": 438, "Ġyou": 498,
    "ant": 517, "Ġare": 525, "yst": 597, "ystem": 612, "user": 872, "Ġass": 1071, "Ġhow": 1246, "ful": 1262,
    "elp": 1267, "Ġhelp": 1492, "You": 2610, "ello": 4791, "hi": 6023, "Ġassist": 7789, "system": 8948,
    "Hello": 9707, "Ġhelpful": 10950, "istant": 11202, "Ġassistant": 17847, "assistant": 77091,
}
# LLaDA: the same derivations for its observed tokens (its merges are unpublished here), without
# "ass" + "istant": LLaDA encodes "assistant" as 598, 10450. Only the final tokens' ids are real.
LLADA_MERGES = [
    ("e", "r"), ("Ġ", "a"), ("r", "e"), ("s", "t"), ("a", "n"), ("o", "u"), ("a", "s"), ("e", "l"), ("Ġ", "h"),
    ("u", "s"), ("o", "w"), ("Ġ", "y"), ("i", "st"), ("l", "o"), ("as", "s"), ("Ġy", "ou"), ("an", "t"),
    ("Ġa", "re"), ("us", "er"), ("Ġh", "ow"), ("el", "lo"), ("H", "ello"), ("ist", "ant"),
]
LLADA_PINNED = {"user": 3840, "ass": 598, "istant": 10450, "Hello": 14455, "Ġhow": 1099, "Ġare": 449, "Ġyou": 362}
# Qwen2's pre-tokenization regex (single digits); our stand-in for LLaDA's unpublished one.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _vocab(size: int, pinned: dict[str, int], merges: list[tuple[str, str]]) -> dict[str, int]:
    """Ids 0..size-1: byte symbols, pinned tokens at their ids, other merge results at the lowest free ids,
    and an unreachable filler `<|synthetic_N|>` at every id left."""
    vocab = {symbol: i for i, symbol in enumerate(BYTE_SYMBOLS)}
    vocab.update(pinned)
    used = set(vocab.values())
    if len(used) != len(vocab) or max(used) >= size:
        raise AssertionError("pinned token ids collide or exceed the vocabulary")
    free = (i for i in range(size) if i not in used)
    for left, right in merges:
        for part in (left, right):
            if part not in vocab:
                raise AssertionError(f"merge ({left!r}, {right!r}) uses {part!r}, which no earlier merge produces")
        if left + right not in vocab:
            vocab[left + right] = next(free)
            used.add(vocab[left + right])
    for i in range(size):
        if i not in used:
            vocab[f"<|synthetic_{i}|>"] = i
    return vocab


def _llada_tokenizer_json(path: Path, chat_markers: bool = True) -> None:
    """tokenizer.json: byte-level BPE of 126080 tokens, then the 269 added tokens at 126080..126348
    (Base: 266, without the chat markers)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.BPE(vocab=_vocab(LLADA_FIRST_ADDED_ID, LLADA_PINNED, LLADA_MERGES),
                                     merges=LLADA_MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)  # adds no BOS, as the real one
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False,
                                             single_word=False) for t in _llada_added_tokens(chat_markers)])
    if tokenizer.get_vocab_size(with_added_tokens=True) != LLADA_FIRST_ADDED_ID + len(_llada_added_tokens(chat_markers)):
        raise AssertionError("the LLaDA added tokens did not land at their real ids")
    tokenizer.save(str(path))


# -- sizes and the tensor plan -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Family:
    """What differs between the two layouts."""

    layers_key: str
    hidden_key: str
    intermediate_key: str
    heads_key: str
    shards: int  # number of safetensors files in the published repository
    shard_limit: int  # bytes: the greedy limit that reproduces the published index
    json_format: dict[str, tuple[int, bool]]  # file -> (indent, trailing newline), as published


FAMILIES: dict[str, _Family] = {
    "llada": _Family("n_layers", "d_model", "mlp_hidden_size", "n_heads", 6, 3 * 10**9,
                     {"config.json": (2, False), "generation_config.json": (4, False),
                      "special_tokens_map.json": (2, True), "tokenizer_config.json": (2, True),
                      INDEX_FILE: (2, False)}),
    "dream": _Family("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                     4, 5 * 10**9,
                     {"config.json": (2, True), "generation_config.json": (2, True),
                      "special_tokens_map.json": (2, True), "tokenizer_config.json": (2, True),
                      "added_tokens.json": (2, True), INDEX_FILE: (2, True), "vocab.json": (2, True)}),
}


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One published checkpoint: its family's layout with its own files. `sources` says where each
    fact was read and what is modelled (a file no public copy holds is written as its sibling's)."""

    repo: str
    family: Family
    config: dict[str, Any]  # config.json at the published size, keys in the published order
    generation_config: dict[str, Any]
    sources: str
    layer_major: bool = False  # LLaDA: tensors saved block by block (1.5), not kind by kind (8B)
    chat_markers: bool = True  # LLaDA: the chat template's markers are tokens (Base: they are not)
    dlm_pad: bool = False  # Dream: DiffuCoder-Instruct's <|dlm_pad|> at 151667, the tokenizer's pad
    template_file: bool = False  # Dream: the chat template ships as chat_template.jinja (DiffuCoder)
    extra_code: tuple[str, ...] = ()  # further code files of the repository (written as stubs)


DIFFUCODER_CONFIG = {k: v for k, v in DREAM_CONFIG.items() if k != "_name_or_path"} | {
    "transformers_version": "4.51.3", "use_cache": False}
DREAM_CODER_CONFIG = {k: v for k, v in DREAM_CONFIG.items() if k not in ("_name_or_path", "use_mrope")} | {
    "bos_token_id": 151665, "max_position_embeddings": 32768}
_DREAM_GENERATION = {k: v for k, v in DREAM_GENERATION_CONFIG.items() if k != "transformers_version"}

CHECKPOINTS: dict[str, Checkpoint] = {ck.repo: ck for ck in [
    Checkpoint("GSAI-ML/LLaDA-8B-Instruct", "llada", LLADA_CONFIG, LLADA_GENERATION_CONFIG,
               "every JSON file and the index: two byte-identical public copies (see the module docstring)"),
    Checkpoint("GSAI-ML/LLaDA-8B-Base", "llada", LLADA_CONFIG, LLADA_GENERATION_CONFIG,
               "config.json, generation_config.json and the index are Instruct's (their sha256 digests, recorded "
               "for revision 0f2787f2 by third-party provenance code, equal Instruct's); tokenizer_config.json is "
               "Instruct's without the chat markers 126346..126348 and with <|mdm_mask|> first in "
               "additional_special_tokens, special_tokens_map.json the same insertion without its comma (both "
               "rebuilt byte for byte to the recorded digests); the chat template is Instruct's string, whose "
               "markers are no tokens here: upstream feeds Base raw text",
               chat_markers=False),
    Checkpoint("GSAI-ML/LLaDA-1.5", "llada", LLADA_CONFIG,
               {**LLADA_GENERATION_CONFIG, "transformers_version": "4.46.3"},
               "the index (its shard split, reproduced here by saving block by block at HF's 3e9-byte limit) from "
               "a public copy whose shard byte sums match a third-party probe's file sizes of revision 84346fd9; "
               "the architecture, special ids and tokenizer length (126349) from that probe and from "
               "Megatron-Bridge's LLaDA-1.5 bridge. Modelled: config.json and the tokenizer files as Instruct's "
               "(no unedited public copy), generation_config.json from a copy that may be edited",
               layer_major=True),
    Checkpoint("Dream-org/Dream-v0-Instruct-7B", "dream", DREAM_CONFIG, DREAM_GENERATION_CONFIG,
               "every JSON file, vocab.json, merges.txt and the index: one public copy (see the module docstring)"),
    Checkpoint("Dream-org/Dream-v0-Base-7B", "dream", DREAM_CONFIG, DREAM_GENERATION_CONFIG,
               "its special tokens (pad and eos <|endoftext|> 151643, bos <|beginoftext|> 151665) from an lm-eval "
               "log of revision 6572adb5. Modelled: every file as Instruct's (no public copy of its config or "
               "tokenizer files was found)"),
    Checkpoint("apple/DiffuCoder-7B-Instruct", "dream", DIFFUCODER_CONFIG,
               {**_DREAM_GENERATION, "transformers_version": "4.51.3"},
               "config.json verbatim (the hub's blob page); the file list (chat_template.jinja, no tokenizer.json, "
               "zero_to_fp32.py) from a download log of revision b7b61c3e; <|dlm_pad|> = 151667 as the tokenizer's "
               "pad from the model card (a new pad token), third-party notes and added_tokens.json's size (one "
               "entry more than Dream's). Modelled: tokenizer_config.json and special_tokens_map.json as Dream's "
               "with that pad, chat_template.jinja as Dream's template (the same size), generation_config.json "
               "as Dream's with this version",
               dlm_pad=True, template_file=True, extra_code=("zero_to_fp32.py",)),
    Checkpoint("apple/DiffuCoder-7B-cpGRPO", "dream", DIFFUCODER_CONFIG,
               {**_DREAM_GENERATION, "transformers_version": "4.52.0.dev0"},
               "generation_config.json verbatim (the hub's blob page, commit 36651e2); the file list as "
               "DiffuCoder-Instruct's (added_tokens.json of the same size). Modelled: config.json (879 bytes, "
               "not read) and the tokenizer files as DiffuCoder-Instruct's",
               dlm_pad=True, template_file=True, extra_code=("zero_to_fp32.py",)),
    Checkpoint("apple/DiffuCoder-7B-Base", "dream", DIFFUCODER_CONFIG,
               dict(sorted({**_DREAM_GENERATION, "generation_kwargs": {}, "transformers_version": "4.53.0"}.items())),
               "generation_config.json verbatim (the hub's blob page, commit 57fd279); added_tokens.json of "
               "Dream's size (no <|dlm_pad|>) and chat_template.jinja from the file listing. Modelled: config.json "
               "(873 bytes, not read) as DiffuCoder-Instruct's, the tokenizer files as Dream's",
               template_file=True),
    Checkpoint("Dream-org/Dream-Coder-v0-Instruct-7B", "dream", DREAM_CODER_CONFIG,
               {"_from_model_config": True, "bos_token_id": 151665, "eos_token_id": 151643, "pad_token_id": 151643,
                "transformers_version": "4.46.2"},
               "config.json from a third-party copy of the repository (bos 151665, max_position_embeddings 32768, "
               "no use_mrope; its size matches the hub listing), bos 151665 also from a third-party registry of "
               "revision 5d9e88c7; generation_config.json: the only content of its listed size (147 bytes) with "
               "those ids; added_tokens.json of Dream's size. Modelled: the tokenizer files as Dream's; the shard "
               "split (the hub's is 4.78/4.91/4.91/0.63 GB) as Dream's"),
]}


def _config(ck: Checkpoint, layers: int | None, hidden: int | None, intermediate: int | None) -> dict[str, Any]:
    """The published config.json with the layer count and widths asked for (None: the published value)."""
    fam = FAMILIES[ck.family]
    config = dict(ck.config)
    heads = config[fam.heads_key]
    for name, value in (("layers", layers), ("hidden", hidden), ("intermediate", intermediate)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if hidden is not None and (hidden % heads or (hidden // heads) % 2):
        raise ValueError(f"hidden must be a multiple of 2 x {heads} (the published head count, kept; the head "
                         f"dimension must be even for RoPE), got {hidden}")
    if layers is not None:
        config[fam.layers_key] = layers
    if hidden is not None:
        config[fam.hidden_key] = hidden
        if intermediate is None:  # keep the published MLP ratio
            intermediate = max(1, round(ck.config[fam.intermediate_key] * hidden / ck.config[fam.hidden_key]))
    if intermediate is not None:
        config[fam.intermediate_key] = intermediate
    return config


def _saved_order(ck: Checkpoint, names: set[str], layers: int) -> list[str]:
    """The tensors in the order the published checkpoint was saved (see the module docstring)."""
    family = ck.family
    if family == "llada" and ck.layer_major:  # module order: wte, ln_f, each block's tensors, the LM head
        parts = ["attn_out", "ff_out", "attn_norm", "ff_norm", "q_proj", "k_proj", "v_proj", "ff_proj", "up_proj"]
        order = ["model.transformer.wte.weight", "model.transformer.ln_f.weight",
                 *[f"model.transformer.blocks.{i}.{p}.weight" for i in range(layers) for p in parts],
                 "model.transformer.ff_out.weight"]
    elif family == "llada":
        block = "model.transformer.blocks.{}.{}.weight"
        per_type = lambda kind: [block.format(i, kind) for i in range(layers)]  # noqa: E731
        order = ["model.transformer.wte.weight", "model.transformer.ln_f.weight", *per_type("attn_out"),
                 "model.transformer.ff_out.weight", *per_type("ff_out"), *per_type("attn_norm"),
                 *per_type("ff_norm"), *per_type("q_proj"), *per_type("k_proj"), *per_type("v_proj"),
                 *per_type("ff_proj"), *per_type("up_proj")]
    else:
        parts = ["self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                 "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"]
        order = ["model.embed_tokens.weight", *[f"model.layers.{i}.{p}" for i in range(layers) for p in parts],
                 "model.norm.weight", "lm_head.weight"]
    if set(order) != names or len(order) != len(names):
        raise AssertionError(f"the {family} save order does not match the loader's tensor names")
    return order


def _greedy(sizes: list[int], limit: int) -> list[int]:
    """HF's sharding: shard index per tensor, a new shard when the next tensor would pass `limit`."""
    shards, shard, used = [], 0, 0
    for size in sizes:
        if used and used + size > limit:
            shard, used = shard + 1, 0
        shards.append(shard)
        used += size
    return shards


def _assign_shards(sizes: list[int], count: int, published_limit: int) -> list[int]:
    """Shard index per tensor, in order, exactly `count` non-empty shards: HF's greedy split at the published
    limit where that gives `count` (the published sizes), else the most even contiguous split."""
    if len(sizes) < count:
        raise ValueError(f"{len(sizes)} tensors cannot fill {count} shards")
    shards = _greedy(sizes, published_limit)
    if shards[-1] + 1 == count:
        return shards
    low, high = max(sizes), sum(sizes)  # the smallest limit that needs at most `count` shards
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if _greedy(sizes, mid)[-1] < count else (mid + 1, high)
    shards = _greedy(sizes, low)
    starts = [i for i, s in enumerate(shards) if i == 0 or s != shards[i - 1]]
    while len(starts) < count:  # split the largest shard of several tensors at its most even point
        bounds = list(zip(starts, [*starts[1:], len(sizes)]))
        begin, end = max((b for b in bounds if b[1] - b[0] > 1), key=lambda b: sum(sizes[b[0]:b[1]]))
        total = sum(sizes[begin:end])
        cut = min(range(begin + 1, end), key=lambda c: max(sum(sizes[begin:c]), total - sum(sizes[begin:c])))
        starts = sorted([*starts, cut])
    return [sum(1 for s in starts if s <= i) - 1 for i in range(len(sizes))]


@dataclasses.dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]
    kind: Literal["weight", "norm"]  # what values it gets

    @property
    def nbytes(self) -> int:
        return 2 * int(np.prod(self.shape))


def _plan(ck: Checkpoint, config: dict[str, Any]) -> list[tuple[str, list[_Tensor]]]:
    """(shard file name, its tensors sorted by name) for every shard."""
    fam = FAMILIES[ck.family]
    entries = key_map(ModelConfig.from_hf(config))
    order = _saved_order(ck, set(entries), config[fam.layers_key])
    tensors = [_Tensor(n, entries[n].hf_shape,
                       "norm" if len(entries[n].hf_shape) == 1 and not n.endswith(".bias") else "weight")
               for n in order]
    shard_of = _assign_shards([t.nbytes for t in tensors], fam.shards, fam.shard_limit)
    return [(f"model-{s + 1:05d}-of-{fam.shards:05d}.safetensors",
             sorted((t for t, i in zip(tensors, shard_of) if i == s), key=lambda t: t.name))
            for s in range(fam.shards)]


def _index(plan: list[tuple[str, list[_Tensor]]]) -> dict[str, Any]:
    weight_map = {t.name: file for file, tensors in plan for t in tensors}
    total = sum(t.nbytes for _, tensors in plan for t in tensors)
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def _json(value: Any, indent: int, newline: bool) -> bytes:
    return (json.dumps(value, indent=indent, ensure_ascii=False) + ("\n" if newline else "")).encode("utf-8")


def _text_files(ck: Checkpoint, config: dict[str, Any], plan: list[tuple[str, list[_Tensor]]]) -> dict[str, bytes]:
    """Every file of the snapshot but the shards and LLaDA's tokenizer.json (written by the tokenizers
    library), as bytes. config.json comes last: it is written last."""
    fam, repo = FAMILIES[ck.family], ck.repo
    if ck.family == "llada":
        content: dict[str, Any] = {"generation_config.json": ck.generation_config,
                                   "special_tokens_map.json": _llada_special_tokens_map(),
                                   "tokenizer_config.json": _llada_tokenizer_config(ck.chat_markers)}
        code = ["configuration_llada.py", "modeling_llada.py"]
    else:
        vocab = _vocab(DREAM_FIRST_ADDED_ID, DREAM_PINNED, DREAM_MERGES)
        content = {"added_tokens.json": {t: DREAM_FIRST_ADDED_ID + i for i, (t, _) in sorted(
                       enumerate(_dream_added(ck.dlm_pad)), key=lambda x: x[1][0])},
                   "generation_config.json": ck.generation_config,
                   "special_tokens_map.json": _dream_special_tokens_map(ck.dlm_pad),
                   "tokenizer_config.json": _dream_tokenizer_config(ck.dlm_pad, ck.template_file),
                   "vocab.json": dict(sorted(vocab.items()))}
        code = ["configuration_dream.py", "generation_utils.py", "modeling_dream.py", "tokenization_dream.py"]
    code += ck.extra_code
    files = {name: _json(value, *fam.json_format[name]) for name, value in content.items()}
    if ck.family == "llada" and not ck.chat_markers:
        files["special_tokens_map.json"] = _llada_base_special_tokens_map()
    if ck.family == "dream":
        files["merges.txt"] = ("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in DREAM_MERGES)).encode("utf-8")
    if ck.template_file:
        files["chat_template.jinja"] = DREAM_CHAT_TEMPLATE.encode()
    files[INDEX_FILE] = _json(_index(plan), *fam.json_format[INDEX_FILE])
    for name in code:
        files[name] = (f"raise RuntimeError({name!r} ' of a synthetic {repo} snapshot (eval/hf_snapshot.py): "
                       "remote code is never to be run')\n").encode()
    files["README.md"] = (f"# Synthetic {repo} snapshot\n\nWritten by eval/hf_snapshot.py in the file layout of "
                          f"https://huggingface.co/{repo} with RANDOM weights and a synthetic vocabulary around "
                          "the real special tokens. Not the model; for tests only.\n").encode()
    files[".gitattributes"] = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    files["config.json"] = _json(config, *fam.json_format["config.json"])
    return files


# -- weights -----------------------------------------------------------------------------------------

class _Values:
    """Random bf16 values for every tensor, cut from two pools drawn once (weights ~N(0, 0.02), norms
    ~1 + N(0, 0.1)) at random offsets: drawing 8G values one by one would take minutes."""

    def __init__(self, seed: int, elements: int):
        self.rng = np.random.default_rng(seed)
        self.pools = {"weight": self._pool(min(POOL_ELEMENTS, max(elements, 1)), 0.0, 0.02),
                      "norm": self._pool(min(NORM_POOL_ELEMENTS, max(elements, 1)), 1.0, 0.1)}

    def _pool(self, elements: int, mean: float, std: float) -> memoryview:
        """`elements` bf16 values ~N(mean, std), drawn in chunks (no float32 copy of the whole pool)."""
        pool = np.empty(elements, BF16)
        for begin in range(0, elements, 1 << 22):
            end = min(elements, begin + (1 << 22))
            pool[begin:end] = mean + std * self.rng.standard_normal(end - begin, dtype=np.float32)
        return memoryview(pool.view(np.uint8))

    def write(self, out: BinaryIO, tensor: _Tensor) -> None:
        """The tensor's bytes, streamed: the pool from a random offset, wrapping around as often as needed."""
        pool = self.pools[tensor.kind]
        start = 2 * int(self.rng.integers(0, len(pool) // 2))
        left = tensor.nbytes
        while left:
            chunk = min(left, len(pool) - start)
            out.write(pool[start:start + chunk])
            left -= chunk
            start = 0


def _safetensors_header(tensors: list[_Tensor]) -> bytes:
    """The length-prefixed JSON header, offsets in the given order, padded with spaces to 8 bytes as the
    safetensors library pads it."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _shard_writer(tensors: list[_Tensor], values: _Values) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        with open(path, "wb") as out:
            out.write(_safetensors_header(tensors))
            for tensor in tensors:
                values.write(out, tensor)
    return write


# -- the entry point ---------------------------------------------------------------------------------

def checkpoint(name: str) -> Checkpoint:
    """A checkpoint of CHECKPOINTS by its repository ("GSAI-ML/LLaDA-1.5"), the repository's own name
    ("LLaDA-1.5"), or a family ("llada", "dream": LLaDA-8B-Instruct, Dream-v0-Instruct-7B)."""
    by_name = {**{ck.repo: ck for ck in CHECKPOINTS.values()},
               **{ck.repo.split("/")[1]: ck for ck in CHECKPOINTS.values()},
               "llada": CHECKPOINTS["GSAI-ML/LLaDA-8B-Instruct"], "dream": CHECKPOINTS["Dream-org/Dream-v0-Instruct-7B"]}
    if name not in by_name:
        raise ValueError(f"unknown checkpoint {name!r}; known: 'llada', 'dream', {sorted(CHECKPOINTS)}")
    return by_name[name]


def write_snapshot(directory: str | Path, name: str, layers: int | None = None, hidden: int | None = None,
                   intermediate: int | None = None, seed: int = 0) -> Path:
    """Write an HF snapshot laid out as the checkpoint `name` (see `checkpoint`: "llada" is
    GSAI-ML/LLaDA-8B-Instruct, "dream" Dream-org/Dream-v0-Instruct-7B) into `directory` (created if
    needed); returns it.

    layers: the layer count (n_layers / num_hidden_layers); default the published one.
    hidden: the model width (d_model / hidden_size), a multiple of 2 x the published head count (LLaDA 64,
    Dream 56: the head counts are kept); default the published one. intermediate: the MLP width; default
    the published one scaled like `hidden`. Only these config.json values change; the vocabulary keeps its
    real size (the token ids must stay real), so the embedding and LM head dominate a small model.
    seed: the weights' random values. A directory that already holds a config.json is refused (a complete
    snapshot, or someone else's); leftovers of an interrupted write are overwritten.
    """
    directory = Path(directory)
    ck = checkpoint(name)
    config = _config(ck, layers, hidden, intermediate)
    if (directory / "config.json").exists():
        raise FileExistsError(f"{directory} already holds a snapshot (config.json); refusing to overwrite it")
    plan = _plan(ck, config)
    directory.mkdir(parents=True, exist_ok=True)
    values = _Values(seed, sum(t.nbytes // 2 for _, tensors in plan for t in tensors))
    for name, tensors in plan:
        write_atomic(directory / name, _shard_writer(tensors, values))
    if ck.family == "llada":
        write_atomic(directory / "tokenizer.json", functools.partial(_llada_tokenizer_json,
                                                                     chat_markers=ck.chat_markers))
    for file, data in _text_files(ck, config, plan).items():  # config.json last
        write_atomic(directory / file, data)
    return directory
