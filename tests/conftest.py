"""Shared helpers of the test suite: random mixer inputs, user-defined pattern functions, hypothesis set-up.

Shapes follow the library: B batch, H heads, n positions, d key width, e value width.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# The CPU is shared by several jobs: timing-based health checks would make property tests flaky.
settings.register_profile(
    "hf_resolvent",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("hf_resolvent")

# The tests run many small tensor ops; on a CPU shared with other jobs, intra-op threads spin and wait on
# each other (measured 10-20x slower with 2 threads than with 1 on a loaded 2-core machine).
# HF_RESOLVENT_TEST_THREADS overrides the count.
torch.set_num_threads(int(os.environ.get("HF_RESOLVENT_TEST_THREADS", "1")))


REPO = Path(__file__).resolve().parents[1]  # the repository's root
# The experiments import each other by name, as they do when run from their folder (python experiments/sweep.py).
sys.path.insert(0, str(REPO / "experiments"))


def load_script(name: str):
    """The module of ``scripts/<name>.py``, or of ``experiments/<name>.py`` for an experiment (neither folder is a
    package; ``bench/bench_mixer`` names one of ``scripts/bench/``), loaded afresh."""
    path = REPO / "scripts" / f"{name}.py"
    if not path.exists():
        path = REPO / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_script_{name.replace('/', '_')}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # where dataclasses look a module's annotations up
    spec.loader.exec_module(mod)
    return mod


def cubic_plus_one(k: int) -> int:
    """A user pattern function given as a Python callable: f(k) = k^3 + 1 (f(0) = 1, so ':ce' works)."""
    return k**3 + 1


def make_mixer_inputs(
    batch: int = 2,
    heads: int = 3,
    n: int = 37,
    d: int = 8,
    e: int = 5,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    qk_scale: float = 1.0,
    gate_range: tuple[float, float] = (0.05, 0.95),
    requires_grad: bool = False,
) -> dict[str, torch.Tensor]:
    """Random inputs of the mixer as a dict with keys qa, ka, qb, kb (B, H, n, d), x (B, H, n, e),
    g (B, H, n) in ``gate_range`` and d_skip (B, H, n) (the tied variant's d).

    ``qk_scale`` multiplies queries and keys: larger values give sharper softmaxes.
    """
    gen = torch.Generator().manual_seed(seed)
    qa, ka, qb, kb = (torch.randn(batch, heads, n, d, generator=gen) * qk_scale for _ in range(4))
    x = torch.randn(batch, heads, n, e, generator=gen)
    lo, hi = gate_range
    g = lo + (hi - lo) * torch.rand(batch, heads, n, generator=gen)
    d_skip = 0.5 * torch.randn(batch, heads, n, generator=gen)
    out = {"qa": qa, "ka": ka, "qb": qb, "kb": kb, "x": x, "g": g, "d_skip": d_skip}
    return {k: v.to(dtype).requires_grad_(requires_grad) for k, v in out.items()}


def empty_state(pattern, inp: dict, start=None, tied: bool = False, capacity: int | None = None):
    """An ``ops.DecodeState`` before the first token of the mixer inputs ``inp`` (:func:`make_mixer_inputs`' keys):
    the rows a layer of ``pattern`` keeps (the tied variant's with ``tied``), buffers that grow or for ``capacity``
    tokens, in x's dtype."""
    from hf_resolvent.ops import DecodeState
    from hf_resolvent.patterns import get_pattern

    pattern = get_pattern(pattern)
    names = ("keys_b", "outputs") if tied else ("keys_a", "values") + (
        ("keys_b", "outputs") if pattern.has_recurrence else ())
    x, key = inp["x"], inp["ka"] if inp.get("ka") is not None else inp["kb"]
    widths = {name: (x if name in ("values", "outputs") else key).shape[-1] for name in names}
    return DecodeState.empty(pattern, widths, x.shape[0], x.shape[1], capacity, x.dtype, x.device, start=start)


@pytest.fixture(params=["compiled", "torch"])
def cpu_path(request):
    """Runs a test on both CPU paths of the parallel form: the compiled kernels (hf_resolvent.backends.cpu) and
    the PyTorch code they replace. The compiled one must build here: a failed build fails the test."""
    from hf_resolvent.backends import cpu
    from hf_resolvent.ops import dispatch

    if request.param == "torch":
        with dispatch.torch_only():
            yield request.param
        return
    assert cpu.available(), "the compiled CPU kernels did not build (see the warning)"
    yield request.param


@pytest.fixture
def torch_path():
    """Runs a test on the PyTorch code of the parallel form only (its chunked solve's plan, say)."""
    from hf_resolvent.ops import dispatch

    with dispatch.torch_only():
        yield


def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Tiny shapes: intra-op thread hand-offs would dominate on a loaded machine (gradcheck runs thousands of tiny
# forwards). Both set one thread whatever HF_RESOLVENT_TEST_THREADS says, and restore the count afterwards.
one_thread = pytest.fixture(_one_thread, name="one_thread")
one_thread_module = pytest.fixture(_one_thread, scope="module", name="one_thread_module")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A prepared data folder of the offline corpus, small: 12 documents, a 300-token BPE."""
    from hf_resolvent.training import data

    out = tmp_path_factory.mktemp("data")
    data.prepare_dataset(out, source=data.STDLIB, tokenizer="bpe", vocab_size=300, max_docs=12, num_proc=1,
                         log=lambda *a: None)
    return out


def tiny_run_args(data_dir, out, *extra) -> list[str]:
    """scripts/pretrain.py arguments for a run of a 2-layer width-32 model on ``data_dir`` (seconds per run)."""
    return ["--config", "tiny", "--data", str(data_dir), "--output-dir", str(out), "--quiet",
            "--set", "model.overrides={n_layer: 2, n_embd: 32, n_head: 2, n_inner: 64, n_positions: 64}",
            "--set", "data.seq_len=32", "--set", "train.batch_size=4", "--set", "train.micro_batch=2",
            "--set", "train.warmup_steps=2", "--set", "eval.max_windows=4", "--set", "eval.micro_batch=4",
            "--set", "log.every=1", "--set", "log.trackers=none", "--eval-every", "3", "--save-every", "3",
            *extra]


@pytest.fixture
def mixer_inputs():
    """Factory fixture: ``mixer_inputs(batch=..., n=..., ...)`` -> dict of inputs (see make_mixer_inputs)."""
    return make_mixer_inputs


# One tiny model per mixer family: the generation, compile and export tests run each.
FAMILIES = {
    "attention": "attention",
    "local": "local_attention:4",
    "dense": "dense",
    "banded": "banded:3",
    "diagonal": "diagonal",
    "sparse": "exp2",
    "ce": "exp2:ce",
    "square-ce": "square:ce",
    "tied": "exp2:ce+tied",
    "hybrid": ["exp2:ce", "dense+tied", "attention"],
}

VOCAB = 61


def family_model(family: str, seed: int = 0, **kw):
    """A tiny causal LM of a mixer family of FAMILIES (2 layers, or one per mixer of a hybrid), in eval mode."""
    import hf_resolvent as hr

    mixer = FAMILIES[family]
    fields = dict(vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=len(mixer) if isinstance(mixer, list) else 2,
                  n_head=2, bos_token_id=0, eos_token_id=None, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                  initializer_range=0.3)  # wide enough that greedy decoding does not settle on one token
    fields.update(kw)
    torch.manual_seed(seed)
    model = hr.ResolventForCausalLM(hr.ResolventConfig(mixer=mixer, **fields)).eval()
    # A generated pad token would read as a hole in the mask that generate() derives from the ids when it continues.
    model.generation_config.suppress_tokens = [fields["pad_token_id"]]
    return model


def remote_code_logits(folder: Path, ids: torch.Tensor, workdir: Path, check: str = "") -> torch.Tensor:
    """The logits for ``ids`` of the model saved in ``folder``, loaded with ``trust_remote_code`` in a process where
    hf_resolvent cannot be imported; ``check``, a line of Python run there first, sees the model as ``m``."""
    torch.save(ids, workdir / "ids.pt")
    code = (
        "import sys, torch; sys.modules['hf_resolvent'] = None\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()\n"
        f"ids = torch.load({str(workdir / 'ids.pt')!r})\n"
        f"{check}\n"
        f"with torch.no_grad(): torch.save(m(ids).logits, {str(workdir / 'got.pt')!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=workdir,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(workdir)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(workdir / "got.pt")
