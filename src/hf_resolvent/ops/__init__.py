"""The resolvent mixer as functions: Y = (I - B)^-1 A X for a pattern (docs/DESIGN.md sections 1 and 3).

Three forms compute the same function and are tested against each other:

- ``reference``: materialised A and B and one triangular solve (O(n^2) memory, tests only);
- ``parallel``: block forward substitution in PyTorch (training and prefill, CPU and GPU);
- ``recurrent``: one token at a time from a :class:`DecodeState` (decode; ``MixerState`` is its earlier name).

``resolvent_mix(..., impl="triton")`` runs the Triton kernels of ``kernels/`` where available, and
``decode_step(..., impl="triton")`` their decode kernel; ``impl="auto"`` picks Triton for CUDA tensors.
"""

from __future__ import annotations

import torch

from ..patterns import get_pattern
from .parallel import parallel_mix, parallel_mix_tied
from .recurrent import recurrent_mix, recurrent_mix_tied, recurrent_step, recurrent_step_tied
from .reference import mixer_matrices, reference_mix, reference_mix_tied
from .state import DecodeState, MixerState

IMPLS = ("reference", "parallel", "recurrent", "triton", "auto")

__all__ = [
    "IMPLS",
    "DecodeState",
    "MixerState",
    "decode_step",
    "decode_step_tied",
    "mixer_matrices",
    "parallel_mix",
    "parallel_mix_tied",
    "recurrent_mix",
    "recurrent_mix_tied",
    "recurrent_step",
    "recurrent_step_tied",
    "reference_mix",
    "reference_mix_tied",
    "resolvent_mix",
    "resolvent_mix_tied",
]


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _use_triton(impl: str, x: torch.Tensor) -> bool:
    if impl == "triton":
        return True
    return impl == "auto" and x.is_cuda and _triton_available()


def _triton_available() -> bool:
    try:
        from ..kernels import triton_ready
    except ImportError:
        return False
    return triton_ready()


def resolvent_mix(qa, ka, qb, kb, x, g, pattern, impl: str = "auto", start=None, scale=None):
    """Mix values x with the resolvent mixer of ``pattern``.

    Args:
        qa, ka: (B, H, n, d) queries and keys of the direct channel A (RoPE already applied).
        qb, kb: (B, H, n, d) queries and keys of the recurrent channel B; unused (may be None) for
            ``attention`` and ``local_attention`` patterns.
        x: (B, H, n, e) values.
        g: (B, H, n) gate in (0, 1): A = (1 - g) A~, B = g B~; unused for attention patterns.
        pattern: a spec such as ``"exp2:ce"`` or a :class:`~hf_resolvent.patterns.Pattern`.
        impl: ``"reference"``, ``"parallel"``, ``"recurrent"``, ``"triton"`` or ``"auto"`` (Triton for
            CUDA tensors when the kernels can run, else the PyTorch parallel form).
        start: optional (B,) number of leading padding positions per sequence (left padding).
        scale: score scale, default d ** -0.5.

    Returns:
        (B, H, n, e) outputs in x's dtype.
    """
    _check_impl(impl)
    pattern = get_pattern(pattern)
    if impl == "reference":
        return reference_mix(qa, ka, qb, kb, x, g, pattern, start, scale)
    if impl == "recurrent":
        return recurrent_mix(qa, ka, qb, kb, x, g, pattern, start, scale)
    if _use_triton(impl, x):
        from ..kernels import triton_mix

        return triton_mix(qa, ka, qb, kb, x, g, pattern, start=start, scale=scale)
    return parallel_mix(qa, ka, qb, kb, x, g, pattern, start, scale)


def resolvent_mix_tied(qb, kb, x, g, d, pattern, impl: str = "auto", start=None, scale=None):
    """Tied variant (A = B D + D', paper B.3): y = (I - B)^-1 (1 - g) x - d x, with d (B, H, n)."""
    _check_impl(impl)
    pattern = get_pattern(pattern)
    if impl == "reference":
        return reference_mix_tied(qb, kb, x, g, d, pattern, start, scale)
    if impl == "recurrent":
        return recurrent_mix_tied(qb, kb, x, g, d, pattern, start, scale)
    if _use_triton(impl, x):
        from ..kernels import triton_mix_tied

        return triton_mix_tied(qb, kb, x, g, d, pattern, start=start, scale=scale)
    return parallel_mix_tied(qb, kb, x, g, d, pattern, start, scale)


def decode_step(state: DecodeState, qa, ka, qb, kb, x, g, pattern, impl: str = "auto", scale=None):
    """Mix one token per sequence against a layer's decode ``state`` and advance it (the model's decode path).

    Args:
        state: the layer's :class:`DecodeState` (advanced in place).
        qa, ka, qb, kb: (B, H, d) the token's queries and keys (qb, kb None for attention patterns).
        x: (B, H, e) its value; g: (B, H) its gate (None for attention patterns).
        pattern: spec or Pattern.
        impl: ``"triton"`` (the decode kernel of ``kernels/``), ``"auto"`` (Triton for CUDA tensors when the
            kernels can run) or any other form name (the PyTorch recurrent step, ``recurrent_step``).
        scale: score scale, default d ** -0.5.

    Returns:
        y (B, H, e), 0 for sequences still in their left padding.
    """
    _check_impl(impl)
    if _use_triton(impl, x):
        from ..kernels import triton_decode_step

        return triton_decode_step(state, qa, ka, qb, kb, x, g, pattern, scale=scale)
    return recurrent_step(state, qa, ka, qb, kb, x, g, pattern, scale)


def decode_step_tied(state: DecodeState, qb, kb, x, g, d, pattern, impl: str = "auto", scale=None):
    """Tied variant of :func:`decode_step`: qb, kb (B, H, d), x (B, H, e), g and d (B, H) -> y (B, H, e)."""
    _check_impl(impl)
    if _use_triton(impl, x):
        from ..kernels import triton_decode_step_tied

        return triton_decode_step_tied(state, qb, kb, x, g, d, pattern, scale=scale)
    return recurrent_step_tied(state, qb, kb, x, g, d, pattern, scale)
