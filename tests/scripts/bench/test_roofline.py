"""scripts/bench/roofline.py: the model's counts follow the recorded launches, and the measured times are attached
where the benchmark file has them."""

from __future__ import annotations

import json

import torch
from conftest import load_script
from hf_resolvent.backends.triton import resolvent

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
            "--profile", str(profile)]
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
    block = resolvent.get_block_config().solve
    solves = [r for r in dense["launches"]["forward"] + dense["launches"]["backward"] if "solve" in r["kernel"]]
    assert [r["kernel"] for r in solves] == ["dense_solve_fwd", "dense_solve_bwd"]
    assert all(r["chain_steps"] == 4096 // block for r in solves)
    recorded = load_script("bench/roofline").record_passes("dense", 4096, B, H, D, torch.bfloat16)
    for phase in ("forward", "backward"):
        assert [r["programs"] for r in dense["launches"][phase]] == [
            torch.Size(launch.grid).numel() for launch in recorded[phase]]
        assert [r["grid"] for r in dense["launches"][phase]] == [list(launch.grid) for launch in recorded[phase]]
    # attention's forward kernel: one program per 64 rows and head, nothing chained, the FLOPs of causal tiles
    (attn_fwd,) = _case(result, "attention", 4096)["launches"]["forward"]
    cfg = resolvent.get_block_config()
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
