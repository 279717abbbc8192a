import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's time is almost all XLA compilation of tiny models; LLVM's lowest optimisation level
# compiles about a third faster and computes the same values (the parity fixtures still match).
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
# Many tests compile the same programs (the fixture models' decode loops and engine steps) in
# different test files: a compilation cache on disk compiles each once per worker (and across runs
# on one machine). One directory per pytest-xdist worker: workers sharing one crashed on CPU.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(Path(__file__).resolve().parents[1] / ".pytest_cache" / f"jax-{_WORKER}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES
