#!/usr/bin/env python
"""Pretrain a causal LM (resolvent mixer or the GPT-2 baseline) with Accelerate.

    python scripts/pretrain.py --config tiny --output-dir runs/tiny [--max-steps N] [--save-every N] [--resume]
    accelerate launch --num_processes 2 --cpu scripts/pretrain.py --config tiny --output-dir runs/tiny2
    accelerate launch --num_processes 8 scripts/pretrain.py --config 44m-dense --data data/openwebtext \\
        --output-dir runs/44m-dense
    accelerate launch --config_file scripts/accelerate/fsdp_8gpu.yaml scripts/pretrain.py --config 355m-dense ...
    torchrun --nproc_per_node 2 scripts/pretrain.py --fsdp --config tiny --output-dir runs/tiny-fsdp   # CPU too

Configs live in hf_resolvent/training/configs/ (``tiny``, ``44m-<mixer>``, ``355m-<mixer>``, ``*-gpt2``); ``--set
section.key=value`` overrides any field. Without ``--data`` (and ``data.dir`` in the config) the offline default
corpus is prepared into ``data/stdlib`` first (Python's standard-library text; see scripts/prepare_data.py).

The data order is a function of the optimizer step (``StepSampler``), checkpoints are written atomically
(``checkpoints/.tmp_step_N`` renamed to ``checkpoints/step_N`` once complete, with a checksum manifest written
last) and hold the model, optimizer, RNG states, the step and the run's configuration: killing the run at any
moment and re-running the same command with ``--resume`` ends with the same weights as a run never interrupted.
``--resume`` takes the newest checkpoint that matches its manifest (naming any damaged one it skips) and refuses
a configuration or data set other than the checkpoint's. A full device or an output folder that cannot be written
stops the run with an error naming the folder: the checkpoint being written is removed, the earlier ones are kept.
One run at a time may use an output folder (a lock that ends with its process). A non-finite loss or validation
result stops the run with an error. At the end OUTPUT_DIR is a ``save_pretrained`` folder (model, tokenizer,
README.md model card; published so that a kill never leaves a half-written model that loads), with
``metrics.jsonl``, ``loss.png`` and ``train_results.json``. The run's record (``run_config.json``, and in every
checkpoint) names the data folder by its absolute path, so evaluate.py finds it from any working folder.

FSDP2 (``--fsdp``, or an accelerate config with ``distributed_type: FSDP``) shards parameters, gradients and optimizer
state per transformer block with Accelerate's FSDP plugin, on GPUs and on CPU processes (gloo) alike; checkpoints
are then sharded (torch.distributed.checkpoint, one file per rank) and can be resumed by any number of FSDP
processes, one included; the final folder is gathered into one ``save_pretrained`` folder. The first line of a run
says how it is distributed ("FSDP2, 2 processes, full shard (cpu, gloo)"); FSDP asked for and not set up is an
error. With several nodes, OUTPUT_DIR and the data must be on a filesystem all of them share.
"""

from __future__ import annotations

import argparse
import sys

from hf_resolvent import files, locks
from hf_resolvent.training import data as hdata
from hf_resolvent.training import loop
from hf_resolvent.training.config import ConfigError, RunError
from hf_resolvent.training.launch import relaunch_cpu_processes_if_needed


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", help="config name in hf_resolvent/training/configs/ or a .yaml/.json path")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--data", default=None, help="prepared data folder (scripts/prepare_data.py)")
    p.add_argument("--mixer", default=None, help="override model.mixer (a pattern spec such as dense or exp2:ce)")
    p.add_argument("--max-steps", type=int, default=None, help="run length (the learning-rate schedule follows it)")
    p.add_argument("--save-every", type=int, default=None, help="checkpoint every N steps")
    p.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in OUTPUT_DIR")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config field (repeatable), e.g. --set train.lr=3e-4")
    p.add_argument("--no-final-save", action="store_true", help="skip the save_pretrained folder and card")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--fsdp", action="store_true",
                   help="shard with FSDP2 (the settings of scripts/accelerate/fsdp_8gpu.yaml) under any launcher: "
                        "torchrun, accelerate launch, or plain python (one process)")
    p.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: simulate a kill
    p.add_argument("--pause-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: wait for a kill -9
    return p


def train(argv: list[str] | None = None) -> dict:
    """Run (or resume) a pretraining run; returns the final results dict (on every process)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return loop.train(build_parser().parse_args(argv), argv)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        relaunch_cpu_processes_if_needed(__file__, sys.argv[1:])
    try:
        train(argv)
    except (ConfigError, RunError, hdata.DataError, locks.LockHeld, files.WriteError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
