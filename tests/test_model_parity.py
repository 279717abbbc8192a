"""Our logits against transformers' Llama/Qwen2 with the causal mask removed (fixtures made by
tests/fixtures/generate_model_fixtures.py)."""

import numpy as np
import pytest

import acache_jax

CASES = ["llada_mha", "llada_gqa_bias", "dream_gqa"]


def _reference(fixtures_dir, name):
    return fixtures_dir / "models" / name, np.load(fixtures_dir / "models" / name / "reference.npz")


@pytest.mark.parametrize("name", CASES)
def test_fp32_logits_match_pytorch(fixtures_dir, name):
    path, ref = _reference(fixtures_dir, name)
    model = acache_jax.load(path, dtype="float32")
    logits = np.asarray(model.logits(ref["ids"]))
    assert logits.dtype == np.float32 and logits.shape == ref["logits_fp32"].shape
    assert np.abs(logits - ref["logits_fp32"]).max() <= 1e-4


@pytest.mark.parametrize("name", CASES)
def test_bf16_logits_as_close_as_pytorch_bf16(fixtures_dir, name):
    """bf16 keeps 8 mantissa bits, so each rounding moves a value by up to 2**-8 relative, and the two
    implementations round at different points (e.g. Qwen2 rotates in bf16, we in fp32). The fair bar
    is PyTorch's own bf16 error against the fp32 truth (about 1.5-2% relative L2 on these random
    2-layer models): ours may be at most 1.5x that in relative L2 and 2x in max abs error."""
    path, ref = _reference(fixtures_dir, name)
    logits = np.asarray(acache_jax.load(path, dtype="bfloat16").logits(ref["ids"]))
    truth = ref["logits_fp32"]
    rel = lambda x: np.linalg.norm(x - truth) / np.linalg.norm(truth)
    assert np.abs(logits - truth).max() <= 2 * np.abs(ref["logits_bf16"] - truth).max()
    assert rel(logits) <= 1.5 * rel(ref["logits_bf16"])


def test_attention_is_bidirectional(fixtures_dir):
    path, ref = _reference(fixtures_dir, "llada_mha")
    model = acache_jax.load(path, dtype="float32")
    ids = np.array(ref["ids"][:1])
    changed = ids.copy()
    changed[0, -1] = (changed[0, -1] + 1) % model.config.vocab_size
    a, b = np.asarray(model.logits(ids)), np.asarray(model.logits(changed))
    assert np.abs(a[0, 0] - b[0, 0]).max() > 1e-3  # the first position sees the last token


def test_dream_logits_are_shifted(fixtures_dir):
    """Row i comes from the hidden state at i-1 and row 0 keeps its own, so rows 0 and 1 are equal."""
    path, ref = _reference(fixtures_dir, "dream_gqa")
    logits = np.asarray(acache_jax.load(path, dtype="float32").logits(ref["ids"]))
    np.testing.assert_array_equal(logits[:, 0], logits[:, 1])
    assert np.abs(logits[:, 1] - logits[:, 2]).max() > 1e-3


def test_logits_rejects_bad_ids(fixtures_dir):
    model = acache_jax.load(fixtures_dir / "models" / "llada_mha", dtype="float32")
    with pytest.raises(ValueError, match=r"integer token ids shaped \[B, T\]"):
        model.logits(np.zeros((3,), np.int32))
    with pytest.raises(ValueError, match=r"integer token ids shaped \[B, T\]"):
        model.logits(np.zeros((1, 3), np.float32))


def test_a_program_traces_and_lowers_the_layers_once(fixtures_dir):
    """Every layer is one nested call of the same lowered function (tracing and lowering a layer is
    Python work paid at every start, cached executable or not), and XLA inlines the calls."""
    import re

    import jax
    import jax.numpy as jnp

    from acache_jax.model import ForwardInputs

    model = acache_jax.load(fixtures_dir / "models" / "llada_mha", dtype="float32")
    structure, params = model.flat
    ids = jnp.ones((1, 8), jnp.int32)
    positions = jnp.arange(8, dtype=jnp.int32)[None]
    lowered = jax.jit(lambda p, t, q: structure.forward(p, t, ForwardInputs(positions=q)).logits).lower(
        params, ids, positions)
    text = lowered.as_text()
    assert len(re.findall(r"func\.func private @_block_forward\w*\(", text)) == 1
    assert len(re.findall(r"call @_block_forward\w*\(", text)) == model.config.num_layers >= 2
    assert " call(" not in lowered.compile().as_text()  # inlined
