"""scripts/bench/gpu_measure.py: the whole GPU measurement in one command, run here through Triton's interpreter.

``--dry-run`` runs every step (the checks, the side-by-side benchmark, the profiles, the training step, the model
and decode parts) at tiny shapes: the plan of which variant runs on which pattern, the files, the summary and the
exit status are the GPU run's. A variant whose check fails is not timed. The model and decode parts count aten
calls (op_counts.py) where a GPU run also counts CUDA launches: the per-layer count of a training step is the CPU
proxy the suite holds.
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
    assert plan["blocked-sparse"] == [p for p in gpu_measure.CHECKED if p not in ("attention", "dense")]
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
                      {"name": "triton:exp2:ce [sparse_solver=blocked]", "n": 4096, "forward_backward_ms": 4.0},
                      {"name": "triton:exp2:ce [sparse_solver=blocked]", "n": 8192, "forward_backward_ms": 6.0}]}
    verdicts = {"default": {"exp2:ce": "PASS"}, "blocked-sparse": {"exp2:ce": "PASS, 2 of 9 skipped"}}
    best = gpu_measure.fastest(bench, verdicts)["exp2:ce"]
    assert best[4096] == ("default", 3.0, 1.5) and best[8192] == ("blocked-sparse", 6.0, 0.75)
    verdicts["blocked-sparse"]["exp2:ce"] = "FAIL"  # a wrong kernel is never chosen, however fast
    assert gpu_measure.fastest(bench, verdicts)["exp2:ce"][8192][0] == "default"
    met = {(t["pattern"], t["n"], t["at_most"]): t["met"] for t in gpu_measure.targets({"exp2:ce": best})}
    assert met[("exp2:ce", 8192, 1.0)] and not met[("exp2:ce", 4096, 1.0)] and not met[("exp2:ce", 32768, 1.0)]


@pytest.mark.slow
def test_dry_run_checks_times_profiles_and_trains_each_variant(tmp_path):
    proc, summary = _run(tmp_path, "--part", "kernels,train")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["dry_run"] and summary["verdicts"]["blocked-sparse"] == {"exp2:ce": "PASS", "square:ce": "PASS"}
    assert summary["checks"]["blocked-sparse"]["summary"]["PASS"] > 0 and "blocked" not in summary["checks"]
    assert [s["step"] for s in summary["steps"]] == ["check_blocked-sparse", "bench", "profile_dense",
                                                     "profile_exp2_ce", "train_32"]
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert {r["name"] for r in rows} == {
        "sdpa", "triton:attention", "triton:dense", "triton:exp2:ce", "triton:square:ce",
        "triton:exp2:ce [sparse_solver=blocked]", "triton:square:ce [sparse_solver=blocked]",
        "triton:attention [attn_bwd=split,dense_solver=blocked,solved_copy=False,sparse_solver=blocked]",
        "triton:dense [attn_bwd=split,dense_solver=blocked,solved_copy=False,sparse_solver=blocked]"}
    assert all(r["first_call_ms"] > 0 and r["forward_backward_ms"] > 0 for r in rows)
    assert set(summary["fastest"]) == set(gpu_measure.TIMED)
    profiled = {(p, json.dumps(c["config"])) for p, cases in summary["profiles"].items() for c in cases}
    assert profiled == {("dense", "{}"), ("dense", json.dumps(gpu_measure.settings_of("blocked"))),
                        ("exp2:ce", "{}"), ("exp2:ce", '{"sparse_solver": "blocked"}')}
    models = [r["model"] for r in summary["train"]["32"]]
    assert models == ["gpt2", "exp2:ce", "exp2:ce [sparse_solver=blocked]"]
    text = (tmp_path / "summary.md").read_text()
    for heading in ("## Variants", "## Forward + backward", "## Fastest correct variant", "## Targets",
                    "## Profile: dense", "## 44M training step, context 32", "## Steps"):
        assert heading in text


@pytest.mark.slow
def test_a_variant_whose_check_fails_is_not_timed(tmp_path):
    proc, summary = _run(tmp_path, "--variants", "blocked-sparse", "--inject-error", "blocked-sparse")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert set(summary["verdicts"]["blocked-sparse"].values()) == {"FAIL"}
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


# --------------------------------------------------------------------------------------------------
# The model and decode parts


def test_parts_and_their_budgets():
    args = gpu_measure.parse_args(["--out", "/tmp/gm", "--part", "all"])
    assert args.parts == ["kernels", "train", "model", "decode"]
    assert args.budget_s == sum(gpu_measure.DEFAULT_BUDGET.values())
    args = gpu_measure.parse_args(["--out", "/tmp/gm", "--part", "decode,model"])
    assert args.parts == ["model", "decode"] and args.budget_s == 540  # in the order of --part all
    with pytest.raises(SystemExit):
        gpu_measure.parse_args(["--out", "/tmp/gm", "--part", "kernels,speed"])


def test_what_the_gpu_run_leaves_out_and_says_why():
    gpu = gpu_measure.SIZES["gpu"]
    rows = gpu_measure.decode_plan(gpu, dry_run=False)
    assert len(rows) == len(gpu_measure.DECODE_MODELS) * 2 * 2 * 2  # models x prompts x batches x modes
    skipped = {(r["model"], r["mode"]) for r in rows if "skipped" in r}
    assert all((r["context"], r["batch"]) == (32768, 32) for r in rows if "skipped" in r)
    growing = ("gpt2", "gpt2 [flash]", "attention", "dense")
    assert skipped == {(m, mode) for m in growing for mode in ("eager", "captured")}
    modes = [r["mode"] for r in rows]
    assert modes == sorted(modes, key=["eager", "captured"].index)  # eager first: compiling takes the time
    captured = [(r["context"], r["batch"]) for r in rows if r["mode"] == "captured"]
    assert captured[0] == (4096, 1) and captured[-1] == (32768, 32)
    plan = gpu_measure.model_plan(gpu)
    assert [(n, b) for n, b, _, _ in plan] == [(512, 32), (4096, 4), (16384, 1), (65536, 1)]
    assert plan[-1][2] == ["gpt2", "attention", "exp2:ce", "square:ce"] and plan[-1][3][0]["model"] == "dense"
    assert all("dense" in names for _, _, names, _ in plan[:-1])


def test_profiler_events_are_counted_by_kind():
    from types import SimpleNamespace as E

    events = [E(key="cudaLaunchKernel", count=10, self_device_time_total=0.0),
              E(key="cuLaunchKernelEx", count=4, self_device_time_total=0.0),
              E(key="cudaGraphLaunch", count=2, self_device_time_total=0.0),
              E(key="cudaStreamSynchronize", count=3, self_device_time_total=0.0),
              E(key="cudaDeviceSynchronize", count=7, self_device_time_total=0.0),  # the timing's own
              E(key="cudaMemcpy", count=1, self_device_time_total=0.0),
              E(key="cudaMemcpyAsync", count=5, self_device_time_total=0.0),
              E(key="Memcpy DtoH (Device -> Pageable)", count=3, self_device_time_total=30.0),
              E(key="aten::mm", count=6, self_device_time_total=1500.0),
              E(key="sparse_solve_fwd", count=2, self_device_time_total=500.0)]
    counts = gpu_measure.profile_counts(events)
    assert counts.pop("gpu_ms") == pytest.approx(2.03)
    assert counts == {"cuda_launches": 14, "graph_launches": 2, "cuda_syncs": 4, "dtoh_copies": 3}
    top = gpu_measure.top_kernels(events, steps=2, k=2)
    assert [k["name"] for k in top] == ["aten::mm", "sparse_solve_fwd"] and top[0] == {"name": "aten::mm",
                                                                                      "calls": 3, "ms": 0.75}


def test_a_part_starts_no_row_the_time_left_cannot_hold():
    clock = gpu_measure.Clock(100.0)
    assert clock.why_not("eager 16 x 1") is None  # nothing known yet: it runs
    clock.took["eager 16 x 1"] = 1e6
    assert clock.why_not("eager 16 x 1").startswith("out of time") and clock.why_not("eager 32 x 1") is None


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """One dry run of the model and the decode parts (about 35 s on two cores), shared by the tests below."""
    out = tmp_path_factory.mktemp("gpu_measure_parts")
    proc, summary = _run(out, "--part", "model,decode", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, summary


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@pytest.mark.slow
def test_dry_run_of_the_model_part(parts):
    out, summary = parts
    result = json.loads((out / "model.json").read_text())
    assert result["dry_run"] and summary["model"]["rows"] == result["rows"]
    models = ["gpt2", *gpu_measure.TIMED]
    shapes = gpu_measure.SIZES["dry"]["model"]
    rows = {(r["model"], r["context"], r["batch"]): r for r in result["rows"]}
    assert set(rows) == {(m, n, b) for m in models for n, b in shapes}  # every model at every length
    for (model, n, batch), r in rows.items():
        if (model, (n, batch)) == ("dense", shapes[-1]):
            assert r["skipped"].startswith("not at the longest context")
            continue
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["ratio_to_gpt2"] > 0, r
        assert _positive_int(r["aten_launches_per_step"]) and r["aten_syncs_per_step"] >= 0
        assert "cuda_launches_per_step" not in r and r["top_aten"]  # a CPU: no profiler counts
        if model == "gpt2":
            assert r["ratio_to_gpt2"] == 1.0
    for name in ("model.md", "model.png", "launches_per_layer.md"):
        assert (out / name).stat().st_size > 0
    text = (out / "model.md").read_text()
    assert all(f"| {m} | {n} x {b} |" in text for m, n, b in rows)


@pytest.mark.slow
def test_the_cpu_proxy_counts_launches_per_layer_for_each_model(parts):
    out, summary = parts
    layers = json.loads((out / "launches_per_layer.json").read_text())
    assert layers == summary["model"]["launches_per_layer"] and layers["device"] == "cpu"
    rows = {r["model"]: r for r in layers["rows"]}
    assert list(rows) == ["gpt2", *gpu_measure.TIMED]
    for r in rows.values():
        assert _positive_int(r["launches_per_layer"]) and _positive_int(r["launches_per_step"]), r
        assert r["launches_outside_layers"] > 0 and r["syncs_per_layer"] >= 0
        # the step is its layers and what is outside them
        assert r["launches_per_step"] == layers["layers"] * r["launches_per_layer"] + r["launches_outside_layers"]
    assert rows["gpt2"]["per_layer_vs_gpt2"] == 1.0
    assert rows["exp2:ce"]["launches_per_layer"] > rows["gpt2"]["launches_per_layer"]  # more ops than attention's
    text = (out / "launches_per_layer.md").read_text()
    assert all(f"| {model} | {r['launches_per_layer']} |" in text for model, r in rows.items())


@pytest.mark.slow
def test_dry_run_of_the_decode_part(parts):
    out, summary = parts
    result = json.loads((out / "decode.json").read_text())
    assert summary["decode"]["rows"] == result["rows"]
    dry = gpu_measure.SIZES["dry"]
    rows = {(r["model"], r["context"], r["batch"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(m, n, b, mode) for m in gpu_measure.DECODE_MODELS for n in dry["prompts"]
                         for b in dry["batches"] for mode in ("eager", "captured")}
    first = (dry["prompts"][0], dry["batches"][0])
    for (model, n, batch, mode), r in rows.items():
        grows = model.removesuffix(" [flash]") in gpu_measure.GROWING_CACHE
        if (n, batch) == (max(dry["prompts"]), max(dry["batches"])) and grows:
            assert r["skipped"].startswith("its cache keeps every position"), r
        elif mode == "captured" and (n, batch) != first:
            assert r["skipped"].startswith("dry run: captured"), r
        else:
            assert "error" not in r and "skipped" not in r, r
            assert r["ttft_ms"] > 0 and r["decode_ms_per_token"] > 0 and "cuda_launches_per_token" not in r
        if mode == "eager" and "skipped" not in r:
            assert r["counted_tokens"] == dry["counted"][1] - dry["counted"][0]
            assert _positive_int(r["aten_launches"]) and _positive_int(r["aten_syncs"]), r
            assert r["aten_launches_per_token"] > 0 and r["sync_sites_per_token"]
        if mode == "captured" and "skipped" not in r:
            assert r["graphs_compiled"] > 0 and "aten_launches" not in r, r  # compiled; not countable under a mode
    text = (out / "decode.md").read_text()
    assert all(f"| {m} | {n} | {b} | {mode} |" in text for m, n, b, mode in rows)
    assert (out / "decode.png").stat().st_size > 0
    summary_text = (out / "summary.md").read_text()
    for heading in ("## 44M training step", "## aten calls that launch a kernel, per layer", "## Decode", "## Steps"):
        assert heading in summary_text
    assert "## Variants" not in summary_text  # the kernel variants are the kernel and train parts'
