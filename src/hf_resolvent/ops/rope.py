"""RoPE for the mixers' queries and keys: rotate a run of projected parts, return each part heads-major.

The PyTorch code (:func:`apply_rope` and the views in :func:`rotated_heads`) is the reference. Its twin on the CPU
kernels (``backends/cpu/csrc/rope_cpu.cpp``), one C++ call, rotates the run and writes the parts in the layout the
mixer kernels read, with its backward; it takes float32 runs whose last dimension is contiguous and tables without
gradients, and follows the mixer's own ``impl`` (:data:`ROTATED_HEADS_TWIN`). Its twin on Triton
(``triton_rope_heads``, kernels/jit/rope.py) does the same in one launch each way, where the mixer runs on Triton
(:func:`_on_triton`); there :func:`rotated_parts` takes the whole projection in that one launch, the parts RoPE
leaves alone written heads-major beside the rotated ones.
"""

from __future__ import annotations

import functools
import itertools

import torch

from .common import records_grad
from .dispatch import cpu_functions, cpu_ops, cpu_twin, triton, triton_twin_runs


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The sin table with the rotate-half's sign in it: rotate_half(t) = (-t2, t1) is the roll (t2, t1) with the
    first half negated, so a rotation is t * cos + roll(t, half) * signed_sin."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys (..., d) by cos and sin tables broadcast to them (rotate-half), in float32."""
    half = t.shape[-1] // 2
    return torch.addcmul(t.float() * cos, t.roll(half, dims=-1).float(), signed_sin(sin)).to(t.dtype)


def _twin_applies(run: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The C++ rotation computes in float32 on runs whose last dimension is contiguous, and has no gradient for the
    tables."""
    return run.dtype == torch.float32 and not (cos.requires_grad or sin.requires_grad) and run.stride(-1) == 1


ROTATED_HEADS_TWIN = cpu_twin("rope.rotated_heads", ("rope_heads", "rope_heads_backward"), applies=_twin_applies,
                              follows_impl=True)


def _on_triton(run: torch.Tensor, rope, impl: str) -> bool:
    """The Triton twin runs where the mixer runs on Triton (:func:`~.dispatch.triton_twin_runs`), with tables that
    need no gradient (it has none for them)."""
    return (rope is None or not any(table.requires_grad for table in rope)) and triton_twin_runs(impl, run)


def rotated_heads(run: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: str = "auto") -> tuple[torch.Tensor, ...]:
    """Rotate a run of projected parts and split it into heads-major parts.

    Args:
        run: (B, n, P, H, hd), P query/key parts of H heads (a slice of the mixer's input projection).
        cos, sin: (B or 1, n, hd) tables of :class:`~hf_resolvent.modeling_resolvent.ResolventRotaryEmbedding`.
        impl: the mixer's ``impl`` (:mod:`.dispatch`): the Triton launch runs where the mixer runs on Triton, the
            C++ call where its twin takes the call.

    Returns:
        P tensors (B, H, n, hd): contiguous from the C++ call and from Triton, views of the rotated run otherwise.
    """
    if _on_triton(run, (cos, sin), impl):
        return triton().triton_rope_heads(run, cos, sin)
    if ROTATED_HEADS_TWIN.takes(run, cos, sin, impl=impl):
        cos, sin = (table.expand(run.shape[0], -1, -1) for table in (cos, signed_sin(sin)))
        rotated = cpu_functions().RopeHeads.apply(run, cos, sin) if records_grad([run]) else cpu_ops().rope_heads(run, cos, sin)
        return rotated.unbind(0)
    tables = (table[:, :, None, None] for table in (cos, sin))  # (B, n, 1, 1, hd), as the run's parts
    return tuple(part.transpose(1, 2) for part in apply_rope(run, *tables).unbind(2))


@functools.lru_cache
def part_runs(parts: tuple[str, ...], channels: str) -> tuple[tuple[tuple[str, ...], bool], ...]:
    """The runs of consecutive ``parts`` that RoPE rotates (the queries and keys of ``channels``: "ab", "a", "b", or
    "" for none) or not, as (names, rotated): one rotation per run."""
    rotated = {f"{kind}{channel}" for channel in channels for kind in "qk"}
    return tuple((tuple(names), rotate) for rotate, names in itertools.groupby(parts, key=lambda name: name in rotated))


def rotated_parts(proj: torch.Tensor, parts: tuple[str, ...], channels: str, rope, impl: str = "auto"
                  ) -> dict[str, torch.Tensor]:
    """The mixer's projection split into its parts, heads-major, the queries and keys of ``channels`` rotated.

    Args:
        proj: (B, n, P, H, hd), the P parts named by ``parts`` (``qa``, ``ka``, ``x``, ``qb``, ``kb``).
        channels: the channels RoPE rotates ("ab", "a" or "b"); rope: (cos, sin) tables, or None to rotate none.
        impl: as :func:`rotated_heads`.

    Returns:
        {name: (B, H, n, hd)}: on Triton every part contiguous, from one launch; otherwise the rotated parts as
        :func:`rotated_heads` gives them and the others transposed views of ``proj``.
    """
    runs = part_runs(parts, channels if rope is not None else "")
    if _on_triton(proj, rope, impl):
        rotate = tuple(rotated for names, rotated in runs for _ in names)
        tables = rope if any(rotate) else (None, None)
        return dict(zip(parts, triton().triton_rope_heads(proj, *tables, rotate=rotate)))
    # split and unbind, not proj[:, :, i]: their backwards are one cat and one stack, where each index's backward
    # zero-fills a proj-sized gradient that autograd then sums (figures: bench/NOTES.md)
    out = {}
    for (names, rotate), run in zip(runs, proj.split([len(names) for names, _ in runs], 2)):
        out.update(zip(names, rotated_heads(run, *rope, impl=impl) if rotate else
                       (part.transpose(1, 2) for part in run.unbind(2))))
    return out
