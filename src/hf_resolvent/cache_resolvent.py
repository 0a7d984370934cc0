"""Decode cache of resolvent models: a ``transformers`` :class:`~transformers.Cache` with one mixer state per layer.

Each layer keeps only what its pattern lets future tokens read (docs/DESIGN.md section 4): every position for
attention, dense and plain f-patterns, the last w - 1 for local attention, the last w for banded patterns, and the distinct
positions of the slot register for cache-efficient patterns (12 rows after 2048 tokens for ``exp2:ce``).
A row holds the keys of both channels (after RoPE), the input x and the output y; the tied variant keeps its
B keys and z only; attention kinds keep their keys and values.

This file is copied into saved model folders (remote code): it may import only flat sibling modules.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .patterns import Pattern, get_pattern
from .resolvent_ops import DecodeState

__all__ = ["ResolventCache", "ResolventCacheLayer"]


class ResolventCacheLayer:
    """One layer's decode state: a :class:`DecodeState` (or None before the first forward) and its pattern.

    Implements the per-layer methods that :class:`transformers.Cache` and ``generate()`` call (beam-search
    reordering, batch selection and repetition, reset, offloading, and cropping where the pattern keeps
    every position) by delegating to the state, which owns the rules.
    """

    is_compileable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, pattern: Pattern | str, tied: bool = False):
        self.pattern = get_pattern(pattern)
        self.tied = tied
        self.state: DecodeState | None = None
        self.device = None

    def __repr__(self) -> str:
        rows = 0 if self.state is None else self.state.rows()
        return f"ResolventCacheLayer(pattern={self.pattern.name!r}, seen={self.get_seq_length()}, rows={rows})"

    @property
    def is_initialized(self) -> bool:
        return self.state is not None

    @property
    def keeps_every_position(self) -> bool:
        """True when the state holds all past rows (attention, dense, plain f-patterns): then it can be cropped."""
        return DecodeState.keeps_every_position(self.pattern)

    @property
    def is_croppable(self) -> bool:
        return self.keeps_every_position

    @property
    def batch_size(self) -> int:
        return -1 if self.state is None else self.state.batch_size

    def get_seq_length(self) -> int:
        return 0 if self.state is None else self.state.seen

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def nbytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes()

    def reset(self) -> None:
        self.state = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.state is not None:
            self.state.select_batch(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state.repeat_batch(repeats)

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (negative: drop that many), like ``DynamicLayer.crop``; raises a
        ValueError where the pattern does not keep every position (see :meth:`DecodeState.crop`)."""
        if self.state is None:
            return
        if max_length < 0:  # dropping more than was seen leaves nothing, as for DynamicLayer
            max_length = max(0, self.state.seen - abs(max_length))
        self.state.crop(self.pattern, max_length)

    def offload(self) -> None:
        if self.state is None:
            return
        if self.state.positions is not None:
            self.device = self.state.positions.device  # where prefetch() brings it back
        self.state.to("cpu", non_blocking=True)

    def prefetch(self) -> None:
        if self.device is not None and self.state is not None:
            self.state.to(self.device, non_blocking=True)


class ResolventCache(Cache):
    """Per-layer decode states of a resolvent model, usable wherever ``generate()`` expects a ``Cache``.

    ``get_seq_length()`` is the number of tokens seen (left padding included, as for ``DynamicCache``), not the
    rows held; :meth:`nbytes` is the memory the states hold. Beam search (``reorder_cache``), batch selection and
    repetition work for every pattern; :meth:`crop` only where every layer keeps all positions.

    Args:
        config: a :class:`~hf_resolvent.ResolventConfig` (its ``layer_mixers`` give each layer's pattern).
    """

    def __init__(self, config=None, **kwargs):
        if config is None or not hasattr(config, "layer_mixers"):
            raise ValueError("ResolventCache needs the model's ResolventConfig: ResolventCache(model.config)")
        layers = [ResolventCacheLayer(spec["pattern"], spec["tied"]) for spec in config.layer_mixers]
        super().__init__(layers=layers)

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
        return -1

    def update(self, *args, **kwargs):
        raise TypeError(
            "ResolventCache holds mixer states, not attention keys/values: it is filled by the resolvent model's "
            "forward (ResolventForCausalLM), not by update()"
        )

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (negative: drop that many); only when every layer keeps all rows."""
        seen = self.get_seq_length()
        target = seen - abs(max_length) if max_length < 0 else max_length
        for layer in self.layers:  # check every layer before changing any
            if layer.is_initialized and target < seen and not layer.keeps_every_position:
                layer.crop(target)  # raises the explanatory error
        for layer in self.layers:
            layer.crop(max_length)

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return all(layer.is_croppable for layer in self.layers)

    @property
    def batch_size(self) -> int:
        sizes = {layer.batch_size for layer in self.layers if layer.batch_size >= 0}
        if len(sizes) > 1:
            raise ValueError(f"the batch size is not consistent across layers: {sorted(sizes)}")
        return sizes.pop() if sizes else -1
