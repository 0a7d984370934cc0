"""The decode state of a static cache: a :class:`~.state.DecodeState` in preallocated buffers of fixed shape, written
in place, so that a compiled decode step runs without recompiling (``generate(cache_implementation="static")``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .common import require
from .patterns import Pattern, get_pattern
from .register import closed_register, register_step, rows_at, rows_plan
from .state import DecodeState, register_pytree

__all__ = ["StaticDecodeState"]


@dataclass
class StaticDecodeState(DecodeState):
    """A :class:`DecodeState` in preallocated buffers of fixed shape, written in place (the static cache,
    ``generate(cache_implementation="static")``): every decode step has the same shapes and allocates no rows, so a
    compiled step does not recompile per token. Built from a prefill's state by :meth:`preallocate`; holds at most
    ``capacity`` tokens.

    Layouts (S rows, fixed; an empty row has position -1 and is never read):

    - patterns that keep every position: S = capacity, row i is token i (written at row ``seen``);
    - windows (``local_attention:w``, ``banded:w``, ``diagonal``): S = the rows kept, oldest first, shifted by one
      row per token;
    - cache-efficient patterns: S = K, the slots of the register over ``capacity`` tokens; row k holds slot k's
      token, so ``positions`` is the register itself, where one position may sit in several slots (its first
      slot is the one read). ``slots`` stays None.

    Attributes (beside :class:`DecodeState`'s): ``seen`` is a 0-d int64 tensor, so that a compiled step does not
    specialise on it; ``capacity`` the tokens it can hold; ``offsets`` (K,) the register's f(k) (cache-efficient
    patterns); ``offset_table`` (capacity + 1,) bool, True at the distances r - p a plain f-pattern reads.
    Patterns that drop positions record no history: such a state cannot be cropped (the dynamic cache can).
    """

    capacity: int = 0
    offsets: torch.Tensor | None = None
    offset_table: torch.Tensor | None = None

    @classmethod
    def preallocate(cls, pattern: Pattern | str, state: DecodeState, capacity: int) -> StaticDecodeState:
        """The same state as ``state`` (after a prefill, rows held) laid out for ``capacity`` tokens."""
        pattern = get_pattern(pattern)
        if state.positions is None:
            raise ValueError("preallocate a state that holds its prefill's rows (DecodeState.from_prefill)")
        if state.seen > capacity:
            raise ValueError(f"the static cache holds max_cache_len = {capacity} tokens, but the prompt already has "
                             f"{state.seen}; give generate() a larger max_length (or max_new_tokens)")
        positions, device = state.positions, state.positions.device
        batch, held = positions.shape
        offsets = table = None
        if cls.uses_register(pattern):
            offsets = torch.tensor(pattern.offsets(capacity + 1), dtype=torch.long, device=device)
            slots = state.slots if state.slots is not None else positions.new_full((batch, 0), -1)
            slots = torch.cat([slots, slots.new_full((batch, offsets.numel() - slots.shape[1]), -1)], dim=1)
            match = (slots[:, :, None] == positions[:, None, :]) & (slots[:, :, None] >= 0)
            src = match.to(torch.int8).argmax(-1) if held else None  # (B, K): each slot's held row (0 when empty)
            rows = {name: t.new_zeros(*t.shape[:2], offsets.numel(), t.shape[-1]) if src is None else
                    t.gather(2, src[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1]))
                    for name, t in state.tensors().items()}
            positions = slots
        else:
            keep = cls.trailing_rows(pattern)
            empty = (keep if keep is not None else capacity) - held  # rows still to fill
            before = keep is not None  # a window fills from the end (oldest first), the others from row 0

            def pad(t: torch.Tensor, dim: int, value) -> torch.Tensor:
                shape = list(t.shape)
                shape[dim] = empty
                filler = t.new_full(shape, value)
                return torch.cat([filler, t] if before else [t, filler], dim=dim)

            rows = {name: pad(t, 2, 0) for name, t in state.tensors().items()}
            positions = pad(positions, 1, -1)
            if pattern.kind == "pattern":  # a plain f-pattern reads a few of the rows it keeps
                table = torch.zeros(capacity + 1, dtype=torch.bool, device=device)
                table[torch.tensor(pattern.offsets(capacity), dtype=torch.long, device=device)] = True
        start = None if state.start is None else state.start.clone()  # per state: it is written in place
        return cls(**rows, positions=positions.clone(), seen=torch.tensor(state.seen, device=device), start=start,
                   capacity=capacity, offsets=offsets, offset_table=table)

    @classmethod
    def empty(cls, pattern: Pattern | str, names: tuple[str, ...], batch: int, heads: int, dim: int, capacity: int,
              dtype: torch.dtype = torch.float32, device=None) -> StaticDecodeState:
        """A state before the first token, with buffers for ``capacity`` tokens: rows (B, H, S, dim) of each of
        ``names`` (see :attr:`TENSOR_NAMES`), every position -1. A prompt then runs through it one token at a time."""
        rows = {name: torch.zeros(batch, heads, 0, dim, dtype=dtype, device=device) for name in names}
        none = DecodeState(**rows, positions=torch.full((batch, 0), -1, dtype=torch.long, device=device))
        return cls.preallocate(pattern, none, capacity)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every tensor that a decode step changes, by name: the rows, ``positions``, ``seen`` (and ``start`` when
        set). With :meth:`with_buffers`, a step becomes a function of tensors (export)."""
        held = {**self.tensors(), "positions": self.positions, "seen": self.seen}
        return held if self.start is None else {**held, "start": self.start}

    def with_buffers(self, buffers: dict[str, torch.Tensor]) -> StaticDecodeState:
        """The same layout holding ``buffers`` (as :meth:`buffers` names them) instead of its own."""
        if buffers.keys() != self.buffers().keys():
            raise ValueError(f"buffers must be {sorted(self.buffers())}, got {sorted(buffers)}")
        return replace(self, **buffers)

    def read_mask(self, pattern: Pattern, r: torch.Tensor) -> torch.Tensor:
        p, rr = self.positions, r[:, None]
        valid = p >= 0
        if self.uses_register(pattern):  # a position held by several slots is read once, at its first slot
            earlier = torch.ones(p.shape[1], p.shape[1], dtype=torch.bool, device=p.device).tril(-1)
            return valid & ~((p[:, :, None] == p[:, None, :]) & earlier).any(-1)
        lo = self.trailing_rows(pattern)
        if lo is not None:
            return valid & (p >= rr - lo)
        if self.offset_table is not None:
            return valid & self.offset_table[(rr - p).clamp(0, self.capacity)]
        return valid

    def next_position(self, batch: int, device) -> torch.Tensor:
        r = self.seen.to(device).expand(batch).clone()  # not a view: advance() writes seen in place
        return r if self.start is None else r - self.start.to(device)

    def advance(self, pattern: Pattern | str, new: dict[str, torch.Tensor], r: torch.Tensor) -> None:
        pattern = get_pattern(pattern)
        require(self.seen < self.capacity, "a static cache is full", lambda: (
            f"the static cache is full: it holds max_cache_len = {self.capacity} tokens; generate fewer tokens or "
            "give generate() a larger max_length"))
        pos_new = torch.where(r >= 0, r, -1)
        if self.uses_register(pattern):  # the register's rule, on every slot of the capacity
            slots, stay = register_step(self.positions, r, self.offsets)
            for name, t in new.items():  # rows follow their slots
                held = getattr(self, name)
                moved = torch.cat([t[:, :, None], held[:, :, :-1]], dim=2)
                held.copy_(torch.where(stay[:, None, :, None], held, moved))
            self.positions.copy_(slots)
        elif self.trailing_rows(pattern) is not None:
            if self.rows():
                for name, t in new.items():
                    held = getattr(self, name)
                    held.copy_(torch.cat([held[:, :, 1:], t[:, :, None]], dim=2))
                self.positions.copy_(torch.cat([self.positions[:, 1:], pos_new[:, None]], dim=1))
        else:
            row = self.seen.view(1)
            for name, t in new.items():
                getattr(self, name).index_copy_(2, row, t[:, :, None])
            self.positions.index_copy_(1, row, pos_new[:, None])
        self.seen.add_(1)

    def _reach(self, pattern: Pattern, length: int) -> str | None:
        if length >= int(self.seen):
            return "none"
        return "slice" if self.keeps_every_position(pattern) else None

    # crop (DecodeState's): patterns that keep every position only, in place; the others raise (no history here)
    def _slice(self, length: int) -> None:
        self.positions[:, length:] = -1
        self.seen.fill_(length)

    def _why_not_cropped(self, pattern: Pattern, length: int) -> str:
        return (f"a static cache cannot be cropped back to {length} tokens for pattern {pattern.name!r}: the pattern "
                "drops past positions and a static cache records no earlier states; use the dynamic cache (leave "
                "cache_implementation unset) for assisted and prompt-lookup decoding")

    def can_extend(self, pattern: Pattern | str) -> bool:
        """True: it records nothing, and :meth:`extend` writes its buffers in place."""
        return True

    def extend(self, pattern: Pattern | str, new: dict[str, torch.Tensor], r: torch.Tensor) -> None:
        """As :meth:`DecodeState.extend`, in the buffers: the same rows and positions as L calls of :meth:`advance`."""
        pattern = get_pattern(pattern)
        length = r.shape[1]
        require(self.seen + length <= self.capacity, "a static cache is full", lambda: (
            f"the static cache is full: it holds max_cache_len = {self.capacity} tokens; generate fewer tokens or "
            "give generate() a larger max_length"))
        if self.uses_register(pattern):  # the register's closed form on every slot of the capacity; rows follow
            slots = closed_register(pattern, r[:, -1])
            slots = torch.cat([slots, slots.new_full((slots.shape[0], self.offsets.numel() - slots.shape[1]), -1)], 1)
            plan = rows_plan(slots, r, self.positions)
            for name, t in new.items():
                held = getattr(self, name)
                held.copy_(rows_at(plan, t, held))
            self.positions.copy_(slots)
        elif self.trailing_rows(pattern) is not None:
            if self.rows():
                for name, t in new.items():
                    held = getattr(self, name)
                    held.copy_(torch.cat([held, t], dim=2)[:, :, -held.shape[2]:])
                self.positions.copy_(torch.cat([self.positions, r], dim=1)[:, -self.rows():])
        else:
            rows = self.seen + torch.arange(length, device=r.device)
            for name, t in new.items():
                getattr(self, name).index_copy_(2, rows, t)
            self.positions.index_copy_(1, rows, r)
        self.seen.add_(length)

    def record_history(self, on: bool = True) -> None:
        """Nothing to record: patterns that keep every position crop by slicing, the others cannot crop."""

    def select_batch(self, index: torch.Tensor) -> None:
        """As :meth:`DecodeState.select_batch`, in place when the batch keeps its size (the buffers stay)."""
        same = index.numel() == self.batch_size
        for name in self.TENSOR_NAMES + ("positions", "start"):
            t = getattr(self, name)
            if t is not None:
                picked = t.index_select(0, index.to(t.device))
                if same:
                    t.copy_(picked)
                else:
                    setattr(self, name, picked)

    def to(self, device=None, dtype: torch.dtype | None = None, non_blocking: bool = False) -> StaticDecodeState:
        super().to(device, dtype, non_blocking)
        for name in ("seen", "offsets", "offset_table"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device=device, non_blocking=non_blocking))
        return self


register_pytree(StaticDecodeState)
