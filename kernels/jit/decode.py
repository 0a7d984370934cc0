"""One decode step: a token against a layer's cache rows (the rows its pattern reads), both channels.

Conventions: :mod:`.common`.
"""

import triton
import triton.language as tl

from .. import launching
from .common import (
    _max,
    _sum,
)

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
                       MODE: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr, TIED: tl.constexpr,
                       ONCE: tl.constexpr):
    """One decode step for one (batch, head): the new token against the S rows of the layer's cache.

    Grid (BH,). Cache tensors are (B, H, S, w) contiguous, POS (B, S) the pattern position of each row
    (-1: not readable), RPOS (B,) the new token's pattern position r (negative on padding). Which
    rows are read (``ops.DecodeState.read_mask``): MODE 0 every row with POS >= 0; MODE 1 rows with
    POS >= r - W_LO (local attention, banded); MODE 2 rows with r - POS in OFFS[:NSLOT] (plain f-pattern). ONCE
    (a register's slots, where one position may sit in several, next to each other): a row whose position the row
    before holds is not read again.
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
        if ONCE:  # a register is non-increasing along its slots: the copies of a position are neighbours
            prev = tl.load(POS + b * S + sl - 1, mask=smask & (sl > 0), other=-2)
            read = read & (pos != prev)
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


# ------------------------------------------------------------------------------------------------
# Launcher


def step(qa, ka, x, qb, g, dd, cache: dict, positions, r, read_rule, once: bool, scale: float, cfg):
    """One token (B, H, w) per sequence against the cache rows ``cache`` (keys_a, keys_b, values, outputs: (B, H,
    S, w), None for a channel the variant lacks) at pattern ``positions`` (B, S) int64, the token at ``r`` (B,),
    read by ``read_rule`` (``DecodeState.read_rule``: the kernel's MODE, W_LO and OFFS), each position once when
    ``once`` (a register's slots). Returns (y, z) float32 (B, H, e), z the row the cache keeps (None without a B
    term)."""
    batch, heads, e = x.shape
    has_a, has_b, tied = qa is not None, qb is not None, dd is not None
    da, db = qa.shape[-1] if has_a else 1, qb.shape[-1] if has_b else 1
    mode, w_lo, offsets = read_rule
    y = launching.new_buffer((batch, heads, e), x.device)
    z = launching.new_buffer((batch, heads, e), x.device) if has_b else None
    offs = positions if offsets is None else offsets  # a pointer the kernel does not read without MODE 2
    decode_step_kernel[(batch * heads,)](
        qa, ka, x, qb, g, dd, cache["keys_a"], cache["keys_b"], cache["values"], cache["outputs"],
        positions, r, offs, y, z,
        positions.shape[1], heads, da, db, e, scale * launching.LOG2E, w_lo, 0 if offsets is None else offsets.numel(),
        BS=cfg.decode, BDA=launching.tile_width(da), BDB=launching.tile_width(db), BE=launching.tile_width(e),
        MODE=mode, HAS_A=has_a, HAS_B=has_b, TIED=tied, ONCE=once, num_warps=cfg.num_warps)
    return y, z


COSTS = {}  # the roofline models training passes; a decode step is timed, not modelled
