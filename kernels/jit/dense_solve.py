"""The dense resolvent's solve Y = (I - B)^-1 Z and its transpose: blocked (one program per row block, each
solving its block against every earlier one as they are published) and chunked (``BlockConfig.dense_solver =
"chunked"``: the blocks' inverses in parallel, then only the carry between neighbouring blocks in order).

Conventions: :mod:`.common`.
"""

import math

import torch
import triton
import triton.language as tl

from .. import launching
from ..cost import F32
from .common import (
    _as_read,
    _chunk_tile_ptrs,
    _claimed_block,
    _dot,
    _exp2_where,
    _gate,
    _load_row_scalars,
    _load_solved_tile,
    _load_tile,
    _log_sum_exp2,
    _online_softmax,
    _publish_solved,
    _row_ptrs,
    _solve_forward_block,
    _solved_count,
    _store_w_and_row_grads,
    _tile_mask,
    _tile_ptrs,
    _unit_lower_inverse,
    _unit_lower_solve,
    _wait_solved,
)


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
# Launchers (tensors flattened to (B * H, n, w) contiguous; ``launching.LaunchShapes`` gives the sizes). The
# forwards return what the backwards read in ``saved``: R, LSEB, the solved rows' copy (YREAD) and the block
# inverses, beside the direct channel's OA.


def _copies(cfg, qb) -> bool:
    """The solves also write their solved rows in the input dtype (``BlockConfig.solved_copy``, 16-bit inputs)."""
    return cfg.solved_copy and qb.dtype != torch.float32


def _forward(kernel, block: int, qb, kb, oa, g, start, sh, cfg, **chunked):
    dev, BH, n, e = oa.device, sh.BH, sh.n, sh.e
    y, r, lseb = (launching.new_buffer(shape, dev) for shape in ((BH, n, e), (BH, n, e), (BH, n)))
    copy = _copies(cfg, qb)
    y_read = launching.new_buffer((BH, n, e), dev, dtype=qb.dtype) if copy else y
    kernel[launching.solve_grid(n, BH, block)](
        qb, kb, oa, g, y, y_read, r, lseb, start, launching.progress_buffer(BH, dev), n, sh.H, sh.db, e,
        sh.qk_scale2, **chunked, BLOCK=block, LOG2_BLOCK=int(math.log2(block)), BD=launching.tile_width(sh.db),
        BE=launching.tile_width(e), COPY=copy, PREC=sh.prec, SOLVE_PREC=launching.SOLVE_PREC,
        num_warps=cfg.solve_warps, num_stages=cfg.solve_stages)
    return y, dict(r=r, lseb=lseb, y_read=y_read if copy else None, inverses=chunked.get("TINV"))


def blocked_forward(qb, kb, oa, g, start, sh, cfg, keep_inverses: bool):
    """Y = (I - B)^-1 ((1 - geff) OA) in blocks of ``cfg.solve`` rows, each against every earlier block."""
    return _forward(dense_solve_fwd_kernel, cfg.solve, qb, kb, oa, g, start, sh, cfg)


def chunked_forward(qb, kb, oa, g, start, sh, cfg, keep_inverses: bool):
    """As :func:`blocked_forward` in blocks of ``cfg.chunk`` rows, keeping each block's inverse for the backward
    where one follows."""
    inverses = launching.block_inverses(sh.BH, sh.n, cfg.chunk, oa.device) if keep_inverses else None
    return _forward(dense_chunk_fwd_kernel, cfg.chunk, qb, kb, oa, g, start, sh, cfg, TINV=inverses,
                    SAVE_INVERSE=keep_inverses)


def _backward(kernel, block: int, dy, qb, kb, g, start, saved, sh, cfg, **chunked):
    dev, BH, n, e = dy.device, sh.BH, sh.n, sh.e
    w = launching.new_buffer((BH, n, e), dev)
    da, db, dg = (launching.new_buffer((BH, n), dev) for _ in range(3))
    copy = _copies(cfg, qb)
    w_read = launching.new_buffer((BH, n, e), dev, dtype=qb.dtype) if copy else w
    kernel[launching.solve_grid(n, BH, block)](
        qb, kb, saved["oa"], saved["r"], g, saved["lseb"], dy, w, w_read, da, db, dg, start,
        launching.progress_buffer(BH, dev),
        n, sh.H, sh.db, e, sh.qk_scale2, **chunked, BLOCK=block, LOG2_BLOCK=int(math.log2(block)),
        BD=launching.tile_width(sh.db), BE=launching.tile_width(e), COPY=copy, PREC=sh.prec,
        SOLVE_PREC=launching.SOLVE_PREC, num_warps=cfg.solve_warps, num_stages=cfg.solve_stages)
    return w, da, db, dg


def blocked_backward(dy, qb, kb, g, start, saved, sh, cfg):
    """W = (I - B)^-T dY, last block first, and the row scalars DA = (1 - geff) W.OA, DB = geff W.R, DG."""
    return _backward(dense_solve_bwd_kernel, cfg.solve, dy, qb, kb, g, start, saved, sh, cfg)


def chunked_backward(dy, qb, kb, g, start, saved, sh, cfg):
    """As :func:`blocked_backward` in blocks of ``cfg.chunk`` rows, with the inverses the forward kept."""
    return _backward(dense_chunk_bwd_kernel, cfg.chunk, dy, qb, kb, g, start, saved, sh, cfg,
                     TINV=saved["inverses"])


# ------------------------------------------------------------------------------------------------
# Cost model (``cost.launch_cost``): each takes a recorded launch and a ``cost.Cost``, returns its chain steps


def dense_chunk_counts(nblk: int, in_flight: int, backward: bool) -> dict:
    """Per head, the (BLOCK x BLOCK) score products and the tiles of the chunked dense solves, block by block as
    the kernels run them (products on masked, all-zero tiles run all the same; masked loads move nothing).

    Forward, block c with u of the blocks before c - 1 not yet published when it starts (``in_flight`` blocks in
    flight, c - 1 included): the scores of every earlier block and of its own once, those of the u blocks and of
    block c - 1 a second time (the first pass only builds the normaliser): c + u + 2 score products; c products
    P.Y (one per earlier block), of which the c - 1 over the blocks before c - 1 read YREAD (``read_products``,
    one YREAD tile each) and the one with block c - 1, R's, reads Y; c + u + 2 key tiles, c solved Y tiles. Block
    0 scores itself and an empty block before it and runs its P.Y with Y on zeros. Backward, block at solve
    position o (0 the last block): B_rc^T W_r for the o - 1 later blocks but the next, each reading a WREAD tile
    (``read_products``), and the next block's scores (its rows' q, lse, gate and W itself loaded for o >= 1): o - 1
    + 1 score products and o - 1 products with W (the block's own scores are in T_c, which the forward saved)."""
    counts = dict(scores=0, value_products=0, read_products=0, key_tiles=0, solved_tiles=0, later_rows=0)
    for c in range(nblk):
        if backward:
            later = max(c - 1, 0)  # c is the solve position here
            counts["scores"] += later + 1
            counts["value_products"] += later
            counts["read_products"] += later
            counts["later_rows"] += later + (c >= 1)
            counts["solved_tiles"] += later + (c >= 1)
        elif c == 0:
            counts["scores"] += 2
            counts["value_products"] += 1
            counts["key_tiles"] += 1
        else:
            u = min(in_flight, c) - 1
            counts["scores"] += c + u + 2
            counts["value_products"] += c
            counts["read_products"] += c - 1
            counts["key_tiles"] += c + u + 2
            counts["solved_tiles"] += c
    return counts


def dense_chunk_fwd_cost(launch, cost, pattern, in_flight) -> int:
    a, c = launch.args, launch.constexprs
    B, BE, QB, d, e, n = c["BLOCK"], c["BE"], a["QB"], a["d"], a["e"], a["n"]
    programs, nblk = launch.grid[0], launching.cdiv(n, B)
    k = {key: v * QB.shape[0] for key, v in dense_chunk_counts(nblk, in_flight, backward=False).items()}
    y_read = a["YREAD"]
    cost.dot(k["scores"], B, B, c["BD"], QB.dtype, c["PREC"])
    # P Y over every earlier block with YREAD's operands (16-bit with COPY): the blocks before c - 1 read YREAD,
    # R's P Y_(c-1) reads Y rounded alike
    cost.dot(k["value_products"], B, BE, B, y_read.dtype, c["PREC"])
    # T_c formed and applied to the rhs and to the block before's probabilities, then the product after the wait
    cost.inverse_applied(programs, B, c["LOG2_BLOCK"], (BE, B), c["SOLVE_PREC"])
    cost.dot(programs, B, BE, B, torch.float32, c["SOLVE_PREC"])
    cost.move(programs * B, a["G"])
    if c["SAVE_INVERSE"]:
        cost.move(programs * B, a["TINV"], B)  # T_c stored for the backward
    cost.move(programs * B, QB, d)
    cost.dot(programs, B, BE, B, y_read.dtype, c["PREC"])  # R's in-block part, as R's other terms
    cost.move(k["key_tiles"] * B, a["KB"], d)
    cost.move(k["read_products"] * B, y_read, e)  # solved rows of the blocks before c - 1
    cost.move((k["solved_tiles"] - k["read_products"]) * B, width=e, elem=F32)  # Y of block c - 1
    cost.move(programs * B, a["OA"], e)
    cost.move(programs * B, width=2 * e + 1, elem=F32)  # Y, R, LSEB
    if c["COPY"]:
        cost.move(programs * B, y_read, e)  # the copy of Y stored
    return nblk


def dense_chunk_bwd_cost(launch, cost, pattern, in_flight) -> int:
    a, c = launch.args, launch.constexprs
    B, BE, QB, d, e, n = c["BLOCK"], c["BE"], a["QB"], a["d"], a["e"], a["n"]
    programs, nblk = launch.grid[0], launching.cdiv(n, B)
    k = {key: v * QB.shape[0] for key, v in dense_chunk_counts(nblk, in_flight, backward=True).items()}
    w_read = a["WREAD"]
    cost.dot(k["scores"], B, B, c["BD"], QB.dtype, c["PREC"])
    # B^T W over the later blocks but c + 1 with WREAD's operands (16-bit with COPY)
    cost.dot(k["read_products"], B, BE, B, w_read.dtype, c["PREC"])
    # T_c as the forward saved it, applied to the rhs and to the block after's probabilities; the product after
    # the wait
    cost.applied(programs, B, (BE, B), c["SOLVE_PREC"])
    cost.dot(programs, B, BE, B, torch.float32, c["SOLVE_PREC"])
    cost.move(programs * B, a["G"])
    cost.move(programs * B, a["TINV"], B)  # T_c loaded
    cost.move(programs * B, a["KB"], d)
    cost.move(programs * B, a["DY"], e)
    cost.move(k["later_rows"] * B, QB, d)
    cost.move(k["later_rows"] * B, a["G"])
    cost.move(k["later_rows"] * B, width=1, elem=F32)  # LSEB of later blocks
    cost.move(k["read_products"] * B, w_read, e)  # solved rows of the later blocks but c + 1
    cost.move((k["solved_tiles"] - k["read_products"]) * B, width=e, elem=F32)  # W of block c + 1
    cost.move(programs * B, width=2 * e, elem=F32)  # OA, R
    cost.move(programs * B, width=e + 3, elem=F32)  # W, DA, DB, DG
    if c["COPY"]:
        cost.move(programs * B, w_read, e)  # the copy of W stored
    return nblk


def dense_solve_fwd_cost(launch, cost, pattern, in_flight) -> int:
    a, c = launch.args, launch.constexprs
    B, BE, QB, d, e, n = c["BLOCK"], c["BE"], a["QB"], a["d"], a["e"], a["n"]
    programs, nblk = launch.grid[0], launching.cdiv(n, B)
    pairs = nblk * (nblk - 1) // 2 * QB.shape[0]  # (block, earlier block) pairs
    cost.move(programs * B, QB, d)
    cost.move(programs * B, a["G"])
    cost.move(programs * B, a["KB"], d)  # in-block keys
    cost.move(programs * B, a["OA"], e)
    cost.move(pairs * B, a["KB"], d)
    # Earlier blocks' solved rows come from YREAD: Y itself, or with COPY its copy in the input dtype, which the
    # launch also stores.
    y_read = a["YREAD"]
    cost.move(pairs * B, y_read, e)
    cost.move(programs * B, width=2 * e + 1, elem=F32)  # Y, R, LSEB
    if c["COPY"]:
        cost.move(programs * B, y_read, e)
    cost.dot(pairs + programs, B, B, c["BD"], QB.dtype, c["PREC"])
    cost.dot(pairs, B, BE, B, y_read.dtype, c["PREC"])  # P Y
    cost.solve_block(programs, B, c["LOG2_BLOCK"], BE, c["SOLVE_PREC"])
    cost.dot(programs, B, BE, B, y_read.dtype, c["PREC"])  # R's in-block part, as R's other terms
    return nblk


def dense_solve_bwd_cost(launch, cost, pattern, in_flight) -> int:
    a, c = launch.args, launch.constexprs
    B, BE, QB, d, e, n = c["BLOCK"], c["BE"], a["QB"], a["d"], a["e"], a["n"]
    programs, nblk = launch.grid[0], launching.cdiv(n, B)
    pairs = nblk * (nblk - 1) // 2 * QB.shape[0]  # (block, later block) pairs
    cost.move(programs * B, a["KB"], d)
    cost.move(programs * B, a["DY"], e)
    cost.move(pairs * B, QB, d)
    cost.move(pairs * B, a["G"])
    cost.move(pairs * B, width=1, elem=F32)  # LSEB of later blocks
    # Later blocks' solved rows come from WREAD: W itself, or with COPY its copy in the input dtype, which the
    # launch also stores.
    w_read = a["WREAD"]
    cost.move(pairs * B, w_read, e)
    cost.move(programs * B, QB, d)
    cost.move(programs * B, a["G"])
    cost.move(programs * B, width=1 + 2 * e, elem=F32)  # LSEB, OA, R
    cost.move(programs * B, width=e + 3, elem=F32)  # W, DA, DB, DG
    if c["COPY"]:
        cost.move(programs * B, w_read, e)
    cost.dot(pairs + programs, B, B, c["BD"], QB.dtype, c["PREC"])
    cost.dot(pairs, B, BE, B, w_read.dtype, c["PREC"])  # B^T W
    cost.solve_block(programs, B, c["LOG2_BLOCK"], BE, c["SOLVE_PREC"])
    return nblk


COSTS = {"dense_solve_fwd_kernel": dense_solve_fwd_cost, "dense_solve_bwd_kernel": dense_solve_bwd_cost,
         "dense_chunk_fwd_kernel": dense_chunk_fwd_cost, "dense_chunk_bwd_kernel": dense_chunk_bwd_cost}
