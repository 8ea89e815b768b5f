"""PNG plots of a run: loss curves and, per MoE layer, the tokens-per-expert heatmap over steps.

matplotlib is optional (`pip install matplotlib`); without it the run still finishes and says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..runs.sinks import read_jsonl


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: plots skipped (pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def plot_losses(run_dir: Path, plt) -> Path | None:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train), label="train loss (incl. MoE losses)")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("nats per token")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    path = run_dir / "loss.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_expert_load(run_dir: Path, plt) -> Path | None:
    """One heatmap per MoE layer: share of routed pairs per expert (x 1/mean), over log steps."""
    rows = read_jsonl(run_dir / "routing.jsonl")
    if not rows or not rows[0].get("layers"):
        return None
    n_layers = len(rows[0]["layers"])
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(n_layers, 1, figsize=(8, 1.8 * n_layers + 1), squeeze=False)
    for i in range(n_layers):
        load = []
        for r in rows:
            c = r["layers"][i]["counts"]
            mean = sum(c) / max(len(c), 1)
            load.append([v / mean if mean else 0.0 for v in c])
        ax = axes[i][0]
        im = ax.imshow(list(zip(*load)), aspect="auto", cmap="viridis", interpolation="nearest",
                       extent=(steps[0], steps[-1], len(load[0]) - 0.5, -0.5))
        ax.set_ylabel(f"layer {i}\nexpert")
        fig.colorbar(im, ax=ax, label="load / mean")
    axes[-1][0].set_xlabel("step")
    fig.suptitle("tokens per expert (1.0 = balanced)")
    path = run_dir / "expert_load.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_run_plots(run_dir: str | Path) -> list[Path]:
    plt = _pyplot()
    if plt is None:
        return []
    run_dir = Path(run_dir)
    return [p for p in (plot_losses(run_dir, plt), plot_expert_load(run_dir, plt)) if p is not None]
