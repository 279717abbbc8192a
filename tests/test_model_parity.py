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

    from acache_jax.network.model import ForwardInputs

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


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_fused_projections_compute_the_separate_ones(family):
    """A block whose qkv and gate_up weights are fused from separate random q, k, v (with biases),
    gate and up weights gives, in float32, what the separate matmuls give (the network before the
    fusion): its K and V, and its output through attention (query head h reading KV head h // G) and
    the MLP. Tolerance 1e-5: the fused matmul may sum in another order."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from acache_jax.network.attention import attend_dense
    from acache_jax.network.config import ModelConfig
    from acache_jax.network.model import ForwardInputs, Transformer
    from acache_jax.network.sharding import fuse_gate_up, fuse_qkv
    from tests.hf_checkpoints import dream_config, llada_config

    hf = llada_config(n_kv_heads=2, include_qkv_bias=True) if family == "llada" else dream_config()
    cfg = ModelConfig.from_hf(hf)
    d, hd, kv, f = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads, cfg.intermediate_size
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(0.2 * rng.standard_normal(shape), jnp.float32)  # noqa: E731
    wq, wk, wv = normal(d, cfg.num_heads * hd), normal(d, kv * hd), normal(d, kv * hd)
    bq, bk, bv = normal(cfg.num_heads * hd), normal(kv * hd), normal(kv * hd)
    wg, wu = normal(d, f), normal(d, f)
    block = Transformer(cfg, rngs=nnx.Rngs(0)).layers[0]
    block.attn.qkv.kernel[...] = fuse_qkv(wq, wk, wv, kv, hd)
    block.attn.qkv.bias[...] = fuse_qkv(bq, bk, bv, kv, hd)
    block.mlp.gate_up.kernel[...] = fuse_gate_up(wg, wu)
    x, positions = normal(2, 6, d), jnp.broadcast_to(jnp.arange(6), (2, 6))
    out, k, v, _, _ = block(x, ForwardInputs(positions), "xla")

    h = block.attn_norm(x)
    heads = lambda y: y.reshape(2, 6, -1, hd)  # noqa: E731
    q_sep, k_sep, v_sep = heads(h @ wq + bq), heads(h @ wk + bk), heads(h @ wv + bv)
    attended = attend_dense(q_sep, k_sep, v_sep, positions, jnp.ones((2, 6), bool), cfg.rope_theta, "xla")
    x = x + attended.reshape(2, 6, -1) @ block.attn.o.kernel[...]
    m = block.mlp_norm(x)
    want = x + (jax.nn.silu(m @ wg) * (m @ wu)) @ block.mlp.down.kernel[...]
    np.testing.assert_allclose(k, k_sep, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v, v_sep, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
