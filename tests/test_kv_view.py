"""The model forward with an external KVView computes what the full forward computes."""

import chex
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
    chex.assert_trees_all_close(a.k, b.k, atol=1e-5)  # every layer
    np.testing.assert_allclose(a.logits, b.logits, atol=1e-4)
    c = model.forward(ids, jnp.asarray([[0, 1, 2, 3, 4, 9]]))  # a different relative layout does differ
    assert np.abs(np.asarray(c.logits) - np.asarray(a.logits)).max() > 1e-3


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_views_stored_rotated_read_at_an_offset(model, backend):
    """Keys stored already rotated at their own positions 0..L-1 (offset views) and split over two
    views give what one view of keys before RoPE gives: an affix computed alone, read by each row at
    its own offset, beside each row's private keys stored rotated at their logical positions."""
    from pallas_kernels import rope

    rng = np.random.default_rng(3)
    theta = model.config.rope_theta
    affix = jnp.asarray(rng.integers(0, 120, (1, 7)), jnp.int32)
    starts = jnp.asarray([0, 5], jnp.int32)  # row 0: prefix; row 1: the affix sits after 5 own tokens
    ids = jnp.asarray(rng.integers(0, 120, (2, 16)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    own = model.forward(ids, pos)  # the rows' own keys (before RoPE), read as their private keys
    alone = model.forward(affix, jnp.arange(7)[None])  # the affix computed alone, stored once
    affix_pos = starts[:, None] + jnp.arange(7)[None]
    private_valid = jnp.ones((2, 16), bool).at[:, 12:].set(False)
    shared = lambda kv: tuple(jnp.broadcast_to(layer, (2, *layer.shape[1:])) for layer in kv)
    before = KVView(tuple(jnp.concatenate([a, o], 1) for a, o in zip(shared(alone.k), own.k)),
                    tuple(jnp.concatenate([a, o], 1) for a, o in zip(shared(alone.v), own.v)),
                    jnp.concatenate([affix_pos, pos], 1), jnp.concatenate([jnp.ones((2, 7), bool), private_valid], 1))
    rotated_affix = KVView(tuple(rope(layer, jnp.arange(7)[None], theta)[0] for layer in alone.k),
                           tuple(layer[0] for layer in alone.v), affix_pos, jnp.ones((2, 7), bool),
                           jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7)), offset=starts)
    rotated_private = KVView(tuple(rope(layer, pos, theta) for layer in own.k), own.v, pos, private_valid,
                             offset=jnp.zeros(2, jnp.int32))
    q_ids, q_pos = ids[:, 12:], pos[:, 12:] + 7
    want = model.forward(q_ids, q_pos, kv=before, attn_backend="xla").logits
    got = model.forward(q_ids, q_pos, kv=(rotated_affix, rotated_private), attn_backend=backend).logits
    np.testing.assert_allclose(got, want, atol=5e-5)
    probe = jnp.ones(q_ids.shape, bool)  # every query counts
    p_want = model.forward(q_ids, q_pos, kv=KVView(*(shared(alone.k), shared(alone.v)), affix_pos,
                                                   jnp.ones((2, 7), bool)), probe=probe, attn_backend="xla").probe
    p_got = model.forward(q_ids, q_pos, kv=rotated_affix, probe=probe, attn_backend=backend).probe
    np.testing.assert_allclose(p_got, p_want, atol=5e-5)
