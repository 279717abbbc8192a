"""The model forward with an external KVView computes what the full forward computes."""

import jax.numpy as jnp
import numpy as np
import pytest

import acache_jax
from acache_jax import KVView


@pytest.fixture(scope="module", params=["llada_gqa_bias", "dream_gqa"])
def model(request, fixtures_dir):
    return acache_jax.load(fixtures_dir / "models" / request.param, dtype="float32")


def _full(model, ids):
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return pos, model.forward(ids, pos)


def test_block_forward_against_dense_cache_equals_full_forward(model):
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 120, (2, 20)), jnp.int32)
    pos, full = _full(model, ids)
    s, e = 8, 14
    valid = jnp.ones(ids.shape, bool).at[:, s:e].set(False)  # the block's own K/V come from this call
    out = model.forward(ids[:, s:e], pos[:, s:e], kv=KVView(full.k, full.v, pos, valid))
    if model.config.logit_shift:
        # Shifted along this call's tokens: rows 1.. come from positions s.., and row 0 keeps the
        # hidden state of position s itself, which the full forward shows at row s + 1.
        np.testing.assert_allclose(out.logits[:, 1:], full.logits[:, s + 1:e], atol=2e-5)
        np.testing.assert_allclose(out.logits[:, 0], full.logits[:, s + 1], atol=2e-5)
    else:
        np.testing.assert_allclose(out.logits, full.logits[:, s:e], atol=2e-5)
    for layer in range(model.config.num_layers):
        np.testing.assert_allclose(out.k[layer], full.k[layer][:, s:e], atol=2e-5)


def test_pool_with_slot_map_equals_dense(model):
    """A pool in shuffled row order, read through a slot map, gives the dense result; so does a
    shared pool without a batch axis read at different offsets per row (RoPE at read)."""
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, 120, (2, 16)), jnp.int32)
    pos, full = _full(model, ids)
    valid = jnp.ones(ids.shape, bool).at[:, 10:].set(False)
    dense = model.forward(ids[:, 10:], pos[:, 10:], kv=KVView(full.k, full.v, pos, valid)).logits
    perm = rng.permutation(32)
    inverse = np.argsort(perm)
    pool = lambda kv: tuple(layer.reshape(32, *layer.shape[2:])[perm] for layer in kv)
    slots = jnp.asarray(inverse.reshape(2, 16), jnp.int32)
    pooled = model.forward(ids[:, 10:], pos[:, 10:], kv=KVView(pool(full.k), pool(full.v), pos, valid, slots)).logits
    np.testing.assert_allclose(pooled, dense, atol=2e-5)


def test_keys_before_rope_are_position_free(model):
    """A span's K (before RoPE) does not depend on where it sits, and RoPE attention depends only on
    relative positions: the same span at an offset gives the same K and the same logits. This is why
    one affix cache serves every placement."""
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 120, (1, 6)), jnp.int32)
    a = model.forward(ids, jnp.arange(6)[None])
    b = model.forward(ids, 40 + jnp.arange(6)[None])
    for layer in range(model.config.num_layers):
        np.testing.assert_allclose(a.k[layer], b.k[layer], atol=1e-5)
    np.testing.assert_allclose(a.logits, b.logits, atol=1e-4)
    c = model.forward(ids, jnp.asarray([[0, 1, 2, 3, 4, 9]]))  # a different relative layout does differ
    assert np.abs(np.asarray(c.logits) - np.asarray(a.logits)).max() > 1e-3
