"""Every script checks its device and output paths before any work: a device this PyTorch cannot use, a file where
a folder is written (or a folder where a file is), a path inside a file, each end at once with exit code 2 and one
line naming the option and the fix (``hf_resolvent.training.cli``)."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import load_script

from hf_resolvent.training import cli

# (script, its arguments besides the faulty option, the option, what it writes: "folder" or "file")
OUTPUTS = [
    ("long_context", [], "--out", "folder"),
    ("long_context", [], "--runs-dir", "folder"),
    ("sweep", [], "--out", "folder"),
    ("synthetic", [], "--out", "file"),
    ("evaluate", ["runs/none"], "--out", "folder"),
    ("bench/bench_train", [], "--out", "file"),
    ("bench/bench_decode", [], "--out", "file"),
    ("bench/bench_generate", [], "--out", "file"),
    ("bench/bench_mixer", [], "--out", "file"),
    ("bench/roofline", [], "--out", "file"),
    ("bench/gpu_check", [], "--out", "folder"),
    ("bench/gpu_measure", [], "--out", "folder"),
]
DEVICES = [("long_context", []), ("sweep", []), ("synthetic", []), ("evaluate", ["runs/none"]),
           ("bench/bench_train", ["--out", "x.json"])]


def _refused(script, argv, capsys) -> str:
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        load_script(script).main(argv)
    assert exit_info.value.code == 2 and time.monotonic() - t0 < 10  # at once, before any work
    err = capsys.readouterr().err
    assert "Traceback" not in err and sum("error:" in line for line in err.splitlines()) == 1, err  # one message
    return err


@pytest.mark.parametrize(("script", "argv", "option", "kind"), OUTPUTS,
                         ids=[f"{s}-{o}" for s, _, o, _ in OUTPUTS])
def test_an_output_of_the_wrong_kind_is_refused_before_any_work(tmp_path, capsys, script, argv, option, kind):
    a_file, a_folder = tmp_path / "taken.json", tmp_path / "folder"
    a_file.write_text("{}")
    a_folder.mkdir()
    wrong = a_file if kind == "folder" else a_folder
    err = _refused(script, [*argv, option, str(wrong)], capsys)
    said = "is an existing file, not a folder" if kind == "folder" else "is a folder; pass the path of a file"
    assert f"{option} {wrong} {said}" in err, err
    inside = a_file / "sub" / ("out" if kind == "folder" else "out.json")
    err = _refused(script, [*argv, option, str(inside)], capsys)
    assert f"{option} {inside} is inside {a_file}, which is a file" in err, err
    assert a_file.read_text() == "{}" and list(a_folder.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without a GPU")
@pytest.mark.parametrize(("script", "argv"), DEVICES, ids=[s for s, _ in DEVICES])
def test_a_device_this_pytorch_cannot_use_is_refused_before_any_work(tmp_path, capsys, script, argv):
    err = _refused(script, [*argv, "--device", "cuda"], capsys)
    assert "--device cuda: this PyTorch" in err and "--device cpu" in err, err
    err = _refused(script, [*argv, "--device", "gpu0"], capsys)
    assert "--device 'gpu0' is not a device" in err, err


def test_the_checks_pass_what_can_be_written(tmp_path):
    assert cli.output_problem(tmp_path / "new" / "deeper", "--out") is None  # created later
    assert cli.output_problem(tmp_path, "--out") is None
    assert cli.output_problem(tmp_path / "x.json", "--out", "file") is None
    assert cli.device_problem("cpu") is None
