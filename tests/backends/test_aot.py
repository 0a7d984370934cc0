"""The kernels at their real tiles, compiled for an H100 (sm_90) on a machine without a GPU (kernels/aot.py).

Every launch of a forward, backward and decode step is recorded from the real launch code at the default
``BlockConfig``, bfloat16, head width 64, n = 1024, 2 x 12 heads (GPT-2 small's), and compiled with Triton's
compiler and ptxas, specialised on its arguments as a launch on the GPU would be. The tests check what decides
whether a kernel runs, and runs at speed, on the H100: shared memory within the 227 KiB a block may hold,
registers within 255, spills within each kernel's bound (SPILL_BOUND), and which tensor-core
instructions the products compile to (static counts in the PTX text: see ``aot.ptx_counts``). A product of a 64-row tile on 4 warps (one warpgroup) may compile to
Hopper's ``wgmma`` (one m64nNk16 instruction per 16 of its inner dimension, k8 for tf32); a product of fewer
rows falls back to the older warp-level ``mma.sync``.

Each distinct compilation (kernel, argument specialisation, constants, options) runs once per module (the
``compiled`` fixture): the whole file compiles about 30 kernels, seconds each.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_resolvent.backends.triton import aot, launching

N, WIDTH, BATCH, HEADS = 1024, 64, 2, 12
ARCH = 90
# The kernels the defaults replaced (the split attention backward, the blocked dense and sparse solves), still
# selectable; the chunked solves' kernels are checked in CHUNKED below.
REPLACED = {"attn_bwd": "split", "dense_solver": "blocked", "solved_copy": False, "sparse_solver": "blocked"}
CASES = [("attention", False, {}), ("dense", False, {}), ("dense", True, {}), ("attention", False, REPLACED),
         ("dense", False, REPLACED), ("dense", True, REPLACED), ("exp2:ce", False, REPLACED)]

# Spill stack (bytes per thread) of each kernel at the default tiles: a regression guard, the values the kernels
# have. A kernel that spills reads and writes its registers through local memory inside its loops.
SPILL_BOUND = {
    "attn_fwd_kernel": 0,
    "attn_bwd_dkdv_kernel": 0,
    "attn_bwd_dq_kernel": 0,
    "attn_bwd_atomic_kernel": 0,
    "dense_chunk_fwd_kernel": 336,  # tf32x3 in-block inverse at 255 registers, under the 16-bit copy
    "dense_chunk_bwd_kernel": 0,
    "dense_solve_fwd_kernel": 0,
    "dense_solve_bwd_kernel": 0,
    "sparse_direct_kernel": 0,
    "sparse_solve_fwd_kernel": 0,
    "sparse_solve_bwd_kernel": 0,
    "sparse_grads_kernel": 0,
    "decode_step_kernel": 0,
}

# The kernels of the chunked solves, one entry per kernel: (kernel, pattern, the BlockConfig settings that launch
# it, spill bound in bytes per thread as the regression guard above, whether every product compiles to wgmma).
# Each is checked in every launch of the mixer (the tied mixer runs the same tiles). Extend it as chunked kernels
# come and change.
CHUNKED = [
    ("chunk_prepare_kernel", "exp2:ce", {"sparse_solver": "chunked"}, 160, True),
    ("chunk_carry_kernel", "exp2:ce", {"sparse_solver": "chunked"}, 0, False),
    ("chunk_rows_bwd_kernel", "exp2:ce", {"sparse_solver": "chunked"}, 0, True),
    ("chunk_grads_kernel", "exp2:ce", {"sparse_solver": "chunked"}, 0, False),
    # A plain f-pattern holds more rows per chunk than one tile (exp2 at n = 1024: 256): T_c is formed and the held
    # rows are visited a tile at a time, so shared memory stays that of one tile.
    ("chunk_prepare_kernel", "exp2", {"sparse_solver": "chunked"}, 144, True),
    ("chunk_grads_kernel", "exp2", {"sparse_solver": "chunked"}, 56, False),
    ("dense_chunk_fwd_kernel", "dense", {"dense_solver": "chunked", "solved_copy": False}, 320, True),
    ("dense_chunk_bwd_kernel", "dense", {"dense_solver": "chunked", "solved_copy": False}, 0, True),
    ("dense_chunk_fwd_kernel", "dense", {"dense_solver": "chunked", "solved_copy": True}, 336, True),
    ("dense_chunk_bwd_kernel", "dense", {"dense_solver": "chunked", "solved_copy": True}, 0, True),
]

# What each kind of atomic instruction in these kernels is for (see the PTX names in ``aot.ptx_counts``).
ATOMIC_ROLES = {
    "atom.global.gpu.relaxed.add.u32": "ticket",  # a solve program takes its block's ticket
    "atom.global.gpu.release.exch.b32": "publish",  # and publishes its solved block
    "red.global.gpu.relaxed.add.v4.f32": "f32 sum",  # float32 gradient sums, 4 values per instruction
}


@pytest.fixture(scope="module")
def compiled():
    """``compiled(launch)``: compile_launch(launch, sm_90), each distinct compilation once per module."""
    cache = {}

    def compile_once(launch: aot.Launch) -> dict:
        key = aot.compile_key(launch)
        if key not in cache:
            cache[key] = aot.compile_launch(launch, arch=ARCH)
        return cache[key]

    return compile_once


def record(pattern: str, tied: bool = False, dtype: torch.dtype = torch.bfloat16, **settings) -> list[aot.Launch]:
    """The launches of ``pattern`` at the default BlockConfig, changed by ``settings`` (variants)."""
    config = {**dataclasses.asdict(launching.BlockConfig()), **settings}
    with launching.block_config(**config):
        return aot.record_launches(pattern, dtype=dtype, n=N, d=WIDTH, e=WIDTH, batch=BATCH, heads=HEADS, tied=tied)


def _check_fits(launch: aot.Launch, usage: dict, spill_bound: int) -> None:
    where = f"{launch.name} {launch.constexprs} {launch.options}"
    assert usage["shared"] <= aot.SHARED_MEMORY_LIMIT[ARCH], f"{where}: {usage['shared']} B of shared memory"
    assert 0 < usage["registers"] <= 255, f"{where}: {usage['registers']} registers"
    assert usage["spill_stack_bytes"] <= spill_bound, (
        f"{where} spills {usage['spill_stack_bytes']} B per thread at the default tiles, over its bound of "
        f"{spill_bound} B: a change made it spill (fit the tiles or its live values), or lowered its spills "
        f"(lower the bound in this file)")


def test_ptx_counts_reads_instructions_not_names():
    ptx = """
    .reg .pred %p<3>;            // a directive: not an instruction
    // mma.sync.aligned in a comment
    $L__BB0_1:
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, 1, 1, 1, 0, 1;
    @%p1 mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%r1}, {%r2}, {%r3}, {%r4};
    @!%p2 red.global.gpu.relaxed.add.v4.f32 [ %rd3 + 0 ], { %r5, %r6, %r7, %r8 };
    atom.global.gpu.relaxed.add.u32 %r9, [ %rd4 + 0 ], 1;
    ld.shared.v2.b32 {%r1, %r2}, [%r3];
    ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r5];
    st.shared.b16 [%r3], %rs1;
    cp.async.ca.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;
    """
    assert aot.ptx_counts(ptx) == {
        "wgmma": 1, "mma_sync": 1, "atomics": 2, "ld_shared": 2, "cp_async": 1,
        "atomic_ops": {"atom.global.gpu.relaxed.add.u32": 1, "red.global.gpu.relaxed.add.v4.f32": 1}}


@pytest.mark.parametrize(("pattern", "tied", "settings"), CASES,
                         ids=[p + (" tied" if t else "") + (" replaced" if s else "") for p, t, s in CASES])
def test_default_tiles_fit_an_h100(pattern, tied, settings, compiled):
    """Every launch compiles within sm_90's shared memory per block, 255 registers, and its spill bound."""
    launches = record(pattern, tied, **settings)
    unknown = {launch.name for launch in launches} - set(SPILL_BOUND)
    assert not unknown, f"kernels {sorted(unknown)} have no spill bound: add them to SPILL_BOUND"
    for launch in launches:
        _check_fits(launch, compiled(launch), SPILL_BOUND[launch.name])


def test_products_compile_to_the_tensor_core_path_their_tiles_allow(compiled):
    """Which products reach Hopper's warpgroup MMA at the default tiles, and which stay on mma.sync.

    - The attention forward (64 query rows, 4 warps): both products, q k^T (inner dimension d) and p v (inner
      dimension BN), are wgmma: d / 16 + BN / 16 instructions, and nothing runs on mma.sync.
    - The split backward: the dK/dV kernel's key-side products (64 key rows: dV += P^T dO, dK += dS^T Q, inner
      dimension bwd_m) are wgmma, bwd_m / 16 instructions each; its query-side products (bwd_m = 32 rows: S and
      dP) and every product of the dQ kernel (32 query rows) are below a warpgroup's 64 rows and run on mma.sync.
    - The blocked solves (32-row blocks) run every product on mma.sync.

    The split backward and the blocked solves are the kernels the defaults replaced (``REPLACED``); the atomic
    backward and the chunked solves have tests of their own below.
    """
    launches = record("dense", **REPLACED) + record("exp2:ce", **REPLACED)
    seen = set()
    for launch in launches:
        c, usage = launch.constexprs, compiled(launch)
        seen.add(launch.name)
        where = f"{launch.name} {c}: {usage}"
        if launch.name == "attn_fwd_kernel":
            assert c["BM"] == 64 and launch.options["num_warps"] == 4, where
            assert usage["wgmma"] == c["BD"] // 16 + c["BN"] // 16 and usage["mma_sync"] == 0, where
        elif launch.name == "attn_bwd_dkdv_kernel":
            assert c["BN"] == 64 and c["BM"] == 32, where
            assert usage["wgmma"] == (1 + c["HAS_DV"]) * c["BM"] // 16 and usage["mma_sync"] > 0, where
        elif launch.name in ("attn_bwd_dq_kernel", "dense_solve_fwd_kernel", "dense_solve_bwd_kernel",
                             "sparse_solve_fwd_kernel", "sparse_solve_bwd_kernel"):
            assert usage["wgmma"] == 0 and usage["mma_sync"] > 0, where
    assert seen >= {"attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel", "dense_solve_fwd_kernel",
                    "sparse_solve_bwd_kernel"}


def test_atomics_are_where_the_kernels_use_them(compiled):
    """Tickets and publication in the ticket-ordered solves, float32 sums where gradients gather from several
    programs (the sparse backward solve, the sparse gradients), and no atomic anywhere else."""
    expected = {"dense_solve_fwd_kernel": {"ticket", "publish"}, "dense_solve_bwd_kernel": {"ticket", "publish"},
                "dense_chunk_fwd_kernel": {"ticket", "publish"}, "dense_chunk_bwd_kernel": {"ticket", "publish"},
                "sparse_solve_bwd_kernel": {"ticket", "publish", "f32 sum"}, "sparse_grads_kernel": {"f32 sum"},
                "attn_bwd_atomic_kernel": {"f32 sum"}}
    for launch in (record("dense") + record("exp2:ce", **REPLACED) + record("attention") + record("dense", **REPLACED)
                   + record("attention", **REPLACED)):
        ops = compiled(launch)["atomic_ops"]
        unknown = set(ops) - set(ATOMIC_ROLES)
        assert not unknown, f"{launch.name}: atomic instructions {sorted(unknown)} of no known role"
        assert {ATOMIC_ROLES[op] for op in ops} == expected.get(launch.name, set()), (launch.name, ops)


@pytest.mark.parametrize(("pattern", "tied"), [("exp2:ce", False), ("exp2:ce", True), ("exp2", False), ("dense", False)])
def test_chunked_solves_take_atomics_per_tile(pattern, tied, compiled):
    """The chunked solves: no atomics in the chunk kernels but the gradients, and there float32 tile adds, once per
    chunk onto its own rows and once per tile of held rows (the static count of 4-wide adds is exactly those tiles'
    elements over the threads), where ``sparse_grads`` adds per (row, slot); the dense ones keep the ticket
    schedule's two atomics."""
    launches = [launch for launch in record(pattern, tied=tied, sparse_solver="chunked", dense_solver="chunked")
                if "chunk" in launch.name]
    assert launches
    for launch in launches:
        c, usage = launch.constexprs, compiled(launch)
        roles = {ATOMIC_ROLES[op] for op in usage["atomic_ops"]}
        if launch.name == "chunk_grads_kernel":
            widths = (c["BDA"] + c["BE"]) * c["HAS_A"] + c["BDB"]  # dk and dx of channel A, dk of channel B
            assert roles == {"f32 sum"}, (launch.name, usage["atomic_ops"])
            assert 4 * usage["atomics"] * 32 * launch.options["num_warps"] == (c["C"] + c["HB"]) * widths
        elif launch.name.startswith("dense_chunk"):
            assert roles == {"ticket", "publish"} and usage["atomics"] == 2, (launch.name, usage["atomic_ops"])
        else:
            assert usage["atomics"] == 0, (launch.name, usage["atomic_ops"])


@pytest.mark.parametrize("pattern", ["attention", "dense"])
def test_atomic_attention_backward_runs_on_warpgroup_mma(pattern, compiled):
    """``attn_bwd="atomic"``: one kernel per channel, every product a wgmma at its default tiles, no spills, and
    its only atomics the float32 dQ adds, exactly one (atomic_m x d) tile of them per query step.

    dense has both channels: A (non-strict, with dV) and B (strict, value operand the float32 solved Y, tf32)."""
    cfg = launching.BlockConfig()
    launches = [launch for launch in record(pattern, attn_bwd="atomic") if launch.name.startswith("attn_bwd")]
    assert {launch.name for launch in launches} == {"attn_bwd_atomic_kernel"}
    assert len(launches) == {"attention": 1, "dense": 2}[pattern]
    for launch in launches:
        c, usage = launch.constexprs, compiled(launch)
        where = f"{launch.name} {c}: {usage}"
        assert (c["BM"], c["BN"], launch.options["num_warps"]) == (cfg.atomic_m, cfg.atomic_n, cfg.atomic_warps)
        _check_fits(launch, usage, spill_bound=0)
        assert usage["wgmma"] > 0 and usage["mma_sync"] == 0, where
        assert set(usage["atomic_ops"]) == {"red.global.gpu.relaxed.add.v4.f32"}, where
        threads = 32 * launch.options["num_warps"]
        assert 4 * usage["atomics"] * threads == c["BM"] * c["BD"], where


def test_float32_atomic_attention_backward_fits_at_its_fitted_tiles(compiled):
    """float32 inputs: ``fitted_block_config`` halves both atomic tiles (rows of 256 bytes), which keeps K, V and the
    pipelined query tiles within shared memory. The tf32x3 products split every operand in three, so the kernel
    spills a little even so; the bound guards it (every other tile and warp count tried spills too, or loses
    wgmma)."""
    cfg = launching.fitted_block_config(torch.float32, WIDTH, launching.BlockConfig(attn_bwd="atomic"))
    launches = [launch for launch in record("dense", dtype=torch.float32, attn_bwd="atomic")
                if launch.name == "attn_bwd_atomic_kernel"]
    assert len(launches) == 2
    for launch in launches:
        c, usage = launch.constexprs, compiled(launch)
        assert (c["BM"], c["BN"]) == (cfg.atomic_m, cfg.atomic_n) == (32, 64)
        _check_fits(launch, usage, spill_bound=104)
        assert usage["wgmma"] > 0, (launch.constexprs, usage)


@pytest.mark.parametrize(("kernel", "pattern", "settings", "spill_bound", "wgmma_only"), CHUNKED,
                         ids=[f"{entry[0]}-{entry[1]}" for entry in CHUNKED])
def test_chunked_solves_fit_an_h100(kernel, pattern, settings, spill_bound, wgmma_only, compiled):
    """Each kernel of the chunked solves, in every launch of the mixer, fits sm_90 within its spill bound; where
    ``wgmma_only``, every product is a wgmma."""
    launches = [launch for launch in record(pattern, **settings) if launch.name == kernel]
    assert launches, f"no launch of {kernel} for {pattern} under {settings}"
    for launch in launches:
        usage = compiled(launch)
        _check_fits(launch, usage, spill_bound)
        if wgmma_only:
            assert usage["wgmma"] > 0 and usage["mma_sync"] == 0, (launch.name, launch.constexprs, usage)
