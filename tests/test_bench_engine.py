"""eval.bench_engine's warm-up: cases compiled several at once, as many as their pools fit the
device; one that ran out of device memory beside the others runs again alone, with nothing of the
failed attempts held."""

import gc
import threading
import time
import weakref
from pathlib import Path

import acache_jax
from eval.bench_engine import POLICIES, warm_up


def test_a_warm_up_out_of_device_memory_runs_again_alone(capsys):
    class Pool:  # what a warm-up's engine holds on the device
        pass

    failed: list[weakref.ref] = []  # the pools of the attempts that ran out of memory
    retried: list[tuple[str, str]] = []

    def run_step(pool: Pool) -> None:  # a frame below the warm-up's, holding the pool as a jitted call's does
        raise KeyError("no room")

    def warm(case: str, policy: str) -> None:
        pool = Pool()
        if case == "long" and threading.current_thread() is not threading.main_thread():
            failed.append(weakref.ref(pool))
            try:
                run_step(pool)
            except KeyError:  # the error a runtime raises while handling another one: a chain of tracebacks
                raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17.12GiB")
        if case == "long":  # again, alone: the failed attempts' frames (their pools) are gone
            gc.collect()
            assert failed and all(ref() is None for ref in failed)
            retried.append((case, policy))
        if case == "broken":
            raise ValueError("no such case")
        del pool

    ready = warm_up(warm, ["short", "long", "broken"], threads=4, deadline=float("inf"))
    assert ready == ["short", "long"] and retried == [("long", p) for p in POLICIES]
    out = capsys.readouterr().out
    assert "no such case" in out and "RESOURCE_EXHAUSTED" not in out


def test_no_warm_up_starts_again_past_the_deadline(capsys):
    def warm(case: str, policy: str) -> None:
        if threading.current_thread() is threading.main_thread():
            raise AssertionError("retried past the deadline")
        time.sleep(0.8)  # both started (2 threads), and still running at the deadline
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory")

    assert warm_up(warm, ["long"], threads=2, deadline=time.perf_counter() + 0.3) == []
    assert "RESOURCE_EXHAUSTED" in capsys.readouterr().out


def test_warm_ups_run_together_only_while_their_pools_fit_the_budget():
    sizes = {"b16": 28, "b4": 7, "b1": 2}  # GB of each case's pool (LLaDA 13-shot)
    lock, running, peak, together = threading.Lock(), [], [0], set()

    def warm(case: str, policy: str) -> None:
        with lock:
            running.append(case)
            peak[0] = max(peak[0], sum(sizes[c] for c in running))
            if len(running) > 1:
                together.add(frozenset(running))
        time.sleep(0.2)
        with lock:
            running.remove(case)

    ready = warm_up(warm, list(sizes), threads=8, deadline=float("inf"), case_bytes=sizes.get, budget_bytes=26)
    assert ready == list(sizes)
    assert peak[0] == 28  # the 28 GB pool ran alone, over the budget; nothing ran beside it
    assert not any("b16" in group for group in together)
    assert together  # the small ones did share the device


def test_a_warm_up_waiting_for_room_gives_up_at_the_deadline(capsys):
    def warm(case: str, policy: str) -> None:
        time.sleep(0.8)

    ready = warm_up(warm, ["a", "b"], threads=4, deadline=time.perf_counter() + 0.3, case_bytes=lambda c: 10,
                    budget_bytes=10)
    assert ready == []  # the first held the room past the deadline; the other three gave up waiting
    assert "no room on the device before the compile deadline" in capsys.readouterr().out


def test_kernel_trace_profiles_the_cases_bench_engine_times(tmp_path, monkeypatch, capsys):
    """eval.kernel_trace takes bench_engine's case flags (`--affix built` among them) and traces one
    run per case; a tiny model in LLaDA's layout stands in for the 8B one on this CPU. Its first
    line names the package that ran (what tells two trees of an A/B apart)."""
    from acache_jax.network.config import ModelConfig
    from eval import kernel_trace

    tiny = ModelConfig(family="llada", vocab_size=512, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=4,
                       head_dim=16, intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-5, max_seq_len=512,
                       qkv_bias=False, mask_token_id=500, eos_token_id=501, pad_token_id=501)
    monkeypatch.setattr(kernel_trace, "llada_8b", lambda layers: tiny)
    kernel_trace.main(["--out", str(tmp_path), "--shots", "1", "--batches", "1", "--gen", "32", "--steps", "8",
                       "--affix", "built"])
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith(f"; acache_jax from {Path(acache_jax.__file__).resolve().parent}")
    for policy in POLICIES:
        assert f"llada {policy} B1 1-shot: compiled in" in out
        assert any((tmp_path / f"trace_llada_{policy}_b1").rglob("*.json.gz"))
