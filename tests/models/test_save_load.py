"""save_pretrained / from_pretrained (safetensors) and remote code in a fresh process without hf_resolvent."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

import hf_resolvent as hr

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes: thread hand-offs would dominate


def tiny_model(mixer, seed=0, **kw) -> hr.ResolventForCausalLM:
    fields = dict(vocab_size=61, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=None,
                  pad_token_id=0)
    fields.update(kw)
    torch.manual_seed(seed)
    return hr.ResolventForCausalLM(hr.ResolventConfig(mixer=mixer, **fields)).eval()


MIXER = ["exp2:ce", {"pattern": "dense", "tied": True, "gate_init": 0.3}]


def test_round_trip_safetensors(tmp_path):
    model = tiny_model(MIXER, position_embedding="learned", tie_word_embeddings=False)
    ids = torch.randint(1, 61, (2, 12))
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert not (tmp_path / "pytorch_model.bin").exists()
    for cls in (hr.ResolventForCausalLM, AutoModelForCausalLM):
        back = cls.from_pretrained(tmp_path).eval()
        assert type(back) is hr.ResolventForCausalLM
        assert back.config.layer_mixers == model.config.layer_mixers
        with torch.no_grad():
            assert torch.equal(back(ids).logits, ref)
        for (name, p), (_, q) in zip(model.state_dict().items(), back.state_dict().items()):
            assert torch.equal(p, q), name
    base = AutoModel.from_pretrained(tmp_path)
    assert type(base) is hr.ResolventModel
    with torch.no_grad():
        torch.testing.assert_close(model.lm_head(base.eval()(ids).last_hidden_state), ref)


class _Payload:
    """A pickle that runs a shell command when loaded: it would create the file named."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def test_a_pickled_weights_file_that_runs_code_is_refused_with_the_way_to_convert_a_trusted_one(tmp_path):
    model = tiny_model(MIXER)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    torch.save({**model.state_dict(), "payload": _Payload(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(OSError) as err:
        AutoModelForCausalLM.from_pretrained(folder)
    message = str(err.value)
    assert not marker.exists()
    assert f"{folder / 'pytorch_model.bin'} is a pickle that holds more than tensors" in message
    assert "it names posix.system" in message and "not safe to load" in message
    # the conversion the message gives, for a file one trusts, leaves safetensors that load as the model
    command = re.search(r'python -c "(.*?)" && rm', message).group(1)
    subprocess.run([sys.executable, "-c", command], check=True, timeout=300, capture_output=True)
    assert marker.exists()  # the trusted load ran the pickle, as the message warned
    (folder / "pytorch_model.bin").unlink()
    ids = torch.randint(1, 61, (2, 9))
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits, model(ids).logits)


def test_saved_folder_carries_the_code(tmp_path):
    tiny_model(MIXER).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "resolvent"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_resolvent.ResolventConfig",
        "AutoModel": "modeling_resolvent.ResolventModel",
        "AutoModelForCausalLM": "modeling_resolvent.ResolventForCausalLM",
    }
    names = {p.name for p in tmp_path.iterdir()}
    for needed in ("configuration_resolvent.py", "modeling_resolvent.py", "inputs_resolvent.py", "cache_resolvent.py",
                   "gpt2_conversion.py", "patterns.py",
                   "remote_code.py", "resolvent_ops.py", "parallel.py", "recurrent.py", "state.py", "slots.py",
                   "sparse_solve.py", "dense_solve.py", "attention.py", "extend.py"):
        assert needed in names
    entry = (tmp_path / "resolvent_ops.py").read_text()
    assert "IS_BUNDLE = True" in entry
    ops = Path(hr.ops.__file__).parent
    for path in tmp_path.glob("*.py"):  # flat: no package-relative or hf_resolvent imports at module level
        if (ops / path.name).is_file() and path.name != "patterns.py":  # an ops module, shipped as it is
            assert path.read_text() == (ops / path.name).read_text(), path.name
        for line in path.read_text().splitlines():
            assert not line.startswith("from .."), (path.name, line)
            assert not line.startswith(("from hf_resolvent", "import hf_resolvent")), (path.name, line)


def test_a_saved_folder_holds_the_ops_modules_its_entry_reaches_and_no_other(tmp_path):
    """The ops modules copied into a saved folder are those its resolvent_ops.py reaches through flat imports, followed
    through the copies (patterns.py ships with the model files): a new ops module the mixer imports ships with no
    list to keep."""
    tiny_model(MIXER).save_pretrained(tmp_path)
    ops = Path(hr.ops.__file__).parent
    todo, reached = ["resolvent_ops"], set()
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += re.findall(r"^\s*from\s+\.(\w+)\s+import", (tmp_path / f"{module}.py").read_text(), flags=re.M)
    shipped = {p.stem for p in tmp_path.glob("*.py") if (ops / p.name).is_file() and p.name != "patterns.py"}
    assert shipped == reached - {"resolvent_ops", "patterns"}
    assert {"mixer", "state", "dispatch", "parallel"} <= shipped


_LOADER = textwrap.dedent(
    """
    import importlib.abc
    import sys


    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_resolvent" or name.startswith("hf_resolvent."):
                raise ImportError(name + " is blocked in this test")
            return None


    sys.meta_path.insert(0, _Block())
    try:
        import hf_resolvent  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("hf_resolvent is importable: the test would prove nothing")

    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    torch.set_num_threads(1)
    folder, ids_path, out_path = sys.argv[1:4]
    ids = torch.load(ids_path)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert "hf_resolvent" not in type(model).__module__, type(model).__module__
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    base = AutoModel.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        logits = model(ids).logits
        greedy = model.generate(ids, max_new_tokens=6, do_sample=False)
    model.save_pretrained(folder + "_again")  # re-saving remote code keeps the bundle
    again = AutoModelForCausalLM.from_pretrained(folder + "_again", trust_remote_code=True).eval()
    with torch.no_grad():
        logits_again = again(ids).logits
    refused = {}
    for impl in ("cpu", "triton"):  # the backends are not shipped: a named one is refused, never replaced
        again.config.mixer_impl = impl
        try:
            again(ids)
        except RuntimeError as err:
            refused[impl] = str(err)
    torch.save({"logits": logits, "greedy": greedy, "again": logits_again, "refused": refused,
                "config": type(config).__name__,
                "base": type(base).__name__, "modules": sorted(m for m in sys.modules if m.split(".")[0] == "hf_resolvent")},
               out_path)
    """
)


def test_trust_remote_code_in_a_fresh_process_without_hf_resolvent(tmp_path, torch_path):
    """The bundle is the PyTorch path (no compiled kernels): the reference logits come from the same path, so
    that they can be compared bit for bit."""
    model = tiny_model(MIXER)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    ids = torch.randint(1, 61, (2, 10))
    with torch.no_grad():
        ref_logits = model(ids).logits
        ref_greedy = model.generate(ids, max_new_tokens=6, do_sample=False)
    torch.save(ids, tmp_path / "ids.pt")
    (tmp_path / "load.py").write_text(_LOADER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1",
               TRANSFORMERS_VERBOSITY="error")
    result = subprocess.run(
        [sys.executable, "-I", str(tmp_path / "load.py"), str(folder), str(tmp_path / "ids.pt"),
         str(tmp_path / "out.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    assert out["modules"] == []
    assert out["config"] == "ResolventConfig" and out["base"] == "ResolventModel"
    assert torch.equal(out["logits"], ref_logits)
    assert torch.equal(out["again"], ref_logits)
    assert torch.equal(out["greedy"], ref_greedy)
    assert set(out["refused"]) == {"cpu", "triton"}
    assert all("has only the PyTorch path; install hf-resolvent" in why for why in out["refused"].values())


_TOKENIZER_LOADS = {
    "AutoTokenizer, trusted as the model": "from transformers import AutoTokenizer as T; kw = {'trust_remote_code': True}",
    "PreTrainedTokenizerFast": "from transformers import PreTrainedTokenizerFast as T; kw = {}",
    "AutoTokenizer after import hf_resolvent": "import hf_resolvent; from transformers import AutoTokenizer as T; kw = {}",
}


@pytest.mark.parametrize("how", list(_TOKENIZER_LOADS))
def test_the_documented_ways_to_load_a_saved_folders_tokenizer_ask_and_warn_nothing(tmp_path, how):
    """AutoTokenizer reads config.json before the tokenizer, so without hf_resolvent (and without
    trust_remote_code) it asks about the model's code: docs/training.md gives these ways instead."""
    from hf_resolvent.training import data as D

    folder = tmp_path / "model"
    tiny_model("exp2:ce").save_pretrained(folder)
    tokenizer = D.train_bpe_tokenizer([d["text"] for d in D.stdlib_corpus(max_docs=3)], vocab_size=280)
    tokenizer.save_pretrained(folder)
    blocked = "" if "hf_resolvent" in how else "import sys; sys.modules['hf_resolvent'] = None; "
    code = f"{blocked}{_TOKENIZER_LOADS[how]}; print(T.from_pretrained({str(folder)!r}, **kw)('def f(x):').input_ids)"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], input="", capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "custom code" not in result.stdout + result.stderr and "model of type" not in result.stderr
    assert result.stdout.split("\n")[-2] == str(tokenizer("def f(x):").input_ids)
