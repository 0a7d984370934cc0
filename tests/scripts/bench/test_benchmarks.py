"""The benchmark scripts run end to end at toy sizes and write the JSON their fixed command lines promise
(the timings themselves are never asserted: speed targets live in the scripts' printed figures)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_script


def test_bench_mixer_writes_rows_for_every_impl(tmp_path):
    out = tmp_path / "mixer.json"
    assert load_script("bench/bench_mixer").main(["--out", str(out), "--lengths", "48", "--patterns", "dense", "exp2:ce",
                                             "--repeats", "1", "--max-reference", "48", "--heads", "2"]) == 0
    result = json.loads(out.read_text())
    keys = {(r["impl"], r["pattern"], r["n"]) for r in result["rows"]}
    assert keys == {("sdpa", "attention", 48)} | {(impl, p, 48) for impl in ("parallel", "reference")
                                                   for p in ("dense", "exp2:ce")}
    assert all(r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 for r in result["rows"]) and result["complete"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_train_writes_one_row_per_model(tmp_path):
    out = tmp_path / "train.json"
    assert load_script("bench/bench_train").main(["--out", str(out), "--preset", "tiny", "--mixers", "exp2:ce", "dense",
                                             "--rounds", "2", "--seq-len", "32", "--vocab", "300",
                                             "--conv-sizes", "0", "4"]) == 0
    result = json.loads(out.read_text())
    rows = {r["model"]: r for r in result["rows"]}
    assert list(rows) == ["gpt2", "exp2:ce", "dense", "exp2:ce [conv 4]", "dense [conv 4]"]
    assert rows["exp2:ce [conv 4]"]["conv_size"] == 4 and rows["exp2:ce [conv 4]"]["params"] > rows["exp2:ce"]["params"]
    for name, r in rows.items():
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and len(result["step_s"][name]) == 2
        q1, q3 = r["ratio_quartiles"]
        assert min(result["step_s"][name]) > 0 and q1 <= r["ratio_to_gpt2"] <= q3
    assert rows["gpt2"]["ratio_to_gpt2"] == 1.0 and rows["dense"]["params"] > rows["gpt2"]["params"]
    # the convolution's cost: per round, over the same mixer without it
    for mixer in ("exp2:ce", "dense"):
        steps = zip(result["step_s"][f"{mixer} [conv 4]"], result["step_s"][mixer])
        ratios = sorted(a / b for a, b in steps)
        assert rows[f"{mixer} [conv 4]"]["ratio_to_no_conv"] == pytest.approx(sum(ratios) / 2)
        assert "ratio_to_no_conv" not in rows[mixer]
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_train_refuses_to_leave_out_the_reference(tmp_path, capsys):
    with pytest.raises(SystemExit):
        load_script("bench/bench_train").main(["--out", str(tmp_path / "t.json"), "--skip", "gpt2"])
    assert "GPT-2 is the model every ratio is taken to" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_decode_times_eager_and_compiled_steps(tmp_path):
    out = tmp_path / "decode.json"
    assert load_script("bench/bench_decode").main([
        "--out", str(out), "--mixers", "exp2:ce", "--min-context", "32", "--max-context", "64", "--width", "32",
        "--heads", "2", "--layers", "1", "--vocab", "97", "--steps", "2", "--warmup", "1", "--threads", "1",
        "--compiled", "--conv-sizes", "0", "4"]) == 0
    result = json.loads(out.read_text())
    at = {(r["model"], r["context"]): r for r in result["rows"]}
    models = ("gpt2 (DynamicCache)", "exp2:ce", "exp2:ce [conv 4]", "exp2:ce compiled", "exp2:ce [conv 4] compiled")
    assert set(at) == {(m, c) for m in models for c in (32, 64)}
    # the convolution's state: 3 rows of its 5 x 32 channels (float32), at every context
    assert at[("exp2:ce [conv 4]", 64)]["cache_bytes"] - at[("exp2:ce", 64)]["cache_bytes"] == 3 * 160 * 4
    assert all(r["ms_per_token"] > 0 for r in result["rows"])
    # the growing cache holds the register's rows; the static one its capacity's slots, the same at every context
    assert at[("exp2:ce", 64)]["cache_bytes"] < at[("gpt2 (DynamicCache)", 64)]["cache_bytes"]
    assert at[("exp2:ce compiled", 32)]["cache_bytes"] == at[("exp2:ce compiled", 64)]["cache_bytes"] > 0
    assert "static cache of 68 tokens" in result["settings"]["compiled"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_profile_prefill_lists_the_operators_of_a_prefill(capsys):
    """The prefill profiles of docs/benchmarks/generation.md: the mixer's own kernels show for a resolvent model, SDPA
    for GPT-2."""
    tiny = ["--n", "300", "--width", "32", "--heads", "2", "--layers", "2", "--vocab", "128", "--rows", "40"]
    profile = load_script("bench/profile_prefill")
    assert profile.main(["--model", "exp2:ce", *tiny, "--rows", "200"]) == 0
    out = capsys.readouterr().out
    assert "exp2:ce: prefill of 300 tokens, 1 thread(s):" in out and "hf_resolvent::slot_probs" in out
    assert "aten::searchsorted" not in out
    assert profile.main(["--model", "gpt2", *tiny]) == 0
    out = capsys.readouterr().out
    assert "gpt2: prefill of 300 tokens" in out and "scaled_dot_product" in out and "hf_resolvent::" not in out
    # in chunks: the chunks after the first run the chunk form, which looks up the held rows each chunk reads
    assert profile.main(["--model", "exp2:ce", "--chunk", "128", *tiny, "--rows", "200"]) == 0
    out = capsys.readouterr().out
    assert "exp2:ce: prefill of 300 tokens in chunks of 128" in out and "aten::searchsorted" in out


def test_bench_kernels_times_each_config_as_its_own_series(tmp_path):
    """--dry-run (the interpreter, tiny shapes): every --config gives its own triton series, run under its settings."""
    from hf_resolvent.backends.triton import aot

    out = tmp_path / "kernels"
    configs = ["sparse_solver=blocked,attn_bwd=split", "sparse_solver=chunked,attn_bwd=atomic"]
    with aot.recording_launches(run=True) as rec:
        assert load_script("bench/bench_kernels").main(["--dry-run", "--out", str(out), "--patterns",
                                                        "attention,exp2:ce", "--config", configs[0], "--config",
                                                        configs[1]]) == 0
    launched = {}  # {(sparse_solver, attn_bwd): the kernels launched under that BlockConfig}
    for launch in rec.launches:
        launched.setdefault((launch.choice["sparse_solver"], launch.choice["attn_bwd"]), set()).add(launch.name)
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["dry_run"] and result["configs"] == [{"sparse_solver": "blocked", "attn_bwd": "split"},
                                                       {"sparse_solver": "chunked", "attn_bwd": "atomic"}]
    rows = {r["name"]: r for r in result["rows"]}
    triton = {f"triton:{p} [{c}]" for p in ("attention", "exp2:ce") for c in configs}
    assert set(rows) == {"sdpa", "parallel:attention", "parallel:exp2:ce"} | triton
    assert all(r["forward_ms"] > 0 and r["forward_backward_ms"] > 0 and r["n"] == 32 for r in rows.values())
    assert rows["triton:exp2:ce [sparse_solver=chunked,attn_bwd=atomic]"]["config"] == result["configs"][1]
    assert rows["sdpa"]["config"] == {}
    old = {"attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel", "sparse_solve_fwd_kernel", "sparse_solve_bwd_kernel"}
    new = {"attn_bwd_atomic_kernel", "chunk_prepare_kernel", "chunk_carry_kernel", "chunk_rows_bwd_kernel"}
    assert set(launched) == {("blocked", "split"), ("chunked", "atomic")}
    assert launched[("blocked", "split")] >= old and not launched[("blocked", "split")] & new
    assert launched[("chunked", "atomic")] >= new and not launched[("chunked", "atomic")] & old
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_kernels_compile_check_counts_each_variant(tmp_path, capsys):
    """--compile-check under two --config: each distinct kernel compiled once, rows naming the configs that launch
    it, with the PTX counts (the split backward's dQ kernel on mma.sync, the atomic one on wgmma with atomics)."""
    bench = load_script("bench/bench_kernels")
    out = tmp_path / "kernels"
    assert bench.main(["--compile-check", "--arch", "90", "--patterns", "attention", "--no-extra-cases",
                       "--config", "attn_bwd=split", "--config", "attn_bwd=atomic", "--out", str(out)]) == 0
    rows = {r["kernel"]: r for r in json.loads((tmp_path / "kernels_compile.json").read_text())}
    assert set(rows) == {"attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel", "attn_bwd_atomic_kernel",
                         "decode_step_kernel"}
    assert rows["attn_fwd_kernel"]["configs"] == ["attn_bwd=split", "attn_bwd=atomic"]
    assert rows["attn_bwd_dq_kernel"]["configs"] == ["attn_bwd=split"]
    assert rows["attn_bwd_atomic_kernel"]["configs"] == ["attn_bwd=atomic"]
    for r in rows.values():
        assert r["arch"] == "sm_90" and "error" not in r and r["registers"] > 0, r
    dq, atomic = rows["attn_bwd_dq_kernel"], rows["attn_bwd_atomic_kernel"]
    assert dq["wgmma"] == 0 and dq["mma_sync"] > 0 and dq["atomics"] == 0
    assert atomic["wgmma"] > 0 and atomic["mma_sync"] == 0 and atomic["atomics"] > 0
    assert "attn_bwd_atomic_kernel" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.parse_args(["--config", "attn_bwd=sideways"])
    assert "BlockConfig.attn_bwd must be one of 'split', 'atomic'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--config", "tile=16"])
    assert "not NAME=VALUE with NAME a BlockConfig field" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without a GPU")
def test_profile_kernels_without_a_gpu_says_so(capsys):
    profile = load_script("bench/profile_kernels")
    assert profile.main(["--lengths", "64", "--patterns", "exp2:ce", "--config", "sparse_solver=chunked"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    args = profile.parse_args(["--config", "sparse_solver=blocked", "--config", "sparse_solver=chunked,chunk=32"])
    assert args.configs == [{"sparse_solver": "blocked"}, {"sparse_solver": "chunked", "chunk": 32}]
    with pytest.raises(SystemExit):
        profile.parse_args(["--config", "sparse_solver=chunk"])
    assert "BlockConfig.sparse_solver must be one of 'blocked', 'chunked'" in capsys.readouterr().err
