"""Graph form of the resolvent mixer: the parallel form written for ``torch.compile`` and ``torch.export``.

The eager parallel form (:mod:`.parallel`) walks the slots with Python-side slices, writes into preallocated
buffers and hands long loops to the C++ kernels of the CPU; none of that traces into one graph. This form computes the
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

from .common import check_inputs, row_valid_mask, to_compute_dtype
from .patterns import Pattern, get_pattern
from .slots import pattern_slots

GRAPH_CHUNK = 64  # rows per block of the forward substitution


def source_table(pattern: Pattern, rows: torch.Tensor, n: int) -> torch.Tensor:
    """(K, *rows.shape) long: the position that slot k of pattern row ``rows[...]`` (all below n, which sets K) reads
    (``pattern.source_index(n).T`` for rows 0..n-1), -1 where the slot is empty. From the slots' closed form
    src_k(t) = a_k (floor((t - f_k) / a_k) + 1) - 1 (:mod:`.slots`) in tensor operations, so that a graph holds no
    trace of the Python and numpy that build the pattern's own table. A cache-efficient slot whose source an earlier
    slot already reads is empty (S_i is a set)."""
    fs, steps = pattern_slots(pattern, n)
    t = rows[None]
    shape = (len(fs),) + (1,) * rows.dim()
    f = torch.tensor(fs, dtype=torch.long, device=rows.device).view(shape)
    a = torch.tensor(steps, dtype=torch.long, device=rows.device).view(shape)
    src = torch.where(t >= f, a * (torch.div(t - f, a, rounding_mode="floor") + 1) - 1, -1)
    if pattern.cache_efficient and len(fs) > 1:
        # Sources never increase with k: a_(k-1) divides a_k and a_k - a_(k-1) < f_k - f_(k-1), so src_k, a number
        # = -1 mod a_(k-1) below src_(k-1) + 1 + a_(k-1), is at most src_(k-1). A repeated source is therefore the
        # one of slot k - 1, and comparing neighbours is exact (O(K) per row, where all pairs cost O(K^2)).
        repeated = (src[1:] == src[:-1]) & (src[1:] >= 0)
        src = torch.cat([src[:1], torch.where(repeated, -1, src[1:])])
    return src


def _slot_sources(pattern: Pattern, n: int, start: torch.Tensor | None, device, with_self: bool) -> torch.Tensor:
    """(B or 1, K, n) long: the position slot k of row t reads, -1 where the slot is empty or the row is padding.

    Sequence b's row t is the pattern's row t - start[b] (positions count from the first real token)."""
    table = source_table(pattern, torch.arange(n, device=device), n)  # (K, n) pattern rows
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


def gathered_slot_probs(q, k, src, scale) -> torch.Tensor:
    """(B, H, K, n) softmax over the slots of q[t] . k[src(t)], 0 where the slot is empty."""
    keys = _gather_rows(k, src.clamp(min=0))  # (B, H, K, n, d)
    scores = (q[:, :, None] * keys).sum(-1) * scale
    return _masked_softmax(scores, (src >= 0)[:, None], dim=2)


def gathered_slot_sum(w, v, src) -> torch.Tensor:
    """(B, H, n, e): sum over slots k of w[k, t] v[src(k, t)] (w is 0 on empty slots)."""
    return (w[..., None] * _gather_rows(v, src.clamp(min=0))).sum(2)


def _direct(qa, ka, x, pattern: Pattern, start, scale) -> torch.Tensor:
    """Z = A~ X (B, H, n, e)."""
    n = x.shape[-2]
    if pattern.is_dense:
        if start is None:
            return F.scaled_dot_product_attention(qa, ka, x, is_causal=True, scale=scale)
        t = torch.arange(n, device=x.device)
        # a padding row reads itself only (its output is zeroed): no row is left without a key
        mask = ((t[None, :] <= t[:, None]) & (t[None, None, :] >= start[:, None, None])) | (t[:, None] == t[None, :])
        return F.scaled_dot_product_attention(qa, ka, x, attn_mask=mask[:, None], scale=scale)
    src = _slot_sources(pattern, n, start, x.device, with_self=True)
    return gathered_slot_sum(gathered_slot_probs(qa, ka, src, scale), x, src)


def _solve(qb, kb, g, rhs, pattern: Pattern, start, scale, chunk: int) -> torch.Tensor:
    """Y with Y = rhs + diag(g) B~ Y, B~ the pattern's softmax over P^B; rows whose P^B is empty take g = 0."""
    n = rhs.shape[-2]
    if pattern.is_dense:
        valid = None if start is None else torch.arange(n, device=rhs.device)[None, :] >= start[:, None]
        return solve_after(qb, kb, g, rhs, rhs[:, :, :0], scale, chunk, key_valid=valid)
    src = _slot_sources(pattern, n, start, rhs.device, with_self=False)
    return solve_after(qb, kb, g, rhs, rhs[:, :, :0], scale, chunk, src=src)


def solve_after(qb, kb, g, rhs, solved, scale, chunk: int, src=None, key_valid=None) -> torch.Tensor:
    """The last R of m = S + R rows of Y = (1 - g) rhs + diag(g) B~ Y, given the first S rows ``solved``.

    Args:
        qb: (B, H, R, d) queries of the rows to solve; kb: (B, H, m, d) keys of all m rows.
        g: (B, H, R) gate of the rows to solve (0 is taken where a row reads nothing); rhs: (B, H, R, e).
        solved: (B, H, S, e) outputs of the first S rows.
        scale: score scale; chunk: rows per block of the forward substitution.
        src: (B or 1, K, R) the rows (in [0, m), -1 empty) that slot k of each row reads (sparse patterns), or
        key_valid: (B or 1, m) bool or None (all), for dense patterns: row S + i reads every valid row before it.

    Returns:
        (B, H, R, e): the rows S..m-1 of Y. The first S rows enter once, before the blocks (a gather or one matmul
        per block), so a long solved prefix is never copied.
    """
    n_solved, total = solved.shape[-2], kb.shape[-2]
    device, dtype = rhs.device, rhs.dtype
    rows = torch.arange(n_solved, total, device=device)
    if src is None:
        count = torch.ones(1, total, dtype=torch.long, device=device) if key_valid is None else key_valid.long()
        before = F.pad(count.cumsum(-1), (1, 0))[:, n_solved:total]  # valid rows before each row to solve
        g = g * (before > 0)[:, None]
    else:
        g = g * (src >= 0).any(1)[:, None]
        w = gathered_slot_probs(qb, kb, src, scale) * g[:, :, None]  # (B, H, K, R)
        local = src - n_solved  # row among the rows to solve; < 0: a solved row, or empty
    rhs = (1 - g)[..., None] * rhs
    if src is not None and n_solved:  # the solved rows' share, for every row at once
        held = (src >= 0) & (src < n_solved)
        rhs = rhs + gathered_slot_sum(w * held[:, None], solved, torch.where(held, src, 0))
    out = rhs[:, :, :0]
    for c0 in range(0, total - n_solved, chunk):
        c1 = min(total - n_solved, c0 + chunk)
        a0, a1 = n_solved + c0, n_solved + c1
        if src is None:  # dense: the rows' probabilities over all earlier rows
            j = torch.arange(a1, device=device)
            mask = (j[None, :] < rows[c0:c1, None])[None]  # (B or 1, C, a1)
            if key_valid is not None:
                mask = mask & key_valid[:, None, :a1]
            scores = qb[:, :, c0:c1] @ kb[:, :, :a1].transpose(-1, -2) * scale
            p = _masked_softmax(scores, mask[:, None], dim=-1) * g[:, :, c0:c1, None]  # (B, H, C, a1)
            acc = rhs[:, :, c0:c1] + p[..., n_solved:a0] @ out
            if n_solved:
                acc = acc + p[..., :n_solved] @ solved
            block = p[..., a0:a1]
        else:
            s, wc = local[..., c0:c1], w[..., c0:c1]  # (B or 1, K, C), (B, H, K, C)
            acc = rhs[:, :, c0:c1]
            if c0:
                earlier = (s >= 0) & (s < c0)
                acc = acc + gathered_slot_sum(wc * earlier[:, None], out, torch.where(earlier, s, 0))
            onehot = (s[..., None] == torch.arange(c0, c1, device=device)).to(wc.dtype)  # (B or 1, K, C, C)
            block = (wc[..., None] * onehot[:, None]).sum(2)  # (B, H, C, C), strictly lower
        eye = torch.eye(c1 - c0, dtype=dtype, device=device)
        y = torch.linalg.solve_triangular(eye - block, acc, upper=False)
        out = torch.cat([out, y], dim=2)
    return out


def graph_mix(qa, ka, qb, kb, x, g, pattern, start=None, scale=None, chunk: int = GRAPH_CHUNK,
              d=None) -> torch.Tensor:
    """Y = (I - B)^-1 (1 - g) A~ X in the graph form (``d``: the tied variant, z = (I - B)^-1 (1 - g) x, y = z - d x).
    Args as :func:`hf_resolvent.ops.resolvent_mix`; returns (B, H, n, e) in x's dtype, computed in float32 (float64
    for float64 inputs)."""
    pattern = get_pattern(pattern)
    check_inputs(qa, ka, qb, kb, x, g, pattern, start, tied_d=d)
    out_dtype, n = x.dtype, x.shape[-2]
    qa, ka, qb, kb, x, g, d = to_compute_dtype(qa, ka, qb, kb, x, g, d)
    scale = (qa if d is None else qb).shape[-1] ** -0.5 if scale is None else scale
    start = None if start is None else start.to(x.device).long()
    if d is not None:
        y = _solve(qb, kb, g, x, pattern, start, scale, chunk) - d[..., None] * x
    else:
        y = _direct(qa, ka, x, pattern, start, scale)
        if pattern.has_recurrence:
            y = _solve(qb, kb, g, y, pattern, start, scale, chunk)
    if start is not None:
        y = y * row_valid_mask(start, n, y)
    return y.to(out_dtype)
