"""The CPU kernels (hf_resolvent.backends.cpu and its csrc): their checks, their gradients, and the fallback to
the PyTorch path when they cannot be built. Which PyTorch function each replaces, and when, is tested in
tests/ops/test_cpu_twins.py.

Their agreement with the PyTorch path and the reference runs in test_mixer.py and test_parallel_internals.py
(the ``cpu_path`` fixture runs those tests on both paths).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_resolvent.backends import cpu
from hf_resolvent.backends.cpu import functions
from hf_resolvent.ops import attention, dispatch, parallel_mix, reference_mix
from hf_resolvent.ops.dense_solve import DenseSolve
from hf_resolvent.ops.slots import SlotCombine, slot_layout, slot_probs
from hf_resolvent.ops.sparse_solve import SparseSolve
from hf_resolvent.patterns import get_pattern

F64 = torch.float64


@pytest.fixture(autouse=True)
def kernels_built():
    assert cpu.available(), "the CPU kernels did not build (see the warning)"


@pytest.mark.parametrize("spec", ["square:ce", "exp2", "banded:3"])
def test_cpu_functions_gradcheck(spec):
    n = 29
    layout = slot_layout(get_pattern(spec), n)
    gen = torch.Generator().manual_seed(3)
    w = (torch.rand(1, 2, layout.num_slots, n, generator=gen, dtype=F64) / layout.num_slots).requires_grad_()
    z, q, k = (torch.randn(1, 2, n, 3, generator=gen, dtype=F64, requires_grad=True) for _ in range(3))
    assert dispatch.cpu_kernels_for(w, z)
    assert torch.autograd.gradcheck(lambda w_, z_: SparseSolve.apply(w_, z_, layout, 8), (w, z))
    assert torch.autograd.gradcheck(lambda a, b: slot_probs(a, b, layout, 0.8), (q, k))
    assert torch.autograd.gradcheck(lambda a, b: SlotCombine.apply(a, b, layout), (w, z))


def _dense_inputs(n, d, e, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, 3, n, d, generator=gen, dtype=dtype) for _ in range(2))
    z = torch.randn(2, 3, n, e, generator=gen, dtype=dtype)
    g = torch.rand(2, 3, n, generator=gen, dtype=dtype)
    g[..., 0] = 0  # as the mixer passes it: row 0 has no keys
    return [t.requires_grad_() for t in (q, k, g, z)]


@pytest.mark.parametrize("n", [1, 5, 64, 100, 700])
@pytest.mark.parametrize("d,e,chunk", [(16, 24, 64), (64, 64, 32), (8, 8, 7)])
def test_cpu_dense_solve_matches_the_pytorch_one(n, d, e, chunk):
    """Outputs and all four gradients, n below, at and past the chunk, chunks that do not divide n."""
    inputs = _dense_inputs(n, d, e, seed=n)
    dy = torch.randn(2, 3, n, e, generator=torch.Generator().manual_seed(1))
    results = []
    for solve in (functions.DenseSolve, DenseSolve):
        y = solve.apply(*inputs, 0.3, chunk)
        results.append((y, *torch.autograd.grad(y, inputs, dy)))
    for name, got, want in zip(["y", "dq", "dk", "dg", "dz"], *results):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("n,d,e", [(1, 8, 8), (100, 16, 24), (512, 64, 64), (97, 8, 5)])
def test_cpu_causal_attention_matches_sdpa(n, d, e, monkeypatch):
    monkeypatch.setattr(functions, "ATTENTION_CHUNK", 7 if n == 97 else 64)  # chunks that do not divide n
    gen = torch.Generator().manual_seed(n)
    q, k = (torch.randn(2, 3, n, d, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, n, e, generator=gen, requires_grad=True)
    dout = torch.randn(2, 3, n, e, generator=gen)
    got = attention.causal_attention(q, k, v, 0.3)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_causal_attention_past_the_compiled_kernels_length_takes_sdpa(monkeypatch):
    """Past COMPILED_MAX_ROWS rows PyTorch's flash kernel is the faster one: it runs there, with the same results and
    gradients; at the limit the compiled kernel still runs."""
    monkeypatch.setattr(attention, "COMPILED_MAX_ROWS", 96)
    gen = torch.Generator().manual_seed(4)
    for n, compiled in ((96, True), (97, False)):
        q, k, v = (torch.randn(1, 2, n, 8, generator=gen, requires_grad=True) for _ in range(3))
        with torch.profiler.profile() as prof:
            got = attention.causal_attention(q, k, v, 0.3)
        assert ("hf_resolvent::causal_attention_forward" in {e.name for e in prof.events()}) == compiled, n
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        dout = torch.randn(1, 2, n, 8, generator=gen)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_cpu_causal_attention_gradcheck(monkeypatch):
    monkeypatch.setattr(functions, "ATTENTION_CHUNK", 8)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 29, 4, generator=gen, dtype=F64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda *t: attention.causal_attention(*t, 0.6), (q, k, v))


def test_cpu_dense_solve_gradcheck():
    inputs = _dense_inputs(37, 5, 3, dtype=F64, seed=2)
    assert torch.autograd.gradcheck(lambda *t: functions.DenseSolve.apply(*t, 0.7, 8), inputs)


@pytest.mark.parametrize("spec,kernels", [("square:ce", {"slot_probs", "slot_combine", "slot_solve"}),
                                          ("dense", {"dense_solve_forward", "causal_attention_forward"})])
def test_cpu_path_is_taken_and_matches_the_reference(spec, kernels):
    """A float32 mixer on CPU runs the kernels (the profiler sees them) and agrees with the reference."""
    gen = torch.Generator().manual_seed(0)
    qa, ka, qb, kb, x = (torch.randn(2, 2, 70, 8, generator=gen) for _ in range(5))
    g = torch.rand(2, 2, 70, generator=gen)
    with torch.profiler.profile() as prof:
        y = parallel_mix(qa, ka, qb, kb, x, g, spec)
    assert {f"hf_resolvent::{name}" for name in kernels} <= {e.name for e in prof.events()}
    torch.testing.assert_close(y, reference_mix(qa, ka, qb, kb, x, g, spec), atol=1e-5, rtol=1e-5)


DECODE_CASES = [(spec, False) for spec in ("attention", "local_attention:4")] + [
    (spec, tied) for spec in ("dense", "banded:3", "exp2", "exp2:ce", "square:ce") for tied in (False, True)]


@pytest.mark.parametrize("spec,tied", DECODE_CASES)
def test_cpu_decode_step_matches_the_pytorch_step(spec, tied):
    """Token by token from an empty state, a batch with left padding: the compiled step gives the PyTorch step's
    outputs and leaves the same state (rows, positions) after every token, in float32 and float64."""
    from hf_resolvent.ops.recurrent import recurrent_step
    from hf_resolvent.ops.state import DecodeState
    from hf_resolvent.patterns import get_pattern

    for dtype, tol in ((torch.float32, 1e-6), (F64, 1e-13)):
        gen = torch.Generator().manual_seed(5)
        qa, ka, qb, kb, x = (torch.randn(3, 2, 40, 8, generator=gen, dtype=dtype) for _ in range(5))
        g, d = (torch.rand(3, 2, 40, generator=gen, dtype=dtype) for _ in range(2))
        start = torch.tensor([0, 4, 11])
        names = ("keys_b", "outputs") if tied else ("keys_a", "values") + (
            ("keys_b", "outputs") if get_pattern(spec).has_recurrence else ())
        states = {path: DecodeState.empty(spec, {k: 8 for k in names}, 3, 2, dtype=dtype, start=start)
                  for path in ("cpu", "torch")}
        for t in range(40):
            ys = {}
            for path, state in states.items():
                with dispatch.torch_only() if path == "torch" else torch.profiler.profile() as prof:
                    if tied:
                        ys[path] = recurrent_step(state, None, None, qb[:, :, t], kb[:, :, t], x[:, :, t],
                                                  g[:, :, t], spec, d=d[:, :, t])
                    else:
                        ys[path] = recurrent_step(state, qa[:, :, t], ka[:, :, t], qb[:, :, t], kb[:, :, t],
                                                  x[:, :, t], g[:, :, t], spec)
                if path == "cpu":
                    assert "hf_resolvent::decode_step" in {e.name for e in prof.events()}
            torch.testing.assert_close(ys["cpu"], ys["torch"], atol=tol, rtol=tol)
            assert torch.equal(states["cpu"].positions, states["torch"].positions)
            for name, held in states["torch"].tensors().items():
                torch.testing.assert_close(states["cpu"].tensors()[name], held, atol=tol, rtol=tol)


def test_cpu_decode_step_checks_its_inputs():
    ops = cpu.operators()
    q, x = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
    held_k, held_x = torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 5)
    read, r = torch.ones(2, 6, dtype=torch.bool), torch.tensor([6, 6])
    y, _ = ops.decode_step(q, q, None, None, x, None, None, held_k, held_x, None, None, read, r, 0.5)
    assert y.shape == (2, 3, 5)
    strided = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, x, held_k, held_x)]
    assert strided[2].stride(-1) != 1  # rows whose last dimension is not contiguous are copied, not refused
    y_strided, _ = ops.decode_step(strided[0], strided[0], None, None, strided[1], None, None, *strided[2:], None,
                                   None, read, r, 0.5)
    torch.testing.assert_close(y_strided, y)
    with pytest.raises(RuntimeError, match=r"read must be a \(B, S\) bool tensor with B = 2"):
        ops.decode_step(q, q, None, None, x, None, None, held_k, held_x, None, None, read[:1], r, 0.5)
    with pytest.raises(RuntimeError, match=r"keys_a must be \[2, 3, 6, 4\], got \[2, 3, 5, 4\]"):
        ops.decode_step(q, q, None, None, x, None, None, held_k[:, :, :5], held_x, None, None, read, r, 0.5)
    with pytest.raises(RuntimeError, match=r"values must be \[2, 3, 6, 5\], got \[2, 3, 6, 4\]"):
        ops.decode_step(q, q, None, None, x, None, None, held_k, held_k, None, None, read, r, 0.5)
    with pytest.raises(RuntimeError, match=r"ka must be \[2, 3, 4\], got \[2, 3, 3\]"):
        ops.decode_step(q, q[..., :3], None, None, x, None, None, held_k, held_x, None, None, read, r, 0.5)
    with pytest.raises(RuntimeError, match=r"g must be \[2, 3\], got \[2\]"):
        ops.decode_step(q, q, q, q, x, torch.rand(2), None, held_k, held_x, held_k, held_x, read, r, 0.5)
    with pytest.raises(RuntimeError, match="qb needs its key kb"):
        ops.decode_step(q, q, q, None, x, torch.rand(2, 3), None, held_k, held_x, held_k, held_x, read, r, 0.5)
    with pytest.raises(RuntimeError, match="the recurrent channel needs the gate g"):
        ops.decode_step(q, q, q, q, x, None, None, held_k, held_x, held_k, held_x, read, r, 0.5)
    with pytest.raises(RuntimeError, match="keys_a must have x's dtype Float, got Double"):
        ops.decode_step(q, q, None, None, x, None, None, held_k.double(), held_x, None, None, read, r, 0.5)


def test_kernels_check_their_inputs():
    ops = cpu.operators()
    n = 6
    z = torch.randn(1, 1, n, 4)
    w = torch.rand(1, 1, 1, n)
    later = torch.tensor([[-1, 2, 3, 4, 5, 5]])  # row 1 reads row 2: not yet solved
    with pytest.raises(RuntimeError, match="slot 0 of row 1 reads row 2, not an earlier row"):
        ops.slot_solve(w, z, later)
    with pytest.raises(RuntimeError, match="reads row 9, past the sequence"):
        ops.slot_combine(w, z, torch.tensor([[-1, 0, 1, 2, 3, 9]]))
    with pytest.raises(RuntimeError, match=r"src must be a contiguous \(K, n\) int64 tensor with n = 6"):
        ops.slot_dot(z, z, torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"weights must be a contiguous \(B, H, K, n\) tensor"):
        ops.slot_solve(torch.rand(1, 1, 2, n), z, torch.full((1, n), -1))
    g = torch.rand(1, 1, n)
    with pytest.raises(RuntimeError, match="dense_solve: chunk must be >= 1, got 0"):
        ops.dense_solve_forward(z, z, g, z, 1.0, 0)
    with pytest.raises(RuntimeError, match=r"dense_solve: g must be \(B, H, n\)"):
        ops.dense_solve_forward(z, z, g[..., :-1], z, 1.0, 4)
    with pytest.raises(RuntimeError, match="dense_solve: all inputs must share q's dtype"):
        ops.dense_solve_forward(z, z, g.double(), z, 1.0, 4)


def test_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path):
    def no_compiler(**kwargs):
        raise OSError("c++: command not found")

    monkeypatch.setattr(cpu, "_state", {})  # as in a fresh process
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty build cache: a build is needed
    monkeypatch.setattr(cpu, "_compile", no_compiler)
    x = torch.randn(1, 2, 40, 4)
    with pytest.warns(RuntimeWarning, match="could not be built .*c\\+\\+: command not found.*PyTorch path"):
        assert not dispatch.cpu_kernels_for(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second build, no second warning
        assert not dispatch.cpu_kernels_for(x)
    gen = torch.Generator().manual_seed(1)
    qa, ka, qb, kb = (torch.randn(1, 2, 40, 4, generator=gen) for _ in range(4))
    g = torch.rand(1, 2, 40, generator=gen)
    with torch.profiler.profile() as prof:
        y = parallel_mix(qa, ka, qb, kb, x, g, "exp2")
    assert not any(e.name.startswith("hf_resolvent::") for e in prof.events())
    torch.testing.assert_close(y, reference_mix(qa, ka, qb, kb, x, g, "exp2"), atol=1e-5, rtol=1e-5)


def test_environment_switch_skips_the_build(monkeypatch):
    monkeypatch.setattr(cpu, "_state", {})
    monkeypatch.setenv("HF_RESOLVENT_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu, "_compile", lambda **kw: pytest.fail("the build must be skipped"))
    monkeypatch.setattr(torch.ops, "load_library", lambda path: pytest.fail("the library must not be loaded"))
    assert not cpu.available()


def test_other_dtypes_and_devices_take_the_pytorch_path():
    assert not dispatch.cpu_kernels_for(torch.zeros(2, dtype=torch.bfloat16))
    assert not dispatch.cpu_kernels_for(torch.zeros(2, device="meta"))
    assert dispatch.cpu_kernels_for(torch.zeros(2), torch.zeros(2, dtype=F64))


@pytest.mark.parametrize("table_batch", [1, 2])
def test_cpu_rope_equals_the_pytorch_rotation_and_its_gradient(table_batch):
    """rotated_heads on a strided run of the projection (as the mixer slices it): the compiled call gives the
    PyTorch rotation's parts and gradients, with tables for the whole batch or one row broadcast to it."""
    from hf_resolvent.ops.rope import rotated_heads

    gen = torch.Generator().manual_seed(table_batch)
    proj = torch.randn(2, 7, 5, 3, 8, generator=gen)  # (B, n, parts, H, hd); parts 1:3 are the rotated run
    angles = torch.randn(table_batch, 7, 4, generator=gen).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    weights = torch.randn(2, 2, 3, 7, 8, generator=gen)
    results = {}
    for impl in ("cpu", "torch"):
        leaf = proj.clone().requires_grad_()
        with dispatch.torch_only() if impl == "torch" else warnings.catch_warnings():
            parts = rotated_heads(leaf[:, :, 1:3], cos, sin)
            if impl == "cpu":
                assert all(p.is_contiguous() for p in parts)  # the layout the mixer kernels read, no copy left
            loss = sum((p * w).sum() for p, w in zip(parts, weights))
            loss.backward()
        results[impl] = (torch.stack(parts), leaf.grad)
    torch.testing.assert_close(results["cpu"][0], results["torch"][0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(results["cpu"][1], results["torch"][1], atol=1e-6, rtol=1e-6)
    assert results["cpu"][1][:, :, [0, 3, 4]].abs().max() == 0  # parts outside the run get no gradient


def test_cpu_rope_checks_its_inputs():
    ops = cpu.operators()
    src, table = torch.randn(1, 4, 1, 2, 6), torch.randn(1, 4, 6)
    with pytest.raises(RuntimeError, match=r"cos and sin must be float32 \(B, n, hd\) = \(1, 4, 6\)"):
        ops.rope_heads(src, table[:, :3], table)
    with pytest.raises(RuntimeError, match="the head width must be even, got 5"):
        ops.rope_heads(src[..., :5], table[..., :5], table[..., :5])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (F64, 1e-13)])
def test_cpu_gelu_equals_pytorchs_tanh_gelu_and_its_gradient(dtype, tol):
    """ops.gelu_tanh (the MLP's activation) on the compiled pass and on F.gelu(approximate="tanh"): values and
    gradients over the range activations take, past the exponential's clamps, and at the special values."""
    from hf_resolvent.ops.gelu import gelu_tanh

    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(2991, generator=gen, dtype=dtype) * 4, torch.linspace(-60, 60, 1001, dtype=dtype),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e20, -1e20, 300.0, -300.0], dtype=dtype)])
    grad = torch.randn(x.shape, generator=gen, dtype=dtype)
    out = {}
    for impl in ("cpu", "torch"):
        leaf = x.clone().view(4, 1000).requires_grad_()  # 2-D, as c_fc's output
        y = gelu_tanh(leaf, impl=impl)
        assert (y.grad_fn.name() == "GeluTanhBackward") == (impl == "cpu")
        y.backward(grad.view(4, 1000))
        out[impl] = (y.detach().flatten(), leaf.grad.flatten())
    torch.testing.assert_close(out["cpu"][0], out["torch"][0], atol=tol, rtol=tol)
    finite = out["torch"][1].isfinite()  # PyTorch's float32 gradient at +-1e20 is NaN (x^3 overflows); ours is 1, 0
    torch.testing.assert_close(out["cpu"][1][finite], out["torch"][1][finite], atol=10 * tol, rtol=10 * tol)
    assert out["cpu"][1].isfinite().all()
    torch.testing.assert_close(out["cpu"][1][-4:-2], torch.stack([grad[-4], 0 * grad[-3]]))
    special = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    assert torch.equal(cpu.operators().gelu_tanh(special).isnan(), torch.tensor([True, False, True]))
    assert cpu.operators().gelu_tanh(special)[1] == float("inf")
    if dtype == F64:
        assert torch.autograd.gradcheck(functions.GeluTanh.apply, (torch.randn(40, dtype=F64, requires_grad=True),))


def test_cpu_gelu_is_chosen_in_one_place_and_refuses_a_second_derivative():
    from hf_resolvent.ops.gelu import gelu_tanh

    x = torch.randn(4, 6, requires_grad=True)
    assert gelu_tanh(x).grad_fn.name() == "GeluTanhBackward"  # auto, float32 on the CPU
    with dispatch.torch_only():
        assert gelu_tanh(x).grad_fn.name() == "GeluBackward0"
    assert gelu_tanh(x, impl="torch").grad_fn.name() == "GeluBackward0"
    assert gelu_tanh(x.t()).grad_fn.name() == "GeluBackward0"  # not contiguous: the reference
    assert gelu_tanh(x.bfloat16()).grad_fn.name() == "GeluBackward0"
    with torch.no_grad():  # nothing to record: the operator alone
        torch.testing.assert_close(gelu_tanh(x), torch.nn.functional.gelu(x, approximate="tanh"), atol=2e-6, rtol=2e-6)
    (g,) = torch.autograd.grad(gelu_tanh(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|non-differentiable|does not require grad"):
        g.sum().backward()
    with pytest.raises(RuntimeError, match="gelu_tanh: x must be a contiguous float32 or float64 tensor"):
        cpu.operators().gelu_tanh(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="grad must match x"):
        cpu.operators().gelu_tanh_backward(torch.zeros(3), torch.zeros(4))


def test_slot_probs_and_combine_read_keys_and_values_past_their_rows():
    """slot_probs and slot_combine for n rows of a layout may read k and v with more rows (a chunk's held rows come
    first, ops/extend.py): the result is the layout's rows over the longer keys, and a source past them is refused."""
    ops = cpu.operators()
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2, 4, 3, generator=gen), torch.randn(1, 2, 7, 3, generator=gen)
    v = torch.randn(1, 2, 7, 5, generator=gen)
    src = torch.tensor([[3, 4, 5, 6], [0, -1, 2, 1]])  # (K, n) over the 7 rows of k and v
    probs = ops.slot_probs(q, k, src, 0.5)
    keys = k[:, :, src.clamp(min=0)]  # (1, 2, K, n, 3)
    scores = torch.where(src >= 0, 0.5 * (keys * q[:, :, None]).sum(-1), -torch.inf)
    torch.testing.assert_close(probs, scores.softmax(2))
    out = ops.slot_combine(probs, v, src)
    torch.testing.assert_close(out, (probs[..., None] * v[:, :, src.clamp(min=0)]).sum(2))
    with pytest.raises(RuntimeError, match="slot_probs: slot 0 of row 3 reads row 7, past the sequence"):
        ops.slot_probs(q, k, torch.tensor([[3, 4, 5, 7]]), 0.5)
    with pytest.raises(RuntimeError, match=r"slot_probs: k must match q but for its rows"):
        ops.slot_probs(q, k[..., :2].contiguous(), src, 0.5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (F64, 1e-13)])
def test_cpu_short_convolution_equals_pytorchs_depthwise_conv1d_and_its_gradients(dtype, tol):
    """ops.causal_conv_silu (the short convolution, conv_size) on the compiled passes and on SiLU of F.conv1d
    (groups = channels): values and the gradients of the rows, filters and biases, at several widths K and batches."""
    from hf_resolvent.ops.conv import causal_conv_silu

    gen = torch.Generator().manual_seed(0)
    for batch, n, channels, k in ((1, 1, 5, 4), (3, 37, 300, 4), (2, 9, 17, 2), (1, 6, 8, 1)):
        window = torch.randn(batch, n + k - 1, channels, generator=gen, dtype=dtype) * 2
        weight = torch.randn(channels, 1, k, generator=gen, dtype=dtype)
        bias = torch.randn(channels, generator=gen, dtype=dtype)
        grad = torch.randn(batch, n, channels, generator=gen, dtype=dtype)
        out = {}
        for impl in ("cpu", "torch"):
            leaves = [t.clone().requires_grad_() for t in (window, weight, bias)]
            y = causal_conv_silu(*leaves, impl=impl)
            assert (y.grad_fn.name() == "CausalConvSiluBackward") == (impl == "cpu")
            out[impl] = (y, *torch.autograd.grad(y, leaves, grad))
        for got, want in zip(out["cpu"], out["torch"]):
            torch.testing.assert_close(got, want, atol=10 * tol * max(1, n), rtol=10 * tol)
    if dtype == F64:
        leaves = [torch.randn(*shape, dtype=F64, requires_grad=True) for shape in ((2, 10, 5), (5, 1, 3), (5,))]
        assert torch.autograd.gradcheck(functions.CausalConvSilu.apply, tuple(leaves))


def test_cpu_short_convolution_is_chosen_in_one_place_and_refuses_bad_shapes():
    from hf_resolvent.ops.conv import causal_conv_silu

    window, weight, bias = torch.randn(2, 7, 6, requires_grad=True), torch.randn(6, 1, 4), torch.randn(6)
    assert causal_conv_silu(window, weight, bias).grad_fn.name() == "CausalConvSiluBackward"  # auto, float32, CPU
    assert causal_conv_silu(window, weight, bias, impl="torch").grad_fn.name() == "SiluBackward0"
    with dispatch.torch_only():
        assert causal_conv_silu(window, weight, bias).grad_fn.name() == "SiluBackward0"
    strided = window.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    assert causal_conv_silu(strided, weight, bias).grad_fn.name() == "SiluBackward0"  # not contiguous: the reference
    ops = cpu.operators()
    with pytest.raises(RuntimeError, match="weight must be \\(channels, 1, K\\)"):
        ops.causal_conv_silu(window.detach(), torch.randn(5, 1, 4), bias)
    with pytest.raises(RuntimeError, match="window must hold at least K = 4 rows"):
        ops.causal_conv_silu(torch.randn(2, 3, 6), weight, bias)
    with pytest.raises(RuntimeError, match="must have the window's dtype"):
        ops.causal_conv_silu(window.detach(), weight.double(), bias)
    with pytest.raises(RuntimeError, match="grad must be a contiguous \\(2, 4, 6\\) tensor"):
        ops.causal_conv_silu_backward(torch.zeros(2, 5, 6), window.detach(), weight, bias)
