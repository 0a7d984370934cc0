"""The chunk-parallel solve of the GPU design (kernels/chunked_solve.py) in float64: its forward and its reverse
chunk pass give the reference mixer's output and every input gradient, for every pattern kind, the tied variant and
left padding, at lengths that end inside a chunk; its held-row tables are exactly the earlier rows the pattern's
source table reads, and as small as the design counts on."""

from __future__ import annotations

import pytest
import torch
from hf_resolvent.backends.triton.chunked_solve import chunked_mix, held_rows

from hf_resolvent.ops.reference import reference_mix
from hf_resolvent.patterns import get_pattern

F64 = torch.float64
PATTERNS = ["attention", "local_attention:4", "dense", "banded:3", "diagonal", "exp2", "exp2:ce", "square",
            "square:ce", "f:k**3+1:ce"]


def _inputs(batch=2, heads=2, n=37, d=4, e=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = [torch.randn(batch, heads, n, d, generator=gen, dtype=F64).requires_grad_() for _ in range(4)]
    x = torch.randn(batch, heads, n, e, generator=gen, dtype=F64).requires_grad_()
    g = (0.1 + 0.8 * torch.rand(batch, heads, n, generator=gen, dtype=F64)).requires_grad_()
    return q, x, g, torch.randn(batch, heads, n, e, generator=gen, dtype=F64)


def _outputs_and_grads(run, leaves, weight):
    y = run()
    grads = torch.autograd.grad((y * weight).sum(), leaves, allow_unused=True)
    return y.detach(), grads


@pytest.mark.parametrize("chunk", [5, 16])
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "left-padded"])
@pytest.mark.parametrize("spec", PATTERNS)
def test_chunked_solve_equals_the_reference_with_every_gradient(spec, padded, chunk):
    (qa, ka, qb, kb), x, g, weight = _inputs()
    start = torch.tensor([0, 9]) if padded else None
    leaves = (qa, ka, qb, kb, x, g)
    got = _outputs_and_grads(lambda: chunked_mix(qa, ka, qb, kb, x, g, spec, chunk, start), leaves, weight)
    want = _outputs_and_grads(lambda: reference_mix(qa, ka, qb, kb, x, g, spec, start), leaves, weight)
    torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=1e-12)
    for name, a, b in zip(("qa", "ka", "qb", "kb", "x", "g"), got[1], want[1]):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11, msg=name)


@pytest.mark.parametrize("spec", ["dense", "banded:3", "exp2:ce", "square:ce"])
def test_chunked_solve_of_the_tied_variant_equals_the_reference(spec):
    (_, _, qb, kb), x, g, weight = _inputs(seed=1)
    gen = torch.Generator().manual_seed(2)
    d = (0.5 * torch.rand(g.shape, generator=gen, dtype=F64) * (1 - g.detach())).requires_grad_()
    start = torch.tensor([3, 0])
    leaves = (qb, kb, x, g, d)
    got = _outputs_and_grads(lambda: chunked_mix(None, None, qb, kb, x, g, spec, 8, start, d=d), leaves, weight)
    want = _outputs_and_grads(lambda: reference_mix(None, None, qb, kb, x, g, spec, start, d=d), leaves, weight)
    torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=1e-12)
    for name, a, b in zip(("qb", "kb", "x", "g", "d"), got[1], want[1]):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11, msg=name)


@pytest.mark.parametrize("spec", ["dense", "banded:3", "diagonal", "exp2", "exp2:ce", "square:ce", "f:k**3+1:ce"])
@pytest.mark.parametrize("n, chunk", [(37, 5), (100, 16), (129, 32)])
def test_held_rows_are_exactly_the_earlier_rows_a_chunk_reads(spec, n, chunk):
    """H_c against the pattern's masks: every row of the chunk reads inside the chunk or in H_c, and every held row
    is read by some row of the chunk."""
    _, mask_b = get_pattern(spec).masks(n)
    for c, held in enumerate(held_rows(spec, n, chunk)):
        c0 = c * chunk
        read = mask_b[c0:c0 + chunk, :c0].any(0).nonzero().flatten()
        assert torch.equal(held, read), (c, held.tolist(), read.tolist())


def test_attention_kinds_hold_nothing():
    assert all(h.numel() == 0 for h in held_rows("local_attention:8", 50, 16))


@pytest.mark.parametrize("n, most", [(4096, 12), (8192, 13), (32768, 15)])
def test_a_cache_efficient_chunk_holds_a_few_earlier_rows(n, most):
    """exp2:ce, whatever the chunk size from 32 to 128: at most 12, 13 and 15 held rows at 4k, 8k and 32k; at
    C = 64 at most 7 of them in the chunk just before, and at most 8 farther back."""
    for chunk in (32, 64, 128):
        assert max(h.numel() for h in held_rows("exp2:ce", n, chunk)) == most
    held = held_rows("exp2:ce", n, 64)
    assert max(int((h >= 64 * (c - 1)).sum()) for c, h in enumerate(held)) <= 7
    assert max(int((h < 64 * (c - 1)).sum()) for c, h in enumerate(held)) <= 8


def test_a_chunk_size_below_one_is_refused():
    with pytest.raises(ValueError, match="chunk must be a positive number of rows, got 0"):
        held_rows("exp2:ce", 10, 0)
