"""scripts/pretrain.py: an interrupted + resumed run ends with the same weights as an uninterrupted one; the same
script under ``accelerate launch --num_processes 2 --cpu``; the final folder (model, tokenizer, card, plot)."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, load_script, tiny_run_args
from safetensors.torch import load_file

from hf_resolvent.training import data as D
from hf_resolvent.training.checkpoints import latest_checkpoint, tied_weights_notice_hidden
from hf_resolvent.training.config import batch_layout, load_config
from hf_resolvent.training.evaluate import strided_perplexity
from hf_resolvent.training.metrics import read_metrics
from hf_resolvent.training.models import PAPER_MIXERS, build_model, mixer_slug
from hf_resolvent.training.optim import build_optimizer, lr_at

pretrain = load_script("pretrain")


@pytest.fixture(scope="module")
def data_dir(tiny_data):
    return tiny_data


_args = tiny_run_args


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _losses(folder: Path) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(folder / "metrics.jsonl")]


@pytest.fixture(scope="module")
def straight(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    results = pretrain.train(_args(data_dir, out, "--max-steps", "7"))
    return out, results


def test_interrupted_and_resumed_run_equals_uninterrupted(data_dir, straight, tmp_path):
    out_a, results_a = straight
    out_b = tmp_path / "b"
    # "killed" after step 5: the last checkpoint is step 3, steps 4-5 were logged but are lost
    assert pretrain.train(_args(data_dir, out_b, "--max-steps", "7", "--stop-after", "5")) == {"stopped_at": 5}
    assert latest_checkpoint(out_b).name == "step_0000003"
    assert not (out_b / "model.safetensors").exists()
    # a kill during a checkpoint write leaves a temporary folder that must be ignored and cleaned
    (out_b / "checkpoints" / ".tmp_step_0000006").mkdir()
    results_b = pretrain.train(_args(data_dir, out_b, "--max-steps", "7", "--resume"))
    wa, wb = _weights(out_a), _weights(out_b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert _losses(out_a) == _losses(out_b)  # metrics of the lost steps were replaced, not duplicated
    assert results_a["val_loss"] == results_b["val_loss"] and results_b["steps"] == 7
    ckpts = sorted(p.name for p in (out_b / "checkpoints").iterdir())
    assert ckpts == ["step_0000006", "step_0000007"]  # keep: 2, no temporary folder left

    # resuming a finished run trains nothing and rewrites the same final folder
    results_c = pretrain.train(_args(data_dir, out_b, "--max-steps", "7", "--resume"))
    assert results_c["val_loss"] == results_b["val_loss"]
    assert all(torch.equal(wa[k], v) for k, v in _weights(out_b).items())


def test_training_reduces_loss_and_writes_a_model_folder(straight):
    out, results = straight
    rows = read_metrics(out / "metrics.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 7 and losses[-1] < losses[0]
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6, 7]
    assert results["val_ppl"] == pytest.approx(float(torch.tensor(results["val_loss"]).exp()), rel=1e-5)
    assert (out / "loss.png").stat().st_size > 1000

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_resolvent  # noqa: F401  (registers the model type)

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "ResolventForCausalLM" and model.config.n_layer == 2
    assert tok.eos_token == D.EOT
    ids = tok("The", return_tensors="pt")["input_ids"]
    gen = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.eos_token_id)
    assert gen.shape == (1, ids.shape[1] + 5)

    import yaml

    card = (out / "README.md").read_text()
    header = yaml.safe_load(card.split("---")[1])
    assert header["library_name"] == "transformers" and "mixer-dense" in header["tags"]
    metrics = header["model-index"][0]["results"][0]["metrics"]
    assert metrics[0]["value"] == pytest.approx(results["val_ppl"], rel=1e-3)
    assert "{{" not in card and "standard library" in card


def test_usage_errors_are_clear(data_dir, straight, tmp_path, capsys):
    out, _ = straight
    assert pretrain.main(_args(data_dir, out, "--max-steps", "7")) == 2  # checkpoints exist, no --resume
    assert "--resume" in capsys.readouterr().err
    assert pretrain.main(_args(data_dir, out, "--max-steps", "9", "--resume")) == 2  # schedule would change
    assert "train.max_steps: 7 -> 9" in capsys.readouterr().err
    assert pretrain.main(_args(data_dir, tmp_path / "x", "--set", "train.nope=1")) == 2
    assert "unknown config key" in capsys.readouterr().err
    assert pretrain.main(_args(data_dir, tmp_path / "y", "--set", "train.batch_size=5")) == 2
    assert "multiple" in capsys.readouterr().err
    assert pretrain.main(["--config", "tiny", "--data", str(tmp_path), "--output-dir", str(tmp_path / "z")]) == 2
    assert "prepare_data.py" in capsys.readouterr().err


def test_checkpoints_say_nothing_of_the_tied_lm_head(data_dir, tmp_path, caplog):
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        pretrain.train(_args(data_dir, out, "--max-steps", "3", "--no-final-save"))
    assert latest_checkpoint(out).name == "step_0000003"
    assert not [r for r in caplog.records if "Removed shared tensor" in r.getMessage()]


def test_only_the_notice_of_the_models_own_tied_weights_is_hidden(caplog):
    from accelerate import PartialState
    from accelerate.utils.other import clean_state_dict_for_safetensors

    PartialState()  # Accelerate's logger needs its state
    model = build_model({"type": "resolvent", "preset": "tiny", "mixer": "dense",
                           "overrides": {"n_layer": 1, "n_embd": 16, "n_head": 2, "n_inner": 32}}, 50, 16)
    shared = torch.zeros(3)
    untied = {"a.weight": shared, "b.weight": shared}  # a sharing the model does not declare: still reported
    with caplog.at_level(logging.WARNING), tied_weights_notice_hidden(model):
        clean_state_dict_for_safetensors(model.state_dict())
        clean_state_dict_for_safetensors(untied)
        logging.getLogger("accelerate.utils.other").warning("another warning")
    said = [r.getMessage() for r in caplog.records]
    assert not any("lm_head" in m for m in said)
    assert any("Removed shared tensor {'b.weight'}" in m for m in said) and "another warning" in said
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the filter ends with the save
        clean_state_dict_for_safetensors(model.state_dict())
    assert any("lm_head.weight" in r.getMessage() for r in caplog.records)


def test_paper_configs_resolve():
    for size, steps, batch, lr, betas, ctx in (("44m", 100_000, 256, 5e-4, [0.9, 0.98], 512),
                                               ("355m", 25_000, 128, 2.5e-4, [0.9, 0.95], 2048)):
        for mixer in PAPER_MIXERS + ["gpt2"]:
            cfg = load_config(f"{size}-{mixer_slug(mixer)}")
            assert cfg["train"]["max_steps"] == steps and cfg["train"]["batch_size"] == batch
            assert cfg["train"]["lr"] == lr and cfg["train"]["betas"] == betas and cfg["data"]["seq_len"] == ctx
            assert cfg["train"]["weight_decay"] == 0.1 and cfg["train"]["grad_clip"] == 1.0
            if mixer == "gpt2":
                assert cfg["model"]["type"] == "gpt2"
            else:
                assert cfg["model"]["mixer"] == mixer and cfg["model"]["preset"] == size
    assert batch_layout(load_config("44m-dense"), 8) == (32, 1)
    assert batch_layout(load_config("44m-dense"), 1) == (32, 8)
    tcfg = {"lr": 1.0, "warmup_steps": 10, "max_steps": 110, "min_lr_ratio": 0.1}
    assert lr_at(0, tcfg) == pytest.approx(0.1) and lr_at(9, tcfg) == pytest.approx(1.0)
    assert lr_at(60, tcfg) == pytest.approx(0.55) and lr_at(110, tcfg) == pytest.approx(0.1)


def test_optimizer_decays_matrices_only_and_fuses_on_cpu():
    model = build_model({"type": "resolvent", "preset": "tiny", "mixer": "dense",
                           "overrides": {"n_layer": 1, "n_embd": 16, "n_head": 2, "n_inner": 32}}, 50, 16)
    opt = build_optimizer(model, 1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-6)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert decay["fused"] and decay["betas"] == (0.9, 0.95) and decay["eps"] == 1e-6
    # The fused update is the per-tensor loop's, up to rounding.
    twin = build_model({"type": "resolvent", "preset": "tiny", "mixer": "dense",
                          "overrides": {"n_layer": 1, "n_embd": 16, "n_head": 2, "n_inner": 32}}, 50, 16)
    twin.load_state_dict(model.state_dict())
    twin_opt = build_optimizer(twin, 1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-6, fused=False)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    for m, o in ((model, opt), (twin, twin_opt)):
        for _ in range(3):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


_FAULTS_OF_LARGE_BLOCKS = """
import resource, sys, torch
from hf_resolvent.training.memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
for _ in range(3):  # 100 MB blocks allocated and freed: the heap settles
    torch.ones(25_000_000)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    torch.ones(25_000_000)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_keep_freed_memory_reuses_large_blocks():
    faults = {mode: int(subprocess.run([sys.executable, "-c", _FAULTS_OF_LARGE_BLOCKS, mode], check=True,
                                       capture_output=True, text=True).stdout)
              for mode in ("default", "keep")}
    assert faults["default"] > 5 * 20_000  # 24,414 fresh 4 KiB pages per 100 MB block
    assert faults["keep"] < 5_000


def test_two_processes_under_accelerate_launch_agree(data_dir, straight, tmp_path):
    out_a, _ = straight
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--num_processes", "2", "--cpu",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           str(REPO / "scripts" / "pretrain.py"), *_args(data_dir, out, "--max-steps", "7")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "train_results.json").read_text())
    assert results["processes"] == 2
    sums = results["process_checksums"]
    assert len(sums) == 2 and sums[0] == sums[1]  # both processes hold the same weights
    assert "2 process(es) x micro-batch 2 x accumulation 1" in proc.stdout
    # same global batches as the single-process run (2 x 1 instead of 1 x 2 accumulation): same weights up to
    # the order of floating-point summation
    wa, wb = _weights(out_a), _weights(out)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-3, atol=1e-4)


evaluate_script = load_script("evaluate")


def test_strided_perplexity_scores_every_token_once():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=64, n_embd=16, n_layer=1, n_head=2)).eval()
    tokens = torch.randint(0, 50, (45,)).numpy()
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens)[None]).logits[0]
    full = torch.nn.functional.cross_entropy(logits[:-1], torch.from_numpy(tokens[1:])).item()
    one = strided_perplexity(model, tokens, 64, 32, 4, torch.device("cpu"))
    assert one["tokens"] == 44 and one["loss"] == pytest.approx(full, rel=1e-5)
    # non-overlapping windows of 16 (+1 shared boundary token): the mean of the per-window losses
    disjoint = strided_perplexity(model, tokens, 16, 15, 2, torch.device("cpu"))
    nll = 0.0
    for b in range(0, 44, 15):
        w = torch.from_numpy(tokens[b:b + 16])
        with torch.no_grad():
            lg = model(w[None]).logits[0]
        nll += torch.nn.functional.cross_entropy(lg[:-1], w[1:], reduction="sum").item()
    assert disjoint["tokens"] == 44 and disjoint["loss"] == pytest.approx(nll / 44, rel=1e-5)
    for stride in (1, 5, 8, 15):
        assert strided_perplexity(model, tokens, 16, stride, 8, torch.device("cpu"))["tokens"] == 44
    # disjoint windows cannot score the first token of each window (no context inside the window)
    assert strided_perplexity(model, tokens, 16, 16, 8, torch.device("cpu"))["tokens"] == 42
    with pytest.raises(ValueError, match="stride"):
        strided_perplexity(model, tokens, 16, 17, 8, torch.device("cpu"))


def test_evaluate_script_writes_table_figure_and_samples(straight, tmp_path, capsys):
    out_a, results = straight
    out = tmp_path / "eval"
    assert evaluate_script.main([str(out_a), "--out", str(out), "--samples", "2", "--max-new-tokens", "4",
                                 "--max-tokens", "400"]) == 0
    table = json.loads((out / "eval.json").read_text())["rows"]
    assert len(table) == 1 and table[0]["mixer"] == "dense" and table[0]["time_per_token"] == "O(n)"
    assert math.isfinite(table[0]["perplexity"]) and table[0]["tokens"] > 0
    assert len(table[0]["samples"]) == 2
    assert (out / "perplexity_vs_complexity.png").stat().st_size > 1000
    assert "| `dense` |" in (out / "eval.md").read_text()
    assert json.loads((out_a / "eval_results.json").read_text())["perplexity"] == table[0]["perplexity"]
    assert evaluate_script.main([str(tmp_path), "--out", str(out)]) == 2
    assert "no config.json" in capsys.readouterr().err
