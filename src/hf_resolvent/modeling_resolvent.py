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

import math
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from .cache_resolvent import ResolventCache, prepare_generation_cache
from .configuration_resolvent import CLOSED_GATE_VALUE, ResolventConfig
from .gpt2_conversion import from_gpt2
from .inputs_resolvent import CACHE_NAME, check_inputs, lay_out, one_cache
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
        return gate_values(self.gate_proj(u), self.dt_bias, self.A_log, u.dtype, impl=self.config.mixer_impl)

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
        cache = one_cache(past_key_values, cache)
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
        past_key_values = one_cache(past_key_values, cache)
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
        check_inputs(input_ids, inputs_embeds, vocab_size, None if bos == self.config.pad_token_id else bos,
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
        checked = attention_mask
        if continuing and attention_mask is not None:  # generate()'s mask: its columns before this step were checked
            checked = past_key_values.mask_to_check(attention_mask, past, n)
        inputs_embeds, position_ids, start, regroup, documents = lay_out(
            inputs_embeds, checked, position_ids, past, cache_start, cache_asked)
        if continuing and attention_mask is not None:
            past_key_values.mask_checked(attention_mask)
        if documents is not None:  # packed sequences: each document runs as a sequence of its own
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
            past_key_values=one_cache(past_key_values, cache),
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
        """generate() hook: a :class:`ResolventCache` instead of a ``DynamicCache`` (``prepare_generation_cache``)."""
        prepare_generation_cache(self, generation_config, model_kwargs, max_cache_length)

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs: dict, is_encoder_decoder: bool = False,
                                            num_new_tokens: int = 1) -> dict:
        """generate() hook: the 2-D attention mask and position ids grow in buffers the request's cache holds
        (:meth:`ResolventCache.extend_columns`) instead of being copied whole for every token."""
        cache = model_kwargs.get(CACHE_NAME)
        grown = {}
        if isinstance(cache, ResolventCache):
            grown = {key: model_kwargs.pop(key) for key in ("attention_mask", "position_ids")
                     if isinstance(model_kwargs.get(key), torch.Tensor) and model_kwargs[key].dim() == 2}
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder,
                                                                   num_new_tokens)
        if "attention_mask" in grown:
            mask = grown["attention_mask"]
            model_kwargs["attention_mask"] = cache.extend_columns(
                "attention_mask", mask, mask.new_ones(mask.shape[0], num_new_tokens))
        if "position_ids" in grown:
            positions = grown["position_ids"]
            model_kwargs["position_ids"] = cache.extend_columns(
                "position_ids", positions, positions[:, -1:] + torch.arange(1, num_new_tokens + 1,
                                                                              device=positions.device,
                                                                              dtype=positions.dtype))
        return model_kwargs

    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, past_key_values=None, cache=None,
                                  **kwargs):
        """generate() hook for compileable (static) caches, which would get a 4-D mask: the 2-D mask for the prompt,
        and none for decode steps, whose positions the cache already knows (each sequence's left padding is recorded
        at prefill; generate() only appends real tokens). Without a mask, a compiled decode step has one shape."""
        cache = one_cache(past_key_values, cache)
        return attention_mask if cache is None or cache.get_seq_length() == 0 else None

    @classmethod
    def from_gpt2(cls, model_or_path, mixer: Any = "attention", position_embedding: str = "learned",
                  gate_init: str | float = "closed", **config_overrides) -> ResolventForCausalLM:
        """A resolvent model with a ``GPT2LMHeadModel``'s weights (a model, or a path/name for ``from_pretrained``).

        Copies token and position embeddings, LayerNorms, MLPs (GPT-2's ``Conv1D`` weights are transposed) and
        attention: q, k, v -> q^A, k^A, x, and also q, k -> q^B, k^B for resolvent mixers. With ``mixer=
        "attention"`` and learned positions the logits equal GPT-2's; with ``mixer="dense"`` and the default
        closed gate (g = e^-16 at start) they equal GPT-2's up to ~1e-6. Sparse patterns read only P^A_i through A,
        so their logits differ from GPT-2's until fine-tuned. The tied variant has no A channel to copy into. With
        ``conv_size`` the convolution starts as the identity tap on each token (the SiLU after it still changes q, k
        and v, so the logits differ from GPT-2's until fine-tuned).
        """
        return from_gpt2(cls, model_or_path, mixer, position_embedding, gate_init, **config_overrides)
