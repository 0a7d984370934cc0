"""The CPU kernels' autograd Functions: an operator of ``csrc/`` and its backward as one ``torch.autograd.Function``
for each PyTorch function of ``ops/`` whose twin takes the call with a gradient to record (the twins and their
conditions are declared beside those functions: :data:`hf_resolvent.ops.dispatch.CPU_TWINS`). The ops modules
reach them through :func:`hf_resolvent.ops.dispatch.cpu_functions`; without a gradient they call the operators
alone.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import operators

# Rows per gemm block of the CPU kernel's causal attention: of 32, 64 and 128, 64 did best at n = 2048 and nearly
# as well as 32 at n = 512, and every size tried beat PyTorch's flash kernel and its row tree above
# (figures: bench/NOTES.md).
ATTENTION_CHUNK = 64


class CausalAttention(torch.autograd.Function):
    """``ops.attention.causal_attention`` on the CPU kernel (csrc/dense_cpu.cpp): per head, chunks of rows
    against exactly the keys they see, two gemms each. Saves q, k, v, o and the row log-sum-exps."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, lse = operators().causal_attention_forward(q, k, v, scale, ATTENTION_CHUNK)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, grad):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = operators().causal_attention_backward(q, k, v, o, lse, grad.contiguous(), ctx.scale,
                                                           ATTENTION_CHUNK)
        return dq, dk, dv, None


class DenseSolve(torch.autograd.Function):
    """``ops.dense_solve.DenseSolve`` on the CPU kernel (csrc/dense_cpu.cpp): chunks of rows in order, each one gemm
    of scores against all earlier keys and one against the solved rows; no row tree. Same args.
    Saves q, k, g, y and the row log-sum-exps (the backward recomputes the probabilities from them)."""

    @staticmethod
    def forward(ctx, q, k, g, z, scale, chunk):
        q, k, g = q.contiguous(), k.contiguous(), g.contiguous()
        y, lse = operators().dense_solve_forward(q, k, g, z.contiguous(), scale, chunk)
        ctx.save_for_backward(q, k, g, y, lse)
        ctx.scale, ctx.chunk = scale, chunk
        return y

    @staticmethod
    def backward(ctx, grad):
        q, k, g, y, lse = ctx.saved_tensors
        dq, dk, dz, dg = operators().dense_solve_backward(q, k, g, y, lse, grad.contiguous(), ctx.scale, ctx.chunk)
        return dq, dk, dg, dz, None, None


class SlotProbs(torch.autograd.Function):
    """``ops.slots.slot_probs`` in one pass of the CPU kernels per direction (csrc/slots_cpu.cpp). Saves q, k and the
    probs."""

    @staticmethod
    def forward(ctx, q, k, layout, scale):
        q, k = q.contiguous(), k.contiguous()
        probs = operators().slot_probs(q, k, layout.src_tensor, scale)
        ctx.save_for_backward(q, k, probs)
        ctx.layout, ctx.scale = layout, scale
        return probs

    @staticmethod
    def backward(ctx, grad):
        q, k, probs = ctx.saved_tensors
        dq, dk = operators().slot_probs_backward(grad.contiguous(), probs, q, k, ctx.layout.src_tensor, ctx.scale)
        return dq, dk, None, None


class RopeHeads(torch.autograd.Function):
    """``ops.rope.rotated_heads``' rotation: (B, n, P, H, hd) run -> (P, B, H, n, hd) rotated parts, and back for
    the gradient (csrc/rope_cpu.cpp)."""

    @staticmethod
    def forward(ctx, run, cos, sin):
        ctx.save_for_backward(cos, sin)
        return operators().rope_heads(run, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return operators().rope_heads_backward(grad, cos, sin), None, None


class GeluTanh(torch.autograd.Function):
    """``ops.gelu.gelu_tanh`` (csrc/gelu_cpu.cpp)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return operators().gelu_tanh(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return operators().gelu_tanh_backward(grad.contiguous(), x)


class CausalConvSilu(torch.autograd.Function):
    """``ops.conv.causal_conv_silu`` (csrc/conv_cpu.cpp)."""

    @staticmethod
    def forward(ctx, window, weight, bias):
        ctx.save_for_backward(window, weight, bias)
        return operators().causal_conv_silu(window, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        window, weight, bias = ctx.saved_tensors
        return tuple(operators().causal_conv_silu_backward(grad.contiguous(), window, weight, bias))
