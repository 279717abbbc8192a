"""The persistent compilation cache (acache_jax/compile_cache.py): on by default, read back by later
processes, and never the reason a run fails (unwritable directory, failed writes, concurrent processes).

The command-line tests run `python -m acache_jax.generate` as real subprocesses, each through a small
wrapper that counts jax's monitoring events (`/jax/compilation_cache/cache_hits`: an executable read
from disk; `.../cache_misses`: one compiled and written) and can cap the size of the files the process
writes (RLIMIT_FSIZE: a write past it fails with EFBIG, as a write to a full disk fails with ENOSPC).
The suite's own cache settings (tests/conftest.py) are removed from their environment.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from acache_jax import compile_cache

ROOT = Path(__file__).resolve().parents[1]
# The README's first question; the shipped model answers "garden".
PROMPT = ("Story: Mary moved to the bathroom. John went to the hallway. Mary travelled to the garden. "
          "Question: Where is Mary? Answer with one location:")
GENERATE = ["--model", "acache_jax/models/llada-small", "--prompt", PROMPT, "--gen-length", "32"]
EVENTS = "jax events: "
WRAPPER = f"""
import collections, json, resource, runpy, signal, sys
import jax
events = collections.Counter()
jax.monitoring.register_event_listener(lambda event, **_: events.update([event.rsplit("/", 1)[-1]]))
if sys.argv[1] != "-":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails instead of killing the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
sys.argv = ["acache_jax.generate", *sys.argv[2:]]
try:
    runpy.run_module("acache_jax.generate", run_name="__main__", alter_sys=True)
finally:
    print({EVENTS!r} + json.dumps(events), file=sys.stderr, flush=True)
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment without any compilation-cache setting, the XDG cache directory under tmp_path."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("JAX_") and "CACHE" in k) and k != compile_cache.ENV_VAR}
    return env | {"XDG_CACHE_HOME": str(tmp_path / "xdg")} | extra


def _command(*args: str, fsize: int | None = None) -> list[str]:
    return [sys.executable, "-c", WRAPPER, "-" if fsize is None else str(fsize), *GENERATE, *args]


def _finish(proc: subprocess.CompletedProcess | subprocess.Popen, out: str, err: str) -> tuple[str, list[str], dict]:
    """(stdout, stderr lines other than the events line, the events)."""
    lines = err.splitlines()
    events = [json.loads(line.removeprefix(EVENTS)) for line in lines if line.startswith(EVENTS)]
    assert proc.returncode == 0 and len(events) == 1, err
    assert "garden" in out, (out, err)
    return out, [line for line in lines if not line.startswith(EVENTS)], events[0]


def _run(env: dict[str, str], *args: str, fsize: int | None = None) -> tuple[str, list[str], dict]:
    r = subprocess.run(_command(*args, fsize=fsize), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return _finish(r, r.stdout, r.stderr)


def _entries(cache: Path) -> set[str]:
    return {p.name for p in cache.glob("*-cache")}


def _notes(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("acache-jax:")]


def _jax_cache_warnings(lines: list[str]) -> list[str]:
    return [line for line in lines if "persistent compilation cache" in line]


def test_a_second_process_reads_what_the_first_compiled(tmp_path):
    # Every program written (a threshold of 0 s): at the default, a program that compiles in about
    # MIN_COMPILE_SECS is kept by one process and not the other, as the machine's load goes.
    env = _env(tmp_path, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    cache = tmp_path / "xdg" / compile_cache.SUBDIR  # the default: $XDG_CACHE_HOME/acache-jax/jax-compile
    # Every entry was compiled (a miss) by the first process. In about one run in three on 2 cores
    # (at ab1d00b too) the first process also had one hit: a program it asked for twice, the second
    # time reading the entry of the first (which one was not pinned down; jax shares no compile in
    # flight between threads). So its hits are not counted, and the second process reads at least
    # every entry back.
    out, err, events = _run(env)
    written = _entries(cache)
    assert written and events.get("cache_misses") == len(written)
    assert any(name.startswith("jit__decode-") for name in written)  # the decode program, not only helpers

    again, err2, events2 = _run(env)
    assert again == out
    assert events2.get("cache_hits", 0) >= len(written)  # every program the first process kept was read back
    assert not events2.get("cache_misses") and _entries(cache) == written  # and nothing new was compiled into it
    assert not _notes(err + err2) and not _jax_cache_warnings(err + err2)


def test_off_leaves_no_cache_directory(tmp_path):
    _, err, events = _run(_env(tmp_path, **{compile_cache.ENV_VAR: "off"}))
    assert not (tmp_path / "xdg").exists()
    assert not events.get("cache_hits") and not events.get("cache_misses") and not _notes(err)


def test_an_unwritable_cache_directory_warns_once_and_the_run_answers(tmp_path):
    (tmp_path / "xdg").write_text("a file where the cache directory would be created")
    _, err, events = _run(_env(tmp_path))  # mkdir of $XDG_CACHE_HOME/acache-jax/... fails, even for root
    notes = _notes(err)
    assert len(notes) == 1 and "compilation cache off" in notes[0] and str(tmp_path / "xdg") in notes[0], err
    assert not events.get("cache_hits") and not events.get("cache_misses") and not _jax_cache_warnings(err)


def test_failed_cache_writes_only_warn(tmp_path):
    """Our write check passes (a 2-byte file), jax's entries (3 kB and up: the loader's relayout
    programs) fail half-written at 512 bytes: jax warns per program and keeps the executable; a
    later process rejects the truncated entries with a warning, compiles, and answers the same."""
    env, cache = _env(tmp_path), tmp_path / "xdg" / compile_cache.SUBDIR
    out, err, events = _run(env, fsize=512)
    assert len(_notes(err)) == 0 and _entries(cache)
    assert any("Error writing persistent compilation cache entry" in line for line in err), err
    again, err2, events2 = _run(env)
    assert again == out and not events2.get("cache_hits")
    assert any("Error reading persistent compilation cache entry" in line for line in err2), err2


def test_a_failed_write_check_warns_once_and_leaves_jax_alone(tmp_path):
    """A disk that is full when the cache is turned on: the check's write fails, the cache stays off."""
    code = ("import resource, signal, jax; from acache_jax import compile_cache\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
            "print(compile_cache.enable(), jax.config.jax_compilation_cache_dir)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["None", "None"], r.stderr
    notes = _notes(r.stderr.splitlines())
    assert len(notes) == 1 and "File too large" in notes[0], r.stderr
    assert not list((tmp_path / "xdg" / compile_cache.SUBDIR).iterdir())  # the check's file is gone


def test_two_processes_start_at_once_on_one_empty_cache(tmp_path):
    cache = tmp_path / "shared"
    procs = [subprocess.Popen(_command("--compile-cache", str(cache)), cwd=ROOT, env=_env(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [_finish(p, *p.communicate(timeout=600)) for p in procs]
    assert results[0][0] == results[1][0]
    for _, err, _ in results:
        assert not _notes(err) and not _jax_cache_warnings(err), err
    assert any(name.startswith("jit__decode-") for name in _entries(cache))
    assert not (tmp_path / "xdg").exists()  # the flag wins over the default


def test_settings_defaults_and_user_choices(tmp_path):
    """What `enable` sets, and that a jax option the user set is kept."""
    options = ("jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes",
               "jax_compilation_cache_max_size")
    code = ("import jax; from acache_jax import compile_cache\n"
            f"print(compile_cache.enable(), *(getattr(jax.config, o) for o in {options!r}))")
    run = lambda **env: subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(tmp_path, **env),
                                       capture_output=True, text=True, timeout=120).stdout.split()
    default = str(tmp_path / "xdg" / compile_cache.SUBDIR)
    assert run() == [default, str(compile_cache.MIN_COMPILE_SECS), str(compile_cache.MIN_ENTRY_BYTES),
                     str(compile_cache.MAX_BYTES)]
    assert run(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="2.5")[:2] == [default, "2.5"]


def test_resolve_order(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    assert compile_cache.resolve() == (tmp_path / "xdg" / compile_cache.SUBDIR, "default")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")  # the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.resolve() == (tmp_path / "home" / ".cache" / compile_cache.SUBDIR, "default")
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "env"))
    assert compile_cache.resolve() == (tmp_path / "env", compile_cache.ENV_VAR)
    assert compile_cache.resolve(str(tmp_path / "flag")) == (tmp_path / "flag", "--compile-cache")
    assert compile_cache.resolve("OFF") == (None, "--compile-cache")
    monkeypatch.setenv(compile_cache.ENV_VAR, "off")
    assert compile_cache.resolve() == (None, compile_cache.ENV_VAR)
    with pytest.raises(ValueError, match="directory or 'off'"):
        compile_cache.check_setting(" ")


def test_a_cache_configured_through_jax_is_never_overridden(tmp_path, monkeypatch, capsys):
    """tests/conftest.py sets JAX_COMPILATION_CACHE_DIR for the suite: `enable` keeps it, and says so
    once when asked for another directory."""
    configured = jax.config.jax_compilation_cache_dir
    assert configured
    monkeypatch.setattr(compile_cache, "_decided", False)
    monkeypatch.setattr(compile_cache, "_active", None)
    assert compile_cache.enable(str(tmp_path / "elsewhere")) == Path(configured)
    assert compile_cache.enable("off") == Path(configured)  # decided once per process
    assert jax.config.jax_compilation_cache_dir == configured and not (tmp_path / "elsewhere").exists()
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("acache-jax:")]
    assert len(notes) == 1 and "--compile-cache is ignored" in notes[0]


def test_every_command_line_takes_the_setting():
    from acache_jax import generate, lm_eval
    from acache_jax.serve import cli

    for parser in (generate.parser(), cli.parser()):
        assert parser.parse_args(["--compile-cache", "off"]).compile_cache == "off"
        assert parser.parse_args([]).compile_cache is None
        with pytest.raises(SystemExit):
            parser.parse_args(["--compile-cache", ""])
    assert lm_eval.settings({"compile_cache": "/tmp/somewhere"}).compile_cache == "/tmp/somewhere"
    with pytest.raises(lm_eval.InputError, match="compile_cache"):
        lm_eval.settings({"compile_cache": ""})


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream,compile_seconds,noted", [
    (_Terminal(), 0.5, True),  # a compile still running after `after` seconds
    (_Terminal(), 0.0, False),  # a program read back from the cache (or a quick compile)
    (io.StringIO(), 0.5, False),  # not a terminal: logs and pipes keep to errors and statistics
])
def test_a_long_compile_is_noted_on_a_terminal(stream, compile_seconds, noted):
    """note_long_compiles hears of each program's lowering and of the end of its compile from jax's
    monitoring events (recorded here as jax records them) and prints its line at most once."""
    with compile_cache.note_long_compiles(stream, after=0.2):
        for _ in range(2):
            jax.monitoring.record_event_duration_secs("/jax/core/compile/jaxpr_to_mlir_module_duration", 0.01)
            time.sleep(compile_seconds)
            jax.monitoring.record_event_duration_secs("/jax/core/compile/backend_compile_duration", compile_seconds)
    assert stream.getvalue().count("acache-jax: compiling a program for this shape") == int(noted), stream.getvalue()
