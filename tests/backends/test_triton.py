"""Triton kernels against the PyTorch forms, on CPU through Triton's interpreter.

The whole module runs with ``TRITON_INTERPRET=1`` set by an autouse fixture and removed afterwards:
``hf_resolvent.backends.triton`` loads its ``@triton.jit`` functions once per Triton mode (see
kernels/_loader.py), so the setting does not leak into other test modules (there, ``impl="triton"``
on CPU still raises its error). Shapes are tiny (the interpreter is slow) and the tile sizes are set to
16 so that every length spans several blocks and ends in a partial one. Every kernel output is
allocated filled with NaN (``set_nan_fill``), so an unwritten element fails the comparison.

Oracles: ``ops.reference_mix`` (with ``d`` for the tied variant) in float64 on the same (rounded) inputs, and
``ops.recurrent_step`` for the decode kernel.

Tolerances: float32 inputs 1e-4 (absolute and relative; the kernels accumulate in float32 and agree
to ~1e-6 in practice). bfloat16 inputs: max error / max magnitude <= 3e-2 (outputs and gradients are
rounded to bfloat16, probabilities are rounded to bfloat16 before the products with values).
"""

from __future__ import annotations

import pytest
import torch
from conftest import family_model

import hf_resolvent as hr
from hf_resolvent.backends import triton as kernels
from hf_resolvent.ops import (
    DecodeState,
    decode_step,
    recurrent_step,
    reference_mix,
    resolvent_mix,
)

BLOCK = 16
PATTERNS = [
    "attention",
    "local_attention:3",
    "dense",
    "banded:2",
    "diagonal",
    "exp2",
    "exp2:ce",
    "square",
    "square:ce",
    "f:k**2+2",  # f(0) = 2: rows 0 and 1 have no recurrent set
]
RECURRENT = [p for p in PATTERNS if not p.startswith(("attention", "local_attention"))]


@pytest.fixture(autouse=True, scope="module")
def interpreter():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        old = kernels.set_nan_fill(True)
        with kernels.block_config(attn_m=BLOCK, attn_n=BLOCK, bwd_m=BLOCK, bwd_n=BLOCK, solve=BLOCK, sparse_m=BLOCK,
                                  sparse_grads_m=BLOCK, decode=BLOCK, atomic_m=BLOCK, atomic_n=BLOCK, chunk=BLOCK):
            yield
        kernels.set_nan_fill(old)


def _inputs(batch, heads, n, d, e, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    qa, ka, qb, kb = (torch.randn(batch, heads, n, d, generator=gen) for _ in range(4))
    x = torch.randn(batch, heads, n, e, generator=gen)
    g = torch.rand(batch, heads, n, generator=gen) * 0.9 + 0.05
    tied_d = torch.rand(batch, heads, n, generator=gen)
    return [t.to(dtype) for t in (qa, ka, qb, kb, x, g, tied_d)]


def _uses_b(pattern: str) -> bool:
    return not pattern.startswith(("attention", "local_attention"))


def _run(fn, inputs, cotangent):
    """Output and gradients of sum(fn(*inputs) * cotangent) for the inputs that are not None."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    used = [t for t in leaves if t is not None]
    grads = torch.autograd.grad((y.double() * cotangent).sum(), used, allow_unused=True)
    return y, grads


def _close(actual, expected, rel):
    """max |actual - expected| <= rel * max(|expected|, 1)."""
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all(), "kernel output has NaN/inf (unwritten memory?)"
    err = (actual - expected).abs().max().item()
    scale = max(expected.abs().max().item(), 1.0)
    assert err <= rel * scale, f"max error {err:.3g} > {rel} * {scale:.3g}"


def _check_mix(pattern, batch, heads, n, d, e, dtype, rel, start=None, seed=0):
    qa, ka, qb, kb, x, g, _ = _inputs(batch, heads, n, d, e, seed, dtype)
    if not _uses_b(pattern):
        qb = kb = g = None
    inputs = [qa, ka, qb, kb, x, g]
    cot = torch.randn(batch, heads, n, e, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    y, grads = _run(lambda *t: kernels.triton_mix(*t, pattern, start=start), inputs, cot)
    assert y.dtype == dtype and y.shape == (batch, heads, n, e)
    as64 = [None if t is None else t.double() for t in inputs]
    y_ref, grads_ref = _run(lambda *t: reference_mix(*t, pattern, start=start), as64, cot)
    _close(y, y_ref, rel)
    names = [nm for nm, t in zip(("qa", "ka", "qb", "kb", "x", "g"), inputs) if t is not None]
    for name, got, want in zip(names, grads, grads_ref):
        assert got is not None and got.dtype == dtype, name
        try:
            _close(got, want, rel)
        except AssertionError as err:
            raise AssertionError(f"gradient of {name}: {err}") from None


@pytest.mark.parametrize("pattern", PATTERNS)
def test_float32_forward_and_gradients(pattern):
    # n = 37: three blocks of 16, the last one partial; e != d exercises the column masks.
    _check_mix(pattern, batch=2, heads=2, n=37, d=16, e=24, dtype=torch.float32, rel=1e-4)


@pytest.mark.parametrize("pattern", ["attention", "local_attention:3", "dense", "exp2:ce", "banded:3", "square"])
def test_bfloat16_forward_and_gradients(pattern):
    _check_mix(pattern, batch=2, heads=2, n=29, d=16, e=16, dtype=torch.bfloat16, rel=3e-2)


@pytest.mark.parametrize("pattern", ["attention", "local_attention:4", "dense", "banded:2", "exp2:ce", "square"])
def test_left_padding(pattern):
    start = torch.tensor([0, 7, 18])  # 18 > one block: a whole block of padding
    _check_mix(pattern, batch=3, heads=1, n=33, d=16, e=16, dtype=torch.float32, rel=1e-4, start=start)


@pytest.mark.parametrize("n", [1, 5, 16])
def test_short_sequences(n):
    for pattern in ("dense", "exp2:ce"):
        _check_mix(pattern, batch=1, heads=2, n=n, d=16, e=16, dtype=torch.float32, rel=1e-4)


@pytest.mark.parametrize("pattern", ["dense", "exp2:ce"])
def test_every_block_of_a_solve_is_claimed_once_and_published(pattern, monkeypatch):
    # The dense solves and the sparse backward solve run one program per (row block, head) in ticket order and
    # publish each block in solve order (kernels/jit/common.py, _claim_block). After a forward and backward, each
    # schedule must count every block of every head as published and every ticket as taken; a block that never
    # published would leave a GPU program of the next block waiting.
    from hf_resolvent.backends.triton import launching

    schedules = []
    real = launching.progress_buffer
    monkeypatch.setattr(launching, "progress_buffer", lambda BH, device: schedules.append(real(BH, device)) or schedules[-1])
    batch, heads, n = 2, 3, 37  # three blocks of 16, the last one partial
    with kernels.block_config(sparse_solver="blocked"):  # the sparse patterns' ticket-ordered solves
        _check_mix(pattern, batch=batch, heads=heads, n=n, d=16, e=16, dtype=torch.float32, rel=1e-4)
    nblk, BH = -(-n // BLOCK), batch * heads
    assert len(schedules) == (2 if pattern == "dense" else 1)  # the sparse forward solve runs one program per head
    for progress in schedules:
        assert progress.tolist() == [nblk] * BH + [nblk * BH]


def test_pattern_with_no_slot_in_range():
    # f(0) = 2 >= n: no row has a recurrent set, the slot table is empty (K = 0).
    _check_mix("f:k**2+2", batch=1, heads=1, n=2, d=16, e=16, dtype=torch.float32, rel=1e-4)


@pytest.mark.parametrize(("pattern", "dtype", "rel", "padded"), [
    ("dense", torch.float32, 1e-4, False),
    ("square:ce", torch.float32, 1e-4, True),
    ("diagonal", torch.float32, 1e-4, False),
    ("exp2", torch.bfloat16, 3e-2, False),
])
def test_tied_variant(pattern, dtype, rel, padded):
    _check_tied(pattern, dtype, rel, padded)


def _check_tied(pattern, dtype, rel, padded):
    batch, heads, n = 2, 2, 35
    qa, ka, qb, kb, x, g, tied_d = _inputs(batch, heads, n, 16, 16, 3, dtype)
    start = torch.tensor([0, 9]) if padded else None
    inputs = [qb, kb, x, g, tied_d]
    cot = torch.randn(batch, heads, n, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    y, grads = _run(lambda qb, kb, x, g, d: kernels.triton_mix(None, None, qb, kb, x, g, pattern, start=start, d=d),
                    inputs, cot)
    y_ref, grads_ref = _run(lambda qb, kb, x, g, d: reference_mix(None, None, qb, kb, x, g, pattern, start=start, d=d),
                            [t.double() for t in inputs], cot)
    _close(y, y_ref, rel)
    for name, got, want in zip(("qb", "kb", "x", "g", "d"), grads, grads_ref):
        try:
            _close(got, want, rel)
        except AssertionError as err:
            raise AssertionError(f"gradient of {name}: {err}") from None


# --------------------------------------------------------------------------------------------------
# The kernels the defaults replaced (the split attention backward, the blocked dense solves without the 16-bit
# copy, the blocked sparse solves): still selectable, so still checked on the cases above that reach them.

REPLACED = dict(attn_bwd="split", dense_solver="blocked", solved_copy=False, sparse_solver="blocked")


@pytest.mark.parametrize(("pattern", "dtype", "padded"), [
    ("attention", torch.float32, True),
    ("dense", torch.float32, True),
    ("attention", torch.bfloat16, False),
    ("dense", torch.bfloat16, False),
    ("exp2:ce", torch.float32, True),
    ("square", torch.bfloat16, False),
    ("banded:2", torch.float32, True),
])
def test_replaced_kernels(pattern, dtype, padded):
    rel = 1e-4 if dtype == torch.float32 else 3e-2
    start = torch.tensor([0, 7, 18]) if padded else None
    with kernels.block_config(**REPLACED):
        _check_mix(pattern, batch=3, heads=1, n=37, d=16, e=24, dtype=dtype, rel=rel, start=start)


@pytest.mark.parametrize(("dtype", "rel", "padded"), [(torch.float32, 1e-4, True), (torch.bfloat16, 3e-2, False)])
def test_replaced_kernels_tied(dtype, rel, padded):
    with kernels.block_config(**REPLACED):
        _check_tied("dense", dtype, rel, padded)


# --------------------------------------------------------------------------------------------------
# The attention-style backward in one kernel, dQ added atomically (BlockConfig.attn_bwd = "atomic", the default)
#
# Only the dense kinds run it (attention, and the dense pattern's channels A and B); local attention and the
# sparse patterns go through sparse_grads whatever attn_bwd says.


@pytest.mark.parametrize(("pattern", "dtype", "n", "tiles"), [
    ("attention", torch.float32, 37, (BLOCK, BLOCK)),
    ("dense", torch.float32, 37, (BLOCK, BLOCK)),
    ("dense", torch.float32, 37, (BLOCK, 2 * BLOCK)),  # a key block read from the middle of a query block
    ("dense", torch.float32, 37, (2 * BLOCK, BLOCK)),  # query blocks that start before the key block
    ("dense", torch.float32, 5, (BLOCK, BLOCK)),
    ("attention", torch.bfloat16, 29, (BLOCK, BLOCK)),
    ("dense", torch.bfloat16, 29, (BLOCK, BLOCK)),
])
def test_atomic_attention_backward(pattern, dtype, n, tiles):
    rel, e = (1e-4, 24) if dtype == torch.float32 else (3e-2, 16)
    with kernels.block_config(attn_bwd="atomic", atomic_m=tiles[0], atomic_n=tiles[1]):
        _check_mix(pattern, batch=2, heads=2, n=n, d=16, e=e, dtype=dtype, rel=rel)


@pytest.mark.parametrize("pattern", ["attention", "dense"])
@pytest.mark.parametrize("keys_per_program", [BLOCK, 2 * BLOCK])
def test_atomic_attention_backward_left_padding(pattern, keys_per_program):
    # start 18: with 16 keys per program the first key block is all padding, with 32 it is partly padding.
    start = torch.tensor([0, 7, 18])
    with kernels.block_config(attn_bwd="atomic", atomic_n=keys_per_program):
        _check_mix(pattern, batch=3, heads=1, n=33, d=16, e=16, dtype=torch.float32, rel=1e-4, start=start)


@pytest.mark.parametrize(("dtype", "rel", "padded"), [(torch.float32, 1e-4, True), (torch.bfloat16, 3e-2, False)])
def test_atomic_attention_backward_tied(dtype, rel, padded):
    with kernels.block_config(attn_bwd="atomic"):
        _check_tied("dense", dtype, rel, padded)


def test_atomic_attention_backward_launches_one_kernel_per_channel():
    """attn_bwd="atomic" replaces the split pair by attn_bwd_atomic_kernel (recorded launches, nothing runs)."""
    from hf_resolvent.backends.triton import aot

    def bwd(pattern, **kw):
        return [launch for launch in aot.record_launches(pattern, dtype=torch.float32, n=40, d=16, e=16, **kw)
                if launch.name.startswith("attn_bwd")]

    with kernels.block_config(attn_bwd="split"):
        split = {pattern: bwd(pattern) for pattern in ("attention", "dense")}
    assert [launch.name for launch in split["dense"]] == ["attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"] * 2
    with kernels.block_config(attn_bwd="atomic"):
        attention, dense, tied = bwd("attention"), bwd("dense"), bwd("dense", tied=True)
        assert not bwd("local_attention:3")
    assert [launch.name for launch in attention + dense + tied] == ["attn_bwd_atomic_kernel"] * 4
    # Channel A (keys j <= i, dV) and channel B (keys j < i, no dV); the tied variant has channel B only.
    assert [(launch.constexprs["STRICT"], launch.constexprs["HAS_DV"]) for launch in dense] == [(False, True),
                                                                                                   (True, False)]
    assert [(launch.constexprs["STRICT"], launch.constexprs["HAS_DV"]) for launch in tied] == [(True, False)]
    assert dense[0].grid == (-(-40 // BLOCK), 1)


def test_atomic_attention_backward_tiles():
    """BlockConfig.atomic_m / atomic_n hold for 16-bit inputs at head width <= 64 (64 x 128 by default, 128 x 128 when
    asked for); float32 inputs and head width 128 divide both by their row's size over 128 bytes."""
    import dataclasses

    from hf_resolvent.backends.triton import aot, launching

    def tiles(dtype, width):
        launches = aot.record_launches("dense", dtype=dtype, n=256, d=width, e=width)
        return {(launch.constexprs["BM"], launch.constexprs["BN"], launch.options["num_warps"])
                for launch in launches if launch.name == "attn_bwd_atomic_kernel"}

    with kernels.block_config(**dict(dataclasses.asdict(launching.BlockConfig()), attn_bwd="atomic")):
        assert tiles(torch.bfloat16, 64) == tiles(torch.float16, 32) == {(64, 128, 8)}
        assert tiles(torch.bfloat16, 128) == tiles(torch.float32, 64) == {(32, 64, 8)}
        assert tiles(torch.float32, 128) == {(16, 32, 8)}
        with kernels.block_config(atomic_m=128, atomic_warps=4):
            assert tiles(torch.bfloat16, 64) == {(128, 128, 4)}


def test_resolvent_mix_dispatches_to_triton(monkeypatch):
    qa, ka, qb, kb, x, g, _ = _inputs(1, 2, 21, 16, 16, 5)
    calls = []
    real = kernels.triton_mix
    monkeypatch.setattr(kernels, "triton_mix", lambda *a, **k: calls.append(1) or real(*a, **k))
    y = resolvent_mix(qa, ka, qb, kb, x, g, "exp2", impl="triton")
    assert calls, "impl='triton' did not reach hf_resolvent.backends.triton.triton_mix"
    torch.testing.assert_close(y, resolvent_mix(qa, ka, qb, kb, x, g, "exp2", impl="torch"), rtol=1e-4, atol=1e-4)


def test_clear_error_when_triton_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    qa, ka, qb, kb, x, g, _ = _inputs(1, 1, 8, 16, 16, 6)
    if torch.cuda.is_available():  # pragma: no cover - GPU machines: CPU tensors are the error case
        assert kernels.triton_ready()
    else:
        assert not kernels.triton_ready()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1") as info:
        resolvent_mix(qa, ka, qb, kb, x, g, "dense", impl="triton")
    assert "CUDA" in str(info.value)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        decode_step(_empty("dense", qa, x), qa[:, :, 0], ka[:, :, 0], qb[:, :, 0], kb[:, :, 0], x[:, :, 0], g[:, :, 0],
                    impl="triton")


def test_unsupported_dtype_is_refused():
    qa, ka, qb, kb, x, g, _ = _inputs(1, 1, 8, 16, 16, 7, torch.float64)
    with pytest.raises(ValueError, match="float64"):
        kernels.triton_mix(qa, ka, qb, kb, x, g, "dense")


def test_nan_fill_catches_unwritten_outputs():
    # The NaN switch itself: fresh buffers are NaN, so a kernel that skipped rows would fail above.
    from hf_resolvent.backends.triton.launching import new_buffer

    assert torch.isnan(new_buffer((3, 4), torch.device("cpu"))).all()


# --------------------------------------------------------------------------------------------------
# Decode step


def _empty(pattern, q, x, start=None, tied=False, capacity=None, dtype=None) -> DecodeState:
    """A state before the first token for queries like q (B, H, n, d) and values like x (B, H, n, e)."""
    names = ("keys_b", "outputs") if tied else ("keys_a", "values") + (("keys_b", "outputs") if _uses_b(pattern) else ())
    widths = {name: (x if name in ("values", "outputs") else q).shape[-1] for name in names}
    return DecodeState.empty(pattern, widths, x.shape[0], x.shape[1], capacity, dtype or x.dtype, start=start)


def _state_tensors(state: DecodeState):
    out = {k: v for k, v in state.tensors().items()}
    out["positions"] = state.positions
    return out


@pytest.mark.parametrize(("pattern", "padded"), [
    ("attention", True),
    ("local_attention:3", False),
    ("dense", True),
    ("banded:2", False),
    ("exp2", True),
    ("exp2:ce", True),
    ("square:ce", False),
])
@pytest.mark.parametrize("capacity", [None, 16], ids=["growing", "fixed"])
def test_decode_step_matches_recurrent_step(pattern, padded, capacity):
    """Token by token, on buffers that grow and on a static cache's fixed buffers: the kernel's output, and the
    state it leaves, are the PyTorch step's."""
    batch, heads, n = 2, 2, 13
    qa, ka, qb, kb, x, g, _ = _inputs(batch, heads, n, 16, 24, 8)
    start = torch.tensor([0, 4]) if padded else None
    ref_state, tri_state = (_empty(pattern, qa, x, start, capacity=capacity) for _ in range(2))
    for t in range(n):
        args = [None if a is None else a[:, :, t] for a in (qa, ka, qb, kb, x, g)]
        if not _uses_b(pattern):
            args[2] = args[3] = args[5] = None
        want = recurrent_step(ref_state, *args, pattern)
        got = kernels.triton_decode_step(tri_state, *args, pattern)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, t=t: f"step {t}: {m}")
    ref_t, tri_t = _state_tensors(ref_state), _state_tensors(tri_state)
    assert ref_t.keys() == tri_t.keys()
    for name in ref_t:
        torch.testing.assert_close(tri_t[name], ref_t[name], rtol=1e-5, atol=1e-5, msg=lambda m, k=name: f"{k}: {m}")
    assert tri_state.count() == ref_state.count() == n


def test_decode_step_tied_and_bfloat16():
    batch, heads, n = 2, 1, 11
    qa, ka, qb, kb, x, g, tied_d = _inputs(batch, heads, n, 16, 16, 9)
    ref_state, tri_state = (_empty("exp2:ce", qb, x, tied=True) for _ in range(2))
    for t in range(n):
        args = [None, None, *(a[:, :, t] for a in (qb, kb, x, g))]
        want = recurrent_step(ref_state, *args, "exp2:ce", d=tied_d[:, :, t])
        got = kernels.triton_decode_step(tri_state, *args, "exp2:ce", d=tied_d[:, :, t])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # bfloat16 inputs, float32 accumulation: compare with the float32 recurrent form on the same values.
    ref_state, tri_state = _empty("dense", qa, x), _empty("dense", qa, x, dtype=torch.bfloat16)
    low = [a.bfloat16() for a in (qa, ka, qb, kb, x, g)]
    for t in range(n):
        args = [a[:, :, t] for a in low]
        want = recurrent_step(ref_state, *[a.float() for a in args], "dense")
        got = kernels.triton_decode_step(tri_state, *args, "dense")
        assert got.dtype == torch.bfloat16
        _close(got, want, 3e-2)


@pytest.mark.parametrize("family", ["attention", "local", "dense", "sparse", "ce", "square-ce", "tied", "hybrid"])
@pytest.mark.parametrize("static", [False, True], ids=["growing", "fixed"])
def test_the_models_decode_step_in_one_launch_matches_its_composition(family, static):
    """The model's step after a cache on the Triton path (``triton_decode_projected``: RoPE, the gate's activation,
    the read and the state's new rows in one launch per layer) against the PyTorch composition it replaces
    (``rotated_parts``, ``gate_values``, ``tied_weights``, ``recurrent_step``, ``DecodeState.advance``): the logits
    of every step, and every buffer of every layer's state after them, on a left-padded batch, with a short
    convolution and RoPE on one channel for some families."""
    kw = {"conv_size": 3} if family in ("ce", "tied") else {}
    if family in ("dense", "square-ce"):
        kw["rope_channels"] = "b"
    model = family_model(family, **kw)
    ids = torch.randint(1, 61, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    caches, logits = {}, {}
    for impl in ("torch", "triton"):
        model.config.mixer_impl = "torch"
        cache = hr.ResolventCache(model.config, max_cache_len=32 if static else None)
        with torch.no_grad():
            model(ids[:, :12], attention_mask=mask[:, :12], past_key_values=cache, use_cache=True)
            model.config.mixer_impl = impl
            logits[impl] = [model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache,
                                  use_cache=True).logits for t in range(12, 20)]
        caches[impl] = cache
    for t, (got, want) in enumerate(zip(logits["triton"], logits["torch"])):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m, t=t: f"step {t}: {m}")
    for i, (got, want) in enumerate(zip(caches["triton"].layers, caches["torch"].layers)):
        got_buffers, want_buffers = got.state.buffers(), want.state.buffers()
        assert got_buffers.keys() == want_buffers.keys()
        for name in want_buffers:
            torch.testing.assert_close(got_buffers[name], want_buffers[name], rtol=1e-4, atol=1e-4,
                                       msg=lambda m, k=f"layer {i} {name}": f"{k}: {m}")


def test_the_models_decode_step_in_one_launch_in_bfloat16():
    """bfloat16: RoPE's and the gate's roundings as the PyTorch composition makes them, so the tokens agree and the
    logits within bfloat16's tolerance."""
    model = family_model("hybrid", conv_size=3).to(torch.bfloat16)
    prompt = torch.randint(1, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    out = {}
    for impl in ("torch", "triton"):
        model.config.mixer_impl = impl
        out[impl] = model.generate(prompt, max_new_tokens=6, do_sample=False, output_scores=True,
                                   return_dict_in_generate=True)
    assert torch.equal(out["triton"].sequences, out["torch"].sequences)
    for got, want in zip(out["triton"].scores, out["torch"].scores):
        allowed = torch.isfinite(want)  # the pad token is suppressed: -inf in both
        assert torch.equal(torch.isfinite(got), allowed)
        _close(got[allowed], want[allowed], 3e-2)


# --------------------------------------------------------------------------------------------------
# GPU lowering (no GPU needed)


@pytest.mark.parametrize(("pattern", "dtype", "replaced"), [("dense", torch.bfloat16, True),
                                                            ("dense", torch.float32, False),
                                                            ("exp2:ce", torch.float32, False),
                                                            ("exp2:ce", torch.float32, True)])
def test_kernels_compile_for_a_gpu(pattern, dtype, replaced):
    """Every launch of a forward, backward and decode step compiles to a cubin for sm_90.

    The interpreter runs kernels as Python and would accept code that Triton cannot lower to a GPU;
    this builds the recorded launches (at the test tile size, to keep it quick) with Triton's compiler
    and ptxas. ``scripts/bench/bench_kernels.py --compile-check`` does the same at the default tile sizes.
    """
    from hf_resolvent.backends.triton import aot

    with kernels.block_config(**(REPLACED if replaced else {})):
        launches = aot.record_launches(pattern, dtype=dtype, n=40, d=16, e=16, batch=1, heads=2)
    names = {launch.name for launch in launches}
    dense = ({"dense_solve_fwd_kernel", "dense_solve_bwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"}
             if replaced else {"dense_chunk_fwd_kernel", "dense_chunk_bwd_kernel", "attn_bwd_atomic_kernel"})
    sparse = ({"sparse_solve_fwd_kernel", "sparse_solve_bwd_kernel", "sparse_grads_kernel"} if replaced else
              {"chunk_prepare_kernel", "chunk_carry_kernel", "chunk_rows_bwd_kernel", "chunk_grads_kernel"})
    expected = {"dense": {"attn_fwd_kernel", "decode_step_kernel"} | dense,
                "exp2:ce": {"sparse_direct_kernel", "decode_step_kernel"} | sparse}[pattern]
    assert names == expected
    for launch in launches:
        usage = aot.compile_launch(launch, arch=90)
        assert 0 < usage["registers"] <= 255, (launch.name, usage)


def test_float32_attention_at_width_128_fits_a_blocks_shared_memory():
    """At the default tiles, float32 attention kernels at head width 128 compile within sm_90's shared memory per block.

    On an H100 its forward asked for 256 KiB with 64-key steps (227 KiB allowed) and failed at launch;
    ``fitted_block_config`` halves the key step there, and ``compile_launch`` refuses a kernel past the limit."""
    import dataclasses

    from hf_resolvent.backends.triton import aot, launching

    defaults = dataclasses.asdict(launching.BlockConfig(attn_bwd="split"))  # the atomic backward: test_aot.py
    with kernels.block_config(**defaults):
        assert launching.fitted_block_config(torch.bfloat16, 128).attn_n == launching.BlockConfig().attn_n == 64
        assert launching.fitted_block_config(torch.float32, 128).attn_n == 32
        launches = aot.record_launches("attention", dtype=torch.float32, n=64, d=128, e=128, batch=1, heads=1)
        assert {launch.name for launch in launches} >= {"attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"}
        for launch in launches:
            assert aot.compile_launch(launch, arch=90)["shared"] <= aot.SHARED_MEMORY_LIMIT[90]
        unfitted = dict(launches[0].constexprs, BN=64)  # the tile that failed on the H100
        with pytest.raises(RuntimeError, match="shared memory per block, over the 232448 B of sm_90"):
            aot.compile_launch(dataclasses.replace(launches[0], constexprs=unfitted), arch=90)


def test_float32_chunked_solves_at_width_128_fit_a_blocks_shared_memory():
    """The chunked solves at float32 and head width 128 compile within sm_90's shared memory per block.

    On an H200 (Triton 3.6) ``chunk_grads`` asked for 288 KiB there with chunks of 64 (diagonal) and failed at
    launch; ``fitted_block_config`` halves the chunk for rows over 256 bytes."""
    import dataclasses

    from hf_resolvent.backends.triton import aot, launching

    defaults = dataclasses.asdict(launching.BlockConfig(sparse_solver="chunked", dense_solver="chunked"))
    with kernels.block_config(**defaults):
        assert launching.fitted_block_config(torch.bfloat16, 128).chunk == launching.BlockConfig().chunk == 64
        assert launching.fitted_block_config(torch.float32, 64).chunk == 64
        assert launching.fitted_block_config(torch.float32, 128).chunk == 32
        for pattern in ("diagonal", "dense"):
            launches = aot.record_launches(pattern, dtype=torch.float32, n=256, d=128, e=128, batch=1, heads=1)
            names = {launch.name for launch in launches}
            assert names >= ({"chunk_grads_kernel", "chunk_prepare_kernel"} if pattern == "diagonal"
                             else {"dense_chunk_fwd_kernel", "dense_chunk_bwd_kernel"})
            for launch in launches:
                if "chunk" in launch.name:
                    assert aot.compile_launch(launch, arch=90)["shared"] <= aot.SHARED_MEMORY_LIMIT[90], launch.name
                if launch.name.startswith("chunk_"):
                    assert launch.constexprs["C"] == 32, launch.name  # the fitted chunk, in every chunked kernel


def test_model_decodes_through_the_triton_step(monkeypatch):
    """``config.mixer_impl="triton"``: generate() prefills with ``triton_mix`` and decodes every token through the
    Triton decode kernels, reached from the model's cache code, with the tokens of the PyTorch path."""
    from hf_resolvent import ResolventConfig, ResolventForCausalLM

    calls = {"mix": 0, "step": 0}
    for name, key in (("triton_mix", "mix"), ("triton_decode_projected", "step")):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _key=key, **k: calls.__setitem__(_key, calls[_key] + 1)
                            or _real(*a, **k))
    config = ResolventConfig(vocab_size=40, n_positions=32, n_embd=32, n_layer=3, n_head=2, resid_pdrop=0.0,
                             embd_pdrop=0.0, mixer=["exp2:ce", "dense+tied", "attention"], pad_token_id=0)
    torch.manual_seed(0)
    model = ResolventForCausalLM(config).eval()
    prompt = torch.tensor([[5, 9, 3, 7, 1, 2, 8], [0, 0, 4, 6, 11, 12, 13]])
    mask = (prompt != 0).long()
    out = {}
    for impl in ("torch", "triton"):
        model.config.mixer_impl = impl
        out[impl] = model.generate(prompt, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                   output_scores=True, return_dict_in_generate=True)
    new_tokens = 5 - 1  # the first new token comes from the prefill
    assert calls == {"mix": 3, "step": 3 * new_tokens}
    assert torch.equal(out["triton"].sequences, out["torch"].sequences)
    for got, want in zip(out["triton"].scores, out["torch"].scores):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
