"""The models shipped in acache_jax/models: their HF files, held-out accuracy, and the CLI default."""

import functools
import json
from pathlib import Path

import pytest
from safetensors import safe_open

import acache_jax
from acache_jax.generate import DEFAULT_MODEL
from eval.accuracy import accuracy
from eval.anchor_analysis import analyse
from eval.tokenizer import build_tokenizer
from eval.train import model_config
from tests.hf_checkpoints import hf_shapes

MODELS = Path(acache_jax.__file__).resolve().parent / "models"
FAMILY = {"llada-small": "llada", "dream-small": "dream"}


@functools.cache
def shipped(name: str) -> acache_jax.Model:
    return acache_jax.load(MODELS / name)


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
    model = shipped(name)
    assert model.config == model_config(FAMILY[name], tokenizer.get_vocab_size(), {
        k: getattr(model.config, k) for k in ("mask_token_id", "eos_token_id", "pad_token_id")})


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_held_out_babi_accuracy_is_at_least_ninety_percent(name):
    """A CPU-sized sample of the acceptance measurement (docs/TRAINING.md has n = 256)."""
    assert accuracy(shipped(name), "babi", "none", 0, n=48) >= 0.9


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_the_few_shot_affix_answers_the_codebook_task(name):
    """Only the examples show the codebook: without them the answer is a guess (docs/RESULTS.md)."""
    assert accuracy(shipped(name), "codebook", "none", 0, n=32) <= 0.25
    assert accuracy(shipped(name), "codebook", "prefix", 1, n=32) >= 0.5


def test_the_cli_default_is_the_shipped_llada_model():
    """(tests/test_readme.py runs the README's first command, no flag but --prompt, and checks its answer.)"""
    assert DEFAULT_MODEL == MODELS / "llada-small"


def test_anchor_analysis_finds_the_asked_binding_by_kv_deviation():
    """docs/RESULTS.md: dream-small's asked binding is where its K/V change in context."""
    row = analyse(shipped("dream-small"), "prefix", 1, n=16, ratio=0.2)
    assert row["anchors"] == 7 and row["affix_len"] == 34
    assert row["hkvd"]["colour_in_anchors"] == 1.0
    assert row["attention"]["colour_in_anchors"] < 0.5
