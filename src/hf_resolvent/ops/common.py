"""Input checks and small helpers shared by the forms of the mixer."""

from __future__ import annotations

import torch

from .patterns import Pattern


def check_tied(qa, ka, d) -> None:
    """The tied variant (``d`` given) reads no A scores: refuse ``qa`` or ``ka`` beside ``d``."""
    if d is not None and (qa is not None or ka is not None):
        raise ValueError("the tied variant (d given) reads no A scores: pass qa=None and ka=None")


def check_inputs(qa, ka, qb, kb, x, g, pattern: Pattern, start=None, tied_d=None) -> None:
    """Raise a ValueError naming the argument whose shape does not fit (B, H, n, d) conventions."""
    if x is None or x.dim() != 4:
        raise ValueError(f"x must be (batch, heads, n, value_dim), got shape {None if x is None else tuple(x.shape)}")
    batch, heads, n, _ = x.shape

    def need(name, t, last=None):
        if t is None:
            raise ValueError(f"{name} is required for pattern {pattern.name!r}")
        if t.dim() != 4 or tuple(t.shape[:3]) != (batch, heads, n):
            raise ValueError(
                f"{name} must be (batch, heads, n, dim) = ({batch}, {heads}, {n}, dim) like x, got {tuple(t.shape)}"
            )

    check_tied(qa, ka, tied_d)
    if tied_d is None:
        need("qa", qa)
        need("ka", ka)
        if qa.shape[-1] != ka.shape[-1]:
            raise ValueError(f"qa and ka need the same last dim, got {qa.shape[-1]} and {ka.shape[-1]}")
    elif tuple(tied_d.shape) != (batch, heads, n):
        raise ValueError(f"d must be (batch, heads, n) = ({batch}, {heads}, {n}), got {tuple(tied_d.shape)}")
    if pattern.has_recurrence:
        need("qb", qb)
        need("kb", kb)
        if qb.shape[-1] != kb.shape[-1]:
            raise ValueError(f"qb and kb need the same last dim, got {qb.shape[-1]} and {kb.shape[-1]}")
        if g is None or tuple(g.shape) != (batch, heads, n):
            raise ValueError(
                f"g must be (batch, heads, n) = ({batch}, {heads}, {n}) for pattern {pattern.name!r}, "
                f"got {None if g is None else tuple(g.shape)}"
            )
    elif tied_d is not None:
        raise ValueError(f"the tied variant needs a recurrent pattern, got {pattern.name!r}")
    if start is not None:
        if not isinstance(start, torch.Tensor) or start.dtype.is_floating_point or start.dtype in (torch.bool, torch.complex64, torch.complex128):
            got = type(start).__name__ if not isinstance(start, torch.Tensor) else f"a {start.dtype} tensor"
            raise ValueError(f"start must be an integer tensor (torch.long) of shape (batch,), got {got}")
        if start.dim() != 1 or start.shape[0] != batch:
            raise ValueError(f"start must be (batch,) = ({batch},), got {tuple(start.shape)}")
        require((start >= 0).all() & (start < n).all(), "start (leading padding per sequence) must lie in [0, n)",
                lambda: f"start (leading padding per sequence) must lie in [0, n) = [0, {n})")


def to_compute_dtype(*ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The tensors in the dtype the forms compute in: float32, or float64 when the first given tensor is float64
    (None stays None)."""
    dtype = torch.promote_types(next(t for t in ts if t is not None).dtype, torch.float32)
    return [None if t is None else t.to(dtype) for t in ts]


def records_grad(tensors) -> bool:
    """True when autograd records what is computed from ``tensors``: grad mode is on and one of them requires grad."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def require(ok: torch.Tensor, problem: str, message, read_back: bool = True) -> None:
    """Raise ``ValueError(message())`` where the 0-d bool tensor ``ok`` is False. Eager: one host sync. Inside a
    ``torch.compile`` graph, where reading the value would break the graph: a runtime assert in the graph, whose
    error says ``problem`` (the values are not known there). ``read_back=False`` (a decode step, which reads nothing
    back from the device): an assert queued on the device, which on a CPU fails at once (and becomes the
    ValueError) and on a GPU stops the process with ``problem`` at its next synchronisation."""
    if torch.compiler.is_compiling():
        torch._assert_async(ok, problem)
    elif read_back:
        if not bool(ok):
            raise ValueError(message())
    else:
        try:
            torch._assert_async(ok, problem)
            return
        except RuntimeError:
            pass
        raise ValueError(message())  # outside the handler: the error alone, without the assert's as its context


def row_valid_mask(start: torch.Tensor | None, n: int, like: torch.Tensor) -> torch.Tensor:
    """(B or 1, 1, n, 1) mask: 1 on real rows, 0 on leading padding (whose outputs are zeroed)."""
    if start is None:
        return torch.ones(1, 1, n, 1, dtype=like.dtype, device=like.device)
    t = torch.arange(n, device=like.device)
    return (t[None, :] >= start[:, None].to(like.device)).to(like.dtype)[:, None, :, None]
