"""What the model computes around the mixer call on Triton: RoPE with the head split, and the gate's activation, each
one launch forward and one backward (two for the gate: its per-head gradients are sums over every position).

- :func:`triton_rope_heads`: same contract as ``ops.rope.rotated_heads`` (with ``rotate``, the parts RoPE leaves
  alone come out heads-major too, which is ``ops.rope.rotated_parts`` in one launch), the parts contiguous in the
  layout the mixer kernels read;
- :func:`triton_gate_values`: same contract as ``ops.mixer.gate_values``, g contiguous (B, H, n).

Shapes: B batch, n positions, P parts, H heads, hd head width.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ._loader import check_ready, jit_module
from .launching import SUPPORTED_DTYPES, get_block_config


def _check_dtype(what: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"the Triton {what} kernels take float32, bfloat16 or float16 tensors, got {t.dtype}; "
                             "use impl='torch' for float64")


def _tables(cos: torch.Tensor, sin: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as the kernels read them: one layout for both, a unit last stride (copies only where the given
    tables differ in layout or lack that stride)."""
    if cos.dim() != 3 or cos.shape[0] not in (1, batch):
        raise ValueError(f"the RoPE tables must be (batch or 1, n, head_dim), got {tuple(cos.shape)}")
    if cos.shape != sin.shape or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = (t.contiguous() for t in torch.broadcast_tensors(cos, sin))
    return cos, sin


def _rotation(rotate: tuple[bool, ...]) -> int:
    """The kernels' ROTATE: bit p set where part p is rotated."""
    return sum(1 << p for p, flag in enumerate(rotate) if flag)


class _RopeHeads(torch.autograd.Function):
    """(B, n, P, H, hd) run -> P rotated parts (B, H, n, hd), and back for the gradient (jit/rope.py)."""

    @staticmethod
    def forward(ctx, run, cos, sin, rotate: int):
        cfg = get_block_config()
        out = jit_module().rope.heads(run, None if cos is None else (cos, sin), rotate, cfg)
        ctx.set_materialize_grads(False)  # a part without a gradient is read as zeros by the kernel, not filled
        ctx.save_for_backward(cos, sin)
        ctx.meta = (rotate, tuple(run.shape), run.dtype)
        return out.unbind(0)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        cos, sin = ctx.saved_tensors
        rotate, shape, dtype = ctx.meta
        grads = [None if g is None else g.to(dtype).contiguous() for g in grads]
        present = [g for g in grads if g is not None]
        if not present:
            return None, None, None, None
        dsrc = jit_module().rope.heads_backward(grads, None if cos is None else (cos, sin), rotate, shape, dtype,
                                                present[0].device, get_block_config())
        return dsrc, None, None, None


def triton_rope_heads(run: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                      rotate: tuple[bool, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """The parts of a run heads-major, RoPE applied to those ``rotate`` names (``ops.rope.rotated_heads``).

    Args:
        run: (B, n, P, H, hd) P parts of H heads (a slice of the mixer's projection), float32, bfloat16 or float16.
        cos, sin: (B or 1, n, hd) RoPE tables (rotate-half; sin as the rotary embedding gives it, unsigned), without
            gradients; None when no part is rotated.
        rotate: P flags, True where the part is rotated (default: every part).

    Returns:
        P tensors (B, H, n, hd) contiguous in run's dtype, differentiable in ``run``: rotated in float32 and rounded
        once, as ``ops.rope.apply_rope``.
    """
    if run.dim() != 5:
        raise ValueError(f"run must be (batch, n, parts, heads, head_dim), got shape {tuple(run.shape)}")
    batch, n, parts, _, hd = run.shape
    rotate = (True,) * parts if rotate is None else tuple(bool(flag) for flag in rotate)
    if len(rotate) != parts:
        raise ValueError(f"rotate names {len(rotate)} parts, the run has {parts}")
    check_ready(run)
    _check_dtype("RoPE", run)
    if run.stride(-1) != 1:
        run = run.contiguous()
    if any(rotate):
        if cos is None or sin is None:
            raise ValueError("a rotated part needs the cos and sin tables")
        if cos.requires_grad or sin.requires_grad:
            raise ValueError("the Triton RoPE has no gradient for the tables; use impl='torch' to train them")
        if hd % 2:
            raise ValueError(f"RoPE rotates even head widths, got {hd}")
        cos, sin = _tables(cos, sin, batch)
        if cos.shape[1:] != (n, hd):
            raise ValueError(f"the RoPE tables must be (batch or 1, {n}, {hd}), got {tuple(cos.shape)}")
    else:
        cos = sin = None
    return _RopeHeads.apply(run, cos, sin, _rotation(rotate))


class _Gate(torch.autograd.Function):
    """pre (B, n, H) -> g (B, H, n), and the gradients of pre, dt_bias and a_log (jit/gate.py)."""

    @staticmethod
    def forward(ctx, pre, dt_bias, a_log, dtype):
        ctx.save_for_backward(pre, dt_bias, a_log)
        return jit_module().gate.forward(pre, dt_bias, a_log, dtype, get_block_config())

    @staticmethod
    @once_differentiable
    def backward(ctx, dg):
        pre, dt_bias, a_log = ctx.saved_tensors
        dpre, d_dt, d_a_log = jit_module().gate.backward(dg, pre, dt_bias, a_log, get_block_config())
        needs = ctx.needs_input_grad
        return dpre if needs[0] else None, d_dt if needs[1] else None, d_a_log if needs[2] else None, None


def triton_gate_values(pre: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """The gate g = exp(-softplus(pre + dt_bias) exp(a_log)) (``ops.mixer.gate_values``).

    Args:
        pre: (B, n, H) its pre-activation; dt_bias, a_log: (H,).
        dtype: g's dtype (float32, bfloat16 or float16).

    Returns:
        g (B, H, n) contiguous in ``dtype``, computed in float32 (softplus as torch's, linear above 20),
        differentiable in pre, dt_bias and a_log.
    """
    if pre.dim() != 3 or dt_bias.shape != (pre.shape[2],) or a_log.shape != (pre.shape[2],):
        raise ValueError(f"the gate takes pre (batch, n, heads) and dt_bias, a_log (heads,), got "
                         f"{tuple(pre.shape)}, {tuple(dt_bias.shape)}, {tuple(a_log.shape)}")
    check_ready(pre, dt_bias, a_log)
    _check_dtype("gate", pre, dt_bias, a_log, torch.empty((), dtype=dtype))
    return _Gate.apply(pre, dt_bias.contiguous(), a_log.contiguous(), dtype)
