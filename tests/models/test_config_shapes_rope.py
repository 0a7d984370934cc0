"""Config shapes transformers users pass (head_dim given apart from n_embd / n_head) and RoPE scaling through
transformers' RoPE functions (rope_parameters, or the legacy rope_scaling)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_resolvent as hr

pytestmark = pytest.mark.usefixtures("one_thread_module")

MIXERS = ["exp2:ce", "dense+tied", "attention"]


def tiny_model(seed=0, **kw) -> hr.ResolventForCausalLM:
    fields = dict(vocab_size=61, n_positions=256, n_embd=32, n_layer=3, n_head=2, mixer=MIXERS, bos_token_id=0,
                  eos_token_id=None, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, initializer_range=0.1)
    fields.update(kw)
    torch.manual_seed(seed)
    return hr.ResolventForCausalLM(hr.ResolventConfig(**fields)).eval()


def test_head_dim_apart_from_the_width(tmp_path):
    model = tiny_model(n_embd=37, head_dim=16)
    mixer = model.transformer.h[0].mixer
    assert mixer.in_proj.weight.shape == (5 * 2 * 16, 37) and mixer.out_proj.weight.shape == (37, 32)
    ids = torch.randint(1, 61, (2, 11))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :6], use_cache=True)
        step = model(ids[:, 6:], past_key_values=out.past_key_values).logits  # decode through the cache
    assert full.shape == (2, 11, 61)
    torch.testing.assert_close(step, full[:, 6:], atol=1e-4, rtol=1e-4)
    model.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert back.config.head_dim == 16
    with torch.no_grad():
        assert torch.equal(back(ids).logits, full)


@pytest.mark.parametrize("fields, message", [
    (dict(n_embd=37, n_head=2), "must be divisible by n_head .* or give head_dim"),
    (dict(head_dim=0), "head_dim must be a positive integer"),
    (dict(head_dim=15), "needs an even head width, got head_dim = 15"),
    (dict(rope_parameters={"rope_type": "warp"}), "must be 'default' or one of"),
])
def test_inconsistent_shapes_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        hr.ResolventConfig(**fields)


@pytest.mark.parametrize("field, value", [("n_layer", 1_000_000), ("conv_size", 10**12), ("conv_size", 10**6),
                                          ("vocab_size", 10**9), ("n_embd", 10**6), ("n_inner", 10**8)])
def test_a_config_json_asking_for_absurd_sizes_is_refused_by_field(tmp_path, field, value):
    """A damaged or mistyped config.json is refused before anything is allocated, naming the field and its bound."""
    import json

    tiny_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    bound = f"{hr.configuration_resolvent.SIZE_BOUNDS[field]:,}"
    with pytest.raises(ValueError, match=f"{field} = {value:,} is over the largest size a config may ask for "
                                         f"\\({bound}\\)"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_learned_position_table_is_bounded_and_rope_is_not():
    with pytest.raises(ValueError, match="n_positions = 1,073,741,824 rows of a learned position table"):
        hr.ResolventConfig(position_embedding="learned", n_positions=2**30)
    assert hr.ResolventConfig(position_embedding="rope", n_positions=2**30).n_positions == 2**30


def test_linear_scaling_is_the_default_at_scaled_positions():
    """Linear RoPE scaling by 2 divides every frequency by 2: positions 2p then read as positions p unscaled."""
    plain = tiny_model()
    scaled = tiny_model(rope_parameters={"rope_type": "linear", "factor": 2.0})
    scaled.load_state_dict(plain.state_dict())
    ids = torch.randint(1, 61, (1, 20))
    pos = torch.arange(20)[None]
    with torch.no_grad():
        want = plain(ids, position_ids=pos).logits
        got = scaled(ids, position_ids=2 * pos).logits
        other = scaled(ids, position_ids=pos).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(other, want, atol=1e-3)


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_scaled_rope_types_decode_like_their_full_forward(rope):
    model = tiny_model(rope_parameters=dict(rope))
    assert model.config.rope_parameters["rope_type"] == rope["rope_type"]
    assert model.transformer.rotary_emb.rope_type == rope["rope_type"]
    plain = tiny_model()
    ids = torch.randint(1, 61, (1, 40))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :30], use_cache=True)
        step = model(ids[:, 30:], past_key_values=out.past_key_values).logits
        differs = not torch.allclose(full, plain(ids).logits, atol=1e-4)
    torch.testing.assert_close(step, full[:, 30:], atol=1e-4, rtol=1e-4)
    # dynamic NTK changes nothing within the trained length; yarn and llama3 change the frequencies
    assert differs == (rope["rope_type"] != "dynamic")


def test_legacy_rope_scaling_keyword_and_round_trip(tmp_path):
    config = hr.ResolventConfig(rope_scaling={"type": "linear", "factor": 3.0}, rope_theta=5000.0)
    assert config.rope_parameters["rope_type"] == "linear"
    assert config.rope_parameters["factor"] == 3.0 and config.rope_theta == 5000.0
    config.save_pretrained(tmp_path)
    again = hr.ResolventConfig.from_pretrained(tmp_path)
    assert again.rope_parameters == config.rope_parameters and again.rope_theta == 5000.0


def test_rope_parameters_set_on_a_built_config_are_refused(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    late = hr.ResolventConfig.from_pretrained(tmp_path, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="was set after the config was built"):
        hr.ResolventForCausalLM(late)
    old = hr.ResolventConfig.from_pretrained(tmp_path)
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": old.n_positions}
    config = hr.ResolventConfig(**{**old.to_dict(), "rope_parameters": rope, "n_positions": 4 * old.n_positions})
    model = hr.ResolventForCausalLM.from_pretrained(tmp_path, config=config).eval()  # the README's recipe
    assert model.transformer.rotary_emb.rope_type == "yarn" and model.config.n_positions == 1024
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(1, 61, (1, 300))).logits).all()  # past the trained 256


# The checks of transformers' common tests test_model_rope_scaling_from_config and
# test_model_rope_scaling_frequencies, at 1.5x the context, past n_positions: RoPE has no table to run out of.

def test_rope_models_run_past_n_positions_and_decode_there_as_their_full_forward():
    model = tiny_model(n_positions=32)
    ids = torch.randint(1, 61, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :40], use_cache=True)
        step = model(ids[:, 40:], past_key_values=out.past_key_values).logits
        seq = model.generate(ids[:, :30], max_new_tokens=12, do_sample=False)  # crosses position 32 while decoding
        again = model(seq).logits
    assert torch.isfinite(full).all()
    torch.testing.assert_close(step, full[:, 40:], atol=1e-4, rtol=1e-4)
    assert torch.equal(seq[:, 30:], again[:, 29:-1].argmax(-1))


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn"])
def test_rope_scaling_from_config_past_the_context(rope_type):
    """Short inputs: dynamic NTK equals plain RoPE (it scales only past the original context), linear and YaRN
    differ. Inputs of 1.5x n_positions: every scaling differs from plain RoPE."""
    context = 32
    plain = tiny_model(n_positions=context)
    scaled = tiny_model(n_positions=context, rope_parameters={"rope_type": rope_type, "factor": 4.0})
    scaled.load_state_dict(plain.state_dict())
    short = torch.randint(1, 61, (1, 10), generator=torch.Generator().manual_seed(1))
    long = torch.randint(1, 61, (1, int(1.5 * context)), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        same_short = torch.allclose(plain(short).logits, scaled(short).logits, atol=1e-5)
        same_long = torch.allclose(plain(long).logits, scaled(long).logits, atol=1e-5)
    assert same_short == (rope_type == "dynamic")
    assert not same_long


def test_rope_tables_are_batch_positions_head_dim_and_scale_as_transformers_does():
    """cos and sin come as (B, n, head_dim), like transformers' rotary modules; linear scaling by 2 at position 2p
    is plain RoPE at p; dynamic NTK keeps the short tables and changes the long ones."""
    context, factor = 32, 2.0
    x = torch.zeros(1)
    short, long = torch.arange(10)[None], torch.arange(int(1.5 * context))[None]
    plain = tiny_model(n_positions=context).transformer.rotary_emb
    linear = tiny_model(n_positions=context, rope_parameters={"rope_type": "linear", "factor": factor})
    dynamic = tiny_model(n_positions=context, rope_parameters={"rope_type": "dynamic", "factor": factor})
    cos, sin = plain(x, long)
    assert cos.shape == sin.shape == (1, long.shape[1], 16)
    for got, want in zip(linear.transformer.rotary_emb(x, 2 * short), plain(x, short)):
        torch.testing.assert_close(got, want)
    for got, want in zip(dynamic.transformer.rotary_emb(x, short), plain(x, short)):
        torch.testing.assert_close(got, want)
    long_cos, _ = dynamic.transformer.rotary_emb(x, long)
    assert not torch.allclose(long_cos, cos)
