"""The benchmark scripts run end to end at toy sizes and write the JSON their fixed command lines promise
(the timings themselves are never asserted: speed targets live in the scripts' printed figures)."""

from __future__ import annotations

import json

from conftest import load_script


def test_bench_mixer_writes_rows_for_every_impl(tmp_path):
    out = tmp_path / "mixer.json"
    assert load_script("bench_mixer").main(["--out", str(out), "--lengths", "48", "--patterns", "dense", "exp2:ce",
                                             "--repeats", "1", "--max-reference", "48", "--heads", "2"]) == 0
    result = json.loads(out.read_text())
    keys = {(r["impl"], r["pattern"], r["n"]) for r in result["rows"]}
    assert keys == {("sdpa", "attention", 48)} | {(impl, p, 48) for impl in ("parallel", "reference")
                                                   for p in ("dense", "exp2:ce")}
    assert all(r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 for r in result["rows"]) and result["complete"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_train_writes_one_row_per_model(tmp_path):
    out = tmp_path / "train.json"
    assert load_script("bench_train").main(["--out", str(out), "--preset", "tiny", "--mixers", "exp2:ce", "dense",
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
