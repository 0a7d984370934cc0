"""GPT-2's activation (``gelu_new``, the tanh approximation of GELU) for the MLP.

PyTorch's ``F.gelu(x, approximate="tanh")`` is the reference. Its twin on the CPU kernels
(``backends/cpu/csrc/gelu_cpu.cpp``), one C++ pass, computes the same function and its backward: PyTorch's CPU kernel
for this form is bound by its arithmetic, and the MLP's activations are the largest tensor of a prefill. The twin
takes contiguous activations only, and follows the model's ``mixer_impl`` as RoPE and the mixer do
(:data:`GELU_TWIN`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import records_grad
from .dispatch import cpu_functions, cpu_ops, cpu_twin

GELU_TWIN = cpu_twin("gelu.gelu_tanh", ("gelu_tanh", "gelu_tanh_backward"), applies=lambda x: x.is_contiguous(),
                     follows_impl=True)


def gelu_tanh(x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2, elementwise, any shape; ``impl`` is the model's
    ``mixer_impl`` (:mod:`.dispatch`): the C++ pass runs where its twin takes the call."""
    if GELU_TWIN.takes(x, impl=impl):
        # without a graph to record, the operator alone: a decode step's activations are a few thousand numbers
        return cpu_functions().GeluTanh.apply(x) if records_grad([x]) else cpu_ops().gelu_tanh(x)
    return F.gelu(x, approximate="tanh")
