"""Loss curves of several pretraining runs side by side (train loss lines, validation loss points).

    python scripts/plot_runs.py runs/compare.png runs/exp2_ce=exp2:ce runs/gpt2=GPT-2

Each run is a pretrain output folder or its ``metrics.jsonl``, optionally followed by ``=label`` (default: the
folder's name). The legend gives each run's tokens/s (the last logged window) and its last validation perplexity.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_resolvent.training.metrics import read_metrics


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="PNG to write")
    p.add_argument("runs", nargs="+", help="run folder or metrics.jsonl, optionally =label")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for spec in args.runs:
        where, _, label = spec.partition("=")
        path = Path(where)
        metrics = path / "metrics.jsonl" if path.is_dir() else path
        rows = read_metrics(metrics)
        if not rows:
            raise SystemExit(f"plot_runs: no metrics in {metrics}")
        label = label or (path.name if path.is_dir() else path.parent.name)
        train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        val = [(r["step"], r["val_loss"], r["val_ppl"]) for r in rows if "val_loss" in r]
        speed = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
        if speed:
            label += f", {speed[-1]:,.0f} tokens/s"
        if val:
            label += f", val ppl {val[-1][2]:.1f}"
        (line,) = ax.plot(*zip(*train), lw=1.2, label=label)
        if val:
            ax.plot([v[0] for v in val], [v[1] for v in val], "o", color=line.get_color(), ms=4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token); points: validation")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
