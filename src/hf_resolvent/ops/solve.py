"""Triangular solves Y = Z + B Y of the parallel form, as autograd Functions with explicit backwards.

B = diag(g) B~ is strictly lower triangular, so Y = (I - B)^-1 Z is found by block forward
substitution over chunks of C rows (DESIGN.md section 3.2), and the backward needs only the transposed
system: dZ = (I - B)^-T dY by backward block substitution, then dB_ij = dZ_i . y_j on the pattern.
Nothing of size n x n is kept: memory is O(n d) plus the B weights of sparse patterns (O(n K)).

- :class:`SparseSolve` takes the weights W (B, H, K, n) of a sparse pattern (slot-major, see
  :mod:`.slots`) and Z. The part of a row that reads its own chunk is a C x C unit lower-triangular
  system whose inverse is built for all chunks at once by block doubling; the part that reads earlier
  chunks is a handful of shifted / strided slice updates per chunk.
- :class:`DenseSolve` takes qb, kb, g and Z for the dense pattern (P^B_i = all earlier positions) and
  computes the softmax itself. Rows are split recursively: the contribution of the solved first half
  to the second half is one flash attention over already-solved Y, whose log-sum-exp merges it with
  the rest of the row (``aten._scaled_dot_product_flash_attention_for_cpu``); chunks of C rows at the
  leaves are solved with a C x C triangular solve. The backward mirrors it with the flash backward.

Shapes: B batch, H heads, n positions, d key width, e value width, K slots, C chunk.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from .slots import Piece, SlotLayout, piece_combine, piece_scatter, slot_dot, slot_pieces

_NEG = -1e30  # "minus infinity" that keeps exp(a - b) finite when both are "minus infinity"


def _next_pow2(c: int) -> int:
    return 1 << max(0, (c - 1).bit_length())


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I - lower)^-1 for strictly lower-triangular (..., C, C) blocks, C a power of two.

    Block doubling: the inverse of [[M1, 0], [-L21, M2]] is [[N1, 0], [N2 L21 N1, N2]], applied for
    block sizes 1, 2, 4, ... C / 2 to all diagonal blocks of all matrices in one batched matmul per
    level (a triangular solve per chunk was 4x slower on CPU).
    """
    *batch, c, _ = lower.shape
    if c & (c - 1):
        raise ValueError(f"unit_lower_inverse needs a power-of-two block size, got {c}")
    inv = torch.ones(*batch, c, 1, 1, dtype=lower.dtype, device=lower.device)  # diagonal blocks of size s
    s = 1
    while s < c:
        nb = c // (2 * s)
        blocks = lower.view(*batch, nb, 2 * s, nb, 2 * s).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
        d1, d2 = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        new = lower.new_zeros(*batch, nb, 2 * s, 2 * s)
        new[..., :s, :s] = d1
        new[..., s:, s:] = d2
        new[..., s:, :s] = d2 @ (blocks[..., s:, :s] @ d1)
        inv = new
        s *= 2
    return inv.squeeze(-3)


# ------------------------------------------------------------------------------------------------
# Sparse patterns


class _SparsePlan:
    """Precomputed chunk structure of a slot layout: far pieces per chunk and the in-chunk scatter."""

    def __init__(self, layout: SlotLayout, chunk: int):
        n, src = layout.n, layout.src
        self.n, self.chunk = n, chunk
        self.cp = _next_pow2(chunk)
        self.num_chunks = -(-n // chunk)
        t = np.arange(n)
        c0 = (t // chunk) * chunk
        near = (src >= 0) & (src >= c0[None, :])
        flat = (t // chunk) * self.cp * self.cp + (t % chunk) * self.cp + (src - c0[None, :])
        dummy = self.num_chunks * self.cp * self.cp
        self.near_index = torch.from_numpy(np.where(near, flat, dummy).reshape(-1).astype(np.int64))
        self.far: list[list[Piece]] = []
        for c in range(self.num_chunks):
            lo, hi = c * chunk, min(n, (c + 1) * chunk)
            pieces: list[Piece] = []
            for k, (f, a) in enumerate(zip(layout.fs, layout.steps)):
                rows = np.nonzero((src[k, lo:hi] >= 0) & (src[k, lo:hi] < lo))[0]
                if len(rows) == 0:
                    continue
                # Sources are non-decreasing along the rows of a slot, so far rows form a prefix.
                pieces.extend(slot_pieces(f, a, k, lo, lo + int(rows[-1]) + 1))
            self.far.append(pieces)

    def inverses(self, w: torch.Tensor) -> torch.Tensor:
        """(B, H, num_chunks, Cp, Cp): the inverse of I - (in-chunk part of B) for every chunk."""
        b, h = w.shape[:2]
        size = self.num_chunks * self.cp * self.cp
        lower = w.new_zeros(b, h, size + 1)
        lower.scatter_(2, self.near_index.to(w.device)[None, None].expand(b, h, -1), w.reshape(b, h, -1))
        lower = lower[:, :, :size].view(b, h, self.num_chunks, self.cp, self.cp)
        return unit_lower_inverse(lower)


@lru_cache(maxsize=32)
def _sparse_plan(layout: SlotLayout, chunk: int) -> _SparsePlan:
    return _SparsePlan(layout, chunk)


def sparse_plan(layout: SlotLayout, chunk: int) -> _SparsePlan:
    return _sparse_plan(layout, chunk)


def _apply_inverse(inv: torch.Tensor, y: torch.Tensor, c: int, plan: _SparsePlan, transpose: bool) -> None:
    c0 = c * plan.chunk
    c1 = min(plan.n, c0 + plan.chunk)
    m = inv[:, :, c, : c1 - c0, : c1 - c0]
    rows = y[:, :, c0:c1]
    rows.copy_((m.mT if transpose else m) @ rows)


class SparseSolve(torch.autograd.Function):
    """Y = Z + B Y with B[t, src_k(t)] = w[k, t] for a sparse slot layout.

    Args (forward): w (B, H, K, n) weights (zero where the layout is not valid), z (B, H, n, e),
    layout, chunk. Returns y (B, H, n, e). Backward: dz = (I - B)^-T dy, dw[k, t] = dz_t . y_src.
    """

    @staticmethod
    def forward(ctx, w, z, layout, chunk):
        plan = sparse_plan(layout, chunk)
        w = w * layout.valid_on(w.device, w.dtype)
        inv = plan.inverses(w)
        y = z.contiguous().clone()
        for c in range(plan.num_chunks):
            for p in plan.far[c]:
                piece_combine(w, y, y, p)
            _apply_inverse(inv, y, c, plan, transpose=False)
        ctx.save_for_backward(w, y, inv)
        ctx.layout, ctx.plan = layout, plan
        return y

    @staticmethod
    def backward(ctx, grad):
        w, y, inv = ctx.saved_tensors
        plan, layout = ctx.plan, ctx.layout
        dz = grad.contiguous().clone()
        for c in reversed(range(plan.num_chunks)):
            _apply_inverse(inv, dz, c, plan, transpose=True)
            for p in plan.far[c]:
                piece_scatter(w, dz, dz, p)
        dw = None
        if ctx.needs_input_grad[0]:
            dw = slot_dot(dz, y, layout) * layout.valid_on(dz.device, dz.dtype)
        return dw, dz, None, None


# ------------------------------------------------------------------------------------------------
# Dense pattern

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


# Rectangles (rows x keys) up to this size use plain matmuls: the flash kernel's per-call set-up and
# thread hand-off cost more than the work there.
SMALL_RECTANGLE = 128 * 128


def _attend_block(q, k, v, scale):
    """Non-causal attention of q over k, v: (out, lse), like the CPU flash kernel."""
    if q.shape[-2] * k.shape[-2] > SMALL_RECTANGLE:
        return _flash(q, k, v, 0.0, False, scale=scale)
    s = q @ k.mT * scale
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    return (p @ v) / total, (m + torch.log(total)).squeeze(-1)


def _attend_block_backward(do, q, k, v, o, lse, scale):
    """Gradients (dq, dk, dv) of one block of a softmax row whose full output is o and full lse is lse."""
    if q.shape[-2] * k.shape[-2] > SMALL_RECTANGLE:
        return _flash_backward(do, q, k, v, o, lse, 0.0, False, scale=scale)
    p = torch.exp(q @ k.mT * scale - lse[..., None])
    ds = p * (do @ v.mT - (do * o).sum(-1, keepdim=True)) * scale
    return ds @ k, ds.mT @ q, p.mT @ do


def _split(a: int, b: int, chunk: int) -> int:
    """Split point of rows [a, b) on a chunk boundary (a is one)."""
    return a + (-(-(b - a) // chunk) // 2) * chunk


def _leaf_scores(q, k, a, b, scale):
    """Scores of rows [a, b) against keys [a, row): (B, H, b - a, b - a), -inf on and above the diagonal."""
    s = q[:, :, a:b] @ k[:, :, a:b].mT * scale
    mask = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu()
    return s.masked_fill_(mask, float("-inf"))


def _dense_forward(q, k, g, z, scale, chunk):
    """y, o, lse with y = z + g * o, o_i = sum_{j<i} softmax_j(s_ij) y_j, lse_i = logsumexp_{j<i} s_ij."""
    b, h, n, width = z.shape
    y = z.clone()
    o = torch.zeros_like(z)  # accumulated earlier-chunk attention, then the full o of each row
    lse = torch.full((b, h, n), _NEG, dtype=z.dtype, device=z.device)
    eye = torch.eye(chunk, dtype=z.dtype, device=z.device)

    def leaf(a, c):
        s = _leaf_scores(q, k, a, c, scale)
        acc_l = lse[:, :, a:c]
        total = torch.logaddexp(acc_l, torch.logsumexp(s, -1))
        p = torch.exp(s - total[..., None])
        part = o[:, :, a:c] * torch.exp(acc_l - total)[..., None]
        gc = g[:, :, a:c, None]
        rhs = y[:, :, a:c] + gc * part
        yc = torch.linalg.solve_triangular(eye[: c - a, : c - a] - gc * p, rhs, upper=False)
        y[:, :, a:c] = yc
        o[:, :, a:c] = part + p @ yc
        lse[:, :, a:c] = total

    def solve(a, c):
        if c - a <= chunk:
            leaf(a, c)
            return
        mid = _split(a, c, chunk)
        solve(a, mid)
        ob, lb = _attend_block(q[:, :, mid:c], k[:, :, a:mid], y[:, :, a:mid], scale)
        acc_l = lse[:, :, mid:c]
        total = torch.logaddexp(acc_l, lb)
        o[:, :, mid:c] = o[:, :, mid:c] * torch.exp(acc_l - total)[..., None] + ob * torch.exp(lb - total)[..., None]
        lse[:, :, mid:c] = total
        solve(mid, c)

    solve(0, n)
    return y, o, lse


def _dense_backward(q, k, g, y, o, lse, grad, scale, chunk):
    b, h, n, width = y.shape
    dz = grad.clone()
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    eye = torch.eye(chunk, dtype=y.dtype, device=y.device)

    def leaf(a, c):
        s = _leaf_scores(q, k, a, c, scale)
        p = torch.exp(s - lse[:, :, a:c, None])
        gc = g[:, :, a:c, None]
        dzc = torch.linalg.solve_triangular((eye[: c - a, : c - a] - gc * p).mT, dz[:, :, a:c], upper=True)
        dz[:, :, a:c] = dzc
        dp = gc * (dzc @ y[:, :, a:c].mT)
        delta = gc * (dzc * o[:, :, a:c]).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq[:, :, a:c] += ds @ k[:, :, a:c]
        dk[:, :, a:c] += ds.mT @ q[:, :, a:c]

    def solve(a, c):
        if c - a <= chunk:
            leaf(a, c)
            return
        mid = _split(a, c, chunk)
        solve(mid, c)
        do = g[:, :, mid:c, None] * dz[:, :, mid:c]
        gq, gk, gv = _attend_block_backward(
            do, q[:, :, mid:c], k[:, :, a:mid], y[:, :, a:mid], o[:, :, mid:c], lse[:, :, mid:c], scale
        )
        dq[:, :, mid:c] += gq
        dk[:, :, a:mid] += gk
        dz[:, :, a:mid] += gv
        solve(a, mid)

    solve(0, n)
    dg = (dz * o).sum(-1)
    return dq, dk, dg, dz


class DenseSolve(torch.autograd.Function):
    """Y = Z + diag(g) softmax_{j<i}(scale q_i . k_j) Y for the dense pattern.

    Args (forward): q, k (B, H, n, d), g (B, H, n), z (B, H, n, e), scale, chunk. Returns y (B, H, n, e).
    Saves q, k, g, y, o (the B~ Y rows) and the row log-sum-exps: O(n (d + e)) memory.
    """

    @staticmethod
    def forward(ctx, q, k, g, z, scale, chunk):
        d, e = q.shape[-1], z.shape[-1]
        width = max(d, e)  # the flash kernels need one head size for q, k and v: pad with zeros
        qp, kp, zp = (_pad_last(t.contiguous(), width) for t in (q, k, z))
        y, o, lse = _dense_forward(qp, kp, g.contiguous(), zp, scale, chunk)
        ctx.save_for_backward(qp, kp, g, y, o, lse)
        ctx.scale, ctx.chunk, ctx.d, ctx.e = scale, chunk, d, e
        return y[..., :e]

    @staticmethod
    def backward(ctx, grad):
        qp, kp, g, y, o, lse = ctx.saved_tensors
        grad = _pad_last(grad.contiguous(), y.shape[-1])
        dq, dk, dg, dz = _dense_backward(qp, kp, g.contiguous(), y, o, lse, grad, ctx.scale, ctx.chunk)
        return dq[..., : ctx.d], dk[..., : ctx.d], dg, dz[..., : ctx.e], None, None


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    if t.shape[-1] == width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]))
