"""Packed sequences (position_ids restarting per document, as DataCollatorWithFlattening writes them): no mixer
lets a token read another document; each document computes exactly what it computes alone."""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening

import hf_resolvent as hr

pytestmark = pytest.mark.usefixtures("one_thread_module")

MIXERS = ["attention", "local_attention:4", "dense", "banded:3", "diagonal", "exp2", "exp2:ce", "square:ce",
          "exp2:ce+tied", ["exp2:ce", "dense"]]


def tiny_model(mixer, **kw) -> hr.ResolventForCausalLM:
    fields = dict(vocab_size=61, n_positions=64, n_embd=32, n_layer=2, n_head=2, mixer=mixer, bos_token_id=0,
                  eos_token_id=None, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0)
    fields.update(kw)
    torch.manual_seed(0)
    return hr.ResolventForCausalLM(hr.ResolventConfig(**fields))


def _documents(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 61, (k,), generator=gen) for k in lengths]


@pytest.mark.parametrize("mixer", MIXERS, ids=lambda m: "+".join(m) if isinstance(m, list) else m)
def test_each_packed_document_computes_what_it_computes_alone(mixer):
    model = tiny_model(mixer)
    rows = [_documents((5, 3, 7), seed=1), _documents((9, 1, 5), seed=2)]  # two rows of 15 tokens each
    ids = torch.stack([torch.cat(row) for row in rows])
    pos = torch.stack([torch.cat([torch.arange(len(d)) for d in row]) for row in rows])
    packed = model(ids, position_ids=pos).logits
    alone = torch.stack([torch.cat([model(d[None]).logits[0] for d in row]) for row in rows])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    # and the gradients: what a packed training step learns is what the documents teach one by one
    packed.square().mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    alone.square().mean().backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_data_collator_with_flattening_trains_on_separate_documents():
    model = tiny_model("exp2:ce")
    docs = _documents((6, 4, 9), seed=3)
    batch = DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in docs])
    assert batch["input_ids"].shape == (1, 19) and "position_ids" in batch
    loss = model(**batch).loss
    # the collator masks each document's first label: the mean over every other token of each document alone
    total = sum(model(d[None], labels=d[None]).loss * (len(d) - 1) for d in docs)
    torch.testing.assert_close(loss, total / sum(len(d) - 1 for d in docs), atol=1e-5, rtol=1e-5)


def test_packed_sequences_refuse_a_cache_and_left_padding():
    model = tiny_model("exp2:ce").eval()
    ids = torch.randint(1, 61, (1, 8))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    assert model(ids, position_ids=pos).past_key_values is None  # eval mode: no cache unless asked for
    with pytest.raises(ValueError, match="packed documents.*pass the documents as separate"):
        model(ids, position_ids=pos, use_cache=True)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="cannot be left-padded as well"):
        model(ids, position_ids=torch.tensor([[1, 1, 0, 1, 0, 1, 2, 3]]), attention_mask=mask)
    # generate()'s own position_ids for a left-padded prompt are not documents
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(out[0, 2:], model.generate(ids[:, 2:], max_new_tokens=3, do_sample=False)[0])


def test_a_right_padded_prompt_is_named_as_such():
    """generate() derives positions from a right-padded mask that restart inside the row (0, 1, 2, 3, 1, 1): they
    must not read as packed documents, and the error must say what the input is and how to pad it."""
    model = tiny_model("exp2:ce").eval()
    ids = torch.randint(1, 61, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])  # row 0 right-padded, row 1 left-padded
    positions = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)  # what generate() passes: (0, 1, 2, 3, 1, 1)
    for call in (lambda: model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0),
                 lambda: model(ids, attention_mask=mask, position_ids=positions)):  # beside a left-padded row
        with pytest.raises(ValueError, match=r"right-padded \(the attention mask of row 0 ends in zeros\).*"
                                             r"padding_side = 'left'") as err:
            call()
        assert "packed" not in str(err.value)
    model(ids, attention_mask=mask)  # training's forward takes right padding
    model(ids[:1], attention_mask=mask[:1], position_ids=positions[:1])  # alone, its pads are tokens of their own
