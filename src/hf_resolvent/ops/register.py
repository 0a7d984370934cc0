"""The slot register of cache-efficient patterns, as a decode state keeps it (docs/DESIGN.md section 2.1): its closed
form after n tokens, the slot rule for one more token, the rows a state holds after one or several tokens, and the
memo that lets every layer of a cache reuse the first layer's bookkeeping.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from .patterns import Pattern

__all__ = ["EXTEND_PLANS", "PlanMemo", "closed_register", "distinct_desc", "extend_plan", "register_plan",
           "register_step", "rows_at", "rows_plan", "value_key"]


def rows_plan(positions: torch.Tensor, r: torch.Tensor, held_positions: torch.Tensor):
    """Where the rows of ``positions`` (B, W) come from after L new tokens at positions r (B, L): (fresh, index,
    from_held), each (B, W): a new token's row ``index`` of the new rows where ``fresh``, else the held row
    ``from_held`` (found by ``held_positions`` (B, S); None when nothing is held). Rows of empty positions are junk
    (never read)."""
    fresh = positions >= r[:, :1]
    index = torch.where(fresh, positions - r[:, :1], 0)
    if not held_positions.shape[1]:
        return fresh, index, None
    return fresh, index, (positions[:, :, None] == held_positions[:, None, :]).to(torch.int8).argmax(-1)


def rows_at(plan, new: torch.Tensor, held: torch.Tensor | None) -> torch.Tensor:
    """(B, H, W, .) the rows of a :func:`rows_plan` from the new rows ``new`` (B, H, L, .) and the ``held`` ones:
    only the W rows kept are read, never a copy of all new rows."""
    def pick(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return t.gather(2, index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1]))

    fresh, index, from_held = plan
    rows = pick(new, index)
    if from_held is None or held is None:
        return rows
    return torch.where(fresh[:, None, :, None], rows, pick(held, from_held))


def extend_plan(pattern: Pattern, held_positions: torch.Tensor, r: torch.Tensor):
    """A register state's bookkeeping for L tokens at positions r (B, L) after the rows at ``held_positions``:
    (slots, positions, :func:`rows_plan`), memoised on the CPU as :func:`register_plan` is (every layer of a cache
    takes the same tokens with the same register)."""
    def plan():
        slots = closed_register(pattern, r[:, -1])
        positions = distinct_desc(slots)
        return slots, positions, rows_plan(positions, r, held_positions)

    if r.device.type != "cpu" or torch.compiler.is_compiling():
        return plan()
    return EXTEND_PLANS.get(("extend", pattern, r.shape[1], *value_key(held_positions, r[:, 0])), plan)


def register_step(old: torch.Tensor, r: torch.Tensor, fs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot rule (docs/DESIGN.md section 2.1) for one token: the register (B, K) for token r + 1 from the register
    ``old`` (B, K) for token r (B,), with offsets fs (K,); and ``stay`` (B, K), the slots that keep their position
    (the others take slot k - 1's, slot 0 the token r). In 0-indexed positions p'_0 = r and, for k >= 1,
    p'_k = p_k if r + 1 - f(k) <= p_k else p_{k-1}, valid (else -1) once f(k) <= r + 1."""
    rr, fs = r[:, None], fs[None]
    stay = (old >= 0) & (rr + 1 - fs <= old)
    slots = torch.where(stay, old, torch.cat([rr, old[:, :-1]], dim=1))
    return torch.where((fs <= rr + 1) & (rr >= 0), slots, -1), stay


class PlanMemo:
    """Bookkeeping that every layer of a cache repeats on the same values (which rows a token reads and keeps),
    worked out once: the last ``kept`` results by key (values, not tensors: :func:`value_key`). The layers after the
    first reuse the first one's tensors, which is safe because states never write into a tensor they hold."""

    def __init__(self, kept: int):
        self.kept, self.plans, self.lock = kept, OrderedDict(), threading.Lock()  # caches may decode in threads

    def get(self, key: tuple, compute):
        """``compute()``, or its result for the same key, kept from an earlier call."""
        with self.lock:
            plan = self.plans.get(key)
            if plan is not None:
                self.plans.move_to_end(key)
                return plan
        plan = compute()
        with self.lock:
            self.plans[key] = plan
            if len(self.plans) > self.kept:
                self.plans.popitem(last=False)
        return plan


STEP_PLANS = PlanMemo(64)  # one token's plans: a few small tensors each
EXTEND_PLANS = PlanMemo(8)  # several tokens' plans, tables of (K, L): only the current forward's are reused


def value_key(*tensors: torch.Tensor | None) -> tuple:
    """A memo key part for small tensors (host copies: CPU only): their shapes and values."""
    return tuple(None if t is None else (tuple(t.shape), tuple(t.flatten().tolist())) for t in tensors)


def register_plan(pattern: Pattern, slots: torch.Tensor | None, positions: torch.Tensor | None,
                   r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's step of a register state's bookkeeping: the register (B, K) after the token at positions r (B,),
    the distinct positions it holds (B, W), newest first, and src (B, W), the row of [held rows, the token] that each
    comes from (padding rows take row 0 and are never read).

    Every layer of a cache holds the same register and takes the same token, so on the CPU the plan is memoised by
    its inputs' values: the layers after the first reuse the tensors of the first (states never write into a tensor
    they hold, so sharing them is safe). On other devices the key would cost copies to the host: no memo there."""
    if r.device.type != "cpu":
        return step_plan(pattern, slots, positions, r)
    return STEP_PLANS.get((pattern, *value_key(slots, positions, r)), lambda: step_plan(pattern, slots, positions, r))


def step_plan(pattern: Pattern, slots: torch.Tensor | None, positions: torch.Tensor | None,
          r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`register_plan`, worked out: the slot rule (:func:`register_step`), the distinct positions, and each
    kept position's row."""
    batch, device = r.shape[0], r.device
    fs = torch.tensor(pattern.offsets(int(r.max().item()) + 2), dtype=torch.long, device=device)
    old = slots if slots is not None else torch.full((batch, 0), -1, dtype=torch.long, device=device)
    if old.shape[1] < fs.numel():
        old = torch.cat([old, old.new_full((batch, fs.numel() - old.shape[1]), -1)], dim=1)
    else:  # slots past these offsets are empty (f(k) > r + 1): a register built with a bound (from_prefill in a graph)
        old = old[:, :fs.numel()]
    new_slots, _ = register_step(old, r, fs)
    new_positions = distinct_desc(new_slots)
    held = torch.cat([positions if positions is not None else new_positions.new_full((batch, 0), -1), r[:, None]], 1)
    match = (new_positions[:, :, None] == held[:, None, :]) & (new_positions[:, :, None] >= 0)
    return new_slots, new_positions, match.to(torch.int8).argmax(-1)


def closed_register(pattern: Pattern, r_last: torch.Tensor, top: int | None = None) -> torch.Tensor:
    """(B, K) slot register after the tokens up to pattern position r_last (B,), in closed form. ``top`` bounds
    r_last from above (default: its maximum); a larger bound only adds empty slots (-1) on the right."""
    device = r_last.device
    if top is None:
        top = int(r_last.max().item())
    fs = torch.tensor(pattern.offsets(top + 2), dtype=torch.long, device=device)
    steps = torch.tensor(pattern.steps(top + 2), dtype=torch.long, device=device)
    i = (r_last + 2)[:, None]  # 1-indexed row of the next token
    pos = steps[None] * torch.div(i - fs[None] + steps[None] - 1, steps[None], rounding_mode="floor") - 1
    valid = (fs[None] <= r_last[:, None] + 1) & (r_last[:, None] >= 0)
    return torch.where(valid, pos, -1)


def distinct_desc(slots: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """(B, K) slots -> (B, W) their distinct valid values, newest first, padded with -1 (W = ``width``, at least
    the widest row's count; default: that count)."""
    batch = slots.shape[0]
    ordered = slots.sort(dim=1, descending=True).values
    first = torch.ones_like(ordered[:, :1], dtype=torch.bool)
    distinct = torch.cat([first, ordered[:, 1:] != ordered[:, :-1]], dim=1) & (ordered >= 0)
    if width is None:
        width = int(distinct.sum(1).max().item()) if batch else 0
    order = torch.sort(distinct.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :width]
    return torch.where(distinct.gather(1, order), ordered.gather(1, order), -1)
