"""Parity with upstream ACache's code (fixtures made by tests/fixtures/generate_acache_fixtures.py) for
prefix, infix and suffix affixes: LLaDA tokens, NFE and anchors at ratios 0, 0.2, 1; Dream tokens at
ratios 0 and 1 (upstream's Dream probe is not the paper's, and it skips the probe at ratio 1)."""

import itertools
import json

import pytest

import acache_jax
from acache_jax.decoding.decode import generate
from acache_jax.decoding.layout import Request
from acache_jax.network.config import DecodeConfig


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_acache_equals_upstream(fixtures_dir, family):
    fixture = json.loads((fixtures_dir / "acache" / f"{family}_cases.json").read_text())
    model = acache_jax.load(fixtures_dir / "decode" / family, dtype="float32")
    cache = acache_jax.build_affix_cache(model, fixture["affix"])
    key = lambda c: (c["placement"], c["ratio"])
    checked = 0
    for (placement, ratio), group in itertools.groupby(sorted(fixture["cases"], key=key), key=key):
        group = list(group)
        config = DecodeConfig(gen_length=fixture["gen_length"], block_length=fixture["block_length"],
                              threshold=fixture["threshold"], cache="acache", anchor_ratio=ratio,
                              early_stop=False)  # upstream computes every block
        requests = [Request(c["prompt"], tail=c["tail"], affix_position=placement) for c in group]
        out = generate(model, requests, config, affix=cache)  # the queries of a setting in one batch
        for i, case in enumerate(group):
            where = f"{family} {placement} ratio {ratio} prompt {case['prompt']}"
            assert out.tokens[i].tolist() == case["tokens"], where
            if family == "llada":
                assert out.nfe[i] == case["nfe"], where
                if case["anchors"]:
                    assert out.anchors[i].tolist() == case["anchors"], where
            elif ratio == 0:
                assert out.nfe[i] == case["nfe"], where
            checked += 1
    assert checked == (18 if family == "llada" else 12)
