"""Attention masks with holes (zeros between real tokens): a hidden position is in no later row's P^A or P^B, for
every mixer; each sequence computes what its real tokens compute alone, and generation continues from it."""

from __future__ import annotations

import pytest
import torch

import hf_resolvent as hr

pytestmark = pytest.mark.usefixtures("one_thread_module")

MIXERS = ["attention", "local_attention:3", "dense", "banded:2", "diagonal", "exp2", "exp2:ce", "square:ce",
          "dense+tied", ["exp2:ce", "attention"]]


def tiny_model(mixer, **kw) -> hr.ResolventForCausalLM:
    fields = dict(vocab_size=61, n_positions=64, n_embd=32, n_layer=2, n_head=2, mixer=mixer, bos_token_id=0,
                  eos_token_id=None, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, initializer_range=0.2)
    fields.update(kw)
    torch.manual_seed(0)
    model = hr.ResolventForCausalLM(hr.ResolventConfig(**fields)).eval()
    model.generation_config.suppress_tokens = [0]
    return model


@pytest.mark.parametrize("mixer", MIXERS, ids=lambda m: "+".join(m) if isinstance(m, list) else m)
def test_hidden_positions_are_read_by_no_later_row(mixer):
    model = tiny_model(mixer)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 61, (3, 10), generator=gen)
    mask = torch.tensor([[1, 0, 1, 1, 0, 0, 1, 1, 1, 1],
                         [0, 0, 1, 1, 1, 0, 1, 1, 1, 1],   # left padding and a hole
                         [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_hidden_states=True)
        for b in range(3):
            real = mask[b].bool()
            alone = model(ids[b][real][None]).logits[0]
            torch.testing.assert_close(out.logits[b][real], alone, atol=1e-5, rtol=1e-5)
            assert (out.logits[b][~real] == 0).all() and (out.hidden_states[-1][b][~real] == 0).all()
        # a hidden token's value does not matter
        other = ids.masked_fill(~mask.bool(), 7)
        torch.testing.assert_close(model(other, attention_mask=mask).logits, out.logits, atol=0, rtol=0)


@pytest.mark.parametrize("mixer", ["exp2:ce", "dense", ["exp2:ce", "attention"]], ids=str)
def test_generation_continues_after_a_prompt_with_holes(mixer):
    model = tiny_model(mixer)
    ids = torch.randint(1, 61, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 1, 1, 1, 1]])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    for b in range(2):
        real = ids[b][mask[b].bool()][None]
        assert torch.equal(out[b, 8:], model.generate(real, max_new_tokens=6, do_sample=False)[0, real.shape[1]:])


@pytest.mark.parametrize("layout", ["holes", "packed"])
def test_returned_hidden_states_are_on_the_gradient_path(layout):
    """transformers' test_retain_grad_hidden_states_attentions with a regrouped batch (a mask with holes, or packed
    documents): every returned hidden state gets a gradient, and asking for them changes no logit."""
    model = tiny_model("exp2:ce").train()
    ids = torch.randint(1, 61, (2, 8), generator=torch.Generator().manual_seed(3))
    if layout == "holes":
        kw = dict(attention_mask=torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 1, 1, 1, 1]]))
    else:
        kw = dict(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]]))
    out = model(ids, output_hidden_states=True, **kw)
    for h in out.hidden_states:
        h.retain_grad()
    out.logits.sum().backward()
    assert all(h.grad is not None and h.grad.abs().sum() > 0 for h in out.hidden_states)
    with torch.no_grad():
        assert torch.equal(model(ids, **kw).logits, out.logits)
