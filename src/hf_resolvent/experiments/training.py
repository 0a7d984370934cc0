"""What the training, evaluation and sharing scripts share (``scripts/pretrain.py`` and friends).

- run configs: YAML/JSON files with ``inherit:`` and dotted ``--set key=value`` overrides, every numeric setting
  checked against what it allows (:func:`load_config`, :data:`NUMERIC_SETTINGS`);
- the model factory for the papers' comparison: ``resolvent`` models with any mixer and the GPT-2 baseline
  (``transformers.GPT2LMHeadModel`` with SDPA) at the same shape (:func:`build_model`);
- the learning-rate schedule (linear warmup, cosine decay; :func:`lr_at`);
- checkpoint folders written atomically with a checksum manifest, and the newest intact one found again
  (:func:`finalize_checkpoint`, :func:`resumable_checkpoint`); the final model folder published so that a kill
  never leaves one that loads half-written (:func:`publish_model_folder`);
- metrics JSONL, the loss plot and the model card (:func:`render_model_card`).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from ..configuration_resolvent import PRESETS
from ..files import atomic_write_json, file_problem, file_record

CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # package data: the runs of the papers' comparison
MODEL_CARD_TEMPLATE = Path(__file__).resolve().parent / "model_card.md"

# The mixers of the papers' comparison (Table 1 / Figure 4), as core-library pattern specs.
PAPER_MIXERS = ["attention", "local_attention:8", "dense", "banded:8", "diagonal", "exp2", "exp2:ce", "square",
                "square:ce"]


DEFAULTS: dict[str, Any] = {
    "model": {
        "type": "resolvent",  # resolvent | gpt2
        "preset": "tiny",  # a key of PRESETS (configuration_resolvent): the shape of both model types
        "mixer": "dense",  # pattern spec or list of specs (one per layer); ignored by gpt2
        "overrides": {},  # extra config fields (e.g. n_layer, dropout)
        "pad_vocab_multiple": 1,  # round the embedding up (64 is faster on GPUs)
    },
    "data": {
        "dir": None,  # prepared folder (scripts/prepare_data.py); null: the offline default, prepared on demand
        "seq_len": 256,
    },
    "train": {
        "max_steps": 1000,
        "batch_size": 16,  # global batch in sequences (micro_batch * grad_accum * processes)
        "micro_batch": 16,
        "lr": 1e-3,
        "min_lr_ratio": 0.1,
        "warmup_steps": 50,
        "betas": [0.9, 0.98],
        "eps": 1e-8,
        "weight_decay": 0.1,
        "grad_clip": 1.0,
        "mixed_precision": "auto",  # auto: bf16 on GPUs that support it, else fp16 on GPUs, none on CPU
        "seed": 0,
        "compile": False,
        "gradient_checkpointing": False,
    },
    "eval": {"every": 100, "max_windows": 64, "micro_batch": 16},
    "checkpoint": {"every": 200, "keep": 2},
    "log": {"every": 10, "trackers": "auto"},  # auto: tensorboard when installed
}


class ConfigError(ValueError):
    """A run configuration problem (message names the field and the fix)."""


class RunError(RuntimeError):
    """A run that cannot go on as asked: no intact checkpoint, non-finite numbers (the message says what to do)."""


def deep_merge(base: dict, update: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "overrides":
            out[key] = deep_merge(out[key], value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = copy.deepcopy(value)
    return out


def _read_config_file(path: Path) -> dict:
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must hold a mapping, got {type(data).__name__}")
    return data


def resolve_config_path(name: str, config_dir: Path = CONFIG_DIR) -> Path:
    """``tiny`` -> ``configs/tiny.yaml`` beside this module; a path to a ``.yaml``/``.json`` file is used as is."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml", ".json") and p.exists():
        return p
    for ext in (".yaml", ".yml", ".json"):
        cand = config_dir / f"{name}{ext}"
        if cand.exists():
            return cand
    known = sorted(q.stem for q in config_dir.glob("*.yaml"))
    raise ConfigError(f"no config named {name!r}: pass a file path or one of {known}")


def load_config(name: str, overrides: list[str] | None = None, config_dir: Path = CONFIG_DIR) -> dict:
    """Read a run config: DEFAULTS <- inherited files <- the file <- ``overrides`` (``"train.lr=3e-4"``).

    A file may say ``inherit: other.yaml`` (relative to itself). Unknown keys raise :class:`ConfigError`.
    """
    path = resolve_config_path(name, config_dir)
    chain, seen = [], set()
    while path is not None:
        if path in seen:
            raise ConfigError(f"config inheritance loop at {path}")
        seen.add(path)
        data = _read_config_file(path)
        chain.append(data)
        parent = data.pop("inherit", None)
        path = (path.parent / parent).resolve() if parent else None
    cfg = copy.deepcopy(DEFAULTS)
    for data in reversed(chain):
        _check_keys(data)
        cfg = deep_merge(cfg, data)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.lr=3e-4)")
        key, raw = item.split("=", 1)
        import yaml

        set_dotted(cfg, key.strip(), yaml.safe_load(raw))
    cfg["name"] = cfg.get("name") or Path(name).stem
    check_numbers(cfg)
    return cfg


# The numeric settings of a run and the values each allows: whole number or not, and the bounds. A value outside
# them would start a run that trains on nothing (a batch of 0), divides by zero at its first checkpoint, or fails
# deep inside torch; load_config refuses it before anything starts.
NUMERIC_SETTINGS: dict[str, tuple[bool, tuple[tuple[str, float], ...]]] = {
    "model.pad_vocab_multiple": (True, ((">=", 1),)),
    "data.seq_len": (True, ((">=", 1),)),
    "train.max_steps": (True, ((">=", 1),)),
    "train.batch_size": (True, ((">=", 1),)),
    "train.micro_batch": (True, ((">=", 1),)),
    "train.lr": (False, ((">", 0),)),
    "train.min_lr_ratio": (False, ((">=", 0), ("<=", 1))),
    "train.warmup_steps": (True, ((">=", 0),)),
    "train.betas": (False, ((">=", 0), ("<", 1))),  # two of them: AdamW's (beta1, beta2)
    "train.eps": (False, ((">", 0),)),
    "train.weight_decay": (False, ((">=", 0),)),
    "train.grad_clip": (False, ((">", 0),)),
    "train.seed": (True, ((">=", 0),)),  # numpy's generators take no negative seed
    "eval.every": (True, ((">=", 1),)),
    "eval.max_windows": (True, ((">=", 1),)),
    "eval.micro_batch": (True, ((">=", 1),)),
    "checkpoint.every": (True, ((">=", 1),)),
    "checkpoint.keep": (True, ((">=", 0),)),  # 0: keep every checkpoint
    "log.every": (True, ((">=", 1),)),
}
_COMPARE = {">=": float.__ge__, ">": float.__gt__, "<=": float.__le__, "<": float.__lt__}


def _within(value: Any, whole: bool, bounds: tuple[tuple[str, float], ...]) -> bool:
    """Whether ``value`` is a finite number (a whole one for ``whole``) within ``bounds``. A whole number must be one
    already, as the runners read it with ``int()``; a fraction may be a string ``float()`` reads, as YAML leaves
    ``3e-4``."""
    if isinstance(value, bool):
        return False
    if whole:
        if not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            return False
        number = float(value)
    else:
        try:
            number = float(value)
        except (TypeError, ValueError):
            return False
    return math.isfinite(number) and all(_COMPARE[op](number, float(bound)) for op, bound in bounds)


def check_numbers(cfg: dict) -> None:
    """Raise :class:`ConfigError` naming the first numeric setting of ``cfg`` outside what it allows
    (:data:`NUMERIC_SETTINGS`), its value, and what is allowed."""
    for key, (whole, bounds) in NUMERIC_SETTINGS.items():
        section, field = key.split(".")
        value = cfg[section][field]
        if key == "model.pad_vocab_multiple" and value is None:  # build_model reads null as 1
            continue
        rule = " and ".join(f"{op} {bound:g}" for op, bound in bounds)
        if key == "train.betas":
            ok = (isinstance(value, (list, tuple)) and len(value) == 2
                  and all(_within(v, whole, bounds) for v in value))
            allowed = f"two numbers (AdamW's beta1, beta2), each {rule}"
        else:
            ok = _within(value, whole, bounds)
            allowed = f"{'a whole number' if whole else 'a number'} {rule}"
        if not ok:
            raise ConfigError(f"{key}={value!r} is not allowed: it must be {allowed}")


def _check_keys(data: dict) -> None:
    for section, value in data.items():
        if section in ("name", "description"):
            continue
        if section not in DEFAULTS:
            raise ConfigError(f"unknown config section {section!r}; known: {sorted(DEFAULTS)}")
        if not isinstance(value, dict):
            raise ConfigError(f"config section {section!r} must be a mapping")
        for key in value:
            if key not in DEFAULTS[section]:
                raise ConfigError(f"unknown config key {section}.{key}; known: {sorted(DEFAULTS[section])}")


def set_dotted(cfg: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    if parts[0] == "model" and len(parts) == 3 and parts[1] == "overrides":
        cfg["model"]["overrides"][parts[2]] = value
        return
    if len(parts) != 2 or parts[0] not in DEFAULTS or parts[1] not in DEFAULTS[parts[0]]:
        raise ConfigError(f"unknown config key {key!r} (use section.key, e.g. train.lr or model.overrides.n_layer)")
    cfg[parts[0]][parts[1]] = value


def mixer_slug(spec: str | list) -> str:
    """File-name form of a mixer spec: ``exp2:ce`` -> ``exp2_ce``, ``local_attention:8`` -> ``local_attention_8``."""
    if isinstance(spec, (list, tuple)):
        return "-".join(mixer_slug(s) for s in spec)
    return re.sub(r"[^A-Za-z0-9]+", "_", str(spec)).strip("_")


def batch_layout(cfg: dict, world: int) -> tuple[int, int]:
    """(micro_batch, grad_accum) so that micro_batch * grad_accum * world == train.batch_size."""
    batch, micro = int(cfg["train"]["batch_size"]), int(cfg["train"]["micro_batch"])
    micro = min(micro, max(1, batch // world))
    if batch % (micro * world):
        raise ConfigError(f"train.batch_size={batch} is not a multiple of train.micro_batch={micro} x {world} "
                          f"processes; change one of them")
    return micro, batch // (micro * world)


def lr_at(step: int, cfg_train: dict) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine to min_lr_ratio * lr."""
    lr, warmup, total = float(cfg_train["lr"]), int(cfg_train["warmup_steps"]), int(cfg_train["max_steps"])
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    ratio = float(cfg_train["min_lr_ratio"])
    return lr * (ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ------------------------------------------------------------------------------------------------- models


def build_model(model_cfg: dict, vocab_size: int, seq_len: int, eos_token_id: int | None = None):
    """A freshly initialised causal LM for a run config's ``model`` section.

    ``type: gpt2`` builds ``transformers.GPT2LMHeadModel`` (SDPA attention, learned positions) with the shape of
    ``PRESETS[preset]``; ``type: resolvent`` builds ``hf_resolvent.ResolventForCausalLM`` from
    ``ResolventConfig.from_preset(preset, mixer=...)``. ``overrides`` (GPT-2 field names: ``n_layer``,
    ``n_embd``, ``resid_pdrop``, ...) are passed to the config either way; dropout defaults to 0.
    """
    kind = model_cfg["type"]
    overrides = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, **dict(model_cfg.get("overrides") or {})}
    if eos_token_id is not None:
        overrides.setdefault("bos_token_id", eos_token_id)
        overrides.setdefault("eos_token_id", eos_token_id)
    mult = int(model_cfg.get("pad_vocab_multiple") or 1)
    vocab = ((vocab_size + mult - 1) // mult) * mult
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        preset = model_cfg.get("preset", "tiny")
        if preset not in PRESETS:
            raise ConfigError(f"model.preset {preset!r} unknown for gpt2; one of {sorted(PRESETS)}")
        fields = {**PRESETS[preset], "attn_pdrop": 0.0, **overrides}
        fields["n_positions"] = max(seq_len, fields["n_positions"])
        config = GPT2Config(vocab_size=vocab, **fields)
        config._attn_implementation = "sdpa"
        return GPT2LMHeadModel(config)
    if kind == "resolvent":
        from .. import ResolventConfig, ResolventForCausalLM

        config = ResolventConfig.from_preset(model_cfg.get("preset", "tiny"), mixer=model_cfg["mixer"],
                                             vocab_size=vocab, **overrides)
        for name in ("n_positions", "max_position_embeddings"):
            if hasattr(config, name) and getattr(config, name) < seq_len:
                setattr(config, name, seq_len)
        return ResolventForCausalLM(config)
    raise ConfigError(f"model.type must be 'resolvent' or 'gpt2', got {kind!r}")


def model_label(model_cfg: dict) -> str:
    """``gpt2`` or the mixer spec (``dense``, ``exp2:ce``, ...) for tables and plots."""
    if model_cfg["type"] == "gpt2":
        return "gpt2"
    mixer = model_cfg["mixer"]
    return ",".join(mixer) if isinstance(mixer, (list, tuple)) else str(mixer)


DEFAULT_DATA_ROOT = "data"  # where a run without data.dir prepares the offline corpus (or $HF_RESOLVENT_DATA)


def default_data_dir() -> Path:
    """The folder of the offline default corpus, for runs without ``data.dir``: ``$HF_RESOLVENT_DATA/stdlib``, else
    ``data/stdlib`` below the working folder."""
    return Path(os.environ.get("HF_RESOLVENT_DATA", DEFAULT_DATA_ROOT)) / "stdlib"


def recorded_data_dir(run_config: dict) -> Path:
    """The data folder a run's record (``run_config.json``, a checkpoint's ``run``) names. scripts/pretrain.py
    records an absolute path; records of earlier versions hold the path as given, relative to the folder the run
    was started from, or null for the offline default, and are read as from this working folder."""
    recorded = run_config["data"]["dir"]
    return Path(recorded) if recorded is not None else default_data_dir()


def training_budget(run_config: dict, data_meta: dict) -> dict:
    """What two runs must share for their perplexities to be compared: the model shape (without the position
    table's size), context, steps, batch, learning-rate schedule, and the data (corpus, split and tokenizer).
    ``run_config`` is a run's ``run_config.json`` (scripts/pretrain.py), ``data_meta`` the ``meta.json`` of the
    data it trained on; the mixer and the seed are what such a comparison varies."""
    shape = {k: v for k, v in run_config["model"].get("overrides", {}).items() if k != "n_positions"}
    train = run_config["train"]
    return {"shape": shape, "seq_len": run_config["data"]["seq_len"], "steps": train["max_steps"],
            "batch": train["batch_size"], "lr": train["lr"], "warmup": train["warmup_steps"],
            "min_lr_ratio": train.get("min_lr_ratio"),
            **{k: data_meta.get(k) for k in ("corpus_sha256", "tokenizer", "seed", "val_fraction")}}


# order of the per-token classes on the figure's x axis
COMPLEXITY_ORDER = ["O(1)", "O(w)", "O(log n)", "O(sqrt n)", "O(n)"]


def complexity_of(mixer: str) -> dict[str, str] | None:
    """Per-token time and decode-cache classes of a mixer label (``gpt2`` counts as attention), from
    :func:`hf_resolvent.patterns.complexity_table`; None for custom patterns and per-layer lists."""
    from hf_resolvent.patterns import complexity_table

    if "," in mixer:
        return None
    spec = mixer.split("+")[0]
    base = "attention" if spec == "gpt2" else spec.split(":")[0]
    ce = spec.endswith(":ce")
    key = {"local_attention": "local_attention:w", "banded": "banded:w"}.get(base, base + (":ce" if ce else ""))
    for row in complexity_table():
        if row["pattern"] == key:
            return {"time_per_token": row["time_per_token"], "cache": row["cache"]}
    return None


def count_parameters(model) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def build_optimizer(model, lr: float, betas=(0.9, 0.98), weight_decay: float = 0.1, eps: float = 1e-8,
                    fused: bool | None = None):
    """AdamW with weight decay on matrices (embeddings included) and none on biases, norms and gate vectors.

    ``fused`` (default: when every parameter is on a FUSED_ADAMW_DEVICES device; pass it when the model moves
    after this call) selects PyTorch's fused implementation, on CPU too: there the per-tensor loop it replaces
    is a noticeable share of a small model's training step (figures: bench/NOTES.md). Both compute the same
    update up to float rounding.
    """
    import torch

    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": float(weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]
    if fused is None:
        fused = all(p.device.type in FUSED_ADAMW_DEVICES for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=float(lr), betas=tuple(float(b) for b in betas), eps=float(eps),
                             fused=fused)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the system (CPU training).

    Every step of the 44M shape allocates and frees blocks of about 100 MB (logits, their gradient, the tied
    embedding's gradients); glibc serves blocks that large with fresh ``mmap`` pages, so the kernel faults in
    and zeroes all of them again every step, a large share of the step spent as system time. With mmap off and
    trimming at 2 GB the freed blocks are reused and most of those faults go away (figures: bench/NOTES.md).
    PyTorch's CPU tuning guide gets the same from jemalloc or tcmalloc. Returns False where there is no glibc
    (nothing changed).
    """
    import ctypes

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's <malloc.h> parameter numbers
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


# --------------------------------------------------------------------------------------------- checkpoints


CKPT_RE = re.compile(r"^step_(\d{7,})$")
MANIFEST = "manifest.json"


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step:07d}"


def _checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of the finished checkpoint folders, oldest first (temporary folders of saves are not)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := CKPT_RE.match(p.name)) and p.is_dir())


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint folder with the highest step, intact or not (see :func:`resumable_checkpoint`)."""
    found = _checkpoints(output_dir)
    return found[-1][1] if found else None


def write_manifest(folder: Path) -> None:
    """Record the size and SHA-256 of every file of ``folder`` in ``manifest.json``, written last."""
    files = {str(p.relative_to(folder)): file_record(p) for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != MANIFEST}
    atomic_write_json(folder / MANIFEST, {"files": files})


def manifest_problem(folder: Path) -> str | None:
    """What is wrong with ``folder`` against its manifest (a missing, truncated or altered file), or None."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (an interrupted save, or a checkpoint of an older version)"
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    return next((p for name, record in files.items() if (p := file_problem(folder, name, record, full=True))), None)


def resumable_checkpoint(output_dir: str | os.PathLike, report=print) -> Path | None:
    """The newest checkpoint whose files match its manifest, or None when the run has no checkpoint.

    Each damaged newer checkpoint is named through ``report`` and skipped; when checkpoints exist but none is
    intact, :class:`RunError` names them all."""
    found = _checkpoints(output_dir)
    skipped = []
    for _, folder in reversed(found):
        problem = manifest_problem(folder)
        if problem is None:
            if skipped:
                report(f"warning: skipped the damaged checkpoint(s) {'; '.join(skipped)}; resuming from "
                       f"{folder.name}")
            return folder
        skipped.append(f"{folder.name} ({problem})")
    if skipped:
        raise RunError(f"no intact checkpoint in {Path(output_dir) / 'checkpoints'}: {'; '.join(skipped)}. Delete "
                       f"the damaged folders to start this run again from step 0, or train into another --output-dir")
    return None


def sharded_problem(folder: Path) -> str | None:
    """What is missing from the sharded (DCP) parts of a checkpoint folder: every file that a ``.metadata`` names,
    at least as long as the data it places there; None when all are there (or the folder holds no DCP part)."""
    from torch.distributed.checkpoint import FileSystemReader

    for meta in sorted(Path(folder).rglob(".metadata")):
        part = meta.parent
        needed: dict[str, int] = {}
        for info in FileSystemReader(str(part)).read_metadata().storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for rel, size in sorted(needed.items()):
            path = part / rel
            if not path.is_file() or path.stat().st_size < size:
                return (f"{path.relative_to(folder)} is missing or short: a rank's shard did not reach the folder the "
                        f"main process sees. With several nodes, --output-dir must be on a filesystem shared by all "
                        f"of them")
    return None


def finalize_checkpoint(tmp: Path, final: Path, keep: int) -> None:
    """Write the manifest of a fully written checkpoint folder and rename it into place (the atomic step), then
    prune to the newest ``keep``. A sharded checkpoint must hold every rank's shard (:class:`RunError` otherwise)."""
    problem = sharded_problem(tmp)
    if problem is not None:
        raise RunError(f"the checkpoint {final.name} is incomplete: {problem}")
    write_manifest(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep and keep > 0:
        for _, p in _checkpoints(final.parent.parent)[:-keep]:
            shutil.rmtree(p, ignore_errors=True)


def clean_temporary_checkpoints(output_dir: str | os.PathLike) -> None:
    root = Path(output_dir) / "checkpoints"
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".tmp"):
                shutil.rmtree(p, ignore_errors=True)


WEIGHT_FILE = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")


def publish_model_folder(staged: Path, dest: Path) -> None:
    """Move the files of a fully written ``save_pretrained`` folder ``staged`` into ``dest``.

    ``dest`` also holds the run's checkpoints and logs, so it cannot be swapped whole; instead its ``config.json``
    (what makes a folder load) is removed first and the new one moved in last, so a kill at any moment leaves
    either the previous complete model, no loadable model, or the new complete one. Weight files of an earlier
    save that the new one lacks (other shards) are removed."""
    (dest / "config.json").unlink(missing_ok=True)
    new = {p.name for p in staged.iterdir()}
    for p in dest.iterdir():
        if WEIGHT_FILE.match(p.name) and p.name not in new:
            p.unlink()
    for p in sorted(staged.iterdir(), key=lambda p: p.name == "config.json"):
        os.replace(p, dest / p.name)
    staged.rmdir()


# ----------------------------------------------------------------------------------------------- metrics


def read_metrics(path: str | os.PathLike) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill
                continue
    return rows


def truncate_metrics(path: str | os.PathLike, step: int) -> None:
    """Drop rows logged after ``step`` (a resumed run logs those steps again)."""
    path = Path(path)
    if not path.exists():
        return
    rows = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def write_result(out: str | os.PathLike, result: dict, plot) -> Path:
    """Write a script's ``result`` as JSON at ``out`` and its figure, ``plot(result, png)``, beside it (same stem,
    ``.png``); returns the PNG's path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result)
    png = out.with_suffix(".png")
    plot(result, png)
    return png


def log_axes(ax, xlabel: str, ylabel: str) -> None:
    """The benchmark figures' axes: log-2 x, log y, labels and a light grid."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def plot_loss(metrics_path: str | os.PathLike, png_path: str | os.PathLike, title: str = "") -> None:
    """Training loss (and validation loss points) against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", ms=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- model card


def _yaml_list(items: list[str]) -> str:
    return "".join(f"\n- {json.dumps(str(i))}" for i in items) if items else " []"


def render_model_card(info: dict, template: str | os.PathLike = MODEL_CARD_TEMPLATE) -> str:
    """Fill ``model_card.md`` beside this module (``{{key}}`` placeholders) from a run's ``info``.

    Expected keys: ``model_name``, ``mixer``, ``model_type``, ``params``, ``config_name``, ``data``,
    ``datasets`` (Hub dataset ids, may be empty), ``tokenizer``, ``steps``, ``tokens``, ``seq_len``,
    ``batch_size``, ``lr``, ``val_loss``, ``val_ppl``, ``dataset_name``, ``train_command``, ``repo_id``,
    ``base_tags``. Missing values render as ``n/a``.
    """
    text = Path(template).read_text()
    values = dict(info)
    values.setdefault("datasets_yaml", _yaml_list(values.get("datasets") or []))
    values.setdefault("tags_yaml", _yaml_list(values.get("tags") or []))
    for key in ("val_loss", "val_ppl"):
        if isinstance(values.get(key), float):
            values[key] = f"{values[key]:.4f}"

    def sub(m: re.Match) -> str:
        v = values.get(m.group(1))
        return "n/a" if v is None else str(v)

    out = re.sub(r"\{\{\s*([A-Za-z0-9_]+)\s*\}\}", sub, text)
    if "model-index" in out and values.get("val_ppl") is None:
        # no eval result: drop the model-index block rather than publish n/a metrics
        out = re.sub(r"model-index:\n(?:[ -].*\n)+", "", out)
    return out


# ------------------------------------------------------------------------------------- multi-process on CPU

_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")


def _flag(args: list[str], *names: str) -> str | None:
    """The value of the last ``--name value`` / ``--name=value`` of ``args``, else None."""
    found = None
    for i, a in enumerate(args):
        for flag in names:
            if a == flag and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(flag + "="):
                found = a.split("=", 1)[1]
    return found


def _parent_launch() -> tuple[list[str], dict] | None:
    """The parent ``accelerate launch`` command line and the settings of its ``--config_file`` (Linux /proc), else
    None."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    args = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    if not any("accelerate" in a for a in args[:3]):
        return None
    config: dict = {}
    path = _flag(args, "--config_file", "--config-file")
    if path:
        try:  # relative to the launcher's working folder
            config = _read_config_file(Path(f"/proc/{os.getppid()}/cwd") / path)
        except Exception:  # unreadable: the launcher has said so already
            config = {}
    return args, config


def _requested_processes_from_parent() -> int | None:
    """``--num_processes N`` of the parent ``accelerate launch`` command line or its config file, else None."""
    parent = _parent_launch()
    if parent is None:
        return None
    args, config = parent
    n = _flag(args, "--num_processes", "--num-processes")
    n = n if n is not None else config.get("num_processes")
    return int(n) if n is not None else None


def _fsdp_settings_from_parent() -> dict | None:
    """The FSDP settings (``fsdp_config`` keys) the parent ``accelerate launch`` asked for, through its config file
    (``distributed_type: FSDP``) or ``--use_fsdp``, with its ``--fsdp_*`` flags on top; None when it asked for none.
    Accelerate's CPU launcher drops them (it passes no FSDP variables to the processes)."""
    parent = _parent_launch()
    if parent is None:
        return None
    args, config = parent
    if config.get("distributed_type") != "FSDP" and "--use_fsdp" not in args:
        return None
    settings = dict(config.get("fsdp_config") or {})
    for i, a in enumerate(args[:-1]):
        if a.startswith("--fsdp_") and "=" not in a:
            settings[a[2:]] = args[i + 1]
    return settings


def relaunch_cpu_processes_if_needed(script: str | os.PathLike, argv: list[str]) -> None:
    """Make ``accelerate launch --num_processes N --cpu script.py`` start N processes.

    Accelerate's launcher runs multi-process CPU jobs only through ``mpirun`` (``--mpirun_hostfile``); without it
    ``--cpu --num_processes N`` starts ONE process (with ``MASTER_ADDR`` set and no rank variables). In that case
    this replaces the current process by ``python -m torch.distributed.run --nproc_per_node N script.py ...`` with
    ``ACCELERATE_USE_CPU=true``, which Accelerate runs as ``MULTI_CPU`` over gloo. When the launch asked for FSDP
    (a config file with ``distributed_type: FSDP``, or ``--use_fsdp``), its settings are passed on as the FSDP_*
    variables Accelerate's GPU launcher would set, so that the script shards (:func:`enable_fsdp_on_cpu`) instead of
    silently running DDP. Does nothing otherwise.
    """
    env = os.environ
    if env.get("ACCELERATE_USE_CPU", "").lower() not in ("true", "1", "yes") or "MASTER_ADDR" not in env:
        return
    if any(v in env for v in _RANK_VARS) or env.get("HF_RESOLVENT_RELAUNCHED"):
        return
    n = _requested_processes_from_parent()
    if not n or n < 2:
        return
    port = env.get("MASTER_PORT", "29500")
    if port in ("", "0"):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr",
           env["MASTER_ADDR"], "--master_port", port, str(script), *argv]
    fsdp = _fsdp_settings_from_parent()
    print(f"[hf_resolvent] accelerate launch --cpu --num_processes {n} starts one process without mpirun; "
          f"starting {n} CPU processes with torch.distributed.run (gloo) instead"
          + (", with the FSDP settings of the launch" if fsdp is not None else ""), flush=True)
    new_env = {**env, "HF_RESOLVENT_RELAUNCHED": "1", "ACCELERATE_USE_CPU": "true",
               **(fsdp_env(fsdp) if fsdp is not None else {})}
    new_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or n) // n)))
    sys.stdout.flush()
    os.execve(sys.executable, cmd, new_env)


# ------------------------------------------------------------------------------------------ FSDP2 and memory

# The fsdp_config of scripts/accelerate/fsdp_8gpu.yaml (a test keeps the two equal): FSDP2, one shard group per
# transformer block (the class names of both model types; the model's own are kept), parameters, gradients and
# optimizer state fully sharded, sharded checkpoints through torch.distributed.checkpoint (DCP).
FSDP_SETTINGS = {
    "fsdp_version": 2,
    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "fsdp_transformer_layer_cls_to_wrap": "ResolventBlock,GPT2Block",
    "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    "fsdp_cpu_ram_efficient_loading": True,
    "fsdp_reshard_after_forward": True,
    "fsdp_activation_checkpointing": False,
}


def fsdp_env(settings: dict) -> dict[str, str]:
    """The variables ``accelerate launch`` gives its processes for an ``fsdp_config`` (``FSDP_*``, read by
    ``FullyShardedDataParallelPlugin``)."""
    env = {"ACCELERATE_USE_FSDP": "true"}
    for key, value in settings.items():
        name = key.removeprefix("fsdp_").upper().replace("TRANSFORMER_LAYER_CLS_TO_WRAP", "TRANSFORMER_CLS_TO_WRAP")
        env[f"FSDP_{name}"] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def fsdp_plugin(settings: dict | None = None):
    """Accelerate's FSDP plugin for ``settings`` (``fsdp_config`` keys), or, when None, for the FSDP_* variables an
    ``accelerate launch`` set. Only FSDP2 is supported (:class:`ConfigError` otherwise)."""
    from unittest import mock

    from accelerate.utils import FullyShardedDataParallelPlugin

    env = fsdp_env(settings) if settings is not None else {}
    version = env.get("FSDP_VERSION", os.environ.get("FSDP_VERSION", "1"))  # Accelerate's default is 1
    if version != "2":
        raise ConfigError(f"FSDP version {version} was asked for; this script shards with FSDP2 only: set "
                          f"fsdp_version: 2 in the accelerate config (as scripts/accelerate/fsdp_8gpu.yaml does)")
    with mock.patch.dict(os.environ, env):
        return FullyShardedDataParallelPlugin()


def fit_wrap_classes(plugin, model) -> list[str]:
    """Keep the plugin's wrap classes that ``model`` has: the GPU config names the blocks of both model types, and
    Accelerate refuses a class the model lacks. :class:`ConfigError` when none is left."""
    names = plugin.transformer_cls_names_to_wrap
    if plugin.auto_wrap_policy is None or not names:
        return list(names or [])
    present = {type(m).__name__ for m in model.modules()}
    keep = [n for n in names if n in present]
    if not keep:
        blocks = getattr(model, "_no_split_modules", None)
        raise ConfigError(f"none of the FSDP wrap classes {names} is a module of {type(model).__name__} (its blocks: "
                          f"{blocks}); set fsdp_transformer_layer_cls_to_wrap to its block class")
    plugin.transformer_cls_names_to_wrap = keep
    return keep


def enable_fsdp_on_cpu(accelerator, plugin) -> bool:
    """Run Accelerate's FSDP2 path on CPU processes (gloo); True when it switched.

    Accelerate turns an FSDP plugin into ``DistributedType.FSDP`` only on GPU-like devices: CPU processes get
    ``MULTI_CPU`` (DDP) and the plugin is dropped, silently. torch's ``fully_shard`` shards on CPU over gloo, so the
    shared state is switched to FSDP before ``prepare()``, as Accelerate does for GPUs (``AcceleratorState`` and
    ``PartialState`` both, since a later ``AcceleratorState()`` copies the latter). What follows is Accelerate's own
    FSDP2 code, the GPU path: ``prepare`` (``fully_shard`` per block), ``clip_grad_norm_``, ``save_state`` /
    ``load_state`` through DCP, ``get_state_dict``. The caller checks that the parameters are sharded after
    ``prepare``."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        return False
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True


def describe_distributed(accelerator) -> str:
    """How the run is distributed, in words: ``FSDP2, 2 processes, full shard (cpu, gloo)``,
    ``DDP, 2 processes on 2 nodes, replicated (cuda, nccl)``, ``one process, no sharding (cpu)``."""
    import torch
    from accelerate.utils import DistributedType

    n = accelerator.num_processes
    procs = f"{n} process" + ("" if n == 1 else "es")
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or n)
    if n > local:
        procs += f" on {n // local} nodes"
    where = accelerator.device.type
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        where += f", {torch.distributed.get_backend()}"
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        shard = ("full shard" if plugin.reshard_after_forward is True
                 else "gradients and optimizer state sharded, parameters kept after forward")
        return f"FSDP{plugin.fsdp_version}, {procs}, {shard} ({where})"
    if kind == DistributedType.NO:
        return f"one process, no sharding ({where})"
    if kind.value.startswith("MULTI_"):
        return f"DDP, {procs}, replicated ({where})"
    return f"{kind.value}, {procs} ({where})"


def memory_use(files) -> dict | None:
    """This process's peak resident memory (``VmHWM``) and how much of ``files`` (memory-mapped token shards) is
    resident in its mappings, in bytes; None where /proc is not Linux's."""
    try:
        status = Path("/proc/self/status").read_text()
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    peak = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    if peak is None:
        return None
    files = [Path(f).resolve() for f in files]
    targets = {str(f) for f in files}
    resident, current = 0, None
    for line in smaps.splitlines():
        fields = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            current = " ".join(fields[5:]) if len(fields) > 5 else None
        elif fields and fields[0] == "Rss:" and current in targets:
            resident += int(fields[1]) * 1024
    return {"peak_rss_bytes": int(peak.group(1)) * 1024, "shards_resident_bytes": resident,
            "shards_bytes": sum(f.stat().st_size for f in files)}
