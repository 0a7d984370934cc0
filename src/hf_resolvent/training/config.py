"""Run configs: YAML/JSON files with ``inherit:`` and dotted ``--set key=value`` overrides, read over
:data:`DEFAULTS` and checked (every numeric setting against what it allows, :data:`NUMERIC_SETTINGS`); the files of
the papers' comparison are package data in ``configs/`` (:data:`CONFIG_DIR`). Also what a run config decides beyond
its fields: the batch split over processes (:func:`batch_layout`), the data folder (:func:`recorded_data_dir`) and
what two runs must share to be compared (:func:`training_budget`); and the two errors a run reports to its user."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # package data: the runs of the papers' comparison


DEFAULTS: dict[str, Any] = {
    "model": {
        "type": "resolvent",  # resolvent | gpt2
        "preset": "tiny",  # a key of PRESETS (configuration_resolvent): the shape of both model types
        "mixer": "dense",  # pattern spec or list of specs (one per layer); ignored by gpt2
        "overrides": {},  # fields of the model's config (e.g. n_layer, resid_pdrop)
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


def read_config_file(path: Path) -> dict:
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
        data = read_config_file(path)
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
    from .models import check_overrides  # the model classes' fields: imported only when a config is read

    check_overrides(cfg["model"])
    return as_numbers(cfg)


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


def _as_number(value: Any, whole: bool) -> Any:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return value
    try:
        number = float(value)
    except ValueError:
        return value
    return int(number) if whole and number.is_integer() else number


def as_numbers(cfg: dict) -> dict:
    """``cfg`` with every numeric setting (:data:`NUMERIC_SETTINGS`) a number: YAML leaves ``1e-3`` (no decimal
    point) a string, which a run would record as one, so that a resume given ``0.001`` would look like a change."""
    out = copy.deepcopy(cfg)
    for key, (whole, _) in NUMERIC_SETTINGS.items():
        section, field = key.split(".")
        values = out.get(section)
        if isinstance(values, dict) and field in values:
            value = values[field]
            values[field] = ([_as_number(v, whole) for v in value] if isinstance(value, list)
                             else _as_number(value, whole))
    return out


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


def batch_layout(cfg: dict, world: int) -> tuple[int, int]:
    """(micro_batch, grad_accum) so that micro_batch * grad_accum * world == train.batch_size."""
    batch, micro = int(cfg["train"]["batch_size"]), int(cfg["train"]["micro_batch"])
    micro = min(micro, max(1, batch // world))
    if batch % (micro * world):
        raise ConfigError(f"train.batch_size={batch} is not a multiple of train.micro_batch={micro} x {world} "
                          f"processes; change one of them")
    return micro, batch // (micro * world)


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
