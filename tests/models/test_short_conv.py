"""``conv_size``: a short depthwise causal convolution on the parts each mixer reads. Held to a convolution written
out by hand (outputs and gradients), and through every generation path it takes part in: the cache against no
cache, chunked prefill, a padded batch against each sequence alone, masks with holes, packed documents, beam
search's reordering, assisted decoding's rollback, the static cache, remote code (export and ONNX:
tests/models/test_export.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import FAMILIES, VOCAB, family_model, remote_code_logits

import hf_resolvent as hr

pytestmark = pytest.mark.usefixtures("one_thread_module")
K = 4


def tiny_model(family: str, seed: int = 0, **kw):
    return family_model(family, seed=seed, conv_size=K, **kw)


def prompt(batch: int = 2, n: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_the_convolution_is_the_windowed_sum_written_out():
    mixer = tiny_model("ce").transformer.h[0].mixer
    proj = torch.randn(2, 9, mixer.conv.in_channels, dtype=torch.float64, requires_grad=True)
    mixer = mixer.double()
    got, _ = mixer._convolve(proj, None, None)
    w, b = mixer.conv.weight[:, 0], mixer.conv.bias  # (C, K): tap K - 1 reads the token itself
    want = torch.stack([F.silu(b + sum(w[:, j] * proj[:, t - (K - 1) + j] for j in range(K) if t - (K - 1) + j >= 0))
                        for t in range(9)], dim=1)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(got)
    grads = torch.autograd.grad((got * g).sum(), (proj, mixer.conv.weight, mixer.conv.bias))
    grads_want = torch.autograd.grad((want * g).sum(), (proj, mixer.conv.weight, mixer.conv.bias))
    for a, e in zip(grads, grads_want):
        torch.testing.assert_close(a, e)


def test_settings_parameters_and_initialisation():
    model = tiny_model("ce")
    conv = model.transformer.h[0].mixer.conv
    assert conv.kernel_size == (K,) and conv.groups == conv.in_channels == 5 * 32  # qa, ka, x, qb, kb
    assert conv.weight.abs().max() <= 0.5 and conv.weight.std() > 0.2  # nn.Conv1d's uniform in +-1/sqrt(K)
    assert family_model("ce").transformer.h[0].mixer.conv is None  # off by default
    for bad in (1, -2, 2.0, True):
        with pytest.raises(ValueError, match="conv_size must be 0 .* at least 2"):
            hr.ResolventConfig(conv_size=bad)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generation_with_a_cache_chunks_padding_and_beams(family):
    model, ids = tiny_model(family), prompt()
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(greedy, model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False))
    assert torch.equal(greedy, model.generate(ids, max_new_tokens=8, do_sample=False, prefill_chunk_size=3))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids[:1, :4]], 1)
    alone = model.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
    out = model.generate(padded, attention_mask=(torch.arange(7)[None] >= 3).long(), max_new_tokens=5,
                         do_sample=False)
    assert torch.equal(out[:, 3:], alone)
    beams = model.generate(ids, max_new_tokens=5, num_beams=3, do_sample=False)
    assert torch.equal(beams, model.generate(ids, max_new_tokens=5, num_beams=3, do_sample=False, use_cache=False))


@pytest.mark.parametrize("family", ["ce", "dense", "tied", "attention"])
def test_the_window_carries_across_chunk_borders(family):
    model, ids = tiny_model(family), prompt(2, 11)
    with torch.no_grad():
        whole = model(ids).logits
        cache = hr.ResolventCache(model.config)
        parts = [model(ids[:, a:b], past_key_values=cache).logits for a, b in ((0, 2), (2, 3), (3, 8), (8, 11))]
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-5, rtol=1e-5)
    assert all(layer.state.conv.shape == (2, K - 1, layer.state.conv.shape[2]) for layer in cache.layers)


def _crops(monkeypatch) -> list[int]:
    calls, crop = [], hr.ResolventCache.crop
    monkeypatch.setattr(hr.ResolventCache, "crop", lambda self, n: calls.append(n) or crop(self, n))
    return calls


@pytest.mark.parametrize("family", list(FAMILIES))
def test_assisted_and_prompt_lookup_decoding_roll_the_window_back(family, monkeypatch):
    model, ids = tiny_model(family), prompt(1, 10)
    greedy = model.generate(ids, max_new_tokens=12, do_sample=False)
    crops = _crops(monkeypatch)
    assistant = tiny_model(family, seed=1)
    config = assistant.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = 4, "constant"
    config.assistant_confidence_threshold = 0.0
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=assistant), greedy)
    piece = prompt(1, 6, seed=4)
    ids = torch.cat([piece, piece, piece[:, :3]], 1)  # repeats, so that prompt lookup finds drafts
    greedy = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3), greedy)
    assert any(n < 0 for n in crops), "no draft was rejected: the rollback was not exercised"


def test_a_crop_without_recording_is_refused_and_with_it_is_exact():
    model, ids = tiny_model("attention"), prompt(1, 9)
    with torch.no_grad():
        cache = hr.ResolventCache(model.config)
        model(ids[:, :6], past_key_values=cache)
        model(ids[:, 6:], past_key_values=cache)
        with pytest.raises(ValueError, match="cannot be cropped back 3 token.*: the short convolution keeps only its "
                                             "last rows.*activate_past_recording"):
            cache.crop(6)
        again = hr.ResolventCache(model.config)
        model(ids[:, :6], past_key_values=again)
        again.activate_past_recording()
        model(ids[:, 6:], past_key_values=again)
        again.crop(6)
        assert again.get_seq_length() == 6
        torch.testing.assert_close(model(ids[:, 6:], past_key_values=again).logits, model(ids).logits[:, 6:],
                                   atol=1e-5, rtol=1e-5)


def test_hidden_tokens_and_packed_documents_do_not_leak_through_the_window():
    model = tiny_model("ce")
    ids = prompt(2, 10)
    mask = torch.tensor([[1, 0, 1, 1, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        out = model(ids, attention_mask=mask).logits
        for b in range(2):
            real = mask[b].bool()
            torch.testing.assert_close(out[b][real], model(ids[b][real][None]).logits[0], atol=1e-5, rtol=1e-5)
        docs = [ids[0, :4], ids[0, 4:10]]
        packed = model(ids[:1], position_ids=torch.cat([torch.arange(4), torch.arange(6)])[None]).logits[0]
        alone = torch.cat([model(d[None]).logits[0] for d in docs])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["ce", "attention", "hybrid"])
def test_the_static_cache_and_its_compiled_step(family):
    model, ids = tiny_model(family), prompt()
    greedy = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(greedy, model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static"))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids[:1, :4]], 1)
    alone = model.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
    out = model.generate(padded, attention_mask=(torch.arange(7)[None] >= 3).long(), max_new_tokens=5,
                         do_sample=False, cache_implementation="static")
    assert torch.equal(out[:, 3:], alone)
    again = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(greedy, again)  # generate() reuses the model's static cache after a reset
    cache = hr.ResolventCache(model.config, max_cache_len=16)
    with torch.no_grad():
        first = model(ids, past_key_values=cache).logits
        cache.reset()
        assert cache.layers[0].state is None and cache.layers[0].conv_width == K
        torch.testing.assert_close(model(ids, past_key_values=cache).logits, first)
    why = "the short convolution's past rows" if family == "attention" else "pattern"
    with pytest.raises(ValueError, match=f"static cache cannot record past states for {why}"):
        cache.activate_past_recording()


def test_a_saved_model_loads_with_remote_code_and_gives_the_same_logits(tmp_path):
    model = tiny_model("hybrid")
    model.save_pretrained(tmp_path / "m")
    ids = prompt(1, 6)
    with torch.no_grad():
        want = model(ids).logits
    got = remote_code_logits(tmp_path / "m", ids, tmp_path, "assert m.config.conv_size == 4")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    again = hr.ResolventForCausalLM.from_pretrained(tmp_path / "m")
    torch.testing.assert_close(again.transformer.h[0].mixer.conv.weight, model.transformer.h[0].mixer.conv.weight)


def test_gpt2_conversion_starts_the_convolution_as_the_identity_tap():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)).eval()
    model = hr.ResolventForCausalLM.from_gpt2(gpt2, conv_size=K).eval()
    conv = model.transformer.h[0].mixer.conv
    assert conv.bias.abs().max() == 0 and torch.equal(conv.weight[:, 0, -1], torch.ones(conv.in_channels))
    assert conv.weight[:, 0, :-1].abs().max() == 0
    proj = torch.randn(1, 5, conv.in_channels)
    torch.testing.assert_close(model.transformer.h[0].mixer._convolve(proj, None, None)[0], F.silu(proj))
