"""Triangular solves Y = Z + B Y of the parallel form, as autograd Functions with explicit backwards.

B = diag(g) B~ is strictly lower triangular, so Y = (I - B)^-1 Z is found by block forward
substitution over chunks of C rows (DESIGN.md section 3.2), and the backward needs only the transposed
system: dZ = (I - B)^-T dY by backward block substitution, then dB_ij = dZ_i . y_j on the pattern.
Nothing of size n x n is kept: memory is O(n d) plus the B weights of sparse patterns (O(n K)).

- :class:`SparseSolve` takes the weights W (B, H, K, n) of a sparse pattern (slot-major, see
  :mod:`.slots`) and Z. The part of a row that reads its own chunk is a C x C unit lower-triangular
  system (built for all chunks at once, solved per chunk); the part that reads earlier chunks is one
  block matmul (previous chunk) and a few shifted / strided slice updates (``slots.Piece``) per chunk.
- :class:`DenseSolve` takes qb, kb, g and Z for the dense pattern (P^B_i = all earlier positions) and
  computes the softmax itself. Rows are split recursively: the contribution of the solved first half
  to the second half is one flash attention over already-solved Y, whose log-sum-exp merges it with
  the rest of the row (``aten._scaled_dot_product_flash_attention_for_cpu``); chunks of C rows at the
  leaves are solved with a C x C triangular solve. The backward mirrors it with the flash backward.

Shapes: B batch, H heads, n positions, d key width, e value width, K slots, C chunk.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import lru_cache

import numpy as np
import torch

from .slots import Piece, SlotLayout, piece_combine, piece_scatter, slot_dot, slot_pieces

_NEG = -1e30  # "minus infinity" that keeps exp(a - b) finite when both are "minus infinity"


@contextmanager
def serial():
    """Run the enclosed small ops on one thread.

    The sequential parts of the solves are many ops on (B, H, C, C)-sized tensors: too small to gain
    from a second thread, and on a loaded machine every parallel region waits for its slowest thread
    (a 64 x 64 triangular solve took 30x longer at p90 with 2 threads than with 1).
    """
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# Dense rectangles (rows x keys) below this size run on one thread too.
SERIAL_RECTANGLE = 256 * 256


# ------------------------------------------------------------------------------------------------
# Sparse patterns

def solve_unit_lower(m: torch.Tensor, rhs: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """m^-1 rhs (or m^-T rhs) for lower-triangular m (..., L, L) with its unit diagonal stored.

    Row-major m and rhs are column-major m^T and rhs^T to LAPACK, so the problem is posed as the
    right-side solve y^T m^T = rhs^T (y^T m = rhs^T when transposed): no copies into column-major
    order, 2.8x faster than ``solve_triangular(m, rhs)`` at C = 64. The stored unit diagonal with
    ``unitriangular=False`` is itself 3x faster than ``unitriangular=True`` (DESIGN.md section 3).
    """
    if transpose:
        return torch.linalg.solve_triangular(m, rhs.mT, upper=False, left=False).mT
    return torch.linalg.solve_triangular(m.mT, rhs.mT, upper=True, left=False).mT


class _SparsePlan:
    """Precomputed chunk structure of a slot layout for chunks of C rows.

    Every B entry (row t, slot k, source s) is handled in one of four ways:

    - in-chunk (s in t's chunk): the chunk's C x C unit lower-triangular system;
    - slots with f < C, whose sources t - f <= s <= t - f + a - 1 lie in t's chunk or the one
      before: one C x C matmul per chunk with the previous-chunk weights scattered into a block;
    - slots with f - a + 1 >= C ("block" slots): every source of rows [s0, s0 + P) lies before s0
      when P <= f - a + 1, so they are added P = C 2^j rows at once, when the loop reaches s0;
    - the rest (f >= C > f - a + 1, cache-efficient only): in-chunk part in the system, the other
      part by per-chunk slice pieces.
    """

    def __init__(self, layout: SlotLayout, chunk: int):
        n, src = layout.n, layout.src
        self.n, self.chunk = n, chunk
        self.cp = chunk
        self.num_chunks = nc = -(-n // chunk)
        t = np.arange(n)
        c0 = ((t // chunk) * chunk)[None, :]
        valid = src >= 0
        fs = np.array(layout.fs, dtype=np.int64)[:, None]
        near_slot = fs < chunk
        inside = valid & (src >= c0)
        previous = valid & near_slot & (src < c0) & (src >= c0 - chunk)
        cell = (t // chunk) * self.cp * self.cp + (t % chunk) * self.cp
        dummy = nc * self.cp * self.cp
        self.inside_index = torch.from_numpy(np.where(inside, cell + (src - c0), dummy).reshape(-1))
        self.has_previous = bool(previous.any())
        self.previous_index = torch.from_numpy(np.where(previous, cell + (src - c0 + chunk), dummy).reshape(-1))
        # Per chunk: pieces added when the loop reaches it (block slots for whole spans, mixed slots).
        self.pieces: list[list[Piece]] = [[] for _ in range(nc)]
        for k, (f, a) in enumerate(zip(layout.fs, layout.steps)):
            if f - a + 1 >= chunk:
                span = chunk << (((f - a + 1) // chunk).bit_length() - 1)  # C 2^j <= f - a + 1
                for s0 in range(0, n, span):
                    self.pieces[s0 // chunk].extend(slot_pieces(f, a, k, s0, min(n, s0 + span)))
            elif not near_slot[k, 0]:
                for c in range(nc):
                    lo, hi = c * chunk, min(n, (c + 1) * chunk)
                    far = np.nonzero(valid[k, lo:hi] & (src[k, lo:hi] < lo))[0]
                    if len(far):  # sources are non-decreasing along a slot: far rows form a prefix
                        self.pieces[c].extend(slot_pieces(f, a, k, lo, lo + int(far[-1]) + 1))

    def _blocks(self, w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        b, h = w.shape[:2]
        size = self.num_chunks * self.cp * self.cp
        out = w.new_zeros(b, h, size + 1)
        out.scatter_(2, index.to(w.device)[None, None].expand(b, h, -1), w.reshape(b, h, -1))
        return out[:, :, :size].view(b, h, self.num_chunks, self.cp, self.cp)

    def systems(self, w: torch.Tensor) -> torch.Tensor:
        """(B, H, nc, C, C) per chunk: I - (the in-chunk part of B), unit diagonal stored."""
        lower = self._blocks(w, self.inside_index)
        lower.neg_().diagonal(dim1=-2, dim2=-1).fill_(1)
        return lower

    def previous(self, w: torch.Tensor) -> torch.Tensor | None:
        """(B, H, nc, Cp, Cp) per chunk: the weights of its rows on the previous chunk's rows."""
        return self._blocks(w, self.previous_index) if self.has_previous else None


@lru_cache(maxsize=32)
def sparse_plan(layout: SlotLayout, chunk: int) -> _SparsePlan:
    return _SparsePlan(layout, chunk)


def _solve_chunk(system: torch.Tensor, rows: torch.Tensor, transpose: bool) -> None:
    """rows (B, H, L, e) <- the chunk system (its leading L x L block) solved for rows, in place."""
    m = system[..., : rows.shape[-2], : rows.shape[-2]]
    rows.copy_(solve_unit_lower(m, rows, transpose))


class SparseSolve(torch.autograd.Function):
    """Y = Z + B Y with B[t, src_k(t)] = w[k, t] for a sparse slot layout.

    Args (forward): w (B, H, K, n) weights (zero where the layout is not valid), z (B, H, n, e),
    layout, chunk. Returns y (B, H, n, e). Backward: dz = (I - B)^-T dy, dw[k, t] = dz_t . y_src.
    """

    @staticmethod
    def forward(ctx, w, z, layout, chunk):
        plan = sparse_plan(layout, chunk)
        w = w * layout.valid_on(w.device, w.dtype)
        systems, previous = plan.systems(w), plan.previous(w)
        y = z.contiguous().clone()
        with serial():
            for c in range(plan.num_chunks):
                c0, c1 = c * chunk, min(plan.n, (c + 1) * chunk)
                for p in plan.pieces[c]:
                    piece_combine(w, y, y, p)
                rows = y[:, :, c0:c1]
                if previous is not None and c > 0:
                    rows.add_(previous[:, :, c, : c1 - c0, :chunk] @ y[:, :, c0 - chunk : c0])
                _solve_chunk(systems[:, :, c], rows, transpose=False)
        ctx.save_for_backward(w, y)
        ctx.layout, ctx.plan = layout, plan
        return y

    @staticmethod
    def backward(ctx, grad):
        w, y = ctx.saved_tensors
        plan, layout = ctx.plan, ctx.layout
        chunk = plan.chunk
        systems, previous = plan.systems(w), plan.previous(w)
        dz = grad.contiguous().clone()
        with serial():
            for c in reversed(range(plan.num_chunks)):
                c0, c1 = c * chunk, min(plan.n, (c + 1) * chunk)
                rows = dz[:, :, c0:c1]
                _solve_chunk(systems[:, :, c], rows, transpose=True)
                if previous is not None and c > 0:
                    dz[:, :, c0 - chunk : c0].add_(previous[:, :, c, : c1 - c0, :chunk].mT @ rows)
                for p in plan.pieces[c]:
                    piece_scatter(w, dz, dz, p)
        dw = None
        if ctx.needs_input_grad[0]:
            dw = slot_dot(dz, y, layout) * layout.valid_on(dz.device, dz.dtype)
        return dw, dz, None, None


# ------------------------------------------------------------------------------------------------
# Dense pattern

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _attend_block(q, k, v, scale):
    """Non-causal attention of q over k, v: (out, lse). The CPU flash kernel where it applies."""
    if q.device.type == "cpu":
        return _flash(q, k, v, 0.0, False, scale=scale)
    s = q @ k.mT * scale
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ v, lse


def _attend_block_backward(do, q, k, v, o, lse, scale):
    """(dq, dk, dv) of one block of softmax rows whose full output is o and full log-sum-exp is lse.

    The flash backward only uses o through delta_i = do_i . o_i and the probabilities through
    exp(s - lse): passing the *full* row's o and lse makes the block's share of the gradient exact.
    """
    if q.device.type == "cpu":
        return _flash_backward(do, q, k, v, o, lse, 0.0, False, scale=scale)
    p = torch.exp(q @ k.mT * scale - lse[..., None])
    ds = p * (do @ v.mT - (do * o).sum(-1, keepdim=True)) * scale
    return ds @ k, ds.mT @ q, p.mT @ do


FANOUT = 2  # children per node of the row tree (2: binary; large: one attention per chunk)


def _children(a: int, b: int, chunk: int) -> list[tuple[int, int]]:
    """Split rows [a, b) into FANOUT spans on chunk boundaries (a is one)."""
    chunks = -(-(b - a) // chunk)
    size = -(-chunks // FANOUT) * chunk
    return [(s, min(b, s + size)) for s in range(a, b, size)]


def _chunk_scores(q, k, scale, chunk):
    """In-chunk scores (B, H, n / C, C, C) of every chunk, -inf on and above the diagonal."""
    b, h, n, d = q.shape
    qc, kc = q.view(b, h, n // chunk, chunk, d), k.view(b, h, n // chunk, chunk, d)
    s = qc @ kc.mT
    s.mul_(scale)
    return s.masked_fill_(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(), float("-inf"))


def _dense_forward(q, k, g, z, scale, chunk):
    """y, o, lse with y = z + g * o, o_i = sum_{j<i} softmax_j(s_ij) y_j, lse_i = logsumexp_{j<i} s_ij.

    n must be a multiple of chunk. The in-chunk softmax parts of all chunks are computed up front
    (normalised within the chunk: e = exp(s - li)); a chunk's rows merge them with the attention
    over earlier chunks by their log-sum-exps: weight wi = sigmoid(li - lse_earlier) on the chunk.
    """
    b, h, n, _ = z.shape
    e = _chunk_scores(q, k, scale, chunk)
    li = torch.logsumexp(e, -1).clamp_min_(_NEG)  # (B, H, nc, C); first row of a chunk: no keys
    e = e.sub_(li[..., None]).exp_()
    y = z.clone()
    o = torch.zeros_like(z)  # attention over earlier chunks so far, then the full o of each row
    lse = torch.full((b, h, n), _NEG, dtype=z.dtype, device=z.device)
    eye = torch.eye(chunk, dtype=z.dtype, device=z.device)

    def leaf(c):
        rows = slice(c * chunk, (c + 1) * chunk)
        acc_l, l_c, e_c, g_c = lse[:, :, rows], li[:, :, c], e[:, :, c], g[:, :, rows]
        wi = torch.sigmoid(l_c - acc_l)
        system = torch.addcmul(eye, (g_c * wi)[..., None], e_c, value=-1)
        rhs = torch.addcmul(y[:, :, rows], (g_c - g_c * wi)[..., None], o[:, :, rows])
        y_c = solve_unit_lower(system, rhs)
        y[:, :, rows] = y_c
        o[:, :, rows].lerp_(e_c @ y_c, wi[..., None])
        lse[:, :, rows] = torch.logaddexp(acc_l, l_c)

    def solve(a, c):
        if c - a <= chunk:
            with serial():
                leaf(a // chunk)
            return
        for s0, s1 in _children(a, c, chunk):
            if s0 > a:
                with serial() if (s1 - s0) * (s0 - a) < SERIAL_RECTANGLE else nullcontext():
                    ob, lb = _attend_block(q[:, :, s0:s1], k[:, :, a:s0], y[:, :, a:s0], scale)
                    acc_l = lse[:, :, s0:s1]
                    o[:, :, s0:s1].lerp_(ob, torch.sigmoid(lb - acc_l)[..., None])
                    lse[:, :, s0:s1] = torch.logaddexp(acc_l, lb)
            solve(s0, s1)

    solve(0, n)
    return y, o, lse


def _dense_backward(q, k, g, y, o, lse, grad, scale, chunk):
    """(dq, dk, dg, dz) of :func:`_dense_forward` given dy; n a multiple of chunk."""
    b, h, n, _ = y.shape
    nc = n // chunk
    p = _chunk_scores(q, k, scale, chunk)
    p = p.sub_(lse.view(b, h, nc, chunk, 1)).exp_()  # final in-chunk probabilities
    gc = g.view(b, h, nc, chunk, 1)
    eye = torch.eye(chunk, dtype=y.dtype, device=y.device)
    dz = grad.clone()
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)

    def leaf(c):
        rows = slice(c * chunk, (c + 1) * chunk)
        system = torch.addcmul(eye, gc[:, :, c], p[:, :, c], value=-1)
        dz[:, :, rows] = solve_unit_lower(system, dz[:, :, rows], transpose=True)

    def solve(a, c):
        if c - a <= chunk:
            with serial():
                leaf(a // chunk)
            return
        for s0, s1 in reversed(_children(a, c, chunk)):
            solve(s0, s1)
            if s0 > a:
                with serial() if (s1 - s0) * (s0 - a) < SERIAL_RECTANGLE else nullcontext():
                    do = g[:, :, s0:s1, None] * dz[:, :, s0:s1]
                    gq, gk, gv = _attend_block_backward(
                        do, q[:, :, s0:s1], k[:, :, a:s0], y[:, :, a:s0], o[:, :, s0:s1], lse[:, :, s0:s1], scale
                    )
                    dq[:, :, s0:s1] += gq
                    dk[:, :, a:s0] += gk
                    dz[:, :, a:s0] += gv

    solve(0, n)
    # In-chunk score gradients of all chunks at once: ds_ij = p_ij g_i (dz_i . y_j - dz_i . o_i) scale.
    shape = (b, h, nc, chunk, -1)
    dzc, yc, oc = dz.view(shape), y.view(shape), o.view(shape)
    ds = (dzc @ yc.mT).sub_((dzc * oc).sum(-1, keepdim=True)).mul_(p).mul_(gc * scale)
    dq += (ds @ k.view(shape)).view(dq.shape)
    dk += (ds.mT @ q.view(shape)).view(dk.shape)
    dg = (dz * o).sum(-1)
    return dq, dk, dg, dz


class DenseSolve(torch.autograd.Function):
    """Y = Z + diag(g) softmax_{j<i}(scale q_i . k_j) Y for the dense pattern.

    Args (forward): q, k (B, H, n, d), g (B, H, n), z (B, H, n, e), scale, chunk. Returns y (B, H, n, e).
    Saves q, k, g, y, o (the B~ Y rows) and the row log-sum-exps: O(n (d + e)) memory.
    """

    @staticmethod
    def forward(ctx, q, k, g, z, scale, chunk):
        n, d, e = q.shape[-2], q.shape[-1], z.shape[-1]
        width = max(d, e)  # the flash kernels need one head size for q, k and v: pad with zeros
        rows = -(-n // chunk) * chunk  # whole chunks: extra rows at the end are never read by real ones
        qp, kp, zp = (_pad(t.contiguous(), rows, width) for t in (q, k, z))
        gp = torch.nn.functional.pad(g, (0, rows - n)).contiguous()
        y, o, lse = _dense_forward(qp, kp, gp, zp, scale, chunk)
        ctx.save_for_backward(qp, kp, gp, y, o, lse)
        ctx.scale, ctx.chunk, ctx.shape = scale, chunk, (n, d, e)
        return y[..., :n, :e]

    @staticmethod
    def backward(ctx, grad):
        qp, kp, gp, y, o, lse = ctx.saved_tensors
        n, d, e = ctx.shape
        grad = _pad(grad.contiguous(), y.shape[-2], y.shape[-1])
        dq, dk, dg, dz = _dense_backward(qp, kp, gp, y, o, lse, grad, ctx.scale, ctx.chunk)
        return dq[..., :n, :d], dk[..., :n, :d], dg[..., :n], dz[..., :n, :e], None, None


def _pad(t: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """Zero-pad the last two dims of t (B, H, n, w) to (rows, width)."""
    if t.shape[-2] == rows and t.shape[-1] == width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[-1], 0, rows - t.shape[-2]))
