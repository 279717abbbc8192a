"""JAX's persistent compilation cache, on by default: a program compiles once per machine, not once per process.

Why: every (batch, length) bucket, engine step and block loop is an XLA program compiled the first
time a process needs it: about a second per program for the shipped models on a CPU, tens of seconds
for an 8B-shaped program on a GPU. Without a cache on disk every process pays that again (each CLI
call, each server restart, each lm-eval run). JAX can keep compiled executables on disk, keyed by
the program, its devices, its compile options and the jax/jaxlib versions (so one directory serves
every model, shape and jax version without mixing them up), but only once a directory is set, and
nothing sets one by default. This module is the one place that does.

Where (the first that applies):
1. the command line's `--compile-cache DIR|off` (`generate`, `serve`; lm-eval: model arg
   `compile_cache=DIR|off`), passed to `enable` as `setting`;
2. the environment variable ACACHE_JAX_COMPILE_CACHE (a directory, or `off`);
3. `$XDG_CACHE_HOME/acache-jax/jax-compile` (default `~/.cache/acache-jax/jax-compile`).
`off` turns it off. A cache directory set through jax itself (JAX_COMPILATION_CACHE_DIR, or
`jax.config.update("jax_compilation_cache_dir", ...)`) is never overridden: it is used with the
user's own settings, and a flag or variable that asks for something else gets one note on stderr.
Nor is `jax_enable_compilation_cache=False`: then nothing is cached.

Library users: `acache_jax.load` calls `enable()` too, so a script that loads a model gets the
cache as the command line does. The choice: the programs that take long to compile in such a
process are ours (the decode, forward and engine programs, built for the loaded model), a user of
the library pays the same compile time as a user of the command line, and an entry is keyed by
the program and its compile options, so reading it back gives the executable the compiler would
have built. Opting out is one variable (ACACHE_JAX_COMPILE_CACHE=off), and configuring jax's own
cache before the first `load` keeps that one. The cost: jax's cache is process-wide, so the
caller's own jitted functions that compile for long enough (MIN_COMPILE_SECS) land there too.

Never breaks a run: if the directory cannot be created or written (a read-only or missing home, a
path under a file), `enable` prints one line to stderr and the process runs without the cache.
Past that check, jax itself catches every error of a cache read or write (a full disk, an entry
another process is still writing, a damaged entry) and turns it into a Python warning naming the
program, then compiles as if there were no cache (jax/_src/compiler.py `_cache_read`,
`_cache_write`), unless the user set `jax_raise_persistent_cache_errors`. jax writes an entry in
place, and never rewrites one that exists: a write that fails midway leaves a truncated entry,
which later processes reject with that warning (and compile the program) until the directory is
deleted (tests/test_compile_cache.py shows both); deleting it is always safe. Processes share the
directory safely: entries are written only by the first process of a multi-host job, an entry
that exists is never rewritten, and with `filelock` installed (it comes with transformers) a size
limit turns on jax's file lock around every read and write, so no process reads a half-written
entry, and the least recently used entries go once the directory passes MAX_BYTES.

The first call of `enable` decides for the process (jax opens its cache once); later calls return
that decision.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import jax

ENV_VAR = "ACACHE_JAX_COMPILE_CACHE"
OFF = "off"
SUBDIR = Path("acache-jax") / "jax-compile"
# Programs that compile for less than this are not written. Measured on a CPU with the shipped
# models: model programs (decode, forward, rank_anchors, the engine's packed step and block
# loop) take 0.8-5 s, the load-time finiteness check about 0.15-0.3 s, and the dozens of small
# helper programs (stage, convert_element_type, iota, ...) 0.005-0.05 s, about what reading an
# entry back costs, so caching them would fill the directory for nothing. jax's own default (1 s)
# would skip the engine's CPU programs.
MIN_COMPILE_SECS = 0.1
# No size floor: an executable's size says nothing about how long it took to compile (-1 also
# stops jax from replacing it with a filesystem-specific minimum).
MIN_ENTRY_BYTES = -1
# The size past which the least recently used entries are evicted; setting it also turns on jax's
# file lock. Entries are executables, not weights: the shipped models' are 2-500 kB on a CPU and on
# an H200, so this holds thousands of programs.
MAX_BYTES = 4 << 30

# jax's defaults of the options this module sets; a different value (or the option's environment
# variable) means the user chose it, and it is left alone.
_JAX_DEFAULTS = {"jax_persistent_cache_min_compile_time_secs": 1.0,
                 "jax_persistent_cache_min_entry_size_bytes": 0,
                 "jax_compilation_cache_max_size": -1}

_decided = False
_active: Path | None = None


def check_setting(text: str) -> str:
    """A `--compile-cache` / ACACHE_JAX_COMPILE_CACHE value: a directory or `off` (raises ValueError if empty)."""
    if not text.strip():
        raise ValueError(f"expected a directory or '{OFF}', got {text!r}")
    return text


def default_dir() -> Path | None:
    """`$XDG_CACHE_HOME/acache-jax/jax-compile`, else `~/.cache/...`; None when there is no home to
    put it in. The XDG spec says a relative XDG_CACHE_HOME is to be ignored."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / SUBDIR
    try:
        return Path.home() / ".cache" / SUBDIR
    except RuntimeError:  # no HOME and no password entry for this user
        return None


def resolve(setting: str | None = None) -> tuple[Path | None, str]:
    """(the directory asked for, or None for off; where the choice came from): the flag, then the
    environment variable, then the XDG default. An empty flag or variable counts as not given."""
    for value, origin in ((setting, "--compile-cache"), (os.environ.get(ENV_VAR), ENV_VAR)):
        if value is not None and value.strip():
            value = value.strip()
            if value.lower() == OFF:
                return None, origin
            return Path(value).expanduser().absolute(), origin
    return default_dir(), "default"


def _jax_dir() -> str | None:
    """The cache directory configured through jax itself (its config or JAX_COMPILATION_CACHE_DIR)."""
    return jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR") or None


def _user_set(option: str) -> bool:
    return option.upper() in os.environ or getattr(jax.config, option) != _JAX_DEFAULTS[option]


def _unwritable(path: Path) -> str | None:
    """Why the directory cannot hold the cache (created if missing, a file written and removed), or None."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check-", suffix=".tmp", dir=path)
        try:
            os.write(fd, b"ok")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None


def _note(text: str) -> None:
    print(f"acache-jax: {text}", file=sys.stderr, flush=True)


def enable(setting: str | None = None) -> Path | None:
    """Turn on jax's persistent compilation cache for this process (module docstring: where, and why
    it is safe); returns the directory in use, or None when the process runs without one.

    setting: the command line's value (a directory or `off`); None: the environment variable, else
    the XDG default. Every entry point calls this before its first compile; the first call decides."""
    global _decided, _active
    if _decided:
        return _active
    _decided = True
    wanted, origin = resolve(setting)
    if not jax.config.jax_enable_compilation_cache:
        return None  # the user turned jax's cache off
    configured = _jax_dir()
    if configured:
        if origin != "default" and (wanted is None or Path(configured).expanduser().absolute() != wanted):
            _note(f"jax's own compilation cache setting ({configured}) is used; {origin} is ignored")
        _active = Path(configured)
        return _active
    if wanted is None:
        if origin == "default":
            _note("no home directory for the compilation cache; running without it "
                  f"(set {ENV_VAR}=DIR to keep compiled programs)")
        return None
    reason = _unwritable(wanted)
    if reason:
        _note(f"compilation cache off: cannot write {wanted} ({reason}); "
              f"{ENV_VAR}=DIR moves it, {ENV_VAR}=off silences this")
        return None
    jax.config.update("jax_compilation_cache_dir", str(wanted))
    for option, value in (("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS),
                          ("jax_persistent_cache_min_entry_size_bytes", MIN_ENTRY_BYTES)):
        if not _user_set(option):
            jax.config.update(option, value)
    # jax's LRU eviction (and its file lock) needs filelock; without it, jax would turn the cache off
    if not _user_set("jax_compilation_cache_max_size") and importlib.util.find_spec("filelock") is not None:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    _active = wanted
    return _active


# A program whose compile (or cache read) has run this long gets `note_long_compiles`'s line; a
# program read back from the cache takes 0.01-0.3 s, a compile of the shipped models' decode
# program 2-6 s on a CPU.
NOTE_AFTER_SECS = 1.0
_LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # a program was lowered: its compile or read follows
_COMPILED = "/jax/core/compile/backend_compile_duration"  # ... and has finished (compiled or read)


@contextlib.contextmanager
def note_long_compiles(stream: TextIO | None = None, after: float = NOTE_AFTER_SECS) -> Iterator[None]:
    """Inside the block, print one line on `stream` (default stderr) once a program has been
    compiling for `after` seconds: at most once, and only when `stream` is a terminal.

    Why: a command's first run of a shape spends most of its seconds in XLA's compiler, and a
    silent wait of 4-13 s reads as a hang. A program read back from this cache finishes well within
    `after`, so the line appears only when a compile really runs, and it says that later runs read
    the program back (or that the cache is off). Only a terminal gets it, as git and pip show
    progress: in logs and pipelines stderr keeps to errors and statistics, and stdout is never
    touched. jax reports each program's lowering and the end of its compile (or cache read) to
    `jax.monitoring` listeners; a thread notes a compile that has not ended in time."""
    stream = sys.stderr if stream is None else stream
    if not getattr(stream, "isatty", lambda: False)():
        yield
        return
    started: list[float | None] = [None]  # when the program now compiling was lowered
    stop = threading.Event()

    def on_duration(event: str, duration: float, **kwargs: Any) -> None:
        if event == _LOWERED:
            started[0] = time.monotonic()
        elif event == _COMPILED:
            started[0] = None

    def watch() -> None:
        while not stop.wait(0.1):
            began = started[0]
            if began is not None and time.monotonic() - began >= after:
                later = (f"later runs read it from the compilation cache in {_active}" if _active is not None
                         else "the compilation cache is off, so every run compiles it")
                print(f"acache-jax: compiling a program for this shape ({later})...", file=stream, flush=True)
                return

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    watcher = threading.Thread(target=watch, name="compile-note", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        jax.monitoring.unregister_event_duration_listener(on_duration)
