#!/usr/bin/env python
"""Recall at a distance (the passkey with decoys, MQAR): train small models to competence at context T, read them at
up to 16 x T (docs/benchmarks/long-context.md shows the results).

    python experiments/recall_at_distance.py --out runs/recall                      # 5 mixers x RoPE / none, 3 seeds
    python experiments/recall_at_distance.py --conv-size 4 --out runs/recall_conv4  # with the short convolution
    python experiments/recall_at_distance.py --mixers attention exp2:ce --positions none --pairs 8 --out runs/r8
    python experiments/recall_at_distance.py --task mqar --context 128 --pairs 8 --out runs/mqar8
    python experiments/recall_at_distance.py --quick --out runs/recall_quick        # the plumbing, a minute
    python experiments/recall_at_distance.py --out runs/recall --resume             # continue a run that was cut short
    python experiments/recall_at_distance.py --compare runs/r8 runs/r8_6layers --out runs/how_far   # runs side by side

OUT gets results.json (settings, chance levels, one row per model and seed: its training record, accuracy by length
and decode cache), results.md and recall.png; with --compare, how_far.md and how_far.png of the runs named.

The tasks (``passkey_batch`` of synthetic_tasks.py): ``pairs`` (key, value) bigrams among filler tokens, then keys
of some of them; the model must answer each key's value. ``decoy``, the passkey with decoys, asks one pair: read with
the asked pair in the first quarter and the decoys after it, so that at length n the answer lies at least 3n/4 back
and every other value present is nearer. ``mqar``, multi-query associative recall at a distance, asks every pair:
read with all of them in the first quarter. Both train on samples of T tokens with the pairs anywhere, ending in
``queries`` keys. A model that ignores order cannot tell which value present is asked (a bag-of-tokens model scores
about 1/pairs: tests/training/test_synthetic.py).

Competence before extrapolation: a model trains until its accuracy at T, on fresh samples laid out as the longer
lengths are, reaches ``target``, or until ``max_steps``; the result records which, with its accuracy at T and the
longest length it trained on, so that no length past T is read off a model that never learned the task. The
training length grows with competence, from the pairs and queries alone (no filler) to T
(:func:`train_to_competence`): with filler from the start, attention and GPT-2 stayed at a bag of tokens' accuracy
for 20,000 steps (4 pairs at T = 32).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from hf_resolvent.training import cli
from hf_resolvent.training.models import cache_bytes

import protocol
import synthetic_tasks as tasks


@dataclass
class RecallSettings:
    task: str = "decoy"  # "decoy": the passkey with decoys (one pair asked); "mqar": every pair asked
    context: int = 64  # T, the training length
    pairs: int = 4
    vocab: tuple[int, int, int] = (8, 16, 16)  # filler, key and value tokens
    d: int = 64
    layers: int = 3  # at 2, attention without positions learned the task in only some seeds
    heads: int = 2
    conv_size: int = 0  # the short convolution of the resolvent models (0: none; GPT-2 has none)
    lr: float = 1e-3
    rates: tuple[float, ...] = ()  # a grid (protocol.best_rate) swept on each model's first seed, its best kept
    warmup: int = 100
    batch: int = 32
    queries: int = 4  # answers per decoy training sample (the keys of that many pairs end it); mqar asks every pair
    schedule: str = "curriculum"  # or "plain": samples of T from the first step, the rate decaying (SCHEDULES)
    train_far: bool = False  # train on the layout lengths are read on (the asked pairs first): a control, since one
    # query's answer there is the sample's first value, which a model can find without the key
    grow: float = 1.25  # the training length's factor at each check passed, from the pairs alone up to T
    grow_at: float = 0.95  # accuracy at the current training length that lets it grow
    patience: int = 0  # checks at one training length after which it grows below grow_at too (0: never)
    max_steps: int = 8000
    check_every: int = 250
    check_samples: int = 500
    target: float = 0.99  # accuracy at T that ends training
    eval_samples: int = 1000  # per length
    multiples: tuple[int, ...] = (1, 2, 4, 8, 16)

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"recall: task must be one of {sorted(TASKS)}, got {self.task!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"recall: schedule must be one of {sorted(SCHEDULES)}, got {self.schedule!r}")
        if isinstance(self.queries, bool) or not isinstance(self.queries, int) or self.queries < 1:
            raise ValueError(f"recall: queries must be a whole number >= 1, got {self.queries!r}")
        if any(isinstance(r, bool) or not isinstance(r, (int, float)) or r <= 0 for r in self.rates):
            raise ValueError(f"recall: rates must be positive learning rates, got {self.rates!r}")
        if self.train_far and self.schedule != "plain":
            raise ValueError("recall: train_far trains on samples of T laid out as they are read; it needs the plain "
                             "schedule (the curriculum's short samples cannot hold that layout)")
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 0:
            raise ValueError(f"recall: patience must be a whole number of checks >= 0 (0: the gate alone), got "
                             f"{self.patience!r}")

    @property
    def train_queries(self) -> int:
        """Keys that end a training sample: ``queries`` (decoy) or every pair (mqar)."""
        return self.pairs if self.task == "mqar" else min(self.queries, self.pairs)

    @property
    def read_queries(self) -> int:
        """Pairs asked per sample when reading a length: one (decoy) or every one (mqar)."""
        return 1 if self.task == "decoy" else self.pairs

    @property
    def chance(self) -> dict:
        return {"values": 1 / self.vocab[2], "values_present": 1 / self.pairs}

    def record(self) -> dict:
        """The settings as results.json holds them (tuples as lists)."""
        return {**asdict(self), "vocab": list(self.vocab), "multiples": list(self.multiples),
                "rates": list(self.rates)}


TASKS = {"decoy": "Passkey with decoys", "mqar": "MQAR at a distance"}
SCHEDULES = {
    "curriculum": "the training length grows with competence, from the pairs and queries alone to T; the rate "
                  "constant after its warm-up",
    "plain": "samples of T from the first step; the rate decays along a cosine to a tenth after its warm-up",
}
POSITIONS = ("rope", "rope:a", "rope:b", "learned", "none")


@torch.no_grad()
def accuracy(model, s: RecallSettings, length: int, n_samples: int, seed: int, device, batch_size: int = 50,
             far: bool = True) -> float:
    """Accuracy over the answers of ``n_samples`` fresh samples of ``length`` tokens: the asked pairs far back
    (``far=True``, how lengths are read), or laid out as in training (``far=False``: the pairs anywhere, the
    training's queries)."""
    vocab, rng = tasks.Vocab(*s.vocab), np.random.default_rng([seed, length, 2**31 - 1])
    was, right, q = model.training, 0, s.read_queries if far else s.train_queries
    model.eval()
    for i in range(0, n_samples, batch_size):
        batch = tasks.passkey_batch(vocab, length, s.pairs, min(batch_size, n_samples - i), rng, far=far, queries=q)
        answers = model(input_ids=batch.input_ids.to(device)).logits[:, -q:].argmax(-1).cpu()
        right += int((answers == batch.labels[:, -q:]).sum())
    model.train(was)
    return right / (n_samples * q)


def train_to_competence(mixer, seed: int, s: RecallSettings, position_embedding: str, device, log=print):
    """(model, record): trained by :func:`protocol.train` until its accuracy at T reaches ``s.target``, or for
    ``s.max_steps``.

    ``s.schedule`` "curriculum": the training length grows with competence: it starts at the pairs and queries alone
    (no filler) and, at each check (every ``s.check_every`` steps), grows by ``s.grow`` once the accuracy at the
    current length, on samples laid out as in training, is at least ``s.grow_at``, or (``s.patience`` > 0) after that
    many checks at one length, for a model that has stalled below the gate; the rate is constant. "plain": samples of
    T from the first step, the rate decaying along a cosine over ``s.max_steps``. At T each check reads the far
    layout and stops at ``s.target``.
    ``record``: steps, whether the target was reached, the longest length trained on, the accuracy at T when training
    stopped, seconds."""
    torch.manual_seed(seed)
    model = _model(mixer, position_embedding, s).to(device)
    vocab, rng = tasks.Vocab(*s.vocab), np.random.default_rng([seed, 0])
    name, queries = _name(mixer, position_embedding), s.train_queries
    plain = s.schedule == "plain"
    at = {"length": s.context if plain else min(s.context, 1 + 2 * s.pairs + queries),  # BOS, the pairs, the queries
          "checks": 0, "accuracy": 0.0}

    def check(step: int, loss: float) -> bool:
        check_seed = seed + 10_000 + step
        if at["length"] < s.context:
            here = accuracy(model, s, at["length"], s.check_samples, check_seed, device, far=False)
            log(f"[recall] {name} seed {seed} step {step}: loss {loss:.3f}, accuracy at length {at['length']} "
                f"{here:.3f}")
            at["checks"] += 1
            if here >= s.grow_at or at["checks"] == s.patience:
                at["length"], at["checks"] = min(s.context, max(at["length"] + 1, round(at["length"] * s.grow))), 0
            return False
        at["accuracy"] = accuracy(model, s, s.context, s.check_samples, check_seed, device)
        log(f"[recall] {name} seed {seed} step {step}: loss {loss:.3f}, accuracy at T {at['accuracy']:.3f}")
        return at["accuracy"] >= s.target

    t0 = time.time()
    step, loss = protocol.train(
        model, lambda step: tasks.passkey_batch(vocab, at["length"], s.pairs, s.batch, rng, far=s.train_far,
                                                queries=queries),
        s.max_steps, s.lr, s.warmup, device, decay=plain, check_every=s.check_every, check=check)
    length, acc = at["length"], at["accuracy"]
    if length < s.context:  # never trained at T: its accuracy there, read once
        acc = accuracy(model, s, s.context, s.check_samples, seed + 10_000 + step, device)
    # the asked pairs anywhere: a model that reads the keys answers these as well as the far ones
    anywhere = accuracy(model, s, s.context, s.check_samples, seed + 20_000 + step, device, far=False)
    record = {"steps": step, "reached": acc >= s.target, "trained_length": length, "accuracy_at_T": acc,
              "anywhere_at_T": anywhere, "final_loss": loss, "seconds": round(time.time() - t0, 1)}
    log(f"[recall] {name} seed {seed}: {'competent' if record['reached'] else 'NOT competent'} after {step} steps "
        f"(trained up to length {length}, accuracy at T {acc:.3f}, with the asked pairs anywhere {anywhere:.3f}, "
        f"{record['seconds']:.0f} s)")
    return model.eval(), record


def _name(mixer, position_embedding: str) -> str:
    spec = ",".join(mixer) if isinstance(mixer, (list, tuple)) else str(mixer)
    return spec if spec == "gpt2" else f"{spec} [{position_embedding}]"


def run(mixers: list, seeds: list[int], positions: list[str], s: RecallSettings, out: Path, device, log=print,
        resume: bool = False) -> dict:
    """Train and read every (mixer, position encoding, seed); writes ``out/results.json`` after every model (a run
    cut short keeps what it measured) and returns the results: ``{"settings", "chance", "rows": [{"model",
    "mixer", "positions", "seed", "training": record, "accuracy": {length: value}, "cache": {"length": n,
    "bytes": b}}]}``, where ``cache`` is the decode cache the model holds after the longest length read (batch 1).

    ``resume``: keep the rows of the ``out/results.json`` an earlier run with the same settings wrote, and train
    only the models it lacks. Without it, an existing ``results.json`` is refused rather than overwritten."""
    settings = s.record()
    result = {"settings": settings, "chance": s.chance, "rows": _earlier_rows(out / "results.json", settings, resume)}
    out.mkdir(parents=True, exist_ok=True)
    backfill = [row for row in result["rows"] if "cache" not in row]
    for row in backfill:  # a row written before the cache was recorded: it depends on the architecture alone
        untrained = _model(row["mixer"], row["positions"], s).to(device).eval()
        row["cache"] = _cache_after(untrained, _lengths(row["mixer"], s), device)
    if backfill:
        (out / "results.json").write_text(json.dumps(result, indent=1))
    for mixer in mixers:
        for pe in (["learned"] if mixer == "gpt2" else positions):
            for seed in seeds:
                if any(r["model"] == _name(mixer, pe) and r["seed"] == seed for r in result["rows"]):
                    log(f"[recall] {_name(mixer, pe)} seed {seed}: kept from {out / 'results.json'}")
                    continue
                swept = next((r for r in result["rows"] if r["model"] == _name(mixer, pe)
                              and "by_rate" in r["training"]), None)
                model, record = _train(mixer, seed, s, pe, device, log, swept)
                lengths = _lengths(mixer, s)
                acc = {n: accuracy(model, s, n, s.eval_samples, seed, device) for n in lengths}
                log("[recall]   accuracy by length: " + ", ".join(f"{n}: {a:.3f}" for n, a in acc.items()))
                cache = _cache_after(model, lengths, device)
                result["rows"].append({"model": _name(mixer, pe), "mixer": mixer, "positions": pe, "seed": seed,
                                       "training": record, "accuracy": acc, "cache": cache})
                (out / "results.json").write_text(json.dumps(result, indent=1))
    return result


def _train(mixer, seed: int, s: RecallSettings, position_embedding: str, device, log, swept: dict | None = None):
    """:func:`train_to_competence` at ``s.lr``; with ``s.rates``, at each of them, the best at T kept
    (:func:`protocol.best_rate`), for the first seed of a model; a later seed trains at the rate that seed's row
    (``swept``) chose, and its record names that seed (``rate_of_seed``). One rate per model, chosen on one seed and
    replicated on the others, rather than the best of the grid for every seed: the spread over seeds is then a
    model's, not the best of three tries."""
    if not s.rates:
        return train_to_competence(mixer, seed, s, position_embedding, device, log)
    if swept is not None:
        lr = swept["training"]["lr"]
        model, record = train_to_competence(mixer, seed, replace(s, lr=lr), position_embedding, device, log)
        return model, {**record, "lr": lr, "rate_of_seed": swept["seed"]}
    model, record = protocol.best_rate(
        lambda lr: train_to_competence(mixer, seed, replace(s, lr=lr), position_embedding, device, log), s.rates)
    log(f"[recall] {_name(mixer, position_embedding)} seed {seed}: the best rate is {record['lr']:g} (accuracy at "
        "T by rate: " + ", ".join(f"{r}: {a:.3f}" for r, a in record["by_rate"].items()) + ")")
    return model, record


def _model(mixer, position_embedding: str, s: RecallSettings):
    """The untrained model of one row: the mixer and position encoding at the run's shape."""
    return tasks.task_model(mixer, tasks.Vocab(*s.vocab).size, s.context, s.d, s.layers, s.heads, position_embedding,
                            s.conv_size)


def _lengths(mixer, s: RecallSettings) -> list[int]:
    """The lengths a model is read at: the multiples of T (T alone for GPT-2, whose position table ends there)."""
    return [k * s.context for k in s.multiples if mixer != "gpt2" or k == 1]


def _cache_after(model, lengths: list[int], device) -> dict:
    return {"length": max(lengths), "bytes": cache_bytes(model, max(lengths), device)}


def _earlier_rows(path: Path, settings: dict, resume: bool) -> list[dict]:
    """The rows of an earlier run's ``results.json`` to continue from ([] when there is none)."""
    if not path.exists():
        return []
    if not resume:
        raise FileExistsError(f"{path} holds an earlier run's results: continue it with --resume (resume=True), or "
                              "write to another folder")
    earlier = json.loads(path.read_text())
    # a setting the earlier file lacks did not exist then: its default is what that run did
    before = {**RecallSettings().record(), **earlier["settings"]}
    changed = sorted(k for k in settings.keys() | before.keys() if settings.get(k) != before.get(k))
    if changed:
        raise ValueError(f"cannot resume {path}: its settings differ in " + ", ".join(
            f"{k} ({before.get(k)} there, {settings.get(k)} now)" for k in changed)
            + "; run with the same settings, or write to another folder")
    return earlier["rows"]


def _short_of_T(record: dict, context: int) -> str:
    """"" for a competent model, else why not: " (not reached)", with the length it got to when that is short of T."""
    if record["reached"]:
        return ""
    length = record.get("trained_length", context)
    return " (not reached)" if length >= context else f" (not reached; trained up to length {length})"


def _task_title(settings: dict) -> str:
    """"Passkey with decoys, 4 pairs", from a result's settings (files from before ``task`` are the decoy task)."""
    return f"{TASKS[settings.get('task', 'decoy')]}, {settings['pairs']} pairs"


def _by_model(rows: list[dict]) -> dict[str, list[dict]]:
    by_model: dict[str, list[dict]] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    return by_model


def _accuracy_at(row: dict, n: int) -> float | None:
    """A row's accuracy at length n (JSON read back keys it by the string)."""
    return row["accuracy"].get(n, row["accuracy"].get(str(n)))


def markdown(result: dict) -> str:
    """The accuracy table, a row per model: how many seeds reached the target at T, each seed's steps, the accuracy
    at T of every seed, and past T the accuracy of the competent seeds only (mean, min-max over seeds; "-" where
    none was competent: no length past T is read off a model that did not learn the task); then the decode cache
    after the longest length, where the rows record it."""
    s = result["settings"]
    lengths = [k * s["context"] for k in s["multiples"]]
    conv = f", short convolution of {s['conv_size']}" if s.get("conv_size") else ""
    with_cache = any("cache" in r for r in result["rows"])
    cache_note = " Cache: the decode cache after the longest length read (KiB, float32, batch 1)." if with_cache else ""
    queries = s["pairs"] if s.get("task", "decoy") == "mqar" else min(s.get("queries", 4), s["pairs"])
    rate = (f"the best at T of {', '.join(f'{r:g}' for r in s['rates'])} per model on its first seed, the other "
            "seeds at that rate" if s.get("rates") else f"{s['lr']:g}")
    recipe = (f"AdamW at {rate}, the {s.get('schedule', 'curriculum')} schedule, {queries} "
              f"quer{'y' if queries == 1 else 'ies'} per training sample"
              + (", trained on the far layout (a control: the first value answers one query)"
                 if s.get("train_far") else ""))
    anywhere = any("anywhere_at_T" in r["training"] for r in result["rows"])
    lines = [f"{_task_title(s)}, trained at T = {s['context']} ({s['layers']} layers of width {s['d']}{conv}; "
             f"{recipe}); "
             f"chance {1 / s['vocab'][2]:.3f} "
             f"over the values, {1 / s['pairs']:.2f} over those present; {s['eval_samples']} samples per cell. "
             f"Column T: every seed; longer lengths: the competent seeds (accuracy >= {s['target']} at T) only."
             + (f" T, pairs anywhere: accuracy at T with the asked pairs anywhere ({s['check_samples']} samples), "
                "which a model that reads the keys keeps." if anywhere else "") + cache_note,
             "", "| model | competent seeds | steps | " + " | ".join(f"{n}" for n in lengths) + " |"
             + (" T, pairs anywhere |" if anywhere else "") + (" cache (KiB) |" if with_cache else "")
             + (" at T by rate |" if s.get("rates") else ""),
             "|---|---:|---|" + "---:|" * (len(lengths) + anywhere + with_cache) + ("---|" if s.get("rates") else "")]
    for model, rows in _by_model(result["rows"]).items():
        steps = ", ".join(f"{r['training']['steps']}" + _short_of_T(r["training"], s["context"])
                          + (f" at {r['training']['lr']:g}" if s.get("rates") else "") for r in rows)
        competent = [r for r in rows if r["training"]["reached"]]
        cells = [_spread([_accuracy_at(r, n) for r in (rows if n == s["context"] else competent)]) for n in lengths]
        if anywhere:
            cells.append(_spread([r["training"].get("anywhere_at_T") for r in rows]))
        if with_cache:
            cells.append(_cache_cell(rows[0]))
        if s.get("rates"):
            cells.append(_grid_cell(rows))
        lines.append(f"| {model} | {len(competent)} of {len(rows)} | {steps} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _grid_cell(rows: list[dict]) -> str:
    """The accuracy at T of each rate of the grid on the seed that swept it: "1e-3: 0.31, 3e-3: 0.99 (seed 0)"."""
    swept = [r for r in rows if "by_rate" in r["training"]]
    return "; ".join(", ".join(f"{rate}: {acc:.2f}" for rate, acc in r["training"]["by_rate"].items())
                     + f" (seed {r['seed']})" for r in swept) or "-"


def _cache_cell(row: dict) -> str:
    """The decode cache of a model (every seed has the same architecture): "96.0", or "96.0 at 64" when it was read
    at a shorter length than the others (GPT-2), "-" when not recorded."""
    if "cache" not in row:
        return "-"
    kib = f"{row['cache']['bytes'] / 1024:.1f}"
    return kib if row["mixer"] != "gpt2" else f"{kib} at {row['cache']['length']}"


def _spread(values: list) -> str:
    """"0.97" for one value, "0.97 (0.93-1.00)" for several, "-" for none."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{np.mean(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _mean_by_length(rows: list[dict]) -> tuple[list[int], list[float]]:
    """The lengths read and the accuracy at each, averaged over the rows (seeds) given."""
    lengths = sorted({int(n) for r in rows for n in r["accuracy"]})
    return lengths, [float(np.mean([_accuracy_at(r, n) for r in rows])) for n in lengths]


def _accuracy_axes(ax, settings: dict, ylabel: str, title: str) -> None:
    """Accuracy against a log2 length axis, with chance over the values present."""
    ax.axhline(1 / settings["pairs"], color="grey", lw=0.8, ls=":", label="chance over the values present")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (asked pairs in the first quarter)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.02)
    ax.set_title(title)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["settings"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (model, rows) in enumerate(_by_model(result["rows"]).items()):
        ax.plot(*_mean_by_length(rows), marker="o", label=model, color=f"C{i % 10}",
                linestyle="--" if "[none]" in model else "-")
    _accuracy_axes(ax, s, "accuracy", f"{_task_title(s)}, trained at T = {s['context']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def how_far(results: list[dict]) -> str:
    """One table across runs of one task, pairs and T (their settings may differ otherwise): a row per model and
    setting, with the accuracy at every length over all its seeds, competent or not (the column "competent" says how
    many reached the target at T), and the decode cache after the longest length. It answers how far each setting
    gets and what it holds to get there; the per-run tables (:func:`markdown`) keep the rule that only competent
    seeds are read past T."""
    first = results[0]["settings"]
    for r in results[1:]:
        s = r["settings"]
        if (s.get("task", "decoy"), s["pairs"], s["context"], s["multiples"]) != (
                first.get("task", "decoy"), first["pairs"], first["context"], first["multiples"]):
            raise ValueError(f"how_far compares runs of one task, pairs, T and lengths: {_task_title(first)} at T = "
                             f"{first['context']} against {_task_title(s)} at T = {s['context']}")
    lengths = [k * first["context"] for k in first["multiples"]]
    lines = [f"{_task_title(first)}, trained at T = {first['context']}; chance {1 / first['vocab'][2]:.3f} over the "
             f"values, {1 / first['pairs']:.2f} over those present. Every seed at every length (mean, min-max), "
             "competent or not; cache: the decode cache after the longest length (KiB, float32, batch 1).", "",
             "| model | setting | competent seeds | " + " | ".join(f"{n}" for n in lengths) + " | cache (KiB) |",
             "|---|---|---:|" + "---:|" * (len(lengths) + 1)]
    for result in results:
        s = result["settings"]
        for model, rows in _by_model(result["rows"]).items():
            competent = sum(r["training"]["reached"] for r in rows)
            cells = [_spread([_accuracy_at(r, n) for r in rows]) for n in lengths]
            lines.append(f"| {model} | {_setting(s)} | {competent} of {len(rows)} | " + " | ".join(cells)
                         + f" | {_cache_cell(rows[0])} |")
    return "\n".join(lines) + "\n"


def _setting(s: dict) -> str:
    """"6 layers x 128, 16 heads, conv 4, patience 4, 12000 steps": what sets a run's models apart."""
    parts = [f"{s['layers']} layers x {s['d']}", f"{s['heads']} heads"]
    if s.get("conv_size"):
        parts.append(f"conv {s['conv_size']}")
    if s.get("patience"):
        parts.append(f"patience {s['patience']}")
    if s.get("train_far"):
        parts.append("trained on the far layout")
    default = RecallSettings()
    parts += [f"{key} {s[key]}" for key in ("lr", "batch", "grow", "grow_at") if s.get(key, getattr(default, key))
              != getattr(default, key)]
    return ", ".join(parts + [f"{s['max_steps']} steps"])


def how_far_plot(results: list[dict], path: Path) -> None:
    """:func:`how_far` as a figure: the mean over every seed by length, a line per model and setting (dashed where no
    seed was competent), its cache in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 5))
    i = 0
    for result in results:
        for model, rows in _by_model(result["rows"]).items():
            competent = sum(r["training"]["reached"] for r in rows)
            label = (f"{model}, {_setting(result['settings'])} ({competent}/{len(rows)} competent; "
                     f"{_cache_cell(rows[0])} KiB)")
            ax.plot(*_mean_by_length(rows), marker="o", color=plt.get_cmap("tab20")(i % 20),
                    linestyle="-" if competent else "--", label=label)
            i += 1
    s = results[0]["settings"]
    _accuracy_axes(ax, s, "accuracy (mean over every seed)",
                   f"How far: {_task_title(s)}, trained at T = {s['context']}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the legend lies outside the axes
    plt.close(fig)


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
    p.add_argument("--rates", type=float, nargs="+", default=list(d.rates), metavar="LR",
                   help="train every model at each of these learning rates and keep the best at T (in place of --lr); "
                        f"the comparison's grid is {' '.join(f'{r:g}' for r in protocol.RATES)}")
    p.add_argument("--queries", type=int, default=d.queries,
                   help="keys that end a training sample of the decoy task (1: the task it is read on); mqar asks every "
                        "pair")
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default=d.schedule,
                   help="; ".join(f"{k}: {v}" for k, v in SCHEDULES.items()))
    p.add_argument("--train-far", action="store_true",
                   help="a control: train on the layout lengths are read on (the asked pairs first), where the first "
                        "value answers one query without its key; compare the table's column 'T, pairs anywhere'")
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
                                  heads=args.heads, conv_size=args.conv_size, lr=args.lr, rates=tuple(args.rates),
                                  batch=args.batch,
                                  queries=args.queries, schedule=args.schedule, train_far=args.train_far,
                                  max_steps=args.max_steps, grow=args.grow, grow_at=args.grow_at,
                                  patience=args.patience, target=args.target, eval_samples=args.eval_samples,
                                  multiples=tuple(args.multiples))
    except ValueError as err:
        parser.error(str(err))
    if args.quick:
        settings = replace(settings, **QUICK)
    try:  # the shortest samples hold the pairs: checked now, not after a model has trained
        tasks.passkey_batch(tasks.Vocab(*settings.vocab), settings.context, settings.pairs, 1,
                            np.random.default_rng(0), far=True, queries=settings.read_queries)
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
