"""Export (hf_resolvent.export): the prefill and the decode step with torch.export, the decode step in ONNX with
onnxruntime, for a stack that holds every kind of decode state. A prompt runs through the exported prefill (or
through the exported step one token at a time), then 16 new tokens; every logit is held to the model's own full
forward over the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_resolvent as hr
from hf_resolvent.export import ResolventDecodeStep, export_decode_step, export_onnx, export_prefill

pytestmark = pytest.mark.usefixtures("one_thread_module")

MIXERS = ["exp2:ce", "banded:3", "dense+tied", "attention", "exp2"]  # register, window, every position, plain f


def tiny_model(positions: str = "rope", conv_size: int = 0) -> hr.ResolventForCausalLM:
    torch.manual_seed(0)
    config = hr.ResolventConfig(vocab_size=61, n_positions=64, n_embd=32, n_layer=len(MIXERS), n_head=2,
                                mixer=MIXERS, bos_token_id=0, eos_token_id=None, initializer_range=0.3,
                                position_embedding=positions, conv_size=conv_size)
    return hr.ResolventForCausalLM(config).eval()


def tokens_and_logits(model, batch: int = 2):
    """A prompt of 6 tokens and 16 greedy new ones, and the logits of one full forward over them."""
    ids = torch.randint(1, 61, (batch, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        seq = model.generate(ids, max_new_tokens=16, do_sample=False)
        return seq, model(seq, use_cache=False).logits


def run_steps(step, seq, state):
    """Feed seq (B, n) through ``step(ids, *state) -> (logits, *state)`` one token at a time: (B, n - 1, vocab)."""
    logits = []
    for i in range(seq.shape[1] - 1):
        out = step(seq[:, i:i + 1], *state)
        logits.append(out[0][:, 0])
        state = out[1:]
    return torch.stack(logits, 1)


VARIANTS = [("rope", 0), ("none", 0), ("rope", 4)]  # the last with a short convolution: its rows are state too


@pytest.mark.parametrize(("positions", "conv_size"), VARIANTS)
def test_torch_export_of_the_decode_step_runs_prompt_and_new_tokens(positions, conv_size):
    model = tiny_model(positions, conv_size)
    seq, want = tokens_and_logits(model)
    program = export_decode_step(model, batch_size=2, max_cache_len=32)
    step = ResolventDecodeStep(model, batch_size=2, max_cache_len=32)
    with torch.no_grad():
        got = run_steps(program.module(), seq, step.initial_state())
        eager = run_steps(step, seq, step.initial_state())
    torch.testing.assert_close(got, want[:, :-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eager, want[:, :-1], atol=1e-5, rtol=1e-5)
    assert step.state_names[:6] == ["layer0.keys_a", "layer0.keys_b", "layer0.values", "layer0.outputs",
                                    "layer0.positions", "layer0.seen"]
    assert ("layer0.conv" in step.state_names) == bool(conv_size)


@pytest.mark.parametrize("conv_size", [0, 4])
def test_torch_export_of_the_prefill_then_the_decode_step(conv_size):
    """The prefill program (the parallel form's graph) leaves the state the decode-step program continues from."""
    model = tiny_model(conv_size=conv_size)
    seq, want = tokens_and_logits(model)
    prefill = export_prefill(model, 6, batch_size=2, max_cache_len=32).module()
    step = export_decode_step(model, batch_size=2, max_cache_len=32).module()
    with torch.no_grad():
        out = prefill(seq[:, :6], *ResolventDecodeStep(model, batch_size=2, max_cache_len=32).initial_state())
        rest = run_steps(step, seq[:, 6:], out[1:])
    torch.testing.assert_close(out[0], want[:, :6], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rest, want[:, 6:-1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"length must lie in \[1, max_cache_len = 32\], got 33"):
        export_prefill(model, 33, max_cache_len=32)


def test_the_step_leaves_its_inputs_and_checks_their_count():
    model = tiny_model()
    step = ResolventDecodeStep(model, max_cache_len=8)
    state = step.initial_state()
    before = [t.clone() for t in state]
    with torch.no_grad():
        out = step(torch.tensor([[5]]), *state)
    assert all(torch.equal(a, b) for a, b in zip(state, before))
    assert int(out[1 + step.state_names.index("layer0.seen")]) == 1
    with pytest.raises(ValueError, match=f"expected {len(state)} state tensors"):
        step(torch.tensor([[5]]), *state[:-1])


@pytest.mark.parametrize(("positions", "conv_size"), VARIANTS)
def test_onnx_export_matches_pytorch_in_onnxruntime(tmp_path, positions, conv_size):
    import onnxruntime as ort  # in the dev extra, as onnx and onnxscript (the export extra)

    model = tiny_model(positions, conv_size)
    seq, want = tokens_and_logits(model, batch=1)
    path = export_onnx(model, tmp_path / "step.onnx", batch_size=1, max_cache_len=32)
    session = ort.InferenceSession(str(path))
    step = ResolventDecodeStep(model, batch_size=1, max_cache_len=32)
    names = ["input_ids", *step.state_names]
    assert [i.name for i in session.get_inputs()] == names
    assert [o.name for o in session.get_outputs()][:2] == ["logits", "layer0.keys_a.next"]

    def run(ids, *state):
        out = session.run(None, dict(zip(names, [ids.numpy(), *(np.asarray(t) for t in state)])))
        return [torch.from_numpy(o) for o in out]

    got = run_steps(run, seq, step.initial_state())
    torch.testing.assert_close(got, want[:, :-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("conv_size", [0, 4])
def test_torch_export_of_the_model_with_its_defaults_returns_a_cache_that_continues(conv_size):
    """torch.export.export(model, (ids,)) as users call it: eval mode, use_cache=True, so the output holds a
    ResolventCache (a registered pytree). The exported program's logits and cache equal eager ones, and the cache
    continues two tokens exactly as the eager prefill's does."""
    model = tiny_model(conv_size=conv_size)
    ids = torch.randint(1, 61, (2, 9), generator=torch.Generator().manual_seed(4))
    new = torch.randint(1, 61, (2, 2), generator=torch.Generator().manual_seed(5))
    program = torch.export.export(model, (ids,))
    with torch.no_grad():
        exported, eager = program.module()(ids), model(ids)
        assert isinstance(exported.past_key_values, hr.ResolventCache)
        got = model(new, past_key_values=exported.past_key_values).logits
        want = model(new, past_key_values=eager.past_key_values).logits
    torch.testing.assert_close(exported.logits, eager.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
