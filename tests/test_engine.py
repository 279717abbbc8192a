"""The serving engine against the static path (tiny fp32 models), its compilation and pool limits."""

import functools
import logging
import threading

import jax
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import acache_jax
from acache_jax.decoding.decode import generate
from acache_jax.decoding.layout import Request, RequestError
from acache_jax.engine import Engine, RequestTooLargeError, runner
from acache_jax.engine.engine import DEFAULT_STEP_TOKENS
from acache_jax.network.config import DecodeConfig, DecodeError

AFFIX = list(range(30, 53))  # 23 tokens
REQUESTS = [
    Request([5, 17, 33, 2, 90], affix_position="prefix", seed=1),
    Request([11, 3, 3, 64, 8, 1, 2, 9, 4], tail=[7, 8, 9, 10], affix_position="infix", seed=2),
    Request([23, 99, 54], affix_position="suffix", seed=3),
    Request([1, 2, 3, 4, 5, 6, 7], affix_position="prefix", seed=4),
    Request([13, 14], tail=[12, 40], affix_position="infix", seed=5),
]


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request, fixtures_dir):
    return acache_jax.load(fixtures_dir / "decode" / request.param, dtype="float32")


# The parity tests run fixed shapes (Engine(fixed_shapes=True), a server's): these small workloads
# then need one token axis, so they compile a few programs, where shapes that follow the requests
# compile one per step size. The shapes of the default mode are checked from test_no_recompilation_...
# on, and its tokens in test_results_are_handed_out_once, test_engine_hooks and test_lm_eval.
FIXED = dict(fixed_shapes=True)

# Every policy on LLaDA; on Dream (logits shifted, its own RoPE and biases) the two selective ones.
# ACache in two submission orders; the other policies differ in what they read, not in how they
# are scheduled, so one (shuffled) order each.
SHUFFLED = [3, 0, 4, 2, 1]


@pytest.mark.parametrize("model,cache,extra,orders", [
    ("llada", "acache", dict(anchor_ratio=0.3, temperature=0.7), [range(len(REQUESTS)), SHUFFLED]),
    ("llada", "dual", dict(temperature=0.7), [SHUFFLED]),
    ("llada", "direct", dict(threshold=None, steps=8), [SHUFFLED]),
    ("llada", "acache", dict(anchor_ratio=0.2, drop_non_anchor=True), [SHUFFLED]),
    ("dream", "acache", dict(anchor_ratio=0.3, temperature=0.7), [range(len(REQUESTS)), SHUFFLED]),
    ("dream", "direct", dict(threshold=None, steps=8), [SHUFFLED]),
    ("llada", "acache", dict(anchor_ratio=0.3, selector="hkvd_block"), [SHUFFLED]),
    ("dream", "acache", dict(anchor_ratio=0.3, selector="hkvd"), [SHUFFLED]),
    ("llada", "acache", dict(anchor_ratio=0.5, anchor_mass=0.6, anchor_min_ratio=0.1), [SHUFFLED])],
    indirect=["model"])
def test_engine_equals_static_path_in_any_order(model, cache, extra, orders):
    """Same tokens, anchors and NFE as `generate`, with requests queued (batch 2) and finishing at
    different times, in any submission order."""
    cfg = DecodeConfig(gen_length=16, block_length=8, cache=cache, **extra)
    static = generate(model, REQUESTS, cfg, affix=AFFIX)
    for order in orders:
        order = list(order)
        engine = Engine(model, cfg, pool_tokens=200, block_size=8, max_batch=2, **FIXED)
        results = engine.generate([REQUESTS[i] for i in order], AFFIX)
        for i, res in zip(order, results):
            assert res.tokens.tolist() == static.tokens[i].tolist(), (cache, i)
            assert res.anchors.tolist() == static.anchors[i].tolist()
            assert res.nfe == static.nfe[i]
        assert engine.usage().blocks_in_use == 0
        assert engine.stats.affix_fills == (0 if cache == "dual" else 1)


@pytest.mark.parametrize("model", ["llada"], indirect=True)
def test_engines_sharing_one_pool_decode_as_alone_and_share_its_affix(model):
    """Two engines of other settings in one `PagedPool` (a server's, one per decoding setting),
    stepped in turn from one thread: each gives the static path's tokens, anchors and NFE; the
    affix is filled once and read by both; every block is free at the end; and an engine given
    the pool adds no device memory (with a pool of its own it added one)."""
    from acache_jax.engine.pool import PagedPool

    live_bytes = lambda: sum(a.nbytes for a in jax.live_arrays())
    configs = [DecodeConfig(gen_length=16, block_length=8, cache=cache, **extra) for cache, extra in
               (("acache", dict(anchor_ratio=0.3, temperature=0.7)), ("direct", dict(threshold=None, steps=8)))]
    pool = PagedPool.create(model, 200, 8)  # the size of the parity test's engines: the same programs
    before = live_bytes()
    engines = [Engine(model, cfg, max_batch=2, pool=pool, **FIXED) for cfg in configs]
    assert live_bytes() - before < 0.1 * sum(a.nbytes for a in jax.tree.leaves(pool.kv))
    ids = [[e.add(r, AFFIX) for r in REQUESTS] for e in engines]
    got: list[dict] = [{}, {}]
    while any(e.has_unfinished() for e in engines):
        for e, done in zip(engines, got):
            if e.has_unfinished():
                done.update((r.request_id, r) for r in e.step())
    for e, cfg, rids, done in zip(engines, configs, ids, got):
        static = generate(model, REQUESTS, cfg, affix=AFFIX)
        for i, rid in enumerate(rids):
            assert done[rid].tokens.tolist() == static.tokens[i].tolist(), (cfg.cache, i)
            assert done[rid].anchors.tolist() == static.anchors[i].tolist() and done[rid].nfe == static.nfe[i]
        e.drain()
    assert [e.stats.affix_fills for e in engines] == [1, 0]  # the second found it resident
    assert pool.blocks.num_free_blocks == pool.blocks.num_blocks
    with pytest.raises(DecodeError, match="not to be given with `pool`"):
        Engine(model, configs[0], pool=pool, pool_tokens=200)


def test_no_recompilation_in_steady_state(fixtures_dir):
    model = acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")
    cfg = DecodeConfig(gen_length=16, block_length=8, cache="acache", anchor_ratio=0.2)
    engine = Engine(model, cfg, pool_tokens=400, block_size=8, max_batch=4)
    steps = (runner.packed_step, runner.block_loop)
    shifted = lambda d: [Request([t + d for t in r.prompt], tail=r.tail, affix_position=r.affix_position, seed=9 + d)
                         for r in reversed(REQUESTS[:4])]
    # The first run grows the read-set widths to what this workload needs; the next ones run the
    # steps at those widths, with and without a second read set (a step whose requests all read
    # their affix in their own set has none: `Runner._reads_whole`), for the mixes of placements
    # that their finishing order leaves together.
    engine.generate(REQUESTS[:4], AFFIX)
    engine.generate(shifted(1), AFFIX)
    engine.generate(shifted(2), AFFIX)
    compiled = [f._cache_size() for f in steps]
    # Different prompts of similar lengths and another arrival order: every shape was seen before.
    for d in (3, 4):
        engine.generate(shifted(d), AFFIX)
    assert [f._cache_size() for f in steps] == compiled


def test_engines_that_differ_only_in_anchor_ratio_share_programs(fixtures_dir):
    """The ratio sets each request's anchor count on the host: an engine with another ratio (and
    the same K) runs the steps compiled for the first."""
    model = acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")
    steps = (runner.packed_step, runner.block_loop)
    make = lambda ratio: Engine(model, DecodeConfig(gen_length=16, block_length=8, cache="acache", anchor_ratio=ratio),
                                pool_tokens=400, block_size=8, max_batch=4)
    first = make(0.18).generate(REQUESTS[:2], AFFIX)
    compiled = [f._cache_size() for f in steps]
    second = make(0.19).generate(REQUESTS[:2], AFFIX)
    assert [f._cache_size() for f in steps] == compiled
    assert [r.anchors.tolist() for r in first] == [r.anchors.tolist() for r in second]  # K = 5 of 23 both


def test_engines_that_differ_only_in_sampler_numbers_and_gen_length_share_programs(fixtures_dir):
    """Temperature and threshold reach the steps traced (`sampling.SamplerValues`), and the steps
    see one block at a time (`DecodeConfig.engine_key`): an engine with other numbers and another
    gen length runs the steps compiled for the first (a server's request with its own temperature
    compiles nothing), and still gives the static path's tokens. (Fixed shapes, as a server's: the
    longer requests' steps then fall in the same token axes.)"""
    model = acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")
    steps = (runner.packed_step, runner.block_loop)
    make = lambda **knobs: DecodeConfig(block_length=8, cache="acache", anchor_ratio=0.2, **knobs)
    engine = lambda config: Engine(model, config, pool_tokens=400, block_size=8, max_batch=4, **FIXED)
    engine(make(gen_length=16, temperature=0.7, threshold=0.9)).generate(REQUESTS[:2], AFFIX)
    compiled = [f._cache_size() for f in steps]
    config = make(gen_length=24, temperature=0.3, threshold=0.6)
    results = engine(config).generate(REQUESTS[:2], AFFIX)
    assert [f._cache_size() for f in steps] == compiled
    static = generate(model, REQUESTS[:2], config, affix=AFFIX)
    assert [r.tokens.tolist() for r in results] == [t.tolist() for t in static.tokens]
    assert all(len(r.tokens) == 24 for r in results)


@pytest.mark.parametrize("model", ["llada", "dream"], indirect=True)
def test_requests_with_their_own_sampler_numbers_share_one_engine(model):
    """Requests whose configs differ from the engine's only in the sampler's numbers and the anchor
    ratios run side by side in one engine (a server's, for every temperature of one rule), each
    committing with its own numbers: each gives the static path's tokens, anchors and NFE under its
    own config. A config that needs other programs (temperature 0: no sampling) is refused."""
    base = DecodeConfig(gen_length=16, block_length=8, cache="acache", anchor_ratio=0.3, temperature=0.7)
    own = [base, base.replace(temperature=0.3), base.replace(temperature=1.5, threshold=0.6),
           base.replace(anchor_ratio=0.2), base.replace(temperature=0.9, threshold=0.8)]
    engine = Engine(model, base, pool_tokens=200, block_size=8, max_batch=2, **FIXED)  # the parity test's programs
    ids = [engine.add(r, AFFIX, config=c) for r, c in zip(REQUESTS, own)]
    results = {r.request_id: r for r in engine.run()}
    for i, (rid, cfg) in enumerate(zip(ids, own)):
        static = generate(model, REQUESTS, cfg, affix=AFFIX)  # all five: the parity test's batch shape
        assert results[rid].tokens.tolist() == static.tokens[i].tolist(), i
        assert results[rid].anchors.tolist() == static.anchors[i].tolist() and results[rid].nfe == static.nfe[i]
    assert len({tuple(r.tokens.tolist()) for r in results.values()}) > 1
    with pytest.raises(DecodeError, match=r"differs in \['temperature'\]"):
        engine.add(REQUESTS[0], AFFIX, config=base.replace(temperature=0.0))


def test_a_warmed_up_engine_compiles_no_step(fixtures_dir, caplog):
    """With fixed shapes, `warm_up` compiles every packed step and block loop beforehand (a server
    starting): serving then compiles only the affix fill, and the tokens are the static path's."""
    model = acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")
    cfg = DecodeConfig(gen_length=16, block_length=8, cache="acache", anchor_ratio=0.3, temperature=0.7)
    # a pool size of its own: no other test has compiled these programs, whatever ran before
    engine = Engine(model, cfg, pool_tokens=264, block_size=8, max_batch=2, **FIXED)
    stopped = threading.Event()
    stopped.set()
    assert engine.warm_up(128, stop=stopped) == 0  # a server stopping: no compile starts
    # one token axis: probing, and not probing with and without a second read set; loops of 1 and
    # 2 rows with and without one
    assert engine.warm_up(128) == 3 + 4
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        results = engine.generate(REQUESTS, AFFIX)
        prefixed = engine.generate([REQUESTS[0], REQUESTS[3]], AFFIX)  # one read set after their probe
    compiled = [r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("Compiling ")]
    assert compiled == ["jit(compute_affix)"]  # the affix fill, which the warm-up leaves to the first request
    static = generate(model, REQUESTS, cfg, affix=AFFIX)
    assert [r.tokens.tolist() for r in results + prefixed] == [static.tokens[i].tolist() for i in (0, 1, 2, 3, 4, 0, 3)]
    with pytest.raises(ValueError, match="fixed shapes"):
        Engine(model, cfg, pool_tokens=200, block_size=8).warm_up(128)


def test_pool_limits(fixtures_dir):
    model = acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")
    cfg = DecodeConfig(gen_length=16, block_length=8, cache="acache", anchor_ratio=0.2)
    # Room for the affix and about one request at a time: the rest wait, nothing crashes.
    engine = Engine(model, cfg, pool_tokens=80, block_size=8, max_batch=4)
    results = engine.generate(REQUESTS[:3], AFFIX)
    assert len(results) == 3 and engine.stats.peak_blocks <= 10
    with pytest.raises(RequestTooLargeError, match="more than the pool"):
        Engine(model, cfg, pool_tokens=32, block_size=8).add(REQUESTS[1], AFFIX)
    # The default pool of one request: a request as long as the context (14 pages of 8) also holds
    # its 5 anchors, and its private and affix slots each end in a part-filled page (12 + 3 pages
    # for 90 + 23 slots).
    prompt = Request(list(range(1, 70)), affix_position="suffix")
    for cache, ratio in (("acache", 0.2), ("acache", 1.0), ("direct", 0.2), ("dual", 0.2)):
        one = Engine(model, cfg.replace(cache=cache, anchor_ratio=ratio), block_size=8, max_batch=1, context=108)
        one.add(prompt, AFFIX)  # 69 + 23 + 16 tokens: the context
        assert one.usage().waiting == 1
        with pytest.raises(RequestError, match="context"):
            one.add(Request(list(range(1, 71)), affix_position="suffix"), AFFIX)


def test_the_engine_context_bounds_its_pool_read_widths_and_requests(fixtures_dir):
    """`context` (a server's --max-model-len) sizes the default pool (max_batch x context here) and, with
    fixed shapes, the read widths, in place of the model's context (256 here; Dream's 131072 made a
    server's pool and programs too large for an H200); a longer request is refused, and so is a
    context beyond the model's."""
    model = acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")
    cfg = DecodeConfig(gen_length=16, block_length=8, cache="acache", anchor_ratio=0.2)
    whole = Engine(model, cfg, block_size=8, max_batch=2, **FIXED)
    assert whole.runner.pool.num_slots == 2 * 256 and whole.runner.read_widths == [256, 256]
    engine = Engine(model, cfg, block_size=8, max_batch=2, context=64, **FIXED)
    assert engine.runner.pool.num_slots == 2 * 64 and engine.usage().blocks == 2 * 64 // 8
    assert engine.runner.read_widths == [64, 64]
    engine.add(Request([5] * 48), gen_length=16)  # 64 tokens: queued
    too_long = r"prompt 49 \+ gen_length 16 = 65 tokens exceeds this engine's context of 64"
    with pytest.raises(RequestError, match=too_long):
        engine.add(Request([5] * 49), gen_length=16)
    with pytest.raises(DecodeError, match="context 257 exceeds the model's context of 256 tokens"):
        Engine(model, cfg, context=257)


def test_engine_rejects_what_it_cannot_run(fixtures_dir):
    model = acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")
    with pytest.raises(DecodeError, match="cache policies"):
        Engine(model, DecodeConfig(cache="prefix"))
    with pytest.raises(DecodeError, match="guidance"):
        Engine(model, DecodeConfig(cache="dual", cfg_scale=1.0))
    with pytest.raises(DecodeError, match="selects anchors with .* not 'random'"):
        Engine(model, DecodeConfig(cache="acache", selector="random"))
    with pytest.raises(RequestError, match="no affix_position"):
        Engine(model, DecodeConfig(cache="acache", gen_length=16, block_length=8)).add(Request([1, 2, 3]), AFFIX)
    np.testing.assert_equal(Engine(model, DecodeConfig(cache="dual", gen_length=8, block_length=8),
                                   pool_tokens=64).generate([Request([1, 2, 3])])[0].tokens.shape, (8,))


def test_engine_kernel_path_equals_xla(fixtures_dir):
    """The engine's pallas path (interpreted here): pool keys stored rotated, read as a shared-affix
    and a private set at their offsets, gives the xla path's tokens and anchors."""
    model = acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")
    outs = []
    for backend in ("xla", "pallas"):
        cfg = DecodeConfig(gen_length=8, block_length=8, cache="acache", anchor_ratio=0.3, attn_backend=backend)
        engine = Engine(model, cfg, pool_tokens=200, block_size=8, max_batch=3)
        outs.append(engine.generate(REQUESTS[:3], AFFIX))
    for xla, pallas in zip(*outs):
        assert pallas.tokens.tolist() == xla.tokens.tolist()
        assert pallas.anchors.tolist() == xla.anchors.tolist()


def test_results_are_handed_out_once(fixtures_dir):
    """generate() returns what it was asked; requests queued before keep running and the next run()
    hands them out; nothing handed out is kept."""
    model = acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")
    cfg = DecodeConfig(gen_length=16, block_length=8, cache="dual")
    engine = Engine(model, cfg, pool_tokens=400, block_size=8, max_batch=4)
    early = [engine.add(r) for r in (Request([1, 2, 3], seed=1), Request([4, 5], seed=2))]
    mine = engine.generate([Request([7, 8, 9], seed=3)])
    assert len(mine) == 1 and mine[0].request_id not in early
    later = engine.run()
    assert sorted(r.request_id for r in later) == early
    assert engine.run() == [] and not engine.has_unfinished()
    assert engine.usage().blocks_in_use == 0
    alone = generate(model, [Request([1, 2, 3], seed=1), Request([4, 5], seed=2)], cfg)
    assert [r.tokens.tolist() for r in later] == [t.tolist() for t in alone.tokens]


@settings(max_examples=2, deadline=None, derandomize=True)
@example(arrivals=[(4, "prefix", 0, 16), (6, "infix", 1, 8), (2, "suffix", 1, 16)])
@given(st.lists(st.tuples(st.integers(1, 9), st.sampled_from(["prefix", "infix", "suffix"]), st.integers(0, 3),
                          st.sampled_from([8, 16])), min_size=2, max_size=5))
def test_packed_steps_mix_probes_recomputes_and_decodes(fixtures_dir, arrivals):
    """Requests arriving at different iterations put probe, recompute and in-block tokens of several
    requests into one packed forward; each request decodes exactly as it does alone."""
    model, engine = _mixing_engine(fixtures_dir)
    requests = [Request(list(range(3, 3 + n)), tail=[7, 9] if placement == "infix" else (), affix_position=placement,
                        seed=i) for i, (n, placement, _, _) in enumerate(arrivals)]
    ids, results, mixed = {}, {}, 0
    for i in range(max(a for _, _, a, _ in arrivals) + 1):
        for r, (_, _, at, gen) in zip(requests, arrivals):
            if at == i:
                ids[engine.add(r, AFFIX, gen_length=gen)] = (r, gen)
        mixed += sum(_plan_kinds(engine)) > 1
        results |= {res.request_id: res for res in engine.step()}
    if {0, 1} <= {at for _, _, at, _ in arrivals}:  # a request probes while one that came before recomputes
        assert mixed, arrivals
    results |= {res.request_id: res for res in engine.run()}
    for rid, (r, gen) in ids.items():
        alone = generate(model, [r], engine.request_config(gen), affix=AFFIX)
        assert results[rid].tokens.tolist() == alone.tokens[0].tolist()
        assert results[rid].anchors.tolist() == alone.anchors[0].tolist() and results[rid].nfe == alone.nfe[0]
    assert engine.usage().blocks_in_use == 0


@functools.cache
def _mixing_engine(fixtures_dir):
    """One engine for every example: it is drained after each, and its compiled steps serve the next
    examples too."""
    model = acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")
    cfg = DecodeConfig(gen_length=16, block_length=8, cache="acache", anchor_ratio=0.3, threshold=0.5)
    return model, Engine(model, cfg, pool_tokens=600, block_size=8, max_batch=4, **FIXED)


def _plan_kinds(engine):
    """Which kinds of segment the next step's packed forward would hold (without changing state)."""
    running = engine.scheduler.running
    return (any(s.needs_probe for s in running) or bool(engine.scheduler.waiting),
            any(s.needs_recompute and not s.needs_probe for s in running),
            any(not s.needs_recompute for s in running))


def test_padding_stays_small_on_a_mixed_workload(fixtures_dir):
    """forward_tokens counts what the forwards computed for requests, padded_tokens the padded
    token axis: the packed steps waste little."""
    model = acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")
    cfg = DecodeConfig(gen_length=16, block_length=8, cache="acache", anchor_ratio=0.2, threshold=0.6)
    engine = Engine(model, cfg, pool_tokens=2000, block_size=8, max_batch=8)
    rng = np.random.default_rng(0)
    for i in range(12):
        placement = ("prefix", "infix", "suffix")[i % 3]
        engine.add(Request(rng.integers(3, 100, size=int(rng.integers(2, 30))).tolist(),
                           tail=[5, 6] if placement == "infix" else (), affix_position=placement, seed=i), AFFIX)
    results = engine.run()
    stats = engine.stats.summary()
    assert len(results) == 12 and stats["forward_tokens"] == sum(r.forward_tokens for r in results)
    assert stats["padded_tokens"] / stats["forward_tokens"] <= 1.3, stats


@pytest.mark.parametrize("model", ["llada"], indirect=True)
def test_bucketed_affix_caches_share_their_programs(model):
    """A server builds its affix caches bucketed (`build_affix_cache(bucketed=True)`, keeping the
    padded rows): affixes of different lengths in one bucket are built and stored in an engine's
    pool by the same programs, where each new length compiled two (a server meets a new length with
    every discovered span), and a padded cache serves the static path's tokens. (The first parity
    case's config and engine: their programs are compiled already.)"""
    from acache_jax.decoding.acache import _first_rows, build_affix_cache

    cfg = DecodeConfig(gen_length=16, block_length=8, cache="acache", anchor_ratio=0.3, temperature=0.7)
    programs = lambda: np.asarray([runner.fill_affix._cache_size(), _first_rows._cache_size()])
    new, results = [], []
    for affix in (AFFIX, AFFIX[:20]):  # 23 and 20 tokens: one bucket, 32 rows
        before = programs()
        cache = build_affix_cache(model, affix, bucketed=True)
        assert cache.length == len(affix) and {a.shape[0] for a in cache.k + cache.v} == {32}
        engine = Engine(model, cfg, pool_tokens=200, block_size=8, max_batch=2, **FIXED)
        results.append(engine.generate(REQUESTS, cache))
        new.append((programs() - before).tolist())
    assert new[1] == [0, 0], f"programs the fill and the build compiled per affix: {new}"
    static = generate(model, REQUESTS, cfg, affix=AFFIX)
    assert [r.tokens.tolist() for r in results[0]] == [t.tolist() for t in static.tokens]
    assert [r.anchors.tolist() for r in results[0]] == [a.tolist() for a in static.anchors]


class _Tokens:
    """A runner observer that keeps the tokens of each forward (padding excluded)."""

    timed = False

    def __init__(self):
        self.tokens = []

    def forward(self, tokens, token_keys, logit_rows):
        self.tokens.append(tokens)

    def affix_fill(self, tokens):  # not a packed forward: the bound is on those
        pass

    def call(self, kind, steps, seconds):
        pass


def test_a_step_token_bound_splits_the_work_and_changes_no_token(fixtures_dir):
    """Engine(max_step_tokens=): no packed forward computes more (each of these requests fits with
    every mid-block row beside it), the first step's four probes (92 tokens) are split over steps, and
    every request decodes exactly as the static path decodes it."""
    model = acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")
    cfg = DecodeConfig(gen_length=16, block_length=8, cache="acache", anchor_ratio=0.3, temperature=0.7)
    static = generate(model, REQUESTS, cfg, affix=AFFIX)
    seen = {}
    for bound in (None, 64):
        seen[bound] = _Tokens()
        engine = Engine(model, cfg, pool_tokens=400, block_size=8, max_batch=4, observer=seen[bound],
                        max_step_tokens=bound, **FIXED)
        for i, res in enumerate(engine.generate(REQUESTS, AFFIX)):
            assert res.tokens.tolist() == static.tokens[i].tolist(), (bound, i)
            assert res.anchors.tolist() == static.anchors[i].tolist() and res.nfe == static.nfe[i]
        assert engine.usage().blocks_in_use == 0
    assert seen[None].tokens[0] == 92 and max(seen[None].tokens) > 64
    assert max(seen[64].tokens) <= 64 and len(seen[64].tokens) > len(seen[None].tokens)
    with pytest.raises(DecodeError, match="max_step_tokens must be a positive integer"):
        Engine(model, cfg, max_step_tokens=0)
    # bounded by default (the 8B-shaped step it bounds is too large for this suite: docs/BENCHMARKS.md)
    assert Engine(model, cfg, pool_tokens=64).scheduler.max_step_tokens == DEFAULT_STEP_TOKENS == 16_384


def test_requests_whose_affix_starts_at_zero_read_one_set_after_their_probe(fixtures_dir, monkeypatch):
    """Their shared affix rows are stored rotated at their own positions, so after the probe they
    read them in their own set (one attention call a layer, not two and a merge), with the static
    path's tokens; a request with its affix elsewhere reads two sets. With fixed shapes too: an
    empty second set would cost every step its attention calls (`warm_up` compiles both)."""
    model = acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")
    cfg = DecodeConfig(gen_length=16, block_length=8, cache="acache", anchor_ratio=0.3, temperature=0.7)
    sets = []
    loop = runner.block_loop

    def counting(structure, cfg, packing, *args):
        reads, _ = jax.tree.unflatten(packing.treedef, list(range(len(packing.leaves))))
        sets.append(len(reads))
        return loop(structure, cfg, packing, *args)

    monkeypatch.setattr(runner, "block_loop", counting)
    prefixed = [REQUESTS[0], REQUESTS[3]]
    static = generate(model, prefixed, cfg, affix=AFFIX)
    for requests, fixed, want in ((prefixed, False, 1), (prefixed, True, 1), (REQUESTS[1:2], False, 2),
                                  (REQUESTS[1:2], True, 2)):
        sets.clear()
        engine = Engine(model, cfg, pool_tokens=200, block_size=8, max_batch=2, fixed_shapes=fixed)
        results = engine.generate(requests, AFFIX)
        assert sets and set(sets) == {want}, (requests[0].affix_position, fixed, sets)
        if requests is prefixed:
            assert [r.tokens.tolist() for r in results] == [t.tolist() for t in static.tokens]
