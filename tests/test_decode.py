"""Decode loop behaviour: batch invariance, compilation per bucket, NFE accounting, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import acache_jax
from acache_jax.decoding import decode, sampling
from acache_jax.decoding.decode import generate
from acache_jax.decoding.layout import Request, RequestError, make_batch
from acache_jax.network.config import DecodeConfig, DecodeError

PROMPTS = [[5, 17, 33, 2, 90], [11, 3, 3, 64, 101, 7, 45, 19, 8, 100, 2], [23, 99], [1, 2, 3, 4, 5, 6, 7]]


@pytest.fixture(scope="module")
def llada(fixtures_dir):
    return acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")


@pytest.fixture(scope="module")
def dream(fixtures_dir):
    return acache_jax.load(fixtures_dir / "decode" / "dream", dtype="float32")


@pytest.mark.parametrize("family,config", [
    ("llada", DecodeConfig(gen_length=16, block_length=8, cache="dual", temperature=0.7, threshold=0.6)),
    ("llada", DecodeConfig(gen_length=16, block_length=8, cache="prefix", threshold=None, steps=8, cfg_scale=1.0)),
    ("llada", DecodeConfig(gen_length=16, block_length=8, cache="none", threshold=None, factor=1.0, remasking="random")),
    ("dream", DecodeConfig(gen_length=16, block_length=8, cache="dual", temperature=0.8, top_p=0.9, threshold=None,
                           steps=8, alg="topk_margin", alg_temp=0.5)),
    ("dream", DecodeConfig(gen_length=16, block_length=8, cache="prefix", threshold=None, steps=8, alg="origin",
                           temperature=0.5, top_k=20)),
])
def test_each_row_equals_the_request_alone(request, family, config):
    """Mixed lengths, a padding row (3 requests in a batch of 4) and per-request random seeds."""
    model = request.getfixturevalue(family)
    requests = [Request(p, seed=10 + i) for i, p in enumerate(PROMPTS[:3])]
    batched = generate(model, requests, config)
    for i, r in enumerate(requests):
        alone = generate(model, [r], config)
        np.testing.assert_array_equal(batched.tokens[i], alone.tokens[0])
        assert batched.nfe[i] == alone.nfe[0] and batched.forward_tokens[i] == alone.forward_tokens[0]
        assert (alone.tokens[0] != model.config.mask_token_id).all()


def test_no_recompilation_within_a_bucket(llada):
    config = DecodeConfig(gen_length=16, block_length=8, threshold=0.7)
    generate(llada, [PROMPTS[0], PROMPTS[1]], config)
    compiled = decode.decode_batch._cache_size()
    generate(llada, [PROMPTS[2], PROMPTS[3]], config)  # other lengths, same (batch 2, length 16) bucket
    generate(llada, [[9] * 16, [4] * 3], config)
    assert decode.decode_batch._cache_size() == compiled
    generate(llada, [[9] * 17], config)  # a longer bucket compiles once
    assert decode.decode_batch._cache_size() == compiled + 1


@pytest.mark.parametrize("family,base,changes", [
    ("llada", DecodeConfig(gen_length=16, block_length=8, temperature=0.7, threshold=0.6),
     [dict(temperature=0.3), dict(threshold=0.8), dict(temperature=1.5, threshold=0.5)]),
    ("llada", DecodeConfig(gen_length=16, block_length=8, threshold=None, factor=1.0), [dict(factor=2.5)]),
    ("dream", DecodeConfig(gen_length=16, block_length=8, temperature=0.8, top_p=0.9, threshold=None, steps=8,
                           alg_temp=0.5), [dict(temperature=0.4, top_p=0.6, alg_temp=1.5)]),
])
def test_sampler_numbers_share_the_program(request, family, base, changes):
    """Configs that differ only in the sampler's numbers run one compiled loop (the numbers are traced),
    and give the tokens of the loop with those numbers compiled in (fp32)."""
    model = request.getfixturevalue(family)
    prompt = Request(PROMPTS[1], seed=3)
    generate(model, [prompt], base)
    compiled = decode.decode_batch._cache_size()
    batch = make_batch([prompt], base.gen_length, model.config, None)
    for change in changes:
        config = base.replace(**change)
        traced = generate(model, [prompt], config).tokens[0]
        assert decode.decode_batch._cache_size() == compiled, change
        built_in, _ = decode.decode_batch(*model.flat, batch, config)  # numbers in the program's key
        compiled = decode.decode_batch._cache_size()
        g0 = batch.gen_start
        np.testing.assert_array_equal(traced, np.asarray(built_in)[0, g0:g0 + config.gen_length])


def test_nfe_and_forward_tokens(llada):
    """A fixed schedule of one token per step: 16 forwards; dual-cache in-block steps cost one block."""
    prompt = PROMPTS[0]
    steps = dict(gen_length=16, block_length=8, threshold=None, steps=16)
    none = generate(llada, [prompt], DecodeConfig(cache="none", **steps))
    dual = generate(llada, [prompt], DecodeConfig(cache="dual", **steps))
    prefix = generate(llada, [prompt], DecodeConfig(cache="prefix", **steps))
    total = len(prompt) + 16
    assert none.nfe[0] == dual.nfe[0] == prefix.nfe[0] == 16
    assert none.forward_tokens[0] == 16 * total
    assert dual.forward_tokens[0] == 2 * total + 14 * 8  # 2 block starts + 14 block-only steps
    # prefix: in-block steps see the block and everything after it (16 then 8 tokens)
    assert prefix.forward_tokens[0] == 2 * total + 7 * 16 + 7 * 8
    assert none.seconds[0] > 0 and none.batch_forward_calls == 16


@pytest.mark.parametrize("kwargs,message", [
    (dict(gen_length=20, block_length=8), "multiple of block_length"),
    (dict(threshold=0.0), r"threshold must be in \(0, 1\]"),
    (dict(threshold=1.5), r"threshold must be in \(0, 1\]"),
    (dict(cache="paged"), "unknown cache policy 'paged'"),
    (dict(threshold=None, steps=7, gen_length=16, block_length=8), "multiple of the number of blocks"),
    (dict(remasking="lowest"), "unknown remasking"),
])
def test_bad_settings(llada, kwargs, message):
    with pytest.raises(DecodeError, match=message):
        generate(llada, [PROMPTS[0]], DecodeConfig(**kwargs))


def test_bad_requests(llada):
    with pytest.raises(RequestError, match="request 1: empty prompt"):
        generate(llada, [PROMPTS[0], []], DecodeConfig(gen_length=16, block_length=8))
    too_long = [1] * (llada.config.max_seq_len - 10)
    with pytest.raises(RequestError, match="exceeds the model's context of 256"):
        generate(llada, [too_long], DecodeConfig(gen_length=16, block_length=8))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        generate(llada, [[1, 500]], DecodeConfig(gen_length=16, block_length=8))
    with pytest.raises(RequestError, match="no prompts"):
        generate(llada, [], DecodeConfig())


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mask_is_never_proposed(family, temperature):
    """Logits that favour [MASK] by far still propose another token, with and without sampling: a
    committed mask would stay masked and its block never finish."""
    vocab, mask = 16, 15
    logits = jnp.zeros((2, 8, vocab)).at[..., mask].set(30.0).at[..., 3].set(1.0)
    keys = jax.random.split(jax.random.key(0), 2)
    cfg = sampling.SamplerConfig(family=family, mask_token_id=mask, temperature=temperature)
    x0, conf = sampling.propose(logits, keys, cfg)
    assert (np.asarray(x0) != mask).all() and np.isfinite(np.asarray(conf)).all()
