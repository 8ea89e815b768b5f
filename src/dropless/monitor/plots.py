"""Routing-health plots (matplotlib, an optional dependency: `pip install dropless[plots]`).

Every function takes the rows of routing.jsonl (dicts, see docs/monitoring.md) and writes one PNG,
returning its path. Missing values (null in the file) are drawn as gaps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """The one place matplotlib is imported (headless backend)."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("dropless diagnose draws plots with matplotlib: "
                          "pip install 'dropless[plots]' (or pip install matplotlib)") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _series(rows: list[dict], layer: int, key: str) -> list[float]:
    out = []
    for r in rows:
        v = r["layers"][layer].get(key) if layer < len(r["layers"]) else None
        out.append(float("nan") if v is None else float(v))
    return out


def load_heatmap(rows: list[dict], layer: int, path: Path) -> Path:
    """Expert load over log steps, as a multiple of the mean load (1 = fair share)."""
    plt = pyplot()
    steps = [r["step"] for r in rows]
    grid = []
    for r in rows:
        c = r["layers"][layer]["counts"]
        mean = sum(c) / len(c) if c and sum(c) else 1.0
        grid.append([v / mean for v in c])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    im = ax.imshow(list(map(list, zip(*grid))), aspect="auto", origin="lower", cmap="magma",
                   extent=(-0.5, len(steps) - 0.5, -0.5, len(grid[0]) - 0.5) if grid else None)
    ax.set_xlabel("log step index" if len(steps) > 12 else "step")
    if len(steps) <= 12:
        ax.set_xticks(range(len(steps)), [str(s) for s in steps])
    ax.set_ylabel("expert")
    ax.set_title(f"layer {layer}: load / mean load")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def curves(rows: list[dict], keys: list[str], path: Path, title: str, log_y: bool = False) -> Path:
    """One line per (layer, key) over steps."""
    plt = pyplot()
    steps = [r["step"] for r in rows]
    n_layers = max((len(r["layers"]) for r in rows), default=0)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i in range(n_layers):
        for key in keys:
            ax.plot(steps, _series(rows, i, key), marker=".", label=f"L{i} {key}")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_title(title)
    if n_layers * len(keys) <= 12:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
