"""Softmax attention built from blocks: calls of the CPU flash-attention kernel merged by log-sum-exps.

Two users: the dense solve (:mod:`.dense`), whose rows attend to blocks of already solved outputs, and
causal attention itself (:func:`causal_attention`, the direct term Z of dense and attention patterns). On CPU
both have twins on the CPU kernels (:mod:`hf_resolvent.backends.cpu`); this is their PyTorch code.

Why causal attention is split here: PyTorch's CPU flash kernel walks keys in blocks of 512 and skips
only whole blocks above the diagonal, so up to n = 512 a causal call costs as much as a full one. Split
into a row tree (causal leaves of LEAF rows, full blocks below them) it does about half the work, which
shortens causal attention and the dense mixer built on it for SPLIT_MIN_ROWS <= n <= SPLIT_MAX_ROWS
(figures: bench/NOTES.md).

Shapes: B batch, H heads, n positions, d key width, e value width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import cpu_functions, cpu_twin

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

FANOUT = 2  # children per node of the row tree
# Causal attention is split into a row tree on CPU for SPLIT_MIN_ROWS <= n <= SPLIT_MAX_ROWS, with causal leaves
# of LEAF rows. Below 384 rows the tree's extra calls cost more than the masked work they skip; past 512 keys
# the kernel's own block skipping works and the tree only adds calls. Of the leaf sizes tried at n = 512
# (64, 128, 256), 128 did best. Figures: bench/NOTES.md.
SPLIT_MIN_ROWS, SPLIT_MAX_ROWS, LEAF = 384, 512, 128


def _block_scores(q, k, scale, causal):
    """Scores (B, H, m, m') of the non-CPU paths below; -inf above the diagonal when ``causal``."""
    s = q @ k.mT * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def attend_block(q, k, v, scale, causal=False):
    """Attention of q (B, H, m, d) over k, v (B, H, m', .): (out, lse (B, H, m)). The CPU flash kernel where
    it applies; ``causal`` masks key j > row i (top-left aligned, m = m')."""
    if q.device.type == "cpu":
        return _flash(q, k, v, 0.0, causal, scale=scale)[:2]
    s = _block_scores(q, k, scale, causal)
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ v, lse


def attend_block_backward(do, q, k, v, o, lse, scale, causal=False):
    """(dq, dk, dv) of one block of softmax rows whose full output is o and full log-sum-exp is lse.

    The flash backward uses o only through delta_i = do_i . o_i and the probabilities only as
    exp(s - lse): passing the *full* row's o and lse makes the block's share of the gradient exact.
    """
    if q.device.type == "cpu":
        return _flash_backward(do, q, k, v, o, lse, 0.0, causal, scale=scale)
    p = torch.exp(_block_scores(q, k, scale, causal) - lse[..., None])
    ds = p * (do @ v.mT - (do * o).sum(-1, keepdim=True)) * scale
    return ds @ k, ds.mT @ q, p.mT @ do


def merge_block(o, lse, ob, lb) -> None:
    """Fold a block's (ob, lb) into rows' running (o, lse), in place: o = mix by the blocks' softmax mass."""
    o.lerp_(ob, torch.sigmoid(lb - lse)[..., None])
    torch.logaddexp(lse, lb, out=lse)


def _children(a: int, b: int, chunk: int) -> list[tuple[int, int]]:
    """Split rows [a, b) into FANOUT spans on chunk boundaries (a is one)."""
    chunks = -(-(b - a) // chunk)
    size = -(-chunks // FANOUT) * chunk
    return [(s, min(b, s + size)) for s in range(a, b, size)]


def walk(n: int, chunk: int, leaf, node, reverse: bool = False) -> None:
    """Visit the row tree: ``leaf(c)`` per chunk c (rows [c C, min(n, (c + 1) C))), ``node(a, s0, s1)`` for
    keys [a, s0) -> rows [s0, s1).

    Forward order (a block's keys are visited before it: the dense solve needs them solved; every row's
    first block has keys from 0) or reverse order (the backward: rows first).
    """

    def visit(a: int, c: int) -> None:
        if c - a <= chunk:
            leaf(a // chunk)
            return
        spans = _children(a, c, chunk)
        for s0, s1 in reversed(spans) if reverse else spans:
            if reverse:
                visit(s0, s1)
            if s0 > a:
                node(a, s0, s1)
            if not reverse:
                visit(s0, s1)

    visit(0, n)


def _causal_blocks(n: int) -> list[tuple[int, int, int, int, bool]]:
    """(row start, row end, key start, key end, causal) of causal attention's row tree, in forward order."""
    blocks = []
    walk(n, LEAF, lambda c: blocks.append((c * LEAF, min(n, (c + 1) * LEAF)) * 2 + (True,)),
         lambda a, s0, s1: blocks.append((s0, s1, a, s0, False)))
    return blocks


class _SplitCausalAttention(torch.autograd.Function):
    """Causal attention as a row tree of flash calls (see the module docstring). Saves q, k, v, o, lse."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        n = q.shape[-2]
        o = torch.empty(*q.shape[:-1], v.shape[-1], dtype=v.dtype, device=v.device)
        lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)

        for r0, r1, k0, k1, causal in _causal_blocks(n):
            ob, lb = attend_block(q[:, :, r0:r1], k[:, :, k0:k1], v[:, :, k0:k1], scale, causal)
            if k0 == 0:  # the rows' first block in forward order
                o[:, :, r0:r1], lse[:, :, r0:r1] = ob, lb
            else:
                merge_block(o[:, :, r0:r1], lse[:, :, r0:r1], ob, lb)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, grad):
        q, k, v, o, lse = ctx.saved_tensors
        n, grad = q.shape[-2], grad.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

        for r0, r1, k0, k1, causal in _causal_blocks(n):
            rows, keys = slice(r0, r1), slice(k0, k1)
            gq, gk, gv = attend_block_backward(grad[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                               o[:, :, rows], lse[:, :, rows], ctx.scale, causal)
            dq[:, :, rows] += gq
            dk[:, :, keys] += gk
            dv[:, :, keys] += gv
        return dq, dk, dv, None


# The CPU kernel's causal attention serves up to COMPILED_MAX_ROWS rows; past that PyTorch's flash kernel, whose key
# blocks skip the masked half once n is large, is the faster one, forward and backward (the two tie at 4096: the
# timings are in the message of the commit that set this limit, a68c3f7).
COMPILED_MAX_ROWS = 4096

CAUSAL_ATTENTION_TWIN = cpu_twin("attention.causal_attention", ("causal_attention_forward", "causal_attention_backward"),
                                 applies=lambda q, k, v: q.shape[-2] <= COMPILED_MAX_ROWS)


def causal_attention(q, k, v, scale: float) -> torch.Tensor:
    """softmax_{j <= i}(scale q_i . k_j) v: (B, H, n, e). The CPU kernel where its twin takes the call (up to
    COMPILED_MAX_ROWS rows); else a row tree of flash calls on CPU where that is faster (SPLIT_MIN_ROWS <= n <=
    SPLIT_MAX_ROWS; the kernel needs e = d), else one causal ``scaled_dot_product_attention`` call."""
    n = q.shape[-2]
    if CAUSAL_ATTENTION_TWIN.takes(q, k, v):
        return cpu_functions().CausalAttention.apply(q, k, v, scale)
    if q.device.type == "cpu" and SPLIT_MIN_ROWS <= n <= SPLIT_MAX_ROWS and v.shape[-1] == q.shape[-1]:
        return _SplitCausalAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
