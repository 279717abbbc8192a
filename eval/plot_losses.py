"""The loss curve of a training run as a PNG: python -m eval.plot_losses DIR/losses.json [OUT.png]

Separate from training so that a run on a machine without matplotlib can be plotted elsewhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from acache_jax.network.files import write_atomic


def plot_losses(losses_json: str | Path, png: str | Path, smooth: int = 50) -> None:
    """The loss curve (per step, and a moving average) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = np.asarray(json.loads(Path(losses_json).read_text())["loss"])
    steps = np.arange(1, len(loss) + 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, loss, alpha=0.3, lw=0.8, label="loss")
    if len(loss) >= smooth:
        ax.plot(steps[smooth - 1:], np.convolve(loss, np.ones(smooth) / smooth, "valid"), label=f"mean of {smooth}")
    ax.set(xlabel="step", ylabel="masked-diffusion loss", yscale="log", title=Path(losses_json).parent.name)
    ax.legend()
    fig.tight_layout()
    write_atomic(png, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


if __name__ == "__main__":
    source = Path(sys.argv[1])
    plot_losses(source, sys.argv[2] if len(sys.argv) > 2 else source.with_name("loss.png"))
