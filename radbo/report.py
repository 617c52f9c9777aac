"""Plots of run results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_accuracy(rounds: Sequence[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Test accuracy vs round as a PNG (written atomically). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(r["round"] + 1, r["test_accuracy"]) for r in rounds if "test_accuracy" in r]
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=120)
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", markersize=3)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        Path(tmp).unlink(missing_ok=True)
    return path
