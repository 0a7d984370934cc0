"""Triton kernels of the resolvent mixer (installed as ``hf_resolvent.kernels``). See kernels/README.md.

Entry points used by :mod:`hf_resolvent.ops` (``resolvent_mix(..., impl="triton")``):

- :func:`triton_ready` -> bool: Triton can run here (a CUDA device, or ``TRITON_INTERPRET=1``);
- :func:`triton_mix`, :func:`triton_mix_tied`: same contract as ``ops.parallel_mix`` /
  ``ops.parallel_mix_tied``, differentiable (fused forward and backward kernels);
- :func:`triton_decode_step`, :func:`triton_decode_step_tied`: same contract as
  ``ops.recurrent_step`` / ``ops.recurrent_step_tied`` (one token against a layer's ``MixerState``).

Importing this package does not import Triton; the kernels are loaded on first use.
"""

from ._loader import check_ready, interpreting, triton_ready
from .decode import triton_decode_step, triton_decode_step_tied
from .resolvent import BlockConfig, block_config, get_block_config, make_plan, set_nan_fill, triton_mix, triton_mix_tied

__all__ = [
    "BlockConfig",
    "block_config",
    "check_ready",
    "get_block_config",
    "interpreting",
    "make_plan",
    "set_nan_fill",
    "triton_decode_step",
    "triton_decode_step_tied",
    "triton_mix",
    "triton_mix_tied",
    "triton_ready",
]
