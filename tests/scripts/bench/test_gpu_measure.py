"""scripts/bench/gpu_measure.py: the whole GPU measurement in one command, run here through Triton's interpreter.

``--dry-run`` runs every step (the checks, the side-by-side benchmark, the profiles, the training step) at tiny
shapes: the plan of which variant runs on which pattern, the files, the summary and the exit status are the GPU
run's. A variant whose check fails is not timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, load_script

gpu_measure = load_script("bench/gpu_measure")
SCRIPT = str(REPO / "scripts" / "bench" / "gpu_measure.py")


def _run(out, *extra, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(out), *extra], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, json.loads((out / "summary.json").read_text())


def test_each_variant_runs_only_on_the_patterns_it_changes():
    plan = gpu_measure.plan(list(gpu_measure.VARIANTS), gpu_measure.CHECKED)
    assert plan["default"] == gpu_measure.CHECKED
    assert plan["chunked-sparse"] == [p for p in gpu_measure.CHECKED if p not in ("attention", "dense")]
    assert plan["blocked"] == ["attention", "dense"]  # the split backward and the blocked dense solve
    from hf_resolvent.backends.triton import aot

    assert aot.relevant({"sparse_solver": "chunked", "attn_bwd": "split"}, "exp2:ce") == {"sparse_solver": "chunked"}
    assert aot.relevant({"sparse_solver": "chunked", "attn_bwd": "split"}, "attention") == {"attn_bwd": "split"}
    assert aot.relevant({"solved_copy": True, "sparse_solver": "chunked"}, "dense") == {"solved_copy": True}


def test_the_fastest_correct_variant_is_chosen_per_length():
    bench = {"rows": [{"name": "sdpa", "n": 4096, "forward_backward_ms": 2.0},
                      {"name": "sdpa", "n": 8192, "forward_backward_ms": 8.0},
                      {"name": "triton:exp2:ce", "n": 4096, "forward_backward_ms": 3.0},
                      {"name": "triton:exp2:ce", "n": 8192, "forward_backward_ms": 12.0},
                      {"name": "triton:exp2:ce [sparse_solver=chunked]", "n": 4096, "forward_backward_ms": 4.0},
                      {"name": "triton:exp2:ce [sparse_solver=chunked]", "n": 8192, "forward_backward_ms": 6.0}]}
    verdicts = {"default": {"exp2:ce": "PASS"}, "chunked-sparse": {"exp2:ce": "PASS, 2 of 9 skipped"}}
    best = gpu_measure.fastest(bench, verdicts)["exp2:ce"]
    assert best[4096] == ("default", 3.0, 1.5) and best[8192] == ("chunked-sparse", 6.0, 0.75)
    verdicts["chunked-sparse"]["exp2:ce"] = "FAIL"  # a wrong kernel is never chosen, however fast
    assert gpu_measure.fastest(bench, verdicts)["exp2:ce"][8192][0] == "default"
    met = {(t["pattern"], t["n"], t["at_most"]): t["met"] for t in gpu_measure.targets({"exp2:ce": best})}
    assert met[("exp2:ce", 8192, 1.0)] and not met[("exp2:ce", 4096, 1.0)] and not met[("exp2:ce", 32768, 1.0)]


def test_dry_run_checks_times_profiles_and_trains_each_variant(tmp_path):
    proc, summary = _run(tmp_path, "--part", "all")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["dry_run"] and summary["verdicts"]["chunked-sparse"] == {"exp2:ce": "PASS", "square:ce": "PASS"}
    assert summary["checks"]["chunked-sparse"]["summary"]["PASS"] > 0 and "blocked" not in summary["checks"]
    assert [s["step"] for s in summary["steps"]] == ["check_chunked-sparse", "bench", "profile_dense",
                                                     "profile_exp2_ce", "train_32"]
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert {r["name"] for r in rows} == {
        "sdpa", "triton:attention", "triton:dense", "triton:exp2:ce", "triton:square:ce",
        "triton:exp2:ce [sparse_solver=chunked]", "triton:square:ce [sparse_solver=chunked]",
        "triton:attention [attn_bwd=split,dense_solver=blocked,solved_copy=False]",
        "triton:dense [attn_bwd=split,dense_solver=blocked,solved_copy=False]"}
    assert all(r["first_call_ms"] > 0 and r["forward_backward_ms"] > 0 for r in rows)
    assert set(summary["fastest"]) == set(gpu_measure.TIMED)
    profiled = {(p, json.dumps(c["config"])) for p, cases in summary["profiles"].items() for c in cases}
    assert profiled == {("dense", "{}"), ("dense", json.dumps(gpu_measure.settings_of("blocked"))),
                        ("exp2:ce", "{}"), ("exp2:ce", '{"sparse_solver": "chunked"}')}
    models = [r["model"] for r in summary["train"]["32"]]
    assert models == ["gpt2", "exp2:ce", "exp2:ce [sparse_solver=chunked]"]
    text = (tmp_path / "summary.md").read_text()
    for heading in ("## Variants", "## Forward + backward", "## Fastest correct variant", "## Targets",
                    "## Profile: dense", "## 44M training step, context 32", "## Steps"):
        assert heading in text


def test_a_variant_whose_check_fails_is_not_timed(tmp_path):
    proc, summary = _run(tmp_path, "--variants", "chunked-sparse", "--inject-error", "chunked-sparse")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert set(summary["verdicts"]["chunked-sparse"].values()) == {"FAIL"}
    names = {r["name"] for r in json.loads((tmp_path / "kernels.json").read_text())["rows"]}
    assert not any("chunked" in name for name in names) and "triton:exp2:ce" in names
    assert "not timed on exp2:ce, square:ce" in proc.stdout
    assert "done, with failures" in proc.stdout.splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without a GPU")
def test_without_a_gpu_it_says_so(tmp_path, capsys):
    assert gpu_measure.main(["--out", str(tmp_path / "m")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_measure.parse_args(["--out", str(tmp_path), "--variants", "fastest"])
    assert "unknown ['fastest']" in capsys.readouterr().err
