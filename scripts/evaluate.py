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
scripts/sweep.py) holds GPT-2 and attention trained at one budget. Where an evaluated model was trained at that
same budget (shape, context, steps, batch, learning-rate schedule, corpus and tokenizer: ``training_budget``),
their strided perplexities join the table and the figure as references, so that a single run (the README's
first command trains the sweep's ``dense`` run) is seen beside them; otherwise the output says why not.

Perplexity is computed here from the model's own next-token loss rather than with ``evaluate.load("perplexity")``:
that metric downloads its script from the Hub and re-loads the model by Hub id, so it fails offline and cannot
score a local resolvent model with remote code; the computation is a few lines (exp of the mean token NLL).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hf_resolvent import files
from hf_resolvent.training import cli
from hf_resolvent.training import data as hdata
from hf_resolvent.training.config import RunError, recorded_data_dir, training_budget
from hf_resolvent.training.models import COMPLEXITY_ORDER, complexity_of, count_parameters

REPO = Path(__file__).resolve().parents[1]
DEFAULT_REFERENCES = REPO / "bench" / "sweep" / "sweep.json"
REFERENCE_MODELS = ("gpt2", "attention")  # the sweep's rows drawn beside a run of the same budget

DEFAULT_PROMPTS = {
    hdata.STDLIB: ["The", "Return a new", "This module provides"],
    None: ["The", "In 2019, researchers", "Once upon a time"],
}


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
                   help="a scripts/sweep.py sweep.json whose GPT-2 and attention rows are drawn beside models "
                        "trained at its budget ('none': no references)")
    return p


def model_mixer_label(model) -> str:
    if model.config.model_type == "gpt2":
        return "gpt2"
    mixer = getattr(model.config, "mixer", "?")
    specs = mixer if isinstance(mixer, list) else [mixer]
    names = [s["pattern"] + ("+tied" if s.get("tied") else "") if isinstance(s, dict) else str(s) for s in specs]
    return names[0] if len(set(names)) == 1 else ",".join(names)


def _data_dir_for(model_dir: Path, override: str | None) -> Path:
    if override:
        return Path(override)
    run_cfg = model_dir / "run_config.json"
    if run_cfg.exists():
        return recorded_data_dir(json.loads(run_cfg.read_text()))
    raise hdata.DataError(f"{model_dir} has no run_config.json to tell which data it was trained on; pass --data")


def load_tokenizer(model_dir: Path, data_dir: Path | None):
    """The tokenizer saved in ``model_dir``. A folder without tokenizer files is an error that says so and where the
    training data's tokenizer is (``data_dir``, when known): transformers' own error for it is a guess about a
    missing converter ("You need to have sentencepiece or tiktoken installed")."""
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_base import FULL_TOKENIZER_FILE, TOKENIZER_CONFIG_FILE

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception:
        if any((model_dir / name).exists() for name in (TOKENIZER_CONFIG_FILE, FULL_TOKENIZER_FILE)):
            raise  # the files are there: transformers' error is about them
        source = data_dir / "tokenizer" if data_dir is not None else None
        where = (f" (the tokenizer of the data it was trained on is in {source}: copy its files into {model_dir})"
                 if source is not None and source.is_dir() else "")
        raise hdata.DataError(f"{model_dir} has no tokenizer files ({TOKENIZER_CONFIG_FILE}, {FULL_TOKENIZER_FILE}): "
                              f"save the tokenizer the model was trained with into it, with "
                              f"tokenizer.save_pretrained({str(model_dir)!r}){where}") from None


def _check_same_tokenizer(tokenizer, data_dir: Path) -> None:
    from transformers import AutoTokenizer

    data_tok = AutoTokenizer.from_pretrained(data_dir / "tokenizer")
    if data_tok.get_vocab() != tokenizer.get_vocab():
        raise hdata.DataError(f"the model's tokenizer differs from the one {data_dir} was tokenised with; evaluate "
                              f"on data prepared with the model's tokenizer (--data)")


@torch.no_grad()
def strided_perplexity(model, tokens: np.ndarray, max_length: int, stride: int, batch_size: int,
                       device: torch.device) -> dict:
    """Perplexity of a token stream ``tokens`` (int64, (N,)) with strided windows.

    Window k covers ``[k * stride, k * stride + max_length)``; it scores its tokens not scored by window
    k - 1 (all of them for k = 0), so for ``stride < max_length`` every token after the first is predicted
    exactly once, with at least ``max_length - stride`` tokens of context (except in the first window); with
    ``stride == max_length`` (disjoint windows) the first token of each window is not scored. Returns mean NLL
    (nats/token), perplexity and the number of scored tokens.
    """
    if not 0 < stride <= max_length:
        raise ValueError(f"stride must be in (0, max_length={max_length}], got {stride}")
    n = len(tokens)
    if n < 2:
        raise hdata.DataError("need at least 2 tokens to evaluate")
    windows = []  # (begin, end, first scored target index within the window)
    prev_end = 0
    for begin in range(0, n - 1, stride):
        end = min(begin + max_length, n)
        first = max(prev_end - begin, 1)  # target positions (>= 1: the first token of a window has no context)
        if first < end - begin:
            windows.append((begin, end, first))
        prev_end = end
        if end == n:
            break
    nll, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        group = windows[i:i + batch_size]
        length = max(e - b for b, e, _ in group)
        ids = torch.zeros(len(group), length, dtype=torch.long)
        targets = torch.full((len(group), length), -100, dtype=torch.long)
        for r, (b, e, first) in enumerate(group):
            chunk = torch.from_numpy(tokens[b:e])
            ids[r, : e - b] = chunk
            targets[r, first: e - b] = chunk[first:]
        ids, targets = ids.to(device), targets.to(device)
        logits = model(input_ids=ids).logits.float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets[:, 1:].reshape(-1),
                               ignore_index=-100, reduction="sum")
        nll += loss.item()
        count += int((targets[:, 1:] != -100).sum())
    mean = nll / count
    if not math.isfinite(mean):
        raise RunError(f"the mean loss over {count:,} tokens is {mean}: the model's weights or outputs are not "
                         f"finite; it cannot be evaluated (retrain it, or evaluate an earlier checkpoint)")
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": count, "max_length": max_length, "stride": stride}


def generate_samples(model, tokenizer, prompts: list[str], max_new_tokens: int, seed: int,
                     device: torch.device) -> list[dict]:
    out = []
    for i, prompt in enumerate(prompts):
        torch.manual_seed(seed + i)
        enc = tokenizer(prompt, return_tensors="pt").to(device)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8,
                             pad_token_id=tokenizer.eos_token_id)
        out.append({"prompt": prompt, "text": tokenizer.decode(gen[0], skip_special_tokens=True)})
    return out


def evaluate_model(model_dir: Path, args, device: torch.device, log=print) -> dict:
    from transformers import AutoModelForCausalLM

    import hf_resolvent  # noqa: F401 - registers the resolvent model type

    data_dir = _data_dir_for(model_dir, args.data)
    tokenizer = load_tokenizer(model_dir, data_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
    try:
        hdata.verify_prepared(data_dir)
    except hdata.DataError as err:
        raise hdata.DataError(f"{err} (or pass --data)") from None
    _check_same_tokenizer(tokenizer, data_dir)
    meta = json.loads((data_dir / "meta.json").read_text())
    split = hdata.TokenShards(data_dir, args.split)
    run_cfg = json.loads((model_dir / "run_config.json").read_text()) if (model_dir / "run_config.json").exists() else {}
    budget = training_budget(run_cfg, meta) if run_cfg else None
    max_length = args.max_length or run_cfg.get("data", {}).get("seq_len") or 512
    if len(split) < max_length + 1:
        raise hdata.DataError(f"the {args.split} split of {data_dir} has {len(split):,} tokens, fewer than one window "
                              f"of {max_length + 1}: pass a smaller --max-length or prepare more data")
    n = len(split) if not args.max_tokens else min(len(split), max(args.max_tokens, max_length + 1))
    tokens = split.read(0, n)
    stride = args.stride or max(1, max_length // 2)
    label = model_mixer_label(model)
    t0 = time.time()
    ppl = strided_perplexity(model, tokens, max_length, stride, args.batch_size, device)
    log(f"[evaluate] {model_dir}: mixer {label}, {args.split} perplexity {ppl['perplexity']:.3f} "
        f"(loss {ppl['loss']:.4f}), strided: windows of {max_length} tokens every {stride}, each of "
        f"{ppl['tokens']:,} tokens scored once with at least {max_length - stride} tokens of context (not "
        f"training's figure, which scores a sample of non-overlapping windows) ({time.time() - t0:.1f}s)")
    samples = []
    if args.samples:
        prompts = args.prompt or DEFAULT_PROMPTS.get(meta.get("source"), DEFAULT_PROMPTS[None])
        samples = generate_samples(model, tokenizer, (prompts * args.samples)[: args.samples], args.max_new_tokens,
                                   args.seed, device)
        for s in samples:
            log(f"[sample] {s['text']!r}")
    cx = complexity_of(label) or {}
    result = {"model": str(model_dir), "name": model_dir.name, "mixer": label,
              "params": count_parameters(model), "data": meta.get("data"), "split": args.split, **ppl,
              "time_per_token": cx.get("time_per_token"), "cache": cx.get("cache"), "budget": budget,
              "samples": samples}
    with files.writing(model_dir, "or copy the model folder somewhere writable and evaluate the copy"):
        files.atomic_write_json(model_dir / "eval_results.json", result)
    return result


def reference_rows(results: list[dict], path: str) -> tuple[list[dict], str]:
    """The GPT-2 and attention rows (first seed) of the sweep at ``path``, when an evaluated model was trained
    at the sweep's budget, as evaluate rows marked ``reference``; and a line saying what was done."""
    if path == "none":
        return [], "no references (--references none)"
    if not Path(path).exists():
        return [], f"no references: {path} does not exist (scripts/sweep.py writes it)"
    sweep = json.loads(Path(path).read_text())
    budget = sweep["settings"].get("budget")
    if budget is None:
        return [], f"no references: {path} does not record its training budget (an older scripts/sweep.py wrote it)"
    if not any(r.get("budget") == budget for r in results):
        theirs = ", ".join(f"{k} {v}" for k, v in budget.items() if k != "corpus_sha256")
        return [], (f"no references from {path}: no model here was trained at its budget ({theirs}, corpus "
                    f"{str(budget['corpus_sha256'])[:12]})")
    seed = min(r["seed"] for r in sweep["rows"])
    rows = [{"model": path, "name": f"{r['model']} ({Path(path).parent.name} reference)", "mixer": r["model"],
             "params": r["params"], "perplexity": r["strided_ppl"], "loss": math.log(r["strided_ppl"]),
             "tokens": None, "time_per_token": r["time_per_token"], "cache": r["cache"], "reference": True}
            for r in sweep["rows"] if r["model"] in REFERENCE_MODELS and r["seed"] == seed and r.get("strided_ppl")]
    return rows, f"references from {path}: {', '.join(r['mixer'] for r in rows)} (seed {seed}), trained at this budget"


def plot_comparison(results: list[dict], path: Path) -> None:
    """Perplexity against per-token time class and decode-cache class, one point per model (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    order = COMPLEXITY_ORDER
    for ax, key, title in ((axes[0], "time_per_token", "per-token time"), (axes[1], "cache", "decode cache")):
        placed: dict[int, int] = {}
        for r in results:
            cls = r.get(key)
            if cls not in order:
                continue
            x = order.index(cls)
            k = placed.get(x, 0)
            placed[x] = k + 1
            jitter = (k % 5 - 2) * 0.06
            marker = "s" if r["mixer"] in ("gpt2", "attention", "local_attention:8") else "o"
            if r.get("reference"):
                ax.scatter(x + jitter, r["perplexity"], marker=marker, s=40, facecolors="none", edgecolors="grey")
                label = f"{r['mixer']} (reference)"
            else:
                ax.scatter(x + jitter, r["perplexity"], marker=marker, s=40)
                label = r["mixer"]
            ax.annotate(label, (x + jitter, r["perplexity"]), textcoords="offset points", xytext=(4, 3), fontsize=8)
        ax.set_xticks(range(len(order)), order)
        ax.set_xlim(-0.5, len(order) - 0.5)
        ax.set_xlabel(f"{title} class")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation perplexity")
    fig.suptitle("Perplexity vs per-token complexity (squares: attention-only mixers, circles: resolvent; hollow "
                 "grey: references trained at the same budget)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown_table(results: list[dict]) -> str:
    lines = ["| model | mixer | params | time / token | cache | val loss | perplexity | tokens |",
             "|---|---|---:|---|---|---:|---:|---:|"]
    for r in sorted(results, key=lambda r: r["perplexity"]):
        tokens = f"{r['tokens']:,}" if r.get("tokens") else "n/a"
        lines.append(f"| {r['name']} | `{r['mixer']}` | {r['params']:,} | {r.get('time_per_token') or 'n/a'} | "
                     f"{r.get('cache') or 'n/a'} | {r['loss']:.4f} | {r['perplexity']:.2f} | {tokens} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check(parser, device=args.device, folders=[("--out", args.out)])
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    results = []
    try:
        for m in args.models:
            model_dir = Path(m)
            if not (model_dir / "config.json").exists():
                raise hdata.DataError(f"{model_dir} is not a model folder (no config.json); pass the --output-dir "
                                      f"of a finished scripts/pretrain.py run")
            results.append(evaluate_model(model_dir, args, device))
        out = Path(args.out) if args.out else Path(args.models[0]).resolve().parent / "eval"
        references, said = reference_rows(results, args.references)
        print(f"[evaluate] {said}")
        table = markdown_table(results + references)
        with files.writing(out, "or pass another --out"):
            out.mkdir(parents=True, exist_ok=True)
            files.atomic_write_json(out / "eval.json", {"rows": results, "references": references})
            (out / "eval.md").write_text(table)
            plot_comparison(results + references, out / "perplexity_vs_complexity.png")
    except (hdata.DataError, RunError, ValueError, OSError) as err:  # OSError: a damaged model folder, a refused write
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table)
    print(f"[evaluate] wrote {out / 'eval.json'}, {out / 'eval.md'} and {out / 'perplexity_vs_complexity.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
