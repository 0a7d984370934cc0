"""Sparse triangular solve Y = Z + B Y of the parallel form, as an autograd Function with explicit backward.

B = diag(g) B~ is strictly lower triangular, so Y = (I - B)^-1 Z is found by block forward
substitution over chunks of C rows (docs/DESIGN.md section 3.2), and the backward needs only the transposed
system: dZ = (I - B)^-T dY by backward block substitution, then dB_ij = dZ_i . y_j on the pattern.
Nothing of size n x n is kept: memory is O(n d) plus the B weights of sparse patterns (O(n K)) and,
while solving, their near-slot band blocks (O(n W), W <= 8 C).

- :class:`SparseSolve` takes the weights W (B, H, K, n) of a sparse pattern (slot-major, see
  :mod:`.slots`) and Z. The part of a row that reads its own chunk is a C x C unit lower-triangular
  system (built for all chunks at once, solved per chunk); the part that reads earlier chunks is one
  block matmul (the near slots: a band of W rows before the chunk) and a few shifted / strided slice
  updates (``slots.Piece``) per chunk.
- the dense pattern is in :mod:`.dense`.

Shapes: B batch, H heads, n positions, d key width, e value width, K slots, C chunk.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from .dispatch import cpu_ops, cpu_twin
from .slots import Piece, SlotLayout, run_sums, slot_dot, slot_pieces
from .threads import serial

_NEG = -1e30  # "minus infinity" that keeps exp(a - b) finite when both are "minus infinity"




# ------------------------------------------------------------------------------------------------
# Sparse patterns

def solve_unit_lower_(m: torch.Tensor, rows: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """rows (..., L, e) <- m^-1 rows (or m^-T rows), in place, for lower-triangular m (..., L, L) with its unit
    diagonal stored. Returns rows.

    Row-major m and rows are column-major m^T and rows^T to LAPACK, so the problem is posed as the
    right-side solve y^T m^T = rows^T (y^T m = rows^T when transposed), written over rows^T: no copies into
    column-major order, which is what makes it cheaper than ``solve_triangular(m, rhs)``. The unit diagonal
    is stored and passed with ``unitriangular=False`` because that path, too, is cheaper than
    ``unitriangular=True`` (docs/DESIGN.md section 3; figures in bench/NOTES.md).
    """
    if transpose:
        torch.linalg.solve_triangular(m, rows.mT, upper=False, left=False, out=rows.mT)
    else:
        torch.linalg.solve_triangular(m.mT, rows.mT, upper=True, left=False, out=rows.mT)
    return rows


class _SparsePlan:
    """Precomputed chunk structure of a slot layout for chunks of C rows.

    Every B entry (row t, slot k, source s) is handled in one of these ways:

    - in-chunk (s in t's chunk): the chunk's C x C unit lower-triangular system;
    - slots with f <= W (the band, a multiple of C), whose sources t - f <= s <= t - f + a - 1 lie in
      t's chunk or the W rows before it: one C x W matmul per chunk with those weights scattered into a
      block;
    - slots with f > W and f - a + 1 >= C ("block" slots): every source of rows [s0, s0 + P) lies
      before s0 when P <= f - a + 1, so they are added P = C 2^j rows at once, when the loop reaches s0;
    - the rest (f > W, f - a + 1 < C, cache-efficient only): in-chunk part in the system, the other
      part by per-chunk slice pieces.
    """

    def __init__(self, layout: SlotLayout, chunk: int, band: int):
        n, src = layout.n, layout.src
        self.n, self.chunk, self.band = n, chunk, band
        self.num_chunks = nc = -(-n // chunk)
        t = np.arange(n)
        c0 = ((t // chunk) * chunk)[None, :]
        valid = src >= 0
        fs = np.array(layout.fs, dtype=np.int64)[:, None]
        near_slot = fs <= band  # sources t - f ... t - f + a - 1 lie in [c0 - W, c1)
        inside = valid & (src >= c0)
        previous = valid & near_slot & (src < c0)
        dummy = nc * chunk * chunk
        self.inside_index = torch.from_numpy(np.where(inside, t * chunk + (src - c0), dummy).reshape(-1))
        self.has_previous = bool(previous.any())
        self.previous_index = torch.from_numpy(
            np.where(previous, t * band + (src - c0 + band), nc * chunk * band).reshape(-1))
        # Per chunk: pieces added when the loop reaches it (block slots for whole spans, mixed slots).
        self.pieces: list[list[Piece]] = [[] for _ in range(nc)]
        for k, slot in enumerate(_far_pieces(layout, chunk)):
            if not near_slot[k, 0]:
                for c, piece in slot:
                    self.pieces[c].append(piece)
        self.num_pieces = sum(map(len, self.pieces))
        self.bounds = [(c * chunk, min(n, (c + 1) * chunk)) for c in range(nc)]
        # The pieces as plain tuples for the loops: (slot, t0, t1, s0, s1, stride, runs, length).
        self.steps = [
            [(p.slot, p.t0, p.t1, p.s0, p.s0 + p.stride * (p.runs - 1) + 1, p.stride, p.runs, p.length) for p in ps]
            for ps in self.pieces
        ]

    def _blocks(self, w: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
        b, h = w.shape[:2]
        size = self.num_chunks * self.chunk * width
        out = w.new_zeros(b, h, size + 1)
        out.scatter_(2, index.to(w.device)[None, None].expand(b, h, -1), w.reshape(b, h, -1))
        return out[:, :, :size].view(b, h, self.num_chunks, self.chunk, width)

    def systems(self, w: torch.Tensor) -> torch.Tensor:
        """(B, H, nc, C, C) per chunk: I - (the in-chunk part of B), unit diagonal stored."""
        lower = self._blocks(w, self.inside_index, self.chunk)
        lower.neg_().diagonal(dim1=-2, dim2=-1).fill_(1)
        return lower

    def previous(self, w: torch.Tensor) -> torch.Tensor | None:
        """(B, H, nc, C, W) per chunk: the weights of its rows on the W rows before it (near slots)."""
        return self._blocks(w, self.previous_index, self.band) if self.has_previous else None


@lru_cache(maxsize=32)
def _far_pieces(layout: SlotLayout, chunk: int) -> tuple[tuple[tuple[int, Piece], ...], ...]:
    """Per slot, the (chunk, piece) pairs that add its sources before each chunk when it is outside the band
    (empty for slots with f <= C, which are always in it); they do not depend on the band's width."""
    n, src = layout.n, layout.src
    valid = src >= 0
    out = []
    for k, (f, a) in enumerate(zip(layout.fs, layout.steps)):
        pairs = []
        if f <= chunk:  # always in the band
            out.append(())
            continue
        if f - a + 1 >= chunk:
            span = chunk << (((f - a + 1) // chunk).bit_length() - 1)  # C 2^j <= f - a + 1
            for s0 in range(0, n, span):
                pairs += [(s0 // chunk, p) for p in slot_pieces(f, a, k, s0, min(n, s0 + span))]
        else:
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                far = np.nonzero(valid[k, lo:hi] & (src[k, lo:hi] < lo))[0]
                if len(far):  # sources are non-decreasing along a slot: far rows form a prefix
                    pairs += [(lo // chunk, p) for p in slot_pieces(f, a, k, lo, lo + int(far[-1]) + 1)]
        out.append(tuple(pairs))
    return tuple(out)


# One C x C block of band matmul costs about as much as this many slice pieces. With it the rule picks W = 4C
# for square:ce and W = C for the other patterns, the same bands that timing the mixer with each W chose
# (figures: bench/NOTES.md).
BAND_BLOCK_COST = 2


@lru_cache(maxsize=32)
def sparse_plan(layout: SlotLayout, chunk: int) -> _SparsePlan:
    """The cheapest plan among near-slot bands W = C, 2C, 4C, 8C (at most n rows): fewest slice pieces plus
    BAND_BLOCK_COST per C x C block of band matmuls. Wide bands pay off for cache-efficient patterns with many
    slots (square:ce: 234 pieces at n = 512, C = 32 and W = C; 64 at W = 4C)."""
    pieces = [len(slot) for slot in _far_pieces(layout, chunk)]

    def cost(band: int) -> int:
        outside = sum(m for f, m in zip(layout.fs, pieces) if f > band)
        return outside + BAND_BLOCK_COST * -(-layout.n // chunk) * (band // chunk)

    bands = [chunk << j for j in range(4) if j == 0 or chunk << j <= layout.n]
    return _SparsePlan(layout, chunk, min(bands, key=cost))


SPARSE_SOLVE_TWIN = cpu_twin("sparse_solve.SparseSolve", ("slot_solve", "slot_solve_transpose", "slot_dot"))


class SparseSolve(torch.autograd.Function):
    """Y = Z + B Y with B[t, src_k(t)] = w[k, t] for a sparse slot layout.

    Args (forward): w (B, H, K, n) weights (zero where the layout is not valid), z (B, H, n, e),
    layout, chunk. Returns y (B, H, n, e). Backward: dz = (I - B)^-T dy, dw[k, t] = dz_t . y_src.
    Its twin on the CPU kernels (:mod:`hf_resolvent.backends.cpu`) solves row by row; the PyTorch path goes chunk by
    chunk on one intra-op thread (see :mod:`.threads`).
    """

    @staticmethod
    def forward(ctx, w, z, layout, chunk):
        ctx.layout, ctx.chunk = layout, chunk
        ctx.cpu_kernels = SPARSE_SOLVE_TWIN.takes(w, z)
        if ctx.cpu_kernels:  # row by row in C++, skipping invalid slots: no chunks, no plan, no mask
            w = w.contiguous()
            y = cpu_ops().slot_solve(w, z.contiguous(), layout.src_tensor)
        else:
            w = w * layout.valid_on(w.device, w.dtype)
            with serial():
                y = z.contiguous().clone()
                _forward_substitution(sparse_plan(layout, chunk), w, y)
        ctx.save_for_backward(w, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        w, y = ctx.saved_tensors
        if ctx.cpu_kernels:
            dz = cpu_ops().slot_solve_transpose(w, grad.contiguous(), ctx.layout.src_tensor)
        else:
            with serial():
                dz = grad.contiguous().clone()
                _backward_substitution(sparse_plan(ctx.layout, ctx.chunk), w, dz)
        dw = None
        if ctx.needs_input_grad[0]:
            if ctx.cpu_kernels:  # the C++ slot_dot leaves invalid slots at 0
                dw = slot_dot(dz, y, ctx.layout, cpu_kernels=True)
            else:
                with serial():
                    dw = slot_dot(dz, y, ctx.layout, cpu_kernels=False) * ctx.layout.valid_on(dz.device, dz.dtype)
        return dw, dz, None, None


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(B, H, ...) -> (B * H, ...), a view of a contiguous tensor."""
    return t.view(t.shape[0] * t.shape[1], *t.shape[2:])


def _forward_substitution(plan: _SparsePlan, w: torch.Tensor, y: torch.Tensor) -> None:
    """y (B, H, n, e) holds z; overwrite it with (I - B)^-1 z, chunk by chunk."""
    systems, previous = _flat(plan.systems(w)), plan.previous(w)
    previous = None if previous is None else _flat(previous)
    w3, y3 = _flat(w), _flat(y)
    bh, e = y3.shape[0], y3.shape[-1]
    for c, (c0, c1) in enumerate(plan.bounds):
        for k, t0, t1, s0, s1, stride, runs, length in plan.steps[c]:  # sources before the chunk
            dst, src, wt = y3[:, t0:t1], y3[:, s0:s1:stride], w3[:, k, t0:t1]
            if length == 1:
                dst.addcmul_(wt[..., None], src)
            else:
                dst.view(bh, runs, length, e).addcmul_(wt.view(bh, runs, length, 1), src[:, :, None])
        rows = y3[:, c0:c1]
        if previous is not None and c:
            lo = max(0, c0 - plan.band)
            # bmm then add, not baddbmm_ into the slice: ATen's batched gemm needs a contiguous result, else it
            # loops over the batch with one addmm per (batch x head) row
            rows += torch.bmm(previous[:, c, : c1 - c0, lo - c0 + plan.band :], y3[:, lo:c0])
        solve_unit_lower_(systems[:, c, : c1 - c0, : c1 - c0], rows)


def _backward_substitution(plan: _SparsePlan, w: torch.Tensor, dz: torch.Tensor) -> None:
    """dz (B, H, n, e) holds dy; overwrite it with (I - B)^-T dy, chunk by chunk from the end."""
    systems, previous = _flat(plan.systems(w)), plan.previous(w)
    previous = None if previous is None else _flat(previous)
    w3, z3 = _flat(w), _flat(dz)
    bh, e = z3.shape[0], z3.shape[-1]
    for c in reversed(range(plan.num_chunks)):
        c0, c1 = plan.bounds[c]
        rows = z3[:, c0:c1]
        solve_unit_lower_(systems[:, c, : c1 - c0, : c1 - c0], rows, transpose=True)
        if previous is not None and c:
            lo = max(0, c0 - plan.band)
            z3[:, lo:c0] += torch.bmm(previous[:, c, : c1 - c0, lo - c0 + plan.band :].mT, rows)  # bmm: as above
        for k, t0, t1, s0, s1, stride, runs, length in plan.steps[c]:
            dst, src, wt = z3[:, s0:s1:stride], z3[:, t0:t1], w3[:, k, t0:t1]
            if length == 1:
                dst.addcmul_(wt[..., None], src)
            else:
                dst.add_(run_sums(wt.view(bh, runs, length), src.view(bh, runs, length, e)))
