"""Causal attention: the forward (online softmax), the backward as two passes (dK and dV per key block,
dQ per query block) or one pass with atomic dQ (``BlockConfig.attn_bwd``). The dense resolvent's direct channel
runs these kernels too.

Conventions: :mod:`.common`.
"""

import triton
import triton.language as tl

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
