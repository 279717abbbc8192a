"""eval.affix_sweep on a tiny untrained model: the grid, its invariants, the table and the figures."""

import json
from types import SimpleNamespace

import pytest

from flax import nnx

from acache_jax.network.config import DecodeConfig
from acache_jax.network.hf_checkpoint import export_hf
from acache_jax.network.model import Transformer
from eval import affix_sweep
from eval.accuracy import Score
from eval.affix_sweep import main
from eval.tokenizer import build_tokenizer, save_tokenizer, special_ids
from eval.train import model_config


def test_sweep_smoke(tmp_path):
    tokenizer = build_tokenizer()
    cfg = model_config("llada", tokenizer.get_vocab_size(), special_ids(tokenizer), tiny=True)
    model_dir = tmp_path / "tiny"
    save_tokenizer(tokenizer, model_dir)
    export_hf(model_dir, cfg, nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1], dtype="float32",
              generation=DecodeConfig(gen_length=32, block_length=32))
    out = tmp_path / "sweep"
    grid = ["--ratios", "0,1", "--selector", "hkvd_block", "--masses", "0.5"]
    assert main(["--models", str(model_dir), "--tasks", "codebook", "--placements", "suffix", "--shots", "1",
                 *grid, "-n", "4", "--out", str(out)]) == 0
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    policies = {r["policy"] for r in rows if r["placement"] != "none"}
    assert policies == {"full", "acache@0", "acache@1", "acache@mass0.5", "dropna@0.2", "attention@0.2", "hkvd@0.2"}
    acc = {(r["placement"], r["policy"]): r["accuracy"] for r in rows}
    assert acc[("suffix", "acache@1")] == acc[("suffix", "full")]  # every anchor recomputed: full recompute
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows) and ("none", "full") in acc
    fraction = {r["policy"]: r.get("anchor_fraction") for r in rows if r["placement"] == "suffix"}
    assert fraction["acache@0"] == 0.0 and fraction["acache@1"] == 1.0 and fraction["full"] is None
    assert 0.05 <= fraction["acache@mass0.5"] <= 0.4 + 1 / 16  # within its bounds (the cap rounds up)
    table = (out / "RESULTS_table.md").read_text()
    assert table.count("| tiny | codebook |") == 1 and "ACache 0.2 (hkvd_block)" in table and "mass 0.5" in table
    for name in ("fig4_ratio.png", "fig5_selectors.png", "fig7_dropna.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"

    # --resume measures only the missing rows: a dropped row comes back, a kept one is not measured again
    stored = json.loads((out / "sweep.json").read_text())
    dropped, kept = stored["rows"].pop(), stored["rows"][0]
    kept["accuracy"] = 0.123
    (out / "sweep.json").write_text(json.dumps(stored))
    assert main(["--models", str(model_dir), "--tasks", "codebook", "--placements", "suffix", "--shots", "1",
                 *grid, "-n", "4", "--out", str(out), "--resume", "--no-plots"]) == 0
    resumed = json.loads((out / "sweep.json").read_text())["rows"]
    assert len(resumed) == len(rows) and resumed[0]["accuracy"] == 0.123 and resumed[-1] == dropped


def test_merge_combines_shards_and_checks_settings(tmp_path):
    def shard(name, rows, n=4):
        (tmp_path / name).mkdir()
        (tmp_path / name / "sweep.json").write_text(json.dumps(dict(ratios=[0.0, 1.0], n=n, seed=0, rows=rows)))

    def row(placement, policy, acc):
        shots = 0 if placement == "none" else 1
        return dict(model="m", task="codebook", placement=placement, shots=shots, policy=policy, accuracy=acc)

    shard("a", [row("none", "full", 0.1), row("prefix", "full", 0.9), row("prefix", "acache@0", 0.5)])
    shard("b", [row("none", "full", 0.1), row("suffix", "full", 0.8), row("suffix", "acache@0", 0.2)])
    out = tmp_path / "merged"
    assert main(["--merge", f"{tmp_path / 'a'},{tmp_path / 'b'}", "--ratios", "0,1", "-n", "4", "--out", str(out),
                 "--no-plots"]) == 0
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert len(rows) == 5  # the no-affix row of both shards once
    table = (out / "RESULTS_table.md").read_text()
    assert "| m | codebook | prefix | 1 | 0.10 | 0.50 |" in table
    assert "| m | codebook | suffix | 1 | 0.10 | 0.20 |" in table
    shard("c", [], n=8)
    with pytest.raises(SystemExit, match="n 8 \\(here 4\\); merging needs the same settings"):
        main(["--merge", str(tmp_path / "c"), "--ratios", "0,1", "-n", "4", "--out", str(tmp_path / "other")])
    with pytest.raises(SystemExit, match="selector attention \\(here hkvd\\)"):  # another selector's rows
        main(["--merge", str(tmp_path / "a"), "--ratios", "0,1", "-n", "4", "--selector", "hkvd",
              "--out", str(tmp_path / "other")])
    with pytest.raises(SystemExit):  # an existing sweep is not overwritten without --resume
        main(["--merge", f"{tmp_path / 'a'}", "--ratios", "0,1", "-n", "4", "--out", str(out)])
    assert len(json.loads((out / "sweep.json").read_text())["rows"]) == 5


def test_worlds_average_each_setting_over_consecutive_seeds(monkeypatch, tmp_path):
    calls = []

    def fake_score(model, task, placement, shots, n, seed, config):
        calls.append(seed)
        return Score(seed / 10, seed / 100 if config.selective else None)

    monkeypatch.setattr(affix_sweep, "score", fake_score)
    monkeypatch.setattr(affix_sweep, "load", lambda path: SimpleNamespace(decode_config=DecodeConfig().replace))
    rows = list(affix_sweep.sweep([tmp_path / "m"], ["codebook"], ["prefix"], [1], affix_sweep.Grid((0.0,)), n=4,
                                  seed=3, worlds=2))
    # no affix; full, acache@0, dropna and the other selectors (the library's own is acache@r's)
    assert [r["policy"] for r in rows] == ["full", "full", "acache@0", "dropna@0.2"] + [
        f"{s}@0.2" for s in affix_sweep.NAMED_SELECTORS if s != DecodeConfig.selector]
    assert all(r["accuracy"] == pytest.approx(0.35) for r in rows)  # mean of seeds 3 and 4
    assert [r.get("anchor_fraction") for r in rows[:3]] == [None, None, pytest.approx(0.035)]
    assert calls == [3, 4] * 6
