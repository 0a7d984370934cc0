"""Decode cache of resolvent models: a ``transformers`` :class:`~transformers.Cache` with one mixer state per layer.

Each layer keeps only what its pattern lets future tokens read (docs/DESIGN.md section 4): every position for
attention, dense and plain f-patterns, the last w - 1 for local attention, the last w for banded patterns, and the
slots of the register for cache-efficient patterns (12 rows after 2048 tokens for ``exp2:ce``). A row holds the keys
of both channels (after RoPE), the input x and the output y; the tied variant keeps its B keys and z only;
attention kinds keep their keys and values. A model with a short convolution (``conv_size`` K) also keeps, per
layer, the last K - 1 projected rows the convolution reads. All of it is the layer's
:class:`~hf_resolvent.ops.DecodeState`; a cache layer is the adapter that ``transformers`` talks to, and holds no
tensor of its own.

With ``max_cache_len`` (``generate(cache_implementation="static")``) the states' buffers are allocated for that many
tokens at fixed addresses and written in place: the cache is then compileable, and a compiled decode step runs
every token as one graph.

This file is copied into saved model folders (remote code): it may import only flat sibling modules.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .inputs_resolvent import CACHE_NAME
from .patterns import Pattern, get_pattern
from .resolvent_ops import DecodeState

__all__ = ["ResolventCache", "ResolventCacheLayer", "prepare_generation_cache"]


class ResolventCacheLayer:
    """One layer's place in the cache: its pattern and its :class:`DecodeState` (None before the first forward).

    Implements the per-layer methods that :class:`transformers.Cache` and ``generate()`` call (beam-search
    reordering, batch selection and repetition, reset, offloading, past recording and cropping) by delegating to
    the state, which owns the rows and the rules. Cropping is exact for patterns that keep every position (without a
    convolution), and for the others over the tokens decoded since :meth:`activate_past_recording` (``generate()``
    calls it for assisted and prompt-lookup decoding) or since the last crop.

    With ``max_cache_len`` the state's buffers hold that many tokens at fixed addresses, and the layer is
    compileable; it then crops only patterns that keep every position.
    """

    is_sliding = False
    supports_early_init = False

    def __init__(self, pattern: Pattern | str, tied: bool = False, max_cache_len: int | None = None,
                 conv_size: int = 0):
        self.pattern = get_pattern(pattern)
        self.tied = tied
        self.max_cache_len = max_cache_len
        self.conv_width = conv_size
        self.state: DecodeState | None = None
        self.spare: DecodeState | None = None  # a static layer's state after a reset, whose buffers a prefill reuses
        self.device = None
        self.record_past = False

    def __repr__(self) -> str:
        rows = 0 if self.state is None else self.state.rows_held()
        return f"ResolventCacheLayer(pattern={self.pattern.name!r}, seen={self.get_seq_length()}, rows={rows})"

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
        return ("keys_b", "outputs") if self.tied else DecodeState.NAMES

    def store_prefill(self, rows: dict[str, torch.Tensor], start: torch.Tensor | None,
                      conv: torch.Tensor | None = None) -> None:
        """Take the state of a prefill from its per-position tensors (``DecodeState.from_prefill``'s ``tensors``,
        each (B, H, n, .), and ``conv``, the convolution's input rows), in fixed buffers when the layer is static:
        those of its last state where they fit, so that a compiled step keeps its addresses."""
        spare, self.spare = self.spare, None
        if spare is not None and spare.refill(rows, start, conv):
            self.state = spare
            return
        self.state = DecodeState.from_prefill(self.pattern, rows, start, record=self.record_past,
                                              capacity=self.max_cache_len, conv=conv)

    @property
    def keeps_every_position(self) -> bool:
        """True when the state holds all past rows (attention, dense, plain f-patterns) and no convolution rows: it
        crops by marking rows empty."""
        return DecodeState.keeps_every_token(self.pattern) and not self.conv_width

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can put the layer back as it was: always for states that crop by themselves, and for
        the others while recording past states."""
        return self.keeps_every_position or self.record_past

    def activate_past_recording(self) -> None:
        """Record the state before each decoded token until the next :meth:`crop`, so that crop can go back over
        them (``transformers``' name for it; generate() calls it for assisted and prompt-lookup decoding)."""
        if self.is_compileable and not self.keeps_every_position:
            what = (f"pattern {self.pattern.name!r} (it drops past positions)"
                    if not DecodeState.keeps_every_token(self.pattern)
                    else "the short convolution's past rows (conv_size)")
            raise ValueError(f"a static cache cannot record past states for {what}, so assisted and prompt-lookup "
                             "decoding cannot roll it back; leave cache_implementation unset")
        self.record_past = True
        if self.state is not None:
            self.state.record_history()

    @property
    def batch_size(self) -> int:
        return -1 if self.state is None else self.state.batch_size

    def get_seq_length(self) -> int:
        """Tokens seen, a host int: the state counts them on the host. Inside a compiled graph, a static layer's
        count is its 0-d device tensor (a host value there would be a constant of the graph)."""
        if self.state is None:
            return 0
        if torch.compiler.is_compiling() and self.state.storage.fixed:
            return self.state.seen
        return self.state.count()

    def get_max_length(self) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def nbytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes()

    def reset(self) -> None:
        if self.is_compileable and self.state is not None:
            self.spare = self.state  # its buffers serve the next prefill
        self.state = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.state is not None:
            self.state.select_batch(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state.repeat_batch(repeats)

    def target_length(self, length: int) -> int:
        """The tokens left by ``crop(length)``: ``length`` > 0 keeps that many, <= 0 drops ``-length`` newest ones."""
        seen = self.get_seq_length()
        return min(seen, length) if length > 0 else max(0, seen + length)

    def can_crop(self, length: int) -> bool:
        """True when ``crop(length)`` is exact (see :meth:`crop`)."""
        return self.state is None or self.state.can_crop_to(self.target_length(length))

    def crop(self, length: int) -> None:
        """Drop the ``-length`` newest tokens (``length`` <= 0, ``transformers``' convention), or keep the first
        ``length`` (> 0). What was recorded is then forgotten: the tokens left are accepted. Raises a ValueError
        where the state cannot go back that far (see :meth:`DecodeState.crop`)."""
        if self.state is None:
            return
        self.state.crop(self.target_length(length))
        self.state.forget_history()

    def offload(self) -> None:
        if self.state is None:
            return
        self.device = self.state.positions.device  # where prefetch() brings it back
        self.state.to("cpu", non_blocking=True)

    def prefetch(self) -> None:
        if self.device is not None and self.state is not None:
            self.state.to(self.device, non_blocking=True)


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
        # the projected parts each layer's convolution reads (qa, ka, x, qb, kb; fewer for attention and tied)
        self.conv_parts = [3 if not get_pattern(spec["pattern"]).has_recurrence or spec["tied"] else 5
                           for spec in config.layer_mixers]

    def allocate(self, batch_size: int, dtype: torch.dtype = torch.float32, device=None) -> ResolventCache:
        """Give a static cache its empty states now, instead of at the first forward; a prompt then runs through
        the decode step one token at a time (as an exported step does, :mod:`hf_resolvent.export`). Returns the
        cache."""
        if self.max_cache_len is None:
            raise ValueError("allocate() is for a static cache: ResolventCache(config, max_cache_len=...)")
        heads, dim = self.head_shape
        for layer, parts in zip(self.layers, self.conv_parts):
            conv = None if not layer.conv_width else (layer.conv_width - 1, parts * heads * dim)
            layer.state = DecodeState.empty(layer.pattern, dict.fromkeys(layer.row_names, dim), batch_size, heads,
                                            self.max_cache_len, dtype, device, conv_shape=conv)
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
        """Bytes held by all layers' states (keys, values, outputs and positions, convolution rows)."""
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

    def extend_columns(self, name: str, t: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """``t`` (B, n) with ``columns`` (B, k) appended, for what ``generate()`` grows by a column per token (the
        attention mask, the position ids), ``name`` telling them apart.

        ``t`` grows inside a buffer this cache holds, twice as long as needed when it is made: a token writes its
        own columns instead of copying every column before it (a copy as long as the prompt). A ``t`` that is not a
        view of that buffer (the prompt's, or one a caller made) is copied into a new one. Views of the buffer stay
        valid: ``generate()`` only appends, and a crop (assisted decoding's rollback) rewrites the columns it gave
        back with the same values.
        """
        rooms = self.__dict__.setdefault("_rooms", {})
        room, (batch, length), more = rooms.get(name), t.shape, columns.shape[1]
        if not (self._holds(name, t) and length + more <= room.shape[1]):
            room = t.new_empty(batch, 2 * (length + more))
            room[:, :length] = t
            rooms[name] = room
            if name == "attention_mask":
                self._mask_checked = 0
        elif name == "attention_mask":  # the columns from ``length`` on are written again: unchecked
            self._mask_checked = min(self._mask_checked, length)
        room[:, length:length + more] = columns
        return room[:, :length + more]

    def _holds(self, name: str, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of the start of the buffer :meth:`extend_columns` grows ``name`` in (compared by
        pointer, shape and strides: no value is read)."""
        room = self.__dict__.get("_rooms", {}).get(name)
        return (room is not None and t.data_ptr() == room.data_ptr() and t.device == room.device
                and t.dtype == room.dtype and t.shape[0] == room.shape[0] and t.stride() == room.stride()
                and t.shape[1] <= room.shape[1])

    def mask_to_check(self, mask: torch.Tensor, past: int, n: int) -> torch.Tensor:
        """The part of a 2-D attention mask given with ``n`` tokens after ``past`` cached ones that a forward must
        still check: the ``n`` new columns alone where ``mask`` is the mask this cache grows (:meth:`extend_columns`)
        and a forward has checked its first ``past`` columns (:meth:`mask_checked`), else all of it. A decode step
        in ``generate()`` then reads its token's column, not a mask as long as the sequence."""
        if mask.shape[1] == past + n and self._holds("attention_mask", mask) and self._mask_checked >= past:
            return mask[:, past:]
        return mask

    def mask_checked(self, mask: torch.Tensor) -> None:
        """Record that a forward checked ``mask`` (remembered only where it is the mask this cache grows)."""
        if self._holds("attention_mask", mask):
            self._mask_checked = mask.shape[1]

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


def prepare_generation_cache(model, generation_config, model_kwargs: dict, max_cache_length: int | None) -> None:
    """The cache ``generate()`` decodes through, put in ``model_kwargs`` (the model's
    ``_prepare_cache_for_generation`` hook): a given :class:`ResolventCache` as it is (an empty cache of another kind
    replaced by one), else a growing one, or for ``cache_implementation="static"`` a preallocated one. Also takes the
    cache under the other release's argument name (``CACHE_NAME``), and checks ``prefill_chunk_size``, which
    transformers uses unchecked."""
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
                cache = model_kwargs[CACHE_NAME] = ResolventCache(model.config)
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
        max_cache_len = max(max_cache_length, getattr(model, "_previous_max_cache_length", -1))
        model._previous_max_cache_length = max_cache_len
        cache = getattr(model, "_static_cache", None)
        if cache is None or cache.max_cache_len != max_cache_len:
            cache = model._static_cache = ResolventCache(model.config, max_cache_len=max_cache_len)
        cache.reset()
        model_kwargs[CACHE_NAME] = cache
    else:
        model_kwargs[CACHE_NAME] = ResolventCache(model.config)
    if generation_config.is_assistant:  # an assistant's drafts are rolled back: as transformers does for its caches
        model_kwargs[CACHE_NAME].activate_past_recording()


# A pytree of the layers' states, so that torch.export can return the cache a forward builds (use_cache=True, the
# default in eval mode) and take one as an input. transformers' own exporter registers Cache classes its way when it
# finds one unregistered; this one comes first.


def _cache_children(cache: ResolventCache) -> tuple[list, tuple]:
    layers = tuple((layer.pattern.name, layer.tied, layer.max_cache_len, layer.record_past, layer.conv_width)
                   for layer in cache.layers)
    return [layer.state for layer in cache.layers], (cache.head_shape, cache.conv_parts, layers)


def _cache_from_children(children, context) -> ResolventCache:
    head_shape, conv_parts, specs = context
    layers = []
    for state, (pattern, tied, max_cache_len, record_past, conv_width) in zip(children, specs):
        layer = ResolventCacheLayer(pattern, tied, max_cache_len, conv_width)
        layer.record_past, layer.state = record_past, state  # as flattened: no new recording starts
        layers.append(layer)
    cache = ResolventCache.__new__(ResolventCache)
    Cache.__init__(cache, layers=layers)
    cache.head_shape, cache.conv_parts = head_shape, conv_parts
    return cache


def _cache_children_with_keys(cache: ResolventCache) -> tuple[list, tuple]:
    children, context = _cache_children(cache)
    return [(torch.utils._pytree.SequenceKey(i), child) for i, child in enumerate(children)], context


torch.utils._pytree.register_pytree_node(
    ResolventCache, _cache_children, _cache_from_children,
    serialized_type_name=f"{ResolventCache.__module__}.ResolventCache", flatten_with_keys_fn=_cache_children_with_keys)
