"""eval/hf_snapshot.py: synthetic HF snapshots in the exact layouts of GSAI-ML/LLaDA-8B-Instruct and
Dream-org/Dream-v0-Instruct-7B load and tokenize with the real ids and chat templates (every other published
checkpoint, and a decode of each: tests/test_checkpoints.py).

The tests and the real-scale check lean on these snapshots standing in for the published ones, so what
can be compared with the published repositories is compared: the JSON files written at the published size
against the sha256 digests of the published files (read from public copies; see eval/hf_snapshot.py), and
chat encodings against token ids of the real tokenizers (LLaDA: ids printed by third-party code run on the
real tokenizer; Dream: computed from the published vocab.json / merges.txt). The models are tiny (1 layer,
width 128 / 112) but keep the real vocabularies' sizes, so that every token id is real.
"""

from __future__ import annotations

import hashlib
import json
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

import acache_jax
from acache_jax.network.hf_checkpoint import INDEX_FILE
from acache_jax.network.tokenizer import import_transformers
from eval import hf_snapshot

WIDTH = {"llada": 128, "dream": 112}  # multiples of 2 x the published head counts (32, 28)

# sha256 of the published files (GSAI-ML/LLaDA-8B-Instruct: two byte-identical public copies;
# Dream-org/Dream-v0-Instruct-7B: one public copy).
PUBLISHED_SHA256 = {
    "llada": {
        "config.json": "5f99fefe855fdb5100bb6cadb57bdb09fae723ad54811f95c00ecacf29d58a6a",
        "generation_config.json": "00b3d1ffda2ca0a45633deb52ca4413dda046e7c94e9b05b73ed4a565b0677b3",
        "special_tokens_map.json": "e9f1f0f6fa133da3169ae69b1969c51cced047a900050893d7a0711c6bd063aa",
        "tokenizer_config.json": "b9a6102c39a4f42f47f0d63fc6cee58a2381199d90f2a4f39b3f6871f32b4119",
        INDEX_FILE: "28b4ec27206e42e7ade630450e6ce618bd197acf34d35120e8e86d2bb910a408",
    },
    "dream": {
        "config.json": "11afc7fe7a1881e73dcd70cca6868aaaf8eb89ad45ea5fc6426c3fb82dec9340",
        "generation_config.json": "e4fa42a31ef22740804534395c7a18f335a3c1f9abd9db83a6941b1c8748b2ee",
        "special_tokens_map.json": "fa14641fdc084244b0a530556b1d5bfcb9fa0ed9151a780ffec3b44ba96a0dfe",
        "tokenizer_config.json": "b0e9c1a6299d8832a1362d6b24f007de8a2acfe0243d8a3a1d1b57aa8250f7ee",
        "added_tokens.json": "32ad9d49fafda64e737853737fe3be3e33cce3f719a159ed73f04cbd81a690ce",
        INDEX_FILE: "998a078123ffc97763690de7f2a677eb89168af5eaf8a5e12e6bc24d18e25bdb",
    },
}
# Other checkpoints' files whose published digests were read (eval/hf_snapshot.py CHECKPOINTS says where).
PUBLISHED_SHA256_OTHERS = {
    "GSAI-ML/LLaDA-8B-Base": {
        **{k: PUBLISHED_SHA256["llada"][k] for k in ("config.json", "generation_config.json", INDEX_FILE)},
        "tokenizer_config.json": "6e9f41633217287fcf9a58890efb26e91e905bd6ae2234b534b65e0c36f4dd3c",
        "special_tokens_map.json": "981e83321bd28bee90ad62ce1bd0baa0fcef3540dd29ca35e2116ec5577fef71",
    },
    "GSAI-ML/LLaDA-1.5": {INDEX_FILE: "529c88f26aebf7797ba124ceea1e0a574f5057b3b54132800c2a2e20e79d862c"},
}
FILES = {
    "llada": {".gitattributes", "README.md", "config.json", "configuration_llada.py", "generation_config.json",
              *(f"model-0000{i}-of-00006.safetensors" for i in range(1, 7)), INDEX_FILE, "modeling_llada.py",
              "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"},
    "dream": {".gitattributes", "README.md", "added_tokens.json", "config.json", "configuration_dream.py",
              "generation_config.json", "generation_utils.py", "merges.txt",
              *(f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)), INDEX_FILE, "modeling_dream.py",
              "special_tokens_map.json", "tokenization_dream.py", "tokenizer_config.json", "vocab.json"},
}
# (mask, eos, pad, bos in config.json, tokenizer length, the chat template's end-of-turn id)
IDS = {"llada": (126336, 126081, 126081, None, 126349, 126348),
       "dream": (151666, 151643, 151643, 151643, 151667, 151645)}
# model.encode("Hello, how are you?") with the real tokenizers. LLaDA: bos from its template, the rest as
# printed for the real tokenizer (user header 126346, 3840, 126347, 198, 198; the text 14455, 11, 1099,
# 449, 362, 30; the assistant header 126348, 126346, 598, 10450, 126347, 198, 198). Dream: from the
# published vocab.json / merges.txt and chat template (default system prompt included).
HELLO = "Hello, how are you?"
REAL_HELLO_IDS = {
    "llada": [126080, 126346, 3840, 126347, 198, 198, 14455, 11, 1099, 449, 362, 30, 126348, 126346, 598, 10450,
              126347, 198, 198],
    "dream": [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198, 9707, 11, 1246,
              525, 498, 30, 151645, 198, 151644, 77091, 198],
}


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-snapshots")
    return {family: hf_snapshot.write_snapshot(root / family, family, layers=1, hidden=width)
            for family, width in WIDTH.items()}


@pytest.fixture(scope="module")
def models(snapshots) -> dict[str, acache_jax.Model]:
    return {family: acache_jax.load(path) for family, path in snapshots.items()}


@pytest.mark.parametrize("name", ["llada", "dream", *PUBLISHED_SHA256_OTHERS])
def test_published_size_files_are_the_published_bytes(name):
    """At the published size every JSON file we reproduce, the shard index included (same shard files,
    same split of 291 / 339 tensors), is byte for byte the published one: no 16 GB needed to check."""
    published = PUBLISHED_SHA256.get(name) or PUBLISHED_SHA256_OTHERS[name]
    ck = hf_snapshot.checkpoint(name)
    config = hf_snapshot._config(ck, None, None, None)
    files = hf_snapshot._text_files(ck, config, hf_snapshot._plan(ck, config))
    digests = {file: hashlib.sha256(files[file]).hexdigest() for file in published}
    assert digests == published


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_layout_and_weights(family, snapshots):
    """The published file names; config.json as published but for the sizes asked for; every shard a
    valid safetensors file (read by the safetensors library) holding what the index says, bf16, finite."""
    path = snapshots[family]
    assert {p.name for p in path.iterdir()} == FILES[family]
    config = json.loads((path / "config.json").read_text())
    published = hf_snapshot.checkpoint(family).config
    changed = {k for k in published if config[k] != published[k]}
    assert list(config) == list(published)
    assert changed == ({"n_layers", "d_model", "mlp_hidden_size"} if family == "llada"
                       else {"num_hidden_layers", "hidden_size", "intermediate_size"})
    index = json.loads((path / INDEX_FILE).read_text())
    total, seen = 0, set()
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / shard), framework="numpy") as f:
            assert f.metadata() == {"format": "pt"}
            assert sorted(f.keys()) == sorted(k for k, v in index["weight_map"].items() if v == shard)
            for key in f.keys():
                tensor = f.get_tensor(key).astype(np.float32)
                assert f.get_slice(key).get_dtype() == "BF16" and np.isfinite(tensor).all()
                total += 2 * tensor.size
                seen.add(key)
                if tensor.ndim == 1 and not key.endswith(".bias"):  # norms ~1
                    assert 0.8 < tensor.mean() < 1.2
                elif tensor.size > 10_000:  # matrices ~N(0, 0.02)
                    assert 0.015 < tensor.std() < 0.025
    assert set(index["weight_map"].values()) == {name for name in FILES[family] if "-of-" in name}
    assert seen == set(index["weight_map"]) and total == index["metadata"]["total_size"]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_load_ids_and_chat_encoding(family, models, snapshots):
    """`load` reads the snapshot; the special ids are the real ones; `encode` applies the real chat
    template and gives the real tokenizer's ids, and what transformers gives from the same files."""
    model = models[family]
    mask, eos, pad, bos, length, end_of_turn = IDS[family]
    cfg = model.config
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (mask, eos, pad, bos)
    tok = model.tokenizer
    assert len(tok) == length and tok.eos_token_id == eos and tok.pad_token_id == pad
    assert tok.convert_tokens_to_ids("<|mdm_mask|>" if family == "llada" else "<|mask|>") == mask
    assert {eos, end_of_turn} <= model.stop_token_ids
    assert model.encode(HELLO) == REAL_HELLO_IDS[family]

    transformers = import_transformers()
    if family == "llada":  # loads without remote code: AutoTokenizer, as a user would
        ref = transformers.AutoTokenizer.from_pretrained(str(snapshots[family]), trust_remote_code=False)
        assert tok(HELLO)["input_ids"] == [14455, 11, 1099, 449, 362, 30]  # the real one adds no BOS
    else:  # AutoTokenizer would run tokenization_dream.py; transformers' Qwen2 reading of the files
        ref = transformers.Qwen2Tokenizer.from_pretrained(str(snapshots[family]))
    for text in ("hi", HELLO):
        expected = ref.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
        assert model.encode(text) == list(expected)
    assert "tokenization_dream" not in sys.modules
    assert isinstance(tok.decode([cfg.vocab_size - 1, length - 1, 1000]), str)  # a padding id decodes too


def test_remote_code_stub_raises_and_snapshots_are_not_overwritten(snapshots, tmp_path):
    with pytest.raises(RuntimeError, match="never to be run"):
        runpy.run_path(str(snapshots["dream"] / "tokenization_dream.py"))
    with pytest.raises(FileExistsError):
        hf_snapshot.write_snapshot(snapshots["llada"], "llada", layers=1, hidden=128)
    with pytest.raises(ValueError, match="multiple of 2 x 28"):
        hf_snapshot.write_snapshot(tmp_path / "bad", "dream", layers=1, hidden=100)
    assert not (tmp_path / "bad").exists()
