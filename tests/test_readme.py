"""The README's commands, as written: parsed out of README.md so that the two cannot drift apart.

Every line of a `bash` block runs in a real shell from the repository root, in order (a later line
may read what an earlier one wrote). The `./setup.sh && ` before the opening commands is the set-up
that made the interpreter running this suite, so it is not repeated, and the second opening
command (the test suite) is this suite. Blocks marked `readme-test: parse only` run for minutes to
hours; their flags are parsed by the module's own parser. The `python` blocks are executed in
order in one namespace.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SETUP = "./setup.sh && "
PARSE_ONLY = "<!-- readme-test: parse only"


def _blocks(language: str) -> list[tuple[bool, str]]:
    """(parse only, body) of every fenced block of this language, in order."""
    found = []
    for match in re.finditer(rf"^```{language}\n(.*?)^```", README, re.S | re.M):
        before = README[:match.start()].rstrip().splitlines()
        found.append((bool(before) and before[-1].startswith(PARSE_ONLY), match.group(1)))
    return found


def _commands(body: str) -> list[str]:
    """Shell commands of a block: continuation lines joined, comments and blank lines left out."""
    text = body.replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


BASH = _blocks("bash")
OPENING = _commands(BASH[0][1])
RUN = [_commands(body) for parse_only, body in BASH[1:] if not parse_only]  # one list of commands per block
PARSE = [c for parse_only, body in BASH[1:] if parse_only for c in _commands(body)]


def _shell(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_the_opening_commands_are_setup_then_the_main_job_and_the_tests():
    assert len(OPENING) == 2 and all(c.startswith(SETUP) for c in OPENING)
    assert OPENING[0][len(SETUP):].startswith(".venv/bin/python -m acache_jax.generate ")
    assert OPENING[1] == SETUP + ".venv/bin/python -m pytest"
    assert "pytest" in (ROOT / ".ci" / "run").read_text() and OPENING[1] in (ROOT / ".ci" / "run").read_text()


def test_the_main_command_answers_the_question():
    """The first thing a new user runs: the answer alone on stdout, nothing alarming on stderr."""
    run = _shell(OPENING[0][len(SETUP):])
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "garden"
    assert run.stderr.startswith("[nfe ") and "PyTorch was not found" not in run.stderr


@pytest.mark.parametrize("block", RUN, ids=[b[0][:60] for b in RUN])
def test_commands_run_as_written(block):
    for command in block:  # in order: a later command may read what an earlier one wrote
        run = _shell(command)
        assert run.returncode == 0, f"{command}\n{run.stderr}"
        if " acache_jax.generate " in command:
            assert run.stdout.strip(), f"{command}\nprinted no answer"
            assert "PyTorch was not found" not in run.stderr


@pytest.mark.parametrize("command", PARSE, ids=[c[:60] for c in PARSE])
def test_long_command_parses(command):
    argv = shlex.split(command)
    assert argv[:2] == [".venv/bin/python", "-m"], command
    importlib.import_module(argv[2]).parser().parse_args(argv[3:])


def test_there_is_something_to_test():
    assert sum(map(len, RUN)) >= 6 and len(PARSE) >= 3 and len(_blocks("python")) >= 2


def test_python_examples_run(monkeypatch):
    monkeypatch.chdir(ROOT)
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for _, body in _blocks("python"):
            exec(compile(body, "README.md", "exec"), namespace)  # noqa: S102 (the documented example itself)
    lines = out.getvalue().splitlines()
    assert lines[0] == "garden 2"  # the comment beside the print says so
    assert lines[1].startswith("['zib means purple.', 'lorp means red.']")
    assert lines[2].endswith(" True")


def test_the_layout_names_every_module():
    """README "Layout" names every module of the project's packages, each under its folder's entry
    (a module moved or added without its line fails here), and names no folder that does not exist."""
    layout = re.search(r"^## Layout\n.*?^```\n(.*?)^```", README, re.S | re.M).group(1)
    entries = re.split(r"^(?=\S)", layout, flags=re.M)  # one per top-level folder, its lines joined
    text = {entry.split()[0].rstrip("/"): " ".join(entry.split()) for entry in entries if entry.strip()}
    unnamed = []
    for top in ("acache_jax", "convert", "eval", "pallas_kernels"):
        assert top in text, f"the Layout has no entry for {top}/"
        words = set(re.findall(r"[\w.]+", text[top]))
        for module in sorted((ROOT / top).rglob("*.py")):
            parts = module.relative_to(ROOT / top).with_suffix("").parts
            if parts[-1] in ("__init__", "__main__") or parts[0] == "models":
                continue
            folder_named = len(parts) == 1 or f"{'/'.join(parts[:-1])}/" in text[top]
            if parts[-1] not in words or not folder_named:
                unnamed.append(str(module.relative_to(ROOT)))
        for folder in re.findall(r"(?<![\w/.])([a-z_]+)/", text[top]):
            if folder != top:
                assert (ROOT / top / folder).is_dir() or (ROOT / folder).is_dir(), f"{top}/{folder}/ does not exist"
    assert not unnamed, f"README Layout does not name: {unnamed}"
