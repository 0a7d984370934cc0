"""Several new tokens after a decode state, in parallel: a chunked prefill's later chunks, and every forward of more
than one token that continues a cache (assisted decoding's drafts, a new turn of a chat).

L tokens that continue a state of S held rows are rows S..S+L-1 of the parallel form over m = S + L rows, [held
rows; new rows], whose first S rows are already solved: their inputs, keys and outputs are the state's. Every row a
new token reads is one of them (docs/DESIGN.md section 4: a state holds what later tokens read), so:

- the sources of the new rows are the pattern's own (:func:`.graph.source_table` at their positions), found
  among the held rows (:meth:`~.state.DecodeState.held_rows`) or the new rows;
- Z = A~ X is a gather over those sources, or for dense patterns attention over all m rows in blocks of rows;
- Y = (1 - g) Z + g B~ Y is the graph form's block forward substitution (:func:`.graph.solve_after`), started
  after the held rows.

On the CPU, without gradients, sparse patterns run the same rows on the slot operators of the CPU kernels
(``slot_probs``, ``slot_combine``, ``slot_solve``, which take any source table; :data:`OUTPUTS_TWIN`): per sequence, over [the held rows the
new ones read; new rows], with the held rows' slots empty and their outputs as the right-hand side, so a solve
reproduces them and goes on from there. The PyTorch code below is their reference and the path with autograd.

The result equals L decode steps (and a prefill of the whole sequence) to rounding; the state then takes the L
tokens in one :meth:`~.state.DecodeState.extend`. Memory and work are those of the L rows plus the rows they read,
so a long prompt in chunks holds one chunk's activations at a time.

Shapes: B batch, H heads, L new tokens, S rows held, d key width, e value width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import check_tied, records_grad, to_compute_dtype
from .dispatch import cpu_ops, cpu_twin
from .graph import GRAPH_CHUNK, gathered_slot_probs, gathered_slot_sum, solve_after, source_table
from .state import DecodeState

DIRECT_ROWS = 512  # new rows per block of a dense pattern's attention over all rows


def _sources(state: DecodeState, held: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """(B, K, L) long: the row of [held rows; new rows] that slot k of new token (b, l) at position r[b, l] reads
    through B (sparse patterns), -1 where the slot is empty; ``held`` (B, S) the held rows' positions."""
    pattern = state.pattern
    size, r0 = held.shape[1], r[:, :1]
    table = source_table(pattern, r, int(r.max().item()) + 1).transpose(0, 1)  # (B, K, L) positions
    rows = torch.where(table >= r0[:, :, None], size + table - r0[:, :, None], state.held_rows(table))
    rows = torch.where(table >= 0, rows, -1)
    if size:
        read = held.gather(1, rows.clamp(0, size - 1).flatten(1)).view_as(rows)
        ok = (rows >= size) | ((rows >= 0) & (read == table))
    else:
        ok = rows >= 0
    if bool(((table >= 0) & ~ok).any()):
        raise RuntimeError(f"a token of pattern {pattern.name!r} reads a position its decode state no longer holds: "
                           "please report")
    return rows


def _with_self(size: int, slots: torch.Tensor) -> torch.Tensor:
    """(B, 1 + K, L): the sources of A, which reads the token itself (slot 0, after the ``size`` held rows) and the
    slots of B."""
    own = size + torch.arange(slots.shape[2], device=slots.device).expand(slots.shape[0], 1, -1)
    return torch.cat([own, slots], dim=1)


def _direct(size: int, qa, ka, x, scale, slots=None, valid=None) -> torch.Tensor:
    """Z = A~ X for the new rows (B, H, L, e) after ``size`` held rows; ka and x hold all m rows. Sparse patterns
    give their ``slots`` (:func:`_sources`), dense ones their ``valid`` rows of [held rows; new rows]."""
    if slots is not None:
        src = _with_self(size, slots)
        return gathered_slot_sum(gathered_slot_probs(qa, ka, src, scale), x, src)
    length = qa.shape[2]
    out = []
    for c0 in range(0, length, DIRECT_ROWS):
        c1 = min(length, c0 + DIRECT_ROWS)
        j = torch.arange(size + c1, device=x.device)
        mask = valid[:, None, :size + c1] & (j[None, :] <= size + torch.arange(c0, c1, device=x.device)[:, None])
        out.append(F.scaled_dot_product_attention(qa[:, :, c0:c1], ka[:, :, :size + c1], x[:, :, :size + c1],
                                                  attn_mask=mask[:, None], scale=scale))
    return torch.cat(out, dim=2)


def _with_held(rows: dict[str, torch.Tensor], name: str, new: torch.Tensor) -> torch.Tensor:
    """[held rows; new rows] of one tensor (B, H, m, .), in the new rows' dtype."""
    held = rows.get(name)
    return new if held is None else torch.cat([held.to(new.dtype), new], dim=2)


def _positions(state: DecodeState, x: torch.Tensor) -> torch.Tensor:
    """(B, L) the pattern positions of the new tokens; refuses tokens inside a left padding."""
    r = state.next_position()[:, None] + torch.arange(x.shape[2], device=x.device)
    if bool((r[:, 0] < 0).any()):
        raise ValueError("tokens after a cache must follow real tokens (no left padding left to run): run the "
                         "padding in the prefill")
    return r


def _read_rows(held_rows: int, slots: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """For each sequence b, the tables of the CPU kernels' path over [the u held rows its new rows read; new rows]:
    (used, src_a, src_b, src_solve, reads) with ``used`` (u,) those held rows, sorted; src_a (1 + K, L) and src_b
    (K, L) the sources of A (the token itself, then B's) and of B for the new rows; src_solve (K, u + L) B's
    sources for all rows, the held ones' slots empty (slot_solve's layout); reads (L,) the new rows that read
    anything through B."""
    length = slots.shape[2]
    out = []
    for table in slots:  # (K, L) over [held rows; new rows]
        held = (table >= 0) & (table < held_rows)
        used = torch.unique(table[held])
        u = used.numel()
        src_b = torch.where(held, torch.searchsorted(used, table.clamp(min=0)), table - held_rows + u)
        src_b = torch.where(table >= 0, src_b, -1)
        src_a = torch.cat([u + torch.arange(length, device=table.device)[None], src_b])
        src_solve = torch.cat([src_b.new_full((src_b.shape[0], u), -1), src_b], 1)
        out.append((used, src_a, src_b, src_solve, (src_b >= 0).any(0)))
    return out


def _sparse_on_cpu_kernels(held: dict[str, torch.Tensor], pattern, plan, scale, qa, ka, qb, kb, x, g,
                           tied: bool) -> torch.Tensor:
    """:func:`_outputs` of a sparse pattern on the slot operators of the CPU kernels, one sequence at a time (each has its own
    tables, :func:`_read_rows`): (B, H, L, e). The kernels score the new rows against [held rows read; new rows]; the
    solve runs over those rows too, with the held rows' slots empty and their outputs as its right-hand side, so that
    it gives them back and continues from them."""
    ops = cpu_ops()
    out = []
    for b, (used, src_a, src_b, src_solve, reads) in enumerate(plan):
        def rows(name: str, new: torch.Tensor | None, b=b, used=used) -> torch.Tensor:  # (1, H, u + L, .)
            kept = held[name][b:b + 1].index_select(2, used)
            return kept if new is None else torch.cat([kept.to(new.dtype), new[b:b + 1]], 2)

        if tied:
            direct = x[b:b + 1]
        else:
            probs = ops.slot_probs(qa[b:b + 1].contiguous(), rows("keys_a", ka), src_a, scale)
            direct = ops.slot_combine(probs, rows("values", x), src_a)
        if not pattern.has_recurrence:
            out.append(direct)
            continue
        gate = g[b:b + 1] * reads  # rows that read nothing take g = 0
        w = ops.slot_probs(qb[b:b + 1].contiguous(), rows("keys_b", kb), src_b, scale) * gate[:, :, None]
        rhs = torch.cat([rows("outputs", None).to(x.dtype), (1 - gate)[..., None] * direct], 2)
        u = used.numel()
        out.append(ops.slot_solve(F.pad(w, (u, 0)), rhs, src_solve)[:, :, u:])
    return torch.cat(out, 0)


def _twin_applies(x: torch.Tensor, *, slots, size: int, given) -> bool:
    """The slot operators serve sparse patterns (``slots``, the new rows' sources) after a state that holds rows,
    without gradients (they run here without their backwards). ``x`` is in the compute dtype."""
    return slots is not None and bool(size) and not records_grad(given)


OUTPUTS_TWIN = cpu_twin("extend._outputs", ("slot_probs", "slot_combine", "slot_solve"), applies=_twin_applies)


def _outputs(state: DecodeState, r, scale, qa, ka, qb, kb, x, g, tied: bool) -> torch.Tensor:
    """The new rows' outputs as the state keeps them (B, H, L, e): y, or the tied variant's z."""
    pattern = state.pattern
    rows, positions = state.view()
    size = positions.shape[1]
    slots = None if pattern.is_dense else _sources(state, positions, r)
    valid = torch.cat([positions >= 0, r >= 0], dim=1) if pattern.is_dense else None  # (B, m)
    given = [t for t in (qa, ka, qb, kb, x, g) if t is not None] + list(rows.values())
    if OUTPUTS_TWIN.takes(x, slots=slots, size=size, given=given):
        return _sparse_on_cpu_kernels(rows, pattern, _read_rows(size, slots), scale, qa, ka, qb, kb, x, g, tied)
    direct = x if tied else _direct(size, qa, _with_held(rows, "keys_a", ka), _with_held(rows, "values", x), scale,
                                    slots, valid)
    if not pattern.has_recurrence:
        return direct
    return solve_after(qb, _with_held(rows, "keys_b", kb), g, direct, rows["outputs"].to(x.dtype), scale, GRAPH_CHUNK,
                       src=slots, key_valid=valid)


def extend_mix(state: DecodeState, qa, ka, qb, kb, x, g, pattern=None, scale=None, d=None, conv=None
               ) -> torch.Tensor:
    """L tokens per sequence against a layer's decode ``state``, in parallel, and advance it (the state takes the
    L tokens as L :func:`~.recurrent.recurrent_step` calls would).

    Args:
        state: the layer's :class:`DecodeState`, with :meth:`~.state.DecodeState.can_extend` true.
        qa, ka, qb, kb: (B, H, L, d) the tokens' queries and keys (qb, kb None for attention patterns; qa, ka None
            for the tied variant).
        x: (B, H, L, e) their values; g: (B, H, L) their gate (None for attention patterns).
        pattern: the state's own (it may be given, as to the other forms); scale: score scale, default d ** -0.5.
        d: (B, H, L) for the tied variant: z = (I - B)^-1 (1 - g) x over the held and new rows, y = z - d x; the
            state keeps z.
        conv: (B, L, C) the tokens' input rows of the layer's short convolution, which the state keeps.

    Returns:
        y (B, H, L, e) in x's dtype, computed in float32 (float64 for float64 inputs).
    """
    r = _positions(state, x)
    out_dtype = x.dtype
    check_tied(qa, ka, d)
    qa, ka, qb, kb, x, g, d = to_compute_dtype(qa, ka, qb, kb, x, g, d)
    scale = (qa if d is None else qb).shape[-1] ** -0.5 if scale is None else scale
    if d is not None:
        z = _outputs(state, r, scale, None, None, qb, kb, x, g, tied=True)
        state.extend({"keys_b": kb, "outputs": z}, r, conv)
        return (z - d[..., None] * x).to(out_dtype)
    y = _outputs(state, r, scale, qa, ka, qb, kb, x, g, tied=False)
    rows = {"keys_a": ka, "values": x}
    if state.pattern.has_recurrence:
        rows.update(keys_b=kb, outputs=y)
    state.extend(rows, r, conv)
    return y.to(out_dtype)
