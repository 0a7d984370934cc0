"""Triton kernels of the resolvent mixer (the ``@triton.jit`` functions only; see kernels/README.md).

This file is not imported as a normal module: :func:`hf_resolvent.backends.triton._loader.jit_module` loads it
once per Triton mode (compiled for the GPU, or through the interpreter when ``TRITON_INTERPRET=1``),
because ``triton.jit`` picks the mode when a function is decorated.

Conventions shared by every kernel
----------------------------------
- Per (batch, head) tensors are contiguous (BH, n, w) with w the real width (d keys, e values): row t
  of program bh starts at ``bh * n * w + t * w``. Row scalars (gate, log-sum-exps) are (BH, n).
- ``START`` (B,) int32 is the left padding of each sequence: pattern row of position t is ``rel = t - s``;
  positions t < s are never read and their outputs are 0.
- Scores are kept in base 2: ``s2 = q . k * scale * log2(e)``; log-sum-exps are base 2 as well
  (``p = exp2(s2 - lse2)``). Gradients of scores are natural (dS = P (dP - D)), so dq, dk get ``scale``.
- Every accumulation is float32; q . k products run in the input dtype (bf16 on tensor cores), other
  products take float32 operands with input precision ``PREC`` ("tf32x3", float32-accurate, for float32
  inputs; "tf32" for 16-bit inputs). The in-block solves use ``SOLVE_PREC`` ("tf32x3"). "ieee" works
  too but lowers to FMA loops that spill registers at 64-row blocks.
- A = (1 - geff) softmax over P^A, B = geff softmax over P^B, geff = g where P^B of the row is non-empty.
  OA is the direct channel's normalised output softmax(P^A) X, R the recurrent read softmax(P^B) Y:
  Y = (1 - geff) OA + geff R.
- Sparse patterns are described by a small table of offsets f(k) (OFFS, NSLOT entries) and, for
  cache-efficient patterns (CE), periods a_k (STEPS); slot k of pattern row rel reads
  rel - f(k) (translation-invariant) or a_k * ceil((rel + 1 - f(k)) / a_k) - 1 (cache-efficient,
  duplicates of slot k - 1 dropped), valid when f(k) <= rel.
"""

import triton
import triton.language as tl

# Triton's own tl.sum / tl.max / tl.zeros / tl.cdiv are @triton.jit functions decorated when triton is
# first imported: if that happened before TRITON_INTERPRET=1 was set (transformers imports triton), the
# interpreter cannot call them. The kernels therefore use only builtins and the helpers below, which
# reduce with Triton's standard combine functions (the interpreter runs those with numpy).
_SUM_COMBINE = tl.standard._sum_combine
_MAX_COMBINE = tl.standard._elementwise_max


@triton.jit
def _sum(x, axis: tl.constexpr):
    """Sum of a float32 tensor along ``axis`` (tl.sum without the dtype promotion)."""
    return tl.reduce(x, axis, _SUM_COMBINE)


@triton.jit
def _max(x, axis: tl.constexpr):
    """Maximum along ``axis`` (tl.max)."""
    return tl.reduce(x, axis, _MAX_COMBINE)


# Triton's interpreter multiplies bfloat16 tiles as raw 16-bit integers; there, _dot upcasts the
# operands to float32 first, which gives the same numbers as a bf16 tensor-core product with float32
# accumulation (products of bf16 values are exact in float32). This file is loaded once per mode.
_UPCAST_DOTS = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """tl.dot(a, b) with float32 accumulation; PREC is the input precision of float32 operands."""
    if _UPCAST_DOTS:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _unit_lower_solve(L, rhs, LOG2_BLOCK: tl.constexpr, TRANS: tl.constexpr, SOLVE_PREC: tl.constexpr):
    """(I - L)^-1 rhs, or (I - L)^-T rhs with TRANS, for a strictly lower (BLOCK, BLOCK) float32 tile L.

    L is nilpotent (L^BLOCK = 0), so (I - L)^-1 = (I + L)(I + L^2)(I + L^4)...(I + L^(BLOCK/2)), the
    factors commuting: y <- y + P y, P <- P P, log2(BLOCK) times (with P = L^T for the transpose).
    L's entries are >= 0 with row sums <= 1, so every product is non-negative and bounded (no
    cancellation). log2(BLOCK) products (BLOCK, BLOCK) x (BLOCK, e) and log2(BLOCK) - 1 squarings,
    all on tensor cores (SOLVE_PREC "tf32x3" keeps float32 accuracy).
    """
    if TRANS:
        P = tl.trans(L)
    else:
        P = L
    y = rhs
    for j in tl.static_range(LOG2_BLOCK):
        y = y + _dot(P, y, SOLVE_PREC)
        if j < LOG2_BLOCK - 1:
            P = _dot(P, P, SOLVE_PREC)
    return y


@triton.jit
def _unit_lower_inverse(L, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, TRANS: tl.constexpr,
                        SOLVE_PREC: tl.constexpr):
    """T = (I - L)^-1, or (I - L)^-T with TRANS, for a strictly lower (BLOCK, BLOCK) float32 tile L: the factors of
    ``_unit_lower_solve`` multiplied out, T <- T + T P with P <- P P, starting from T = I + P. 2 (log2(BLOCK) - 1)
    products, against 2 log2(BLOCK) - 1 for one right-hand side by ``_unit_lower_solve``: kernels that apply T to
    two or more right-hand sides form it (every product non-negative, as there)."""
    if TRANS:
        P = tl.trans(L)
    else:
        P = L
    ar = tl.arange(0, BLOCK)
    T = tl.where(ar[:, None] == ar[None, :], 1.0, 0.0) + P
    for _ in tl.static_range(1, LOG2_BLOCK):
        P = _dot(P, P, SOLVE_PREC)
        T = T + _dot(T, P, SOLVE_PREC)
    return T


# ------------------------------------------------------------------------------------------------
# Addressing: which rows a program owns, tile and row-scalar loads


@triton.jit
def _head_and_start(START, H, AXIS: tl.constexpr):
    """The (batch, head) index bh of this program (grid axis AXIS) and the left padding s of its sequence.

    bh is int64 because the offsets ``bh * n * w`` can exceed int32 on large inputs.
    """
    bh = tl.program_id(AXIS).to(tl.int64)
    return bh, tl.load(START + bh // H)


@triton.jit
def _row_block(START, H, BLOCK: tl.constexpr):
    """For a grid (cdiv(n, BLOCK), BH): this program's block index pid, its head bh, the left padding s
    and the BLOCK positions of the block."""
    pid = tl.program_id(0)
    bh, s = _head_and_start(START, H, 1)
    return pid, bh, s, pid * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _pattern_rows(rows, n, s):
    """For positions ``rows``: in range (rmask), pattern position ``rel = rows - s``, and valid
    (in range and not left padding)."""
    rmask = rows < n
    rel = rows - s
    return rmask, rel, rmask & (rel >= 0)


@triton.jit
def _tile_ptrs(PTR, bh, n, rows, cols, width):
    """Pointers to elements (rows, cols) of head bh of a contiguous (BH, n, width) tensor.

    The int64 head offset goes into the base pointer first, so the per-element offsets stay int32.
    """
    return PTR + bh * n * width + rows[:, None] * width + cols[None, :]


@triton.jit
def _tile_mask(row_ok, cols, width):
    """Mask of a (rows, cols) tile: rows where ``row_ok`` (None: every row is in range), columns < width."""
    if row_ok is None:
        mask = cols[None, :] < width
    else:
        mask = row_ok[:, None] & (cols[None, :] < width)
    return mask


@triton.jit
def _load_tile(PTR, bh, n, rows, row_ok, cols, width):
    """Tile (rows, cols) of head bh of a (BH, n, width) tensor, 0 outside ``_tile_mask``."""
    return tl.load(_tile_ptrs(PTR, bh, n, rows, cols, width), mask=_tile_mask(row_ok, cols, width), other=0.0)


@triton.jit
def _row_ptrs(PTR, bh, n, rows):
    """Pointers to entries ``rows`` of head bh of a contiguous (BH, n) tensor of row scalars."""
    return PTR + bh * n + rows


@triton.jit
def _load_row_scalars(PTR, bh, n, rows, rmask):
    """Entries ``rows`` of head bh of a (BH, n) tensor of row scalars, 0 outside rmask."""
    return tl.load(_row_ptrs(PTR, bh, n, rows), mask=rmask, other=0.0)


@triton.jit
def _gate(G, bh, n, rows, rmask, hasb):
    """geff of the rows: the gate g (float32) where the row has a recurrent set (hasb), 0 elsewhere."""
    return tl.where(hasb, _load_row_scalars(G, bh, n, rows, rmask).to(tl.float32), 0.0)


# ------------------------------------------------------------------------------------------------
# Softmax pieces


@triton.jit
def _online_softmax(m, l_sum, s2):
    """One step of a base-2 online softmax over the columns of the scores s2 (BM, BN).

    Returns the new running max and sum, ``alpha`` that rescales what was accumulated under the old
    max, and the unnormalised probabilities p. A row whose scores are all -inf so far keeps p = 0
    (its max is taken as 0 there, so no -inf - -inf = NaN).
    """
    m_new = tl.maximum(m, _max(s2, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s2 - m_use[:, None])
    return m_new, l_sum * alpha + _sum(p, 1), alpha, p


@triton.jit
def _log_sum_exp2(m, l_sum):
    """Base-2 log-sum-exp of rows from their running max and sum; 0 on rows with nothing to read."""
    has = l_sum > 0
    return tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), 0.0)


@triton.jit
def _exp2_where(ok, x):
    """exp2(x) where ok and exactly 0 elsewhere, whatever x holds there (masked scores, unread lse)."""
    return tl.exp2(tl.where(ok, x, float("-inf")))


@triton.jit
def _causal(rows, keys, STRICT: tl.constexpr):
    """(rows, keys) mask of the keys a row reads: keys j < i with STRICT (channel B), j <= i otherwise."""
    if STRICT:
        causal = keys[None, :] < rows[:, None]
    else:
        causal = keys[None, :] <= rows[:, None]
    return causal


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


# The solves (dense and sparse): scheduling, and how a block ends.
#
# The dense solves and the sparse backward solve run one program per row block (the sparse forward
# keeps one per head: see its docstring). Block c needs the solved rows of earlier blocks (of later
# ones, going backward), so these programs cannot just run side by side. Each takes a ticket (an
# atomic counter) when it starts; tickets map to blocks in solve order, every head's first block
# first. A program waits only on smaller tickets, whose programs have started, so the GPU always makes
# progress, which the order of the grid alone would not promise. Blocks are published in solve order,
# so PROGRESS[bh], the number of blocks of head bh published so far, says which are solved: the block
# at solve position o is solved when PROGRESS[bh] > o. What a block can do before its inputs are
# solved runs in parallel with the blocks before it.


@triton.jit
def _claim_block(PROGRESS, START, H, nblk, REVERSE: tl.constexpr):
    """For a grid (nblk * BH,): this program's block index, head bh, left padding s and solve position
    (the block index, counted from the last block with REVERSE), from its ticket. PROGRESS (BH + 1,)
    int32 is zero on entry; its last entry is the ticket counter."""
    BH = tl.num_programs(0) // nblk
    ticket = tl.atomic_add(PROGRESS + BH, 1, sem="relaxed")
    order = ticket // BH
    bh = (ticket % BH).to(tl.int64)
    if REVERSE:
        blk = nblk - 1 - order
    else:
        blk = order
    return blk, bh, tl.load(START + bh // H), order


@triton.jit
def _solved_count(PROGRESS, bh):
    """Blocks of head bh published so far (acquire: their stores are visible to this program after it)."""
    return tl.atomic_add(PROGRESS + bh, 0, sem="acquire")


@triton.jit
def _wait_solved(PROGRESS, bh, order, known):
    """Waits until the block at solve position ``order`` of head bh is published (no wait for order < 0);
    ``known`` is the count last read. Returns the count."""
    while known <= order:
        known = _solved_count(PROGRESS, bh)
    return known


@triton.jit
def _publish_solved(PROGRESS, bh, order, known):
    """Publishes this block (solve position ``order``) once every thread's stores are done and the block
    before it is published (PROGRESS stays a count of a prefix)."""
    _wait_solved(PROGRESS, bh, order - 1, known)
    tl.debug_barrier()
    tl.atomic_xchg(PROGRESS + bh, order + 1, sem="release")


@triton.jit
def _load_solved_tile(PTR, bh, n, rows, row_ok, cols, width):
    """``_load_tile`` of rows another program wrote and published: read from L2 (``.cg``), since this
    SM's L1 is not kept coherent with other SMs' stores."""
    return tl.load(_tile_ptrs(PTR, bh, n, rows, cols, width), mask=_tile_mask(row_ok, cols, width), other=0.0,
                   cache_modifier=".cg")



@triton.jit
def _as_read(y, YREAD, COPY: tl.constexpr):
    """Solved rows y as the products that read them with probabilities see them: rounded to the dtype of their
    copy YREAD under COPY (``solved_copy``), else y itself. One return: Triton 3.6 refuses returns of two dtypes
    even where a constexpr decides between them."""
    if COPY:
        y = y.to(YREAD.dtype.element_ty)
    return y


@triton.jit
def _solve_forward_block(OA, Y, YREAD, R, bh, n, rows, rmask, valid, ce, e, geff, bt, earlier,
                         LOG2_BLOCK: tl.constexpr, COPY: tl.constexpr, PREC: tl.constexpr,
                         SOLVE_PREC: tl.constexpr):
    """Solves one block of the forward recurrence and writes its rows of Y and R.

    (I - geff Bt) Y_c = (1 - geff) OA_c + geff earlier, with Bt the block's strictly lower in-block
    probabilities and ``earlier`` what its rows read from earlier blocks; R_c = earlier + Bt Y_c, its in-block term
    at ``earlier``'s precision PREC. Under COPY, ``earlier`` read the copy of the earlier rows, and R's in-block
    term reads Y_c as rounded to it: R is then the read of the rows that channel B's attention backward sees
    (V = the copy), and its row term geff W.R cancels that backward's dP exactly.
    """
    oa = _load_tile(OA, bh, n, rows, rmask, ce, e).to(tl.float32)
    rhs = (1.0 - geff)[:, None] * oa + geff[:, None] * earlier
    y = _unit_lower_solve(geff[:, None] * bt, rhs, LOG2_BLOCK, False, SOLVE_PREC)
    y = tl.where(valid[:, None], y, 0.0)
    y_read = _as_read(y, YREAD, COPY)
    r_read = earlier + _dot(bt.to(y_read.dtype), y_read, PREC)
    tl.store(_tile_ptrs(Y, bh, n, rows, ce, e), y, mask=_tile_mask(rmask, ce, e))
    tl.store(_tile_ptrs(R, bh, n, rows, ce, e), r_read, mask=_tile_mask(rmask, ce, e))
    return y


@triton.jit
def _store_w_and_row_grads(W_TILE, OA_TILE, R_TILE, tile_mask, DA, DB, DG, bh, n, rows, rmask, w, geff, hasb):
    """End of a block of a backward solve: writes W of its rows and the row scalars of the
    attention-style gradients, DA = (1 - geff) W.OA, DB = geff W.R and DG = dL/dg = W.(R - OA) on
    rows with a recurrent set (0 elsewhere). W_TILE, OA_TILE, R_TILE point at the block's (rows, e)
    tiles of W, OA and R (each kernel addresses them its own way)."""
    tl.store(W_TILE, w, mask=tile_mask)
    oa = tl.load(OA_TILE, mask=tile_mask, other=0.0).to(tl.float32)
    rr = tl.load(R_TILE, mask=tile_mask, other=0.0)
    w_oa = _sum(w * oa, 1)
    w_rr = _sum(w * rr, 1)
    tl.store(_row_ptrs(DA, bh, n, rows), (1.0 - geff) * w_oa, mask=rmask)
    tl.store(_row_ptrs(DB, bh, n, rows), geff * w_rr, mask=rmask)
    tl.store(_row_ptrs(DG, bh, n, rows), tl.where(hasb, w_rr - w_oa, 0.0), mask=rmask)


@triton.jit
def _claimed_block(START, PROGRESS, n, H, BLOCK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                   REVERSE: tl.constexpr):
    """Start of a ticket-ordered solve program (grid (cdiv(n, BLOCK) * BH,)): the blocks per head, its ticket
    (block, head, left padding, solve position; ``_claim_block``), index ranges, the block's first position, its
    positions and their masks (``_pattern_rows``)."""
    nblk = (n + BLOCK - 1) // BLOCK
    blk, bh, s, order = _claim_block(PROGRESS, START, H, nblk, REVERSE)
    ar = tl.arange(0, BLOCK)
    c0 = blk * BLOCK
    rows = c0 + ar
    rmask, rel, valid = _pattern_rows(rows, n, s)
    return nblk, blk, bh, s, order, ar, tl.arange(0, BD), tl.arange(0, BE), c0, rows, rmask, rel, valid


@triton.jit
def _dense_fwd_block(QB, G, START, PROGRESS, n, H, d, BLOCK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr):
    """Start of a dense forward solve program (``_claimed_block``, first block first): also the first key block lo
    it reads and its rows' channel-B queries and geff."""
    _, blk, bh, s, order, ar, cd, ce, c0, rows, rmask, rel, valid = _claimed_block(START, PROGRESS, n, H, BLOCK, BD,
                                                                                    BE, False)
    q = _load_tile(QB, bh, n, rows, rmask, cd, d)
    geff = _gate(G, bh, n, rows, rmask, rmask & (rel >= 1))
    return blk, bh, s, order, ar, cd, ce, (s // BLOCK) * BLOCK, c0, rows, rmask, valid, q, geff


@triton.jit
def _dense_bwd_block(KB, DY, START, PROGRESS, n, H, d, e, BLOCK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr):
    """Start of a dense backward solve program (``_claimed_block``, last block first): its columns are the block's
    positions; also their keys, and dY of the block as the start of the right-hand side."""
    nblk, blk, bh, s, order, ar, cd, ce, c0, cols, cmask, rel, cvalid = _claimed_block(START, PROGRESS, n, H, BLOCK,
                                                                                        BD, BE, True)
    kc = _load_tile(KB, bh, n, cols, cmask, cd, d)
    rhs = _load_tile(DY, bh, n, cols, cvalid, ce, e).to(tl.float32)
    return nblk, blk, bh, s, order, ar, cd, ce, c0, cols, cmask, cvalid, cmask & (rel >= 1), kc, rhs


@triton.jit
def _dense_fwd_tile(QB_ROWS, KB, Y, bh, n, s, j0, ar, cd, d, ce, e, m, l_sum, acc, qk_scale2, PREC: tl.constexpr):
    """One earlier key block j0 of the dense forward solve: its scores, merged into the running
    softmax (m, l_sum), and its solved Y rows (float32, or their copy in the input dtype) accumulated into acc."""
    keys = j0 + ar  # an earlier block: every key is < n
    k = _load_tile(KB, bh, n, keys, None, cd, d)
    yv = _load_solved_tile(Y, bh, n, keys, None, ce, e)
    s2 = _dot(QB_ROWS, tl.trans(k), PREC) * qk_scale2
    s2 = tl.where(keys[None, :] >= s, s2, float("-inf"))
    m, l_sum, alpha, p = _online_softmax(m, l_sum, s2)
    acc = acc * alpha[:, None] + _dot(p.to(yv.dtype), yv, PREC)
    return m, l_sum, acc


@triton.jit
def dense_solve_fwd_kernel(QB, KB, OA, G, Y, YREAD, R, LSEB, START, PROGRESS, n, H, d, e, qk_scale2,
                           BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                           COPY: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr):
    """Dense resolvent, forward: Y = (1 - geff) OA + geff softmax_{j<i}(qb_i . kb_j) Y_j, by blocks.

    Grid (cdiv(n, BLOCK) * BH,): one program per row block, in ticket order (``_claim_block``). Block c:
    (1) online softmax of its B-queries over the keys of earlier blocks, accumulating their solved Y
    (read back from the output buffer; blocks not yet published when the program starts are waited
    on one by one); (2) the in-block strictly lower scores, merged into the same running max / sum,
    which gives the full-row normaliser; (3) the in-block unit lower triangular system
    (I - geff Bt) Y_c = rhs, solved by repeated squaring (``_unit_lower_solve``).
    Writes Y and R = softmax(P^B) Y (BH, n, e) float32 and the base-2 log-sum-exp LSEB (BH, n). Earlier blocks
    are read from YREAD: Y itself, or with COPY a copy of Y in the input dtype that the block also writes (its
    products with probabilities then take 16-bit operands, as FlashAttention's P V).
    Memory beyond the inputs: O(n e) per (batch, head); nothing n x n.
    """
    blk, bh, s, order, ar, cd, ce, lo, c0, rows, rmask, valid, q, geff = _dense_fwd_block(QB, G, START, PROGRESS, n, H,
                                                                                        d, BLOCK, BD, BE)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    l_sum = tl.full([BLOCK], 0.0, tl.float32)
    acc = tl.full([BLOCK, BE], 0.0, tl.float32)
    # Blocks published when the program starts need no check (a loop the compiler can pipeline);
    # the few after them are waited on one by one.
    known = _solved_count(PROGRESS, bh)
    mid = tl.maximum(tl.minimum(known * BLOCK, c0), lo)
    for j0 in range(lo, mid, BLOCK):
        m, l_sum, acc = _dense_fwd_tile(q, KB, YREAD, bh, n, s, j0, ar, cd, d, ce, e, m, l_sum, acc, qk_scale2, PREC)
    for j0 in range(mid, c0, BLOCK):
        known = _wait_solved(PROGRESS, bh, j0 // BLOCK, known)
        m, l_sum, acc = _dense_fwd_tile(q, KB, YREAD, bh, n, s, j0, ar, cd, d, ce, e, m, l_sum, acc, qk_scale2, PREC)
    # In-block scores (strictly lower), merged into the running normaliser.
    kc = _load_tile(KB, bh, n, rows, rmask, cd, d)
    s2 = _dot(q, tl.trans(kc), PREC) * qk_scale2
    ok = (ar[None, :] < ar[:, None]) & (rows[None, :] >= s) & rmask[None, :]
    s2 = tl.where(ok, s2, float("-inf"))
    m, l_sum, alpha, p = _online_softmax(m, l_sum, s2)
    acc = acc * alpha[:, None]
    has = l_sum > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_sum, 1.0), 0.0)
    earlier = acc * inv_l[:, None]
    bt = p * inv_l[:, None]
    y = _solve_forward_block(OA, Y, YREAD, R, bh, n, rows, rmask, valid, ce, e, geff, bt, earlier, LOG2_BLOCK, COPY,
                             PREC, SOLVE_PREC)
    if COPY:
        tl.store(_tile_ptrs(YREAD, bh, n, rows, ce, e), y.to(YREAD.dtype.element_ty), mask=_tile_mask(rmask, ce, e))
    tl.store(_row_ptrs(LSEB, bh, n, rows), _log_sum_exp2(m, l_sum), mask=rmask)
    _publish_solved(PROGRESS, bh, order, known)


@triton.jit
def _dense_later_block(QB, LSEB, G, bh, n, s, r0, ar, cd, d, kc, cvalid, qk_scale2, PREC: tl.constexpr):
    """B_rc of the later row block r0 onto the columns (keys kc, valid where cvalid), recomputed from the scores:
    its rows and their mask, and the (rows, columns) tile geff_i exp2(s2_ij - LSEB_i)."""
    rows = r0 + ar
    rmask = rows < n
    hasb_r = rmask & (rows - s >= 1)
    qr = _load_tile(QB, bh, n, rows, rmask, cd, d)
    lse_r = _load_row_scalars(LSEB, bh, n, rows, rmask)
    geff_r = _gate(G, bh, n, rows, rmask, hasb_r)
    s2 = _dot(qr, tl.trans(kc), PREC) * qk_scale2
    ok = cvalid[None, :] & hasb_r[:, None]
    return rows, rmask, _exp2_where(ok, s2 - lse_r[:, None]) * geff_r[:, None]


@triton.jit
def _dense_bwd_tile(QB, LSEB, G, W, bh, n, s, r0, ar, cd, d, ce, e, kc, cvalid, rhs, qk_scale2,
                    PREC: tl.constexpr):
    """One later row block r0 of the dense backward solve: adds B_rc^T W_r to the right-hand side of
    the columns (keys kc, valid where cvalid), W_r in float32 or its copy in the input dtype."""
    rows, rmask, pb = _dense_later_block(QB, LSEB, G, bh, n, s, r0, ar, cd, d, kc, cvalid, qk_scale2, PREC)
    w_later = _load_solved_tile(W, bh, n, rows, rmask, ce, e)
    return rhs + _dot(tl.trans(pb).to(w_later.dtype), w_later, PREC)


@triton.jit
def dense_solve_bwd_kernel(QB, KB, OA, R, G, LSEB, DY, W, WREAD, DA, DB, DG, START, PROGRESS, n, H, d, e, qk_scale2,
                           BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                           COPY: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr):
    """Dense resolvent, backward solve: W = (I - B)^-T dY by blocks, last block first.

    Grid (cdiv(n, BLOCK) * BH,), in ticket order, solve order from the last block. For block c
    (positions j): rhs = dY_c + sum over later blocks r of B_rc^T W_r, with
    B_rc = geff_i exp2(s2_ij - LSEB_i) recomputed from the scores (nothing n x n is stored); then
    W_c = (I - B_cc)^-T rhs with the transposed in-block solve. Also writes the row scalars of the
    attention-style gradients (``_store_w_and_row_grads``). Later blocks are read from WREAD: W itself, or with
    COPY a copy of W in the input dtype that the block also writes (as ``dense_solve_fwd_kernel``'s YREAD).
    """
    nblk, blk, bh, s, order, ar, cd, ce, c0, cols, cmask, cvalid, hasb_c, kc, rhs = _dense_bwd_block(
        KB, DY, START, PROGRESS, n, H, d, e, BLOCK, BD, BE)
    # Later blocks in solve order (the last block is position 0): those published at the start
    # without a check, then the rest one by one.
    known = _solved_count(PROGRESS, bh)
    mid = tl.minimum(known, order)
    for o in range(0, mid):
        rhs = _dense_bwd_tile(QB, LSEB, G, WREAD, bh, n, s, (nblk - 1 - o) * BLOCK, ar, cd, d, ce, e, kc, cvalid,
                              rhs, qk_scale2, PREC)
    for o in range(mid, order):
        known = _wait_solved(PROGRESS, bh, o, known)
        rhs = _dense_bwd_tile(QB, LSEB, G, WREAD, bh, n, s, (nblk - 1 - o) * BLOCK, ar, cd, d, ce, e, kc, cvalid,
                              rhs, qk_scale2, PREC)
    qc = _load_tile(QB, bh, n, cols, cmask, cd, d)
    lse_c = _load_row_scalars(LSEB, bh, n, cols, cmask)
    geff_c = _gate(G, bh, n, cols, cmask, hasb_c)
    s2 = _dot(qc, tl.trans(kc), PREC) * qk_scale2
    ok = (ar[None, :] < ar[:, None]) & cvalid[None, :] & hasb_c[:, None]
    bt = _exp2_where(ok, s2 - lse_c[:, None])
    w = _unit_lower_solve(geff_c[:, None] * bt, rhs, LOG2_BLOCK, True, SOLVE_PREC)
    w = tl.where(cvalid[:, None], w, 0.0)
    _store_w_and_row_grads(_tile_ptrs(W, bh, n, cols, ce, e), _tile_ptrs(OA, bh, n, cols, ce, e),
                           _tile_ptrs(R, bh, n, cols, ce, e), _tile_mask(cmask, ce, e),
                           DA, DB, DG, bh, n, cols, cmask, w, geff_c, hasb_c)
    if COPY:
        tl.store(_tile_ptrs(WREAD, bh, n, cols, ce, e), w.to(WREAD.dtype.element_ty), mask=_tile_mask(cmask, ce, e))
    _publish_solved(PROGRESS, bh, order, known)


# Dense resolvent, chunked solves (BlockConfig.dense_solver = "chunked"): the schedule of the blocked solves
# (tickets, blocks published in solve order), with what sits on the chain from block to block cut to one product.
# Block c needs Y of every earlier block, but only Y_{c-1} can still be in flight when its program is ready:
# with T_c = (I - B_cc)^-1 and M_c = T_c B_{c,c-1},
#   Y_c = T_c ((1 - geff) OA_c + B_{c,<c-1} Y_{<c-1}) + M_c Y_{c-1},
# so the row normaliser, T_c (squarings), M_c and the first term are computed before the wait on block c - 1,
# after which one (BLOCK x BLOCK) x (BLOCK x e) product remains. The backward mirrors it: with
# M'_c = T_c^T B_{c+1,c}^T,  W_c = T_c^T (dY_c + sum_{r > c+1} B_rc^T W_r) + M'_c W_{c+1}.


@triton.jit
def dense_chunk_fwd_kernel(QB, KB, OA, G, Y, YREAD, R, LSEB, START, PROGRESS, n, H, d, e, qk_scale2, TINV,
                           BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                           COPY: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr,
                           SAVE_INVERSE: tl.constexpr):
    """Dense resolvent, forward, chunked: what ``dense_solve_fwd_kernel`` computes (Y, R, LSEB), with one product
    after the wait on the block before.

    Grid (cdiv(n, BLOCK) * BH,), ticket order. Block c: (1) online softmax with P.Y over the blocks before c - 1
    that were published when the program started; (2) the scores of the remaining earlier blocks and of the block
    itself join the running max and sum only, which makes the row normaliser final; (3) the blocks before c - 1
    not yet published, waited on one by one, add P.Y with final probabilities; (4) T_c applied to the right-hand
    side and to geff P_{c,c-1} (T_c formed, ``_unit_lower_inverse``); (5) the wait on block c - 1 and
    Y_c = Yhat_c + M_c Y_{c-1}.
    The P.Y products read earlier blocks from YREAD (Y, or its copy in the input dtype with COPY, as in
    ``dense_solve_fwd_kernel``); the chain product reads Y itself. With SAVE_INVERSE, T_c goes to TINV (BH,
    cdiv(n, BLOCK), BLOCK, BLOCK) float32, whole, for the backward.
    """
    blk, bh, s, order, ar, cd, ce, lo, c0, rows, rmask, valid, q, geff = _dense_fwd_block(QB, G, START, PROGRESS, n, H,
                                                                                        d, BLOCK, BD, BE)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    l_sum = tl.full([BLOCK], 0.0, tl.float32)
    acc = tl.full([BLOCK, BE], 0.0, tl.float32)
    known = _solved_count(PROGRESS, bh)
    mid = tl.maximum(tl.minimum(known * BLOCK, c0 - BLOCK), lo)
    for j0 in range(lo, mid, BLOCK):
        m, l_sum, acc = _dense_fwd_tile(q, KB, YREAD, bh, n, s, j0, ar, cd, d, ce, e, m, l_sum, acc, qk_scale2, PREC)
    for j0 in range(mid, c0, BLOCK):
        keys = j0 + ar
        s2 = _dot(q, tl.trans(_load_tile(KB, bh, n, keys, None, cd, d)), PREC) * qk_scale2
        m, l_sum, alpha, _ = _online_softmax(m, l_sum, tl.where(keys[None, :] >= s, s2, float("-inf")))
        acc = acc * alpha[:, None]
    kc = _load_tile(KB, bh, n, rows, rmask, cd, d)
    s_in = _dot(q, tl.trans(kc), PREC) * qk_scale2
    ok = (ar[None, :] < ar[:, None]) & (rows[None, :] >= s) & rmask[None, :]
    m, l_sum, alpha, p_in = _online_softmax(m, l_sum, tl.where(ok, s_in, float("-inf")))
    lse = _log_sum_exp2(m, l_sum)
    has = l_sum > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_sum, 1.0), 0.0)
    acc = acc * (alpha * inv_l)[:, None]
    p_in = p_in * inv_l[:, None]
    for j0 in range(mid, c0 - BLOCK, BLOCK):
        known = _wait_solved(PROGRESS, bh, j0 // BLOCK, known)
        keys = j0 + ar
        s2 = _dot(q, tl.trans(_load_tile(KB, bh, n, keys, None, cd, d)), PREC) * qk_scale2
        p = _exp2_where(keys[None, :] >= s, s2 - lse[:, None])
        y_read = _load_solved_tile(YREAD, bh, n, keys, None, ce, e)
        acc += _dot(p.to(y_read.dtype), y_read, PREC)
    inverse = _unit_lower_inverse(geff[:, None] * p_in, BLOCK, LOG2_BLOCK, False, SOLVE_PREC)
    if SAVE_INVERSE:
        tl.store(_chunk_tile_ptrs(TINV, bh, n, blk, 0, BLOCK, BLOCK, BLOCK), inverse)
    prev = c0 - BLOCK + ar
    prev_ok = (prev >= s) & (prev >= 0)
    s_prev = _dot(q, tl.trans(_load_tile(KB, bh, n, prev, prev_ok, cd, d)), PREC) * qk_scale2
    p_prev = _exp2_where(prev_ok[None, :], s_prev - lse[:, None])
    chain = _dot(inverse, geff[:, None] * p_prev, SOLVE_PREC)
    oa = _load_tile(OA, bh, n, rows, rmask, ce, e).to(tl.float32)
    yhat = _dot(inverse, (1.0 - geff)[:, None] * oa + geff[:, None] * acc, SOLVE_PREC)
    known = _wait_solved(PROGRESS, bh, blk - 1, known)
    y_prev = _load_solved_tile(Y, bh, n, prev, prev_ok, ce, e)
    y = tl.where(valid[:, None], yhat + _dot(chain, y_prev, SOLVE_PREC), 0.0)
    tl.store(_tile_ptrs(Y, bh, n, rows, ce, e), y, mask=_tile_mask(rmask, ce, e))
    if COPY:
        tl.store(_tile_ptrs(YREAD, bh, n, rows, ce, e), y.to(YREAD.dtype.element_ty), mask=_tile_mask(rmask, ce, e))
    _publish_solved(PROGRESS, bh, order, known)
    # R and LSEB are read by the backward only: off the chain, after the publication.
    # Under COPY, R reads every row as rounded to the copy, as channel B's attention backward does (see
    # ``_solve_forward_block``).
    y_prev_read, y_read = _as_read(y_prev, YREAD, COPY), _as_read(y, YREAD, COPY)
    r_read = acc + _dot(p_prev.to(y_prev_read.dtype), y_prev_read, PREC) + _dot(p_in.to(y_read.dtype), y_read, PREC)
    tl.store(_tile_ptrs(R, bh, n, rows, ce, e), r_read, mask=_tile_mask(rmask, ce, e))
    tl.store(_row_ptrs(LSEB, bh, n, rows), lse, mask=rmask)


@triton.jit
def dense_chunk_bwd_kernel(QB, KB, OA, R, G, LSEB, DY, W, WREAD, DA, DB, DG, START, PROGRESS, n, H, d, e, qk_scale2,
                           TINV, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                           COPY: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr):
    """Dense resolvent, backward, chunked: what ``dense_solve_bwd_kernel`` computes (W and the row scalars), with
    one product after the wait on the block after.

    Grid (cdiv(n, BLOCK) * BH,), ticket order from the last block. Block c: dY_c plus B_rc^T W_r of the later
    blocks but c + 1 (published ones first, the rest waited on one by one); T_c^T (T_c as the forward left it in
    TINV) applied to that and to B_{c+1,c}^T; then the wait on block c + 1 and W_c = What_c + M'_c W_{c+1}.
    The later blocks' products read WREAD (W, or its copy in the input dtype with COPY); the chain reads W itself.
    """
    nblk, blk, bh, s, order, ar, cd, ce, c0, cols, cmask, cvalid, hasb_c, kc, rhs = _dense_bwd_block(
        KB, DY, START, PROGRESS, n, H, d, e, BLOCK, BD, BE)
    # Later blocks in solve order (the last block is position 0, block c + 1 is position order - 1).
    known = _solved_count(PROGRESS, bh)
    mid = tl.maximum(tl.minimum(known, order - 1), 0)
    for o in range(0, mid):
        rhs = _dense_bwd_tile(QB, LSEB, G, WREAD, bh, n, s, (nblk - 1 - o) * BLOCK, ar, cd, d, ce, e, kc, cvalid,
                              rhs, qk_scale2, PREC)
    for o in range(mid, order - 1):
        known = _wait_solved(PROGRESS, bh, o, known)
        rhs = _dense_bwd_tile(QB, LSEB, G, WREAD, bh, n, s, (nblk - 1 - o) * BLOCK, ar, cd, d, ce, e, kc, cvalid,
                              rhs, qk_scale2, PREC)
    geff_c = _gate(G, bh, n, cols, cmask, hasb_c)
    inverse_t = tl.trans(tl.load(_chunk_tile_ptrs(TINV, bh, n, blk, 0, BLOCK, BLOCK, BLOCK)))
    nxt, nxt_mask, b_next = _dense_later_block(QB, LSEB, G, bh, n, s, c0 + BLOCK, ar, cd, d, kc, cvalid, qk_scale2,
                                               PREC)
    chain = _dot(inverse_t, tl.trans(b_next), SOLVE_PREC)
    what = _dot(inverse_t, rhs, SOLVE_PREC)
    known = _wait_solved(PROGRESS, bh, order - 1, known)
    w_next = _load_solved_tile(W, bh, n, nxt, nxt_mask, ce, e)
    w = tl.where(cvalid[:, None], what + _dot(chain, w_next, SOLVE_PREC), 0.0)
    _store_w_and_row_grads(_tile_ptrs(W, bh, n, cols, ce, e), _tile_ptrs(OA, bh, n, cols, ce, e),
                           _tile_ptrs(R, bh, n, cols, ce, e), _tile_mask(cmask, ce, e),
                           DA, DB, DG, bh, n, cols, cmask, w, geff_c, hasb_c)
    if COPY:
        tl.store(_tile_ptrs(WREAD, bh, n, cols, ce, e), w.to(WREAD.dtype.element_ty), mask=_tile_mask(cmask, ce, e))
    _publish_solved(PROGRESS, bh, order, known)


# ------------------------------------------------------------------------------------------------
# Sparse kinds (local attention, banded, diagonal, translation-invariant and cache-efficient f)


@triton.jit
def _ce_source(OFFS, STEPS, k, rel, live):
    """Pattern position a_k ceil((rel + 1 - f(k)) / a_k) - 1 that slot k of a cache-efficient pattern reads
    (a_k - 1 on rows that do not read slot k, where it is never used as a source)."""
    f = tl.load(OFFS + k)
    a = tl.load(STEPS + k)
    u = tl.where(live & (rel >= f), rel + 1 - f, 1)
    return a * ((u + a - 1) // a) - 1


@triton.jit
def _slot_source(OFFS, STEPS, k, rel, live, s, CE: tl.constexpr):
    """Source position of slot k for rows at pattern positions ``rel`` (BLOCK,) int32, left padding s.

    Returns (source, ok): ``ok`` marks rows that read slot k (f(k) <= rel, and for cache-efficient
    patterns not a duplicate of slot k - 1); ``source`` is s + the pattern-relative source (s where not
    ok, a safe address). Slots may be visited in any order: slot k - 1 is recomputed, not carried.
    """
    f = tl.load(OFFS + k)
    ok = live & (rel >= f)
    if CE:
        src = _ce_source(OFFS, STEPS, k, rel, live)
        prev = tl.where(k > 0, _ce_source(OFFS, STEPS, tl.maximum(k - 1, 0), rel, live), -1)
        ok = ok & (src != prev)
    else:
        src = rel - f
    src = tl.where(ok, src, 0)
    return src + s, ok


@triton.jit
def _load_channel_b_rows(QB, LSEB, G, bh, n, rows, rmask, hasb, cd, d):
    """The channel-B queries (float32), log-sum-exps and geff of a block of rows."""
    q = _load_tile(QB, bh, n, rows, rmask, cd, d).to(tl.float32)
    lse = _load_row_scalars(LSEB, bh, n, rows, rmask)
    geff = _gate(G, bh, n, rows, rmask, hasb)
    return q, lse, geff


@triton.jit
def sparse_direct_kernel(QA, KA, X, QB, KB, OA, LSEA, LSEB, START, OFFS, STEPS, NSLOT, n, H, da, db, e, qk_scale2,
                         BM: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BE: tl.constexpr,
                         CE: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr):
    """Sparse patterns, the parallel part of the forward: direct channel and recurrent normaliser.

    Grid (cdiv(n, BM), BH). For each row the sources are computed from the offsets table (no index
    tensor is read). HAS_A: OA = softmax over {row} U slots of qa . ka, applied to x (BH, n, e) float32
    (0 on padded rows), LSEA (BH, n). HAS_B: LSEB (BH, n), the log-sum-exp of qb . kb over the slots
    (0 where there is none), which the sequential solve then uses as a fixed normaliser.
    O(K (d + e)) work per row.
    """
    _, bh, s, rows = _row_block(START, H, BM)
    rmask, rel, valid = _pattern_rows(rows, n, s)
    ce = tl.arange(0, BE)
    if HAS_A:
        ca = tl.arange(0, BDA)
        qa = _load_tile(QA, bh, n, rows, rmask, ca, da).to(tl.float32)
        ka = _load_tile(KA, bh, n, rows, rmask, ca, da).to(tl.float32)
        m = _sum(qa * ka, 1) * qk_scale2
        l_sum = tl.full([BM], 1.0, tl.float32)
        acc = _load_tile(X, bh, n, rows, rmask, ce, e).to(tl.float32)
    if HAS_B:
        cb = tl.arange(0, BDB)
        qb = _load_tile(QB, bh, n, rows, rmask, cb, db).to(tl.float32)
        mb = tl.full([BM], float("-inf"), tl.float32)
        lb = tl.full([BM], 0.0, tl.float32)
    for k in range(0, NSLOT):
        src, ok = _slot_source(OFFS, STEPS, k, rel, valid, s, CE)
        if HAS_A:
            kk = _load_tile(KA, bh, n, src, ok, ca, da).to(tl.float32)
            xk = _load_tile(X, bh, n, src, ok, ce, e).to(tl.float32)
            sk = tl.where(ok, _sum(qa * kk, 1) * qk_scale2, float("-inf"))
            # m starts at the row's own score, finite: no -inf guard as in _online_softmax.
            m_new = tl.maximum(m, sk)
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(sk - m_new)
            l_sum = l_sum * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * xk
            m = m_new
        if HAS_B:
            kk = _load_tile(KB, bh, n, src, ok, cb, db).to(tl.float32)
            sk = tl.where(ok, _sum(qb * kk, 1) * qk_scale2, float("-inf"))
            mb_new = tl.maximum(mb, sk)
            m_use = tl.where(mb_new == float("-inf"), 0.0, mb_new)
            lb = lb * tl.exp2(mb - m_use) + tl.exp2(sk - m_use)
            mb = mb_new
    if HAS_A:
        out = tl.where(valid[:, None], acc / l_sum[:, None], 0.0)
        tl.store(_tile_ptrs(OA, bh, n, rows, ce, e), out, mask=_tile_mask(rmask, ce, e))
        tl.store(_row_ptrs(LSEA, bh, n, rows), m + tl.log2(l_sum), mask=rmask)
    if HAS_B:
        tl.store(_row_ptrs(LSEB, bh, n, rows), _log_sum_exp2(mb, lb), mask=rmask)


@triton.jit
def sparse_solve_fwd_kernel(QB, KB, OA, G, LSEB, Y, R, START, OFFS, STEPS, NSLOT, F0, n, H, d, e, qk_scale2,
                            BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                            CE: tl.constexpr, SOLVE_PREC: tl.constexpr):
    """Sparse patterns, forward solve: Y = (1 - geff) OA + geff sum_slots softmax(qb . kb) Y[src].

    Grid (BH,); row blocks in order. Slots whose source lies in an earlier block gather the solved
    Y rows; slots inside the block fill a (BLOCK, BLOCK) strictly lower tile that is then solved as
    in the dense kernel. F0 = f(0): rows with rel < F0 have no recurrent set (geff = 0).
    Writes Y and R = softmax(P^B) Y (BH, n, e) float32. O(n (BLOCK + K) e) work.

    Unlike the other solves this one keeps one program per head: one program per block (``_claim_block``)
    measured slower on the H100, because every slot of a block can read the block just before it, so
    the chain from block to block still held the whole slot loop (kernels/README.md, Limitations).
    """
    bh, s = _head_and_start(START, H, 0)
    ar = tl.arange(0, BLOCK)
    cd = tl.arange(0, BD)
    ce = tl.arange(0, BE)
    for c0 in range(0, n, BLOCK):
        rows = c0 + ar
        rmask, rel, valid = _pattern_rows(rows, n, s)
        hasb = valid & (rel >= F0)
        q, lse, geff = _load_channel_b_rows(QB, LSEB, G, bh, n, rows, rmask, hasb, cd, d)
        earlier = tl.full([BLOCK, BE], 0.0, tl.float32)
        bt = tl.full([BLOCK, BLOCK], 0.0, tl.float32)
        for k in range(0, NSLOT):
            src, ok = _slot_source(OFFS, STEPS, k, rel, valid, s, CE)
            kk = _load_tile(KB, bh, n, src, ok, cd, d).to(tl.float32)
            p = _exp2_where(ok, _sum(q * kk, 1) * qk_scale2 - lse)
            early = ok & (src < c0)
            yk = _load_tile(Y, bh, n, src, early, ce, e)
            earlier += tl.where(early, p, 0.0)[:, None] * yk
            inside = ok & (src >= c0)
            bt += tl.where((ar[None, :] == (src - c0)[:, None]) & inside[:, None], p[:, None], 0.0)
        _solve_forward_block(OA, Y, Y, R, bh, n, rows, rmask, valid, ce, e, geff, bt, earlier, LOG2_BLOCK, False,
                             SOLVE_PREC, SOLVE_PREC)
        # Later blocks of this program read these rows of Y back from global memory.
        tl.debug_barrier()


@triton.jit
def sparse_solve_bwd_kernel(QB, KB, OA, R, G, LSEB, DY, GACC, W, DA, DB, DG, START, PROGRESS, OFFS, STEPS, NSLOT,
                            F0, n, H, d, e, qk_scale2,
                            BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                            CE: tl.constexpr, SOLVE_PREC: tl.constexpr):
    """Sparse patterns, backward solve: W = (I - B)^-T dY, last block first.

    Grid (cdiv(n, BLOCK) * BH,), in ticket order, solve order from the last block. GACC (BH, n, e)
    float32, zero on entry, collects B^T W from later blocks: once W_c is solved, every slot of block c
    whose source lies in an earlier block adds B_ij W_i to GACC[j] (atomic adds: two rows may share a
    source), before the block is published. A block's in-block tile is built first; it then waits for
    every later block to be published, and its right-hand side is dY_c + GACC_c, with
    W_c = (I - B_cc)^-T rhs. Row scalars DA, DB, DG as in the dense backward solve.
    """
    _, blk, bh, s, order, ar, cd, ce, c0, rows, rmask, rel, valid = _claimed_block(START, PROGRESS, n, H, BLOCK, BD,
                                                                                    BE, True)
    hasb = valid & (rel >= F0)
    q, lse, geff = _load_channel_b_rows(QB, LSEB, G, bh, n, rows, rmask, hasb, cd, d)
    # One (int64) offset tile serves the block's five (rows, e) tiles: dY, GACC, W, OA, R.
    row_e = bh * n * e + rows[:, None] * e + ce[None, :]
    rhs = tl.load(DY + row_e, mask=_tile_mask(valid, ce, e), other=0.0).to(tl.float32)
    bt = tl.full([BLOCK, BLOCK], 0.0, tl.float32)
    for k in range(0, NSLOT):
        src, ok = _slot_source(OFFS, STEPS, k, rel, valid, s, CE)
        inside = ok & (src >= c0)
        kk = _load_tile(KB, bh, n, src, inside, cd, d).to(tl.float32)
        p = _exp2_where(inside, _sum(q * kk, 1) * qk_scale2 - lse)
        bt += tl.where(ar[None, :] == (src - c0)[:, None], p[:, None], 0.0)
    known = _wait_solved(PROGRESS, bh, order - 1, _solved_count(PROGRESS, bh))
    # GACC was written with atomics (at L2) by other programs: read it from L2 (.cg), not L1.
    rhs += tl.load(GACC + row_e, mask=_tile_mask(rmask, ce, e), other=0.0, cache_modifier=".cg")
    w = _unit_lower_solve(geff[:, None] * bt, rhs, LOG2_BLOCK, True, SOLVE_PREC)
    w = tl.where(valid[:, None], w, 0.0)
    _store_w_and_row_grads(W + row_e, OA + row_e, R + row_e, _tile_mask(rmask, ce, e),
                           DA, DB, DG, bh, n, rows, rmask, w, geff, hasb)
    # Scatter B_ij W_i to the sources j of earlier blocks.
    for k in range(0, NSLOT):
        src, ok = _slot_source(OFFS, STEPS, k, rel, valid, s, CE)
        early = ok & (src < c0)
        kk = _load_tile(KB, bh, n, src, early, cd, d).to(tl.float32)
        p = _exp2_where(early, _sum(q * kk, 1) * qk_scale2 - lse)
        tl.atomic_add(_tile_ptrs(GACC, bh, n, src, ce, e), (geff * p)[:, None] * w, mask=_tile_mask(early, ce, e),
                      sem="relaxed")
    _publish_solved(PROGRESS, bh, order, known)


@triton.jit
def sparse_grads_kernel(QA, KA, X, QB, KB, Y, W, G, DA, DB, LSEA, LSEB, DQA, DKA, DX, DQB, DKB,
                        START, OFFS, STEPS, NSLOT, F0, n, H, da, db, e, qk_scale2, scale,
                        BM: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BE: tl.constexpr,
                        CE: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr):
    """Sparse patterns, attention-style gradients of both channels once W = (I - B)^-T dY is known.

    Grid (cdiv(n, BM), BH). Per row i and slot (and the row itself for A): P recomputed from the
    stored log-sum-exps, dS = P (dO . V - D) with dO = (1 - geff) W, V = x (channel A) and
    dO = geff W, V = Y (channel B). dQ rows are written directly; dK and dX of the sources receive
    atomic adds (DKA, DX, DKB float32, zero on entry).
    """
    _, bh, s, rows = _row_block(START, H, BM)
    rmask, rel, valid = _pattern_rows(rows, n, s)
    ce = tl.arange(0, BE)
    w = _load_tile(W, bh, n, rows, rmask, ce, e)
    if HAS_B:
        hasb = valid & (rel >= F0)
        cb = tl.arange(0, BDB)
        qb, lseb, geff = _load_channel_b_rows(QB, LSEB, G, bh, n, rows, rmask, hasb, cb, db)
        delta_b = _load_row_scalars(DB, bh, n, rows, rmask)
        dqb = tl.full([BM, BDB], 0.0, tl.float32)
    else:
        geff = tl.full([BM], 0.0, tl.float32)
    if HAS_A:
        ca = tl.arange(0, BDA)
        qa = _load_tile(QA, bh, n, rows, rmask, ca, da).to(tl.float32)
        lsea = _load_row_scalars(LSEA, bh, n, rows, rmask)
        delta_a = _load_row_scalars(DA, bh, n, rows, rmask)
        do_a = w * (1.0 - geff)[:, None]
        ka = _load_tile(KA, bh, n, rows, rmask, ca, da).to(tl.float32)
        xs = _load_tile(X, bh, n, rows, rmask, ce, e).to(tl.float32)
        p0 = _exp2_where(valid, _sum(qa * ka, 1) * qk_scale2 - lsea)
        ds0 = p0 * (_sum(do_a * xs, 1) - delta_a)
        dqa = ds0[:, None] * ka
        tl.atomic_add(_tile_ptrs(DKA, bh, n, rows, ca, da), ds0[:, None] * qa * scale, mask=_tile_mask(valid, ca, da),
                      sem="relaxed")
        tl.atomic_add(_tile_ptrs(DX, bh, n, rows, ce, e), p0[:, None] * do_a, mask=_tile_mask(valid, ce, e),
                      sem="relaxed")
    for k in range(0, NSLOT):
        src, ok = _slot_source(OFFS, STEPS, k, rel, valid, s, CE)
        if HAS_A:
            kk = _load_tile(KA, bh, n, src, ok, ca, da).to(tl.float32)
            xk = _load_tile(X, bh, n, src, ok, ce, e).to(tl.float32)
            p = _exp2_where(ok, _sum(qa * kk, 1) * qk_scale2 - lsea)
            ds = p * (_sum(do_a * xk, 1) - delta_a)
            dqa += ds[:, None] * kk
            tl.atomic_add(_tile_ptrs(DKA, bh, n, src, ca, da), ds[:, None] * qa * scale, mask=_tile_mask(ok, ca, da),
                          sem="relaxed")
            tl.atomic_add(_tile_ptrs(DX, bh, n, src, ce, e), p[:, None] * do_a, mask=_tile_mask(ok, ce, e),
                          sem="relaxed")
        if HAS_B:
            kk = _load_tile(KB, bh, n, src, ok, cb, db).to(tl.float32)
            yk = _load_tile(Y, bh, n, src, ok, ce, e)
            p = _exp2_where(ok, _sum(qb * kk, 1) * qk_scale2 - lseb)
            ds = p * (geff * _sum(w * yk, 1) - delta_b)
            dqb += ds[:, None] * kk
            tl.atomic_add(_tile_ptrs(DKB, bh, n, src, cb, db), ds[:, None] * qb * scale, mask=_tile_mask(ok, cb, db),
                          sem="relaxed")
    if HAS_A:
        tl.store(_tile_ptrs(DQA, bh, n, rows, ca, da), dqa * scale, mask=_tile_mask(rmask, ca, da))
    if HAS_B:
        tl.store(_tile_ptrs(DQB, bh, n, rows, cb, db), dqb * scale, mask=_tile_mask(rmask, cb, db))


# ------------------------------------------------------------------------------------------------
# Sparse kinds, chunked solves (BlockConfig.sparse_solver = "chunked")
#
# Per (batch, head) the real rows are cut into chunks of C rows counted from the first real token (pattern
# position rel = 0). With T_c = (I - B_cc)^-1 (the chunk's own block of B), H_c the earlier rows the chunk
# reads (HELD[c]: pattern positions, -1 padded to HM), J_c = T_c B[c, H_c] and Yhat_c = T_c (1 - geff) OA_c:
#
#   forward:   Y_c = Yhat_c + J_c Y[H_c]                           chunk after chunk
#   backward:  G_c = dY_c + ACC_c;  ACC[H_c] += J_c^T G_c           last chunk first;  W_c = T_c^T G_c
#
# Only the chain through the held rows is sequential. chunk_prepare_kernel computes Yhat_c and J_c for every
# chunk at once; chunk_carry_kernel walks the chain with the value columns split across programs, so each
# program owns its columns and no program waits on another; chunk_rows_bwd_kernel solves W_c for every chunk
# at once and the row scalars of the gradients; chunk_grads_kernel gives dq, dk, dx as tiles over the chunk's own
# and held rows. Held rows are visited in blocks of HB (<= C) columns, so tiles stay C x C however many rows a
# chunk holds. kernels/chunked_solve.py is the float64 model of these steps.


@triton.jit
def _chunk_of_program(START, H, n, C: tl.constexpr):
    """For a grid (cdiv(n, C), BH): the chunk index c, head bh, left padding s, the chunk's positions, which are
    in range, and their pattern positions."""
    c = tl.program_id(0)
    bh, s = _head_and_start(START, H, 1)
    rel = c * C + tl.arange(0, C)
    rows = s + rel
    return c, bh, s, rows, rows < n, rel


@triton.jit
def _held_rows(HELD, c, s, n, h0, HM: tl.constexpr, HB: tl.constexpr):
    """Held rows h0 .. h0 + HB - 1 of chunk c as positions (s where the table is padded, a safe address) and which
    are real. The table is laid out for a sequence of n real rows: with left padding, the chunks past the
    sequence's end list rows past n, which are not real either."""
    held = tl.load(HELD + c * HM + h0 + tl.arange(0, HB))
    ok = (held >= 0) & (s + held < n)
    return s + tl.where(ok, held, 0), ok


@triton.jit
def _reads_ptrs(READS, c, col0, C: tl.constexpr, HM: tl.constexpr, WIDTH: tl.constexpr):
    """Pointers to columns col0 .. col0 + WIDTH - 1 of chunk c's reads (C, C + HM) in READS (cdiv(n, C), C, C + HM)
    int8 from ``resolvent.held_table``: the pattern's sources laid out per chunk once on the host (column j < C: the
    chunk's row j; column C + h: its held row h), so no program computes a source."""
    return READS + (c * C + tl.arange(0, C)[:, None]) * (C + HM) + col0 + tl.arange(0, WIDTH)[None, :]


@triton.jit
def _own_probabilities(Q, K, LSE, READS, bh, n, c, rows, rmask, cd, d, qk_scale2, DIAG: tl.constexpr,
                       C: tl.constexpr, HM: tl.constexpr, PREC: tl.constexpr):
    """A softmax channel's probabilities from a chunk's rows onto its own rows (C, C) as one tensor-core tile, with
    the row's query tile q and log-sum-exps; DIAG adds the row itself (channel A reads it)."""
    q = _load_tile(Q, bh, n, rows, rmask, cd, d)
    k = _load_tile(K, bh, n, rows, rmask, cd, d)
    lse = _load_row_scalars(LSE, bh, n, rows, rmask)
    read = (tl.load(_reads_ptrs(READS, c, 0, C, HM, C)) != 0) & rmask[:, None]
    if DIAG:
        ar = tl.arange(0, C)
        read = read | ((ar[:, None] == ar[None, :]) & rmask[:, None])
    return q, k, lse, _exp2_where(read, _dot(q, tl.trans(k), PREC) * qk_scale2 - lse[:, None])


@triton.jit
def _held_probabilities(q, lse, K, HELD, READS, bh, s, n, c, rmask, h0, cd, d, qk_scale2, C: tl.constexpr,
                        HM: tl.constexpr, HB: tl.constexpr, PREC: tl.constexpr):
    """The same channel's probabilities onto held rows h0 .. h0 + HB - 1 (C, HB), with those rows, which are real,
    and their keys."""
    hrows, hok = _held_rows(HELD, c, s, n, h0, HM, HB)
    k = _load_tile(K, bh, n, hrows, hok, cd, d)
    read = (tl.load(_reads_ptrs(READS, c, C + h0, C, HM, HB)) != 0) & rmask[:, None] & hok[None, :]
    return hrows, hok, k, _exp2_where(read, _dot(q, tl.trans(k), PREC) * qk_scale2 - lse[:, None])


@triton.jit
def _zero_padding_rows(PTR, bh, n, s, c, cols, width, C: tl.constexpr, BW: tl.constexpr):
    """Writes 0 to the left-padding positions among c * C .. c * C + C - 1 of a (BH, n, width) tensor, BW its
    tile width (the chunks count from the first real token, so no chunk owns those rows)."""
    pad = c * C + tl.arange(0, C)
    tl.store(_tile_ptrs(PTR, bh, n, pad, cols, width), tl.full([C, BW], 0.0, tl.float32),
             mask=_tile_mask(pad < s, cols, width))


@triton.jit
def _chunk_tile_ptrs(PTR, bh, n, c, h0, C: tl.constexpr, WIDTH: tl.constexpr, HB: tl.constexpr):
    """Pointers to columns h0 .. h0 + HB - 1 of block c's (C, WIDTH) tile of head bh in PTR (BH, cdiv(n, C), C,
    WIDTH): J_c (WIDTH = HM) or the block's inverse T_c (WIDTH = HB = C)."""
    nc = (n + C - 1) // C
    # The tile's start as one scalar and its offsets in int32: int64 addresses per element spilled more at the stores
    # of the chunked kernels on sm_90.
    return PTR + (bh * nc + c) * (C * WIDTH) + (tl.arange(0, C)[:, None] * WIDTH + h0 + tl.arange(0, HB)[None, :])


@triton.jit
def chunk_prepare_kernel(QB, KB, OA, G, LSEB, HELD, READS, Y, J, START, F0, n, H, d, e, qk_scale2, TINV,
                         C: tl.constexpr, LOG2_C: tl.constexpr, HM: tl.constexpr, HB: tl.constexpr,
                         BD: tl.constexpr, BE: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr,
                         SAVE_INVERSE: tl.constexpr):
    """Chunked sparse solve, the parallel part of the forward: Yhat_c (written to Y) and J_c for every chunk.

    Grid (cdiv(n, C), BH). Yhat_c = T_c (1 - geff) OA_c and J_c = T_c geff P_held with T_c = (I - geff P_in)^-1
    formed (``_unit_lower_inverse``) and applied to the right-hand side and to HB held columns at a time.
    J (BH, cdiv(n, C), C, HM) float32 is written whole (zero rows past n, zero columns past |H_c|), and so is T_c
    into TINV (BH, cdiv(n, C), C, C) for the backward with SAVE_INVERSE; Y is 0 on padded rows.
    """
    c, bh, s, rows, rmask, rel = _chunk_of_program(START, H, n, C)
    cd = tl.arange(0, BD)
    ce = tl.arange(0, BE)
    geff = _gate(G, bh, n, rows, rmask, rmask & (rel >= F0))
    q, k_own, lse, p_in = _own_probabilities(QB, KB, LSEB, READS, bh, n, c, rows, rmask, cd, d, qk_scale2, False,
                                             C, HM, PREC)
    lower = geff[:, None] * p_in
    rhs = (1.0 - geff)[:, None] * _load_tile(OA, bh, n, rows, rmask, ce, e).to(tl.float32)
    inverse = _unit_lower_inverse(lower, C, LOG2_C, False, SOLVE_PREC)
    if SAVE_INVERSE:
        tl.store(_chunk_tile_ptrs(TINV, bh, n, c, 0, C, C, C), inverse)
    for h0 in range(0, HM, HB):
        hrows, hok, k_held, p_held = _held_probabilities(q, lse, KB, HELD, READS, bh, s, n, c, rmask, h0, cd, d,
                                                         qk_scale2, C, HM, HB, PREC)
        tl.store(_chunk_tile_ptrs(J, bh, n, c, h0, C, HM, HB), _dot(inverse, geff[:, None] * p_held, SOLVE_PREC))
    yhat = _dot(inverse, rhs, SOLVE_PREC)
    tl.store(_tile_ptrs(Y, bh, n, rows, ce, e), yhat, mask=_tile_mask(rmask, ce, e))
    _zero_padding_rows(Y, bh, n, s, c, ce, e, C, BE)


@triton.jit
def chunk_carry_kernel(Y, J, HELD, START, n, H, e, C: tl.constexpr, HM: tl.constexpr, HB: tl.constexpr,
                       BES: tl.constexpr, REVERSE: tl.constexpr, SOLVE_PREC: tl.constexpr):
    """Chunked sparse solve, the chain through the held rows, in place on Y (BH, n, e) float32.

    Grid (BH, cdiv(e, BES)): each program owns BES value columns of one head. Forward: Y holds Yhat on entry;
    chunk after chunk, Y_c += J_c Y[H_c]. REVERSE (backward): Y holds dY on entry (0 on padded rows); last chunk
    first, Y_c is then final (G_c) and Y[H_c] += J_c^T G_c (the rows of H_c are distinct: no atomics). Rows a
    chunk reads were written by this program at an earlier step: a barrier ends each step.
    """
    bh, s = _head_and_start(START, H, 0)
    cols = tl.program_id(1) * BES + tl.arange(0, BES)
    ar = tl.arange(0, C)
    nreal = (n - s + C - 1) // C
    for i in range(0, nreal):
        if REVERSE:
            c = nreal - 1 - i
        else:
            c = i
        rows = s + c * C + ar
        rmask = rows < n
        if REVERSE:
            grad = _load_tile(Y, bh, n, rows, rmask, cols, e)
            for h0 in range(0, HM, HB):
                hrows, hok = _held_rows(HELD, c, s, n, h0, HM, HB)
                jc = tl.load(_chunk_tile_ptrs(J, bh, n, c, h0, C, HM, HB))
                ptrs = _tile_ptrs(Y, bh, n, hrows, cols, e)
                mask = _tile_mask(hok, cols, e)
                tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + _dot(tl.trans(jc), grad, SOLVE_PREC), mask=mask)
        else:
            acc = _load_tile(Y, bh, n, rows, rmask, cols, e)
            for h0 in range(0, HM, HB):
                hrows, hok = _held_rows(HELD, c, s, n, h0, HM, HB)
                jc = tl.load(_chunk_tile_ptrs(J, bh, n, c, h0, C, HM, HB))
                acc += _dot(jc, _load_tile(Y, bh, n, hrows, hok, cols, e), SOLVE_PREC)
            tl.store(_tile_ptrs(Y, bh, n, rows, cols, e), acc, mask=_tile_mask(rmask, cols, e))
        tl.debug_barrier()


@triton.jit
def chunk_rows_bwd_kernel(QB, KB, OA, G, LSEB, HELD, READS, Y, GRAD, TINV, W, DA, DB, DG, START, F0, n, H, d, e,
                          qk_scale2, C: tl.constexpr, LOG2_C: tl.constexpr, HM: tl.constexpr, HB: tl.constexpr,
                          BD: tl.constexpr, BE: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr):
    """Chunked sparse solve, the parallel part of the backward: W_c = T_c^T G_c for every chunk (GRAD holds G
    from the reverse chain, TINV T_c from the forward), and the row scalars DA = (1 - geff) W.OA, DB = geff W.R,
    DG = W.(R - OA) on rows with a recurrent set, as ``_store_w_and_row_grads`` writes them.

    Grid (cdiv(n, C), BH). W.R_i = sum_j P_ij W_i . Y_j over the chunk's own rows and its held rows: tensor-core
    tiles W_c Y_c^T and W_c Y[H_c]^T weighted by P, so R itself is never stored.
    """
    c, bh, s, rows, rmask, rel = _chunk_of_program(START, H, n, C)
    cd = tl.arange(0, BD)
    ce = tl.arange(0, BE)
    hasb = rmask & (rel >= F0)
    geff = _gate(G, bh, n, rows, rmask, hasb)
    q, k_own, lse, p_in = _own_probabilities(QB, KB, LSEB, READS, bh, n, c, rows, rmask, cd, d, qk_scale2, False,
                                             C, HM, PREC)
    grad = _load_tile(GRAD, bh, n, rows, rmask, ce, e)
    w = _dot(tl.trans(tl.load(_chunk_tile_ptrs(TINV, bh, n, c, 0, C, C, C))), grad, SOLVE_PREC)
    w_r = _sum(p_in * _dot(w, tl.trans(_load_tile(Y, bh, n, rows, rmask, ce, e)), PREC), 1)
    for h0 in range(0, HM, HB):
        hrows, hok, k_held, p_held = _held_probabilities(q, lse, KB, HELD, READS, bh, s, n, c, rmask, h0, cd, d,
                                                         qk_scale2, C, HM, HB, PREC)
        w_r += _sum(p_held * _dot(w, tl.trans(_load_tile(Y, bh, n, hrows, hok, ce, e)), PREC), 1)
    w_oa = _sum(w * _load_tile(OA, bh, n, rows, rmask, ce, e).to(tl.float32), 1)
    tl.store(_tile_ptrs(W, bh, n, rows, ce, e), w, mask=_tile_mask(rmask, ce, e))
    tl.store(_row_ptrs(DA, bh, n, rows), (1.0 - geff) * w_oa, mask=rmask)
    tl.store(_row_ptrs(DB, bh, n, rows), geff * w_r, mask=rmask)
    tl.store(_row_ptrs(DG, bh, n, rows), tl.where(hasb, w_r - w_oa, 0.0), mask=rmask)
    _zero_padding_rows(W, bh, n, s, c, ce, e, C, BE)
    pad = c * C + tl.arange(0, C)
    zero = tl.full([C], 0.0, tl.float32)
    tl.store(_row_ptrs(DA, bh, n, pad), zero, mask=pad < s)
    tl.store(_row_ptrs(DB, bh, n, pad), zero, mask=pad < s)
    tl.store(_row_ptrs(DG, bh, n, pad), zero, mask=pad < s)


@triton.jit
def _channel_grads(Q, K, V, LSE, DELTA, DQ, DK, DV, HELD, READS, do, bh, s, n, c, rows, rmask, cd, d, ce, e,
                   qk_scale2, scale, DIAG: tl.constexpr, HAS_DV: tl.constexpr, C: tl.constexpr, HM: tl.constexpr,
                   HB: tl.constexpr, BDW: tl.constexpr, PREC: tl.constexpr):
    """One softmax channel's gradients for a chunk's rows, given dO (C, e): dS = P (dO V^T - DELTA) over the
    chunk's own rows and its held rows, HB at a time. dQ rows are written once; dK (and dV = P^T dO with HAS_DV) of
    the chunk's rows and of each block of held rows get one atomic tile add. Operands as in the attention backward:
    q, k, dS in Q's dtype, P and dO in V's."""
    DT = Q.dtype.element_ty
    VT = V.dtype.element_ty
    do = do.to(VT)
    delta = _load_row_scalars(DELTA, bh, n, rows, rmask)
    q, k, lse, p = _own_probabilities(Q, K, LSE, READS, bh, n, c, rows, rmask, cd, d, qk_scale2, DIAG, C, HM, PREC)
    ds = p * (_dot(do, tl.trans(_load_tile(V, bh, n, rows, rmask, ce, e).to(VT)), PREC) - delta[:, None])
    dq = _dot(ds.to(DT), k, PREC)
    tl.atomic_add(_tile_ptrs(DK, bh, n, rows, cd, d), _dot(tl.trans(ds).to(DT), q, PREC) * scale,
                  mask=_tile_mask(rmask, cd, d), sem="relaxed")
    if HAS_DV:
        tl.atomic_add(_tile_ptrs(DV, bh, n, rows, ce, e), _dot(tl.trans(p).to(VT), do, PREC),
                      mask=_tile_mask(rmask, ce, e), sem="relaxed")
    for h0 in range(0, HM, HB):
        hrows, hok, kh, ph = _held_probabilities(q, lse, K, HELD, READS, bh, s, n, c, rmask, h0, cd, d, qk_scale2, C,
                                                 HM, HB, PREC)
        dsh = ph * (_dot(do, tl.trans(_load_tile(V, bh, n, hrows, hok, ce, e).to(VT)), PREC) - delta[:, None])
        dq += _dot(dsh.to(DT), kh, PREC)
        tl.atomic_add(_tile_ptrs(DK, bh, n, hrows, cd, d), _dot(tl.trans(dsh).to(DT), q, PREC) * scale,
                      mask=_tile_mask(hok, cd, d), sem="relaxed")
        if HAS_DV:
            tl.atomic_add(_tile_ptrs(DV, bh, n, hrows, ce, e), _dot(tl.trans(ph).to(VT), do, PREC),
                          mask=_tile_mask(hok, ce, e), sem="relaxed")
    tl.store(_tile_ptrs(DQ, bh, n, rows, cd, d), dq * scale, mask=_tile_mask(rmask, cd, d))
    _zero_padding_rows(DQ, bh, n, s, c, cd, d, C, BDW)


@triton.jit
def chunk_grads_kernel(QA, KA, X, QB, KB, Y, W, G, DA, DB, LSEA, LSEB, HELD, READS, DQA, DKA, DX, DQB, DKB, START, F0,
                       n, H, da, db, e, qk_scale2, scale, C: tl.constexpr, HM: tl.constexpr, HB: tl.constexpr,
                       BDA: tl.constexpr, BDB: tl.constexpr, BE: tl.constexpr, HAS_A: tl.constexpr,
                       PREC: tl.constexpr):
    """Chunked sparse solve, the attention-style gradients of both channels once W is known (``sparse_grads_kernel``'s
    results), as tiles.

    Grid (cdiv(n, C), BH). A chunk's rows read their sources among the chunk's own rows and its held rows (channel
    A also reads the row itself), so per channel P, dP = dO V^T and dS = P (dP - D) are a (C, C) tile and (C, HB)
    tiles (``_channel_grads``), with dO = (1 - geff) W, V = x for A and dO = geff W, V = Y for B. dk and dx of a
    chunk's rows and of its held rows receive one atomic tile add per chunk (DKA, DX, DKB float32, zero on entry),
    where ``sparse_grads_kernel`` adds once per (row, slot).
    """
    c, bh, s, rows, rmask, rel = _chunk_of_program(START, H, n, C)
    ce = tl.arange(0, BE)
    w = _load_tile(W, bh, n, rows, rmask, ce, e)
    geff = _gate(G, bh, n, rows, rmask, rmask & (rel >= F0))
    if HAS_A:
        _channel_grads(QA, KA, X, LSEA, DA, DQA, DKA, DX, HELD, READS, (1.0 - geff)[:, None] * w, bh, s, n, c, rows,
                       rmask, tl.arange(0, BDA), da, ce, e, qk_scale2, scale, True, True, C, HM, HB, BDA, PREC)
    _channel_grads(QB, KB, Y, LSEB, DB, DQB, DKB, DKB, HELD, READS, geff[:, None] * w, bh, s, n, c, rows, rmask,
                   tl.arange(0, BDB), db, ce, e, qk_scale2, scale, False, False, C, HM, HB, BDB, PREC)


# ------------------------------------------------------------------------------------------------
# Decode


@triton.jit
def _load_head_vector(PTR, bh, cols, width):
    """The (width,) vector of head bh of a (BH, width) tensor as float32, 0 past width."""
    return tl.load(PTR + bh * width + cols, mask=cols < width, other=0.0).to(tl.float32)


@triton.jit
def _load_cache_rows(PTR, bh, S, slots, read, cols, width):
    """Rows ``slots`` of head bh of a (BH, S, width) cache as float32, 0 where not read or past width."""
    return tl.load(PTR + (bh * S + slots[:, None]) * width + cols[None, :],
                   mask=read[:, None] & (cols < width)[None, :], other=0.0).to(tl.float32)


@triton.jit
def decode_step_kernel(QA, KA, X, QB, G, DD, CKA, CKB, CV, CO, POS, RPOS, OFFS, Y, Z,
                       S, H, da, db, e, qk_scale2, W_LO, NSLOT,
                       BS: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BE: tl.constexpr,
                       MODE: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr, TIED: tl.constexpr):
    """One decode step for one (batch, head): the new token against the S rows of the layer's cache.

    Grid (BH,). Cache tensors are (B, H, S, w) contiguous, POS (B, S) the pattern position of each row
    (-1: not readable), RPOS (B,) the new token's pattern position r (negative on padding). Which
    rows are read (``ops.DecodeState.read_mask``): MODE 0 every row with POS >= 0; MODE 1 rows with
    POS >= r - W_LO (local attention, banded); MODE 2 rows with r - POS in OFFS[:NSLOT] (plain f-pattern).
    Channel A reads those rows plus the token itself (its key KA, value X); channel B those rows
    (keys CKB, outputs CO). Online softmax over blocks of BS rows, float32.
    Writes Y (BH, e) float32, 0 where r < 0, and (with B) what the cache keeps: Z = y unmasked, as
    ``recurrent_step`` stores it; TIED (no A): Z = z = geff R + (1 - geff) x and Y = z - DD x, both 0
    where r < 0.
    """
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    r = tl.load(RPOS + b)
    ce = tl.arange(0, BE)
    emask = ce < e
    x = _load_head_vector(X, bh, ce, e)
    if HAS_A:
        ca = tl.arange(0, BDA)
        qa = _load_head_vector(QA, bh, ca, da)
        ka = _load_head_vector(KA, bh, ca, da)
        m = _sum(qa * ka, 0) * qk_scale2
        l_sum = tl.full((), 1.0, tl.float32)
        acc = x
    if HAS_B:
        cb = tl.arange(0, BDB)
        qb = _load_head_vector(QB, bh, cb, db)
        mb = tl.full((), float("-inf"), tl.float32)
        lb = tl.full((), 0.0, tl.float32)
        accb = tl.full([BE], 0.0, tl.float32)
    for s0 in range(0, S, BS):
        sl = s0 + tl.arange(0, BS)
        smask = sl < S
        pos = tl.load(POS + b * S + sl, mask=smask, other=-1)
        read = smask & (pos >= 0)
        if MODE == 1:
            read = read & (pos >= r - W_LO)
        if MODE == 2:
            hit = pos < 0
            for k in range(0, NSLOT):
                hit = hit | ((r - pos) == tl.load(OFFS + k))
            read = read & hit
        if HAS_A:
            kk = _load_cache_rows(CKA, bh, S, sl, read, ca, da)
            vv = _load_cache_rows(CV, bh, S, sl, read, ce, e)
            sc = tl.where(read, _sum(qa[None, :] * kk, 1) * qk_scale2, float("-inf"))
            # m starts at the token's own score, finite: no -inf guard as in channel B.
            m_new = tl.maximum(m, _max(sc, 0))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(sc - m_new)
            l_sum = l_sum * alpha + _sum(p, 0)
            acc = acc * alpha + _sum(p[:, None] * vv, 0)
            m = m_new
        if HAS_B:
            kk = _load_cache_rows(CKB, bh, S, sl, read, cb, db)
            vv = _load_cache_rows(CO, bh, S, sl, read, ce, e)
            sc = tl.where(read, _sum(qb[None, :] * kk, 1) * qk_scale2, float("-inf"))
            mb_new = tl.maximum(mb, _max(sc, 0))
            m_use = tl.where(mb_new == float("-inf"), 0.0, mb_new)
            p = tl.exp2(sc - m_use)
            alpha = tl.exp2(mb - m_use)
            lb = lb * alpha + _sum(p, 0)
            accb = accb * alpha + _sum(p[:, None] * vv, 0)
            mb = mb_new
    live = r >= 0
    if HAS_B:
        hasb = lb > 0
        geff = tl.where(hasb, tl.load(G + bh).to(tl.float32), 0.0)
        rb = accb / tl.where(hasb, lb, 1.0)
        if TIED:
            z = geff * rb + (1.0 - geff) * x
            dd = tl.load(DD + bh).to(tl.float32)
            tl.store(Z + bh * e + ce, tl.where(live, z, 0.0), mask=emask)
            tl.store(Y + bh * e + ce, tl.where(live, z - dd * x, 0.0), mask=emask)
        else:
            y = (1.0 - geff) * (acc / l_sum) + geff * rb
            tl.store(Z + bh * e + ce, y, mask=emask)
            tl.store(Y + bh * e + ce, tl.where(live, y, 0.0), mask=emask)
    else:
        tl.store(Y + bh * e + ce, tl.where(live, acc / l_sum, 0.0), mask=emask)
