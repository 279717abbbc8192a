"""Token- and anchor-exact parity with upstream ACache's LLaDA code (fixtures made by
tests/fixtures/generate_acache_fixtures.py) for prefix, infix and suffix affixes."""

import itertools
import json

import pytest

import acache_jax
from acache_jax.decode import DecodeConfig, generate
from acache_jax.layout import Request


@pytest.fixture(scope="module")
def fixture(fixtures_dir):
    return json.loads((fixtures_dir / "acache" / "llada_cases.json").read_text())


@pytest.fixture(scope="module")
def model(fixtures_dir):
    return acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")


def test_tokens_anchors_and_nfe_equal_upstream(model, fixture):
    cache = acache_jax.build_affix_cache(model, fixture["affix"])
    key = lambda c: (c["placement"], c["ratio"])
    checked = 0
    for (placement, ratio), group in itertools.groupby(sorted(fixture["cases"], key=key), key=key):
        group = list(group)
        config = DecodeConfig(gen_length=fixture["gen_length"], block_length=fixture["block_length"],
                              threshold=fixture["threshold"], cache="acache", anchor_ratio=ratio)
        requests = [Request(c["prompt"], tail=c["tail"], affix_position=placement) for c in group]
        out = generate(model, requests, config, affix=cache)  # both queries in one batch
        for i, case in enumerate(group):
            where = f"{placement} ratio {ratio} prompt {case['prompt']}"
            assert out.tokens[i].tolist() == case["tokens"], where
            assert out.nfe[i] == case["nfe"], where
            if case["anchors"]:
                assert out.anchors[i].tolist() == case["anchors"], where
            checked += 1
    assert checked == 18
