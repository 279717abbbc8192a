"""The command line in its own process, measured: what the bad-input tests need to show that a
request is refused before anything that grows with it is built (time and peak memory)."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(argv: list, stdin: bytes = b"", stderr: int | None = None, env: dict[str, str] | None = None
            ) -> tuple[int, str, str, float, int]:
    """(exit code, stdout, stderr, seconds, peak RSS in bytes) of `python -m acache_jax.generate`.

    argv items may be bytes (an argument that is not UTF-8, as a shell passes it). stderr: a file
    descriptor to write the child's stderr to instead of capturing it (a terminal's; closed here once
    the child holds it; "" is returned). The peak is the child's own, from wait4 in a small launcher
    (`_LAUNCHER` says why; RUSAGE_CHILDREN would be the largest of every child so far)."""
    start = time.perf_counter()
    peak_file = Path(tempfile.mkstemp(prefix="cli-peak-")[1])
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, peak_file, sys.executable, "-m", "acache_jax.generate",
                             *map(os.fsencode, argv)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE if stderr is None else stderr, env=env)
    if stderr is not None:
        os.close(stderr)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        out = pool.submit(proc.stdout.read)
        err = pool.submit(proc.stderr.read) if proc.stderr else None
        proc.stdin.write(stdin)
        proc.stdin.close()
        out_bytes, err_bytes = out.result(timeout=300), err.result(timeout=300) if err else b""
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe:
            pipe.close()
    peak = int(peak_file.read_text())
    peak_file.unlink()
    return (proc.returncode, out_bytes.decode(), err_bytes.decode(errors="replace"), time.perf_counter() - start,
            peak)


def rss_mb(pid: int) -> float:
    """A running process's resident set (VmRSS) in MB."""
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


# Runs the command as its child and writes the child's peak RSS (wait4) to argv[1]. Started from a
# small process: a child forked from a large one (a test worker of gigabytes) inherits that size as
# its peak until it execs, so its own ru_maxrss would report the worker's size, not its own.
_LAUNCHER = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss * 1024))
sys.exit(os.waitstatus_to_exitcode(status))
"""
