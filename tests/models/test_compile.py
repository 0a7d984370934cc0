"""torch.compile of the model: what compiles whole today (attention layers, fullgraph=True), and the input checks
inside a compiled graph. The resolvent mixers' PyTorch code still breaks the graph (numpy slot plans, a
data-dependent read rule); that is listed in the README table as not yet done."""

from __future__ import annotations

import pytest
import torch

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


def test_the_cpu_backend_named_inside_a_graph_is_refused_not_replaced():
    """A graph cannot hold the C++ kernels: tracing the mixer with impl='cpu' is an error (without fullgraph,
    the compiler runs that part eagerly, on the kernels named)."""
    model = tiny_model(mixer="exp2", mixer_impl="cpu")
    with pytest.raises(Exception, match="impl='cpu' cannot run inside torch.compile"):
        torch.compile(model, fullgraph=True)(torch.randint(1, 61, (1, 8)), use_cache=False)
