"""Decode step on Triton: one token per sequence against a layer's cache (``ops.DecodeState``).

Mirrors ``ops.recurrent_step`` (and its tied variant) in one kernel launch: the token's output from the rows held in
the state (which rows are read is the state's ``read_rule``, evaluated in the kernel from the held positions), then
the token's rows written into the state's buffers in place, where ``DecodeState.advance`` would write them (the state
then advances its positions and count). :func:`triton_decode_projected` also takes the mixer's projection as it
comes (RoPE and the gate's activation applied in the kernel), which is the model's decode step.

Shapes: B batch, H heads, S rows held, d key width, e value width; one token is (B, H, d).
"""

from __future__ import annotations

import torch

from hf_resolvent.ops.common import check_tied
from hf_resolvent.ops.state import SLOTS, DecodeState

from ._loader import check_ready, jit_module
from .launching import SUPPORTED_DTYPES, get_block_config


def _check(state: DecodeState, x: torch.Tensor, tied: bool, *tensors) -> None:
    check_ready(x, *tensors)
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the Triton decode kernel takes float32, bfloat16 or float16 inputs, got {x.dtype}")
    if tied and not state.pattern.has_recurrence:
        raise ValueError(f"the tied variant needs a recurrent pattern, got {state.pattern.name!r}")
    if x.dim() != 3:
        raise ValueError(f"x must be one token (batch, heads, value_dim), got shape {tuple(x.shape)}")


def _run(state: DecodeState, token: dict, scale, rope=None, gate_raw=None, conv=None) -> torch.Tensor:
    """Launch the kernel for ``token`` (as :func:`.jit.decode_step.step` takes it) and advance ``state``."""
    if not state.pattern.has_recurrence:  # attention kinds read no B channel, whatever was passed
        token.update(qb=None, kb=None, g=None)
    if scale is None:
        scale = (token["qa"] if token.get("qa") is not None else token["qb"]).shape[-1] ** -0.5
    plan = state.begin_step(reads=False)  # the kernel evaluates the read rule
    write = ("row", plan.row) if plan.row is not None else ("slots", plan.stay)
    # the state's whole buffers (rows past those taken are empty: position -1, never read)
    cache = {name: state.rows.get(name) for name in ("keys_a", "values", "keys_b", "outputs")}
    y, _ = jit_module().decode_step.step(token, cache, state.positions, plan.r, state.read_rule(),
                                    state.layout == SLOTS, float(scale), get_block_config(), rope, gate_raw, write)
    state.advance(None, plan, conv)
    return y.to(token["x"].dtype)


def triton_decode_step(state: DecodeState, qa, ka, qb, kb, x, g, pattern=None, scale=None, d=None, conv=None
                       ) -> torch.Tensor:
    """Mix one token per sequence on Triton and advance ``state`` (like ``ops.recurrent_step``).

    Args:
        state: the layer's :class:`~hf_resolvent.ops.DecodeState` (advanced in place).
        qa, ka, qb, kb: (B, H, d) the token's queries and keys (qb, kb None for attention kinds; qa, ka None for
            the tied variant).
        x: (B, H, e) its value; g: (B, H) its gate (None for attention kinds).
        pattern: the state's own (it may be given); scale: default d ** -0.5.
        d: (B, H) for the tied variant: z = g B~ z[P^B] + (1 - g) x, y = z - d x; the state keeps z.
        conv: (B, C) the token's input row of the layer's short convolution, which the state keeps.

    Returns:
        y (B, H, e) in x's dtype (float32 accumulation), 0 for sequences still in their left padding.
    """
    check_tied(qa, ka, d)
    _check(state, x, d is not None, qa, ka, qb, kb)
    contiguous = lambda t: None if t is None else t.contiguous()
    token = {name: contiguous(t) for name, t in (("qa", qa), ("ka", ka), ("x", x), ("qb", qb), ("kb", kb), ("g", g),
                                                  ("d", d))}
    return _run(state, token, scale, conv=conv)


def triton_decode_projected(state: DecodeState, proj: torch.Tensor, parts: tuple[str, ...], rope=None, gate=None,
                            skip=None, scale=None, conv=None) -> torch.Tensor:
    """The mixer's decode step from its projection (``ops.decode_projected``), in one launch.

    Args:
        state: the layer's decode state (advanced in place).
        proj: (B, P, H, hd) the token's projected parts, named by ``parts`` (``qa``, ``ka``, ``x``, ``qb``, ``kb``).
        rope: None, or (cos, sin, channels): tables (B or 1, hd) that rotate the queries and keys of ``channels``
            ("a", "b" or "ab").
        gate: None, or (a, dt_bias, A_log): a (B, H) the gate's pre-activation, g = exp(-softplus(a + dt_bias)
            exp(A_log)) (``ops.gate_values``).
        skip: the tied variant's (B, H) pre-activation s of d = (1 - g) sigmoid(s), or None.
        scale, conv: as :func:`triton_decode_step`.

    Returns:
        y (B, H, hd) in proj's dtype.
    """
    if proj.dim() != 4 or proj.shape[1] != len(parts) or proj.stride(-1) != 1 or proj.stride(-2) != proj.shape[-1]:
        raise ValueError(f"proj must be (batch, {len(parts)} parts, heads, head_dim) with heads contiguous, got shape "
                         f"{tuple(proj.shape)} and strides {proj.stride()}")
    token = dict(zip(parts, proj.unbind(1)))
    _check(state, token["x"], skip is not None, proj)
    gate_raw = None
    if gate is not None:
        pre, dt_bias, a_log = gate
        token["g"], gate_raw = pre.contiguous(), (dt_bias, a_log)
    if skip is not None:
        token["d"] = skip.contiguous()
    return _run(state, token, scale, rope, gate_raw, conv)
