"""The optimizer and its learning-rate schedule: AdamW without decay on vectors (:func:`build_optimizer`), linear
warmup then cosine decay (:func:`lr_at`)."""

from __future__ import annotations

import math


def lr_at(step: int, cfg_train: dict) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine to min_lr_ratio * lr."""
    lr, warmup, total = float(cfg_train["lr"]), int(cfg_train["warmup_steps"]), int(cfg_train["max_steps"])
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    ratio = float(cfg_train["min_lr_ratio"])
    return lr * (ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def build_optimizer(model, lr: float, betas=(0.9, 0.98), weight_decay: float = 0.1, eps: float = 1e-8,
                    fused: bool | None = None):
    """AdamW with weight decay on matrices (embeddings included) and none on biases, norms and gate vectors.

    ``fused`` (default: when every parameter is on a FUSED_ADAMW_DEVICES device; pass it when the model moves
    after this call) selects PyTorch's fused implementation, on CPU too: there the per-tensor loop it replaces
    is a noticeable share of a small model's training step (figures: bench/NOTES.md). Both compute the same
    update up to float rounding.
    """
    import torch

    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": float(weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]
    if fused is None:
        fused = all(p.device.type in FUSED_ADAMW_DEVICES for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=float(lr), betas=tuple(float(b) for b in betas), eps=float(eps),
                             fused=fused)
