"""What every launcher of the Triton kernels shares: the tiles and variants (``BlockConfig``), the output buffers,
the sizes of a launch, what the kernels need to know about a pattern (``Plan``, the chunked solves' held rows), and
the small tensors the solves schedule themselves with. Loaded once, whichever Triton mode the kernels run in
(``_loader``): the settings here hold for both.

Shapes: B batch, H heads, n positions, d key width, e value width.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, replace

import torch

from hf_resolvent.patterns import Pattern

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
    # The variants measured fastest and correct on a GPU: the atomic attention backward and the chunked dense solves
    # reading 16-bit copies (bench/gpu/measure_h200_2), the chunked sparse solves (bench/gpu/measure_h200_3: 48 of 48
    # checks, 4-8x faster than the blocked ones).
    sparse_solver: str = "chunked"
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
        first = torch.searchsorted(held_chunk, torch.arange(cdiv(n, chunk)))
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
def held_tables_on(pattern: Pattern, n: int, chunk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`held_table` on ``device``, copied there once: every forward and backward of the chunked solves reads
    them, and at long lengths they are tens of megabytes."""
    return tuple(t.to(device) for t in held_table(pattern, n, chunk))


def slot_tables(plan: Plan, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse kernels' slot tables: f(k) and a_k per slot, int32 (one unused entry where there are none)."""
    return tuple(torch.tensor(values or (1,), dtype=torch.int32, device=device) for values in (plan.offsets, plan.steps))


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
# Launches (all tensors flattened to (B * H, n, w) contiguous)


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

    @property
    def qk_scale2(self) -> float:
        """The score scale in base 2, as the kernels take it (they exponentiate with exp2)."""
        return self.scale * LOG2E


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def solve_grid(n: int, BH: int, block: int) -> tuple:
    """Grid of the solves run per block of ``block`` rows (the ticket-ordered ones): one program per (row block,
    batch x head), which the kernels order by ticket."""
    return (cdiv(n, block) * BH,)


def score_grad_buffers(sh: LaunchShapes, device, has_a: bool, has_b: bool) -> tuple:
    """The sparse kernels' gradients of the scores and values: dqa, dka, dx (direct channel) and dqb, dkb (recurrent
    channel), float32, None for a channel the variant lacks. dq is written whole; dk and dx receive atomic adds, so
    they start at zero."""
    def channel(present: bool, d: int, widths: tuple) -> tuple:
        if not present:
            return (None,) * (1 + len(widths))
        return (new_buffer((sh.BH, sh.n, d), device), *(torch.zeros(sh.BH, sh.n, w, device=device) for w in widths))

    return (*channel(has_a, sh.da, (sh.da, sh.e)), *channel(has_b, sh.db, (sh.db,)))


def progress_buffer(BH: int, device) -> torch.Tensor:
    """The solves' schedule (``jit.common._claim_block``): blocks published per (batch x head), then the ticket."""
    return torch.zeros(BH + 1, dtype=torch.int32, device=device)


def block_inverses(BH: int, n: int, block: int, device) -> torch.Tensor:
    """The chunked solves' in-block inverses T_c = (I - B_cc)^-1, (BH, cdiv(n, block), block, block) float32: the
    forward forms them and writes them whole, the backward applies their transposes instead of forming them again
    (one more float32 tensor of n x block per head saved for the backward, against 2 (log2(block) - 1) in-block
    products per block)."""
    return new_buffer((BH, cdiv(n, block), block, block), device)
