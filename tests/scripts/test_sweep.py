"""experiments/sweep.py: the quick sweep end to end (two mixers, two seeds, through scripts/pretrain.py subprocesses and
scripts/evaluate.py), its table, figure and seed summary; the bootstrap interval, the Pareto front and the
errors."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import load_script

import sweep  # noqa: E402


@pytest.fixture(scope="module")
def quick(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    argv = ["--quick", "--data", str(tiny_data), "--runs-dir", str(root / "runs"), "--out", str(root / "out"),
            "--steps", "6", "--seeds", "0", "1", "--run-timeout", "300"]
    assert sweep.main(argv) == 0
    return root, json.loads((root / "out" / "sweep.json").read_text())


def test_quick_sweep_trains_evaluates_and_writes_table_and_figure(quick):
    root, result = quick
    rows = {(r["model"], r["seed"]): r for r in result["rows"]}
    assert set(rows) == {("attention", 0), ("exp2:ce", 0), ("attention", 1), ("exp2:ce", 1)}
    for r in rows.values():
        assert r["tokens"] == 6 * 4 * 32 and r["params"] > 0 and r["train_time_s"] >= 0
        assert math.isfinite(r["val_ppl"]) and r["ppl_low"] <= r["val_ppl"] <= r["ppl_high"]
        assert r["windows"] >= 2 and math.isfinite(r["strided_ppl"])
        assert (root / "runs" / r["run"].split("/")[-1] / "eval_results.json").exists()  # evaluate.py ran on it
    att, ce = rows[("attention", 0)], rows[("exp2:ce", 0)]
    # attention reads every earlier position in each of its 2 layers; exp2:ce a logarithmic few
    assert att["reads_per_token"] == 2 * 32 and att["time_per_token"] == "O(n)"
    assert ce["reads_per_token"] < att["reads_per_token"] and ce["time_per_token"] == "O(log n)"
    assert 0 < ce["cache_bytes"] < att["cache_bytes"] and ce["cache"] == "O(log n)"
    assert ce["params"] > att["params"]  # the resolvent layer's extra projections
    # seeds change the initialisation (and data order): the two seeds' models differ
    assert rows[("attention", 0)]["val_ppl"] != rows[("attention", 1)]["val_ppl"]
    pair = result["seeds"]["pairs"]["exp2:ce - attention"]
    assert pair["diffs"] == pytest.approx([rows[("exp2:ce", s)]["val_ppl"] - rows[("attention", s)]["val_ppl"]
                                           for s in (0, 1)])
    table = (root / "out" / "sweep.md").read_text()
    assert "| attention | 0 |" in table and "| exp2:ce | 1 |" in table and "exp2:ce - attention" in table
    assert result["command"].startswith("python experiments/sweep.py --quick")
    assert (root / "out" / "sweep.png").stat().st_size > 5000
    assert (root / "out" / "evaluate" / "perplexity_vs_complexity.png").exists()


def test_same_steps_and_data_for_every_model(quick):
    root, result = quick
    configs = [json.loads((root / "runs" / r["run"].split("/")[-1] / "run_config.json").read_text())
               for r in result["rows"] if r["seed"] == 0]
    for section in ("train", "data"):
        assert configs[0][section] == configs[1][section]
    assert {c["model"]["mixer"] for c in configs} == {"attention", "exp2:ce"}


def test_bootstrap_interval_and_pareto_front():
    rng = np.random.default_rng(0)
    losses = 3.0 + 0.3 * rng.standard_normal(400)
    lo, hi = sweep.bootstrap_ppl(losses)
    assert lo < math.exp(losses.mean()) < hi
    # the interval is about 2 x 1.96 standard errors wide (in log space)
    assert math.log(hi) - math.log(lo) == pytest.approx(2 * 1.96 * 0.3 / math.sqrt(400), rel=0.2)
    lo4, hi4 = sweep.bootstrap_ppl(losses[:25])
    assert hi4 - lo4 > hi - lo
    rows = [{"m": "a", "c": 10, "val_ppl": 20.0}, {"m": "b", "c": 1, "val_ppl": 30.0},
            {"m": "c", "c": 5, "val_ppl": 35.0}, {"m": "d", "c": 100, "val_ppl": 19.0},
            {"m": "e", "c": 100, "val_ppl": 25.0}]
    assert [r["m"] for r in sweep.pareto(rows, "c")] == ["b", "a", "d"]


def test_hybrid_and_tied_models_reach_pretrain_as_per_layer_specs():
    preset = dict(sweep.PRESETS["hour"])
    cmd = sweep.pretrain_command(sweep.PRETRAIN, "exp2:ce/attention", 0, preset, Path("r"), None)
    assert "model.mixer=[exp2:ce, attention, exp2:ce, attention]" in cmd and "--mixer" not in cmd
    tied = sweep.pretrain_command(sweep.PRETRAIN, "exp2:ce+tied", 0, preset, Path("r"), None)
    assert tied[tied.index("--mixer") + 1] == "exp2:ce+tied"
    assert "model.type=gpt2" in sweep.pretrain_command(sweep.PRETRAIN, "gpt2", 0, preset, Path("r"), None)
    names = set(sweep.MODELS)
    for required in ("gpt2", "attention", "local_attention:8", "dense", "banded:8", "diagonal", "exp2", "exp2:ce",
                     "square", "square:ce"):
        assert required in names and required in preset["models"]


def test_bad_requests_fail_clearly(tiny_data, tmp_path, capsys):
    assert sweep.main(["--quick", "--models", "attention", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown model(s) ['nope']" in capsys.readouterr().err
    assert sweep.main(["--quick", "--seeds", "0", "0", "--out", str(tmp_path)]) == 2
    assert "repeats a seed" in capsys.readouterr().err
    # a failing training run names the model and the command that reproduces it
    assert sweep.main(["--quick", "--models", "attention", "--data", str(tmp_path / "missing"), "--runs-dir",
                       str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--run-timeout", "120"]) == 2
    err = capsys.readouterr().err
    assert "training attention (seed 0) failed" in err and "pretrain.py" in err


def test_evaluate_draws_the_sweeps_references_beside_a_run_of_the_same_budget(quick, tmp_path, capsys):
    root, result = quick
    evaluate = load_script("evaluate")
    assert result["settings"]["budget"]["steps"] == 6 and result["settings"]["budget"]["corpus_sha256"]
    run = root / "runs" / "exp2_ce-seed0"
    assert (run / "config.json").exists()
    refs = str(root / "out" / "sweep.json")
    assert evaluate.main([str(run), "--samples", "0", "--references", refs, "--out", str(tmp_path / "same")]) == 0
    said = capsys.readouterr().out
    ev = json.loads((tmp_path / "same" / "eval.json").read_text())
    attention = next(r for r in result["rows"] if r["model"] == "attention" and r["seed"] == 0)
    assert [r["mixer"] for r in ev["references"]] == ["attention"]  # the quick sweep has no gpt2
    assert ev["references"][0]["perplexity"] == attention["strided_ppl"]
    assert "references from" in said and "attention (seed 0)" in said
    assert "attention (out reference)" in (tmp_path / "same" / "eval.md").read_text()

    # the same run with another recorded budget (fault injected into its run_config.json): no references, and why
    other = tmp_path / "other-budget"
    shutil.copytree(run, other)
    cfg = json.loads((other / "run_config.json").read_text())
    cfg["train"]["max_steps"] = 7
    (other / "run_config.json").write_text(json.dumps(cfg))
    assert evaluate.main([str(other), "--samples", "0", "--references", refs, "--out", str(tmp_path / "o")]) == 0
    said = capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "eval.json").read_text())["references"] == []
    assert "no model here was trained at its budget" in said and "steps 6" in said
    assert evaluate.main([str(run), "--samples", "0", "--references", "none", "--out", str(tmp_path / "n")]) == 0
    assert "no references (--references none)" in capsys.readouterr().out


def test_the_hour_preset_trains_the_tiny_config(tmp_path):
    """The README's first command (``--config tiny``) trains at the hour preset's budget, so evaluate.py draws the
    committed sweep's GPT-2 and attention beside it."""
    from hf_resolvent.training.config import load_config

    tiny, hour = load_config("tiny"), sweep.PRESETS["hour"]
    assert tiny["model"]["overrides"] == hour["shape"] and tiny["data"]["seq_len"] == hour["seq_len"]
    assert (tiny["train"]["max_steps"], tiny["train"]["batch_size"], tiny["train"]["lr"],
            tiny["train"]["warmup_steps"], tiny["train"]["seed"]) == (hour["steps"], hour["batch"], hour["lr"],
                                                                      hour["warmup"], 0)
