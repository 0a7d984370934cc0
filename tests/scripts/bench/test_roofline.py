"""scripts/bench/roofline.py: the model's counts follow the recorded launches, and the measured times are attached
where the benchmark file has them."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from conftest import load_script
from hf_resolvent.backends.triton import aot, launching

B, H, D = 4, 16, 64
PROFILE_LOG = """=== n=64 dense (2 steps)
----  ----
                  dense_solve_fwd_kernel         0.00%       0.000us         0.00%       0.000us       0.000us      30.000ms        25.32%      30.000ms      15.000ms             2
                    attn_bwd_dkdv_kernel         0.00%       0.000us         0.00%       0.000us       0.000us     800.000us        27.68%     800.000us     200.000us             4
void at::native::elementwise_kernel<1...         0.00%       0.000us         0.00%       0.000us       0.000us      18.144us         0.00%      18.144us       6.048us             2
"""


def _run(tmp_path, lengths: str, **flags) -> dict:
    out = tmp_path / "roofline.json"
    profile = tmp_path / "profile.log"
    profile.write_text(PROFILE_LOG)
    argv = ["--out", str(out), "--patterns", "attention,dense,exp2:ce", "--lengths", lengths,
            "--profile", str(profile), "--config", f"blocked:{BLOCKED}"]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    assert load_script("bench/roofline").main(argv) == 0
    return json.loads(out.read_text())


def _case(result, pattern, n):
    (case,) = [c for c in result["cases"] if c["pattern"] == pattern and c["n"] == n]
    return case


def test_roofline_counts_follow_the_launches_and_measured_times_are_attached(tmp_path):
    result = _run(tmp_path, "64,4096", step_latency_us=3)
    assert {(c["pattern"], c["n"]) for c in result["cases"]} == {
        (p, n) for p in ("attention", "dense", "exp2:ce", "sdpa") for n in (64, 4096)}
    hw = result["settings"]

    # SDPA: FlashAttention-2's count, 4 n^2/2 d per head forward, 2.5 times that backward
    sdpa = _case(result, "sdpa", 4096)
    forward = 4 * 4096**2 // 2 * D * B * H
    assert sdpa["forward"]["flops"] == forward
    assert sdpa["forward_backward"]["flops"] == forward + int(2.5 * forward)
    assert sdpa["forward"]["roofline_s"] == forward / (hw["bf16_tflops"] * 1e12)

    # the dense pattern: its solves walk n / block blocks; programs are the recorded grids
    dense = _case(result, "dense", 4096)
    block = launching.get_block_config().solve
    solves = [r for r in dense["launches"]["forward"] + dense["launches"]["backward"] if "solve" in r["kernel"]]
    assert [r["kernel"] for r in solves] == ["dense_solve_fwd", "dense_solve_bwd"]
    assert all(r["chain_steps"] == 4096 // block for r in solves)
    with launching.block_config(**aot.parse_config(BLOCKED)):
        recorded = load_script("bench/roofline").record_passes("dense", 4096, B, H, D, torch.bfloat16)
    for phase in ("forward", "backward"):
        assert [r["programs"] for r in dense["launches"][phase]] == [
            torch.Size(launch.grid).numel() for launch in recorded[phase]]
        assert [r["grid"] for r in dense["launches"][phase]] == [list(launch.grid) for launch in recorded[phase]]
    # attention's forward kernel: one program per 64 rows and head, nothing chained, the FLOPs of causal tiles
    (attn_fwd,) = _case(result, "attention", 4096)["launches"]["forward"]
    cfg = launching.get_block_config()
    tiles = sum(-(-min((i + 1) * cfg.attn_m, 4096) // cfg.attn_n) for i in range(4096 // cfg.attn_m))
    assert attn_fwd["programs"] == 4096 // cfg.attn_m * B * H and attn_fwd["chain_steps"] == 0
    assert attn_fwd["flops"] == tiles * B * H * 2 * (2 * cfg.attn_m * cfg.attn_n * D)
    # inputs q, k, v (bf16), outputs O and LSE (float32), start: the memory floor
    assert attn_fwd["bytes"] == B * H * 4096 * (3 * D * 2 + D * 4 + 4) + B * 4

    # roofline = max(compute, memory) + chain steps x the assumed latency, per launch, and summed per pass
    for case in result["cases"]:
        for rows in case["launches"].values():
            for r in rows:
                assert r["roofline_s"] == max(r["compute_s"], r["memory_s"]) + r["chain_steps"] * 3e-6
                assert r["memory_s"] == r["bytes"] / (hw["hbm_tbps"] * 1e12)
        total = sum(r["roofline_s"] for rows in case["launches"].values() for r in rows)
        assert abs(case["forward_backward"]["roofline_s"] - total) <= 1e-12 * total

    # measured times from bench/gpu/kernels_h100.json where it has the case, with measured / roofline
    measured = json.loads((load_script("bench/roofline").REPO / "bench/gpu/kernels_h100.json").read_text())
    row = next(r for r in measured["rows"] if r["name"] == "triton:exp2:ce" and r["n"] == 4096)
    exp2 = _case(result, "exp2:ce", 4096)["forward_backward"]
    assert exp2["measured_ms"] == row["forward_backward_ms"]
    assert exp2["measured_over_roofline"] == row["forward_backward_ms"] / (exp2["roofline_s"] * 1e3)
    assert _case(result, "sdpa", 4096)["forward"]["measured_ms"] is not None
    assert _case(result, "dense", 64)["forward"]["measured_ms"] is None  # n = 64 was not benchmarked

    # per-kernel times from the profile log: Self CUDA over the steps, several launches of a kernel added up
    kernels = {k["kernel"]: k for k in _case(result, "dense", 64)["kernels"]}
    assert kernels["dense_solve_fwd"]["profiled_ms"] == 15.0
    assert kernels["attn_bwd_dkdv"]["profiled_ms"] == 0.4 and kernels["attn_bwd_dkdv"]["launches"] == 2
    assert kernels["attn_fwd"]["profiled_ms"] is None


def test_roofline_without_measurements_says_not_measured(tmp_path, capsys):
    result = _run(tmp_path, "128", measured="")
    assert all(c[p]["measured_ms"] is None for c in result["cases"] for p in ("forward", "forward_backward"))
    assert "not measured" in capsys.readouterr().out


CHUNKED = "sparse_solver=chunked,dense_solver=chunked,attn_bwd=atomic,solved_copy=false"
# The kernels the defaults replaced: the split attention backward, the blocked dense solves without the copy and
# the blocked sparse solves.
BLOCKED = "attn_bwd=split,dense_solver=blocked,solved_copy=false,sparse_solver=blocked"


def _run_variants(tmp_path, patterns: str, lengths: str, *extra: str, batch: int = 1, heads: int = 2,
                  configs=(f"blocked:{BLOCKED}", f"chunked:{CHUNKED}")) -> dict:
    out = tmp_path / "variants.json"
    argv = ["--out", str(out), "--patterns", patterns, "--lengths", lengths, "--batch", str(batch),
            "--heads", str(heads), "--profile", ""]
    argv += [arg for config in configs for arg in ("--config", config)] + list(extra)
    assert load_script("bench/roofline").main(argv) == 0
    return json.loads(out.read_text())


def _variant(result, pattern, n, variant):
    (case,) = [c for c in result["cases"] if (c["pattern"], c["n"], c["variant"]) == (pattern, n, variant)]
    return case


def _rows(case, kernel):
    return [r for phase in ("forward", "backward") for r in case["launches"][phase] if r["kernel"] == kernel]


def test_chunked_sparse_solve_follows_the_chunk_formulas(tmp_path):
    n, BH = 256, 2
    result = _run_variants(tmp_path, "exp2:ce", str(n))
    case = _variant(result, "exp2:ce", n, "chunked")
    assert case["config"] == {"sparse_solver": "chunked", "dense_solver": "chunked", "attn_bwd": "atomic",
                              "solved_copy": False}
    assert [r["kernel"] for r in case["launches"]["forward"]] == ["sparse_direct", "chunk_prepare", "chunk_carry"]
    assert [r["kernel"] for r in case["launches"]["backward"]] == ["chunk_carry", "chunk_rows_bwd", "chunk_grads"]

    # The held rows by hand: the sources before each chunk that the chunk's rows read.
    from hf_resolvent.patterns import get_pattern

    C = launching.get_block_config().chunk
    src = get_pattern("exp2:ce").source_index(n)
    held = [set(src[c0:c0 + C][(src[c0:c0 + C] >= 0) & (src[c0:c0 + C] < c0)].tolist()) for c0 in range(0, n, C)]
    held_total = sum(len(h) for h in held)
    HM = max(16, 1 << (max(len(h) for h in held) - 1).bit_length())
    nc, log2 = n // C, C.bit_length() - 1
    rows, held_rows, mask = BH * n, BH * held_total, C * (C + HM)  # the mask: int8, one byte per entry
    # recorded on meta tensors, the launches leave launching.held_table's cached tables on the CPU for real launches
    assert [t.device.type for t in launching.held_table(get_pattern("exp2:ce"), n, C)] == ["cpu", "cpu"]

    # The carry: n / C steps in each direction, nothing else chained; one (C x HM) x (HM x 16) product per step
    carry = _rows(case, "chunk_carry")
    assert [r["chain_steps"] for r in carry] == [nc, nc]
    assert [r["grid"] for r in carry] == [[BH, D // 16]] * 2
    assert all(r["flops"] == BH * (D // 16) * nc * 2 * C * 16 * HM for r in carry)
    assert sum(r["chain_steps"] for rows in case["launches"].values() for r in rows) == 2 * nc
    forward_carry, reverse_carry = carry
    # per step J_c (float32) and the held table (int32) per program; Y_c twice and the held rows once (forward)
    assert forward_carry["tile_bytes"] == BH * (D // 16) * nc * (C * HM + HM) * 4 + BH * (2 * n + held_total) * D * 4
    assert reverse_carry["tile_bytes"] == BH * (D // 16) * nc * (C * HM + HM) * 4 + BH * (n + 2 * held_total) * D * 4
    # its memory floor: Y and J (float32), the held table (int32), start (int32)
    assert forward_carry["bytes"] == BH * n * D * 4 + BH * nc * C * HM * 4 + nc * HM * 4 + 4

    # The parallel chunk kernels: one program per (chunk, head), no chain; scores as two bf16 tiles, T_c formed and
    # applied (forward) or loaded and applied (backward), tf32x3: three tf32 products each; no integer work: the
    # chunk's mask is loaded
    (prepare,) = _rows(case, "chunk_prepare")
    (rows_bwd,) = _rows(case, "chunk_rows_bwd")
    programs = nc * BH
    scores = programs * 2 * C * (C + HM) * D
    inverse_applied = programs * 2 * C * (2 * (log2 - 1) * C * C + C * (D + HM))
    assert prepare["programs"] == programs and prepare["chain_steps"] == 0
    assert prepare["flops"] == scores + inverse_applied
    assert prepare["work_flops"] == {"16bit": scores, "tf32": 3 * inverse_applied, "fp32": 0}
    # bf16 q, k (own and held rows) and gate, float32 LSE, OA and Yhat; per program the held table and the mask;
    # J and T_c whole
    assert prepare["tile_bytes"] == (rows * (2 * D * 2 + 2 + 4 + D * 4 + D * 4) + held_rows * D * 2
                                     + programs * (HM * 4 + mask + C * HM * 4 + C * C * 4))
    # its memory floor holds the mask table once: (n / C, C, C + HM) int8
    floor = BH * n * (2 * D * 2 + 2 + 4 + 2 * D * 4) + nc * HM * 4 + nc * mask + BH * nc * C * (HM + C) * 4 + 4
    assert prepare["bytes"] == floor
    applied = programs * 2 * C * C * D  # T_c^T G_c
    w_y = programs * 2 * C * (C + HM) * D
    assert rows_bwd["flops"] == scores + applied + w_y
    assert rows_bwd["work_flops"] == {"16bit": scores, "tf32": 3 * applied + w_y, "fp32": 0}
    hw = result["settings"]
    compute = scores / (hw["bf16_tflops"] * 1e12) + 3 * inverse_applied / (hw["tf32_tflops"] * 1e12)
    assert math.isclose(prepare["compute_s"], compute / min(1.0, programs / hw["sms"]))

    # held rows in blocks of HB < HM: the same products, HB columns at a time
    script = load_script("bench/roofline")
    recorded = script.record_passes("exp2:ce", n, 1, BH, D, torch.bfloat16, case["config"])
    (launch,) = [r for r in recorded["forward"] if r.name == "chunk_prepare_kernel"]
    blocked = script.launch_cost(dataclasses.replace(launch, constexprs={**launch.constexprs, "HB": HM // 2}), "exp2:ce")
    assert blocked["work_flops"] == prepare["work_flops"] and blocked["tile_bytes"] == prepare["tile_bytes"]

    # chunk_grads, per chunk: channel A's scores, dP (against x), dq, dk and dx, channel B's scores, dq, dk in bf16,
    # B's dP against Y (float32) at tf32; each a pair of products, own rows and held rows, of 2 C (C + HM) D FLOPs
    (grads,) = _rows(case, "chunk_grads")
    pair = programs * 2 * C * (C + HM) * D
    assert grads["grid"] == [nc, BH] and grads["chain_steps"] == 0
    assert grads["flops"] == 9 * pair and grads["work_flops"] == {"16bit": 8 * pair, "tf32": pair, "fp32": 0}
    # loads: W (float32) and the gate once; per channel the held table and the mask per program, q, k and V of
    # the own and held rows, LSE, D; stores: dq once, dk (and dx) of own and held rows as atomic adds
    tables = programs * (HM * 4 + mask)
    channel_a = (tables + rows * D * 2 + (rows + held_rows) * (D * 2 + D * 2) + rows * (2 + D) * 4
                 + (rows + held_rows) * 2 * D * 4)
    channel_b = (tables + rows * D * 2 + (rows + held_rows) * (D * 2 + D * 4) + rows * (2 + D) * 4
                 + (rows + held_rows) * D * 4)
    shared = rows * (D * 4 + 2)
    assert grads["tile_bytes"] == shared + channel_a + channel_b
    assert grads["bytes"] == (BH * n * (5 * D * 2 + 2 * D * 4 + 2 + 4 * 4 + 5 * D * 4) + nc * HM * 4 + nc * mask + 4)
    # tied (no channel A): channel B's four pairs alone
    (launch,) = [r for r in recorded["backward"] if r.name == "chunk_grads_kernel"]
    tied = script.launch_cost(dataclasses.replace(launch, constexprs={**launch.constexprs, "HAS_A": False}),
                              "exp2:ce")
    assert tied["work_flops"] == {"16bit": 3 * pair, "tf32": pair, "fp32": 0}
    assert tied["tile_bytes"] == shared + channel_b

    # the blocked solves (the default for the sparse patterns) walk n / solve blocks in each direction instead
    blocked = _variant(result, "exp2:ce", n, "blocked")
    block = launching.get_block_config().solve
    solves = _rows(blocked, "sparse_solve_fwd") + _rows(blocked, "sparse_solve_bwd")
    assert [(r["kernel"], r["chain_steps"]) for r in solves] == [("sparse_solve_fwd", n // block),
                                                                   ("sparse_solve_bwd", n // block)]


def _dense_chunk_fwd_by_hand(nblk: int, in_flight: int) -> tuple[int, int, int]:
    """(score products, P.Y products that read YREAD, P.Y products with the block before's Y) per head of
    dense_chunk_fwd_kernel, walking its loops as written: block c starts with the blocks before c - in_flight
    published."""
    B = 1
    scores = py_read = py_prev = 0
    for c in range(nblk):
        c0, lo = c * B, 0
        known = max(c - in_flight, 0)
        mid = max(min(known * B, c0 - B), lo)
        scores += len(range(lo, mid, B))  # published: scores and P.Y
        py_read += len(range(lo, mid, B))
        scores += len(range(mid, c0, B))  # the rest and the block before: scores for the normaliser
        scores += 1  # the block's own
        scores += len(range(mid, c0 - B, B))  # the rest again, after the normaliser, with P.Y
        py_read += len(range(mid, c0 - B, B))
        scores += 1  # the block before, once more
        py_prev += 1  # its P.Y after the wait, with Y itself
    return scores, py_read, py_prev


def test_chunked_dense_solve_has_one_chain_step_per_block(tmp_path):
    n, BH, in_flight = 512, 2, 3
    result = _run_variants(tmp_path, "dense", str(n), "--blocks-in-flight", str(in_flight))
    case = _variant(result, "dense", n, "chunked")
    B = launching.get_block_config().chunk
    nblk, log2 = n // B, B.bit_length() - 1
    fwd, bwd = _rows(case, "dense_chunk_fwd") + _rows(case, "dense_chunk_bwd")
    assert fwd["chain_steps"] == bwd["chain_steps"] == nblk
    assert fwd["programs"] == bwd["programs"] == nblk * BH
    scores, py_read, py_prev = _dense_chunk_fwd_by_hand(nblk, in_flight)
    py = py_read + py_prev
    inverse_applied = 2 * B * (2 * (log2 - 1) * B * B + B * (D + B))  # T_c formed, applied to rhs and chain
    after_wait = 2 * 2 * B * B * D  # the chain's product and R's in-block part
    assert fwd["work_flops"]["16bit"] == BH * scores * 2 * B * B * D
    assert fwd["flops"] == BH * (scores * 2 * B * B * D + py * 2 * B * B * D + nblk * (inverse_applied + after_wait))
    # backward: later blocks but the next add B^T W; the next block's scores; T_c as the forward saved it, applied
    # to the rhs and the chain; one product after the wait
    later = sum(max(o - 1, 0) for o in range(nblk))
    applied = 2 * B * B * (D + B)
    assert bwd["flops"] == BH * ((later + nblk) * 2 * B * B * D + later * 2 * B * B * D
                                 + nblk * (applied + 2 * B * B * D))
    # the blocked variant's solves walk n / solve blocks
    blocked = _variant(result, "dense", n, "blocked")
    block = launching.get_block_config().solve
    assert [r["chain_steps"] for r in _rows(blocked, "dense_solve_fwd") + _rows(blocked, "dense_solve_bwd")] == [
        n // block, n // block]


def test_atomic_backward_is_one_kernel_per_channel(tmp_path):
    n, BH = 512, 2
    result = _run_variants(tmp_path, "attention,dense", str(n))
    cfg = launching.get_block_config()
    # one key block per program walks the query blocks from its own: scores, dP, dK, dQ and dV once per tile
    tiles = sum(n // cfg.atomic_m - (j * cfg.atomic_n) // cfg.atomic_m for j in range(n // cfg.atomic_n))
    (attn,) = _variant(result, "attention", n, "chunked")["launches"]["backward"]
    assert attn["kernel"] == "attn_bwd_atomic" and attn["grid"] == [n // cfg.atomic_n, BH]
    assert attn["flops"] == BH * tiles * 2 * cfg.atomic_m * cfg.atomic_n * (3 * D + 2 * D)
    assert attn["chain_steps"] == 0
    dense_bwd = [r["kernel"] for r in _variant(result, "dense", n, "chunked")["launches"]["backward"]]
    assert dense_bwd == ["dense_chunk_bwd", "attn_bwd_atomic", "attn_bwd_atomic"]  # channel A, then channel B
    split = [r["kernel"] for r in _variant(result, "attention", n, "blocked")["launches"]["backward"]]
    assert split == ["attn_bwd_dkdv", "attn_bwd_dq"]


def test_solved_copy_moves_the_products_with_solved_rows_from_tf32_to_16_bit(tmp_path):
    n, BH, in_flight = 512, 2, 3
    result = _run_variants(tmp_path, "dense", str(n), "--blocks-in-flight", str(in_flight), "--config",
                           f"copy:{BLOCKED},solved_copy=true", "--config", f"chunked+copy:{CHUNKED},solved_copy=true")
    cfg = launching.get_block_config()
    case = {v: _variant(result, "dense", n, v) for v in ("blocked", "copy", "chunked", "chunked+copy")}
    assert case["chunked+copy"]["config"] == {**case["chunked"]["config"], "solved_copy": True}

    def moved(plain, copy, flops, read_rows):
        """``flops`` of plain's tf32 work at 16 bits in copy, the same total; ``read_rows`` of solved rows read at
        2 bytes instead of 4."""
        assert copy["flops"] == plain["flops"]
        assert copy["work_flops"] == {"16bit": plain["work_flops"]["16bit"] + flops,
                                      "tf32": plain["work_flops"]["tf32"] - flops, "fp32": 0}
        assert copy["tile_bytes"] == plain["tile_bytes"] - read_rows * D * 2 + BH * n * D * 2  # the copy stored
        assert copy["bytes"] == plain["bytes"] + BH * n * D * 2  # the copy, a tensor of its own

    # blocked forward: every (block, earlier block) pair's P.Y, (B x B) x (B x D), reads the bf16 copy, and R's
    # in-block product reads Y rounded alike
    B = cfg.solve
    nblk = n // B
    pairs = BH * nblk * (nblk - 1) // 2
    (fwd,), (fwd_copy,) = _rows(case["blocked"], "dense_solve_fwd"), _rows(case["copy"], "dense_solve_fwd")
    moved(fwd, fwd_copy, (pairs + BH * nblk) * 2 * B * B * D, pairs * B)
    # chunked forward: the P.Y over blocks before c - 1 read the copy; R's products with block c - 1 and with the
    # block itself read Y rounded alike; R's product with block c - 1 still loads Y (the chain needs it)
    B = cfg.chunk
    _, py_read, py_prev = _dense_chunk_fwd_by_hand(n // B, in_flight)
    assert py_read == (n // B - 1) * (n // B - 2) // 2 and py_prev == n // B
    (fwd,), (fwd_copy,) = _rows(case["chunked"], "dense_chunk_fwd"), _rows(case["chunked+copy"], "dense_chunk_fwd")
    moved(fwd, fwd_copy, BH * (py_read + py_prev + n // B) * 2 * B * B * D, BH * py_read * B)
    assert fwd_copy["work_flops"]["tf32"] > 0  # the in-block inverse and the chain's product stay float32

    # blocked backward: every (block, later block) pair's B^T W, (B x B) x (B x D), reads the bf16 copy of W
    B = cfg.solve
    (bwd,), (bwd_copy,) = _rows(case["blocked"], "dense_solve_bwd"), _rows(case["copy"], "dense_solve_bwd")
    moved(bwd, bwd_copy, pairs * 2 * B * B * D, pairs * B)
    # chunked backward: B^T W over the later blocks but c + 1 read the copy; the chain's product with W_(c+1)
    # keeps W, as does the in-block solve
    B = cfg.chunk
    later = sum(max(o - 1, 0) for o in range(n // B))
    (bwd,), (bwd_copy,) = _rows(case["chunked"], "dense_chunk_bwd"), _rows(case["chunked+copy"], "dense_chunk_bwd")
    moved(bwd, bwd_copy, BH * later * 2 * B * B * D, BH * later * B)
    assert bwd_copy["work_flops"]["tf32"] > 0

    # channel B's atomic backward: V is the copy, so dP = dO V^T per tile runs at 16 bits; channel A's is unchanged
    tiles = sum(n // cfg.atomic_m - (j * cfg.atomic_n) // cfg.atomic_m for j in range(n // cfg.atomic_n))
    dp = BH * tiles * 2 * cfg.atomic_m * cfg.atomic_n * D
    (a, b), (a_copy, b_copy) = _rows(case["chunked"], "attn_bwd_atomic"), _rows(case["chunked+copy"], "attn_bwd_atomic")
    assert a_copy == a
    assert b["work_flops"]["tf32"] == dp and b_copy["work_flops"] == {"16bit": b["work_flops"]["16bit"] + dp,
                                                                      "tf32": 0, "fp32": 0}
    assert b_copy["tile_bytes"] == b["tile_bytes"] - BH * n * D * 2  # V: one key block per program, 2 bytes
    # the split backward alike: channel B's dK/dV and dQ kernels each take one product with V per tile
    split = [r for r in case["blocked"]["launches"]["backward"] if r["kernel"].startswith("attn_bwd")]
    split_copy = [r for r in case["copy"]["launches"]["backward"] if r["kernel"].startswith("attn_bwd")]
    assert split_copy[:2] == split[:2]
    assert sum(r["work_flops"]["tf32"] for r in split[2:]) > 0
    assert all(r["work_flops"]["tf32"] == 0 for r in split_copy[2:])
    assert [r["flops"] for r in split_copy] == [r["flops"] for r in split]

    # float32 inputs: the copy would be Y itself, so solved_copy changes nothing
    script = load_script("bench/roofline")
    plain, copy = (script.record_passes("dense", n, 1, BH, D, torch.float32, settings)
                   for settings in ({}, {"solved_copy": True}))
    for phase in ("forward", "backward"):
        assert [script.launch_cost(launch, "dense") for launch in copy[phase]] == [
            script.launch_cost(launch, "dense") for launch in plain[phase]]


def test_variants_leave_the_default_figures_alone_and_take_their_own_measurements(tmp_path):
    n = 256
    measured = tmp_path / "measured.json"
    today = load_script("bench/roofline").current_defaults()  # a row measured with today's kernels says so
    rows = [{"name": "triton:exp2:ce", "config": {}, "kernels": today, "n": n, "forward_ms": 1.0,
             "forward_backward_ms": 2.0},
            {"name": f"triton:exp2:ce [{BLOCKED}]", "config": aot.parse_config(BLOCKED), "kernels": today, "n": n,
             "forward_ms": 3.0, "forward_backward_ms": 4.0}]
    measured.write_text(json.dumps({"batch": 1, "heads": 2, "head_dim": D, "dtype": "bfloat16", "device": "GPU",
                                    "rows": rows}))
    profile = tmp_path / "profile.log"
    profile.write_text(f"=== n={n} exp2:ce (2 steps) [{BLOCKED}]\n"
                       "                  sparse_solve_fwd_kernel         0.00%       0.000us         0.00%       "
                       "0.000us       0.000us      30.000ms        25.32%      30.000ms      15.000ms             2\n")
    both = _run_variants(tmp_path, "exp2:ce,dense", str(n), "--measured", str(measured), "--profile", str(profile),
                         "--kernel-step-latency-us", "chunk_carry=5", configs=("default", f"blocked:{BLOCKED}"))
    out = tmp_path / "alone.json"
    assert load_script("bench/roofline").main(["--out", str(out), "--patterns", "exp2:ce,dense", "--lengths", str(n),
                                               "--batch", "1", "--heads", "2", "--profile", "",
                                               "--kernel-step-latency-us", "chunk_carry=5"]) == 0
    alone = json.loads(out.read_text())
    for pattern in ("exp2:ce", "dense"):
        assert _variant(both, pattern, n, "default")["launches"] == _variant(alone, pattern, n, "default")["launches"]
    assert {c["variant"] for c in both["cases"]} == {"default", "blocked", None}  # None: SDPA, once per length

    # measured times and profiles by the variant's settings, whatever their order
    default = _variant(both, "exp2:ce", n, "default")
    assert default["forward_backward"]["measured_ms"] == 2.0
    blocked = _variant(both, "exp2:ce", n, "blocked")
    assert blocked["forward"]["measured_ms"] == 3.0 and blocked["forward_backward"]["measured_ms"] == 4.0
    kernels = {k["kernel"]: k for k in blocked["kernels"]}
    assert kernels["sparse_solve_fwd"]["profiled_ms"] == 15.0 and kernels["sparse_solve_fwd"]["launches"] == 1
    assert kernels["sparse_solve_fwd"]["pass"] == "forward" and kernels["sparse_solve_bwd"]["pass"] == "backward"
    assert {k["kernel"]: k["profiled_ms"] for k in default["kernels"]} == {
        "sparse_direct": None, "chunk_prepare": None, "chunk_carry": None, "chunk_rows_bwd": None, "chunk_grads": None}
    # the per-kernel step latency applies to that kernel's chain only
    for r in _rows(default, "chunk_carry"):
        assert math.isclose(r["chain_s"], r["chain_steps"] * 5e-6)
    (dense_fwd,) = _rows(_variant(both, "dense", n, "default"), "dense_chunk_fwd")
    assert math.isclose(dense_fwd["chain_s"], dense_fwd["chain_steps"] * 2e-6)
    # every pass against SDPA at its length, and the latency at which it would equal it
    sdpa = _variant(both, "sdpa", n, None)["forward_backward"]["roofline_s"]
    fb = default["forward_backward"]
    assert fb["roofline_over_sdpa"] == fb["roofline_s"] / sdpa
    assert math.isclose(fb["sdpa_step_us"], (sdpa - fb["work_s"]) / fb["chain_steps"] * 1e6)


def test_bad_variant_and_latency_options_are_refused_with_the_fix(tmp_path, capsys):
    script = load_script("bench/roofline")
    for argv, said in ((["--config", "sparse_solver=fast"], "sparse_solver"),
                       (["--config", "tile=32"], "BlockConfig field"),
                       (["--config", "a:chunk=32", "--config", "a:chunk=16"], "share a name"),
                       (["--kernel-step-latency-us", "chunk_carry"], "KERNEL=MICROSECONDS"),
                       (["--blocks-in-flight", "0"], ">= 1")):
        with pytest.raises(SystemExit) as refused:
            script.main(["--out", str(tmp_path / "x.json"), *argv])
        assert refused.value.code == 2
        assert said in capsys.readouterr().err


def test_every_training_kernel_has_its_cost_model_beside_it():
    """The roofline reads each kernel's cost from its op module (``COSTS``): a kernel added without one would stop
    the roofline at its first launch. The decode step is timed, not modelled."""
    from hf_resolvent.backends.triton._loader import jit_module

    jit = jit_module(interpret=False)
    assert set(jit.COSTS) == set(jit.KERNELS) - {"decode_step_kernel"}
    for op in jit.OPS:
        assert all(name in vars(op) for name in op.COSTS), f"{op.__name__} models a kernel it does not hold"
