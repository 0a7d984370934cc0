"""Training through transformers: Trainer fine-tunes a tiny model; gradient checkpointing gives the same gradients."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments

import hf_resolvent as hr

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes: thread hand-offs would dominate


def tiny_model(mixer, seed=0, **kw) -> hr.ResolventForCausalLM:
    fields = dict(vocab_size=32, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=None,
                  resid_pdrop=0.0, embd_pdrop=0.0)
    fields.update(kw)
    torch.manual_seed(seed)
    return hr.ResolventForCausalLM(hr.ResolventConfig(mixer=mixer, **fields))


def _counting_dataset(rows: int, length: int, seed: int = 0) -> Dataset:
    """Sequences that count up by a per-row step (mod 32): learnable from the previous two tokens."""
    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(0, 32, (rows, 1), generator=gen)
    step = torch.randint(1, 4, (rows, 1), generator=gen)
    ids = (first + step * torch.arange(length)[None]) % 32
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def test_trainer_fine_tunes_and_loss_goes_down(tmp_path):
    model = tiny_model(["exp2:ce", "dense+tied"])
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=16, gradient_accumulation_steps=2, max_steps=40,
        learning_rate=1e-2, warmup_steps=0, logging_steps=5, save_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )
    train = _counting_dataset(256, 24)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=_counting_dataset(32, 24, seed=1))
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) >= 6
    assert losses[-1] < 0.7 * losses[0]
    assert after < 0.7 * before, (before, after)


@pytest.mark.parametrize("mixer, reentrant", [("dense", False), ("exp2:ce", False), ("square:ce+tied", True),
                                             ("attention", True)])
def test_gradient_checkpointing_gives_the_same_gradients(mixer, reentrant):
    ids = torch.randint(0, 32, (3, 20))
    grads, calls = [], []
    for checkpointing in (False, True):
        model = tiny_model(mixer, seed=1)
        if checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable({"use_reentrant": reentrant})
            else:
                model.gradient_checkpointing_enable({"use_reentrant": reentrant})
            assert all(block.gradient_checkpointing for block in model.transformer.h)
        count = [0]
        model.transformer.h[0].mixer.register_forward_hook(lambda *_, c=count: c.__setitem__(0, c[0] + 1))
        model.train()
        # a cache asked for while checkpointing is dropped (transformers clears it under its release's name): the
        # block's recompute in the backward pass would otherwise find the state its first pass wrote and decode
        out = model(ids, labels=ids, use_cache=checkpointing)
        out.loss.backward()
        calls.append(count[0])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert calls == [1, 2]  # checkpointing recomputed the block in the backward pass
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(model.parameters()))
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)
