"""The gate's activation: g (B, H, n) = exp(-softplus(pre + dt_bias) exp(a_log)) from its pre-activation pre
(B, n, H) as the layer's ``gate_proj`` lays it out, written heads-major as the mixer kernels read it, and its
gradients (pre's, and the per-head dt_bias's and a_log's, sums over the batch and the positions).

The PyTorch reference is ``ops.mixer.gate_values``; softplus is torch's (threshold 20: linear above it), all
arithmetic in float32. Conventions: :mod:`.common`.
"""

import triton
import triton.language as tl

from .. import launching
from .common import _sum

SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch.nn.functional.softplus's default: softplus(x) = x above it

# ------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _activation(PRE, DT, ALOG, b, rows, heads, n, H, s_b, s_n, s_h):
    """For a (rows, heads) tile of sequence b: the mask, x = pre + dt_bias, softplus(x), exp(a_log) and the gate,
    float32."""
    mask = (rows < n)[:, None] & (heads < H)[None, :]
    pre = tl.load(PRE + b * s_b + rows.to(tl.int64)[:, None] * s_n + heads[None, :] * s_h, mask=mask, other=0.0)
    x = pre.to(tl.float32) + tl.load(DT + heads, mask=heads < H, other=0.0).to(tl.float32)[None, :]
    decay = tl.exp(tl.load(ALOG + heads, mask=heads < H, other=0.0).to(tl.float32))[None, :]
    # log1p(exp(x)) as torch computes it: log(1 + y) loses y below float32's epsilon, where log1p(y) ~ y
    y = tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))
    log1p = tl.where(y < 1e-4, y * (1.0 - 0.5 * y), tl.log(1.0 + y))
    softplus = tl.where(x > SOFTPLUS_THRESHOLD, x, log1p)
    return mask, x, y, softplus, decay, tl.exp(-softplus * decay)


@triton.jit
def gate_fwd_kernel(PRE, DT, ALOG, G, n, H, s_b, s_n, s_h, BN: tl.constexpr, BH: tl.constexpr):
    """G (B, H, n) contiguous, in its dtype, from PRE (B, n, H) (strides s_b, s_n, s_h), DT and ALOG (H,).

    Grid (cdiv(n, BN), B): a program takes BN positions of one sequence, every head."""
    b = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    heads = tl.arange(0, BH)
    mask, _, _, _, _, g = _activation(PRE, DT, ALOG, b, rows, heads, n, H, s_b, s_n, s_h)
    tl.store(G + b * H * n + heads[None, :] * n + rows[:, None], g.to(G.dtype.element_ty), mask=mask)


@triton.jit
def gate_bwd_kernel(PRE, DT, ALOG, DG, DPRE, PARTIAL, n, H, s_b, s_n, s_h, g_b, g_h, g_n, R,
                    BN: tl.constexpr, BH: tl.constexpr):
    """From DG (B, H, n) (strides g_b, g_h, g_n), the gradient of ``gate_fwd_kernel``'s output: DPRE (B, n, H)
    contiguous in its dtype, and this program's sums over its positions of the gradients of dt_bias and of
    exp(a_log), float32, rows ``b * cdiv(n, BN) + pid`` of PARTIAL (2, R, H) (R rows each).

    With x = pre + dt_bias, s = softplus(x), A = exp(a_log), g = exp(-s A): dx = -dg g A sigmoid(x) (1 above the
    threshold, as torch's softplus backward) and dA = -dg g s. Grid (cdiv(n, BN), B), as the forward."""
    b = tl.program_id(1).to(tl.int64)
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    heads = tl.arange(0, BH)
    mask, x, y, softplus, decay, g = _activation(PRE, DT, ALOG, b, rows, heads, n, H, s_b, s_n, s_h)
    dg = tl.load(DG + b * g_b + heads[None, :] * g_h + rows.to(tl.int64)[:, None] * g_n, mask=mask, other=0.0)
    d_exponent = -(dg.to(tl.float32) * g)
    dx = d_exponent * decay * tl.where(x > SOFTPLUS_THRESHOLD, 1.0, y / (y + 1.0))
    dx = tl.where(mask, dx, 0.0)
    d_decay = tl.where(mask, d_exponent * softplus, 0.0)
    tl.store(DPRE + (b * n + rows.to(tl.int64)[:, None]) * H + heads[None, :], dx.to(DPRE.dtype.element_ty),
             mask=mask)
    row = b * ((n + BN - 1) // BN) + pid
    tl.store(PARTIAL + row * H + heads, _sum(dx, 0), mask=heads < H)
    tl.store(PARTIAL + (R + row) * H + heads, _sum(d_decay, 0), mask=heads < H)


@triton.jit
def gate_reduce_kernel(PARTIAL, ALOG, DDT, DALOG, R, H, BR: tl.constexpr, BH: tl.constexpr):
    """DDT and DALOG (H,), in their dtypes: the sums over the R rows of PARTIAL (2, R, H) float32, the second
    times exp(a_log) (the gradient of a_log from that of exp(a_log)). Grid (cdiv(H, BH),)."""
    heads = tl.program_id(0) * BH + tl.arange(0, BH)
    hmask = heads < H
    d_dt = tl.full([BR, BH], 0.0, tl.float32)
    d_decay = tl.full([BR, BH], 0.0, tl.float32)
    for r0 in range(0, R, BR):
        rows = r0 + tl.arange(0, BR)
        mask = (rows < R)[:, None] & hmask[None, :]
        offsets = rows.to(tl.int64)[:, None] * H + heads[None, :]
        d_dt += tl.load(PARTIAL + offsets, mask=mask, other=0.0)
        d_decay += tl.load(PARTIAL + R * H + offsets, mask=mask, other=0.0)
    decay = tl.exp(tl.load(ALOG + heads, mask=hmask, other=0.0).to(tl.float32))
    tl.store(DDT + heads, _sum(d_dt, 0).to(DDT.dtype.element_ty), mask=hmask)
    tl.store(DALOG + heads, (_sum(d_decay, 0) * decay).to(DALOG.dtype.element_ty), mask=hmask)


# ------------------------------------------------------------------------------------------------
# Launchers

ROWS = 64  # positions per program
REDUCE_ROWS = 32  # rows of partial sums per step of the reduction
REDUCE_HEADS = 16


def forward(pre, dt_bias, a_log, dtype, cfg):
    """g (B, H, n) contiguous in ``dtype`` from ``pre`` (B, n, H) and ``dt_bias``, ``a_log`` (H,) contiguous."""
    batch, n, heads = pre.shape
    g = launching.new_buffer((batch, heads, n), pre.device, dtype)
    gate_fwd_kernel[(launching.cdiv(n, ROWS), batch)](pre, dt_bias, a_log, g, n, heads, *pre.stride(), BN=ROWS,
                                                      BH=launching.tile_width(heads), num_warps=cfg.num_warps)
    return g


def backward(dg, pre, dt_bias, a_log, cfg):
    """(dpre, d_dt_bias, d_a_log) for the gradient ``dg`` (B, H, n) of :func:`forward`'s g, each in its input's
    dtype: two launches, the gradients and their per-program sums over the positions, then the sums' sum."""
    batch, n, heads = pre.shape
    blocks = batch * launching.cdiv(n, ROWS)
    dpre = launching.new_buffer(pre.shape, pre.device, pre.dtype)
    partial = launching.new_buffer((2, blocks, heads), pre.device)
    gate_bwd_kernel[(launching.cdiv(n, ROWS), batch)](pre, dt_bias, a_log, dg, dpre, partial, n, heads, *pre.stride(),
                                                      *dg.stride(), blocks, BN=ROWS, BH=launching.tile_width(heads),
                                                      num_warps=cfg.num_warps)
    d_dt = launching.new_buffer((heads,), pre.device, dt_bias.dtype)
    d_a_log = launching.new_buffer((heads,), pre.device, a_log.dtype)
    gate_reduce_kernel[(launching.cdiv(heads, REDUCE_HEADS),)](partial, a_log, d_dt, d_a_log, blocks, heads,
                                                                BR=REDUCE_ROWS, BH=REDUCE_HEADS, num_warps=1)
    return dpre, d_dt, d_a_log


# ------------------------------------------------------------------------------------------------
# Cost models (cost.launch_cost): memory-bound, a few transcendental functions per element


def _positions(launch) -> int:
    return launch.grid[0] * launch.grid[1] * launch.constexprs["BN"] * launch.args["H"]


def gate_fwd_cost(launch, cost, pattern, in_flight) -> int:
    elements = _positions(launch)
    cost.move(elements, launch.args["PRE"])
    cost.move(elements, launch.args["G"])
    cost.vector(elements, 8)
    return 0


def gate_bwd_cost(launch, cost, pattern, in_flight) -> int:
    a = launch.args
    elements = _positions(launch)
    cost.move(elements, a["PRE"])
    cost.move(elements, a["DG"])
    cost.move(elements, a["DPRE"])
    cost.move(2 * launch.grid[0] * launch.grid[1], a["PARTIAL"], a["H"])
    cost.vector(elements, 16)
    return 0


def gate_reduce_cost(launch, cost, pattern, in_flight) -> int:
    a = launch.args
    cost.move(2 * a["R"], a["PARTIAL"], a["H"])
    cost.vector(2 * a["R"] * a["H"], 1)
    return 0


COSTS = {"gate_fwd_kernel": gate_fwd_cost, "gate_bwd_kernel": gate_bwd_cost, "gate_reduce_kernel": gate_reduce_cost}
