"""ResolventConfig, ResolventModel / ResolventForCausalLM forward, loss, padding, gates, Auto classes, GPT-2 conversion."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import hf_resolvent as hr
from hf_resolvent.configuration_resolvent import CLOSED_GATE_VALUE

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes: thread hand-offs would dominate


def tiny_config(mixer="exp2:ce", **kw) -> hr.ResolventConfig:
    fields = dict(vocab_size=61, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=None,
                  pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0)
    fields.update(kw)
    return hr.ResolventConfig(mixer=mixer, **fields)


def tiny_model(mixer="exp2:ce", seed=0, **kw) -> hr.ResolventForCausalLM:
    torch.manual_seed(seed)
    return hr.ResolventForCausalLM(tiny_config(mixer, **kw)).eval()


# --------------------------------------------------------------------------------------------------
# Config


def test_config_fields_aliases_and_round_trip(tmp_path):
    cfg = tiny_config(["exp2:ce+tied", {"pattern": "dense", "gate_init": "closed"}], position_embedding="learned")
    assert cfg.hidden_size == 32 and cfg.num_hidden_layers == 2 and cfg.num_attention_heads == 2
    assert cfg.max_position_embeddings == 64
    assert cfg.layer_mixers == [
        {"pattern": "exp2:ce", "tied": True, "gate_init": "mamba2"},
        {"pattern": "dense", "tied": False, "gate_init": "closed"},
    ]
    cfg.save_pretrained(tmp_path)
    back = hr.ResolventConfig.from_pretrained(tmp_path)
    assert back.layer_mixers == cfg.layer_mixers and back.position_embedding == "learned"
    auto = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(auto, hr.ResolventConfig)


@pytest.mark.parametrize(
    "fields, needle",
    [
        (dict(mixer="foo"), "mixer"),
        (dict(mixer=["dense"]), "n_layer"),
        (dict(mixer=["dense", "nope"]), "mixer[1]"),
        (dict(mixer="attention+tied"), "tied"),
        (dict(mixer={"pattern": "dense", "colour": 1}), "unknown keys"),
        (dict(mixer="exp2:ce", gate_init="wide"), "gate_init"),
        (dict(mixer={"pattern": "dense", "gate_init": 1.5}), "gate_init"),
        (dict(n_embd=33), "n_embd"),
        (dict(n_embd=12, n_head=4), "even head width"),
        (dict(position_embedding="alibi"), "position_embedding"),
        (dict(n_layer=0), "n_layer"),
        (dict(resid_pdrop=1.5), "resid_pdrop"),
        (dict(activation_function="swishy"), "activation_function"),
        (dict(mixer_impl="cuda"), "mixer_impl"),
        (dict(chunk_size_feed_forward=-2), "chunk_size_feed_forward"),
        (dict(eos_token_id=61), "eos_token_id = 61 lies outside the vocabulary (vocab_size = 61: ids 0 to 60)"),
        (dict(bos_token_id=-1), "bos_token_id = -1 lies outside the vocabulary"),
        (dict(eos_token_id=[3, 99]), "eos_token_id = [3, 99] lies outside"),
        (dict(pad_token_id=61), "pad_token_id = 61 lies outside"),
    ],
)
def test_config_rejects_bad_values(fields, needle):
    with pytest.raises(ValueError) as err:
        tiny_config(**fields)
    assert needle in str(err.value)


def test_default_special_token_ids_follow_the_vocabulary():
    """GPT-2's convention, the last id (50256 for its vocabulary), for any vocab_size: no id outside the table, so
    transformers has nothing to warn about when the model is built."""
    assert hr.ResolventConfig().bos_token_id == hr.ResolventConfig().eos_token_id == 50256
    small = hr.ResolventConfig(vocab_size=128, n_embd=32, n_layer=1, n_head=2)
    assert small.bos_token_id == small.eos_token_id == 127
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hr.ResolventForCausalLM(small)
    assert hr.ResolventConfig(vocab_size=128, eos_token_id=None).eos_token_id is None


def _count(cfg) -> int:
    with torch.device("meta"):
        model = hr.ResolventForCausalLM(cfg)
    return sum(p.numel() for p in model.parameters())


def test_presets_and_parameter_counts():
    c44 = hr.ResolventConfig.from_preset("44m", mixer="dense")
    assert (c44.n_layer, c44.n_embd, c44.n_inner, c44.n_head, c44.n_positions) == (6, 512, 2048, 8, 512)
    c355 = hr.ResolventConfig.from_preset("355m", mixer="attention", n_positions=1024)
    assert (c355.n_layer, c355.n_embd, c355.n_inner, c355.n_head, c355.n_positions) == (24, 1024, 4096, 16, 1024)
    attention = _count(hr.ResolventConfig.from_preset("44m", mixer="attention"))
    dense = _count(c44)
    # Measured: 44,646,912 (attention) and 47,823,456 (dense): +2 d^2 + d H + 2 H per layer, +7.1%.
    assert attention == 44_646_912 and dense == 47_823_456
    assert 0.06 < dense / attention - 1 < 0.08
    with pytest.raises(ValueError, match="preset"):
        hr.ResolventConfig.from_preset("7b")


# --------------------------------------------------------------------------------------------------
# Forward


def test_forward_shapes_loss_and_hidden_states():
    model = tiny_model(["exp2:ce", "dense+tied"])
    ids = torch.randint(1, 61, (3, 11))
    out = model(ids, labels=ids, output_hidden_states=True)
    assert out.logits.shape == (3, 11, 61)
    assert len(out.hidden_states) == 3 and out.hidden_states[0].shape == (3, 11, 32)
    manual = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 61), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, manual)
    # num_items_in_batch: the loss is the sum over tokens divided by it
    summed = manual * 30
    out2 = model(ids, labels=ids, num_items_in_batch=torch.tensor(7))
    torch.testing.assert_close(out2.loss, summed / 7)
    # the last hidden state is after the final LayerNorm, and feeds the head
    torch.testing.assert_close(model.lm_head(out.hidden_states[-1]), out.logits)
    tup = model(ids, return_dict=False, use_cache=False)
    assert isinstance(tup, tuple) and torch.equal(tup[0], out.logits)


def test_the_position_wise_half_in_blocks_of_rows_is_the_same_function(monkeypatch):
    """chunk_size_feed_forward (a runtime choice, read at every call): the MLP runs once per block of rows in a longer
    sequence, and the logits and gradients are those of the whole sequence at once."""
    model = tiny_model(["exp2:ce", "dense"])
    ids = torch.randint(1, 61, (2, 11))
    calls, mlp_forward = [], hr.modeling_resolvent.ResolventMLP.forward

    def counted(self, h):
        calls.append(h.shape[1])
        return mlp_forward(self, h)

    monkeypatch.setattr(hr.modeling_resolvent.ResolventMLP, "forward", counted)
    results = []
    for rows in (0, 4, 11):
        model.config.chunk_size_feed_forward = rows
        calls.clear()
        model.zero_grad()
        out = model(ids, labels=ids)
        out.loss.backward()
        results.append((out.logits, [p.grad.clone() for p in model.parameters()]))
        assert calls == {0: [11, 11], 4: [4, 4, 3] * 2, 11: [11, 11]}[rows]
    for logits, grads in results[1:]:
        torch.testing.assert_close(logits, results[0][0])
        for g, want in zip(grads, results[0][1]):
            torch.testing.assert_close(g, want)


def test_inputs_embeds_equal_input_ids():
    model = tiny_model("square:ce")
    ids = torch.randint(1, 61, (2, 9))
    a = model(ids).logits
    b = model(inputs_embeds=model.transformer.wte(ids)).logits
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="exactly one"):
        model(ids, inputs_embeds=model.transformer.wte(ids))


@pytest.mark.parametrize("mixer", ["attention", "dense", "exp2:ce", "banded:3+tied"])
@pytest.mark.parametrize("position_embedding", ["rope", "learned"])
def test_padding_never_changes_real_tokens(mixer, position_embedding):
    model = tiny_model(mixer, position_embedding=position_embedding)
    a = torch.randint(1, 61, (1, 6))
    b = torch.randint(1, 61, (1, 10))
    alone_a, alone_b = model(a).logits, model(b).logits
    pad = torch.zeros(1, 4, dtype=torch.long)
    left = torch.cat([torch.cat([pad, a], 1), b])
    left_mask = torch.cat([torch.cat([torch.zeros_like(pad), torch.ones_like(a)], 1), torch.ones_like(b)])
    out = model(left, attention_mask=left_mask).logits
    torch.testing.assert_close(out[0, 4:], alone_a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], alone_b[0], atol=1e-5, rtol=1e-5)
    right = torch.cat([torch.cat([a, pad], 1), b])
    right_mask = torch.cat([torch.cat([torch.ones_like(a), torch.zeros_like(pad)], 1), torch.ones_like(b)])
    out = model(right, attention_mask=right_mask).logits
    torch.testing.assert_close(out[0, :6], alone_a[0], atol=1e-5, rtol=1e-5)


def test_bad_inputs_raise_clear_errors():
    model = tiny_model("exp2:ce")
    ids = torch.randint(1, 61, (2, 6))
    with pytest.raises(ValueError, match="2-D"):
        model(ids, attention_mask=torch.ones(2, 1, 6, 6))
    with pytest.raises(ValueError, match="no real token|without any real token"):
        model(ids, attention_mask=torch.tensor([[0] * 6, [1] * 6]))
    with pytest.raises(ValueError, match="learned position table has n_positions = 64 rows"):
        tiny_model("exp2:ce", position_embedding="learned")(torch.randint(1, 61, (1, 65)))
    with pytest.raises(ValueError, match="output_attentions"):
        model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="ResolventCache"):
        from transformers import DynamicCache

        cache = DynamicCache()
        cache.update(torch.zeros(2, 2, 3, 16), torch.zeros(2, 2, 3, 16), 0)
        model(ids, past_key_values=cache)


def test_gate_initialisations():
    u = torch.randn(2, 5, 32)
    model = tiny_model({"pattern": "dense", "gate_init": "mamba2"})
    mixer = model.transformer.h[0].mixer
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 1e-1 * 1.001
    a = mixer.A_log.exp()
    assert a.min() >= 1.0 and a.max() <= 16.0
    g = mixer.gate(u)
    assert g.shape == (2, 2, 5) and (g > 0).all() and (g < 1).all()

    closed = tiny_model({"pattern": "dense", "gate_init": "closed"}).transformer.h[1].mixer.gate(u)
    torch.testing.assert_close(closed, torch.full_like(closed, CLOSED_GATE_VALUE), rtol=1e-5, atol=0)
    assert CLOSED_GATE_VALUE == pytest.approx(math.exp(-16))
    half = tiny_model({"pattern": "exp2:ce", "gate_init": 0.25}).transformer.h[0].mixer.gate(u)
    torch.testing.assert_close(half, torch.full_like(half, 0.25))
    # the closed gate still learns: its gradient is non-zero
    m = tiny_model({"pattern": "dense", "gate_init": "closed"})
    m.train()
    ids = torch.randint(1, 61, (2, 8))
    m(ids, labels=ids).loss.backward()
    assert m.transformer.h[0].mixer.A_log.grad.abs().sum() > 0


def test_auto_classes():
    cfg = tiny_config("dense")
    assert isinstance(AutoModelForCausalLM.from_config(cfg), hr.ResolventForCausalLM)
    assert isinstance(AutoModel.from_config(cfg), hr.ResolventModel)
    assert isinstance(AutoConfig.for_model("resolvent", n_layer=1, n_embd=16, n_head=2), hr.ResolventConfig)


def test_tied_word_embeddings():
    model = tiny_model("dense")
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    untied = tiny_model("dense", tie_word_embeddings=False)
    assert untied.lm_head.weight.data_ptr() != untied.transformer.wte.weight.data_ptr()


# --------------------------------------------------------------------------------------------------
# GPT-2 conversion


def _small_gpt2(seed=0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=61, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def test_from_gpt2_attention_equals_gpt2(tmp_path):
    gpt2 = _small_gpt2()
    gpt2.save_pretrained(tmp_path)
    ids = torch.randint(0, 61, (2, 20))
    with torch.no_grad():
        ref = gpt2(ids, output_hidden_states=True)
    for source in (gpt2, str(tmp_path)):  # a model or a folder
        model = hr.ResolventForCausalLM.from_gpt2(source, mixer="attention").eval()
        assert model.config.position_embedding == "learned" and model.config.tie_word_embeddings
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
        assert len(out.hidden_states) == len(ref.hidden_states)
        for mine, theirs in zip(out.hidden_states, ref.hidden_states):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    # greedy decoding through the caches agrees too
    assert torch.equal(model.generate(ids[:, :8], max_new_tokens=6, do_sample=False),
                       gpt2.generate(ids[:, :8], max_new_tokens=6, do_sample=False))


def test_from_gpt2_closed_dense_gate_equals_gpt2():
    gpt2 = _small_gpt2(1)
    model = hr.ResolventForCausalLM.from_gpt2(gpt2, mixer="dense").eval()
    ids = torch.randint(0, 61, (2, 20))
    with torch.no_grad():
        ref = gpt2(ids).logits
        out = model(ids).logits
    # g = e^-16 ~ 1.1e-7 at start: the recurrent channel adds ~1e-7 relative
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert (out - ref).abs().max() < 1e-4
    # the sparse patterns' direct channel only sees P^A_i: not GPT-2 any more (why the test above uses dense)
    sparse = hr.ResolventForCausalLM.from_gpt2(gpt2, mixer="exp2:ce").eval()
    with torch.no_grad():
        assert (sparse(ids).logits - ref).abs().max() > 1e-3
