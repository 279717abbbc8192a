"""Token-exact parity with the upstream PyTorch samplers (fixtures made by
tests/fixtures/generate_decode_fixtures.py from Fast-dLLM's and LLaDA's generate code)."""

import itertools
import json

import pytest

import acache_jax
from acache_jax.decoding.decode import generate
from acache_jax.network.config import DecodeConfig


def _groups(fixtures_dir, family):
    cases = json.loads((fixtures_dir / "decode" / family / "cases.json").read_text())
    key = lambda c: c["name"]
    return [(name, list(group)) for name, group in itertools.groupby(sorted(cases, key=key), key=key)]


@pytest.fixture(scope="module")
def models(fixtures_dir):
    return {f: acache_jax.load(fixtures_dir / "decode" / f, dtype="float32") for f in ("llada", "dream")}


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_tokens_equal_upstream(fixtures_dir, models, family):
    """Each setting's prompts (of different lengths) run as one batch; every row equals upstream's
    batch-1 result, and for LLaDA so does the NFE (upstream's count includes block-start forwards)."""
    checked = 0
    for name, cases in _groups(fixtures_dir, family):
        config = DecodeConfig(**cases[0]["decode"], early_stop=False)  # upstream computes every block
        result = generate(models[family], [c["prompt"] for c in cases], config)
        for case, tokens, nfe in zip(cases, result.tokens, result.nfe):
            assert tokens.tolist() == case["tokens"], f"{family}/{name} prompt {case['prompt']}"
            if case["nfe"] is not None:
                assert nfe == case["nfe"], f"{family}/{name} NFE"
            checked += 1
    assert checked >= 12


def test_fixtures_exercise_parallel_commits(fixtures_dir):
    """The fixtures are only meaningful if steps commit several tokens at once: one token per
    forward would take 32 forwards for the 32 generated tokens."""
    for name, cases in _groups(fixtures_dir, "llada"):
        if name in ("dual_threshold_low", "dual_factor", "none_factor"):
            assert all(c["nfe"] <= 24 for c in cases), name
        if "threshold" in name:
            assert min(c["nfe"] for c in cases) < 32, name
