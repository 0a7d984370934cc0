"""Backends of the mixer's parallel form (and decode step), chosen by :mod:`hf_resolvent.ops.dispatch`:

- :mod:`.cpu`: the CPU kernels, C++ (``cpu/csrc``), built on first use, each the twin of a PyTorch function in
  ``ops/`` that declares it and when it applies (:func:`hf_resolvent.ops.dispatch.cpu_twin`), and their autograd
  Functions (``cpu/functions.py``);
- :mod:`.triton`: the Triton kernels (sources in the repository's ``kernels/`` folder), fused forward, backward
  and decode step, for CUDA tensors (tested on CPU with ``TRITON_INTERPRET=1``).

Neither is imported until a call chooses it.
"""
