#!/usr/bin/env python
"""Which mixer for long context? Train GPT-2 and the sweep's mixers at a short context T and measure them at up to
16 x T: validation loss by position, with and without zero-shot RoPE scaling, and recall at a distance.

    python scripts/long_context.py --quick --out runs/long_context/quick   # CI: gpt2 and exp2:ce, about a minute
    python scripts/long_context.py --preset hour --out runs/long_context/hour   # every model of the sweep, 3 seeds (bench/long_context holds a copy)
    python scripts/long_context.py --preset bytes --out runs/long_context/bytes  # byte-level models that read their context, with and without RoPE
    python scripts/long_context.py --preset bytes_conv --out runs/long_context/bytes_conv  # the same with the short convolution

Three questions, each trained at a short context and measured at longer ones (lengths: the preset's multiples of
the context the task was trained at):

- **loss** (language modelling): every model is a ``scripts/pretrain.py`` run on the offline corpus at context T,
  built as ``scripts/sweep.py`` builds its runs (same arguments, same run folders, ``--resume``: finished runs are
  reused). Each validation window of ``max multiple x T`` tokens (non-overlapping, from the start of the split;
  ``settings.loss.windows`` says how many) is scored in one forward pass, and the loss of every predicted token
  is averaged per position bucket: ``length`` kT holds the tokens at positions [k'T, kT), k' the multiple before
  k (positions [1, T) for k = 1: exactly the positions seen in training). Tasks ``loss`` (the trained model as it
  is) and ``loss:linear``, ``loss:dynamic``, ``loss:yarn``: the trained weights loaded into a config with that
  ``rope_parameters`` (factor F = the largest multiple, original context T), zero-shot, no training. Dynamic NTK
  changes the frequencies for the whole input once it is longer than T, so every bucket of a long window sees them.
  Task ``context_use`` (length T): 1 - (mean loss over positions [T/2, T)) / (mean loss over [1, T/16]), how much
  the model gains from its context where it was trained; a model short of ``CONTEXT_USE_GOAL`` (0.10) has not
  learned to read it, and its losses past T say little. A model named ``<mixer> [none]`` has no position encoding
  (``position_embedding="none"``), ``<mixer> [conv4]`` has RoPE and the short causal convolution of 4
  (``conv_size=4``), ``<mixer> [none+conv4]`` both; the ``bytes`` and ``bytes_conv`` presets prepare their own
  byte-level tokenisation of the offline corpus (one token per byte) in the runs folder.
- **token_carry** (carrying one token's identity over a distance; presets ``hour`` and ``quick``): ``BOS``, a few
  filler tokens (0 to ``prefix`` of them, so that the pair does not sit at a fixed position), a key and its value
  stated once, ``distance`` filler tokens, then the key: the model must answer the value. It is a passkey without
  decoys: the value is the sample's only value token, so a model that ignores order answers it without the key
  (``scripts/recall_at_distance.py`` is the recall that needs the key). Trained on samples that fit in T
  (distances from 1 to the longest that fits), evaluated on samples of every length kT, whose distance is the
  longest that fits in kT (``settings.token_carry.distance``). Metric: accuracy of the answer.
- **mqar** (multi-query associative recall, ``hf_resolvent.training.synthetic``): trained on sequences of one
  length L, evaluated on sequences of kL with the same number of pairs (the queries spread over the longer
  sequence). Metric: accuracy over the queries.

The synthetic tasks train small models in-process (``hf_resolvent.training.synthetic.task_model``: the same
shape for every mixer, a fixed number of steps, no curriculum) and are not saved.

GPT-2 has a learned position table, trained only up to the context it was trained at: its rows past T have ``value``
null and a ``note`` saying why (and its ``loss:<scaling>`` rows, which have no RoPE to scale, likewise); every other
value is a finite number. RoPE models (every resolvent model) run past ``n_positions`` as they are.

With ``--seeds A B ...`` (default: the preset's) the first seed trains every model and the others the preset's
``seeded`` models (default: the sweep's headline mixers, attention, dense and exp2:ce), for every task.

OUT gets ``results.json`` (``{"command", "settings", "rows": [{"model", "task", "length", "seed", "value",
"metric"}, ...]}``), ``results.md`` (the tables, "n/a" where a model cannot run), ``loss_by_position.png``
(loss against position, one colour per mixer, one line style per RoPE scaling) and, with the synthetic tasks,
``recall.png`` (accuracy against distance for token carry and against length for MQAR, one colour per mixer).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_resolvent.training import cli
from hf_resolvent.training.long_context import PRESETS, LongContextError, long_context
from hf_resolvent.training.sweep import HEADLINE, MODELS, SweepError

PRETRAIN = Path(__file__).resolve().parent / "pretrain.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="hour", choices=sorted(PRESETS))
    p.add_argument("--quick", action="store_true", help="the quick preset (CI): gpt2 and exp2:ce, about a minute")
    p.add_argument("--models", nargs="+", default=None, metavar="NAME",
                   help=f"only these (default: the preset's); known: {', '.join(MODELS)}")
    p.add_argument("--seeds", nargs="+", type=int, default=None,
                   help="the first for every model, the others for " + ", ".join(HEADLINE))
    p.add_argument("--steps", type=int, default=None, help="optimizer steps of the language models")
    p.add_argument("--data", default=None, help="prepared data folder (default: the offline corpus, data/stdlib)")
    p.add_argument("--runs-dir", default=None, help="where the language models go (default: runs/long_context/PRESET)")
    p.add_argument("--out", default="runs/long_context", help="folder for results.json, results.md and the figures")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds one language-model run may take")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check(parser, device=args.device, folders=[("--out", args.out), ("--runs-dir", args.runs_dir)])
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    try:
        long_context(args, argv, PRETRAIN, log)
    except (LongContextError, SweepError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
