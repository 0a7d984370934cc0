"""ResolventCache and generate(): decode equals the full forward for every mixer kind, generation modes, cache size."""

from __future__ import annotations

import pytest
import torch
from conftest import empty_state, load_script

import hf_resolvent as hr
from hf_resolvent.ops import DecodeState, recurrent_mix
from hf_resolvent.patterns import get_pattern

KINDS = [
    "attention",
    "local_attention:4",
    "dense",
    "banded:3",
    "diagonal",
    "exp2",
    "exp2:ce",
    "square",
    "square:ce",
    "f:k**3+1:ce",
    "dense+tied",
    "exp2:ce+tied",
    "banded:3+tied",
    ["exp2:ce", "dense"],  # hybrid stack
]


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes: thread hand-offs would dominate


def tiny_model(mixer="exp2:ce", seed=0, **kw) -> hr.ResolventForCausalLM:
    fields = dict(vocab_size=61, n_positions=128, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=None,
                  pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0)
    fields.update(kw)
    torch.manual_seed(seed)
    return hr.ResolventForCausalLM(hr.ResolventConfig(mixer=mixer, **fields)).eval()


def _kind_id(kind) -> str:
    return "+".join(kind) if isinstance(kind, list) else kind


# --------------------------------------------------------------------------------------------------
# The state built from a prefill equals the one left by replaying the recurrent steps


STATE_SPECS = ["attention", "local_attention:3", "dense", "banded:3", "diagonal", "exp2", "exp2:ce", "square:ce",
               "f:k**3+1:ce"]


@pytest.mark.parametrize("spec, tied", [(s, False) for s in STATE_SPECS]
                         + [(s, True) for s in STATE_SPECS if get_pattern(s).has_recurrence])
def test_state_from_prefill_equals_replayed_steps(spec, tied):
    pattern = get_pattern(spec)
    gen = torch.Generator().manual_seed(1)
    for n in (1, 2, 5, 9, 20):
        for start in (None, torch.tensor([0, min(3, n - 1), n - 1])):
            qa, ka, qb, kb = (torch.randn(3, 2, n, 4, generator=gen, dtype=torch.float64) for _ in range(4))
            x = torch.randn(3, 2, n, 3, generator=gen, dtype=torch.float64)
            g = torch.rand(3, 2, n, generator=gen, dtype=torch.float64)
            d = torch.rand(3, 2, n, generator=gen, dtype=torch.float64)
            replayed = empty_state(pattern, {"x": x, "ka": ka, "kb": kb}, start, tied)
            if tied:
                y = recurrent_mix(None, None, qb, kb, x, g, pattern, start=start, state=replayed, d=d)
                valid = torch.ones(3, 1, n, 1, dtype=torch.float64)
                if start is not None:
                    valid = (torch.arange(n)[None] >= start[:, None]).double()[:, None, :, None]
                rows = {"keys_b": kb, "outputs": (y + d[..., None] * x) * valid}
            else:
                y = recurrent_mix(qa, ka, qb, kb, x, g, pattern, start=start, state=replayed)
                rows = {"keys_a": ka, "values": x}
                if pattern.has_recurrence:
                    rows.update(keys_b=kb, outputs=y)
            built = DecodeState.from_prefill(pattern, rows, start)
            assert built.seen == replayed.seen == n
            (built_rows, built_pos), (replayed_rows, replayed_pos) = built.view(), replayed.view()
            assert torch.equal(built_pos, replayed_pos)
            held = (replayed_pos >= 0)[:, None, :, None]
            assert set(built_rows) == set(replayed_rows)
            for name, t in replayed_rows.items():
                torch.testing.assert_close(built_rows[name] * held, t * held)


# --------------------------------------------------------------------------------------------------
# Decoding through the cache equals the full forward


@pytest.mark.parametrize("kind", KINDS, ids=_kind_id)
def test_decode_through_cache_equals_full_forward(kind):
    model = tiny_model(kind)
    ids = torch.randint(1, 61, (2, 19))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = hr.ResolventCache(model.config)
        steps = torch.cat([model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(19)], 1)
        assert cache.get_seq_length() == 19
        cache2 = hr.ResolventCache(model.config)
        prefill = model(ids[:, :11], past_key_values=cache2).logits
        rest = [model(ids[:, t:t + 1], past_key_values=cache2).logits for t in range(11, 19)]
        # chunked: the rest in one multi-token call on a filled cache
        cache3 = hr.ResolventCache(model.config)
        chunks = torch.cat([model(ids[:, :7], past_key_values=cache3).logits,
                            model(ids[:, 7:], past_key_values=cache3).logits], 1)
    torch.testing.assert_close(steps, full, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat([prefill] + rest, 1), full, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunks, full, atol=1e-4, rtol=1e-4)
    assert cache.nbytes() == cache2.nbytes() == cache3.nbytes()


def test_left_padded_prefill_then_decode_equals_alone():
    model = tiny_model(["exp2:ce", "square:ce+tied"])
    a, b = torch.randint(1, 61, (1, 5)), torch.randint(1, 61, (1, 9))
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), a], 1), b])
    mask = (torch.arange(9)[None] >= torch.tensor([[4], [0]])).long()
    nxt = torch.randint(1, 61, (2, 3))
    with torch.no_grad():
        cache = hr.ResolventCache(model.config)
        model(batch, attention_mask=mask, past_key_values=cache)
        out = []
        for t in range(3):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
            out.append(model(nxt[:, t:t + 1], attention_mask=mask, past_key_values=cache).logits)
        out = torch.cat(out, 1)
        alone_a = model(torch.cat([a, nxt[:1]], 1)).logits[:, -3:]
        alone_b = model(torch.cat([b, nxt[1:]], 1)).logits[:, -3:]
    torch.testing.assert_close(out[:1], alone_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1:], alone_b, atol=1e-4, rtol=1e-4)
    # a right-padded prefill cannot be continued
    cache = hr.ResolventCache(model.config)
    right = torch.tensor([[1] * 5 + [0] * 4, [1] * 9])
    model(batch, attention_mask=right, past_key_values=cache)
    with pytest.raises(ValueError, match="left"):
        model(nxt[:, :1], attention_mask=torch.cat([right, torch.ones(2, 1, dtype=torch.long)], 1),
              past_key_values=cache)


# --------------------------------------------------------------------------------------------------
# generate()


@pytest.mark.parametrize("kind", ["attention", "dense", "exp2:ce", "square:ce+tied", "banded:3"])
def test_greedy_with_cache_equals_without(kind):
    model = tiny_model(kind)
    ids = torch.randint(1, 61, (2, 7))
    with_cache = model.generate(ids, max_new_tokens=8, do_sample=False)
    without = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False)
    assert with_cache.shape == (2, 15)
    assert torch.equal(with_cache, without)


def test_generate_modes():
    model = tiny_model(["exp2:ce", "dense+tied"])
    ids = torch.randint(1, 61, (2, 9))
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False)
    # chunked prefill equals the prompt at once
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, prefill_chunk_size=4), greedy)
    # continue from a returned cache
    out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, hr.ResolventCache)
    assert out.past_key_values.get_seq_length() == 12
    more = model.generate(out.sequences, past_key_values=out.past_key_values, max_new_tokens=4, do_sample=False)
    assert torch.equal(more, greedy)
    # beam search reorders the cache: same as without cache
    beams = model.generate(ids, max_new_tokens=6, num_beams=3, do_sample=False)
    assert torch.equal(beams, model.generate(ids, max_new_tokens=6, num_beams=3, do_sample=False, use_cache=False))
    beams4 = model.generate(ids, max_new_tokens=6, num_beams=3, num_return_sequences=3, do_sample=False)
    assert beams4.shape == (6, 15)
    # sampling with num_return_sequences: same draws with and without cache
    torch.manual_seed(3)
    s1 = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=10, num_return_sequences=3)
    torch.manual_seed(3)
    s2 = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=10, num_return_sequences=3, use_cache=False)
    assert s1.shape == (6, 15) and torch.equal(s1, s2)
    # inputs_embeds
    emb = model.generate(inputs_embeds=model.transformer.wte(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(emb, greedy[:, 9:])


def test_left_padded_batch_generates_like_each_prompt_alone():
    model = tiny_model(["square:ce", "exp2:ce+tied"], position_embedding="learned")
    a, b = torch.randint(1, 61, (1, 4)), torch.randint(1, 61, (1, 10))
    batch = torch.cat([torch.cat([torch.zeros(1, 6, dtype=torch.long), a], 1), b])
    mask = (torch.arange(10)[None] >= torch.tensor([[6], [0]])).long()
    out = model.generate(batch, attention_mask=mask, max_new_tokens=7, do_sample=False)
    assert torch.equal(out[0, 6:], model.generate(a, max_new_tokens=7, do_sample=False)[0])
    assert torch.equal(out[1], model.generate(b, max_new_tokens=7, do_sample=False)[0])
    beams = model.generate(batch, attention_mask=mask, max_new_tokens=5, num_beams=2, do_sample=False)
    assert torch.equal(beams[0, 6:], model.generate(a, max_new_tokens=5, num_beams=2, do_sample=False)[0])


def test_generate_grows_the_mask_and_positions_in_one_buffer_each_not_a_copy_per_token():
    model = tiny_model("exp2:ce")
    batch = torch.randint(1, 61, (2, 9))
    mask = (torch.arange(9)[None] >= torch.tensor([[3], [0]])).long()
    seen, update = [], model._update_model_kwargs_for_generation

    def recording_update(*args, **kwargs):
        grown = update(*args, **kwargs)
        seen.append((grown["attention_mask"], grown["position_ids"]))
        return grown

    model._update_model_kwargs_for_generation = recording_update
    out = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
    del model._update_model_kwargs_for_generation
    masks, positions = zip(*seen)
    assert [m.shape[1] for m in masks] == [p.shape[1] for p in positions] == list(range(10, 16))
    # after each token, the mask and the positions are views of one buffer each, not new copies
    assert len({m.data_ptr() for m in masks}) == 1 and len({p.data_ptr() for p in positions}) == 1
    for i, (m, p) in enumerate(seen):
        assert torch.equal(m[:, :9], mask) and bool(m[:, 9:].eq(1).all())
        assert torch.equal(p[:, -1], torch.tensor([6, 9]) + i)  # counted from each sequence's first real token
    assert torch.equal(out, model.generate(batch, attention_mask=mask.clone(), max_new_tokens=6, do_sample=False,
                                           use_cache=False))


def test_a_decode_step_checks_its_own_mask_column_not_the_whole_mask():
    """generate()'s mask grows in the cache's buffer; a forward checks it whole once, then each step only the
    columns it adds (no op of a later step reads a tensor as long as the prompt). A mask a caller builds is checked
    whole every time, and a zero among the new columns is refused either way."""
    from torch.utils._python_dispatch import TorchDispatchMode

    kind = load_script("bench/op_counts")._Kind  # whether an op launches a kernel (not a view or metadata)
    n = 300
    model = tiny_model("exp2:ce", n_positions=n + 16)
    steps = []

    class Long(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if kind(func).launches and any(isinstance(a, torch.Tensor) and max(a.shape, default=0) >= n for a in args):
                steps[-1].append((func.overloadpacket.__name__,
                                  [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
            return func(*args, **(kwargs or {}))

    forward = model.forward

    def watched(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None or cache.get_seq_length() == 0:
            return forward(*args, **kwargs)
        steps.append([])
        with Long():
            return forward(*args, **kwargs)

    model.forward = watched
    ids, mask = torch.randint(1, 61, (2, n)), (torch.arange(n)[None] >= torch.tensor([[5], [0]])).long()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    del model.forward
    assert steps[0] == [("sum", [(2, n + 1)])] and steps[1:] == [[]] * 4
    assert torch.equal(out, model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                           use_cache=False))
    cache, one = hr.ResolventCache(model.config), torch.ones(2, 1, dtype=torch.long)
    model(ids, attention_mask=mask, past_key_values=cache)
    grown = cache.extend_columns("attention_mask", mask, one)
    assert cache.mask_to_check(grown, n, 1) is grown  # a new buffer: no forward has checked it yet
    model(ids[:, :1], attention_mask=grown, past_key_values=cache)
    padded = cache.extend_columns("attention_mask", grown, 0 * one)
    assert cache.mask_to_check(padded, n + 1, 1).shape == (2, 1)  # the new column alone
    with pytest.raises(ValueError, match="new tokens after a cache must be all ones"):
        model(ids[:, :1], attention_mask=padded, past_key_values=cache)
    with pytest.raises(ValueError, match="prefill's mask followed by ones"):  # a caller's mask: checked whole
        model(ids[:, :1], attention_mask=torch.ones(2, n + 2, dtype=torch.long), past_key_values=cache)


def test_a_cache_extends_only_its_own_buffers_in_place():
    cache = hr.ResolventCache(tiny_model("exp2:ce").config)
    prompt, ones = torch.tensor([[0, 0, 1], [1, 1, 1]]), lambda k: torch.ones(2, k, dtype=torch.long)
    grown = cache.extend_columns("mask", prompt, ones(2))
    assert torch.equal(grown, torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])) and torch.equal(prompt[0], grown[0, :3])
    again = cache.extend_columns("mask", grown, ones(1))
    assert again.data_ptr() == grown.data_ptr() and again.shape == (2, 6)
    cropped = cache.extend_columns("mask", again[:, :4], ones(3))  # assisted decoding crops, then extends
    assert cropped.data_ptr() == grown.data_ptr() and torch.equal(cropped[:, :3], prompt) and bool(cropped[:, 3:].all())
    other = cache.extend_columns("positions", torch.tensor([[0, 1], [4, 5]]), torch.tensor([[2], [6]]))
    assert torch.equal(other, torch.tensor([[0, 1, 2], [4, 5, 6]])) and other.data_ptr() != grown.data_ptr()
    assert cache.extend_columns("mask", cropped, ones(1)).data_ptr() == grown.data_ptr()  # a buffer per name
    callers = torch.zeros(2, 20, dtype=torch.long)
    callers[:, :4] = 1
    extended = cache.extend_columns("mask", callers[:, :4], ones(30))  # a caller's view: copied, never written into
    assert extended.shape == (2, 34) and bool(extended.all()) and not bool(callers[:, 4:].any())
    beyond = cache.extend_columns("mask", extended, ones(100))  # past the buffer's room: a new, larger buffer
    assert beyond.shape == (2, 134) and bool(beyond.all())


def test_other_cache_implementations_refused():
    model = tiny_model("exp2:ce")
    with pytest.raises(ValueError, match="cache_implementation='offloaded' is not available for resolvent models"):
        model.generate(torch.randint(1, 61, (1, 6)), max_new_tokens=3, cache_implementation="offloaded")


def test_a_full_static_cache_says_so():
    model = tiny_model(["exp2:ce", "dense"])
    cache = hr.ResolventCache(model.config, max_cache_len=7)
    with torch.no_grad():
        model(torch.randint(1, 61, (1, 6)), past_key_values=cache)
        model(torch.randint(1, 61, (1, 1)), past_key_values=cache)
        with pytest.raises(ValueError, match="the static cache is full: it holds max_cache_len = 7 tokens"):
            model(torch.randint(1, 61, (1, 1)), past_key_values=cache)
        with pytest.raises(ValueError, match="max_cache_len = 5 tokens, but the prompt already has 6"):
            model(torch.randint(1, 61, (1, 6)), past_key_values=hr.ResolventCache(model.config, max_cache_len=5))
    with pytest.raises(ValueError, match="max_cache_len must be a positive number of tokens"):
        hr.ResolventCache(model.config, max_cache_len=0)


# --------------------------------------------------------------------------------------------------
# The cache object


def test_cache_api():
    model = tiny_model(["exp2:ce", "dense"])
    ids = torch.randint(1, 61, (3, 8))
    cache = hr.ResolventCache(model.config)
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0 and not cache.is_compileable
    with torch.no_grad():
        model(ids, past_key_values=cache)
    assert cache.get_seq_length() == 8 and cache.batch_size == 3 and len(cache) == 2
    # reorder (beam search) == running the reordered batch
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    nxt = torch.randint(1, 61, (3, 1))
    with torch.no_grad():
        got = model(nxt, past_key_values=cache).logits
        want = model(torch.cat([ids[[2, 0, 0]], nxt], 1)).logits[:, -1:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    cache.batch_repeat_interleave(2)
    assert cache.batch_size == 6
    cache.batch_select_indices(torch.tensor([1, 4]))
    assert cache.batch_size == 2
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(5)
    with pytest.raises(TypeError, match="update"):
        cache.update(torch.zeros(1), torch.zeros(1), 0)
    with pytest.raises(ValueError, match="cache holds"):
        model(torch.randint(1, 61, (5, 1)), past_key_values=cache)
    cache.reset()
    assert cache.get_seq_length() == 0


def test_crop_where_every_position_is_kept():
    model = tiny_model(["dense", "attention"])
    ids = torch.randint(1, 61, (1, 10))
    cache = hr.ResolventCache(model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache)
        cache.crop(-4)
        assert cache.get_seq_length() == 6
        got = model(ids[:, 6:7], past_key_values=cache).logits
        want = model(ids[:, :7]).logits[:, -1:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert cache.is_croppable


@pytest.mark.parametrize("mixer", ["dense", "exp2:ce"])
def test_a_crop_to_a_tensor_length_then_steps_as_a_fresh_cache(mixer):
    """transformers' candidate generators (5.16) crop to a 0-d tensor length: the count stays the host's, and the
    steps after it read the rows held (a count kept as that tensor, and grown in place, went stale)."""
    model = tiny_model(mixer)
    ids = torch.randint(1, 61, (1, 14), generator=torch.Generator().manual_seed(0))
    cache = hr.ResolventCache(model.config)
    cache.activate_past_recording()
    with torch.no_grad():
        model(ids[:, :10], past_key_values=cache)
        for t in range(10, 13):
            model(ids[:, t:t + 1], past_key_values=cache)
        cache.crop(torch.tensor(11))
        assert cache.get_seq_length() == 11
        got = torch.cat([model(ids[:, t:t + 1], past_key_values=cache).logits for t in (11, 12, 13)], 1)
    want = model(ids).logits[:, 11:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("spec, distinct, held", [("exp2:ce", 12, 12), ("square:ce", 34, 46), ("banded:8", 8, 8),
                                                  ("dense", 2048, 2048), ("exp2:ce+tied", 12, 12)])
def test_cache_bytes_follow_the_pattern_plan(spec, distinct, held):
    """After 2048 tokens each layer holds what token 2049 may read: S_2049 for cache-efficient patterns, in one row
    per slot of the register (square:ce's 46 slots hold its 34 positions: a position may sit in several)."""
    fields = dict(vocab_size=11, n_positions=4096, n_embd=8, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=None,
                  resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(0)
    model = hr.ResolventForCausalLM(hr.ResolventConfig(mixer=spec, **fields)).eval()
    pattern = get_pattern(spec.replace("+tied", ""))
    assert pattern.cache_size(2048) == distinct
    cache = hr.ResolventCache(model.config)
    with torch.no_grad():
        model(torch.randint(0, 11, (1, 2048)), past_key_values=cache)
    tied = spec.endswith("+tied")
    head_dim, heads, itemsize = 4, 2, 4
    per_row = heads * head_dim * itemsize * (2 if tied else 4) + 8  # keys_b, z | keys_a, keys_b, x, y; a position
    for state in cache.states:
        assert state.rows_held() == held
        _, positions = state.view()
        assert len(set(positions[0][positions[0] >= 0].tolist())) == distinct
        assert state.nbytes() == held * per_row
    assert cache.nbytes() == 2 * held * per_row
    with torch.no_grad():  # one more token: still the plan
        model(torch.randint(0, 11, (1, 1)), past_key_values=cache)
    after = len(pattern.offsets(2050)) if state.layout == "slots" else pattern.cache_size(2049)
    assert all(s.rows_held() == after for s in cache.states)


# --------------------------------------------------------------------------------------------------
# pipeline


def _local_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = ["the cat sat on the mat", "a dog ran in the park", "the sun is warm today", "we read a book"]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(text, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")


def test_text_generation_pipeline():
    from transformers import pipeline

    tokenizer = _local_tokenizer()
    tokenizer.padding_side = "left"
    model = tiny_model("exp2:ce", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = pipe(["the cat sat", "a dog ran in the park"], max_new_tokens=5, do_sample=False)
    assert len(out) == 2 and out[0][0]["generated_text"].startswith("the cat sat")
    alone = pipe("the cat sat", max_new_tokens=5, do_sample=False)
    assert alone[0]["generated_text"] == out[0][0]["generated_text"]


def test_forward_takes_the_cache_under_either_name():
    """transformers 5.24 renamed forward()'s and generate()'s cache argument from past_key_values to cache; the model
    takes both (the supported releases lie on both sides), continues the same way under either, refuses two different
    caches at once, and returns the cache under the installed release's name."""
    model = tiny_model("exp2:ce")
    ids = torch.randint(1, 61, (1, 9), generator=torch.Generator().manual_seed(0))
    full = model(ids).logits[:, -1]
    for name in ("cache", "past_key_values"):
        cache = hr.ResolventCache(model.config)
        model(ids[:, :8], **{name: cache}, use_cache=True)
        out = model(ids[:, 8:], **{name: cache}, use_cache=True)
        torch.testing.assert_close(out.logits[:, -1], full, atol=1e-5, rtol=1e-5)
        assert out[hr.modeling_resolvent.CACHE_NAME] is cache
    with pytest.raises(ValueError, match="got two different caches, as past_key_values and as cache; pass one"):
        model(ids, cache=hr.ResolventCache(model.config), past_key_values=hr.ResolventCache(model.config))


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_generate_continues_from_a_returned_cache_under_either_name(name):
    """A second generate() from the first one's returned cache, passed as cache= (transformers >= 5.24's name) or as
    past_key_values= (the name before), gives the tokens of one generate() over the whole text, on every supported
    release (CI runs this file at both ends of the range)."""
    model = tiny_model(["exp2:ce", "dense"])
    ids = torch.randint(1, 61, (2, 5), generator=torch.Generator().manual_seed(4))
    first = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    cache = first[hr.modeling_resolvent.CACHE_NAME]
    assert isinstance(cache, hr.ResolventCache)
    text = torch.cat([first.sequences, torch.full((2, 1), 7)], dim=1)
    again = model.generate(text, max_new_tokens=4, do_sample=False, **{name: cache})
    assert torch.equal(again, model.generate(text, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("size", [0, -3, 2.5, True])
def test_a_prefill_chunk_size_that_is_not_a_positive_count_is_refused(size):
    model = tiny_model("exp2:ce")
    with pytest.raises(ValueError, match=f"prefill_chunk_size must be a positive number of tokens .*got {size!r}"):
        model.generate(torch.randint(1, 61, (1, 6)), max_new_tokens=2, prefill_chunk_size=size)
