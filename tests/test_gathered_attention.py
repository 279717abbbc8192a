"""The gathered-attention and anchor-importance kernels (Pallas, interpret mode) against the jnp oracle."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import anchor_importance, gathered_attention, merge_partials


def make_inputs(seed, b, tq, hq, hkv, d, tk, pool, dtype, use_rope, lens=None):
    """Random inputs whose slot maps share pool rows across rows and hold junk beyond kv_lens."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, tq, hq, d)), dtype)
    k_pool = jnp.asarray(rng.normal(size=(pool, hkv, d)), dtype)
    v_pool = jnp.asarray(rng.normal(size=(pool, hkv, d)), dtype)
    slots = rng.integers(0, pool, size=(b, tk))
    slots[1:, : tk // 2] = slots[0, : tk // 2]  # a span every row reads from the same pool rows
    lens = rng.integers(1, tk + 1, size=b) if lens is None else np.asarray(lens)
    junk = rng.choice([-(10**6), pool, pool + 7, 2**30], size=(b, tk))
    slots = np.where(np.arange(tk)[None] < lens[:, None], slots, junk)
    positions = jnp.asarray(rng.integers(0, 4 * tk, size=(b, tk)), jnp.int32) if use_rope else None
    return q, k_pool, v_pool, jnp.asarray(slots, jnp.int32), jnp.asarray(lens, jnp.int32), positions


def assert_close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


CASES = [  # (query heads per kv head, kv heads, head dim, dtype, RoPE at read, key splits, cos/sin tables)
    (1, 3, 64, jnp.float32, True, None, False),
    (4, 2, 128, jnp.bfloat16, True, None, True),
    (7, 1, 128, jnp.float32, False, 3, False),
    (7, 2, 64, jnp.bfloat16, True, 2, False),
    (4, 1, 64, jnp.float32, True, 1, True),
]


@pytest.mark.parametrize("group,hkv,d,dtype,use_rope,splits,rope_tables", CASES)
def test_attention_matches_oracle(group, hkv, d, dtype, use_rope, splits, rope_tables):
    tk = 77
    # kv_lens: the whole range, a single key, an odd length, and a padding row with none.
    q, kp, vp, slots, lens, pos = make_inputs(group + d, 4, 13, group * hkv, hkv, d, tk, 50, dtype, use_rope,
                                              lens=[tk, 1, 38, 0])
    kw = dict(k_positions=pos, rope_theta=10000.0 if use_rope else None, return_lse=True)
    want, want_lse = gathered_attention(q, kp, vp, slots, lens, backend="xla", **kw)
    got, got_lse = gathered_attention(q, kp, vp, slots, lens, backend="pallas", interpret=True, splits=splits,
                                      block_k=32, rope_tables=rope_tables, **kw)
    chex.assert_shape(got, q.shape)
    chex.assert_type(got, q.dtype)
    assert_close(got, want, dtype)
    np.testing.assert_allclose(got_lse[:3], want_lse[:3], rtol=1e-4, atol=1e-3)
    assert not np.asarray(got[3]).any()  # no keys: zero output


def test_oracle_is_plain_softmax_attention():
    """The oracle itself against a float64 numpy softmax over the gathered keys (no RoPE)."""
    q, kp, vp, slots, lens, _ = make_inputs(0, 2, 5, 4, 2, 64, 20, 30, jnp.float32, False, lens=[20, 7])
    got = np.asarray(gathered_attention(q, kp, vp, slots, lens, backend="xla"))
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, kp, vp))
    for b in range(2):
        rows = np.asarray(slots[b, : int(lens[b])])
        for h in range(4):
            s = q64[b, :, h] @ k64[rows, h // 2].T / 8.0
            p = np.exp(s - s.max(-1, keepdims=True))
            np.testing.assert_allclose(got[b, :, h], (p / p.sum(-1, keepdims=True)) @ v64[rows, h // 2], atol=1e-5)


def test_rope_at_read_makes_a_stored_span_position_independent():
    """Reading pre-RoPE keys at positions p equals reading keys rotated at p beforehand."""
    from pallas_kernels import rope

    q, kp, vp, slots, lens, pos = make_inputs(1, 2, 6, 4, 2, 64, 16, 16, jnp.float32, True, lens=[16, 16])
    slots = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    rotated = jnp.concatenate([rope(kp[None], pos[b:b + 1], 10000.0)[0] for b in range(2)])
    dense_slots = jnp.arange(32, dtype=jnp.int32).reshape(2, 16)
    want = gathered_attention(q, rotated, jnp.concatenate([vp, vp]), dense_slots, lens, backend="xla")
    got = gathered_attention(q, kp, vp, slots, lens, k_positions=pos, rope_theta=10000.0, interpret=True)
    assert_close(got, want, jnp.float32)


def test_merge_partials_equals_attention_over_the_union():
    q, kp, vp, slots, lens, _ = make_inputs(2, 2, 5, 4, 2, 64, 30, 40, jnp.float32, False, lens=[30, 30])
    whole = gathered_attention(q, kp, vp, slots, lens, backend="xla")
    parts = [gathered_attention(q, kp, vp, s, jnp.full((2,), 15, jnp.int32), backend="pallas", interpret=True,
                                return_lse=True) for s in (slots[:, :15], slots[:, 15:])]
    assert_close(merge_partials([p[0] for p in parts], [p[1] for p in parts]), whole, jnp.float32)


@pytest.mark.parametrize("group,d,use_rope", [(1, 64, True), (7, 128, False)])
def test_anchor_importance_matches_oracle(group, d, use_rope):
    q, kp, _, slots, lens, pos = make_inputs(3, 3, 11, group * 2, 2, d, 45, 60, jnp.float32, use_rope,
                                             lens=[45, 1, 20])
    weights = jnp.asarray(np.random.default_rng(4).integers(0, 2, size=(3, 11)), jnp.float32)
    kw = dict(k_positions=pos, rope_theta=10000.0 if use_rope else None)
    want = anchor_importance(q, kp, slots, lens, weights, backend="xla", **kw)
    got = anchor_importance(q, kp, slots, lens, weights, backend="pallas", interpret=True, block_k=16,
                            rope_tables=use_rope, **kw)
    assert_close(got, want, jnp.float32)
    # Softmax rows sum to one: the total is (counted queries) x (query heads); nothing beyond kv_lens.
    np.testing.assert_allclose(np.asarray(want).sum(-1), np.asarray(weights).sum(-1) * group * 2, rtol=1e-5)
    assert not np.asarray(want)[1, 1:].any() and not np.asarray(want)[2, 20:].any()


@settings(max_examples=6, deadline=None)
@given(b=st.integers(1, 3), tq=st.integers(1, 40), group=st.sampled_from([1, 2, 4, 7]), hkv=st.integers(1, 2),
       d=st.sampled_from([32, 64]), tk=st.integers(1, 70), pool=st.integers(1, 90), use_rope=st.booleans(),
       bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_property_random_shapes(b, tq, group, hkv, d, tk, pool, use_rope, bf16, seed):
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    q, kp, vp, slots, lens, pos = make_inputs(seed, b, tq, group * hkv, hkv, d, tk, pool, dtype, use_rope)
    kw = dict(k_positions=pos, rope_theta=500.0 if use_rope else None)
    want = gathered_attention(q, kp, vp, slots, lens, backend="xla", **kw)
    got = gathered_attention(q, kp, vp, slots, lens, backend="pallas", interpret=True, block_k=16, **kw)
    assert_close(got, want, dtype)


def test_bad_inputs_raise_clear_errors():
    q, kp, vp, slots, lens, pos = make_inputs(5, 2, 4, 4, 2, 64, 10, 10, jnp.float32, True)
    with pytest.raises(ValueError, match="kv heads"):
        gathered_attention(q[:, :, :3], kp, vp, slots, lens)
    with pytest.raises(ValueError, match="go together"):
        gathered_attention(q, kp, vp, slots, lens, k_positions=pos)
    with pytest.raises(ValueError, match="do not match batch"):
        gathered_attention(q, kp, vp, slots[:1], lens)
    with pytest.raises(ValueError, match="unknown backend"):
        gathered_attention(q, kp, vp, slots, lens, backend="triton")


def test_model_pallas_backend_equals_xla():
    """A model forward reading a pooled view (shared rows, invalid keys) and running the probe."""
    from acache_jax.attention import KVView
    from acache_jax.checkpoint import load

    model = load("tests/fixtures/decode/llada")
    cfg = model.config
    rng = np.random.default_rng(6)
    b, t, n, pool = 2, 7, 12, 20
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size - 10, size=(b, t)), jnp.int32)
    positions = jnp.asarray(np.arange(n, n + t)[None].repeat(b, 0), jnp.int32)
    valid = jnp.asarray([[True] * t, [True] * 5 + [False] * 2])
    shape = (pool, cfg.num_kv_heads, cfg.head_dim)
    kv = KVView(tuple(jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(cfg.num_layers)),
                tuple(jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(cfg.num_layers)),
                jnp.asarray(np.arange(n)[None].repeat(b, 0), jnp.int32),
                jnp.asarray(rng.random((b, n)) < 0.8), jnp.asarray(rng.integers(0, pool, size=(b, n)), jnp.int32))
    probe = ids % 2 == 0
    run = lambda backend: jax.device_get(model.forward(ids, positions, valid=valid, kv=kv, probe=probe,
                                                       attn_backend=backend))
    want, got = run("xla"), run("pallas")
    np.testing.assert_allclose(got.logits[0], want.logits[0], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(got.logits[1, :5], want.logits[1, :5], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(got.probe, want.probe, atol=1e-4, rtol=1e-4)
