#!/usr/bin/env python
"""Evaluate trained models: validation perplexity (strided windows), sample generations, and the papers' figure.

    python scripts/evaluate.py runs/tiny                       # one model
    python scripts/evaluate.py runs/44m-* --out runs/eval-44m   # the comparison: table + figure

For every model folder (a ``save_pretrained`` folder written by scripts/pretrain.py) this computes the perplexity
of the validation split the model was trained with (or ``--data``) with strided windows: windows of
``--max-length`` tokens every ``--stride`` tokens, each token scored once with at least
``max_length - stride`` tokens of context (the method of the ``transformers`` perplexity guide). It prints
sample generations and writes ``eval_results.json`` into the folder. In ``--out`` (default: ``eval/`` next to
the first model folder, e.g. ``runs/eval``) it writes the comparison: ``eval.json``, ``eval.md`` and
``perplexity_vs_complexity.png`` (perplexity against the per-token time and decode-cache class of each mixer,
one point per model, as in the papers).

References: ``--references`` (default: the repository's ``bench/sweep/sweep.json``, written by
experiments/sweep.py) holds GPT-2 and attention trained at one budget. Where an evaluated model was trained at that
same budget (shape, context, steps, batch, learning-rate schedule, corpus and tokenizer: ``training_budget``),
their strided perplexities join the table and the figure as references, so that a single run (the README's
first command trains the sweep's ``dense`` run) is seen beside them; otherwise the output says why not.

``hf_resolvent.training.evaluate`` does the work.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

import torch

from hf_resolvent.training import cli
from hf_resolvent.training import data as hdata
from hf_resolvent.training.config import RunError
from hf_resolvent.training.evaluate import EvalSettings, evaluate

REPO = Path(__file__).resolve().parents[1]
DEFAULT_REFERENCES = REPO / "bench" / "sweep" / "sweep.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="model folders (save_pretrained output of scripts/pretrain.py)")
    p.add_argument("--data", default=None, help="prepared data folder (default: the one each model trained on)")
    p.add_argument("--split", default="val", choices=["val", "train"])
    p.add_argument("--max-length", type=int, default=None, help="window length (default: the training context)")
    p.add_argument("--stride", type=int, default=None, help="window step (default: max_length // 2)")
    p.add_argument("--max-tokens", type=int, default=200_000, help="score at most this many tokens (0: all)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--samples", type=int, default=3, help="sample generations per model (0: none)")
    p.add_argument("--prompt", action="append", default=None, help="generation prompt (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="folder for the comparison table and figure (default: eval/ next to the first model)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("--references", default=str(DEFAULT_REFERENCES),
                   help="a experiments/sweep.py sweep.json whose GPT-2 and attention rows are drawn beside models "
                        "trained at its budget ('none': no references)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check(parser, device=args.device, folders=[("--out", args.out)])
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    settings = EvalSettings(**{f.name: getattr(args, f.name) for f in fields(EvalSettings)})
    out = Path(args.out) if args.out else Path(args.models[0]).resolve().parent / "eval"
    try:
        _, table = evaluate([Path(m) for m in args.models], out, settings, device, args.references)
    except (hdata.DataError, RunError, ValueError, OSError) as err:  # OSError: a damaged model folder, a refused write
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table)
    print(f"[evaluate] wrote {out / 'eval.json'}, {out / 'eval.md'} and {out / 'perplexity_vs_complexity.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
