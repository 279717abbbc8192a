"""The built wheel, installed apart from this checkout and run from another directory that holds
folders named `eval` and `convert` of its own (as a user's project may): the library, its
commands and the shipped models work, and the library imports neither of those names."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUESTION = ("Story: Mary moved to the bathroom. John went to the hallway. Mary travelled to the garden. "
            "Question: Where is Mary? Answer with one location:")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(site directory holding the installed wheel, a working directory with look-alike packages)."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"  # a copy: builds write build/ and *.egg-info beside the sources
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "out", "build", "*.egg-info",
                                                                 "__pycache__", ".pytest_cache", ".hypothesis"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(base / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    assert "BuildBackendWarning" not in build.stderr, build.stderr
    wheel = next((base / "dist").glob("acache_jax-*.whl"))
    site = base / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr
    work = base / "project"
    for name in ("eval", "convert"):
        (work / name).mkdir(parents=True)
        (work / name / "__init__.py").write_text(f"raise ImportError('the user\\'s own {name} package')\n")
    return site, work


def _run(installed, *argv) -> subprocess.CompletedProcess:
    site, work = installed
    return subprocess.run(list(argv), cwd=work, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(site)})


def test_the_wheel_works_from_elsewhere(installed, tmp_path):
    site, _ = installed
    code = ("import sys, acache_jax; from acache_jax.decoding.decode import generate; "
            "from acache_jax.generate import DEFAULT_MODEL; m = acache_jax.load(DEFAULT_MODEL); "
            f"out = generate(m, [m.encode({QUESTION!r})]); print(m.answer_text(out.tokens[0])); "
            "print(acache_jax.__file__); print(sorted(n for n in ('eval', 'convert') if n in sys.modules))")
    run = _run(installed, sys.executable, "-c", code)
    assert run.returncode == 0, run.stderr
    answer, where, imported = run.stdout.splitlines()
    assert answer == "garden" and where.startswith(str(site)) and imported == "[]"
    # the installed commands, the converter's too (one test: the wheel is built once)
    run = _run(installed, str(site / "bin" / "acache-generate"), "--prompt", QUESTION)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "garden"
    shipped = site / "acache_jax" / "models" / "llada-small"
    run = _run(installed, str(site / "bin" / "acache-convert"), str(shipped), str(tmp_path / "converted"))
    assert run.returncode == 0, run.stderr
    run = _run(installed, str(site / "bin" / "acache-generate"), "--model", str(tmp_path / "converted"),
               "--prompt", QUESTION)
    assert run.returncode == 0 and run.stdout.strip() == "garden", run.stderr
