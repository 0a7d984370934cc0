"""scripts/bench/gpu_check.py: the correctness check of the Triton kernels on a GPU, run here on CPU through Triton's
interpreter.

``--dry-run`` runs the same code as on a GPU (inputs, kernels with NaN-filled outputs, oracles, comparisons, JSON)
at tiny shapes; an injected error in the kernel output must make it fail. The full grid is checked as a plan only.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from argparse import Namespace

import pytest
import torch
from conftest import REPO, load_script

gpu_check = load_script("bench/gpu_check")
SCRIPT = str(REPO / "scripts" / "bench" / "gpu_check.py")


def _run(out, *extra, timeout=240):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(out), *extra], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow
def test_dry_run_passes_every_case(tmp_path):
    proc, result = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    planned = [c.id for c in gpu_check.plan_cases(gpu_check.parse_args(["--dry-run"]))]
    assert [r["id"] for r in result["cases"]] == planned
    assert result["complete"] and result["passed"] and result["summary"]["PASS"] == len(planned)
    kinds = {r["kind"] for r in result["cases"]}
    assert kinds == set(gpu_check.KINDS)
    for kind in ("mix", "decode"):  # every pattern through the forward / backward and the decode kernels
        assert {r["pattern"] for r in result["cases"] if r["kind"] == kind} == set(gpu_check.DRY_PATTERNS)
    assert {r["oracle"].split()[0] for r in result["cases"]} == {"reference_mix", "parallel_mix", "recurrent_step"}
    assert all(("(d: tied)" in r["oracle"]) == r["kind"].endswith("tied") for r in result["cases"])
    for r in result["cases"]:
        assert r["status"] == "PASS", r
        tol_max, tol_norm = r["tol"]
        names = set(r["checks"])
        assert "y" in names and (names > {"y"}), r["id"]  # gradients (mix, tied) or the cache (decode)
        for name, c in r["checks"].items():
            assert c["ok"] and c["finite"], (r["id"], name, c)
            assert math.isfinite(c["rel"]) and math.isfinite(c["norm_rel"]), (r["id"], name, c)
            assert c["rel"] <= tol_max and c["norm_rel"] <= tol_norm
    assert "-> PASS" in proc.stdout.splitlines()[-1]


def test_an_injected_error_fails_the_check(tmp_path):
    # A wrong value in the kernel's last output row; one compile worker runs first (the GPU path's warm-up).
    select = ["--kinds", "mix,decode", "--dtypes", "float32", "--patterns", "attention"]
    proc, result = _run(tmp_path, "--inject-error", "offset", "--jobs", "1", *select)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["warm_up"]["jobs"] == 1 and result["warm_up"]["failed_workers"] == 0
    assert [r["id"] for r in result["cases"]] == ["mix/attention/float32/tiny", "decode/attention/float32/tiny-cache"]
    for r in result["cases"]:
        assert r["status"] == "FAIL"
        failing = {name for name, c in r["checks"].items() if not c["ok"]}
        assert failing == {"y"}, r  # the constant offset leaves the gradients and the cache right
        assert r["checks"]["y"]["rel"] > 0.1
    assert not result["passed"] and "-> FAIL" in proc.stdout.splitlines()[-1]


VARIANTS = "sparse_solver=chunked,dense_solver=chunked,attn_bwd=atomic"


def test_dry_run_under_a_variant_runs_its_kernels(tmp_path, monkeypatch):
    """--config: every case runs under the BlockConfig settings (here the chunked sparse and dense solves and the
    atomic attention backward, which launch their own kernels), recorded in the JSON; run in this process so that
    the kernels it launches can be seen."""
    from hf_resolvent.backends.triton import aot, launching

    for name in ("TRITON_INTERPRET", "HF_RESOLVENT_CPU_KERNELS"):  # set by --dry-run; restored after the test
        monkeypatch.setenv(name, os.environ.get(name, "0"))
    nan_fill, threads = launching.set_nan_fill(False), torch.get_num_threads()
    try:
        with aot.recording_launches(run=True) as rec:
            code = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--config", VARIANTS, "--kinds", "mix,tied",
                                   "--dtypes", "bfloat16", "--patterns", "attention,dense,exp2:ce"])
    finally:
        launching.set_nan_fill(nan_fill)
        torch.set_num_threads(threads)
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 0 and result["passed"], [r for r in result["cases"] if r["status"] != "PASS"]
    assert result["config"] == {"sparse_solver": "chunked", "dense_solver": "chunked", "attn_bwd": "atomic"}
    assert result["args"]["config"] == VARIANTS
    cfg = result["block_config"]
    assert (cfg["sparse_solver"], cfg["attn_bwd"], cfg["chunk"], cfg["solve"]) == ("chunked", "atomic", 16, 16)
    assert [r["id"] for r in result["cases"]] == ["mix/attention/bfloat16/tiny", "mix/dense/bfloat16/tiny",
                                                  "mix/exp2:ce/bfloat16/tiny", "tied/exp2:ce/bfloat16/tiny"]
    launched = {launch.name for launch in rec.launches}
    assert launched >= {"attn_bwd_atomic_kernel", "chunk_prepare_kernel", "chunk_carry_kernel", "chunk_rows_bwd_kernel",
                        "dense_chunk_fwd_kernel", "dense_chunk_bwd_kernel"}
    assert not launched & {"attn_bwd_dq_kernel", "sparse_solve_fwd_kernel", "sparse_solve_bwd_kernel",
                           "dense_solve_fwd_kernel", "dense_solve_bwd_kernel"}
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--config", "chunk=48"])


@pytest.mark.parametrize("config", ["solved_copy=true", "dense_solver=chunked,solved_copy=true"])
def test_dry_run_passes_with_the_copies_of_the_solved_rows(tmp_path, config):
    """``solved_copy``: channel B's attention backward reads the bfloat16 copy of Y, so its row term (geff W.R) must
    read the same copy, or dP - D loses its cancellation and the gradients of qb and kb leave the tolerance."""
    proc, result = _run(tmp_path, "--config", config, "--patterns", "dense", "--dtypes", "bfloat16", "--kinds", "mix")
    assert proc.returncode == 0 and result["passed"], [r for r in result["cases"] if r["status"] != "PASS"]
    assert [r["id"] for r in result["cases"]] == ["mix/dense/bfloat16/tiny"]


def test_compare_catches_nan_and_wrong_values():
    want = torch.randn(3, 4, 5, dtype=torch.float64)
    tol = (1e-4, 1e-5)
    assert gpu_check.compare(want.float(), want, tol)["ok"]
    bad = want.clone()
    bad[0, 0, 0] = float("nan")
    c = gpu_check.compare(bad, want, tol)
    assert not c["ok"] and not c["finite"] and c["nonfinite"] == 1
    off = want + 1e-3 * want.abs().max()  # every value a little off: the max error fails, and the norm error
    c = gpu_check.compare(off, want, tol)
    assert not c["ok"] and c["rel"] == pytest.approx(1e-3) and c["norm_rel"] > 1e-5
    spread = want * (1 + 2e-5)  # a spread precision loss under the max tolerance fails on the norm
    c = gpu_check.compare(spread, want, tol)
    assert c["rel"] < 1e-4 and not c["ok"]
    assert gpu_check.compare(torch.zeros(2), torch.zeros(2), tol)["ok"]


def test_an_oracle_of_zeros_is_judged_by_the_root_mean_square():
    """diagonal's qb and kb gradients are zero (a softmax over one entry); a kernel's rounding there, 1e-6 per value,
    once failed on the H100 as a norm summed over two million values (7e-5), and a real error must still fail."""
    zeros = torch.zeros(2, 8, 2048, 64, dtype=torch.float64)
    rounding = 1e-6 * torch.randn(zeros.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    c = gpu_check.compare(rounding.float(), zeros, (2e-4, 5e-5))
    assert c["ok"] and c["norm_rel"] == pytest.approx(1e-6, rel=0.01)
    assert not gpu_check.compare((rounding + 1e-3).float(), zeros, (2e-4, 5e-5))["ok"]


def test_full_grid_covers_the_real_shapes():
    args = gpu_check.parse_args([])
    assert args.jobs == 8 and args.shapes == "full" and args.tol_bf16 == (6e-2, 2e-2)
    cases = gpu_check.plan_cases(args)
    assert len({c.id for c in cases}) == len(cases)
    mix = [c for c in cases if c.kind == "mix"]
    for shape in {c.shape for c in mix}:
        got = {(c.pattern, c.dtype) for c in mix if c.shape == shape}
        assert got == {(p, t) for p in gpu_check.PATTERNS for t in gpu_check.DTYPES}, shape
    assert {c.n for c in mix} == {512, 2048, 4096, 8192, 16384}
    assert {c.d for c in cases} == {64, 128} and {c.heads for c in cases} == {8, 16}
    assert min(c.batch for c in cases) == 1 and max(c.batch for c in cases) == 8
    assert {c.kind for c in cases} == set(gpu_check.KINDS) and any(c.padded for c in cases)
    for c in cases:  # the reference form's (B, H, n, n) float64 matrices stay small
        if c.oracle == "reference":
            assert c.batch * c.heads * c.n**2 * 8 <= 1 << 30, c.id
    selected = gpu_check.plan_cases(gpu_check.parse_args(["--kinds", "decode", "--patterns", "exp2:ce",
                                                          "--dtypes", "float32"]))
    assert [c.id for c in selected] == ["decode/exp2:ce/float32/cache", "decode/exp2:ce/float32/cache-d128"]
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--tol-fp32", "1e-4"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without a GPU")
def test_without_a_gpu_it_says_so(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "--dry-run" in capsys.readouterr().err


def test_pytest_result_is_recorded(tmp_path):
    tests = tmp_path / "test_sample.py"
    tests.write_text("import time\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2\n\n"
                     "def test_slow():\n    time.sleep(60)\n")
    args = Namespace(pytest_args=f"{tests} -p no:cacheprovider -k 'ok or bad'", pytest_timeout=60)
    result = gpu_check.run_pytest(args, tmp_path)
    assert result["returncode"] == 1 and not result["timed_out"]
    assert "1 failed, 1 passed" in result["summary"] and any("test_bad" in s for s in result["failures"])
    assert (tmp_path / "pytest.log").read_text().strip()
    args = Namespace(pytest_args=f"{tests} -p no:cacheprovider -k slow", pytest_timeout=3)
    result = gpu_check.run_pytest(args, tmp_path)
    assert result["timed_out"] and result["returncode"] is None and result["seconds"] < 30
