"""GPT-2's activation (``gelu_new``, the tanh approximation of GELU) for the MLP.

PyTorch's ``F.gelu(x, approximate="tanh")`` is the reference. On the CPU, for contiguous float32 or float64
activations with the compiled kernels built, one C++ pass (``backends/cpu/csrc/gelu_cpu.cpp``) computes the same
function and its backward: PyTorch's CPU kernel for this form is bound by its arithmetic, and the MLP's activations
are the largest tensor of a prefill. :func:`~hf_resolvent.ops.dispatch.choose` decides with the model's
``mixer_impl``, as for RoPE and the mixer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .common import records_grad
from .dispatch import choose, compiled_for, compiled_ops


class _GeluTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return compiled_ops().gelu_tanh(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return compiled_ops().gelu_tanh_backward(grad.contiguous(), x)


def gelu_tanh(x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2, elementwise, any shape; ``impl`` is the model's
    ``mixer_impl`` (:mod:`.dispatch`): the compiled pass runs where it chooses the CPU kernels."""
    if x.is_contiguous() and choose(impl, x) == "cpu" and compiled_for(x):
        # without a graph to record, the operator alone: a decode step's activations are a few thousand numbers
        return _GeluTanh.apply(x) if records_grad([x]) else compiled_ops().gelu_tanh(x)
    return F.gelu(x, approximate="tanh")
