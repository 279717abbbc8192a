"""The engine hooks a server needs: cancel, partial output, requests without an affix under acache,
a warm-up before the first request."""

import logging
import queue

import jax
import pytest

import acache_jax
from acache_jax.decoding.layout import Request
from acache_jax.engine import Engine
from acache_jax.network.config import DecodeConfig, DecodeError

AFFIX = list(range(30, 53))
FIXED = dict(fixed_shapes=True)  # a server's engines: few programs for these small workloads (see test_engine)


@pytest.fixture(scope="module")
def model(fixtures_dir):
    return acache_jax.load(fixtures_dir / "decode" / "llada", dtype="float32")


def _empty(engine: Engine) -> bool:
    return engine.usage().blocks_in_use == 0 and not engine.has_unfinished() and not engine._live


def test_a_request_without_affix_under_acache_decodes_as_under_dual(model):
    plain = [Request([5, 17, 33, 2, 90], seed=1), Request([1, 2, 3, 4, 5, 6, 7], seed=2)]
    mixed = [*plain, Request([9, 8, 7], affix_position="prefix", seed=3)]
    dual = Engine(model, DecodeConfig(gen_length=16, block_length=8, cache="dual"), pool_tokens=200, block_size=8,
                  **FIXED)
    acache = Engine(model, DecodeConfig(gen_length=16, block_length=8, cache="acache"), pool_tokens=200, block_size=8,
                    **FIXED)
    expected = [r.tokens.tolist() for r in dual.generate(plain)]
    ids = [acache.add(r, AFFIX if r.affix_position else None) for r in mixed]
    got = {r.request_id: r.tokens.tolist() for r in acache.run()}
    assert [got[i] for i in ids[:2]] == expected
    assert _empty(acache)


def test_requests_of_little_affix_reuse_run_as_dual_and_the_others_are_unchanged(model):
    """min_affix_reuse: a request whose affix tokens x blocks fall below it gets the dual engine's
    tokens (no probe, no anchors); the others get exactly what an engine without the bound gives."""
    reqs = [Request([5, 17, 33], tail=[2, 90] if pos == "infix" else (), affix_position=pos, seed=s)
            for s, pos in enumerate(["prefix", "infix", "suffix"])]
    gens = [8, 16, 8]  # one block: 23 affix tokens; two blocks: 46
    config = DecodeConfig(gen_length=16, block_length=8, cache="acache")

    def run(engine):
        ids = [engine.add(r, AFFIX, gen_length=g) for r, g in zip(reqs, gens)]
        got = {r.request_id: r for r in engine.run()}
        assert _empty(engine)
        return [got[i] for i in ids]

    dual = run(Engine(model, config.replace(cache="dual"), pool_tokens=200, block_size=8, **FIXED))
    acache = run(Engine(model, config, pool_tokens=200, block_size=8, **FIXED))
    mixed = run(Engine(model, config, pool_tokens=200, block_size=8, min_affix_reuse=40, **FIXED))
    for i in (0, 2):
        assert mixed[i].tokens.tolist() == dual[i].tokens.tolist()
        assert (mixed[i].anchors.size, mixed[i].nfe, mixed[i].forward_tokens) == (0, dual[i].nfe, dual[i].forward_tokens)
    assert mixed[1].tokens.tolist() == acache[1].tokens.tolist()
    assert mixed[1].anchors.tolist() == acache[1].anchors.tolist() and mixed[1].anchors.size
    assert (mixed[1].nfe, mixed[1].forward_tokens) == (acache[1].nfe, acache[1].forward_tokens)
    with pytest.raises(DecodeError, match="min_affix_reuse"):
        Engine(model, config, min_affix_reuse=-1)


def test_cancel_frees_slots_at_once_and_partial_output_only_grows(model):
    cfg = DecodeConfig(gen_length=32, block_length=8, cache="acache", early_stop=False)
    engine = Engine(model, cfg, pool_tokens=400, block_size=8, max_batch=2, **FIXED)
    reqs = [Request([5, 17, 33, 2, 90], affix_position="prefix", seed=s) for s in range(3)]
    ids = [engine.add(r, AFFIX) for r in reqs]  # the third waits: max_batch 2
    seen = {i: [] for i in ids}
    while engine.usage().blocks_in_use == 0 or not engine.partial(ids[0]).size:
        engine.step()
    for i in ids:
        seen[i].append(engine.partial(i).tolist())
    assert engine.cancel(ids[1]) and engine.cancel(ids[2])  # running and waiting
    assert not engine.cancel(ids[1]) and engine.partial(ids[1]) is None
    assert (engine.usage().running, engine.usage().waiting) == (1, 0)
    results = []
    while engine.has_unfinished():
        seen[ids[0]].append([] if engine.partial(ids[0]) is None else engine.partial(ids[0]).tolist())
        results += engine.step()
    engine.drain()
    assert [r.request_id for r in results] == [ids[0]]
    final = results[0].tokens.tolist()
    for prefix in seen[ids[0]]:
        assert final[:len(prefix)] == prefix and model.config.mask_token_id not in prefix
    assert _empty(engine)
    alone = Engine(model, cfg, pool_tokens=400, block_size=8, max_batch=2, **FIXED).generate([reqs[0]], AFFIX)[0]
    assert alone.tokens.tolist() == final  # the cancelled neighbours changed nothing


def test_the_server_warm_up_compiles_the_engine_default_requests_run_on(caplog):
    """`serve --warmup-tokens`: the worker compiles, before any request, the engine that a request
    with the server's default knobs runs on (its config holds one block, not the default gen length),
    so serving it compiles no packed step or block loop; its steps are bounded to that many tokens.
    A request with other knobs (sampling) gets an engine that compiles its programs in a thread of
    its own while the default engine goes on answering (before, its first steps compiled them in
    the engine thread, and every request waited); then it serves without compiling a step."""
    from acache_jax.generate import DEFAULT_MODEL
    from acache_jax.serve.protocol import engine_config, parse
    from acache_jax.serve.worker import Settings, Worker

    model = acache_jax.load(DEFAULT_MODEL)
    base = model.decode_config(cache="acache")
    base = base.replace(gen_length=2 * base.block_length)  # a server default of two blocks
    worker = Worker(model, Settings(max_batch=2, warmup_tokens=128, min_affix_reuse=7))
    try:
        assert worker.warm_up(base).wait(300)
        job = parse({"prompt": "Story: Mary went to the office.\nQuestion: Where is Mary?\nAnswer with one location:",
                     "max_tokens": base.gen_length}, model, base, "llada-small", chat=False)
        events = queue.Queue()
        jax.config.update("jax_log_compiles", True)  # the engine thread compiles: not a thread-local setting
        with caplog.at_level(logging.WARNING):
            worker.submit(job, events.put)
            while (event := events.get(timeout=300))[0] == "text":
                pass
        assert event[0] == "done", event
        compiled = {r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("Compiling ")}
        assert not compiled & {"jit(packed_step)", "jit(block_loop)"}, compiled
        assert list(worker.engines) == [engine_config(base).engine_key()]
        engine = worker.engines[engine_config(base).engine_key()]
        assert engine.config == engine_config(base)
        assert engine.scheduler.max_step_tokens == 128  # steps stay warmed up
        assert engine.min_affix_reuse == 7

        def answer(**knobs) -> tuple[queue.Queue, dict]:
            events = queue.Queue()
            worker.submit(parse({"prompt": "Where is Mary?", "max_tokens": 8, **knobs}, model, base, "llada-small",
                                chat=False), events.put)
            while (event := events.get(timeout=300))[0] == "text":
                pass
            return event, dict(worker.snapshot)

        sampled = queue.Queue()
        worker.submit(parse({"prompt": "Where is Mary?", "max_tokens": 8, "temperature": 0.5}, model, base,
                            "llada-small", chat=False), sampled.put)
        event, metrics = answer()  # the defaults, while the sampling engine compiles
        assert event[0] == "done" and metrics["engines_compiling"] == 1, (event, metrics)
        while (event := sampled.get(timeout=300))[0] == "text":
            pass
        assert event[0] == "done", event
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            event, metrics = answer(temperature=0.9)
        compiled = {r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("Compiling ")}
        assert event[0] == "done" and metrics["engines_compiling"] == 0 and metrics["engines"] == 2, metrics
        assert not compiled & {"jit(packed_step)", "jit(block_loop)"}, compiled
    finally:
        jax.config.update("jax_log_compiles", False)
        worker.stop()
