"""What the server sizes from the device memory the weights leave, what it refuses at start, and a
SIGTERM during its warm-up; and that the engines share that one pool.

`cli.serve_context` picks the request context (the server's max-model-len, which sizes the one KV
pool every engine runs in, and their fixed read widths) from the memory free after loading; a CPU does not say
what it has free, so the budgets here are pretend ones, given to that function (and once to the
command line in place of its `free_device_bytes`). The shapes are the real models': Dream-7B's
context of 131072 tokens at 56 KiB of K/V a token is what ran an H200 out of memory.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from acache_jax.engine.engine import default_pool_tokens
from acache_jax.network.config import DecodeConfig, InputError
from acache_jax.serve import cli
from tests.test_serve import start_server

GIB = 2**30
DREAM = dict(model_context=131072, token_bytes=28 * 2 * 4 * 128 * 2)  # layers x K,V x kv heads x head dim x bf16
LLADA = dict(model_context=4096, token_bytes=32 * 2 * 32 * 128 * 2)
# what the H200 of docs/results/real_scale_dream_h200_622d9fc_stderr.log had free beside Dream-7B's bf16
# weights: its allocator's limit (XLA's "base limit" there, 104.9 GiB) less about 15 GiB
H200_FREE = 90 * GIB
ACACHE = DecodeConfig(cache="acache")  # the server's default policy, 0.2 anchors per affix token


def test_the_default_context_is_the_model_s_when_its_pool_fits_or_the_memory_is_not_known():
    default = dict(gen_length=256, config=ACACHE)
    assert cli.serve_context(**LLADA, max_batch=16, free_bytes=H200_FREE, **default) == (4096, None)  # 32 GiB
    assert cli.serve_context(**DREAM, max_batch=4, free_bytes=H200_FREE, **default) == (131072, None)  # 28 GiB
    assert cli.serve_context(**DREAM, max_batch=16, free_bytes=None, **default) == (131072, None)  # a CPU


def test_a_default_pool_that_does_not_fit_lowers_the_context_to_the_longest_power_of_two_that_does():
    """Dream at --max-batch 16: 16 x 131072 tokens are 112 GiB of K/V, and 65536 tokens 56 GiB, more
    than half of the 90 GiB free; 32768 (28 GiB) fits. One line says so and names the flags."""
    context, note = cli.serve_context(**DREAM, max_batch=16, free_bytes=H200_FREE, gen_length=256, config=ACACHE)
    assert context == 32768
    assert note.startswith("requests of up to 32768 tokens (the model's context is 131072)") and "112.0 GiB" in note
    assert "\n" not in note and all(flag in note for flag in ("--max-model-len", "--pool-tokens", "--max-batch"))
    # flags that fit are taken as they are, and need no line
    assert cli.serve_context(**DREAM, max_batch=16, free_bytes=H200_FREE, gen_length=256, config=ACACHE,
                             max_model_len=16384) == (16384, None)
    assert cli.serve_context(**DREAM, max_batch=16, free_bytes=H200_FREE, gen_length=256, config=ACACHE,
                             pool_tokens=500_000) == (131072, None)


def test_at_one_request_the_pool_holds_its_anchors_and_the_context_is_sized_for_them():
    """At --max-batch 1 the default pool holds one request of the context with its anchors (0.2 of an
    affix as long as the context) and a page of rounding per segment, so the context is the longest
    power of two whose pool fits, not whose context fits; under dual the pool is the context."""
    # 32768 tokens with ceil(0.2 x 32768) = 6554 anchors: 2458 pages of 16 slots, and one more
    assert default_pool_tokens(ACACHE, 1, 32768) == (2458 + 1) * 16 == 39344
    assert default_pool_tokens(DecodeConfig(cache="dual"), 1, 32768) == 32768
    assert default_pool_tokens(ACACHE, 2, 32768) == 2 * 32768
    free = 2 * DREAM["token_bytes"] * 36_000  # K/V of 36000 tokens in the half for the pool
    assert cli.serve_context(**DREAM, max_batch=1, free_bytes=free, gen_length=256, config=ACACHE)[0] == 16384
    assert cli.serve_context(**DREAM, max_batch=1, free_bytes=free, gen_length=256,
                             config=DecodeConfig(cache="dual"))[0] == 32768


@pytest.mark.parametrize("flags,free,message", [
    (dict(max_model_len=65536), H200_FREE, "a KV pool of --max-batch 16 x --max-model-len 65536 tokens needs "
                                           "56.0 GiB of KV, more than half of the 90.0 GiB the device has free"),
    (dict(pool_tokens=1_000_000), H200_FREE, "--pool-tokens 1000000 needs 53.4 GiB of KV, more than half of the 90.0"),
    (dict(max_model_len=8192, pool_tokens=4096), None, "--max-model-len 8192 exceeds --pool-tokens 4096"),
    # half a GiB free: 16 requests of 256 tokens would fit, but 256 leaves no room beside a default answer of 256
    ({}, GIB // 2, "a KV pool of --max-batch 16 requests of even 512 tokens (the default generation length 256 and"),
])
def test_flags_whose_pool_cannot_fit_are_refused_in_one_line(flags, free, message):
    with pytest.raises(InputError) as e:
        cli.serve_context(**DREAM, max_batch=16, free_bytes=free, gen_length=256, config=ACACHE, **flags)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("flags,error", [
    (["--max-model-len", "100000"], "error: --max-model-len 100000 exceeds the model's context of 512 tokens"),
    (["--pool-tokens", "4096"], "error: --pool-tokens 4096 needs 24.0 MiB of KV, more than half of the 0.1 MiB"),
])
def test_the_server_refuses_them_at_start(flags, error, monkeypatch, capsys):
    """The command line, in this process, with a pretend device of 64 KiB free after the weights (the
    shipped model: a context of 512 tokens, 6 KiB of K/V a token in bfloat16): one line on stderr,
    exit 2, and no server."""
    monkeypatch.setattr(cli, "free_device_bytes", lambda: 64 << 10)
    assert cli.main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith(error) and err.count("\n") == 1, err


def test_sigterm_during_the_warm_up_stops_it_and_exits_0_in_seconds():
    """SIGTERM while the warm-up compiles (steps of up to 65536 tokens: 70 programs, minutes on
    a CPU): no compile starts after it, the engine thread ends once those in flight end, every block
    is freed, exit status 0, no traceback and no C++ abort. Before: the warm-up went on, the
    shutdown gave up on the engine thread after 30 s ('did not stop in time', exit 1), and the
    process then waited for every program (3 minutes here) or aborted at exit (on the H200:
    'terminate called after throwing an instance of ...')."""
    proc, _ = start_server("--warmup-tokens", "65536")
    try:
        sigterm = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(60)
        took = time.perf_counter() - sigterm
        log = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    compiled = re.search(r"warm-up stopped with the server, having compiled (\d+) programs", log)
    assert status == 0 and compiled and int(compiled[1]) < 70, log
    assert "stopped; 0 KV blocks left allocated" in log, log
    for word in ("Traceback", "terminate called", "did not stop", "warm-up failed"):
        assert word not in log, log
    print(f"\nexited {took:.1f} s after SIGTERM, having compiled {compiled[1]} programs")


def test_min_affix_reuse_is_a_non_negative_count_of_affix_tokens_times_blocks(capsys):
    """`--min-affix-reuse` (Engine's `min_affix_reuse`): 0 by default, any non-negative integer; a
    negative one is refused by the parser before anything loads."""
    assert cli.parser().parse_args([]).min_affix_reuse == 0
    assert cli.parser().parse_args(["--min-affix-reuse", "920"]).min_affix_reuse == 920
    with pytest.raises(SystemExit) as e:
        cli.parser().parse_args(["--min-affix-reuse", "-1"])
    assert e.value.code == 2 and "--min-affix-reuse" in capsys.readouterr().err


def test_every_engine_runs_in_the_one_pool_and_a_failed_step_frees_what_it_held():
    """The server's engines (one per decoding setting) run in its one KV pool, the one
    `serve_context` sized: a request with other knobs adds an engine and no K/V memory (before,
    each engine made a pool of its own: at 8B on an H200 a second setting asked for a second 32
    GiB), and requests that differ only in the sampler's numbers share one engine. A step that
    fails answers its own requests 500 and frees their blocks while the others finish; a failure
    after the step took the pool's arrays (they are donated) loses every request's K/V, so all are
    answered 500 and the next request gets a new pool. The worker runs
    in this process (its thread), on the shipped model."""
    import queue
    import threading

    import jax

    import acache_jax
    from acache_jax.cli import DEFAULT_MODEL
    from acache_jax.serve import protocol
    from acache_jax.serve.worker import Settings, Worker

    model = acache_jax.load(DEFAULT_MODEL)
    base = model.decode_config(block_length=8, gen_length=8, cache="acache", early_stop=False)
    live_bytes = lambda: sum(a.nbytes for a in jax.live_arrays())
    before = live_bytes()
    worker = Worker(model, Settings(max_batch=4, max_engines=3, discovery=False, finish_early=False,
                                    default_engine=protocol.engine_config(base)))

    def submit(max_tokens: int = 8, **knobs) -> queue.Queue:
        events: queue.Queue = queue.Queue()
        body = {"prompt": "Mary went to the office.", "max_tokens": max_tokens, **knobs}
        worker.submit(protocol.parse(body, model, base, "m", chat=False), events.put)
        return events

    def outcome(events: queue.Queue) -> tuple[str, object]:
        while True:
            kind, value = events.get(timeout=120)
            if kind != "text":
                return kind, value

    def gated(engine, gate: threading.Event) -> None:
        """The engine's next step waits for `gate`: a job submitted meanwhile is taken in right after it."""
        run = engine.runner.run
        engine.runner.run = lambda plan: (gate.wait(60), run(plan))[1]

    def settle() -> dict[str, float]:
        deadline = time.time() + 60
        while worker.snapshot["requests_running"] + worker.snapshot["requests_waiting"] or worker.inflight:
            assert time.time() < deadline
            time.sleep(0.05)
        return worker.snapshot

    try:
        answers = [outcome(e) for e in [submit(), submit(cache="dual"), submit(temperature=0.5),
                                        submit(temperature=0.8, threshold=0.7)]]
        assert [kind for kind, _ in answers] == ["done"] * 4, answers
        pool = worker.pool
        assert len(worker.engines) == 3 and all(e.runner.paged is pool for e in worker.engines.values())
        pool_bytes = sum(a.nbytes for a in jax.tree.leaves(pool.kv))
        assert live_bytes() - before < 1.5 * pool_bytes  # one pool (and a few small arrays), not three
        assert settle()["pool_blocks_capacity"] == pool.blocks.num_blocks

        # a failing step, the pool intact: its request fails, the other engine's finishes
        dual = next(e for k, e in worker.engines.items() if k.cache == "dual")
        gate = threading.Event()
        gated(worker.engines[protocol.engine_config(base).engine_key()], gate)
        running = submit(max_tokens=32)
        while worker.snapshot["requests_waiting"] + worker.snapshot["requests_running"] == 0:  # taken in
            time.sleep(0.01)

        def fail(plan):
            raise RuntimeError("a staged failure")
        dual.runner.run = fail
        failing = submit(cache="dual")
        time.sleep(0.2)  # taken in once the gated step returns
        gate.set()
        (kind, error), (ran, answer) = outcome(failing), outcome(running)
        assert kind == "error" and error.status == 500 and "a staged failure" in error.message
        assert ran == "done" and answer.extra["nfe"] >= 4  # its 4 blocks
        m = settle()
        assert m["pool_blocks_used"] == 0 and m["engines"] == 2 and worker.pool is pool

        # a failure that took the pool's arrays with it: every request fails, a new pool follows
        hot = next(e for k, e in worker.engines.items() if k.temperature)
        gate = threading.Event()
        gated(hot, gate)
        running = submit(max_tokens=32, temperature=0.5)
        while worker.snapshot["requests_waiting"] + worker.snapshot["requests_running"] == 0:  # taken in
            time.sleep(0.01)

        def lose(plan):
            for a in jax.tree.leaves(pool.kv):
                a.delete()
            raise RuntimeError("a staged failure after the pool went in")
        worker.engines[protocol.engine_config(base).engine_key()].runner.run = lose
        failing = submit()
        time.sleep(0.2)
        gate.set()
        for kind, error in (outcome(failing), outcome(running)):
            assert kind == "error" and error.status == 500, (kind, error)
        assert settle()["engines"] == 0 and worker.pool is None
        assert outcome(submit())[0] == "done" and worker.pool is not None and worker.pool is not pool
        assert settle()["pool_blocks_used"] == 0
    finally:
        worker.stop()
