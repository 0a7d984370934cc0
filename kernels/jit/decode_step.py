"""One decode step: a token against a layer's cache rows (the rows its pattern reads), both channels, and the rows the
cache takes from it.

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

WRITE_NONE, WRITE_ROW, WRITE_SLOTS = 0, 1, 2  # what the kernel writes into the cache (``step``'s ``write``)


@triton.jit
def _load_token(PTR, b, h, sb, cols, width):
    """The (width,) vector of head h of sequence b as float32, 0 past width: heads of ``width`` elements side by
    side, sequences ``sb`` elements apart (a (B, H, w) tensor, or one part of the (B, P, H, w) projection)."""
    return tl.load(PTR + b * sb + h * width + cols, mask=cols < width, other=0.0).to(tl.float32)


@triton.jit
def _load_rotated(PTR, b, h, sb, cols, width, COS, SIN, sc_b):
    """:func:`_load_token` rotated by RoPE (rotate-half, tables of ``width`` per sequence, ``sc_b`` apart: 0 when
    shared), rounded to the input's dtype as the PyTorch form rounds a rotated part."""
    half = width // 2
    t = _load_token(PTR, b, h, sb, cols, width)
    partner = tl.load(PTR + b * sb + h * width + (cols + half) % width, mask=cols < width, other=0.0).to(tl.float32)
    cos = tl.load(COS + b * sc_b + cols, mask=cols < width, other=0.0).to(tl.float32)
    sin = tl.load(SIN + b * sc_b + cols, mask=cols < width, other=0.0).to(tl.float32)
    rotated = t * cos + partner * tl.where(cols < half, -sin, sin)
    return rotated.to(PTR.dtype.element_ty).to(tl.float32)


@triton.jit
def _load_cache_rows(PTR, bh, S, slots, read, cols, width):
    """Rows ``slots`` of head bh of a (BH, S, width) cache as float32, 0 where not read or past width."""
    return tl.load(PTR + (bh * S + slots[:, None]) * width + cols[None, :],
                   mask=read[:, None] & (cols < width)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _store_row(PTR, bh, S, row, cols, width, value):
    """Row ``row`` of head bh of a (BH, S, width) cache := value (in the cache's dtype)."""
    tl.store(PTR + (bh * S + row) * width + cols, value.to(PTR.dtype.element_ty), mask=cols < width)


@triton.jit
def _shifted_rows(PTR, bh, S, sl, smask, cols, width, token):
    """A register's rows ``sl`` after a token (before the stay rule): row s takes row s - 1, row 0 the token."""
    before = tl.load(PTR + (bh * S + sl[:, None] - 1) * width + cols[None, :],
                     mask=(smask & (sl > 0))[:, None] & (cols < width)[None, :], other=0.0)
    return tl.where((sl == 0)[:, None], token.to(PTR.dtype.element_ty)[None, :], before)


@triton.jit
def _store_rows(PTR, bh, S, sl, moved, cols, width, value):
    tl.store(PTR + (bh * S + sl[:, None]) * width + cols[None, :], value,
             mask=moved[:, None] & (cols < width)[None, :])


@triton.jit
def decode_step_kernel(QA, KA, X, QB, KB, G, DD, DT, ALOG, COS, SIN,
                       CKA, CKB, CV, CO, POS, RPOS, OFFS, ROW, STAY, Y, Z,
                       S, H, da, db, e, sqa, ska, sx, sqb, skb, sc_b, qk_scale2, W_LO, NSLOT,
                       BS: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BE: tl.constexpr,
                       MODE: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr, TIED: tl.constexpr,
                       ONCE: tl.constexpr, ROPE_A: tl.constexpr, ROPE_B: tl.constexpr, GATE_RAW: tl.constexpr,
                       WRITE: tl.constexpr):
    """One decode step for one (batch, head): the new token against the S rows of the layer's cache, then (WRITE) the
    token's rows into the cache.

    Grid (BH,). The token's vectors QA, KA, X, QB, KB are heads of width da, db or e side by side, sequences sqa, ska,
    sx, sqb, skb elements apart ((B, H, w) tensors, or the parts of the mixer's (B, P, H, hd) projection). ROPE_A,
    ROPE_B: rotate channel A's or B's query and key by the tables COS, SIN (width d, sequences sc_b apart) first.
    G (B, H): the gate, or with GATE_RAW its pre-activation a, g = exp(-softplus(a + DT[h]) exp(ALOG[h])); DD (B,
    H) the tied variant's d, or with GATE_RAW its pre-activation s, d = (1 - g) sigmoid(s).

    Cache tensors are (B, H, S, w) contiguous, POS (B, S) the pattern position of each row
    (-1: not readable), RPOS (B,) the new token's pattern position r (negative on padding). Which
    rows are read (``ops.DecodeState.read_mask``): MODE 0 every row with POS >= 0; MODE 1 rows with
    POS >= r - W_LO (local attention, banded); MODE 2 rows with r - POS in OFFS[:NSLOT] (plain f-pattern). ONCE
    (a register's slots, where one position may sit in several, next to each other): a row whose position the row
    before holds is not read again.
    Channel A reads those rows plus the token itself (its key KA, value X); channel B those rows
    (keys CKB, outputs CO). Online softmax over blocks of BS rows, float32.
    Writes Y (BH, e) float32, 0 where r < 0, and with B what the cache keeps: z = y unmasked, as
    ``recurrent_step`` stores it; TIED (no A): z = geff R + (1 - geff) x and Y = z - d x, both 0 where r < 0.
    The kept rows (keys_a = ka, values = x, keys_b = kb, outputs = z, as the variant keeps them) go to Z (z alone)
    with WRITE_NONE; into the cache with WRITE_ROW (at row ROW[0]) or WRITE_SLOTS (a register: row s takes row s - 1
    and row 0 the token, except where STAY[b, s]). The positions are not written: the heads of a sequence share them.
    """
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    r = tl.load(RPOS + b)
    ce = tl.arange(0, BE)
    emask = ce < e
    x = _load_token(X, b, h, sx, ce, e)
    if HAS_A:
        ca = tl.arange(0, BDA)
        if ROPE_A:
            qa = _load_rotated(QA, b, h, sqa, ca, da, COS, SIN, sc_b)
            ka = _load_rotated(KA, b, h, ska, ca, da, COS, SIN, sc_b)
        else:
            qa = _load_token(QA, b, h, sqa, ca, da)
            ka = _load_token(KA, b, h, ska, ca, da)
        m = _sum(qa * ka, 0) * qk_scale2
        l_sum = tl.full((), 1.0, tl.float32)
        acc = x
    if HAS_B:
        cb = tl.arange(0, BDB)
        if ROPE_B:
            qb = _load_rotated(QB, b, h, sqb, cb, db, COS, SIN, sc_b)
        else:
            qb = _load_token(QB, b, h, sqb, cb, db)
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
    z = x
    if HAS_B:
        hasb = lb > 0
        g = tl.load(G + bh).to(tl.float32)
        if GATE_RAW:  # softplus as torch's (linear past 20), then rounded to the input's dtype as the PyTorch gate
            a = g + tl.load(DT + h).to(tl.float32)
            dt = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
            g = tl.exp(-dt * tl.exp(tl.load(ALOG + h).to(tl.float32))).to(X.dtype.element_ty).to(tl.float32)
        geff = tl.where(hasb, g, 0.0)
        rb = accb / tl.where(hasb, lb, 1.0)
        if TIED:
            z = tl.where(live, geff * rb + (1.0 - geff) * x, 0.0)
            dd = tl.load(DD + bh).to(tl.float32)
            if GATE_RAW:
                dd = ((1.0 - g) * (1.0 / (1.0 + tl.exp(-dd)))).to(X.dtype.element_ty).to(tl.float32)
            tl.store(Y + bh * e + ce, tl.where(live, z - dd * x, 0.0), mask=emask)
        else:
            z = (1.0 - geff) * (acc / l_sum) + geff * rb
            tl.store(Y + bh * e + ce, tl.where(live, z, 0.0), mask=emask)
        if ROPE_B:
            kb = _load_rotated(KB, b, h, skb, cb, db, COS, SIN, sc_b)
        else:
            kb = _load_token(KB, b, h, skb, cb, db)
    else:
        tl.store(Y + bh * e + ce, tl.where(live, acc / l_sum, 0.0), mask=emask)
    if WRITE == 0:
        if HAS_B:
            tl.store(Z + bh * e + ce, z, mask=emask)
    else:
        tl.debug_barrier()  # every row this program reads is read before any is written
        if WRITE == 1:
            row = tl.load(ROW)
            if HAS_A and not TIED:
                _store_row(CKA, bh, S, row, ca, da, ka)
                _store_row(CV, bh, S, row, ce, e, x)
            if HAS_B:
                _store_row(CKB, bh, S, row, cb, db, kb)
                _store_row(CO, bh, S, row, ce, e, z)
        else:
            # from the last block down: a block's rows move up by one, reading the row below before it is written
            blocks = (S + BS - 1) // BS
            for i in range(0, blocks):
                sl = (blocks - 1 - i) * BS + tl.arange(0, BS)
                smask = sl < S
                moved = smask & (tl.load(STAY + b * S + sl, mask=smask, other=1) == 0)
                if HAS_A and not TIED:
                    new_ka = _shifted_rows(CKA, bh, S, sl, smask, ca, da, ka)
                    new_v = _shifted_rows(CV, bh, S, sl, smask, ce, e, x)
                if HAS_B:
                    new_kb = _shifted_rows(CKB, bh, S, sl, smask, cb, db, kb)
                    new_o = _shifted_rows(CO, bh, S, sl, smask, ce, e, z)
                tl.debug_barrier()
                if HAS_A and not TIED:
                    _store_rows(CKA, bh, S, sl, moved, ca, da, new_ka)
                    _store_rows(CV, bh, S, sl, moved, ce, e, new_v)
                if HAS_B:
                    _store_rows(CKB, bh, S, sl, moved, cb, db, new_kb)
                    _store_rows(CO, bh, S, sl, moved, ce, e, new_o)
                tl.debug_barrier()


# ------------------------------------------------------------------------------------------------
# Launcher


def step(token: dict, cache: dict, positions, r, read_rule, once: bool, scale: float, cfg, rope=None,
         gate_raw=None, write=None):
    """One token per sequence against the cache rows ``cache`` (keys_a, keys_b, values, outputs: (B, H, S, w), None
    for a channel the variant lacks) at pattern ``positions`` (B, S) int64, the token at ``r`` (B,), read by
    ``read_rule`` (``DecodeState.read_rule``: the kernel's MODE, W_LO and OFFS), each position once when ``once`` (a
    register's slots).

    ``token``: the token's qa, ka, x, qb, kb (B, H, w) with heads contiguous (views of a projection allowed; None for
    a channel the variant lacks), its gate g and the tied variant's d (B, H) contiguous. ``rope``: None, or (cos, sin,
    channels) to rotate the queries and keys of ``channels`` ("a", "b" or "ab") by tables (B or 1, d). ``gate_raw``:
    None, or (dt_bias, A_log) (H,) when g and d are pre-activations. ``write``: None (the caller writes the rows), or
    ``("row", row)`` with row (1,) int64, or ``("slots", stay)`` with stay (B, S) bool.

    Returns (y, z) float32 (B, H, e), z the row the cache keeps (None with a B term absent or with ``write``)."""
    x = token["x"]
    batch, heads, e = x.shape
    qa, ka, qb, kb = (token.get(name) for name in ("qa", "ka", "qb", "kb"))
    has_a, has_b, tied = qa is not None, qb is not None, token.get("d") is not None
    da, db = qa.shape[-1] if has_a else 1, qb.shape[-1] if has_b else 1
    mode, w_lo, offsets = read_rule
    y = launching.new_buffer((batch, heads, e), x.device)
    z = launching.new_buffer((batch, heads, e), x.device) if has_b and write is None else None
    offs = positions if offsets is None else offsets  # a pointer the kernel does not read without MODE 2
    cos, sin, channels = rope if rope is not None else (x, x, "")
    dt_bias, a_log = gate_raw if gate_raw is not None else (None, None)
    kind, where = write if write is not None else ("none", None)
    row, stay = (where, None) if kind == "row" else (None, where)
    stride = lambda t: 0 if t is None else t.stride(0)
    decode_step_kernel[(batch * heads,)](
        qa, ka, x, qb, kb, token.get("g"), token.get("d"), dt_bias, a_log, cos, sin,
        cache["keys_a"], cache["keys_b"], cache["values"], cache["outputs"], positions, r, offs, row, stay, y, z,
        positions.shape[1], heads, da, db, e, stride(qa), stride(ka), x.stride(0), stride(qb), stride(kb),
        cos.stride(0) if cos.shape[0] > 1 else 0, scale * launching.LOG2E, w_lo,
        0 if offsets is None else offsets.numel(),
        BS=cfg.decode, BDA=launching.tile_width(da), BDB=launching.tile_width(db), BE=launching.tile_width(e),
        MODE=mode, HAS_A=has_a, HAS_B=has_b, TIED=tied, ONCE=once, ROPE_A="a" in channels and has_a,
        ROPE_B="b" in channels and has_b, GATE_RAW=gate_raw is not None,
        WRITE={"none": WRITE_NONE, "row": WRITE_ROW, "slots": WRITE_SLOTS}[kind], num_warps=cfg.num_warps)
    return y, z


COSTS = {}  # the roofline models training passes; a decode step is timed, not modelled
