"""The Triton twins of what runs around the mixer call, on CPU through Triton's interpreter: RoPE with the head split
(``triton_rope_heads``: ``ops.rope.rotated_heads`` and ``rotated_parts``) and the gate's activation
(``triton_gate_values``: ``ops.mixer.gate_values``).

The module runs with ``TRITON_INTERPRET=1`` and every kernel output filled with NaN before the kernel writes it (an
autouse fixture, as in test_triton.py), so an element a kernel leaves unwritten fails the comparison.

Oracles: the PyTorch code of the same functions (``impl="torch"``), forward and gradients through autograd.
Tolerances: float32 1e-6 (the same float32 arithmetic, in another order), bfloat16 one rounding of the output
(2 ** -7 of its magnitude, 2 ** -6 for gradients, which PyTorch rounds twice where the kernels round once).

Then which code runs (the twins on the Triton path only: not under impl "torch" or "cpu", nor in a graph), the model's
training step on the Triton path against the PyTorch one, the kernels compiled for sm_90, and the launches of a
training step per layer.
"""

from __future__ import annotations

import pytest
import torch
from conftest import load_script

import hf_resolvent as hr
from hf_resolvent.backends import triton as kernels
from hf_resolvent.ops import dispatch, mixer, rope
from hf_resolvent.ops.mixer import gate_values
from hf_resolvent.ops.rope import rotated_heads, rotated_parts

PARTS = ("qa", "ka", "x", "qb", "kb")


@pytest.fixture(autouse=True, scope="module")
def interpreter():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.delenv(dispatch.ENV, raising=False)
        old = kernels.set_nan_fill(True)
        yield
        kernels.set_nan_fill(old)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, grad: bool = False) -> None:
    """Within float32 arithmetic of the reference (float32), or one bfloat16 rounding of its largest element."""
    actual, expected = actual.float(), expected.float()
    assert actual.shape == expected.shape
    assert not actual.isnan().any()
    scale = expected.abs().max().item()
    tol = 1e-6 * max(scale, 1.0) if dtype == torch.float32 else (2**-6 if grad else 2**-7) * scale
    err = (actual - expected).abs().max().item()
    assert err <= tol, f"max error {err:.3g} over {tol:.3g} (magnitude {scale:.3g})"


def _tables(batch: int, n: int, hd: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of random angles, (batch, n, hd) float32, the rotate-half's layout (both halves alike)."""
    angles = torch.rand(batch, n, hd // 2, generator=torch.Generator().manual_seed(seed)) * 6.3
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _grads(outputs, leaves, seed: int):
    """The gradients of sum(output * cotangent) over the outputs, for the leaves (random float32 cotangents)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum((out.float() * torch.randn(out.shape, generator=gen)).sum() for out in outputs)
    return torch.autograd.grad(total, leaves)


# --------------------------------------------------------------------------------------------------
# RoPE and the head split


ROPE_CASES = [  # (batch, n, parts in the run, heads, head width, table batch)
    (2, 37, 2, 2, 16, 1),
    (2, 37, 3, 1, 32, 2),
    (1, 5, 1, 3, 16, 1),
    (3, 17, 5, 2, 32, 3),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("batch", "n", "parts", "heads", "hd", "table_batch"), ROPE_CASES)
def test_rotated_heads_on_triton_equal_pytorch(batch, n, parts, heads, hd, table_batch, dtype):
    """A run sliced from a projection (strided, as the mixer passes it): parts, their contiguity, and the gradient of
    the projection."""
    gen = torch.Generator().manual_seed(n)
    proj = torch.randn(batch, n, parts + 2, heads, hd, generator=gen).to(dtype)
    cos, sin = _tables(table_batch, n, hd, seed=parts)
    results = {}
    for impl in ("triton", "torch"):
        leaf = proj.clone().requires_grad_()
        out = rotated_heads(leaf[:, :, 1:1 + parts], cos, sin, impl=impl)
        results[impl] = out, _grads(out, [leaf], seed=1)[0]
    (out, grad), (ref, ref_grad) = results["triton"], results["torch"]
    assert len(out) == parts
    for part, expected in zip(out, ref):
        assert part.is_contiguous() and part.dtype == dtype
        _close(part, expected, dtype)
    _close(grad, ref_grad, dtype, grad=True)
    assert (grad[:, :, 0] == 0).all() and (grad[:, :, parts + 1] == 0).all()  # parts outside the run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("parts", "channels", "with_rope"),
                         [(PARTS, "ab", True), (PARTS, "a", True), (PARTS, "b", True), (("x", "qb", "kb"), "ab", True),
                          (("qa", "ka", "x"), "ab", True), (PARTS, "ab", False)],
                         ids=["ab", "a", "b", "tied", "attention", "no-rope"])
def test_rotated_parts_on_triton_equal_pytorch(parts, channels, with_rope, dtype):
    """The whole projection in one launch each way: rotated and unrotated parts, every one contiguous, and the
    projection's gradient (also where some parts have none)."""
    batch, n, heads, hd = 2, 21, 2, 16
    proj = torch.randn(batch, n, len(parts), heads, hd, generator=torch.Generator().manual_seed(3)).to(dtype)
    tables = _tables(1, n, hd, seed=4) if with_rope else None
    results = {}
    for impl in ("triton", "torch"):
        leaf = proj.clone().requires_grad_()
        out = rotated_parts(leaf, parts, channels, tables, impl=impl)
        used = [out[name] for name in parts if name != "ka"]  # ka's gradient is None: read as zeros
        results[impl] = out, _grads(used, [leaf], seed=5)[0]
    (out, grad), (ref, ref_grad) = results["triton"], results["torch"]
    assert list(out) == list(parts)
    for name in parts:
        assert out[name].is_contiguous()
        _close(out[name], ref[name], dtype)
    _close(grad, ref_grad, dtype, grad=True)


def test_triton_rope_heads_rejects_what_it_cannot_take():
    run = torch.zeros(1, 4, 2, 1, 16)
    cos, sin = _tables(1, 4, 16, seed=0)
    with pytest.raises(ValueError, match="rotate names 1 parts"):
        kernels.triton_rope_heads(run, cos, sin, rotate=(True,))
    with pytest.raises(ValueError, match="needs the cos and sin"):
        kernels.triton_rope_heads(run, None, None)
    with pytest.raises(ValueError, match="float64"):
        kernels.triton_rope_heads(run.double(), cos, sin)
    with pytest.raises(ValueError, match="no gradient for the tables"):
        kernels.triton_rope_heads(run, cos.requires_grad_(), sin)


# --------------------------------------------------------------------------------------------------
# The gate


GATE_CASES = [  # (batch, n, heads, dtype of pre and of g, dtype of dt_bias and a_log)
    (2, 37, 3, torch.float32, torch.float32),
    (1, 5, 1, torch.float32, torch.float32),
    (3, 70, 2, torch.float32, torch.float32),  # two programs of positions per sequence
    (2, 37, 3, torch.bfloat16, torch.float32),
    (2, 37, 17, torch.bfloat16, torch.bfloat16),  # heads past one tile of 16
]


@pytest.mark.parametrize(("batch", "n", "heads", "dtype", "param_dtype"), GATE_CASES)
def test_gate_values_on_triton_equal_pytorch(batch, n, heads, dtype, param_dtype):
    """g and the gradients of pre, dt_bias and a_log, with pre + dt_bias on both sides of softplus's threshold (20)
    and far below 0 (where softplus is exp(x): log(1 + exp(x)) would give 0)."""
    gen = torch.Generator().manual_seed(heads)
    pre = (torch.randn(batch, n, heads, generator=gen) * 8).to(dtype)
    pre[0, :3] = torch.tensor([25.0, -30.0, 19.5])[:, None].to(dtype)
    dt_bias = torch.randn(heads, generator=gen).to(param_dtype)
    a_log = (torch.randn(heads, generator=gen) * 0.5 - 1).to(param_dtype)
    results = {}
    for impl in ("triton", "torch"):
        leaves = [t.clone().requires_grad_() for t in (pre, dt_bias, a_log)]
        g = gate_values(*leaves, dtype, impl=impl)
        results[impl] = g, _grads([g], leaves, seed=2)
    (g, grads), (ref, ref_grads) = results["triton"], results["torch"]
    assert g.is_contiguous() and g.dtype == dtype and g.shape == (batch, heads, n)
    _close(g, ref, dtype)
    for name, grad, expected in zip(("pre", "dt_bias", "a_log"), grads, ref_grads):
        assert grad.dtype == expected.dtype, name
        _close(grad, expected, dtype if name == "pre" else param_dtype, grad=True)


def test_gate_values_in_another_dtype_than_pre():
    """g in bfloat16 from a float32 pre-activation (g's dtype is the caller's)."""
    pre = torch.randn(2, 9, 2, generator=torch.Generator().manual_seed(0))
    params = torch.zeros(2), torch.zeros(2)
    _close(gate_values(pre, *params, torch.bfloat16, impl="triton"),
           gate_values(pre, *params, torch.bfloat16, impl="torch"), torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# Which code runs


@pytest.fixture
def twin_calls(monkeypatch):
    """{"rope": count, "gate": count} of the calls that reach the Triton twins."""
    from hf_resolvent.backends.triton import rope_gate

    calls = {"rope": 0, "gate": 0}

    def counting(key: str, fn):
        def counted(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return counted

    for key, name in (("rope", "triton_rope_heads"), ("gate", "triton_gate_values")):
        monkeypatch.setattr(rope_gate, name, counting(key, getattr(rope_gate, name)))
    return calls


def _inputs_around_the_mixer():
    """A projection (1, 6, 5 parts, 2 heads, 16), its RoPE tables and a gate's (pre, dt_bias, a_log)."""
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(1, 6, 5, 2, 16, generator=gen), _tables(1, 6, 16, seed=0),
            (torch.randn(1, 6, 2, generator=gen), torch.zeros(2), torch.zeros(2)))


def _around_the_mixer(impl: str, proj, tables, gate):
    """rotated_parts, rotated_heads and gate_values as the model and the vLLM layers call them, for ``impl``."""
    parts = rotated_parts(proj, PARTS, "ab", tables, impl=impl)
    rotated_heads(proj[:, :, :2], *tables, impl=impl)
    return parts, gate_values(*gate, torch.float32, impl=impl)


def test_the_twins_run_on_the_triton_path(twin_calls, monkeypatch):
    _around_the_mixer("triton", *_inputs_around_the_mixer())
    assert twin_calls == {"rope": 2, "gate": 1}
    monkeypatch.setenv(dispatch.ENV, "triton")  # "auto" takes the environment's choice
    _around_the_mixer("auto", *_inputs_around_the_mixer())
    assert twin_calls == {"rope": 4, "gate": 2}


@pytest.mark.parametrize("impl", ["torch", "cpu", "auto"])
def test_the_twins_do_not_run_off_the_triton_path(impl, twin_calls):
    """"auto" on CPU tensors runs the CPU kernels or PyTorch, whatever the interpreter could do."""
    if impl == "cpu" and not dispatch.backend("cpu").available():
        pytest.skip("the CPU kernels are not built here")
    _around_the_mixer(impl, *_inputs_around_the_mixer())
    assert twin_calls == {"rope": 0, "gate": 0}


def test_the_twins_do_not_run_in_a_graph(twin_calls):
    """Under torch.compile the PyTorch code is traced, for impl="triton" too (the kernels are opaque to a graph)."""
    torch._dynamo.reset()
    inputs = _inputs_around_the_mixer()
    try:
        parts, g = torch.compile(_around_the_mixer, backend="eager", fullgraph=True)("triton", *inputs)
    finally:
        torch._dynamo.reset()
    assert twin_calls == {"rope": 0, "gate": 0}
    assert not g.is_contiguous() and not parts["x"].is_contiguous()  # PyTorch's transposed views
    eager_parts, eager_g = _around_the_mixer("torch", *inputs)
    assert torch.equal(g, eager_g) and all(torch.equal(parts[k], eager_parts[k]) for k in PARTS)


def test_the_twins_leave_float64_and_trained_tables_to_pytorch(twin_calls):
    proj, (cos, sin), _ = _inputs_around_the_mixer()
    proj = proj.double()
    rotated_parts(proj, PARTS, "ab", (cos.double(), sin.double()), impl="triton")
    gate_values(torch.randn(1, 6, 2, dtype=torch.float64), torch.zeros(2), torch.zeros(2), torch.float64,
                impl="triton")
    rotated_parts(proj.float(), PARTS, "ab", (cos.requires_grad_(), sin), impl="triton")
    assert twin_calls == {"rope": 0, "gate": 0}


# --------------------------------------------------------------------------------------------------
# The model's training step


def _model(mixer: str, impl: str, n_layer: int = 2, dtype=torch.float32):
    torch.manual_seed(0)
    config = hr.ResolventConfig.from_preset("tiny", mixer=mixer, n_layer=n_layer, n_embd=64, n_head=2, n_inner=256,
                                            vocab_size=97, resid_pdrop=0.0, embd_pdrop=0.0, mixer_impl=impl,
                                            gate_init="mamba2")
    return hr.ResolventForCausalLM(config).to(dtype).train()


def _step(model, ids, mask=None):
    model.zero_grad()
    loss = model(ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mixer", ["exp2:ce", "attention", "exp2:ce+tied"])
def test_a_training_step_on_triton_equals_pytorch(mixer, twin_calls, monkeypatch):
    """Loss and every parameter's gradient, the Triton path (mixer, RoPE and, through HF_RESOLVENT_MIXER_IMPL, the
    gate on Triton) against the PyTorch one, float32, a left-padded batch."""
    ids = torch.randint(1, 97, (2, 29), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ref_loss, ref_grads = _step(_model(mixer, "torch"), ids, mask)
    monkeypatch.setenv(dispatch.ENV, "triton")  # the model passes no impl to gate_values: "auto" takes this one
    loss, grads = _step(_model(mixer, "triton"), ids, mask)
    layers = 2
    assert twin_calls == {"rope": layers, "gate": 0 if mixer == "attention" else layers}
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        ref = ref_grads[name]
        err = (grad - ref).abs().max().item()
        assert err <= 1e-4 * max(ref.abs().max().item(), 1e-3), f"{name}: max error {err:.3g}"


# --------------------------------------------------------------------------------------------------
# Compiled for a GPU


@pytest.mark.parametrize(("parts", "rotated", "dtype", "batch", "heads", "hd", "shared_tables"),
                         [(PARTS, "ab", torch.bfloat16, 1, 2, 64, True),
                          (PARTS, "a", torch.float32, 2, 3, 16, False),
                          (("x", "qb", "kb"), "", torch.float16, 1, 17, 32, True),
                          (("qa", "ka", "x"), "ab", torch.float32, 2, 12, 128, True)])
def test_the_kernels_compile_for_a_gpu(parts, rotated, dtype, batch, heads, hd, shared_tables):
    """Every launch of the twins' forward and backward (aot.record_projection_launches) compiles to a cubin for sm_90,
    within 255 registers, without spills, and without atomics (the gate's per-head sums are a second launch)."""
    from hf_resolvent.backends.triton import aot

    launches = aot.record_projection_launches(parts, rotated, dtype=dtype, n=40, d=hd, batch=batch, heads=heads,
                                              shared_tables=shared_tables)
    assert [launch.name for launch in launches] == ["rope_heads_kernel", "gate_fwd_kernel", "gate_bwd_kernel",
                                                    "gate_reduce_kernel", "rope_heads_bwd_kernel"]
    for launch in launches:
        usage = aot.compile_launch(launch, arch=90)
        assert 0 < usage["registers"] <= 255 and usage["spill_stack_bytes"] == 0, (launch.name, usage)
        assert usage["atomics"] == 0, (launch.name, usage)


# --------------------------------------------------------------------------------------------------
# Launches of a training step


OpCounter = load_script("bench/op_counts").OpCounter

# Per layer, forward and backward, exp2:ce on the Triton path (the model of _model, batch 2 x 64 tokens), counted as
# scripts/bench/op_counts.py counts them (a Triton launch as one): 98 before these twins (commit 871402c: RoPE's mul,
# roll, neg, cat and addcmul per rotated run and their backwards, the mixer's copies of each part, the gate's
# softplus, exp and mul each way). RoPE's twin makes them 71 (27 fewer), the gate's another 13 fewer (58).
BEFORE = 98
BOUND_ROPE = BEFORE - 25  # mixer_impl="triton": the model passes its impl to RoPE
BOUND_ROPE_AND_GATE = BEFORE - 38  # and HF_RESOLVENT_MIXER_IMPL=triton: the gate's "auto" takes it too


def _launches_per_layer(mixer: str) -> int:
    """Launches of a training step (forward and backward) with two layers less those with one."""
    ids = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(0))
    counts = []
    nan_fill = kernels.set_nan_fill(False)  # outputs allocated as they are outside the tests (a NaN fill launches)
    try:
        for n_layer in (1, 2):
            model = _model(mixer, "triton", n_layer)
            _step(model, ids)  # a first step may allocate what the next ones reuse
            model.zero_grad()
            with OpCounter() as counter:
                model(ids, labels=ids).loss.backward()
            counts.append(counter.n_launches)
    finally:
        kernels.set_nan_fill(nan_fill)
    return counts[1] - counts[0]


def test_a_training_step_launches_fewer_kernels_per_layer(monkeypatch):
    ours = _launches_per_layer("exp2:ce")
    assert ours <= BOUND_ROPE, f"{ours} launches per layer, over the bound of {BOUND_ROPE}"
    monkeypatch.setenv(dispatch.ENV, "triton")
    with_gate = _launches_per_layer("exp2:ce")
    assert with_gate <= BOUND_ROPE_AND_GATE, f"{with_gate} launches per layer, over the bound of {BOUND_ROPE_AND_GATE}"


def test_the_launch_bound_fails_without_the_twins(monkeypatch):
    """The bounds above can fail: with the twins' choice switched off, the count is the one before them."""
    for module in (rope, mixer):
        monkeypatch.setattr(module, "triton_twin_runs", lambda impl, *tensors: False)
    monkeypatch.setenv(dispatch.ENV, "triton")
    assert _launches_per_layer("exp2:ce") > BOUND_ROPE
