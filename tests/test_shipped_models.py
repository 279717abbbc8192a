"""The models shipped in acache_jax/models: their HF files, held-out accuracy, and the CLI default."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

import acache_jax
from acache_jax.generate import DEFAULT_MODEL
from eval.accuracy import accuracy
from eval.tokenizer import build_tokenizer
from eval.train import model_config
from tests.hf_checkpoints import hf_shapes

MODELS = Path(acache_jax.__file__).resolve().parent / "models"
FAMILY = {"llada-small": "llada", "dream-small": "dream"}


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_files_are_the_familys_hf_layout_and_small(name):
    directory = MODELS / name
    hf = json.loads((directory / "config.json").read_text())
    assert hf["model_type"].lower() == FAMILY[name]  # upstream spells them "llada" and "Dream"
    with safe_open(directory / "model.safetensors", "np") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == hf_shapes(hf)
    assert (directory / "model.safetensors").stat().st_size <= 10e6
    tokenizer = build_tokenizer()  # the shipped tokenizer is the one the tasks build
    assert json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"] == tokenizer.get_vocab()
    model = acache_jax.load(directory)
    assert model.config == model_config(FAMILY[name], tokenizer.get_vocab_size(), {
        k: getattr(model.config, k) for k in ("mask_token_id", "eos_token_id", "pad_token_id")})


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_held_out_babi_accuracy_is_at_least_ninety_percent(name):
    """A CPU-sized sample of the acceptance measurement (docs/TRAINING.md has n = 256)."""
    assert accuracy(acache_jax.load(MODELS / name), "babi", "none", 0, n=48) >= 0.9


def test_generate_uses_the_shipped_llada_model_by_default():
    assert DEFAULT_MODEL == MODELS / "llada-small"
    prompt = ("Story: Mary moved to the bathroom. John went to the hallway. Mary travelled to the garden. "
              "Question: Where is Mary? Answer with one location:")
    run = subprocess.run([sys.executable, "-m", "acache_jax.generate", "--prompt", prompt, "--gen-length", "32",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["text"].strip() == "garden"
