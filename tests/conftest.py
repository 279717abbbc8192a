import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's time is almost all XLA compilation of tiny models; LLVM's lowest optimisation level
# compiles about a third faster and computes the same values (the parity fixtures still match).
# Level 1 was tried (2026-12-07, a full run from a fresh clone on the 2-core machine): 1,734 CPU-s of
# tests against 1,445 at level 0; only the files that sample a real 126k-152k vocabulary ran faster.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
# The pytest-xdist workers and the subprocesses tests start (the CLI, the server, the README's
# commands) compile many of the same programs (the shipped and fixture models'): one compilation
# cache on disk for the whole run compiles each once. A size limit turns on JAX's file lock, without
# which a process could read an entry another is still writing.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="acache-jax-tests-xla-")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
# Programs compiled faster than this are not written. Writing all (0) saved 5-14 CPU-s in files that
# start processes and cost 18-26 in each file of many small programs (kv_view, model_parity,
# gathered_attention): 1,491 CPU-s of tests against 1,445 and 1,469 at 0.2 (2026-12-07).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


def _memory_maps() -> tuple[int, int]:
    """(this process's memory mappings, the kernel's limit), or (0, 1) where /proc does not say."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return 0, 1


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    """Every compiled XLA CPU program keeps memory mappings of its code; a worker that compiles half
    the suite's programs would pass vm.max_map_count (65530) and crash inside the next compile.
    Past half the limit, drop JAX's caches (their programs recompile when next asked for)."""
    used, limit = _memory_maps()
    if used > limit // 2:
        import jax

        jax.clear_caches()
        gc.collect()


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# The files, longest first, down to 15 s (wall seconds in a full run on the 2-core CI machine with
# three workers, 2026-12-06: 273, 190, 164, 162, 142, 129, 109, 101, 77, 73, 60, 52, 46, 42, 41, 37,
# 35, 33, 30, 29, 28, 28, 26, 25, 19, 18, 17 of 2,042 worker-seconds; the rest take 0.7-13 s). With
# --dist loadfile the workers take whole files in the order of the work queue, so a long file
# handed out last (the soak tests, the one bf16 test) runs alone while the others idle; handing out
# the long ones first and the short ones last balances the workers (with only the first 17 listed,
# the three ended 31 s apart). xdist would otherwise order the queue by tests per file
# (`--loadscope-reorder`, its default), which put the 1-test bf16 file and the 3-test soak file
# last: pyproject.toml passes --no-loadscope-reorder.
LONG_FILES = ("test_engine.py", "test_acache.py", "test_soak.py", "test_readme.py", "test_engine_bf16.py",
              "test_checkpoints.py", "test_sharding.py", "test_train.py", "test_serve.py", "test_lm_eval.py",
              "test_compile_cache.py", "test_generate_cli.py", "test_real_scale.py", "test_serve_limits.py",
              "test_acache_parity.py", "test_decode.py", "test_decode_parity.py", "test_affix_sweep.py",
              "test_bench_traffic.py", "test_kv_view.py", "test_gathered_attention.py", "test_bad_inputs.py",
              "test_interrupted_runs.py", "test_engine_hooks.py", "test_model_parity.py", "test_shipped_models.py",
              "test_convert.py", "test_packaging.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker more than the cores (at most --maxprocesses). Many tests wait on
    processes of their own (servers, CLI runs, the mesh checks' eight-device subprocesses), and a
    worker waiting leaves its core idle: on the 2-core CI machine three workers keep both busy."""
    return (os.cpu_count() or 1) + 1
