"""``rope_channels``: RoPE on the queries and keys of one channel only, A (the direct reads) or B (the feedback),
or both (the default). The rule is the mixer's, so the decode cache, padded batches and the static cache follow it."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB
from conftest import family_model as tiny_model

import hf_resolvent as hr
from hf_resolvent.ops.rope import part_runs

pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.mark.parametrize(("channels", "rotated"), [("ab", {"qa", "ka", "qb", "kb"}), ("a", {"qa", "ka"}),
                                                   ("b", {"qb", "kb"})])
def test_the_queries_and_keys_of_the_named_channels_rotate_and_the_inputs_never(channels, rotated):
    for family in ("ce", "tied", "attention"):
        mixer = tiny_model(family, rope_channels=channels).transformer.h[0].mixer
        got = {name for names, rotate in part_runs(mixer.parts, mixer.rope_channels) if rotate for name in names}
        assert got == rotated & set(mixer.parts) and "x" not in got


def _last_logits_ignore_prefix_order(model) -> bool:
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    order = torch.randperm(8, generator=torch.Generator().manual_seed(1))
    shuffled = torch.cat([ids[:, :-1][:, order], ids[:, -1:]], 1)
    with torch.no_grad():
        return torch.allclose(model(ids).logits[:, -1], model(shuffled).logits[:, -1], atol=1e-5, rtol=1e-5)


def test_an_attention_layer_without_its_channel_rotated_sees_no_position():
    assert _last_logits_ignore_prefix_order(tiny_model("attention", n_layer=1, rope_channels="b"))
    assert not _last_logits_ignore_prefix_order(tiny_model("attention", n_layer=1, rope_channels="a"))


@pytest.mark.parametrize("channels", ["a", "b"])
@pytest.mark.parametrize("family", ["ce", "tied", "dense", "hybrid"])
def test_decoding_with_a_cache_equals_full_forwards(family, channels):
    model = tiny_model(family, rope_channels=channels)
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(greedy, model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False))
    assert torch.equal(greedy, model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static"))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids[:1, :4]], 1)
    alone = model.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
    out = model.generate(padded, attention_mask=(torch.arange(7)[None] >= 3).long(), max_new_tokens=5,
                         do_sample=False)
    assert torch.equal(out[:, 3:], alone)


def test_a_bad_value_is_named():
    with pytest.raises(ValueError, match="rope_channels must be one of 'ab', 'a', 'b'.*got 'q'"):
        hr.ResolventConfig(rope_channels="q")


def test_the_weights_record_their_channels_and_a_config_that_differs_is_warned(tmp_path):
    model = tiny_model("ce", rope_channels="a")
    model.save_pretrained(tmp_path / "m")
    again = hr.ResolventForCausalLM.from_pretrained(tmp_path / "m")
    assert again.config.rope_channels == "a"
    with pytest.warns(UserWarning, match="trained with rope_channels='a', but the config says rope_channels='ab'"):
        hr.ResolventForCausalLM.from_pretrained(tmp_path / "m", rope_channels="ab")
