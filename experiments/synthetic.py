#!/usr/bin/env python
"""Train a 2-layer model on a synthetic task (copy, associative recall, multi-hop recall, multi-query associative
recall) and report held-out accuracy, as in the papers' section 5.2 (Table 1).

    python experiments/synthetic.py --task multihop --mixer dense --preset cpu
    python experiments/synthetic.py --task multihop --mixer attention --preset cpu-long
    python experiments/synthetic.py --task mqar --mixer exp2:ce --preset cpu --out runs/bench/synthetic/mqar_cpu_exp2_ce.json
    python experiments/synthetic.py --task copy --mixer exp2 --preset paper        # GPU: 20k steps x batch 1024
    python experiments/synthetic.py --summary runs/bench/synthetic/mqar_*.json --out runs/bench/synthetic/mqar.json

Tasks are generated on the fly (no overfitting), with a curriculum over equal phases whose lengths and pair
counts are the full ones divided by 8, 4, 2 and 1 (the papers'; ``--curriculum``, see experiments/synthetic_tasks.py).
``--mixer`` takes any pattern spec of the core library (``attention``, ``local_attention:8``, ``dense``,
``banded:8``, ``diagonal``, ``exp2``, ``exp2:ce``, ``square``, ``square:ce``, ...) or ``gpt2`` (transformers'
GPT2LMHeadModel). Accuracy is measured on held-out samples of the full size (the last phase): ``accuracy`` over
the final answers (copied tokens / queries), ``by_hops`` split by lookup depth (multi-hop),
``sequence_accuracy`` = all answers of a sample right; for mqar also ``by_pairs``, the accuracy on samples with
exactly m pairs for each m of the preset's ``eval_pairs``.

``--summary RESULT.json ...`` gathers finished runs (any tasks) into one JSON (``--out``), a markdown table beside
it (``.md``) and, for mqar runs, a plot of accuracy against the number of pairs (``.png``).

Presets:
  paper  the papers' setting: copy L = 128, recall up to 64 pairs in sequences up to 256, vocab 16 fillers +
         128 keys + 128 values; d 256, 2 layers, 4 heads; 20k steps, batch 1024, lr 3e-3, warmup 2k.
  cpu    a reduced setting for 2 CPU cores: copy L = 32, recall up to 4 pairs in sequences up to 16, vocab
         4 fillers + 16 keys + 16 values; d 128, 2 layers, 4 heads; 6000 steps x batch 64, lr 1e-3, warmup 200,
         no curriculum. (At this scale the curriculum hurts: its first phases have a single pair, where "output
         the value in the context" is always right, and the models stay on that plateau, about 40% accuracy on
         full-size samples, for thousands of steps; without it attention learns associative recall in about
         1000 steps. 8 pairs in sequences of 32 did not leave the plateau in 4000 steps for either model.)
  cpu-long  the cpu preset with longer sequences, so that the sparse patterns' reach matters: recall and
         multi-hop up to 12 pairs in sequences up to 64 (1 to 12 pairs per sample), vocab 4 fillers + 32 keys +
         32 values.
  smoke  seconds; for tests.

MQAR (``--task mqar``) has its own settings in each preset (``MQAR``): keys and values are the two halves of
the vocabulary and the pair count is drawn per sample from [min_pairs, pairs]:
  paper     vocab 8192 (15 fillers + 4087 keys + 4087 values), sequences of 256, 4 to 64 pairs; the paper
            preset's model and schedule.
  cpu       vocab 36 (4 fillers + 16 keys + 16 values), sequences of 32, 1 to 4 pairs; d 128, 2 layers, 4 heads;
            1500 steps x batch 64, lr 1e-3, warmup 100, no curriculum (the easy difficulty).
  cpu-long  the same vocabulary, model and schedule, sequences of 64, 1 to 8 pairs (the hard difficulty).
With 64 keys and 64 values in sequences of 64 (d 64, lr 3e-3, batch 32), attention and dense after 1200 steps,
and attention after 4000, stayed on the plateau of guessing among the values in the context (100% with one pair,
about 1/m with m; bench/synthetic/mqar.md); with 16 keys and values attention leaves it after about 1000 steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from hf_resolvent.training import cli

import protocol
import synthetic_tasks as tasks

PRESETS = {
    "paper": {"copy_len": 128, "recall_len": 256, "pairs": 64, "vocab": (16, 128, 128), "d": 256, "layers": 2,
              "heads": 4, "steps": 20_000, "batch": 1024, "lr": 3e-3, "warmup": 2000, "eval_samples": 2048},
    "cpu": {"copy_len": 32, "recall_len": 16, "pairs": 4, "vocab": (4, 16, 16), "d": 128, "layers": 2,
            "heads": 4, "steps": 6000, "batch": 64, "lr": 1e-3, "warmup": 200, "eval_samples": 512,
            "curriculum": "1"},
    "smoke": {"copy_len": 8, "recall_len": 16, "pairs": 4, "vocab": (4, 8, 8), "d": 32, "layers": 2, "heads": 2,
              "steps": 8, "batch": 4, "lr": 3e-3, "warmup": 2, "eval_samples": 16},
}
PRESETS["cpu-long"] = {**PRESETS["cpu"], "recall_len": 64, "pairs": 12, "min_pairs": 1, "vocab": (4, 32, 32)}

# The cpu preset's model and optimiser (d 128, lr 1e-3, batch 64) over 1500 steps. A vocabulary of 64 keys and 64
# values with a smaller model (d 64, lr 3e-3, batch 32) left attention guessing for 4000 steps; 16 + 16 does not.
MQAR_CPU_MODEL = {"d": 128, "heads": 4, "batch": 64, "lr": 1e-3, "warmup": 100, "steps": 1500, "eval_samples": 256}
# MQAR's settings per preset, over the preset's own ones
MQAR = {
    "paper": {"recall_len": 256, "pairs": 64, "min_pairs": 4, "vocab": (15, 4087, 4087),
              "eval_pairs": [4, 8, 16, 32, 64]},
    "cpu": {"recall_len": 32, "pairs": 4, "min_pairs": 1, "vocab": (4, 16, 16), **MQAR_CPU_MODEL,
            "eval_pairs": [1, 2, 4]},
    "cpu-long": {"recall_len": 64, "pairs": 8, "min_pairs": 1, "vocab": (4, 16, 16), **MQAR_CPU_MODEL,
                 "eval_pairs": [1, 2, 4, 8]},
    "smoke": {"recall_len": 16, "pairs": 4, "min_pairs": 1, "vocab": (2, 8, 8), "eval_pairs": [1, 4]},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=tasks.TASKS)
    p.add_argument("--mixer", help="pattern spec (dense, exp2:ce, attention, ...) or gpt2")
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None, help="split each batch (gradient accumulation)")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--conv-size", type=int, default=0,
                   help="the short causal convolution of a resolvent model (conv_size; 0: none)")
    p.add_argument("--pairs", type=int, default=None, help="most key-value pairs (recall tasks)")
    p.add_argument("--min-pairs", type=int, default=None, help="fewest key-value pairs of a sample (recall tasks)")
    p.add_argument("--length", type=int, default=None, help="longest sequence (recall) or copied length (copy)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--curriculum", default=None,
                   help="comma-separated phase divisors, equal shares of the run (the papers': 8,4,2,1; 1 = none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-samples", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=0, help="also evaluate every N steps (0: only at the end)")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    p.add_argument("--device", default=None)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--summary", nargs="+", metavar="RESULT.json", default=None,
                   help="instead of training: gather these result files into --out (JSON, .md table, .png plot)")
    return p


def task_spec(task: str, preset: dict) -> tasks.TaskSpec:
    vocab = tasks.Vocab(*preset["vocab"])
    if task == "copy":
        return tasks.TaskSpec("copy", preset["copy_len"], vocab=vocab)
    return tasks.TaskSpec(task, preset["recall_len"], preset["pairs"], vocab=vocab, min_pairs=preset.get("min_pairs", 0))


def _parse_curriculum(text: str) -> tuple[int, ...]:
    try:
        phases = tuple(int(v) for v in str(text).split(","))
    except ValueError:
        phases = ()
    if not phases or min(phases) < 1:
        raise ValueError(f"--curriculum takes comma-separated positive divisors such as 8,4,2,1 or 1, got {text!r}")
    return phases


@torch.no_grad()
def evaluate(model, spec: tasks.TaskSpec, n_samples: int, seed: int, device, batch_size: int = 64) -> dict:
    """Accuracy on ``n_samples`` fresh full-size samples drawn with ``seed`` (never seen in training)."""
    rng = np.random.default_rng([seed, 2**31 - 1])
    was = model.training
    model.eval()
    right = total = seq_right = seqs = inter_right = inter_total = 0
    by_hops: dict[int, list[int]] = {}
    for i in range(0, n_samples, batch_size):
        batch = tasks.make_batch(spec, min(batch_size, n_samples - i), rng)
        pred = model(input_ids=batch.input_ids.to(device)).logits.argmax(-1).cpu()
        ok = pred == batch.labels
        q = batch.query_mask
        inter = (batch.labels != tasks.IGNORE) & ~q
        right += int((ok & q).sum())
        total += int(q.sum())
        inter_right += int((ok & inter).sum())
        inter_total += int(inter.sum())
        seq_right += int(((ok | ~q).all(dim=1)).sum())
        seqs += len(batch.input_ids)
        for h in batch.hops[q].unique().tolist():
            sel = q & (batch.hops == h)
            acc = by_hops.setdefault(int(h), [0, 0])
            acc[0] += int((ok & sel).sum())
            acc[1] += int(sel.sum())
    model.train(was)
    out = {"accuracy": right / max(1, total), "sequence_accuracy": seq_right / max(1, seqs), "answers": total,
           "by_hops": {str(h): {"accuracy": r / t, "answers": t} for h, (r, t) in sorted(by_hops.items())}}
    if inter_total:
        out["intermediate_accuracy"] = inter_right / inter_total
    return out


def resolve_preset(task: str, name: str) -> dict:
    """The preset ``name`` with the task's own settings (MQAR's) merged over it."""
    preset = dict(PRESETS[name])
    if task == "mqar":
        preset.update(MQAR[name])
    return preset


def run(args) -> dict:
    if not args.task or not args.mixer:
        raise ValueError("training needs --task and --mixer (or pass --summary RESULT.json ... to gather results)")
    preset = resolve_preset(args.task, args.preset)
    for key, attr in (("steps", "steps"), ("batch", "batch_size"), ("lr", "lr"), ("d", "d_model"),
                      ("eval_samples", "eval_samples"), ("pairs", "pairs"), ("warmup", "warmup"),
                      ("min_pairs", "min_pairs")):
        if getattr(args, attr) is not None:
            preset[key] = getattr(args, attr)
    if args.curriculum is not None:
        preset["curriculum"] = args.curriculum
    phases = _parse_curriculum(preset.get("curriculum", "8,4,2,1"))
    if args.length is not None:
        preset["copy_len" if args.task == "copy" else "recall_len"] = args.length
    spec = task_spec(args.task, preset)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    model = tasks.task_model(args.mixer, spec.vocab.size, spec.total_length(), preset["d"], preset["layers"],
                             preset["heads"], conv_size=args.conv_size).to(device)
    params = sum(p.numel() for p in model.parameters())
    steps, batch_size = int(preset["steps"]), int(preset["batch"])
    micro = min(args.micro_batch or batch_size, batch_size)
    if batch_size % micro:
        raise ValueError(f"--batch-size {batch_size} must be a multiple of --micro-batch {micro}")
    rng = np.random.default_rng([args.seed, 0])
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    log(f"[synthetic] task {args.task} ({spec}), mixer {args.mixer}: {params:,} parameters, {steps} steps x batch "
        f"{batch_size}, device {device}")
    if device.type == "cpu" and args.mixer != "gpt2":
        with torch.no_grad():  # the first forward compiles the CPU kernels (first use only): before the progress bar
            model(input_ids=tasks.make_batch(spec, 1, np.random.default_rng(0)).input_ids.to(device))
    from tqdm.auto import tqdm

    bar = tqdm(total=steps, disable=args.quiet, unit="step", dynamic_ncols=True)
    history = []

    def draw(step: int):
        return tasks.make_batch(spec.phase(tasks.curriculum_divisor(step, steps, phases)), micro, rng)

    def on_step(step: int, loss: float) -> None:
        bar.update(1)
        if (step - 1) % 20 == 0:
            bar.set_postfix(loss=f"{loss:.3f}", phase=f"/{tasks.curriculum_divisor(step - 1, steps, phases)}")

    def held_out(step: int, loss: float) -> bool:
        if step < steps:
            ev = evaluate(model, spec, min(256, preset["eval_samples"]), args.seed, device)
            history.append({"step": step, "loss": loss, **ev})
            bar.write(f"[synthetic] step {step}: loss {loss:.3f}, held-out accuracy {ev['accuracy']:.3f}")
        return False

    t0 = time.time()
    _, total_loss = protocol.train(model, draw, steps, preset["lr"], preset["warmup"], device,
                                   accum=batch_size // micro, autocast=amp, on_step=on_step,
                                   check_every=args.eval_every or 0, check=held_out if args.eval_every else None)
    bar.close()
    train_time = time.time() - t0
    result = evaluate(model, spec, preset["eval_samples"], args.seed, device)
    result.update({"task": args.task, "mixer": args.mixer, "conv_size": args.conv_size, "preset": args.preset,
                   "params": params, "steps": steps,
                   "batch_size": batch_size, "lr": preset["lr"], "curriculum": list(phases),
                   "final_loss": total_loss, "train_time_s": round(train_time, 1), "device": str(device),
                   "seed": args.seed, "history": history,
                   "spec": {"max_len": spec.max_len, "max_pairs": spec.max_pairs, "min_pairs": spec.pair_range[0],
                            "vocab": list(preset["vocab"])}})
    if args.task == "mqar":
        counts = [m for m in preset["eval_pairs"] if m <= spec.max_pairs]
        per = max(16, preset["eval_samples"] // 2)
        result["by_pairs"] = {str(m): evaluate(model, spec.with_pairs(m), per, args.seed, device)["accuracy"]
                              for m in counts}
    log(f"[synthetic] {args.task} / {_model(result)}: held-out accuracy {result['accuracy']:.4f} "
        f"(sequences {result['sequence_accuracy']:.4f}; by hops "
        + ", ".join(f"{h}: {v['accuracy']:.3f}" for h, v in result["by_hops"].items())
        + f") after {train_time:.0f}s")
    return result


def _model(r: dict) -> str:
    """The mixer of a result, and its short convolution if it had one."""
    return r["mixer"] + (f" [conv {r['conv_size']}]" if r.get("conv_size") else "")


def _label(r: dict) -> str:
    return (f"{r['task']} ({r['preset']}: up to {r['spec']['max_pairs']} pairs in {r['spec']['max_len']} tokens, "
            f"{r['steps']} steps)")


def summary_table(rows: list[dict]) -> str:
    """Markdown: one row per mixer, one column per task and preset (accuracy over the final answers)."""
    settings = sorted({_label(r) for r in rows})
    mixers = list(dict.fromkeys(_model(r) for r in rows))
    cell = {(_model(r), _label(r)): r for r in rows}
    lines = ["| mixer | " + " | ".join(settings) + " |", "|---|" + "---:|" * len(settings)]
    for m in mixers:
        cells = []
        for st in settings:
            r = cell.get((m, st))
            if r is None:
                cells.append("not run")
                continue
            text = f"{100 * r['accuracy']:.1f}%"
            if r.get("by_pairs"):
                text += " (" + ", ".join(f"{k}: {100 * v:.0f}" for k, v in r["by_pairs"].items()) + ")"
            cells.append(text)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_by_pairs(rows: list[dict], path: Path) -> bool:
    """Accuracy against the number of pairs, one panel per MQAR setting, one line per mixer; False if no MQAR run."""
    mqar = [r for r in rows if r.get("by_pairs")]
    if not mqar:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({_label(r) for r in mqar})
    mixers = sorted({_model(r) for r in mqar})
    color = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(mixers)}  # one colour per mixer in every panel
    fig, axes = plt.subplots(1, len(settings), figsize=(5.5 * len(settings), 4), squeeze=False)
    for ax, st in zip(axes[0], settings):
        for r in sorted((r for r in mqar if _label(r) == st), key=_model):
            pairs = [int(k) for k in r["by_pairs"]]
            ax.plot(pairs, [100 * v for v in r["by_pairs"].values()], "o-", label=_model(r), ms=4,
                    color=color[_model(r)])
        pairs = sorted({int(k) for r in mqar if _label(r) == st for k in r["by_pairs"]})
        ax.plot(pairs, [100 / m for m in pairs], "k:", lw=1, label="guessing among the m values in the context")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("key-value pairs in the sample")
        ax.set_ylabel("query accuracy (%)")
        ax.set_ylim(0, 102)
        ax.set_title(st.replace("mqar ", "MQAR "), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def summarize(paths: list[str], out: str | None) -> int:
    rows = []
    for p in paths:
        try:
            r = json.loads(Path(p).read_text())
        except (OSError, ValueError) as err:
            print(f"error: cannot read the result {p}: {err}; pass files written by --out", file=sys.stderr)
            return 2
        if not isinstance(r, dict) or not {"task", "mixer", "accuracy", "spec"} <= set(r):
            print(f"error: {p} is not a result of this script (needs task, mixer, accuracy, spec)", file=sys.stderr)
            return 2
        rows.append({k: v for k, v in r.items() if k != "history"} | {"file": str(p)})
    table = summary_table(rows)
    print(table, end="")
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
        out.with_suffix(".md").write_text(table)
        if plot_by_pairs(rows, out.with_suffix(".png")):
            print(f"[synthetic] wrote {out}, {out.with_suffix('.md')} and {out.with_suffix('.png')}")
        else:
            print(f"[synthetic] wrote {out} and {out.with_suffix('.md')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check(parser, device=args.device, files=[("--out", args.out)])
    if args.summary:
        return summarize(args.summary, args.out)
    try:
        result = run(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
