"""Internals of the parallel form: slot arithmetic, chunk inverses, the custom solves and their memory.

The agreement of the public functions with the reference is tested in test_mixer.py; these tests pin
the pieces that make the parallel form fast, so a regression shows where it is.
"""

from __future__ import annotations

import pytest
import torch

from hf_resolvent.ops import attention as attention_mod
from hf_resolvent.ops import dense_solve as dense_mod
from hf_resolvent.ops import parallel_mix, reference_mix
from hf_resolvent.ops import slots as slots_mod
from hf_resolvent.ops import sparse_solve as sparse_mod
from hf_resolvent.ops.dense_solve import DenseSolve
from hf_resolvent.ops.slots import (
    SlotCombine,
    SlotDot,
    slot_combine,
    slot_dot,
    slot_layout,
    slot_pieces,
    slot_probs,
    slot_scatter,
)
from hf_resolvent.ops.sparse_solve import SparseSolve, solve_unit_lower_
from hf_resolvent.patterns import get_pattern

F64 = torch.float64


SPARSE = ["banded:3", "diagonal", "exp2", "exp2:ce", "square", "square:ce", "f:3*k+1:ce", "local_attention:4"]


def _dense_slot_matrix(layout):
    """(K, n, n) 0/1 matrices: entry [k, t, s] = 1 where slot k of row t reads s."""
    k, n = layout.src.shape
    m = torch.zeros(k, n, n, dtype=F64)
    src = torch.from_numpy(layout.src)
    rows = torch.arange(n)
    for j in range(k):
        ok = src[j] >= 0
        m[j, rows[ok], src[j][ok]] = 1
    return m


@pytest.mark.parametrize("spec", SPARSE)
@pytest.mark.parametrize("with_self", [False, True])
def test_slot_ops_match_dense_matrices(spec, with_self, monkeypatch, cpu_path):
    monkeypatch.setattr(slots_mod, "ROW_BLOCK", 16)  # several row blocks, runs cut at block edges
    n = 53
    layout = slot_layout(get_pattern(spec), n, with_self)
    m = _dense_slot_matrix(layout)
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 3, n, 5, generator=gen, dtype=F64) for _ in range(2))
    v, u = (torch.randn(2, 3, n, 4, generator=gen, dtype=F64) for _ in range(2))
    w = torch.randn(2, 3, layout.num_slots, n, generator=gen, dtype=F64) * layout.valid
    valid = layout.valid.to(F64)
    torch.testing.assert_close(slot_dot(q, k, layout) * valid, torch.einsum("kts,bhtd,bhsd->bhkt", m, q, k))
    torch.testing.assert_close(slot_combine(w, v, layout), torch.einsum("kts,bhkt,bhse->bhte", m, w, v))
    torch.testing.assert_close(slot_scatter(w, u, layout), torch.einsum("kts,bhkt,bhte->bhse", m, w, u))
    # slot_probs: the softmax of each row's scaled scores over its valid slots, with gradients
    scores = 0.7 * torch.einsum("bhtd,bhsd->bhts", q, k).masked_fill(m.sum(0) == 0, float("-inf"))
    dense_probs = torch.softmax(scores, -1).nan_to_num()  # rows without slots: all 0
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    probs = slot_probs(qg, kg, layout, 0.7)
    torch.testing.assert_close(torch.einsum("kts,bhkt->bhts", m, probs), dense_probs)
    grad = torch.randn(probs.shape, generator=gen, dtype=F64)
    expected = torch.autograd.grad(torch.einsum("kts,bhts->bhkt", m, torch.softmax(
        0.7 * torch.einsum("bhtd,bhsd->bhts", qg, kg).masked_fill(m.sum(0) == 0, float("-inf")), -1).nan_to_num()),
        (qg, kg), grad * valid)
    for got, want in zip(torch.autograd.grad(probs, (qg, kg), grad), expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("f,a", [(1, 1), (5, 3), (10, 6), (4, 4), (26, 12)])
def test_slot_pieces_cover_rows_once_with_their_sources(f, a):
    n, r0, r1 = 97, 13, 80
    seen = {}
    for p in slot_pieces(f, a, 0, r0, r1):
        for m in range(p.runs):
            for t in range(p.t0 + m * p.length, p.t0 + (m + 1) * p.length):
                assert t not in seen
                seen[t] = p.s0 + m * p.stride
    expected = {t: a * ((t - f) // a + 1) - 1 for t in range(max(r0, f), r1)}
    assert seen == expected
    assert all(s < t for t, s in seen.items()) and n > r1


@pytest.mark.parametrize("transpose", [False, True])
def test_solve_unit_lower_in_place(transpose):
    m = torch.eye(9, dtype=F64) - torch.randn(2, 3, 9, 9, dtype=F64).tril(-1) * 0.3
    rhs = torch.randn(2, 3, 9, 4, dtype=F64)
    rows = rhs.clone()
    got = solve_unit_lower_(m, rows, transpose)
    assert got is rows  # solved in place
    torch.testing.assert_close((m.mT if transpose else m) @ got, rhs)


def _force_band(monkeypatch, blocks):
    """Make SparseSolve use a near-slot band of ``blocks`` chunks instead of the cheapest one."""
    monkeypatch.setattr(sparse_mod, "sparse_plan", lambda layout, chunk: sparse_mod._SparsePlan(layout, chunk, chunk * blocks))


@pytest.mark.parametrize("spec", ["exp2", "exp2:ce", "square", "square:ce", "f:3*k+1:ce", "banded:5"])
@pytest.mark.parametrize("chunk", [4, 8, 12])
@pytest.mark.parametrize("band", [1, 3, 8])
def test_sparse_solve_matches_dense_solve(spec, chunk, band, monkeypatch, torch_path):
    """Covers every kind of entry of the chunked solve: in-chunk, near-slot band (one chunk wide, several,
    wider than the rows before the first chunks), whole-span slots (f - a + 1 >= C) and per-chunk pieces
    (f >= C > f - a + 1)."""
    _force_band(monkeypatch, band)
    n = 75
    layout = slot_layout(get_pattern(spec), n)
    gen = torch.Generator().manual_seed(7)
    w = torch.rand(2, 2, layout.num_slots, n, generator=gen, dtype=F64) / layout.num_slots * layout.valid
    z = torch.randn(2, 2, n, 3, generator=gen, dtype=F64)
    b = torch.einsum("kts,bhkt->bhts", _dense_slot_matrix(layout), w)
    expected = torch.linalg.solve_triangular(torch.eye(n, dtype=F64) - b, z, upper=False)
    torch.testing.assert_close(SparseSolve.apply(w, z, layout, chunk), expected)


@pytest.mark.parametrize("spec,chunk,band", [("exp2:ce", 4, 1), ("square", 5, 1), ("banded:2", 8, 1), ("square:ce", 8, 1),
                                             ("square:ce", 4, 3)])
def test_sparse_solve_gradcheck(spec, chunk, band, one_thread, monkeypatch, torch_path):
    _force_band(monkeypatch, band)
    n = 29
    layout = slot_layout(get_pattern(spec), n)
    gen = torch.Generator().manual_seed(2)
    w = (torch.rand(1, 2, layout.num_slots, n, generator=gen, dtype=F64) / layout.num_slots).requires_grad_()
    z = torch.randn(1, 2, n, 3, generator=gen, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w_, z_: SparseSolve.apply(w_, z_, layout, chunk), (w, z))
    q, k = (torch.randn(1, 2, n, 3, generator=gen, dtype=F64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda a, b: SlotDot.apply(a, b, layout), (q, k))
    assert torch.autograd.gradcheck(lambda a, b: SlotCombine.apply(a, b, layout), (w, z))


@pytest.mark.parametrize("spec,n,blocks", [("square:ce", 512, 4), ("square:ce", 2048, 4), ("square", 2048, 1),
                                             ("exp2:ce", 2048, 1), ("exp2", 8192, 1), ("banded:8", 512, 1)])
def test_sparse_plan_picks_a_wide_band_only_where_it_saves_pieces(spec, n, blocks):
    """The cost rule (pieces + BAND_BLOCK_COST per band block) gives the bands measured fastest on CPU."""
    layout = slot_layout(get_pattern(spec), n)
    plan = sparse_mod.sparse_plan(layout, 32)
    assert plan.band == 32 * blocks
    narrow = sparse_mod._SparsePlan(layout, 32, 32)
    assert (plan.num_pieces < narrow.num_pieces / 2) == (blocks > 1)


@pytest.mark.parametrize("d,e,chunk", [(4, 4, 4), (3, 5, 3), (6, 2, 8)])
def test_dense_solve_gradcheck(d, e, chunk, one_thread):
    n = 13
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 1, n, d, generator=gen, dtype=F64, requires_grad=True) for _ in range(2))
    g = torch.rand(2, 1, n, generator=gen, dtype=F64).requires_grad_()
    z = torch.randn(2, 1, n, e, generator=gen, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: DenseSolve.apply(*a, d**-0.5, chunk), (q, k, g, z))


def test_dense_solve_matches_direct_solve():
    n, chunk = 70, 8  # several recursion levels, a partial last chunk
    gen = torch.Generator().manual_seed(4)
    q, k, z = (torch.randn(1, 2, n, 4, generator=gen, dtype=F64) for _ in range(3))
    g = torch.rand(1, 2, n, generator=gen, dtype=F64)
    s = (q @ k.mT * 0.5).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(-1), float("-inf"))
    b = g[..., None] * torch.nan_to_num(torch.softmax(s, -1))
    expected = torch.linalg.solve_triangular(torch.eye(n, dtype=F64) - b, z, upper=False)
    torch.testing.assert_close(DenseSolve.apply(q, k, g, z, 0.5, chunk), expected)


@pytest.mark.parametrize("n, leaf", [(400, 128), (70, 8)])  # the default split; many levels, partial leaves
def test_split_causal_attention_matches_sdpa(n, leaf, monkeypatch, torch_path):
    monkeypatch.setattr(attention_mod, "LEAF", leaf)
    monkeypatch.setattr(attention_mod, "SPLIT_MIN_ROWS", 1)
    calls, real = [], attention_mod.attend_block
    monkeypatch.setattr(attention_mod, "attend_block", lambda *a: calls.append(a[-1]) or real(*a))
    gen = torch.Generator().manual_seed(7)
    q, k = (torch.randn(2, 3, n, 8, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, n, 8, generator=gen, requires_grad=True)
    dy = torch.randn(2, 3, n, 8, generator=gen)
    out = attention_mod.causal_attention(q, k, v, 0.3)
    grads = torch.autograd.grad(out, (q, k, v), dy)
    assert calls.count(True) == -(-n // leaf) and calls.count(False) >= 1  # really split
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, torch.autograd.grad(expected, (q, k, v), dy)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_split_causal_attention_gradcheck(one_thread, monkeypatch, torch_path):
    monkeypatch.setattr(attention_mod, "LEAF", 4)
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 13, 3, generator=gen, dtype=F64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda *a: attention_mod._SplitCausalAttention.apply(*a, 0.5), (q, k, v))


def _saved_elements(pattern, n):
    gen = torch.Generator().manual_seed(5)
    ins = [torch.randn(1, 2, n, 8, generator=gen, requires_grad=True) for _ in range(5)]
    g = torch.rand(1, 2, n, generator=gen).requires_grad_()
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        parallel_mix(*ins, g, pattern, chunk=16)
    return sum(sizes), max(sizes)


@pytest.mark.parametrize("pattern", ["dense", "exp2", "square:ce"])
def test_autograd_memory_is_linear_in_n(pattern, cpu_path):
    """Everything autograd keeps is O(n (d + K + C)): no n x n score matrix, no (n, K, d) gather."""
    n, heads, d, chunk = 512, 2, 8, 16
    slots = 1 if pattern == "dense" else slot_layout(get_pattern(pattern), n, True).num_slots
    row = heads * n * max(d, slots, chunk)  # the size of one (B, H, n, width) tensor
    total, largest = _saved_elements(pattern, n)
    assert largest <= row
    assert total <= 16 * row
    assert heads * n * n > 16 * row  # an n x n tensor per head would not fit the bound


def test_parallel_bfloat16_and_padding_quick():
    n = 40
    gen = torch.Generator().manual_seed(6)
    ins = [torch.randn(2, 2, n, 8, generator=gen) for _ in range(5)] + [torch.rand(2, 2, n, generator=gen)]
    start = torch.tensor([3, 0])
    for spec in ["dense", "exp2:ce"]:
        ref = reference_mix(*ins, spec, start=start)
        out = parallel_mix(*[t.to(torch.bfloat16) for t in ins], spec, start=start)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
        assert torch.all(out[0, :, :3] == 0)


def test_bad_chunk_is_a_clear_error():
    x = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="chunk"):
        parallel_mix(x, x, x, x, x, torch.rand(1, 1, 8), "exp2", chunk=0)


def test_parallel_with_two_threads(cpu_path):
    """The suite runs on one thread (conftest); this covers the threaded paths (serial sections inside
    a two-thread run, flash nodes with intra-op threads) and checks the thread count is restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(8)
        n = 70
        for spec in ["dense", "exp2:ce", "square"]:
            ins = [torch.randn(2, 3, n, 8, generator=gen, dtype=F64, requires_grad=True) for _ in range(5)]
            g = torch.rand(2, 3, n, generator=gen, dtype=F64).requires_grad_()
            out = parallel_mix(*ins, g, spec, chunk=16)
            ref = reference_mix(*ins, g, spec)
            torch.testing.assert_close(out, ref)
            w = torch.randn_like(out)
            got = torch.autograd.grad((out * w).sum(), [*ins, g])
            want = torch.autograd.grad((ref * w).sum(), [*ins, g])
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("groups", [2, 4, 7])
def test_dense_solve_split_by_head_groups(groups, monkeypatch):
    """On CPU the dense tree's backward runs on (batch x head) groups in worker threads, one per intra-op thread
    (forced here at any length): any split (uneven, more groups than rows) gives the reference's gradients."""
    monkeypatch.setattr(dense_mod, "head_groups", lambda t: groups)
    monkeypatch.setattr(dense_mod, "GROUPED_MIN_ROWS", 1)
    gen = torch.Generator().manual_seed(9)
    n = 45
    ins = [torch.randn(2, 3, n, 8, generator=gen, dtype=F64, requires_grad=True) for _ in range(5)]
    g = torch.rand(2, 3, n, generator=gen, dtype=F64).requires_grad_()
    out = parallel_mix(*ins, g, "dense", chunk=8)
    ref = reference_mix(*ins, g, "dense")
    torch.testing.assert_close(out, ref)
    w = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * w).sum(), [*ins, g]), torch.autograd.grad((ref * w).sum(), [*ins, g])):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        torch.testing.assert_close(parallel_mix(*ins, g, "dense", chunk=8), ref)


def test_head_groups_wait_for_every_worker_before_raising():
    """A failing group raises in the caller, but only once the other groups have finished writing."""
    import threading

    from hf_resolvent.ops.threads import by_head_groups

    slow_done = threading.Event()

    def fn(t):
        if t[0, 0, 0, 0] == 0:  # the first group fails at once
            raise ValueError("group failed")
        threading.Event().wait(0.2)
        t.fill_(7.0)
        slow_done.set()
        return (t,)

    x = torch.arange(4.0).view(1, 4, 1, 1).repeat(1, 1, 2, 2)
    with pytest.raises(ValueError, match="group failed"):
        by_head_groups(fn, (x,), 2)
    assert slow_done.is_set() and torch.all(x[0, 2:] == 7.0)
