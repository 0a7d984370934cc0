"""The dense pattern (P^B_i = all earlier positions) in the parallel form, with an explicit backward.

Y = Z + B Y with B = diag(g) softmax_{j<i}(scale qb_i . kb_j); Z = (1 - g) A~ X comes from causal attention
(:mod:`.flash`; it is computed apart because solving it in the same row tree with the heads stacked took
longer, see bench/NOTES.md).

Rows are split recursively (a binary tree on chunk boundaries). For a node [a, c) split at s0, the
contribution of keys [a, s0) to rows [s0, c) is one call of the CPU flash attention kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``, which also returns the log-sum-exp) over the
already solved y[a:s0]; the log-sum-exps merge it with the row's other parts. At the leaves (chunks
of C rows) the in-chunk scores, exponentiated for all chunks at once, complete each row and leave a
C x C unit lower-triangular system for y.

The backward mirrors the tree in reverse: transposed chunk solves give dZ = (I - B)^-T dY, and each
node's flash backward, fed with the rows' *full* outputs and log-sum-exps, gives that block's share
of dq, dk and of B^T dZ. Memory: O(n (d + e)) per head; no n x n tensor.

On CPU the tree has a twin on the CPU kernels (``DenseSolve`` of :mod:`hf_resolvent.backends.cpu.functions`):
chunks of rows in order, each with one gemm of scores against all earlier keys; :func:`dense_solve` asks its twin.

Shapes: B batch, H heads, n positions, d key width, e value width, C chunk, D = max(d, e).
"""

from __future__ import annotations

import torch

from .attention import attend_block, attend_block_backward, merge_block, walk
from .dispatch import cpu_functions, cpu_twin
from .sparse_solve import solve_unit_lower_
from .threads import by_head_groups, head_groups

_NEG = -1e30  # "minus infinity" that keeps exp(a - b) finite when both are "minus infinity"

# The backward splits the heads over worker threads from this many rows on: at 2048 rows the groups keep
# the cores busy through the tree's many small ops, at 1024 they neither help nor hurt, and at 512 the
# hand-offs outweigh the gain (figures: bench/NOTES.md).
GROUPED_MIN_ROWS = 2048


def _chunk_scores(q, k, scale, chunk):
    """In-chunk scores (B, H, n / C, C, C) of every chunk against earlier keys of the chunk (-inf on and
    above the diagonal)."""
    b, h, n, d = q.shape
    qc, kc = q.view(b, h, n // chunk, chunk, d), k.view(b, h, n // chunk, chunk, d)
    s = qc @ kc.mT
    s.mul_(scale)
    return s.masked_fill_(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(), float("-inf"))


def _tree_forward(q, k, y, g, scale, chunk, for_backward=True):
    """Solve y = z + diag(g) B~ y in place; y (B, H, n, D) holds z on entry, n a multiple of chunk.

    Returns what the backward needs: o (B, H, n, D), each row's B~ y, and lse (B, H, n), its
    log-sum-exp of scores; (None, None) without ``for_backward``, which skips assembling them.

    A row's softmax has two parts: the keys of earlier chunks (gathered by the nodes into o, lse) and
    those of its own chunk (in-chunk softmax rho, log-sum-exp li, computed for all chunks at once). With
    s = sigmoid(li - lse), the in-chunk part's share, the leaf solves (I - diag(g s) rho) y = z + g (1 - s) o;
    the rows' full o and lse are assembled once after the walk, so a leaf is a handful of ops.
    """
    b, h, n, width = y.shape
    nc = n // chunk
    rho = _chunk_scores(q, k, scale, chunk)
    m = rho.amax(-1, keepdim=True).clamp_min_(_NEG)  # (B, H, nc, C, 1); a chunk's first row has no keys
    rho = rho.sub_(m).exp_()
    li = (m + rho.sum(-1, keepdim=True).log()).clamp_min_(_NEG)
    rho.mul_(torch.exp(m - li))
    o = torch.zeros_like(y)
    lse = torch.full((b, h, n), _NEG, dtype=y.dtype, device=y.device)
    share = torch.empty(b, h, n, 1, dtype=y.dtype, device=y.device)  # s per row
    eye = torch.eye(chunk, dtype=y.dtype, device=y.device)
    # (B * H, ...) views for the leaves: fewer dims, less indexing work per op
    rho3, li3 = rho.flatten(0, 1), li.flatten(0, 1)
    y3, o3, g3 = y.view(b * h, n, width), o.view(b * h, n, width), g.reshape(b * h, n, 1)
    lse3, share3 = lse.view(b * h, n, 1), share.view(b * h, n, 1)

    def leaf(c):
        rows = slice(c * chunk, (c + 1) * chunk)
        s, g_c, y_c = share3[:, rows], g3[:, rows], y3[:, rows]
        torch.sub(li3[:, c], lse3[:, rows], out=s).sigmoid_()
        gs = g_c * s
        system = torch.addcmul(eye, gs, rho3[:, c], value=-1)
        y_c.addcmul_(g_c - gs, o3[:, rows])  # right-hand side z + g (1 - s) o
        solve_unit_lower_(system, y_c)

    def node(a, s0, s1):
        ob, lb = attend_block(q[:, :, s0:s1], k[:, :, a:s0], y[:, :, a:s0], scale)
        merge_block(o[:, :, s0:s1], lse[:, :, s0:s1], ob, lb)

    walk(n, chunk, leaf, node)
    if not for_backward:
        return None, None
    shape = (b, h, nc, chunk, width)
    o.lerp_((rho @ y.view(shape)).view(o.shape), share)
    return o, torch.logaddexp(lse, li.view(lse.shape), out=lse)


def _tree_backward(q, k, y, o, lse, g, grad, scale, chunk):
    """Gradients (dq, dk, dz, dg) of :func:`_tree_forward` given dy = grad (B, H, n, D)."""
    b, h, n, width = y.shape
    nc = n // chunk
    p = _chunk_scores(q, k, scale, chunk)
    p = p.sub_(lse.view(b, h, nc, chunk, 1)).exp_()  # final in-chunk probabilities
    gcol = g[..., None]
    eye = torch.eye(chunk, dtype=y.dtype, device=y.device)
    dz = grad.clone()
    dq, dk = torch.zeros_like(q), torch.zeros_like(k)
    p3, g3, z3 = p.flatten(0, 1), g.reshape(b * h, n, 1), dz.view(b * h, n, width)

    def leaf(c):
        rows = slice(c * chunk, (c + 1) * chunk)
        system = torch.addcmul(eye, g3[:, rows], p3[:, c], value=-1)
        dz_c = z3[:, rows]
        solve_unit_lower_(system, dz_c, transpose=True)

    def node(a, s0, s1):
        gq, gk, gv = attend_block_backward(
            gcol[:, :, s0:s1] * dz[:, :, s0:s1], q[:, :, s0:s1], k[:, :, a:s0], y[:, :, a:s0], o[:, :, s0:s1],
            lse[:, :, s0:s1], scale,
        )
        dq[:, :, s0:s1] += gq
        dk[:, :, a:s0] += gk
        dz[:, :, a:s0] += gv

    walk(n, chunk, leaf, node, reverse=True)
    # In-chunk score gradients of all chunks at once: ds_ij = p_ij g_i (dz_i . y_j - dz_i . o_i) scale.
    shape = (b, h, nc, chunk, width)
    dzc, yc, oc = dz.view(shape), y.view(shape), o.view(shape)
    ds = (dzc @ yc.mT).sub_((dzc * oc).sum(-1, keepdim=True)).mul_(p).mul_(g.view(b, h, nc, chunk, 1) * scale)
    dq += (ds @ k.view(shape)).view(dq.shape)
    dk += (ds.mT @ q.view(shape)).view(dk.shape)
    dg = (dz * o).sum(-1)
    return dq, dk, dz, dg


def _pad(t: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """Zero-pad the last two dims of t (B, H, n, w) to (rows, width)."""
    if t.shape[-2] == rows and t.shape[-1] == width:
        return t.contiguous()
    return torch.nn.functional.pad(t, (0, width - t.shape[-1], 0, rows - t.shape[-2]))


class DenseSolve(torch.autograd.Function):
    """Y = Z + diag(g) softmax_{j<i}(scale q_i . k_j) Y for the dense pattern.

    Args (forward): q, k (B, H, n, d), g (B, H, n), z (B, H, n, e), scale, chunk. Returns y (B, H, n, e).
    Saves q, k, g, y, o (the B~ Y rows) and the row log-sum-exps: O(n (d + e)) memory.
    """

    @staticmethod
    def forward(ctx, q, k, g, z, scale, chunk):
        n, d, e = q.shape[-2], q.shape[-1], z.shape[-1]
        chunk = -(-n // -(-n // chunk))  # equal chunks of at most `chunk` rows: n = 16 is one chunk of 16, not 64
        width, rows = max(d, e), -(-n // chunk) * chunk
        qp, kp = _pad(q, rows, width), _pad(k, rows, width)
        y = _pad(z, rows, width).clone()  # holds z, then y
        gp = torch.nn.functional.pad(g, (0, rows - n)).contiguous()
        o, lse = _tree_forward(qp, kp, y, gp, scale, chunk, for_backward=any(ctx.needs_input_grad))
        ctx.save_for_backward(qp, kp, y, o, lse, gp)
        ctx.scale, ctx.chunk, ctx.dims = scale, chunk, (d, e)
        return y[..., :n, :e]

    @staticmethod
    def backward(ctx, grad):
        qp, kp, y, o, lse, gp = ctx.saved_tensors
        n, (d, e) = grad.shape[2], ctx.dims
        grad = _pad(grad, y.shape[2], y.shape[3])
        # Long backwards split the heads over worker threads (see .threads); the forward, whose leaves are
        # fewer ops, runs every op on the intra-op threads: of the threading choices tried on 2 cores, this pairing
        # did best for each direction (figures: bench/NOTES.md).
        groups = head_groups(qp) if y.shape[2] >= GROUPED_MIN_ROWS else 1
        dq, dk, dz, dg = by_head_groups(lambda *t: _tree_backward(*t, ctx.scale, ctx.chunk),
                                        (qp, kp, y, o, lse, gp, grad), groups)
        return dq[..., :n, :d], dk[..., :n, :d], dg[..., :n], dz[..., :n, :e], None, None


DENSE_SOLVE_TWIN = cpu_twin("dense_solve.dense_solve", ("dense_solve_forward", "dense_solve_backward"))


def dense_solve(q, k, g, z, scale: float, chunk: int) -> torch.Tensor:
    """Y = Z + diag(g) softmax_{j<i}(scale q_i . k_j) Y: (B, H, n, e), on the CPU kernel where its twin takes the call
    (:mod:`hf_resolvent.backends.cpu`), else by :class:`DenseSolve`."""
    if DENSE_SOLVE_TWIN.takes(q, k, g, z):
        return cpu_functions().DenseSolve.apply(q, k, g, z, scale, chunk)
    return DenseSolve.apply(q, k, g, z, scale, chunk)
