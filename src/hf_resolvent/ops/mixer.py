"""The mixer functions the model calls: each runs the backend that :func:`.dispatch.choose` names, by the row of
:data:`BACKENDS` that says what that backend runs for each kind of call (parallel, or graph inside ``torch.compile``;
the recurrent step or the extend path after a decode state; the Triton kernels; PyTorch's SDPA).

Same contracts as the forms they run (``parallel_mix``, ``recurrent_step``, ...); ``impl`` is described in
:mod:`.dispatch`. A saved model folder ships this module with the ops modules it imports, as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .dispatch import TRITON_DTYPES, choose, torch_only, triton, triton_twin_runs
from .extend import extend_mix
from .graph import graph_mix
from .parallel import parallel_mix, sdpa_mix
from .patterns import get_pattern
from .recurrent import recurrent_step
from .rope import rotated_parts
from .state import DecodeState


@dataclass(frozen=True)
class Backend:
    """What one backend runs for each kind of mixer call (a row of :data:`BACKENDS`).

    Attributes:
        mix: the forward, with :func:`resolvent_mix`'s arguments (qa, ka, qb, kb, x, g, pattern, start, scale, d).
        step: one token after a decode state, with :func:`decode_step`'s (state, qa, ka, qb, kb, x, g, scale, d,
            conv).
        tokens: several tokens after a state at once, the same arguments with a token axis; None: a step each.
        step_projected: one token from the layer's projection in one launch (:func:`decode_projected`'s case);
            None: composed from RoPE, the gate and ``step``.
    """

    mix: Callable
    step: Callable
    tokens: Callable | None = None
    step_projected: Callable | None = None


def _alone(form: Callable) -> Callable:
    """``form`` in PyTorch alone: no CPU twin of its leaves runs (:func:`.dispatch.torch_only`)."""

    def run(*args, **kwargs):
        with torch_only():
            return form(*args, **kwargs)

    return run


def _triton(name: str) -> Callable:
    """The Triton backend's function ``name``, looked up when called (the backend is imported only then)."""
    return lambda *args, **kwargs: getattr(triton(), name)(*args, **kwargs)


def _cuda_mix(qa, ka, qb, kb, x, g, pattern, start=None, scale=None, d=None):
    """The "cuda" backend's forward: softmax attention alone (no B channel) through PyTorch's SDPA, the backends a
    transformers model of attention gets (cuDNN, flash, memory-efficient); every other pattern on Triton."""
    if pattern.kind == "attention":
        return sdpa_mix(qa, ka, x, start, scale)
    return triton().triton_mix(qa, ka, qb, kb, x, g, pattern, start=start, scale=scale, d=d)


BACKENDS: dict[str, Backend] = {
    "torch": Backend(_alone(parallel_mix), _alone(recurrent_step), _alone(extend_mix)),
    "cpu": Backend(parallel_mix, recurrent_step, extend_mix),
    "cuda": Backend(_cuda_mix, _triton("triton_decode_step"), extend_mix, _triton("triton_decode_projected")),
    "triton": Backend(_triton("triton_mix"), _triton("triton_decode_step"), None, _triton("triton_decode_projected")),
    "graph": Backend(graph_mix, recurrent_step),
}


def resolvent_mix(qa, ka, qb, kb, x, g, pattern, impl: str = "auto", start=None, scale=None, d=None):
    """Mix values x with the resolvent mixer of ``pattern``.

    Args:
        qa, ka: (B, H, n, d) queries and keys of the direct channel A (RoPE already applied); None for the tied
            variant.
        qb, kb: (B, H, n, d) queries and keys of the recurrent channel B; unused (may be None) for
            ``attention`` and ``local_attention`` patterns.
        x: (B, H, n, e) values.
        g: (B, H, n) gate in (0, 1): A = (1 - g) A~, B = g B~; unused for attention patterns.
        pattern: a spec such as ``"exp2:ce"`` or a :class:`~hf_resolvent.patterns.Pattern`.
        impl: which backend runs it (:mod:`.dispatch`): ``"auto"``, ``"torch"``, ``"cpu"`` or ``"triton"``.
        start: optional (B,) number of leading padding positions per sequence (left padding).
        scale: score scale, default d ** -0.5.
        d: (B, H, n) for the tied variant (A = B D + D', paper B.3, with ``qa = ka = None``):
            y = (I - B)^-1 (1 - g) x - d x.

    Returns:
        (B, H, n, e) outputs in x's dtype.
    """
    return BACKENDS[choose(impl, x)].mix(qa, ka, qb, kb, x, g, get_pattern(pattern), start=start, scale=scale, d=d)


def decode_step(state: DecodeState, qa, ka, qb, kb, x, g, pattern=None, impl: str = "auto", scale=None, d=None,
                conv=None):
    """Mix one token per sequence against a layer's decode ``state`` and advance it (the model's decode path).

    Args:
        state: the layer's :class:`DecodeState` (advanced in place).
        qa, ka, qb, kb: (B, H, d) the token's queries and keys (qb, kb None for attention patterns; qa, ka None for
            the tied variant).
        x: (B, H, e) its value; g: (B, H) its gate (None for attention patterns).
        pattern: the state's own (it may be given, as to the other forms).
        impl: as for :func:`resolvent_mix`; the backend's decode step runs (:data:`BACKENDS`): the Triton decode
            kernel, or ``recurrent_step`` (on its CPU twin where that takes the call, in PyTorch alone for
            ``"torch"``).
        scale: score scale, default d ** -0.5.
        d: (B, H) for the tied variant.
        conv: (B, C) the token's input row of the layer's short convolution, which the state keeps.

    Returns:
        y (B, H, e), 0 for sequences still in their left padding.
    """
    return BACKENDS[choose(impl, x)].step(state, qa, ka, qb, kb, x, g, scale=scale, d=d, conv=conv)


def decode_tokens(state: DecodeState, qa, ka, qb, kb, x, g, pattern=None, impl: str = "auto", scale=None, d=None,
                  conv=None):
    """Mix L tokens per sequence against a layer's decode ``state`` and advance it (the model's forward after a
    cache): all at once where the backend has a path for several tokens and the state allows it
    (:meth:`~.state.DecodeState.can_extend`), else one decode step per token.

    Args: as :func:`decode_step`, with a token axis: qa, ka, qb, kb (B, H, L, d), x (B, H, L, e), g and d (B, H, L),
    conv (B, L, C).

    Returns:
        y (B, H, L, e).
    """
    backend = BACKENDS[choose(impl, x)]
    if x.shape[2] > 1 and backend.tokens is not None and state.can_extend():
        return backend.tokens(state, qa, ka, qb, kb, x, g, scale=scale, d=d, conv=conv)
    at = lambda t, i: None if t is None else t[:, :, i]  # noqa: E731
    ys = [backend.step(state, *(at(t, i) for t in (qa, ka, qb, kb, x, g)), scale=scale, d=at(d, i),
                       conv=None if conv is None else conv[:, i])
          for i in range(x.shape[2])]
    return ys[0][:, :, None] if len(ys) == 1 else torch.stack(ys, dim=2)


def gate_values(pre: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, dtype: torch.dtype,
                impl: str = "auto") -> torch.Tensor:
    """The gate g (B, H, n) in (0, 1) from its pre-activation ``pre`` (B, n, H) (the layer's ``gate_proj``) and the
    per-head ``dt_bias`` and ``a_log`` (H,): g = exp(-softplus(pre + dt_bias) exp(a_log)), as Mamba-2's decay,
    computed in float32 and returned in ``dtype``.

    ``impl``: the mixer's. Where the mixer runs on Triton (:func:`~.dispatch.triton_twin_runs`), its Triton twin
    (``triton_gate_values``) computes the same in one launch forward and two backward, g contiguous; the PyTorch code
    below is the reference, and returns a transposed view."""
    if dtype in TRITON_DTYPES and triton_twin_runs(impl, pre, dt_bias, a_log):
        return triton().triton_gate_values(pre, dt_bias, a_log, dtype)
    dt = F.softplus(pre.float() + dt_bias.float())
    return torch.exp(-dt * torch.exp(a_log.float())).transpose(1, 2).to(dtype)


def tied_weights(g: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """The tied variant's d (B, H, n) = (1 - g) sigmoid(s) from the gate g (B, H, n) and the pre-activation ``skip``
    s (B, n, H) (the layer's ``skip_proj``)."""
    return (1 - g) * torch.sigmoid(skip).transpose(1, 2)


def decode_projected(state: DecodeState, proj: torch.Tensor, parts: tuple[str, ...], rope=None,
                     rope_channels: str = "ab", gate=None, skip=None, impl: str = "auto", conv=None) -> torch.Tensor:
    """The mixer of L new tokens after a decode ``state`` (advanced in place), from the layer's projection: the
    model's forward after a cache.

    Args:
        state: the layer's :class:`DecodeState`.
        proj: (B, L, P, H, hd) the tokens' projected parts (after the short convolution), named by ``parts``.
        rope: (cos, sin) tables (B or 1, L, hd) that rotate the queries and keys of ``rope_channels``, or None.
        gate: (pre, dt_bias, a_log) for :func:`gate_values`, or None for attention patterns.
        skip: the tied variant's pre-activation (B, L, H) of :func:`tied_weights`, or None.
        impl: as :func:`decode_tokens`. One token on the Triton path runs as one kernel launch
            (``triton_decode_projected``: RoPE, the gate and the state's rows in the kernel); every other case
            composes :func:`~.rope.rotated_parts`, :func:`gate_values` and :func:`decode_tokens`, the reference.
        conv: (B, L, C) the tokens' input rows of the layer's short convolution, which the state keeps.

    Returns:
        y (B, H, L, hd) in proj's dtype.
    """
    backend = BACKENDS[choose(impl, proj)]
    if proj.shape[1] == 1 and backend.step_projected is not None:
        one = lambda t: None if t is None else t[:, 0]  # noqa: E731
        tables = None if rope is None else (one(rope[0]), one(rope[1]), rope_channels)
        gate_pre = None if gate is None else (one(gate[0]), *gate[1:])
        y = backend.step_projected(state, proj[:, 0], parts, tables, gate_pre, one(skip), conv=one(conv))
        return y[:, :, None]
    t = rotated_parts(proj, parts, rope_channels, rope, impl)
    g = None if gate is None else gate_values(*gate, dtype=proj.dtype, impl=impl)
    d = None if skip is None else tied_weights(g, skip)
    return decode_tokens(state, t.get("qa"), t.get("ka"), t.get("qb"), t.get("kb"), t["x"], g, impl=impl, d=d,
                         conv=conv).to(proj.dtype)
