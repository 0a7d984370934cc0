"""Faults injected into training runs (scripts/pretrain.py) and evaluation (scripts/evaluate.py): a second run
into a busy folder, a resume against another configuration or data, damaged checkpoints, a kill while the final
model is written, non-finite numbers, a validation split too short for one window."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import load_script, tiny_run_args
from safetensors.torch import load_file, save_file

from hf_resolvent import data as D
from hf_resolvent.experiments import training as T

pretrain = load_script("pretrain")
evaluate = load_script("evaluate")

_HOLDER = textwrap.dedent("""
    import sys, time
    from hf_resolvent import locks
    with locks.exclusive(sys.argv[1], what="a test's folder", fix="-"):
        print("held", flush=True)
        time.sleep(120)
""")


def _hold_lock(path: Path) -> subprocess.Popen:
    """A live process holding the lock ``path`` (it prints "held" once it does)."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory):
    """An uninterrupted 7-step run (checkpoints at 3, 6, 7)."""
    out = tmp_path_factory.mktemp("straight")
    return out, pretrain.train(tiny_run_args(tiny_data, out, "--max-steps", "7"))


def _stopped_run(data_dir: Path, out: Path, stop: int = 6, *extra) -> None:
    """A run of 7 steps killed after step ``stop`` (checkpoints every 3 steps)."""
    assert pretrain.train(tiny_run_args(data_dir, out, "--max-steps", "7", "--stop-after", str(stop), *extra)) \
        == {"stopped_at": stop}


def _main(args: list[str], capsys) -> tuple[int, str]:
    code = pretrain.main(args)
    return code, capsys.readouterr().err


# ------------------------------------------------------------------------------------------- item 3: locks


def test_a_second_run_into_a_busy_folder_stops_at_once(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    holder = _hold_lock(out / ".run.lock")  # what a live run holds
    try:
        code, err = _main(tiny_run_args(tiny_data, out, "--max-steps", "3"), capsys)
    finally:
        holder.kill()
        holder.wait()
    assert code == 2
    assert f"pid {holder.pid}" in err and "another --output-dir" in err, err
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()  # nothing written


def test_the_lock_of_a_killed_run_is_taken_over(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    holder = _hold_lock(out / ".run.lock")
    holder.send_signal(signal.SIGKILL)  # a run killed with kill -9 cleans up nothing
    holder.wait()
    code, err = _main(tiny_run_args(tiny_data, out, "--max-steps", "3", "--no-final-save"), capsys)
    assert code == 0, err
    assert "took over the run folder" in err and f"pid {holder.pid}" in err
    assert T.latest_checkpoint(out).name == "step_0000003"
    assert not (out / ".run.lock.owner").exists()  # released at the end


# ---------------------------------------------------------------------------- item 4: resume checks the run


@pytest.mark.parametrize("change, named", [
    (["--mixer", "exp2:ce"], "model.mixer: 'dense' -> 'exp2:ce'"),
    (["--set", "model.overrides={n_layer: 2, n_embd: 32, n_head: 4, n_inner: 64, n_positions: 64}"],
     "model.overrides"),
    (["--set", "train.lr=0.01"], "train.lr: 0.002 -> 0.01"),
])
def test_resume_refuses_another_configuration_even_without_run_config(tiny_data, tmp_path, capsys, change, named):
    out = tmp_path / "run"
    _stopped_run(tiny_data, out, 3)
    (out / "run_config.json").unlink()  # the record beside the run is gone: the checkpoint's own must decide
    code, err = _main(tiny_run_args(tiny_data, out, "--max-steps", "7", "--resume", *change), capsys)
    assert code == 2
    assert named in err and "another --output-dir" in err, err
    assert T.latest_checkpoint(out).name == "step_0000003"  # nothing trained


def test_resume_refuses_data_prepared_anew_in_the_same_folder(tiny_data, tmp_path, capsys):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    out = tmp_path / "run"
    _stopped_run(data, out, 3)
    shutil.rmtree(data)  # the same path now holds other data: same options, so only the data record can tell
    D.prepare_dataset(data, source=D.STDLIB, tokenizer="bpe", vocab_size=300, max_docs=14, num_proc=1,
                      log=lambda *a: None)
    code, err = _main(tiny_run_args(data, out, "--max-steps", "7", "--resume"), capsys)
    assert code == 2
    assert "dataset.train_tokens" in err, err


# ------------------------------------------------------------------------- item 5: checkpoints and the final


def _flip_a_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))


def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(tiny_data, straight, tmp_path, capsys):
    out = tmp_path / "run"
    _stopped_run(tiny_data, out, 6)
    _flip_a_byte(out / "checkpoints" / "step_0000006" / "model.safetensors")
    code, err = _main(tiny_run_args(tiny_data, out, "--max-steps", "7", "--resume"), capsys)
    assert code == 0, err
    assert "step_0000006 (model.safetensors is damaged: its sha256 differs" in err and "resuming from step_0000003" in err
    a, b = load_file(str(straight[0] / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # steps 4-7 trained again: the same weights


def test_no_intact_checkpoint_is_a_clear_error(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    _stopped_run(tiny_data, out, 6)
    ckpts = out / "checkpoints"
    weights = ckpts / "step_0000006" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    (ckpts / "step_0000003" / "manifest.json").unlink()  # an interrupted save
    code, err = _main(tiny_run_args(tiny_data, out, "--max-steps", "7", "--resume"), capsys)
    assert code == 2
    assert "no intact checkpoint" in err and "step_0000006 (model.safetensors is damaged: 100 bytes" in err, err
    assert "step_0000003 (no manifest.json" in err and "Traceback" not in err


def test_a_kill_while_the_final_model_is_written_leaves_no_folder_that_loads(tiny_data, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"

    def killed(*args, **kwargs):  # the model's weights and config are written by now, the rest is not
        raise KeyboardInterrupt

    monkeypatch.setattr(T, "plot_loss", killed)
    with pytest.raises(KeyboardInterrupt):
        pretrain.train(tiny_run_args(tiny_data, out, "--max-steps", "3"))
    assert not (out / "config.json").exists()
    with pytest.raises((OSError, ValueError), match="config.json"):
        AutoModelForCausalLM.from_pretrained(out)
    monkeypatch.undo()
    pretrain.train(tiny_run_args(tiny_data, out, "--max-steps", "3", "--resume"))  # the same command finishes it
    assert AutoModelForCausalLM.from_pretrained(out).config.n_layer == 2
    assert not (out / ".tmp_final").exists()


# ---------------------------------------------------------------------------------- item 6: non-finite numbers


def _poison(folder: Path, manifest: bool = True) -> None:
    """Put a NaN into the folder's weights and re-write its manifest (intact files, bad numbers)."""
    path = folder / "model.safetensors"
    weights = load_file(str(path))
    name = next(k for k in weights if k.endswith("weight"))
    weights[name][0] = float("nan")
    save_file(weights, str(path), metadata={"format": "pt"})
    if manifest:
        T.write_manifest(folder)


def test_training_stops_at_the_first_non_finite_loss(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    _stopped_run(tiny_data, out, 3)
    _poison(out / "checkpoints" / "step_0000003")
    code, err = _main(tiny_run_args(tiny_data, out, "--max-steps", "7", "--resume"), capsys)
    assert code == 2
    assert "at step 4 is nan" in err and "step_0000003" in err and "train.lr" in err, err
    assert not (out / "model.safetensors").exists() and not (out / "checkpoints" / "step_0000006").exists()


def test_resuming_a_finished_run_with_non_finite_weights_is_refused(tiny_data, straight, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(straight[0], out)
    (out / "model.safetensors").unlink()
    (out / "config.json").unlink()
    last = out / "checkpoints" / "step_0000007"
    _poison(last)
    state = json.loads((last / "trainer_state.json").read_text())
    for key in pretrain.EVAL_KEYS:  # no stored result: the final evaluation runs on the poisoned weights
        state.pop(key, None)
    (last / "trainer_state.json").write_text(json.dumps(state))
    T.write_manifest(last)
    code, err = _main(tiny_run_args(tiny_data, out, "--max-steps", "7", "--resume"), capsys)
    assert code == 2 and "the validation loss at step 7 is nan" in err, err
    assert not (out / "config.json").exists()


def test_a_validation_split_shorter_than_one_window_is_refused(tiny_data, tmp_path, capsys):
    val = len(D.TokenShards(tiny_data, "val"))
    assert len(D.TokenShards(tiny_data, "train")) > 4 * (val + 1)
    seq = val + 1  # one window needs seq_len + 1 tokens
    out = tmp_path / "run"
    code, err = _main(tiny_run_args(tiny_data, out, "--max-steps", "3", "--set", f"data.seq_len={seq}",
                                    "--set", f"model.overrides.n_positions={seq}"), capsys)
    assert code == 2
    assert "val" in err and str(val) in err.replace(",", "") and "seq_len" in err, err
    assert not (out / "model.safetensors").exists()


def test_evaluate_refuses_non_finite_results_and_short_splits(straight, tmp_path, capsys):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(straight[0], folder)
    code = evaluate.main([str(folder), "--samples", "0", "--max-length", str(10**6), "--out", str(tmp_path / "e")])
    assert code == 2
    assert "fewer than one window" in capsys.readouterr().err
    _poison(folder, manifest=False)  # the model folder's own weights
    code = evaluate.main([str(folder), "--samples", "0", "--out", str(tmp_path / "e")])
    assert code == 2
    err = capsys.readouterr().err
    assert "not finite" in err and "Traceback" not in err
    assert not (folder / "eval_results.json").exists() and not (tmp_path / "e" / "eval.json").exists()


def test_the_two_perplexities_say_what_they_measure(straight, tmp_path, capsys):
    folder, results = straight
    assert results["val_windows"] == 4 and results["val_window"] == 32
    assert "(4 non-overlapping windows of 32 tokens" in (folder / "README.md").read_text()
    assert evaluate.main([str(folder), "--samples", "0", "--out", str(tmp_path / "e")]) == 0
    assert "strided: windows of 32 tokens every 16" in capsys.readouterr().out
