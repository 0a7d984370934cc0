"""Resolvent language models for ``transformers``: GPT-2 blocks whose attention is a resolvent token mixer.

Each block computes, per head, Y = (I - B)^-1 A X (docs/DESIGN.md section 1) with

- values x = W_x u, two query/key pairs (q^A, k^A) and (q^B, k^B) with RoPE on all four (or GPT-2's learned
  position table), masked softmaxes A~ over P^A_i and B~ over P^B_i (the layer's pattern);
- a Mamba-2 style gate g = exp(-softplus(w.u + dt_bias) * exp(A_log)) in (0, 1), A = (1 - g) A~, B = g B~;
- attention patterns (``"attention"``, ``"local_attention:w"``) have B = 0 and no gate: plain softmax attention;
- the tied variant (``"+tied"``, paper B.3) has no A scores: z = (I - B)^-1 (1 - g) x, y = z - d x with
  d = (1 - g) sigmoid(w_d.u + b_d).

Full sequences (training, prefill) run the parallel form (``ops.resolvent_mix``: PyTorch on CPU, the Triton
kernels for CUDA tensors when available); tokens after a cache run ``ops.decode_projected`` on the per-layer states
of a :class:`~hf_resolvent.ResolventCache`, built directly from the prefill (``ops.DecodeState.from_prefill``): one
decode step per token (the Triton decode kernel, RoPE and the gate included, or ``ops.recurrent_step``, chosen the
same way), or several tokens at once (``ops.extend_mix``: a chunked prefill, assisted decoding's drafts).
``config.mixer_impl`` forces a path.

Padding: a 2-D ``attention_mask`` with left padding becomes the ops' ``start`` (padded positions are never read
and positions count from the first real token, so a left-padded batch gives the same outputs as each sequence
alone); right padding needs nothing in a full forward (the mixer is causal); holes are refused.

This file is copied into saved model folders (remote code): it imports only ``torch``, ``transformers`` and flat
sibling modules. What else a saved folder holds, and why, is :mod:`.remote_code`'s.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from .cache_resolvent import ResolventCache
from .configuration_resolvent import CLOSED_GATE_VALUE, ResolventConfig
from .patterns import get_pattern
from .remote_code import (
    AUTO_MAP,
    add_architecture_record,
    check_weight_files,
    check_weight_index,
    unsafe_pickle_problem,
    write_ops_bundle,
)
from .resolvent_ops import (
    causal_conv_silu,
    decode_projected,
    gate_values,
    gelu_tanh,
    require,
    resolvent_mix,
    rotated_parts,
    tied_weights,
)

__all__ = ["ResolventPreTrainedModel", "ResolventModel", "ResolventForCausalLM", "ResolventMixer", "ResolventBlock"]

# --------------------------------------------------------------------------------------------------
# Positions


class ResolventRotaryEmbedding(nn.Module):
    """RoPE tables from ``config.rope_parameters``: the ``"default"`` frequencies, or any scaled type of
    ``transformers``' ``ROPE_INIT_FUNCTIONS`` (linear, dynamic NTK, YaRN, llama3, ...), with their attention factor;
    dynamic types update the frequencies with the length, through ``transformers``' ``dynamic_rope_update``.
    ``inv_freq`` is a non-persistent buffer, rebuilt at load by ``PreTrainedModel._init_weights``."""

    def __init__(self, config: ResolventConfig):
        super().__init__()
        self.config = config
        if "rope_theta" not in (config.rope_parameters or {}):  # set on a built config, so never standardized
            raise ValueError(
                f"config.rope_parameters = {config.rope_parameters!r} was set after the config was built (e.g. as a "
                "from_pretrained keyword), so it lacks the defaults the config fills in; build the config with it: "
                "ResolventConfig(**{**config.to_dict(), 'rope_parameters': {...}})")
        self.rope_type = config.rope_parameters["rope_type"]
        self.max_seq_len_cached = self.original_max_seq_len = config.n_positions
        init_fn = self.compute_default_rope_parameters if self.rope_type == "default" else ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = init_fn(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: ResolventConfig, device=None, **kwargs) -> tuple[torch.Tensor, float]:
        """theta^(-2i / head_dim) for i < head_dim / 2, and an attention factor of 1."""
        dim, base = config.head_dim, config.rope_parameters["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)), 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for integer positions (B, n), each (B, n, head_dim) in float32 (x gives the device)."""
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq.to(x.device, torch.float32)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


# transformers 5.24 renamed the cache argument of forward() and generate(), and the output field, from
# ``past_key_values`` to ``cache``. The supported releases lie on both sides of the rename (pyproject.toml): forward()
# takes either name, and the generate() hooks and outputs below use the installed release's.
CACHE_NAME = "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"


def _one_cache(past_key_values: Cache | None, cache: Cache | None) -> Cache | None:
    """The cache given to forward() under either name (see :data:`CACHE_NAME`)."""
    if past_key_values is not None and cache is not None and past_key_values is not cache:
        raise ValueError("got two different caches, as past_key_values and as cache; pass one (cache= on "
                         "transformers >= 5.24, past_key_values= before)")
    return cache if cache is not None else past_key_values


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


# --------------------------------------------------------------------------------------------------
# Modules


class ResolventMixer(nn.Module):
    """One layer's token mixer (the ``attn`` of a GPT-2 block), for the layer's spec in ``config.layer_mixers``.

    Parameters: ``in_proj`` (width -> parts x width; parts ``qa, ka, x`` for attention kinds, ``qa, ka, x, qb,
    kb`` for resolvent ones, ``x, qb, kb`` tied; GPT-2's ``c_attn`` order q, k, v first), ``out_proj``, and for
    resolvent kinds the gate (``gate_proj`` width -> heads, ``dt_bias``, ``A_log``), tied, ``skip_proj``, and with
    ``config.conv_size``, ``conv`` (one causal filter per projected channel).
    """

    def __init__(self, config: ResolventConfig, layer_idx: int):
        super().__init__()
        spec = config.layer_mixers[layer_idx]
        self.layer_idx = layer_idx
        self.pattern = get_pattern(spec["pattern"])
        self.tied = spec["tied"]
        self.gate_init = spec["gate_init"]
        self.recurrent = self.pattern.has_recurrence
        self.config = config  # shared with the model: config.mixer_impl is read at every call
        self.num_heads = config.n_head
        self.head_dim = config.head_dim
        if not self.recurrent:
            self.parts = ("qa", "ka", "x")
        elif self.tied:
            self.parts = ("x", "qb", "kb")
        else:
            self.parts = ("qa", "ka", "x", "qb", "kb")
        self.rope_channels = config.rope_channels
        width, inner = config.n_embd, config.n_head * config.head_dim
        self.in_proj = nn.Linear(width, len(self.parts) * inner)
        self.out_proj = nn.Linear(inner, width)
        if self.recurrent:
            self.gate_proj = nn.Linear(width, self.num_heads, bias=False)
            self.dt_bias = nn.Parameter(torch.zeros(self.num_heads))
            self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        if self.tied:
            self.skip_proj = nn.Linear(width, self.num_heads)
        # the short causal convolution (config.conv_size): depthwise over every part, applied in _convolve
        channels = len(self.parts) * inner
        self.conv = nn.Conv1d(channels, channels, config.conv_size, groups=channels) if config.conv_size else None
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def extra_repr(self) -> str:
        return f"pattern={self.pattern.name!r}, tied={self.tied}, heads={self.num_heads}, head_dim={self.head_dim}"

    @torch.no_grad()
    def init_gate(self) -> None:
        """Initialise the gate for ``self.gate_init`` (skips parameters already loaded from a checkpoint)."""
        if not self.recurrent:
            return
        heads = self.num_heads
        if self.gate_init == "mamba2":
            log_dt = torch.empty(heads).uniform_(math.log(1e-3), math.log(1e-1))
            init.copy_(self.dt_bias, _inverse_softplus(log_dt.exp()))
            init.copy_(self.A_log, torch.empty(heads).uniform_(1.0, 16.0).log())
        else:
            value = CLOSED_GATE_VALUE if self.gate_init == "closed" else float(self.gate_init)
            # g = exp(-softplus(0 + dt_bias) * exp(A_log)) with softplus(dt_bias) = 1: g = exp(-exp(A_log)).
            init.zeros_(self.gate_proj.weight)
            init.copy_(self.dt_bias, _inverse_softplus(torch.ones(heads)))
            init.copy_(self.A_log, torch.full((heads,), math.log(-math.log(value))))

    def gate(self, u: torch.Tensor) -> torch.Tensor:
        """g (B, H, n) in (0, 1) from the block input u (B, n, width)."""
        return gate_values(self.gate_proj(u), self.dt_bias, self.A_log, u.dtype)

    def forward(self, hidden_states: torch.Tensor, rope=None, start=None, layer_cache=None) -> torch.Tensor:
        """(B, n, width) -> (B, n, width). ``rope``: (cos, sin) or None; ``start``: (B,) left padding or None;
        ``layer_cache``: this layer's :class:`~hf_resolvent.cache_resolvent.ResolventCacheLayer` or None."""
        batch, n, width = hidden_states.shape
        proj = self.in_proj(hidden_states)
        state = None if layer_cache is None else layer_cache.state
        conv_rows = None
        if self.conv is not None:
            proj, conv_rows = self._convolve(proj, start, state)
        proj = proj.view(batch, n, len(self.parts), self.num_heads, self.head_dim)
        impl = self.config.mixer_impl
        if state is not None:  # the new tokens after the state (advanced in place), all at once or one step each
            gate = (self.gate_proj(hidden_states), self.dt_bias, self.A_log) if self.recurrent else None
            y = decode_projected(state, proj, self.parts, rope, self.rope_channels, gate,
                                 self.skip_proj(hidden_states) if self.tied else None, impl=impl,
                                 conv=None if conv_rows is None else conv_rows[:, -n:])
        else:
            t = rotated_parts(proj, self.parts, self.rope_channels, rope, impl)
            g = self.gate(hidden_states) if self.recurrent else None
            d = tied_weights(g, self.skip_proj(hidden_states)) if self.tied else None
            y = resolvent_mix(t.get("qa"), t.get("ka"), t.get("qb"), t.get("kb"), t["x"], g, self.pattern, impl=impl,
                              start=start, d=d)
            if layer_cache is not None:
                layer_cache.store_prefill(self._state_rows(t, y, d, start), start, conv=conv_rows)
        out = y.transpose(1, 2).reshape(batch, n, self.num_heads * self.head_dim)
        return self.resid_dropout(self.out_proj(out))

    def _convolve(self, proj: torch.Tensor, start, state) -> tuple[torch.Tensor, torch.Tensor]:
        """SiLU of the depthwise causal convolution of the projected parts (B, n, C) over each token and the K - 1
        before it, and the rows it read (B, K - 1 + n, C), which the decode state keeps. Rows of left padding are
        zeros, so that no hidden token reaches a real one (and the first real token sees what it sees unpadded);
        after a decode state, the rows before the new tokens are the state's (new tokens there are never padding)."""
        k = self.conv.kernel_size[0]
        if state is None:
            if start is not None:
                real = torch.arange(proj.shape[1], device=proj.device)[None, :] >= start[:, None]
                proj = proj * real[..., None].to(proj.dtype)
            before = proj.new_zeros(proj.shape[0], k - 1, proj.shape[2])
        else:
            before = state.conv.to(proj.dtype)
        rows = torch.cat([before, proj], dim=1)
        return causal_conv_silu(rows, self.conv.weight, self.conv.bias, impl=self.config.mixer_impl), rows

    def _state_rows(self, t, y, d, start) -> dict[str, torch.Tensor]:
        """The per-position tensors a decode state stores (docs/DESIGN.md section 4), each (B, H, n, .)."""
        if not self.recurrent:
            return {"keys_a": t["ka"], "values": t["x"]}
        if self.tied:
            z = y + d[..., None] * t["x"]
            if start is not None:
                positions = torch.arange(y.shape[2], device=y.device)
                z = z * (positions[None, :] >= start[:, None].to(y.device)).to(z.dtype)[:, None, :, None]
            return {"keys_b": t["kb"], "outputs": z}
        return {"keys_a": t["ka"], "values": t["x"], "keys_b": t["kb"], "outputs": y}


class ResolventMLP(nn.Module):
    """GPT-2's MLP with ``nn.Linear`` layers: c_proj(act(c_fc(x))), then dropout."""

    def __init__(self, config: ResolventConfig):
        super().__init__()
        inner = config.n_inner if config.n_inner is not None else 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, inner)
        self.c_proj = nn.Linear(inner, config.n_embd)
        # gelu_new (GPT-2's tanh approximation) is ops.gelu_tanh: one pass over the activations where transformers'
        # gelu_new makes eight, on the compiled kernel where the mixer's impl chooses them (None marks it)
        tanh_gelu = config.activation_function in ("gelu_new", "gelu_pytorch_tanh")
        self.act = None if tanh_gelu else ACT2FN[config.activation_function]
        self.config = config  # shared with the model: config.mixer_impl is read at every call
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(hidden_states)
        h = gelu_tanh(h, impl=self.config.mixer_impl) if self.act is None else self.act(h)
        return self.dropout(self.c_proj(h))


class ResolventBlock(GradientCheckpointingLayer):
    """Pre-norm block: h + mixer(ln_1(h)), then + mlp(ln_2(.)), the latter in blocks of
    ``config.chunk_size_feed_forward`` rows."""

    def __init__(self, config: ResolventConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mixer = ResolventMixer(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = ResolventMLP(config)
        self.config = config  # shared with the model: config.chunk_size_feed_forward is read at every call

    def forward(self, hidden_states, rope=None, start=None, past_key_values=None, use_cache=False, cache=None):
        # the model passes the cache under CACHE_NAME: the name GradientCheckpointingLayer clears while it recomputes
        cache = _one_cache(past_key_values, cache)
        layer_cache = None if cache is None else cache.layers[self.layer_idx]
        hidden_states = hidden_states + self.mixer(self.ln_1(hidden_states), rope, start, layer_cache)
        rows = self.config.chunk_size_feed_forward
        if not rows or hidden_states.shape[1] <= rows:
            return hidden_states + self.mlp(self.ln_2(hidden_states))
        # position-wise, so in blocks of rows: the MLP's (rows, n_inner) activations stay in the processor's caches
        # (transformers' apply_chunking_to_forward would refuse a length that is not a multiple of the block)
        return torch.cat([h + self.mlp(self.ln_2(h)) for h in hidden_states.split(rows, dim=1)], dim=1)


# --------------------------------------------------------------------------------------------------
# Models


class ResolventPreTrainedModel(PreTrainedModel):
    """Weights initialisation, gradient checkpointing, and ``save_pretrained`` with the model code."""

    config_class = ResolventConfig
    config: ResolventConfig
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ResolventBlock"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    # Not "stateful" in generate()'s sense: every layer's cache can be rolled back over the tokens it recorded
    # (ResolventCacheLayer.activate_past_recording), so assisted and prompt-lookup decoding work for every mixer.
    _is_stateful = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, ResolventMixer):
            # GPT-2's scaled init of the residual projections (two per block).
            init.normal_(module.out_proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))
            module.init_gate()
            if module.conv is not None:  # nn.Conv1d's own initialisation, not the base class's normal(0, std)
                bound = 1 / math.sqrt(module.conv.kernel_size[0])
                init.uniform_(module.conv.weight, -bound, bound)
                init.uniform_(module.conv.bias, -bound, bound)
        elif isinstance(module, ResolventMLP):
            init.normal_(module.c_proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained`` (safetensors), plus the model code when the class is registered for
        an auto class (``import hf_resolvent`` does that): ``auto_map`` for AutoConfig, AutoModel and
        AutoModelForCausalLM, the modeling files, and copies of the ops modules the mixers need. Every weights file
        records the mixer of each layer in its metadata; from_pretrained warns when the config loading it says
        otherwise (both: :mod:`.remote_code`)."""
        remote = self.is_remote_code()
        if remote:
            auto_map = dict(getattr(self.config, "auto_map", None) or {})
            auto_map.update(AUTO_MAP)
            self.config.auto_map = auto_map
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):  # the process that wrote the files
            if remote:
                write_ops_bundle(save_directory)
            add_architecture_record(self.config, save_directory, kwargs.get("variant"))
        return result

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``, after checking a local folder's safetensors index, which transformers
        reads without a check (a damaged one fails deep inside it); a pickled weights file that names code to run is
        an OSError saying so and how to convert a trusted one."""
        check_weight_index(pretrained_model_name_or_path, kwargs.get("subfolder"), kwargs.get("variant"))
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except pickle.UnpicklingError as err:
            folder = Path(str(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
            pickled = next(iter(sorted(folder.glob("*.bin"))), folder / "pytorch_model.bin")
            raise OSError(unsafe_pickle_problem(pickled, err)) from None

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        """from_pretrained hook that receives the resolved weights files (local or downloaded): check them first."""
        check_weight_files(model.config, checkpoint_files)
        return PreTrainedModel._load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args,
                                                      **kwargs)


def _start_from_mask(mask: torch.Tensor, past: int, n: int, cache_start: torch.Tensor | None):
    """(start, regroup) from a 2-D attention mask: the leading padding per sequence (B,) or None, and for a prefill
    whose mask has holes the :class:`_Regroup` that moves each sequence's real tokens to the right end (so that they
    read as left-padded), else None. Raises on unsupported masks."""
    if mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be 2-D (batch, length) with 1 for tokens and 0 for padding, got shape "
            f"{tuple(mask.shape)}; resolvent mixers take their structure from the pattern, not from a 4-D mask"
        )
    batch, length = mask.shape
    if not isinstance(past, int) or past > 0:  # after a cache: one pass over the mask as given, no copy of it (a
        return _check_continued_mask(mask, past, n, cache_start), None  # decode step's mask grows with n)
    if length != n:
        raise ValueError(f"attention_mask has {length} columns but the input has {n} positions")
    mask = mask.to(torch.bool)
    columns = torch.arange(length, device=mask.device)
    count = mask.sum(1)
    lead = (mask.long().cumsum(1) == 0).sum(1)
    contiguous = (columns[None] >= lead[:, None]) & (columns[None] < (lead + count)[:, None])
    if torch.compiler.is_compiling():  # a graph keeps its shapes: left and right padding only, no branch on values
        problem = "attention_mask has holes or an all-padding sequence, which a compiled forward cannot regroup"
        require((count > 0).all() & (contiguous == mask).all(), problem, lambda: problem)
        return lead, None
    if (count == 0).any():
        raise ValueError("attention_mask has a sequence without any real token (all padding); remove it (with "
                         "generate(prefill_chunk_size=...), the first chunk must reach a real token of every "
                         "sequence: use chunks longer than the longest left padding)")
    if not torch.equal(contiguous, mask):  # holes: no later row reads a hidden position
        return n - count, _Regroup.right_aligned(mask)
    return (lead if bool(lead.any()) else None), None


def _check_continued_mask(mask: torch.Tensor, past: int, n: int, cache_start: torch.Tensor | None):
    """The start of tokens after a cache (the cache's own), once their 2-D mask checks out, by a check that reads
    nothing back (a decode step never waits for the device): the prefill's mask then ones, as many real tokens as
    the cache holds plus the new ones (a zero among the new columns, or a longer mask, counts differently), or the
    new tokens' ones alone."""
    length = mask.shape[1]
    if length == past + n:
        real = past + n - (0 if cache_start is None else cache_start.to(mask.device))
        problem = ("attention_mask does not match the cache: when continuing from a cache the mask must be the "
                   "prefill's mask followed by ones (right padding cannot be continued; pad on the left with "
                   "tokenizer.padding_side = 'left')")
        counted = mask.sum(1) if mask.dtype != torch.bool else mask.sum(1, dtype=torch.long)
        require((counted == real).all(), problem, lambda: problem, read_back=False)
    elif length == n:
        problem = "attention_mask of new tokens after a cache must be all ones (no padding after tokens)"
        require(mask.bool().all(), problem, lambda: problem, read_back=False)
    else:
        raise ValueError(
            f"attention_mask has {length} columns; expected {past + n} (cached {past} + new {n}) or {n} (new only)"
        )
    return cache_start


class _Regroup:
    """A batch (B, n) laid out again for the mixers, and back: packed documents become one row each (right-padded,
    :func:`_packed_documents`), and the real tokens of a sequence whose mask has holes move to the right end of
    their row (left-padded, :meth:`right_aligned`). Positions that no row holds come back as zeros.

    Attributes: index (R, L) flat positions b * n + t of the tokens each row holds (0 on padding), valid (R, L)."""

    def __init__(self, index: torch.Tensor, valid: torch.Tensor, shape: tuple[int, int]):
        self.index, self.valid, self.shape = index, valid, shape

    @classmethod
    def right_aligned(cls, mask: torch.Tensor) -> _Regroup:
        """Each row's real tokens (mask True), in order, at the right end of the row."""
        batch, n = mask.shape
        slot = (n - mask.sum(1))[:, None] + mask.long().cumsum(1) - 1  # where each real token goes in its row
        flat = torch.arange(batch * n, device=mask.device).view(batch, n)
        rows = torch.arange(batch, device=mask.device)[:, None].expand(batch, n)
        index = torch.zeros(batch, n, dtype=torch.long, device=mask.device)
        valid = torch.zeros(batch, n, dtype=torch.bool, device=mask.device)
        index[rows[mask], slot[mask]] = flat[mask]
        valid[rows[mask], slot[mask]] = True
        return cls(index, valid, (batch, n))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """(B, n, ...) -> (R, L, ...)."""
        return t.reshape(self.shape[0] * self.shape[1], *t.shape[2:])[self.index]

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """(R, L, ...) -> (B, n, ...): every token back in its place."""
        out = t.new_zeros(self.shape[0] * self.shape[1], *t.shape[2:])
        out[self.index[self.valid]] = t[self.valid]
        return out.view(*self.shape, *t.shape[2:])


def _refuse_right_padding(attention_mask: torch.Tensor) -> None:
    """A batch whose mask rows end in zeros is right-padded: generation would continue each row after its padding.
    Named where the positions generate() derives from such a mask would otherwise read as packed documents (with a
    cache, or beside left-padded rows)."""
    mask = attention_mask.bool()
    rows = (~mask[:, -1] & mask.any(1)).nonzero().flatten().tolist()
    if rows:
        raise ValueError(
            f"the prompt is right-padded (the attention mask of row {', '.join(map(str, rows[:8]))} ends in zeros): a "
            "decode cache and generate() continue each row after its last position, so pad on the left "
            "(tokenizer.padding_side = 'left', or padding_side='left' when tokenizing); right padding is for "
            "training")


def _packed_documents(position_ids: torch.Tensor, start: torch.Tensor | None) -> _Regroup | None:
    """The documents of packed sequences: a new one wherever a position is not above the previous one (position_ids
    restarting, as ``DataCollatorWithFlattening`` writes them); None when no row restarts. Left padding is skipped."""
    batch, n = position_ids.shape
    columns = torch.arange(n, device=position_ids.device)
    lead = torch.zeros(batch, dtype=torch.long, device=position_ids.device) if start is None else start
    real = columns[None] >= lead[:, None]
    new = torch.ones_like(real)
    new[:, 1:] = (position_ids[:, 1:] <= position_ids[:, :-1]) | ~real[:, :-1]  # a restart, or the first token
    new &= real
    if torch.compiler.is_compiling():  # a graph cannot split rows into documents: one document per row
        problem = "position_ids restart inside a row (packed documents), which a compiled forward cannot split"
        require(new.sum() == batch, problem, lambda: problem)
        return None
    if int(new.sum()) == batch:  # one document per row (host sync, like the position check)
        return None
    if start is not None and bool(start.any()):
        raise ValueError("packed sequences (position_ids restarting inside a row) cannot be left-padded as well; "
                         "pack the documents without padding")
    doc = new.long().cumsum(1) - 1 + (new.sum(1).cumsum(0) - new.sum(1))[:, None]  # (B, n) global document id
    flat_doc = doc.reshape(-1)
    count = torch.bincount(flat_doc)
    first = torch.cumsum(count, 0) - count  # flat position of each document's first token
    offset = torch.arange(batch * n, device=doc.device) - first[flat_doc]
    length = int(count.max())
    index = torch.zeros(count.numel(), length, dtype=torch.long, device=doc.device)
    valid = torch.zeros(count.numel(), length, dtype=torch.bool, device=doc.device)
    index[flat_doc, offset] = torch.arange(batch * n, device=doc.device)
    valid[flat_doc, offset] = True
    return _Regroup(index, valid, (batch, n))


def _check_inputs(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, vocab_size: int,
                  bos_token_id: int | None, read_back: bool = True) -> None:
    """Refuse what the embedding lookup or the mixers would fail on deep inside torch: a wrong rank, no sequences,
    no positions, token ids outside [0, vocab_size). ``input_ids`` (B, n) or ``inputs_embeds`` (B, n, width);
    ``bos_token_id`` (or None) is suggested as the prompt of an empty one.

    Every forward and every generate() step passes here; the id range costs one min/max reduction, and one host
    sync unless ``read_back`` is False (tokens after a cache: an assert queued on the device, see ``require``).
    """
    name, tokens, rank = ("input_ids", input_ids, 2) if inputs_embeds is None else ("inputs_embeds", inputs_embeds, 3)
    shape = tuple(tokens.shape)
    if tokens.dim() != rank:
        dims = "batch, length" if rank == 2 else "batch, length, width"
        raise ValueError(f"{name} must be ({dims}), got shape {shape}")
    if shape[0] == 0:
        raise ValueError(f"{name} holds no sequences (shape {shape}, a batch of 0); pass at least one sequence")
    if shape[1] == 0:  # no shape in the message: generate() may have repeated the rows (beams) by now
        start = "" if bos_token_id is None else f" (to generate from nothing, start with the BOS token {bos_token_id})"
        raise ValueError(f"{name} holds no tokens (length 0): an empty prompt; give at least one token{start}")
    if inputs_embeds is None:
        low, high = input_ids.min(), input_ids.max()  # not aminmax: ONNX has no full-tensor form of it
        require((low >= 0) & (high < vocab_size), f"input_ids outside the vocabulary (vocab_size = {vocab_size})", lambda: (
            f"input_ids holds the token id {int(low) if low < 0 else int(high)}, outside the vocabulary (vocab_size = "
            f"{vocab_size}: ids 0 to {vocab_size - 1}); use the model's own tokenizer, or call "
            "model.resize_token_embeddings(len(tokenizer)) after adding tokens"), read_back=read_back)


class ResolventModel(ResolventPreTrainedModel):
    """The bare model: embeddings (token, and learned positions if configured), blocks, final LayerNorm.

    Forward inputs follow GPT-2/Llama: ``input_ids`` (B, n) or ``inputs_embeds`` (B, n, width),
    ``attention_mask`` (B, n) or (B, cached + n), ``position_ids`` (B or 1, n) (default: counted from each
    sequence's first real token), ``cache`` or ``past_key_values`` (a :class:`ResolventCache`, under either name:
    :data:`CACHE_NAME`), ``use_cache`` (default
    ``config.use_cache`` in eval mode, False in training mode), ``output_hidden_states``.
    """

    def __init__(self, config: ResolventConfig):
        super().__init__(config)
        self.embed_dim = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd) if config.position_embedding == "learned" else None
        self.rotary_emb = ResolventRotaryEmbedding(config) if config.position_embedding == "rope" else None
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([ResolventBlock(config, i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, new_embeddings):
        self.wte = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast | tuple:
        past_key_values = _one_cache(past_key_values, cache)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids (B, n) and inputs_embeds (B, n, width)")
        if output_attentions:
            raise ValueError(
                "output_attentions is not available: resolvent mixers never form attention matrices "
                "(the effective mixing matrix is (I - B)^-1 A; see hf_resolvent.ops.mixer_matrices)"
            )
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        cache_asked = bool(use_cache) or past_key_values is not None
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        vocab_size = getattr(self.wte, "num_embeddings", self.config.vocab_size)  # the table actually looked up
        bos = self.config.bos_token_id
        # tokens after a cache (a decode step) are checked without reading the device back
        continuing = (isinstance(past_key_values, ResolventCache) and not torch.compiler.is_compiling()
                      and past_key_values.get_seq_length() > 0)
        # a prompt of the BOS token alone reads as all padding when the pad token is the same id
        _check_inputs(input_ids, inputs_embeds, vocab_size, None if bos == self.config.pad_token_id else bos,
                      read_back=not continuing)
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)
        batch, n = inputs_embeds.shape[:2]
        device = inputs_embeds.device

        if past_key_values is not None and not isinstance(past_key_values, ResolventCache):
            if isinstance(past_key_values, Cache) and past_key_values.get_seq_length() == 0:
                past_key_values = ResolventCache(self.config)  # e.g. an empty DynamicCache made by a caller
            else:
                raise ValueError(
                    f"past_key_values must be a ResolventCache (got {type(past_key_values).__name__}); create one "
                    "with ResolventCache(model.config) or let the model make it (use_cache=True)"
                )
        if past_key_values is None and use_cache:
            past_key_values = ResolventCache(self.config)
        # an int, or inside a compiled graph a static cache's 0-d tensor: only arithmetic on it below, no branch
        past = 0 if past_key_values is None else past_key_values.get_seq_length()
        if past_key_values is not None and past_key_values.batch_size not in (-1, batch):
            raise ValueError(f"the cache holds {past_key_values.batch_size} sequences but the input has {batch}")
        cache_start = None if past_key_values is None else past_key_values.start
        regroup = None
        if attention_mask is not None:
            start, regroup = _start_from_mask(attention_mask.to(device), past, n, cache_start)
        else:
            start = cache_start
        if regroup is not None:  # a mask with holes: the real tokens, right-aligned, run as left-padded sequences
            inputs_embeds = regroup.pack(inputs_embeds)
            if position_ids is not None:
                position_ids = regroup.pack(position_ids.to(device).view(-1, n).expand(batch, -1))

        documents = None
        if position_ids is None:
            position_ids = (torch.arange(n, device=device) + past)[None].expand(batch, -1)
            if start is not None:
                position_ids = (position_ids - start.to(device)[:, None]).clamp(min=0)
        else:
            position_ids = position_ids.to(device).view(-1, n).expand(batch, -1)
            if n > 1 and past == 0:
                if attention_mask is not None and (cache_asked or (start is not None and bool(start.any()))):
                    _refuse_right_padding(attention_mask)  # its positions (0, 1, 2, 1, 1) are not documents
                documents = _packed_documents(position_ids, start)
        if documents is not None and regroup is not None:
            raise ValueError("packed sequences (position_ids restarting inside a row) cannot have attention-mask "
                             "holes as well; pass the documents without padding")
        if documents is not None:  # packed sequences: each document runs as a sequence of its own
            if cache_asked:
                raise ValueError(
                    "position_ids restart inside a sequence (packed documents, e.g. DataCollatorWithFlattening): "
                    "that is for training; a decode cache needs one document per sequence, so pass the documents "
                    "as separate (left-padded) sequences to use_cache / generate()")
            use_cache, past_key_values = False, None
        if self.wpe is not None:  # a learned table ends at n_positions; RoPE goes on (scaled as the config says)
            top = position_ids.max()
            limit = self.config.n_positions
            require(top < limit, f"a position past n_positions = {limit}", lambda: (
                f"sequence too long: position {int(top)} reached, but the model's learned position table has "
                f"n_positions = {limit} rows; shorten the input (a model with position_embedding='rope' or 'none' "
                "has no such limit)"), read_back=not continuing)

        hidden_states = inputs_embeds
        if self.wpe is not None:
            hidden_states = hidden_states + self.wpe(position_ids).to(hidden_states.dtype)
        hidden_states = self.drop(hidden_states)
        if documents is not None:
            hidden_states, position_ids = documents.pack(hidden_states), documents.pack(position_ids)
        rope = None if self.rotary_emb is None else self.rotary_emb(hidden_states, position_ids)
        start = None if start is None else start.to(device)

        regrouped = documents or regroup  # at most one of them (refused above)
        all_hidden_states = () if output_hidden_states else None
        for block in self.h:
            if output_hidden_states:
                if regrouped is not None:  # the tensor shown is the one the block reads: gradients reach it
                    shown = regrouped.unpack(hidden_states)
                    hidden_states = regrouped.pack(shown)
                all_hidden_states += (hidden_states if regrouped is None else shown,)
            hidden_states = block(hidden_states, rope=rope, start=start, use_cache=use_cache,
                                  **{CACHE_NAME: past_key_values})
        hidden_states = self.ln_f(hidden_states)
        if regrouped is not None:
            hidden_states = regrouped.unpack(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)

        output = BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            **{CACHE_NAME: past_key_values if use_cache else None},
            hidden_states=all_hidden_states,
        )
        return output if return_dict else output.to_tuple()


class ResolventForCausalLM(ResolventPreTrainedModel, GenerationMixin):
    """:class:`ResolventModel` with a language-modelling head (tied to the token embedding by default).

    ``labels`` (B, n) give the library's causal-LM loss (shifted inside, -100 ignored, ``num_items_in_batch``
    honoured). ``generate()`` decodes through a :class:`ResolventCache`: greedy, sampling, beam search,
    ``num_return_sequences``, continuing from a returned cache, chunked prefill (``prefill_chunk_size``),
    assisted (``assistant_model=``) and prompt-lookup (``prompt_lookup_num_tokens=``) decoding for every mixer.
    """

    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: ResolventConfig):
        super().__init__(config)
        self.transformer = ResolventModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple:
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        outputs = self.transformer(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=_one_cache(past_key_values, cache),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            return_dict=True,
        )
        hidden_states = outputs.last_hidden_state
        if isinstance(logits_to_keep, int):
            if logits_to_keep:
                hidden_states = hidden_states[:, -logits_to_keep:]
        else:
            hidden_states = hidden_states[:, logits_to_keep]
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        output = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **{CACHE_NAME: outputs[CACHE_NAME] if CACHE_NAME in outputs else None},
            hidden_states=outputs.hidden_states,
        )
        return output if return_dict else output.to_tuple()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode=None, batch_size=None,
                                      max_cache_length=None, *args, **kwargs):
        """generate() hook: make a :class:`ResolventCache` (instead of a ``DynamicCache``), static for
        ``cache_implementation="static"``. Also takes the cache under the other release's name (see
        :data:`CACHE_NAME`), and checks ``prefill_chunk_size``, which transformers uses unchecked."""
        chunk = generation_config.prefill_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"prefill_chunk_size must be a positive number of tokens (or None: the prompt at once), "
                             f"got {chunk!r}")
        other = "past_key_values" if CACHE_NAME == "cache" else "cache"
        if model_kwargs.get(other) is not None:
            if model_kwargs.get(CACHE_NAME) is not None:
                raise ValueError("got two caches, as past_key_values and as cache; pass one")
            model_kwargs[CACHE_NAME] = model_kwargs.pop(other)
        cache = model_kwargs.get(CACHE_NAME)
        if cache is not None:
            if generation_config.cache_implementation is not None:
                raise ValueError(f"pass either cache_implementation or {CACHE_NAME} to generate(), not both")
            if not isinstance(cache, ResolventCache):
                if isinstance(cache, Cache) and cache.get_seq_length() == 0:
                    cache = model_kwargs[CACHE_NAME] = ResolventCache(self.config)
                else:
                    raise ValueError(
                        f"{CACHE_NAME} must be a ResolventCache, got {type(cache).__name__}; continue from the "
                        "cache that a previous generate()/forward returned"
                    )
            cache._is_user_defined = True
            return
        if generation_config.use_cache is False:
            return
        implementation = generation_config.cache_implementation
        if implementation not in (None, "dynamic", "static"):
            raise ValueError(
                f"cache_implementation={implementation!r} is not available for resolvent models: they use their own "
                "ResolventCache, growing (leave cache_implementation unset) or preallocated (\"static\")"
            )
        # static: sized by generate() for the prompt and every new token, as transformers sizes its StaticCache, and
        # never below the last static generation's size, so that a compiled decode step keeps its shapes (a shorter
        # generation reuses the compiled graph instead of compiling another)
        if implementation == "static":
            # as transformers keeps its StaticCache: one cache per model, reset for each generation, so that a
            # compiled (and captured) decode step keeps the addresses of its buffers
            max_cache_len = max(max_cache_length, getattr(self, "_previous_max_cache_length", -1))
            self._previous_max_cache_length = max_cache_len
            cache = getattr(self, "_static_cache", None)
            if cache is None or cache.max_cache_len != max_cache_len:
                cache = self._static_cache = ResolventCache(self.config, max_cache_len=max_cache_len)
            cache.reset()
            model_kwargs[CACHE_NAME] = cache
        else:
            model_kwargs[CACHE_NAME] = ResolventCache(self.config)
        if generation_config.is_assistant:  # an assistant's drafts are rolled back: as transformers does for its caches
            model_kwargs[CACHE_NAME].activate_past_recording()

    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, past_key_values=None, cache=None,
                                  **kwargs):
        """generate() hook for compileable (static) caches, which would get a 4-D mask: the 2-D mask for the prompt,
        and none for decode steps, whose positions the cache already knows (each sequence's left padding is recorded
        at prefill; generate() only appends real tokens). Without a mask, a compiled decode step has one shape."""
        cache = _one_cache(past_key_values, cache)
        return attention_mask if cache is None or cache.get_seq_length() == 0 else None

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_gpt2(
        cls,
        model_or_path,
        mixer: Any = "attention",
        position_embedding: str = "learned",
        gate_init: str | float = "closed",
        **config_overrides,
    ) -> ResolventForCausalLM:
        """A resolvent model with a ``GPT2LMHeadModel``'s weights (a model, or a path/name for ``from_pretrained``).

        Copies token and position embeddings, LayerNorms, MLPs (GPT-2's ``Conv1D`` weights are transposed) and
        attention: q, k, v -> q^A, k^A, x, and also q, k -> q^B, k^B for resolvent mixers. With ``mixer=
        "attention"`` and learned positions the logits equal GPT-2's; with ``mixer="dense"`` and the default
        closed gate (g = e^-16 at start) they equal GPT-2's up to ~1e-6. Sparse patterns read only P^A_i through A,
        so their logits differ from GPT-2's until fine-tuned. The tied variant has no A channel to copy into. With
        ``conv_size`` the convolution starts as the identity tap on each token (the SiLU after it still changes q, k
        and v, so the logits differ from GPT-2's until fine-tuned).
        """
        from transformers import GPT2LMHeadModel

        if position_embedding == "none":
            raise ValueError("from_gpt2 with position_embedding='none': GPT-2's weights were trained with its learned "
                             "position table, and without positions its attention sees an unordered prefix; convert "
                             "with 'learned' (the table is copied) or 'rope' and fine-tune")
        gpt2 = model_or_path if isinstance(model_or_path, nn.Module) else GPT2LMHeadModel.from_pretrained(model_or_path)
        gc = gpt2.config
        if getattr(gc, "scale_attn_by_inverse_layer_idx", False) or not getattr(gc, "scale_attn_weights", True):
            raise ValueError("from_gpt2 supports GPT-2 attention scaled by head_dim ** -0.5 only")
        if getattr(gc, "add_cross_attention", False):
            raise ValueError("from_gpt2 does not convert cross-attention (add_cross_attention=True)")
        fields = dict(
            vocab_size=gc.vocab_size, n_positions=gc.n_positions, n_embd=gc.n_embd, n_layer=gc.n_layer,
            n_head=gc.n_head, n_inner=gc.n_inner, activation_function=gc.activation_function,
            resid_pdrop=gc.resid_pdrop, embd_pdrop=gc.embd_pdrop, layer_norm_epsilon=gc.layer_norm_epsilon,
            initializer_range=gc.initializer_range, bos_token_id=gc.bos_token_id, eos_token_id=gc.eos_token_id,
            pad_token_id=gc.pad_token_id, tie_word_embeddings=gc.tie_word_embeddings,
            position_embedding=position_embedding, mixer=mixer, gate_init=gate_init,
        )
        fields.update(config_overrides)
        model = cls(ResolventConfig(**fields))
        src, dst = gpt2.transformer, model.transformer
        width = gc.n_embd
        with torch.no_grad():
            dst.wte.weight.copy_(src.wte.weight)
            if dst.wpe is not None:
                dst.wpe.weight.copy_(src.wpe.weight[: dst.wpe.weight.shape[0]])
            dst.ln_f.load_state_dict(src.ln_f.state_dict())
            for block_src, block in zip(src.h, dst.h):
                block.ln_1.load_state_dict(block_src.ln_1.state_dict())
                block.ln_2.load_state_dict(block_src.ln_2.state_dict())
                block.mlp.c_fc.weight.copy_(block_src.mlp.c_fc.weight.t())
                block.mlp.c_fc.bias.copy_(block_src.mlp.c_fc.bias)
                block.mlp.c_proj.weight.copy_(block_src.mlp.c_proj.weight.t())
                block.mlp.c_proj.bias.copy_(block_src.mlp.c_proj.bias)
                w = block_src.attn.c_attn.weight.t()  # (3 width, width): rows q, k, v
                b = block_src.attn.c_attn.bias
                parts = {"qa": 0, "ka": 1, "x": 2, "qb": 0, "kb": 1}
                mixer_mod = block.mixer
                for i, name in enumerate(mixer_mod.parts):
                    j = parts[name]
                    mixer_mod.in_proj.weight[i * width:(i + 1) * width].copy_(w[j * width:(j + 1) * width])
                    mixer_mod.in_proj.bias[i * width:(i + 1) * width].copy_(b[j * width:(j + 1) * width])
                mixer_mod.out_proj.weight.copy_(block_src.attn.c_proj.weight.t())
                mixer_mod.out_proj.bias.copy_(block_src.attn.c_proj.bias)
                if mixer_mod.conv is not None:  # the identity tap: each token's own projection
                    mixer_mod.conv.weight.zero_()
                    mixer_mod.conv.weight[:, 0, -1] = 1.0
                    mixer_mod.conv.bias.zero_()
            if not model.config.tie_word_embeddings:
                model.lm_head.weight.copy_(gpt2.lm_head.weight)
        return model
