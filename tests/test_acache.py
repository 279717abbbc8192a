"""ACache: invariants on tiny fp32 models, a plain-jnp oracle for the anchor probe, bad input."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import acache_jax
from acache_jax.decoding.acache import build_affix_cache, probe_importance, rank_anchors_jit, select_anchors
from acache_jax.decoding.decode import anchor_axis, decode_batch, generate
from acache_jax.decoding.layout import Request, make_batch
from acache_jax.network.config import DecodeConfig, InputError
from acache_jax.network.model import ForwardInputs
from acache_jax.network.sharding import split_parts

AFFIX = list(range(30, 54))  # 24 tokens
REQUESTS = [
    Request([5, 17, 33, 2, 90], affix_position="prefix"),
    Request([11, 3, 3, 64], tail=[7, 8, 9], affix_position="infix"),
    Request([23, 99, 54], affix_position="suffix"),
    Request([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], tail=[12], affix_position="infix"),
]
BASE = dict(gen_length=16, block_length=8, threshold=0.9)


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request, fixtures_dir):
    return acache_jax.load(fixtures_dir / "decode" / request.param, dtype="float32")


@pytest.fixture(scope="module")
def cache(model):
    return build_affix_cache(model, AFFIX)


def _tokens(result):
    return [t.tolist() for t in result.tokens]


def test_ratio_one_is_the_dual_cache_baseline(model, cache):
    dual = generate(model, REQUESTS, DecodeConfig(cache="dual", **BASE), affix=AFFIX)
    full = generate(model, REQUESTS, DecodeConfig(cache="acache", anchor_ratio=1.0, **BASE), affix=cache)
    assert _tokens(full) == _tokens(dual)
    assert all(len(a) == len(AFFIX) for a in full.anchors)


def test_ratio_zero_is_direct_reuse(model, cache):
    zero = generate(model, REQUESTS, DecodeConfig(cache="acache", anchor_ratio=0.0, **BASE), affix=cache)
    direct = generate(model, REQUESTS, DecodeConfig(cache="direct", **BASE), affix=cache)
    assert _tokens(zero) == _tokens(direct)
    assert (zero.nfe == direct.nfe).all() and (zero.forward_tokens == direct.forward_tokens).all()


# random and bottom select without the model's scores: one model is enough for them.
@pytest.mark.parametrize("model,selector", [("llada", "attention"), ("llada", "hkvd"), ("llada", "random"),
                                            ("llada", "bottom"), ("dream", "attention"), ("dream", "hkvd"),
                                            ("dream", "hkvd_block")],
                         indirect=["model"])
def test_each_row_equals_the_request_alone(model, cache, selector):
    config = DecodeConfig(cache="acache", anchor_ratio=0.2, selector=selector, **BASE)
    batched = generate(model, REQUESTS, config, affix=cache)
    k = math.ceil(0.2 * len(AFFIX))
    for i, r in enumerate(REQUESTS):
        alone = generate(model, [r], config, affix=cache)
        assert batched.tokens[i].tolist() == alone.tokens[0].tolist()
        assert batched.anchors[i].tolist() == alone.anchors[0].tolist()
        assert len(alone.anchors[0]) == k and list(alone.anchors[0]) == sorted(set(alone.anchors[0]))
        assert batched.nfe[i] == alone.nfe[0]


def test_selectors_share_one_compiled_decode_loop(model, cache):
    """Anchors are an input of the decode loop, so a config that differs only in its selector and
    ratio (same K) runs the loop another one compiled."""
    request = [Request(list(range(3, 40)), affix_position="prefix")]
    generate(model, request, DecodeConfig(cache="acache", anchor_ratio=0.17, selector="random", **BASE), affix=cache)
    compiled = decode_batch._cache_size()
    out = generate(model, request, DecodeConfig(cache="acache", anchor_ratio=0.18, selector="bottom", **BASE),
                   affix=cache)
    assert decode_batch._cache_size() == compiled and len(out.anchors[0]) == math.ceil(0.18 * len(AFFIX))


def test_one_affix_cache_serves_every_offset(model, cache):
    """K before RoPE is independent of where the span sits and attention depends on relative
    positions only: the cache built at positions 0.. equals one built at the request's own offset."""
    at_offset = model.forward(jnp.asarray([AFFIX]), ForwardInputs(37 + jnp.arange(len(AFFIX))[None]), with_logits=False)
    chex.assert_trees_all_close((cache.k, cache.v), jax.tree.map(lambda a: a[0], (at_offset.k, at_offset.v)),
                                atol=1e-5)
    # Infix requests with the affix at offsets 4 and 11 in one batch, both from the one cache.
    config = DecodeConfig(cache="direct", **BASE)
    both = generate(model, [REQUESTS[1], REQUESTS[3]], config, affix=cache)
    for i, r in enumerate([REQUESTS[1], REQUESTS[3]]):
        assert both.tokens[i].tolist() == generate(model, [r], config, affix=cache).tokens[0].tolist()


def _oracle_importance(model, request):
    """Plain float64 numpy re-derivation of the probe (paper eq. 4-5) from the parameter tree: the
    request's non-affix tokens run layer by layer against the affix-alone K/V; at each layer the
    mask queries' softmax over affix keys only is summed over queries and heads."""
    cfg = model.config
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(model.params))
    row = request.row(AFFIX, BASE["gen_length"], cfg.mask_token_id)
    seq, start = row.tokens.tolist(), row.affix_start
    affix_pos = np.arange(start, start + len(AFFIX))
    own_pos = np.array([i for i in range(len(seq)) if not start <= i < start + len(AFFIX)])
    own = np.asarray([seq[i] for i in own_pos])
    group, scale = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim ** -0.5

    def rope(x, pos):
        half = cfg.head_dim // 2
        ang = np.asarray(pos)[:, None] / cfg.rope_theta ** (np.arange(half) * 2 / cfg.head_dim)
        ang = np.concatenate([ang, ang], -1)[:, None]
        return x * np.cos(ang) + np.concatenate([-x[..., half:], x[..., :half]], -1) * np.sin(ang)

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def norm(x, w):
        return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps)

    def proj(x, lin):
        return x @ lin["kernel"] + (lin["bias"] if "bias" in lin else 0)

    def unfused(lin, module):
        """The separate projections of a fused one: part name -> {"kernel": ..., "bias": ...}."""
        leaves = {name: split_parts(module, leaf, cfg.num_kv_heads, cfg.head_dim) for name, leaf in lin.items()}
        return {part: {name: leaves[name][part] for name in leaves} for part in leaves["kernel"]}

    def layer_forward(x, pos, layer, ext=None):
        """One block; ext = (k, v, positions) of external keys. Returns (x', rotated q, k, v)."""
        h = norm(x, layer["attn_norm"]["weight"])
        heads = lambda y, n: y.reshape(len(x), n, cfg.head_dim)
        qkv = unfused(layer["attn"]["qkv"], "qkv")
        q = rope(heads(proj(h, qkv["q"]), cfg.num_heads), pos)
        k, v = heads(proj(h, qkv["k"]), cfg.num_kv_heads), heads(proj(h, qkv["v"]), cfg.num_kv_heads)
        keys, values = rope(k, pos), v
        if ext is not None:
            keys, values = np.concatenate([rope(ext[0], ext[2]), keys]), np.concatenate([ext[1], values])
        att = softmax(np.einsum("qhd,khd->hqk", q, np.repeat(keys, group, 1)) * scale)
        x = x + proj(np.einsum("hqk,khd->qhd", att, np.repeat(values, group, 1)).reshape(len(x), -1), layer["attn"]["o"])
        m = norm(x, layer["mlp_norm"]["weight"])
        gate_up = unfused(layer["mlp"]["gate_up"], "gate_up")
        gate = proj(m, gate_up["gate"])
        return x + proj(gate / (1 + np.exp(-gate)) * proj(m, gate_up["up"]), layer["mlp"]["down"]), q, k, v

    a = p["embed"][np.asarray(AFFIX)]
    x = p["embed"][own]
    is_mask = (own == cfg.mask_token_id).astype(np.float64)
    total = np.zeros(len(AFFIX))
    for i in range(cfg.num_layers):
        layer = p["layers"][i]
        a, _, ka, va = layer_forward(a, np.arange(len(AFFIX)), layer)  # the affix alone, positions 0..L-1
        x, q, _, _ = layer_forward(x, own_pos, layer, ext=(ka, va, affix_pos))
        probs = softmax(np.einsum("qhd,khd->hqk", q, np.repeat(rope(ka, affix_pos), group, 1)) * scale)
        total = total + np.einsum("hqk,q->k", probs, is_mask)
    return total


def test_attention_selector_matches_a_plain_oracle(model, cache):
    batch = make_batch(REQUESTS, BASE["gen_length"], model.config, AFFIX)
    probe = jax.jit(probe_importance, static_argnums=0)
    ours = np.asarray(probe(*model.flat, batch, cache))
    k = math.ceil(0.2 * len(AFFIX))
    result = generate(model, REQUESTS, DecodeConfig(cache="acache", anchor_ratio=0.2, **BASE), affix=cache)
    for i, r in enumerate(REQUESTS):
        oracle = _oracle_importance(model, r)
        np.testing.assert_allclose(ours[i], oracle, rtol=1e-4, atol=1e-4)
        assert result.anchors[i].tolist() == sorted(np.argsort(-oracle, kind="stable")[:k].tolist())
        assert oracle.sum() > 0


def test_a_sweep_over_budgets_and_masses_ranks_with_one_program(model, cache):
    """The selection's forward does not depend on how many anchors a row keeps: budgets and anchor
    masses of one shape share the ranking's program (only the small cut compiles per budget), and
    each budget keeps the first of the plain oracle's order."""
    batch = make_batch(REQUESTS, BASE["gen_length"], model.config, AFFIX)
    oracle = [np.argsort(-_oracle_importance(model, r), kind="stable") for r in REQUESTS]
    select = lambda k, mass=None: np.asarray(select_anchors(*model.flat, batch, cache, k, "attention", mass=mass))
    select(3)
    select(3, mass=0.5)  # with a mass: one more program (its covering count), then none
    compiled = rank_anchors_jit._cache_size()
    for k, mass in ((5, None), (9, None), (5, 0.3), (9, 0.9)):
        anchors = select(k, mass)
        assert anchors.shape == (len(REQUESTS), k)
        for row, order in zip(anchors, oracle):
            kept = row[row < len(AFFIX)]
            assert kept.tolist() == sorted(order[:len(kept)].tolist()) and 0 < len(kept) <= k
            assert mass is not None or len(kept) == k
    assert rank_anchors_jit._cache_size() == compiled


def test_budgets_a_few_anchors_apart_share_the_decode_loop(model, cache):
    """The static loop's anchor axis is K rounded up to ANCHOR_AXIS_STEP: K = 5 and K = 7 run one
    compiled loop, and each decodes exactly as a loop whose axis is K itself (tokens, NFE, forward
    tokens): the padded entries are no anchor."""
    config = DecodeConfig(cache="acache", **BASE)
    run = lambda k: generate(model, REQUESTS, config.replace(anchor_ratio=k / len(AFFIX)), affix=cache)
    runs = {5: run(5)}
    compiled = decode_batch._cache_size()
    runs[7] = run(7)
    assert decode_batch._cache_size() == compiled and anchor_axis(5, len(AFFIX)) == anchor_axis(7, len(AFFIX)) == 8
    batch = make_batch(REQUESTS, BASE["gen_length"], model.config, AFFIX)
    for k, result in runs.items():
        cfg = config.replace(anchor_ratio=k / len(AFFIX))
        exact = select_anchors(*model.flat, batch, cache, k, "attention")
        assert exact.shape == (len(REQUESTS), k)
        tokens, stats = decode_batch(*model.flat, batch, cfg, cache, exact)
        g0 = batch.gen_start
        for i in range(len(REQUESTS)):
            assert result.anchors[i].tolist() == np.asarray(exact[i]).tolist()
            assert result.tokens[i].tolist() == np.asarray(tokens[i, g0:g0 + BASE["gen_length"]]).tolist()
            assert result.nfe[i] == int(stats.nfe[i]) + 1  # + the probe
            probed = int((batch.valid & ~batch.affix_columns())[i].sum())
            assert result.forward_tokens[i] == int(stats.forward_tokens[i]) + probed


def test_an_adaptive_budget_keeps_the_anchors_covering_the_mass(model, cache):
    """Under an anchor mass each row keeps the fewest of its best-probed affix tokens that hold that
    share of its importance (the plain oracle's), clipped to the ratio bounds, and decodes in the
    batch exactly as under a fixed budget of that many anchors (same tokens, NFE, forward tokens)."""
    ratio, mass, floor, L = 0.5, 0.4, 0.1, len(AFFIX)
    config = DecodeConfig(cache="acache", anchor_ratio=ratio, anchor_mass=mass, anchor_min_ratio=floor, **BASE)
    batched = generate(model, REQUESTS, config, affix=cache)
    kept = []
    for i, r in enumerate(REQUESTS):
        score = _oracle_importance(model, r)
        order = np.argsort(-score, kind="stable")
        held = np.cumsum(score[order])
        kept.append(int(np.clip(np.searchsorted(held, mass * held[-1]) + 1, math.ceil(floor * L), math.ceil(ratio * L))))
        assert batched.anchors[i].tolist() == sorted(order[:kept[-1]].tolist())
    assert len(set(kept)) > 1, kept  # the rows' budgets differ
    for k in set(kept):  # the rows of each budget together, under that fixed budget
        rows = [i for i, ki in enumerate(kept) if ki == k]
        fixed = generate(model, [REQUESTS[i] for i in rows], config.replace(anchor_mass=None, anchor_ratio=(k - 0.5) / L),
                         affix=cache)
        for j, i in enumerate(rows):
            assert batched.anchors[i].tolist() == fixed.anchors[j].tolist()
            assert batched.tokens[i].tolist() == fixed.tokens[j].tolist()
            assert batched.nfe[i] == fixed.nfe[j] and batched.forward_tokens[i] == fixed.forward_tokens[j]


@pytest.mark.parametrize("selector", ["hkvd", "hkvd_block"])
def test_hkvd_selectors_match_a_per_request_oracle(model, cache, selector):
    """An affix token's hkvd score is the deviation of its K/V over all layers between the request's
    own forward (one unpadded row; hkvd_block: without the generation after the first block, the
    other columns at their own positions) and the affix cache."""
    config = DecodeConfig(cache="acache", anchor_ratio=0.2, selector=selector, **BASE)
    result = generate(model, REQUESTS, config, affix=cache)
    k = math.ceil(0.2 * len(AFFIX))
    for i, r in enumerate(REQUESTS):
        row = r.row(AFFIX, BASE["gen_length"], model.config.mask_token_id)
        cols = np.arange(row.num_columns)
        if selector == "hkvd_block":
            cols = cols[(cols < row.gen_start + BASE["block_length"]) | (cols >= row.gen_start + row.gen_length)]
        out = model.forward(jnp.asarray(row.tokens[cols])[None], ForwardInputs(jnp.asarray(cols, jnp.int32)[None]),
                            with_logits=False)
        at = np.flatnonzero(np.isin(cols, row.affix_columns))
        f64 = lambda a: np.asarray(a, np.float64)
        deviation = sum(((f64(ours[0])[at] - f64(cached)) ** 2).sum((1, 2))
                        for ours, cached in zip(out.k + out.v, cache.k + cache.v))
        assert result.anchors[i].tolist() == sorted(np.argsort(-deviation, kind="stable")[:k].tolist())


@pytest.mark.parametrize("model", ["llada"], indirect=True)  # counts of columns: the family does not matter
def test_recompute_forward_width_is_anchors_plus_private(model, cache):
    """The block-start recompute computes K + non-affix tokens, not L + non-affix (fixed schedule:
    one token per step, 2 blocks of 8, so 2 recomputes, 14 block steps, 1 probe)."""
    r = REQUESTS[0]
    steps = dict(gen_length=16, block_length=8, threshold=None, steps=16)
    non_affix = len(r.prompt) + 16
    # what each selector's forward computes: the request's own tokens (the attention probe), all of
    # it (hkvd), its text and first block (hkvd_block)
    probed = dict(attention=non_affix, hkvd=len(AFFIX) + non_affix, hkvd_block=len(AFFIX) + len(r.prompt) + 8)
    for ratio, selector in ((0.0, "attention"), (0.2, "attention"), (0.5, "attention"), (0.2, "hkvd"),
                            (0.2, "hkvd_block")):
        k = math.ceil(ratio * len(AFFIX))
        out = generate(model, [r], DecodeConfig(cache="acache", anchor_ratio=ratio, selector=selector, **steps),
                       affix=cache)
        probe = probed[selector] if k else 0
        assert out.forward_tokens[0] == probe + 2 * (k + non_affix) + 14 * 8
        assert out.nfe[0] == 16 + (1 if k else 0)
    dual = generate(model, [r], DecodeConfig(cache="dual", **steps), affix=AFFIX)
    assert dual.forward_tokens[0] == 2 * (len(AFFIX) + non_affix) + 14 * 8


def test_drop_non_anchor_differs_and_keeps_anchors(model, cache):
    keep = generate(model, REQUESTS, DecodeConfig(cache="acache", anchor_ratio=0.2, **BASE), affix=cache)
    drop = generate(model, REQUESTS, DecodeConfig(cache="acache", anchor_ratio=0.2, drop_non_anchor=True, **BASE),
                    affix=cache)
    assert [a.tolist() for a in keep.anchors] == [a.tolist() for a in drop.anchors]
    assert _tokens(keep) != _tokens(drop)
    full_drop = generate(model, REQUESTS, DecodeConfig(cache="acache", anchor_ratio=1.0, drop_non_anchor=True, **BASE),
                         affix=cache)
    dual = generate(model, REQUESTS, DecodeConfig(cache="dual", **BASE), affix=AFFIX)
    assert _tokens(full_drop) == _tokens(dual)  # nothing to drop when every affix token is an anchor


def test_bad_input(model, cache, fixtures_dir):
    acache = DecodeConfig(cache="acache", **BASE)
    with pytest.raises(InputError, match="the affix is empty"):
        build_affix_cache(model, [])
    with pytest.raises(InputError, match="more than the model's context"):
        build_affix_cache(model, [1] * (model.config.max_seq_len + 1))
    with pytest.raises(InputError, match="exceeds the model's context"):
        generate(model, [Request([1] * 230, affix_position="prefix")], acache, affix=cache)
    with pytest.raises(InputError, match=r"anchor ratio must be in \[0, 1\]"):
        generate(model, REQUESTS, DecodeConfig(cache="acache", anchor_ratio=1.5, **BASE), affix=cache)
    with pytest.raises(InputError, match="infix affix needs a prompt tail"):
        generate(model, [Request([1, 2], affix_position="infix")], acache, affix=cache)
    with pytest.raises(InputError, match="affix_position 'prefix' given without an affix"):
        generate(model, REQUESTS, acache)
    with pytest.raises(InputError, match="cache policy 'acache' needs an affix"):
        generate(model, [Request([1, 2])], acache)
    with pytest.raises(InputError, match="an affix was given but the request has no affix_position"):
        generate(model, [Request([1, 2])], acache, affix=cache)
    other = acache_jax.load(fixtures_dir / "models" / ("llada_mha" if model.config.family == "llada" else "dream_gqa"),
                            dtype="float32")
    with pytest.raises(InputError, match="built with another model"):
        generate(other, [Request([1, 2], affix_position="prefix")], acache, affix=cache)
