"""Backends of the mixer's parallel form (and decode step), chosen by :mod:`hf_resolvent.ops.dispatch`:

- :mod:`.cpu`: C++ kernels (``cpu/csrc``), built on first use, each the twin of a PyTorch function in ``ops/``;
- :mod:`.triton`: the Triton kernels (sources in the repository's ``kernels/`` folder), fused forward, backward
  and decode step, for CUDA tensors (tested on CPU with ``TRITON_INTERPRET=1``).

Neither is imported until a call chooses it.
"""
