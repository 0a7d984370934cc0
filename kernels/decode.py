"""Decode step on Triton: one token per sequence against a layer's cache (``ops.DecodeState``).

Mirrors ``ops.recurrent_step`` (and its tied variant): the kernel computes the token's output
from the rows held in the state (which rows are read is the state's ``read_rule``, evaluated in the
kernel from the held positions), then the state advances through the same ``DecodeState.advance`` as
the PyTorch form, so both paths keep identical caches.

Shapes: B batch, H heads, S rows held, d key width, e value width; one token is (B, H, d).
"""

from __future__ import annotations

import torch

from hf_resolvent.ops.common import check_tied
from hf_resolvent.ops.state import SLOTS, DecodeState

from ._loader import check_ready, jit_module
from .launching import SUPPORTED_DTYPES, get_block_config


def _step(state: DecodeState, qa, ka, qb, kb, x, g, d, scale, tied: bool, conv):
    pattern = state.pattern
    check_ready(qa, ka, qb, kb, x)
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the Triton decode kernel takes float32, bfloat16 or float16 inputs, got {x.dtype}")
    if tied and not pattern.has_recurrence:
        raise ValueError(f"the tied variant needs a recurrent pattern, got {pattern.name!r}")
    if x.dim() != 3:
        raise ValueError(f"x must be one token (batch, heads, value_dim), got shape {tuple(x.shape)}")
    batch, heads, e = x.shape
    has_a, has_b = not tied, pattern.has_recurrence
    plan = state.step_plan()
    r = plan.r
    ref = qb if tied else qa
    scale = ref.shape[-1] ** -0.5 if scale is None else float(scale)

    if not has_b:  # attention kinds read no B channel, whatever was passed
        qb = kb = g = None

    # the state's whole buffers (rows past those taken are empty: position -1, never read)
    cache = {name: state.rows.get(name) if token is not None else None
             for name, token in (("keys_a", qa), ("values", x if has_a else None), ("keys_b", qb),
                                 ("outputs", x if has_b else None))}
    contiguous = lambda t: None if t is None else t.contiguous()
    y, z = jit_module().decode.step(*(contiguous(t) for t in (qa, ka, x, qb, g, d)), cache, state.positions, r,
                                    state.read_rule(), state.layout == SLOTS, scale, get_block_config())
    y = y.to(x.dtype)
    if tied:
        new = {"keys_b": kb, "outputs": z.to(x.dtype)}
    else:
        new = {"keys_a": ka, "values": x}
        if has_b:
            new.update(keys_b=kb, outputs=z.to(x.dtype))
    state.advance(new, plan, conv)
    return y


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
    return _step(state, qa, ka, qb, kb, x, g, d, scale, tied=d is not None, conv=conv)
