#!/usr/bin/env python
"""Train GPT-2 and every mixer of the papers' comparison at one shape and token budget, evaluate them all, and
write the table and the perplexity-versus-cost figure ("which mixer should I use?").

    python experiments/sweep.py --preset hour --out bench/sweep                 # about an hour on 2 CPU cores
    python experiments/sweep.py --preset hour --seeds 0 1 2 --out bench/sweep   # + seeds 1, 2 of the headline mixers
    python experiments/sweep.py --quick --out runs/sweep-quick                  # CI: two mixers, a couple of minutes

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
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from hf_resolvent.patterns import get_pattern
from hf_resolvent.training import cli
from hf_resolvent.training import data as hdata
from hf_resolvent.training.config import RunError, default_data_dir, training_budget
from hf_resolvent.training.evaluate import EvalSettings, evaluate, strided_perplexity
from hf_resolvent.training.metrics import write_result
from hf_resolvent.training.models import COMPLEXITY_ORDER, cache_bytes, complexity_of

# name -> pretrain.py arguments choosing the model (on top of the base config "tiny", a resolvent model).
# "{hybrid}" is replaced by one spec per layer, alternating exp2:ce and attention.
MODELS = {
    "gpt2": ["--set", "model.type=gpt2"],
    "attention": ["--mixer", "attention"],
    "local_attention:8": ["--mixer", "local_attention:8"],
    "dense": ["--mixer", "dense"],
    "banded:8": ["--mixer", "banded:8"],
    "diagonal": ["--mixer", "diagonal"],
    "exp2": ["--mixer", "exp2"],
    "exp2:ce": ["--mixer", "exp2:ce"],
    "square": ["--mixer", "square"],
    "square:ce": ["--mixer", "square:ce"],
    "exp2:ce+tied": ["--mixer", "exp2:ce+tied"],
    "square:ce+tied": ["--mixer", "square:ce+tied"],
    "exp2:ce/attention": ["--set", "model.mixer={hybrid}"],
}
SWEEP_MODELS = list(MODELS)  # the sweep's own presets: every mixer with RoPE
# the mixers of the long-context comparison, which also runs them without a position encoding
# (position_embedding="none") and with the short causal convolution of 4 (conv_size=4), with RoPE and without
LONG_CONTEXT_MIXERS = ("attention", "dense", "exp2:ce", "square:ce", "exp2:ce+tied")
MODELS.update({f"{m} [none]": [*MODELS[m], "--set", "model.overrides.position_embedding=none"]
               for m in LONG_CONTEXT_MIXERS})
MODELS.update({f"{m} [{pos}conv4]": [*MODELS[m + suffix], "--set", "model.overrides.conv_size=4"]
               for m in LONG_CONTEXT_MIXERS for pos, suffix in (("", ""), ("none+", " [none]"))})
REFERENCES = ("gpt2", "attention")
HEADLINE = ("attention", "dense", "exp2:ce")  # the models trained again with --seeds
HYBRID = ("exp2:ce", "attention")

PRESETS = {
    # 4 layers x 128 (the tiny config's shape), context 128, 16 x 128 tokens per step
    "hour": {"shape": {"n_layer": 4, "n_embd": 128, "n_head": 4, "n_inner": 512, "n_positions": 256},
             "seq_len": 128, "batch": 16, "micro_batch": 16, "steps": 300, "lr": 2e-3, "warmup": 30,
             "eval_windows": 512, "models": SWEEP_MODELS},
    "quick": {"shape": {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_inner": 64, "n_positions": 64},
              "seq_len": 32, "batch": 4, "micro_batch": 4, "steps": 20, "lr": 3e-3, "warmup": 2,
              "eval_windows": 64, "models": ["attention", "exp2:ce"]},
}


class SweepError(RuntimeError):
    """A run or an evaluation of the sweep failed (the message names it and how to reproduce it)."""


def plan(args) -> tuple[dict, list[tuple[str, int]]]:
    """The preset (with the command line's changes) and the (model, seed) runs, in training order."""
    preset = dict(PRESETS["quick" if args.quick else args.preset])
    if args.steps is not None:
        if args.steps < 1:
            raise SweepError(f"--steps must be >= 1, got {args.steps}")
        preset["steps"] = args.steps
    if args.eval_windows is not None:
        if args.eval_windows < 2:
            raise SweepError(f"--eval-windows must be >= 2 (the bootstrap resamples windows), got {args.eval_windows}")
        preset["eval_windows"] = args.eval_windows
    models = args.models or preset["models"]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SweepError(f"unknown model(s) {unknown}; choose among {list(MODELS)}")
    if len(set(args.seeds)) != len(args.seeds):
        raise SweepError(f"--seeds repeats a seed: {args.seeds}")
    runs = [(m, args.seeds[0]) for m in models]
    runs += [(m, s) for s in args.seeds[1:] for m in models if m in HEADLINE]
    return preset, runs


def run_dir(root: Path, model: str, seed: int) -> Path:
    slug = model.replace(":", "_").replace("+", "-").replace("/", "-").replace(" [", "-").replace("]", "")
    return root / f"{slug}-seed{seed}"


def pretrain_command(pretrain: Path, model: str, seed: int, preset: dict, out: Path, data: str | None) -> list[str]:
    """The command line of one run: ``pretrain`` (the path of scripts/pretrain.py) at the preset's shape and budget."""
    shape = ", ".join(f"{k}: {v}" for k, v in preset["shape"].items())
    steps = int(preset["steps"])
    cmd = [sys.executable, str(pretrain), "--config", "tiny", "--output-dir", str(out), "--quiet", "--resume",
           "--max-steps", str(steps),
           "--set", f"model.overrides={{{shape}}}",
           "--set", f"data.seq_len={preset['seq_len']}",
           "--set", f"train.batch_size={preset['batch']}", "--set", f"train.micro_batch={preset['micro_batch']}",
           "--set", f"train.lr={preset['lr']}", "--set", f"train.warmup_steps={preset['warmup']}",
           "--set", f"train.seed={seed}",
           # pretrain's own validation only at the end; checkpoints so that a killed sweep resumes
           "--set", f"eval.every={steps}", "--set", "eval.max_windows=16",
           "--set", f"checkpoint.every={max(1, min(steps, 100))}", "--set", "checkpoint.keep=1",
           "--set", "log.trackers=none"]
    if data:
        cmd += ["--data", str(data)]
    layers = int(preset["shape"]["n_layer"])
    hybrid = "[" + ", ".join(HYBRID[i % len(HYBRID)] for i in range(layers)) + "]"
    return cmd + [a.replace("{hybrid}", hybrid) for a in MODELS[model]]


def train(pretrain: Path, model: str, seed: int, preset: dict, out: Path, data: str | None, timeout: float,
          log=print) -> dict:
    cmd = pretrain_command(pretrain, model, seed, preset, out, data)
    shown = " ".join(shlex.quote(c) for c in [Path(cmd[0]).name, *cmd[1:]])
    log(f"[sweep] {model} (seed {seed}): {shown}")
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=Path.cwd())
    except subprocess.TimeoutExpired:
        raise SweepError(f"training {model} (seed {seed}) ran past --run-timeout {timeout:.0f}s; raise it, or run "
                         f"the command alone: {shown}") from None
    if proc.returncode != 0:
        raise SweepError(f"training {model} (seed {seed}) failed (exit {proc.returncode}):\n"
                         f"{(proc.stdout + proc.stderr)[-3000:]}\nthe command: {shown}")
    results = json.loads((out / "train_results.json").read_text())
    log(f"[sweep] {model} (seed {seed}): {results['steps']} steps in {results['train_time_s']:.0f}s "
        f"(wall {time.time() - t0:.0f}s)")
    return results


def window_losses(model, tokens: np.ndarray, seq_len: int, max_windows: int, device) -> np.ndarray:
    """Mean loss of each non-overlapping validation window of ``seq_len`` tokens (``strided_perplexity`` scores each)."""
    n = min(len(tokens) // seq_len, max_windows)
    if n < 2:
        raise SweepError(f"the validation split has {len(tokens):,} tokens: fewer than two windows of {seq_len}; "
                         f"prepare more data or use a shorter context")
    out = []
    for i in range(n):
        chunk = tokens[i * seq_len:(i + 1) * seq_len]
        out.append(strided_perplexity(model, chunk, seq_len, seq_len, 1, device)["loss"])
    return np.array(out)


def bootstrap_ppl(losses: np.ndarray, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of exp(mean window loss), resampling windows with replacement (windows hold equal tokens)."""
    rng = np.random.default_rng(seed)
    means = losses[rng.integers(0, len(losses), size=(reps, len(losses)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return math.exp(lo), math.exp(hi)


def layer_patterns(model) -> list[str]:
    """The pattern of every layer (``attention`` for GPT-2)."""
    if model.config.model_type == "gpt2":
        return ["attention"] * model.config.n_layer
    return [spec["pattern"] for spec in model.config.layer_mixers]


def costs(model, n: int, device) -> dict:
    patterns = layer_patterns(model)
    classes = [complexity_of(p) or {} for p in patterns]
    order = COMPLEXITY_ORDER

    def widest(key):  # a hybrid costs what its most expensive layer costs
        found = [c[key] for c in classes if c.get(key) in order]
        return max(found, key=order.index) if found else None

    return {"layers": patterns, "reads_per_token": sum(get_pattern(p).cost(n) for p in patterns),
            "time_per_token": widest("time_per_token"), "cache": widest("cache"),
            "cache_bytes": cache_bytes(model, n, device)}


def evaluate_run(folder: Path, data_dir: Path, seq_len: int, max_windows: int, device) -> dict:
    from transformers import AutoModelForCausalLM

    dev = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(folder).to(dev).eval()
    val = hdata.TokenShards(data_dir, "val")
    tokens = val.read(0, min(len(val), max_windows * seq_len))
    losses = window_losses(model, tokens, seq_len, max_windows, dev)
    lo, hi = bootstrap_ppl(losses)
    return {"val_ppl": math.exp(float(losses.mean())), "val_loss": float(losses.mean()), "ppl_low": lo,
            "ppl_high": hi, "windows": len(losses), "window": seq_len, **costs(model, seq_len, dev)}


def pareto(rows: list[dict], key: str) -> list[dict]:
    """The rows no other row beats on both ``key`` (cost) and perplexity, cheapest first."""
    front, best = [], math.inf
    for r in sorted(rows, key=lambda r: (r[key], r["val_ppl"])):
        if r["val_ppl"] < best:
            front.append(r)
            best = r["val_ppl"]
    return front


def seed_summary(rows: list[dict], seeds: list[int]) -> dict:
    """Per-seed perplexities of the headline models and their paired differences against attention."""
    if len(seeds) < 2:
        return {}
    ppl = {(r["model"], r["seed"]): r["val_ppl"] for r in rows}
    out = {"seeds": seeds, "models": {}, "pairs": {}}
    for m in HEADLINE:
        vals = [ppl[(m, s)] for s in seeds if (m, s) in ppl]
        if vals:
            out["models"][m] = {"ppl": vals, "mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1))
                                if len(vals) > 1 else None}
    for m in HEADLINE[1:]:
        diffs = [ppl[(m, s)] - ppl[("attention", s)] for s in seeds if (m, s) in ppl and ("attention", s) in ppl]
        if len(diffs) >= 2:
            mean, se = float(np.mean(diffs)), float(np.std(diffs, ddof=1) / math.sqrt(len(diffs)))
            out["pairs"][f"{m} - attention"] = {
                "diffs": diffs, "mean": mean, "stderr": se, "same_sign": len({d > 0 for d in diffs}) == 1,
                "beyond_2_stderr": abs(mean) > 2 * se}
    return out


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"Command: `{result['command']}`", "",
             f"{s['models']} models, {s['shape']}, context {s['seq_len']}, {s['steps']} steps x {s['batch']} sequences "
             f"= {s['tokens']:,} tokens each (same data order per seed), data: {s['data']}. Validation perplexity "
             f"over {s['windows']} windows of {s['seq_len']} tokens with a 95% bootstrap interval; strided: "
             "scripts/evaluate.py (windows of the context every half context). Cost at n = context: positions "
             "read to produce token n (all layers), decode cache after n tokens (float32, batch 1).", "",
             "| model | seed | params | tokens | val ppl [95% CI] | strided ppl | train time | time / token | "
             "reads / token | cache | cache KiB |",
             "|---|---:|---:|---:|---|---:|---:|---|---:|---|---:|"]
    for r in sorted(result["rows"], key=lambda r: (r["seed"], r["val_ppl"])):
        strided = f"{r['strided_ppl']:.2f}" if r.get("strided_ppl") else "n/a"
        lines.append(f"| {r['model']} | {r['seed']} | {r['params']:,} | {r['tokens']:,} | {r['val_ppl']:.2f} "
                     f"[{r['ppl_low']:.2f}, {r['ppl_high']:.2f}] | {strided} | {r['train_time_s']:.1f} s | "
                     f"{r['time_per_token'] or 'n/a'} | {r['reads_per_token']} | {r['cache'] or 'n/a'} | "
                     f"{r['cache_bytes'] / 1024:.1f} |")
    seeds = result.get("seeds")
    if seeds:
        lines += ["", f"Seeds {seeds['seeds']} (each seed changes the initialisation and the data order):", "",
                  "| model | perplexity per seed | mean | std |", "|---|---|---:|---:|"]
        for m, v in seeds["models"].items():
            std = f"{v['std']:.2f}" if v["std"] is not None else "n/a"
            lines.append(f"| {m} | {', '.join(f'{x:.2f}' for x in v['ppl'])} | {v['mean']:.2f} | {std} |")
        lines += ["", "| paired difference | per seed | mean | std. error | same sign | beyond 2 std. errors |",
                  "|---|---|---:|---:|---|---|"]
        for name, v in seeds["pairs"].items():
            lines.append(f"| {name} | {', '.join(f'{d:+.2f}' for d in v['diffs'])} | {v['mean']:+.2f} | "
                         f"{v['stderr']:.2f} | {'yes' if v['same_sign'] else 'no'} | "
                         f"{'yes' if v['beyond_2_stderr'] else 'no'} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed0 = result["settings"]["seeds"][0]
    rows = [r for r in result["rows"] if r["seed"] == seed0]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    panels = ((axes[0], "reads_per_token", f"positions read per token at n = {result['settings']['seq_len']} "
               "(all layers, log)"),
              (axes[1], "cache_bytes", f"decode cache after n = {result['settings']['seq_len']} tokens (bytes, log)"))
    for ax, key, xlabel in panels:
        for r in rows:
            ref = r["model"] in REFERENCES
            err = [[r["val_ppl"] - r["ppl_low"]], [r["ppl_high"] - r["val_ppl"]]]
            ax.errorbar(r[key], r["val_ppl"], yerr=err, fmt="s" if ref else "o", ms=6 if ref else 5, capsize=2,
                        color="black" if ref else "tab:blue", alpha=0.9)
            ax.annotate(r["model"], (r[key], r["val_ppl"]), textcoords="offset points", xytext=(5, 3), fontsize=8)
            if ref:
                ax.axhline(r["val_ppl"], color="grey", ls=":", lw=1)
        front = pareto(rows, key)
        ax.step([r[key] for r in front], [r["val_ppl"] for r in front], where="post", color="tab:red", lw=1.2,
                label="Pareto front")
        ax.scatter([r[key] for r in front], [r["val_ppl"] for r in front], s=110, facecolors="none",
                   edgecolors="tab:red", lw=1.2)
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    axes[0].set_ylabel("validation perplexity (95% bootstrap interval)")
    s = result["settings"]
    fig.suptitle(f"Perplexity vs cost: {s['shape']}, context {s['seq_len']}, {s['tokens']:,} tokens per model "
                 f"(seed {seed0}; squares and dotted lines: GPT-2 and attention)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def data_dir_of(args) -> Path:
    """The folder pretrain.py trains on: --data, else its offline default."""
    return Path(args.data) if args.data else default_data_dir()


def sweep(args, argv: list[str], pretrain: Path, log=print) -> dict:
    """Train the runs of ``plan(args)`` (each ``pretrain``, the path of scripts/pretrain.py, in a subprocess),
    evaluate them and write ``sweep.json``, ``sweep.md`` and ``sweep.png`` into ``args.out``. ``args`` holds the
    attributes of experiments/sweep.py's options; ``argv`` is recorded as the command."""
    preset, runs = plan(args)
    name = "quick" if args.quick else args.preset
    root = Path(args.runs_dir or f"runs/sweep/{name}")
    out = Path(args.out)
    trained = []
    for model, seed in runs:
        folder = run_dir(root, model, seed)
        trained.append((model, seed, folder, train(pretrain, model, seed, preset, folder, args.data, args.run_timeout,
                                                   log)))
    data_dir = data_dir_of(args)
    # the evaluation of every run together: strided perplexity, its table and figure
    try:
        evaluate([f for _, _, f, _ in trained], out / "evaluate", EvalSettings(data=args.data, samples=0, max_tokens=0),
                 torch.device(args.device), references="none", log=log)
    except (hdata.DataError, RunError, ValueError, OSError) as err:
        raise SweepError(f"evaluating the sweep's runs failed: {err}") from None
    strided = {r["model"]: r["perplexity"] for r in json.loads((out / "evaluate" / "eval.json").read_text())["rows"]}
    rows = []
    for model, seed, folder, res in trained:
        ev_row = evaluate_run(folder, data_dir, preset["seq_len"], preset["eval_windows"], args.device)
        rows.append({"model": model, "seed": seed, "run": str(folder), "params": res["params"],
                     "tokens": res["tokens"], "train_time_s": res["train_time_s"],
                     "strided_ppl": strided.get(str(folder)), **ev_row})
        log(f"[sweep] {model} (seed {seed}): perplexity {ev_row['val_ppl']:.2f} [{ev_row['ppl_low']:.2f}, "
            f"{ev_row['ppl_high']:.2f}], {ev_row['reads_per_token']} reads/token, {ev_row['cache_bytes']:,} cache bytes")
    settings = {"preset": name, "models": len(set(m for m, _ in runs)), "seeds": list(args.seeds),
                "shape": ", ".join(f"{k} {v}" for k, v in preset["shape"].items() if k != "n_positions"),
                "seq_len": preset["seq_len"], "steps": preset["steps"], "batch": preset["batch"],
                "lr": preset["lr"], "warmup": preset["warmup"], "tokens": trained[0][3]["tokens"],
                "windows": rows[0]["windows"], "data": trained[0][3].get("data"), "runs_dir": str(root),
                # what a run must share to be drawn beside these (scripts/evaluate.py's references)
                "budget": training_budget(json.loads((trained[0][2] / "run_config.json").read_text()),
                                            json.loads((data_dir / "meta.json").read_text()))}
    result = {"command": "python experiments/sweep.py " + " ".join(shlex.quote(a) for a in argv), "settings": settings,
              "rows": rows, "seeds": seed_summary(rows, list(args.seeds))}
    write_result(out / "sweep.json", result, plot)  # atomic JSON, then sweep.png beside it
    table = markdown(result)
    (out / "sweep.md").write_text(table)
    log(table)
    log(f"[sweep] wrote {out / 'sweep.json'}, {out / 'sweep.md'} and {out / 'sweep.png'}")
    return result


PRETRAIN = Path(__file__).resolve().parents[1] / "scripts" / "pretrain.py"  # each run of the sweep


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
