"""The GPU kernels of engine runs at 8B shape: one profiled run per (policy, batch), summarised from
the trace jax.profiler writes (the per-layer kernel list of docs/BENCHMARKS.md).

    python -m eval.kernel_trace --out DIR [--family llada|dream] [--shots 4] [--batches 1,16]
                                [--policies baseline,acache] [--layers N] [--top 45]
                                [eval.bench_engine's case flags: --gen, --block, --steps, ...]

Each case is first run whole once (its programs compile), then run again under
`jax.profiler.trace` (DIR/trace_<family>_<policy>_b<batch>, perfetto format). Printed per case and
GPU stream: its span, the time some kernel ran (busy) and the idle gaps between kernels; then the
kernels by total time, with their call counts and mean durations. The profiler slows the host, so
the run's tokens/s and the gaps are not those of a plain run (eval.bench_engine measures those);
kernel durations are. Kernel names are XLA's (fusions, cuBLAS, our Pallas kernels by name), and a
name's count tells which forwards ran it: layers x in-block steps, or layers x recomputes. On a
machine without a GPU the trace has no GPU stream and the summary says so.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import time
from pathlib import Path

import jax

from acache_jax import compile_cache
from eval.bench_decode import llada_8b, random_model
from eval.bench_engine import add_case_args, case_configs, code_path, dream_7b, new_engine, served_affix, warm


def busy_and_gaps(intervals: list[tuple[float, float]]) -> tuple[float, float, list[float]]:
    """(span, busy time, idle gaps) of (start, duration) intervals in µs, overlaps counted once."""
    intervals = sorted(intervals)
    busy, end, gaps = 0.0, None, []
    for start, duration in intervals:
        if end is None or start >= end:
            if end is not None:
                gaps.append(start - end)
            busy += duration
            end = start + duration
        elif start + duration > end:
            busy += start + duration - end
            end = start + duration
    return (end - intervals[0][0] if intervals else 0.0), busy, gaps


def summarise(trace_dir: Path, label: str, top: int) -> None:
    files = glob.glob(str(trace_dir / "**" / "*.trace.json.gz"), recursive=True)
    if not files:
        print(f"[{label}] no perfetto trace under {trace_dir}")
        return
    data = json.load(gzip.open(files[0]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    gpu = {pid for pid, name in processes.items() if "gpu" in name.lower()}
    if not gpu:
        print(f"[{label}] no GPU stream in the trace (processes: {sorted(processes.values())})")
        return
    kernels = collections.defaultdict(lambda: collections.defaultdict(list))  # stream -> name -> durations
    intervals = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu:
            stream = threads.get((e["pid"], e["tid"]), str(e["tid"]))
            kernels[stream][e["name"]].append(float(e.get("dur", 0)))
            intervals[stream].append((float(e["ts"]), float(e.get("dur", 0))))
    for stream, names in kernels.items():
        span, busy, gaps = busy_and_gaps(intervals[stream])
        if busy < 1000:  # copy-only streams: a few µs in a run
            continue
        gaps.sort()
        print(f"[{label}] {stream}: span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms ({100 * busy / span:.0f}%), "
              f"{len(gaps)} gaps (median {gaps[len(gaps) // 2] if gaps else 0:.1f} µs), "
              f"{sum(g for g in gaps if g > 100) / 1e3:.1f} ms in gaps over 100 µs")
        for name, durations in sorted(names.items(), key=lambda kv: -sum(kv[1]))[:top]:
            total = sum(durations)
            print(f"    {total / 1e3:9.2f} ms {len(durations):7d} x {total / len(durations):8.1f} µs  {name[:150]}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eval.kernel_trace", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where the traces go")
    p.add_argument("--family", choices=["llada", "dream"], default="llada")
    p.add_argument("--shots", type=int, default=4)
    p.add_argument("--batches", default="16,1")
    p.add_argument("--policies", default="baseline,acache")
    p.add_argument("--layers", type=int, default=None, help="fewer layers (a CPU check); default: the real count")
    p.add_argument("--top", type=int, default=45, help="kernels listed per stream")
    add_case_args(p)  # how each case decodes: eval.bench_engine's flags and defaults
    args = p.parse_args(argv)
    cfg = llada_8b(args.layers or 32) if args.family == "llada" else dream_7b(args.layers or 28)
    compile_cache.enable()  # the programs eval.bench_engine compiled for the same cases are read back
    model = random_model(cfg)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; acache_jax from {code_path()}", flush=True)
    for batch in (int(b) for b in args.batches.split(",")):
        for policy in args.policies.split(","):
            started = time.perf_counter()
            warm(model, args.shots, batch, policy, args)
            affix, requests, pool_tokens, configs = case_configs(cfg, args.shots, batch, args)
            trace_dir = args.out / f"trace_{args.family}_{policy}_b{batch}"
            traced = time.perf_counter()
            with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
                engine = new_engine(model, configs[policy], pool_tokens, batch, args)
                engine.generate(requests, served_affix(model, policy, affix, args))
            print(f"{args.family} {policy} B{batch} {args.shots}-shot: compiled in {traced - started:.1f} s, "
                  f"traced run {time.perf_counter() - traced:.2f} s, "
                  f"{engine.stats.summary()['tokens_per_s']:.0f} tok/s", flush=True)
            del engine  # its KV pool: the next case's engine would not fit beside it (13-shot B16)
            summarise(trace_dir, f"{policy} B{batch}", args.top)


if __name__ == "__main__":
    main()
