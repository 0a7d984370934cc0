"""Recurrent form of the resolvent mixer (decode): one token at a time from a small state.

    y_t = (1 - g_t) softmax(qa_t . ka[P^A_t]) x[P^A_t] + g_t softmax(qb_t . kb[P^B_t]) y[P^B_t]

This module holds the maths of one step. What a layer keeps between steps, which held rows a token reads, and
how the state advances are the :class:`~.state.DecodeState`'s (docs/DESIGN.md section 4): the steps below ask
it for the token's position and read rule, attend, then hand it the token's rows.

Positions in a state are the pattern's own 0-indexed positions r = t - start, where ``start`` counts
a sequence's leading padding: a padded position is stored as -1 and never read.

Shapes: B batch, H heads, S rows held, d key width, e value width; one token is (B, H, d).
"""

from __future__ import annotations

import torch

from .common import check_inputs, check_tied, records_grad, to_compute_dtype
from .dispatch import cpu_ops, cpu_twin
from .patterns import get_pattern
from .state import DecodeState

__all__ = ["recurrent_mix", "recurrent_step"]


def _attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor, scale: float, own=None):
    """Softmax attention of one query q (B, H, d) over the rows of keys (B, H, S, d) that mask (B, S) lets through,
    and over the token's own row ``own`` = (key (B, H, d), value (B, H, e)) when given: (B, H, e), 0 where no row
    is. The own row joins the softmax as one more score, so the held rows are never copied to append it."""
    scores = torch.einsum("bhd,bhsd->bhs", q, keys) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    if own is None:
        probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
        return torch.einsum("bhs,bhse->bhe", probs, vals)
    key, value = own
    probs = torch.softmax(torch.cat([scores, (q * key).sum(-1, keepdim=True) * scale], dim=-1), dim=-1)
    return torch.einsum("bhs,bhse->bhe", probs[..., :-1], vals) + probs[..., -1:] * value


def _held(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Held rows t (B, H, S, .), or none (S = 0) where the state keeps none, shaped like the token's ``like``."""
    if t is None:
        return like.new_zeros(like.shape[0], like.shape[1], 0, like.shape[-1])
    return t


# The C++ step has no backward: it runs only where no gradient is recorded.
MIX_TWIN = cpu_twin("recurrent._mix", ("decode_step",), applies=lambda *given: not records_grad(given))


def _mix(rows: dict[str, torch.Tensor], read, r, scale, qa, ka, qb, kb, x, g, d):
    """The token's output y (B, H, e) and the row the state keeps as ``outputs`` (y before the padding mask; the tied
    variant's z, masked), from the held ``rows`` that ``read`` (B, S) lets through. Its twin on the CPU kernels
    (``backends/cpu/csrc/decode_cpu.cpp``, :data:`MIX_TWIN`) does this arithmetic in one call where it takes the
    call; the PyTorch code below is its reference."""
    held = [rows.get(name) if q is not None else None  # the rows of the channels this step uses
            for name, q in (("keys_a", qa), ("values", qa), ("keys_b", qb), ("outputs", qb))]
    given = [t for t in (qa, ka, qb, kb, x, g, d, *held) if t is not None]
    if MIX_TWIN.takes(*given):
        return cpu_ops().decode_step(qa, ka, qb, kb, x, g, d, *held, read, r, scale)
    keys_a, values, keys_b, outputs = held
    valid = (r >= 0).to(x.dtype)[:, None, None]
    if d is not None:  # tied: z = g B~ z[P^B] + (1 - g) x, y = z - d x
        g_eff = g * read.any(1, keepdim=True).to(g.dtype)
        recur = _attend(qb, _held(keys_b, kb), _held(outputs, x), read, scale)
        z = (g_eff[..., None] * recur + (1 - g_eff)[..., None] * x) * valid
        return (z - d[..., None] * x) * valid, z
    y = _attend(qa, _held(keys_a, ka), _held(values, x), read, scale, own=(ka, x))
    if qb is not None:
        g_eff = g * read.any(1, keepdim=True).to(g.dtype)
        recur = _attend(qb, _held(keys_b, kb), _held(outputs, x), read, scale)
        y = (1 - g_eff)[..., None] * y + g_eff[..., None] * recur
    return y * valid, y


def recurrent_step(state: DecodeState, qa, ka, qb, kb, x, g, pattern=None, scale=None, d=None, conv=None):
    """Mix one token (each input (B, H, d) or (B, H) for g and ``d``) and advance ``state``. Returns y (B, H, e).

    ``pattern`` is the state's own (it may be given, as to the other forms). ``d`` asks for the tied variant
    (``qa = ka = None``): z_t = g softmax(qb . kb[P^B]) z[P^B] + (1 - g) x_t, y_t = z_t - d_t x_t; the state keeps z.
    ``conv`` (B, C): the token's input row of the layer's short convolution, which the state keeps."""
    check_tied(qa, ka, d)
    q = qa if d is None else qb
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    plan = state.begin_step()
    rows, _ = state.view()
    r, read = plan.r, plan.read
    if d is not None:
        y, z = _mix(rows, read, r, scale, None, None, qb, kb, x, g, d)
        state.advance({"keys_b": kb, "outputs": z}, plan, conv)
        return y
    has_b = state.pattern.has_recurrence
    y, stored = _mix(rows, read, r, scale, qa, ka, qb if has_b else None, kb if has_b else None, x,
                     g if has_b else None, None)
    new = {"keys_a": ka, "values": x}
    if has_b:
        new.update(keys_b=kb, outputs=stored)
    state.advance(new, plan, conv)
    return y


def recurrent_mix(qa, ka, qb, kb, x, g, pattern, start=None, scale=None, state=None, d=None) -> torch.Tensor:
    """Run the recurrent form over a whole sequence (B, H, n, .) -> (B, H, n, e); tests and prefill. ``d``: the
    tied variant, as :func:`recurrent_step`."""
    pattern = get_pattern(pattern)
    check_inputs(qa, ka, qb, kb, x, g, pattern, start, tied_d=d)
    out_dtype = x.dtype
    qa, ka, qb, kb, x, g, d = to_compute_dtype(qa, ka, qb, kb, x, g, d)
    if state is None:
        names = ("keys_b", "outputs") if d is not None else ("keys_a", "values") + (
            ("keys_b", "outputs") if pattern.has_recurrence else ())
        widths = {name: (x if name in ("values", "outputs") else (qb if d is not None else qa)).shape[-1]
                  for name in names}
        state = DecodeState.empty(pattern, widths, x.shape[0], x.shape[1], dtype=x.dtype, device=x.device,
                                  start=start)
    ys = []
    for t in range(x.shape[2]):
        qa_t, ka_t, qb_t, kb_t, g_t, d_t = (None if a is None else a[:, :, t] for a in (qa, ka, qb, kb, g, d))
        ys.append(recurrent_step(state, qa_t, ka_t, qb_t, kb_t, x[:, :, t], g_t, scale=scale, d=d_t))
    return torch.stack(ys, dim=2).to(out_dtype)
