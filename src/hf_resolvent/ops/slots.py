"""Slot arithmetic of sparse patterns: scores, weighted sums and their transposes without gathers.

Every sparse pattern (banded, diagonal, translation-invariant and cache-efficient f-patterns, local
attention) reads, for row t (0-indexed) and slot k, the source row

    src_k(t) = a_k * (floor((t - f_k) / a_k) + 1) - 1      for t >= f_k,

with a_k = 1 for all but the cache-efficient patterns (then src_k(t) = t - f_k, a shift). The source
of slot k is constant over runs of a_k consecutive rows and moves by a_k from one run to the next, so
a block of rows [t0, t0 + R a) reads the strided rows ``v[s0 : s0 + R a : a]``: all slot operations
below are slices, strided views and broadcasts, never an (n, K, d) gather (docs/DESIGN.md section 3: on
long sequences a gather costs far more than shifted slices; figures in bench/NOTES.md).

Tensors are slot-major: scores and weights are (B, H, K, n) so that one slot's row range is
contiguous. Rows t < f_k, and slots that :meth:`~hf_resolvent.patterns.Pattern.source_index` marks
empty (duplicates of S_i), are masked by :attr:`SlotLayout.valid`.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
import torch

from .dispatch import cpu_functions, cpu_ops, cpu_twin
from .patterns import Pattern
from .threads import serial, serial_for

# Rows per block of the slot loops: small enough that temporaries stay in cache and are recycled
# by the allocator, large enough that the Python loop is short.
ROW_BLOCK = 2048


@dataclass(frozen=True, eq=False)  # hashed by identity (layouts are cached)
class SlotLayout:
    """The slots of a sparse pattern for sequences of length n (no left padding).

    Attributes:
        n: sequence length.
        fs, steps: per slot k the offset f_k and period a_k (tuples of length K).
        src: (K, n) numpy int64 array of 0-indexed sources, -1 where the slot is empty.
        valid: (K, n) bool tensor (CPU), ``src >= 0``.

    The CPU kernels (:mod:`hf_resolvent.backends.cpu`) read ``src`` directly (``src_tensor``); the PyTorch code
    below covers the same rows with slices (:class:`Piece`).
    """

    n: int
    fs: tuple[int, ...]
    steps: tuple[int, ...]
    src: np.ndarray
    valid: torch.Tensor

    @property
    def num_slots(self) -> int:
        return len(self.fs)

    @cached_property
    def src_tensor(self) -> torch.Tensor:
        """``src`` as a contiguous (K, n) int64 CPU tensor."""
        return torch.from_numpy(np.ascontiguousarray(self.src, dtype=np.int64))

    def valid_on(self, device, dtype=None) -> torch.Tensor:
        """``valid`` as a (1, 1, K, n) tensor on ``device`` (bool, or ``dtype`` when given)."""
        v = self.valid.to(device)[None, None]
        return v if dtype is None else v.to(dtype)


def pattern_slots(pattern: Pattern, n: int) -> tuple[list[int], list[int]]:
    """The offsets f_k and periods a_k of a sparse pattern's slots for length n (as :class:`SlotLayout` holds them,
    without the row itself)."""
    if pattern.kind == "local_attention":
        fs = list(range(1, pattern.window))
        return fs, [1] * len(fs)
    if pattern.band is not None:
        fs = list(range(1, pattern.band + 1))
        return fs, [1] * len(fs)
    if pattern.kind == "pattern":
        fs = pattern.offsets(n)
        return fs, (pattern.steps(n) if pattern.cache_efficient else [1] * len(fs))
    raise ValueError(f"pattern {pattern.name!r} is dense: it has no slot layout")


@lru_cache(maxsize=64)
def slot_layout(pattern: Pattern, n: int, with_self: bool = False) -> SlotLayout:
    """Slots of P^B (resolvent kinds) or of P^A minus the row (local attention) for length n.

    ``with_self`` prepends the slot f = 0 (the row itself), which makes P^A = {t} U P^B.
    """
    fs, steps = pattern_slots(pattern, n)
    src = pattern.source_index(n).numpy().T.copy() if fs else np.zeros((0, n), dtype=np.int64)
    # The closed form, checked against the pattern's own table so that both stay in step.
    t = np.arange(n)[None, :]
    f = np.array(fs, dtype=np.int64)[:, None]
    a = np.array(steps, dtype=np.int64)[:, None]
    formula = np.where(t >= f, a * ((t - f) // a + 1) - 1, -1)
    if src.shape != formula.shape or not np.all((src == formula) | (src < 0)):
        raise RuntimeError(f"slot formula disagrees with source_index for pattern {pattern.name!r}: please report")
    if with_self:
        fs, steps = [0] + list(fs), [1] + list(steps)
        src = np.concatenate([np.arange(n)[None, :], src], axis=0)
    return SlotLayout(n, tuple(fs), tuple(steps), src, torch.from_numpy(src >= 0))


@dataclass(frozen=True)
class Piece:
    """Rows [t0, t0 + runs * length) of one slot, in ``runs`` runs of ``length`` rows; run m reads
    source row s0 + m * stride."""

    slot: int
    t0: int
    runs: int
    length: int
    s0: int
    stride: int

    @property
    def t1(self) -> int:
        return self.t0 + self.runs * self.length


def slot_pieces(f: int, a: int, slot: int, r0: int, r1: int) -> list[Piece]:
    """Cover rows [max(r0, f), r1) of slot (f, a) with pieces of whole runs (partial runs at the ends)."""
    lo = max(r0, f)
    if lo >= r1:
        return []
    if a == 1:
        return [Piece(slot, lo, r1 - lo, 1, lo - f, 1)]
    out = []
    t = lo
    # A partial run up to the next run boundary.
    first_end = min(r1, f + ((t - f) // a + 1) * a)
    if (t - f) % a:
        out.append(Piece(slot, t, 1, first_end - t, a * ((t - f) // a + 1) - 1, a))
        t = first_end
    runs = (r1 - t) // a
    if runs:
        out.append(Piece(slot, t, runs, a, a * ((t - f) // a + 1) - 1, a))
        t += runs * a
    if t < r1:
        out.append(Piece(slot, t, 1, r1 - t, a * ((t - f) // a + 1) - 1, a))
    return out


@lru_cache(maxsize=64)
def _block_pieces(fs: tuple[int, ...], steps: tuple[int, ...], n: int, block: int) -> tuple[Piece, ...]:
    pieces = []
    for b0 in range(0, n, block):
        b1 = min(n, b0 + block)
        for k, (f, a) in enumerate(zip(fs, steps)):
            pieces.extend(slot_pieces(f, a, k, b0, b1))
    return tuple(pieces)


def block_pieces(layout: SlotLayout, block: int | None = None) -> tuple[Piece, ...]:
    """All rows of all slots, row block by row block (slots inner, for cache locality)."""
    return _block_pieces(layout.fs, layout.steps, layout.n, block or ROW_BLOCK)


def _src_view(v: torch.Tensor, p: Piece) -> torch.Tensor:
    """(B, H, runs, D) source rows of piece p in v (B, H, n, D)."""
    return v[:, :, p.s0 : p.s0 + p.stride * (p.runs - 1) + 1 : p.stride]


def piece_dot(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, p: Piece, scratch: torch.Tensor | None = None) -> None:
    """out (B, H, K, n)[slot, rows] = q[rows] . k[src(rows)].

    ``scratch`` (B, H, >= rows, d), reused across calls, holds the elementwise products: a fresh
    temporary per piece costs more than the multiply (page faults of a large allocation).
    """
    rows = q[:, :, p.t0 : p.t1]
    dst = out[:, :, p.slot, p.t0 : p.t1]
    src = _src_view(k, p)
    b, h = q.shape[:2]
    prod = None if scratch is None else scratch[:, :, : p.t1 - p.t0]
    if p.length == 1:
        prod = torch.mul(rows, src, out=prod)
        torch.sum(prod, -1, out=dst)
    else:
        shape = (b, h, p.runs, p.length, rows.shape[-1])
        prod = torch.mul(rows.view(shape), src[:, :, :, None, :], out=None if prod is None else prod.view(shape))
        dst.view(b, h, p.runs, p.length).copy_(prod.sum(-1))


def piece_combine(w: torch.Tensor, v: torch.Tensor, out: torch.Tensor, p: Piece, rows_offset: int = 0) -> None:
    """out[rows - rows_offset] += w[slot, rows] * v[src(rows)] (w slot-major (B, H, K, n))."""
    t0 = p.t0 - rows_offset
    dst = out[:, :, t0 : t0 + p.runs * p.length]
    src = _src_view(v, p)
    wt = w[:, :, p.slot, p.t0 : p.t1]
    if p.length == 1:
        dst.addcmul_(wt[..., None], src)
    else:
        b, h = dst.shape[:2]
        dst.view(b, h, p.runs, p.length, -1).addcmul_(wt.view(b, h, p.runs, p.length, 1), src[:, :, :, None, :])


# Runs shorter than this are summed by a multiply and a sum; longer ones by a batched matmul: for runs of a few
# rows the per-run matmuls cost more than the elementwise product they replace, for runs of a dozen rows they
# are the cheaper way (figures: bench/NOTES.md).
MATMUL_MIN_RUN = 8


def run_sums(wt: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(..., runs, e): sum over each run of wt (..., runs, length) times rows (..., runs, length, e)."""
    if wt.shape[-1] < MATMUL_MIN_RUN:
        return (wt[..., None] * rows).sum(-2)
    return (wt[..., None, :] @ rows).squeeze(-2)


def piece_scatter(w: torch.Tensor, u: torch.Tensor, out: torch.Tensor, p: Piece, rows_offset: int = 0) -> None:
    """out[src(rows)] += w[slot, rows] * u[rows - rows_offset] (the transpose of :func:`piece_combine`)."""
    t0 = p.t0 - rows_offset
    rows = u[:, :, t0 : t0 + p.runs * p.length]
    wt = w[:, :, p.slot, p.t0 : p.t1]
    dst = _src_view(out, p)
    if p.length == 1:
        dst.addcmul_(wt[..., None], rows)
    else:
        b, h = rows.shape[:2]
        dst.add_(run_sums(wt.view(b, h, p.runs, p.length), rows.view(b, h, p.runs, p.length, -1)))


SLOT_DOT_TWIN = cpu_twin("slots.slot_dot", ("slot_dot",))
SLOT_COMBINE_TWIN = cpu_twin("slots.slot_combine", ("slot_combine",))
SLOT_SCATTER_TWIN = cpu_twin("slots.slot_scatter", ("slot_scatter",))


def slot_dot(q: torch.Tensor, k: torch.Tensor, layout: SlotLayout, cpu_kernels: bool | None = None) -> torch.Tensor:
    """Scores S (B, H, K, n): S[k, t] = q_t . k_{src_k(t)}; 0 where t < f_k. ``cpu_kernels``: the choice of the
    forward this call belongs to (a backward keeps its forward's path); None asks the twin."""
    if SLOT_DOT_TWIN.takes(q, k) if cpu_kernels is None else cpu_kernels:
        return cpu_ops().slot_dot(q.contiguous(), k.contiguous(), layout.src_tensor)
    b, h, n, d = q.shape
    out = q.new_zeros(b, h, layout.num_slots, n)
    pieces = block_pieces(layout)
    scratch = q.new_empty(b, h, max((p.t1 - p.t0 for p in pieces), default=0), d)
    for p in pieces:
        piece_dot(q, k, out, p, scratch)
    return out


def slot_combine(w: torch.Tensor, v: torch.Tensor, layout: SlotLayout, cpu_kernels: bool | None = None) -> torch.Tensor:
    """Weighted sum (B, H, n, e): out_t = sum_k w[k, t] v_{src_k(t)} (w is (B, H, K, n)); ``cpu_kernels`` as in
    :func:`slot_dot`."""
    if SLOT_COMBINE_TWIN.takes(w, v) if cpu_kernels is None else cpu_kernels:
        return cpu_ops().slot_combine(w.contiguous(), v.contiguous(), layout.src_tensor)
    out = v.new_zeros(v.shape)
    for p in block_pieces(layout):
        piece_combine(w, v, out, p)
    return out


def slot_scatter(w: torch.Tensor, u: torch.Tensor, layout: SlotLayout, cpu_kernels: bool | None = None) -> torch.Tensor:
    """Transpose of :func:`slot_combine` (B, H, n, e): out_s = sum over (k, t) with src_k(t) = s of w[k, t] u_t;
    ``cpu_kernels`` as in :func:`slot_dot`."""
    if SLOT_SCATTER_TWIN.takes(w, u) if cpu_kernels is None else cpu_kernels:
        return cpu_ops().slot_scatter(w.contiguous(), u.contiguous(), layout.src_tensor)
    out = u.new_zeros(u.shape)
    for p in block_pieces(layout):
        piece_scatter(w, u, out, p)
    return out


class SlotDot(torch.autograd.Function):
    """S = slot_dot(q, k) with the explicit backward dq = combine(dS, k), dk = scatter(dS, q)."""

    @staticmethod
    def forward(ctx, q, k, layout):
        ctx.save_for_backward(q, k)
        ctx.layout, ctx.cpu_kernels = layout, SLOT_DOT_TWIN.takes(q, k)
        with serial_for(q):
            return slot_dot(q, k, layout, ctx.cpu_kernels)

    @staticmethod
    def backward(ctx, grad):
        q, k = ctx.saved_tensors
        grad = grad.contiguous()
        with nullcontext() if ctx.cpu_kernels else serial():
            dq = slot_combine(grad, k, ctx.layout, ctx.cpu_kernels) if ctx.needs_input_grad[0] else None
            dk = slot_scatter(grad, q, ctx.layout, ctx.cpu_kernels) if ctx.needs_input_grad[1] else None
        return dq, dk, None


class SlotCombine(torch.autograd.Function):
    """out = slot_combine(w, v) with the explicit backward dw = dot(dout, v), dv = scatter(w, dout)."""

    @staticmethod
    def forward(ctx, w, v, layout):
        ctx.save_for_backward(w, v)
        ctx.layout, ctx.cpu_kernels = layout, SLOT_COMBINE_TWIN.takes(w, v)
        with serial_for(v):
            return slot_combine(w, v, layout, ctx.cpu_kernels)

    @staticmethod
    def backward(ctx, grad):
        w, v = ctx.saved_tensors
        grad = grad.contiguous()
        with nullcontext() if ctx.cpu_kernels else serial():
            dw = slot_dot(grad, v, ctx.layout, ctx.cpu_kernels) if ctx.needs_input_grad[0] else None
            dv = slot_scatter(w, grad, ctx.layout, ctx.cpu_kernels) if ctx.needs_input_grad[1] else None
        return dw, dv, None


def slot_softmax(scores: torch.Tensor, layout: SlotLayout) -> torch.Tensor:
    """Softmax over the valid slots of each row (dim 2 of (B, H, K, n)); rows with none give zeros."""
    valid = layout.valid_on(scores.device)
    probs = torch.softmax(scores.masked_fill(~valid, -1e30), dim=2)
    return probs * valid.to(probs.dtype)


SLOT_PROBS_TWIN = cpu_twin("slots.slot_probs", ("slot_probs", "slot_probs_backward"))


def slot_probs(q: torch.Tensor, k: torch.Tensor, layout: SlotLayout, scale: float) -> torch.Tensor:
    """Softmax weights (B, H, K, n) of each row over its valid slots, scores scale * q_t . k_{src_k(t)}; 0 on
    invalid slots. Differentiable in q and k."""
    if SLOT_PROBS_TWIN.takes(q, k):
        return cpu_functions().SlotProbs.apply(q, k, layout, scale)
    return slot_softmax(SlotDot.apply(q, k, layout) * scale, layout)


def slot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SlotLayout, scale: float) -> torch.Tensor:
    """Softmax attention of q over the slots of each row: (B, H, n, e)."""
    return SlotCombine.apply(slot_probs(q, k, layout, scale), v, layout)
