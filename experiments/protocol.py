"""How the synthetic studies train their models (synthetic.py, recall_at_distance.py, long_context.py): one loop
(:func:`train`) and one way to give every model of a comparison its own learning rate (:func:`best_rate`).

The loop: AdamW (betas 0.9 and 0.98, weight decay 0.1 on matrices, the per-tensor loop the committed tables were
measured with), a linear warm-up, then a cosine decay to a tenth of the rate (or the rate held after the warm-up),
the gradient clipped at norm 1, the loss of the answer positions (``synthetic_tasks.task_loss``).

A comparison trains each model at every rate of a small grid and reads the best (:data:`RATES`, the grid Zoology
sweeps for MQAR): one rate for all would measure how well that rate suits each mixer as much as the mixer.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from hf_resolvent.training.optim import build_optimizer, lr_at

import synthetic_tasks as tasks

RATES = (1e-3, 3e-3, 1e-2)


def train(model, draw: Callable[[int], tasks.Batch], steps: int, lr: float, warmup: int, device, *,
          decay: bool = True, accum: int = 1, autocast=None, check_every: int = 0,
          check: Callable[[int, float], bool] | None = None, on_step: Callable[[int, float], None] | None = None):
    """Train ``model`` (in place) for up to ``steps`` optimizer steps on batches ``draw(step)``, ``accum`` of them
    per step; returns (steps run, the last step's loss).

    ``decay``: the cosine after the warm-up (False: the rate held). ``check(step, loss)`` runs every
    ``check_every`` steps and after the last; training stops when it returns True. ``on_step(step, loss)`` runs
    after every step (a progress bar)."""
    opt = build_optimizer(model, lr, betas=(0.9, 0.98), weight_decay=0.1, fused=False)
    rates = {"lr": lr, "warmup_steps": warmup, "max_steps": steps, "min_lr_ratio": 0.1}
    model.train()
    step, loss = 0, float("nan")
    while step < steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, rates) if decay else lr * min(1.0, (step + 1) / warmup)
        loss = 0.0
        for _ in range(accum):
            with autocast or nullcontext():
                part = tasks.task_loss(model, draw(step), device)
            (part / accum).backward()
            loss += part.item() / accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if on_step is not None:
            on_step(step, loss)
        if check is not None and (step % check_every == 0 or step == steps) and check(step, loss):
            break
    return step, loss


def best_rate(fit: Callable[[float], tuple[object, dict]], rates=RATES, score: str = "accuracy_at_T"):
    """Train at every rate of ``rates`` with ``fit(lr) -> (model, record)`` and keep the model whose
    ``record[score]`` is highest (the first such rate on a tie). Returns (model, record); the record gains
    ``lr`` and ``by_rate``: {rate: its record's score} for the whole grid."""
    best, grid = None, {}
    for lr in rates:
        model, record = fit(lr)
        grid[f"{lr:g}"] = record[score]
        if best is None or record[score] > best[1][score]:
            best = model, {**record, "lr": lr}
    model, record = best
    record["by_rate"] = grid
    return model, record
