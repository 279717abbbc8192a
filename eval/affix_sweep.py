"""Accuracy sweep over anchor ratios, affix placements and shots (analogues of the paper's figures 4, 5, 7).

    python -m eval.affix_sweep --models DIR[,DIR] [--tasks babi,arithmetic,codebook] [-n 128] --out DIR
    python -m eval.affix_sweep --merge OUT1,OUT2,... --out DIR   # shards run in parallel processes
    python -m eval.affix_sweep --models ... --out DIR --resume     # measure only what DIR lacks
    python -m eval.affix_sweep --models ... --tasks codebook --worlds 8 -n 32 --out DIR

Per model, task, placement and shots, every policy decodes the same held-out questions with the
same shared few-shot affix (full recompute = the dual cache, which recomputes the affix in place):
- ACache at each `--ratios` value with the attention selector and KeepNA (ratio 0 = direct reuse);
- at `--ablation-ratio`: DropNA (non-anchor affix K/V dropped) and the hkvd and hkvd_block selectors;
- per task, the accuracy without any affix.
With --worlds W each accuracy is the mean over W worlds (seeds seed..seed+W-1, each with its own
affix and n questions): a world's codebook has only four words, so it asks only four questions.
Writes OUT/sweep.json, OUT/fig4_ratio.png (accuracy vs ratio per placement), OUT/fig5_selectors.png
(attention vs hkvd and hkvd_block), OUT/fig7_dropna.png (KeepNA vs DropNA) and OUT/RESULTS_table.md:
per placement, direct / ablation ratio / full recompute and the fraction of the gap the ablation
ratio recovers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from acache_jax.checkpoint import load
from acache_jax.files import write_atomic
from eval.accuracy import accuracy, full_recompute
from eval.tasks import STUDY_TASKS

PLACEMENTS = ("prefix", "infix", "suffix")


def _key(row: dict[str, Any]) -> tuple:
    """What identifies a measured setting."""
    return row["model"], row["task"], row["placement"], row["shots"], row["policy"]


def settings(ratios: list[float], ablation: float) -> dict[str, Any]:
    """Policy name -> DecodeConfig overrides of the full-recompute config."""
    out: dict[str, dict] = {"full": {}}
    out |= {f"acache@{r:g}": dict(cache="acache", anchor_ratio=r) for r in ratios}
    out[f"dropna@{ablation:g}"] = dict(cache="acache", anchor_ratio=ablation, drop_non_anchor=True)
    out |= {f"{s}@{ablation:g}": dict(cache="acache", anchor_ratio=ablation, selector=s)
            for s in ("hkvd", "hkvd_block")}
    return out


def sweep(model_dirs: list[Path], tasks: list[str], placements: list[str], shots: list[int], ratios: list[float],
          ablation: float, n: int, seed: int = 0, done: frozenset[tuple] = frozenset(),
          worlds: int = 1) -> Iterator[dict[str, Any]]:
    """One row per (model, task, placement, shots, policy) not in `done`, as each is measured."""
    for model_dir in model_dirs:
        model = load(model_dir)
        full = full_recompute(model)
        for task in tasks:
            grid = [("none", 0, "full", full)]
            grid += [(placement, k, policy, dataclasses.replace(full, **overrides))
                     for placement in placements for k in shots
                     for policy, overrides in settings(ratios, ablation).items()]
            for placement, k, policy, config in grid:
                row = dict(model=model_dir.name, task=task, placement=placement, shots=k, policy=policy)
                if _key(row) not in done:
                    acc = [accuracy(model, task, placement, k, n, seed + w, config) for w in range(worlds)]
                    yield row | dict(accuracy=sum(acc) / worlds)


def merge(paths: list[Path], ratios: list[float], n: int, seed: int, worlds: int = 1) -> list[dict[str, Any]]:
    """The rows of several shards' sweep.json (run with the same ratios, n, seed and worlds), each setting once."""
    rows: dict[tuple, dict[str, Any]] = {}
    for path in paths:
        shard = json.loads(path.read_text())
        if (shard["ratios"], shard["n"], shard["seed"], shard.get("worlds", 1)) != (ratios, n, seed, worlds):
            raise SystemExit(f"error: {path} was run with ratios {shard['ratios']}, n {shard['n']}, seed "
                             f"{shard['seed']}, worlds {shard.get('worlds', 1)}; merging needs the same --ratios, "
                             "-n, --seed and --worlds")
        for r in shard["rows"]:
            rows.setdefault(_key(r), r)
    return list(rows.values())


def summary_table(rows: list[dict[str, Any]], ablation: float) -> str:
    """Per (model, task, placement, shots): no affix, direct, ablation ratio, full, gap recovered, DropNA, hkvd,
    hkvd_block."""
    index = {_key(r): r["accuracy"] for r in rows}
    a = f"{ablation:g}"
    lines = [f"| model | task | placement | shots | no affix | direct | ACache {a} | full | gap recovered | "
             f"DropNA {a} | hkvd {a} | hkvd_block {a} |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (model, task, placement, shots, policy), _ in index.items():
        if policy != "full" or placement == "none":
            continue
        get = lambda p: index.get((model, task, placement, shots, p), float("nan"))
        direct, mid, full = get("acache@0"), get(f"acache@{a}"), get("full")
        gap = full - direct
        recovered = f"{(mid - direct) / gap:.0%}" if gap > 0 else "no gap"
        no_affix = index.get((model, task, "none", 0, "full"), float("nan"))
        lines.append(f"| {model} | {task} | {placement} | {shots} | {no_affix:.2f} | "
                     f"{direct:.2f} | {mid:.2f} | {full:.2f} | {recovered} | {get(f'dropna@{a}'):.2f} | "
                     f"{get(f'hkvd@{a}'):.2f} | {get(f'hkvd_block@{a}'):.2f} |")
    return "\n".join(lines)


def plots(rows: list[dict[str, Any]], ratios: list[float], ablation: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    index = {_key(r): r["accuracy"] for r in rows}
    groups = sorted({(r["model"], r["task"]) for r in rows})
    shots = sorted({r["shots"] for r in rows if r["shots"]})
    a = f"{ablation:g}"

    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.4), squeeze=False)
    for ax, (model, task) in zip(axes[0], groups):
        for placement in PLACEMENTS:
            for k in shots:
                ys = [index.get((model, task, placement, k, f"acache@{r:g}")) for r in ratios]
                if all(y is not None for y in ys):
                    ax.plot(ratios, ys, marker="o", label=f"{placement} {k}-shot")
                    ax.axhline(index.get((model, task, placement, k, "full"), float("nan")), lw=0.5, ls=":")
        ax.set(title=f"{model} / {task}", xlabel="anchor ratio", ylabel="accuracy", ylim=(-0.02, 1.02))
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    write_atomic(out / "fig4_ratio.png", lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)

    for name, others in (("fig5_selectors.png", {f"hkvd@{a}": "hkvd", f"hkvd_block@{a}": "hkvd_block"}),
                         ("fig7_dropna.png", {f"dropna@{a}": "DropNA"})):
        fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.4), squeeze=False)
        for ax, (model, task) in zip(axes[0], groups):
            keys = [(p, k) for p in PLACEMENTS for k in shots]
            xs = range(len(keys))
            bars = {f"acache@{a}": "attention, KeepNA", **others}
            width = 0.8 / len(bars)
            for i, (policy, label) in enumerate(bars.items()):
                ys = [index.get((model, task, p, k, policy), float("nan")) for p, k in keys]
                ax.bar([x + (i - (len(bars) - 1) / 2) * width for x in xs], ys, width, label=f"{label} @{a}")
            ax.set_xticks(list(xs), [f"{p[:3]} {k}" for p, k in keys], fontsize=7)
            ax.set(title=f"{model} / {task}", ylabel="accuracy", ylim=(0, 1.02))
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        write_atomic(out / name, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
        plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.affix_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--models", help="comma-separated model directories")
    p.add_argument("--merge", help="comma-separated output directories of earlier runs (shards): combine their "
                   "rows instead of decoding")
    p.add_argument("--tasks", default=",".join(STUDY_TASKS))
    p.add_argument("--placements", default=",".join(PLACEMENTS))
    p.add_argument("--shots", default="1,2")
    p.add_argument("--ratios", default="0,0.1,0.2,0.3,0.5,1")
    p.add_argument("--ablation-ratio", type=float, default=0.2)
    p.add_argument("-n", type=int, default=128, help="questions per setting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worlds", type=int, default=1, help="average each accuracy over this many worlds (seeds)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--resume", action="store_true", help="keep the rows of OUT/sweep.json (same --ratios, -n, "
                   "--seed, --worlds) and measure only the rest")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",")]
    if 0.0 not in ratios:
        p.error("--ratios must include 0 (direct reuse): the summary measures the gap from it")
    if (args.models is None) == (args.merge is None):
        p.error("give either --models or --merge")
    if (args.out / "sweep.json").is_file() and not args.resume:
        p.error(f"{args.out / 'sweep.json'} exists: pass --resume to keep its rows (and measure or merge only "
                "the rest), or choose another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    write = lambda rows: write_atomic(args.out / "sweep.json", json.dumps(
        dict(ratios=ratios, n=args.n, seed=args.seed, worlds=args.worlds, rows=rows), indent=1))
    own = [args.out / "sweep.json"] if args.resume and (args.out / "sweep.json").is_file() else []
    if args.merge:
        rows = merge(own + [Path(d) / "sweep.json" for d in args.merge.split(",")], ratios, args.n, args.seed,
                     args.worlds)
    else:  # written after every row, so a run that is stopped keeps what it measured
        rows = merge(own, ratios, args.n, args.seed, args.worlds)
        for row in sweep([Path(m) for m in args.models.split(",")], args.tasks.split(","),
                         args.placements.split(","), [int(k) for k in args.shots.split(",")], ratios,
                         args.ablation_ratio, args.n, args.seed, frozenset(map(_key, rows)), args.worlds):
            rows.append(row)
            print(json.dumps(row), flush=True)
            write(rows)
    write(rows)
    write_atomic(args.out / "RESULTS_table.md", summary_table(rows, args.ablation_ratio) + "\n")
    if not args.no_plots:
        plots(rows, ratios, args.ablation_ratio, args.out)
    print(summary_table(rows, args.ablation_ratio))
    return 0


if __name__ == "__main__":
    sys.exit(main())
