"""A run's metrics (JSON lines, cut back when a run resumes), the loss plot, and the JSON-plus-figure results of
the benchmark and comparison scripts."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..files import atomic_write_json


def read_metrics(path: str | os.PathLike) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill
                continue
    return rows


def truncate_metrics(path: str | os.PathLike, step: int) -> None:
    """Drop rows logged after ``step`` (a resumed run logs those steps again)."""
    path = Path(path)
    if not path.exists():
        return
    rows = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def write_result(out: str | os.PathLike, result: dict, plot) -> Path:
    """Write a script's ``result`` as JSON at ``out`` and its figure, ``plot(result, png)``, beside it (same stem,
    ``.png``); returns the PNG's path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result)
    png = out.with_suffix(".png")
    plot(result, png)
    return png


def log_axes(ax, xlabel: str, ylabel: str) -> None:
    """The benchmark figures' axes: log-2 x, log y, labels and a light grid."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def plot_loss(metrics_path: str | os.PathLike, png_path: str | os.PathLike, title: str = "") -> None:
    """Training loss (and validation loss points) against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", ms=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
