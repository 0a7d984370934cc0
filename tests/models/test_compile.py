"""torch.compile of the model: a full forward of every mixer family (the graph form of the parallel mixer, with
left and right padding), a training step's gradients, the decode step of every mixer on a static cache
(fullgraph=True), and the input checks inside a compiled graph."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, family_model
from transformers import CompileConfig

import hf_resolvent as hr

pytestmark = pytest.mark.usefixtures("one_thread_module")


def tiny_model(**kw) -> hr.ResolventForCausalLM:
    fields = dict(vocab_size=61, n_positions=32, n_embd=32, n_layer=2, n_head=2, mixer="attention", bos_token_id=0,
                  eos_token_id=None)
    fields.update(kw)
    torch.manual_seed(0)
    return hr.ResolventForCausalLM(hr.ResolventConfig(**fields)).eval()


def test_fullgraph_compile_equals_eager_and_keeps_the_input_checks():
    model = tiny_model()
    compiled = torch.compile(model, fullgraph=True)
    ids = torch.randint(1, 61, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                   atol=1e-5, rtol=1e-5)
        bad = ids.clone()
        bad[1, 5] = 99
        with pytest.raises(RuntimeError, match=r"input_ids outside the vocabulary \(vocab_size = 61\)"):
            compiled(bad, use_cache=False)
        with pytest.raises(ValueError, match="holds the token id 99, outside the vocabulary"):  # eager: the value
            model(bad, use_cache=False)


def padded_batch(n: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (3, n) and their mask: a full row, a left-padded one and a right-padded one."""
    ids = torch.randint(1, 61, (3, n), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    mask[2, -5:] = 0
    return ids, mask


@pytest.mark.parametrize("conv_size", [0, 4])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fullgraph_forward_of_every_family_equals_eager(family, conv_size):
    """One graph (dynamo's eager backend: the trace itself) for the whole forward, padding included, with and
    without a short convolution; the logits of real tokens equal the eager forward's (the parallel form on the CPU
    kernels) to 1e-5."""
    model = family_model(family, conv_size=conv_size)
    ids, mask = padded_batch()
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(ids, attention_mask=mask, use_cache=False).logits
        got = torch.compile(model, fullgraph=True, backend="eager")(ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("conv_size", [0, 4])
def test_compiled_training_step_gradients_equal_eager(conv_size):
    """A training step compiled by inductor (fullgraph, forward and backward) for a cache-efficient sparse layer and a
    tied dense one, with left and right padding: loss and every parameter's gradient equal eager to 1e-5. (Dynamo's
    aot_eager backend fails on this backward: it views a linear layer's gradient that inductor's lowering
    reshapes.)"""
    model = tiny_model(mixer=["exp2:ce", "dense+tied"], resid_pdrop=0.0, embd_pdrop=0.0,
                       conv_size=conv_size).train()  # no dropout: the two runs draw no random numbers
    ids, mask = padded_batch(32)
    labels = ids.masked_fill(mask == 0, -100)

    def grads(run):
        model.zero_grad(set_to_none=True)
        loss = run(ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    torch._dynamo.reset()
    want_loss, want = grads(model)
    got_loss, got = grads(torch.compile(model, fullgraph=True))
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)


def test_the_cpu_backend_named_inside_a_graph_is_refused_not_replaced():
    """A graph cannot hold the C++ kernels: tracing the mixer with impl='cpu' is an error (without fullgraph,
    the compiler runs that part eagerly, on the kernels named)."""
    model = tiny_model(mixer="exp2", mixer_impl="cpu")
    with pytest.raises(Exception, match="impl='cpu' cannot run inside torch.compile"):
        torch.compile(model, fullgraph=True)(torch.randint(1, 61, (1, 8)), use_cache=False)


@pytest.mark.parametrize("conv_size", [0, 4])
def test_inductor_compiled_static_decoding_equals_eager(conv_size):
    """A hybrid stack of every kind of decode state (register, window, every position, tied), decoded by generate()
    with a static cache and inductor's compiled step: one graph for all tokens, logits equal to eager decoding on the
    growing cache to 1e-5 (float32)."""
    model = tiny_model(mixer=["exp2:ce", "banded:3", "dense+tied"], n_layer=3, initializer_range=0.3,
                       pad_token_id=0, conv_size=conv_size)
    ids = torch.randint(1, 61, (2, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want = model.generate(ids, **kw)
    config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
    config._compile_all_devices = True  # transformers' switch for compiling on a CPU
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = model.generate(ids, cache_implementation="static", compile_config=config, **kw)
        # the next generation takes the same buffers (fixed addresses, marked static for the compiler) and graph
        buffers = {k: t.data_ptr() for layer in model._static_cache.layers for k, t in layer.state.buffers().items()}
        again = model.generate(ids, cache_implementation="static", compile_config=config, **kw)
    assert buffers == {k: t.data_ptr() for layer in model._static_cache.layers for k, t in layer.state.buffers().items()}
    assert all(getattr(t, "_dynamo_static_input_type", None) for layer in model._static_cache.layers
               for t in layer.state.buffers().values())
    for run in (got, again):
        assert torch.equal(run.sequences, want.sequences)
        for step, (a, b) in enumerate(zip(run.logits, want.logits)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"new token {step}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fullgraph_forward_with_the_default_cache_continues_like_eager(family):
    """An eval-mode forward with the defaults (use_cache=True) in one graph, left padding included: the cache built
    inside the graph (static widths for the register, runtime asserts for start) continues three tokens exactly as
    the eager prefill's cache does."""
    model = family_model(family)
    ids, mask = padded_batch(19)
    mask[2] = 1  # a left-padded batch, which a cache can continue
    new = torch.randint(1, 61, (3, 3), generator=torch.Generator().manual_seed(3))
    longer = torch.cat([mask, torch.ones_like(new)], dim=1)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, backend="eager")(ids, attention_mask=mask)
        eager = model(ids, attention_mask=mask)
        got = model(new, attention_mask=longer, past_key_values=compiled.past_key_values).logits
        want = model(new, attention_mask=longer, past_key_values=eager.past_key_values).logits
    real = mask.bool()
    torch.testing.assert_close(compiled.logits[real], eager.logits[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
