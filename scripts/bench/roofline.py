"""Roofline model of the Triton mixer's kernels: what each kernel moves and computes, and the time that implies.

    python scripts/bench/roofline.py --out runs/bench/roofline.json
    python scripts/bench/roofline.py --patterns dense,exp2:ce --lengths 8192 --step-latency-us 1
    python scripts/bench/roofline.py --config default \
        --config chunked:sparse_solver=chunked,dense_solver=chunked,attn_bwd=atomic

For each pattern and length (B4 H16 d64 bfloat16 by default, the shapes of ``bench/gpu/kernels_h100.json``) the
forward and backward launches are recorded from the real launch code (``kernels/aot.py``'s recorder, on meta
tensors: nothing runs and nothing is allocated), so grids, tile sizes and dtypes follow the code. Each
``--config [NAME:]FIELD=VALUE,...`` (BlockConfig settings, e.g. the solvers ``sparse_solver=chunked``,
``dense_solver=chunked`` and the backward ``attn_bwd=atomic``; ``default`` for none) is one variant, recorded
under those settings and named NAME (its settings without one) in the rows and the JSON. Per launch:

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
  also load their chunk's mask of reads, C x (C + HM) int8 from ``resolvent.held_table``: one table for every
  head, so from L2 but for its one HBM read;
- FLOPs: 2 m n k per tensor-core product (``tl.dot``) at its tile sizes, split by the precision it runs at
  (16-bit operands; float32 operands as tf32, or tf32x3 = three tf32 products), and 2 per multiply-add of the
  row-by-row dot products of the sparse kernels, which run on the CUDA cores in float32. The operands' dtype is
  the launch's: with ``solved_copy`` the dense forward solves' P.Y over earlier blocks read YREAD, the copy of Y in
  the input dtype that the launch also stores (constexpr COPY), the dense backward solves' B^T W over later
  blocks read WREAD, the copy of W alike, and channel B's attention backward takes Y's copy as V, so those
  products count at the 16-bit rate and those tiles at two bytes an element (the chunked solves' products with
  the block next in the chain read Y or W itself);
- roofline time: max(compute time, bytes / bandwidth) + chain steps x the per-step latency, with the compute
  time the sum over precisions of FLOPs / peak, scaled up when the grid has fewer programs than the GPU has
  SMs; integer work (the sources the row-by-row sparse kernels compute per row and slot) is left out. Beside
  it, the overlapped time max(compute, memory, chain): the chain's steps and the parallel work fully
  overlapped, where the roofline time has them one after the other.

The per-step latency is an assumption (``DEFAULT_STEP_LATENCY_US``, ``--step-latency-us``; per kernel
``--kernel-step-latency-us``), and so is how many blocks of a ticket-ordered solve are still in flight when a
block's program starts (``DEFAULT_BLOCKS_IN_FLIGHT``, ``--blocks-in-flight``): the chunked dense forward scores
those blocks twice. Every pass line gives its work time (the sum of max(compute, memory)) and its chain steps,
so the time at another latency L is work + steps x L.

A pass is its kernels one after another (the small PyTorch operations between them are left out). SDPA is the
reference: FlashAttention-2's count, 4 n^2/2 d FLOPs per head forward and 2.5 times that backward. Beside each
pass: the measured time from ``--measured`` (a bench_kernels.py JSON; its rows of the variant's settings) and
measured / roofline, and per kernel the time per step from ``--profile`` (a profile_kernels.py log) where it has
the case. Prints a table per case, a summary of the passes against SDPA, and writes the JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import sys
from pathlib import Path

from hf_resolvent.training import cli

REPO = Path(__file__).resolve().parents[2]

# NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (dense, no sparsity): BF16 tensor core 989 TFLOP/s,
# TF32 tensor core 494.5 TFLOP/s, FP32 66.9 TFLOP/s, HBM3 3.35 TB/s, 132 SMs.
H100_BF16_TFLOPS = 989.0
H100_TF32_TFLOPS = 494.5
H100_FP32_TFLOPS = 66.9
H100_HBM_TBPS = 3.35
H100_SMS = 132
# Assumed, not measured: the time one step of a solve's chain takes on its own (a wait on the previous block's
# publication, the L2 round trip of its rows, the dependent products after the wait).
DEFAULT_STEP_LATENCY_US = 2.0
# Assumed: blocks of a ticket-ordered solve not yet published when a block's program starts (the block before it
# included). About the resident programs over the heads: 132 SMs x 2 programs / 64 heads at B4 H16.
DEFAULT_BLOCKS_IN_FLIGHT = 4

DEFAULT_PATTERNS = "attention,dense,exp2:ce,square:ce"
DEFAULT_LENGTHS = "4096,8192,32768"
DEFAULT_MEASURED = "bench/gpu/kernels_h100.json"
DEFAULT_PROFILE = "bench/gpu/profile_h100_lookback.log"
SDPA = "sdpa"
DEFAULT_VARIANT = "default"
# A measurement names the kernels it timed by aot.KERNEL_FIELDS; files written before they recorded them
# (bench_kernels rows without "kernels", profile logs whose case lines name only what they changed) meant the
# defaults of their day, LEGACY_DEFAULTS, which the measured kernels later replaced.
LEGACY_DEFAULTS = {"sparse_solver": "blocked", "dense_solver": "blocked", "solved_copy": False, "attn_bwd": "split"}
# How many tf32 products a tl.dot does per precision of its float32 operands.
TF32_PASSES = {"tf32": 1, "tf32x3": 3}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench/roofline.json")
    p.add_argument("--patterns", default=DEFAULT_PATTERNS, help=f"comma-separated; '{SDPA}' is always added")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--bf16-tflops", type=float, default=H100_BF16_TFLOPS, help="16-bit tensor-core peak")
    p.add_argument("--tf32-tflops", type=float, default=H100_TF32_TFLOPS, help="tf32 tensor-core peak")
    p.add_argument("--fp32-tflops", type=float, default=H100_FP32_TFLOPS, help="float32 CUDA-core peak")
    p.add_argument("--hbm-tbps", type=float, default=H100_HBM_TBPS, help="memory bandwidth, TB/s")
    p.add_argument("--sms", type=int, default=H100_SMS, help="streaming multiprocessors")
    p.add_argument("--step-latency-us", type=float, default=DEFAULT_STEP_LATENCY_US,
                   help="assumed time of one chain step of a solve (microseconds)")
    p.add_argument("--kernel-step-latency-us", default="", metavar="KERNEL=US[,KERNEL=US...]",
                   help="per-kernel chain-step latencies over --step-latency-us, e.g. chunk_carry=1")
    p.add_argument("--blocks-in-flight", type=int, default=DEFAULT_BLOCKS_IN_FLIGHT,
                   help="assumed blocks of a ticket-ordered solve not yet published when a block starts (>= 1)")
    p.add_argument("--config", action="append", default=None, metavar="[NAME:]FIELD=VALUE[,FIELD=VALUE...]",
                   help="BlockConfig settings of one variant ('default' for none); repeat it to model variants "
                        "side by side (default: the defaults alone)")
    p.add_argument("--measured", default=DEFAULT_MEASURED, help="bench_kernels.py JSON ('' for none)")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="profile_kernels.py log ('' for none)")
    args = p.parse_args(argv)
    try:
        args.variants = [parse_variant(text) for text in args.config or [DEFAULT_VARIANT]]
        args.kernel_step_latency = parse_kernel_latencies(args.kernel_step_latency_us)
    except ValueError as err:
        p.error(str(err))
    names = [name for name, _ in args.variants]
    if len(set(names)) != len(names):
        p.error(f"--config: two variants share a name ({', '.join(names)}); name them NAME:FIELD=VALUE,...")
    if args.blocks_in_flight < 1:
        p.error(f"--blocks-in-flight must be >= 1 (the block before is always in flight), got {args.blocks_in_flight}")
    cli.check(p, files=[("--out", args.out)])
    return args


def parse_variant(text: str) -> tuple[str, dict]:
    """(name, BlockConfig settings) of a ``--config`` value: ``[NAME:]FIELD=VALUE,...``, or ``default`` (or "")
    for the defaults. Without a name the variant is named by its settings."""
    from hf_resolvent.backends.triton import aot

    text = text.strip()
    name, sep, rest = text.partition(":")
    if not sep or "=" in name:
        name, rest = "", text
    if rest in ("", DEFAULT_VARIANT):
        return name or DEFAULT_VARIANT, {}
    try:
        settings = aot.parse_config(rest)
    except ValueError as err:
        raise ValueError(f"--config {text!r}: {err}") from None
    return name or aot.config_label(settings), settings


def parse_kernel_latencies(text: str) -> dict:
    """{kernel: microseconds} from ``KERNEL=US,...`` (kernel names with or without ``_kernel``)."""
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        try:
            out[name.strip().removesuffix("_kernel")] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--kernel-step-latency-us: {item!r} is not KERNEL=MICROSECONDS (e.g. chunk_carry=1)")
    return out


# --------------------------------------------------------------------------------------------------
# Recording the launches


def record_passes(pattern: str, n: int, batch: int, heads: int, d: int, dtype, settings: dict | None = None) -> dict:
    """The launches of a forward and of a backward of ``pattern`` under the BlockConfig ``settings`` (default: the
    current config), recorded on meta tensors: {"forward": [...], "backward": [...]} of ``aot.Launch``."""
    from hf_resolvent.backends.triton import resolvent

    with resolvent.block_config(**(settings or {})):
        return _record_passes(pattern, n, batch, heads, d, dtype)


def _record_passes(pattern: str, n: int, batch: int, heads: int, d: int, dtype) -> dict:
    import torch
    from hf_resolvent.backends.triton import aot, resolvent

    from hf_resolvent.patterns import get_pattern

    plan = resolvent.make_plan(get_pattern(pattern), n)
    BH = batch * heads
    with torch.device("meta"):
        qa, ka, qb, kb, x = (torch.empty(BH, n, d, dtype=dtype) for _ in range(5))
        g = torch.empty(BH, n, dtype=dtype) if plan.has_b else None
        if not plan.has_b:
            qb = kb = None
        start = torch.zeros(batch, dtype=torch.int32)
        sh = resolvent.LaunchShapes(BH=BH, H=heads, n=n, da=d, db=d, e=d, scale=d**-0.5,
                                    prec=resolvent.FP32_PREC if dtype == torch.float32 else "tf32")
        cfg = resolvent.fitted_block_config(dtype, d)
        with aot.recording_launches() as rec:
            _, saved = resolvent.launch_forward(qa, ka, qb, kb, x, g, start, plan, sh, cfg, False)
            n_forward = len(rec.launches)
            resolvent.launch_backward(torch.empty(BH, n, d, dtype=dtype), qa, ka, qb, kb, x, g, start, saved, plan,
                                      sh, cfg, False)
    return {"forward": rec.launches[:n_forward], "backward": rec.launches[n_forward:]}


# --------------------------------------------------------------------------------------------------
# Cost of one launch


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
        import torch

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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _key_steps_causal(n: int, rows: int, keys: int) -> int:
    """Key steps of keys per step summed over the query blocks of rows (keys 0 .. the block's last row)."""
    return sum(_cdiv(min((i + 1) * rows, n), keys) for i in range(_cdiv(n, rows)))


def _query_steps_from_key_block(n: int, rows: int, keys: int) -> int:
    """Query steps of rows per step summed over the key blocks of keys (query blocks from the key block's)."""
    return sum(_cdiv(n - ((j * keys) // rows) * rows, rows) for j in range(_cdiv(n, keys)))


def _solve_block(cost: Cost, count: int, B: int, log2: int, BE: int, solve_prec: str):
    """The in-block solve (I - L)^-1 rhs by repeated squaring: log2(B) products onto the rhs, log2(B) - 1
    squarings, all with float32 operands."""
    import torch

    cost.dot(count * log2, B, BE, B, torch.float32, solve_prec)
    cost.dot(count * (log2 - 1), B, B, B, torch.float32, solve_prec)


def _inverse_applied(cost: Cost, count: int, B: int, log2: int, widths: tuple, solve_prec: str):
    """T = (I - L)^-1 formed (``_unit_lower_inverse``: 2 (log2(B) - 1) products of B x B, float32 operands), then
    applied to right-hand sides of the given widths, one product each."""
    import torch

    cost.dot(count * 2 * (log2 - 1), B, B, B, torch.float32, solve_prec)
    _applied(cost, count, B, widths, solve_prec)


def _applied(cost: Cost, count: int, B: int, widths: tuple, solve_prec: str):
    """A formed B x B inverse applied to right-hand sides of the given widths, one float32 product each."""
    import torch

    for width in widths:
        cost.dot(count, B, width, B, torch.float32, solve_prec)


def _chunk_pair(cost: Cost, count: int, C: int, HM: int, width: int, dtype, prec: str):
    """A product over a chunk's own rows and its twin over the chunk's held rows: C x C or C x HM on two of its
    sizes, ``width`` the third (which two depends on the product; its FLOPs, 2 C (C + HM) width, do not)."""
    cost.dot(count, C, C, width, dtype, prec)
    cost.dot(count, C, HM, width, dtype, prec)


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


@functools.lru_cache(maxsize=64)
def held_counts(pattern: str, n: int, chunk: int) -> dict:
    """The chunked sparse solves' held rows at length n (no left padding): HM, the width of
    ``resolvent.held_table``, and the held rows of all chunks together (the rows the kernels really gather)."""
    from hf_resolvent.backends.triton import resolvent
    from hf_resolvent.backends.triton.chunked_solve import held_rows

    sizes = [len(h) for h in held_rows(pattern, n, chunk)]
    return {"HM": resolvent.tile_width(max(sizes, default=1)), "held": sum(sizes), "chunks": len(sizes)}


def _sparse_pairs(pattern: str, n: int, block: int) -> dict:
    """(row, slot) pairs the pattern reads at length n (no left padding): all of them, and for blocks of
    ``block`` rows, those whose source lies in an earlier block or inside the row's own block."""
    import torch

    from hf_resolvent.patterns import get_pattern

    src = get_pattern(pattern).source_index(n)
    ok = src >= 0
    first_row = (torch.arange(n) // block * block)[:, None]
    early = ok & (src < first_row)
    return {"all": int(ok.sum()), "early": int(early.sum()), "inside": int((ok & ~early).sum())}


def _key_block_traffic(cost: Cost, programs: int, steps: int, BM: int, BN: int, Q, K, V, W, d: int, e: int,
                       has_dv: bool):
    """Tile traffic of an attention backward over key blocks (the split dK/dV kernel, the atomic kernel): each
    program's K and V once, the query rows' Q, W and row scalars at every step, dK (and dV) stored once."""
    f32 = 4
    cost.move(programs * BN, K, d)
    cost.move(programs * BN, V, e)
    cost.move(steps * BM, Q, d)
    cost.move(steps * BM, W, e)
    cost.move(steps * BM, width=3, elem=f32)  # COEF, DELTA, LSE
    cost.move(programs * BN, width=d + (e if has_dv else 0), elem=f32)  # DK, DV


def launch_cost(launch, pattern: str, in_flight: int = DEFAULT_BLOCKS_IN_FLIGHT) -> dict:
    """Programs, chain steps, bytes and FLOPs of one recorded launch (see the module docstring for what counts);
    ``in_flight`` the assumption of the chunked dense forward."""
    import torch

    a, c = launch.args, launch.constexprs
    name = launch.name.removesuffix("_kernel")
    n = a["n"]
    programs = math.prod(launch.grid)
    cost = Cost()
    chain = 0
    f32 = 4
    if name == "attn_fwd":
        BM, BN, BD, BE = c["BM"], c["BN"], c["BD"], c["BE"]
        Q, K, V, BH, d, e = a["Q"], a["K"], a["V"], a["Q"].shape[0], a["d"], a["e"]
        steps = _key_steps_causal(n, BM, BN) * BH
        cost.move(programs * BM, Q, d)
        cost.move(steps * BN, K, d)
        cost.move(steps * BN, V, e)
        cost.move(programs * BM, width=e + 1, elem=f32)  # OUT and LSE
        cost.dot(steps, BM, BN, BD, Q.dtype, c["PREC"])
        cost.dot(steps, BM, BE, BN, V.dtype, c["PREC"])
    elif name in ("attn_bwd_dkdv", "attn_bwd_dq"):
        BM, BN, BD, BE = c["BM"], c["BN"], c["BD"], c["BE"]
        Q, K, V, W, BH, d, e = a["Q"], a["K"], a["V"], a["W"], a["Q"].shape[0], a["d"], a["e"]
        if name == "attn_bwd_dkdv":
            has_dv = c["HAS_DV"]
            steps = _query_steps_from_key_block(n, BM, BN) * BH
            _key_block_traffic(cost, programs, steps, BM, BN, Q, K, V, W, d, e, has_dv)
            n_value_dots = 2 if has_dv else 1  # dO V^T, and P^T dO for dV
        else:
            steps = _key_steps_causal(n, BM, BN) * BH
            cost.move(programs * BM, Q, d)
            cost.move(programs * BM, W, e)
            cost.move(programs * BM, width=3, elem=f32)
            cost.move(steps * BN, K, d)
            cost.move(steps * BN, V, e)
            cost.move(programs * BM, width=d, elem=f32)  # DQ
            n_value_dots = 1
        cost.dot(2 * steps, BM, BN, BD, Q.dtype, c["PREC"])  # Q K^T, and dS with Q or K
        # dO and P meet V in V's dtype: x's for channel A; for B, Y (float32, at tf32) or its 16-bit copy
        cost.dot(n_value_dots * steps, BM, BN, BE, V.dtype, c["PREC"])
    elif name == "attn_bwd_atomic":
        # One program per key block walks the query blocks from its own: scores, dP, dK and dQ once per step.
        BM, BN, BD, BE = c["BM"], c["BN"], c["BD"], c["BE"]
        Q, K, V, W, BH, d, e = a["Q"], a["K"], a["V"], a["W"], a["Q"].shape[0], a["d"], a["e"]
        has_dv = c["HAS_DV"]
        steps = _query_steps_from_key_block(n, BM, BN) * BH
        _key_block_traffic(cost, programs, steps, BM, BN, Q, K, V, W, d, e, has_dv)
        cost.move(steps * BM, width=d, elem=f32)  # DQ atomics
        cost.dot(3 * steps, BN, BM, BD, Q.dtype, c["PREC"])  # K Q^T, dS Q for dK, dS^T K for dQ
        # V dO^T, and P^T dO for dV, in V's dtype (channel B's: Y at tf32, or its 16-bit copy)
        cost.dot((2 if has_dv else 1) * steps, BN, BM, BE, V.dtype, c["PREC"])
    elif name in ("dense_chunk_fwd", "dense_chunk_bwd"):
        B, log2, BD, BE = c["BLOCK"], c["LOG2_BLOCK"], c["BD"], c["BE"]
        QB, KB, G, BH, d, e = a["QB"], a["KB"], a["G"], a["QB"].shape[0], a["d"], a["e"]
        nblk = _cdiv(n, B)
        chain = nblk
        k = {key: v * BH for key, v in dense_chunk_counts(nblk, in_flight, name == "dense_chunk_bwd").items()}
        cost.dot(k["scores"], B, B, BD, QB.dtype, c["PREC"])
        if name == "dense_chunk_fwd":
            # P Y over every earlier block with YREAD's operands (16-bit with COPY): the blocks before c - 1 read
            # YREAD, R's P Y_(c-1) reads Y rounded alike
            y_read = a["YREAD"]
            cost.dot(k["value_products"], B, BE, B, y_read.dtype, c["PREC"])
        else:
            # B^T W over the later blocks but c + 1 with WREAD's operands (16-bit with COPY)
            w_read = a["WREAD"]
            cost.dot(k["read_products"], B, BE, B, w_read.dtype, c["PREC"])
        # T_c (formed forward, loaded backward) applied to the rhs and to the block before's (after's) probabilities
        if name == "dense_chunk_fwd":
            _inverse_applied(cost, programs, B, log2, (BE, B), c["SOLVE_PREC"])
        else:
            _applied(cost, programs, B, (BE, B), c["SOLVE_PREC"])
        cost.dot(programs, B, BE, B, torch.float32, c["SOLVE_PREC"])  # the product after the wait
        cost.move(programs * B, G)
        cost.move(programs * B, a["TINV"], B)  # T_c, stored forward and loaded backward
        if name == "dense_chunk_fwd":
            cost.move(programs * B, QB, d)
            cost.dot(programs, B, BE, B, y_read.dtype, c["PREC"])  # R's in-block part, as R's other terms
            cost.move(k["key_tiles"] * B, KB, d)
            cost.move(k["read_products"] * B, y_read, e)  # solved rows of the blocks before c - 1
            cost.move((k["solved_tiles"] - k["read_products"]) * B, width=e, elem=f32)  # Y of block c - 1
            cost.move(programs * B, a["OA"], e)
            cost.move(programs * B, width=2 * e + 1, elem=f32)  # Y, R, LSEB
            if c["COPY"]:
                cost.move(programs * B, y_read, e)  # the copy of Y stored
        else:
            cost.move(programs * B, KB, d)
            cost.move(programs * B, a["DY"], e)
            cost.move(k["later_rows"] * B, QB, d)
            cost.move(k["later_rows"] * B, G)
            cost.move(k["later_rows"] * B, width=1, elem=f32)  # LSEB of later blocks
            cost.move(k["read_products"] * B, w_read, e)  # solved rows of the later blocks but c + 1
            cost.move((k["solved_tiles"] - k["read_products"]) * B, width=e, elem=f32)  # W of block c + 1
            cost.move(programs * B, width=2 * e, elem=f32)  # OA, R
            cost.move(programs * B, width=e + 3, elem=f32)  # W, DA, DB, DG
            if c["COPY"]:
                cost.move(programs * B, w_read, e)  # the copy of W stored
    elif name in ("chunk_prepare", "chunk_rows_bwd", "chunk_carry", "chunk_grads"):
        C = c["C"]
        held = held_counts(pattern, n, C)
        HM, e = c["HM"], a["e"]
        if HM != held["HM"]:
            raise ValueError(f"{launch.name}: HM = {HM} but resolvent.held_table gives {held['HM']}: the launch was "
                             f"not recorded for pattern {pattern!r} at n = {n}")
        if name == "chunk_carry":
            # Grid (BH, e / BES): each program walks every chunk of its head for BES value columns.
            BH, BES = launch.grid[0], c["BES"]
            chain = _cdiv(n, C)
            per_step = programs * chain
            cost.move(per_step * HM, a["HELD"])
            cost.move(per_step * C * HM, a["J"])  # J_c, read by every column program
            # Forward: Y_c read and written, the held rows read; backward: G_c read, the held rows read and written.
            own, carried = (1, 2) if c["REVERSE"] else (2, 1)
            cost.move(BH * (own * n + carried * held["held"]), width=e, elem=f32)
            cost.dot(per_step, C, BES, HM, torch.float32, c["SOLVE_PREC"])  # J_c Y[H_c], or J_c^T G_c
        elif name == "chunk_grads":
            # Grid (cdiv(n, C), BH): per chunk and channel (A unless tied, B always) P, dP and dS over the chunk's
            # own rows and its held rows (HB at a time, HM in all); dq written once, dk (and dx for A) as atomic
            # tile adds.
            BH, BE, prec = launch.grid[1], c["BE"], c["PREC"]
            rows, held_rows = n * BH, held["held"] * BH
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
                cost.move(rows, width=2 + d, elem=f32)  # LSE and D in, dq out
                cost.move(rows + held_rows, width=d + (e if has_dx else 0), elem=f32)  # dk (and dx) atomics
                _chunk_pair(cost, programs, C, HM, BD, q.dtype, prec)  # scores q k^T
                # dP = dO V^T: dO cast to x's dtype for A; float32 operands (Y and geff W) for B
                _chunk_pair(cost, programs, C, HM, BE, v.dtype, prec)
                _chunk_pair(cost, programs, C, HM, BD, q.dtype, prec)  # dq = dS k
                _chunk_pair(cost, programs, C, HM, BD, q.dtype, prec)  # dk = dS^T q
                if has_dx:
                    _chunk_pair(cost, programs, C, HM, BE, v.dtype, prec)  # dx = P^T dO
        else:
            BH, log2, BD, BE, d = launch.grid[1], c["LOG2_C"], c["BD"], c["BE"], a["d"]
            rows, held_rows = n * BH, held["held"] * BH
            # The chunk's scores onto its own rows and its held rows (HB at a time): tensor-core tiles, masked by the
            # chunk's reads.
            cost.move(rows, a["QB"], d)
            cost.move(rows, a["KB"], d)
            cost.move(held_rows, a["KB"], d)
            cost.move(rows, a["G"])
            cost.move(rows, width=1, elem=f32)  # LSEB
            cost.move(programs * HM, a["HELD"])
            cost.move(programs * C, a["READS"], C + HM)
            _chunk_pair(cost, programs, C, HM, BD, a["QB"].dtype, c["PREC"])
            cost.move(rows, a["OA"], e)
            if name == "chunk_prepare":
                # T_c, then T_c rhs and T_c geff P_held (HB columns at a time)
                _inverse_applied(cost, programs, C, log2, (BE, HM), c["SOLVE_PREC"])
                cost.move(programs * C, a["TINV"], C)  # T_c, for the backward
                cost.move(rows, width=e, elem=f32)  # Y (Yhat)
                cost.move(programs * C * HM, a["J"])  # J, whole tiles
            else:
                _applied(cost, programs, C, (BE,), c["SOLVE_PREC"])  # W_c = T_c^T G_c, T_c as the forward saved it
                cost.move(programs * C, a["TINV"], C)
                cost.move(rows, a["GRAD"], e)
                cost.move(rows + held_rows, a["Y"], e)
                _chunk_pair(cost, programs, C, HM, BE, torch.float32, c["PREC"])  # W_c Y_c^T and W_c Y[H_c]^T
                cost.move(rows, width=e + 3, elem=f32)  # W, DA, DB, DG
    elif name in ("dense_solve_fwd", "dense_solve_bwd"):
        B, log2, BD, BE = c["BLOCK"], c["LOG2_BLOCK"], c["BD"], c["BE"]
        QB, KB, G, BH, d, e = a["QB"], a["KB"], a["G"], a["QB"].shape[0], a["d"], a["e"]
        nblk = _cdiv(n, B)
        chain = nblk
        pairs = nblk * (nblk - 1) // 2 * BH  # (block, earlier or later block) pairs
        if name == "dense_solve_fwd":
            cost.move(programs * B, QB, d)
            cost.move(programs * B, G)
            cost.move(programs * B, KB, d)  # in-block keys
            cost.move(programs * B, a["OA"], e)
            cost.move(pairs * B, KB, d)
            # Earlier blocks' solved rows come from YREAD: Y itself, or with COPY its copy in the input dtype,
            # which the launch also stores.
            y_read = a["YREAD"]
            cost.move(pairs * B, y_read, e)
            cost.move(programs * B, width=2 * e + 1, elem=f32)  # Y, R, LSEB
            if c["COPY"]:
                cost.move(programs * B, y_read, e)
            cost.dot(pairs + programs, B, B, BD, QB.dtype, c["PREC"])
            cost.dot(pairs, B, BE, B, y_read.dtype, c["PREC"])  # P Y
            _solve_block(cost, programs, B, log2, BE, c["SOLVE_PREC"])
            cost.dot(programs, B, BE, B, y_read.dtype, c["PREC"])  # R's in-block part, as R's other terms
        else:
            cost.move(programs * B, KB, d)
            cost.move(programs * B, a["DY"], e)
            cost.move(pairs * B, QB, d)
            cost.move(pairs * B, G)
            cost.move(pairs * B, width=1, elem=f32)  # LSEB of later blocks
            # Later blocks' solved rows come from WREAD: W itself, or with COPY its copy in the input dtype,
            # which the launch also stores.
            w_read = a["WREAD"]
            cost.move(pairs * B, w_read, e)
            cost.move(programs * B, QB, d)
            cost.move(programs * B, G)
            cost.move(programs * B, width=1 + 2 * e, elem=f32)  # LSEB, OA, R
            cost.move(programs * B, width=e + 3, elem=f32)  # W, DA, DB, DG
            if c["COPY"]:
                cost.move(programs * B, w_read, e)
            cost.dot(pairs + programs, B, B, BD, QB.dtype, c["PREC"])
            cost.dot(pairs, B, BE, B, w_read.dtype, c["PREC"])  # B^T W
            _solve_block(cost, programs, B, log2, BE, c["SOLVE_PREC"])
    elif name in ("sparse_direct", "sparse_grads", "sparse_solve_fwd", "sparse_solve_bwd"):
        e = a["e"]
        if name in ("sparse_direct", "sparse_grads"):
            rows_per_program = c["BM"]
            block = rows_per_program
        else:
            block = c["BLOCK"]
        pairs = _sparse_pairs(pattern, n, block)
        rows = n * (a["QB"].shape[0] if "QB" in a else a["X"].shape[0])
        BH = rows // n
        p_all, p_early, p_inside = (pairs[k] * BH for k in ("all", "early", "inside"))
        if name == "sparse_direct":
            da, db = a["da"], a["db"]
            if c["HAS_A"]:
                cost.move(rows, a["QA"], da)
                cost.move(rows + p_all, a["KA"], da)
                cost.move(rows + p_all, a["X"], e)
                cost.move(rows, width=e + 1, elem=f32)  # OA, LSEA
                cost.vector(rows + p_all, 2 * da + 2 * e)  # q.k, p x
            if c["HAS_B"]:
                cost.move(rows, a["QB"], db)
                cost.move(p_all, a["KB"], db)
                cost.move(rows, width=1, elem=f32)  # LSEB
                cost.vector(p_all, 2 * db)
        elif name == "sparse_grads":
            da, db = a["da"], a["db"]
            cost.move(rows, a["W"], e)
            if c["HAS_B"]:
                cost.move(rows, a["QB"], db)
                cost.move(rows, a["G"])
                cost.move(rows, width=2, elem=f32)  # LSEB, DB
                cost.move(p_all, a["KB"], db)
                cost.move(p_all, a["Y"], e)
                cost.move(p_all, width=db, elem=f32)  # DKB atomics
                cost.move(rows, width=db, elem=f32)  # DQB
                cost.vector(p_all, 3 * 2 * db + 2 * e)  # q.k, dq, dk; w.y
            if c["HAS_A"]:
                cost.move(rows, a["QA"], da)
                cost.move(rows, width=2, elem=f32)  # LSEA, DA
                cost.move(rows + p_all, a["KA"], da)
                cost.move(rows + p_all, a["X"], e)
                cost.move(rows + p_all, width=da + e, elem=f32)  # DKA, DX atomics
                cost.move(rows, width=da, elem=f32)  # DQA
                cost.vector(rows + p_all, 3 * 2 * da + 2 * 2 * e)  # q.k, dq, dk; do.x, dx
        else:
            B, log2, BE, d = c["BLOCK"], c["LOG2_BLOCK"], c["BE"], a["d"]
            nblk = _cdiv(n, B)
            chain = nblk
            cost.move(rows, a["QB"], d)
            cost.move(rows, a["G"])
            cost.move(rows, width=1, elem=f32)  # LSEB
            cost.vector(p_all, 2 * d)  # q.k of every pair
            blocks = nblk * BH
            if name == "sparse_solve_fwd":
                cost.move(p_all, a["KB"], d)
                cost.move(p_early, width=e, elem=f32)  # solved Y of earlier blocks
                cost.vector(p_early, 2 * e)
                cost.move(rows, a["OA"], e)
                cost.move(rows, width=2 * e, elem=f32)  # Y, R
                _solve_block(cost, blocks, B, log2, BE, c["SOLVE_PREC"])
                cost.dot(blocks, B, BE, B, a["R"].dtype, c["SOLVE_PREC"])  # R's in-block part
            else:
                cost.move(p_inside, a["KB"], d)
                cost.move(p_early, a["KB"], d)  # recomputed for the scatter
                cost.move(rows, a["DY"], e)
                cost.move(rows, width=3 * e, elem=f32)  # GACC, OA, R
                cost.move(rows, width=e + 3, elem=f32)  # W, DA, DB, DG
                cost.move(p_early, width=e, elem=f32)  # GACC atomics
                cost.vector(p_early, 2 * d + 2 * e)  # q.k again, p w
                _solve_block(cost, blocks, B, log2, BE, c["SOLVE_PREC"])
    else:
        raise ValueError(f"no cost model for kernel {launch.name!r}: add one to scripts/bench/roofline.py")
    return {"kernel": name, "grid": list(launch.grid), "programs": programs, "chain_steps": chain,
            "bytes": hbm_bytes(launch), "tile_bytes": cost.bytes, "flops": cost.flops, "work_flops": dict(cost.work)}


def hbm_bytes(launch) -> int:
    """The launch's memory floor: every distinct tensor it is passed, moved once (inputs read, outputs written,
    accumulators counted once); tiles read again by other programs or later loop steps are taken to hit L2."""
    import torch

    seen = {id(v): v for v in launch.args.values() if isinstance(v, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in seen.values())


def roofline_seconds(row: dict, hw: dict) -> dict:
    """Compute, memory and chain times of a launch (or of SDPA), the roofline time they imply (the chain after
    the larger of the other two) and the overlapped time (the largest of the three)."""
    f = row["work_flops"]
    fill = min(1.0, row["programs"] / hw["sms"]) if row.get("programs") else 1.0
    compute = (f["16bit"] / hw["bf16_flops"] + f["tf32"] / hw["tf32_flops"] + f["fp32"] / hw["fp32_flops"]) / fill
    memory = row["bytes"] / hw["hbm_bytes"]
    chain = row["chain_steps"] * hw["kernel_step_latency_s"].get(row["kernel"], hw["step_latency_s"])
    return {"compute_s": compute, "memory_s": memory, "chain_s": chain, "roofline_s": max(compute, memory) + chain,
            "overlapped_s": max(compute, memory, chain)}


def sdpa_cost(n: int, batch: int, heads: int, d: int, elem: int) -> dict:
    """FlashAttention-2's count for causal attention: forward 4 n^2/2 d FLOPs per head, backward 2.5 times that.
    Bytes: q, k, v read and o written forward; q, k, v, o, dO read and dq, dk, dv written backward (16-bit),
    and the float32 log-sum-exp. Programs are not modelled (the whole GPU is taken as busy)."""
    BH = batch * heads
    forward = 4 * n * n // 2 * d * BH
    rows = BH * n
    fwd_bytes, bwd_bytes = rows * (4 * d * elem + 4), rows * (8 * d * elem + 4)
    return {"forward": {"kernel": f"{SDPA}_fwd", "programs": None, "chain_steps": 0, "bytes": fwd_bytes,
                        "tile_bytes": fwd_bytes,
                        "flops": forward, "work_flops": {"16bit": forward, "tf32": 0, "fp32": 0}},
            "backward": {"kernel": f"{SDPA}_bwd", "programs": None, "chain_steps": 0, "bytes": bwd_bytes,
                         "tile_bytes": bwd_bytes,
                         "flops": int(2.5 * forward),
                         "work_flops": {"16bit": int(2.5 * forward), "tf32": 0, "fp32": 0}}}


# --------------------------------------------------------------------------------------------------
# Measured times


def load_measured(path: str, args) -> dict:
    """The rows of a bench_kernels.py JSON whose shapes are the modelled ones (none otherwise, or without a path):
    {"rows": [{"name", "config", "n", "forward_ms", "forward_backward_ms"}], ...} with the file's device. A row's
    name is its candidate without the `` [settings]`` bench_kernels.py adds; rows without a config are the
    defaults'."""
    if not path:
        return {"rows": [], "source": None, "device": None}
    with open(REPO / path if not os.path.isabs(path) else path) as f:
        data = json.load(f)
    same = (data.get("batch"), data.get("heads"), data.get("head_dim"), data.get("dtype")) == (
        args.batch, args.heads, args.head_dim, args.dtype)
    rows = []
    if same:
        for r in data["rows"]:
            if r.get("forward_ms") is not None:
                rows.append({"name": r["name"].split(" [")[0], "config": r.get("config") or {}, "n": r["n"],
                             "defaults": r.get("kernels") or LEGACY_DEFAULTS,
                             "forward_ms": r["forward_ms"], "forward_backward_ms": r.get("forward_backward_ms")})
    return {"rows": rows, "source": path, "device": data.get("device"), "shapes_match": same}


def measured_times(measured: dict, name: str, settings: dict, n: int) -> dict:
    """The measured row of candidate ``name`` on the kernels BlockConfig ``settings`` runs today, at length n ({} if
    none)."""
    pattern = name.split(":", 1)[-1]
    want = _kernels_key(settings, current_defaults(), pattern)
    for r in measured["rows"]:
        if (r["name"], r["n"]) == (name, n) and _kernels_key(r["config"], r["defaults"], pattern) == want:
            return r
    return {}


def current_defaults() -> dict:
    from hf_resolvent.backends.triton import aot, resolvent

    return aot.kernel_choice(resolvent.BlockConfig())


def _kernels_key(settings: dict, defaults: dict, pattern: str) -> tuple:
    """What ``pattern`` runs under ``settings`` on top of the kernel choice ``defaults``, as sorted (field, value)
    pairs: the kernel-choosing fields that matter to the pattern, and the other settings (tiles) as given."""
    from hf_resolvent.backends.triton import aot

    if pattern == SDPA:
        return ()
    full = {**defaults, **settings}
    choice = aot.relevant({k: full[k] for k in aot.KERNEL_FIELDS}, pattern)
    return _settings_key({**choice, **{k: v for k, v in settings.items() if k not in aot.KERNEL_FIELDS}})


_CASE = re.compile(r"^=== n=(\d+) (\S+) \((\d+) steps\)(?: \[(.*)\])?")
_TIME = re.compile(r"^([\d.]+)(ms|us|s)$")


def _settings_key(settings: dict) -> tuple:
    return tuple(sorted(settings.items()))


def parse_profile(text: str) -> dict:
    """{(pattern, n, kernels): {kernel: ms per forward + backward step}} from a profile_kernels.py log: the Self
    CUDA column of each ``*_kernel`` row of torch.profiler's table, divided by the case's steps; kernels (sorted
    (field, value) pairs) from the `` [settings]`` of the case's line over LEGACY_DEFAULTS (profile_kernels.py
    names every kernel-choosing field there)."""
    from hf_resolvent.backends.triton import aot

    cases, current, steps = {}, None, 1
    for line in text.splitlines():
        head = _CASE.match(line)
        if head:
            try:
                settings = _kernels_key(aot.parse_config(head.group(4) or ""), LEGACY_DEFAULTS, head.group(2))
            except ValueError:  # settings this code does not know: a case no variant matches
                settings = (("unknown", head.group(4)),)
            current, steps = (head.group(2), int(head.group(1)), settings), int(head.group(3))
            cases[current] = {}
            continue
        cols = re.split(r"\s{2,}", line.strip())
        if current is None or len(cols) < 11 or not cols[0].endswith("_kernel"):
            continue
        t = _TIME.match(cols[6])
        if t:
            scale = {"s": 1e3, "ms": 1.0, "us": 1e-3}[t.group(2)]
            name = cols[0].removesuffix("_kernel")
            cases[current][name] = cases[current].get(name, 0.0) + float(t.group(1)) * scale / steps
    return cases


# --------------------------------------------------------------------------------------------------
# The model, the table, the JSON


def hardware(args) -> dict:
    return {"bf16_flops": args.bf16_tflops * 1e12, "tf32_flops": args.tf32_tflops * 1e12,
            "fp32_flops": args.fp32_tflops * 1e12, "hbm_bytes": args.hbm_tbps * 1e12, "sms": args.sms, "step_latency_s": args.step_latency_us * 1e-6,
            "kernel_step_latency_s": {k: v * 1e-6 for k, v in args.kernel_step_latency.items()}}


TOTALS = ("bytes", "tile_bytes", "flops", "chain_steps", "compute_s", "memory_s", "chain_s", "work_s",
          "roofline_s", "overlapped_s")


def _launch_row(cost: dict, hw: dict) -> dict:
    row = dict(cost, **roofline_seconds(cost, hw))
    row["work_s"] = max(row["compute_s"], row["memory_s"])
    return row


def _pass_total(rows: list[dict]) -> dict:
    return {k: sum(r[k] for r in rows) for k in TOTALS}


def _ratio(measured_ms, roofline_s):
    return None if measured_ms is None else measured_ms / (roofline_s * 1e3)


def model_case(pattern: str, n: int, args, hw: dict, measured: dict, profile: dict,
               variant: tuple[str, dict] = (DEFAULT_VARIANT, {})) -> dict:
    """Every launch of a forward and a backward of ``pattern`` at length n under the variant (name, BlockConfig
    settings), with their roofline times, the kernels' summary (launches of one kernel added up) and the passes'
    totals beside the measured times. SDPA has no variant (None)."""
    import torch

    dtype = getattr(torch, args.dtype)
    name, settings = variant
    if pattern == SDPA:
        passes = sdpa_cost(n, args.batch, args.heads, args.head_dim, torch.empty((), dtype=dtype).element_size())
        launches = {k: [_launch_row(v, hw)] for k, v in passes.items()}
        candidate, name, settings = SDPA, None, {}
    else:
        recorded = record_passes(pattern, n, args.batch, args.heads, args.head_dim, dtype, settings)
        launches = {k: [_launch_row(launch_cost(launch, pattern, args.blocks_in_flight), hw)
                        for launch in v] for k, v in recorded.items()}
        candidate = f"triton:{pattern}"
    forward = _pass_total(launches["forward"])
    forward_backward = _pass_total(launches["forward"] + launches["backward"])
    times = measured_times(measured, candidate, settings, n)
    forward["measured_ms"] = times.get("forward_ms")
    forward_backward["measured_ms"] = times.get("forward_backward_ms")
    for total in (forward, forward_backward):
        total["measured_over_roofline"] = _ratio(total["measured_ms"], total["roofline_s"])
    profiled = profile.get((pattern, n, _kernels_key(settings, current_defaults(), pattern)), {})
    kernels = {}
    for phase in ("forward", "backward"):
        for row in launches[phase]:
            k = kernels.setdefault(row["kernel"], {"kernel": row["kernel"], "pass": phase, "launches": 0,
                                                   "programs": 0, **{key: 0 for key in TOTALS}})
            if k["pass"] != phase:  # launched in both passes (the chunked solves' carry)
                k["pass"] = "both"
            k["launches"] += 1
            for key in ("programs",) + TOTALS:
                k[key] += row[key] or 0
    for k in kernels.values():
        k["profiled_ms"] = profiled.get(k["kernel"])
        k["profiled_over_roofline"] = _ratio(k["profiled_ms"], k["roofline_s"])
        # The step latency that would make the roofline equal the profiled time: everything the model misses is
        # put on the chain, so an upper bound on what a step costs.
        k["profiled_step_us"] = None
        if k["profiled_ms"] is not None and k["chain_steps"]:
            k["profiled_step_us"] = (k["profiled_ms"] * 1e-3 - k["work_s"]) / k["chain_steps"] * 1e6
    return {"pattern": pattern, "n": n, "variant": name, "config": settings, "launches": launches,
            "kernels": list(kernels.values()), "forward": forward, "forward_backward": forward_backward}


def compare_to_sdpa(cases: list[dict]):
    """Adds to each pass total its roofline and overlapped times over SDPA's at the same length, and the chain-step
    latency at which the roofline equals SDPA's (the same latency for every chain; negative where the work alone
    takes longer, None without chain steps)."""
    sdpa = {c["n"]: c for c in cases if c["pattern"] == SDPA}
    for case in cases:
        for phase in ("forward", "forward_backward"):
            total, ref = case[phase], sdpa[case["n"]][phase]["roofline_s"]
            total["roofline_over_sdpa"] = total["roofline_s"] / ref
            total["overlapped_over_sdpa"] = total["overlapped_s"] / ref
            total["sdpa_step_us"] = ((ref - total["work_s"]) / total["chain_steps"] * 1e6 if total["chain_steps"]
                                     else None)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def _measured(ms, ratio) -> str:
    return "not measured" if ms is None else f"{ms:.3g} ms ({ratio:.2g}x)"


def _title(case: dict) -> str:
    return f"{case['pattern']} n={case['n']}" + (f" [{case['variant']}]" if case["variant"] else "")


def print_case(case: dict):
    f, fb = case["forward"], case["forward_backward"]
    print(f"\n== {_title(case)}: roofline forward {_ms(f['roofline_s'])} ms, measured "
          f"{_measured(f['measured_ms'], f['measured_over_roofline'])}; forward+backward {_ms(fb['roofline_s'])} ms, "
          f"measured {_measured(fb['measured_ms'], fb['measured_over_roofline'])}")
    print(f"   {'kernel':<16} {'pass':<8} {'launches':>8} {'programs':>9} {'chain':>6} {'HBM GB':>8} {'tile GB':>8} "
          f"{'GFLOP':>9} {'compute':>8} {'memory':>8} {'chain':>8} {'roofline':>9} {'profiled':>9}")
    for k in case["kernels"]:
        prof = "-" if k["profiled_ms"] is None else f"{k['profiled_ms']:.3g}"
        if k["profiled_step_us"] is not None:
            prof += f" ({k['profiled_step_us']:.3g} us/step)"
        print(f"   {k['kernel']:<16} {k['pass']:<8} {k['launches']:>8} {k['programs'] or '-':>9} {k['chain_steps']:>6} "
              f"{k['bytes'] / 1e9:>8.3g} {k['tile_bytes'] / 1e9:>8.3g} {k['flops'] / 1e9:>9.4g} {_ms(k['compute_s']):>8} {_ms(k['memory_s']):>8} {_ms(k['chain_s']):>8} "
              f"{_ms(k['roofline_s']):>9} {prof:>9}")


def print_summary(cases: list[dict]):
    """One line per case: the forward's roofline and the forward + backward's parts, each against SDPA."""
    print("\n== passes against SDPA (ms; work = sum of max(compute, memory) per kernel, roofline = work + chain, "
          "overlapped = sum of max(compute, memory, chain); at a step latency L the roofline is work + steps x L, "
          "equal to SDPA's at L = 'L=SDPA', in us)")
    width = max(len(c["variant"] or "-") for c in cases)
    print(f"   {'pattern':<10} {'n':>6} {'variant':<{width}} {'fwd':>7} {'/SDPA':>6} | {'fwd+bwd: steps':>14} "
          f"{'HBM GB':>7} {'GFLOP':>8} {'work':>7} {'chain':>7} {'roofline':>8} {'/SDPA':>6} "
          f"{'overlap':>7} {'/SDPA':>6} {'L=SDPA':>7} {'measured':>9}")
    for c in cases:
        f, fb = c["forward"], c["forward_backward"]
        meas = "-" if fb["measured_ms"] is None else f"{fb['measured_ms']:.3g}"
        even = fb["sdpa_step_us"]
        even = "-" if even is None else ("never" if even < 0 else f"{even:.3g}")
        print(f"   {c['pattern']:<10} {c['n']:>6} {c['variant'] or '-':<{width}} {_ms(f['roofline_s']):>7} "
              f"{f['roofline_over_sdpa']:>6.2f} | {fb['chain_steps']:>14} {fb['bytes'] / 1e9:>7.3g} "
              f"{fb['flops'] / 1e9:>8.4g} {_ms(fb['work_s']):>7} {_ms(fb['chain_s']):>7} "
              f"{_ms(fb['roofline_s']):>8} {fb['roofline_over_sdpa']:>6.2f} {_ms(fb['overlapped_s']):>7} "
              f"{fb['overlapped_over_sdpa']:>6.2f} {even:>7} {meas:>9}")


def main(argv=None) -> int:
    args = parse_args(argv)
    hw = hardware(args)
    measured = load_measured(args.measured, args)
    profile = {}
    if args.profile:
        with open(REPO / args.profile if not os.path.isabs(args.profile) else args.profile) as f:
            profile = parse_profile(f.read())
    patterns = [p for p in args.patterns.split(",") if p and p != SDPA]
    lengths = [int(v) for v in args.lengths.split(",")]
    latencies = "".join(f", {k} {v} us" for k, v in args.kernel_step_latency.items())
    print(f"roofline: B{args.batch} H{args.heads} d{args.head_dim} {args.dtype}; peaks {args.bf16_tflops} TFLOP/s "
          f"16-bit, {args.tf32_tflops} tf32, {args.fp32_tflops} float32 CUDA cores, {args.hbm_tbps} TB/s, {args.sms} SMs. "
          f"Assumed: chain-step latency {args.step_latency_us} us{latencies}; {args.blocks_in_flight} blocks in "
          f"flight. Variants: "
          + "; ".join(f"{name} = {settings or 'the defaults'}" for name, settings in args.variants)
          + f". Times in ms; measured: {measured['source'] or 'none'} ({measured['device'] or '-'}), profiled: "
          f"{args.profile or 'none'} (ms per forward+backward step)")
    cases = []
    for n in lengths:
        for pattern in patterns:
            for variant in args.variants:
                cases.append(model_case(pattern, n, args, hw, measured, profile, variant))
                print_case(cases[-1])
        cases.append(model_case(SDPA, n, args, hw, measured, profile))
        print_case(cases[-1])
    compare_to_sdpa(cases)
    print_summary(cases)
    settings = {k: getattr(args, k) for k in ("batch", "heads", "head_dim", "dtype", "bf16_tflops", "tf32_tflops",
                                              "fp32_tflops", "hbm_tbps", "sms", "step_latency_us",
                                              "kernel_step_latency", "blocks_in_flight", "measured", "profile")}
    settings["variants"] = [{"name": name, "config": config} for name, config in args.variants]
    settings["assumptions"] = (
        "the chain-step latency is assumed, not measured, and so are the blocks in flight when a ticket-ordered "
        "block starts; bytes (the roofline's) move every distinct tensor argument of a launch once, tile_bytes "
        "every program's loads and stores (an atomic add as one store); FLOPs are 2 m n k per tl.dot and 2 per "
        "multiply-add of the sparse kernels' row dot products; a tf32x3 product takes the time of three tf32 "
        "products; integer work is not counted")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": settings, "measured_device": measured["device"], "cases": cases},
                              indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
