"""Triton path of ``resolvent_mix`` (and its tied variant): which ops' launchers a call runs, chosen once per call
from the plan and ``BlockConfig`` (``jit/``, one module per op), and the autograd Function around them.

Which kernels run (see kernels/README.md for the algorithms):

============================  ===============================================  ==========================
pattern                       forward                                          backward
============================  ===============================================  ==========================
attention                     attn_fwd (causal flash attention)                attn_bwd_dkdv, attn_bwd_dq
dense                         attn_fwd, then dense_solve_fwd (sequential)      dense_solve_bwd, then
                                                                               attn_bwd_* for A and for B
local_attention, banded,      sparse_direct, then sparse_solve_fwd             sparse_solve_bwd, then
diagonal, f-patterns (+ :ce)  (sequential; none for local attention)           sparse_grads
============================  ===============================================  ==========================

``BlockConfig`` names the variants (kernels/README.md): ``dense_solver="chunked"`` runs dense_chunk_fwd /
dense_chunk_bwd instead of the blocked dense solves, ``sparse_solver="chunked"`` runs chunk_prepare and
chunk_carry forward, chunk_carry (reverse) and chunk_rows_bwd backward instead of the sparse solves, and
``attn_bwd="atomic"`` runs attn_bwd_atomic instead of the attn_bwd_dkdv / attn_bwd_dq pair.

Left padding (``start``) is supported by every kernel. Inputs may be float32, bfloat16 or float16;
every accumulation is float32, outputs come back in x's dtype.

Shapes: B batch, H heads, n positions, d key width, e value width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from hf_resolvent.ops.common import check_inputs
from hf_resolvent.patterns import get_pattern

from ._loader import check_ready, jit_module
from .launching import (
    FP32_PREC,
    SUPPORTED_DTYPES,
    BlockConfig,
    LaunchShapes,
    Plan,
    fitted_block_config,
    has_recurrent_rows,
    make_plan,
    valid_rows,
)

# --------------------------------------------------------------------------------------------------
# The variant's launchers, chosen once from the plan and BlockConfig (all tensors flattened to (B * H, n, w))


@dataclass(frozen=True)
class Variant:
    """The launchers one call runs (the table above). The kind fixes the direct channel (``attention.forward`` for
    the dense kinds, ``sparse_solve.direct`` for the others); the solve's forward and backward are None without a
    B term; the scores' gradients come from ``grads`` (sparse kinds: both channels in one kernel) or from
    ``attention_backward``, once per channel (dense kinds)."""

    dense: bool
    solve_forward: Callable | None
    solve_backward: Callable | None
    grads: Callable | None  # sparse kinds: both channels' score gradients in one kernel
    attention_backward: Callable | None  # dense kinds: one channel's score gradients


def variant(jit, plan: Plan, cfg: BlockConfig) -> Variant:
    """The launchers of ``plan`` under ``cfg``, from ``jit``, the kernel package of the current Triton mode."""
    attention_backward = jit.attention.backward_atomic if cfg.attn_bwd == "atomic" else jit.attention.backward_split
    if plan.dense:
        solver = (jit.dense_solve.chunked_forward, jit.dense_solve.chunked_backward) if cfg.dense_solver == "chunked" \
            else (jit.dense_solve.blocked_forward, jit.dense_solve.blocked_backward)
        return Variant(True, *(solver if plan.has_b else (None, None)), None, attention_backward)
    chunked = plan.has_b and cfg.sparse_solver == "chunked"
    solver = (jit.sparse_chunked.forward, jit.sparse_chunked.backward) if chunked \
        else (jit.sparse_solve.blocked_forward, jit.sparse_solve.blocked_backward)
    grads = jit.sparse_chunked.grads if chunked else jit.sparse_solve.grads
    return Variant(False, *(solver if plan.has_b else (None, None)), grads, None)


def launch_forward(qa, ka, qb, kb, x, g, start, plan: Plan, sh: LaunchShapes, cfg: BlockConfig, tied: bool,
                   for_backward: bool = True):
    """Run the forward kernels. Returns (y, saved) with y (BH, n, e) float32; without ``for_backward`` the chunked
    solves keep no block inverses in ``saved`` (no backward will read them). ``qa``, ``ka`` are None when tied,
    ``qb``, ``kb`` and ``g`` without a B term."""
    jit = jit_module()
    run = variant(jit, plan, cfg)
    if run.dense:
        oa, lsea = (x, None) if tied else jit.attention.forward(qa, ka, x, start, sh, sh.da, cfg)
        lseb = None
    else:
        oa, lsea, lseb = jit.sparse_solve.direct(qa, ka, x, qb, kb, start, plan, sh, cfg)
    saved = dict(oa=oa, lsea=lsea, lseb=lseb)
    if run.solve_forward is None:
        return oa, dict(saved, y=oa)
    if run.dense:
        y, solved = run.solve_forward(qb, kb, oa, g, start, sh, cfg, keep_inverses=for_backward)
    else:
        y, solved = run.solve_forward(qb, kb, oa, g, lseb, start, plan, sh, cfg, keep_inverses=for_backward)
    return y, dict(saved, y=y, **solved)


def launch_backward(dy, qa, ka, qb, kb, x, g, start, saved, plan: Plan, sh: LaunchShapes, cfg: BlockConfig, tied: bool):
    """Gradients (dqa, dka, dqb, dkb, dx, dg) as float32 flat tensors (None where not applicable)."""
    jit = jit_module()
    run = variant(jit, plan, cfg)
    heads = sh.BH // start.shape[0]
    if run.solve_backward is None:
        w = dy.float() * valid_rows(start, heads, sh.n)[..., None]
        da, db, dg = (w * saved["oa"]).sum(-1), None, None
        geff = torch.zeros(sh.BH, sh.n, device=dy.device)
    else:
        if run.dense:
            w, da, db, dg = run.solve_backward(dy, qb, kb, g, start, saved, sh, cfg)
        else:
            w, da, db, dg = run.solve_backward(dy, qb, kb, g, start, saved, plan, sh, cfg)
        geff = g.float() * has_recurrent_rows(plan, start, heads, sh.n)
    dqa = dka = dqb = dkb = dx = None
    if run.dense:
        if not tied:
            dqa, dka, dx = run.attention_backward(qa, ka, x, w, 1.0 - geff, da, saved["lsea"], start, sh, sh.da, cfg,
                                                  strict=False, with_dv=True)
        if plan.has_b:
            # Channel B's values are the solved rows: their copy in the input dtype where the forward kept one.
            v = saved["y_read"] if saved["y_read"] is not None else saved["y"]
            dqb, dkb, _ = run.attention_backward(qb, kb, v, w, geff, db, saved["lseb"], start, sh, sh.db, cfg,
                                                 strict=True, with_dv=False)
    else:
        dqa, dka, dx, dqb, dkb = run.grads(qa, ka, x, qb, kb, w, g, da, db, start, saved, plan, sh, cfg)
    if tied:
        dx = (1.0 - geff)[..., None] * w
    return dqa, dka, dqb, dkb, dx, dg


# --------------------------------------------------------------------------------------------------
# Autograd


def _flat(t: torch.Tensor | None, dtype=None) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])
    if dtype is not None:
        t = t.to(dtype)
    return t.contiguous()


class _MixFunction(torch.autograd.Function):
    """y = (I - B)^-1 A x on the Triton kernels; tied=True gives z = (I - B)^-1 (1 - g) x (float32)."""

    @staticmethod
    def forward(ctx, qa, ka, qb, kb, x, g, start, plan: Plan, scale: float, tied: bool):
        batch, heads, n, e = x.shape
        dtype = x.dtype
        sh = LaunchShapes(BH=batch * heads, H=heads, n=n, da=0 if qa is None else qa.shape[-1],
                          db=0 if qb is None else qb.shape[-1], e=e, scale=scale,
                          prec=FP32_PREC if dtype == torch.float32 else "tf32")
        cfg = fitted_block_config(dtype, max(sh.da, sh.db, e))
        flat = [_flat(t, dtype) for t in (qa, ka, qb, kb, x)] + [_flat(g)]
        start = start.to(device=x.device, dtype=torch.int32).contiguous()
        # A backward may follow only where an input needs its gradient (under torch.no_grad an input that requires
        # grad still counts: the inverses are kept for nothing then, never missed).
        y, saved = launch_forward(*flat, start, plan, sh, cfg, tied, for_backward=any(ctx.needs_input_grad[:6]))
        keys = tuple(saved)
        ctx.save_for_backward(*flat, start, *saved.values())
        ctx.meta = (plan, sh, cfg, tied, keys, [None if t is None else t.dtype for t in (qa, ka, qb, kb, x, g)])
        out = y.view(batch, heads, n, e)
        return out if tied else out.to(dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        plan, sh, cfg, tied, keys, dtypes = ctx.meta
        qa, ka, qb, kb, x, g, start, *rest = ctx.saved_tensors
        saved = dict(zip(keys, rest))
        batch, heads, n, e = dy.shape
        grads = launch_backward(_flat(dy), qa, ka, qb, kb, x, g, start, saved, plan, sh, cfg, tied)
        out = []
        for grad, dt, like in zip(grads, dtypes, (qa, ka, qb, kb, x, g)):
            if grad is None or dt is None:
                out.append(None)
            else:
                out.append(grad.view(batch, heads, *like.shape[1:]).to(dt))
        return (*out, None, None, None, None)


def _prepare(x, start, pattern, *tensors):
    check_ready(*tensors, x)
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"the Triton kernels take float32, bfloat16 or float16 inputs, got {x.dtype}; "
            "use impl='torch' for float64")
    batch, _, n, _ = x.shape
    if start is None:
        start = torch.zeros(batch, dtype=torch.int32, device=x.device)
    return make_plan(pattern, n), start


def triton_mix(qa, ka, qb, kb, x, g, pattern, start=None, scale=None, d=None) -> torch.Tensor:
    """Y = (I - B)^-1 (1 - g) A~ X on the Triton kernels; same contract as ``ops.parallel_mix``.

    Args:
        qa, ka: (B, H, n, d) direct-channel queries/keys (None for the tied variant); qb, kb: (B, H, n, d')
            recurrent channel (None for attention kinds); x: (B, H, n, e) values; g: (B, H, n) gate (None for
            attention kinds); pattern: spec or Pattern; start: optional (B,) left padding; scale: default
            d ** -0.5 (d of qa, for both channels, as in ``ops.reference``; of qb for the tied variant);
            d: (B, H, n) for the tied variant, z = (I - B)^-1 (1 - g) x, y = z - d x.

    Returns:
        (B, H, n, e) in x's dtype. Differentiable in qa, ka, qb, kb, x, g and d.
    """
    pattern = get_pattern(pattern)
    check_inputs(qa, ka, qb, kb, x, g, pattern, start, tied_d=d)
    if d is not None:
        plan, start = _prepare(x, start, pattern, qb, kb, g, d)
        scale = qb.shape[-1] ** -0.5 if scale is None else float(scale)
        z = _MixFunction.apply(None, None, qb, kb, x, g, start, plan, scale, True)
        valid = valid_rows(start, 1, x.shape[2]).view(x.shape[0], 1, x.shape[2], 1)
        y = (z - d.float()[..., None] * x.float()) * valid
        return y.to(x.dtype)
    plan, start = _prepare(x, start, pattern, qa, ka, qb, kb, g)
    scale = qa.shape[-1] ** -0.5 if scale is None else float(scale)
    if not plan.has_b:
        qb = kb = g = None
    return _MixFunction.apply(qa, ka, qb, kb, x, g, start, plan, scale, False)
