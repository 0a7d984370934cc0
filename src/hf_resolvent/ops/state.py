"""Build a decode state directly from a prefilled sequence (no replay of n recurrent steps).

After the parallel form has run over a prompt, the decode cache of a layer needs the rows that future tokens
may still read (docs/DESIGN.md section 4). :func:`state_from_sequence` keeps exactly those rows of the full-sequence
tensors and returns the :class:`~hf_resolvent.ops.recurrent.MixerState` that ``n`` calls of ``recurrent_step``
would have produced (same rows, positions, slot register and ``seen``), following ``recurrent.py``:

- positions are the pattern's own positions r = t - start (-1 for left padding);
- attention, dense and plain f-patterns keep every row; local attention the last w - 1; banded the last w
  (diagonal: 1);
- cache-efficient patterns keep the distinct positions of S_{r+2} (1-indexed, the set the next token reads),
  newest first, padded with -1 to the widest row of the batch; the slot register holds the non-deduplicated
  closed form p_k = a_k * ceil((i - f(k)) / a_k) (1-indexed i = r + 2, stored 0-indexed), -1 where f(k) > r + 1.

Shapes: B batch, H heads, n positions, S rows kept, K slots.
"""

from __future__ import annotations

import torch

from ..patterns import Pattern, get_pattern
from .recurrent import MixerState

__all__ = ["state_from_sequence", "rows_kept"]

_NAMES = ("keys_a", "keys_b", "values", "outputs")


def rows_kept(pattern: Pattern) -> int | None:
    """How many trailing rows an appending state keeps (None: all); not for cache-efficient patterns."""
    if pattern.kind == "local_attention":
        return pattern.window - 1
    if pattern.band is not None:
        return pattern.band
    return None


def _register(pattern: Pattern, r_last: torch.Tensor) -> torch.Tensor:
    """(B, K) slot register after the tokens up to pattern position r_last (B,), closed form."""
    device = r_last.device
    top = int(r_last.max().item())
    fs = torch.tensor(pattern.offsets(top + 2), dtype=torch.long, device=device)
    steps = torch.tensor(pattern.steps(top + 2), dtype=torch.long, device=device)
    i = (r_last + 2)[:, None]  # 1-indexed row of the next token
    pos = steps[None] * torch.div(i - fs[None] + steps[None] - 1, steps[None], rounding_mode="floor") - 1
    valid = (fs[None] <= r_last[:, None] + 1) & (r_last[:, None] >= 0)
    return torch.where(valid, pos, -1)


def _distinct_desc(slots: torch.Tensor) -> torch.Tensor:
    """(B, K) slots -> (B, W) their distinct valid values, descending, padded with -1 (W = widest row)."""
    batch = slots.shape[0]
    ordered = slots.sort(dim=1, descending=True).values
    first = torch.ones_like(ordered[:, :1], dtype=torch.bool)
    distinct = torch.cat([first, ordered[:, 1:] != ordered[:, :-1]], dim=1) & (ordered >= 0)
    width = int(distinct.sum(1).max().item()) if batch else 0
    order = torch.sort(distinct.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :width]
    return torch.where(distinct.gather(1, order), ordered.gather(1, order), -1)


def state_from_sequence(pattern, tensors: dict[str, torch.Tensor], start: torch.Tensor | None = None) -> MixerState:
    """The decode state after a whole sequence, from its per-position tensors.

    Args:
        pattern: a spec or :class:`~hf_resolvent.patterns.Pattern`.
        tensors: the rows a state stores, each (B, H, n, .): ``keys_a`` and ``values`` (A channel; attention
            kinds and the untied resolvent), ``keys_b`` and ``outputs`` (B channel: y, or z = y + d x for the tied
            variant, zero on padding). Keys after RoPE. Only the given names are stored.
        start: optional (B,) leading padding per sequence.

    Returns:
        A :class:`MixerState` equal to the one ``n`` calls of ``recurrent_step`` (or ``recurrent_step_tied``)
        leave, ready for the next token. The kept rows are copies (they do not pin the full tensors).
    """
    pattern = get_pattern(pattern)
    unknown = set(tensors) - set(_NAMES)
    if unknown:
        raise ValueError(f"tensors may only hold {_NAMES}, got {sorted(unknown)}")
    if not tensors:
        raise ValueError("tensors is empty: give at least the values or outputs of the sequence")
    ref = next(iter(tensors.values()))
    batch, _, n = ref.shape[:3]
    for name, t in tensors.items():
        if t.dim() != 4 or tuple(t.shape[:3]) != (batch, ref.shape[1], n):
            raise ValueError(f"{name} must be (B, H, n, .) = ({batch}, {ref.shape[1]}, {n}, .), got {tuple(t.shape)}")
    device = ref.device
    if start is not None:
        start = start.to(device=device, dtype=torch.long)
        if start.shape != (batch,) or (start < 0).any() or (start >= n).any():
            raise ValueError(f"start must be (batch,) = ({batch},) with values in [0, n) = [0, {n})")
    offset = torch.zeros(batch, dtype=torch.long, device=device) if start is None else start
    state = MixerState(start=start, seen=n)

    if pattern.kind == "pattern" and pattern.cache_efficient:
        slots = _register(pattern, n - 1 - offset)
        positions = _distinct_desc(slots)
        rows = torch.where(positions >= 0, positions + offset[:, None], 0)  # (B, W) sequence index t
        for name, t in tensors.items():
            index = rows[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1])
            setattr(state, name, t.gather(2, index))
        state.slots = slots
        state.positions = positions
        return state

    keep = rows_kept(pattern)
    kept = n if keep is None else min(n, keep)
    t_index = torch.arange(n - kept, n, device=device)
    for name, t in tensors.items():
        setattr(state, name, t[:, :, n - kept:].clone())
    r = t_index[None, :] - offset[:, None]
    state.positions = torch.where(r >= 0, r, -1)
    return state
