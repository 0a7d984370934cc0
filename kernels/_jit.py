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
def _slot_source(OFFS, STEPS, k, rel, live, prev, CE: tl.constexpr):
    """Pattern-relative source of slot k for rows at pattern positions ``rel`` (BLOCK,) int32.

    Returns (source, ok, raw): ``ok`` marks rows that read slot k (f(k) <= rel, and for
    cache-efficient patterns not a duplicate of slot k - 1); ``raw`` is the slot's position before
    de-duplication, to pass as ``prev`` for slot k + 1 (start with -1).
    """
    f = tl.load(OFFS + k)
    ok = live & (rel >= f)
    if CE:
        a = tl.load(STEPS + k)
        u = tl.where(ok, rel + 1 - f, 1)
        raw = a * ((u + a - 1) // a) - 1
        src = raw
        ok = ok & (raw != prev)
    else:
        raw = rel - f
        src = raw
    src = tl.where(ok, src, 0)
    return src, ok, raw


# ------------------------------------------------------------------------------------------------
# Dense kinds (attention, dense resolvent)


@triton.jit
def attn_fwd_kernel(Q, K, V, OUT, LSE, START, n, H, d, e, qk_scale2,
                    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                    PREC: tl.constexpr):
    """Causal softmax attention (the direct channel of dense kinds), FlashAttention-style.

    Grid (cdiv(n, BM), BH). Writes O = softmax(q k^T) v (BH, n, e) float32, 0 on padded rows, and the
    base-2 log-sum-exp LSE (BH, n) (0 on rows with nothing to read).
    """
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    s = tl.load(START + bh // H)
    rows = pid * BM + tl.arange(0, BM)
    cd = tl.arange(0, BD)
    ce = tl.arange(0, BE)
    rmask = rows < n
    q = tl.load(Q + bh * n * d + rows[:, None] * d + cd[None, :], mask=rmask[:, None] & (cd[None, :] < d), other=0.0)
    m = tl.full([BM], float("-inf"), tl.float32)
    l_sum = tl.full([BM], 0.0, tl.float32)
    acc = tl.full([BM, BE], 0.0, tl.float32)
    lo = (s // BN) * BN
    hi = tl.minimum((pid + 1) * BM, n)
    for j0 in range(lo, hi, BN):
        keys = j0 + tl.arange(0, BN)
        kmask = keys < n
        k = tl.load(K + bh * n * d + keys[:, None] * d + cd[None, :], mask=kmask[:, None] & (cd[None, :] < d),
                    other=0.0)
        v = tl.load(V + bh * n * e + keys[:, None] * e + ce[None, :], mask=kmask[:, None] & (ce[None, :] < e),
                    other=0.0)
        s2 = _dot(q, tl.trans(k), PREC) * qk_scale2
        ok = (keys[None, :] <= rows[:, None]) & (keys[None, :] >= s) & kmask[None, :]
        s2 = tl.where(ok, s2, float("-inf"))
        m_new = tl.maximum(m, _max(s2, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s2 - m_use[:, None])
        l_sum = l_sum * alpha + _sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC)
        m = m_new
    has = l_sum > 0
    l_safe = tl.where(has, l_sum, 1.0)
    out = tl.where(has[:, None], acc / l_safe[:, None], 0.0)
    tl.store(OUT + bh * n * e + rows[:, None] * e + ce[None, :], out, mask=rmask[:, None] & (ce[None, :] < e))
    tl.store(LSE + bh * n + rows, tl.where(has, m + tl.log2(l_safe), 0.0), mask=rmask)


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
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    s = tl.load(START + bh // H)
    keys = pid * BN + tl.arange(0, BN)
    cd = tl.arange(0, BD)
    ce = tl.arange(0, BE)
    kmask = keys < n
    kvalid = kmask & (keys >= s)
    k = tl.load(K + bh * n * d + keys[:, None] * d + cd[None, :], mask=kmask[:, None] & (cd[None, :] < d), other=0.0)
    v = tl.load(V + bh * n * e + keys[:, None] * e + ce[None, :], mask=kmask[:, None] & (ce[None, :] < e),
                other=0.0).to(VT)
    dk = tl.full([BN, BD], 0.0, tl.float32)
    dv = tl.full([BN, BE], 0.0, tl.float32)
    lo = ((pid * BN) // BM) * BM
    for i0 in range(lo, n, BM):
        rows = i0 + tl.arange(0, BM)
        rmask = rows < n
        q = tl.load(Q + bh * n * d + rows[:, None] * d + cd[None, :], mask=rmask[:, None] & (cd[None, :] < d),
                    other=0.0)
        w = tl.load(W + bh * n * e + rows[:, None] * e + ce[None, :], mask=rmask[:, None] & (ce[None, :] < e),
                    other=0.0)
        coef = tl.load(COEF + bh * n + rows, mask=rmask, other=0.0)
        delta = tl.load(DELTA + bh * n + rows, mask=rmask, other=0.0)
        lse = tl.load(LSE + bh * n + rows, mask=rmask, other=0.0)
        s2 = _dot(q, tl.trans(k), PREC) * qk_scale2
        if STRICT:
            causal = keys[None, :] < rows[:, None]
        else:
            causal = keys[None, :] <= rows[:, None]
        ok = causal & kvalid[None, :] & rmask[:, None]
        p = tl.exp2(tl.where(ok, s2 - lse[:, None], float("-inf")))
        do = (w * coef[:, None]).to(VT)
        if HAS_DV:
            dv += _dot(tl.trans(p).to(VT), do, PREC)
        dp = _dot(do, tl.trans(v), PREC)
        ds = p * (dp - delta[:, None])
        dk += _dot(tl.trans(ds).to(DT), q, PREC)
    tl.store(DK + bh * n * d + keys[:, None] * d + cd[None, :], dk * scale, mask=kmask[:, None] & (cd[None, :] < d))
    if HAS_DV:
        tl.store(DV + bh * n * e + keys[:, None] * e + ce[None, :], dv, mask=kmask[:, None] & (ce[None, :] < e))


@triton.jit
def attn_bwd_dq_kernel(Q, K, V, W, COEF, DELTA, LSE, DQ, START, n, H, d, e, qk_scale2, scale,
                       BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                       STRICT: tl.constexpr, PREC: tl.constexpr):
    """Query-side gradient of a causal softmax channel: dQ_i = scale sum_j dS_ij K_j (see dkdv kernel).

    Grid (cdiv(n, BM), BH). Writes float32 (BH, n, d).
    """
    DT = Q.dtype.element_ty  # q, k, dS operands: bf16 tensor cores for bf16 inputs
    VT = V.dtype.element_ty  # dO, V, P operands: float32 (tf32) when V is the solved Y
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    s = tl.load(START + bh // H)
    rows = pid * BM + tl.arange(0, BM)
    cd = tl.arange(0, BD)
    ce = tl.arange(0, BE)
    rmask = rows < n
    q = tl.load(Q + bh * n * d + rows[:, None] * d + cd[None, :], mask=rmask[:, None] & (cd[None, :] < d), other=0.0)
    w = tl.load(W + bh * n * e + rows[:, None] * e + ce[None, :], mask=rmask[:, None] & (ce[None, :] < e), other=0.0)
    coef = tl.load(COEF + bh * n + rows, mask=rmask, other=0.0)
    delta = tl.load(DELTA + bh * n + rows, mask=rmask, other=0.0)
    lse = tl.load(LSE + bh * n + rows, mask=rmask, other=0.0)
    do = (w * coef[:, None]).to(VT)
    dq = tl.full([BM, BD], 0.0, tl.float32)
    lo = (s // BN) * BN
    hi = tl.minimum((pid + 1) * BM, n)
    for j0 in range(lo, hi, BN):
        keys = j0 + tl.arange(0, BN)
        kmask = keys < n
        k = tl.load(K + bh * n * d + keys[:, None] * d + cd[None, :], mask=kmask[:, None] & (cd[None, :] < d),
                    other=0.0)
        v = tl.load(V + bh * n * e + keys[:, None] * e + ce[None, :], mask=kmask[:, None] & (ce[None, :] < e),
                    other=0.0).to(VT)
        s2 = _dot(q, tl.trans(k), PREC) * qk_scale2
        if STRICT:
            causal = keys[None, :] < rows[:, None]
        else:
            causal = keys[None, :] <= rows[:, None]
        ok = causal & kmask[None, :] & (keys[None, :] >= s) & rmask[:, None]
        p = tl.exp2(tl.where(ok, s2 - lse[:, None], float("-inf")))
        dp = _dot(do, tl.trans(v), PREC)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(DT), k, PREC)
    tl.store(DQ + bh * n * d + rows[:, None] * d + cd[None, :], dq * scale, mask=rmask[:, None] & (cd[None, :] < d))


@triton.jit
def dense_solve_fwd_kernel(QB, KB, OA, G, Y, R, LSEB, START, n, H, d, e, qk_scale2,
                           BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                           PREC: tl.constexpr, SOLVE_PREC: tl.constexpr):
    """Dense resolvent, forward: Y = (1 - geff) OA + geff softmax_{j<i}(qb_i . kb_j) Y_j, by blocks.

    Grid (BH,): one program walks the row blocks in order (block c needs Y of blocks < c). For block c:
    (1) online softmax of its B-queries over the keys of earlier blocks, accumulating the already
    solved Y (read back from the output buffer); (2) the in-block strictly lower scores, merged into
    the same running max / sum, which gives the full-row normaliser; (3) the in-block unit lower
    triangular system (I - geff Bt) Y_c = rhs, solved by repeated squaring (``_unit_lower_solve``).
    Writes Y and R = softmax(P^B) Y (BH, n, e) float32 and the base-2 log-sum-exp LSEB (BH, n).
    Memory beyond the inputs: O(n e) per (batch, head); nothing n x n.
    """
    bh = tl.program_id(0).to(tl.int64)
    s = tl.load(START + bh // H)
    ar = tl.arange(0, BLOCK)
    cd = tl.arange(0, BD)
    ce = tl.arange(0, BE)
    dmask = cd[None, :] < d
    emask = ce[None, :] < e
    lo = (s // BLOCK) * BLOCK
    for c0 in range(0, n, BLOCK):
        rows = c0 + ar
        rmask = rows < n
        rel = rows - s
        valid = rmask & (rel >= 0)
        hasb = rmask & (rel >= 1)
        q = tl.load(QB + bh * n * d + rows[:, None] * d + cd[None, :], mask=rmask[:, None] & dmask, other=0.0)
        g = tl.load(G + bh * n + rows, mask=rmask, other=0.0).to(tl.float32)
        geff = tl.where(hasb, g, 0.0)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        l_sum = tl.full([BLOCK], 0.0, tl.float32)
        acc = tl.full([BLOCK, BE], 0.0, tl.float32)
        for j0 in range(lo, c0, BLOCK):
            keys = j0 + ar
            k = tl.load(KB + bh * n * d + keys[:, None] * d + cd[None, :], mask=dmask, other=0.0)
            yv = tl.load(Y + bh * n * e + keys[:, None] * e + ce[None, :], mask=emask, other=0.0)
            s2 = _dot(q, tl.trans(k), PREC) * qk_scale2
            s2 = tl.where(keys[None, :] >= s, s2, float("-inf"))
            m_new = tl.maximum(m, _max(s2, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_use)
            p = tl.exp2(s2 - m_use[:, None])
            l_sum = l_sum * alpha + _sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p, yv, PREC)
            m = m_new
        # In-block scores (strictly lower), merged into the running normaliser.
        kc = tl.load(KB + bh * n * d + rows[:, None] * d + cd[None, :], mask=rmask[:, None] & dmask, other=0.0)
        s2 = _dot(q, tl.trans(kc), PREC) * qk_scale2
        ok = (ar[None, :] < ar[:, None]) & (rows[None, :] >= s) & rmask[None, :]
        s2 = tl.where(ok, s2, float("-inf"))
        m_new = tl.maximum(m, _max(s2, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s2 - m_use[:, None])
        l_sum = l_sum * alpha + _sum(p, 1)
        acc = acc * alpha[:, None]
        m = m_new
        has = l_sum > 0
        inv_l = tl.where(has, 1.0 / tl.where(has, l_sum, 1.0), 0.0)
        earlier = acc * inv_l[:, None]
        bt = p * inv_l[:, None]
        oa = tl.load(OA + bh * n * e + rows[:, None] * e + ce[None, :], mask=rmask[:, None] & emask,
                     other=0.0).to(tl.float32)
        rhs = (1.0 - geff)[:, None] * oa + geff[:, None] * earlier
        y = _unit_lower_solve(geff[:, None] * bt, rhs, LOG2_BLOCK, False, SOLVE_PREC)
        y = tl.where(valid[:, None], y, 0.0)
        r_read = earlier + _dot(bt, y, SOLVE_PREC)
        out_mask = rmask[:, None] & emask
        tl.store(Y + bh * n * e + rows[:, None] * e + ce[None, :], y, mask=out_mask)
        tl.store(R + bh * n * e + rows[:, None] * e + ce[None, :], r_read, mask=out_mask)
        tl.store(LSEB + bh * n + rows, tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), 0.0), mask=rmask)
        # Later blocks of this program read these rows of Y back from global memory.
        tl.debug_barrier()


@triton.jit
def dense_solve_bwd_kernel(QB, KB, OA, R, G, LSEB, DY, W, DA, DB, DG, START, n, H, d, e, qk_scale2,
                           BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                           PREC: tl.constexpr, SOLVE_PREC: tl.constexpr):
    """Dense resolvent, backward solve: W = (I - B)^-T dY by blocks, last block first.

    Grid (BH,). For block c (positions j): rhs = dY_c + sum over later blocks r of B_rc^T W_r, with
    B_rc = geff_i exp2(s2_ij - LSEB_i) recomputed from the scores (nothing n x n is stored); then
    W_c = (I - B_cc)^-T rhs with the transposed in-block solve. Also writes the row
    scalars of the attention-style gradients: DA = (1 - geff) W.OA, DB = geff W.R, and
    DG = dL/dg = W.(R - OA) on rows with a recurrent set (0 elsewhere).
    """
    bh = tl.program_id(0).to(tl.int64)
    s = tl.load(START + bh // H)
    ar = tl.arange(0, BLOCK)
    cd = tl.arange(0, BD)
    ce = tl.arange(0, BE)
    dmask = cd[None, :] < d
    emask = ce[None, :] < e
    nblk = (n + BLOCK - 1) // BLOCK
    for it in range(0, nblk):
        c0 = (nblk - 1 - it) * BLOCK
        cols = c0 + ar
        cmask = cols < n
        cvalid = cmask & (cols >= s)
        hasb_c = cmask & (cols - s >= 1)
        kc = tl.load(KB + bh * n * d + cols[:, None] * d + cd[None, :], mask=cmask[:, None] & dmask, other=0.0)
        rhs = tl.load(DY + bh * n * e + cols[:, None] * e + ce[None, :], mask=cvalid[:, None] & emask,
                      other=0.0).to(tl.float32)
        for r0 in range(c0 + BLOCK, n, BLOCK):
            rows = r0 + ar
            rmask = rows < n
            hasb_r = rmask & (rows - s >= 1)
            qr = tl.load(QB + bh * n * d + rows[:, None] * d + cd[None, :], mask=rmask[:, None] & dmask, other=0.0)
            lse_r = tl.load(LSEB + bh * n + rows, mask=rmask, other=0.0)
            geff_r = tl.where(hasb_r, tl.load(G + bh * n + rows, mask=rmask, other=0.0).to(tl.float32), 0.0)
            w_later = tl.load(W + bh * n * e + rows[:, None] * e + ce[None, :], mask=rmask[:, None] & emask,
                              other=0.0)
            s2 = _dot(qr, tl.trans(kc), PREC) * qk_scale2
            ok = cvalid[None, :] & hasb_r[:, None]
            pb = tl.exp2(tl.where(ok, s2 - lse_r[:, None], float("-inf"))) * geff_r[:, None]
            rhs += _dot(tl.trans(pb), w_later, PREC)
        qc = tl.load(QB + bh * n * d + cols[:, None] * d + cd[None, :], mask=cmask[:, None] & dmask, other=0.0)
        lse_c = tl.load(LSEB + bh * n + cols, mask=cmask, other=0.0)
        geff_c = tl.where(hasb_c, tl.load(G + bh * n + cols, mask=cmask, other=0.0).to(tl.float32), 0.0)
        s2 = _dot(qc, tl.trans(kc), PREC) * qk_scale2
        ok = (ar[None, :] < ar[:, None]) & cvalid[None, :] & hasb_c[:, None]
        bt = tl.exp2(tl.where(ok, s2 - lse_c[:, None], float("-inf")))
        w = _unit_lower_solve(geff_c[:, None] * bt, rhs, LOG2_BLOCK, True, SOLVE_PREC)
        w = tl.where(cvalid[:, None], w, 0.0)
        tl.store(W + bh * n * e + cols[:, None] * e + ce[None, :], w, mask=cmask[:, None] & emask)
        oa = tl.load(OA + bh * n * e + cols[:, None] * e + ce[None, :], mask=cmask[:, None] & emask,
                     other=0.0).to(tl.float32)
        rr = tl.load(R + bh * n * e + cols[:, None] * e + ce[None, :], mask=cmask[:, None] & emask, other=0.0)
        w_oa = _sum(w * oa, 1)
        w_rr = _sum(w * rr, 1)
        tl.store(DA + bh * n + cols, (1.0 - geff_c) * w_oa, mask=cmask)
        tl.store(DB + bh * n + cols, geff_c * w_rr, mask=cmask)
        tl.store(DG + bh * n + cols, tl.where(hasb_c, w_rr - w_oa, 0.0), mask=cmask)
        # Earlier blocks of this program read these rows of W back from global memory.
        tl.debug_barrier()


# ------------------------------------------------------------------------------------------------
# Sparse kinds (local attention, banded, diagonal, translation-invariant and cache-efficient f)


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
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    s = tl.load(START + bh // H)
    rows = pid * BM + tl.arange(0, BM)
    rmask = rows < n
    rel = rows - s
    valid = rmask & (rel >= 0)
    ce = tl.arange(0, BE)
    emask = ce[None, :] < e
    if HAS_A:
        ca = tl.arange(0, BDA)
        amask = ca[None, :] < da
        qa = tl.load(QA + bh * n * da + rows[:, None] * da + ca[None, :], mask=rmask[:, None] & amask,
                     other=0.0).to(tl.float32)
        ka = tl.load(KA + bh * n * da + rows[:, None] * da + ca[None, :], mask=rmask[:, None] & amask,
                     other=0.0).to(tl.float32)
        m = _sum(qa * ka, 1) * qk_scale2
        l_sum = tl.full([BM], 1.0, tl.float32)
        acc = tl.load(X + bh * n * e + rows[:, None] * e + ce[None, :], mask=rmask[:, None] & emask,
                      other=0.0).to(tl.float32)
    if HAS_B:
        cb = tl.arange(0, BDB)
        bmask = cb[None, :] < db
        qb = tl.load(QB + bh * n * db + rows[:, None] * db + cb[None, :], mask=rmask[:, None] & bmask,
                     other=0.0).to(tl.float32)
        mb = tl.full([BM], float("-inf"), tl.float32)
        lb = tl.full([BM], 0.0, tl.float32)
    prev = tl.full([BM], -1, tl.int32)
    for k in range(0, NSLOT):
        src, ok, prev = _slot_source(OFFS, STEPS, k, rel, valid, prev, CE)
        src = src + s
        if HAS_A:
            kk = tl.load(KA + bh * n * da + src[:, None] * da + ca[None, :], mask=ok[:, None] & amask,
                         other=0.0).to(tl.float32)
            xk = tl.load(X + bh * n * e + src[:, None] * e + ce[None, :], mask=ok[:, None] & emask,
                         other=0.0).to(tl.float32)
            sk = tl.where(ok, _sum(qa * kk, 1) * qk_scale2, float("-inf"))
            m_new = tl.maximum(m, sk)
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(sk - m_new)
            l_sum = l_sum * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * xk
            m = m_new
        if HAS_B:
            kk = tl.load(KB + bh * n * db + src[:, None] * db + cb[None, :], mask=ok[:, None] & bmask,
                         other=0.0).to(tl.float32)
            sk = tl.where(ok, _sum(qb * kk, 1) * qk_scale2, float("-inf"))
            mb_new = tl.maximum(mb, sk)
            m_use = tl.where(mb_new == float("-inf"), 0.0, mb_new)
            lb = lb * tl.exp2(mb - m_use) + tl.exp2(sk - m_use)
            mb = mb_new
    if HAS_A:
        out = tl.where(valid[:, None], acc / l_sum[:, None], 0.0)
        tl.store(OA + bh * n * e + rows[:, None] * e + ce[None, :], out, mask=rmask[:, None] & emask)
        tl.store(LSEA + bh * n + rows, m + tl.log2(l_sum), mask=rmask)
    if HAS_B:
        has = lb > 0
        tl.store(LSEB + bh * n + rows, tl.where(has, mb + tl.log2(tl.where(has, lb, 1.0)), 0.0), mask=rmask)


@triton.jit
def sparse_solve_fwd_kernel(QB, KB, OA, G, LSEB, Y, R, START, OFFS, STEPS, NSLOT, F0, n, H, d, e, qk_scale2,
                            BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                            CE: tl.constexpr, SOLVE_PREC: tl.constexpr):
    """Sparse patterns, forward solve: Y = (1 - geff) OA + geff sum_slots softmax(qb . kb) Y[src].

    Grid (BH,); row blocks in order. Slots whose source lies in an earlier block gather the solved
    Y rows; slots inside the block fill a (BLOCK, BLOCK) strictly lower tile that is then solved as
    in the dense kernel. F0 = f(0): rows with rel < F0 have no recurrent set (geff = 0).
    Writes Y and R = softmax(P^B) Y (BH, n, e) float32. O(n (BLOCK + K) e) work.
    """
    bh = tl.program_id(0).to(tl.int64)
    s = tl.load(START + bh // H)
    ar = tl.arange(0, BLOCK)
    cd = tl.arange(0, BD)
    ce = tl.arange(0, BE)
    dmask = cd[None, :] < d
    emask = ce[None, :] < e
    for c0 in range(0, n, BLOCK):
        rows = c0 + ar
        rmask = rows < n
        rel = rows - s
        valid = rmask & (rel >= 0)
        hasb = valid & (rel >= F0)
        q = tl.load(QB + bh * n * d + rows[:, None] * d + cd[None, :], mask=rmask[:, None] & dmask,
                    other=0.0).to(tl.float32)
        lse = tl.load(LSEB + bh * n + rows, mask=rmask, other=0.0)
        geff = tl.where(hasb, tl.load(G + bh * n + rows, mask=rmask, other=0.0).to(tl.float32), 0.0)
        earlier = tl.full([BLOCK, BE], 0.0, tl.float32)
        bt = tl.full([BLOCK, BLOCK], 0.0, tl.float32)
        prev = tl.full([BLOCK], -1, tl.int32)
        for k in range(0, NSLOT):
            src, ok, prev = _slot_source(OFFS, STEPS, k, rel, valid, prev, CE)
            src = src + s
            kk = tl.load(KB + bh * n * d + src[:, None] * d + cd[None, :], mask=ok[:, None] & dmask,
                         other=0.0).to(tl.float32)
            p = tl.exp2(tl.where(ok, _sum(q * kk, 1) * qk_scale2 - lse, float("-inf")))
            early = ok & (src < c0)
            yk = tl.load(Y + bh * n * e + src[:, None] * e + ce[None, :], mask=early[:, None] & emask, other=0.0)
            earlier += tl.where(early, p, 0.0)[:, None] * yk
            inside = ok & (src >= c0)
            bt += tl.where((ar[None, :] == (src - c0)[:, None]) & inside[:, None], p[:, None], 0.0)
        oa = tl.load(OA + bh * n * e + rows[:, None] * e + ce[None, :], mask=rmask[:, None] & emask,
                     other=0.0).to(tl.float32)
        rhs = (1.0 - geff)[:, None] * oa + geff[:, None] * earlier
        y = _unit_lower_solve(geff[:, None] * bt, rhs, LOG2_BLOCK, False, SOLVE_PREC)
        y = tl.where(valid[:, None], y, 0.0)
        r_read = earlier + _dot(bt, y, SOLVE_PREC)
        out_mask = rmask[:, None] & emask
        tl.store(Y + bh * n * e + rows[:, None] * e + ce[None, :], y, mask=out_mask)
        tl.store(R + bh * n * e + rows[:, None] * e + ce[None, :], r_read, mask=out_mask)
        tl.debug_barrier()


@triton.jit
def sparse_solve_bwd_kernel(QB, KB, OA, R, G, LSEB, DY, GACC, W, DA, DB, DG, START, OFFS, STEPS, NSLOT, F0,
                            n, H, d, e, qk_scale2,
                            BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                            CE: tl.constexpr, SOLVE_PREC: tl.constexpr):
    """Sparse patterns, backward solve: W = (I - B)^-T dY, last block first.

    Grid (BH,). GACC (BH, n, e) float32, zero on entry, collects B^T W from later blocks: once W_c is
    solved, every slot of block c whose source lies in an earlier block adds B_ij W_i to GACC[j]
    (atomic adds: two rows may share a source). Block c's right-hand side is dY_c + GACC_c, and
    W_c = (I - B_cc)^-T rhs. Row scalars DA, DB, DG as in the dense backward solve.
    """
    bh = tl.program_id(0).to(tl.int64)
    s = tl.load(START + bh // H)
    ar = tl.arange(0, BLOCK)
    cd = tl.arange(0, BD)
    ce = tl.arange(0, BE)
    dmask = cd[None, :] < d
    emask = ce[None, :] < e
    nblk = (n + BLOCK - 1) // BLOCK
    for it in range(0, nblk):
        c0 = (nblk - 1 - it) * BLOCK
        rows = c0 + ar
        rmask = rows < n
        rel = rows - s
        valid = rmask & (rel >= 0)
        hasb = valid & (rel >= F0)
        q = tl.load(QB + bh * n * d + rows[:, None] * d + cd[None, :], mask=rmask[:, None] & dmask,
                    other=0.0).to(tl.float32)
        lse = tl.load(LSEB + bh * n + rows, mask=rmask, other=0.0)
        geff = tl.where(hasb, tl.load(G + bh * n + rows, mask=rmask, other=0.0).to(tl.float32), 0.0)
        row_e = bh * n * e + rows[:, None] * e + ce[None, :]
        rhs = tl.load(DY + row_e, mask=valid[:, None] & emask, other=0.0).to(tl.float32)
        # GACC was written with atomics (at L2): bypass L1, which may hold a stale line shared with a
        # row of the next block when rows are not a multiple of 128 bytes.
        rhs += tl.load(GACC + row_e, mask=rmask[:, None] & emask, other=0.0, cache_modifier=".cg")
        bt = tl.full([BLOCK, BLOCK], 0.0, tl.float32)
        prev = tl.full([BLOCK], -1, tl.int32)
        for k in range(0, NSLOT):
            src, ok, prev = _slot_source(OFFS, STEPS, k, rel, valid, prev, CE)
            src = src + s
            inside = ok & (src >= c0)
            kk = tl.load(KB + bh * n * d + src[:, None] * d + cd[None, :], mask=inside[:, None] & dmask,
                         other=0.0).to(tl.float32)
            p = tl.exp2(tl.where(inside, _sum(q * kk, 1) * qk_scale2 - lse, float("-inf")))
            bt += tl.where(ar[None, :] == (src - c0)[:, None], p[:, None], 0.0)
        w = _unit_lower_solve(geff[:, None] * bt, rhs, LOG2_BLOCK, True, SOLVE_PREC)
        w = tl.where(valid[:, None], w, 0.0)
        tl.store(W + row_e, w, mask=rmask[:, None] & emask)
        oa = tl.load(OA + row_e, mask=rmask[:, None] & emask, other=0.0).to(tl.float32)
        rr = tl.load(R + row_e, mask=rmask[:, None] & emask, other=0.0)
        w_oa = _sum(w * oa, 1)
        w_rr = _sum(w * rr, 1)
        tl.store(DA + bh * n + rows, (1.0 - geff) * w_oa, mask=rmask)
        tl.store(DB + bh * n + rows, geff * w_rr, mask=rmask)
        tl.store(DG + bh * n + rows, tl.where(hasb, w_rr - w_oa, 0.0), mask=rmask)
        # Scatter B_ij W_i to the sources j of earlier blocks.
        prev = tl.full([BLOCK], -1, tl.int32)
        for k in range(0, NSLOT):
            src, ok, prev = _slot_source(OFFS, STEPS, k, rel, valid, prev, CE)
            src = src + s
            early = ok & (src < c0)
            kk = tl.load(KB + bh * n * d + src[:, None] * d + cd[None, :], mask=early[:, None] & dmask,
                         other=0.0).to(tl.float32)
            p = tl.exp2(tl.where(early, _sum(q * kk, 1) * qk_scale2 - lse, float("-inf")))
            tl.atomic_add(GACC + bh * n * e + src[:, None] * e + ce[None, :], (geff * p)[:, None] * w,
                          mask=early[:, None] & emask)
        tl.debug_barrier()


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
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    s = tl.load(START + bh // H)
    rows = pid * BM + tl.arange(0, BM)
    rmask = rows < n
    rel = rows - s
    valid = rmask & (rel >= 0)
    ce = tl.arange(0, BE)
    emask = ce[None, :] < e
    w = tl.load(W + bh * n * e + rows[:, None] * e + ce[None, :], mask=rmask[:, None] & emask, other=0.0)
    if HAS_B:
        hasb = valid & (rel >= F0)
        geff = tl.where(hasb, tl.load(G + bh * n + rows, mask=rmask, other=0.0).to(tl.float32), 0.0)
        cb = tl.arange(0, BDB)
        bmask = cb[None, :] < db
        qb = tl.load(QB + bh * n * db + rows[:, None] * db + cb[None, :], mask=rmask[:, None] & bmask,
                     other=0.0).to(tl.float32)
        lseb = tl.load(LSEB + bh * n + rows, mask=rmask, other=0.0)
        delta_b = tl.load(DB + bh * n + rows, mask=rmask, other=0.0)
        dqb = tl.full([BM, BDB], 0.0, tl.float32)
    else:
        geff = tl.full([BM], 0.0, tl.float32)
    if HAS_A:
        ca = tl.arange(0, BDA)
        amask = ca[None, :] < da
        qa = tl.load(QA + bh * n * da + rows[:, None] * da + ca[None, :], mask=rmask[:, None] & amask,
                     other=0.0).to(tl.float32)
        lsea = tl.load(LSEA + bh * n + rows, mask=rmask, other=0.0)
        delta_a = tl.load(DA + bh * n + rows, mask=rmask, other=0.0)
        do_a = w * (1.0 - geff)[:, None]
        ka = tl.load(KA + bh * n * da + rows[:, None] * da + ca[None, :], mask=rmask[:, None] & amask,
                     other=0.0).to(tl.float32)
        xs = tl.load(X + bh * n * e + rows[:, None] * e + ce[None, :], mask=rmask[:, None] & emask,
                     other=0.0).to(tl.float32)
        p0 = tl.exp2(tl.where(valid, _sum(qa * ka, 1) * qk_scale2 - lsea, float("-inf")))
        ds0 = p0 * (_sum(do_a * xs, 1) - delta_a)
        dqa = ds0[:, None] * ka
        tl.atomic_add(DKA + bh * n * da + rows[:, None] * da + ca[None, :], ds0[:, None] * qa * scale,
                      mask=valid[:, None] & amask)
        tl.atomic_add(DX + bh * n * e + rows[:, None] * e + ce[None, :], p0[:, None] * do_a,
                      mask=valid[:, None] & emask)
    prev = tl.full([BM], -1, tl.int32)
    for k in range(0, NSLOT):
        src, ok, prev = _slot_source(OFFS, STEPS, k, rel, valid, prev, CE)
        src = src + s
        if HAS_A:
            kk = tl.load(KA + bh * n * da + src[:, None] * da + ca[None, :], mask=ok[:, None] & amask,
                         other=0.0).to(tl.float32)
            xk = tl.load(X + bh * n * e + src[:, None] * e + ce[None, :], mask=ok[:, None] & emask,
                         other=0.0).to(tl.float32)
            p = tl.exp2(tl.where(ok, _sum(qa * kk, 1) * qk_scale2 - lsea, float("-inf")))
            ds = p * (_sum(do_a * xk, 1) - delta_a)
            dqa += ds[:, None] * kk
            tl.atomic_add(DKA + bh * n * da + src[:, None] * da + ca[None, :], ds[:, None] * qa * scale,
                          mask=ok[:, None] & amask)
            tl.atomic_add(DX + bh * n * e + src[:, None] * e + ce[None, :], p[:, None] * do_a,
                          mask=ok[:, None] & emask)
        if HAS_B:
            kk = tl.load(KB + bh * n * db + src[:, None] * db + cb[None, :], mask=ok[:, None] & bmask,
                         other=0.0).to(tl.float32)
            yk = tl.load(Y + bh * n * e + src[:, None] * e + ce[None, :], mask=ok[:, None] & emask, other=0.0)
            p = tl.exp2(tl.where(ok, _sum(qb * kk, 1) * qk_scale2 - lseb, float("-inf")))
            ds = p * (geff * _sum(w * yk, 1) - delta_b)
            dqb += ds[:, None] * kk
            tl.atomic_add(DKB + bh * n * db + src[:, None] * db + cb[None, :], ds[:, None] * qb * scale,
                          mask=ok[:, None] & bmask)
    if HAS_A:
        tl.store(DQA + bh * n * da + rows[:, None] * da + ca[None, :], dqa * scale, mask=rmask[:, None] & amask)
    if HAS_B:
        tl.store(DQB + bh * n * db + rows[:, None] * db + cb[None, :], dqb * scale, mask=rmask[:, None] & bmask)


# ------------------------------------------------------------------------------------------------
# Decode


@triton.jit
def decode_step_kernel(QA, KA, X, QB, G, DD, CKA, CKB, CV, CO, POS, RPOS, OFFS, Y, Z,
                       S, H, da, db, e, qk_scale2, W_LO, NSLOT,
                       BS: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BE: tl.constexpr,
                       MODE: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr, TIED: tl.constexpr):
    """One decode step for one (batch, head): the new token against the S rows of the layer's cache.

    Grid (BH,). Cache tensors are (B, H, S, w) contiguous, POS (B, S) the pattern position of each row
    (-1: not readable), RPOS (B,) the new token's pattern position r (negative on padding). Which
    rows are read (``ops.recurrent._read_mask``): MODE 0 every row with POS >= 0; MODE 1 rows with
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
    x = tl.load(X + bh * e + ce, mask=emask, other=0.0).to(tl.float32)
    if HAS_A:
        ca = tl.arange(0, BDA)
        amask = ca < da
        qa = tl.load(QA + bh * da + ca, mask=amask, other=0.0).to(tl.float32)
        ka = tl.load(KA + bh * da + ca, mask=amask, other=0.0).to(tl.float32)
        m = _sum(qa * ka, 0) * qk_scale2
        l_sum = tl.full((), 1.0, tl.float32)
        acc = x
    if HAS_B:
        cb = tl.arange(0, BDB)
        bmask = cb < db
        qb = tl.load(QB + bh * db + cb, mask=bmask, other=0.0).to(tl.float32)
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
            kk = tl.load(CKA + (bh * S + sl[:, None]) * da + ca[None, :], mask=read[:, None] & amask[None, :],
                         other=0.0).to(tl.float32)
            vv = tl.load(CV + (bh * S + sl[:, None]) * e + ce[None, :], mask=read[:, None] & emask[None, :],
                         other=0.0).to(tl.float32)
            sc = tl.where(read, _sum(qa[None, :] * kk, 1) * qk_scale2, float("-inf"))
            m_new = tl.maximum(m, _max(sc, 0))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(sc - m_new)
            l_sum = l_sum * alpha + _sum(p, 0)
            acc = acc * alpha + _sum(p[:, None] * vv, 0)
            m = m_new
        if HAS_B:
            kk = tl.load(CKB + (bh * S + sl[:, None]) * db + cb[None, :], mask=read[:, None] & bmask[None, :],
                         other=0.0).to(tl.float32)
            vv = tl.load(CO + (bh * S + sl[:, None]) * e + ce[None, :], mask=read[:, None] & emask[None, :],
                         other=0.0).to(tl.float32)
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
