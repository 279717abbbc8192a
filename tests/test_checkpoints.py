"""Every published checkpoint of the two families (README "Supported checkpoints") loads, converts,
tokenizes, takes its own generation defaults and decodes; the look-alikes of other architectures are
refused in one line that names them.

Each checkpoint is a tiny snapshot in its exact published layout (eval/hf_snapshot.py: the file set,
config.json, generation_config.json, tokenizer files, special and added tokens at their real ids; one
layer, a narrow width, the real vocabulary sizes). Chat encodings are compared with what transformers
makes of the same files: AutoTokenizer for the LLaDA layout, transformers' Qwen2 reading of vocab.json
and merges.txt for the Dream layout (AutoTokenizer would run the snapshot's remote code).
"""

from __future__ import annotations

import json
import shlex

import jax
import numpy as np
import pytest

import acache_jax
from acache_jax import generate as generate_cli
from acache_jax.network.config import ConfigError, DecodeConfig
from acache_jax.network.tokenizer import import_transformers
from convert import convert
from eval import hf_snapshot
from tests.test_readme import PARSE

WIDTH = {"llada": 64, "dream": 56}  # 2 x the published head counts: the narrowest widths
HELLO = "Hello, how are you?"
LLADA_HELLO = [14455, 11, 1099, 449, 362, 30]  # the real LLaDA tokenizer's ids of HELLO (tests/test_hf_snapshot.py)
DREAM_GENERATION = dict(alg="origin", steps=512, temperature=0.0)  # Dream's generation_config.json



LLADA = dict(mask=126336, eos=126081, pad=126081, bos=None)
DREAM = dict(mask=151666, eos=151643, pad=151643, bos=151643)
# Per checkpoint: special ids (config.json), tokenizer length, ids generated text must end at, whether a
# user turn goes through the chat template, and the generation defaults its files set.
EXPECTED = {
    "GSAI-ML/LLaDA-8B-Instruct": {**LLADA, "length": 126349, "stops": {126081, 126348}, "chat": True, "defaults": {}},
    # Instruct's template without Instruct's marker tokens: prompted with plain text, as upstream does
    "GSAI-ML/LLaDA-8B-Base": {**LLADA, "length": 126346, "stops": {126081}, "chat": False, "defaults": {}},
    "GSAI-ML/LLaDA-1.5": {**LLADA, "length": 126349, "stops": {126081, 126348}, "chat": True, "defaults": {}},
    "Dream-org/Dream-v0-Instruct-7B": {**DREAM, "length": 151667, "stops": {151643, 151645}, "chat": True,
                                       "defaults": DREAM_GENERATION},
    "Dream-org/Dream-v0-Base-7B": {**DREAM, "length": 151667, "stops": {151643, 151645}, "chat": True,
                                   "defaults": DREAM_GENERATION},
    # answers end with <|im_end|>, then <|dlm_pad|> fills the generation
    "apple/DiffuCoder-7B-Instruct": {**DREAM, "length": 151668, "stops": {151643, 151645, 151667}, "chat": True,
                                     "defaults": DREAM_GENERATION},
    "apple/DiffuCoder-7B-cpGRPO": {**DREAM, "length": 151668, "stops": {151643, 151645, 151667}, "chat": True,
                                   "defaults": DREAM_GENERATION},
    "apple/DiffuCoder-7B-Base": {**DREAM, "length": 151667, "stops": {151643, 151645}, "chat": True,
                                 "defaults": DREAM_GENERATION},
    # its generation_config.json sets no decoding keys: DecodeConfig's defaults
    "Dream-org/Dream-Coder-v0-Instruct-7B": {**DREAM, "bos": 151665, "length": 151667, "stops": {151643, 151645},
                                             "chat": True, "defaults": dict(alg=DecodeConfig.alg, steps=None)},
}


# The README's command per checkpoint ("Supported checkpoints": the authors' recommended decoding).
README_COMMANDS = {repo: shlex.split(command) for repo in EXPECTED for command in PARSE
                   if f"/path/to/{repo.split('/')[1]} " in command}
# After the README's own flags, so they win: one token a step as those commands decode, over 4 tokens
# (each step samples the real vocabulary, 126k-152k columns: most of this test's time on a CPU)
SHORT = ["--gen-length", "4", "--block-length", "4", "--steps", "4"]


def test_every_checkpoint_is_tested_and_documented():
    assert set(EXPECTED) == set(hf_snapshot.CHECKPOINTS) == set(README_COMMANDS)


@pytest.mark.parametrize("repo", list(EXPECTED))
def test_checkpoint_loads_converts_chats_and_decodes(repo, tmp_path, capsys):
    ck, want = hf_snapshot.CHECKPOINTS[repo], EXPECTED[repo]
    snapshot = hf_snapshot.write_snapshot(tmp_path / "hf", repo, layers=1, hidden=WIDTH[ck.family])
    model = acache_jax.load(snapshot)
    cfg, tok = model.config, model.tokenizer
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (
        want["mask"], want["eos"], want["pad"], want["bos"])
    assert len(tok) == want["length"] and want["stops"] <= model.stop_token_ids
    assert cfg.mask_token_id not in model.stop_token_ids

    transformers = import_transformers()
    if ck.family == "llada":
        ref = transformers.AutoTokenizer.from_pretrained(str(snapshot), trust_remote_code=False)
    else:
        ref = transformers.Qwen2Tokenizer.from_pretrained(str(snapshot))
    if want["chat"]:
        for text in ("hi", HELLO):
            expected = ref.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
            assert model.encode(text) == list(expected)
    else:
        assert tok.chat_template is None and ref.chat_template is not None  # shipped, but not usable here
        assert model.encode(HELLO) == ref(HELLO)["input_ids"] == LLADA_HELLO

    defaults = model.generation_config
    assert {k: getattr(defaults, k) for k in want["defaults"]} == want["defaults"]

    converted = acache_jax.load(convert(snapshot, tmp_path / "ours"))
    assert converted.config == cfg and converted.generation_config == defaults
    assert converted.stop_token_ids == model.stop_token_ids and converted.encode(HELLO) == model.encode(HELLO)
    assert len(converted.tokenizer) == len(tok)
    same = jax.tree.map(lambda a, b: a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)),
                        model.params, converted.params)  # on the host: no program to compile per shape
    assert all(jax.tree.leaves(same))  # bit for bit, in the dtype both load in (bf16)

    argv = README_COMMANDS[repo][3:]  # after ".venv/bin/python -m acache_jax.generate"
    argv[argv.index("--model") + 1] = str(tmp_path / "ours")  # the converted directory
    capsys.readouterr()
    assert generate_cli.main([*argv, *SHORT, "--json"]) == 0  # its sampling flags, on its model
    row = json.loads(capsys.readouterr().out)
    tokens = np.asarray(row["tokens"])
    assert tokens.shape == (4,) and ((0 <= tokens) & (tokens < cfg.vocab_size)).all() and isinstance(row["text"], str)
    assert cfg.mask_token_id not in tokens  # every position committed, never to [MASK] (Diffulex #39's symptom)


def test_dream_coder_and_diffucoder_files_differ_from_dream_where_published():
    """The published differences the table relies on: Dream-Coder's bos and context, DiffuCoder's
    pad token and chat_template.jinja, LLaDA-1.5's shard split."""
    assert hf_snapshot.CHECKPOINTS["Dream-org/Dream-Coder-v0-Instruct-7B"].config["max_position_embeddings"] == 32768
    ck = hf_snapshot.CHECKPOINTS["apple/DiffuCoder-7B-Instruct"]
    config = hf_snapshot._config(ck, None, None, None)
    files = hf_snapshot._text_files(ck, config, hf_snapshot._plan(ck, config))
    assert "chat_template.jinja" in files and "chat_template" not in json.loads(files["tokenizer_config.json"])
    assert json.loads(files["added_tokens.json"])["<|dlm_pad|>"] == 151667
    assert len(files["config.json"]) == 875 and len(files["added_tokens.json"]) == 681  # the listed sizes


# One config.json per look-alike, as published (model_type, architectures and distinctive keys).
LOOK_ALIKES = {
    "LLaDA-MoE": ({"model_type": "llada", "architectures": ["LLaDAMoEModelLM"], "hidden_size": 2048,
                   "num_hidden_layers": 16, "num_experts": 64, "num_experts_per_tok": 8}, "LLaDA-MoE"),
    "LLaDA2.0-mini": ({"model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"], "hidden_size": 2048,
                       "num_experts": 256}, "LLaDA2.x"),
    "LLaDA-V": ({"model_type": "llava_llada", "architectures": ["LlavaLLaDAModelLM"],
                 "mm_vision_tower": "google/siglip2-so400m-patch14-384"}, "LLaDA-V"),
    "SDAR": ({"model_type": "sdar", "architectures": ["SDARForCausalLM"], "block_size": 4, "mask_token_id": 151669},
             "SDAR / TraDo"),
    "Fast-dLLM v2": ({"model_type": "Fast_dLLM_Qwen", "architectures": ["Fast_dLLM_QwenForCausalLM"], "bd_size": 32,
                      "hidden_size": 3584}, "Fast-dLLM v2"),
    "DiffusionGemma": ({"model_type": "diffusion_gemma", "architectures": ["DiffusionGemmaForBlockDiffusion"],
                        "canvas_length": 256}, "DiffusionGemma"),
    "Nemotron diffusion": ({"model_type": "nemotron_labs_diffusion", "architectures": ["NemotronLabsDiffusionModel"],
                            "mask_token_id": 100, "block_size": 32}, "Nemotron-Labs Diffusion"),
    "GPTQ LLaDA": ({**hf_snapshot.LLADA_CONFIG, "quantization_config": {"bits": 4, "group_size": 128,
                                                                         "quant_method": "gptq"}}, "quantized"),
    "MLX LLaDA": ({**hf_snapshot.LLADA_CONFIG, "quantization": {"bits": 4, "group_size": 64}}, "quantized"),
}


@pytest.mark.parametrize("name", list(LOOK_ALIKES))
def test_look_alike_is_refused_by_name(name, tmp_path):
    config, named = LOOK_ALIKES[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the config is refused first
    for attempt in (lambda: acache_jax.load(tmp_path), lambda: convert(tmp_path, tmp_path / "out")):
        with pytest.raises(ConfigError) as error:
            attempt()
        message = str(error.value)
        assert named in message and "not supported" in message and "\n" not in message
    assert not (tmp_path / "out").exists()
