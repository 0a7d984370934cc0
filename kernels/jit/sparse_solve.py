"""The sparse patterns (local attention, banded, diagonal, translation-invariant and cache-efficient f): the
direct channel, the recurrent solve row by row through the slots, its backward solve, and the gradients of the
scores.

Conventions: :mod:`.common`.
"""

import math

import torch
import triton
import triton.language as tl

from hf_resolvent.patterns import get_pattern

from .. import launching
from ..cost import F32
from .common import (
    _claimed_block,
    _exp2_where,
    _gate,
    _head_and_start,
    _load_row_scalars,
    _load_tile,
    _log_sum_exp2,
    _pattern_rows,
    _publish_solved,
    _row_block,
    _row_ptrs,
    _solve_forward_block,
    _solved_count,
    _store_w_and_row_grads,
    _sum,
    _tile_mask,
    _tile_ptrs,
    _unit_lower_solve,
    _wait_solved,
)

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
# Launchers (tensors flattened to (B * H, n, w) contiguous; ``launching.LaunchShapes`` gives the sizes). A channel
# the variant lacks is None: qa and ka for the tied variant, qb and kb (and g) for local attention.


def _slots(plan, device) -> tuple:
    """The slot arguments of every sparse kernel: OFFS, STEPS and NSLOT."""
    offsets, steps = launching.slot_tables(plan, device)
    return offsets, steps, len(plan.offsets)


def direct(qa, ka, x, qb, kb, start, plan, sh, cfg):
    """The parallel part of the forward: the direct channel OA with its log-sum-exp LSEA (unless tied: OA = x), and
    channel B's log-sum-exp LSEB (with a B term). Returns (oa, lsea, lseb), None where absent."""
    dev, BH, n, e = x.device, sh.BH, sh.n, sh.e
    has_a, has_b = qa is not None, qb is not None
    oa = launching.new_buffer((BH, n, e), dev) if has_a else x
    lsea = launching.new_buffer((BH, n), dev) if has_a else None
    lseb = launching.new_buffer((BH, n), dev) if has_b else None
    sparse_direct_kernel[(launching.cdiv(n, cfg.sparse_m), BH)](
        qa, ka, x, qb, kb, oa if has_a else None, lsea, lseb, start, *_slots(plan, dev), n, sh.H, sh.da, sh.db, e,
        sh.qk_scale2, BM=cfg.sparse_m, BDA=launching.tile_width(sh.da), BDB=launching.tile_width(sh.db),
        BE=launching.tile_width(e), CE=plan.ce, HAS_A=has_a, HAS_B=has_b, num_warps=cfg.num_warps)
    return oa, lsea, lseb


def blocked_forward(qb, kb, oa, g, lseb, start, plan, sh, cfg, keep_inverses: bool):
    """Y = (I - B)^-1 ((1 - geff) OA): one program per head walks its row blocks in order (``cfg.solve`` rows).
    Returns (y, saved) with R = softmax(P^B) Y for the backward."""
    dev, BH, n, e = oa.device, sh.BH, sh.n, sh.e
    y, r = launching.new_buffer((BH, n, e), dev), launching.new_buffer((BH, n, e), dev)
    sparse_solve_fwd_kernel[(BH,)](
        qb, kb, oa, g, lseb, y, r, start, *_slots(plan, dev), plan.f0, n, sh.H, sh.db, e, sh.qk_scale2,
        BLOCK=cfg.solve, LOG2_BLOCK=int(math.log2(cfg.solve)), BD=launching.tile_width(sh.db),
        BE=launching.tile_width(e), CE=plan.ce, SOLVE_PREC=launching.SOLVE_PREC, num_warps=cfg.solve_warps,
        num_stages=cfg.solve_stages)
    return y, dict(r=r)


def blocked_backward(dy, qb, kb, g, start, saved, plan, sh, cfg):
    """W = (I - B)^-T dY in ticket-ordered blocks of ``cfg.solve`` rows, last block first, and the row scalars
    DA, DB, DG. Returns (w, da, db, dg)."""
    dev, BH, n, e = dy.device, sh.BH, sh.n, sh.e
    w = launching.new_buffer((BH, n, e), dev)
    da, db, dg = (launching.new_buffer((BH, n), dev) for _ in range(3))
    gathered = torch.zeros(BH, n, e, device=dev)  # what later blocks send back, added atomically
    sparse_solve_bwd_kernel[launching.solve_grid(n, BH, cfg.solve)](
        qb, kb, saved["oa"], saved["r"], g, saved["lseb"], dy, gathered, w, da, db, dg, start,
        launching.progress_buffer(BH, dev),
        *_slots(plan, dev), plan.f0, n, sh.H, sh.db, e, sh.qk_scale2,
        BLOCK=cfg.solve, LOG2_BLOCK=int(math.log2(cfg.solve)), BD=launching.tile_width(sh.db),
        BE=launching.tile_width(e), CE=plan.ce, SOLVE_PREC=launching.SOLVE_PREC, num_warps=cfg.solve_warps,
        num_stages=cfg.solve_stages)
    return w, da, db, dg


def grads(qa, ka, x, qb, kb, w, g, da, db, start, saved, plan, sh, cfg):
    """The scores' gradients row by row through the slots, both channels in one kernel: (dqa, dka, dx, dqb, dkb),
    float32, None for a channel the variant lacks (dx too when tied: the caller forms it from W)."""
    dev, n, e = w.device, sh.n, sh.e
    has_a, has_b = qa is not None, qb is not None
    dqa, dka, dx, dqb, dkb = launching.score_grad_buffers(sh, dev, has_a, has_b)
    sparse_grads_kernel[(launching.cdiv(n, cfg.sparse_grads_m), sh.BH)](
        qa, ka, x, qb, kb, saved["y"], w, g, da, db, saved["lsea"], saved["lseb"], dqa, dka, dx, dqb, dkb, start,
        *_slots(plan, dev), plan.f0, n, sh.H, sh.da, sh.db, e, sh.qk_scale2, sh.scale, BM=cfg.sparse_grads_m,
        BDA=launching.tile_width(sh.da), BDB=launching.tile_width(sh.db), BE=launching.tile_width(e), CE=plan.ce,
        HAS_A=has_a, HAS_B=has_b, num_warps=cfg.num_warps)
    return dqa, dka, dx, dqb, dkb


# ------------------------------------------------------------------------------------------------
# Cost model (``cost.launch_cost``): each takes a recorded launch and a ``cost.Cost``, returns its chain steps.
# The sparse kernels work row by row: they move and multiply the (row, slot) pairs the pattern reads.


def sparse_pairs(pattern: str, n: int, block: int) -> dict:
    """(row, slot) pairs the pattern reads at length n (no left padding): all of them, and for blocks of
    ``block`` rows, those whose source lies in an earlier block or inside the row's own block."""
    src = get_pattern(pattern).source_index(n)
    ok = src >= 0
    first_row = (torch.arange(n) // block * block)[:, None]
    early = ok & (src < first_row)
    return {"all": int(ok.sum()), "early": int(early.sum()), "inside": int((ok & ~early).sum())}


def _rows_and_pairs(launch, pattern, block):
    """Rows of the launch (n x BH) and its (row, slot) pairs, all, early and inside, over every head."""
    a = launch.args
    BH = a["X"].shape[0] if a.get("X") is not None else a["QB"].shape[0]
    pairs = sparse_pairs(pattern, a["n"], block)
    return a["n"] * BH, {key: v * BH for key, v in pairs.items()}


def sparse_direct_cost(launch, cost, pattern, in_flight) -> int:
    a, c = launch.args, launch.constexprs
    rows, pairs = _rows_and_pairs(launch, pattern, c["BM"])
    da, db, e = a["da"], a["db"], a["e"]
    if c["HAS_A"]:
        cost.move(rows, a["QA"], da)
        cost.move(rows + pairs["all"], a["KA"], da)
        cost.move(rows + pairs["all"], a["X"], e)
        cost.move(rows, width=e + 1, elem=F32)  # OA, LSEA
        cost.vector(rows + pairs["all"], 2 * da + 2 * e)  # q.k, p x
    if c["HAS_B"]:
        cost.move(rows, a["QB"], db)
        cost.move(pairs["all"], a["KB"], db)
        cost.move(rows, width=1, elem=F32)  # LSEB
        cost.vector(pairs["all"], 2 * db)
    return 0


def sparse_grads_cost(launch, cost, pattern, in_flight) -> int:
    a, c = launch.args, launch.constexprs
    rows, pairs = _rows_and_pairs(launch, pattern, c["BM"])
    da, db, e = a["da"], a["db"], a["e"]
    cost.move(rows, a["W"], e)
    if c["HAS_B"]:
        cost.move(rows, a["QB"], db)
        cost.move(rows, a["G"])
        cost.move(rows, width=2, elem=F32)  # LSEB, DB
        cost.move(pairs["all"], a["KB"], db)
        cost.move(pairs["all"], a["Y"], e)
        cost.move(pairs["all"], width=db, elem=F32)  # DKB atomics
        cost.move(rows, width=db, elem=F32)  # DQB
        cost.vector(pairs["all"], 3 * 2 * db + 2 * e)  # q.k, dq, dk; w.y
    if c["HAS_A"]:
        cost.move(rows, a["QA"], da)
        cost.move(rows, width=2, elem=F32)  # LSEA, DA
        cost.move(rows + pairs["all"], a["KA"], da)
        cost.move(rows + pairs["all"], a["X"], e)
        cost.move(rows + pairs["all"], width=da + e, elem=F32)  # DKA, DX atomics
        cost.move(rows, width=da, elem=F32)  # DQA
        cost.vector(rows + pairs["all"], 3 * 2 * da + 2 * 2 * e)  # q.k, dq, dk; do.x, dx
    return 0


def _solve_rows_cost(launch, cost, pattern):
    """What both sequential solves do: per row its query, gate and LSEB, q.k of every pair, the in-block solve of
    every block. Returns (rows, pairs, chain steps)."""
    a, c = launch.args, launch.constexprs
    B, d = c["BLOCK"], a["d"]
    rows, pairs = _rows_and_pairs(launch, pattern, B)
    nblk = launching.cdiv(a["n"], B)
    cost.move(rows, a["QB"], d)
    cost.move(rows, a["G"])
    cost.move(rows, width=1, elem=F32)  # LSEB
    cost.vector(pairs["all"], 2 * d)  # q.k of every pair
    cost.solve_block(nblk * (rows // a["n"]), B, c["LOG2_BLOCK"], c["BE"], c["SOLVE_PREC"])
    return rows, pairs, nblk


def sparse_solve_fwd_cost(launch, cost, pattern, in_flight) -> int:
    a, c = launch.args, launch.constexprs
    e, BE, B = a["e"], c["BE"], c["BLOCK"]
    rows, pairs, nblk = _solve_rows_cost(launch, cost, pattern)
    cost.move(pairs["all"], a["KB"], a["d"])
    cost.move(pairs["early"], width=e, elem=F32)  # solved Y of earlier blocks
    cost.vector(pairs["early"], 2 * e)
    cost.move(rows, a["OA"], e)
    cost.move(rows, width=2 * e, elem=F32)  # Y, R
    cost.dot(nblk * (rows // a["n"]), B, BE, B, a["R"].dtype, c["SOLVE_PREC"])  # R's in-block part
    return nblk


def sparse_solve_bwd_cost(launch, cost, pattern, in_flight) -> int:
    a = launch.args
    d, e = a["d"], a["e"]
    rows, pairs, nblk = _solve_rows_cost(launch, cost, pattern)
    cost.move(pairs["inside"], a["KB"], d)
    cost.move(pairs["early"], a["KB"], d)  # recomputed for the scatter
    cost.move(rows, a["DY"], e)
    cost.move(rows, width=3 * e, elem=F32)  # GACC, OA, R
    cost.move(rows, width=e + 3, elem=F32)  # W, DA, DB, DG
    cost.move(pairs["early"], width=e, elem=F32)  # GACC atomics
    cost.vector(pairs["early"], 2 * d + 2 * e)  # q.k again, p w
    return nblk


COSTS = {"sparse_direct_kernel": sparse_direct_cost, "sparse_grads_kernel": sparse_grads_cost,
         "sparse_solve_fwd_kernel": sparse_solve_fwd_cost, "sparse_solve_bwd_kernel": sparse_solve_bwd_cost}
