"""Recurrent form of the resolvent mixer (decode): one token at a time from a small state.

    y_t = (1 - g_t) softmax(qa_t . ka[P^A_t]) x[P^A_t] + g_t softmax(qb_t . kb[P^B_t]) y[P^B_t]

The state keeps, per layer, only the positions that future tokens may still read (docs/DESIGN.md
section 4): all of them (attention, dense, plain f-patterns), the last w (local attention keeps w - 1,
banded w), or the distinct positions of the cache-efficient set S_{i+1}, tracked with the slot rule.

Positions in a state are the pattern's own 0-indexed positions r = t - start, where ``start`` counts
a sequence's leading padding: a padded position is stored as -1 and never read.

Shapes: B batch, H heads, S rows held, d key width, e value width; one token is (B, H, d).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..patterns import Pattern, get_pattern
from .common import check_inputs


@dataclass
class MixerState:
    """What one layer keeps between decode steps.

    Attributes:
        keys_a, keys_b: (B, H, S, d) keys of the A and B channels (after RoPE), None when unused.
        values: (B, H, S, e) inputs x (None for the tied variant, which needs only z).
        outputs: (B, H, S, e) outputs y, or z = y + d x for the tied variant.
        positions: (B, S) pattern position of each row, -1 for padding or empty.
        slots: (B, K) cache-efficient patterns only: the slot register p_k (positions, -1 empty).
        seen: tokens processed so far, padding included.
        start: (B,) leading padding per sequence, or None.
    """

    keys_a: torch.Tensor | None = None
    keys_b: torch.Tensor | None = None
    values: torch.Tensor | None = None
    outputs: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    seen: int = 0
    start: torch.Tensor | None = None
    _tensor_names: tuple = field(default=("keys_a", "keys_b", "values", "outputs"), repr=False)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in self._tensor_names if getattr(self, k) is not None}

    def nbytes(self) -> int:
        """Bytes held by the cached tensors (keys, values, outputs and positions)."""
        total = sum(t.numel() * t.element_size() for t in self.tensors().values())
        for t in (self.positions, self.slots):
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    def rows(self) -> int:
        """Rows held (S): positions kept for future tokens, padding rows of a batch included."""
        return 0 if self.positions is None else self.positions.shape[1]

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (in that order): beam-search reordering, num_return_sequences."""
        for name, t in self.tensors().items():
            setattr(self, name, t.index_select(0, index.to(t.device)))
        for name in ("positions", "slots", "start"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, index.to(t.device)))


def _relative_position(state: MixerState, batch: int, device) -> torch.Tensor:
    r = torch.full((batch,), state.seen, dtype=torch.long, device=device)
    if state.start is not None:
        r = r - state.start.to(device)
    return r


def _attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor, scale: float):
    """Softmax attention of one query per (B, H) over masked rows; returns (out, any_valid)."""
    scores = torch.einsum("bhd,bhsd->bhs", q, keys) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    return torch.einsum("bhs,bhse->bhe", probs, vals)


def _read_mask(pattern: Pattern, positions: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """(B, S) which held rows token r reads through B (through A for attention kinds)."""
    p, r = positions, r[:, None]
    valid = p >= 0
    if pattern.kind in ("attention", "dense"):
        return valid
    if pattern.kind == "local_attention":
        return valid & (p > r - pattern.window)
    if pattern.band is not None:
        return valid & (p >= r - pattern.band)
    if pattern.cache_efficient:
        return valid  # the register holds S exactly
    offsets = torch.tensor(pattern.offsets(int(r.max().item()) + 1), dtype=torch.long, device=p.device)
    return valid & torch.isin(r - p, offsets)


def _append(state: MixerState, new: dict[str, torch.Tensor], r: torch.Tensor, keep: int | None) -> None:
    pos_new = torch.where(r >= 0, r, -1)[:, None]
    for name, t in new.items():
        old = getattr(state, name)
        cat = t[:, :, None] if old is None else torch.cat([old, t[:, :, None]], dim=2)
        setattr(state, name, cat if keep is None else cat[:, :, -keep:])
    pos = pos_new if state.positions is None else torch.cat([state.positions, pos_new], dim=1)
    state.positions = pos if keep is None else pos[:, -keep:]


def _advance_register(pattern: Pattern, state: MixerState, new: dict[str, torch.Tensor], r: torch.Tensor) -> None:
    """Slot rule (docs/DESIGN.md section 2), then keep the distinct positions of the new slots.

    In 0-indexed positions, after token r the slots for token r + 1 are p'_0 = r and, for k >= 1,
    p'_k = p_k if r + 1 - f(k) <= p_k else p_{k-1}, valid once f(k) <= r + 1.
    """
    device = r.device
    batch = r.shape[0]
    fs = torch.tensor(pattern.offsets(int(r.max().item()) + 2), dtype=torch.long, device=device)
    K = fs.numel()
    old = state.slots if state.slots is not None else torch.full((batch, 0), -1, dtype=torch.long, device=device)
    if old.shape[1] < K:
        old = torch.cat([old, old.new_full((batch, K - old.shape[1]), -1)], dim=1)
    rr = r[:, None]
    keep = (old >= 0) & (rr + 1 - fs[None] <= old)
    shifted = torch.cat([rr, old[:, :-1]], dim=1)
    slots = torch.where(keep, old, shifted)
    slots = torch.where((fs[None] <= rr + 1) & (rr >= 0), slots, -1)
    state.slots = slots

    # Distinct positions, newest first, padded with -1 to the longest row of the batch.
    sorted_desc = slots.sort(dim=1, descending=True).values
    distinct = torch.cat([torch.ones_like(sorted_desc[:, :1], dtype=torch.bool),
                          sorted_desc[:, 1:] != sorted_desc[:, :-1]], dim=1) & (sorted_desc >= 0)
    width = int(distinct.sum(1).max().item()) if batch else 0
    order = torch.sort(distinct.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :width]
    positions = torch.where(distinct.gather(1, order), sorted_desc.gather(1, order), -1)

    # Each kept position is either the new token or a row already held.
    old_pos = state.positions if state.positions is not None else positions.new_full((batch, 0), -1)
    held = torch.cat([old_pos, r[:, None]], dim=1)  # (B, S + 1); the new token is the last row
    match = (positions[:, :, None] == held[:, None, :]) & (positions[:, :, None] >= 0)
    src = match.to(torch.int8).argmax(-1)  # (B, width)
    for name, t in new.items():
        old_t = getattr(state, name)
        both = t[:, :, None] if old_t is None else torch.cat([old_t, t[:, :, None]], dim=2)
        index = src[:, None, :, None].expand(-1, both.shape[1], -1, both.shape[-1])
        setattr(state, name, both.gather(2, index))
    state.positions = positions


def _update(pattern: Pattern, state: MixerState, new: dict[str, torch.Tensor], r: torch.Tensor) -> None:
    if pattern.kind == "pattern" and pattern.cache_efficient:
        _advance_register(pattern, state, new, r)
    elif pattern.kind == "local_attention":
        _append(state, new, r, pattern.window - 1)
    elif pattern.band is not None:
        _append(state, new, r, pattern.band)
    else:
        _append(state, new, r, None)
    state.seen += 1


def _held(state: MixerState, name: str, like: torch.Tensor) -> torch.Tensor:
    t = getattr(state, name)
    if t is None:
        return like.new_zeros(like.shape[0], like.shape[1], 0, like.shape[-1])
    return t


def recurrent_step(state: MixerState, qa, ka, qb, kb, x, g, pattern, scale=None) -> torch.Tensor:
    """Mix one token (each input (B, H, d) or (B, H) for g) and advance ``state``. Returns y (B, H, e)."""
    pattern = get_pattern(pattern)
    batch = x.shape[0]
    r = _relative_position(state, batch, x.device)
    positions = state.positions if state.positions is not None else r.new_full((batch, 0), -1)
    scale = qa.shape[-1] ** -0.5 if scale is None else scale
    read = _read_mask(pattern, positions, r)
    self_row = torch.ones(batch, 1, dtype=torch.bool, device=x.device)
    keys_a = torch.cat([_held(state, "keys_a", ka), ka[:, :, None]], dim=2)
    vals = torch.cat([_held(state, "values", x), x[:, :, None]], dim=2)
    direct = _attend(qa, keys_a, vals, torch.cat([read, self_row], 1), scale)
    new = {"keys_a": ka, "values": x}
    if pattern.has_recurrence:
        g_eff = g * read.any(1, keepdim=True).to(g.dtype)
        recur = _attend(qb, _held(state, "keys_b", kb), _held(state, "outputs", x), read, scale)
        y = (1 - g_eff)[..., None] * direct + g_eff[..., None] * recur
        new.update(keys_b=kb, outputs=y)
    else:
        y = direct
    y = y * (r >= 0).to(y.dtype)[:, None, None]
    _update(pattern, state, new, r)
    return y


def recurrent_step_tied(state: MixerState, qb, kb, x, g, d, pattern, scale=None) -> torch.Tensor:
    """Tied variant, one token: z_t = g softmax(qb . kb[P^B]) z[P^B] + (1 - g) x_t, y_t = z_t - d_t x_t."""
    pattern = get_pattern(pattern)
    batch = x.shape[0]
    r = _relative_position(state, batch, x.device)
    positions = state.positions if state.positions is not None else r.new_full((batch, 0), -1)
    scale = qb.shape[-1] ** -0.5 if scale is None else scale
    read = _read_mask(pattern, positions, r)
    g_eff = g * read.any(1, keepdim=True).to(g.dtype)
    recur = _attend(qb, _held(state, "keys_b", kb), _held(state, "outputs", x), read, scale)
    z = g_eff[..., None] * recur + (1 - g_eff)[..., None] * x
    valid = (r >= 0).to(z.dtype)[:, None, None]
    _update(pattern, state, {"keys_b": kb, "outputs": z * valid}, r)
    return (z - d[..., None] * x) * valid


def _promote(*ts):
    dtype = torch.promote_types(next(t for t in ts if t is not None).dtype, torch.float32)
    return [None if t is None else t.to(dtype) for t in ts]


def recurrent_mix(qa, ka, qb, kb, x, g, pattern, start=None, scale=None, state=None) -> torch.Tensor:
    """Run the recurrent form over a whole sequence (B, H, n, .) -> (B, H, n, e); tests and prefill."""
    pattern = get_pattern(pattern)
    check_inputs(qa, ka, qb, kb, x, g, pattern, start)
    out_dtype = x.dtype
    qa, ka, qb, kb, x, g = _promote(qa, ka, qb, kb, x, g)
    state = state if state is not None else MixerState(start=start)
    ys = []
    for t in range(x.shape[2]):
        qa_t, ka_t, qb_t, kb_t, g_t = (None if a is None else a[:, :, t] for a in (qa, ka, qb, kb, g))
        ys.append(recurrent_step(state, qa_t, ka_t, qb_t, kb_t, x[:, :, t], g_t, pattern, scale))
    return torch.stack(ys, dim=2).to(out_dtype)


def recurrent_mix_tied(qb, kb, x, g, d, pattern, start=None, scale=None, state=None) -> torch.Tensor:
    """Tied variant of :func:`recurrent_mix`."""
    pattern = get_pattern(pattern)
    check_inputs(None, None, qb, kb, x, g, pattern, start, tied_d=d)
    out_dtype = x.dtype
    qb, kb, x, g, d = _promote(qb, kb, x, g, d)
    state = state if state is not None else MixerState(start=start)
    ys = [recurrent_step_tied(state, qb[:, :, t], kb[:, :, t], x[:, :, t], g[:, :, t], d[:, :, t], pattern, scale)
          for t in range(x.shape[2])]
    return torch.stack(ys, dim=2).to(out_dtype)
