"""A decode step launches few kernels: the kernel-launching aten calls (and Triton launches) of one generated token,
per layer, on the Triton path (interpreted; scripts/bench/op_counts.py counts a Triton launch as one, as on a GPU),
within 1.5x those of GPT-2 (transformers, SDPA) of the same width and depth with its dynamic cache, for every mixer
family, with the growing cache and with the static one (whose step, eager, works out its own positions per layer).

On a GPU each launch costs the host a few microseconds, which at this model size is most of a decode step.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, VOCAB, family_model, load_script
from transformers import GPT2Config, GPT2LMHeadModel

import hf_resolvent as hr

OpCounter = load_script("bench/op_counts").OpCounter

pytestmark = pytest.mark.usefixtures("one_thread_module")


def _launches_per_layer(model, cache) -> float:
    """Launches of the third token after a left-padded prefill (the first two may grow buffers), per layer."""
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    name = hr.modeling_resolvent.CACHE_NAME  # the installed transformers' name of the cache argument
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True, **{name: cache})
        for _ in range(3):
            token = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            with OpCounter() as counter:
                out = model(token, attention_mask=mask, use_cache=True, **{name: out[name]})
    return counter.n_launches / model.config.n_layer


def _gpt2_launches_per_layer(n_layer: int) -> float:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=128, bos_token_id=0,
                        eos_token_id=0, attn_implementation="sdpa")
    model = GPT2LMHeadModel(config).eval()
    return _launches_per_layer(model, None)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_decode_step_launches_at_most_one_and_a_half_times_gpt2s_kernels(family, static, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = family_model(family, mixer_impl="triton")
    ours = _launches_per_layer(model, hr.ResolventCache(model.config, max_cache_len=32 if static else None))
    gpt2 = _gpt2_launches_per_layer(model.config.n_layer)
    assert ours <= 1.5 * gpt2, f"{family}: {ours:.1f} launches per layer against GPT-2's {gpt2:.1f}"


def test_the_count_sees_a_launch_more_per_layer(monkeypatch):
    """The bound above can fail: one more op per layer in the mixer's step is counted."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = family_model("ce", mixer_impl="triton")
    before = _launches_per_layer(model, hr.ResolventCache(model.config))
    for block in model.transformer.h:
        out_proj = block.mixer.out_proj
        monkeypatch.setattr(out_proj, "forward", lambda x, _linear=out_proj: torch.nn.functional.linear(
            x, _linear.weight, _linear.bias).clone())
    after = _launches_per_layer(model, hr.ResolventCache(model.config))
    assert after == before + 1
