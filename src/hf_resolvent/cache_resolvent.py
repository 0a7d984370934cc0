"""Decode cache of resolvent models: a ``transformers`` :class:`~transformers.Cache` with one mixer state per layer.

Each layer keeps only what its pattern lets future tokens read (docs/DESIGN.md section 4): every position for
attention, dense and plain f-patterns, the last w - 1 for local attention, the last w for banded patterns, and the distinct
positions of the slot register for cache-efficient patterns (12 rows after 2048 tokens for ``exp2:ce``).
A row holds the keys of both channels (after RoPE), the input x and the output y; the tied variant keeps its
B keys and z only; attention kinds keep their keys and values. A model with a short convolution (``conv_size`` K)
also keeps, per layer, the last K - 1 projected rows the convolution reads (all of them since
:meth:`~ResolventCacheLayer.activate_past_recording`, so that a crop can go back).

With ``max_cache_len`` (``generate(cache_implementation="static")``) the states are preallocated for that many
tokens and written in place (:class:`~hf_resolvent.ops.StaticDecodeState`): the cache is then compileable, and a
compiled decode step runs every token without recompiling.

This file is copied into saved model folders (remote code): it may import only flat sibling modules.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .patterns import Pattern, get_pattern
from .resolvent_ops import DecodeState, StaticDecodeState

__all__ = ["ResolventCache", "ResolventCacheLayer"]


class ResolventCacheLayer:
    """One layer's decode state: a :class:`DecodeState` (or None before the first forward) and its pattern.

    Implements the per-layer methods that :class:`transformers.Cache` and ``generate()`` call (beam-search
    reordering, batch selection and repetition, reset, offloading, past recording and cropping) by delegating to
    the state, which owns the rules. Cropping is exact for patterns that keep every position, and for the others
    over the tokens decoded since :meth:`activate_past_recording` (``generate()`` calls it for assisted and
    prompt-lookup decoding) or since the last crop.

    With ``max_cache_len`` the state is a :class:`StaticDecodeState` for that many tokens (built from the prefill),
    and the layer is compileable; it then crops only patterns that keep every position.
    """

    is_sliding = False
    supports_early_init = False

    def __init__(self, pattern: Pattern | str, tied: bool = False, max_cache_len: int | None = None,
                 conv_size: int = 0):
        self.pattern = get_pattern(pattern)
        self.tied = tied
        self.max_cache_len = max_cache_len
        self._state: DecodeState | None = None
        self.device = None
        self.record_past = False
        # the short convolution's input rows before the next token (B, R, C), row 0 at position conv_first (rows
        # before the sequence are zeros); None without a convolution or before the first forward
        self.conv_rows: torch.Tensor | None = None
        self.conv_first, self.conv_width = 0, conv_size

    def __repr__(self) -> str:
        rows = 0 if self.state is None else self.state.rows()
        return f"ResolventCacheLayer(pattern={self.pattern.name!r}, seen={self.get_seq_length()}, rows={rows})"

    @property
    def state(self) -> DecodeState | None:
        """The layer's :class:`DecodeState` (None before the first forward); a new one records when the layer does."""
        return self._state

    @state.setter
    def state(self, state: DecodeState | None) -> None:
        if state is not None and self.record_past and state.history is None:
            state.record_history()
        self._state = state

    @property
    def is_initialized(self) -> bool:
        return self.state is not None

    @property
    def is_compileable(self) -> bool:
        """True for a static layer: its decode steps keep their shapes."""
        return self.max_cache_len is not None

    @property
    def row_names(self) -> tuple[str, ...]:
        """The per-row tensors this layer's state holds (docs/DESIGN.md section 4)."""
        if not self.pattern.has_recurrence:
            return ("keys_a", "values")
        return ("keys_b", "outputs") if self.tied else DecodeState.TENSOR_NAMES

    def store_prefill(self, rows: dict[str, torch.Tensor], start: torch.Tensor | None) -> None:
        """Take the state of a prefill from its per-position tensors (``DecodeState.from_prefill``'s ``tensors``,
        each (B, H, n, .)), preallocated for ``max_cache_len`` tokens when the layer is static."""
        state = DecodeState.from_prefill(self.pattern, rows, start, record=self.record_past and not self.is_compileable)
        if self.is_compileable:
            state = StaticDecodeState.preallocate(self.pattern, state, self.max_cache_len)
        self.state = state

    def keep_conv_rows(self, rows: torch.Tensor) -> None:
        """Take the convolution's input rows up to the newest token (the held ones, then the new): keep the last
        K - 1, or all while recording (:meth:`activate_past_recording`). A static layer writes them into its
        buffer in place."""
        last = rows.shape[1] - (self.conv_width - 1)
        if self.is_compileable:  # fixed shape: K - 1 rows, no recording
            if self.conv_rows is None:
                self.conv_rows = rows[:, last:].clone()
            else:
                self.conv_rows.copy_(rows[:, last:])
            return
        if self.conv_rows is None:  # a prefill: its rows start with K - 1 zero rows before position 0
            self.conv_first = -(self.conv_width - 1)
        keep = 0 if self.record_past else last
        self.conv_first += keep
        self.conv_rows = rows[:, keep:]

    @property
    def keeps_every_position(self) -> bool:
        """True when the state holds all past rows (attention, dense, plain f-patterns): it crops by slicing."""
        return DecodeState.keeps_every_position(self.pattern)

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can put the layer back as it was: always for patterns that keep every position, and
        for the others while recording past states."""
        return self.keeps_every_position or self.record_past

    def activate_past_recording(self) -> None:
        """Record the state before each decoded token until the next :meth:`crop`, so that crop can go back over
        them (``transformers``' name for it; generate() calls it for assisted and prompt-lookup decoding)."""
        if self.is_compileable and not self.keeps_every_position:
            raise ValueError(
                f"a static cache cannot record past states for pattern {self.pattern.name!r} (it drops past positions), "
                "so assisted and prompt-lookup decoding cannot roll it back; leave cache_implementation unset")
        if self.is_compileable and self.conv_width:
            raise ValueError("a static cache cannot record the short convolution's past rows (conv_size), so "
                             "assisted and prompt-lookup decoding cannot roll it back; leave cache_implementation unset")
        self.record_past = True
        if self.state is not None:
            self.state.record_history()

    @property
    def batch_size(self) -> int:
        return -1 if self.state is None else self.state.batch_size

    def get_seq_length(self) -> int:
        """Tokens seen. A static layer's count is a tensor: read as an int eagerly, left a 0-d tensor inside a
        compiled graph (reading it would break the graph)."""
        if self.state is None:
            return 0
        seen = self.state.seen
        return seen if isinstance(seen, int) or torch.compiler.is_compiling() else int(seen)

    def get_max_length(self) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def nbytes(self) -> int:
        rows = 0 if self.conv_rows is None else self.conv_rows.numel() * self.conv_rows.element_size()
        return rows + (0 if self.state is None else self.state.nbytes())

    def reset(self) -> None:
        self._state = None
        self.conv_rows, self.conv_first = None, 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.state is not None:
            self.state.select_batch(indices)
        if self.conv_rows is not None:
            self.conv_rows = self.conv_rows.index_select(0, indices.to(self.conv_rows.device))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state.repeat_batch(repeats)
        if self.conv_rows is not None:
            self.conv_rows = self.conv_rows.repeat_interleave(repeats, dim=0)

    def target_length(self, length: int) -> int:
        """The tokens left by ``crop(length)``: ``length`` > 0 keeps that many, <= 0 drops ``-length`` newest ones."""
        seen = self.get_seq_length()
        return min(seen, length) if length > 0 else max(0, seen + length)

    def can_crop(self, length: int) -> bool:
        """True when ``crop(length)`` is exact (see :meth:`crop`)."""
        if self.state is None:
            return True
        target = self.target_length(length)
        return self.state.can_crop_to(self.pattern, target) and self._conv_rows_reach(target)

    def _conv_rows_reach(self, length: int) -> bool:
        """Whether the convolution's rows held go back to the K - 1 before token ``length`` (no convolution: True)."""
        if self.conv_rows is None or length >= self.get_seq_length():
            return True
        return length - (self.conv_width - 1) >= self.conv_first

    def crop(self, length: int) -> None:
        """Drop the ``-length`` newest tokens (``length`` <= 0, ``transformers``' convention), or keep the first
        ``length`` (> 0). What was recorded is then forgotten: the tokens left are accepted. Raises a ValueError
        where the state cannot go back that far (see :meth:`DecodeState.crop`)."""
        if self.state is None:
            return
        target, seen = self.target_length(length), self.get_seq_length()
        if not self._conv_rows_reach(target):
            raise ValueError(
                f"the short convolution of this layer holds its input rows from token {self.conv_first} on, and a "
                f"crop back {seen - target} token(s) needs them from token {target - self.conv_width + 1}: record "
                "them first (cache.activate_past_recording(), which generate() does for assisted and prompt-lookup "
                "decoding)")
        self.state.crop(self.pattern, target)
        self.state.forget_history()
        if self.conv_rows is not None and target < seen:
            self.conv_rows = self.conv_rows[:, : target - self.conv_first]

    def offload(self) -> None:
        if self.state is None:
            return
        if self.state.positions is not None:
            self.device = self.state.positions.device  # where prefetch() brings it back
        self.state.to("cpu", non_blocking=True)
        if self.conv_rows is not None:
            self.conv_rows = self.conv_rows.to("cpu", non_blocking=True)

    def prefetch(self) -> None:
        if self.device is not None and self.state is not None:
            self.state.to(self.device, non_blocking=True)
            if self.conv_rows is not None:
                self.conv_rows = self.conv_rows.to(self.device, non_blocking=True)


class ResolventCache(Cache):
    """Per-layer decode states of a resolvent model, usable wherever ``generate()`` expects a ``Cache``.

    ``get_seq_length()`` is the number of tokens seen (left padding included, as for ``DynamicCache``), not the
    rows held; :meth:`nbytes` is the memory the states hold. Beam search (``reorder_cache``), batch selection and
    repetition work for every pattern; :meth:`crop` for every pattern over the tokens recorded (see :meth:`crop`).

    Args:
        config: a :class:`~hf_resolvent.ResolventConfig` (its ``layer_mixers`` give each layer's pattern).
        max_cache_len: make a static cache for this many tokens (prompt and new tokens; padding included):
            preallocated states written in place, for compiled decoding. None (default): states that grow.
    """

    def __init__(self, config=None, max_cache_len: int | None = None, **kwargs):
        if config is None or not hasattr(config, "layer_mixers"):
            raise ValueError("ResolventCache needs the model's ResolventConfig: ResolventCache(model.config)")
        if max_cache_len is not None and (not isinstance(max_cache_len, int) or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive number of tokens or None, got {max_cache_len!r}")
        conv_size = getattr(config, "conv_size", 0)
        layers = [ResolventCacheLayer(spec["pattern"], spec["tied"], max_cache_len, conv_size)
                  for spec in config.layer_mixers]
        super().__init__(layers=layers)
        self.head_shape = (config.n_head, config.head_dim)

    def allocate(self, batch_size: int, dtype: torch.dtype = torch.float32, device=None) -> ResolventCache:
        """Give a static cache its empty states now, instead of at the first forward; a prompt then runs through
        the decode step one token at a time (as an exported step does, :mod:`hf_resolvent.export`). Returns the
        cache."""
        if self.max_cache_len is None:
            raise ValueError("allocate() is for a static cache: ResolventCache(config, max_cache_len=...)")
        heads, dim = self.head_shape
        for layer in self.layers:
            layer.state = StaticDecodeState.empty(layer.pattern, layer.row_names, batch_size, heads, dim,
                                                  self.max_cache_len, dtype, device)
        return self

    def __repr__(self) -> str:
        return f"ResolventCache(seen={self.get_seq_length()}, nbytes={self.nbytes()}, layers={len(self.layers)})"

    @property
    def states(self) -> list[DecodeState | None]:
        """The :class:`DecodeState` of every layer (None before the first forward)."""
        return [layer.state for layer in self.layers]

    @property
    def start(self) -> torch.Tensor | None:
        """(B,) leading padding per sequence recorded at prefill, or None."""
        state = self.layers[0].state if self.layers else None
        return None if state is None else state.start

    def nbytes(self) -> int:
        """Bytes held by all layers' states (keys, values, outputs, positions and slot registers)."""
        return sum(layer.nbytes() for layer in self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        if layer_idx >= len(self.layers):
            return query_length, 0
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.layers[0].get_max_length() if self.layers else -1

    @property
    def max_cache_len(self) -> int | None:
        """The tokens a static cache holds, None for a dynamic one."""
        return self.layers[0].max_cache_len if self.layers else None

    def update(self, *args, **kwargs):
        raise TypeError(
            "ResolventCache holds mixer states, not attention keys/values: it is filled by the resolvent model's "
            "forward (ResolventForCausalLM), not by update()"
        )

    def crop(self, length: int) -> None:
        """Drop the ``-length`` newest tokens (``length`` <= 0, as ``transformers`` calls it; 0 drops nothing and
        accepts what was recorded), or keep the first ``length`` (> 0). Exact for every layer that keeps all
        positions, and for the others over the tokens recorded since :meth:`activate_past_recording` or the last
        crop; otherwise a ValueError, before any layer changes."""
        for layer in self.layers:  # check every layer before changing any
            if not layer.can_crop(length):
                layer.crop(length)  # raises the explanatory error
        for layer in self.layers:
            layer.crop(length)

    @property
    def is_compileable(self) -> bool:
        """True for a static cache (``max_cache_len``): generate() may then compile the decode step."""
        return bool(self.layers) and all(layer.is_compileable for layer in self.layers)

    @property
    def is_croppable(self) -> bool:
        return all(layer.is_croppable for layer in self.layers)

    @property
    def batch_size(self) -> int:
        sizes = {layer.batch_size for layer in self.layers if layer.batch_size >= 0}
        if len(sizes) > 1:
            raise ValueError(f"the batch size is not consistent across layers: {sorted(sizes)}")
        return sizes.pop() if sizes else -1


# A pytree of the layers' states, so that torch.export can return the cache a forward builds (use_cache=True, the
# default in eval mode) and take one as an input. transformers' own exporter registers Cache classes its way when it
# finds one unregistered; this one comes first.


def _cache_children(cache: ResolventCache) -> tuple[list, tuple]:
    layers = tuple((layer.pattern.name, layer.tied, layer.max_cache_len, layer.record_past, layer.conv_first,
                    layer.conv_width) for layer in cache.layers)
    children = [layer.state for layer in cache.layers] + [layer.conv_rows for layer in cache.layers]
    return children, (cache.head_shape, layers)


def _cache_from_children(children, context) -> ResolventCache:
    head_shape, specs = context
    states, conv_rows = children[:len(specs)], children[len(specs):]
    layers = []
    for state, rows, (pattern, tied, max_cache_len, record_past, conv_first, conv_width) in zip(states, conv_rows,
                                                                                              specs):
        layer = ResolventCacheLayer(pattern, tied, max_cache_len, conv_width)
        layer.record_past, layer._state = record_past, state  # as flattened: no new recording starts
        layer.conv_rows, layer.conv_first = rows, conv_first
        layers.append(layer)
    cache = ResolventCache.__new__(ResolventCache)
    Cache.__init__(cache, layers=layers)
    cache.head_shape = head_shape
    return cache


def _cache_children_with_keys(cache: ResolventCache) -> tuple[list, tuple]:
    children, context = _cache_children(cache)
    return [(torch.utils._pytree.SequenceKey(i), child) for i, child in enumerate(children)], context


torch.utils._pytree.register_pytree_node(
    ResolventCache, _cache_children, _cache_from_children,
    serialized_type_name=f"{ResolventCache.__module__}.ResolventCache", flatten_with_keys_fn=_cache_children_with_keys)
