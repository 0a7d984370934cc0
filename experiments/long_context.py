#!/usr/bin/env python
"""Which mixer for long context? Train GPT-2 and the sweep's mixers at a short context T and measure them at up to
16 x T: validation loss by position, with and without zero-shot RoPE scaling, and recall at a distance.

    python experiments/long_context.py --quick --out runs/long_context/quick   # CI: gpt2 and exp2:ce, about a minute
    python experiments/long_context.py --preset hour --out runs/long_context/hour   # every model of the sweep, 3 seeds (bench/long_context holds a copy)
    python experiments/long_context.py --preset bytes --out runs/long_context/bytes  # byte-level models that read their context, with and without RoPE
    python experiments/long_context.py --preset bytes_conv --out runs/long_context/bytes_conv  # the same with the short convolution

Three questions, each trained at a short context and measured at longer ones (lengths: the preset's multiples of
the context the task was trained at):

- **loss** (language modelling): every model is a ``scripts/pretrain.py`` run on the offline corpus at context T,
  built as ``experiments/sweep.py`` builds its runs (same arguments, same run folders, ``--resume``: finished runs are
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
  (``experiments/recall_at_distance.py`` is the recall that needs the key). Trained on samples that fit in T
  (distances from 1 to the longest that fits), evaluated on samples of every length kT, whose distance is the
  longest that fits in kT (``settings.token_carry.distance``). Metric: accuracy of the answer.
- **mqar** (multi-query associative recall, ``experiments/synthetic_tasks.py``): trained on sequences of one
  length L, evaluated on sequences of kL with the same number of pairs (the queries spread over the longer
  sequence). Metric: accuracy over the queries.

The synthetic tasks train small models in-process (``task_model`` of experiments/synthetic_tasks.py: the same
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
import json
import math
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hf_resolvent.configuration_resolvent import ResolventConfig
from hf_resolvent.files import atomic_write_json
from hf_resolvent.modeling_resolvent import ResolventForCausalLM
from hf_resolvent.training import cli
from hf_resolvent.training import data as hdata
from hf_resolvent.training.data import prepare_dataset

import protocol
import synthetic_tasks as tasks
from sweep import (
    HEADLINE,
    HYBRID,
    LONG_CONTEXT_MIXERS,
    MODELS,
    PRETRAIN,
    SWEEP_MODELS,
    SweepError,
    data_dir_of,
    run_dir,
    train,
)

SCALINGS = ("linear", "dynamic", "yarn")
LOSS_TASKS = ("loss", *(f"loss:{s}" for s in SCALINGS))
TASKS = (*LOSS_TASKS, "context_use", "token_carry", "mqar")
METRICS = {"loss": "loss (nats/token) over the positions of the bucket", "token_carry": "accuracy", "mqar": "accuracy",
           "context_use": "1 - (mean loss over positions [T/2, T)) / (mean loss over positions [1, T/16])"}
CONTEXT_USE_GOAL = 0.10  # a model uses its context when its loss in the last half of T is 10% below the first T/16

PRESETS = {
    # The language models at the sweep's hour shape and context (n_positions included, so that experiments/sweep.py's
    # runs of the same steps can be reused through --runs-dir), at half its steps.
    "hour": {
        "models": SWEEP_MODELS, "seeds": [0, 1, 2],
        "lm": {"shape": {"n_layer": 4, "n_embd": 128, "n_head": 4, "n_inner": 512, "n_positions": 256},
               "seq_len": 128, "batch": 16, "micro_batch": 16, "steps": 150, "lr": 2e-3, "warmup": 30,
               "multiples": [1, 2, 4, 8, 16], "windows": 18},
        "token_carry": {"context": 128, "prefix": 8, "vocab": (8, 16, 16), "d": 64, "layers": 2, "heads": 2,
                        "steps": 600, "batch": 32, "lr": 3e-3, "warmup": 60, "eval_samples": 64,
                        "multiples": [1, 2, 4, 8, 16]},
        "mqar": {"length": 32, "pairs": 4, "vocab": (4, 16, 16), "d": 64, "layers": 2, "heads": 2,
                 "steps": 1000, "batch": 32, "lr": 3e-3, "warmup": 100, "eval_samples": 128,
                 "multiples": [1, 2, 4, 8]},
    },
    # Language models that read their context: byte-level text (the offline corpus with a 257-token vocabulary, one
    # token per byte, prepared into the runs folder) at T = 128 bytes, ten times the hour's steps, each mixer with
    # RoPE and without a position encoding. No synthetic tasks: experiments/recall_at_distance.py is the recall study.
    "bytes": {
        "models": ["gpt2", "attention", "dense", "exp2:ce", "square:ce", "exp2:ce+tied", "attention [none]",
                   "dense [none]", "exp2:ce [none]", "square:ce [none]", "exp2:ce+tied [none]"],
        "seeds": [0, 1, 2], "seeded": ["gpt2", "attention", "dense", "exp2:ce"],
        "data": {"tokenizer": "bpe", "vocab_size": 257},
        "lm": {"shape": {"n_layer": 4, "n_embd": 128, "n_head": 4, "n_inner": 512, "n_positions": 128},
               "seq_len": 128, "batch": 16, "micro_batch": 16, "steps": 1500, "lr": 2e-3, "warmup": 100,
               "multiples": [1, 2, 4, 8, 16], "windows": 18},
    },
    "quick": {
        "models": ["gpt2", "exp2:ce"], "seeds": [0],
        "lm": {"shape": {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_inner": 64, "n_positions": 32},
               "seq_len": 32, "batch": 8, "micro_batch": 8, "steps": 300, "lr": 3e-3, "warmup": 30,
               "multiples": [1, 2, 4, 8], "windows": 4},
        "token_carry": {"context": 32, "prefix": 4, "vocab": (4, 8, 8), "d": 32, "layers": 2, "heads": 2,
                        "steps": 400, "batch": 32, "lr": 3e-3, "warmup": 40, "eval_samples": 64,
                        "multiples": [1, 2, 4, 8]},
        "mqar": {"length": 16, "pairs": 2, "vocab": (2, 8, 8), "d": 32, "layers": 2, "heads": 2,
                 "steps": 400, "batch": 32, "lr": 3e-3, "warmup": 40, "eval_samples": 64,
                 "multiples": [1, 2, 4]},
    },
}


# The same language models with the short convolution of 4, each with RoPE and without positions: the convolution
# gives a model without positions the order of the last few tokens, so the pair shows what RoPE adds beyond that.
PRESETS["bytes_conv"] = {
    **PRESETS["bytes"],
    "models": [f"{m} [{pos}conv4]" for m in LONG_CONTEXT_MIXERS for pos in ("", "none+")],
    "seeded": [f"{m} [{pos}conv4]" for m in ("attention", "dense", "exp2:ce", "exp2:ce+tied")
               for pos in ("", "none+")],
}


class LongContextError(RuntimeError):
    """A request the script cannot carry out (the message says what to change)."""


def resolve(args) -> tuple[str, dict, list[tuple[str, int]]]:
    """The preset's name, its settings with the command line's changes, and the (model, seed) pairs in order."""
    name = "quick" if args.quick else args.preset
    preset = json.loads(json.dumps(PRESETS[name]))  # a deep copy: the tests change their own
    if args.steps is not None:
        if args.steps < 1:
            raise LongContextError(f"--steps must be >= 1, got {args.steps}")
        preset["lm"]["steps"] = args.steps
    models = args.models or preset["models"]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise LongContextError(f"unknown model(s) {unknown}; choose among {list(MODELS)}")
    seeds = args.seeds if args.seeds is not None else preset["seeds"]
    if len(set(seeds)) != len(seeds):
        raise LongContextError(f"--seeds repeats a seed: {seeds}")
    preset["models"], preset["seeds"] = list(models), list(seeds)
    preset["seeded"] = list(preset.get("seeded", HEADLINE))
    for task in ("lm", *(t for t in ("token_carry", "mqar") if t in preset)):
        mult = preset[task]["multiples"]
        if mult[0] != 1 or any(b <= a for a, b in zip(mult, mult[1:])):
            raise LongContextError(f"{task}: multiples must start at 1 and increase, got {mult}")
    return name, preset, pairs_of(models, seeds, preset["seeded"])


def pairs_of(models: list[str], seeds: list[int], seeded) -> list[tuple[str, int]]:
    """The first seed for every model, the others for the models of ``seeded``."""
    return [(m, seeds[0]) for m in models] + [(m, s) for s in seeds[1:] for m in models if m in seeded]


# --------------------------------------------------------------------------------------------------------------
# Rows


def row(model: str, task: str, length: int, seed: int, value: float | None, note: str | None = None) -> dict:
    """One result. ``value`` None only with a ``note`` saying why the model cannot run there."""
    if value is None and not note:
        raise ValueError("a missing value needs a note saying why")
    if value is not None and not math.isfinite(value):
        raise LongContextError(f"{model} (seed {seed}), {task} at length {length}: the value is {value}; the model's "
                               "outputs are not finite")
    out = {"model": model, "task": task, "length": int(length), "seed": int(seed),
           "value": None if value is None else float(value), "metric": METRICS[task.split(":")[0]]}
    if note:
        out["note"] = note
    return out


def learned_positions_note(context: int) -> str:
    # the table may have more rows (the hour preset's n_positions), but none past the context was ever trained
    return f"not applicable: GPT-2's learned positions are trained up to its context {context} only"


# --------------------------------------------------------------------------------------------------------------
# Language modelling: loss by position


def buckets(multiples: list[int], context: int) -> list[tuple[int, int, int]]:
    """(length, first position, end position) per multiple: positions [k'T, kT) (from 1 for the first bucket)."""
    out, start = [], 1
    for k in multiples:
        out.append((k * context, start, k * context))
        start = k * context
    return out


@torch.no_grad()
def position_losses(model, windows: np.ndarray, device) -> np.ndarray:
    """(W, n) token losses of ``windows`` (W, n): entry [w, p] is the loss of predicting token p (0 at p = 0)."""
    out = np.zeros(windows.shape, dtype=np.float64)
    for w, window in enumerate(windows):
        ids = torch.from_numpy(window.astype(np.int64))[None].to(device)
        logits = model(input_ids=ids).logits[0].float()
        out[w, 1:] = F.cross_entropy(logits[:-1], ids[0, 1:], reduction="none").cpu().numpy()
    return out


def bucket_means(losses: np.ndarray, multiples: list[int], context: int) -> dict[int, float]:
    """Mean loss per bucket over every window; only the buckets the windows reach."""
    return {length: float(losses[:, a:b].mean()) for length, a, b in buckets(multiples, context)
            if b <= losses.shape[1]}


def context_use(losses: np.ndarray, context: int) -> float:
    """How much the model gains from its context inside the training length T: 1 - (mean loss over positions
    [T/2, T)) / (mean loss over [1, T/16]), from :func:`position_losses`. Near 0 for a model that predicts from
    the last token or two alone; a language model that reads its context scores well above CONTEXT_USE_GOAL."""
    early = losses[:, 1:max(2, context // 16 + 1)].mean()
    return float(1.0 - losses[:, context // 2:context].mean() / early)


def validation_windows(data_dir: Path, width: int, most: int) -> np.ndarray:
    val = hdata.TokenShards(data_dir, "val")
    n = min(len(val) // width, most)
    if n < 1:
        raise LongContextError(f"the validation split of {data_dir} has {len(val):,} tokens: not one window of "
                               f"{width}; prepare more data or use fewer multiples")
    return val.read(0, n * width).reshape(n, width)


def scaled_config(folder: Path, rope_type: str, factor: int, context: int):
    """The trained model's config with zero-shot RoPE scaling ``rope_type`` by ``factor`` from ``context``.

    Linear and dynamic NTK take the factor alone; dynamic takes ``n_positions`` as the original context (it
    changes nothing up to it), so it stays the trained context. YaRN names the original context itself."""
    old = ResolventConfig.from_pretrained(folder)
    rope = {"rope_type": rope_type, "factor": float(factor)}
    n_positions = context
    if rope_type == "yarn":
        rope["original_max_position_embeddings"] = context
        n_positions = factor * context
    return ResolventConfig(**{**old.to_dict(), "rope_parameters": rope, "n_positions": n_positions})


def loss_rows(model_name: str, seed: int, folder: Path, windows: np.ndarray, lm: dict, device, log) -> list[dict]:
    from transformers import AutoModelForCausalLM

    T, mult = lm["seq_len"], lm["multiples"]
    lengths = [k * T for k in mult]
    factor = mult[-1]
    model = AutoModelForCausalLM.from_pretrained(folder).to(device).eval()
    learned = model.config.model_type == "gpt2" or getattr(model.config, "position_embedding", "rope") == "learned"
    rows = []
    if learned:  # the first T tokens of every window: the same tokens at the same positions as the RoPE models'
        losses = position_losses(model, windows[:, :T], device)
        means = bucket_means(losses, mult, T)
        note = learned_positions_note(T)
        rows += [row(model_name, "loss", n, seed, means.get(n), None if n in means else note) for n in lengths]
        rows.append(row(model_name, "context_use", T, seed, context_use(losses, T)))
        for s in SCALINGS:
            rows += [row(model_name, f"loss:{s}", n, seed, None,
                         "not applicable: learned positions, no RoPE to scale") for n in lengths]
        return rows
    losses = position_losses(model, windows, device)
    means = bucket_means(losses, mult, T)
    rows += [row(model_name, "loss", n, seed, means[n]) for n in lengths]
    rows.append(row(model_name, "context_use", T, seed, context_use(losses, T)))
    for s in SCALINGS:
        if model.config.position_embedding == "none":
            rows += [row(model_name, f"loss:{s}", n, seed, None, "not applicable: no position encoding to scale")
                     for n in lengths]
            continue
        scaled = ResolventForCausalLM.from_pretrained(folder, config=scaled_config(folder, s, factor, T))
        means = bucket_means(position_losses(scaled.to(device).eval(), windows, device), mult, T)
        rows += [row(model_name, f"loss:{s}", n, seed, means[n]) for n in lengths]
    log(f"[long_context] {model_name} (seed {seed}) loss by position: "
        + ", ".join(f"{r['task']}@{r['length']} {r['value']:.3f}" for r in rows
                    if r["length"] in (T, lengths[-1]) and r["value"] is not None))
    return rows


# --------------------------------------------------------------------------------------------------------------
# Synthetic tasks: token carry and MQAR


def token_carry_batch(vocab: tasks.Vocab, distances: tuple[int, int], prefix: int, batch_size: int,
                      rng: np.random.Generator) -> tasks.Batch:
    """``batch_size`` token-carry samples (a passkey without decoys): BOS, 0..``prefix`` fillers, key, value, d
    fillers (d drawn from ``distances``, both ends included), the key again, labelled with the value; right-padded
    with PAD."""
    samples = []
    for _ in range(batch_size):
        d = int(rng.integers(distances[0], distances[1] + 1))
        p = int(rng.integers(0, prefix + 1))
        key = vocab.key0 + int(rng.integers(0, vocab.n_keys))
        value = vocab.value0 + int(rng.integers(0, vocab.n_values))
        filler = rng.integers(vocab.noise0, vocab.noise0 + vocab.n_noise, size=p + d)
        samples.append((np.concatenate([[tasks.BOS], filler[:p], [key, value], filler[p:], [key]]).astype(np.int64),
                        value))
    width = max(len(s) for s, _ in samples)
    ids = np.full((batch_size, width), tasks.PAD, dtype=np.int64)
    labels = np.full((batch_size, width), tasks.IGNORE, dtype=np.int64)
    for b, (s, value) in enumerate(samples):
        ids[b, :len(s)] = s
        labels[b, len(s) - 1] = value  # answered at the repeated key
    query = labels != tasks.IGNORE
    return tasks.Batch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(np.where(query, 0, -1)),
                   torch.from_numpy(query))


def token_carry_distance(length: int, prefix: int) -> int:
    """The longest distance whose every sample (any prefix up to ``prefix``) fits in ``length`` tokens."""
    return length - 4 - prefix


def model_spec(name: str, layers: int) -> str | list[str]:
    """The mixer spec of a sweep model for the tasks' model factory (``gpt2`` for GPT-2)."""
    if name == "exp2:ce/attention":
        return [HYBRID[i % len(HYBRID)] for i in range(layers)]
    return name


def train_task(name: str, seed: int, cfg: dict, vocab_size: int, context: int, draw, device):
    """A small model trained on batches ``draw(rng, batch_size)`` by :func:`protocol.train` (warm-up and cosine
    decay); no curriculum."""
    torch.manual_seed(seed)
    model = tasks.task_model(model_spec(name, cfg["layers"]), vocab_size, context, cfg["d"], cfg["layers"],
                             cfg["heads"]).to(device)
    rng = np.random.default_rng([seed, 0])
    _, loss = protocol.train(model, lambda step: draw(rng, int(cfg["batch"])), int(cfg["steps"]), cfg["lr"],
                             cfg["warmup"], device)
    return model.eval(), loss


@torch.no_grad()
def accuracy(model, draw, n_samples: int, seed: int, device, batch_size: int = 32) -> float:
    """Accuracy over the answers of ``n_samples`` fresh samples ``draw(rng, n)`` (a seed apart from training's)."""
    rng = np.random.default_rng([seed, 2**31 - 1])
    right = total = 0
    for i in range(0, n_samples, batch_size):
        batch = draw(rng, min(batch_size, n_samples - i))
        pred = model(input_ids=batch.input_ids.to(device)).logits.argmax(-1).cpu()
        q = batch.query_mask
        right += int(((pred == batch.labels) & q).sum())
        total += int(q.sum())
    return right / max(1, total)


def token_carry_rows(name: str, seed: int, cfg: dict, device, log) -> list[dict]:
    vocab, T, prefix = tasks.Vocab(*cfg["vocab"]), cfg["context"], cfg["prefix"]
    longest = token_carry_distance(T, prefix)
    if longest < 1:
        raise LongContextError(f"token_carry: context {T} leaves no distance after a prefix of up to {prefix}")
    t0 = time.time()
    model, loss = train_task(name, seed, cfg, vocab.size, T,
                             lambda rng, n: token_carry_batch(vocab, (1, longest), prefix, n, rng), device)

    def samples_of(n: int):  # the longest distance that fits in n tokens
        d = token_carry_distance(n, prefix)
        return lambda rng, b: token_carry_batch(vocab, (d, d), prefix, b, rng)

    return recall_rows(name, "token_carry", seed, cfg, T, model, samples_of, device, log, loss, t0)


def recall_rows(name: str, task: str, seed: int, cfg: dict, trained: int, model, samples_of, device, log,
                loss: float, t0: float) -> list[dict]:
    """The accuracy of a recall model trained at ``trained`` tokens on samples of each multiple of it
    (``samples_of(n)`` draws samples of n tokens); GPT-2's rows past its trained length are not applicable."""
    rows = []
    for k in cfg["multiples"]:
        n = k * trained
        if name == "gpt2" and n > trained:
            rows.append(row(name, task, n, seed, None, learned_positions_note(trained)))
            continue
        rows.append(row(name, task, n, seed, accuracy(model, samples_of(n), cfg["eval_samples"], seed, device)))
    log(f"[long_context] {name} (seed {seed}) {task}: final training loss {loss:.3f} ({time.time() - t0:.0f}s); "
        "accuracy " + _values(rows))
    return rows


def _values(rows: list[dict]) -> str:
    return ", ".join(f"{r['length']}: " + ("n/a" if r["value"] is None else f"{r['value']:.2f}") for r in rows)


def mqar_spec(cfg: dict, length: int) -> tasks.TaskSpec:
    return tasks.TaskSpec("mqar", length, cfg["pairs"], vocab=tasks.Vocab(*cfg["vocab"]))


def mqar_rows(name: str, seed: int, cfg: dict, device, log) -> list[dict]:
    L = cfg["length"]
    spec = mqar_spec(cfg, L)
    t0 = time.time()
    model, loss = train_task(name, seed, cfg, spec.vocab.size, L,
                             lambda rng, n: tasks.make_batch(spec, n, rng), device)

    def samples_of(n: int):  # the same pairs in a longer sequence
        longer = mqar_spec(cfg, n)
        return lambda rng, b: tasks.make_batch(longer, b, rng)

    return recall_rows(name, "mqar", seed, cfg, L, model, samples_of, device, log, loss, t0)


# --------------------------------------------------------------------------------------------------------------
# Tables and figures


def expected_keys(settings: dict) -> set[tuple[str, str, int, int]]:
    """Every (model, task, length, seed) the settings ask for: results.json has one row for each."""
    out = set()
    for model, seed in pairs_of(settings["models"], settings["seeds"], settings.get("seeded", HEADLINE)):
        for task in LOSS_TASKS:
            out |= {(model, task, k * settings["loss"]["context"], seed) for k in settings["loss"]["multiples"]}
        out.add((model, "context_use", settings["loss"]["context"], seed))
        if "token_carry" in settings:
            out |= {(model, "token_carry", k * settings["token_carry"]["context"], seed)
                    for k in settings["token_carry"]["multiples"]}
            out |= {(model, "mqar", k * settings["mqar"]["length"], seed) for k in settings["mqar"]["multiples"]}
    return out


def _cell(values: list[float | None]) -> str:
    if any(v is None for v in values):
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}"


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"Command: `{result['command']}`", ""]
    by_key: dict[tuple[str, str, int], list] = {}
    for r in result["rows"]:
        by_key.setdefault((r["model"], r["task"], r["length"]), []).append(r["value"])
    sections = [(f"Validation loss (nats/token) by position, trained at context {s['loss']['context']}; column n: "
                 f"positions [n', n) of {s['loss']['windows']} windows of {s['loss']['window']} tokens; zero-shot "
                 f"RoPE scaling by {s['loss']['factor']}", LOSS_TASKS,
                 [k * s["loss"]["context"] for k in s["loss"]["multiples"]], "position")]
    if "token_carry" in s:
        sections += [
            (f"Token-carry accuracy (one key and value: carrying the value's identity, no key needed), trained on "
             f"samples of up to {s['token_carry']['context']} tokens; column n: samples of n tokens, distance "
             f"{', '.join(f'{d}' for d in s['token_carry']['distance'].values())}", ("token_carry",),
             [k * s["token_carry"]["context"] for k in s["token_carry"]["multiples"]], "length"),
            (f"MQAR accuracy ({s['mqar']['pairs']} pairs), trained on sequences of {s['mqar']['length']}; "
             "column n: sequences of n tokens", ("mqar",),
             [k * s["mqar"]["length"] for k in s["mqar"]["multiples"]], "length")]
    for title, task_names, lengths, unit in sections:
        lines += [title + " (mean ± std over seeds where there are several; n/a: the model cannot run there):", "",
                  "| model | task | " + " | ".join(f"{unit} {n}" for n in lengths) + " |",
                  "|---|---|" + "---:|" * len(lengths)]
        for model in s["models"]:
            for task in task_names:
                cells = [_cell(by_key.get((model, task, n), [None])) for n in lengths]
                lines.append(f"| {model} | {task} | " + " | ".join(cells) + " |")
        lines.append("")
    T = s["loss"]["context"]
    use = {model: by_key[(model, "context_use", T)] for model in s["models"] if (model, "context_use", T) in by_key}
    if use:  # results written before the task existed have none
        lines += [f"Context use inside T = {T}: 1 - (mean loss over positions [{T // 2}, {T})) / (mean loss over [1, "
                  f"{max(1, T // 16)}]); a model that reads its context is at least {CONTEXT_USE_GOAL:.2f}:", "",
                  "| model | context use | reads its context |", "|---|---:|---|"]
        lines += [f"| {model} | {_cell(v)} | {sum(x >= CONTEXT_USE_GOAL for x in v)} of {len(v)} seeds |"
                  for model, v in use.items()]
        lines.append("")
    return "\n".join(lines)


def _mean_curves(rows: list[dict], task: str):
    """{model: (lengths, means, lows, highs)} over the seeds, the finite values only."""
    out = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        per: dict[int, list[float]] = {}
        for r in rows:
            if r["model"] == model and r["task"] == task and r["value"] is not None:
                per.setdefault(r["length"], []).append(r["value"])
        if per:
            xs = sorted(per)
            out[model] = (xs, [np.mean(per[x]) for x in xs], [min(per[x]) for x in xs], [max(per[x]) for x in xs])
    return out


def plot(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, rows = result["settings"], result["rows"]
    cmap = plt.get_cmap("tab10" if len(s["models"]) <= 10 else "tab20")
    color = {m: cmap(i % cmap.N) for i, m in enumerate(s["models"])}  # one colour per mixer
    styles = {"loss": "-", "loss:linear": "--", "loss:dynamic": "-.", "loss:yarn": ":"}
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for task, style in styles.items():
        for model, (xs, ys, lo, hi) in _mean_curves(rows, task).items():
            ax.plot(xs, ys, style, marker="o", ms=3, color=color[model], label=f"{model} ({task})")
            if len(s["seeds"]) > 1:
                ax.fill_between(xs, lo, hi, color=color[model], alpha=0.12)
    ax.axvline(s["loss"]["context"], color="grey", lw=1, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"position (bucket end; trained at {s['loss']['context']}, dotted line)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("Loss by position: solid the model as trained, dashed linear, dash-dot dynamic NTK, dotted YaRN "
                 f"(factor {s['loss']['factor']}); GPT-2 stops at its context", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    loss_png = out / "loss_by_position.png"
    fig.savefig(loss_png, dpi=120)
    plt.close(fig)
    if "token_carry" not in s:
        return [loss_png]

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    distance = {int(n): d for n, d in s["token_carry"]["distance"].items()}
    for ax, task, xlabel, x_of, trained in (
            (axes[0], "token_carry", "filler tokens between the value and its query", lambda n: distance[n],
             token_carry_distance(s["token_carry"]["context"], s["token_carry"]["prefix"])),
            (axes[1], "mqar", f"sequence length ({s['mqar']['pairs']} pairs)", lambda n: n, s["mqar"]["length"])):
        for model, (xs, ys, lo, hi) in _mean_curves(rows, task).items():
            ax.plot([x_of(x) for x in xs], [100 * y for y in ys], "o-", ms=4, color=color[model], label=model)
            if len(s["seeds"]) > 1:
                ax.fill_between([x_of(x) for x in xs], [100 * v for v in lo], [100 * v for v in hi],
                                color=color[model], alpha=0.12)
        ax.axvline(trained, color="grey", lw=1, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 102)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("accuracy (%)")
        ax.set_title(f"{task}: trained up to the dotted line", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    recall_png = out / "recall.png"
    fig.savefig(recall_png, dpi=120)
    plt.close(fig)
    return [loss_png, recall_png]


# --------------------------------------------------------------------------------------------------------------
# The run


def long_context(args, argv: list[str], pretrain: Path, log=print) -> dict:
    """Train the preset's runs (each ``pretrain``, the path of scripts/pretrain.py, in a subprocess), measure them
    and write ``results.json``, ``results.md`` and the figures into ``args.out``. ``args`` holds the attributes of
    experiments/long_context.py's options; ``argv`` is recorded as the command."""
    name, preset, runs = resolve(args)
    root = Path(args.runs_dir or f"runs/long_context/{name}")
    out = Path(args.out)
    device = torch.device(args.device)
    lm = preset["lm"]
    data = args.data
    if data is None and "data" in preset:  # the preset's own tokenisation of the offline corpus
        data = str(root / "data")
        log(f"[long_context] preparing the offline corpus with {preset['data']} into {data}")
        prepare_dataset(data, allow_download=False, log=log, **preset["data"])
    trained = []
    for model, seed in runs:  # every language model first: a failing run stops the script before the evaluations
        folder = run_dir(root, model, seed)
        trained.append((model, seed, folder, train(pretrain, model, seed, lm, folder, data, args.run_timeout,
                                                   log)))
    data_dir = Path(data) if data else data_dir_of(args)
    width = lm["multiples"][-1] * lm["seq_len"]
    windows = validation_windows(data_dir, width, lm["windows"])
    rows = []
    for model, seed, folder, _ in trained:
        rows += loss_rows(model, seed, folder, windows, lm, device, log)
    settings = {
        "preset": name, "models": preset["models"], "seeds": preset["seeds"], "seeded": preset["seeded"],
        "runs_dir": str(root),
        "loss": {"context": lm["seq_len"], "multiples": lm["multiples"], "window": width, "windows": len(windows),
                 "factor": lm["multiples"][-1], "scalings": list(SCALINGS),
                 "shape": {k: v for k, v in lm["shape"].items()}, "steps": lm["steps"], "batch": lm["batch"],
                 "lr": lm["lr"], "warmup": lm["warmup"], "tokens": trained[0][3]["tokens"],
                 "data": trained[0][3].get("data"), "tokenizer": trained[0][3].get("tokenizer"),
                 "train_time_s": {f"{m} (seed {s})": res["train_time_s"] for m, s, _, res in trained}},
    }
    if "token_carry" in preset:
        for model, seed in runs:
            rows += token_carry_rows(model, seed, preset["token_carry"], device, log)
            rows += mqar_rows(model, seed, preset["mqar"], device, log)
        tc = preset["token_carry"]
        settings["token_carry"] = {**tc, "distance": {str(k * tc["context"]): token_carry_distance(k * tc["context"],
                                                                                                   tc["prefix"])
                                                      for k in tc["multiples"]},
                                   "trained_distances": [1, token_carry_distance(tc["context"], tc["prefix"])]}
        settings["mqar"] = dict(preset["mqar"])
    result = {"command": "python experiments/long_context.py " + " ".join(shlex.quote(a) for a in argv),
              "settings": settings, "rows": rows}
    missing = expected_keys(settings) - {(r["model"], r["task"], r["length"], r["seed"]) for r in rows}
    if missing:
        raise LongContextError(f"no result for {sorted(missing)[:5]} ...")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "results.json", result)
    table = markdown(result)
    (out / "results.md").write_text(table)
    figures = plot(result, out)
    log(table)
    log(f"[long_context] wrote {out / 'results.json'}, {out / 'results.md'} and " + ", ".join(map(str, figures)))
    return result


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
