"""The model forward through a KV pool (write, then read through read sets) computes what the dense
full forward computes; an affix computed alone and read at an offset is a view of the same keys."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import acache_jax
from acache_jax.network.kv import KVPool, PoolAccess, flat_index, read_set, rows_access
from eval.bench_decode import pool_from_rows
from acache_jax.network.model import ForwardInputs
from pallas_kernels import rope


@pytest.fixture(scope="module", params=["llada_gqa_bias", "dream_gqa"])
def model(request, fixtures_dir):
    return acache_jax.load(fixtures_dir / "models" / request.param, dtype="float32")


def _full(model, ids):
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return pos, model.forward(ids, ForwardInputs(pos))


def _pool_of(model, full, rows):
    """A pool holding a dense forward's K (rotated at its positions) and V, in the order `rows`."""
    b, t = full.k[0].shape[:2]
    pool = pool_from_rows(full.k, full.v, jnp.broadcast_to(jnp.arange(t), (b, t)), model.config.rope_theta)
    return KVPool(tuple(k[rows] for k in pool.k), tuple(v[rows] for v in pool.v))


def test_block_through_the_pool_equals_the_full_forward(model):
    """A block of each row recomputed against the pool of the full forward: the block writes its
    own K/V (the same values) and reads the whole row, so logits and K equal the full forward's."""
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 120, (2, 20)), jnp.int32)
    pos, full = _full(model, ids)
    s, e = 8, 14
    pool = _pool_of(model, full, np.arange(40))
    reads = (read_set(jnp.arange(2)[:, None] * 20 + jnp.arange(20)[None], jnp.ones((2, 20), bool), jnp.zeros(2)),)
    write = jnp.arange(2)[:, None] * 20 + jnp.arange(s, e)[None]
    idx = jnp.broadcast_to(jnp.arange(e - s), (2, e - s))
    out = model.forward(ids[:, s:e].reshape(-1), ForwardInputs(pos[:, s:e].reshape(-1),
                                                               access=rows_access(pool, write, reads),
                                                               logit_index=flat_index(idx, e - s)))
    if model.config.logit_shift:
        # Shifted along this call's tokens: rows 1.. come from positions s.., and row 0 keeps the
        # hidden state of position s itself, which the full forward shows at row s + 1.
        np.testing.assert_allclose(out.logits[:, 1:], full.logits[:, s + 1:e], atol=2e-5)
        np.testing.assert_allclose(out.logits[:, 0], full.logits[:, s + 1], atol=2e-5)
    else:
        np.testing.assert_allclose(out.logits, full.logits[:, s:e], atol=2e-5)
    for layer in range(model.config.num_layers):
        np.testing.assert_allclose(out.k[layer].reshape(2, e - s, *out.k[layer].shape[1:]),
                                   full.k[layer][:, s:e], atol=2e-5)


def test_shuffled_pool_and_packed_segments_equal_rows(model):
    """The same two requests as rows, and as segments of one packed token axis in a shuffled pool
    with tiles of 3 tokens: the same logits."""
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, 120, (2, 16)), jnp.int32)
    pos, full = _full(model, ids)
    reads = lambda slots: (read_set(slots, jnp.ones((2, 16), bool), jnp.zeros(2)),)
    rows = jnp.arange(2)[:, None] * 16 + jnp.arange(16)[None]
    idx = jnp.broadcast_to(jnp.arange(6), (2, 6))
    dense = model.forward(ids[:, 10:].reshape(-1), ForwardInputs(pos[:, 10:].reshape(-1), access=rows_access(
        _pool_of(model, full, np.arange(32)), rows[:, 10:], reads(rows)), logit_index=flat_index(idx, 6))).logits
    perm = rng.permutation(32)
    slot_of = np.argsort(perm).reshape(2, 16)  # row-major index -> shuffled pool row
    pool = _pool_of(model, full, perm)
    # packed: [pad, request 1's 6 tokens, request 0's 6 tokens, pad], tiles of 3
    order = [None] + [(1, c) for c in range(10, 16)] + [(0, c) for c in range(10, 16)] + [None]
    tokens = jnp.asarray([0 if o is None else int(ids[o]) for o in order], jnp.int32)
    positions = jnp.asarray([0 if o is None else o[1] for o in order], jnp.int32)
    write = jnp.asarray([pool.num_slots if o is None else slot_of[o] for o in order], jnp.int32)
    segment = jnp.asarray([-1 if o is None else o[0] for o in order], jnp.int32)
    tiles = jnp.asarray([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], [14, 14, 14]], jnp.int32)
    access = PoolAccess(pool, write, segment, reads(jnp.asarray(slot_of)), tiles, jnp.asarray([1, 1, 0, 0, 0]))
    packed = model.forward(tokens, ForwardInputs(positions, access=access,
                                                 logit_index=jnp.asarray([range(7, 13), range(1, 7)])))
    np.testing.assert_allclose(packed.logits, dense, atol=2e-5)


def test_keys_before_rope_are_position_free(model):
    """A span's K (before RoPE) does not depend on where it sits, and RoPE attention depends only on
    relative positions: the same span at an offset gives the same K and the same logits. This is why
    one affix cache serves every placement."""
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 120, (1, 6)), jnp.int32)
    a = model.forward(ids, ForwardInputs(jnp.arange(6)[None]))
    b = model.forward(ids, ForwardInputs(40 + jnp.arange(6)[None]))
    chex.assert_trees_all_close(a.k, b.k, atol=1e-5)  # every layer
    np.testing.assert_allclose(a.logits, b.logits, atol=1e-4)
    c = model.forward(ids, ForwardInputs(jnp.asarray([[0, 1, 2, 3, 4, 9]])))  # a different layout does differ
    assert np.abs(np.asarray(c.logits) - np.asarray(a.logits)).max() > 1e-3


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_an_affix_stored_alone_read_at_an_offset(model, backend):
    """Rows whose affix sits at offsets 0 and 5 (prefix, infix), read from one copy of the affix
    computed alone (K rotated at 0..L-1, the query turned back by the offset), give the same logits
    as reading the affix's keys in place, rotated at the positions they sit at."""
    rng = np.random.default_rng(3)
    theta = model.config.rope_theta
    affix = jnp.asarray(rng.integers(0, 120, (1, 7)), jnp.int32)
    starts = jnp.asarray([0, 5], jnp.int32)
    own_ids = jnp.asarray(rng.integers(0, 120, (2, 12)), jnp.int32)
    alone = model.forward(affix, ForwardInputs(jnp.arange(7)[None]))
    own_pos = jnp.where(jnp.arange(12)[None] < starts[:, None], jnp.arange(12)[None], jnp.arange(12)[None] + 7)
    affix_pos = starts[:, None] + jnp.arange(7)[None]
    # in place: pool rows [row 0: affix at its positions | its own 12][row 1: the same], one read set
    rows19 = jnp.arange(2)[:, None] * 19
    rows_of = lambda a: jnp.concatenate([a, jnp.zeros((2, 12, *a.shape[2:]), a.dtype)], 1).reshape(38, *a.shape[2:])
    twice = lambda a: jnp.broadcast_to(a, (2, *a.shape[1:]))
    pool_in_place = KVPool(tuple(rows_of(rope(twice(k), affix_pos, theta)) for k in alone.k),
                           tuple(rows_of(twice(v)) for v in alone.v))
    want = model.forward(own_ids.reshape(-1), ForwardInputs(
        own_pos.reshape(-1), access=rows_access(pool_in_place, rows19 + 7 + jnp.arange(12)[None], (
            read_set(rows19 + jnp.arange(19)[None], jnp.ones((2, 19), bool), jnp.zeros(2)),))),
        attn_backend="xla").logits
    cache = acache_jax.AffixCache(tuple(k[0] for k in alone.k), tuple(v[0] for v in alone.v), affix[0], "")
    shared = cache.pool(24, theta)  # rows 0..6 the affix; 7.. the two rows' own 12
    own_rows = 7 + jnp.arange(2)[:, None] * 12 + jnp.arange(12)[None]
    reads = (read_set(own_rows, jnp.ones((2, 12), bool), jnp.zeros(2)),
             read_set(jnp.broadcast_to(jnp.arange(7), (2, 7)), jnp.ones((2, 7), bool), starts))
    got = model.forward(own_ids.reshape(-1), ForwardInputs(own_pos.reshape(-1),
                                                           access=rows_access(shared, own_rows, reads)),
                        attn_backend=backend).logits
    np.testing.assert_allclose(got, want, atol=5e-5)


def test_pool_writes_promise_unique_indices_and_padding_writes_nothing():
    """A forward's pool writes and the placement of its output from the query tiles promise unique
    indices (padding entries made distinct past the end): XLA's GPU scatter then stores bfloat16
    elements directly instead of looping on compare-and-swap. Padding tokens still write nothing and
    every real token gets its own tile's output."""
    import jax

    from acache_jax.network.attention import attend_pool

    rng = np.random.default_rng(3)
    m, heads, dim, slots = 6, 2, 8, 10
    q, k, v = (jnp.asarray(rng.normal(size=(m, heads, dim)), jnp.bfloat16) for _ in range(3))
    pool = KVPool((jnp.zeros((slots, heads, dim), jnp.bfloat16),), (jnp.zeros((slots, heads, dim), jnp.bfloat16),))
    write = jnp.asarray([4, slots, 7, 2, slots, 9], jnp.int32)  # tokens 1 and 4: padding
    segment = jnp.asarray([0, -1, 0, 1, -1, 1], jnp.int32)
    reads = (read_set(jnp.asarray([[4, 7], [2, 9]]), jnp.ones((2, 2), bool), jnp.zeros(2)),)
    tiles = jnp.asarray([[0, 2], [3, 5], [m, m]], jnp.int32)  # padding tokens are in no tile
    access = PoolAccess(pool, write, segment, reads, tiles, jnp.asarray([0, 1, 1]))
    run = jax.jit(lambda q, k, v, access: attend_pool(q, k, v, jnp.arange(m), access, 10000.0, "xla")[:3])
    scatters = [line for line in run.lower(q, k, v, access).as_text().splitlines() if "stablehlo.scatter" in line]
    assert len(scatters) == 3 and all("unique_indices = true" in line for line in scatters), scatters
    out, pool_k, pool_v = run(q, k, v, access)
    np.testing.assert_array_equal(np.asarray(pool_v, np.float32)[[4, 7, 2, 9]], np.asarray(v, np.float32)[[0, 2, 3, 5]])
    untouched = [s for s in range(slots) if s not in (4, 7, 2, 9)]
    assert not np.asarray(pool_k, np.float32)[untouched].any() and not np.asarray(pool_v, np.float32)[untouched].any()
    assert not np.asarray(out, np.float32)[[1, 4]].any() and np.asarray(out, np.float32)[[0, 2, 3, 5]].any()
