"""No interrupted or repeated run loses what it finished or leaves anything half-written: conversions
stopped by TERM, INT or KILL, a long `generate --input` stopped by Ctrl-C, sweeps run twice into one
directory, results written atomically."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from acache_jax.network.config import InputError
from acache_jax.network.files import check_output_path, write_atomic
from tests.hf_checkpoints import hf_shapes, llada_config

ROOT = Path(__file__).resolve().parents[1]


def _partials(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".partial-" in p.name)


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory) -> Path:
    """An HF LLaDA layout of ~100 MB (zeros: conversion does not look at values), slow enough to stop."""
    directory = tmp_path_factory.mktemp("big")
    cfg = llada_config(d_model=512, n_heads=8, n_kv_heads=8, n_layers=12, mlp_hidden_size=2048,
                       vocab_size=8192, embedding_size=8192)
    save_file({k: np.zeros(s, np.float32) for k, s in hf_shapes(cfg).items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def _start_convert(src: Path, dst: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "convert", str(src), str(dst), "--dtype", "float32"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_partial(proc: subprocess.Popen, parent: Path) -> None:
    deadline = time.monotonic() + 120
    while not _partials(parent):
        assert proc.poll() is None, f"conversion ended before it could be stopped: {proc.communicate()}"
        assert time.monotonic() < deadline, "no temporary directory appeared"
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopped_conversion_removes_its_temporary_directory(big_checkpoint, tmp_path, sig):
    dst = tmp_path / "out"
    proc = _start_convert(big_checkpoint, dst)
    _wait_for_partial(proc, tmp_path)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted: nothing was written" in err
    assert _partials(tmp_path) == [] and not dst.exists()


def test_killed_conversion_leaves_a_partial_the_next_run_removes(big_checkpoint, tmp_path):
    dst = tmp_path / "out"
    proc = _start_convert(big_checkpoint, dst)
    _wait_for_partial(proc, tmp_path)
    proc.kill()
    proc.wait(timeout=60)
    left = _partials(tmp_path)
    assert len(left) == 1 and left[0].startswith(".out.partial-")
    run = subprocess.run([sys.executable, "-m", "convert", str(big_checkpoint), str(dst), "--dtype", "float32"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert f"removed {left[0]}, left beside out by an interrupted write" in run.stderr
    assert _partials(tmp_path) == [] and (dst / "acache.json").is_file()


def test_a_partial_of_a_running_writer_is_left_alone(tmp_path):
    """Only leftovers of dead processes are removed (a pid that is alive: this test's own)."""
    from acache_jax.network.files import remove_stale_partials

    mine = tmp_path / f".out.partial-{os.getpid()}-abcdef12"
    mine.mkdir()
    dead = tmp_path / ".out.partial-999999999-abcdef12"
    dead.mkdir()
    assert remove_stale_partials(tmp_path / "out") == [dead]
    assert mine.is_dir() and not dead.exists()


def _sigint_default() -> None:
    """A shell starts background jobs with SIGINT ignored, and Python keeps that: give the child
    the terminal's Ctrl-C, whatever started this test run."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_ctrl_c_swallowed_by_a_finalizer_still_stops_the_cli():
    """Python prints and swallows an exception raised inside a __del__ or a garbage-collection
    callback (jax runs one at every collection): a Ctrl-C landing there must still stop the CLI's
    loops at their next check, as the one a run once finished despite (exit 0 after SIGINT)."""
    from acache_jax.generate import _sigint_remembered, _stop_if_interrupted

    class Finalized:
        def __del__(self):
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # the handler, run where Python runs it

    # Python's own handler, as in a terminal (a pytest-xdist worker runs with SIGINT ignored, which
    # the CLI keeps: see _sigint_remembered)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    swallowed = []
    hook, sys.unraisablehook = sys.unraisablehook, swallowed.append
    try:
        with _sigint_remembered() as interrupts:
            Finalized()  # the KeyboardInterrupt raised in __del__ goes to the unraisable hook
            assert [type(u.exc_value) for u in swallowed] == [KeyboardInterrupt]
            with pytest.raises(KeyboardInterrupt):
                _stop_if_interrupted(interrupts)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        sys.unraisablehook = hook
        signal.signal(signal.SIGINT, outer)


def _interrupt_inside_c_code(signum: int):
    """A stand-in for a step during which the signal's handler runs in Python code that C code
    called: C code raises SystemError over the KeyboardInterrupt (seen once in CI: numpy hashing a
    jax dtype while a conversion was stopped, which then ended with a traceback and status 1)."""
    def step(*args, **kwargs):
        try:
            signal.getsignal(signum)(signum, None)
        except KeyboardInterrupt as e:
            raise SystemError("<function _ScalarMeta.__hash__> returned a result with an exception set") from e
    return step


def test_an_interrupt_that_c_code_wraps_still_ends_the_cli_as_interrupted(tmp_path, fixtures_dir, monkeypatch,
                                                                          capsys):
    """convert (TERM) and generate (Ctrl-C): exit status 130 and the one line, not a traceback; the
    same SystemError with no signal behind it is still raised."""
    import convert.__main__ as convert_cli
    from acache_jax import generate as generate_cli

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # convert's main installs its own
    dst = tmp_path / "out"
    try:
        monkeypatch.setattr(convert_cli, "convert", _interrupt_inside_c_code(signal.SIGTERM))
        assert convert_cli.main([str(tmp_path), str(dst)]) == 130
        assert capsys.readouterr().err == f"interrupted: nothing was written to {dst}\n"
        monkeypatch.setattr(convert_cli, "convert", lambda *args: _raise(SystemError("a bug")))
        with pytest.raises(SystemError, match="a bug"):
            convert_cli.main([str(tmp_path), str(dst)])

        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (xdist workers ignore it)
        argv = ["--model", str(fixtures_dir / "decode" / "llada"), "--prompt-ids", "5,17,33", "--gen-length", "16",
                "--block-length", "8"]
        monkeypatch.setattr(generate_cli, "_run_static", _interrupt_inside_c_code(signal.SIGINT))
        assert generate_cli.main(argv) == 130
        assert capsys.readouterr().err == "interrupted: 0 of 1 requests done (printed above)\n"
        monkeypatch.setattr(generate_cli, "_run_static", lambda *args: _raise(SystemError("a bug")))
        with pytest.raises(SystemError, match="a bug"):
            generate_cli.main(argv)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _raise(error: BaseException):
    raise error


def test_interrupted_generate_keeps_what_it_finished(tmp_path, fixtures_dir):
    """Ctrl-C on a long --input run: every finished answer is already on stdout, in input order, and
    one line says how many."""
    n = 4000  # about 20 s of decoding: the interrupt lands long before the end, however the cores are shared
    path = tmp_path / "in.jsonl"
    lines = [json.dumps({"prompt_ids": [1 + i % 50, 7, 9]}) + "\n" for i in range(n)]
    path.write_text("".join(lines))
    proc = subprocess.Popen([sys.executable, "-m", "acache_jax.generate", "--model", str(fixtures_dir / "decode" / "llada"),
                             "--input", str(path), "--json", "--batch-size", "2", "--gen-length", "16",
                             "--block-length", "8"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_sigint_default)
    first = proc.stdout.readline()  # results stream: the first window's arrive long before the last
    assert first, proc.stderr.read()
    proc.send_signal(signal.SIGINT)
    rest, err = proc.stdout.read(), proc.stderr.read()  # the same buffered readers readline used
    proc.wait(timeout=120)
    rows = [json.loads(line) for line in (first + rest).splitlines()]
    assert proc.returncode == 130, err
    assert 0 < len(rows) < n
    assert f"interrupted: {len(rows)} of {n} requests done" in err
    # in input order: what a full run of those lines prints (a result does not depend on its batch)
    done = tmp_path / "done.jsonl"
    done.write_text("".join(lines[:len(rows)]))
    full = subprocess.run([sys.executable, "-m", "acache_jax.generate", "--model", str(fixtures_dir / "decode" / "llada"),
                           "--input", str(done), "--json", "--batch-size", "2", "--gen-length", "16",
                           "--block-length", "8"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    expected = [json.loads(line)["tokens"] for line in full.stdout.splitlines()]
    assert [r["tokens"] for r in rows] == expected


def test_sweep_refuses_to_overwrite_and_resumes(tmp_path):
    from eval.affix_sweep import main

    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps(dict(ratios=[0.0], n=1, seed=0, worlds=1, rows=[
        dict(model="m", task="babi", placement="none", shots=0, policy="full", accuracy=1.0)])))
    with pytest.raises(SystemExit) as exit_:
        main(["--merge", str(tmp_path / "other"), "--out", str(out), "--ratios", "0", "-n", "1", "--no-plots"])
    assert exit_.value.code == 2
    assert json.loads((out / "sweep.json").read_text())["rows"][0]["model"] == "m"  # untouched


def test_writes_are_atomic(tmp_path):
    path = tmp_path / "result.json"
    write_atomic(path, "old")

    def torn(tmp: Path):
        tmp.write_text("half")
        raise OSError("the writer died here")

    with pytest.raises(OSError, match="died here"):
        write_atomic(path, torn)
    assert path.read_text() == "old" and _partials(tmp_path) == []
    write_atomic(tmp_path / "new" / "deeper" / "r.json", b"{}")  # parents are created
    assert (tmp_path / "new" / "deeper" / "r.json").read_bytes() == b"{}"


def test_outputs_are_checked_before_the_work(tmp_path):
    """eval.accuracy --json into a missing directory creates it first; a directory as output fails at once."""
    assert check_output_path(tmp_path / "out" / "eval.json").parent.is_dir()
    with pytest.raises(InputError, match="is a directory"):
        check_output_path(tmp_path)
    run = subprocess.run([sys.executable, "-m", "eval.accuracy", "--model", "acache_jax/models/llada-small",
                          "--json", str(tmp_path), "-n", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "is a directory" in run.stderr and "Traceback" not in run.stderr


def test_ctrl_c_while_a_result_prints_takes_effect_after_it():
    """The CLI prints each result and counts it with Ctrl-C deferred: the interrupt lands after the
    block (and the handler in place before it is back)."""
    from acache_jax.generate import _sigint_deferred

    before = signal.getsignal(signal.SIGINT)
    finished = []
    with pytest.raises(KeyboardInterrupt):
        with _sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs between these bytecodes
            finished.append(True)
    assert finished == [True] and signal.getsignal(signal.SIGINT) is before
