"""Configuration of resolvent language models: a GPT-2 backbone whose attention is a resolvent mixer.

Each layer's token mixer is Y = (I - B)^-1 A X with a sparsity pattern of :mod:`hf_resolvent.patterns`
(docs/DESIGN.md sections 1 and 2). The ``mixer`` field names it, for all layers at once or one per layer.

This file is copied into saved model folders (remote code): it may import only flat sibling modules.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import PretrainedConfig
from transformers.utils import CONFIG_NAME

from .patterns import get_pattern

__all__ = ["ResolventConfig", "parse_mixer_spec", "GATE_INITS", "MIXER_IMPLS", "PRESETS"]

# Gate initialisations, see ResolventConfig. A float in (0, 1) is accepted too.
GATE_INITS = ("mamba2", "closed")
# The choices of hf_resolvent.ops.dispatch.IMPLS (a test holds the two equal; this file ships without ops).
MIXER_IMPLS = ("auto", "torch", "cpu", "triton")
# "closed" starts with g = exp(-16) ~ 1.1e-7 for every token: the layer is its direct channel A (plus ~1e-7),
# yet the gate keeps a non-zero gradient in log space (d log g / d A_log = -16), so fine-tuning can open it.
CLOSED_GATE_VALUE = math.exp(-16.0)


class _LastId:
    """The default of ``bos_token_id`` and ``eos_token_id``: GPT-2's convention, the last id of the vocabulary
    (50256 for its 50257 tokens), whatever ``vocab_size`` is."""

    def __repr__(self) -> str:
        return "vocab_size - 1"


LAST_ID = _LastId()

PRESETS: dict[str, dict[str, Any]] = {
    # The papers' sizes (docs/DESIGN.md section 5).
    "44m": {"n_layer": 6, "n_embd": 512, "n_head": 8, "n_inner": 2048, "n_positions": 512},
    "355m": {"n_layer": 24, "n_embd": 1024, "n_head": 16, "n_inner": 4096, "n_positions": 2048},
    # Small enough to train for a few hundred steps on a laptop CPU in minutes (the first command of the README).
    "tiny": {"n_layer": 4, "n_embd": 128, "n_head": 4, "n_inner": 512, "n_positions": 256},
}


def _check_gate_init(value: Any, where: str) -> str | float:
    if isinstance(value, str) and value in GATE_INITS:
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 < float(value) < 1.0:
        return float(value)
    raise ValueError(
        f"{where}: gate_init must be one of {GATE_INITS} or a number in (0, 1) (the gate value at "
        f"initialisation), got {value!r}"
    )


def parse_mixer_spec(spec: Any, default_gate_init: str | float = "mamba2", where: str = "mixer") -> dict[str, Any]:
    """Normalise one layer's mixer spec to ``{"pattern": str, "tied": bool, "gate_init": str | float}``.

    Accepted forms: a pattern string of :func:`hf_resolvent.patterns.get_pattern` (``"exp2:ce"``, ``"dense"``,
    ``"attention"``, ``"banded:8"``, ``"f:k**2+1:ce"``, ...) optionally followed by ``"+tied"`` (the tied variant
    A = B D + D', paper B.3); or a dict with keys ``pattern`` (required), ``tied`` and ``gate_init``.
    Raises ValueError naming ``where`` (the config field) and the fix.
    """
    if isinstance(spec, str):
        text = spec.strip()
        tied = False
        if text.endswith("+tied"):
            tied, text = True, text[: -len("+tied")].strip()
        spec = {"pattern": text, "tied": tied}
    if not isinstance(spec, dict):
        raise ValueError(
            f"{where}: a mixer spec is a pattern string such as 'exp2:ce' or 'dense+tied', or a dict "
            f"{{'pattern': ..., 'tied': ..., 'gate_init': ...}}; got {type(spec).__name__}"
        )
    unknown = set(spec) - {"pattern", "tied", "gate_init"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} in mixer spec; allowed: pattern, tied, gate_init")
    if "pattern" not in spec or not isinstance(spec["pattern"], str):
        raise ValueError(f"{where}: the mixer spec needs a 'pattern' string such as 'exp2:ce', got {spec!r}")
    try:
        pattern = get_pattern(spec["pattern"])
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    tied = spec.get("tied", False)
    if not isinstance(tied, bool):
        raise ValueError(f"{where}: 'tied' must be true or false, got {tied!r}")
    if tied and not pattern.has_recurrence:
        raise ValueError(
            f"{where}: the tied variant needs a recurrent pattern (B != 0), but {pattern.name!r} has none; "
            "drop '+tied' or use e.g. 'exp2:ce+tied'"
        )
    gate_init = _check_gate_init(spec.get("gate_init", default_gate_init), where)
    return {"pattern": pattern.name, "tied": tied, "gate_init": gate_init}


# The largest size a config may ask for, per field: far past any model trained today, small enough that a damaged or
# mistyped config.json (n_layer: 1000000) is refused by name instead of building for minutes or failing in the
# allocator.
SIZE_BOUNDS = {
    "vocab_size": 2**24,
    "n_positions": 2**31 - 1,
    "n_embd": 2**16,
    "n_layer": 2**10,
    "n_head": 2**12,
    "head_dim": 2**12,
    "n_inner": 2**19,
    "conv_size": 2**10,
}
# Rows of a learned position table (position_embedding="learned"), which is allocated whole.
LEARNED_POSITIONS_BOUND = 2**21

POSITION_EMBEDDINGS = ("rope", "learned", "none")  # see ResolventConfig's position_embedding
ROPE_CHANNELS = ("ab", "a", "b")  # see ResolventConfig's rope_channels

class ResolventConfig(PretrainedConfig):
    r"""Configuration of :class:`~hf_resolvent.ResolventModel` and :class:`~hf_resolvent.ResolventForCausalLM`.

    The backbone is GPT-2's (pre-norm blocks, GELU MLP, tied embeddings); each block's attention is replaced by
    a resolvent mixer. Field names follow :class:`transformers.GPT2Config`, with the usual aliases
    (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``max_position_embeddings``).

    Args:
        vocab_size: vocabulary size (50257, GPT-2's tokenizer).
        n_positions: the context the model is made for (pattern positions, padding excluded): the rows of a learned
            position table, which ends there; RoPE models run past it (with the scaling of ``rope_parameters``,
            if any, which takes it as the original context).
        n_embd: model width.
        n_layer: number of blocks.
        n_head: heads per mixer.
        head_dim: width of each head, default ``n_embd // n_head`` (then n_embd must be divisible by n_head); given,
            the mixer projects n_embd to n_head * head_dim and back, as Llama-style configs do.
        n_inner: MLP width, default ``4 * n_embd``.
        activation_function: MLP activation (a key of ``transformers.activations.ACT2FN``).
        resid_pdrop, embd_pdrop: dropout after each mixer / MLP and on the embeddings.
        layer_norm_epsilon: LayerNorm epsilon.
        initializer_range: std of the normal initialisation of weights.
        position_embedding: ``"rope"`` (rotary, on all four queries/keys), ``"learned"`` (GPT-2's table) or
            ``"none"`` (no position encoding: order reaches the model only through causality and the mixer's
            pattern, as in an SSM; nothing bounds the length).
        rope_channels: with ``"rope"``, the channels whose queries and keys RoPE rotates: ``"ab"`` both (the
            default), ``"a"`` the direct channel only (``qa``, ``ka``: attention layers keep their positions) or
            ``"b"`` the feedback channel only (``qb``, ``kb``: attention layers then see no position). The inputs
            ``x`` are never rotated.
        rope_theta: RoPE base.
        rope_parameters: RoPE as ``transformers`` models take it: ``{"rope_type": ..., "rope_theta": ..., ...}`` with a
            ``rope_type`` of ``"default"`` or any of ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``
            (``"linear"``, ``"dynamic"``, ``"yarn"``, ``"llama3"``, ``"longrope"``, ...), to extend the context after
            training (raise ``n_positions`` with it). The legacy ``rope_scaling`` keyword is accepted too.
        mixer: the token mixer: one spec for every layer or a list with one spec per layer. A spec is a pattern
            string (``"attention"``, ``"local_attention:64"``, ``"dense"``, ``"banded:8"``, ``"diagonal"``,
            ``"exp2"``, ``"exp2:ce"``, ``"square:ce"``, ``"f:k**3+1"``, ...) with an optional ``"+tied"``
            suffix, or a dict ``{"pattern": ..., "tied": bool, "gate_init": ...}``.
        gate_init: default gate initialisation of resolvent layers: ``"mamba2"`` (g = exp(-softplus(w.u +
            dt_bias) exp(A_log)), softplus(dt_bias) log-uniform in [1e-3, 1e-1], exp(A_log) uniform in [1, 16]),
            ``"closed"`` (g = e^-16 ~ 1.1e-7 at start, input-independent: the layer starts as its direct channel,
            used by :meth:`ResolventForCausalLM.from_gpt2`) or a float v in (0, 1) (g = v at start).
        conv_size: width K of a short depthwise causal convolution on every projected part the mixer reads (queries,
            keys and inputs), as fla's ``use_short_conv`` and Mamba's ``d_conv`` put one: each part at token i becomes
            SiLU of a per-channel weighted sum of its values at tokens i - K + 1 .. i, so one layer sees the last few
            tokens at once. 0 (default) is off; otherwise at least 2. Weights start as PyTorch's ``nn.Conv1d``
            (uniform in +-1/sqrt(K), bias likewise). Its decode state is the last K - 1 projected rows per layer.
        bos_token_id, eos_token_id: default ``vocab_size - 1`` (GPT-2's ``<|endoftext|>`` for its vocabulary); ids
            (and ``pad_token_id``) must lie in the vocabulary, or be None.
        tie_word_embeddings: share the input embedding and the LM head.
        mixer_impl: which code runs the mixers, passed as ``impl`` to the ops (``hf_resolvent/ops/dispatch.py``):
            ``"auto"`` (default: the environment variable ``HF_RESOLVENT_MIXER_IMPL`` if set, else the Triton
            kernels for CUDA tensors, the compiled CPU kernels on CPU, PyTorch elsewhere), ``"torch"``, ``"cpu"``,
            ``"triton"``: a backend, as ``attn_implementation`` names one. A runtime choice: override it with
            ``from_pretrained(..., mixer_impl=...)``.
        chunk_size_feed_forward: ``transformers``' name for the rows each block's position-wise half (LayerNorm, MLP,
            residual) takes at a time in a sequence longer than it (default 1024), so that the MLP's activations stay
            in the processor's caches during a long prefill; 0 takes the whole sequence at once. The same function
            either way (to rounding); a runtime choice like ``mixer_impl``.
    """

    model_type = "resolvent"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    attribute_map = {
        "hidden_size": "n_embd",
        "max_position_embeddings": "n_positions",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
        "intermediate_size": "n_inner",
    }

    def __init__(
        self,
        vocab_size: int = 50257,
        n_positions: int = 1024,
        n_embd: int = 768,
        n_layer: int = 12,
        n_head: int = 12,
        n_inner: int | None = None,
        activation_function: str = "gelu_new",
        resid_pdrop: float = 0.1,
        embd_pdrop: float = 0.1,
        layer_norm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        position_embedding: str = "rope",
        rope_channels: str = "ab",
        rope_theta: float = 10000.0,
        rope_parameters: dict | None = None,
        head_dim: int | None = None,
        mixer: Any = "exp2:ce",
        gate_init: str | float = "mamba2",
        conv_size: int = 0,
        use_cache: bool = True,
        bos_token_id: int | None = LAST_ID,
        eos_token_id: int | list[int] | None = LAST_ID,
        pad_token_id: int | None = None,
        tie_word_embeddings: bool = True,
        mixer_impl: str = "auto",
        chunk_size_feed_forward: int = 1024,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.n_positions = n_positions
        self.n_embd = n_embd
        self.n_layer = n_layer
        self.n_head = n_head
        self.n_inner = n_inner
        self.activation_function = activation_function
        self.resid_pdrop = resid_pdrop
        self.embd_pdrop = embd_pdrop
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.position_embedding = position_embedding
        self.rope_channels = rope_channels
        self.rope_theta = rope_theta
        self.rope_parameters = dict(rope_parameters) if rope_parameters else None  # standardized by the base class
        self.head_dim = head_dim
        self.mixer = list(mixer) if isinstance(mixer, tuple) else mixer
        self.gate_init = gate_init
        self.use_cache = use_cache
        bos_token_id = vocab_size - 1 if bos_token_id is LAST_ID and isinstance(vocab_size, int) else bos_token_id
        eos_token_id = vocab_size - 1 if eos_token_id is LAST_ID and isinstance(vocab_size, int) else eos_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.tie_word_embeddings = tie_word_embeddings
        self.mixer_impl = mixer_impl
        self.chunk_size_feed_forward = chunk_size_feed_forward
        self.conv_size = conv_size
        self._validate()
        if self.head_dim is None:
            self.head_dim = n_embd // n_head
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            chunk_size_feed_forward=chunk_size_feed_forward,
            **kwargs,
        )
        self._validate_rope()

    # ----------------------------------------------------------------------------------------------
    def _validate(self) -> None:
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            positive_int(name)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            for token in value if isinstance(value, list) else [value]:
                if token is not None and (isinstance(token, bool) or not isinstance(token, int)
                                          or not 0 <= token < self.vocab_size):
                    raise ValueError(
                        f"{name} = {value!r} lies outside the vocabulary (vocab_size = {self.vocab_size}: ids 0 to "
                        f"{self.vocab_size - 1}); give your tokenizer's id (e.g. {name}=tokenizer.{name}), or None")
        if self.n_inner is not None:
            positive_int("n_inner")
        if self.head_dim is not None:
            positive_int("head_dim")
        elif self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); pick n_head among the divisors, "
                "or give head_dim"
            )
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(f"position_embedding must be one of {', '.join(map(repr, POSITION_EMBEDDINGS))}, got "
                             f"{self.position_embedding!r}")
        if type(self.conv_size) is not int or self.conv_size == 1 or self.conv_size < 0:
            raise ValueError(f"conv_size must be 0 (no convolution) or a width of at least 2, got {self.conv_size!r}")
        for name, bound in SIZE_BOUNDS.items():
            value = getattr(self, name)
            if value is not None and value > bound:
                raise ValueError(f"{name} = {value:,} is over the largest size a config may ask for ({bound:,}): the "
                                 f"config is damaged or mistyped; give a smaller {name}")
        if self.position_embedding == "learned" and self.n_positions > LEARNED_POSITIONS_BOUND:
            raise ValueError(f"n_positions = {self.n_positions:,} rows of a learned position table is over the bound "
                             f"of {LEARNED_POSITIONS_BOUND:,}; give a smaller n_positions, or position_embedding="
                             f"'rope' (RoPE allocates no table and runs past n_positions)")
        if self.rope_channels not in ROPE_CHANNELS:
            raise ValueError(f"rope_channels must be one of {', '.join(map(repr, ROPE_CHANNELS))} (the channels whose "
                             f"queries and keys RoPE rotates), got {self.rope_channels!r}")
        head_dim = self.head_dim or self.n_embd // self.n_head
        if self.position_embedding == "rope" and head_dim % 2:
            raise ValueError(f"position_embedding='rope' needs an even head width, got head_dim = {head_dim}")
        if not isinstance(self.rope_theta, (int, float)) or self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be a positive number, got {self.rope_theta!r}")
        for name in ("resid_pdrop", "embd_pdrop"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be a dropout probability in [0, 1), got {value!r}")
        if not isinstance(self.layer_norm_epsilon, (int, float)) or self.layer_norm_epsilon <= 0:
            raise ValueError(f"layer_norm_epsilon must be positive, got {self.layer_norm_epsilon!r}")
        from transformers.activations import ACT2FN

        if self.activation_function not in ACT2FN:
            raise ValueError(
                f"activation_function {self.activation_function!r} is unknown; use one of transformers' ACT2FN keys "
                "such as 'gelu_new' or 'gelu'"
            )
        value = self.chunk_size_feed_forward
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"chunk_size_feed_forward must be a whole number of rows (0: no chunks), got {value!r}")
        if self.mixer_impl in ("parallel", "graph", "reference", "recurrent"):
            raise ValueError(f"mixer_impl={self.mixer_impl!r} names a form of the mixer, not a backend: a model runs "
                             f"the form its backend needs; choose one of {MIXER_IMPLS} (the forms are functions of "
                             "hf_resolvent.ops, for tests and oracles)")
        if self.mixer_impl not in MIXER_IMPLS:
            raise ValueError(
                f"mixer_impl must be one of {MIXER_IMPLS} (see hf_resolvent/ops/dispatch.py), got {self.mixer_impl!r}"
            )
        _check_gate_init(self.gate_init, "gate_init")
        self.layer_mixers  # noqa: B018 - parses and validates every layer's spec

    def _validate_rope(self) -> None:
        """After the base class has standardized ``rope_parameters`` (from ``rope_theta`` and a legacy
        ``rope_scaling``): a known type, and transformers' own checks of its parameters."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"rope_parameters['rope_type'] must be 'default' or one of {sorted(ROPE_INIT_FUNCTIONS)}, "
                             f"got {rope_type!r}")
        self.validate_rope()
        self.rope_theta = self.rope_parameters["rope_theta"]  # one value, wherever it was given

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict[str, Any], dict[str, Any]]:
        """``PretrainedConfig.get_config_dict``, refusing a folder without config.json: transformers would build a
        default config (768 wide, ``mixer="exp2:ce"``) and load the weights into it."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if not config_dict:
            raise OSError(
                f"{pretrained_model_name_or_path} has no {CONFIG_NAME} (or an empty one): a model folder needs the "
                f"{CONFIG_NAME} that save_pretrained writes beside the weights (sizes, mixer per layer). Restore it, "
                "or pass the model's config explicitly: from_pretrained(path, config=ResolventConfig(...))"
            )
        return config_dict, kwargs

    @property
    def layer_mixers(self) -> list[dict[str, Any]]:
        """One normalised spec per layer: ``{"pattern": str, "tied": bool, "gate_init": str | float}``."""
        if isinstance(self.mixer, list):
            if len(self.mixer) != self.n_layer:
                raise ValueError(
                    f"mixer is a list of {len(self.mixer)} specs but n_layer = {self.n_layer}; give one spec per "
                    "layer or a single spec for all layers"
                )
            specs = self.mixer
            return [parse_mixer_spec(s, self.gate_init, f"mixer[{i}]") for i, s in enumerate(specs)]
        spec = parse_mixer_spec(self.mixer, self.gate_init, "mixer")
        return [dict(spec) for _ in range(self.n_layer)]

    @classmethod
    def from_preset(cls, name: str, mixer: Any = "exp2:ce", **overrides) -> ResolventConfig:
        """Config of a named size: ``"44m"`` (6 x 512, ff 2048, 8 heads, ctx 512), ``"355m"`` (24 x 1024, ff 4096,
        16 heads, ctx 2048) or ``"tiny"`` (4 x 128, ff 512, 4 heads, ctx 256), with any ``mixer`` and overrides."""
        key = str(name).lower()
        if key not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
        fields = dict(PRESETS[key])
        fields.update(overrides)
        return cls(mixer=mixer, **fields)
