"""Causal attention: the forward (online softmax), the backward as two passes (dK and dV per key block,
dQ per query block) or one pass with atomic dQ (``BlockConfig.attn_bwd``). The dense resolvent's direct channel
runs these kernels too.

Conventions: :mod:`.common`.
"""

import torch
import triton
import triton.language as tl

from .. import launching
from ..cost import F32
from .common import (
    _causal,
    _dot,
    _exp2_where,
    _head_and_start,
    _load_row_scalars,
    _load_tile,
    _log_sum_exp2,
    _online_softmax,
    _row_block,
    _row_ptrs,
    _tile_mask,
    _tile_ptrs,
)

# ------------------------------------------------------------------------------------------------
# Dense kinds (attention, dense resolvent)


@triton.jit
def _causal_key_range(s, pid, BM: tl.constexpr, BN: tl.constexpr, n):
    """Start and end of the keys query block pid reads in steps of BN: from the BN-block holding the
    first non-padding position s to the block's last row (keys past it are all masked)."""
    return (s // BN) * BN, tl.minimum((pid + 1) * BM, n)


@triton.jit
def _load_key_block(K, V, bh, n, first, BN: tl.constexpr, cd, d, ce, e):
    """Keys first .. first + BN - 1: their positions, which are in range, and their key (BN, d) and
    value (BN, e) tiles."""
    keys = first + tl.arange(0, BN)
    kmask = keys < n
    k = _load_tile(K, bh, n, keys, kmask, cd, d)
    v = _load_tile(V, bh, n, keys, kmask, ce, e)
    return keys, kmask, k, v


@triton.jit
def _load_query_rows(Q, W, COEF, DELTA, LSE, bh, n, rows, rmask, cd, d, ce, e):
    """What a block of query rows brings to the backward of a softmax channel: q, W and COEF
    (dO = COEF W), DELTA = dO . O and the base-2 log-sum-exp."""
    q = _load_tile(Q, bh, n, rows, rmask, cd, d)
    w = _load_tile(W, bh, n, rows, rmask, ce, e)
    coef = _load_row_scalars(COEF, bh, n, rows, rmask)
    delta = _load_row_scalars(DELTA, bh, n, rows, rmask)
    lse = _load_row_scalars(LSE, bh, n, rows, rmask)
    return q, w, coef, delta, lse


@triton.jit
def attn_fwd_kernel(Q, K, V, OUT, LSE, START, n, H, d, e, qk_scale2,
                    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                    PREC: tl.constexpr):
    """Causal softmax attention (the direct channel of dense kinds), FlashAttention-style.

    Grid (cdiv(n, BM), BH). Writes O = softmax(q k^T) v (BH, n, e) float32, 0 on padded rows, and the
    base-2 log-sum-exp LSE (BH, n) (0 on rows with nothing to read).
    """
    pid, bh, s, rows = _row_block(START, H, BM)
    cd = tl.arange(0, BD)
    ce = tl.arange(0, BE)
    rmask = rows < n
    q = _load_tile(Q, bh, n, rows, rmask, cd, d)
    m = tl.full([BM], float("-inf"), tl.float32)
    l_sum = tl.full([BM], 0.0, tl.float32)
    acc = tl.full([BM, BE], 0.0, tl.float32)
    lo, hi = _causal_key_range(s, pid, BM, BN, n)
    for j0 in range(lo, hi, BN):
        keys, kmask, k, v = _load_key_block(K, V, bh, n, j0, BN, cd, d, ce, e)
        s2 = _dot(q, tl.trans(k), PREC) * qk_scale2
        ok = _causal(rows, keys, False) & (keys[None, :] >= s) & kmask[None, :]
        s2 = tl.where(ok, s2, float("-inf"))
        m, l_sum, alpha, p = _online_softmax(m, l_sum, s2)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC)
    has = l_sum > 0
    l_safe = tl.where(has, l_sum, 1.0)
    out = tl.where(has[:, None], acc / l_safe[:, None], 0.0)
    tl.store(_tile_ptrs(OUT, bh, n, rows, ce, e), out, mask=_tile_mask(rmask, ce, e))
    tl.store(_row_ptrs(LSE, bh, n, rows), _log_sum_exp2(m, l_sum), mask=rmask)


@triton.jit
def _key_block_program(K, V, START, H, n, d, e, BN: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                       VT: tl.constexpr):
    """For a grid (cdiv(n, BN), BH) of key blocks (the attention backward's key side): the block index, head and
    left padding, index ranges, the block's keys, which are in range and which are real, and its K and V tiles
    (V in the dtype VT of the products that take it)."""
    pid = tl.program_id(0)
    bh, s = _head_and_start(START, H, 1)
    cd = tl.arange(0, BD)
    ce = tl.arange(0, BE)
    keys, kmask, k, v = _load_key_block(K, V, bh, n, pid * BN, BN, cd, d, ce, e)
    return pid, bh, s, cd, ce, keys, kmask, kmask & (keys >= s), k, v.to(VT)


@triton.jit
def _store_key_grads(DK, DV, dk, dv, bh, n, keys, kmask, cd, d, ce, e, HAS_DV: tl.constexpr):
    """Stores a key block's dK (and dV with HAS_DV)."""
    tl.store(_tile_ptrs(DK, bh, n, keys, cd, d), dk, mask=_tile_mask(kmask, cd, d))
    if HAS_DV:
        tl.store(_tile_ptrs(DV, bh, n, keys, ce, e), dv, mask=_tile_mask(kmask, ce, e))


@triton.jit
def attn_bwd_dkdv_kernel(Q, K, V, W, COEF, DELTA, LSE, DK, DV, START, n, H, d, e, qk_scale2, scale,
                         BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                         STRICT: tl.constexpr, HAS_DV: tl.constexpr, PREC: tl.constexpr):
    """Key-side gradients of a causal softmax channel: dK (and dV) for one block of keys.

    The channel's output gradient is dO_i = COEF_i W_i (W = (I - B)^-T dY, COEF = 1 - geff for A,
    geff for B); DELTA_i = dO_i . O_i. STRICT: keys j < i (channel B) instead of j <= i.
    Grid (cdiv(n, BN), BH). dS_ij = P_ij (dO_i . V_j - DELTA_i); dK_j = scale sum_i dS_ij Q_i;
    dV_j = sum_i P_ij dO_i. Writes float32 (BH, n, d) / (BH, n, e).
    """
    DT = Q.dtype.element_ty  # q, k, dS operands: bf16 tensor cores for bf16 inputs
    VT = V.dtype.element_ty  # dO, V, P operands: float32 (tf32) when V is the solved Y
    pid, bh, s, cd, ce, keys, kmask, kvalid, k, v = _key_block_program(K, V, START, H, n, d, e, BN, BD, BE, VT)
    dk = tl.full([BN, BD], 0.0, tl.float32)
    dv = tl.full([BN, BE], 0.0, tl.float32)
    lo = ((pid * BN) // BM) * BM
    for i0 in range(lo, n, BM):
        rows = i0 + tl.arange(0, BM)
        rmask = rows < n
        q, w, coef, delta, lse = _load_query_rows(Q, W, COEF, DELTA, LSE, bh, n, rows, rmask, cd, d, ce, e)
        s2 = _dot(q, tl.trans(k), PREC) * qk_scale2
        ok = _causal(rows, keys, STRICT) & kvalid[None, :] & rmask[:, None]
        p = _exp2_where(ok, s2 - lse[:, None])
        do = (w * coef[:, None]).to(VT)
        if HAS_DV:
            dv += _dot(tl.trans(p).to(VT), do, PREC)
        dp = _dot(do, tl.trans(v), PREC)
        ds = p * (dp - delta[:, None])
        dk += _dot(tl.trans(ds).to(DT), q, PREC)
    _store_key_grads(DK, DV, dk * scale, dv, bh, n, keys, kmask, cd, d, ce, e, HAS_DV)


@triton.jit
def attn_bwd_dq_kernel(Q, K, V, W, COEF, DELTA, LSE, DQ, START, n, H, d, e, qk_scale2, scale,
                       BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                       STRICT: tl.constexpr, PREC: tl.constexpr):
    """Query-side gradient of a causal softmax channel: dQ_i = scale sum_j dS_ij K_j (see dkdv kernel).

    Grid (cdiv(n, BM), BH). Writes float32 (BH, n, d).
    """
    DT = Q.dtype.element_ty  # q, k, dS operands: bf16 tensor cores for bf16 inputs
    VT = V.dtype.element_ty  # dO, V, P operands: float32 (tf32) when V is the solved Y
    pid, bh, s, rows = _row_block(START, H, BM)
    cd = tl.arange(0, BD)
    ce = tl.arange(0, BE)
    rmask = rows < n
    q, w, coef, delta, lse = _load_query_rows(Q, W, COEF, DELTA, LSE, bh, n, rows, rmask, cd, d, ce, e)
    do = (w * coef[:, None]).to(VT)
    dq = tl.full([BM, BD], 0.0, tl.float32)
    lo, hi = _causal_key_range(s, pid, BM, BN, n)
    for j0 in range(lo, hi, BN):
        keys, kmask, k, v = _load_key_block(K, V, bh, n, j0, BN, cd, d, ce, e)
        v = v.to(VT)
        s2 = _dot(q, tl.trans(k), PREC) * qk_scale2
        ok = _causal(rows, keys, STRICT) & kmask[None, :] & (keys[None, :] >= s) & rmask[:, None]
        p = _exp2_where(ok, s2 - lse[:, None])
        dp = _dot(do, tl.trans(v), PREC)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(DT), k, PREC)
    tl.store(_tile_ptrs(DQ, bh, n, rows, cd, d), dq * scale, mask=_tile_mask(rmask, cd, d))


@triton.jit
def attn_bwd_atomic_kernel(Q, K, V, W, COEF, DELTA, LSE, DQ, DK, DV, START, n, H, d, e, qk_scale2, scale,
                           BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                           STRICT: tl.constexpr, HAS_DV: tl.constexpr, PREC: tl.constexpr):
    """Every gradient of a causal softmax channel in one kernel (the FlashAttention-2 backward).

    Same channel and arguments as the split pair (see attn_bwd_dkdv_kernel), with DQ float32 and zero
    on entry. Grid (cdiv(n, BN), BH): a program holds one block of keys and walks the query blocks that
    read it. dK and dV accumulate in registers and are stored once; each query block's share of dQ,
    scale sum_j dS_ij K_j over this program's keys, is added to DQ with relaxed atomic adds, since every
    key block up to a row contributes to that row. Scores are held transposed (keys by queries), so the
    key-side products take the resident K and V tiles as their left operand and only dQ turns dS around.
    """
    DT = Q.dtype.element_ty  # q, k, dS operands: bf16 tensor cores for bf16 inputs
    VT = V.dtype.element_ty  # dO, V, P operands: float32 (tf32) when V is the solved Y
    pid, bh, s, cd, ce, keys, kmask, kvalid, k, v = _key_block_program(K, V, START, H, n, d, e, BN, BD, BE, VT)
    dk = tl.full([BN, BD], 0.0, tl.float32)
    dv = tl.full([BN, BE], 0.0, tl.float32)
    # Queries from the block holding this block's first key on; a block of left padding is read by none.
    lo = ((pid * BN) // BM) * BM
    hi = tl.where(pid * BN + BN > s, n, lo)
    for i0 in range(lo, hi, BM):
        rows = i0 + tl.arange(0, BM)
        rmask = rows < n
        q, w, coef, delta, lse = _load_query_rows(Q, W, COEF, DELTA, LSE, bh, n, rows, rmask, cd, d, ce, e)
        s2t = _dot(k, tl.trans(q), PREC) * qk_scale2
        ok = tl.trans(_causal(rows, keys, STRICT)) & kvalid[:, None] & rmask[None, :]
        pt = _exp2_where(ok, s2t - lse[None, :])
        do = (w * coef[:, None]).to(VT)
        if HAS_DV:
            dv += _dot(pt.to(VT), do, PREC)
        dpt = _dot(v, tl.trans(do), PREC)
        dst = pt * (dpt - delta[None, :])
        dk += _dot(dst.to(DT), q, PREC)
        dq = _dot(tl.trans(dst.to(DT)), k, PREC) * scale
        tl.atomic_add(_tile_ptrs(DQ, bh, n, rows, cd, d), dq, mask=_tile_mask(rmask, cd, d), sem="relaxed")
    _store_key_grads(DK, DV, dk * scale, dv, bh, n, keys, kmask, cd, d, ce, e, HAS_DV)


# ------------------------------------------------------------------------------------------------
# Launchers (tensors flattened to (B * H, n, w) contiguous; ``launching.LaunchShapes`` gives the sizes)


def forward(q, k, v, start, sh, d, cfg):
    """Causal attention of one channel (width d): (out (BH, n, e) float32, lse (BH, n) base 2)."""
    out, lse = launching.new_buffer((sh.BH, sh.n, sh.e), v.device), launching.new_buffer((sh.BH, sh.n), v.device)
    attn_fwd_kernel[(launching.cdiv(sh.n, cfg.attn_m), sh.BH)](
        q, k, v, out, lse, start, sh.n, sh.H, d, sh.e, sh.qk_scale2, BM=cfg.attn_m, BN=cfg.attn_n,
        BD=launching.tile_width(d), BE=launching.tile_width(sh.e), PREC=sh.prec, num_warps=cfg.num_warps)
    return out, lse


def _grad_buffers(q, d: int, e: int, with_dv: bool, dq_from_zero: bool):
    """dq, dk (BH, n, d) and dv (BH, n, e), None without ``with_dv``: float32, written whole but for an atomic dq."""
    BH, n = q.shape[:2]
    dq = torch.zeros(BH, n, d, device=q.device) if dq_from_zero else launching.new_buffer((BH, n, d), q.device)
    dv = launching.new_buffer((BH, n, e), q.device) if with_dv else None
    return dq, launching.new_buffer((BH, n, d), q.device), dv


def backward_split(q, k, v, w, coef, delta, lse, start, sh, d, cfg, strict: bool, with_dv: bool):
    """The backward of one channel as two kernels: dK (and dV) per key block, then dQ per query block. ``w`` is the
    gradient reaching the channel's output, ``coef`` its weight per row, ``delta`` the rows' w . out; ``strict``
    leaves the diagonal out (channel B). Returns (dq, dk, dv) float32, dv None without ``with_dv``."""
    dq, dk, dv = _grad_buffers(q, d, sh.e, with_dv, dq_from_zero=False)
    tiles = dict(BD=launching.tile_width(d), BE=launching.tile_width(sh.e), STRICT=strict, PREC=sh.prec,
                 num_warps=cfg.num_warps)
    attn_bwd_dkdv_kernel[(launching.cdiv(sh.n, cfg.bwd_n), sh.BH)](
        q, k, v, w, coef, delta, lse, dk, dv, start, sh.n, sh.H, d, sh.e, sh.qk_scale2, sh.scale,
        BM=cfg.bwd_m, BN=cfg.bwd_n, HAS_DV=with_dv, **tiles)
    attn_bwd_dq_kernel[(launching.cdiv(sh.n, cfg.bwd_m), sh.BH)](
        q, k, v, w, coef, delta, lse, dq, start, sh.n, sh.H, d, sh.e, sh.qk_scale2, sh.scale,
        BM=cfg.bwd_m, BN=cfg.bwd_n, **tiles)
    return dq, dk, dv


def backward_atomic(q, k, v, w, coef, delta, lse, start, sh, d, cfg, strict: bool, with_dv: bool):
    """As :func:`backward_split`, in one kernel over key blocks; every key block before a query row adds its share
    of that row's dQ, so dQ starts at zero."""
    dq, dk, dv = _grad_buffers(q, d, sh.e, with_dv, dq_from_zero=True)
    attn_bwd_atomic_kernel[(launching.cdiv(sh.n, cfg.atomic_n), sh.BH)](
        q, k, v, w, coef, delta, lse, dq, dk, dv, start, sh.n, sh.H, d, sh.e, sh.qk_scale2, sh.scale,
        BM=cfg.atomic_m, BN=cfg.atomic_n, BD=launching.tile_width(d), BE=launching.tile_width(sh.e), STRICT=strict,
        HAS_DV=with_dv, PREC=sh.prec, num_warps=cfg.atomic_warps)
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------
# Cost model (``cost.launch_cost``): each takes a recorded launch and a ``cost.Cost``, returns its chain steps


def _key_steps_causal(n: int, rows: int, keys: int) -> int:
    """Key steps of keys per step summed over the query blocks of rows (keys 0 .. the block's last row)."""
    return sum(launching.cdiv(min((i + 1) * rows, n), keys) for i in range(launching.cdiv(n, rows)))


def _query_steps_from_key_block(n: int, rows: int, keys: int) -> int:
    """Query steps of rows per step summed over the key blocks of keys (query blocks from the key block's)."""
    return sum(launching.cdiv(n - ((j * keys) // rows) * rows, rows) for j in range(launching.cdiv(n, keys)))


def _key_block_traffic(cost, programs: int, steps: int, a: dict, c: dict):
    """Tile traffic of a backward over key blocks (the split dK/dV kernel, the atomic kernel): each program's K and
    V once, the query rows' Q, W and row scalars at every step, dK (and dV) stored once."""
    BM, BN, d, e = c["BM"], c["BN"], a["d"], a["e"]
    cost.move(programs * BN, a["K"], d)
    cost.move(programs * BN, a["V"], e)
    cost.move(steps * BM, a["Q"], d)
    cost.move(steps * BM, a["W"], e)
    cost.move(steps * BM, width=3, elem=F32)  # COEF, DELTA, LSE
    cost.move(programs * BN, width=d + (e if c["HAS_DV"] else 0), elem=F32)  # DK, DV


def _programs(launch) -> int:
    return launch.grid[0] * launch.grid[1]


def attn_fwd_cost(launch, cost, pattern, in_flight) -> int:
    a, c = launch.args, launch.constexprs
    BM, BN, Q, V, n = c["BM"], c["BN"], a["Q"], a["V"], a["n"]
    steps = _key_steps_causal(n, BM, BN) * Q.shape[0]
    cost.move(_programs(launch) * BM, Q, a["d"])
    cost.move(steps * BN, a["K"], a["d"])
    cost.move(steps * BN, V, a["e"])
    cost.move(_programs(launch) * BM, width=a["e"] + 1, elem=F32)  # OUT and LSE
    cost.dot(steps, BM, BN, c["BD"], Q.dtype, c["PREC"])
    cost.dot(steps, BM, c["BE"], BN, V.dtype, c["PREC"])
    return 0


def attn_bwd_dkdv_cost(launch, cost, pattern, in_flight) -> int:
    a, c = launch.args, launch.constexprs
    BM, BN, Q = c["BM"], c["BN"], a["Q"]
    steps = _query_steps_from_key_block(a["n"], BM, BN) * Q.shape[0]
    _key_block_traffic(cost, _programs(launch), steps, a, c)
    cost.dot(2 * steps, BM, BN, c["BD"], Q.dtype, c["PREC"])  # Q K^T, and dS^T Q
    # dO V^T, and P^T dO for dV, in V's dtype: x's for channel A; for B, Y (float32, at tf32) or its 16-bit copy
    cost.dot((2 if c["HAS_DV"] else 1) * steps, BM, BN, c["BE"], a["V"].dtype, c["PREC"])
    return 0


def attn_bwd_dq_cost(launch, cost, pattern, in_flight) -> int:
    a, c = launch.args, launch.constexprs
    BM, BN, Q, d, e = c["BM"], c["BN"], a["Q"], a["d"], a["e"]
    programs = _programs(launch)
    steps = _key_steps_causal(a["n"], BM, BN) * Q.shape[0]
    cost.move(programs * BM, Q, d)
    cost.move(programs * BM, a["W"], e)
    cost.move(programs * BM, width=3, elem=F32)
    cost.move(steps * BN, a["K"], d)
    cost.move(steps * BN, a["V"], e)
    cost.move(programs * BM, width=d, elem=F32)  # DQ
    cost.dot(2 * steps, BM, BN, c["BD"], Q.dtype, c["PREC"])  # Q K^T, and dS K
    cost.dot(steps, BM, BN, c["BE"], a["V"].dtype, c["PREC"])  # dO V^T in V's dtype
    return 0


def attn_bwd_atomic_cost(launch, cost, pattern, in_flight) -> int:
    # One program per key block walks the query blocks from its own: scores, dP, dK and dQ once per step.
    a, c = launch.args, launch.constexprs
    BM, BN, Q = c["BM"], c["BN"], a["Q"]
    steps = _query_steps_from_key_block(a["n"], BM, BN) * Q.shape[0]
    _key_block_traffic(cost, _programs(launch), steps, a, c)
    cost.move(steps * BM, width=a["d"], elem=F32)  # DQ atomics
    cost.dot(3 * steps, BN, BM, c["BD"], Q.dtype, c["PREC"])  # K Q^T, dS Q for dK, dS^T K for dQ
    # V dO^T, and P^T dO for dV, in V's dtype (channel B's: Y at tf32, or its 16-bit copy)
    cost.dot((2 if c["HAS_DV"] else 1) * steps, BN, BM, c["BE"], a["V"].dtype, c["PREC"])
    return 0


COSTS = {"attn_fwd_kernel": attn_fwd_cost, "attn_bwd_dkdv_kernel": attn_bwd_dkdv_cost,
         "attn_bwd_dq_kernel": attn_bwd_dq_cost, "attn_bwd_atomic_kernel": attn_bwd_atomic_cost}
