"""The engine and the static path share one KV representation (kv.py), so they agree exactly in
bfloat16 too: the shipped models on a mixed workload (codebook questions, their few-shot affix in
every placement, all in one engine), every policy, through `python -m eval.engine_agreement`
(the command of the larger measurement in docs/DECODING.md) in its own process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import acache_jax

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(acache_jax.__file__).resolve().parent / "models"
POLICIES = ["direct", "acache", "dual"]


@pytest.mark.parametrize("name", ["llada-small", "dream-small"])
def test_engine_equals_static_in_bf16(name, tmp_path):
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, "-m", "eval.engine_agreement", "--models", str(MODELS / name), "-n", "6",
                          "--tasks", "codebook", "--policies", ",".join(POLICIES), "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == POLICIES and all(r["dtype"] == "bfloat16" for r in rows)
    for row in rows:
        assert row["tokens_equal"] == 1.0, row
