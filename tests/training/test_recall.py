"""experiments/recall_at_distance.py and experiments/recall_at_distance.py: models train until competent at T (or their
budget, which the record says), are read at longer lengths on samples whose asked pair lies far back, and every
row says how it was trained."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from conftest import load_script

import recall_at_distance as recall
import synthetic_tasks as tasks

TINY = recall.RecallSettings(context=32, pairs=2, d=32, layers=2, max_steps=80, check_every=20, check_samples=20, grow=100.0,
                             grow_at=0.0, eval_samples=20, multiples=(1, 2))  # at T after the first check


def test_training_stops_at_competence_and_says_when_it_did_not(tmp_path):
    logs = []
    model, record = recall.train_to_competence("attention", 0, replace(TINY, target=0.0), "rope", torch.device("cpu"),
                                               logs.append)
    assert record["reached"] and record["steps"] == 2 * TINY.check_every  # competent at the first check at T
    assert record["trained_length"] == 32
    model, record = recall.train_to_competence("attention", 0, replace(TINY, target=1.01), "none", torch.device("cpu"),
                                               logs.append)
    assert not record["reached"] and record["steps"] == TINY.max_steps and 0 <= record["accuracy_at_T"] <= 1
    assert any("NOT competent after 80 steps" in line for line in logs)
    assert model.config.position_embedding == "none" and not model.training
    one_channel = tasks.task_model("exp2:ce", 64, 32, 32, 2, 2, "rope:b", conv_size=4).config
    assert (one_channel.position_embedding, one_channel.rope_channels, one_channel.conv_size) == ("rope", "b", 4)


def test_the_training_length_grows_only_with_competence():
    """From the pairs and queries alone (BOS, 2 pairs, 2 queries: 7 tokens) by ``grow`` at each check passed; a
    model that never passes stays at the shortest length, and the record says so."""
    logs = []
    _, record = recall.train_to_competence("attention", 0, replace(TINY, grow=2.0, target=1.01), "rope", "cpu",
                                           logs.append)
    assert [re.search(r"accuracy at (length \d+|T)", line).group(1) for line in logs[:4]] == [
        "length 7", "length 14", "length 28", "T"]
    logs.clear()
    _, record = recall.train_to_competence("attention", 0, replace(TINY, grow_at=1.01), "rope", "cpu", logs.append)
    assert record["trained_length"] == 7 and not record["reached"]
    assert all("accuracy at length 7" in line for line in logs[:-1])
    # with patience, a model stalled below the gate moves on after that many checks at one length
    logs.clear()
    _, record = recall.train_to_competence("attention", 0, replace(TINY, grow=2.0, grow_at=1.01, patience=2,
                                                                   target=1.01, max_steps=160), "rope", "cpu", logs.append)
    assert [re.search(r"accuracy at (length \d+|T)", line).group(1) for line in logs[:7]] == [
        "length 7", "length 7", "length 14", "length 14", "length 28", "length 28", "T"]


def test_a_run_writes_a_row_per_model_and_seed(tmp_path):
    result = recall.run(["exp2:ce", "gpt2"], [0, 1], ["rope", "none"], TINY, tmp_path, torch.device("cpu"),
                        lambda *a: None)
    assert [(r["model"], r["seed"]) for r in result["rows"]] == [
        ("exp2:ce [rope]", 0), ("exp2:ce [rope]", 1), ("exp2:ce [none]", 0), ("exp2:ce [none]", 1),
        ("gpt2", 0), ("gpt2", 1)]
    assert set(result["rows"][0]["accuracy"]) == {32, 64} and set(result["rows"][-1]["accuracy"]) == {32}
    # the decode cache after the longest length read: GPT-2's at T (its position table ends there), the same for
    # every seed of one architecture
    assert [r["cache"]["length"] for r in result["rows"]] == [64] * 4 + [32] * 2
    assert result["rows"][0]["cache"] == result["rows"][1]["cache"] and result["rows"][0]["cache"]["bytes"] > 0
    assert result["chance"] == {"values": 1 / 16, "values_present": 1 / 2}
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["rows"]) == 6 and saved["settings"]["pairs"] == 2
    table = recall.markdown(saved)  # read back from JSON: lengths as strings
    assert "| exp2:ce [none] | " in table and "chance 0.062 over the values, 0.50 over those present" in table
    gpt2_kib = saved["rows"][-1]["cache"]["bytes"] / 1024
    assert "cache (KiB) |" in table and re.search(rf"\| gpt2 \|.* \| {gpt2_kib:.1f} at 32 \|", table)
    recall.plot(saved, tmp_path / "recall.png")
    assert (tmp_path / "recall.png").stat().st_size > 0


def test_the_script_checks_its_settings_before_training(tmp_path, capsys):
    script = load_script("recall_at_distance")
    with pytest.raises(SystemExit):
        script.main(["--out", str(tmp_path / "r"), "--context", "8", "--pairs", "4"])
    assert "cannot hold BOS, 4 pairs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(["--out", str(tmp_path / "r"), "--patience", "-1", "--context", "8"])  # refused before anything
    assert "patience must be a whole number of checks >= 0" in capsys.readouterr().err
    assert script.main(["--quick", "--mixers", "exp2:ce", "--positions", "none", "--out", str(tmp_path / "q")]) == 0
    assert {p.name for p in (tmp_path / "q").iterdir()} == {"results.json", "results.md", "recall.png"}
    with pytest.raises(SystemExit):  # the same folder again: refused, not overwritten
        script.main(["--quick", "--mixers", "exp2:ce", "--positions", "none", "--out", str(tmp_path / "q")])
    assert "--resume" in capsys.readouterr().err
    # a comma-separated spec is a hybrid stack, one spec per layer
    assert script.main(["--quick", "--mixers", "exp2:ce,attention,exp2:ce", "--positions", "none", "--seeds", "0",
                        "--out", str(tmp_path / "h")]) == 0
    row = json.loads((tmp_path / "h" / "results.json").read_text())["rows"][0]
    assert row["mixer"] == ["exp2:ce", "attention", "exp2:ce"] and row["model"] == "exp2:ce,attention,exp2:ce [none]"


def test_a_run_cut_short_resumes_without_retraining_and_never_overwrites(tmp_path):
    logs = []
    first = recall.run(["attention"], [0], ["none"], TINY, tmp_path, torch.device("cpu"), logs.append)
    with pytest.raises(FileExistsError, match="--resume"):  # an earlier run's results are never overwritten
        recall.run(["attention"], [0, 1], ["none"], TINY, tmp_path, torch.device("cpu"), logs.append)
    with pytest.raises(ValueError, match=r"settings differ in pairs \(2 there, 3 now\)"):
        recall.run(["attention"], [0, 1], ["none"], replace(TINY, pairs=3), tmp_path, torch.device("cpu"),
                   logs.append, resume=True)
    logs.clear()
    second = recall.run(["attention"], [0, 1], ["none"], TINY, tmp_path, torch.device("cpu"), logs.append,
                        resume=True)
    assert second["rows"][0] == json.loads(json.dumps(first["rows"][0]))  # kept as written, not retrained
    assert [r["seed"] for r in second["rows"]] == [0, 1]
    assert sum("seed 0: kept from" in line for line in logs) == 1 and not any("seed 0 step" in line for line in logs)
    assert len(json.loads((tmp_path / "results.json").read_text())["rows"]) == 2
    # a row written before the cache was recorded gets it on resuming, from its architecture (weights play no part)
    saved = json.loads((tmp_path / "results.json").read_text())
    del saved["rows"][0]["cache"]
    (tmp_path / "results.json").write_text(json.dumps(saved))
    third = recall.run(["attention"], [0], ["none"], TINY, tmp_path, torch.device("cpu"), logs.append, resume=True)
    assert third["rows"][0]["cache"] == first["rows"][0]["cache"]
    assert json.loads((tmp_path / "results.json").read_text())["rows"][0]["cache"] == first["rows"][0]["cache"]
    # a file written before a setting existed resumes at that setting's default, and not at another value
    saved = json.loads((tmp_path / "results.json").read_text())
    del saved["settings"]["conv_size"]
    (tmp_path / "results.json").write_text(json.dumps(saved))
    assert len(recall.run(["attention"], [0, 1], ["none"], TINY, tmp_path, torch.device("cpu"), logs.append,
                          resume=True)["rows"]) == 2
    with pytest.raises(ValueError, match=r"conv_size \(0 there, 4 now\)"):
        recall.run(["attention"], [0], ["none"], replace(TINY, conv_size=4), tmp_path, torch.device("cpu"),
                   logs.append, resume=True)


def test_how_far_puts_runs_of_one_task_side_by_side(tmp_path, capsys):
    """Every seed at every length, competent or not, with each run's setting and its cache; runs of another task,
    pairs or T are refused, and so is a folder without results."""
    quick = replace(TINY, max_steps=20, check_every=10)
    cpu, quiet = torch.device("cpu"), lambda *a: None
    recall.run(["attention"], [0], ["none"], quick, tmp_path / "a", cpu, quiet)
    deeper = recall.run(["exp2:ce"], [0, 1], ["none", "rope"], replace(quick, layers=3, patience=2), tmp_path / "b",
                        cpu, quiet)
    script = load_script("recall_at_distance")
    assert script.main(["--compare", str(tmp_path / "a"), str(tmp_path / "b"), "--positions", "none",
                        "--out", str(tmp_path / "c")]) == 0
    table = (tmp_path / "c" / "how_far.md").read_text()
    assert "| attention [none] | 2 layers x 32, 2 heads, grow 100.0, grow_at 0.0, 20 steps | 0 of 1 | " in table
    row = next(line for line in table.splitlines() if line.startswith("| exp2:ce [none] |"))
    assert "3 layers x 32, 2 heads, patience 2, grow 100.0, grow_at 0.0, 20 steps" in row and "[rope]" not in table
    cells = row.strip("|").split(" | ")
    seeds = [r for r in deeper["rows"] if r["positions"] == "none"]
    for cell, n in zip(cells[3:5], (32, 64)):  # every seed at T and past it, none of them competent
        values = [r["accuracy"][n] for r in seeds]
        assert cell.startswith(f"{sum(values) / 2:.2f} ({min(values):.2f}-{max(values):.2f})")
    assert cells[5].strip(" |") == f"{seeds[0]['cache']['bytes'] / 1024:.1f}"
    assert (tmp_path / "c" / "how_far.png").stat().st_size > 0
    recall.run(["attention"], [0], ["none"], replace(quick, pairs=3), tmp_path / "p3", cpu, quiet)
    with pytest.raises(SystemExit):
        script.main(["--compare", str(tmp_path / "a"), str(tmp_path / "p3"), "--out", str(tmp_path / "d")])
    assert "compares runs of one task, pairs, T and lengths" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(["--compare", str(tmp_path / "nothing"), "--out", str(tmp_path / "d")])
    assert "no results.json there" in capsys.readouterr().err


class _Oracle(torch.nn.Module):
    """Answers a query key with the value that followed it in the sample, at the last ``answered`` positions only."""

    def __init__(self, answered: int):
        super().__init__()
        self.answered = answered

    def forward(self, input_ids):
        from types import SimpleNamespace

        logits = torch.zeros(*input_ids.shape, 64)
        for b, row in enumerate(input_ids.tolist()):
            follows = {row[t]: row[t + 1] for t in range(len(row) - self.answered - 1)}  # the pairs, not the queries
            for t in range(len(row) - self.answered, len(row)):
                logits[b, t, follows[row[t]]] = 1.0
        return SimpleNamespace(logits=logits)


def test_accuracy_counts_every_answer_of_a_sample():
    """The decoy task asks one pair, MQAR every pair: a model that answers only the last query is right on every
    decoy sample and on a quarter of MQAR's answers (4 pairs)."""
    decoy, mqar = replace(TINY, pairs=4, context=64), replace(TINY, task="mqar", pairs=4, context=64)
    assert mqar.read_queries == 4 and decoy.read_queries == 1
    assert recall.accuracy(_Oracle(1), decoy, 64, 40, 0, "cpu") == 1.0
    assert recall.accuracy(_Oracle(1), mqar, 64, 40, 0, "cpu") == 0.25
    assert recall.accuracy(_Oracle(4), mqar, 128, 40, 0, "cpu") == 1.0
    with pytest.raises(ValueError, match="task must be one of"):
        replace(TINY, task="passkey")


def test_the_plain_schedule_trains_at_T_from_the_first_step_with_a_decaying_rate(monkeypatch):
    """schedule="plain": every training sample is T long and of the asked number of queries, and the rate follows
    lr_at's warm-up and cosine (the curriculum's stays constant after its warm-up)."""
    lengths = []
    draw = recall.tasks.passkey_batch

    def recorded(vocab, length, pairs, batch_size, rng, far=False, queries=1):
        if not far:
            lengths.append((length, queries))
        return draw(vocab, length, pairs, batch_size, rng, far=far, queries=queries)

    monkeypatch.setattr(recall.tasks, "passkey_batch", recorded)
    step = recall.tasks.task_loss
    settings = replace(TINY, schedule="plain", queries=1, target=1.01, max_steps=40, warmup=4, check_every=20)
    optimizers = []
    real = recall.protocol.build_optimizer
    monkeypatch.setattr(recall.protocol, "build_optimizer",
                        lambda *a, **k: optimizers.append(real(*a, **k)) or optimizers[-1])
    seen = []
    monkeypatch.setattr(recall.tasks, "task_loss", lambda m, b, d: seen.append(optimizers[0].param_groups[0]["lr"])
                        or step(m, b, d))
    _, record = recall.train_to_competence("attention", 0, settings, "none", "cpu", lambda *a: None)
    assert record["trained_length"] == 32 and set(lengths) == {(32, 1)}
    schedule = {"lr": settings.lr, "warmup_steps": 4, "max_steps": 40, "min_lr_ratio": 0.1}
    assert seen == pytest.approx([recall.protocol.lr_at(i, schedule) for i in range(40)])
    assert seen[-1] < 0.2 * settings.lr
    with pytest.raises(ValueError, match="schedule must be one of"):
        replace(TINY, schedule="cosine")
    with pytest.raises(ValueError, match="queries must be a whole number"):
        replace(TINY, queries=0)


def test_mqar_runs_end_to_end_and_names_its_task(tmp_path):
    result = recall.run(["attention"], [0], ["none"], replace(TINY, task="mqar"), tmp_path, torch.device("cpu"),
                        lambda *a: None)
    assert result["settings"]["task"] == "mqar" and set(result["rows"][0]["accuracy"]) == {32, 64}
    assert recall.markdown(result).startswith("MQAR at a distance, 2 pairs, trained at T = 32 (2 layers of width 32; "
                                              "AdamW at 0.001, the curriculum schedule, 2 queries per training sample)")


def test_a_rate_grid_is_swept_on_a_models_first_seed_and_its_best_replicated(tmp_path, monkeypatch):
    """With ``rates``, a model's first seed trains at each rate and keeps the best at T, with the grid; its other
    seeds train at that rate alone, and the table says which rate each seed ran at and the grid beside."""
    trained = []
    real = recall.train_to_competence

    def recorded(mixer, seed, s, pe, device, log):
        trained.append((mixer, seed, s.lr))
        model, record = real(mixer, seed, s, pe, device, log)
        return model, {**record, "accuracy_at_T": {0.01: 0.5, 0.1: 0.75, 1.0: 0.25}[s.lr]}

    monkeypatch.setattr(recall, "train_to_competence", recorded)
    settings = replace(TINY, rates=(0.01, 0.1, 1.0), max_steps=20)
    result = recall.run(["attention"], [0, 1, 2], ["none"], settings, tmp_path, torch.device("cpu"), lambda *a: None)
    assert trained == [("attention", 0, lr) for lr in (0.01, 0.1, 1.0)] + [("attention", 1, 0.1), ("attention", 2, 0.1)]
    first, *others = result["rows"]
    assert first["training"]["lr"] == 0.1 and first["training"]["by_rate"] == {"0.01": 0.5, "0.1": 0.75, "1": 0.25}
    assert all(r["training"]["lr"] == 0.1 and r["training"]["rate_of_seed"] == 0 and "by_rate" not in r["training"]
               for r in others)
    table = recall.markdown(result)
    assert "AdamW at the best at T of 0.01, 0.1, 1 per model on its first seed, the other seeds at that rate" in table
    assert table.count(" at 0.1") == 3 and "0.01: 0.50, 0.1: 0.75, 1: 0.25 (seed 0)" in table
    # a resumed run replicates the rate its first seed chose, without sweeping again
    trained.clear()
    result = recall.run(["attention"], [0, 1, 2, 3], ["none"], settings, tmp_path, torch.device("cpu"),
                        lambda *a: None, resume=True)
    assert trained == [("attention", 3, 0.1)]
    with pytest.raises(ValueError, match="rates must be positive learning rates"):
        replace(TINY, rates=(1e-3, 0))


def test_a_model_trained_on_the_far_layout_is_read_with_the_pairs_anywhere_too(tmp_path, monkeypatch):
    """The far layout as a training control: the training batches are far ones, every row records its accuracy at T
    with the asked pairs anywhere beside the far one, and the table shows it; training on it needs samples of T from
    the first step."""
    layouts, real = [], tasks.passkey_batch

    def recorded(vocab, length, pairs, batch_size, rng, far=False, queries=1):
        layouts.append((batch_size, far))
        return real(vocab, length, pairs, batch_size, rng, far=far, queries=queries)

    monkeypatch.setattr(tasks, "passkey_batch", recorded)
    settings = replace(TINY, schedule="plain", queries=1, train_far=True, batch=7)
    result = recall.run(["attention"], [0], ["none"], settings, tmp_path, torch.device("cpu"), lambda *a: None)
    assert {far for size, far in layouts if size == 7} == {True}  # every training batch
    assert (TINY.check_samples, False) in layouts  # the reading with the pairs anywhere
    record = result["rows"][0]["training"]
    assert 0 <= record["anywhere_at_T"] <= 1
    table = recall.markdown(result)
    assert "trained on the far layout (a control" in table and "| T, pairs anywhere |" in table
    assert f"| {record['anywhere_at_T']:.2f} |" in table
    with pytest.raises(ValueError, match="train_far .* needs the plain schedule"):
        replace(TINY, train_far=True)


def test_the_table_reads_past_T_only_the_seeds_competent_at_T():
    settings = TINY.record()
    rows = [{"model": "m", "seed": seed, "training": {"steps": steps, "reached": reached, "trained_length": length},
             "accuracy": {"32": at_t, "64": past}}
            for seed, steps, reached, length, at_t, past in ((0, 40, True, 32, 1.0, 0.9), (1, 80, False, 14, 0.3, 0.7))]
    table = recall.markdown({"settings": settings, "rows": rows})
    assert "| m | 1 of 2 | 40, 80 (not reached; trained up to length 14) | 0.65 (0.30-1.00) | 0.90 |" in table
    rows[0]["training"]["reached"] = False
    assert "| m | 0 of 2 | " in recall.markdown({"settings": settings, "rows": rows}).split("\n")[-2]
    assert recall.markdown({"settings": settings, "rows": rows}).split("\n")[-2].endswith("| -" + " |")
