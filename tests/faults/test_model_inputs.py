"""Bad model inputs get one clear error naming the problem and the fix.

- Token inputs (empty prompt, batch of 0, ids outside the vocabulary): a ValueError from the model's forward, also
  through generate(); valid inputs at the vocabulary's edges still run.
- Model folders: the weights files record the mixer of each layer and the kind of positions, and loading them
  into another model (edited config.json: other mixers, another n_layer, other positions; ``from_pretrained(...,
  mixer=...)``) warns naming the differences; a missing config.json, a damaged or missing weights file, weights
  that are not finite, or a damaged safetensors index are an OSError naming the file.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import hf_resolvent as hr

VOCAB = 61


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes: thread hand-offs would dominate


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = hr.ResolventConfig(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                mixer=["exp2:ce", "dense+tied"], bos_token_id=1, eos_token_id=None, pad_token_id=0,
                                resid_pdrop=0.0, embd_pdrop=0.0)
    return hr.ResolventForCausalLM(config).eval()


def _raises_clearly(call, fragments) -> None:
    """call() raises a ValueError from our model code, whose one message holds every fragment."""
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    # raised by our check, not by torch deep inside, and not chained to another error
    raised_in = Path(info.traceback[-1].path)
    assert raised_in.name in ("modeling_resolvent.py", "inputs_resolvent.py", "common.py") and "hf_resolvent" in raised_in.parts, raised_in
    assert info.value.__cause__ is None and info.value.__context__ is None


BAD_IDS = [
    pytest.param(torch.empty(1, 0, dtype=torch.long), ["length 0", "empty prompt", "BOS token 1"], id="empty-prompt"),
    pytest.param(torch.empty(0, 5, dtype=torch.long), ["no sequences", "(0, 5)", "batch of 0"], id="batch-of-0"),
    pytest.param(torch.empty(0, 0, dtype=torch.long), ["no sequences", "(0, 0)", "batch of 0"], id="nothing"),
    pytest.param(torch.tensor([[1, 2, VOCAB]]), ["token id 61", "vocab_size = 61", "0 to 60"], id="id-vocab-size"),
    pytest.param(torch.tensor([[1, 50_000], [3, 4]]), ["token id 50000", "vocab_size = 61"], id="id-far-out"),
    pytest.param(torch.tensor([[1, -1, 2]]), ["token id -1", "vocab_size = 61"], id="id-negative"),
    pytest.param(torch.tensor([[-7, 99]]), ["token id -7", "vocab_size = 61"], id="both-ends"),
]


@pytest.mark.parametrize("ids, fragments", BAD_IDS)
def test_forward_refuses_bad_input_ids(model, ids, fragments):
    with torch.no_grad():
        _raises_clearly(lambda: model(ids), fragments)
        _raises_clearly(lambda: model.transformer(input_ids=ids), fragments)


@pytest.mark.parametrize("ids, fragments", BAD_IDS)
@pytest.mark.parametrize("options", [{}, {"do_sample": True}, {"num_beams": 2}], ids=["greedy", "sample", "beams"])
def test_generate_refuses_bad_input_ids(model, ids, fragments, options):
    _raises_clearly(lambda: model.generate(ids, max_new_tokens=3, **options), fragments)


def test_generate_refuses_bad_ids_after_a_cache(model):
    """Continuing from a returned cache: the new tokens are checked too."""
    ids = torch.tensor([[1, 2, 3]])
    out = model.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    more = torch.cat([out.sequences, torch.tensor([[VOCAB + 3]])], dim=1)
    _raises_clearly(lambda: model.generate(more, past_key_values=out.past_key_values, max_new_tokens=2),
                    ["token id 64", "vocab_size = 61"])


@pytest.mark.parametrize(
    "shape, fragments",
    [
        ((0, 4, 32), ["inputs_embeds", "(0, 4, 32)", "batch of 0"]),
        ((2, 0, 32), ["inputs_embeds", "length 0", "empty prompt"]),
        ((2, 32), ["inputs_embeds", "(batch, length, width)", "(2, 32)"]),
    ],
)
def test_empty_inputs_embeds_are_refused(model, shape, fragments):
    with torch.no_grad():
        _raises_clearly(lambda: model(inputs_embeds=torch.zeros(shape)), fragments)


def test_ids_at_the_vocabulary_edges_still_run(model):
    """0 and vocab_size - 1 are valid; inputs_embeds and decoding with a cache take the same path as before."""
    ids = torch.tensor([[0, VOCAB - 1, 5, VOCAB - 1], [3, 0, VOCAB - 1, 7]])
    with torch.no_grad():
        logits = model(ids).logits
        assert logits.shape == (2, 4, VOCAB) and torch.isfinite(logits).all()
        embeds = model.transformer.wte(ids)
        torch.testing.assert_close(model(inputs_embeds=embeds).logits, logits)
        prefill = model(ids[:, :3], use_cache=True)
        step = model(ids[:, 3:], past_key_values=prefill.past_key_values, use_cache=True)
        torch.testing.assert_close(step.logits[:, -1], logits[:, -1], atol=1e-5, rtol=1e-5)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert out.shape == (2, 9) and int(out.min()) >= 0 and int(out.max()) < VOCAB
    one = model.generate(torch.tensor([[1]]), max_new_tokens=3, do_sample=False)  # the BOS token alone
    assert one.shape == (1, 4)


# --------------------------------------------------------------------------------------------------
# Model folders

MIXERS = ["exp2:ce", "dense+tied"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A model with two different mixers, saved as one weights file and as several shards (folders read-only)."""
    torch.manual_seed(0)
    config = hr.ResolventConfig(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, mixer=MIXERS,
                                bos_token_id=1, eos_token_id=None, pad_token_id=0)
    model = hr.ResolventForCausalLM(config).eval()
    root = tmp_path_factory.mktemp("saved")
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    assert len(list((root / "sharded").glob("model-*-of-*.safetensors"))) > 1
    return model, root


def _copy(saved, layout, tmp_path):
    folder = tmp_path / layout
    shutil.copytree(saved[1] / layout, folder)
    return folder


def _weight_files(folder):
    return sorted(folder.glob("model*.safetensors"))


def _mixer_warnings(record):
    return [str(w.message) for w in record if "trained with mixer" in str(w.message)]


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_weights_files_record_the_mixer_of_each_layer(saved, layout):
    model, root = saved
    files = _weight_files(root / layout)
    assert files
    for path in files:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata()
        assert metadata["format"] == "pt"  # transformers' own entry is kept
        assert json.loads(metadata["hf_resolvent.mixers"]) == MIXERS, path.name
    back = hr.ResolventForCausalLM.from_pretrained(root / layout).eval()  # the tensor bytes are unchanged
    for (name, p), (_, q) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(p, q), name


def test_a_variant_records_its_mixers(saved, tmp_path):
    saved[0].save_pretrained(tmp_path, variant="v1")
    with safe_open(tmp_path / "model.v1.safetensors", framework="pt") as f:
        assert json.loads(f.metadata()["hf_resolvent.mixers"]) == MIXERS


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_loading_with_another_mixer_warns_naming_both(saved, layout, tmp_path):
    folder = saved[1] / layout
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        hr.ResolventForCausalLM.from_pretrained(folder)  # as saved: no warning
    assert _mixer_warnings(record) == []

    with pytest.warns(UserWarning, match="trained with mixer") as record:
        hr.ResolventForCausalLM.from_pretrained(folder, mixer=["banded:4", "dense+tied"])
    (message,) = _mixer_warnings(record)
    assert str(MIXERS) in message and str(["banded:4", "dense+tied"]) in message, message
    assert ".safetensors" in message

    edited = _copy(saved, layout, tmp_path)
    config = json.loads((edited / "config.json").read_text())
    # parameters of the same shapes (only layer 1's gate goes unused): transformers alone would load this quietly
    config["mixer"] = ["square:ce", "local_attention:8"]
    (edited / "config.json").write_text(json.dumps(config))
    for cls in (hr.ResolventForCausalLM, AutoModelForCausalLM):
        with pytest.warns(UserWarning, match="trained with mixer") as record:
            cls.from_pretrained(edited)
        (message,) = _mixer_warnings(record)
        assert str(MIXERS) in message and str(["square:ce", "local_attention:8"]) in message, message


def test_a_folder_without_config_json_is_refused_naming_it(saved, tmp_path):
    folder = _copy(saved, "single", tmp_path)
    (folder / "config.json").unlink()
    for load in (hr.ResolventForCausalLM.from_pretrained, hr.ResolventModel.from_pretrained,
                 hr.ResolventConfig.from_pretrained):
        with pytest.raises(OSError) as info:
            load(folder)
        message = str(info.value)
        assert "config.json" in message and str(folder) in message, message


def _truncate_half(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _cut_last_byte(path):
    path.write_bytes(path.read_bytes()[:-1])


def _garbage(path):
    path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                   dtype=torch.uint8).numpy().tobytes())


def _empty(path):
    path.write_bytes(b"")


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("damage", [_truncate_half, _cut_last_byte, _garbage, _empty],
                         ids=["truncated", "last-byte-cut", "garbage", "empty"])
def test_a_damaged_weights_file_is_named(saved, layout, damage, tmp_path):
    folder = _copy(saved, layout, tmp_path)
    path = _weight_files(folder)[-1]
    damage(path)
    for cls in (hr.ResolventForCausalLM, AutoModelForCausalLM):
        with pytest.raises(OSError) as info:
            cls.from_pretrained(folder)
        message = str(info.value)
        assert str(path) in message and "damaged" in message, message
        assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_missing_shard_is_named(saved, tmp_path):
    folder = _copy(saved, "sharded", tmp_path)
    path = _weight_files(folder)[1]
    path.unlink()
    with pytest.raises(FileNotFoundError) as info:
        hr.ResolventForCausalLM.from_pretrained(folder)
    assert str(path) in str(info.value) and "missing" in str(info.value)


def _architecture_warnings(record):
    return [str(w.message) for w in record if "do not match the model the config loading them builds" in
            str(w.message)]


@pytest.mark.parametrize("edit, fragments", [
    (dict(n_layer=3), ["saved for n_layer = 2, but the config says n_layer = 3",
                       "layers 2 to 2 start from random weights"]),
    (dict(n_layer=1), ["saved for n_layer = 2, but the config says n_layer = 1",
                       "the trained layers 1 to 1 are left out"]),
    (dict(position_embedding="learned"), ["trained with position_embedding='rope', but the config says "
                                          "position_embedding='learned'", "learned position table starts from random"]),
], ids=["more-layers", "fewer-layers", "learned-positions"])
def test_a_config_edited_to_another_shape_warns_naming_it(saved, edit, fragments, tmp_path):
    folder = _copy(saved, "single", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(edit)
    if "n_layer" in edit:  # the mixer list follows the layers, with the same spec in every common layer
        config["mixer"] = (MIXERS * 2)[:edit["n_layer"]]
    (folder / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        hr.ResolventForCausalLM.from_pretrained(folder)
    (message,) = _architecture_warnings(record)
    assert all(fragment in message for fragment in fragments), message
    assert "trained with mixer" not in message, message  # the common layers' mixers agree: not said to differ


def _overwrite_middle(path):
    """0xff bytes over a stretch in the middle of the tensor data, as a bad copy might leave: every float32 there
    reads as NaN, and the file still opens."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = b"\xff" * 4096
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_weights_that_are_not_finite_are_refused_naming_the_tensor_and_file(saved, layout, tmp_path):
    folder = _copy(saved, layout, tmp_path)
    path = max(_weight_files(folder), key=lambda p: p.stat().st_size)
    _overwrite_middle(path)
    with safe_open(path, framework="pt") as f:
        names = [name for name in f.keys() if not torch.isfinite(f.get_tensor(name)).all()]
    assert names  # the damage is there, and safetensors reads it without complaint
    for cls in (hr.ResolventForCausalLM, AutoModelForCausalLM):
        with pytest.raises(OSError) as info:
            cls.from_pretrained(folder)
        message = str(info.value)
        assert str(path) in message and f"NaN or infinite values in {names[0]}" in message, message


@pytest.mark.parametrize("content, problem", [
    ("{not json", "is not valid JSON"),
    ("", "is not valid JSON"),
    ("[1, 2]", "holds a list, not a JSON object"),
    ('{"metadata": {}, "weight_map": {}}', "has no weight_map"),
    ('{"metadata": {}}', "has no weight_map"),
    ('{"weight_map": {"lm_head.weight": 3}}', "has a weight_map whose values are not all shard file names"),
], ids=["broken", "empty", "list", "empty-map", "no-map", "bad-values"])
def test_a_damaged_weights_index_is_named(saved, content, problem, tmp_path):
    folder = _copy(saved, "sharded", tmp_path)
    index = folder / "model.safetensors.index.json"
    index.write_text(content)
    for cls in (hr.ResolventForCausalLM, AutoModelForCausalLM):
        with pytest.raises(OSError) as info:
            cls.from_pretrained(folder)
        message = str(info.value)
        assert f"the weights index {index} {problem}" in message and "save or download the model again" in message
