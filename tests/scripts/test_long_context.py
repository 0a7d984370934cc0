"""experiments/long_context.py: a preset smaller than --quick end to end (GPT-2 and exp2:ce through scripts/pretrain.py,
loss by position with and without RoPE scaling, token carry and MQAR), its JSON's schema, its rows (one for every
model, task and length, not-applicable ones for GPT-2 past its context), tables and figures; the token-carry samples
and the position buckets on their own."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import long_context as lc  # noqa: E402

# --quick's models and tasks, smaller: the tiny corpus's validation split holds two windows of 4 x 16 tokens
TEST_PRESET = {
    "models": ["gpt2", "exp2:ce"], "seeds": [0],
    "lm": {"shape": {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_inner": 64, "n_positions": 16},
           "seq_len": 16, "batch": 4, "micro_batch": 4, "steps": 4, "lr": 3e-3, "warmup": 1,
           "multiples": [1, 2, 4], "windows": 2},
    "token_carry": {"context": 16, "prefix": 2, "vocab": (2, 4, 4), "d": 16, "layers": 1, "heads": 2,
                "steps": 4, "batch": 4, "lr": 3e-3, "warmup": 1, "eval_samples": 8, "multiples": [1, 2, 4]},
    "mqar": {"length": 8, "pairs": 2, "vocab": (2, 4, 4), "d": 16, "layers": 1, "heads": 2,
             "steps": 4, "batch": 4, "lr": 3e-3, "warmup": 1, "eval_samples": 8, "multiples": [1, 2]},
}


@pytest.fixture(scope="module")
def result(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("long_context")
    lc.PRESETS["test"] = TEST_PRESET
    argv = ["--preset", "test", "--data", str(tiny_data), "--runs-dir", str(root / "runs"), "--out",
            str(root / "out"), "--run-timeout", "300", "--quiet"]
    assert lc.main(argv) == 0
    return root / "out", json.loads((root / "out" / "results.json").read_text())


def test_every_model_task_and_length_has_one_row_of_the_schema(result):
    out, res = result
    assert set(res) == {"command", "settings", "rows"} and res["command"].startswith("python experiments/long_context.py")
    keys = [(r["model"], r["task"], r["length"], r["seed"]) for r in res["rows"]]
    assert len(keys) == len(set(keys))
    want = {(m, t, n, 0) for m in ("gpt2", "exp2:ce") for t in ("loss", "loss:linear", "loss:dynamic", "loss:yarn")
            for n in (16, 32, 64)}
    want |= {(m, "context_use", 16, 0) for m in ("gpt2", "exp2:ce")}
    want |= {(m, "token_carry", n, 0) for m in ("gpt2", "exp2:ce") for n in (16, 32, 64)}
    want |= {(m, "mqar", n, 0) for m in ("gpt2", "exp2:ce") for n in (8, 16)}
    assert set(keys) == want == lc.expected_keys(res["settings"])
    for r in res["rows"]:
        assert {"model", "task", "length", "seed", "value", "metric"} <= set(r) <= {*r, "note"}
        assert r["metric"] == ("accuracy" if r["task"] in ("token_carry", "mqar") else lc.METRICS[r["task"].split(":")[0]])
    s = res["settings"]
    assert s["loss"]["windows"] == 2 and s["loss"]["window"] == 64 and s["loss"]["factor"] == 4
    assert s["token_carry"]["distance"] == {"16": 10, "32": 26, "64": 58}  # n - BOS, key, value, key - prefix 2


def test_gpt2_past_its_context_is_not_applicable_and_every_other_value_is_finite(result):
    _, res = result
    for r in res["rows"]:
        context = 8 if r["task"] == "mqar" else 16
        if r["model"] == "gpt2" and (r["length"] > context or r["task"].startswith("loss:")):
            assert r["value"] is None and r["note"].startswith("not applicable")
        else:
            assert isinstance(r["value"], float) and math.isfinite(r["value"]) and "note" not in r
            if r["metric"] == "accuracy":
                assert 0.0 <= r["value"] <= 1.0
            elif r["task"] == "context_use":
                assert r["value"] < 1.0
            else:
                assert 0.0 < r["value"] < 10.0  # nats per token, vocabulary of 300


def test_scalings_change_the_loss_past_the_context_and_dynamic_not_within_it(result):
    _, res = result
    v = {(r["task"], r["length"]): r["value"] for r in res["rows"] if r["model"] == "exp2:ce"}
    for s in ("linear", "yarn"):
        assert v[(f"loss:{s}", 16)] != v[("loss", 16)]
    assert v[("loss:dynamic", 64)] != v[("loss", 64)]


def test_tables_and_figures(result):
    out, res = result
    table = (out / "results.md").read_text()
    assert "| gpt2 | loss | " in table and "| n/a | n/a |" in table and "| exp2:ce | loss:yarn |" in table
    assert "Context use inside T = 16" in table and "| exp2:ce | " in table.split("Context use")[1]
    earlier = {**res, "rows": [r for r in res["rows"] if r["task"] != "context_use"]}  # written before the task
    assert "Context use" not in lc.markdown(earlier) and "| exp2:ce | token_carry |" in lc.markdown(earlier)
    assert (out / "loss_by_position.png").stat().st_size > 5000 and (out / "recall.png").stat().st_size > 5000


def test_token_carry_samples_state_the_pair_once_and_ask_the_key_at_the_end():
    vocab = lc.tasks.Vocab(3, 5, 5)
    batch = lc.token_carry_batch(vocab, (7, 7), 2, 32, np.random.default_rng(0))
    for ids, labels in zip(batch.input_ids.numpy(), batch.labels.numpy()):
        real = ids[ids != lc.tasks.PAD]
        assert real[0] == lc.tasks.BOS and 11 <= len(real) <= 13  # 7 fillers between, 0 to 2 before
        keys = np.flatnonzero(vocab.is_key(real))
        values = np.flatnonzero(vocab.is_value(real))
        assert len(keys) == 2 and len(values) == 1 and keys[-1] == len(real) - 1
        assert values[0] == keys[0] + 1 and real[keys[0]] == real[keys[1]] and keys[1] - values[0] == 8
        assert np.flatnonzero(labels != lc.tasks.IGNORE).tolist() == [len(real) - 1]
        assert labels[len(real) - 1] == real[values[0]]
    assert lc.token_carry_distance(64, 2) == 58


def test_context_use_compares_the_last_half_of_the_context_with_its_first_sixteenth():
    losses = np.zeros((2, 64))
    losses[:, 1:5] = 4.0  # positions [1, T/16] for T = 64
    losses[:, 5:32] = 9.0  # between: not counted
    losses[:, 32:64] = 3.0  # the last half
    assert lc.context_use(losses, 64) == pytest.approx(0.25)
    flat = np.full((2, 64), 2.0)  # a model that gains nothing from context
    assert abs(lc.context_use(flat, 64)) < 1e-12 < lc.CONTEXT_USE_GOAL


def test_buckets_cover_each_position_once():
    assert lc.buckets([1, 2, 4], 16) == [(16, 1, 16), (32, 16, 32), (64, 32, 64)]
    losses = np.tile(np.arange(64, dtype=float), (3, 1))
    means = lc.bucket_means(losses, [1, 2, 4], 16)
    assert means == {16: pytest.approx(8.0), 32: pytest.approx(23.5), 64: pytest.approx(47.5)}
    assert lc.bucket_means(losses[:, :16], [1, 2, 4], 16) == {16: pytest.approx(8.0)}


def test_a_missing_value_needs_its_reason_and_nan_is_refused():
    with pytest.raises(ValueError, match="needs a note"):
        lc.row("gpt2", "loss", 32, 0, None)
    with pytest.raises(lc.LongContextError, match="not finite"):
        lc.row("dense", "loss", 32, 0, float("nan"))
    assert torch.isfinite(torch.tensor(lc.row("dense", "token_carry", 32, 0, 0.5)["value"]))


def test_bad_requests_fail_clearly(tmp_path, capsys):
    assert lc.main(["--quick", "--models", "gpt2", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown model(s) ['nope']" in capsys.readouterr().err
    assert lc.main(["--quick", "--seeds", "1", "1", "--out", str(tmp_path)]) == 2
    assert "repeats a seed" in capsys.readouterr().err


def test_a_preset_with_its_own_data_and_models_without_positions(tmp_path):
    """The bytes preset's plumbing, smaller: the offline corpus tokenised one token per byte into the runs folder,
    models without positions (one with the short convolution, as bytes_conv trains), the language-model tasks only."""
    lc.PRESETS["test_bytes"] = {
        "models": ["attention [none]", "attention [none+conv4]"], "seeds": [0], "seeded": [],
        "data": {"tokenizer": "bpe", "vocab_size": 257, "max_docs": 12},
        "lm": {"shape": {"n_layer": 1, "n_embd": 16, "n_head": 2, "n_inner": 32, "n_positions": 16}, "seq_len": 16,
               "batch": 2, "micro_batch": 2, "steps": 2, "lr": 3e-3, "warmup": 1, "multiples": [1, 2], "windows": 2}}
    runs = tmp_path / "runs"
    assert lc.main(["--preset", "test_bytes", "--runs-dir", str(runs), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {r["task"] for r in res["rows"]} == {*lc.LOSS_TASKS, "context_use"} and "token_carry" not in res["settings"]
    assert "257" in res["settings"]["loss"]["tokenizer"] and (runs / "data" / "meta.json").exists()
    assert all(r["value"] is None and "no position encoding" in r["note"] for r in res["rows"]
               if r["task"].startswith("loss:"))
    configs = [json.loads((runs / f"attention-{slug}-seed0" / "config.json").read_text())
               for slug in ("none", "none-conv4")]
    assert [(c["position_embedding"], c["conv_size"]) for c in configs] == [("none", 0), ("none", 4)]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["loss_by_position.png", "results.json",
                                                                    "results.md"]
