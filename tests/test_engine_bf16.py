"""The engine and the static path share one KV representation (kv.py), so they agree exactly in
bfloat16 too: the shipped models on a mixed workload (codebook questions, their few-shot affix in
every placement, all in one engine), every policy, through `python -m eval.engine_agreement`
(the command of the larger measurement in docs/DECODING.md) in its own process, both models in one run."""

import json
import subprocess
import sys
from pathlib import Path

import acache_jax

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(acache_jax.__file__).resolve().parent / "models"
POLICIES = ["direct", "acache", "dual"]
NAMES = ["llada-small", "dream-small"]


def test_engine_equals_static_in_bf16(tmp_path):
    out = tmp_path / "rows.json"
    models = ",".join(str(MODELS / name) for name in NAMES)
    run = subprocess.run([sys.executable, "-m", "eval.engine_agreement", "--models", models, "-n", "6",
                          "--tasks", "codebook", "--policies", ",".join(POLICIES), "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["model"], r["policy"]) for r in rows] == [(m, p) for m in NAMES for p in POLICIES]
    assert all(r["dtype"] == "bfloat16" for r in rows)
    for row in rows:
        assert row["tokens_equal"] == 1.0, row
