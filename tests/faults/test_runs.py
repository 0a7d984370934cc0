"""Faults injected into training runs (scripts/pretrain.py) and evaluation (scripts/evaluate.py): a second run
into a busy folder, a resume against another configuration or data, damaged checkpoints, a kill while the final
model is written, non-finite numbers, a validation split too short for one window, numeric settings out of range,
a full device or a read-only folder, a model folder without its tokenizer, a run evaluated from another folder."""

from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import load_script, tiny_run_args
from safetensors.torch import load_file, save_file

from hf_resolvent import files
from hf_resolvent.training import data as D
from hf_resolvent.training import loop
from hf_resolvent.training.checkpoints import latest_checkpoint, write_manifest
from hf_resolvent.training.config import NUMERIC_SETTINGS, ConfigError, load_config
from hf_resolvent.training.evaluate import EVAL_KEYS
from hf_resolvent.training.optim import lr_at

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


def test_the_loss_logged_after_a_resume_says_which_steps_it_averages(tiny_data, straight, tmp_path):
    """log.every 4, checkpoints every 3: a run killed after step 5 resumes from step 3, so its row at step 4 averages
    step 4 alone where the uninterrupted run's averages steps 1-4; each row records its span (loss_steps)."""
    every = ("--set", "log.every=4")
    whole, out = tmp_path / "whole", tmp_path / "run"
    pretrain.train(tiny_run_args(tiny_data, whole, "--max-steps", "7", *every))
    _stopped_run(tiny_data, out, 5, *every)
    pretrain.train(tiny_run_args(tiny_data, out, "--max-steps", "7", "--resume", *every))

    def spans(folder):
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss_steps"] for r in rows if "loss" in r}

    assert spans(whole) == {4: 4, 7: 3}
    assert spans(out) == {4: 1, 7: 3}


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
    assert latest_checkpoint(out).name == "step_0000003"
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
    assert latest_checkpoint(out).name == "step_0000003"  # nothing trained


def test_resume_refuses_data_prepared_anew_in_the_same_folder(tiny_data, tmp_path, capsys):
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

    monkeypatch.setattr(loop, "plot_loss", killed)
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
        write_manifest(folder)


def test_training_stops_at_the_first_non_finite_loss(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    _stopped_run(tiny_data, out, 3)
    _poison(out / "checkpoints" / "step_0000003")
    code, err = _main(tiny_run_args(tiny_data, out, "--max-steps", "7", "--resume"), capsys)
    assert code == 2
    assert "at step 4 is nan" in err and "step_0000003" in err and "train.lr" in err, err
    assert not (out / "model.safetensors").exists() and not (out / "checkpoints" / "step_0000006").exists()


def test_resuming_a_finished_run_with_non_finite_weights_is_refused(tiny_data, straight, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(straight[0], out)
    (out / "model.safetensors").unlink()
    (out / "config.json").unlink()
    last = out / "checkpoints" / "step_0000007"
    _poison(last)
    state = json.loads((last / "trainer_state.json").read_text())
    for key in EVAL_KEYS:  # no stored result: the final evaluation runs on the poisoned weights
        state.pop(key, None)
    (last / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(last)
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
    folder = tmp_path / "model"
    shutil.copytree(straight[0], folder, ignore=shutil.ignore_patterns("eval_results.json"))
    code = evaluate.main([str(folder), "--samples", "0", "--max-length", str(10**6), "--out", str(tmp_path / "e")])
    assert code == 2
    assert "fewer than one window" in capsys.readouterr().err
    _poison(folder, manifest=False)  # NaN in the model folder's own weights: refused as they load, or by the result
    code = evaluate.main([str(folder), "--samples", "0", "--out", str(tmp_path / "e")])
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and ("not finite" in err or "NaN" in err), err
    assert not (folder / "eval_results.json").exists() and not (tmp_path / "e" / "eval.json").exists()
    # finite weights so large that the outputs overflow: only the result can tell
    weights = load_file(str(straight[0] / "model.safetensors"))
    final_norm = next(k for k in weights if "ln_f" in k and k.endswith("weight"))
    weights[final_norm].fill_(3e38)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    code = evaluate.main([str(folder), "--samples", "0", "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert code == 2 and "not finite" in err and "Traceback" not in err, err
    assert not (folder / "eval_results.json").exists() and not (tmp_path / "e" / "eval.json").exists()


def test_the_two_perplexities_say_what_they_measure(straight, tmp_path, capsys):
    folder, results = straight
    assert results["val_windows"] == 4 and results["val_window"] == 32
    assert "(4 non-overlapping windows of 32 tokens" in (folder / "README.md").read_text()
    assert evaluate.main([str(folder), "--samples", "0", "--out", str(tmp_path / "e")]) == 0
    assert "strided: windows of 32 tokens every 16" in capsys.readouterr().out


# ------------------------------------------------------------------- round two, item 1: numeric settings


@pytest.mark.parametrize("setting, named", [
    (["--set", "train.batch_size=0"], "train.batch_size=0"),
    (["--set", "train.batch_size=-4"], "train.batch_size=-4"),
    (["--save-every", "0"], "checkpoint.every=0"),
    (["--eval-every", "0"], "eval.every=0"),
    (["--set", "train.lr=-1e-3"], "train.lr='-1e-3'"),
    (["--set", "train.lr=abc"], "train.lr='abc'"),
])
def test_a_numeric_setting_out_of_range_stops_the_run_before_it_starts(tiny_data, tmp_path, capsys, setting, named):
    out = tmp_path / "run"
    code, err = _main(tiny_run_args(tiny_data, out, "--max-steps", "4", *setting), capsys)
    assert code == 2
    assert named in err and "must be a" in err and "Traceback" not in err, err
    assert not out.exists()  # nothing started, nothing written


def test_every_numeric_setting_is_checked_and_sound_values_pass():
    for key in NUMERIC_SETTINGS:
        for bad in ("-1", "abc", "true", ".nan"):
            with pytest.raises(ConfigError, match=f"^{key}=.* is not allowed: it must be "):
                load_config("tiny", [f"{key}={bad}"])
    for whole in ("train.max_steps", "eval.every", "checkpoint.every", "log.every", "data.seq_len"):
        with pytest.raises(ConfigError, match="whole number"):
            load_config("tiny", [f"{whole}=2.5"])
    with pytest.raises(ConfigError, match="two numbers"):
        load_config("tiny", ["train.betas=[0.9]"])
    # edge values that are allowed, and a fraction as YAML leaves it (a string float() reads)
    cfg = load_config("tiny", ["train.lr=3e-4", "train.warmup_steps=0", "checkpoint.keep=0", "train.seed=0",
                                 "train.min_lr_ratio=0", "train.weight_decay=0", "train.betas=[0.0, 0.999]"])
    assert cfg["train"]["lr"] == 3e-4 and lr_at(0, cfg["train"]) == pytest.approx(3e-4)


@pytest.mark.parametrize("setting, named", [
    ("model.overrides={n_layer: 2, vocab_size: 100}", "model.overrides.vocab_size cannot be set: the tokenizer sets it"),
    ("model.overrides={n_layer: 2, mixer: exp2}", "model.overrides.mixer cannot be set: it is model.mixer (--mixer)"),
    ("model.overrides.n_layerz=2", "model.overrides.n_layerz is not a field of a resolvent model's config (did you "
                                   "mean n_layer?)"),
])
def test_an_override_that_would_collide_or_be_ignored_stops_the_run_by_name(tiny_data, tmp_path, capsys, setting,
                                                                            named):
    out = tmp_path / "run"
    code, err = _main(tiny_run_args(tiny_data, out, "--max-steps", "4", "--set", setting), capsys)
    assert code == 2 and named in err and "Traceback" not in err, err
    assert not out.exists()


def test_gpt2_overrides_are_checked_against_gpt2s_fields():
    assert load_config("tiny-gpt2", ["model.overrides.attn_pdrop=0.1"])["model"]["overrides"]["attn_pdrop"] == 0.1
    with pytest.raises(ConfigError, match="model.overrides.conv_size is not a field of a gpt2 model's config"):
        load_config("tiny-gpt2", ["model.overrides.conv_size=4"])


def test_a_number_written_without_a_decimal_point_is_a_number_and_resumes_as_one():
    from hf_resolvent.training.checkpoints import check_resumable

    as_typed, as_decimal = load_config("tiny", ["train.lr=1e-3"]), load_config("tiny", ["train.lr=0.001"])
    assert as_typed["train"]["lr"] == 0.001 and isinstance(as_typed["train"]["lr"], float)
    check_resumable(as_typed, as_decimal)
    recorded_as_text = {**as_decimal, "train": {**as_decimal["train"], "lr": "1e-3"}}  # a record YAML left a string
    check_resumable(recorded_as_text, as_decimal)
    with pytest.raises(ConfigError, match=r"train.lr: 0.001 -> 0.002"):
        check_resumable(recorded_as_text, load_config("tiny", ["train.lr=2e-3"]))


# ---------------------------------------------------------- round two, item 8: a full device, a read-only folder


TORCH_SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"


@pytest.mark.parametrize("error", [RuntimeError(TORCH_SHORT_WRITE), OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))],
                         ids=["torch-short-write", "ENOSPC"])
def test_a_full_device_during_a_checkpoint_keeps_the_last_one(tiny_data, straight, tmp_path, monkeypatch, capsys,
                                                              error):
    real_save = torch.save

    def save(obj, f, *args, **kwargs):  # the device fills up while step 6's checkpoint is written
        if "step_0000006" in str(f):
            Path(f).write_bytes(b"\0" * 100)  # what the writer got onto the disk
            raise error
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    out = tmp_path / "run"
    code, err = _main(tiny_run_args(tiny_data, out, "--max-steps", "7"), capsys)
    assert code == 2
    assert f"no space left on the device holding {out / 'checkpoints'}" in err, err
    assert "--resume" in err and "step_0000003" in err and "Traceback" not in err and "enforce" not in err, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000003"]  # no partial checkpoint
    assert not (out / "config.json").exists()
    monkeypatch.undo()
    code, err = _main(tiny_run_args(tiny_data, out, "--max-steps", "7", "--resume"), capsys)
    assert code == 0, err
    a, b = load_file(str(straight[0] / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # steps 4-7 trained again from step 3: the same weights


def test_a_full_device_while_the_final_model_is_written_leaves_nothing_that_loads(tiny_data, tmp_path,
                                                                                   monkeypatch, capsys):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(loop, "plot_loss", full)  # the weights and config are staged by now
    out = tmp_path / "run"
    code, err = _main(tiny_run_args(tiny_data, out, "--max-steps", "3"), capsys)
    assert code == 2
    assert f"no space left on the device holding {out}" in err and "--resume" in err and "Traceback" not in err, err
    assert not (out / "config.json").exists() and not (out / ".tmp_final").exists()


def _refuse_writes(monkeypatch, folder: Path, code: int = errno.EROFS) -> None:
    """Make every write under ``folder`` fail as on a read-only filesystem (tests run as root, whom chmod does not
    stop): creating a folder or a file, or opening one for writing."""
    folder = os.path.abspath(folder)
    inside = lambda path: os.path.commonpath([folder, os.path.abspath(os.fspath(path))]) == folder  # noqa: E731
    refused = lambda path: OSError(code, os.strerror(code), os.fspath(path))  # noqa: E731
    real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and inside(file) and any(c in mode for c in "wax+"):
            raise refused(file)
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise refused(path)
        return real_os_open(path, flags, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if inside(path) and not os.path.exists(path):  # an existing folder is EEXIST, as on a read-only mount
            raise refused(path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "mkdir", mkdir)


@pytest.mark.parametrize("refused", [errno.EROFS, errno.EACCES], ids=["EROFS", "EACCES"])
def test_a_read_only_output_folder_is_a_clear_error(tiny_data, tmp_path, monkeypatch, capsys, refused):
    out = tmp_path / "run"
    out.mkdir()
    _refuse_writes(monkeypatch, out, refused)
    code, err = _main(tiny_run_args(tiny_data, out, "--max-steps", "3"), capsys)
    assert code == 2
    assert f"cannot write to {out} ({os.strerror(refused)})" in err and "--output-dir" in err, err
    assert "Traceback" not in err and list(out.iterdir()) == []


def test_evaluate_into_read_only_folders_is_a_clear_error(straight, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "model"
    shutil.copytree(straight[0], folder, ignore=shutil.ignore_patterns("checkpoints", "eval_results.json"))
    with monkeypatch.context() as m:
        _refuse_writes(m, folder)
        code = evaluate.main([str(folder), "--samples", "0", "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot write to {folder}" in err and "Traceback" not in err, err
    assert not (folder / "eval_results.json").exists() and not (tmp_path / "e").exists()
    with monkeypatch.context() as m:
        _refuse_writes(m, tmp_path / "e")
        code = evaluate.main([str(folder), "--samples", "0", "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot write to {tmp_path / 'e'}" in err and "--out" in err, err


def test_writing_names_refused_writes_and_passes_other_errors_on(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    full = {"no space left on the device holding": [
        OSError(errno.ENOSPC, "No space left on device"), RuntimeError(TORCH_SHORT_WRITE),
        RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file "
                     "data/0: file write failed"),
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")],
        "cannot write to": [OSError(errno.EROFS, "Read-only file system"), PermissionError(errno.EACCES, "denied")],
        "a file under": [OSError(errno.EFBIG, "File too large"),
                         SafetensorError("Error while serializing: I/O error: File too large (os error 27)")]}
    for said, errors in full.items():
        for error in errors:
            with pytest.raises(files.WriteError, match=f"^{said} {tmp_path}.*, or pass another --out$"):
                with files.writing(tmp_path, "or pass another --out"):
                    raise error
    for other in (RuntimeError("boom"), FileNotFoundError(errno.ENOENT, "gone"), ValueError("no")):
        with pytest.raises(type(other)) as caught, files.writing(tmp_path):
            raise other
        assert caught.value is other
    # an atomic write cut short leaves neither the file nor its temporary twin
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(files.WriteError, match="no space left"), files.writing(tmp_path):
        files.atomic_write_json(tmp_path / "x.json", {"a": 1})
    assert list(tmp_path.iterdir()) == []


def test_a_file_size_limit_while_saving_is_a_clear_error(tmp_path):
    """A real limit on file size (``ulimit -f``, as a FAT32 drive's 4 GiB): safetensors fails with EFBIG, which is
    named like a full device."""
    code = (
        "import resource, sys, torch\n"
        "from safetensors.torch import save_file\n"
        "from hf_resolvent import files\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))\n"
        "try:\n"
        f"    with files.writing({str(tmp_path)!r}, 'or pass another --output-dir'):\n"
        f"        save_file({{'w': torch.zeros(1 << 18)}}, {str(tmp_path / 'model.safetensors')!r})\n"
        "except files.WriteError as err:\n"
        "    print(err)\n"
        "    sys.exit(2)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"a file under {tmp_path} grew past the largest file allowed there (File too large")
    assert "ulimit -f" in proc.stdout and proc.stdout.rstrip().endswith("or pass another --output-dir")


# --------------------------------------------------------------- round two, item 9: a folder without its tokenizer


def test_evaluate_a_model_folder_without_its_tokenizer_says_so(tiny_data, straight, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(straight[0], folder, ignore=shutil.ignore_patterns("checkpoints", "eval_results.json",
                                                                       "tokenizer*.json"))
    code = evaluate.main([str(folder), "--samples", "0", "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{folder} has no tokenizer files (tokenizer_config.json, tokenizer.json)" in err, err
    assert str(tiny_data / "tokenizer") in err and "sentencepiece" not in err and "Traceback" not in err, err
    assert not (folder / "eval_results.json").exists() and not (tmp_path / "e").exists()


# ------------------------------------------------------ round two, item 18: the record's data folder is absolute


def test_evaluate_finds_the_data_of_a_run_started_in_another_folder(tiny_data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tiny_data.parent)
    out = tmp_path / "run"
    pretrain.train(tiny_run_args(tiny_data.name, out, "--max-steps", "3"))  # --data data0: relative
    assert json.loads((out / "run_config.json").read_text())["data"]["dir"] == str(tiny_data.resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code = evaluate.main([str(out), "--samples", "0", "--out", str(tmp_path / "e")])
    assert code == 0, capsys.readouterr().err
    assert json.loads((out / "eval_results.json").read_text())["tokens"] > 0


def test_resume_accepts_the_relative_data_folder_an_earlier_version_recorded(tiny_data, tmp_path, monkeypatch,
                                                                             capsys):
    monkeypatch.chdir(tiny_data.parent)
    out = tmp_path / "run"
    _stopped_run(Path(tiny_data.name), out, 3, "--no-final-save")
    last = out / "checkpoints" / "step_0000003"
    state = json.loads((last / "trainer_state.json").read_text())
    state["run"]["data"]["dir"] = tiny_data.name  # as recorded before paths were made absolute
    (last / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(last)
    code, err = _main(tiny_run_args(tiny_data.name, out, "--max-steps", "7", "--resume", "--no-final-save"), capsys)
    assert code == 0, err
    assert latest_checkpoint(out).name == "step_0000007"
