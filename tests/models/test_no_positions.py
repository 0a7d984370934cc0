"""``position_embedding="none"``: no position encoding, as an SSM has. Order reaches the model only through causality
and the mixer's pattern; it works wherever RoPE does (the decode cache, padded batches, the static cache, remote
code); GPT-2 conversion refuses it."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, VOCAB, remote_code_logits
from conftest import family_model as tiny_model

import hf_resolvent as hr

pytestmark = pytest.mark.usefixtures("one_thread_module")


def unpositioned(family: str, **kw):
    return tiny_model(family, position_embedding="none", **kw)


def test_the_model_has_no_position_parameters_and_attention_sees_an_unordered_prefix():
    model = unpositioned("attention", n_layer=1)  # one layer: a second would see order through causal prefixes
    assert model.transformer.wpe is None and model.transformer.rotary_emb is None
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    shuffled = torch.cat([ids[:, :-1][:, torch.randperm(8, generator=torch.Generator().manual_seed(1))], ids[:, -1:]],
                         1)
    with torch.no_grad():  # attention without positions: the last token's output ignores the prefix's order
        torch.testing.assert_close(model(ids).logits[:, -1], model(shuffled).logits[:, -1], atol=1e-5, rtol=1e-5)
        sparse = unpositioned("ce", n_layer=1)  # exp2:ce's pattern reads positions 1, 2, 4, ... back: order matters
        assert not torch.allclose(sparse(ids).logits[:, -1], sparse(shuffled).logits[:, -1], atol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decoding_with_a_cache_equals_full_forwards(family):
    model = unpositioned(family)
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(greedy, model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False))
    assert torch.equal(greedy, model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static"))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids[:1, :4]], 1)
    mask = (torch.arange(7)[None] >= 3).long()
    alone = model.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
    out = model.generate(padded, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(out[:, 3:], alone)


def test_a_saved_model_loads_with_remote_code_and_gives_the_same_logits(tmp_path):
    model = unpositioned("hybrid")
    model.save_pretrained(tmp_path / "m")
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
    got = remote_code_logits(tmp_path / "m", ids, tmp_path, "assert m.config.position_embedding == 'none'")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the weights say which positions they were trained with: loading them into a RoPE config warns
    with pytest.warns(UserWarning, match="position_embedding='none'"):
        hr.ResolventForCausalLM.from_pretrained(tmp_path / "m", position_embedding="rope")


def test_gpt2_conversion_and_bad_values_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32))
    with pytest.raises(ValueError, match="from_gpt2 with position_embedding='none'.*'learned'"):
        hr.ResolventForCausalLM.from_gpt2(gpt2, position_embedding="none")
    with pytest.raises(ValueError, match="position_embedding must be one of 'rope', 'learned', 'none', got 'nope'"):
        hr.ResolventConfig(position_embedding="nope")
