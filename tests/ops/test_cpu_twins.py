"""The CPU twins (hf_resolvent.ops.dispatch.CPU_TWINS): each PyTorch function with a twin on the CPU kernels runs
the twin's operators exactly when its twin says it takes the call, for tensors of several kinds, and the cases where
it does are pinned here. That the twins compute what the PyTorch code computes is tested in
tests/backends/test_cpu.py, test_mixer.py and test_parallel_internals.py."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch

import hf_resolvent.ops.conv
import hf_resolvent.ops.gelu
import hf_resolvent.ops.rope  # noqa: F401  (conv, gelu and rope declare their twins on import, as the model imports them)
from hf_resolvent.backends import cpu
from hf_resolvent.ops import DecodeState, dispatch, extend_mix, recurrent_step
from hf_resolvent.ops.attention import causal_attention
from hf_resolvent.ops.conv import causal_conv_silu
from hf_resolvent.ops.dense_solve import dense_solve
from hf_resolvent.ops.gelu import gelu_tanh
from hf_resolvent.ops.rope import rotated_heads
from hf_resolvent.ops.slots import slot_combine, slot_dot, slot_layout, slot_probs, slot_scatter
from hf_resolvent.ops.sparse_solve import SparseSolve
from hf_resolvent.patterns import get_pattern

pytestmark = pytest.mark.usefixtures("one_thread")

N, SPEC = 24, "exp2:ce"


@dataclass(frozen=True)
class Case:
    """The tensors a recipe gets: dtype, whether they record gradients, whether their last two dimensions are
    transposed in memory (not contiguous), whether the call runs inside ``dispatch.torch_only()``."""

    dtype: torch.dtype = torch.float32
    grad: bool = False
    strided: bool = False
    torch_only: bool = False


CASES = {
    "float32": Case(),
    "float32, recording gradients": Case(grad=True),
    "float64": Case(dtype=torch.float64),
    "bfloat16": Case(dtype=torch.bfloat16),
    "float32, not contiguous": Case(strided=True),
    "float32, inside torch_only()": Case(torch_only=True),
}


class Maker:
    """Tensors of a case from seeded float64 values."""

    def __init__(self, case: Case):
        self.case, self.gen = case, torch.Generator().manual_seed(0)

    def __call__(self, *shape: int, kind: str = "normal", grad: bool | None = None) -> torch.Tensor:
        values = {"normal": lambda: torch.randn(shape, generator=self.gen, dtype=torch.float64),
                  "gate": lambda: torch.rand(shape, generator=self.gen, dtype=torch.float64),
                  "weights": lambda: torch.rand(shape, generator=self.gen, dtype=torch.float64) / 8}[kind]()
        t = values.to(self.case.dtype)
        if self.case.strided and t.dim() >= 2 and min(t.shape[-2:]) > 1:  # a (1, m) tensor is contiguous either way
            t = t.transpose(-1, -2).contiguous().transpose(-1, -2)
            assert not t.is_contiguous()
        return t.requires_grad_(self.case.grad if grad is None else grad)


def _backward(out) -> None:
    outs = out if isinstance(out, tuple) else (out,)
    if any(o.requires_grad for o in outs):
        sum(o.float().sum() for o in outs).backward()


def _layout():
    return slot_layout(get_pattern(SPEC), N)


def _slot_dot(t):
    with torch.no_grad():
        slot_dot(t(1, 2, N, 4), t(1, 2, N, 4), _layout())


def _slot_combine(t):
    layout = _layout()
    with torch.no_grad():
        slot_combine(t(1, 2, layout.num_slots, N, kind="weights"), t(1, 2, N, 4), layout)


def _slot_scatter(t):
    layout = _layout()
    with torch.no_grad():
        slot_scatter(t(1, 2, layout.num_slots, N, kind="weights"), t(1, 2, N, 4), layout)


def _slot_probs(t):
    _backward(slot_probs(t(1, 2, N, 4), t(1, 2, N, 4), _layout(), 0.5))


def _sparse_solve(t):
    layout = _layout()
    _backward(SparseSolve.apply(t(1, 2, layout.num_slots, N, kind="weights"), t(1, 2, N, 4), layout, 8))


def _dense_solve(t):
    _backward(dense_solve(t(1, 2, N, 4), t(1, 2, N, 4), t(1, 2, N, kind="gate"), t(1, 2, N, 4), 0.5, 8))


def _causal_attention(t):
    _backward(causal_attention(t(1, 2, N, 4), t(1, 2, N, 4), t(1, 2, N, 4), 0.5))


def _recurrent_mix(t):
    qa, ka, qb, kb, x = (t(1, 2, 4) for _ in range(5))
    state = DecodeState.empty(SPEC, dict.fromkeys(DecodeState.NAMES, 4), 1, 2, dtype=x.dtype)
    recurrent_step(state, qa, ka, qb, kb, x, t(1, 2, kind="gate"), SPEC)


def _extend_outputs(t):
    held = {name: t(1, 2, N, 4, grad=False) for name in ("keys_a", "values", "keys_b", "outputs")}
    state = DecodeState.from_prefill(SPEC, held)
    qa, ka, qb, kb, x = (t(1, 2, 3, 4) for _ in range(5))
    extend_mix(state, qa, ka, qb, kb, x, t(1, 2, 3, kind="gate"), SPEC)


def _gelu_tanh(t):
    _backward(gelu_tanh(t(4, 6)))


def _causal_conv_silu(t):
    _backward(causal_conv_silu(t(2, N + 3, 6), t(6, 1, 4), t(6)))


def _rotated_heads(t):
    angles = t(1, N, 2, grad=False).repeat(1, 1, 2)
    _backward(rotated_heads(t(1, N, 2, 2, 4), angles.cos(), angles.sin()))


RECIPES = {
    "slots.slot_dot": _slot_dot,
    "slots.slot_combine": _slot_combine,
    "slots.slot_scatter": _slot_scatter,
    "slots.slot_probs": _slot_probs,
    "sparse_solve.SparseSolve": _sparse_solve,
    "dense_solve.dense_solve": _dense_solve,
    "attention.causal_attention": _causal_attention,
    "recurrent._mix": _recurrent_mix,
    "extend._outputs": _extend_outputs,
    "gelu.gelu_tanh": _gelu_tanh,
    "conv.causal_conv_silu": _causal_conv_silu,
    "rope.rotated_heads": _rotated_heads,
}

# The cases where each function runs its twin. Everywhere: CPU tensors in float32 or float64, outside torch_only().
USUAL = {"float32", "float32, recording gradients", "float64", "float32, not contiguous"}
RUNS_TWIN = dict.fromkeys(RECIPES, USUAL) | {
    "recurrent._mix": USUAL - {"float32, recording gradients"},  # no backward
    # no backward; the extend path computes in float32 whatever the inputs' dtype
    "extend._outputs": USUAL - {"float32, recording gradients"} | {"bfloat16"},
    "gelu.gelu_tanh": USUAL - {"float32, not contiguous"},
    "conv.causal_conv_silu": USUAL - {"float32, not contiguous"},
    "rope.rotated_heads": {"float32", "float32, recording gradients"},  # float32, last dimension contiguous
}


def test_every_operator_of_the_cpu_kernels_has_a_pytorch_twin():
    assert cpu.available(), "the CPU kernels did not build (see the warning)"
    defined = {name.removeprefix("hf_resolvent::") for name in torch._C._dispatch_get_all_op_names()
               if name.startswith("hf_resolvent::")}
    named = {op for twin in dispatch.CPU_TWINS.values() for op in twin.operators}
    assert named == defined
    assert set(dispatch.CPU_TWINS) == set(RECIPES), "a twin without a recipe here, or a recipe without a twin"
    assert all(name == twin.name for name, twin in dispatch.CPU_TWINS.items())


def test_a_twin_is_declared_once():
    with pytest.raises(ValueError, match="the CPU twin of attention.causal_attention is already declared"):
        dispatch.cpu_twin("attention.causal_attention", ("causal_attention_forward",))


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("name", list(RECIPES))
def test_a_function_runs_its_twin_exactly_when_the_twin_takes_the_call(name, case_name, monkeypatch):
    assert cpu.available(), "the CPU kernels did not build (see the warning)"
    case, twin = CASES[case_name], dispatch.CPU_TWINS[name]
    said = []
    takes = dispatch.CpuTwin.takes

    def recorded(self, *args, **kwargs):
        answer = takes(self, *args, **kwargs)
        if self is twin:
            said.append(answer)
        return answer

    monkeypatch.setattr(dispatch.CpuTwin, "takes", recorded)
    with dispatch.torch_only() if case.torch_only else nullcontext(), torch.profiler.profile() as prof:
        try:
            RECIPES[name](Maker(case))
        except NotImplementedError:  # a PyTorch path without a bfloat16 kernel (the mixer computes in float32)
            assert case.dtype == torch.bfloat16
    ran = {e.name.removeprefix("hf_resolvent::") for e in prof.events() if e.name.startswith("hf_resolvent::")}
    assert said, f"{name} did not ask its twin"
    expected = case_name in RUNS_TWIN[name]
    assert any(said) == expected, (said, expected)
    if not expected:
        assert not ran & set(twin.operators), ran
    elif case.grad:  # forward and backward
        assert set(twin.operators) <= ran, ran
    else:
        assert ran & set(twin.operators), ran
