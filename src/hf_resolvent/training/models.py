"""The models of the papers' comparison: ``resolvent`` models with any mixer and the GPT-2 baseline
(``transformers.GPT2LMHeadModel`` with SDPA) at the same shape (:func:`build_model`), the next-token loss they are
trained and evaluated on (:func:`lm_loss`), what their decode cache holds (:func:`cache_bytes`), and how tables,
plots and file names call them (:func:`model_label`, :func:`mixer_slug`, :func:`complexity_of`)."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from ..configuration_resolvent import PRESETS
from .config import ConfigError

# The mixers of the papers' comparison (Table 1 / Figure 4), as core-library pattern specs.
PAPER_MIXERS = ["attention", "local_attention:8", "dense", "banded:8", "diagonal", "exp2", "exp2:ce", "square",
                "square:ce"]


def mixer_slug(spec: str | list) -> str:
    """File-name form of a mixer spec: ``exp2:ce`` -> ``exp2_ce``, ``local_attention:8`` -> ``local_attention_8``."""
    if isinstance(spec, (list, tuple)):
        return "-".join(mixer_slug(s) for s in spec)
    return re.sub(r"[^A-Za-z0-9]+", "_", str(spec)).strip("_")


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of windows ``batch`` (B, L + 1): inputs [:, :-1], targets [:, 1:]."""
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def build_model(model_cfg: dict, vocab_size: int, seq_len: int, eos_token_id: int | None = None):
    """A freshly initialised causal LM for a run config's ``model`` section.

    ``type: gpt2`` builds ``transformers.GPT2LMHeadModel`` (SDPA attention, learned positions) with the shape of
    ``PRESETS[preset]``; ``type: resolvent`` builds ``hf_resolvent.ResolventForCausalLM`` from
    ``ResolventConfig.from_preset(preset, mixer=...)``. ``overrides`` (GPT-2 field names: ``n_layer``,
    ``n_embd``, ``resid_pdrop``, ...) are passed to the config either way; dropout defaults to 0.
    """
    check_overrides(model_cfg)
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
    from .. import ResolventConfig, ResolventForCausalLM

    config = ResolventConfig.from_preset(model_cfg.get("preset", "tiny"), mixer=model_cfg["mixer"],
                                         vocab_size=vocab, **overrides)
    for name in ("n_positions", "max_position_embeddings"):
        if hasattr(config, name) and getattr(config, name) < seq_len:
            setattr(config, name, seq_len)
    return ResolventForCausalLM(config)


# model.overrides that build_model sets from elsewhere: naming them there would be a second, conflicting value
SET_ELSEWHERE = {
    "vocab_size": "the tokenizer sets it (rounded up to model.pad_vocab_multiple)",
    "mixer": "it is model.mixer (--mixer)",
}


def _config_class(kind: str):
    if kind == "gpt2":
        from transformers import GPT2Config

        return GPT2Config
    from .. import ResolventConfig

    return ResolventConfig


def config_fields(kind: str) -> set[str]:
    """The fields a model config of ``kind`` (``resolvent`` or ``gpt2``) takes: its constructor's arguments, those
    of ``PretrainedConfig``, and their aliases (``hidden_size`` for ``n_embd``, ...)."""
    import inspect

    from transformers import PretrainedConfig

    cls = _config_class(kind)
    names = {name for c in (cls, PretrainedConfig) for name, param in inspect.signature(c.__init__).parameters.items()
             if param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL) and name != "self"}
    return names | set(cls.attribute_map)


def check_overrides(model_cfg: dict) -> None:
    """Refuse a ``model.overrides`` key the model config does not take (a misspelt field would be stored and ignored,
    and the preset's value used) or one that another setting gives (:data:`SET_ELSEWHERE`), naming it."""
    import difflib

    kind, overrides = model_cfg.get("type"), model_cfg.get("overrides") or {}
    if kind not in ("resolvent", "gpt2"):
        raise ConfigError(f"model.type must be 'resolvent' or 'gpt2', got {kind!r}")
    if not isinstance(overrides, dict):
        raise ConfigError(f"model.overrides must be a mapping of config fields (e.g. {{n_layer: 4}}), got "
                          f"{overrides!r}")
    fields = config_fields(kind)
    for key in overrides:
        if key in SET_ELSEWHERE:
            raise ConfigError(f"model.overrides.{key} cannot be set: {SET_ELSEWHERE[key]}; leave it out")
        if key not in fields:
            close = difflib.get_close_matches(str(key), sorted(fields), n=1)
            hint = f"did you mean {close[0]}?" if close else f"the fields are those of {_config_class(kind).__name__}"
            raise ConfigError(f"model.overrides.{key} is not a field of a {kind} model's config ({hint}); the preset's "
                              f"value would be used instead")
    for alias, field in _config_class(kind).attribute_map.items():
        if alias in overrides and field in overrides:
            raise ConfigError(f"model.overrides gives both {alias} and {field}, two names of one field; keep one")


def model_label(model_cfg: dict) -> str:
    """``gpt2`` or the mixer spec (``dense``, ``exp2:ce``, ...) for tables and plots."""
    if model_cfg["type"] == "gpt2":
        return "gpt2"
    mixer = model_cfg["mixer"]
    return ",".join(mixer) if isinstance(mixer, (list, tuple)) else str(mixer)


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


def cache_bytes(model, n: int, device) -> int:
    """Bytes of the decode cache after a prefill of ``n`` tokens (batch 1)."""
    from ..modeling_resolvent import CACHE_NAME  # the cache's field name in this transformers

    ids = torch.zeros(1, n, dtype=torch.long, device=device)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True)[CACHE_NAME]
    if callable(getattr(cache, "nbytes", None)):
        return int(cache.nbytes())
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
