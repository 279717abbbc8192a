"""Every entry point a user has, at a real checkpoint's size, each in its own process.

    python -m eval.real_scale --family llada [--layers N] [--hidden H] [--workdir DIR] [--out FILE]
                              [--steps convert,load,generate,engine,lm_eval,serve]

Writes an HF snapshot in the exact layout of LLaDA-8B-Instruct or Dream-v0-Instruct-7B (random bf16
weights; eval.hf_snapshot), times reading its files from the page cache, then runs as a user would:
`python -m convert`; `acache_jax.load` of the snapshot and of the converted directory; `python -m
acache_jax.generate --model DIR` (256 tokens) with an empty and then a warm compilation cache,
static and `--engine`; the lm-eval adapter on one document; the server started (with its warm-up),
one chat request, one streamed request, one at each of two temperatures and one under `dual`,
stopped by SIGTERM; the server again with the warm cache.
It prints one table: seconds, peak host RSS and peak device memory per step, with the programs each
process compiled or read from the persistent compilation cache (`programs`, `program_s`: the
seconds jax spent on them) and how many of those came from the cache (`cache_hits`). Tiny models prove logic, not scale: this is the
check that a change to loading, converting, compiling or serving holds at 8B size. `--layers` and
`--hidden` make the model small enough for a CPU.

The processes run under `python -m eval.real_scale --child MODULE ...`, which runs MODULE as
`python -m MODULE` would and, at exit, records the device's peak memory and jax's compile events.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

GB = 1e9
STEPS = ("convert", "load", "generate", "engine", "lm_eval", "serve")
STATS_ENV = "REAL_SCALE_STATS"  # where a child writes its device and compile figures
PROFILE_ENV = "REAL_SCALE_PROFILE"  # set: each step prints a cProfile of its command to stderr (a load also its
# threads' timeline, `trace_load`), and runs slower
CACHE_ENV = "ACACHE_JAX_COMPILE_CACHE"
# requests the serve steps send after their first two: the sampler's numbers alone, then the policy
SETTINGS = ({"temperature": 0.5}, {"temperature": 0.8}, {"cache": "dual"})


# -- the child: a user's command, observed -------------------------------------------------------

def child(module: str, argv: list[str]) -> None:
    """Run `python -m module argv...`, then write what jax saw to $REAL_SCALE_STATS."""
    import atexit
    import runpy

    import jax

    events: dict[str, list[float]] = {}

    def record(name: str, *args, **kwargs) -> None:
        value = args[0] if args and isinstance(args[0], (int, float)) else 1.0
        events.setdefault(name, []).append(float(value))

    jax.monitoring.register_event_listener(lambda name, **kw: record(name))
    jax.monitoring.register_event_duration_secs_listener(lambda name, secs, **kw: record(name, secs))

    def write() -> None:
        stats = jax.devices()[0].memory_stats() or {}
        # jax times a program's compile and its read from the persistent cache as one event
        programs = events.get("/jax/core/compile/backend_compile_duration", [])
        out = {"peak_device_bytes": stats.get("peak_bytes_in_use"), "programs": len(programs),
               "program_s": round(sum(programs), 2),
               "cache_hits": len(events.get("/jax/compilation_cache/cache_hits", []))}
        Path(os.environ[STATS_ENV]).write_text(json.dumps(out))

    atexit.register(write)
    sys.argv = [module, *argv]
    if module == "load":  # the library API: load a model and wait for its weights
        started = time.perf_counter()
        import acache_jax

        imported = time.perf_counter()
        jax.devices()  # the GPU's start, which any program pays once, apart from the load it precedes
        backend = time.perf_counter()
        profiler = cProfile.Profile() if os.environ.get(PROFILE_ENV) else None
        timeline = None if profiler is None else trace_load()
        model = acache_jax.load(argv[0]) if profiler is None else profiler.runcall(acache_jax.load, argv[0])
        jax.block_until_ready(model.flat[1])
        loaded = time.perf_counter()
        if profiler is not None:  # where a load's time goes, on stderr (the run's --log keeps it)
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
            timeline()
        print(json.dumps({"import_s": round(imported - started, 2), "backend_s": round(backend - imported, 2),
                          "load_s": round(loaded - backend, 2)}))
        return
    profiler = cProfile.Profile() if os.environ.get(PROFILE_ENV) else None
    if profiler is None:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    try:  # where a command's time goes, on stderr (the run's --log keeps it)
        profiler.runcall(runpy.run_module, module, run_name="__main__", alter_sys=True)
    finally:
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(40)


def trace_load():
    """(profiled loads) Time the loader's threads, which a profile of the calling thread does not
    see: when the compiling thread took and finished each program (`sharding.compiling_ahead`), how
    long the copying threads took over each kind of tensor (`transfer_param`), the relayout thread
    over each (`place_param`: its program's call, which waits while that program compiles) and each
    fusion, and when the bytes were copied and the parameters done. Returns a function that prints
    the timeline to stderr, in seconds from now."""
    import threading

    from acache_jax.network import checkpoint
    t0 = time.perf_counter()
    ahead, copy, place, fuse, read = (checkpoint.compiling_ahead, checkpoint.transfer_param, checkpoint.place_param,
                                      checkpoint.fuse_param, checkpoint.read_hf)
    compiled: list[tuple[str, float, float]] = []  # (program, taken, done)
    calls: dict[str, list[float]] = {}  # kind of call -> seconds of each
    copied: list[tuple[int, float]] = []  # (bytes, when) of each tensor copied to the device
    done: list[tuple[int, float]] = []  # (bytes, when) of each parameter handed out
    shapes = lambda arrays: " ".join("x".join(map(str, a.shape)) for a in arrays if hasattr(a, "shape"))  # noqa: E731

    def timed_ahead(programs):
        def each():
            for i, (program, inputs) in enumerate(programs):
                taken = time.perf_counter() - t0
                yield program, inputs
                compiled.append((f"{i}:{getattr(program, '__name__', '?')}({shapes(inputs)})", taken,
                                 time.perf_counter() - t0))
        return ahead(each())

    def timed(kind: str, function, *args, **kwargs):
        started = time.perf_counter()
        out = function(*args, **kwargs)
        calls.setdefault(kind, []).append(time.perf_counter() - started)
        return out

    def timed_copy(path, array, *args, **kwargs):  # until the bytes are on the device (a call may return before)
        out = timed(f"copy ({shapes([array])})", lambda: copy(path, array, *args, **kwargs).block_until_ready())
        copied.append((out.nbytes, time.perf_counter() - t0))
        return out

    def timed_place(path, array, *args, **kwargs):
        kind = f"place ({shapes([array])}{', transposed' if kwargs.get('transposed') else ''})"
        return timed(kind, place, path, array, *args, **kwargs)

    def timed_fuse(path, parts, *args, **kwargs):
        return timed(f"fuse {path[-2]} ({shapes(parts)})", fuse, path, parts, *args, **kwargs)

    def timed_read(*args, **kwargs):
        for path, array in read(*args, **kwargs):
            done.append((array.nbytes, time.perf_counter() - t0))
            yield path, array

    (checkpoint.compiling_ahead, checkpoint.transfer_param, checkpoint.place_param, checkpoint.fuse_param,
     checkpoint.read_hf) = (timed_ahead, timed_copy, timed_place, timed_fuse, timed_read)

    def report() -> None:
        lines = [f"load timeline, seconds from the start ({threading.active_count()} threads alive):"]
        lines += [f"  compiled ahead {n}: taken {a:.2f}, done {b:.2f}" for n, a, b in compiled]
        lines += [f"  {n}: {len(t)} calls, {sum(t):.2f} s in all, longest {max(t):.3f} s" for n, t in calls.items()]
        for what, events in (("the files' bytes copied to the device", copied), ("the parameters' bytes placed", done)):
            total, so_far, marks = sum(n for n, _ in events), 0, [0.1, 0.25, 0.5, 0.75, 1.0]
            for nbytes, when in sorted(events, key=lambda e: e[1]):
                so_far += nbytes
                while marks and so_far >= marks[0] * total:
                    lines.append(f"  {marks.pop(0):.0%} of {what} at {when:.2f}")
        print("\n".join(lines), file=sys.stderr)

    return report


# -- the parent: steps, each a process -----------------------------------------------------------

class Step:
    """One process a user would run: wall seconds, peak RSS (its own, from wait4), the child's figures."""

    def __init__(self, name: str, cmd: list[str], env: dict, cwd: Path, log: Path | None = None):
        self.name, self.cmd, self.env, self.cwd, self.log = name, cmd, env, cwd, log
        self.row: dict = {"step": name}

    def start(self) -> None:
        self.files = {k: Path(tempfile.mkstemp(prefix=f"real-scale-{k}-")[1]) for k in ("stats", "out", "err")}
        self.peak_anon = 0
        env = {**self.env, STATS_ENV: str(self.files["stats"])}
        self.t0 = time.perf_counter()
        with open(self.files["out"], "w") as out, open(self.files["err"], "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "eval.real_scale", "--child", *self.cmd],
                                         cwd=self.cwd, env=env, stdout=out, stderr=err, text=True)

    def running(self) -> bool:
        """Whether the process still runs; each call also samples its anonymous memory (`peak_anon`):
        ru_maxrss counts the pages of the files it maps too (a snapshot's weights, read through
        maps, are 16 GB of page cache that stays the kernel's to drop), so the memory the process
        holds itself is sampled apart, as often as this is called (every 0.05-0.2 s)."""
        if self.proc.returncode is not None or self._reap(os.WNOHANG):
            return False
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
            anon = int(status.split("RssAnon:")[1].split()[0]) * 1024
            self.peak_anon = max(self.peak_anon, anon)
        except (OSError, IndexError, ValueError):  # no /proc (not Linux), or the process just ended
            pass
        return True

    def _reap(self, options: int) -> bool:
        pid, status, usage = os.wait4(self.proc.pid, options)
        if not pid:
            return False
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.peak_rss = usage.ru_maxrss * 1024  # kilobytes on Linux
        return True

    def finish(self, timeout: float) -> dict:
        deadline = time.perf_counter() + timeout
        while self.running():
            if time.perf_counter() > deadline:
                self.proc.kill()
                self._reap(0)
                self.row["error"] = f"killed after {timeout:.0f} s"
                break
            time.sleep(0.05)
        self.row.update(seconds=round(time.perf_counter() - self.t0, 2), rc=self.proc.returncode,
                        peak_rss_gb=round(self.peak_rss / GB, 2), peak_anon_gb=round(self.peak_anon / GB, 2) or None)
        self.stdout, self.stderr = (self.files[k].read_text(errors="replace") for k in ("out", "err"))
        if self.log is not None:
            with open(self.log, "a") as log:
                log.write(f"==== {self.name} (rc {self.proc.returncode}): {' '.join(self.cmd)}\n{self.stderr}\n")
        try:
            stats = json.loads(self.files["stats"].read_text() or "{}")
        except json.JSONDecodeError:
            stats = {}
        for file in self.files.values():
            file.unlink(missing_ok=True)
        peak = stats.pop("peak_device_bytes", None)
        self.row.update(peak_device_gb=None if peak is None else round(peak / GB, 2), **stats)
        if self.cmd[0] == "load" and self.proc.returncode == 0:  # the child's own import and load times
            self.row.update(json.loads(self.stdout.strip().splitlines()[-1]))
        if self.proc.returncode != 0 and "error" not in self.row:
            self.row["error"] = (self.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
        return self.row

    def run(self, timeout: float) -> dict:
        self.start()
        return self.finish(timeout)


def read_files_seconds(directory: Path) -> tuple[float, float]:
    """Seconds to read every safetensors file of directory once (sequentially, 16 MiB at a time: a
    plain `cat`), and the bytes read; the second of two passes, so both come from the page cache."""
    files = sorted(directory.glob("*.safetensors"))
    buffer = bytearray(16 << 20)
    view = memoryview(buffer)
    for _ in range(2):
        started, total = time.perf_counter(), 0
        for file in files:
            with open(file, "rb", buffering=0) as f:
                while n := f.readinto(view):
                    total += n
        seconds = time.perf_counter() - started
    return seconds, total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> tuple[float, bytes]:
    started = time.perf_counter()
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        data = response.read()
    return time.perf_counter() - started, data


def serve_step(name: str, model: Path, env: dict, cwd: Path, warmup_tokens: int, timeout: float,
               log: Path | None = None) -> dict:
    """Start the server (with its warm-up), wait until it answers, send one chat request and one
    streamed one, then one at each of `SETTINGS` (other decoding settings: the temperatures share
    an engine, dual has its own, all in the server's one KV pool; each new engine compiles in the
    background), with one more request at the defaults while the first of them waits for its
    engine (`chat_while_compiling_s`), read how many engines it holds, stop it with SIGTERM."""
    port = _free_port()
    step = Step(name, ["acache_jax.serve", "--model", str(model), "--port", str(port),
                       "--warmup-tokens", str(warmup_tokens)], env, cwd, log)
    step.start()
    base = f"http://127.0.0.1:{port}"
    deadline = step.t0 + timeout
    listening = None
    while time.perf_counter() < deadline and step.running():
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2):
                listening = time.perf_counter() - step.t0
                break
        except OSError:
            time.sleep(0.2)
    figures = {"listening_s": None if listening is None else round(listening, 2)}
    if listening is not None:
        try:
            chat = {"model": model.name, "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 32}
            latency, data = _post(f"{base}/v1/chat/completions", chat, max(1.0, deadline - time.perf_counter()))
            figures["first_answer_s"] = round(time.perf_counter() - step.t0, 2)  # waits for the warm-up
            figures["chat_s"] = round(latency, 2)
            figures["chat_ok"] = bool(json.loads(data)["choices"])
            latency, data = _post(f"{base}/v1/chat/completions", {**chat, "stream": True},
                                  max(1.0, deadline - time.perf_counter()))
            figures["stream_s"] = round(latency, 2)
            figures["stream_ok"] = data.rstrip().endswith(b"data: [DONE]")
            for i, knobs in enumerate(SETTINGS):
                with ThreadPoolExecutor(1) as pool:
                    pending = pool.submit(_post, f"{base}/v1/chat/completions", {**chat, **knobs},
                                          max(1.0, deadline - time.perf_counter()))
                    if i == 0:
                        time.sleep(1.0)  # taken in: its engine compiles
                        latency, data = _post(f"{base}/v1/chat/completions", chat,
                                              max(1.0, deadline - time.perf_counter()))
                        figures["chat_while_compiling_s"] = round(latency, 2)
                        figures["still_compiling"] = not pending.done()
                    latency, data = pending.result()
                name = "_".join(f"{k}_{v}" for k, v in knobs.items())
                figures[f"{name}_s"] = round(latency, 2)
                figures["settings_ok"] = figures.get("settings_ok", True) and bool(json.loads(data)["choices"])
            with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
                metrics = dict(line.split(" ") for line in r.read().decode().splitlines() if line.startswith("acache_"))
            figures["engines"] = int(float(metrics["acache_engines"]))
        except (OSError, ValueError, KeyError) as e:
            figures["client_error"] = f"{type(e).__name__}: {e}"[:200]
    if step.running():
        step.proc.send_signal(signal.SIGTERM)
    row = step.finish(timeout=120)
    row.update(figures)
    if not (figures.get("chat_ok") and figures.get("stream_ok") and figures.get("settings_ok")) and "error" not in row:
        row["error"] = figures.get("client_error", "the server did not answer")
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2:])
        return 0
    p = argparse.ArgumentParser(prog="python -m eval.real_scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=["llada", "dream"], required=True)
    p.add_argument("--layers", type=int, default=None, help="fewer layers (CPU runs); default: the real count")
    p.add_argument("--hidden", type=int, default=None, help="a smaller width (CPU runs); default: the real one")
    p.add_argument("--workdir", type=Path, default=None, help="where the snapshot, converted copy and cache go "
                   "(kept; a snapshot already there is reused); default: a temporary directory, removed")
    p.add_argument("--steps", default=",".join(STEPS), help=f"which of {','.join(STEPS)} to run")
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--block-length", type=int, default=None,
                   help="the generate steps' decoding block (default: the model's)")
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="the server's --warmup-tokens (default: 16 x 128 with an NVIDIA GPU; else 0)")
    p.add_argument("--timeout", type=float, default=900, help="seconds any one step may take")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here (atomically)")
    p.add_argument("--log", type=Path, default=None, help="append every process's stderr here")
    args = p.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    if unknown := sorted(set(steps) - set(STEPS)):
        p.error(f"unknown steps {unknown}; choose from {','.join(STEPS)}")
    import jax

    jax.config.update("jax_platforms", "cpu")  # this process never takes the GPU (or its memory) from its children
    from acache_jax.network.files import write_atomic  # here: a child imports the library as the user's process would

    root = Path(__file__).resolve().parents[1]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="real-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def report(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out is not None:  # after every step: a run stopped from outside keeps what it finished
            write_atomic(args.out, json.dumps({"family": args.family, "layers": args.layers, "hidden": args.hidden,
                                               "rows": rows}, indent=1))

    try:
        snapshot = work / f"{args.family}-snapshot"
        if not (snapshot / "config.json").is_file():
            from eval.hf_snapshot import write_snapshot

            started = time.perf_counter()
            write_snapshot(snapshot, args.family, layers=args.layers, hidden=args.hidden)
            report({"step": "write snapshot", "seconds": round(time.perf_counter() - started, 2)})
        seconds, total = read_files_seconds(snapshot)
        report({"step": "read files (page cache)", "seconds": round(seconds, 2), "gb": round(total / GB, 2),
                "gb_per_s": round(total / GB / seconds, 2)})
        cache = work / "compile-cache"

        def empty_cache() -> None:  # before the steps named "cold cache"
            shutil.rmtree(cache, ignore_errors=True)

        # The cache is this run's to measure: a cache configured through jax's own variables (which
        # acache_jax never overrides) would make the "empty cache" steps read entries.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
        env.update({CACHE_ENV: str(cache), "PYTHONUNBUFFERED": "1"})
        converted = work / f"{args.family}-converted"
        run = lambda name, cmd: report(Step(name, cmd, env, root, args.log).run(args.timeout))  # noqa: E731
        if "convert" in steps:
            shutil.rmtree(converted, ignore_errors=True)
            run("convert", ["convert", str(snapshot), str(converted)])
        if "load" in steps:
            empty_cache()
            run("load snapshot, cold cache", ["load", str(snapshot)])
            run("load snapshot, warm cache", ["load", str(snapshot)])
            if converted.is_dir():
                run("load converted, warm cache", ["load", str(converted)])
        prompt = ",".join(str(10 + i) for i in range(64))
        generate = ["acache_jax.generate", "--prompt-ids", prompt, "--gen-length", str(args.gen_length)]
        if args.block_length is not None:
            generate += ["--block-length", str(args.block_length)]
        if "generate" in steps:
            empty_cache()
            run("generate, cold cache", [*generate, "--model", str(snapshot)])
            run("generate, warm cache", [*generate, "--model", str(snapshot)])
            if converted.is_dir():
                run("generate converted, warm cache", [*generate, "--model", str(converted)])
        if "engine" in steps:
            run("generate --engine, cache of the static run", [*generate, "--model", str(snapshot), "--engine"])
            run("generate --engine, warm cache", [*generate, "--model", str(snapshot), "--engine"])
        if "lm_eval" in steps:
            out_dir, data = work / "lm_eval", work / "lm_eval_data"
            subprocess.run([sys.executable, "-m", "eval.lm_eval_data", "--out", str(data), "--tasks", "arithmetic",
                            "-n", "8"], cwd=root, check=True, capture_output=True)
            env["ACACHE_LM_EVAL_DATA"] = str(data)
            run("lm-eval, one document", ["acache_jax.lm_eval", "--model", "acache_jax", "--model_args",
                                          f"pretrained={snapshot},dtype=bfloat16", "--tasks", "acache_arithmetic",
                                          "--include_path", str(root / "eval" / "lm_eval_tasks"), "--limit", "1",
                                          "--output_path", str(out_dir)])
        if "serve" in steps:
            gpu = Path("/dev/nvidiactl").exists()
            warmup = args.warmup_tokens if args.warmup_tokens is not None else 16 * 128 if gpu else 0
            empty_cache()
            report(serve_step("serve, cold cache", snapshot, env, root, warmup, args.timeout, args.log))
            report(serve_step("serve, warm cache", snapshot, env, root, warmup, args.timeout, args.log))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print_table(rows)
    return 0 if all(r.get("rc", 0) == 0 and "error" not in r for r in rows) else 1


def print_table(rows: list[dict]) -> None:
    columns = ("seconds", "peak_rss_gb", "peak_anon_gb", "peak_device_gb", "programs", "program_s", "cache_hits", "rc")
    print("| step | " + " | ".join(columns) + " | notes |")
    print("|---|" + "---|" * (len(columns) + 1))
    for row in rows:
        notes = {k: v for k, v in row.items() if k not in columns and k != "step"}
        cells = [row.get(c, "") for c in columns]
        cells = [f"{c:.2f}" if isinstance(c, float) else str(c) for c in cells]
        print(f"| {row['step']} | " + " | ".join(cells) + f" | {json.dumps(notes) if notes else ''} |")


if __name__ == "__main__":
    sys.exit(main())
