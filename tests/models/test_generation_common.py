"""What transformers' generation tests check for decoder-only models, for every mixer family.

Each mode runs on a tiny model of each family and is held to an equivalent that does not depend on the mode
under test: decoding with the cache against decoding without it (every step a full forward), a left-padded batch
against each prompt alone, assisted and prompt-lookup decoding against plain greedy decoding, a continued
generation against one run, a chunked prefill against the prompt at once, the static cache (eager and compiled) against the growing one. Group beam search, contrastive search and DoLa are not in transformers 5.x itself
(they moved to Hub ``custom_generate`` repositories, which need a download), so they are not tested here.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import FAMILIES, VOCAB
from conftest import family_model as tiny_model
from transformers import CompileConfig, StoppingCriteria, StoppingCriteriaList

import hf_resolvent as hr

pytestmark = [pytest.mark.usefixtures("one_thread_module"),
              pytest.mark.parametrize("family", list(FAMILIES))]

def prompt(batch: int = 2, n: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_greedy_and_sampling_with_and_without_cache(family):
    model, ids = tiny_model(family), prompt()
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert greedy.shape == (2, 15) and torch.equal(greedy[:, :7], ids)
    assert torch.equal(greedy, model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False))
    draws = []
    for use_cache in (True, False):
        torch.manual_seed(5)
        draws.append(model.generate(ids, max_new_tokens=8, do_sample=True, top_k=20, temperature=1.5,
                                    num_return_sequences=2, use_cache=use_cache))
    assert draws[0].shape == (4, 15) and torch.equal(draws[0], draws[1])
    assert torch.equal(draws[0][::2, :7], ids) and torch.equal(draws[0][1::2, :7], ids)


def test_beam_search_and_beam_sampling_with_and_without_cache(family):
    model, ids = tiny_model(family), prompt()
    for kw in (dict(do_sample=False), dict(do_sample=True, top_k=20)):
        outs = []
        for use_cache in (True, False):
            torch.manual_seed(7)
            outs.append(model.generate(ids, max_new_tokens=6, num_beams=3, num_return_sequences=2,
                                       use_cache=use_cache, **kw))
        assert outs[0].shape == (4, 13) and torch.equal(outs[0], outs[1]), kw


def test_dict_outputs_scores_logits_and_hidden_states(family):
    model, ids = tiny_model(family), prompt()
    out = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True,
                         output_logits=True, output_hidden_states=True)
    assert len(out.scores) == len(out.logits) == len(out.hidden_states) == 5
    full = model(out.sequences[:, :-1]).logits  # every generated token's logits from one full forward
    for i, (scores, logits) in enumerate(zip(out.scores, out.logits)):
        assert scores.shape == logits.shape == (2, VOCAB)
        torch.testing.assert_close(logits, full[:, 6 + i], atol=1e-4, rtol=1e-4)
        assert torch.equal(scores.argmax(-1), out.sequences[:, 7 + i])
    layers = model.config.n_layer + 1  # embeddings, then each block (the last after ln_f)
    assert len(out.hidden_states[0]) == layers and out.hidden_states[0][0].shape == (2, 7, 32)
    assert out.hidden_states[1][-1].shape == (2, 1, 32)
    assert isinstance(out.past_key_values, hr.ResolventCache) and out.past_key_values.get_seq_length() == 11


def test_left_padding_equals_each_prompt_alone(family):
    model = tiny_model(family)
    short, long = prompt(1, 4, seed=2), prompt(1, 9, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), short], 1), long])
    mask = (torch.arange(9)[None] >= torch.tensor([[5], [0]])).long()
    out = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(out[0, 5:], model.generate(short, max_new_tokens=6, do_sample=False)[0])
    assert torch.equal(out[1], model.generate(long, max_new_tokens=6, do_sample=False)[0])


def test_continue_from_returned_cache(family):
    model, ids = tiny_model(family), prompt()
    once = model.generate(ids, max_new_tokens=9, do_sample=False)
    first = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    more = model.generate(first.sequences, past_key_values=first.past_key_values, max_new_tokens=5, do_sample=False)
    assert torch.equal(more, once)


def test_chunked_prefill_equals_the_prompt_at_once(family, monkeypatch):
    """prefill_chunk_size runs each chunk after the first in parallel from the cache (ops.extend_mix): the logits of
    every chunk equal the full forward's, and generation is the same, for a left-padded batch too."""
    from hf_resolvent.ops import mixer

    calls = []

    def counted(run):
        return lambda *args, **kwargs: calls.append(1) or run(*args, **kwargs)

    for name, backend in mixer.BACKENDS.items():
        if backend.tokens is not None:
            monkeypatch.setitem(mixer.BACKENDS, name, replace(backend, tokens=counted(backend.tokens)))
    model = tiny_model(family)
    ids = prompt(2, 40, seed=4)
    mask = (torch.arange(40)[None] >= torch.tensor([[3], [0]])).long()
    full = model(ids, attention_mask=mask).logits
    cache, parts = hr.ResolventCache(model.config), []
    for a, b in ((0, 9), (9, 10), (10, 40)):
        out = model(ids[:, a:b], attention_mask=mask[:, :b], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        parts.append(out.logits)
    real = mask.bool()[:, :, None]
    torch.testing.assert_close(torch.where(real, torch.cat(parts, 1), 0), torch.where(real, full, 0), atol=1e-5,
                               rtol=1e-5)
    once = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                      prefill_chunk_size=16), once)
    # per layer: the 30 tokens above, then generate()'s chunks of 16 and 8 after the first (one token: a step)
    assert len(calls) == 3 * model.config.n_layer
    with pytest.raises(ValueError, match="chunks longer than the longest left padding"):  # 3 padding tokens
        model.generate(ids, attention_mask=mask, max_new_tokens=2, prefill_chunk_size=3)


def _crops(monkeypatch) -> list[int]:
    """Records the crops generate() asks of resolvent caches, so that a test sees rollbacks really happened."""
    calls, crop = [], hr.ResolventCache.crop
    monkeypatch.setattr(hr.ResolventCache, "crop", lambda self, n: calls.append(n) or crop(self, n))
    return calls


def _drafting(assistant: hr.ResolventForCausalLM) -> hr.ResolventForCausalLM:
    """Four drafts every round, however unsure: an untrained assistant would otherwise draft nothing."""
    config = assistant.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = 4, "constant"
    config.assistant_confidence_threshold = 0.0
    return assistant


def test_assisted_decoding_equals_greedy(family, monkeypatch):
    model, ids = tiny_model(family), prompt(1, 10)
    greedy = model.generate(ids, max_new_tokens=16, do_sample=False)
    crops = _crops(monkeypatch)
    for assistant in (tiny_model(family, seed=1), tiny_model("ce", seed=2), tiny_model(family)):
        assistant = _drafting(assistant)
        assert torch.equal(model.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=assistant), greedy)
    # as a tokenizer gives it: an unpadded batch of one with its mask, a draft of the family and an attention one
    for assistant in (tiny_model(family, seed=1), tiny_model("attention", seed=2)):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             assistant_model=_drafting(assistant))
        assert torch.equal(out, greedy)
    assert any(n < 0 for n in crops), "no draft was rejected: the rollback was not exercised"


def test_prompt_lookup_decoding_equals_greedy(family, monkeypatch):
    model = tiny_model(family)
    piece = prompt(1, 6, seed=4)
    ids = torch.cat([piece, piece, piece[:, :3]], 1)  # repeats, so that prompt lookup finds drafts
    greedy = model.generate(ids, max_new_tokens=16, do_sample=False)
    crops = _crops(monkeypatch)
    assert torch.equal(model.generate(ids, max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=3), greedy)
    assert any(n < 0 for n in crops), "no draft was rejected: the rollback was not exercised"


class _StopAfter(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_stopping_criteria_and_eos(family):
    model, ids = tiny_model(family), prompt()
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False)
    stopped = model.generate(ids, max_new_tokens=8, do_sample=False, stopping_criteria=StoppingCriteriaList([_StopAfter(10)]))
    assert torch.equal(stopped, greedy[:, :10])
    eos = int(greedy[0, 9])  # the first sequence's third new token
    ended = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0)
    stop = int((greedy[0, 7:] == eos).nonzero()[0]) + 8  # the first eos, included
    assert torch.equal(ended[0, :stop], greedy[0, :stop])
    assert (ended[0, stop:] == 0).all()  # padded after its eos


def test_static_cache_equals_the_growing_cache(family):
    """cache_implementation="static": preallocated states for prompt + new tokens; greedy, sampling, beam search,
    a left-padded batch and a chunked prefill give what the growing cache gives."""
    model, ids = tiny_model(family), prompt()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    runs = [dict(do_sample=False), dict(do_sample=True, top_k=20, num_return_sequences=2),
            dict(do_sample=False, num_beams=3), dict(do_sample=False, attention_mask=mask),
            dict(do_sample=False, attention_mask=mask, prefill_chunk_size=4)]
    for kw in runs:
        outs = []
        for implementation in (None, "static"):
            torch.manual_seed(3)
            outs.append(model.generate(ids, max_new_tokens=7, cache_implementation=implementation,
                                       return_dict_in_generate=True, **kw))
        assert torch.equal(outs[1].sequences, outs[0].sequences), kw
    cache = outs[1].past_key_values  # sized by generate(): the last token is never fed back
    assert cache.is_compileable and cache.max_cache_len == cache.get_seq_length() == 13


def test_a_shorter_compiled_generation_reuses_the_compiled_step(family):
    """A second compiled generate() with fewer tokens keeps the static cache's size, so its decode step runs the
    graph compiled for the first (transformers' StaticCache does the same) and gives eager decoding's tokens."""
    model, ids = tiny_model(family), prompt()
    config = CompileConfig(fullgraph=True, dynamic=False, backend="eager")
    config._compile_all_devices = True
    torch._dynamo.reset()
    first = model.generate(ids, max_new_tokens=9, do_sample=False, cache_implementation="static",
                           compile_config=config, return_dict_in_generate=True)
    want = model.generate(ids, max_new_tokens=5, do_sample=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static",
                             compile_config=config, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want)
    assert got.past_key_values.max_cache_len == first.past_key_values.max_cache_len == 7 + 9 - 1  # the first's size


def test_compiled_static_decoding_compiles_once_and_equals_eager(family):
    """generate() compiles the decode step (fullgraph) when the cache is static: one graph for every token, the
    same tokens as eager decoding. Dynamo's own backend ("eager") checks the graph; tests/models/test_compile.py
    runs inductor's."""
    model, ids = tiny_model(family), prompt()
    want = model.generate(ids, max_new_tokens=9, do_sample=False)
    config = CompileConfig(fullgraph=True, dynamic=False, backend="eager")
    config._compile_all_devices = True  # transformers' switch for compiling on a CPU
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = model.generate(ids, max_new_tokens=9, do_sample=False, cache_implementation="static",
                             compile_config=config)
    assert torch.equal(got, want)
    assert hasattr(model, "_compiled_call")  # generate() took the compiled path
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
