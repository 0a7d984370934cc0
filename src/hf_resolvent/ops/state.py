"""The decode state of one mixer layer: every row the layer keeps between decode steps, where each row sits, and every
rule that changes them (docs/DESIGN.md section 4).

One :class:`DecodeState` holds all that a layer keeps: the mixer's rows (keys of both channels after RoPE, inputs x,
outputs y; the tied variant's B keys and z; attention's keys and values), the pattern position of each row, the
short convolution's last input rows, the tokens taken and the left padding. Its storage is a component:
:class:`Growing` (the dynamic cache: buffers that grow as tokens come, ``seen`` a host int) or :class:`Fixed` (the
static cache: buffers allocated once for ``capacity`` tokens at fixed addresses, ``seen`` a 0-d device tensor, so
that a compiled decode step is one graph for every token and can be captured). Every method writes into the buffers
in place (``copy_``, ``index_copy_``), and nothing in a decode step reads a device value on the host: what the host
needs (how many rows, which offsets) follows from the tokens taken, which the host counts.

Layouts (t is a token's index in its sequence, padding included; ``positions`` holds its pattern position
r = t - start, or -1 for padding and empty rows, which are never read):

=============================================  =========================================================
pattern                                        rows
=============================================  =========================================================
``attention``, ``dense``, plain f-patterns     every token: row t
``local_attention:w``, ``banded:w``,           a ring of the last w - 1 (local attention: the token reads
``diagonal`` (w = 1)                           itself from its input) or w tokens: row t mod the ring's size
cache-efficient f-patterns (``:ce``)           the slot register (docs/DESIGN.md section 2.1): row k holds
                                               slot k's token; a position held by several slots is read once
=============================================  =========================================================

The register after the tokens up to position r has the closed form p_k = a_k * ceil((r + 2 - f(k)) / a_k) - 1
(0-indexed, -1 where f(k) > r + 1), and one more token moves it by the slot rule: slot 0 takes the token, slot k
keeps p_k while r + 1 - f(k) <= p_k, else takes slot k - 1's (:func:`register_step`).

Crop (assisted and prompt-lookup decoding roll back rejected drafts): a state that keeps every token crops by
marking the dropped rows empty; the others, while recording (:meth:`DecodeState.record_history`), go back to a copy
of their small state taken before each token, or rebuild it from the recorded prefill.

Shapes: B batch, H heads, S rows, K slots, C convolution channels, n tokens of a prefill, L new tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import ClassVar

import torch

from .common import require
from .patterns import Pattern, get_pattern

__all__ = ["DecodeState", "Fixed", "Growing", "StepPlan", "closed_register", "register_step", "register_pytree"]

ALL, RING, SLOTS = "all", "ring", "slots"  # the layouts


def layout_of(pattern: Pattern) -> str:
    """Where a pattern's state keeps its rows: ``ALL`` tokens, a ``RING`` of the last ones, or register ``SLOTS``."""
    if pattern.kind == "pattern" and pattern.cache_efficient:
        return SLOTS
    return ALL if ring_size(pattern) is None else RING


def ring_size(pattern: Pattern) -> int | None:
    """Rows a windowed pattern keeps, the most recent ones: w - 1 for ``local_attention:w`` (the token reads itself
    from its input), w for ``banded:w``, 1 for ``diagonal``; None for every other pattern."""
    if pattern.kind == "local_attention":
        return pattern.window - 1
    return pattern.band


# --------------------------------------------------------------------------------------------------
# The register's arithmetic


def closed_register(pattern: Pattern, r_last: torch.Tensor, top: int) -> torch.Tensor:
    """(B, K) slot register after the tokens up to pattern position r_last (B,), in closed form; ``top``, a bound of
    r_last known on the host, sets K = the offsets f(k) <= top + 1 (slots past a sequence's own are -1)."""
    device = r_last.device
    fs = _table(pattern, "offsets", top + 2, device)
    steps = _table(pattern, "steps", top + 2, device)
    i = (r_last + 2)[:, None]  # 1-indexed row of the next token
    pos = steps[None] * torch.div(i - fs[None] + steps[None] - 1, steps[None], rounding_mode="floor") - 1
    valid = (fs[None] <= r_last[:, None] + 1) & (r_last[:, None] >= 0)
    return torch.where(valid, pos, -1)


def register_step(old: torch.Tensor, r: torch.Tensor, fs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot rule for one token: the register (B, K) after the token at r (B,) from the register ``old`` (B, K)
    before it, with offsets fs (K,); and ``stay`` (B, K), the slots that keep their position (the others take slot
    k - 1's, slot 0 the token r). p'_0 = r and, for k >= 1, p'_k = p_k if r + 1 - f(k) <= p_k else p_{k-1}, valid
    (else -1) once f(k) <= r + 1."""
    rr, fs = r[:, None], fs[None]
    stay = (old >= 0) & (rr + 1 - fs <= old)
    slots = torch.where(stay, old, torch.cat([rr, old[:, :-1]], dim=1))
    return torch.where((fs <= rr + 1) & (rr >= 0), slots, -1), stay


_TABLES: dict[tuple, torch.Tensor] = {}


def _table(pattern: Pattern, what: str, n: int, device) -> torch.Tensor:
    """A pattern's small constant tensors, made once per size and device (so that a decode step copies nothing to
    the device): ``"offsets"`` f(k) < n and ``"steps"`` a_k, each (K,) int64; ``"slots"`` the first n offsets, 2**62
    past the pattern's last (a slot that never fills); ``"reads"`` (n,) bool, True at the distances a plain
    f-pattern reads."""
    key = (pattern, what, n, str(device))
    table = _TABLES.get(key)
    if table is None:
        if what == "reads":
            table = torch.zeros(n, dtype=torch.bool)
            table[list(pattern.offsets(n))] = True
        elif what == "slots":
            bound = 2
            while len(pattern.offsets(bound)) < n and bound < 2**40:
                bound *= 2
            values = list(pattern.offsets(bound))[:n]
            table = torch.tensor(values + [2**62] * (n - len(values)), dtype=torch.long)
        else:
            table = torch.tensor(pattern.offsets(n) if what == "offsets" else pattern.steps(n), dtype=torch.long)
        table = _TABLES.setdefault(key, table.to(device))
    return table


def _rounded(n: int) -> int:
    """The power of two at or above ``n``: a growing state's tables are made once per doubling, not per token."""
    return 1 << max(0, n - 1).bit_length()


# --------------------------------------------------------------------------------------------------
# Storage


class Growing:
    """Buffers that grow with the tokens taken (the dynamic cache); ``seen`` is a host int."""

    fixed = False

    def __init__(self, seen: int = 0):
        self.seen = seen

    def rows_for(self, state: DecodeState, seen: int) -> int:
        """Rows the buffers need to hold ``seen`` tokens: every token, the ring, or the register's slots up to
        position ``seen`` (with room for a few more tokens, so that the buffers grow seldom)."""
        if state.layout == ALL:
            return seen
        if state.layout == RING:
            return state.ring
        return len(state.pattern.offsets(2 * seen + 2))

    def grow(self, state: DecodeState, rows: int) -> None:
        """Give ``state``'s buffers at least ``rows`` rows: appending patterns a quarter more (plus 64), so that
        taking a token costs one row written, not a copy of every row; new rows are empty (position -1)."""
        have = state.positions.shape[1]
        if rows <= have:
            return
        if state.layout == ALL:
            rows = rows + max(rows // 4, 64)
        state.positions = _extended(state.positions, 1, rows, -1)
        state.rows = {name: _extended(t, 2, rows, 0) for name, t in state.rows.items()}

    def count(self) -> int:
        return self.seen

    def take(self, n: int) -> None:
        self.seen += n

    def set_count(self, n: int) -> None:
        self.seen = n

    def copy(self) -> Growing:
        return Growing(self.seen)


class Fixed:
    """Buffers allocated once for ``capacity`` tokens, at fixed addresses that the compiler is told of (the static
    cache): a compiled decode step writes them in place and is one graph for every token. ``seen`` is a 0-d int64
    device tensor, never read on the host by a step; ``host_seen`` counts the same on the host while the host knows
    it (None after a step run inside a compiled graph, where the count cannot be kept on the host)."""

    fixed = True

    def __init__(self, capacity: int, seen: torch.Tensor, host_seen: int | None):
        self.capacity, self.seen, self.host_seen = capacity, seen, host_seen

    def rows_for(self, state: DecodeState, seen: int) -> int:
        if state.layout == ALL:
            return self.capacity
        if state.layout == RING:
            return state.ring
        return len(state.pattern.offsets(self.capacity + 2))

    def grow(self, state: DecodeState, rows: int) -> None:
        if rows > state.positions.shape[1]:
            raise ValueError(f"the static cache holds max_cache_len = {self.capacity} tokens; give generate() a "
                             "larger max_length (or max_new_tokens)")

    def count(self) -> int:
        if self.host_seen is None:  # steps ran in a compiled graph: read the device count once, outside any step
            self.host_seen = int(self.seen)
        return self.host_seen

    def take(self, n: int) -> None:
        self.seen.add_(n)
        self.host_seen = None if torch.compiler.is_compiling() or self.host_seen is None else self.host_seen + n

    def set_count(self, n: int) -> None:
        self.seen.fill_(n)
        self.host_seen = n

    def copy(self) -> Fixed:
        return Fixed(self.capacity, self.seen.clone(), self.host_seen)

    def mark_static(self, state: DecodeState) -> None:
        """Ready the state for a compiled step: tell the compiler that the buffers keep their addresses, so that a
        captured graph may write them, and make the pattern's tables a step reads (:meth:`DecodeState._constant`)."""
        for t in state.buffers().values():
            torch._dynamo.mark_static_address(t)
        device, n = state.positions.device, self.capacity + 1
        needs = ([("slots", state.positions.shape[1])] if state.layout == SLOTS else
                 [("offsets", n), ("reads", n)] if state.layout == ALL and state.pattern.kind == "pattern" else [])
        state.tables = {(what, size): _table(state.pattern, what, size, device) for what, size in needs}


def _extended(t: torch.Tensor, dim: int, size: int, fill) -> torch.Tensor:
    """``t`` with rows of ``fill`` appended along ``dim`` up to ``size`` (``t`` itself when it has them)."""
    if t.shape[dim] >= size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_full(shape, fill)], dim=dim)


# --------------------------------------------------------------------------------------------------
# The state


@dataclass(eq=False)
class DecodeState:
    """Every row one layer keeps between decode steps. Build it from a prefill (:meth:`from_prefill`) or empty
    (:meth:`empty`), then let each decode step :meth:`advance` it (several tokens at once: :meth:`extend`).

    Attributes:
        pattern: the layer's pattern.
        rows: the per-row tensors by name (:attr:`NAMES`), each (B, H, S, w): ``keys_a`` and ``values`` (channel A;
            attention kinds and the untied resolvent), ``keys_b`` and ``outputs`` (channel B: y, or the tied
            variant's z, 0 on padding). Keys after RoPE.
        positions: (B, S) int64 pattern position of each row, -1 for padding or empty.
        storage: :class:`Growing` or :class:`Fixed`, which also keeps the count of tokens taken (:attr:`seen`).
        start: (B,) leading padding per sequence, or None.
        conv: (B, K - 1, C) the short convolution's input rows before the next token (zeros before the sequence), or
            None without a convolution.
        history: while recording (:meth:`record_history`), a copy of the small state before each token taken since,
            oldest first, for :meth:`crop`; None otherwise.
        prefill: while recording, the tensors of the prefill the state was built from, for :meth:`crop` inside it.
    """

    pattern: Pattern
    rows: dict[str, torch.Tensor]
    positions: torch.Tensor
    storage: Growing | Fixed
    start: torch.Tensor | None = None
    conv: torch.Tensor | None = None
    history: list[dict] | None = None
    prefill: dict[str, torch.Tensor] | None = None

    NAMES: ClassVar[tuple[str, ...]] = ("keys_a", "keys_b", "values", "outputs")
    # The read rule's modes, as the Triton decode kernel takes them.
    READ_ALL: ClassVar[int] = 0
    READ_WINDOW: ClassVar[int] = 1
    READ_OFFSETS: ClassVar[int] = 2

    @staticmethod
    def keeps_every_token(pattern: Pattern | str) -> bool:
        """True for the patterns whose state holds every token (attention, dense, plain f-patterns)."""
        return layout_of(get_pattern(pattern)) == ALL

    def __post_init__(self):
        self.pattern = get_pattern(self.pattern)
        self.layout = layout_of(self.pattern)
        self.ring = ring_size(self.pattern)

    # ----------------------------------------------------------------------------------------------
    # Building

    @classmethod
    def from_prefill(cls, pattern: Pattern | str, tensors: dict[str, torch.Tensor], start: torch.Tensor | None = None,
                     record: bool = False, capacity: int | None = None, conv: torch.Tensor | None = None
                     ) -> DecodeState:
        """The state after a whole sequence, laid out from its per-position tensors (no replay of n steps).

        Args:
            pattern: a spec or :class:`~hf_resolvent.patterns.Pattern`.
            tensors: the rows to keep, each (B, H, n, .), by name (:attr:`NAMES`); only those given are kept.
            start: optional (B,) leading padding per sequence, in [0, n).
            record: start recording (:meth:`record_history`), the prefill's tensors included, so that :meth:`crop`
                can go back inside it.
            capacity: buffers for this many tokens at fixed addresses (:class:`Fixed`, the static cache); None:
                buffers that grow (:class:`Growing`).
            conv: (B, K - 1 + n, C) the short convolution's input rows over the prefill (K - 1 zero rows first).

        Returns:
            A state ready for token n, in buffers of its own (not views of ``tensors``).
        """
        pattern = get_pattern(pattern)
        unknown = set(tensors) - set(cls.NAMES)
        if unknown:
            raise ValueError(f"tensors may only hold {cls.NAMES}, got {sorted(unknown)}")
        if not tensors:
            raise ValueError("tensors is empty: give at least the values or outputs of the sequence")
        ref = next(iter(tensors.values()))
        batch, heads, n = ref.shape[:3]
        for name, t in tensors.items():
            if t.dim() != 4 or tuple(t.shape[:3]) != (batch, heads, n):
                raise ValueError(f"{name} must be (B, H, n, .) = ({batch}, {heads}, {n}, .), got {tuple(t.shape)}")
        device = ref.device
        if start is not None:
            start = start.to(device=device, dtype=torch.long)
            message = f"start must be (batch,) = ({batch},) with values in [0, n) = [0, {n})"
            if start.shape != (batch,):
                raise ValueError(message)
            require(((start >= 0) & (start < n)).all(), message, lambda: message)
        if capacity is not None and n > capacity:
            raise ValueError(f"the static cache holds max_cache_len = {capacity} tokens, but the prompt already has "
                             f"{n}; give generate() a larger max_length (or max_new_tokens)")
        storage = (Growing(n) if capacity is None else
                   Fixed(capacity, torch.tensor(n, dtype=torch.long, device=device), n))
        state = cls(pattern, {}, torch.empty(batch, 0, dtype=torch.long, device=device), storage, start)
        size = storage.rows_for(state, n)
        state.positions = torch.full((batch, size), -1, dtype=torch.long, device=device)
        state.rows = {name: t.new_zeros(batch, heads, size, t.shape[-1]) for name, t in tensors.items()}
        state._lay_out(tensors, 0)
        if conv is not None:  # the last K - 1 rows
            state.conv = conv[:, n:].clone()
        if capacity is not None:
            storage.mark_static(state)
        if record:
            state.record_history()
            state.prefill = {**tensors, **({} if conv is None else {"conv": conv})}
        return state

    @classmethod
    def empty(cls, pattern: Pattern | str, widths: dict[str, int], batch: int, heads: int,
              capacity: int | None = None, dtype: torch.dtype = torch.float32, device=None,
              start: torch.Tensor | None = None, conv_shape: tuple[int, int] | None = None) -> DecodeState:
        """A state before the first token: rows (B, H, S, w) of each name of ``widths`` (name -> w), every position
        -1; buffers for ``capacity`` tokens at fixed addresses (the static cache), or buffers that grow (None).
        ``start`` (B,): the left padding of the tokens to come; ``conv_shape`` (K - 1, C): convolution rows (zeros).
        A prompt then runs through it one token at a time (the recurrent form, an exported step)."""
        pattern = get_pattern(pattern)
        storage = Growing(0) if capacity is None else Fixed(capacity, torch.zeros((), dtype=torch.long,
                                                                                   device=device), 0)
        start = None if start is None else start.to(device=device, dtype=torch.long)
        state = cls(pattern, {}, torch.empty(batch, 0, dtype=torch.long, device=device), storage, start)
        size = storage.rows_for(state, 0)
        state.positions = torch.full((batch, size), -1, dtype=torch.long, device=device)
        state.rows = {name: torch.zeros(batch, heads, size, w, dtype=dtype, device=device)
                      for name, w in widths.items()}
        if conv_shape is not None:
            state.conv = torch.zeros(batch, *conv_shape, dtype=dtype, device=device)
        if storage.fixed:
            storage.mark_static(state)
        return state

    def refill(self, tensors: dict[str, torch.Tensor], start: torch.Tensor | None = None,
               conv: torch.Tensor | None = None) -> bool:
        """Take a new prefill (:meth:`from_prefill`'s arguments) into this static state's buffers, in place, so that
        a compiled and captured decode step keeps reading the same addresses from one generation to the next.
        False (and nothing changed) where the prefill does not fit them: another batch, rows, dtype or device, a
        longer prompt than the capacity, or a convolution where there was none."""
        ref = next(iter(tensors.values()))
        fits = (self.storage.fixed and tensors.keys() == self.rows.keys() and ref.shape[2] <= self.storage.capacity
                and all(t.shape[:2] == held.shape[:2] and t.shape[3] == held.shape[3] and t.dtype == held.dtype
                        and t.device == held.device for t, held in ((tensors[k], self.rows[k]) for k in self.rows))
                and (conv is None) == (self.conv is None))
        if not fits:
            return False
        n = ref.shape[2]
        self.positions.fill_(-1)
        if start is None or self.start is None or self.start.shape != start.shape:
            self.start = None if start is None else start.to(device=ref.device, dtype=torch.long).clone()
            if self.start is not None:
                torch._dynamo.mark_static_address(self.start)
        else:
            self.start.copy_(start)
        self._lay_out(tensors, 0)
        if conv is not None:
            self.conv.copy_(conv[:, n:])
        self.storage.set_count(n)
        self.history = self.prefill = None
        return True

    def _lay_out(self, tensors: dict[str, torch.Tensor], first: int | torch.Tensor) -> None:
        """Write the rows of tokens ``first`` .. ``first + n - 1`` (each of ``tensors`` (B, H, n, .)) where the layout
        keeps them, as taking them one by one would (the storage counts them after)."""
        ref = next(iter(tensors.values()))
        batch, n, device = ref.shape[0], ref.shape[2], ref.device
        offset = torch.zeros(batch, dtype=torch.long, device=device) if self.start is None else self.start
        t = first + torch.arange(n, device=device)  # sequence indices of the tokens
        r = t[None, :] - offset[:, None]  # (B, n) their pattern positions
        if self.layout == SLOTS:  # a host bound of every position: the capacity, or the tokens taken
            top = self.storage.capacity - 1 if self.storage.fixed else first + n - 1
            slots = _extended(closed_register(self.pattern, r[:, -1], top), 1, self.positions.shape[1], -1)
            if isinstance(first, int) and first == 0:
                src, fresh, before = (slots + offset[:, None]).clamp(min=0), None, None
            else:  # a slot holds one of the new tokens, or a row it held before
                fresh = slots >= r[:, :1]
                src, before = torch.where(fresh, slots - r[:, :1], 0), self._held_slot(slots)
            for name, held in self.rows.items():
                new = _gather_rows(tensors[name], src).to(held.dtype)
                if fresh is not None:
                    new = torch.where(fresh[:, None, :, None], new, _gather_rows(held, before))
                self.rows[name] = _overwritten(held, new)
            self.positions.copy_(slots)
            return
        keep = n if self.layout == ALL else min(n, self.ring)
        rows = t[n - keep:]
        if self.layout == RING:
            rows = rows % self.ring
        for name, held in self.rows.items():
            self.rows[name] = _rows_written(held, rows, tensors[name][:, :, n - keep:])
        self.positions.index_copy_(1, rows, torch.where(r[:, n - keep:] >= 0, r[:, n - keep:], -1))

    def _held_slot(self, positions: torch.Tensor) -> torch.Tensor:
        """(B, W) the slot that holds each of ``positions`` (B, W) now (0 where none does: such rows are replaced)."""
        match = (positions[:, :, None] == self.positions[:, None, :]) & (positions[:, :, None] >= 0)
        return match.to(torch.int8).argmax(-1)

    # ----------------------------------------------------------------------------------------------
    # Reading

    @property
    def seen(self) -> int | torch.Tensor:
        """Tokens taken, padding included: a host int, or a static state's 0-d device tensor."""
        return self.storage.seen

    def count(self) -> int:
        """Tokens taken, as a host int (a static state keeps it on the host too, but for steps run in a graph)."""
        return self.storage.count()

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The row buffers by name, each (B, H, S, .) (rows past those taken are empty: position -1)."""
        return dict(self.rows)

    def __getattr__(self, name: str):
        if name in DecodeState.NAMES:  # state.keys_a, ...: the buffer, or None when the layer keeps none
            return self.__dict__.get("rows", {}).get(name)
        raise AttributeError(name)

    def rows_held(self) -> int:
        """Rows that may hold a token: a static state's whole buffers (allocated at once); a growing one's every
        token taken, the ring, or the register's slots."""
        if self.storage.fixed:
            return self.positions.shape[1]
        seen = self.count()
        if self.layout == ALL:
            return seen
        if self.layout == RING:
            return min(seen, self.ring)
        return min(self.positions.shape[1], len(self.pattern.offsets(seen + 1)))

    def view(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(rows, positions) narrowed to the rows in use where the host knows them (a growing state that keeps every
        token: its first ``seen``); else the whole buffers."""
        if self.layout == ALL and not self.storage.fixed:
            seen = self.storage.seen
            return {k: t[:, :, :seen] for k, t in self.rows.items()}, self.positions[:, :seen]
        return dict(self.rows), self.positions

    def nbytes(self) -> int:
        """Bytes of the rows held (:meth:`rows_held`): keys, values, outputs and positions, and the convolution's
        rows. A growing state's spare rows are not counted: its figure depends on the tokens taken only."""
        rows = self.rows_held()
        per_row = sum(t.shape[1] * t.shape[3] * t.element_size() for t in self.rows.values()) + 8
        conv = 0 if self.conv is None else self.conv.numel() * self.conv.element_size()
        return self.batch_size * rows * per_row + conv

    def next_position(self) -> torch.Tensor:
        """(B,) int64 pattern position r of the next token: ``seen - start``, negative inside the left padding."""
        seen = self.storage.seen
        if self.start is not None:
            return seen - self.start
        if isinstance(seen, int):
            return torch.full((self.batch_size,), seen, dtype=torch.long, device=self.positions.device)
        return seen.expand(self.batch_size).contiguous()

    def read_bound(self) -> int:
        """A host bound of every position the next token's read rule looks at (plain f-patterns: their offsets):
        a static state's capacity, or a power of two at or above the tokens taken."""
        return self.storage.capacity if self.storage.fixed else _rounded(self.storage.seen + 1)

    def read_rule(self) -> tuple[int, int, torch.Tensor | None]:
        """Which held rows the next token at position r reads, as ``(mode, lo, offsets)``:

        - ``READ_ALL``: every valid row (attention and dense read the whole past; a register holds exactly what the
          token reads, a position in several slots read once);
        - ``READ_WINDOW``: rows with p >= r - lo, lo the ring's size;
        - ``READ_OFFSETS``: rows with r - p one of ``offsets`` (plain f-patterns keep every row, read a few):
          (K,) the pattern's f(k) up to :meth:`read_bound`.
        """
        if self.layout == RING:
            return self.READ_WINDOW, self.ring, None
        if self.layout == ALL and self.pattern.kind == "pattern":
            return self.READ_OFFSETS, 0, self._constant("offsets", self.read_bound() + 1)
        return self.READ_ALL, 0, None

    def read_mask(self, r: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """(B, S) which rows of ``positions`` (default: all) the tokens at positions r (B,) read through B (through A
        for attention kinds): :meth:`read_rule`, evaluated on the rows."""
        p = self.positions if positions is None else positions
        valid = p >= 0
        if self.layout == RING:
            return valid & (p >= r[:, None] - self.ring)
        if self.layout == SLOTS:  # a position held by several slots is read once, at its first slot; the register
            # is non-increasing along the slots (the slot rule keeps it so), so the copies of a position are neighbours
            return valid & torch.cat([valid[:, :1], p[:, 1:] != p[:, :-1]], dim=1)
        if self.pattern.kind == "pattern":
            size = self.read_bound() + 1
            reads = self._constant("reads", size)
            return valid & reads[(r[:, None] - p).clamp(0, size - 1)]
        return valid

    def _constant(self, what: str, n: int) -> torch.Tensor:
        """The pattern's table ``what`` of size ``n`` (:func:`_table`). A static state holds those its steps read,
        made with its buffers (:meth:`Fixed.mark_static`): a compiled step that looked them up in the shared dict
        would be guarded on the dict, and compiled again whenever another state added a table to it."""
        held = self.__dict__.get("tables", {}).get((what, n))
        return _table(self.pattern, what, n, self.positions.device) if held is None else held

    def begin_step(self, reads: bool = True) -> StepPlan:
        """Begin taking the next token: make room for it, keep the copy :meth:`crop` goes back to while recording, and
        return the token's bookkeeping (:class:`StepPlan`), which :meth:`advance` then follows; without its read mask
        where ``reads`` is False (a kernel that evaluates the read rule itself). Every layer of a cache
        takes the same token at the same positions, and a state's positions follow from the pattern, the tokens taken
        and the left padding alone, so a growing state shares the plan with the other layers (:data:`STEP_PLANS`,
        keyed by what the host knows: the pattern, the tokens taken, the rows, and the left padding's tensor); a
        static one, whose step may run in a graph, works it out itself."""
        self._make_room(1)
        if self.history is not None:
            self.history.append(self._snapshot())
        key = None
        if not self.storage.fixed:
            key = (self.pattern, self.storage.seen, self.positions.shape, id(self.start), str(self.positions.device),
                   reads)
            entry = STEP_PLANS.get(key)
            if entry is not None and entry[0] is self.start:
                STEP_PLANS.move_to_end(key)
                return entry[1]
        r = self.next_position()
        _, positions = self.view()
        slots = stay = row = None
        if self.layout == SLOTS:
            slots, stay = register_step(self.positions, r, self._constant("slots", self.positions.shape[1]))
        else:
            row = _row_index(self.storage.seen, 1, self.ring, r.device)
        plan = StepPlan(r, self.read_mask(r, positions) if reads else None, row, slots, stay)
        if key is not None:  # the entry holds the padding's tensor: no other tensor takes its id meanwhile
            STEP_PLANS[key] = (self.start, plan)
            if len(STEP_PLANS) > 8:
                STEP_PLANS.popitem(last=False)
        return plan

    def held_rows(self, p: torch.Tensor) -> torch.Tensor:
        """The row that holds position p (B, ...) for each sequence (valid, before the next token): row p + start
        of a state that keeps every token, its place in the ring, or the first slot that holds it. A position not
        held gives a row whose position differs."""
        flat = p.reshape(p.shape[0], -1)
        if self.layout == SLOTS:
            rows = self._held_slot(flat)
        else:
            rows = flat if self.start is None else flat + self.start[:, None]
            if self.layout == RING:
                rows = rows % self.ring
        return rows.view_as(p)

    # ----------------------------------------------------------------------------------------------
    # Taking tokens

    def advance(self, new: dict[str, torch.Tensor] | None, plan: StepPlan | None = None,
                conv: torch.Tensor | None = None) -> None:
        """Take one token, in place: its rows ``new`` (by name, each (B, H, w)) as the plan of :meth:`begin_step`
        places them (``plan``, if the caller began the step already), and its convolution input row ``conv`` (B, C)
        where the layer has a convolution. ``new`` None: a kernel has written the token's rows in place already,
        between :meth:`begin_step` and this call (the positions, which the layers' heads share, are written here)."""
        plan = self.begin_step() if plan is None else plan
        if self.layout == SLOTS:
            for name, held in self.rows.items() if new is not None else ():  # rows follow their slots
                moved = torch.cat([new[name][:, :, None].to(held.dtype), held[:, :, :-1]], dim=2)
                self.rows[name] = _overwritten(held, torch.where(plan.stay[:, None, :, None], held, moved))
            self.positions.copy_(plan.slots)
        else:
            for name, held in self.rows.items() if new is not None else ():
                self.rows[name] = _rows_written(held, plan.row, new[name][:, :, None])
            self.positions.index_copy_(1, plan.row, torch.where(plan.r >= 0, plan.r, -1)[:, None])
        if conv is not None:
            self.conv = _overwritten(self.conv, torch.cat([self.conv[:, 1:], conv[:, None].to(self.conv.dtype)], 1))
        self.storage.take(1)

    def extend(self, new: dict[str, torch.Tensor], r: torch.Tensor, conv: torch.Tensor | None = None) -> None:
        """Take L tokens at once, as L calls of :meth:`advance` would: ``new`` each (B, H, L, .), r (B, L) their
        positions, consecutive from :meth:`next_position` and all >= 0 (continuing a cache takes no padding), and
        ``conv`` (B, L, C) their convolution input rows."""
        if not self.can_extend():
            raise RuntimeError("this state records the state before each token: advance it token by token")
        length = r.shape[1]
        self._make_room(length)
        self._lay_out(new, self.storage.seen.clone() if self.storage.fixed else self.storage.seen)
        self.storage.take(length)
        if conv is not None:
            width = self.conv.shape[1]
            self.conv = _overwritten(self.conv, torch.cat([self.conv, conv.to(self.conv.dtype)], dim=1)[:, -width:])

    def can_extend(self) -> bool:
        """True when :meth:`extend` can take several tokens at once: always, except while recording a state that
        cannot crop by itself (a crop then needs the state before each token)."""
        return self.history is None or (self.layout == ALL and self.conv is None)

    def _make_room(self, length: int) -> None:
        """Rows for ``length`` more tokens: a growing state grows its buffers; a static one refuses tokens past its
        capacity (checked on the host, or inside a compiled graph by an assert that reads nothing back)."""
        storage = self.storage
        if not storage.fixed:
            storage.grow(self, storage.rows_for(self, storage.seen + length))
            return
        capacity = storage.capacity
        message = lambda: (f"the static cache is full: it holds max_cache_len = {capacity} tokens; generate fewer "  # noqa: E731
                           "tokens or give generate() a larger max_length")
        if torch.compiler.is_compiling():
            require(storage.seen + length <= capacity, "a static cache is full", message)
        elif storage.count() + length > capacity:
            raise ValueError(message())

    # ----------------------------------------------------------------------------------------------
    # Crop: rolling back rejected drafts

    def record_history(self, on: bool = True) -> None:
        """Start (or stop) keeping a copy of the small state before each token taken, so that :meth:`crop` can go
        back over those tokens for every pattern: the register's slots or the ring (O(log n) rows for ``exp2:ce``)
        and the convolution's rows. A state that keeps every token copies only its convolution rows: it crops by
        marking rows empty. Stopping forgets what was recorded, the prefill's tensors too."""
        self.history = [] if on else None
        if not on:
            self.prefill = None

    def forget_history(self) -> None:
        """Drop what was recorded so far and go on recording (the tokens before are accepted for good)."""
        if self.history is not None:
            self.history = []
        self.prefill = None

    def _snapshot(self) -> dict:
        """What :meth:`crop` restores to go back before the next token."""
        kept = {"seen": self.count()}
        if self.layout != ALL:
            kept.update(positions=self.positions.clone(), rows={k: t.clone() for k, t in self.rows.items()})
        if self.conv is not None:
            kept["conv"] = self.conv.clone()
        return kept

    def _reach(self, length: int) -> str | None:
        """How :meth:`crop` reaches ``length``: "none" (nothing to drop), "slice", "history", "prefill", or None."""
        seen = self.count()
        if length >= seen:
            return "none"
        recorded = 0 if self.history is None else len(self.history)
        if seen - length <= recorded:
            return "history"
        if self.layout == ALL and self.conv is None:
            return "slice"
        if self.prefill is not None and length <= next(iter(self.prefill.values())).shape[2]:
            return "prefill" if length > 0 else None
        return None

    def can_crop_to(self, length: int) -> bool:
        """True when :meth:`crop` to ``length`` is exact (see there)."""
        return self._reach(length) is not None

    def crop(self, length: int) -> None:
        """Forget every token after the first ``length`` (>= 0), as if only those had been seen, in place.

        A state that keeps every token marks the later rows empty. The others have dropped rows that the shorter
        state would hold: while recording (:meth:`record_history`) they go back to the copy taken before token
        ``length``, or rebuild the state from the recorded prefill when ``length`` lies inside it; elsewhere a
        ValueError."""
        length = int(length)  # transformers' candidate generators may give a 0-d tensor; the count is the host's
        if length < 0:
            raise ValueError(f"crop length must be >= 0, got {length}")
        reach = self._reach(length)
        if reach == "none":
            return
        if reach is None:
            raise ValueError(self._why_not_cropped(length))
        seen = self.count()
        if reach == "history":
            kept = self.history[length - seen]  # the state before token `length`
            del self.history[length - seen:]
            if self.layout == ALL:
                self.positions[:, length:].fill_(-1)
            else:
                self.positions.copy_(_extended(kept["positions"], 1, self.positions.shape[1], -1))
                for name, held in self.rows.items():
                    self.rows[name] = _overwritten(held, _extended(kept["rows"][name], 2, held.shape[2], 0))
            if self.conv is not None:
                self.conv = _overwritten(self.conv, kept["conv"])
        elif reach == "slice":
            self.positions[:, length:].fill_(-1)
        else:
            prefill = self.prefill
            self.storage.set_count(length)
            self.positions.fill_(-1)
            for name, held in self.rows.items():
                self.rows[name] = _overwritten(held, torch.zeros_like(held))
            self._lay_out({k: t[:, :, :length] for k, t in prefill.items() if k != "conv"}, 0)
            if self.conv is not None:
                conv = prefill["conv"]
                self.conv = _overwritten(self.conv, conv[:, length:length + self.conv.shape[1]])
            if self.history is not None:
                self.history = []
        self.storage.set_count(length)

    def _why_not_cropped(self, length: int) -> str:
        if self.storage.fixed:
            return (f"a static cache cannot be cropped back to {length} tokens for pattern {self.pattern.name!r}: it "
                    "records no earlier states; use the dynamic cache (leave cache_implementation unset) for "
                    "assisted and prompt-lookup decoding")
        recorded = 0 if self.history is None else len(self.history)
        what = "the short convolution keeps only its last rows" if self.layout == ALL else (
            "the pattern drops past positions (that is what keeps its cache small)")
        return (f"the decode state of pattern {self.pattern.name!r} cannot be cropped back {self.count() - length} "
                f"token(s): {what}, and the states of only the last {recorded} tokens were recorded. Record them "
                "first (cache.activate_past_recording(), which generate() does for assisted and prompt-lookup "
                "decoding), or re-run the prompt.")

    # ----------------------------------------------------------------------------------------------
    # Batch, device, dtype

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep the sequences ``index`` (B',) in that order (repeats allowed): beam-search reordering, batch
        selection. Every per-sequence tensor follows, the recorded copies included; a static state keeps its buffers
        when the batch keeps its size."""
        index = index.to(self.positions.device)
        in_place = self.storage.fixed and index.numel() == self.batch_size

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            picked = t.index_select(0, index)
            return t.copy_(picked) if in_place else picked

        self.rows = {k: pick(t) for k, t in self.rows.items()}
        self.positions, self.start, self.conv = pick(self.positions), pick(self.start), pick(self.conv)
        for kept in self.history or []:
            for key in ("positions", "conv"):
                if key in kept:
                    kept[key] = kept[key].index_select(0, index)
            if "rows" in kept:
                kept["rows"] = {k: t.index_select(0, index) for k, t in kept["rows"].items()}
        if self.prefill is not None:
            self.prefill = {k: t.index_select(0, index) for k, t in self.prefill.items()}

    def repeat_batch(self, repeats: int) -> None:
        """Repeat each sequence ``repeats`` times (B -> B * repeats, like ``repeat_interleave``), e.g. for
        ``num_return_sequences``."""
        self.select_batch(torch.arange(self.batch_size, device=self.positions.device).repeat_interleave(repeats))

    def to(self, device=None, dtype: torch.dtype | None = None, non_blocking: bool = False) -> DecodeState:
        """Move the state to ``device`` and cast its rows to ``dtype``, in place (the integer tensors keep int64);
        the recorded copies move too. Returns the state, like ``nn.Module.to``."""
        def move(t: torch.Tensor | None, cast: bool = True) -> torch.Tensor | None:
            if t is None:
                return None
            return t.to(device=device, dtype=dtype if cast and t.is_floating_point() else None,
                        non_blocking=non_blocking)

        self.rows = {k: move(t) for k, t in self.rows.items()}
        self.positions, self.start, self.conv = move(self.positions), move(self.start), move(self.conv)
        if self.storage.fixed:
            self.storage.seen = move(self.storage.seen)
        for kept in self.history or []:
            for key in ("positions", "conv"):
                if key in kept:
                    kept[key] = move(kept[key])
            if "rows" in kept:
                kept["rows"] = {k: move(t) for k, t in kept["rows"].items()}
        if self.prefill is not None:
            self.prefill = {k: move(t) for k, t in self.prefill.items()}
        return self

    # ----------------------------------------------------------------------------------------------
    # Tensors in and out (torch.export, ONNX)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every tensor a decode step changes or reads per sequence, by name: the rows, ``positions``, ``seen`` (a
        static state's), ``start`` and ``conv`` where set. With :meth:`with_buffers` a step is a function of tensors."""
        held = {**self.rows, "positions": self.positions}
        if self.storage.fixed:
            held["seen"] = self.storage.seen
        for name in ("start", "conv"):
            if getattr(self, name) is not None:
                held[name] = getattr(self, name)
        return held

    def with_buffers(self, buffers: dict[str, torch.Tensor]) -> DecodeState:
        """The same layout holding ``buffers`` (as :meth:`buffers` names them) instead of its own."""
        if buffers.keys() != self.buffers().keys():
            raise ValueError(f"buffers must be {sorted(self.buffers())}, got {sorted(buffers)}")
        storage = Fixed(self.storage.capacity, buffers["seen"], None) if self.storage.fixed else self.storage.copy()
        return DecodeState(self.pattern, {k: buffers[k] for k in self.rows}, buffers["positions"], storage,
                           buffers.get("start"), buffers.get("conv"))


def _records(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _overwritten(held: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``held`` holding ``value``, written in place; a new tensor where autograd records either (its backward keeps
    the values ``held`` had)."""
    value = value.to(held.dtype)
    return value if _records(held, value) else held.copy_(value)


def _rows_written(held: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``held`` (B, H, S, w) with ``rows`` (B, H, L, w) at rows ``index`` (L,), in place but where autograd records
    (see :func:`_overwritten`)."""
    rows = rows.to(held.dtype)
    return held.index_copy(2, index, rows) if _records(held, rows) else held.index_copy_(2, index, rows)


@dataclass
class StepPlan:
    """Where the next token goes and what it reads (:meth:`DecodeState.begin_step`).

    Attributes:
        r: (B,) its pattern positions, negative inside the left padding.
        read: (B, S) the rows of the state's view it reads (:meth:`DecodeState.read_mask`), or None where not asked
            for.
        row: (1,) the row it is written to (every token, or the ring); None for a register.
        slots, stay: (B, K) the register after it, and the slots that keep their token (a register only).
    """

    r: torch.Tensor
    read: torch.Tensor | None
    row: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    stay: torch.Tensor | None = None


# The plans of the last tokens, shared by the layers of growing states: key -> (the padding's tensor, plan).
STEP_PLANS: OrderedDict = OrderedDict()


def _row_index(seen: int | torch.Tensor, length: int, ring: int | None, device) -> torch.Tensor:
    """(length,) the rows of the next ``length`` tokens: ``seen`` on, modulo the ring where there is one."""
    rows = seen + torch.arange(length, device=device)
    return rows if ring is None else rows % ring


def _gather_rows(t: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """(B, H, W, w) rows ``src`` (B, W) of t (B, H, n, w)."""
    return t.gather(2, src[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1]))


# --------------------------------------------------------------------------------------------------
# States as pytrees: torch.export returns the cache a prefill builds, and takes one as an input


def _state_children(state: DecodeState) -> tuple[list, tuple]:
    """A state's tensors as children (its row buffers, positions, start, convolution rows, and a static state's
    count); its pattern, layout of names and storage kind as the context."""
    names = tuple(state.rows)
    seen = state.storage.seen if state.storage.fixed else None
    children = [*(state.rows[k] for k in names), state.positions, state.start, state.conv, seen]
    capacity = state.storage.capacity if state.storage.fixed else None
    return children, (state.pattern, names, capacity, None if state.storage.fixed else state.storage.seen)


def _state_from_children(children, context) -> DecodeState:
    pattern, names, capacity, growing_seen = context
    *rows, positions, start, conv, seen = children
    storage = Growing(growing_seen) if capacity is None else Fixed(capacity, seen, None)
    return DecodeState(pattern, dict(zip(names, rows)), positions, storage, start, conv)


def _state_children_with_keys(state: DecodeState) -> tuple[list, tuple]:
    children, context = _state_children(state)
    keys = [*context[1], "positions", "start", "conv", "seen"]
    return [(torch.utils._pytree.GetAttrKey(key), child) for key, child in zip(keys, children)], context


def register_pytree(cls: type) -> None:
    """Make a state class a pytree (its tensors the children)."""
    torch.utils._pytree.register_pytree_node(
        cls, _state_children, _state_from_children, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=_state_children_with_keys)


register_pytree(DecodeState)
