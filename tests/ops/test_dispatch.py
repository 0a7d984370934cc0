"""The one switch (hf_resolvent.ops.dispatch): which code runs a mixer call, with what precedence, and the errors
when a named backend cannot run. The backends' agreement with the forms is tested in test_mixer.py,
tests/backends/test_cpu.py and tests/backends/test_triton.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hf_resolvent as hr
from hf_resolvent.backends import cpu
from hf_resolvent.configuration_resolvent import MIXER_IMPLS
from hf_resolvent.ops import DecodeState, decode_step, dispatch, mixer, reference_mix, resolvent_mix
from hf_resolvent.patterns import get_pattern

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(n=40, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    qa, ka, qb, kb, x = (torch.randn(1, 2, n, 8, generator=gen, requires_grad=requires_grad) for _ in range(5))
    g = torch.rand(1, 2, n, generator=gen).requires_grad_(requires_grad)
    return qa, ka, qb, kb, x, g


def _empty(spec="exp2") -> DecodeState:
    """A state before the first token of batch 1, 2 heads, width 8."""
    return DecodeState.empty(spec, dict.fromkeys(DecodeState.NAMES, 8), 1, 2)


def _cpu_ops_run(fn) -> set[str]:
    """The CPU kernels' operators that ``fn`` calls."""
    with torch.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("hf_resolvent::")}


def test_the_backend_table_of_the_architecture_page_is_the_modules():
    """docs/ARCHITECTURE.md shows the dispatch module's table of backends, a row per backend of mixer.BACKENDS."""

    def table(text: str) -> list[str]:
        rows = text[text.index("<!-- backend table -->"):text.index("<!-- end of backend table -->")].splitlines()[1:]
        return [row.strip() for row in rows if row.strip()]

    page = table((Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md").read_text())
    assert page == table(dispatch.__doc__)
    assert [row.split(" | ")[0].strip("| `\"") for row in page[2:]] == list(mixer.BACKENDS)


def test_the_config_accepts_exactly_the_choices_of_the_switch():
    assert MIXER_IMPLS == dispatch.IMPLS
    with pytest.raises(ValueError, match="mixer_impl must be one of .*got 'cuda'"):
        hr.ResolventConfig(mixer_impl="cuda")
    with pytest.raises(ValueError, match="mixer_impl='graph' names a form of the mixer, not a backend"):
        hr.ResolventConfig(mixer_impl="graph")


def test_precedence_argument_then_environment_then_auto(monkeypatch):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    assert dispatch.resolve(None) == dispatch.resolve("auto") == "auto"
    monkeypatch.setenv(dispatch.ENV, "torch")
    assert dispatch.resolve("auto") == "torch"  # "auto" names nothing: the environment decides
    assert dispatch.resolve("cpu") == "cpu"  # an argument beats the environment
    monkeypatch.setenv(dispatch.ENV, "gpu")
    with pytest.raises(ValueError, match=f"{dispatch.ENV} must be one of .*got 'gpu'"):
        dispatch.resolve("auto")
    with pytest.raises(ValueError, match="impl must be one of .*got 'fast'"):
        dispatch.resolve("fast")
    monkeypatch.setenv(dispatch.ENV, "graph")  # a form, from either source, names the function to call instead
    with pytest.raises(ValueError, match=f"{dispatch.ENV}='graph' names a form, not a backend: call "
                                         "hf_resolvent.ops.graph_mix"):
        dispatch.resolve(None)
    monkeypatch.delenv(dispatch.ENV)
    with pytest.raises(ValueError, match="impl='recurrent' names a form, not a backend: call hf_resolvent.ops"
                                         ".recurrent_mix"):
        dispatch.resolve("recurrent")


@pytest.mark.parametrize("spec", ["exp2:ce", "dense"])
def test_torch_and_cpu_run_what_they_name_in_forward_and_backward(spec):
    assert cpu.available(), "the compiled CPU kernels did not build (see the warning)"
    qa, ka, qb, kb, x, g = _inputs(requires_grad=True)
    ref = reference_mix(qa, ka, qb, kb, x, g, spec)
    for impl, expect_cpu_kernels in (("torch", False), ("cpu", True), ("auto", True)):
        out = {}

        def step(out=out, impl=impl):
            out["y"] = resolvent_mix(qa, ka, qb, kb, x, g, spec, impl=impl)
            out["y"].square().sum().backward()  # the backward keeps the forward's path

        ran = _cpu_ops_run(step)
        assert bool(ran) == expect_cpu_kernels, (impl, ran)
        if expect_cpu_kernels:  # both directions ran compiled
            assert any("backward" in name or "transpose" in name or "scatter" in name for name in ran), ran
        torch.testing.assert_close(out["y"], ref, atol=1e-5, rtol=1e-5)
        for t in (qa, ka, qb, kb, x, g):
            t.grad = None


def test_the_environment_reaches_the_model_and_the_config_beats_it(monkeypatch):
    config = hr.ResolventConfig(vocab_size=40, n_positions=64, n_embd=32, n_layer=1, n_head=2, mixer="exp2")
    model = hr.ResolventForCausalLM(config).eval()
    ids = torch.randint(0, 40, (1, 24))
    monkeypatch.setenv(dispatch.ENV, "torch")
    assert not _cpu_ops_run(lambda: model(ids))
    model.config.mixer_impl = "cpu"
    assert _cpu_ops_run(lambda: model(ids))
    monkeypatch.setenv(dispatch.ENV, "torch")
    model.config.mixer_impl = "auto"
    assert not _cpu_ops_run(lambda: model(ids))


def test_a_named_backend_that_cannot_run_is_an_error_not_a_fallback(monkeypatch):
    qa, ka, qb, kb, x, g = _inputs()
    meta = torch.empty(1, 2, 4, 8, device="meta")
    with pytest.raises(RuntimeError, match="take CPU tensors, got tensors on meta; use impl='auto' or 'torch'"):
        dispatch.choose("cpu", meta)
    monkeypatch.setattr(cpu, "_state", {"ok": False})  # as after a failed build
    with pytest.raises(RuntimeError, match="compiled CPU kernels are not available here"):
        resolvent_mix(qa, ka, qb, kb, x, g, "exp2", impl="cpu")
    torch.testing.assert_close(resolvent_mix(qa, ka, qb, kb, x, g, "exp2"), reference_mix(qa, ka, qb, kb, x, g, "exp2"),
                               atol=1e-5, rtol=1e-5)  # "auto" falls back: it named nothing


def test_decoding_runs_the_recurrent_step_except_on_triton(monkeypatch):
    """On CPU the recurrent step runs its compiled twin unless impl="torch" asks for PyTorch alone; a named "cpu"
    that cannot run is an error, not a fallback."""
    qa, ka, qb, kb, x, g = _inputs(n=1)
    for impl in ("auto", "cpu", "torch"):
        assert dispatch.choose(impl, x) == impl.replace("auto", "cpu")
    token = (qa[:, :, 0], ka[:, :, 0], qb[:, :, 0], kb[:, :, 0], x[:, :, 0], g[:, :, 0])
    ran = {}
    for impl in ("cpu", "torch"):
        with torch.profiler.profile() as prof:
            y = decode_step(_empty(), *token, "exp2", impl=impl)
        assert y.shape == (1, 2, 8)
        ran[impl] = "hf_resolvent::decode_step" in {e.name for e in prof.events()}
    assert ran == {"cpu": True, "torch": False}
    monkeypatch.setattr(cpu, "_state", {"ok": False})  # as after a failed build
    with pytest.raises(RuntimeError, match="compiled CPU kernels are not available here"):
        decode_step(_empty(), *token, "exp2", impl="cpu")
    assert decode_step(_empty(), *token, "exp2").shape == (1, 2, 8)  # "auto" falls back: it named nothing


class _OnCuda:
    """Stands for a CUDA tensor where the dispatch asks only where a tensor lives."""

    is_cuda = True
    device = torch.device("cuda")


def test_softmax_attention_alone_takes_sdpa_on_a_gpu(monkeypatch):
    """Under "auto", CUDA tensors take the "cuda" backend: the attention pattern runs scaled_dot_product_attention
    (the backend a transformers model gets), every other pattern Triton; "torch" and a named "triton" keep their
    paths."""
    monkeypatch.setattr(dispatch, "triton_ready", lambda: True)
    assert dispatch.choose("auto", _OnCuda()) == "cuda"
    assert dispatch.choose("triton", _OnCuda()) == "triton" and dispatch.choose("torch", _OnCuda()) == "torch"
    assert dispatch.choose("auto", torch.empty(1)) != "cuda"  # a CPU tensor
    ran = []
    monkeypatch.setattr(mixer, "sdpa_mix", lambda *a: ran.append("sdpa"))
    monkeypatch.setattr(mixer, "triton", lambda: type("Triton", (), {"triton_mix": lambda *a, **k: ran.append("triton")}))
    for spec in ("attention", "dense", "local_attention:8"):
        mixer.BACKENDS["cuda"].mix(*(None,) * 6, get_pattern(spec))
    assert ran == ["sdpa", "triton", "triton"]
    monkeypatch.setattr(dispatch, "triton_ready", lambda: False)  # no Triton here: PyTorch
    assert dispatch.choose("auto", _OnCuda()) == "torch"
    monkeypatch.setattr(dispatch, "triton_ready", lambda: True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert dispatch.choose("auto", _OnCuda()) == "graph"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_sdpa_path_is_the_attention_pattern(dtype):
    """sdpa_mix, in the inputs' dtype, equals the reference mixer of the attention pattern, with left padding, and
    its gradients too."""
    from hf_resolvent.ops.parallel import sdpa_mix

    gen = torch.Generator().manual_seed(3)
    qa, ka, x = (torch.randn(3, 2, 19, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3))
    start = torch.tensor([0, 4, 11])
    want = reference_mix(qa, ka, None, None, x, None, "attention", start=start)
    low = [t.detach().to(dtype).requires_grad_() for t in (qa, ka, x)]
    got = sdpa_mix(*low, start)
    assert got.dtype == dtype
    tol = 1e-10 if dtype == torch.float64 else 3e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((want * g).sum(), (qa, ka, x)),
                    torch.autograd.grad((got.double() * g).sum(), low)):
        torch.testing.assert_close(b.double(), a, atol=tol * 4, rtol=tol * 4)


def test_a_graph_takes_the_graph_form(monkeypatch):
    """Inside torch.compile / torch.export the eager parallel form's slices and kernels do not trace: "auto" and
    "torch" run the graph form there (and only there)."""
    x = torch.empty(1, 2, 4, 8)
    assert dispatch.choose("torch", x) == "torch"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for impl in ("auto", "torch"):
        assert dispatch.choose(impl, x) == "graph", impl
