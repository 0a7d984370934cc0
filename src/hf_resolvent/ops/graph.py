"""Graph form of the resolvent mixer: the parallel form written for ``torch.compile`` and ``torch.export``.

The eager parallel form (:mod:`.parallel`) walks the slots with Python-side slices, writes into preallocated
buffers and hands long loops to compiled C++ kernels; none of that traces into one graph. This form computes the
same Y = (I - B)^-1 A X with tensor operations only:

- the sources of every row are an index tensor (K, n) from the pattern's own table (``Pattern.source_index``), so
  scores and weighted sums are gathers, which a compiler fuses with the reduction that follows;
- left padding (``start``) shifts those indices per sequence instead of rotating the tensors;
- Y = Z + B Y is solved by block forward substitution over chunks of C rows: the rows before the chunk enter the
  right-hand side (a gather for sparse patterns, a matmul for dense ones), the chunk's own C x C lower-triangular
  block is solved by ``torch.linalg.solve_triangular``. The loop over chunks unrolls into n / C steps of a graph
  specialised to n.

Autograd differentiates it; no custom backward. Dense patterns hold one (C, n) score block per chunk, sparse ones
(K, n) scores and a (K, C, C) block per chunk: O(n (K + C) d) memory, O(n C) more for dense.

Shapes: B batch, H heads, n positions, d key width, e value width, K slots per row, C rows per chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import check_inputs, row_valid_mask
from .parallel import _promote
from .patterns import Pattern, get_pattern
from .slots import _pattern_slots

GRAPH_CHUNK = 64  # rows per block of the forward substitution


def _source_table(pattern: Pattern, n: int, device) -> torch.Tensor:
    """(K, n) long: ``pattern.source_index(n).T``, from the slots' closed form src_k(t) = a_k (floor((t - f_k) / a_k)
    + 1) - 1 (:mod:`.slots`) in tensor operations, so that a graph holds no trace of the Python and numpy that build
    the pattern's own table. A cache-efficient slot whose source an earlier slot already reads is empty (S_i is a
    set)."""
    fs, steps = _pattern_slots(pattern, n)
    t = torch.arange(n, device=device)[None, :]
    f = torch.tensor(fs, dtype=torch.long, device=device)[:, None]
    a = torch.tensor(steps, dtype=torch.long, device=device)[:, None]
    src = torch.where(t >= f, a * (torch.div(t - f, a, rounding_mode="floor") + 1) - 1, -1)
    if pattern.cache_efficient:
        earlier = torch.ones(len(fs), len(fs), dtype=torch.bool, device=device).tril(-1)[:, :, None]  # [k, j]: j < k
        repeated = ((src[:, None] == src[None]) & earlier).any(1) & (src >= 0)
        src = torch.where(repeated, -1, src)
    return src


def _slot_sources(pattern: Pattern, n: int, start: torch.Tensor | None, device, with_self: bool) -> torch.Tensor:
    """(B or 1, K, n) long: the position slot k of row t reads, -1 where the slot is empty or the row is padding.

    Sequence b's row t is the pattern's row t - start[b] (positions count from the first real token)."""
    table = _source_table(pattern, n, device)  # (K, n) pattern rows
    if with_self:
        table = torch.cat([torch.arange(n, device=device)[None, :], table], dim=0)
    if start is None:
        return table[None]
    rel = torch.arange(n, device=device)[None, :] - start[:, None]  # (B, n) pattern row of each row
    src = table[:, rel.clamp(min=0)]  # (K, B, n)
    src = torch.where((src >= 0) & (rel[None] >= 0), src + start[None, :, None], -1)
    return src.transpose(0, 1)


def _gather_rows(v: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """v (B, H, m, D) read at src (B or 1, K, R) (entries in [0, m)) -> (B, H, K, R, D)."""
    b, h, m, dim = v.shape
    k, r = src.shape[-2:]
    index = src.expand(b, k, r).reshape(b, 1, k * r, 1).expand(b, h, k * r, dim)
    return torch.gather(v, 2, index).reshape(b, h, k, r, dim)


def _masked_softmax(scores: torch.Tensor, valid: torch.Tensor, dim: int) -> torch.Tensor:
    """Softmax over ``dim`` where ``valid``; 0 elsewhere and on rows with nothing valid (finite gradients too)."""
    anything = valid.any(dim, keepdim=True)
    scores = torch.where(valid, scores, torch.where(anything, float("-inf"), 0.0))
    return torch.softmax(scores, dim) * valid


def _slot_probs(q, k, src, scale) -> torch.Tensor:
    """(B, H, K, n) softmax over the slots of q[t] . k[src(t)], 0 where the slot is empty."""
    keys = _gather_rows(k, src.clamp(min=0))  # (B, H, K, n, d)
    scores = (q[:, :, None] * keys).sum(-1) * scale
    return _masked_softmax(scores, (src >= 0)[:, None], dim=2)


def _slot_sum(w, v, src) -> torch.Tensor:
    """(B, H, n, e): sum over slots k of w[k, t] v[src(k, t)] (w is 0 on empty slots)."""
    return (w[..., None] * _gather_rows(v, src.clamp(min=0))).sum(2)


def _dense_mask(n: int, start: torch.Tensor | None, device, strict: bool) -> torch.Tensor:
    """(B or 1, 1, n, n) bool: row t reads s where s < t (strict) or s <= t, and s is not padding."""
    t = torch.arange(n, device=device)
    mask = (t[None, :] < t[:, None]) if strict else (t[None, :] <= t[:, None])
    if start is None:
        return mask[None, None]
    return (mask[None] & (t[None, None, :] >= start[:, None, None]))[:, None]


def _direct(qa, ka, x, pattern: Pattern, start, scale) -> torch.Tensor:
    """Z = A~ X (B, H, n, e)."""
    n = x.shape[-2]
    if pattern.is_dense:
        if start is None:
            return F.scaled_dot_product_attention(qa, ka, x, is_causal=True, scale=scale)
        t = torch.arange(n, device=x.device)
        # a padding row reads itself only (its output is zeroed): no row is left without a key
        mask = _dense_mask(n, start, x.device, strict=False) | (t[:, None] == t[None, :])
        return F.scaled_dot_product_attention(qa, ka, x, attn_mask=mask, scale=scale)
    src = _slot_sources(pattern, n, start, x.device, with_self=True)
    return _slot_sum(_slot_probs(qa, ka, src, scale), x, src)


def _solve(qb, kb, g, rhs, pattern: Pattern, start, scale, chunk: int) -> torch.Tensor:
    """Y with Y = rhs + diag(g) B~ Y, B~ the pattern's softmax over P^B; rows whose P^B is empty take g = 0."""
    n = rhs.shape[-2]
    device = rhs.device
    if pattern.is_dense:
        mask = _dense_mask(n, start, device, strict=True)  # (B or 1, 1, n, n)
        has_b = mask.any(-1)  # (B or 1, 1, n)
        src = w = None
    else:
        src = _slot_sources(pattern, n, start, device, with_self=False)  # (B or 1, K, n)
        has_b = (src >= 0).any(1)[:, None]
        w = _slot_probs(qb, kb, src, scale)  # (B, H, K, n)
    g = g * has_b
    rhs = (1 - g)[..., None] * rhs
    if w is not None:
        w = w * g[:, :, None]
    solved = rhs[:, :, :0]
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        rows = torch.arange(c0, c1, device=device)
        if w is None:  # dense: the rows' probabilities over all earlier positions
            scores = qb[:, :, c0:c1] @ kb[:, :, :c1].transpose(-1, -2) * scale
            p = _masked_softmax(scores, mask[:, :, c0:c1, :c1], dim=-1) * g[:, :, c0:c1, None]  # (B, H, C, c1)
            acc = rhs[:, :, c0:c1] + p[..., :c0] @ solved
            block = p[..., c0:c1]
        else:
            s, wc = src[..., c0:c1], w[..., c0:c1]  # (B or 1, K, C), (B, H, K, C)
            earlier = (s < c0).to(wc.dtype)[:, None]  # empty slots (-1) count as earlier with weight 0
            acc = rhs[:, :, c0:c1]
            if c0:
                acc = acc + _slot_sum(wc * earlier, solved, s.clamp(max=c0 - 1))
            onehot = (s[..., None] == rows[None, None, None, :]).to(wc.dtype)  # (B or 1, K, C, C)
            block = (wc[..., None] * onehot[:, None]).sum(2)  # (B, H, C, C), strictly lower
        eye = torch.eye(c1 - c0, dtype=rhs.dtype, device=device)
        y = torch.linalg.solve_triangular(eye - block, acc, upper=False)
        solved = torch.cat([solved, y], dim=2)
    return solved


def graph_mix(qa, ka, qb, kb, x, g, pattern, start=None, scale=None, chunk: int = GRAPH_CHUNK) -> torch.Tensor:
    """Y = (I - B)^-1 (1 - g) A~ X in the graph form. Args as :func:`hf_resolvent.ops.resolvent_mix`; returns
    (B, H, n, e) in x's dtype, computed in float32 (float64 for float64 inputs)."""
    pattern = get_pattern(pattern)
    check_inputs(qa, ka, qb, kb, x, g, pattern, start)
    out_dtype, n = x.dtype, x.shape[-2]
    qa, ka, qb, kb, x, g = _promote(qa, ka, qb, kb, x, g)
    scale = qa.shape[-1] ** -0.5 if scale is None else scale
    start = None if start is None else start.to(x.device).long()
    y = _direct(qa, ka, x, pattern, start, scale)
    if pattern.has_recurrence:
        y = _solve(qb, kb, g, y, pattern, start, scale, chunk)
    if start is not None:
        y = y * row_valid_mask(start, n, y)
    return y.to(out_dtype)


def graph_mix_tied(qb, kb, x, g, d, pattern, start=None, scale=None, chunk: int = GRAPH_CHUNK) -> torch.Tensor:
    """Tied variant: z = (I - B)^-1 (1 - g) x, y = z - d x, in the graph form. Returns y (B, H, n, e)."""
    pattern = get_pattern(pattern)
    check_inputs(None, None, qb, kb, x, g, pattern, start, tied_d=d)
    out_dtype, n = x.dtype, x.shape[-2]
    qb, kb, x, g, d = _promote(qb, kb, x, g, d)
    scale = qb.shape[-1] ** -0.5 if scale is None else scale
    start = None if start is None else start.to(x.device).long()
    y = _solve(qb, kb, g, x, pattern, start, scale, chunk) - d[..., None] * x
    if start is not None:
        y = y * row_valid_mask(start, n, y)
    return y.to(out_dtype)
