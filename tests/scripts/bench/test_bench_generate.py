"""scripts/bench/bench_generate.py at toy sizes, run as a user runs it (a subprocess; it forks one child per measurement):
every row has sane figures, the cache sizes order as the mixers promise, and a child over its time budget becomes
a skipped row instead of a hang. Timings are checked for sign and consistency only, never for speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, load_script

TINY = ["--width", "32", "--heads", "2", "--layers", "2", "--vocab", "128", "--new-tokens", "4", "--threads", "1"]


def _start(tmp_path, name: str, *extra: str):
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_generate.py"), "--out", str(out), *TINY, *extra]
    return out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)


def _finish(started) -> tuple[dict, str]:
    out, proc = started
    try:
        stdout, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-5000:]
    assert out.with_suffix(".png").stat().st_size > 0
    return json.loads(out.read_text()), stdout


def test_generate_rows_cache_sizes_and_time_budget(tmp_path):
    models = ["gpt2", "mamba2", "attention", "exp2:ce", "exp2:ce chunked"]
    # both runs at once (the second only waits for timeouts): the imports dominate either
    main = _start(tmp_path, "gen", "--contexts", "32", "64", "--models", *models, "--batches", "1", "2",
                  "--batch-context", "32", "--prefill-chunk", "16")
    late = _start(tmp_path, "late", "--contexts", "32", "64", "--models", "exp2:ce", "--batches",
                  "--max-seconds", "0.001")
    result, stdout = _finish(main)
    rows = result["rows"]
    at = {(r["model"], r["context"], r["batch"]): r for r in rows}
    # batch 1 at 32 tokens is the context sweep's run, reused: one row per (model, n, batch)
    assert len(rows) == len(at) == 3 * len(models)
    assert set(at) == {(m, n, b) for m in models for n, b in ((32, 1), (64, 1), (32, 2))}
    for r in rows:
        assert "skipped" not in r and "error" not in r, r
        assert r["new_tokens"] == 4 and r["threads"] == 1
        assert 0 < r["ttft_s"] < r["total_s"]
        assert r["decode_ms_per_token"] > 0 and r["decode_ms_median"] > 0
        assert r["total_s"] >= r["ttft_s"] + 3 * r["decode_ms_per_token"] / 1e3 * 0.999
        assert abs(r["decode_tokens_per_s"] * r["decode_ms_per_token"] / 1e3 - r["batch"]) < 1e-6
        assert r["peak_rss_mib"] >= r["model_rss_mib"] > 10 and r["params"] > 0
        assert r["cache_bytes"] > 0
        g = at[("gpt2", r["context"], r["batch"])]
        assert abs(r["decode_vs_gpt2"] * g["decode_ms_per_token"] - r["decode_ms_per_token"]) < 1e-9
        added = r["peak_rss_mib"] - r["model_rss_mib"]
        assert abs(r["added_vs_gpt2"] * max(g["peak_rss_mib"] - g["model_rss_mib"], 1e-9) - added) < 1e-6
    # GPT-2 keeps keys and values of every token fed: 2 x layers x (n + new - 1) x width float32 per sequence
    for n, b in ((32, 1), (64, 1), (32, 2)):
        assert at[("gpt2", n, b)]["cache_bytes"] == 2 * 2 * (n + 3) * 32 * 4 * b
    # attention grows with the context; exp2:ce and Mamba2 hardly or not at all, and hold less at 64 tokens
    assert at[("attention", 64, 1)]["cache_bytes"] > 1.8 * at[("attention", 32, 1)]["cache_bytes"]
    assert at[("exp2:ce", 64, 1)]["cache_bytes"] < at[("attention", 64, 1)]["cache_bytes"] / 2
    assert at[("mamba2", 64, 1)]["cache_bytes"] == at[("mamba2", 32, 1)]["cache_bytes"]
    assert at[("attention", 32, 2)]["cache_bytes"] == 2 * at[("attention", 32, 1)]["cache_bytes"]
    for n, b in ((32, 1), (64, 1), (32, 2)):  # a prompt in chunks of 16 leaves the same state
        assert at[("exp2:ce chunked", n, b)]["cache_bytes"] == at[("exp2:ce", n, b)]["cache_bytes"]
    s = result["settings"]
    assert s["prefill_chunk"] == 16
    assert s["threads"] == 1 and s["contexts"] == [32, 64] and s["mamba2"]["hidden_size"] == 32
    assert "| 64 | exp2:ce |" in stdout and "batched decode at n = 32" in stdout
    assert "peak above the model MiB (x)" in stdout

    # a budget no child can meet: the first context times out, the longer one is not even started
    result, stdout = _finish(late)
    rows = {r["context"]: r for r in result["rows"]}
    assert set(rows) == {32, 64} and all("ttft_s" not in r for r in rows.values())
    assert rows[32]["skipped"].startswith("timeout") and rows[64]["skipped"] == "timeout at 32 tokens"
    assert "skipped: timeout" in stdout


def test_million_preset_computed_cache_and_growth(tmp_path):
    """--million at toy lengths (its contexts overridden): no batched runs, the KV cache computed from the config is
    the one generate() returned, and the growth table's exponents are those of the rows."""
    models = ["gpt2", "attention", "exp2:ce chunked", "square:ce chunked"]
    result, stdout = _finish(_start(tmp_path, "million", "--million", "--contexts", "32", "128", "--models", *models,
                                    "--prefill-chunk", "16"))
    s, rows = result["settings"], result["rows"]
    assert s["million"] and s["batches"] == [] and s["max_seconds"] == 600 and s["new_tokens"] == 4
    at = {(r["model"], r["context"]): r for r in rows}
    assert set(at) == {(m, n) for m in models for n in (32, 128)} and all(r["batch"] == 1 for r in rows)
    for (model, _), r in at.items():
        assert "ttft_s" in r, r
        if model in ("gpt2", "attention"):  # every position kept: the formula matches the cache, to the byte
            assert r["cache_bytes_computed"] == r["cache_bytes"]
        else:
            assert "cache_bytes_computed" not in r
    assert at[("gpt2", 128)]["cache_bytes_computed"] == 2 * 2 * (128 + 3) * 32 * 4
    growth = {(g["model"], g["context_from"], g["context_to"]): g for g in result["growth"]}
    assert set(growth) == {(m, 32, 128) for m in models}
    for (model, a, b), g in growth.items():
        ra, rb = at[(model, a)], at[(model, b)]
        assert abs(4 ** g["ttft_exponent"] - rb["ttft_s"] / ra["ttft_s"]) < 1e-6 * rb["ttft_s"] / ra["ttft_s"]
        ratio = rb["decode_ms_per_token"] / ra["decode_ms_per_token"]
        assert abs(4 ** g["decode_exponent"] - ratio) < 1e-6 * ratio
    assert "growth between measured prompt lengths" in stdout and "| square:ce chunked | 32 | 128 |" in stdout


def test_kv_cache_computed_from_the_config():
    """At a million tokens GPT-2's cache (bench shape: 4 layers of width 256, float32) is the 8 GiB the docs quote;
    a cache-efficient or recurrent model has no per-token formula; a skipped row shows the computed figure."""
    mod = load_script("bench/bench_generate")
    s = dict(width=256, layers=4, heads=4, vocab=50257)
    tokens = 2**20 + 31
    assert mod.kv_cache_bytes("gpt2", s, tokens) == 2 * 4 * tokens * 256 * 4
    assert 8.0 <= mod.kv_cache_bytes("gpt2", s, tokens) / 2**30 < 8.1
    # attention keeps keys and values as GPT-2 does, and an int64 position per row; dense four rows per position
    assert mod.kv_cache_bytes("attention", s, tokens) == 4 * tokens * (2 * 256 * 4 + 8)
    assert mod.kv_cache_bytes("dense", s, tokens) == 4 * tokens * (4 * 256 * 4 + 8)
    assert mod.kv_cache_bytes("gpt2", s, 100, batch=3) == 3 * mod.kv_cache_bytes("gpt2", s, 100)
    for name in ("exp2:ce chunked", "square:ce+tied", "local_attention:256", "mamba2"):
        assert mod.kv_cache_bytes(name, s, tokens) is None, name
    skipped = dict(model="gpt2", context=tokens - 31, batch=1, new_tokens=32, skipped="estimated 9999 s",
                   cache_bytes_computed=mod.kv_cache_bytes("gpt2", s, tokens))
    result = {"rows": [skipped], "growth": [], "settings": dict(new_tokens=32, threads=1, batch_context=4096,
                                                                  batches=[])}
    line = next(x for x in mod.table(result).splitlines() if x.startswith(f"| {tokens - 31} | gpt2 |"))
    assert "skipped: estimated 9999 s" in line and line.endswith("| 8192.242 (computed) |")


def test_million_preset_defaults_and_bad_options(capsys):
    mod = load_script("bench/bench_generate")
    args = mod.parse_args(["--out", "x.json", "--million"])
    assert args.contexts == [2**16, 2**17, 2**18, 2**19, 2**20] and args.batches == [] and args.max_seconds == 600
    assert "gpt2" in args.models and {"exp2:ce chunked", "square:ce chunked"} <= set(args.models)
    assert mod.parse_args(["--out", "x.json"]).max_seconds == 1200  # the other runs keep their limit
    for bad, message in ((["--million", "--quick"], "two presets"), (["--models", "exp2:ce/x"], "unknown pattern")):
        with pytest.raises(SystemExit):
            mod.parse_args(["--out", "x.json", *bad])
        assert message in capsys.readouterr().err


def test_predicted_skips_and_same_mixers_as_bench_decode():
    mod = load_script("bench/bench_generate")
    assert mod.MIXERS == load_script("bench/bench_decode").MIXERS
    hist = [dict(context=1024, batch=1, ttft_s=1.0, total_s=2.0, model_rss_mib=400.0, peak_rss_mib=500.0),
            dict(context=4096, batch=1, ttft_s=16.0, total_s=20.0, model_rss_mib=400.0, peak_rss_mib=800.0)]
    assert mod.predict_skip(hist, 8192, 1, 600, 100) is None  # 64 + 8 s, 1.2 GiB
    assert "--max-seconds" in mod.predict_skip(hist, 32768, 1, 600, 100)  # quadratic: 1024 + 32 s
    assert "--max-gib" in mod.predict_skip(hist, 8192, 1, 600, 0.9)  # (400 + 2 x 300) MiB
    assert mod.predict_skip(hist, 32768, 8, 600, 100) is None  # no run at batch 8 to go by


def test_the_peak_is_never_under_the_resident_size_seen_before_it(monkeypatch):
    """Linux sums its RSS counters per CPU lazily: a VmHWM read after the run came back 16 KiB under the VmRSS read
    before it (a CI run). The row's peak is at least every resident size it observed."""
    bench = load_script("bench/bench_generate")
    real, seen = bench.proc_status_kib, []

    def status(field):  # VmHWM 16 KiB under the first VmRSS read (the resident size before the prompt)
        if field == "VmRSS":
            seen.append(real(field))
            return seen[-1]
        return seen[0] - 16 if field == "VmHWM" else real(field)

    monkeypatch.setattr(bench, "proc_status_kib", status)
    settings = dict(width=32, layers=1, heads=2, vocab=64, threads=1, seed=0, mamba_state=16)
    row = bench.measure({"settings": settings, "model": "exp2:ce", "context": 16, "batch": 1, "new_tokens": 3})
    assert row["peak_rss_mib"] >= row["model_rss_mib"] > 0
