"""Parallel form of the resolvent mixer (training, prefill): block forward substitution.

Y = (I - B)^-1 A X is computed as Z = A X (an attention over P^A), then Y = Z + B Y solved chunk by
chunk: for the rows of chunk c, the terms of B that read earlier chunks use already-solved outputs,
and the terms inside the chunk form a small unit lower-triangular system (DESIGN.md section 3.2).

Shapes: B batch, H heads, n positions, d key width, e value width, C chunk, M slots per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..patterns import Pattern, get_pattern
from .common import check_inputs, row_valid_mask

DEFAULT_CHUNK = 64


def sparse_index(pattern: Pattern, n: int, start: torch.Tensor | None, device) -> torch.Tensor:
    """(B or 1, n, M) LongTensor of 0-indexed sources per row, -1 where empty.

    With ``start`` the pattern's row r of sequence b sits at t = r + start[b], and so do its sources.
    """
    rel = pattern.source_index(n).to(device)
    if start is None:
        return rel[None]
    t = torch.arange(n, device=device)
    r = t[None, :] - start[:, None].to(device)  # (B, n) pattern row of each position
    rows = rel[r.clamp(min=0)]  # (B, n, M)
    shifted = rows + start[:, None, None].to(device)
    return torch.where((r[..., None] >= 0) & (rows >= 0), shifted, -1)


def gather_slots(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows of t (B, H, n, d) at idx (B or 1, m, M) -> (B, H, m, M, d); -1 entries give row 0."""
    batch, heads, _, d = t.shape
    _, m, slots = idx.shape
    flat = idx.clamp(min=0).reshape(idx.shape[0], 1, m * slots, 1).expand(batch, heads, m * slots, d)
    return torch.gather(t, 2, flat).view(batch, heads, m, slots, d)


def _dense_pad_mask(start: torch.Tensor | None, n: int, device) -> torch.Tensor | None:
    """(B, 1, 1, n) bool: True on real key positions, or None without padding."""
    if start is None:
        return None
    return (torch.arange(n, device=device)[None, :] >= start[:, None].to(device))[:, None, None, :]


def direct_mix(qa, ka, x, pattern: Pattern, start=None, scale=None) -> torch.Tensor:
    """A~ X: softmax attention of qa over ka restricted to P^A (which always holds the row itself)."""
    n = x.shape[-2]
    if pattern.is_dense:
        if start is None:
            return F.scaled_dot_product_attention(qa, ka, x, is_causal=True, scale=scale)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        mask = causal & _dense_pad_mask(start, n, x.device)
        mask = mask | torch.eye(n, dtype=torch.bool, device=x.device)  # padded rows read themselves
        return F.scaled_dot_product_attention(qa, ka, x, attn_mask=mask, scale=scale)
    scale = qa.shape[-1] ** -0.5 if scale is None else scale
    idx = sparse_index(pattern, n, start, x.device)  # P^A minus the row itself
    s_self = (qa * ka).sum(-1, keepdim=True) * scale
    s_slots = torch.einsum("bhnd,bhnmd->bhnm", qa, gather_slots(ka, idx)) * scale
    s_slots = s_slots.masked_fill((idx < 0)[:, None], float("-inf"))
    w = torch.softmax(torch.cat([s_self, s_slots], dim=-1), dim=-1)
    return w[..., :1] * x + torch.einsum("bhnm,bhnme->bhne", w[..., 1:], gather_slots(x, idx))


def _solve_chunk(lower: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve (I - lower) y = rhs for a strictly lower (.., C, C) block.

    The unit diagonal is stored and ``unitriangular=False`` used: about 3x faster on CPU than
    asking for ``unitriangular=True`` (DESIGN.md section 3).
    """
    eye = torch.eye(lower.shape[-1], dtype=lower.dtype, device=lower.device)
    return torch.linalg.solve_triangular(eye - lower, rhs, upper=False)


def solve_sparse(qb, kb, g, z, pattern: Pattern, start=None, scale=None, chunk=DEFAULT_CHUNK) -> torch.Tensor:
    """Y = Z + B Y for a sparse B (banded, diagonal, f-patterns) by block forward substitution."""
    n = z.shape[-2]
    scale = qb.shape[-1] ** -0.5 if scale is None else scale
    idx = sparse_index(pattern, n, start, z.device)  # (Bi, n, M)
    scores = torch.einsum("bhnd,bhnmd->bhnm", qb, gather_slots(kb, idx)) * scale
    scores = scores.masked_fill((idx < 0)[:, None], float("-inf"))
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0) * g[..., None]  # (B, H, n, M)
    batch, heads = z.shape[:2]
    solved: list[torch.Tensor] = []
    for c0 in range(0, n, chunk):
        c1 = min(c0 + chunk, n)
        idx_c, w_c = idx[:, c0:c1], weights[:, :, c0:c1]
        earlier = (idx_c >= 0) & (idx_c < c0)
        rhs = z[:, :, c0:c1]
        if c0 > 0:
            y_prev = torch.cat(solved, dim=2)
            src = gather_slots(y_prev, idx_c.clamp(max=c0 - 1))
            rhs = rhs + torch.einsum("bhcm,bhcme->bhce", w_c * earlier[:, None], src)
        inside = (idx_c >= c0)[:, None]
        cols = (idx_c - c0).clamp(min=0)[:, None].expand(batch, heads, -1, -1)
        lower = torch.zeros(batch, heads, c1 - c0, c1 - c0, dtype=z.dtype, device=z.device)
        lower = lower.scatter_add(-1, cols, w_c * inside)
        solved.append(_solve_chunk(lower, rhs))
    return torch.cat(solved, dim=2)


def solve_dense(qb, kb, g, z, start=None, scale=None, chunk=DEFAULT_CHUNK) -> torch.Tensor:
    """Y = Z + B Y for the dense pattern (P^B_i = all earlier positions), chunk by chunk."""
    n = z.shape[-2]
    scale = qb.shape[-1] ** -0.5 if scale is None else scale
    pad = _dense_pad_mask(start, n, z.device)
    solved: list[torch.Tensor] = []
    for c0 in range(0, n, chunk):
        c1 = min(c0 + chunk, n)
        q = qb[:, :, c0:c1]
        scores = q @ kb[:, :, :c1].transpose(-1, -2) * scale  # (B, H, C, c1)
        allowed = torch.ones(c1 - c0, c1, dtype=torch.bool, device=z.device).tril(c0 - 1)
        if pad is not None:
            allowed = allowed & pad[..., :c1]
        probs = torch.nan_to_num(torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1), nan=0.0)
        probs = probs * g[:, :, c0:c1, None]
        rhs = z[:, :, c0:c1]
        if c0 > 0:
            rhs = rhs + probs[..., :c0] @ torch.cat(solved, dim=2)
        solved.append(_solve_chunk(probs[..., c0:], rhs))
    return torch.cat(solved, dim=2)


def has_recurrent_row(pattern: Pattern, n: int, start, device) -> torch.Tensor:
    """(B or 1, 1, n) float mask: 1 where P^B of the row is non-empty (else the gate is forced to 0)."""
    if pattern.kind == "dense":
        t = torch.arange(n, device=device)
        first = torch.zeros(1, device=device, dtype=torch.long) if start is None else start.to(device)
        return (t[None, :] > first[:, None]).float()[:, None]
    return (sparse_index(pattern, n, start, device) >= 0).any(-1).float()[:, None]


def _solve(qb, kb, g_eff, z, pattern, start, scale, chunk):
    if pattern.kind == "dense":
        return solve_dense(qb, kb, g_eff, z, start, scale, chunk)
    return solve_sparse(qb, kb, g_eff, z, pattern, start, scale, chunk)


def _promote(*ts):
    dtype = torch.promote_types(next(t for t in ts if t is not None).dtype, torch.float32)
    return [None if t is None else t.to(dtype) for t in ts]


def parallel_mix(qa, ka, qb, kb, x, g, pattern, start=None, scale=None, chunk=DEFAULT_CHUNK) -> torch.Tensor:
    """Y = (I - B)^-1 (1 - g) A~ X in the parallel form. Returns (B, H, n, e) in x's dtype.

    Computation is in float32 (or float64 for float64 inputs), whatever the input dtype.
    """
    pattern = get_pattern(pattern)
    check_inputs(qa, ka, qb, kb, x, g, pattern, start)
    out_dtype, n = x.dtype, x.shape[-2]
    qa, ka, qb, kb, x, g = _promote(qa, ka, qb, kb, x, g)
    z = direct_mix(qa, ka, x, pattern, start, scale)
    if pattern.has_recurrence:
        g_eff = g * has_recurrent_row(pattern, n, start, x.device)
        z = _solve(qb, kb, g_eff, (1 - g_eff)[..., None] * z, pattern, start, scale, chunk)
    return (z * row_valid_mask(start, n, z)).to(out_dtype)


def parallel_mix_tied(qb, kb, x, g, d, pattern, start=None, scale=None, chunk=DEFAULT_CHUNK) -> torch.Tensor:
    """Tied variant: z = (I - B)^-1 (1 - g) x, y = z - d x. Returns y (B, H, n, e)."""
    pattern = get_pattern(pattern)
    check_inputs(None, None, qb, kb, x, g, pattern, start, tied_d=d)
    out_dtype, n = x.dtype, x.shape[-2]
    qb, kb, x, g, d = _promote(qb, kb, x, g, d)
    g_eff = g * has_recurrent_row(pattern, n, start, x.device)
    z = _solve(qb, kb, g_eff, (1 - g_eff)[..., None] * x, pattern, start, scale, chunk)
    y = z - d[..., None] * x
    return (y * row_valid_mask(start, n, y)).to(out_dtype)
