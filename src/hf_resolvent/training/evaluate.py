"""Evaluation of trained models (``scripts/evaluate.py`` is its command line): validation perplexity with strided
windows, sample generations, the comparison table and the papers' figure (perplexity against each mixer's per-token
time and decode-cache class).

Strided perplexity: windows of ``max_length`` tokens every ``stride`` tokens, each token scored once with at least
``max_length - stride`` tokens of context (the method of the ``transformers`` perplexity guide). It is computed
from the model's own next-token loss rather than with ``evaluate.load("perplexity")``: that metric downloads its
script from the Hub and re-loads the model by Hub id, so it fails offline and cannot score a local resolvent model
with remote code.

References: a sweep's ``sweep.json`` (``experiments/sweep.py``) holds GPT-2 and attention trained at one budget. Where an
evaluated model was trained at that same budget (shape, context, steps, batch, learning-rate schedule, corpus and
tokenizer: ``training_budget``), their strided perplexities join the table and the figure as references.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .. import files
from . import data as hdata
from .config import RunError, recorded_data_dir, training_budget
from .models import COMPLEXITY_ORDER, complexity_of, count_parameters, lm_loss

REFERENCE_MODELS = ("gpt2", "attention")  # the sweep's rows drawn beside a run of the same budget

DEFAULT_PROMPTS = {
    hdata.STDLIB: ["The", "Return a new", "This module provides"],
    None: ["The", "In 2019, researchers", "Once upon a time"],
}


@dataclass
class EvalSettings:
    data: str | None = None  # prepared data folder (None: the one each model trained on)
    split: str = "val"
    max_length: int | None = None  # window length (None: the training context)
    stride: int | None = None  # window step (None: max_length // 2)
    max_tokens: int = 200_000  # score at most this many tokens (0: all)
    batch_size: int = 8
    samples: int = 3  # sample generations per model
    prompt: list[str] | None = None  # generation prompts (None: the corpus's defaults)
    max_new_tokens: int = 48
    seed: int = 0


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


def evaluate_model(model_dir: Path, s: EvalSettings, device: torch.device, log=print) -> dict:
    from transformers import AutoModelForCausalLM

    data_dir = _data_dir_for(model_dir, s.data)
    tokenizer = load_tokenizer(model_dir, data_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
    try:
        hdata.verify_prepared(data_dir)
    except hdata.DataError as err:
        raise hdata.DataError(f"{err} (or pass --data)") from None
    _check_same_tokenizer(tokenizer, data_dir)
    meta = json.loads((data_dir / "meta.json").read_text())
    split = hdata.TokenShards(data_dir, s.split)
    run_cfg = json.loads((model_dir / "run_config.json").read_text()) if (model_dir / "run_config.json").exists() else {}
    budget = training_budget(run_cfg, meta) if run_cfg else None
    max_length = s.max_length or run_cfg.get("data", {}).get("seq_len") or 512
    if len(split) < max_length + 1:
        raise hdata.DataError(f"the {s.split} split of {data_dir} has {len(split):,} tokens, fewer than one window "
                              f"of {max_length + 1}: pass a smaller --max-length or prepare more data")
    n = len(split) if not s.max_tokens else min(len(split), max(s.max_tokens, max_length + 1))
    tokens = split.read(0, n)
    stride = s.stride or max(1, max_length // 2)
    label = model_mixer_label(model)
    t0 = time.time()
    ppl = strided_perplexity(model, tokens, max_length, stride, s.batch_size, device)
    log(f"[evaluate] {model_dir}: mixer {label}, {s.split} perplexity {ppl['perplexity']:.3f} "
        f"(loss {ppl['loss']:.4f}), strided: windows of {max_length} tokens every {stride}, each of "
        f"{ppl['tokens']:,} tokens scored once with at least {max_length - stride} tokens of context (not "
        f"training's figure, which scores a sample of non-overlapping windows) ({time.time() - t0:.1f}s)")
    samples = []
    if s.samples:
        prompts = s.prompt or DEFAULT_PROMPTS.get(meta.get("source"), DEFAULT_PROMPTS[None])
        samples = generate_samples(model, tokenizer, (prompts * s.samples)[: s.samples], s.max_new_tokens,
                                   s.seed, device)
        for sample in samples:
            log(f"[sample] {sample['text']!r}")
    cx = complexity_of(label) or {}
    result = {"model": str(model_dir), "name": model_dir.name, "mixer": label,
              "params": count_parameters(model), "data": meta.get("data"), "split": s.split, **ppl,
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
        return [], f"no references: {path} does not exist (experiments/sweep.py writes it)"
    sweep = json.loads(Path(path).read_text())
    budget = sweep["settings"].get("budget")
    if budget is None:
        return [], f"no references: {path} does not record its training budget (an older experiments/sweep.py wrote it)"
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


def evaluate(model_dirs: list[Path], out: Path, s: EvalSettings, device: torch.device, references: str,
             log=print) -> tuple[list[dict], str]:
    """Evaluate every model folder, draw the references (a sweep.json, or "none") beside those trained at its
    budget, and write ``eval.json``, ``eval.md`` and ``perplexity_vs_complexity.png`` into ``out``. Returns the
    rows and the table."""
    results = []
    for model_dir in model_dirs:
        if not (model_dir / "config.json").exists():
            raise hdata.DataError(f"{model_dir} is not a model folder (no config.json); pass the --output-dir "
                                  f"of a finished scripts/pretrain.py run")
        results.append(evaluate_model(model_dir, s, device, log))
    reference, said = reference_rows(results, references)
    log(f"[evaluate] {said}")
    table = markdown_table(results + reference)
    with files.writing(out, "or pass another --out"):
        out.mkdir(parents=True, exist_ok=True)
        files.atomic_write_json(out / "eval.json", {"rows": results, "references": reference})
        (out / "eval.md").write_text(table)
        plot_comparison(results + reference, out / "perplexity_vs_complexity.png")
    return results, table


# The validation loss of a training run (scripts/pretrain.py), over fixed non-overlapping windows

EVAL_KEYS = ("val_loss", "val_ppl", "val_tokens", "val_windows", "val_window")


def describe_eval(ev: dict) -> str:
    """The validation figures with what they measure (scripts/evaluate.py's strided perplexity differs)."""
    return (f"val loss {ev['val_loss']:.4f}, perplexity {ev['val_ppl']:.2f} ({ev['val_windows']} non-overlapping "
            f"windows of {ev['val_window']} tokens, {ev['val_tokens']:,} tokens scored)")


@torch.no_grad()
def evaluate_loss(accelerator, model, val: hdata.TokenShards, seq_len: int, max_windows: int, micro: int) -> dict:
    """Mean validation loss over fixed non-overlapping windows, split across processes.

    Runs the prepared (wrapped) model so that sharded (FSDP) parameters work; every process runs the same number
    of forward passes (a process short of windows repeats its last one with weight 0)."""
    starts = hdata.eval_windows(val, seq_len, max_windows)
    world, rank = accelerator.num_processes, accelerator.process_index
    mine = starts[rank::world]
    n_batches = math.ceil(math.ceil(len(starts) / world) / micro)
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for i in range(n_batches):
        chunk = mine[i * micro:(i + 1) * micro]
        weight = 1.0 if chunk else 0.0
        chunk = chunk or starts[:1]
        rows = np.stack([val.read(s, seq_len + 1) for s in chunk])
        batch = torch.from_numpy(rows).to(accelerator.device)
        with accelerator.autocast():
            loss = lm_loss(model, batch)
        n = batch[:, 1:].numel() * weight
        total += torch.tensor([loss.item() * n, n], dtype=torch.float64, device=accelerator.device)
    model.train(was_training)
    total = accelerator.reduce(total, reduction="sum")
    val_loss = (total[0] / total[1]).item()  # eval_windows refused a split without a window
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)), "val_tokens": int(total[1].item()),
            "val_windows": len(starts), "val_window": seq_len}
