"""The short causal convolution (``ResolventConfig.conv_size``): SiLU of a depthwise convolution of width K over each
token and the K - 1 rows before it, on rows laid out as the mixer's projection gives them, (batch, positions,
channels).

SiLU of PyTorch's ``F.conv1d`` (groups = channels) is the reference. Its twin on the CPU kernels
(``backends/cpu/csrc/conv_cpu.cpp``) computes the same function and its backward in one pass each over the rows'
own layout, where the reference transposes them both ways and runs a slow depthwise backward. The twin takes a
contiguous window only, and follows the model's ``mixer_impl`` as RoPE and GELU do (:data:`CONV_TWIN`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import records_grad
from .dispatch import cpu_functions, cpu_ops, cpu_twin

CONV_TWIN = cpu_twin("conv.causal_conv_silu", ("causal_conv_silu", "causal_conv_silu_backward"),
                     applies=lambda window, weight, bias: window.is_contiguous(), follows_impl=True)


def causal_conv_silu(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, impl: str = "auto"):
    """silu(bias + sum_j weight[:, 0, j] window[:, t + j]) for t < L - K + 1: (B, L, C) rows (the new tokens and the
    K - 1 before them), (C, 1, K) filters and (C,) biases as ``nn.Conv1d(C, C, K, groups=C)`` holds them, to
    (B, L - K + 1, C). ``impl`` is the model's ``mixer_impl`` (:mod:`.dispatch`): the C++ pass runs where its twin
    takes the call."""
    if CONV_TWIN.takes(window, weight, bias, impl=impl):
        if records_grad([window, weight, bias]):
            return cpu_functions().CausalConvSilu.apply(window, weight, bias)
        return cpu_ops().causal_conv_silu(window, weight, bias)
    out = F.conv1d(window.transpose(1, 2), weight, bias, groups=window.shape[2])
    return F.silu(out.transpose(1, 2))
