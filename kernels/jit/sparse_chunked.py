"""The sparse patterns' chunked solves (``BlockConfig.sparse_solver = "chunked"``): every chunk solved in
parallel against the rows it holds, then the carry through the held rows, in order; and their backward.

Conventions: :mod:`.common`.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from .. import launching
from ..cost import F32
from .common import (
    _chunk_tile_ptrs,
    _dot,
    _exp2_where,
    _gate,
    _head_and_start,
    _load_row_scalars,
    _load_tile,
    _row_ptrs,
    _sum,
    _tile_mask,
    _tile_ptrs,
    _unit_lower_inverse,
)

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
    int8 from ``launching.held_table``: the pattern's sources laid out per chunk once on the host (column j < C: the
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
# Launchers (tensors flattened to (B * H, n, w) contiguous; ``launching.LaunchShapes`` gives the sizes). The
# direct channel runs ``sparse_solve.direct`` first, as for the blocked solves.


def _held_tiles(cfg, held) -> dict:
    """The chunk and held-row tile constexprs of every chunked sparse kernel: C rows per chunk, HM held rows in the
    table, visited HB <= C at a time."""
    return dict(C=cfg.chunk, HM=held.shape[1], HB=min(held.shape[1], cfg.chunk))


def _carry(y, j, held, start, sh, cfg, reverse: bool):
    """The chain through the held rows, in place on y (BH, n, e) float32: forward Yhat -> Y, reverse dY -> G. One
    program per (batch x head, 16 value columns); no software pipelining across the barrier that ends each
    chunk."""
    columns = 16
    chunk_carry_kernel[(sh.BH, launching.cdiv(sh.e, columns))](
        y, j, held, start, sh.n, sh.H, sh.e, **_held_tiles(cfg, held), BES=columns, REVERSE=reverse,
        SOLVE_PREC=launching.SOLVE_PREC, num_warps=cfg.solve_warps, num_stages=1)


def forward(qb, kb, oa, g, lseb, start, plan, sh, cfg, keep_inverses: bool):
    """Y = (I - B)^-1 ((1 - geff) OA) in chunks of ``cfg.chunk`` rows: every chunk's Yhat_c and J_c at once, then
    the carry. Returns (y, saved) with J and, where a backward follows, each chunk's inverse T_c."""
    dev, BH, n, e = oa.device, sh.BH, sh.n, sh.e
    held, reads = launching.held_tables_on(plan.pattern, n, cfg.chunk, dev)
    y = launching.new_buffer((BH, n, e), dev)
    j = launching.new_buffer((BH, held.shape[0], cfg.chunk, held.shape[1]), dev)
    inverses = launching.block_inverses(BH, n, cfg.chunk, dev) if keep_inverses else None
    chunk_prepare_kernel[(held.shape[0], BH)](
        qb, kb, oa, g, lseb, held, reads, y, j, start, plan.f0, n, sh.H, sh.db, e, sh.qk_scale2, inverses,
        **_held_tiles(cfg, held), LOG2_C=int(math.log2(cfg.chunk)), BD=launching.tile_width(sh.db),
        BE=launching.tile_width(e), PREC=sh.prec, SOLVE_PREC=launching.SOLVE_PREC, SAVE_INVERSE=keep_inverses,
        num_warps=cfg.solve_warps)
    _carry(y, j, held, start, sh, cfg, reverse=False)
    return y, dict(j=j, inverses=inverses, held=held, reads=reads)


def backward(dy, qb, kb, g, start, saved, plan, sh, cfg):
    """W = (I - B)^-T dY: the reverse carry gives G, then W_c = T_c^T G_c for every chunk at once, with the row
    scalars DA, DB, DG. Returns (w, da, db, dg)."""
    dev, BH, n, e = dy.device, sh.BH, sh.n, sh.e
    held, reads = saved["held"], saved["reads"]
    grad = dy.float() * launching.valid_rows(start, BH // start.shape[0], n)[..., None]
    _carry(grad, saved["j"], held, start, sh, cfg, reverse=True)
    w = launching.new_buffer((BH, n, e), dev)
    da, db, dg = (launching.new_buffer((BH, n), dev) for _ in range(3))
    chunk_rows_bwd_kernel[(held.shape[0], BH)](
        qb, kb, saved["oa"], g, saved["lseb"], held, reads, saved["y"], grad, saved["inverses"], w, da, db, dg, start,
        plan.f0, n, sh.H, sh.db, e, sh.qk_scale2, **_held_tiles(cfg, held), LOG2_C=int(math.log2(cfg.chunk)),
        BD=launching.tile_width(sh.db), BE=launching.tile_width(e), PREC=sh.prec, SOLVE_PREC=launching.SOLVE_PREC,
        num_warps=cfg.solve_warps)
    return w, da, db, dg


def grads(qa, ka, x, qb, kb, w, g, da, db, start, saved, plan, sh, cfg):
    """The scores' gradients as tiles over each chunk's own and held rows: (dqa, dka, dx, dqb, dkb) float32, the
    direct channel's None for the tied variant (its dx comes from W)."""
    held, reads = saved["held"], saved["reads"]
    dqa, dka, dx, dqb, dkb = launching.score_grad_buffers(sh, w.device, has_a=qa is not None, has_b=True)
    chunk_grads_kernel[(held.shape[0], sh.BH)](
        qa, ka, x, qb, kb, saved["y"], w, g, da, db, saved["lsea"], saved["lseb"], held, reads, dqa, dka, dx, dqb, dkb,
        start, plan.f0, sh.n, sh.H, sh.da, sh.db, sh.e, sh.qk_scale2, sh.scale, **_held_tiles(cfg, held),
        BDA=launching.tile_width(sh.da), BDB=launching.tile_width(sh.db), BE=launching.tile_width(sh.e),
        HAS_A=qa is not None, PREC=sh.prec, num_warps=cfg.solve_warps)
    return dqa, dka, dx, dqb, dkb


# ------------------------------------------------------------------------------------------------
# Cost model (``cost.launch_cost``): each takes a recorded launch and a ``cost.Cost``, returns its chain steps.
# The chunked kernels count the held rows the pattern really has (``chunked_solve.held_rows``).


@functools.lru_cache(maxsize=64)
def held_counts(pattern: str, n: int, chunk: int) -> dict:
    """The held rows at length n (no left padding): HM, the width of ``launching.held_table``, and the held rows of
    all chunks together (the rows the kernels really gather)."""
    from ..chunked_solve import held_rows

    sizes = [len(h) for h in held_rows(pattern, n, chunk)]
    return {"HM": launching.tile_width(max(sizes, default=1)), "held": sum(sizes), "chunks": len(sizes)}


def _held(launch, pattern) -> dict:
    HM, held = launch.constexprs["HM"], held_counts(pattern, launch.args["n"], launch.constexprs["C"])
    if HM != held["HM"]:
        raise ValueError(f"{launch.name}: HM = {HM} but launching.held_table gives {held['HM']}: the launch was not "
                         f"recorded for pattern {pattern!r} at n = {launch.args['n']}")
    return held


def _chunk_pair(cost, count: int, C: int, HM: int, width: int, dtype, prec: str):
    """A product over a chunk's own rows and its twin over the chunk's held rows: C x C or C x HM on two of its
    sizes, ``width`` the third (which two depends on the product; its FLOPs, 2 C (C + HM) width, do not)."""
    cost.dot(count, C, C, width, dtype, prec)
    cost.dot(count, C, HM, width, dtype, prec)


def chunk_carry_cost(launch, cost, pattern, in_flight) -> int:
    # Grid (BH, e / BES): each program walks every chunk of its head for BES value columns.
    a, c = launch.args, launch.constexprs
    held, C, HM, e = _held(launch, pattern), c["C"], c["HM"], a["e"]
    BH, chain = launch.grid[0], launching.cdiv(a["n"], C)
    per_step = launch.grid[0] * launch.grid[1] * chain
    cost.move(per_step * HM, a["HELD"])
    cost.move(per_step * C * HM, a["J"])  # J_c, read by every column program
    # Forward: Y_c read and written, the held rows read; backward: G_c read, the held rows read and written.
    own, carried = (1, 2) if c["REVERSE"] else (2, 1)
    cost.move(BH * (own * a["n"] + carried * held["held"]), width=e, elem=F32)
    cost.dot(per_step, C, c["BES"], HM, torch.float32, c["SOLVE_PREC"])  # J_c Y[H_c], or J_c^T G_c
    return chain


def chunk_grads_cost(launch, cost, pattern, in_flight) -> int:
    # Grid (cdiv(n, C), BH): per chunk and channel (A unless tied, B always) P, dP and dS over the chunk's own rows
    # and its held rows (HB at a time, HM in all); dq written once, dk (and dx for A) as atomic tile adds.
    a, c = launch.args, launch.constexprs
    held, C, HM, e, prec = _held(launch, pattern), c["C"], c["HM"], a["e"], c["PREC"]
    programs, BH = launch.grid[0] * launch.grid[1], launch.grid[1]
    rows, held_rows = a["n"] * BH, held["held"] * BH
    cost.move(rows, a["W"], e)
    cost.move(rows, a["G"])
    channels = [(a["QB"], a["KB"], a["Y"], a["db"], c["BDB"], False)]
    if c["HAS_A"]:
        channels.insert(0, (a["QA"], a["KA"], a["X"], a["da"], c["BDA"], True))
    for q, k, v, d, BD, has_dx in channels:
        cost.move(programs * HM, a["HELD"])  # each channel loads the held table and the mask of reads
        cost.move(programs * C, a["READS"], C + HM)
        cost.move(rows, q, d)
        cost.move(rows + held_rows, k, d)
        cost.move(rows + held_rows, v, e)  # x (A) or Y (B)
        cost.move(rows, width=2 + d, elem=F32)  # LSE and D in, dq out
        cost.move(rows + held_rows, width=d + (e if has_dx else 0), elem=F32)  # dk (and dx) atomics
        _chunk_pair(cost, programs, C, HM, BD, q.dtype, prec)  # scores q k^T
        # dP = dO V^T: dO cast to x's dtype for A; float32 operands (Y and geff W) for B
        _chunk_pair(cost, programs, C, HM, c["BE"], v.dtype, prec)
        _chunk_pair(cost, programs, C, HM, BD, q.dtype, prec)  # dq = dS k
        _chunk_pair(cost, programs, C, HM, BD, q.dtype, prec)  # dk = dS^T q
        if has_dx:
            _chunk_pair(cost, programs, C, HM, c["BE"], v.dtype, prec)  # dx = P^T dO
    return 0


def _chunk_rows_cost(launch, cost, pattern):
    """What chunk_prepare and chunk_rows_bwd share: the chunk's scores onto its own rows and its held rows (HB at a
    time), tensor-core tiles masked by the chunk's reads. Returns (programs, rows, held rows)."""
    a, c = launch.args, launch.constexprs
    held, C, HM, d = _held(launch, pattern), c["C"], c["HM"], a["d"]
    programs, BH = launch.grid[0] * launch.grid[1], launch.grid[1]
    rows, held_rows = a["n"] * BH, held["held"] * BH
    cost.move(rows, a["QB"], d)
    cost.move(rows, a["KB"], d)
    cost.move(held_rows, a["KB"], d)
    cost.move(rows, a["G"])
    cost.move(rows, width=1, elem=F32)  # LSEB
    cost.move(programs * HM, a["HELD"])
    cost.move(programs * C, a["READS"], C + HM)
    _chunk_pair(cost, programs, C, HM, c["BD"], a["QB"].dtype, c["PREC"])
    cost.move(rows, a["OA"], a["e"])
    return programs, rows, held_rows


def chunk_prepare_cost(launch, cost, pattern, in_flight) -> int:
    a, c = launch.args, launch.constexprs
    C, HM = c["C"], c["HM"]
    programs, rows, _ = _chunk_rows_cost(launch, cost, pattern)
    # T_c, then T_c rhs and T_c geff P_held (HB columns at a time)
    cost.inverse_applied(programs, C, c["LOG2_C"], (c["BE"], HM), c["SOLVE_PREC"])
    if c["SAVE_INVERSE"]:
        cost.move(programs * C, a["TINV"], C)  # T_c, for the backward
    cost.move(rows, width=a["e"], elem=F32)  # Y (Yhat)
    cost.move(programs * C * HM, a["J"])  # J, whole tiles
    return 0


def chunk_rows_bwd_cost(launch, cost, pattern, in_flight) -> int:
    a, c = launch.args, launch.constexprs
    C, HM, e = c["C"], c["HM"], a["e"]
    programs, rows, held_rows = _chunk_rows_cost(launch, cost, pattern)
    cost.applied(programs, C, (c["BE"],), c["SOLVE_PREC"])  # W_c = T_c^T G_c, T_c as the forward saved it
    cost.move(programs * C, a["TINV"], C)
    cost.move(rows, a["GRAD"], e)
    cost.move(rows + held_rows, a["Y"], e)
    _chunk_pair(cost, programs, C, HM, c["BE"], torch.float32, c["PREC"])  # W_c Y_c^T and W_c Y[H_c]^T
    cost.move(rows, width=e + 3, elem=F32)  # W, DA, DB, DG
    return 0


COSTS = {"chunk_prepare_kernel": chunk_prepare_cost, "chunk_carry_kernel": chunk_carry_cost,
         "chunk_rows_bwd_kernel": chunk_rows_bwd_cost, "chunk_grads_kernel": chunk_grads_cost}
