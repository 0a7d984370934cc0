"""The mixer functions the model calls: each runs the backend that :mod:`.dispatch` chooses, in the form that suits it
(parallel, or graph inside ``torch.compile``; the recurrent step or the extend path after a decode state).

Same contracts as the forms they run (``parallel_mix``, ``recurrent_step``, ...); ``impl`` is described in
:mod:`.dispatch`. A saved model folder ships this module with the ops modules it imports, as they are.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from .dispatch import TRITON_DTYPES, choose, choose_decode, choose_extend, torch_only, triton, triton_twin_runs
from .extend import extend_mix
from .graph import graph_mix
from .parallel import parallel_mix, sdpa_mix
from .patterns import get_pattern
from .recurrent import recurrent_step
from .rope import rotated_parts
from .state import DecodeState


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
    pattern = get_pattern(pattern)
    path = choose(impl, x, pattern)
    if path == "sdpa":
        return sdpa_mix(qa, ka, x, start, scale)
    if path == "graph":
        return graph_mix(qa, ka, qb, kb, x, g, pattern, start, scale, d=d)
    if path == "triton":
        return triton().triton_mix(qa, ka, qb, kb, x, g, pattern, start=start, scale=scale, d=d)
    with torch_only() if path == "torch" else nullcontext():
        return parallel_mix(qa, ka, qb, kb, x, g, pattern, start, scale, d=d)


def decode_step(state: DecodeState, qa, ka, qb, kb, x, g, pattern=None, impl: str = "auto", scale=None, d=None,
                conv=None):
    """Mix one token per sequence against a layer's decode ``state`` and advance it (the model's decode path).

    Args:
        state: the layer's :class:`DecodeState` (advanced in place).
        qa, ka, qb, kb: (B, H, d) the token's queries and keys (qb, kb None for attention patterns; qa, ka None for
            the tied variant).
        x: (B, H, e) its value; g: (B, H) its gate (None for attention patterns).
        pattern: the state's own (it may be given, as to the other forms).
        impl: as for :func:`resolvent_mix`; the Triton decode kernel runs for ``"triton"`` (and ``"auto"`` on CUDA
            tensors, outside a graph), ``recurrent_step`` for every other choice (on its CPU twin where that takes
            the call, in PyTorch alone for ``"torch"``).
        scale: score scale, default d ** -0.5.
        d: (B, H) for the tied variant.
        conv: (B, C) the token's input row of the layer's short convolution, which the state keeps.

    Returns:
        y (B, H, e), 0 for sequences still in their left padding.
    """
    path = choose_decode(impl, x)
    if path == "triton":
        return triton().triton_decode_step(state, qa, ka, qb, kb, x, g, scale=scale, d=d, conv=conv)
    with torch_only() if path == "torch" else nullcontext():
        return recurrent_step(state, qa, ka, qb, kb, x, g, scale=scale, d=d, conv=conv)


def decode_tokens(state: DecodeState, qa, ka, qb, kb, x, g, pattern=None, impl: str = "auto", scale=None, d=None,
                  conv=None):
    """Mix L tokens per sequence against a layer's decode ``state`` and advance it (the model's forward after a
    cache): all at once where :func:`~.dispatch.choose_extend` allows it, else one :func:`decode_step` per token.

    Args: as :func:`decode_step`, with a token axis: qa, ka, qb, kb (B, H, L, d), x (B, H, L, e), g and d (B, H, L),
    conv (B, L, C).

    Returns:
        y (B, H, L, e).
    """
    path = choose_extend(impl, state) if x.shape[2] > 1 else "steps"
    if path != "steps":
        with torch_only() if path == "torch" else nullcontext():
            return extend_mix(state, qa, ka, qb, kb, x, g, scale=scale, d=d, conv=conv)
    ys = [decode_step(state, *(None if t is None else t[:, :, i] for t in (qa, ka, qb, kb, x, g)), impl=impl,
                      scale=scale, d=None if d is None else d[:, :, i], conv=None if conv is None else conv[:, i])
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
    if proj.shape[1] == 1 and choose_decode(impl, proj) == "triton":
        one = lambda t: None if t is None else t[:, 0]
        tables = None if rope is None else (one(rope[0]), one(rope[1]), rope_channels)
        gate_pre = None if gate is None else (one(gate[0]), *gate[1:])
        y = triton().triton_decode_projected(state, proj[:, 0], parts, tables, gate_pre, one(skip), conv=one(conv))
        return y[:, :, None]
    t = rotated_parts(proj, parts, rope_channels, rope, impl)
    g = None if gate is None else gate_values(*gate, dtype=proj.dtype, impl=impl)
    d = None if skip is None else tied_weights(g, skip)
    return decode_tokens(state, t.get("qa"), t.get("ka"), t.get("qb"), t.get("kb"), t["x"], g, impl=impl, d=d,
                         conv=conv).to(proj.dtype)
