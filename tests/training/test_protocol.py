"""experiments/protocol.py: the one training loop of the synthetic studies and the learning-rate grid."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import protocol
import synthetic_tasks as tasks

VOCAB = tasks.Vocab(8, 16, 16)


def _model(seed=0):
    torch.manual_seed(seed)
    return tasks.task_model("attention", VOCAB.size, 32, 32, 2, 2, "none")


def test_the_loop_steps_draws_and_stops_where_it_is_told():
    rng, drawn, after, checked = np.random.default_rng(0), [], [], []

    def draw(step):
        drawn.append(step)
        return tasks.passkey_batch(VOCAB, 32, 2, 4, rng)

    steps, loss = protocol.train(_model(), draw, 50, 1e-3, 5, "cpu", accum=2, check_every=4,
                                 check=lambda step, loss: checked.append(step) or step >= 12,
                                 on_step=lambda step, loss: after.append(step))
    assert steps == 12 and np.isfinite(loss) and loss > 0
    assert drawn == [s for s in range(12) for _ in range(2)]  # accum batches per step, told the step
    assert after == list(range(1, 13)) and checked == [4, 8, 12]
    steps, _ = protocol.train(_model(), draw, 6, 1e-3, 2, "cpu", check_every=4, check=lambda step, loss: checked.append(step))
    assert steps == 6 and checked[-2:] == [4, 6]  # and after the last step


@pytest.mark.parametrize("decay", [True, False])
def test_the_rate_warms_up_then_decays_or_holds(monkeypatch, decay):
    seen, real = [], protocol.build_optimizer
    opts = []
    monkeypatch.setattr(protocol, "build_optimizer", lambda *a, **k: opts.append(real(*a, **k)) or opts[-1])
    rng = np.random.default_rng(0)

    def draw(step):
        seen.append(opts[0].param_groups[0]["lr"])
        return tasks.passkey_batch(VOCAB, 32, 2, 4, rng)

    protocol.train(_model(), draw, 20, 1e-2, 4, "cpu", decay=decay)
    assert seen[:4] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2])
    assert seen[-1] == (pytest.approx(1e-2) if not decay else pytest.approx(protocol.lr_at(19, {
        "lr": 1e-2, "warmup_steps": 4, "max_steps": 20, "min_lr_ratio": 0.1})))
    assert decay == (seen[-1] < 2e-3)


def test_learning_lowers_the_loss():
    rng = np.random.default_rng(1)
    model = _model()
    batch = tasks.passkey_batch(VOCAB, 32, 2, 64, np.random.default_rng(7))
    with torch.no_grad():
        before = float(tasks.task_loss(model, batch, "cpu"))
    protocol.train(model, lambda step: tasks.passkey_batch(VOCAB, 32, 2, 16, rng), 60, 3e-3, 5, "cpu")
    with torch.no_grad():
        assert float(tasks.task_loss(model.eval(), batch, "cpu")) < before - 0.3


def test_best_rate_keeps_the_best_and_records_the_grid():
    scores = {1e-3: 0.4, 3e-3: 0.9, 1e-2: 0.9}
    model, record = protocol.best_rate(lambda lr: (f"model at {lr}", {"accuracy_at_T": scores[lr], "steps": 7}))
    assert model == "model at 0.003" and record["lr"] == 3e-3 and record["steps"] == 7  # the first of a tie
    assert record["by_rate"] == {"0.001": 0.4, "0.003": 0.9, "0.01": 0.9}
