"""Parallel form of the resolvent mixer (training, prefill): block forward substitution.

Y = (I - B)^-1 A X is computed as Z = A X (an attention over P^A), then Y = Z + B Y solved by block
forward substitution (docs/DESIGN.md section 3.2), both with explicit backwards (autograd Functions):

- dense patterns: Z by causal attention (:mod:`.flash`); the solve is a row tree of CPU flash-attention calls
  over the solved Y, merged by log-sum-exps, with C x C triangular solves at the leaves (:mod:`.dense`);
- sparse patterns (banded, diagonal, f-patterns, cache-efficient ones, local attention): scores and
  weighted sums by shifted / strided slices per slot, no gather and no n x n tensor (:mod:`.slots`);
  the solve goes chunk by chunk (:mod:`.solve`). O(n (C + K) d) work, O(n (d + K)) memory.

On CPU, for float32 and float64, both solves and the slot operations run on their twins in the CPU kernels
(:mod:`hf_resolvent.backends.cpu`; each function asks its twin, :func:`.dispatch.cpu_twin`) once they build; the
PyTorch code is their fallback and the reference the tests hold them to.

Left padding (``start``) is turned into right padding by rotating each sequence, so every kernel
runs unmasked on the same pattern rows; causality keeps real rows away from the rotated padding.
Computation is in float32 (float64 for float64 inputs).

Shapes: B batch, H heads, n positions, d key width, e value width, C chunk, M (= K) slots per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import causal_attention
from .common import check_inputs, row_valid_mask, to_compute_dtype
from .dense_solve import dense_solve
from .patterns import Pattern, get_pattern
from .slots import slot_attention, slot_layout, slot_probs
from .sparse_solve import SparseSolve
from .threads import serial_for

# Rows per block of the forward substitution (``chunk=None``), tuned on a 2-core CPU at n = 2048-8192.
DENSE_CHUNK = 64
SPARSE_CHUNK = 32
DEFAULT_CHUNK = DENSE_CHUNK


class _Roll:
    """Left padding turned into right padding: sequence b is rotated left by start[b].

    The mixer is causal, so real rows never read the rotated padding that now sits at the end; every
    kernel then runs without masks and the same pattern rows for all sequences.
    """

    def __init__(self, start: torch.Tensor, n: int):
        t = torch.arange(n, device=start.device)
        self.fwd = (t[None, :] + start[:, None]) % n  # (B, n): new row -> old row
        self.bwd = (t[None, :] - start[:, None]) % n

    @staticmethod
    def make(start, n):
        if start is None or not bool((start != 0).any()):
            return None
        return _Roll(start.long(), n)

    @staticmethod
    def _take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if t.dim() == 3:
            return torch.gather(t, 2, idx.to(t.device)[:, None, :].expand(t.shape))
        return torch.gather(t, 2, idx.to(t.device)[:, None, :, None].expand(t.shape))

    def forward(self, t):
        return None if t is None else self._take(t, self.fwd)

    def back(self, t):
        return self._take(t, self.bwd)


def sdpa_mix(qa, ka, x, start=None, scale=None) -> torch.Tensor:
    """The attention pattern (B = 0: causal softmax attention) through ``F.scaled_dot_product_attention`` in the
    inputs' own dtype, so that it runs on the backend PyTorch picks for any model (cuDNN, flash or memory-efficient
    attention on a GPU). Left padding: each sequence rotated so that its padding comes last (causal rows never read
    it), the outputs rotated back and zeroed there. Args and result as :func:`parallel_mix` without the B channel."""
    n = x.shape[-2]
    roll = _Roll.make(start, n)
    if roll is not None:
        qa, ka, x = (roll.forward(t) for t in (qa, ka, x))
    y = F.scaled_dot_product_attention(qa, ka, x, is_causal=True, scale=scale)
    return y if roll is None else roll.back(y) * row_valid_mask(start, n, y)


def _direct(qa, ka, x, pattern: Pattern, scale: float) -> torch.Tensor:
    if pattern.is_dense:
        return causal_attention(qa, ka, x, scale)
    with serial_for(x):  # many small ops: one intra-op thread (see .threads) unless on the CPU kernels
        return slot_attention(qa, ka, x, slot_layout(pattern, x.shape[-2], with_self=True), scale)


def _recurrent_rows(pattern: Pattern, n: int, device) -> torch.Tensor:
    """(1, 1, n) float: 1 where P^B of the row is non-empty (no padding)."""
    if pattern.kind == "dense":
        return (torch.arange(n, device=device) > 0).float()[None, None]
    return slot_layout(pattern, n).valid.any(0).to(device).float()[None, None]


def _solve(qb, kb, g_eff, z, pattern: Pattern, scale: float, chunk) -> torch.Tensor:
    if pattern.kind == "dense":
        return dense_solve(qb, kb, g_eff, z, scale, chunk or DENSE_CHUNK)
    layout = slot_layout(pattern, z.shape[-2])
    with serial_for(z):
        w = slot_probs(qb, kb, layout, scale) * g_eff[:, :, None, :]
        return SparseSolve.apply(w, z, layout, chunk or SPARSE_CHUNK)


def _check_chunk(chunk) -> None:
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise ValueError(f"chunk must be a positive integer (rows per block of the solve) or None, got {chunk!r}")


def parallel_mix(qa, ka, qb, kb, x, g, pattern, start=None, scale=None, chunk=None, d=None) -> torch.Tensor:
    """Y = (I - B)^-1 (1 - g) A~ X in the parallel form. Returns (B, H, n, e) in x's dtype.

    Args as :func:`hf_resolvent.ops.resolvent_mix` (``d``: the tied variant, z = (I - B)^-1 (1 - g) x, y = z - d x);
    ``chunk`` is the number of rows per block of the forward substitution (default: DENSE_CHUNK = 64 for dense,
    SPARSE_CHUNK = 32 for sparse patterns; any positive integer works). Computation is in float32 (float64 for
    float64 inputs), whatever the input dtype. Differentiable in all tensor inputs, with memory O(n (d + K)) per head.
    """
    pattern = get_pattern(pattern)
    check_inputs(qa, ka, qb, kb, x, g, pattern, start, tied_d=d)
    _check_chunk(chunk)
    out_dtype, n = x.dtype, x.shape[-2]
    qa, ka, qb, kb, x, g, d = to_compute_dtype(qa, ka, qb, kb, x, g, d)
    scale = (qa if d is None else qb).shape[-1] ** -0.5 if scale is None else scale
    roll = _Roll.make(start, n)
    if roll is not None:
        qa, ka, qb, kb, x, g, d = (roll.forward(t) for t in (qa, ka, qb, kb, x, g, d))
    y = _direct(qa, ka, x, pattern, scale) if d is None else x  # the tied variant's A~ is I
    if pattern.has_recurrence:
        g_eff = g * _recurrent_rows(pattern, n, x.device)[0]
        y = _solve(qb, kb, g_eff, (1 - g_eff)[..., None] * y, pattern, scale, chunk)
    if d is not None:
        y = y - d[..., None] * x
    if roll is not None:
        y = roll.back(y) * row_valid_mask(start, n, y)
    return y.to(out_dtype)
