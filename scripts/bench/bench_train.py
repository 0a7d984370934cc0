#!/usr/bin/env python
"""Training throughput of the 44M shape: GPT-2 (transformers' GPT2LMHeadModel, SDPA) vs every resolvent mixer.

    python scripts/bench/bench_train.py --out runs/bench/train.json            # CPU defaults: batch 1 x 512, short runs
    python scripts/bench/bench_train.py --out runs/bench/train.json --batch 32 --rounds 10 --device cuda --bf16

One training step = forward, next-token cross-entropy, backward, gradient clipping and a fused AdamW update (as
in ``pretrain.py``), on random token windows (throughput does not depend on the data). Models are measured side
by side: all of them are built (seeded) and kept in memory with their optimizers (about 0.8 GB each at 44M,
float32), warmed up for one step, then each of ``--rounds`` rounds runs one step of every model in a fresh
random order. A model's ratio to GPT-2 is the median over rounds of its step time over GPT-2's step time in the
same round (the table also gives their quartiles: on a shared machine single steps move by tens of percent, so
use enough rounds). Writes ``{"rows": [{"model", "tokens_per_s", "step_ms", "ratio_to_gpt2", "params"}, ...],
...}`` to ``--out``, prints a Markdown table and writes a PNG next to the JSON.

Shape (paper Table 2): 6 layers, d 512, ff 2048, 8 heads of 64, context 512, vocab 50257 (GPT-2 tokenizer).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from hf_resolvent.backends.triton import aot, block_config

from hf_resolvent.configuration_resolvent import PRESETS
from hf_resolvent.training import cli
from hf_resolvent.training.memory import keep_freed_memory
from hf_resolvent.training.metrics import write_result
from hf_resolvent.training.models import PAPER_MIXERS, build_model, complexity_of, count_parameters
from hf_resolvent.training.optim import build_optimizer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON output (the PNG goes next to it)")
    p.add_argument("--mixers", nargs="+", default=PAPER_MIXERS, help="resolvent mixers to compare with GPT-2")
    p.add_argument("--preset", default="44m", choices=sorted(PRESETS))
    p.add_argument("--seq-len", type=int, default=None, help="default: the preset's context (512 for 44m)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--rounds", type=int, default=8, help="timed rounds; each runs one step of every model")
    p.add_argument("--device", default=None)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (GPUs)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads on CPU")
    p.add_argument("--config", action="append", default=None, metavar="NAME=VALUE[,NAME=VALUE...]",
                   help="Triton kernel variant (BlockConfig settings) to train every mixer under; repeat it to time "
                        "the variants side by side, each model named 'MIXER [SETTINGS]' (default: one, the defaults)")
    p.add_argument("--conv-sizes", nargs="+", type=int, default=[0], metavar="K",
                   help="train every mixer with each of these short convolutions (conv_size; 0: none), side by "
                        "side: a model with one is named 'MIXER [conv K]'")
    p.add_argument("--skip", action="append", default=[], metavar="NAME",
                   help="leave out the model of this name (e.g. 'exp2:ce [attn_bwd=split]'); repeatable")
    return p


def make_model(name: str, preset: str, vocab: int, seq_len: int, conv_size: int = 0, n_layer: int | None = None):
    shape = {k: v for k, v in PRESETS[preset].items() if k != "n_positions"}  # same shape for every model
    if conv_size:
        shape["conv_size"] = conv_size
    if n_layer:  # gpu_measure.py counts the ops of one layer as the difference of two depths
        shape["n_layer"] = n_layer
    cfg = {"type": "gpt2" if name == "gpt2" else "resolvent", "preset": preset, "mixer": name, "overrides": shape,
           "pad_vocab_multiple": 1}
    return build_model(cfg, vocab, seq_len)


class Trainee:
    """One model with its optimizer, so that models can take turns step by step."""

    def __init__(self, model: torch.nn.Module, device: torch.device, bf16: bool, settings: dict):
        self.model, self.device, self.settings = model, device, settings
        self.opt = build_optimizer(model, 1e-4)  # pretrain.py's optimizer (fused AdamW)
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    def step(self, batch: torch.Tensor) -> float:
        """Seconds of one full training step."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with block_config(**self.settings), self.autocast:  # the kernels read it at launch, backward included
            logits = self.model(input_ids=batch[:, :-1]).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def run(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cpu":
        keep_freed_memory()  # as pretrain.py does: no fresh pages for the 100 MB blocks of every step
    seq_len = args.seq_len or PRESETS[args.preset]["n_positions"]
    # (name, mixer, settings, conv_size): GPT-2 once, every mixer once per kernel variant and convolution
    models = [("gpt2", "gpt2", {}, 0)] + [
        (m + "".join(f" [{tag}]" for tag in (aot.config_label(c) if c else "", f"conv {k}" if k else "") if tag),
         m, c, k) for c in args.configs for k in args.conv_sizes for m in args.mixers]
    models = [model for model in models if model[0] not in args.skip]
    names = [name for name, *_ in models]
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, args.vocab, (args.batch, seq_len + 1), generator=gen).to(device)
    trainees = []
    for _, mixer, settings, conv_size in models:
        torch.manual_seed(0)
        model = make_model(mixer, args.preset, args.vocab, seq_len, conv_size).to(device).train()
        trainees.append(Trainee(model, device, args.bf16, settings))
        trainees[-1].step(batch)  # warm-up: allocates the optimizer state, first-call caches
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = torch.randperm(len(trainees), generator=gen).tolist()
        for i in order:
            times[names[i]].append(trainees[i].step(batch))
        print(f"[bench_train] round {r + 1}/{args.rounds}: "
              + ", ".join(f"{n} {times[n][-1] * 1000:.0f}" for n in names) + " ms", flush=True)
    tokens = args.batch * seq_len
    base, base_params = times["gpt2"], count_parameters(trainees[0].model)
    without_conv = {(mixer, aot.config_label(settings)): name for name, mixer, settings, k in models if not k}
    rows = []
    for (name, mixer, settings, conv_size), t in zip(models, trainees):
        step = statistics.median(times[name])
        params = count_parameters(t.model)
        median, quartiles = _round_ratios(times[name], base)
        rows.append({"model": name, "tokens_per_s": tokens / step, "step_ms": step * 1000,
                     "ratio_to_gpt2": median, "ratio_quartiles": quartiles,
                     "params": params, "params_ratio_to_gpt2": params / base_params,
                     "complexity": complexity_of(mixer), "mixer": mixer, "config": settings,
                     "conv_size": conv_size})
        plain = without_conv.get((mixer, aot.config_label(settings)))
        if conv_size and plain is not None:
            # the convolution's cost: each round's step over the same model's without it, in that round
            rows[-1]["ratio_to_no_conv"], rows[-1]["ratio_to_no_conv_quartiles"] = _round_ratios(times[name],
                                                                                                 times[plain])
    return {"rows": rows, "shape": {**PRESETS[args.preset], "seq_len": seq_len, "vocab": args.vocab},
            "batch": args.batch, "rounds": args.rounds, "device": str(device),
            "threads": torch.get_num_threads() if device.type == "cpu" else None, "bf16": args.bf16,
            "torch": torch.__version__, "step_s": times}


def _round_ratios(times: list[float], base: list[float]) -> tuple[float, list[float]]:
    """Median and quartiles over rounds of one model's step time over another's in the same round."""
    ratios = [a / b for a, b in zip(times, base)]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return statistics.median(ratios), [q1, q3]


def markdown(result: dict) -> str:
    lines = ["| model | params | step (ms) | tokens/s | step time vs GPT-2 (quartiles) |", "|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        q1, q3 = r["ratio_quartiles"]
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M ({r['params_ratio_to_gpt2']:.2f}x) | "
                     f"{r['step_ms']:.0f} | {r['tokens_per_s']:,.0f} | {r['ratio_to_gpt2']:.2f}x "
                     f"({q1:.2f}-{q3:.2f}) |")
    conv = [r for r in result["rows"] if "ratio_to_no_conv" in r]
    if conv:
        lines += ["", "| model | step time vs the same model without the convolution (quartiles) |", "|---|---:|"]
        lines += [f"| {r['model']} | {r['ratio_to_no_conv']:.3f}x ({r['ratio_to_no_conv_quartiles'][0]:.3f}-"
                  f"{r['ratio_to_no_conv_quartiles'][1]:.3f}) |" for r in conv]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    colors = ["tab:gray" if r["model"] == "gpt2" else "tab:blue" for r in rows]
    ax.bar(range(len(rows)), [r["ratio_to_gpt2"] for r in rows], color=colors)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), [r["model"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("training step time / GPT-2's")
    s = result["shape"]
    ax.set_title(f"44M shape ({s['n_layer']} x d{s['n_embd']}, ctx {s['seq_len']}), batch {result['batch']}, "
                 f"{result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check(parser, device=args.device, files=[("--out", args.out)])
    if "gpt2" in args.skip:
        parser.error("--skip gpt2: GPT-2 is the model every ratio is taken to; it cannot be left out")
    try:
        args.configs = [aot.parse_config(text) for text in args.config or [""]]
    except ValueError as err:
        parser.error(f"--config: {err}")
    result = run(args)
    png = write_result(args.out, result, plot)
    print(markdown(result))
    print(f"[bench_train] wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
