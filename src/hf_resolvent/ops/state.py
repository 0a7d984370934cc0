"""The decode state of one mixer layer, and every rule that changes it (docs/DESIGN.md section 4).

A layer decodes from a :class:`DecodeState`: the rows that future tokens may still read. This module is the one
home of

- the keep rule: which positions a pattern's state holds after n tokens;
- the read rule: which held rows the next token reads (:meth:`DecodeState.read_rule`, evaluated on the rows by
  :meth:`DecodeState.read_mask` and by the Triton decode kernel);
- advancing by one token: append and trim to a window, or advance the slot register of cache-efficient patterns;
- building the state of a whole prefill directly, without replaying n steps;
- crop: exact by slicing for patterns that keep every position, and by going back to a recorded earlier state for
  the others (:meth:`DecodeState.record_history`: what assisted and prompt-lookup decoding need); batch selection
  and repetition (beam search), device and dtype moves, and the bytes held.

The slot register's arithmetic and its memoised plans are in :mod:`.register`; the preallocated layout of a static
cache, :class:`~.static_state.StaticDecodeState`, in :mod:`.static_state`.

The attention over the held rows is the mixer's business (``recurrent.py``, ``kernels/decode.py``): those call the
methods here and never assign a field, so the invariants below hold wherever a state goes. Every method replaces
a field's tensor rather than writing into it, which is what lets a recorded earlier state share its tensors with
the current one (a shallow copy per token).

Invariants: ``positions`` is the pattern's own 0-indexed position r = t - start of each row (t the sequence index,
start the sequence's left padding), -1 for a padding row or the filler of a shorter sequence in a batch; a row at
-1 is never read. Appending patterns hold their rows oldest first, so row i of a state that keeps every position
is token i. Cache-efficient patterns hold the distinct positions of their slot register, newest first.

Keep rule after n tokens (the pattern is passed to each method; the state does not store it):

=============================================  ===================================================
pattern                                        rows kept
=============================================  ===================================================
``attention``, ``dense``, plain f-patterns     all n
``local_attention:w``                          the last w - 1 (the token itself is read from input)
``banded:w`` (``diagonal``: w = 1)             the last w
cache-efficient f-patterns (``:ce``)           the distinct positions of the slot register S_{n+1}
=============================================  ===================================================

Shapes: B batch, H heads, S rows held, K slots, d key width, e value width, n tokens of a prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch

from .common import records_grad, require
from .patterns import Pattern, get_pattern
from .register import closed_register, distinct_desc, extend_plan, register_plan, rows_at

__all__ = ["DecodeState", "register_pytree"]


@dataclass
class DecodeState:
    """What one layer keeps between decode steps. Build it empty (``DecodeState(start=start)``) and advance it
    token by token, or from a prefill with :meth:`from_prefill`; change it only through its methods.

    Attributes:
        keys_a, keys_b: (B, H, S, d) keys of the A and B channels (after RoPE), None when unused.
        values: (B, H, S, e) inputs x (None for the tied variant, which needs only z).
        outputs: (B, H, S, e) outputs y, or z = y + d x for the tied variant (0 on padding).
        positions: (B, S) int64 pattern position of each row, -1 for padding or empty; None before the first token.
        slots: (B, K) int64, cache-efficient patterns only: the slot register p_k (positions, -1 empty).
        seen: tokens processed so far, padding included.
        start: (B,) leading padding per sequence, or None.
        history: while recording (:meth:`record_history`), the states before each token advanced since, oldest
            first, for :meth:`crop`; None otherwise.
        prefill_rows: while recording, the per-position tensors of the prefill the state was built from (each
            (B, H, n, .)), from which :meth:`crop` rebuilds a state inside the prefill; None otherwise.
    """

    keys_a: torch.Tensor | None = None
    keys_b: torch.Tensor | None = None
    values: torch.Tensor | None = None
    outputs: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    seen: int = 0
    start: torch.Tensor | None = None
    history: list[DecodeState] | None = None
    prefill_rows: dict[str, torch.Tensor] | None = None

    TENSOR_NAMES: ClassVar[tuple[str, ...]] = ("keys_a", "keys_b", "values", "outputs")
    # MODE values of the read rule, as the Triton decode kernel takes them.
    READ_ALL: ClassVar[int] = 0
    READ_WINDOW: ClassVar[int] = 1
    READ_OFFSETS: ClassVar[int] = 2

    # ----------------------------------------------------------------------------------------------
    # Rules of a pattern (no state needed)

    @staticmethod
    def uses_register(pattern: Pattern | str) -> bool:
        """True for cache-efficient f-patterns, whose state follows a slot register instead of a window."""
        pattern = get_pattern(pattern)
        return pattern.kind == "pattern" and pattern.cache_efficient

    @staticmethod
    def trailing_rows(pattern: Pattern | str) -> int | None:
        """Rows a windowed pattern keeps, the most recent ones: w - 1 for ``local_attention:w`` (the token reads
        itself from its input), w for ``banded:w``, 1 for ``diagonal``; None for every other pattern."""
        pattern = get_pattern(pattern)
        if pattern.kind == "local_attention":
            return pattern.window - 1
        return pattern.band

    @staticmethod
    def keeps_every_position(pattern: Pattern | str) -> bool:
        """True when the state holds every past token (attention, dense, plain f-patterns): only then can it be
        cropped, since the other patterns drop rows that no later token reads."""
        return not DecodeState.uses_register(pattern) and DecodeState.trailing_rows(pattern) is None

    @staticmethod
    def read_rule(pattern: Pattern | str, r: torch.Tensor) -> tuple[int, int, list[int]]:
        """Which held rows (valid positions p) the token at positions r (B,) reads, as ``(mode, lo, offsets)``.

        - ``READ_ALL``: every valid row. Attention and dense read all the past; a cache-efficient state holds
          exactly S_{r+1}, so it too reads everything it holds.
        - ``READ_WINDOW``: rows with p >= r - lo, lo = :meth:`trailing_rows`: a window reads what it keeps.
        - ``READ_OFFSETS``: rows with r - p in ``offsets`` (the pattern's f(k) <= r.max()): plain f-patterns keep
          every row but read only a few.
        """
        pattern = get_pattern(pattern)
        lo = DecodeState.trailing_rows(pattern)
        if lo is not None:
            return DecodeState.READ_WINDOW, lo, []
        if pattern.kind == "pattern" and not pattern.cache_efficient:
            return DecodeState.READ_OFFSETS, 0, list(pattern.offsets(int(r.max().item()) + 1))
        return DecodeState.READ_ALL, 0, []

    # ----------------------------------------------------------------------------------------------
    # Reading

    def tensors(self) -> dict[str, torch.Tensor]:
        """The per-row tensors held, by name (keys_a, keys_b, values, outputs), each (B, H, S, .)."""
        return {k: getattr(self, k) for k in self.TENSOR_NAMES if getattr(self, k) is not None}

    def rows(self) -> int:
        """Rows held (S): positions kept for future tokens, padding rows of a batch included."""
        return 0 if self.positions is None else self.positions.shape[1]

    @property
    def batch_size(self) -> int:
        """B, or -1 before the first token (as ``transformers`` cache layers report it)."""
        return -1 if self.positions is None else self.positions.shape[0]

    def nbytes(self) -> int:
        """Bytes of the rows held: keys, values, outputs, positions and slot register (``start`` is not counted). A
        state that keeps every position appends into buffers with spare rows (at most a quarter more, plus 64),
        which are not counted: the figure depends on the tokens seen only."""
        held = list(self.tensors().values()) + [t for t in (self.positions, self.slots) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def next_position(self, batch: int, device) -> torch.Tensor:
        """(B,) int64 pattern position r of the next token: ``seen - start``, negative inside the left padding."""
        r = torch.full((batch,), self.seen, dtype=torch.long, device=device)
        if self.start is not None:
            r = r - self.start.to(device)
        return r

    def read_mask(self, pattern: Pattern, r: torch.Tensor) -> torch.Tensor:
        """(B, S) which held rows the tokens at positions r (B,) read through B (through A for attention kinds):
        :meth:`read_rule`, evaluated on the rows."""
        mode, lo, offsets = self.read_rule(pattern, r)
        p, r = self.row_positions(r.shape[0], r.device), r[:, None]
        valid = p >= 0
        if mode == self.READ_WINDOW:
            return valid & (p >= r - lo)
        if mode == self.READ_OFFSETS:
            return valid & torch.isin(r - p, torch.tensor(offsets, dtype=torch.long, device=p.device))
        return valid

    def row_positions(self, batch: int, device) -> torch.Tensor:
        """(B, S) ``positions``, or an empty (B, 0) before the first token."""
        if self.positions is None:
            return torch.full((batch, 0), -1, dtype=torch.long, device=device)
        return self.positions

    def held_rows(self, pattern: Pattern | str, p: torch.Tensor) -> torch.Tensor:
        """The row that holds position p (B, ...) (valid, before the next token), for each sequence: found by position
        in a register; else row p + start (states that keep every position hold token i at row i) or, in a window of
        the last S tokens, S + p - r (r the next position). A position not held gives a row whose position differs."""
        pattern = get_pattern(pattern)
        held = self.row_positions(p.shape[0], p.device)
        flat = p.reshape(p.shape[0], -1)
        if self.uses_register(pattern):
            rows = (flat[:, :, None] == held[:, None, :]).to(torch.int8).argmax(-1)
        elif self.trailing_rows(pattern) is not None:
            rows = held.shape[1] + flat - self.next_position(p.shape[0], p.device)[:, None]
        else:
            rows = flat if self.start is None else flat + self.start.to(p.device)[:, None]
        return rows.view_as(p)

    # ----------------------------------------------------------------------------------------------
    # Advancing

    def advance(self, pattern: Pattern | str, new: dict[str, torch.Tensor], r: torch.Tensor) -> None:
        """Take in one token and drop the rows the pattern will not read again; ``seen`` grows by 1.

        Args:
            pattern: the layer's pattern (spec or Pattern), the same at every call.
            new: the token's tensors by name (see :attr:`TENSOR_NAMES`), each (B, H, d) or (B, H, e); the same
                names at every call.
            r: (B,) its positions, from :meth:`next_position`; negative (left padding) is stored as -1.
        """
        pattern = get_pattern(pattern)
        if self.history is not None and not self.keeps_every_position(pattern):  # those crop by slicing
            self.history.append(replace(self, history=None, prefill_rows=None))
        if self.uses_register(pattern):
            self._advance_register(pattern, new, r)
        else:
            rows = {name: t[:, :, None] for name, t in new.items()}
            self._append(rows, r[:, None], self.trailing_rows(pattern))
        self.seen += 1

    def _append(self, new: dict[str, torch.Tensor], r: torch.Tensor, keep: int | None) -> None:
        """Add the tokens (each (B, H, L, .), at positions r (B, L); negative is stored as -1) as the newest rows, then
        keep the last ``keep`` rows (None: all)."""
        pos_new = torch.where(r >= 0, r, -1)
        # autograd keeps views of the rows: no writing into spare rows then
        if keep is None and pos_new.device.type == "cpu" and not records_grad(new.values()):
            for name, t in new.items():
                setattr(self, name, _grown(getattr(self, name), t, dim=2))
            self.positions = _grown(self.positions, pos_new, dim=1)
            return
        for name, t in new.items():
            setattr(self, name, _last_rows(getattr(self, name), t, keep, dim=2))
        self.positions = _last_rows(self.positions, pos_new, keep, dim=1)

    def _advance_register(self, pattern: Pattern, new: dict[str, torch.Tensor], r: torch.Tensor) -> None:
        """Slot rule (:func:`register_step`), then hold the distinct positions of the new register."""
        slots, positions, src = register_plan(pattern, self.slots, self.positions, r)
        for name, t in new.items():  # each kept position is the new token (last of `both`) or a row already held
            old_t = getattr(self, name)
            both = t[:, :, None] if old_t is None else torch.cat([old_t, t[:, :, None]], dim=2)
            setattr(self, name, both.gather(2, src[:, None, :, None].expand(-1, both.shape[1], -1, both.shape[-1])))
        self.slots = slots
        self.positions = positions

    def can_extend(self, pattern: Pattern | str) -> bool:
        """True when :meth:`extend` can take several tokens at once: always, except while recording for a pattern
        that drops positions (a crop then needs the state before each token)."""
        return self.history is None or self.keeps_every_position(pattern)

    def extend(self, pattern: Pattern | str, new: dict[str, torch.Tensor], r: torch.Tensor) -> None:
        """Take in L tokens at once, as L calls of :meth:`advance` would: the same rows, positions and register.

        Args:
            pattern: the layer's pattern, as for :meth:`advance`.
            new: the tokens' tensors by name, each (B, H, L, .).
            r: (B, L) their positions, consecutive from :meth:`next_position`, all >= 0 (continuing a cache
                takes no padding).
        """
        pattern = get_pattern(pattern)
        if not self.can_extend(pattern):
            raise RuntimeError("this state records the state before each token: advance it token by token")
        if self.uses_register(pattern):
            slots, positions, plan = extend_plan(pattern, self.row_positions(r.shape[0], r.device), r)
            for name, t in new.items():
                setattr(self, name, rows_at(plan, t, getattr(self, name)))
            self.slots, self.positions = slots, positions
        else:
            self._append(new, r, self.trailing_rows(pattern))
        self.seen += r.shape[1]

    # ----------------------------------------------------------------------------------------------
    # Cache operations

    def record_history(self, on: bool = True) -> None:
        """Start (or stop) keeping the state before each token that :meth:`advance` takes, so that :meth:`crop` can go
        back over those tokens for every pattern. A recorded state is a shallow copy (its tensors are shared): the
        cost is the rows a pattern holds per token recorded, O(log n) for ``exp2:ce``. Patterns that keep every
        position record nothing: they crop by slicing. Stopping forgets what was recorded, the prefill's rows too."""
        self.history = [] if on else None
        if not on:
            self.prefill_rows = None

    def _reach(self, pattern: Pattern, length: int) -> str | None:
        """How :meth:`crop` reaches ``length``: "none" (nothing to drop), "slice", "history", "prefill", or None."""
        if length >= self.seen:
            return "none"
        if self.keeps_every_position(pattern):
            return "slice"
        if self.history is not None and self.seen - length <= len(self.history):
            return "history"
        rows = self.prefill_rows
        start = 0 if self.start is None else int(self.start.max())
        if rows is not None and start < length <= next(iter(rows.values())).shape[2]:
            return "prefill"
        return None

    def can_crop_to(self, pattern: Pattern | str, length: int) -> bool:
        """True when :meth:`crop` to ``length`` is exact (see there)."""
        return self._reach(get_pattern(pattern), length) is not None

    def forget_history(self) -> None:
        """Drop what was recorded so far and go on recording (the tokens before are accepted for good)."""
        if self.history is not None:
            self.history = []
        self.prefill_rows = None

    def crop(self, pattern: Pattern | str, length: int) -> None:
        """Forget every token after the first ``length`` (>= 0), as if only those had been seen.

        Patterns that keep every position slice their rows (row i is token i). The others have dropped rows that the
        shorter state would hold: while recording (:meth:`record_history`) they go back to the state recorded before
        token ``length``, or rebuild it from the recorded prefill when ``length`` lies inside it (past its padding);
        elsewhere they raise a ValueError.
        """
        pattern = get_pattern(pattern)
        if length < 0:
            raise ValueError(f"crop length must be >= 0, got {length}")
        reach = self._reach(pattern, length)
        if reach == "none":
            return
        if reach is None:
            raise ValueError(self._why_not_cropped(pattern, length))
        if reach == "slice":
            self._slice(length)
            return
        if reach == "history":
            earlier = self.history[length - self.seen]  # the state before token `length`
            del self.history[length - self.seen:]
        else:
            earlier = self.from_prefill(pattern, {k: t[:, :, :length] for k, t in self.prefill_rows.items()}, self.start)
            self.history = [] if self.history is not None else None
        for f in fields(self):
            if f.name not in ("history", "prefill_rows"):
                setattr(self, f.name, getattr(earlier, f.name))

    def _slice(self, length: int) -> None:
        """Keep the first ``length`` rows (patterns that keep every position: row i is token i)."""
        for name, t in self.tensors().items():
            setattr(self, name, t[:, :, :length])
        self.positions = self.positions[:, :length]
        self.seen = length

    def _why_not_cropped(self, pattern: Pattern, length: int) -> str:
        recorded = 0 if self.history is None else len(self.history)
        return (f"the decode state of pattern {pattern.name!r} cannot be cropped back {self.seen - length} token(s): "
                f"the pattern drops past positions (that is what keeps its cache small), and the states of only the "
                f"last {recorded} tokens were recorded. Record them first (cache.activate_past_recording(), which "
                "generate() does for assisted and prompt-lookup decoding), or re-run the prompt.")

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep the sequences ``index`` (B',) in that order (repeats allowed): beam-search reordering, batch
        selection. Every per-sequence tensor follows, ``start``, the slot register and the recorded states included."""
        for state in [self] + (self.history or []):
            for name in self.TENSOR_NAMES + ("positions", "slots", "start"):
                t = getattr(state, name)
                if t is not None:
                    setattr(state, name, t.index_select(0, index.to(t.device)))
        if self.prefill_rows is not None:
            self.prefill_rows = {k: t.index_select(0, index.to(t.device)) for k, t in self.prefill_rows.items()}

    def repeat_batch(self, repeats: int) -> None:
        """Repeat each sequence ``repeats`` times in place (B -> B * repeats, like ``repeat_interleave``), e.g.
        for ``num_return_sequences``. A state with neither rows nor ``start`` has no batch and is left as is."""
        ref = self.positions if self.positions is not None else self.start
        if ref is None:
            return
        self.select_batch(torch.arange(ref.shape[0], device=ref.device).repeat_interleave(repeats))

    def to(self, device=None, dtype: torch.dtype | None = None, non_blocking: bool = False) -> DecodeState:
        """Move the state to ``device`` and cast its rows (keys, values, outputs) to ``dtype``, in place; the
        integer tensors (positions, slots, start) keep int64. Recorded states move too. Returns the state, like
        ``nn.Module.to``."""
        for state in [self] + (self.history or []):
            for name, t in state.tensors().items():
                setattr(state, name, t.to(device=device, dtype=dtype, non_blocking=non_blocking))
            for name in ("positions", "slots", "start"):
                t = getattr(state, name)
                if t is not None:
                    setattr(state, name, t.to(device=device, non_blocking=non_blocking))
        if self.prefill_rows is not None:
            self.prefill_rows = {k: t.to(device=device, dtype=dtype, non_blocking=non_blocking)
                                 for k, t in self.prefill_rows.items()}
        return self

    # ----------------------------------------------------------------------------------------------
    # Prefill

    @classmethod
    def from_prefill(cls, pattern: Pattern | str, tensors: dict[str, torch.Tensor],
                     start: torch.Tensor | None = None, record: bool = False) -> DecodeState:
        """The state after a whole sequence, cut from its per-position tensors (no replay of n steps).

        Gives the positions, slot register and ``seen`` that n calls of :meth:`advance` leave, and the same
        tensors on every row a later token can read: appending patterns keep their trailing rows; cache-efficient
        patterns take the register from its closed form p_k = a_k * ceil((i - f(k)) / a_k) (1-indexed i = r + 2,
        stored 0-indexed; -1 where f(k) > r + 1) and hold its distinct positions, newest first.

        Args:
            pattern: a spec or :class:`~hf_resolvent.patterns.Pattern`.
            tensors: the rows to store, each (B, H, n, .): ``keys_a`` and ``values`` (A channel; attention kinds and
                the untied resolvent), ``keys_b`` and ``outputs`` (B channel: y, or z = y + d x for the tied variant,
                zero on padding). Keys after RoPE. Only the given names are stored.
            start: optional (B,) leading padding per sequence, in [0, n).
            record: start recording (:meth:`record_history`); a pattern that drops positions then also keeps
                ``tensors`` until the next :meth:`forget_history`, so that :meth:`crop` can go back inside the prefill.

        Returns:
            A state ready for token n; its rows are copies (they do not pin the full tensors, unless recording).
        """
        pattern = get_pattern(pattern)
        unknown = set(tensors) - set(cls.TENSOR_NAMES)
        if unknown:
            raise ValueError(f"tensors may only hold {cls.TENSOR_NAMES}, got {sorted(unknown)}")
        if not tensors:
            raise ValueError("tensors is empty: give at least the values or outputs of the sequence")
        ref = next(iter(tensors.values()))
        batch, _, n = ref.shape[:3]
        for name, t in tensors.items():
            if t.dim() != 4 or tuple(t.shape[:3]) != (batch, ref.shape[1], n):
                raise ValueError(
                    f"{name} must be (B, H, n, .) = ({batch}, {ref.shape[1]}, {n}, .), got {tuple(t.shape)}")
        device = ref.device
        if start is not None:
            start = start.to(device=device, dtype=torch.long)
            message = f"start must be (batch,) = ({batch},) with values in [0, n) = [0, {n})"
            if start.shape != (batch,):
                raise ValueError(message)
            require(((start >= 0) & (start < n)).all(), message, lambda: message)
        offset = torch.zeros(batch, dtype=torch.long, device=device) if start is None else start

        if cls.uses_register(pattern):
            # inside a graph the register's width cannot depend on the values of start: n - 1 bounds every row
            bound = n - 1 if torch.compiler.is_compiling() else None
            slots = closed_register(pattern, n - 1 - offset, top=bound)
            positions = distinct_desc(slots, width=None if bound is None else slots.shape[1])
            rows = torch.where(positions >= 0, positions + offset[:, None], 0)  # (B, W) sequence index t
            kept = {name: t.gather(2, rows[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1]))
                    for name, t in tensors.items()}
            state = cls(**kept, positions=positions, slots=slots, seen=n, start=start)
        else:
            keep = cls.trailing_rows(pattern)
            first = n - (n if keep is None else min(n, keep))  # sequence index of the oldest row kept
            kept = {name: t[:, :, first:].clone() for name, t in tensors.items()}
            r = torch.arange(first, n, device=device)[None, :] - offset[:, None]
            state = cls(**kept, positions=torch.where(r >= 0, r, -1), seen=n, start=start)
        if record:
            state.record_history()
            if not cls.keeps_every_position(pattern):
                state.prefill_rows = dict(tensors)
        return state


def _grown(held: torch.Tensor | None, rows: torch.Tensor, dim: int) -> torch.Tensor:
    """``held`` with ``rows`` appended along ``dim``, as a view of a buffer with spare rows: the rows are written into
    the spare capacity of ``held``'s buffer when it has enough, else into a new buffer a quarter larger, so that
    appending to a state that keeps every position costs O(1) per token (amortised), not a copy of every row.

    Only the rows past ``held``'s end are written, which no earlier view of the buffer shows; the states of these
    patterns record no history (they crop by slicing), so no other state shares the buffer. (On CUDA the Triton
    decode kernel reads contiguous rows: there the rows are concatenated instead.)"""
    if held is None:
        return rows.clone()
    size, more = held.shape[dim], rows.shape[dim]
    base = held._base
    if (base is not None and base.shape[dim] >= size + more and held.data_ptr() == base.data_ptr()
            and held.stride() == base.stride()
            and all(a == b for i, (a, b) in enumerate(zip(held.shape, base.shape)) if i != dim)):
        base.narrow(dim, size, more).copy_(rows)
        return base.narrow(dim, 0, size + more)
    shape = list(held.shape)
    shape[dim] = size + more + max(size // 4, 64)
    base = held.new_empty(shape)
    base.narrow(dim, 0, size).copy_(held)
    base.narrow(dim, size, more).copy_(rows)
    return base.narrow(dim, 0, size + more)


def _last_rows(held: torch.Tensor | None, new: torch.Tensor, keep: int | None, dim: int) -> torch.Tensor:
    """[held; new] along ``dim``, its last ``keep`` rows (None: all), as a new tensor: only the rows kept are copied,
    and the result pins neither input."""
    if keep is not None:
        new = new.narrow(dim, max(0, new.shape[dim] - keep), min(keep, new.shape[dim]))
        if held is not None:
            left = max(0, keep - new.shape[dim])
            held = held.narrow(dim, max(0, held.shape[dim] - left), min(left, held.shape[dim]))
    return torch.cat([t for t in (held, new) if t is not None], dim=dim)


# --------------------------------------------------------------------------------------------------
# States as pytrees: torch.export returns the cache a prefill builds, and takes one as an input


def _state_children(state: DecodeState) -> tuple[list, tuple]:
    """A state's tensors (and containers of tensors, None where unused) as children; its other fields (counts,
    capacity) and its class as the context."""
    children, names, constants = [], [], []
    for field in fields(state):
        value = getattr(state, field.name)
        if value is None or isinstance(value, (torch.Tensor, list, dict)):
            children.append(value)
            names.append(field.name)
        else:
            constants.append((field.name, value))
    return children, (type(state), tuple(names), tuple(constants))


def _state_from_children(children, context) -> DecodeState:
    cls, names, constants = context
    return cls(**dict(zip(names, children)), **dict(constants))


def _state_children_with_keys(state: DecodeState) -> tuple[list, tuple]:
    children, context = _state_children(state)
    return [(torch.utils._pytree.GetAttrKey(name), child) for name, child in zip(context[1], children)], context


def register_pytree(cls: type) -> None:
    """Make a state class a pytree (its tensors the children)."""
    torch.utils._pytree.register_pytree_node(
        cls, _state_children, _state_from_children, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=_state_children_with_keys)


register_pytree(DecodeState)
