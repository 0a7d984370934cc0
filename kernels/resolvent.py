"""Triton path of ``resolvent_mix`` (and its tied variant): launchers and autograd Functions.

Which kernels run (see kernels/README.md for the algorithms):

============================  ===============================================  ==========================
pattern                       forward                                          backward
============================  ===============================================  ==========================
attention                     attn_fwd (causal flash attention)                attn_bwd_dkdv, attn_bwd_dq
dense                         attn_fwd, then dense_solve_fwd (sequential)      dense_solve_bwd, then
                                                                               attn_bwd_* for A and for B
local_attention, banded,      sparse_direct, then sparse_solve_fwd             sparse_solve_bwd, then
diagonal, f-patterns (+ :ce)  (sequential; none for local attention)           sparse_grads
============================  ===============================================  ==========================

``BlockConfig`` names the variants (kernels/README.md): ``dense_solver="chunked"`` runs dense_chunk_fwd /
dense_chunk_bwd instead of the blocked dense solves, ``sparse_solver="chunked"`` runs chunk_prepare and
chunk_carry forward, chunk_carry (reverse) and chunk_rows_bwd backward instead of the sparse solves, and
``attn_bwd="atomic"`` runs attn_bwd_atomic instead of the attn_bwd_dkdv / attn_bwd_dq pair.

Left padding (``start``) is supported by every kernel. Inputs may be float32, bfloat16 or float16;
every accumulation is float32, outputs come back in x's dtype.

Shapes: B batch, H heads, n positions, d key width, e value width.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, replace

import torch
from torch.autograd.function import once_differentiable

from hf_resolvent.ops.common import check_inputs
from hf_resolvent.patterns import Pattern, get_pattern

from ._loader import check_ready, jit_module

LOG2E = math.log2(math.e)
# Input precision of products with float32 operands (see jit/common.py): float32-accurate on tensor cores.
FP32_PREC = "tf32x3"
SOLVE_PREC = "tf32x3"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes of the kernels (powers of two, at least 16).

    Attributes:
        attn_m, attn_n: query rows per program and keys per inner step of the attention forward.
        bwd_m, bwd_n: query rows and keys per tile of the attention-style backward kernels.
        solve: rows per block of the sequential solves (dense and sparse); the in-block system is
            solve x solve, solved with log2(solve) - 1 squarings of that size and log2(solve) products onto the
            right-hand side.
        sparse_m, sparse_grads_m: rows per program of the parallel sparse forward / gradient kernels.
        decode: cache rows per inner step of the decode kernel.
        num_warps: warps of the parallel kernels; solve_warps, solve_stages: warps and software
            pipelining stages of the sequential solves. The defaults compile for sm_80 / sm_90 with
            bfloat16 inputs, head dim 64, without register spills worth mentioning (see
            ``scripts/bench/bench_kernels.py --compile-check``); with solve = 64 the sequential kernels spill.
        sparse_solver: how the sparse patterns' solves run: ``"blocked"`` (one sequential program per head
            forward, ticket-ordered blocks backward) or ``"chunked"`` (chunks of ``chunk`` rows prepared in
            parallel, then a pass that carries only each chunk's held rows; kernels/README.md).
        dense_solver: how the dense pattern's solves run: ``"blocked"`` (blocks of ``solve`` rows) or
            ``"chunked"`` (blocks of ``chunk`` rows with one product left after the wait on the block before).
            Both chunked solvers keep each block's inverse from the forward for the backward, where an input needs
            its gradient: one more float32 tensor of n x ``chunk`` per head saved for the backward.
        solved_copy: dense pattern, 16-bit inputs: the solves also write the rows they solve (Y forward, W
            backward) in the input dtype, and the products that read solved rows with probabilities (P.Y over
            earlier blocks, B^T W over later ones, channel B's attention backward with V = Y) take that copy, at
            the 16-bit tensor-core rate, as FlashAttention reads V and dO; the in-block solves and the chain stay
            float32. With float32 inputs the copy is the rows themselves.
        chunk: rows per chunk of the chunked solves.
        attn_bwd: the attention-style backward: ``"split"`` (one kernel over key blocks for dK and dV, one over
            query blocks for dQ) or ``"atomic"`` (one kernel over key blocks, dQ added atomically in float32).
        atomic_m, atomic_n, atomic_warps: query rows per step, keys per program and warps of the ``"atomic"``
            backward (``attn_bwd_atomic_kernel``), for 16-bit inputs at head width <= 64, where every product of
            the kernel has 64 or more rows (Hopper's warpgroup products, wgmma); float32 inputs and wider heads
            divide both tile sizes by their row's size over 128 bytes (64 x 128 becomes 32 x 64 for float32 or
            head width 128), to fit shared memory.
    """

    attn_m: int = 64
    attn_n: int = 64
    bwd_m: int = 32
    bwd_n: int = 64
    solve: int = 32
    sparse_m: int = 32
    sparse_grads_m: int = 16
    decode: int = 64
    num_warps: int = 4
    solve_warps: int = 4
    solve_stages: int = 2
    # The variants measured fastest and correct on a GPU (bench/gpu/measure_h200_2): the atomic attention backward and
    # the chunked dense solves reading 16-bit copies; the chunked sparse solves await their check there.
    sparse_solver: str = "blocked"
    dense_solver: str = "chunked"
    solved_copy: bool = True
    chunk: int = 64
    attn_bwd: str = "atomic"
    atomic_m: int = 64
    atomic_n: int = 128
    atomic_warps: int = 8

    def __post_init__(self):
        for name in ("attn_m", "attn_n", "bwd_m", "bwd_n", "solve", "sparse_m", "sparse_grads_m", "decode", "chunk",
                     "atomic_m", "atomic_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"BlockConfig.{name} must be a power of two >= 16, got {v}")
        for name, choices in (("sparse_solver", ("blocked", "chunked")), ("dense_solver", ("blocked", "chunked")),
                              ("attn_bwd", ("split", "atomic"))):
            if getattr(self, name) not in choices:
                raise ValueError(f"BlockConfig.{name} must be one of {', '.join(map(repr, choices))}, "
                                 f"got {getattr(self, name)!r}")


_CONFIG = BlockConfig()
_NAN_FILL = False


def get_block_config() -> BlockConfig:
    return _CONFIG


def fitted_block_config(dtype: torch.dtype, width: int, cfg: BlockConfig | None = None) -> BlockConfig:
    """``cfg`` (default: the current one) with its tiles fitted to a block's shared memory for rows of ``width``
    elements of ``dtype``:

    - the attention tiles' key step halved while its pipelined key and value tiles would pass 16 KiB each (float32
      at head width > 64): compiled for sm_90, the float32 attention kernels at width 128 ask for 256 KiB of shared
      memory with 64-key steps, over the 227 KiB a block may have;
    - the atomic backward's tiles, set for rows of 128 bytes (16-bit inputs, head width 64), divided by the row's
      size over 128 bytes: a program's K and V and its pipelined query tiles sit in shared memory, and the defaults
      then fit sm_80 and sm_90;
    - the chunked solves' chunk divided by the row's size over 256 bytes: ``chunk_grads`` holds (chunk, width) tiles
      of both channels, and at float32 and head width 128 it asked for 288 KiB on sm_90 with chunks of 64."""
    cfg = _CONFIG if cfg is None else cfg
    elem, BW = torch.empty((), dtype=dtype).element_size(), tile_width(width)

    def fitted(step: int) -> int:
        while step > 16 and step * BW * elem > 16384:
            step //= 2
        return step

    shrink = max(1, elem * BW // 128)
    return replace(cfg, attn_n=fitted(cfg.attn_n), bwd_n=fitted(cfg.bwd_n),
                   atomic_m=max(16, cfg.atomic_m // shrink), atomic_n=max(16, cfg.atomic_n // shrink),
                   chunk=max(16, cfg.chunk // max(1, elem * BW // 256)))


@contextlib.contextmanager
def block_config(**changes):
    """Temporarily change tile sizes, e.g. ``with block_config(solve=16, attn_m=16, attn_n=16): ...``."""
    global _CONFIG
    old = _CONFIG
    _CONFIG = replace(old, **changes)
    try:
        yield _CONFIG
    finally:
        _CONFIG = old


def set_nan_fill(enabled: bool) -> bool:
    """Allocate every kernel output with NaN instead of uninitialised memory (tests). Returns the old value.

    A kernel that leaves part of an output unwritten then produces NaN instead of stale values that
    may happen to look right. Buffers that kernels accumulate into with atomics start at zero either way.
    """
    global _NAN_FILL
    old, _NAN_FILL = _NAN_FILL, bool(enabled)
    return old


def new_buffer(shape, device, dtype=torch.float32) -> torch.Tensor:
    """An output buffer the kernels write whole: uninitialised, or NaN under :func:`set_nan_fill` (tests)."""
    if _NAN_FILL:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def tile_width(v: int) -> int:
    """The tile width of a head dimension v: a power of two, at least 16 (what tl.dot takes)."""
    return max(16, triton_next_pow2(v))


def triton_next_pow2(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


# --------------------------------------------------------------------------------------------------
# Pattern -> kernel plan


@dataclass(frozen=True)
class Plan:
    """What the kernels need to know about a pattern at length n.

    dense: attention / dense resolvent (causal prefix) rather than a slot pattern; has_b: B != 0;
    offsets, steps: f(k) and a_k per slot (steps only for cache-efficient patterns); f0: pattern rows
    rel >= f0 have a non-empty recurrent set; pattern: the pattern itself (the chunked solves' held rows).
    """

    dense: bool
    has_b: bool
    ce: bool = False
    offsets: tuple[int, ...] = ()
    steps: tuple[int, ...] = ()
    f0: int = 1
    pattern: Pattern | None = None


def make_plan(pattern: Pattern, n: int) -> Plan:
    if pattern.kind == "attention":
        return Plan(dense=True, has_b=False, pattern=pattern)
    if pattern.kind == "dense":
        return Plan(dense=True, has_b=True, f0=1, pattern=pattern)
    if pattern.kind == "local_attention":
        return Plan(dense=False, has_b=False, offsets=tuple(range(1, pattern.window)), pattern=pattern)
    if pattern.band is not None:
        return Plan(dense=False, has_b=True, offsets=tuple(range(1, pattern.band + 1)), f0=1, pattern=pattern)
    offsets = tuple(pattern.offsets(n))
    steps = tuple(pattern.steps(n)) if pattern.cache_efficient else ()
    return Plan(dense=False, has_b=True, ce=pattern.cache_efficient, offsets=offsets, steps=steps,
                f0=offsets[0] if offsets else n, pattern=pattern)


@functools.lru_cache(maxsize=32)
def held_table(pattern: Pattern, n: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the chunked sparse solves read of a pattern at length n with chunks of ``chunk`` rows, in pattern
    positions (the same for every left padding), on the CPU:

    - held (cdiv(n, chunk), HM) int32: row c lists, sorted, the held rows H_c of chunk c (the earlier rows its
      rows read; ``chunked_solve.held_rows`` is the plain reference), -1 past them; HM is the largest |H_c| as a
      tile width (a power of two >= 16);
    - reads (cdiv(n, chunk), chunk, chunk + HM) int8: 1 where row i of chunk c reads row j of the chunk (column j)
      or its h-th held row (column chunk + h) through B.

    Both come from ``Pattern.source_index`` in a few whole-table operations.
    """
    if pattern.is_dense or not pattern.has_recurrence:
        raise ValueError(f"pattern {pattern.name!r} has no held rows: the chunked sparse solves take sparse patterns "
                         "with a recurrence")
    with torch.device("cpu"):  # cached: never on the device of the first caller's context
        sources = pattern.source_index(n)
        row = torch.arange(n)[:, None].expand_as(sources)
        c0 = (row // chunk) * chunk
        early = (sources >= 0) & (sources < c0)
        inside = sources >= c0
        # The held rows: distinct (chunk, source) pairs of the early reads, sorted, numbered within their chunk.
        keys = (row // chunk * n + sources)[early]
        held_keys = torch.unique(keys)
        held_chunk = held_keys // n
        first = torch.searchsorted(held_chunk, torch.arange(triton_cdiv(n, chunk)))
        rank = torch.arange(len(held_keys)) - first[held_chunk]
        width = tile_width(int(rank.max()) + 1 if len(rank) else 1)
        table = torch.full((len(first), width), -1, dtype=torch.int32)
        table[held_chunk, rank] = (held_keys % n).to(torch.int32)
        reads = torch.zeros(len(first), chunk, chunk + width, dtype=torch.int8)
        reads[row[inside] // chunk, row[inside] % chunk, sources[inside] - c0[inside]] = 1
        rank_of_read = rank[torch.searchsorted(held_keys, keys)]
        reads[row[early] // chunk, row[early] % chunk, chunk + rank_of_read] = 1
    return table, reads


@functools.lru_cache(maxsize=32)
def _held_tables_on(pattern: Pattern, n: int, chunk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`held_table` on ``device``, copied there once: every forward and backward of the chunked solves reads
    them, and at long lengths they are tens of megabytes."""
    return tuple(t.to(device) for t in held_table(pattern, n, chunk))


def _table(values: tuple[int, ...], device) -> torch.Tensor:
    return torch.tensor(values if values else (1,), dtype=torch.int32, device=device)


def has_recurrent_rows(plan: Plan, start: torch.Tensor, heads: int, n: int) -> torch.Tensor:
    """(B * H, n) bool: rows whose recurrent set is non-empty (the gate applies there)."""
    t = torch.arange(n, device=start.device)
    rel = t[None, :] - start[:, None].long()
    has = (rel >= plan.f0) if plan.has_b else torch.zeros_like(rel, dtype=torch.bool)
    return has.repeat_interleave(heads, dim=0)


def valid_rows(start: torch.Tensor, heads: int, n: int) -> torch.Tensor:
    """(B * H, n) bool: real (not padded) rows."""
    t = torch.arange(n, device=start.device)
    return (t[None, :] >= start[:, None].long()).repeat_interleave(heads, dim=0)


# --------------------------------------------------------------------------------------------------
# Launchers (all tensors flattened to (B * H, n, w) contiguous)


@dataclass
class LaunchShapes:
    """The sizes a launch needs: B * H rows of n positions, key widths da / db, value width e, scale, precision."""

    BH: int
    H: int
    n: int
    da: int
    db: int
    e: int
    scale: float
    prec: str


def launch_forward(qa, ka, qb, kb, x, g, start, plan: Plan, sh: LaunchShapes, cfg: BlockConfig, tied: bool,
                   for_backward: bool = True):
    """Run the forward kernels. Returns (y, saved) with y (BH, n, e) float32; without ``for_backward`` the chunked
    solves keep no block inverses in ``saved`` (no backward will read them)."""
    jit = jit_module()
    dev = x.device
    BH, H, n, e = sh.BH, sh.H, sh.n, sh.e
    qk2 = sh.scale * LOG2E
    BE = tile_width(e)
    oa = lsea = lseb = r = j = y_read = inverses = None
    if plan.dense:
        if not tied:
            oa, lsea = new_buffer((BH, n, e), dev), new_buffer((BH, n), dev)
            grid = (triton_cdiv(n, cfg.attn_m), BH)
            jit.attn_fwd_kernel[grid](qa, ka, x, oa, lsea, start, n, H, sh.da, e, qk2,
                                      BM=cfg.attn_m, BN=cfg.attn_n, BD=tile_width(sh.da), BE=BE, PREC=sh.prec,
                                      num_warps=cfg.num_warps)
        else:
            oa = x
        if plan.has_b:
            y, r, lseb = new_buffer((BH, n, e), dev), new_buffer((BH, n, e), dev), new_buffer((BH, n), dev)
            copy = cfg.solved_copy and x.dtype != torch.float32
            y_read = new_buffer((BH, n, e), dev, dtype=x.dtype) if copy else y
            kernel, block = _dense_solve(jit, cfg, "fwd")
            chunked = cfg.dense_solver == "chunked"
            if chunked and for_backward:
                inverses = _block_inverses(BH, n, block, dev)
            kernel[_solve_grid(n, BH, block)](
                qb, kb, oa, g, y, y_read, r, lseb, start, _progress(BH, dev), n, H, sh.db, e, qk2,
                **(_inverses_args(inverses, y) if chunked else {}), BLOCK=block, LOG2_BLOCK=int(math.log2(block)),
                BD=tile_width(sh.db), BE=BE, COPY=copy, PREC=sh.prec, SOLVE_PREC=SOLVE_PREC,
                num_warps=cfg.solve_warps, num_stages=cfg.solve_stages)
        else:
            y = oa
    else:
        offs, steps = _table(plan.offsets, dev), _table(plan.steps, dev)
        K = len(plan.offsets)
        if not tied:
            oa, lsea = new_buffer((BH, n, e), dev), new_buffer((BH, n), dev)
        else:
            oa = x
        if plan.has_b:
            lseb = new_buffer((BH, n), dev)
        grid = (triton_cdiv(n, cfg.sparse_m), BH)
        jit.sparse_direct_kernel[grid](
            qa if not tied else x, ka if not tied else x, x, qb if plan.has_b else x, kb if plan.has_b else x,
            oa, lsea if lsea is not None else lseb, lseb if lseb is not None else lsea, start, offs, steps, K,
            n, H, sh.da, sh.db, e, qk2,
            BM=cfg.sparse_m, BDA=tile_width(sh.da), BDB=tile_width(sh.db), BE=BE, CE=plan.ce, HAS_A=not tied,
            HAS_B=plan.has_b, num_warps=cfg.num_warps)
        if plan.has_b and cfg.sparse_solver == "chunked":
            held, reads = _held_tables_on(plan.pattern, n, cfg.chunk, dev)
            y, j = new_buffer((BH, n, e), dev), new_buffer((BH, held.shape[0], cfg.chunk, held.shape[1]), dev)
            if for_backward:
                inverses = _block_inverses(BH, n, cfg.chunk, dev)
            jit.chunk_prepare_kernel[(held.shape[0], BH)](
                qb, kb, oa, g, lseb, held, reads, y, j, start, plan.f0, n, H, sh.db, e, qk2,
                **_inverses_args(inverses, y), **_held_tiles(cfg, held), LOG2_C=int(math.log2(cfg.chunk)),
                BD=tile_width(sh.db), BE=BE, PREC=sh.prec, SOLVE_PREC=SOLVE_PREC, num_warps=cfg.solve_warps)
            _chunk_carry(jit, y, j, held, start, sh, cfg, reverse=False)
        elif plan.has_b:
            y, r = new_buffer((BH, n, e), dev), new_buffer((BH, n, e), dev)
            jit.sparse_solve_fwd_kernel[(BH,)](
                qb, kb, oa, g, lseb, y, r, start, offs, steps, K, plan.f0, n, H, sh.db, e, qk2,
                BLOCK=cfg.solve, LOG2_BLOCK=int(math.log2(cfg.solve)), BD=tile_width(sh.db), BE=BE, CE=plan.ce,
                SOLVE_PREC=SOLVE_PREC, num_warps=cfg.solve_warps, num_stages=cfg.solve_stages)
        else:
            y = oa
    return y, dict(oa=oa, lsea=lsea, lseb=lseb, y=y, r=r, j=j, y_read=y_read, inverses=inverses)


def launch_backward(dy, qa, ka, qb, kb, x, g, start, saved, plan: Plan, sh: LaunchShapes, cfg: BlockConfig, tied: bool):
    """Gradients (dqa, dka, dqb, dkb, dx, dg) as float32 flat tensors (None where not applicable)."""
    jit = jit_module()
    dev = dy.device
    BH, H, n, e = sh.BH, sh.H, sh.n, sh.e
    qk2 = sh.scale * LOG2E
    BE = tile_width(e)
    B = start.shape[0]
    heads = BH // B
    oa, lsea, lseb, y, r = (saved[k] for k in ("oa", "lsea", "lseb", "y", "r"))
    hasb = has_recurrent_rows(plan, start, heads, n)
    geff = g.float() * hasb if plan.has_b else torch.zeros(BH, n, device=dev)
    dqa = dka = dqb = dkb = dx = dg = None
    offs, steps = _table(plan.offsets, dev), _table(plan.steps, dev)
    K = len(plan.offsets)
    if plan.has_b:
        w = new_buffer((BH, n, e), dev)
        da, db, dg = new_buffer((BH, n), dev), new_buffer((BH, n), dev), new_buffer((BH, n), dev)
        if plan.dense:
            copy = cfg.solved_copy and x.dtype != torch.float32
            w_read = new_buffer((BH, n, e), dev, dtype=x.dtype) if copy else w
            kernel, block = _dense_solve(jit, cfg, "bwd")
            kernel[_solve_grid(n, BH, block)](
                qb, kb, oa, r, g, lseb, dy, w, w_read, da, db, dg, start, _progress(BH, dev), n, H, sh.db, e, qk2,
                **({"TINV": saved["inverses"]} if cfg.dense_solver == "chunked" else {}), BLOCK=block,
                LOG2_BLOCK=int(math.log2(block)), BD=tile_width(sh.db), BE=BE, COPY=copy, PREC=sh.prec,
                SOLVE_PREC=SOLVE_PREC, num_warps=cfg.solve_warps, num_stages=cfg.solve_stages)
        elif cfg.sparse_solver == "chunked":
            held, reads = _held_tables_on(plan.pattern, n, cfg.chunk, dev)
            grad = dy.float() * valid_rows(start, heads, n)[..., None]
            _chunk_carry(jit, grad, saved["j"], held, start, sh, cfg, reverse=True)
            jit.chunk_rows_bwd_kernel[(held.shape[0], BH)](
                qb, kb, oa, g, lseb, held, reads, y, grad, saved["inverses"], w, da, db, dg, start, plan.f0, n, H,
                sh.db, e, qk2, **_held_tiles(cfg, held), LOG2_C=int(math.log2(cfg.chunk)), BD=tile_width(sh.db),
                BE=BE, PREC=sh.prec, SOLVE_PREC=SOLVE_PREC, num_warps=cfg.solve_warps)
        else:
            gacc = torch.zeros(BH, n, e, device=dev)
            jit.sparse_solve_bwd_kernel[_solve_grid(n, BH, cfg.solve)](
                qb, kb, oa, r, g, lseb, dy, gacc, w, da, db, dg, start, _progress(BH, dev), offs, steps, K, plan.f0,
                n, H, sh.db, e, qk2,
                BLOCK=cfg.solve, LOG2_BLOCK=int(math.log2(cfg.solve)), BD=tile_width(sh.db), BE=BE, CE=plan.ce,
                SOLVE_PREC=SOLVE_PREC, num_warps=cfg.solve_warps, num_stages=cfg.solve_stages)
    else:
        w = dy.float() * valid_rows(start, heads, n)[..., None]
        da = (w * oa).sum(-1)
        db = None
    if tied:
        dx = (1.0 - geff)[..., None] * w
    if plan.dense:
        if not tied:
            coef = 1.0 - geff
            dqa, dka, dx = new_buffer((BH, n, sh.da), dev), new_buffer((BH, n, sh.da), dev), new_buffer((BH, n, e), dev)
            _attn_bwd(jit, qa, ka, x, w, coef, da, lsea, dqa, dka, dx, start, sh, sh.da, cfg, strict=False)
        if plan.has_b:
            dqb, dkb = new_buffer((BH, n, sh.db), dev), new_buffer((BH, n, sh.db), dev)
            # Channel B's values are the solved rows: their copy in the input dtype where the forward kept one.
            v = saved["y_read"] if saved["y_read"] is not None else y
            _attn_bwd(jit, qb, kb, v, w, geff, db, lseb, dqb, dkb, None, start, sh, sh.db, cfg, strict=True)
    else:
        if not tied:
            dqa, dka, dx = new_buffer((BH, n, sh.da), dev), torch.zeros(BH, n, sh.da, device=dev), torch.zeros(BH, n, e,
                                                                                                       device=dev)
        if plan.has_b:
            dqb, dkb = new_buffer((BH, n, sh.db), dev), torch.zeros(BH, n, sh.db, device=dev)
        dummy = w
        if plan.has_b and cfg.sparse_solver == "chunked":
            jit.chunk_grads_kernel[(held.shape[0], BH)](
                qa if not tied else dummy, ka if not tied else dummy, x, qb, kb, y, w, g, da, db,
                lsea if lsea is not None else da, lseb, held, reads, dqa if dqa is not None else dummy,
                dka if dka is not None else dummy, dx if not tied else dummy, dqb, dkb, start, plan.f0, n, H, sh.da,
                sh.db, e, qk2, sh.scale, **_held_tiles(cfg, held), BDA=tile_width(sh.da), BDB=tile_width(sh.db),
                BE=BE, HAS_A=not tied, PREC=sh.prec, num_warps=cfg.solve_warps)
            return dqa, dka, dqb, dkb, dx, dg
        grid = (triton_cdiv(n, cfg.sparse_grads_m), BH)
        jit.sparse_grads_kernel[grid](
            qa if not tied else dummy, ka if not tied else dummy, x, qb if plan.has_b else dummy,
            kb if plan.has_b else dummy, y, w, g if plan.has_b else dummy, da, db if db is not None else da,
            lsea if lsea is not None else da, lseb if lseb is not None else da,
            dqa if dqa is not None else dummy, dka if dka is not None else dummy, dx if not tied else dummy,
            dqb if dqb is not None else dummy, dkb if dkb is not None else dummy,
            start, offs, steps, K, plan.f0, n, H, sh.da, sh.db, e, qk2, sh.scale,
            BM=cfg.sparse_grads_m, BDA=tile_width(sh.da), BDB=tile_width(sh.db), BE=BE, CE=plan.ce, HAS_A=not tied,
            HAS_B=plan.has_b, num_warps=cfg.num_warps)
    return dqa, dka, dqb, dkb, dx, dg


def _attn_bwd(jit, q, k, v, w, coef, delta, lse, dq, dk, dv, start, sh: LaunchShapes, d, cfg, strict: bool):
    BH, H, n, e = sh.BH, sh.H, sh.n, sh.e
    qk2 = sh.scale * LOG2E
    if cfg.attn_bwd == "atomic":
        # Every key block before a query row adds its share of that row's dQ: the sums start at zero.
        dq.zero_()
        jit.attn_bwd_atomic_kernel[(triton_cdiv(n, cfg.atomic_n), BH)](
            q, k, v, w, coef, delta, lse, dq, dk, dv if dv is not None else dk, start, n, H, d, e, qk2, sh.scale,
            BM=cfg.atomic_m, BN=cfg.atomic_n, BD=tile_width(d), BE=tile_width(e), STRICT=strict,
            HAS_DV=dv is not None, PREC=sh.prec, num_warps=cfg.atomic_warps)
        return
    common = dict(BD=tile_width(d), BE=tile_width(e), STRICT=strict, PREC=sh.prec, num_warps=cfg.num_warps)
    jit.attn_bwd_dkdv_kernel[(triton_cdiv(n, cfg.bwd_n), BH)](
        q, k, v, w, coef, delta, lse, dk, dv if dv is not None else dk, start, n, H, d, e, qk2, sh.scale,
        BM=cfg.bwd_m, BN=cfg.bwd_n, HAS_DV=dv is not None, **common)
    jit.attn_bwd_dq_kernel[(triton_cdiv(n, cfg.bwd_m), BH)](
        q, k, v, w, coef, delta, lse, dq, start, n, H, d, e, qk2, sh.scale, BM=cfg.bwd_m, BN=cfg.bwd_n, **common)


def _held_tiles(cfg: BlockConfig, held: torch.Tensor) -> dict:
    """The chunk and held-row tile constexprs of every chunked sparse kernel: C rows per chunk, HM held rows in the
    table, visited HB <= C at a time."""
    return dict(C=cfg.chunk, HM=held.shape[1], HB=min(held.shape[1], cfg.chunk))


def _chunk_carry(jit, y, j, held, start, sh: LaunchShapes, cfg: BlockConfig, reverse: bool):
    """The chunked solves' chain through the held rows, in place on y (BH, n, e) float32: forward Yhat -> Y,
    reverse dY -> G. One program per (batch x head, 16 value columns); no software pipelining across the
    barrier that ends each chunk."""
    columns = 16
    jit.chunk_carry_kernel[(sh.BH, triton_cdiv(sh.e, columns))](
        y, j, held, start, sh.n, sh.H, sh.e, **_held_tiles(cfg, held), BES=columns, REVERSE=reverse,
        SOLVE_PREC=SOLVE_PREC, num_warps=cfg.solve_warps, num_stages=1)


def _solve_grid(n: int, BH: int, block: int) -> tuple:
    """Grid of the solves run per block of ``block`` rows (the ticket-ordered ones): one program per (row block,
    batch x head), which the kernels order by ticket."""
    return (triton_cdiv(n, block) * BH,)


def _dense_solve(jit, cfg: BlockConfig, direction: str):
    """The dense solve kernel of ``cfg.dense_solver`` for ``direction`` ("fwd" or "bwd"), and its rows per block."""
    if cfg.dense_solver == "chunked":
        return getattr(jit, f"dense_chunk_{direction}_kernel"), cfg.chunk
    return getattr(jit, f"dense_solve_{direction}_kernel"), cfg.solve


def _block_inverses(BH: int, n: int, block: int, device) -> torch.Tensor:
    """The chunked solves' in-block inverses T_c = (I - B_cc)^-1, (BH, cdiv(n, block), block, block) float32: the
    forward forms them and writes them whole, the backward applies their transposes instead of forming them again
    (one more float32 tensor of n x block per head saved for the backward, against 2 (log2(block) - 1) in-block
    products per block)."""
    return new_buffer((BH, triton_cdiv(n, block), block, block), device)


def _inverses_args(inverses: torch.Tensor | None, placeholder: torch.Tensor) -> dict:
    """The chunked forward kernels' TINV and SAVE_INVERSE arguments: the inverses, or a placeholder pointer
    they do not write when there are none to keep."""
    return dict(TINV=placeholder if inverses is None else inverses, SAVE_INVERSE=inverses is not None)


def _progress(BH: int, device) -> torch.Tensor:
    """The solves' schedule (``jit.common._claim_block``): blocks published per (batch x head), then the ticket."""
    return torch.zeros(BH + 1, dtype=torch.int32, device=device)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------------------
# Autograd


def _flat(t: torch.Tensor | None, dtype=None) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])
    if dtype is not None:
        t = t.to(dtype)
    return t.contiguous()


class _MixFunction(torch.autograd.Function):
    """y = (I - B)^-1 A x on the Triton kernels; tied=True gives z = (I - B)^-1 (1 - g) x (float32)."""

    @staticmethod
    def forward(ctx, qa, ka, qb, kb, x, g, start, plan: Plan, scale: float, tied: bool):
        batch, heads, n, e = x.shape
        dtype = x.dtype
        sh = LaunchShapes(BH=batch * heads, H=heads, n=n, da=0 if qa is None else qa.shape[-1],
                     db=0 if qb is None else qb.shape[-1], e=e, scale=scale,
                     prec=FP32_PREC if dtype == torch.float32 else "tf32")
        cfg = fitted_block_config(dtype, max(sh.da, sh.db, e))
        flat = [_flat(t, dtype) for t in (qa, ka, qb, kb, x)] + [_flat(g)]
        start = start.to(device=x.device, dtype=torch.int32).contiguous()
        # A backward may follow only where an input needs its gradient (under torch.no_grad an input that requires
        # grad still counts: the inverses are kept for nothing then, never missed).
        y, saved = launch_forward(*flat, start, plan, sh, cfg, tied, for_backward=any(ctx.needs_input_grad[:6]))
        keys = ("oa", "lsea", "lseb", "y", "r", "j", "y_read", "inverses")
        ctx.save_for_backward(*flat, start, *(saved[k] for k in keys))
        ctx.meta = (plan, sh, cfg, tied, keys, [None if t is None else t.dtype for t in (qa, ka, qb, kb, x, g)])
        out = y.view(batch, heads, n, e)
        return out if tied else out.to(dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        plan, sh, cfg, tied, keys, dtypes = ctx.meta
        qa, ka, qb, kb, x, g, start, *rest = ctx.saved_tensors
        saved = dict(zip(keys, rest))
        batch, heads, n, e = dy.shape
        grads = launch_backward(_flat(dy), qa, ka, qb, kb, x, g, start, saved, plan, sh, cfg, tied)
        out = []
        for grad, dt, like in zip(grads, dtypes, (qa, ka, qb, kb, x, g)):
            if grad is None or dt is None:
                out.append(None)
            else:
                out.append(grad.view(batch, heads, *like.shape[1:]).to(dt))
        return (*out, None, None, None, None)


def _prepare(x, start, pattern, *tensors):
    check_ready(*tensors, x)
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"the Triton kernels take float32, bfloat16 or float16 inputs, got {x.dtype}; "
            "use impl='torch' for float64")
    batch, _, n, _ = x.shape
    if start is None:
        start = torch.zeros(batch, dtype=torch.int32, device=x.device)
    return make_plan(pattern, n), start


def triton_mix(qa, ka, qb, kb, x, g, pattern, start=None, scale=None, d=None) -> torch.Tensor:
    """Y = (I - B)^-1 (1 - g) A~ X on the Triton kernels; same contract as ``ops.parallel_mix``.

    Args:
        qa, ka: (B, H, n, d) direct-channel queries/keys (None for the tied variant); qb, kb: (B, H, n, d')
            recurrent channel (None for attention kinds); x: (B, H, n, e) values; g: (B, H, n) gate (None for
            attention kinds); pattern: spec or Pattern; start: optional (B,) left padding; scale: default
            d ** -0.5 (d of qa, for both channels, as in ``ops.reference``; of qb for the tied variant);
            d: (B, H, n) for the tied variant, z = (I - B)^-1 (1 - g) x, y = z - d x.

    Returns:
        (B, H, n, e) in x's dtype. Differentiable in qa, ka, qb, kb, x, g and d.
    """
    pattern = get_pattern(pattern)
    check_inputs(qa, ka, qb, kb, x, g, pattern, start, tied_d=d)
    if d is not None:
        plan, start = _prepare(x, start, pattern, qb, kb, g, d)
        scale = qb.shape[-1] ** -0.5 if scale is None else float(scale)
        z = _MixFunction.apply(None, None, qb, kb, x, g, start, plan, scale, True)
        valid = valid_rows(start, 1, x.shape[2]).view(x.shape[0], 1, x.shape[2], 1)
        y = (z - d.float()[..., None] * x.float()) * valid
        return y.to(x.dtype)
    plan, start = _prepare(x, start, pattern, qa, ka, qb, kb, g)
    scale = qa.shape[-1] ** -0.5 if scale is None else float(scale)
    if not plan.has_b:
        qb = kb = g = None
    return _MixFunction.apply(qa, ka, qb, kb, x, g, start, plan, scale, False)
