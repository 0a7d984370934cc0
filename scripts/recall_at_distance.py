#!/usr/bin/env python
"""Recall at a distance (the passkey with decoys, MQAR): train small models to competence at context T, read them at
up to 16 x T (``hf_resolvent.training.recall`` describes the task and the rule; docs/benchmarks/long-context.md the
results).

    python scripts/recall_at_distance.py --out runs/recall                      # 5 mixers x RoPE / none, 3 seeds
    python scripts/recall_at_distance.py --conv-size 4 --out runs/recall_conv4  # with the short convolution
    python scripts/recall_at_distance.py --mixers attention exp2:ce --positions none --pairs 8 --out runs/r8
    python scripts/recall_at_distance.py --task mqar --context 128 --pairs 8 --out runs/mqar8
    python scripts/recall_at_distance.py --quick --out runs/recall_quick        # the plumbing, a minute
    python scripts/recall_at_distance.py --out runs/recall --resume             # continue a run that was cut short
    python scripts/recall_at_distance.py --compare runs/r8 runs/r8_6layers --out runs/how_far   # runs side by side

OUT gets results.json (settings, chance levels, one row per model and seed: its training record, accuracy by length
and decode cache), results.md and recall.png; with --compare, how_far.md and how_far.png of the runs named.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from hf_resolvent.training import cli
from hf_resolvent.training.recall import POSITIONS, TASKS, RecallSettings, how_far, how_far_plot, markdown, plot, run
from hf_resolvent.training.synthetic import Vocab, passkey_batch

MIXERS = ["attention", "dense", "exp2:ce", "square:ce", "exp2:ce+tied"]
QUICK = dict(context=32, pairs=2, d=32, max_steps=60, check_every=20, check_samples=50, eval_samples=50, grow=2.0,
             grow_at=0.0, multiples=(1, 2))


def build_parser() -> argparse.ArgumentParser:
    d = RecallSettings()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results.json, results.md and recall.png")
    p.add_argument("--mixers", nargs="+", default=MIXERS,
                   help="mixer specs, and gpt2 (learned positions); a comma-separated list is one spec per layer, "
                        "e.g. exp2:ce,square:ce,exp2:ce")
    p.add_argument("--positions", nargs="+", choices=POSITIONS,
                   help="position encodings to compare (default: rope and none); rope:a and rope:b rotate one channel "
                        "only (rope_channels); with --compare, only the models with these")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--task", default=d.task, choices=sorted(TASKS),
                   help="decoy: the passkey with decoys (one pair asked); mqar: every pair asked, all far back")
    p.add_argument("--pairs", type=int, default=d.pairs)
    p.add_argument("--context", type=int, default=d.context, help="training length T")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--d", type=int, default=d.d, help="model width")
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--conv-size", type=int, default=d.conv_size,
                   help="the resolvent models' short causal convolution (conv_size; 0: none)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="training stops here if not competent before")
    p.add_argument("--grow", type=float, default=d.grow,
                   help="the training length's factor at each check passed (a large one: T after the first check)")
    p.add_argument("--grow-at", type=float, default=d.grow_at,
                   help="accuracy at the current training length that lets it grow by --grow")
    p.add_argument("--patience", type=int, default=d.patience,
                   help="checks at one training length after which it grows below --grow-at too (0: never)")
    p.add_argument("--target", type=float, default=d.target, help="accuracy at T that ends training")
    p.add_argument("--eval-samples", type=int, default=d.eval_samples, help="samples per length")
    p.add_argument("--multiples", nargs="+", type=int, default=list(d.multiples), help="lengths as multiples of T")
    p.add_argument("--device", default="cpu")
    p.add_argument("--resume", action="store_true",
                   help="continue the run whose results.json is in --out: train only the models it lacks")
    p.add_argument("--quick", action="store_true", help="tiny settings: checks the plumbing (results mean nothing)")
    p.add_argument("--compare", nargs="+", metavar="RUN",
                   help="train nothing: put the runs in these folders (one task, pairs and T) side by side, every seed "
                        "at every length with its cache, in OUT/how_far.md and OUT/how_far.png")
    return p


def compare(parser: argparse.ArgumentParser, folders: list[str], positions: list[str] | None, out: Path) -> int:
    results = []
    for folder in folders:
        path = Path(folder) / "results.json"
        if not path.is_file():
            parser.error(f"--compare {folder}: no results.json there (a folder a run of this script wrote)")
        result = json.loads(path.read_text())
        result["rows"] = [r for r in result["rows"] if positions is None or r["positions"] in positions]
        if not result["rows"]:
            parser.error(f"--compare {folder}: no model with --positions {' '.join(positions)}")
        results.append(result)
    try:
        table = how_far(results)
    except ValueError as err:
        parser.error(str(err))
    out.mkdir(parents=True, exist_ok=True)
    (out / "how_far.md").write_text(table)
    how_far_plot(results, out / "how_far.png")
    print(table)
    print(f"[recall] wrote {out / 'how_far.md'} and {out / 'how_far.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check(parser, device=args.device, folders=[("--out", args.out)])
    if args.compare:
        return compare(parser, args.compare, args.positions, Path(args.out))
    try:
        settings = RecallSettings(task=args.task, context=args.context, pairs=args.pairs, d=args.d, layers=args.layers,
                                  heads=args.heads, conv_size=args.conv_size, lr=args.lr, batch=args.batch,
                                  max_steps=args.max_steps, grow=args.grow, grow_at=args.grow_at,
                                  patience=args.patience, target=args.target, eval_samples=args.eval_samples,
                                  multiples=tuple(args.multiples))
    except ValueError as err:
        parser.error(str(err))
    if args.quick:
        settings = replace(settings, **QUICK)
    try:  # the shortest samples hold the pairs: checked now, not after a model has trained
        passkey_batch(Vocab(*settings.vocab), settings.context, settings.pairs, 1, np.random.default_rng(0), far=True,
                      queries=settings.read_queries)
    except ValueError as err:
        parser.error(f"--context {settings.context} / --pairs {settings.pairs}: {err}")
    out = Path(args.out)
    try:
        mixers = [m.split(",") if "," in m else m for m in args.mixers]  # a hybrid stack: one spec per layer
        result = run(mixers, args.seeds, args.positions or ["rope", "none"], settings, out, torch.device(args.device),
                     resume=args.resume)
    except (FileExistsError, ValueError) as err:
        parser.error(str(err))
    (out / "results.md").write_text(markdown(result))
    plot(result, out / "recall.png")
    print(markdown(result))
    print(f"[recall] wrote {out / 'results.json'}, {out / 'results.md'} and {out / 'recall.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
