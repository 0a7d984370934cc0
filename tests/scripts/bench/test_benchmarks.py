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
                                             "--rounds", "2", "--seq-len", "32", "--vocab", "300"]) == 0
    result = json.loads(out.read_text())
    rows = {r["model"]: r for r in result["rows"]}
    assert list(rows) == ["gpt2", "exp2:ce", "dense"]
    for name, r in rows.items():
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and len(result["step_s"][name]) == 2
        q1, q3 = r["ratio_quartiles"]
        assert min(result["step_s"][name]) > 0 and q1 <= r["ratio_to_gpt2"] <= q3
    assert rows["gpt2"]["ratio_to_gpt2"] == 1.0 and rows["dense"]["params"] > rows["gpt2"]["params"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_decode_times_eager_and_compiled_steps(tmp_path):
    out = tmp_path / "decode.json"
    assert load_script("bench/bench_decode").main([
        "--out", str(out), "--mixers", "exp2:ce", "--min-context", "32", "--max-context", "64", "--width", "32",
        "--heads", "2", "--layers", "1", "--vocab", "97", "--steps", "2", "--warmup", "1", "--threads", "1",
        "--compiled"]) == 0
    result = json.loads(out.read_text())
    at = {(r["model"], r["context"]): r for r in result["rows"]}
    assert set(at) == {(m, c) for m in ("gpt2 (DynamicCache)", "exp2:ce", "exp2:ce compiled") for c in (32, 64)}
    assert all(r["ms_per_token"] > 0 for r in result["rows"])
    # the growing cache holds the register's rows; the static one its capacity's slots, the same at every context
    assert at[("exp2:ce", 64)]["cache_bytes"] < at[("gpt2 (DynamicCache)", 64)]["cache_bytes"]
    assert at[("exp2:ce compiled", 32)]["cache_bytes"] == at[("exp2:ce compiled", 64)]["cache_bytes"] > 0
    assert "static cache of 68 tokens" in result["settings"]["compiled"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_profile_prefill_lists_the_operators_of_a_prefill(capsys):
    """The prefill profiles of docs/benchmarks.md: the mixer's own kernels show for a resolvent model, SDPA for GPT-2."""
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without a GPU")
def test_profile_kernels_without_a_gpu_says_so(capsys):
    assert load_script("bench/profile_kernels").main(["--lengths", "64", "--patterns", "exp2:ce"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
