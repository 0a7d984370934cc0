"""scripts/plot_runs.py: loss curves of several runs in one figure."""

from __future__ import annotations

import json

import pytest
from conftest import load_script

plot_runs = load_script("plot_runs")


def _metrics(folder, losses, ppl):
    folder.mkdir()
    rows = [{"step": 10 * (i + 1), "loss": v, "tokens_per_s": 1000.0 + i} for i, v in enumerate(losses)]
    rows.append({"step": 10 * len(losses), "val_loss": losses[-1], "val_ppl": ppl})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_two_runs_in_one_figure(tmp_path, capsys):
    a = _metrics(tmp_path / "a", [5.0, 4.0, 3.5], 33.1)
    b = _metrics(tmp_path / "b", [5.2, 4.4, 4.0], 54.6)
    out = tmp_path / "both.png"
    assert plot_runs.main([str(out), f"{a}=first", str(b / "metrics.jsonl")]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out}" in capsys.readouterr().out


def test_a_run_without_metrics_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no metrics in .*empty/metrics.jsonl"):
        plot_runs.main([str(tmp_path / "x.png"), str(tmp_path / "empty")])
