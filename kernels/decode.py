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
from hf_resolvent.ops.state import DecodeState
from hf_resolvent.patterns import get_pattern

from ._loader import check_ready, jit_module
from .launching import SUPPORTED_DTYPES, get_block_config


def _step(state: DecodeState, qa, ka, qb, kb, x, g, d, pattern, scale, tied: bool):
    pattern = get_pattern(pattern)
    check_ready(qa, ka, qb, kb, x)
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the Triton decode kernel takes float32, bfloat16 or float16 inputs, got {x.dtype}")
    if tied and not pattern.has_recurrence:
        raise ValueError(f"the tied variant needs a recurrent pattern, got {pattern.name!r}")
    if x.dim() != 3:
        raise ValueError(f"x must be one token (batch, heads, value_dim), got shape {tuple(x.shape)}")
    batch, heads, e = x.shape
    has_a, has_b = not tied, pattern.has_recurrence
    r = state.next_position(batch, x.device)
    positions = state.row_positions(batch, x.device)
    S = positions.shape[1]
    ref = qb if tied else qa
    scale = ref.shape[-1] ** -0.5 if scale is None else float(scale)

    if not has_b:  # attention kinds read no B channel, whatever was passed
        qb = kb = g = None

    def rows_held(name, token):
        """The cache's rows of the tensor that stores ``token``'s kind, (B, H, S, w): none for a channel the variant
        lacks (``token`` None), an empty one while the cache holds no rows."""
        if token is None:
            return None
        t = getattr(state, name)
        return token.new_empty(batch, heads, 0, token.shape[-1]) if t is None or S == 0 else t.contiguous()

    cache = {"keys_a": rows_held("keys_a", qa), "values": rows_held("values", x if has_a else None),
             "keys_b": rows_held("keys_b", qb), "outputs": rows_held("outputs", x if has_b else None)}
    contiguous = lambda t: None if t is None else t.contiguous()
    y, z = jit_module().decode.step(*(contiguous(t) for t in (qa, ka, x, qb, g, d)), cache, positions, r,
                                    DecodeState.read_rule(pattern, r), scale, get_block_config())
    y = y.to(x.dtype)
    if tied:
        new = {"keys_b": kb, "outputs": z.to(x.dtype)}
    else:
        new = {"keys_a": ka, "values": x}
        if has_b:
            new.update(keys_b=kb, outputs=z.to(x.dtype))
    state.advance(pattern, new, r)
    return y


def triton_decode_step(state: DecodeState, qa, ka, qb, kb, x, g, pattern, scale=None, d=None) -> torch.Tensor:
    """Mix one token per sequence on Triton and advance ``state`` (like ``ops.recurrent_step``).

    Args:
        state: the layer's :class:`~hf_resolvent.ops.DecodeState` (advanced in place).
        qa, ka, qb, kb: (B, H, d) the token's queries and keys (qb, kb None for attention kinds; qa, ka None for
            the tied variant).
        x: (B, H, e) its value; g: (B, H) its gate (None for attention kinds).
        pattern: spec or Pattern; scale: default d ** -0.5.
        d: (B, H) for the tied variant: z = g B~ z[P^B] + (1 - g) x, y = z - d x; the state keeps z.

    Returns:
        y (B, H, e) in x's dtype (float32 accumulation), 0 for sequences still in their left padding.
    """
    check_tied(qa, ka, d)
    return _step(state, qa, ka, qb, kb, x, g, d, pattern, scale, tied=d is not None)
