"""RoPE and the head split of the mixer's projection: its parts (B, n, P, H, hd), as the input projection lays them
out, to heads-major parts (P, B, H, n, hd) contiguous, as the mixer kernels read them, the parts that RoPE rotates
rotated on the way (rotate-half), and the transposed map for the gradient.

The PyTorch reference is ``ops.rope.rotated_parts`` (``apply_rope`` on each rotated run, transposed views of the
others). Conventions: :mod:`.common`.
"""

import triton
import triton.language as tl

from .. import launching

# ------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _table_tiles(COS, SIN, b, rows, rmask, cols, hd, c_b, c_n):
    """cos and the rotate-half's signed sin (first half negated) at positions ``rows`` of sequence b and columns
    ``cols``, float32: tables of hd per position, positions c_n and sequences c_b apart (0: one table for all)."""
    offsets = b * c_b + rows[:, None] * c_n + cols[None, :]
    mask = rmask[:, None] & (cols < hd)[None, :]
    cos = tl.load(COS + offsets, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + offsets, mask=mask, other=0.0).to(tl.float32)
    return cos, tl.where((cols < hd // 2)[None, :], -sin, sin)


@triton.jit
def _part_pointer(p: tl.constexpr, T0, T1, T2, T3, T4):
    """The p-th of the pointers T0..T4 (p known at compile time)."""
    if p == 0:
        ptr = T0
    elif p == 1:
        ptr = T1
    elif p == 2:
        ptr = T2
    elif p == 3:
        ptr = T3
    else:
        ptr = T4
    return ptr


@triton.jit
def rope_heads_kernel(SRC, COS, SIN, OUT, n, BH, H, hd, s_b, s_n, s_p, s_h, c_b, c_n,
                      P: tl.constexpr, ROTATE: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """Parts (B, n, P, H, hd) of SRC (strides s_b, s_n, s_p, s_h, unit along hd) to OUT (P, B, H, n, hd)
    contiguous (BH = B * H), in OUT's dtype. Part p is rotated where bit p of ROTATE is set: out[j] = src[j] cos[j]
    + src[(j + hd/2) % hd] sin'[j], sin' the signed sin, computed in float32 and rounded once, as ``apply_rope``;
    the other parts are copied.

    Grid (cdiv(n, BN), B * H): a program takes BN positions of one (batch, head), every part of them, so that the
    table tiles are read once for all the rotated parts.
    """
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.arange(0, BD)
    rmask = rows < n
    mask = rmask[:, None] & (cols < hd)[None, :]
    partner = (cols + hd // 2) % hd
    src = SRC + b * s_b + h * s_h + rows.to(tl.int64)[:, None] * s_n
    out = OUT + rows[:, None] * hd + cols[None, :]
    if ROTATE != 0:
        cos, sin = _table_tiles(COS, SIN, b, rows, rmask, cols, hd, c_b, c_n)
    for p in tl.static_range(P):
        t = tl.load(src + p * s_p + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if (ROTATE >> p) & 1:
            rolled = tl.load(src + p * s_p + partner[None, :], mask=mask, other=0.0).to(tl.float32)
            t = t * cos + rolled * sin
        tl.store(out + (p * BH + bh) * n * hd, t.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def rope_heads_bwd_kernel(G0, G1, G2, G3, G4, COS, SIN, DSRC, n, H, hd, c_b, c_n,
                          P: tl.constexpr, ROTATE: tl.constexpr, GRADS: tl.constexpr, BN: tl.constexpr,
                          BD: tl.constexpr):
    """The gradient of ``rope_heads_kernel``'s source: DSRC (B, n, P, H, hd) contiguous, in its dtype, from the
    gradients G0..G{P-1} (B, H, n, hd) contiguous of the parts (part p's is zero where bit p of GRADS is clear).
    A rotated part takes the transposed rotation, dsrc[j] = g[j] cos[j] + g[j'] sin'[j'] with j' = (j + hd/2) % hd,
    in float32; the others are copied.

    Grid (cdiv(n, BN), B * H), as the forward.
    """
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.arange(0, BD)
    rmask = rows < n
    mask = rmask[:, None] & (cols < hd)[None, :]
    partner = (cols + hd // 2) % hd
    grad_rows = bh * n * hd + rows[:, None] * hd
    dsrc = DSRC + (b * n + rows.to(tl.int64)[:, None]) * (P * H * hd) + h * hd + cols[None, :]
    if (ROTATE & GRADS) != 0:
        cos, _ = _table_tiles(COS, SIN, b, rows, rmask, cols, hd, c_b, c_n)
        _, sin = _table_tiles(COS, SIN, b, rows, rmask, partner, hd, c_b, c_n)
    for p in tl.static_range(P):
        if (GRADS >> p) & 1:
            grad = _part_pointer(p, G0, G1, G2, G3, G4) + grad_rows
            t = tl.load(grad + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if (ROTATE >> p) & 1:
                rolled = tl.load(grad + partner[None, :], mask=mask, other=0.0).to(tl.float32)
                t = t * cos + rolled * sin
        else:
            t = tl.full([BN, BD], 0.0, tl.float32)
        tl.store(dsrc + p * (H * hd), t.to(DSRC.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------
# Launchers

MAX_PARTS = 5  # qa, ka, x, qb, kb: the backward kernel takes one pointer per part
ROWS = 32  # positions per program


def _tables(src, rope):
    """The tables' pointers and strides (sequence, position): a stand-in pointer where nothing is rotated."""
    if rope is None:
        return src, src, 0, 0
    cos, sin = rope
    return cos, sin, cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1)


def heads(src, rope, rotate: int, cfg):
    """(P, B, H, n, hd) contiguous from ``src`` (B, n, P, H, hd) with a unit last stride; ``rotate``: bit p set
    where part p is rotated by ``rope`` = (cos, sin), tables (B or 1, n, hd) with a unit last stride and one
    stride for the sequences of both (None: no part rotated)."""
    batch, n, parts, heads_, hd = src.shape
    out = launching.new_buffer((parts, batch, heads_, n, hd), src.device, src.dtype)
    cos, sin, c_b, c_n = _tables(src, rope if rotate else None)
    s_b, s_n, s_p, s_h, _ = src.stride()
    rope_heads_kernel[(launching.cdiv(n, ROWS), batch * heads_)](
        src, cos, sin, out, n, batch * heads_, heads_, hd, s_b, s_n, s_p, s_h, c_b, c_n,
        P=parts, ROTATE=rotate, BN=ROWS, BD=launching.tile_width(hd), num_warps=cfg.num_warps)
    return out


def heads_backward(grads, rope, rotate: int, like_shape, dtype, device, cfg):
    """The gradient (B, n, P, H, hd) contiguous in ``dtype`` of :func:`heads`' source of shape ``like_shape``, from
    the parts' gradients ``grads`` (P entries (B, H, n, hd) contiguous, None where a part has none)."""
    batch, n, parts, heads_, hd = like_shape
    if parts > MAX_PARTS:
        raise ValueError(f"the RoPE backward kernel takes at most {MAX_PARTS} parts, got {parts}")
    dsrc = launching.new_buffer(like_shape, device, dtype)
    present = sum(1 << p for p, g in enumerate(grads) if g is not None)
    anchor = next((g for g in grads if g is not None), dsrc)
    cos, sin, c_b, c_n = _tables(anchor, rope if rotate & present else None)
    pointers = list(grads) + [None] * (MAX_PARTS - parts)
    rope_heads_bwd_kernel[(launching.cdiv(n, ROWS), batch * heads_)](
        *pointers, cos, sin, dsrc, n, heads_, hd, c_b, c_n,
        P=parts, ROTATE=rotate, GRADS=present, BN=ROWS, BD=launching.tile_width(hd), num_warps=cfg.num_warps)
    return dsrc


# ------------------------------------------------------------------------------------------------
# Cost models (cost.launch_cost): memory-bound copies, a multiply-add or two per element rotated


def _elements(launch) -> tuple[int, int]:
    c = launch.constexprs
    programs = launch.grid[0] * launch.grid[1]
    return programs * c["BN"] * launch.args["hd"], bin(c["ROTATE"]).count("1")


def rope_heads_cost(launch, cost, pattern, in_flight) -> int:
    per_part, rotated = _elements(launch)
    parts, src = launch.constexprs["P"], launch.args["SRC"]
    cost.move(2 * parts * per_part, src)  # read the parts, write them heads-major
    cost.move(2 * per_part * (rotated > 0), elem=launch.args["COS"].element_size())  # the table tiles
    cost.vector(rotated * per_part, 3)
    return 0


def rope_heads_bwd_cost(launch, cost, pattern, in_flight) -> int:
    per_part, rotated = _elements(launch)
    c, dsrc = launch.constexprs, launch.args["DSRC"]
    cost.move((bin(c["GRADS"]).count("1") + c["P"]) * per_part, dsrc)
    cost.move(2 * per_part * (rotated > 0), elem=launch.args["COS"].element_size())
    cost.vector(rotated * per_part, 3)
    return 0


COSTS = {"rope_heads_kernel": rope_heads_cost, "rope_heads_bwd_kernel": rope_heads_bwd_cost}
