"""Accuracy sweep over anchor ratios, affix placements and shots (analogues of the paper's figures 4, 5, 7).

    python -m eval.affix_sweep --models DIR[,DIR] [--tasks babi,arithmetic,codebook] [-n 128] --out DIR
    python -m eval.affix_sweep --merge OUT1,OUT2,... --out DIR   # shards run in parallel processes
    python -m eval.affix_sweep --models ... --out DIR --resume     # measure only what DIR lacks
    python -m eval.affix_sweep --models ... --tasks codebook --worlds 8 -n 32 --out DIR

Per model, task, placement and shots, every policy decodes the same held-out questions with the
same shared few-shot affix (full recompute = the dual cache, which recomputes the affix in place):
- `acache@r`: ACache at each `--ratios` value with `--selector` (default: the library's) and KeepNA
  (ratio 0 = direct reuse);
- `acache@mass{m}`: the adaptive budget at each `--masses` value (same selector, ratio bounds
  `--mass-bounds`), its anchor fraction measured;
- at `--ablation-ratio`: `dropna@r` (the same anchors, non-anchor affix K/V dropped) and `{s}@r`
  for each other selector s of attention, hkvd and hkvd_block;
- per task, the accuracy without any affix.
Selective rows carry `anchor_fraction`, the mean share of the affix recomputed.
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

from acache_jax import compile_cache
from acache_jax.network.checkpoint import load
from acache_jax.network.config import DecodeConfig
from acache_jax.network.files import write_atomic
from eval.accuracy import full_recompute, score
from eval.tasks import STUDY_TASKS

PLACEMENTS = ("prefix", "infix", "suffix")
NAMED_SELECTORS = ("attention", "hkvd", "hkvd_block")  # the ones with an ablation row of their own


def _key(row: dict[str, Any]) -> tuple:
    """What identifies a measured setting."""
    return row["model"], row["task"], row["placement"], row["shots"], row["policy"]


@dataclasses.dataclass(frozen=True)
class Grid:
    """What a sweep measures besides the questions: shards and resumed runs must agree on it."""

    ratios: tuple[float, ...]
    ablation: float = 0.2
    selector: str = DecodeConfig.selector
    masses: tuple[float, ...] = ()
    mass_bounds: tuple[float, float] = (0.05, 0.4)

    def __post_init__(self):
        if len(self.mass_bounds) != 2:
            raise ValueError(f"the adaptive rows' bounds are two ratios (min, max), got {self.mass_bounds}")

    def settings(self) -> dict[str, dict[str, Any]]:
        """Policy name -> DecodeConfig overrides of the full-recompute config."""
        a, acache = f"{self.ablation:g}", dict(cache="acache", selector=self.selector)
        out: dict[str, dict] = {"full": {}}
        out |= {f"acache@{r:g}": acache | dict(anchor_ratio=r) for r in self.ratios}
        low, high = self.mass_bounds
        out |= {f"acache@mass{m:g}": acache | dict(anchor_ratio=high, anchor_mass=m, anchor_min_ratio=low)
                for m in self.masses}
        out[f"dropna@{a}"] = acache | dict(anchor_ratio=self.ablation, drop_non_anchor=True)
        out |= {f"{s}@{a}": dict(cache="acache", anchor_ratio=self.ablation, selector=s)
                for s in NAMED_SELECTORS if s != self.selector}
        return out

    def header(self) -> dict[str, Any]:
        return dict(ratios=list(self.ratios), ablation=self.ablation, selector=self.selector, masses=list(self.masses),
                    mass_bounds=list(self.mass_bounds))


def sweep(model_dirs: list[Path], tasks: list[str], placements: list[str], shots: list[int], grid: Grid, n: int,
          seed: int = 0, done: frozenset[tuple] = frozenset(), worlds: int = 1) -> Iterator[dict[str, Any]]:
    """One row per (model, task, placement, shots, policy) not in `done`, as each is measured."""
    for model_dir in model_dirs:
        model = load(model_dir)
        full = full_recompute(model)
        for task in tasks:
            runs = [("none", 0, "full", full)]
            runs += [(placement, k, policy, dataclasses.replace(full, **overrides))
                     for placement in placements for k in shots for policy, overrides in grid.settings().items()]
            for placement, k, policy, config in runs:
                row = dict(model=model_dir.name, task=task, placement=placement, shots=k, policy=policy)
                if _key(row) not in done:
                    scores = [score(model, task, placement, k, n, seed + w, config) for w in range(worlds)]
                    row["accuracy"] = sum(s.accuracy for s in scores) / worlds
                    if scores[0].anchor_fraction is not None:
                        row["anchor_fraction"] = sum(s.anchor_fraction for s in scores) / worlds
                    yield row


def merge(paths: list[Path], grid: Grid, n: int, seed: int, worlds: int = 1) -> list[dict[str, Any]]:
    """The rows of several shards' sweep.json (run with the same grid, n, seed and worlds), each setting once."""
    rows: dict[tuple, dict[str, Any]] = {}
    want = grid.header() | dict(n=n, seed=seed, worlds=worlds)
    for path in paths:
        shard = json.loads(path.read_text())
        got = Grid(tuple(shard["ratios"])).header() | dict(worlds=1) | {k: shard[k] for k in want if k in shard}
        if got != want:
            differ = ", ".join(f"{k} {got[k]} (here {want[k]})" for k in want if got[k] != want[k])
            raise SystemExit(f"error: {path} was run with {differ}; merging needs the same settings")
        for r in shard["rows"]:
            rows.setdefault(_key(r), r)
    return list(rows.values())


def summary_table(rows: list[dict[str, Any]], grid: Grid) -> str:
    """Per (model, task, placement, shots): no affix, direct, the ablation ratio, full recompute, the
    gap it recovers, DropNA, the other selectors, and each adaptive budget (with its anchor fraction)."""
    index = {_key(r): r for r in rows}
    a = f"{grid.ablation:g}"
    others = [s for s in NAMED_SELECTORS if s != grid.selector]
    masses = [f"{m:g}" for m in grid.masses]
    columns = (["no affix", "direct", f"ACache {a} ({grid.selector})", "full", "gap recovered", f"DropNA {a}"]
               + [f"{s} {a}" for s in others] + [f"mass {m} (anchors)" for m in masses])
    lines = ["| model | task | placement | shots | " + " | ".join(columns) + " |", "|---" * (4 + len(columns)) + "|"]
    for model, task, placement, shots, policy in index:
        if policy != "full" or placement == "none":
            continue
        get = lambda p: index.get((model, task, placement, shots, p), {}).get("accuracy", float("nan"))
        direct, mid, full = get("acache@0"), get(f"acache@{a}"), get("full")
        gap = full - direct
        cells = [index.get((model, task, "none", 0, "full"), {}).get("accuracy", float("nan")), direct, mid, full]
        cells = [f"{c:.2f}" for c in cells] + [f"{(mid - direct) / gap:.0%}" if gap > 0 else "no gap"]
        cells += [f"{get(p):.2f}" for p in [f"dropna@{a}"] + [f"{s}@{a}" for s in others]]
        for m in masses:
            row = index.get((model, task, placement, shots, f"acache@mass{m}"), {})
            cells.append(f"{row['accuracy']:.2f} ({row['anchor_fraction']:.0%})" if row else "nan")
        lines.append(f"| {model} | {task} | {placement} | {shots} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plots(rows: list[dict[str, Any]], grid: Grid, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    index = {_key(r): r["accuracy"] for r in rows}
    groups = sorted({(r["model"], r["task"]) for r in rows})
    shots = sorted({r["shots"] for r in rows if r["shots"]})
    ratios, a = grid.ratios, f"{grid.ablation:g}"

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

    selectors = {f"{s}@{a}": s for s in NAMED_SELECTORS if s != grid.selector}
    for name, others in (("fig5_selectors.png", selectors), ("fig7_dropna.png", {f"dropna@{a}": "DropNA"})):
        fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.4), squeeze=False)
        for ax, (model, task) in zip(axes[0], groups):
            keys = [(p, k) for p in PLACEMENTS for k in shots]
            xs = range(len(keys))
            bars = {f"acache@{a}": f"{grid.selector}, KeepNA", **others}
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
    p.add_argument("--selector", choices=NAMED_SELECTORS, default=DecodeConfig.selector,
                   help="the selector of the acache@r, acache@mass and dropna rows")
    p.add_argument("--masses", default="", help="comma-separated anchor masses: adaptive-budget rows")
    p.add_argument("--mass-bounds", default="0.05,0.4", help="the adaptive rows' min and max anchor ratio")
    p.add_argument("-n", type=int, default=128, help="questions per setting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worlds", type=int, default=1, help="average each accuracy over this many worlds (seeds)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--resume", action="store_true", help="keep the rows of OUT/sweep.json (the same settings) "
                   "and measure only the rest")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    compile_cache.enable()  # compiled programs are kept for later runs (acache_jax/compile_cache.py)
    floats = lambda text: tuple(float(x) for x in text.split(",") if x)
    try:  # every setting checked before any work
        grid = Grid(floats(args.ratios), args.ablation_ratio, args.selector, floats(args.masses),
                    floats(args.mass_bounds))
        for overrides in grid.settings().values():
            DecodeConfig().replace(**overrides)
    except ValueError as e:
        p.error(str(e))
    if 0.0 not in grid.ratios:
        p.error("--ratios must include 0 (direct reuse): the summary measures the gap from it")
    if (args.models is None) == (args.merge is None):
        p.error("give either --models or --merge")
    if (args.out / "sweep.json").is_file() and not args.resume:
        p.error(f"{args.out / 'sweep.json'} exists: pass --resume to keep its rows (and measure or merge only "
                "the rest), or choose another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    write = lambda rows: write_atomic(args.out / "sweep.json", json.dumps(
        grid.header() | dict(n=args.n, seed=args.seed, worlds=args.worlds, rows=rows), indent=1))
    own = [args.out / "sweep.json"] if args.resume and (args.out / "sweep.json").is_file() else []
    if args.merge:
        rows = merge(own + [Path(d) / "sweep.json" for d in args.merge.split(",")], grid, args.n, args.seed,
                     args.worlds)
    else:  # written after every row, so a run that is stopped keeps what it measured
        rows = merge(own, grid, args.n, args.seed, args.worlds)
        for row in sweep([Path(m) for m in args.models.split(",")], args.tasks.split(","),
                         args.placements.split(","), [int(k) for k in args.shots.split(",")], grid, args.n,
                         args.seed, frozenset(map(_key, rows)), args.worlds):
            rows.append(row)
            print(json.dumps(row), flush=True)
            write(rows)
    write(rows)
    write_atomic(args.out / "RESULTS_table.md", summary_table(rows, grid) + "\n")
    if not args.no_plots:
        plots(rows, grid, args.out)
    print(summary_table(rows, grid))
    return 0


if __name__ == "__main__":
    sys.exit(main())
