"""The gathered-attention and anchor-importance kernels (Pallas, interpret mode) against the jnp oracle."""

import collections
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import anchor_importance as _anchor_importance
from pallas_kernels import gathered_attention as _gathered_attention
from pallas_kernels import merge_partials

# Jitted whole: run eagerly, the interpreted kernel and the oracle compile each of their many small
# operations on its own, for every shape.
gathered_attention = jax.jit(_gathered_attention, static_argnames=(
    "sm_scale", "backend", "interpret", "return_lse", "block_q", "block_k", "num_warps", "num_stages", "splits"))
anchor_importance = jax.jit(_anchor_importance, static_argnames=(
    "sm_scale", "backend", "interpret", "block_q", "block_k", "num_warps", "num_stages"))


def make_inputs(seed, b, tq, hq, hkv, d, tk, pool, dtype, lens=None):
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
    return q, k_pool, v_pool, jnp.asarray(slots, jnp.int32), jnp.asarray(lens, jnp.int32)


def assert_close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


CASES = [  # (query heads per kv head, kv heads, head dim, dtype, key splits)
    (1, 3, 64, jnp.float32, None),
    (4, 2, 128, jnp.bfloat16, None),
    (7, 1, 128, jnp.float32, 3),
    (7, 2, 64, jnp.bfloat16, 2),
    (4, 1, 64, jnp.float32, 1),
]


@pytest.mark.parametrize("group,hkv,d,dtype,splits", CASES)
def test_attention_matches_oracle(group, hkv, d, dtype, splits):
    tk = 77
    # kv_lens: the whole range, a single key, an odd length, and a padding row with none.
    q, kp, vp, slots, lens = make_inputs(group + d, 4, 13, group * hkv, hkv, d, tk, 50, dtype, lens=[tk, 1, 38, 0])
    want, want_lse = gathered_attention(q, kp, vp, slots, lens, backend="xla", return_lse=True)
    got, got_lse = gathered_attention(q, kp, vp, slots, lens, backend="pallas", interpret=True, splits=splits,
                                      block_k=32, return_lse=True)
    chex.assert_shape(got, q.shape)
    chex.assert_type(got, q.dtype)
    assert_close(got, want, dtype)
    np.testing.assert_allclose(got_lse[:3], want_lse[:3], rtol=1e-4, atol=1e-3)
    assert not np.asarray(got[3]).any()  # no keys: zero output


def test_oracle_is_plain_softmax_attention():
    """The oracle itself against a float64 numpy softmax over the gathered keys."""
    q, kp, vp, slots, lens = make_inputs(0, 2, 5, 4, 2, 64, 20, 30, jnp.float32, lens=[20, 7])
    got = np.asarray(gathered_attention(q, kp, vp, slots, lens, backend="xla"))
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, kp, vp))
    for b in range(2):
        rows = np.asarray(slots[b, : int(lens[b])])
        for h in range(4):
            s = q64[b, :, h] @ k64[rows, h // 2].T / 8.0
            p = np.exp(s - s.max(-1, keepdims=True))
            np.testing.assert_allclose(got[b, :, h], (p / p.sum(-1, keepdims=True)) @ v64[rows, h // 2], atol=1e-5)


def test_merge_partials_equals_attention_over_the_union():
    q, kp, vp, slots, lens = make_inputs(2, 2, 5, 4, 2, 64, 30, 40, jnp.float32, lens=[30, 30])
    whole = gathered_attention(q, kp, vp, slots, lens, backend="xla")
    parts = [gathered_attention(q, kp, vp, s, jnp.full((2,), 15, jnp.int32), backend="pallas", interpret=True,
                                return_lse=True) for s in (slots[:, :15], slots[:, 15:])]
    assert_close(merge_partials([p[0] for p in parts], [p[1] for p in parts]), whole, jnp.float32)


@pytest.mark.parametrize("group,d", [(1, 64), (7, 128)])
def test_anchor_importance_matches_oracle(group, d):
    q, kp, vp, slots, lens = make_inputs(3, 3, 11, group * 2, 2, d, 45, 60, jnp.float32, lens=[45, 1, 20])
    weights = jnp.asarray(np.random.default_rng(4).integers(0, 2, size=(3, 11)), jnp.float32)
    want = anchor_importance(q, kp, slots, lens, weights, backend="xla")
    got = anchor_importance(q, kp, slots, lens, weights, backend="pallas", interpret=True, block_k=16)
    assert_close(got, want, jnp.float32)
    # the log-sum-exp of an attention call over the same keys, given, is the one it would compute
    _, lse = gathered_attention(q, kp, vp, slots, lens, backend="pallas", interpret=True, return_lse=True)
    assert_close(anchor_importance(q, kp, slots, lens, weights, interpret=True, block_k=16, lse=lse), want,
                 jnp.float32)
    # Softmax rows sum to one: the total is (counted queries) x (query heads); nothing beyond kv_lens.
    np.testing.assert_allclose(np.asarray(want).sum(-1), np.asarray(weights).sum(-1) * group * 2, rtol=1e-5)
    assert not np.asarray(want)[1, 1:].any() and not np.asarray(want)[2, 20:].any()


@settings(max_examples=6, deadline=None)
@given(b=st.integers(1, 3), tq=st.integers(1, 40), group=st.sampled_from([1, 2, 4, 7]), hkv=st.integers(1, 2),
       d=st.sampled_from([32, 64]), tk=st.integers(1, 70), pool=st.integers(1, 90), bf16=st.booleans(),
       seed=st.integers(0, 2**16))
def test_property_random_shapes(b, tq, group, hkv, d, tk, pool, bf16, seed):
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    q, kp, vp, slots, lens = make_inputs(seed, b, tq, group * hkv, hkv, d, tk, pool, dtype)
    want = gathered_attention(q, kp, vp, slots, lens, backend="xla")
    got = gathered_attention(q, kp, vp, slots, lens, backend="pallas", interpret=True, block_k=16)
    assert_close(got, want, dtype)


def test_bad_inputs_raise_clear_errors():
    q, kp, vp, slots, lens = make_inputs(5, 2, 4, 4, 2, 64, 10, 10, jnp.float32)
    with pytest.raises(ValueError, match="kv heads"):
        gathered_attention(q[:, :, :3], kp, vp, slots, lens)
    with pytest.raises(ValueError, match="do not match batch"):
        gathered_attention(q, kp, vp, slots[:1], lens)
    with pytest.raises(ValueError, match="unknown backend"):
        gathered_attention(q, kp, vp, slots, lens, backend="triton")


def test_model_pallas_backend_equals_xla():
    """A packed forward reading a shuffled pool through two read sets (one at an offset, rows past
    `lens` holding junk), with the probe over the second: the kernel path gives the oracle's."""
    from acache_jax.network.checkpoint import load
    from acache_jax.network.kv import KVPool, PoolAccess, ReadSet
    from acache_jax.network.model import ForwardInputs

    model = load("tests/fixtures/decode/llada")
    cfg = model.config
    rng = np.random.default_rng(6)
    m, pool_rows = 9, 40
    shape = (pool_rows, cfg.num_kv_heads, cfg.head_dim)
    pool = KVPool(tuple(jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(cfg.num_layers)),
                  tuple(jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(cfg.num_layers)))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size - 10, size=m), jnp.int32)
    segment = jnp.asarray([0] * 5 + [1] * 4, jnp.int32)
    write = jnp.asarray(rng.permutation(pool_rows)[:m], jnp.int32)
    own = ReadSet(jnp.asarray([list(write[:5]) + [0] * 3, list(write[5:]) + [1, 2, 3, 4]], jnp.int32),
                  jnp.asarray([5, 4], jnp.int32), jnp.zeros(2, jnp.int32))
    shared = ReadSet(jnp.asarray(rng.integers(0, pool_rows, size=(2, 12)), jnp.int32), jnp.asarray([12, 7], jnp.int32),
                     jnp.asarray([3, 6], jnp.int32))
    access = PoolAccess(pool, write, segment, (own, shared), jnp.asarray([[0, 1, 2], [3, 4, 9], [5, 6, 7], [8, 9, 9]]),
                        jnp.asarray([0, 0, 1, 1]), probe_weight=jnp.asarray(rng.random(m) < 0.6, jnp.float32),
                        probe_read=1)
    positions = jnp.asarray([12, 13, 14, 15, 16, 20, 21, 22, 23], jnp.int32)
    run = lambda backend: jax.device_get(model.forward(tokens, ForwardInputs(positions, access=access),
                                                       attn_backend=backend))
    want, got = run("xla"), run("pallas")
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(got.probe, want.probe, atol=1e-4, rtol=1e-4)
    chex.assert_trees_all_close(got.pool, want.pool, atol=1e-5)


def test_a_program_lowers_each_kernel_shape_once():
    """Layers call the kernels with the same shapes; the program holds one lowered copy of each, not
    one per call (lowering a kernel is Python work paid at every start, cached executable or not)."""
    q, kp, vp, slots, lens = make_inputs(0, 2, 8, 4, 2, 64, 16, 20, jnp.float32)

    def layers(q):
        for _ in range(3):
            q = _gathered_attention(q, kp, vp, slots, lens, backend="pallas", interpret=True)
            q = q + _anchor_importance(q, kp, slots, lens, jnp.ones(q.shape[:2]), backend="pallas",
                                       interpret=True).sum()
        return q

    text = jax.jit(layers).lower(q).as_text()
    defined = collections.Counter(re.findall(r"func\.func private @(_pallas|_importance)\w*\(", text))
    called = collections.Counter(re.findall(r"call @(_pallas|_importance)\w*\(", text))
    # two attention configurations: gathered_attention's tuned blocks and the probe's own
    assert defined == {"_pallas": 2, "_importance": 1}
    assert called == {"_pallas": 6, "_importance": 3}


def test_the_jnp_path_skips_a_read_set_no_row_reads_and_returns_what_computing_it_gives():
    """A fixed-shape engine's second read set is empty in a step where no segment needs it: the jnp
    path skips it (`attention._gathered`), with the output and log-sum-exp of computing it in full."""
    from acache_jax.network.attention import _gathered

    for dtype in (jnp.float32, jnp.bfloat16):
        q, kp, vp, slots, _ = make_inputs(5, 3, 8, 4, 2, 64, 40, 50, dtype)
        none = jnp.zeros((3,), jnp.int32)
        want = gathered_attention(q, kp, vp, slots, none, backend="xla", return_lse=True)
        got = jax.jit(_gathered, static_argnames="backend")(q, kp, vp, slots, none, backend="xla")
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
            assert g.dtype == w.dtype and g.shape == w.shape
