"""What every Triton kernel of the resolvent mixer shares: the conventions below, reductions and products that run
the same under the interpreter, tile addressing, softmax pieces, and the scheduling of the solves (dense and
sparse). One module per op holds the ``@triton.jit`` code of that op: ``attention``, ``dense_solve`` (blocked and
chunked), ``sparse_solve``, ``sparse_chunked``, ``decode_step``, ``rope`` and ``gate``.

This package is not imported as a normal one: :func:`hf_resolvent.backends.triton._loader.jit_module` loads it
once per Triton mode (compiled for the GPU, or through the interpreter when ``TRITON_INTERPRET=1``), because
``triton.jit`` picks the mode when a function is decorated; the op modules import these helpers relatively, so each
mode's kernels call that mode's helpers.

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
# accumulation (products of bf16 values are exact in float32). This package is loaded once per mode.
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
def _chunk_tile_ptrs(PTR, bh, n, c, h0, C: tl.constexpr, WIDTH: tl.constexpr, HB: tl.constexpr):
    """Pointers to columns h0 .. h0 + HB - 1 of block c's (C, WIDTH) tile of head bh in PTR (BH, cdiv(n, C), C,
    WIDTH): J_c (WIDTH = HM) or the block's inverse T_c (WIDTH = HB = C)."""
    nc = (n + C - 1) // C
    # The tile's start as one scalar and its offsets in int32: int64 addresses per element spilled more at the stores
    # of the chunked kernels on sm_90.
    return PTR + (bh * nc + c) * (C * WIDTH) + (tl.arange(0, C)[:, None] * WIDTH + h0 + tl.arange(0, HB)[None, :])
