"""The chunk-parallel solve that the GPU kernels are built on, as a plain PyTorch model (float64 in the tests).

Per sequence and head, the rows split into chunks of C. For chunk c (rows R_c) let

- H_c, the held rows: the earlier rows (before R_c) that some row of R_c reads through B (:func:`held_rows`);
- T_c = (I - B[R_c, R_c])^-1, the inverse of the chunk's own unit lower-triangular block;
- J_c = T_c B[R_c, H_c] and Yhat_c = T_c Z_c, with Z = A X the direct term.

Then the solve (I - B) Y = Z is, chunk after chunk,

    Y_c = Yhat_c + J_c Y[H_c]                                                   (forward)

and its backward, last chunk first, with ACC the gradient that later chunks send back to the rows they hold:

    G_c = dY_c + ACC_c;  ACC[H_c] += J_c^T G_c;  W_c = T_c^T G_c               (W = (I - B)^-T dY)
    dZ = W;  dB_ij = W_i . Y_j on the pattern.

Everything but the chain Y_c <- Y[H_c] (and G_c -> ACC[H_c] backward) is independent per chunk: T_c, J_c and
Yhat_c for every chunk at once, then a sequential pass that carries only the held rows. T_c and J_c need no
derivative of their own: the backward is expressed through W and Y.

This module is the reference the chunked Triton kernels are tested against, in the fla manner (a naive model beside
every kernel): :func:`chunked_mix` takes the inputs of ``ops.reference_mix`` (``d`` for the tied variant),
build A and B the same way (``ops.reference.mixer_matrices``), and solve chunk by chunk
through :class:`ChunkedSolve`, whose backward is the reverse pass above (not autograd through the loop). Left
padding is handled as the kernels handle it: each sequence's real rows are solved alone, so that chunks count from
its first real token. Python loops over chunks: a model for checking, not for speed.

Shapes: B batch, H heads, n positions, d key width, e value width, C rows per chunk.
"""

from __future__ import annotations

import torch

from hf_resolvent.ops.common import row_valid_mask
from hf_resolvent.ops.reference import mixer_matrices
from hf_resolvent.patterns import Pattern, get_pattern

__all__ = ["ChunkedSolve", "chunked_mix", "held_rows"]


def held_rows(pattern: Pattern | str, n: int, chunk: int) -> list[torch.Tensor]:
    """H_c for each chunk of C = ``chunk`` rows of a sequence of n real rows: the sorted 0-indexed rows before the
    chunk that its rows read through B (empty for attention kinds). Sparse patterns take them from the pattern's
    source table (``Pattern.source_index``), dense patterns read every earlier row."""
    pattern = get_pattern(pattern)
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of rows, got {chunk}")
    starts = range(0, n, chunk)
    if not pattern.has_recurrence:
        return [torch.zeros(0, dtype=torch.long) for _ in starts]
    if pattern.is_dense:
        return [torch.arange(c0) for c0 in starts]
    sources = pattern.source_index(n)
    held = []
    for c0 in starts:
        read = sources[c0:c0 + chunk]
        held.append(torch.unique(read[(read >= 0) & (read < c0)]))
    return held


class ChunkedSolve(torch.autograd.Function):
    """Y = (I - B)^-1 Z for one sequence, chunk by chunk: b (H, m, m) strictly lower triangular, z (H, m, e), the
    held rows of each chunk of C rows (:func:`held_rows`); the backward is the reverse chunk pass."""

    @staticmethod
    def forward(ctx, b: torch.Tensor, z: torch.Tensor, chunk: int, held: list[torch.Tensor]) -> torch.Tensor:
        heads, m, _ = b.shape
        eye = torch.eye(chunk, dtype=b.dtype, device=b.device)
        y = torch.zeros_like(z)
        inverses, carried = [], []
        for c, c0 in enumerate(range(0, m, chunk)):
            rows = slice(c0, min(c0 + chunk, m))
            size = rows.stop - rows.start
            t = torch.linalg.solve_triangular(eye[:size, :size] - b[:, rows, rows], eye[:size, :size], upper=False)
            j = t @ b[:, rows][:, :, held[c]]  # (H, size, |H_c|)
            y[:, rows] = t @ z[:, rows] + j @ y[:, held[c]]  # the chain: only the held rows are carried
            inverses.append(t)
            carried.append(j)
        ctx.chunk, ctx.held, ctx.inverses, ctx.carried = chunk, held, inverses, carried
        ctx.save_for_backward(b, y)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        b, y = ctx.saved_tensors
        m = b.shape[1]
        acc = torch.zeros_like(dy)  # what later chunks send back to the rows they hold
        w = torch.zeros_like(dy)
        for c in reversed(range(len(ctx.inverses))):
            rows = slice(c * ctx.chunk, min((c + 1) * ctx.chunk, m))
            grad = dy[:, rows] + acc[:, rows]
            acc[:, ctx.held[c]] += ctx.carried[c].transpose(-1, -2) @ grad
            w[:, rows] = ctx.inverses[c].transpose(-1, -2) @ grad
        db = (w @ y.transpose(-1, -2)).tril(-1)  # W_i . Y_j; entries off the pattern meet zeros of B's softmax
        return db, w, None, None


def _solve_each_sequence(b: torch.Tensor, z: torch.Tensor, pattern: Pattern, chunk: int,
                         start: torch.Tensor | None) -> torch.Tensor:
    """(I - B)^-1 Z (B, H, n, e) with each sequence's real rows solved alone, chunks counted from its first one."""
    batch, heads, n, e = z.shape
    out = []
    for i, s in enumerate([0] * batch if start is None else start.tolist()):
        y = ChunkedSolve.apply(b[i, :, s:, s:], z[i, :, s:], chunk, held_rows(pattern, n - s, chunk))
        out.append(torch.cat([z.new_zeros(heads, s, e), y], dim=1))
    return torch.stack(out)


def chunked_mix(qa, ka, qb, kb, x, g, pattern: Pattern | str, chunk: int, start: torch.Tensor | None = None,
                scale: float | None = None, d: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.reference_mix`` with the solve done chunk by chunk (:class:`ChunkedSolve`): (B, H, n, e). ``d``: the
    tied variant, z = (I - B)^-1 (1 - g) x, y = z - d x."""
    pattern = get_pattern(pattern)
    a, b = mixer_matrices(qa, ka, qb, kb, g, pattern, start, scale)
    if d is not None:
        g_eff = b.sum(-1)  # g where the row has a B set, else 0
        z = _solve_each_sequence(b, (1 - g_eff)[..., None] * x.to(b.dtype), pattern, chunk, start)
        y = z - d.to(b.dtype)[..., None] * x.to(b.dtype)
    else:
        y = _solve_each_sequence(b, a @ x.to(a.dtype), pattern, chunk, start)
    return (y * row_valid_mask(start, x.shape[-2], y)).to(x.dtype)

