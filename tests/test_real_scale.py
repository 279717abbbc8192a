"""The real-scale check (eval.real_scale) at a CPU's size: every step it runs succeeds and its table
says what happened (the H200 runs at 8B size are in docs/BENCHMARKS.md)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_real_scale_runs_each_entry_point_and_reads_the_cache_back(tmp_path):
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, "-m", "eval.real_scale", "--family", "llada", "--layers", "1", "--hidden",
                          "128", "--steps", "convert,load,generate", "--gen-length", "8", "--block-length", "8",
                          "--workdir", str(tmp_path / "work"), "--out", str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {row["step"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["write snapshot", "read files (page cache)", "convert", "load snapshot, cold cache",
                          "load snapshot, warm cache", "load converted, warm cache", "generate, cold cache",
                          "generate, warm cache", "generate converted, warm cache"]
    assert all(row.get("rc", 0) == 0 and "error" not in row for row in rows.values())
    assert all(row["peak_rss_gb"] > 0 and row["programs"] > 0 for row in rows.values() if "rc" in row)
    # the memory each process held itself, sampled apart from the file pages its maps count in RSS
    assert all(0 < row["peak_anon_gb"] <= row["peak_rss_gb"] for row in rows.values() if "rc" in row)
    for cold, warm in (("load snapshot, cold cache", "load snapshot, warm cache"),
                       ("generate, cold cache", "generate, warm cache")):
        cold, warm = rows[cold], rows[warm]
        assert cold["cache_hits"] == 0 and warm["cache_hits"] > 0 and warm["program_s"] < cold["program_s"]
    assert all(rows[name]["load_s"] > 0 and rows[name]["backend_s"] >= 0 for name in rows if name.startswith("load "))
    assert "| generate, warm cache |" in run.stdout  # the table


def test_bench_load_times_every_variant_on_a_snapshot(tmp_path):
    """eval.bench_load (the load breakdown in docs/BENCHMARKS.md) runs as documented, on a CPU."""
    from eval.hf_snapshot import write_snapshot

    write_snapshot(tmp_path / "snap", "llada", layers=1, hidden=128)
    run = subprocess.run([sys.executable, "-m", "eval.bench_load", str(tmp_path / "snap")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for line in ("read/16MiB again", "acache_jax.load #1 (as is)", "  read_hf: ", "then the rest of load: ",
                 "acache_jax.load pinned staging, threads 8", "put/mmap threads=8", "chunked/put threads=16"):
        assert line in run.stdout, (line, run.stdout)


def test_a_profiled_load_prints_its_threads_timeline(tmp_path):
    """REAL_SCALE_PROFILE=1 (how docs/BENCHMARKS.md's load profiles were taken): a load's stderr has
    the compiling thread's programs, every program the placing threads called, and when the
    parameters were placed, which a profile of the calling thread alone does not show."""
    from eval.hf_snapshot import write_snapshot

    write_snapshot(tmp_path / "snap", "dream", layers=1, hidden=112)
    run = subprocess.run([sys.executable, "-m", "eval.real_scale", "--child", "load", str(tmp_path / "snap")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "REAL_SCALE_PROFILE": "1", "REAL_SCALE_STATS": str(tmp_path / "stats"),
                              "ACACHE_JAX_COMPILE_CACHE": "off"})
    assert run.returncode == 0, run.stderr
    timeline = run.stderr[run.stderr.index("load timeline"):].splitlines()
    ahead = [m[1] for line in timeline if (m := re.fullmatch(r"  compiled ahead (.+): taken .*", line))]
    calls = {m[1]: int(m[2]) for line in timeline if (m := re.fullmatch(r"  (.+): (\d+) calls, .*", line))}
    # the relayouts and fusions of one Dream layer, the embedding's and head's, and the check
    assert len(ahead) == 9 and ahead[-1].startswith("8:_all_finite")
    fused = sorted(kind.split()[1] for kind, n in calls.items() for _ in range(n) if kind.startswith("fuse "))
    placed = sum(n for kind, n in calls.items() if kind.startswith("place "))
    assert fused == ["gate_up", "qkv", "qkv"]  # the qkv kernel and bias, gate/up
    assert placed == 15  # the layer's 12 tensors (2 norms, q/k/v with biases, o, gate, up, down), embedding, norm, head
    assert timeline[-1].startswith("  100% of the parameters' bytes placed at ")
