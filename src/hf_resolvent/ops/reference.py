"""Naive reference of the resolvent mixer: materialise A and B (n x n), then one triangular solve.

This is the papers' own method and the oracle of every faster path. O(n^2) memory: tests only.

Shapes: B batch, H heads, n positions, d key width, e value width.
"""

from __future__ import annotations

import torch

from .common import check_inputs, row_valid_mask
from .patterns import Pattern, get_pattern


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim where mask is True; rows with no True entry become all zeros."""
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


def mixer_matrices(
    qa: torch.Tensor | None,
    ka: torch.Tensor | None,
    qb: torch.Tensor | None,
    kb: torch.Tensor | None,
    g: torch.Tensor | None,
    pattern: "Pattern | str",
    start: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The matrices A = (1 - diag(g)) A~ and B = diag(g) B~, each (B, H, n, n), in float32 or wider.

    ``qa``/``ka`` may be None for the tied variant (then A~ = I). ``start`` (B,) counts leading padding
    positions per sequence: they are never read, and pattern positions count from the first real one.
    A row whose B set is empty (the first real token, always) gets g = 0.
    """
    pattern = get_pattern(pattern)
    ref = qa if qa is not None else qb
    batch, heads, n, d = ref.shape
    dtype = torch.promote_types(ref.dtype, torch.float32)
    scale = d**-0.5 if scale is None else scale
    mask_a, mask_b = _shifted_masks(pattern, n, start, ref.device)  # (B or 1, 1, n, n)
    if qa is None:
        a_tilde = torch.eye(n, dtype=dtype, device=ref.device).expand(batch, heads, n, n)
    else:
        a_tilde = _masked_softmax(qa.to(dtype) @ ka.to(dtype).transpose(-1, -2) * scale, mask_a)
    if not pattern.has_recurrence:
        return a_tilde, torch.zeros_like(a_tilde)
    b_tilde = _masked_softmax(qb.to(dtype) @ kb.to(dtype).transpose(-1, -2) * scale, mask_b)
    g_eff = g.to(dtype) * mask_b.any(-1).to(dtype)
    return (1 - g_eff)[..., None] * a_tilde, g_eff[..., None] * b_tilde


def _shifted_masks(pattern: Pattern, n: int, start: torch.Tensor | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    mask_a, mask_b = (m.to(device) for m in pattern.masks(n))
    if start is None:
        return mask_a[None, None], mask_b[None, None]
    # Sequence b's row t is the pattern's row t - start[b]: shift both axes by start[b].
    rows = []
    for s in start.tolist():
        a = torch.zeros(2, n, n, dtype=torch.bool, device=device)
        a[0, s:, s:] = mask_a[: n - s, : n - s]
        a[1, s:, s:] = mask_b[: n - s, : n - s]
        rows.append(a)
    both = torch.stack(rows)  # (B, 2, n, n)
    return both[:, 0:1], both[:, 1:2]


def reference_mix(
    qa: torch.Tensor | None,
    ka: torch.Tensor | None,
    qb: torch.Tensor | None,
    kb: torch.Tensor | None,
    x: torch.Tensor,
    g: torch.Tensor | None,
    pattern: "Pattern | str",
    start: torch.Tensor | None = None,
    scale: float | None = None,
    d: torch.Tensor | None = None,
) -> torch.Tensor:
    """Y = (I - B)^-1 A X by one dense triangular solve. Returns (B, H, n, e) in x's dtype.

    ``d`` (B, H, n) asks for the tied variant (paper B.3), with ``qa = ka = None``, straight from its definition:
    A = B D + D' with D = diag(d) and D' = diag(1 - g - d), so that z = y + d x is a convex combination of the
    inputs: z_i = sum_j beta_ij z_j + (1 - g_i) x_i.
    """
    pattern = get_pattern(pattern)
    check_inputs(qa, ka, qb, kb, x, g, pattern, start, tied_d=d)
    a, b = mixer_matrices(qa, ka, qb, kb, g, pattern, start, scale)
    n = x.shape[-2]
    if d is not None:
        g_eff = b.sum(-1)  # g where the row has a B set, else 0
        d = d.to(b.dtype)
        a = b * d[..., None, :] + torch.diag_embed(1 - g_eff - d)
    eye = torch.eye(n, dtype=b.dtype, device=b.device)
    y = torch.linalg.solve_triangular(eye - b, a @ x.to(b.dtype), upper=False)
    return (y * row_valid_mask(start, n, y)).to(x.dtype)
