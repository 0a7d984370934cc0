"""The compiled CPU kernels (hf_resolvent/csrc, loaded by hf_resolvent.ops.cpu_kernels): their checks, their
gradients, and the fallback to the PyTorch path when they cannot be built.

Their agreement with the PyTorch path and the reference runs in test_mixer.py and test_parallel_internals.py
(the ``cpu_path`` fixture runs those tests on both paths).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_resolvent.ops import cpu_kernels, parallel_mix, reference_mix
from hf_resolvent.ops.slots import SlotCombine, slot_layout, slot_probs
from hf_resolvent.ops.solve import SparseSolve
from hf_resolvent.patterns import get_pattern

F64 = torch.float64


@pytest.fixture(autouse=True)
def compiled():
    assert cpu_kernels.available(), "the compiled CPU kernels did not build (see the warning)"


@pytest.mark.parametrize("spec", ["square:ce", "exp2", "banded:3"])
def test_compiled_functions_gradcheck(spec):
    n = 29
    layout = slot_layout(get_pattern(spec), n)
    gen = torch.Generator().manual_seed(3)
    w = (torch.rand(1, 2, layout.num_slots, n, generator=gen, dtype=F64) / layout.num_slots).requires_grad_()
    z, q, k = (torch.randn(1, 2, n, 3, generator=gen, dtype=F64, requires_grad=True) for _ in range(3))
    assert cpu_kernels.compiled_for(w, z)
    assert torch.autograd.gradcheck(lambda w_, z_: SparseSolve.apply(w_, z_, layout, 8), (w, z))
    assert torch.autograd.gradcheck(lambda a, b: slot_probs(a, b, layout, 0.8), (q, k))
    assert torch.autograd.gradcheck(lambda a, b: SlotCombine.apply(a, b, layout), (w, z))


def test_compiled_path_is_taken_and_matches_the_reference():
    """A float32 mixer on CPU runs the kernels (the profiler sees them) and agrees with the reference."""
    gen = torch.Generator().manual_seed(0)
    qa, ka, qb, kb, x = (torch.randn(2, 2, 70, 8, generator=gen) for _ in range(5))
    g = torch.rand(2, 2, 70, generator=gen)
    with torch.profiler.profile() as prof:
        y = parallel_mix(qa, ka, qb, kb, x, g, "square:ce")
    names = {e.name for e in prof.events()}
    assert {"hf_resolvent::slot_probs", "hf_resolvent::slot_combine", "hf_resolvent::slot_solve"} <= names
    torch.testing.assert_close(y, reference_mix(qa, ka, qb, kb, x, g, "square:ce"), atol=1e-5, rtol=1e-5)


def test_kernels_check_their_inputs():
    ops = cpu_kernels.compiled_ops()
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


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    def no_compiler(**kwargs):
        raise OSError("c++: command not found")

    monkeypatch.setattr(cpu_kernels, "_state", {})  # as in a fresh process
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    x = torch.randn(1, 2, 40, 4)
    with pytest.warns(RuntimeWarning, match="could not be built .*c\\+\\+: command not found.*PyTorch path"):
        assert not cpu_kernels.compiled_for(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second build, no second warning
        assert not cpu_kernels.compiled_for(x)
    gen = torch.Generator().manual_seed(1)
    qa, ka, qb, kb = (torch.randn(1, 2, 40, 4, generator=gen) for _ in range(4))
    g = torch.rand(1, 2, 40, generator=gen)
    with torch.profiler.profile() as prof:
        y = parallel_mix(qa, ka, qb, kb, x, g, "exp2")
    assert not any(e.name.startswith("hf_resolvent::") for e in prof.events())
    torch.testing.assert_close(y, reference_mix(qa, ka, qb, kb, x, g, "exp2"), atol=1e-5, rtol=1e-5)


def test_environment_switch_skips_the_build(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("HF_RESOLVENT_CPU_KERNELS", "0")
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("the build must be skipped"))
    assert not cpu_kernels.available()


def test_other_dtypes_and_devices_take_the_pytorch_path():
    assert not cpu_kernels.compiled_for(torch.zeros(2, dtype=torch.bfloat16))
    assert not cpu_kernels.compiled_for(torch.zeros(2, device="meta"))
    assert cpu_kernels.compiled_for(torch.zeros(2), torch.zeros(2, dtype=F64))
