#!/usr/bin/env python
"""Train GPT-2 and every mixer of the papers' comparison at one shape and token budget, evaluate them all, and
write the table and the perplexity-versus-cost figure ("which mixer should I use?").

    python scripts/sweep.py --preset hour --out bench/sweep                 # about an hour on 2 CPU cores
    python scripts/sweep.py --preset hour --seeds 0 1 2 --out bench/sweep   # + seeds 1, 2 of the headline mixers
    python scripts/sweep.py --quick --out runs/sweep-quick                  # CI: two mixers, a couple of minutes

Every model is a ``scripts/pretrain.py`` run (a subprocess, ``--resume``: a killed sweep started again continues
where it stopped, and finished runs are reused) on the offline corpus (``data/stdlib``, prepared on first use;
``--data`` for another prepared folder), at the preset's shape, with the same steps, batch and learning-rate
schedule. ``train.seed`` sets both the initialisation and the data order, so every model of one seed reads the
same batches in the same order. Then, for every run:

- validation perplexity over the non-overlapping windows of ``seq_len`` tokens of the validation split, with a
  95% bootstrap interval over the windows;
- the evaluation of ``scripts/evaluate.py`` on all runs together (strided perplexity, its table and its figure,
  in OUT/evaluate/);
- the cost at the context n = seq_len: positions read to produce token n, summed over the layers (exact, from
  the patterns), the per-token time and cache classes of the papers' Table 1, and the decode cache a real
  prefill of n tokens leaves (bytes, float32, batch 1).

OUT gets ``sweep.json`` (every number and the command), ``sweep.md`` (the table) and ``sweep.png`` (perplexity
against positions read per token and against cache bytes, every model a labelled point with its interval, GPT-2
and attention as reference lines, the Pareto front drawn). With ``--seeds A B ...`` the first seed trains every
model and the others the headline mixers (attention, dense, exp2:ce); ``seeds`` in the JSON and the table give
the per-seed perplexities and the paired differences against attention.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_resolvent.training import cli
from hf_resolvent.training.sweep import HEADLINE, MODELS, PRESETS, SweepError, sweep

PRETRAIN = Path(__file__).resolve().parent / "pretrain.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="hour", choices=sorted(PRESETS))
    p.add_argument("--quick", action="store_true", help="the quick preset (CI): two mixers, a couple of minutes")
    p.add_argument("--models", nargs="+", default=None, metavar="NAME",
                   help=f"train only these (default: the preset's); known: {', '.join(MODELS)}")
    p.add_argument("--seeds", nargs="+", type=int, default=[0],
                   help="train.seed values: the first for every model, the others for " + ", ".join(HEADLINE))
    p.add_argument("--steps", type=int, default=None, help="optimizer steps of every run (default: the preset's)")
    p.add_argument("--data", default=None, help="prepared data folder (default: the offline corpus, data/stdlib)")
    p.add_argument("--runs-dir", default=None, help="where the runs go (default: runs/sweep/PRESET)")
    p.add_argument("--out", default="runs/sweep", help="folder for sweep.json, sweep.md, sweep.png")
    p.add_argument("--eval-windows", type=int, default=None, help="most validation windows scored per model")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds one training run may take")
    p.add_argument("--device", default="cpu", help="device of the evaluation")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check(parser, device=args.device, folders=[("--out", args.out)])
    try:
        sweep(args, argv, PRETRAIN)
    except SweepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
