"""The kernels' cost model: what each recorded launch (``aot.Launch``) moves and computes. Each op module of ``jit/``
holds the model of its kernels beside their code (its ``COSTS``: kernel name -> model); this module holds what they
share and :func:`launch_cost`, which ``scripts/bench/roofline.py`` turns into times. Per launch:

- programs: the size of its grid;
- chain steps: the steps a solve walks one after another, each waiting on the one before it: the blocks of the
  blocked solves (dense, and sparse backward across programs; the sparse forward inside one program per head),
  the blocks of the chunked dense solves (one product left after each wait), and the chunks of the chunked
  sparse solves' carry (one pass per direction). The parallel kernels have none: their programs do not wait on
  each other, and their loops are counted in the FLOP and byte bounds;
- bytes: the memory floor, every distinct tensor the launch is passed moved once (inputs read, outputs written,
  accumulators once), at its real size and dtype: a tile that several programs, or several steps of a loop, read
  again is taken to come from L2. Beside it, tile bytes: what the programs load and store tile by tile (masked
  lanes move nothing, so sparse patterns count the (row, slot) pairs, and the chunked solves the held rows, the
  pattern really reads; an atomic add counts as one store), the traffic L2 serves. The chunked sparse kernels
  also load their chunk's mask of reads, C x (C + HM) int8 from ``launching.held_table``: one table for every
  head, so from L2 but for its one HBM read;
- FLOPs: 2 m n k per tensor-core product (``tl.dot``) at its tile sizes, split by the precision it runs at
  (16-bit operands; float32 operands as tf32, or tf32x3 = three tf32 products), and 2 per multiply-add of the
  row-by-row dot products of the sparse kernels, which run on the CUDA cores in float32. The operands' dtype is
  the launch's: with ``solved_copy`` the dense forward solves' P.Y over earlier blocks read YREAD, the copy of Y in
  the input dtype that the launch also stores (constexpr COPY), the dense backward solves' B^T W over later
  blocks read WREAD, the copy of W alike, and channel B's attention backward takes Y's copy as V, so those
  products count at the 16-bit rate and those tiles at two bytes an element (the chunked solves' products with
  the block next in the chain read Y or W itself).

Integer work (the sources the row-by-row sparse kernels compute per row and slot) is left out.
"""

from __future__ import annotations

import math

import torch

from ._loader import jit_module

# Assumed: blocks of a ticket-ordered solve not yet published when a block's program starts (the block before it
# included). About the resident programs over the heads: 132 SMs x 2 programs / 64 heads at B4 H16.
DEFAULT_BLOCKS_IN_FLIGHT = 4
# How many tf32 products a tl.dot does per precision of its float32 operands.
TF32_PASSES = {"tf32": 1, "tf32x3": 3}
F32 = 4  # bytes of a float32


class Cost:
    """Totals of one launch: bytes, FLOPs (2 m n k per product) and the FLOPs per unit that does them ("16bit" and
    "tf32" tensor cores, tf32x3 counted as its three tf32 products; "fp32" CUDA cores)."""

    def __init__(self):
        self.bytes = 0
        self.flops = 0
        self.work = {"16bit": 0, "tf32": 0, "fp32": 0}

    def move(self, count: int, tensor=None, width: int = 1, elem: int | None = None):
        """``count`` rows of ``width`` elements of ``tensor`` (or of ``elem`` bytes) loaded or stored."""
        size = tensor.element_size() if tensor is not None else elem
        self.bytes += int(count) * width * size

    def dot(self, count: int, m: int, n: int, k: int, a_dtype, prec: str):
        """``count`` tensor-core products (m, k) x (k, n); ``a_dtype`` the operands' dtype, ``prec`` the launch's
        input precision of float32 operands."""
        flops = int(count) * 2 * m * n * k
        self.flops += flops
        if a_dtype == torch.float32:
            self.work["tf32"] += flops * TF32_PASSES[prec]
        else:
            self.work["16bit"] += flops

    def vector(self, count: int, flops_each: int):
        """``count`` row-by-row float32 operations of ``flops_each`` FLOPs on the CUDA cores."""
        self.flops += int(count) * flops_each
        self.work["fp32"] += int(count) * flops_each

    def solve_block(self, count: int, B: int, log2: int, BE: int, solve_prec: str):
        """The in-block solve (I - L)^-1 rhs by repeated squaring: log2(B) products onto the rhs, log2(B) - 1
        squarings, all with float32 operands."""
        self.dot(count * log2, B, BE, B, torch.float32, solve_prec)
        self.dot(count * (log2 - 1), B, B, B, torch.float32, solve_prec)

    def inverse_applied(self, count: int, B: int, log2: int, widths: tuple, solve_prec: str):
        """T = (I - L)^-1 formed (``_unit_lower_inverse``: 2 (log2(B) - 1) products of B x B, float32 operands),
        then applied to right-hand sides of the given widths, one product each."""
        self.dot(count * 2 * (log2 - 1), B, B, B, torch.float32, solve_prec)
        self.applied(count, B, widths, solve_prec)

    def applied(self, count: int, B: int, widths: tuple, solve_prec: str):
        """A formed B x B inverse applied to right-hand sides of the given widths, one float32 product each."""
        for width in widths:
            self.dot(count, B, width, B, torch.float32, solve_prec)


def launch_cost(launch, pattern: str, in_flight: int = DEFAULT_BLOCKS_IN_FLIGHT) -> dict:
    """Programs, chain steps, bytes and FLOPs of one recorded launch of ``pattern`` (see above for what counts);
    ``in_flight`` the assumption of the chunked dense forward. The kernel's own module gives its counts."""
    model = jit_module(interpret=False).COSTS.get(launch.name)
    if model is None:
        raise ValueError(f"no cost model for kernel {launch.name!r}: add one to its module's COSTS in kernels/jit/")
    cost = Cost()
    chain = model(launch, cost, pattern, in_flight)
    return {"kernel": launch.name.removesuffix("_kernel"), "grid": list(launch.grid),
            "programs": math.prod(launch.grid), "chain_steps": chain, "bytes": hbm_bytes(launch),
            "tile_bytes": cost.bytes, "flops": cost.flops, "work_flops": dict(cost.work)}


def hbm_bytes(launch) -> int:
    """The launch's memory floor: every distinct tensor it is passed, moved once (inputs read, outputs written,
    accumulators counted once); tiles read again by other programs or later loop steps are taken to hit L2."""
    seen = {id(v): v for v in launch.args.values() if isinstance(v, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in seen.values())
