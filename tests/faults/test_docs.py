"""What a new user copies runs as written: the README's Python blocks, the model card's usage block (in a process
without hf_resolvent, at a terminal where an interactive prompt would wait), and the README's benchmark
commands write to an untracked folder, never over the committed reference results in bench/."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, load_script, tiny_run_args

ROOT = REPO
README = (ROOT / "README.md").read_text()


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def _python(code: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``code`` with a terminal as its standard input, as a user would: a prompt waits there (until
    transformers' own time-out fails the call) instead of reading end-of-file."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
    terminal, stdin = os.openpty()
    try:
        return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout, stdin=stdin)
    finally:
        os.close(stdin)
        os.close(terminal)


@pytest.mark.parametrize("index", range(len(_blocks(README, "python"))))
def test_every_python_block_of_the_readme_runs_as_written(index, tmp_path):
    result = _python(_blocks(README, "python")[index], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


_NO_HF_RESOLVENT = textwrap.dedent("""
    import importlib.abc, sys

    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "hf_resolvent":
                raise ImportError(name + " is blocked: the card says the model loads without it")

    sys.meta_path.insert(0, _Block())
""")


def test_the_model_cards_usage_block_runs_without_hf_resolvent_or_a_prompt(tiny_data, tmp_path):
    out = tmp_path / "model"
    load_script("pretrain").train(tiny_run_args(tiny_data, out, "--max-steps", "2"))
    card = (out / "README.md").read_text().replace("REPO_ID", str(out))  # push_to_hub fills in the real id
    (block,) = _blocks(card, "python")
    result = _python(_NO_HF_RESOLVENT + block, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Do you wish to run the custom code" not in result.stdout + result.stderr  # transformers' prompt
    assert result.stdout.strip()  # the generated text


def _bench_commands() -> list[list[str]]:
    commands = []
    for block in _blocks(README, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if any(w.startswith("scripts/") for w in words):
                commands.append(words)
    return commands


def test_readme_commands_write_to_an_untracked_folder():
    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split())
    outs = []
    for words in _bench_commands():
        for flag in ("--out", "--output-dir"):
            if flag in words:
                outs.append(words[words.index(flag) + 1])
    assert len(outs) >= 10
    for out in outs:
        assert not out.startswith("bench/") and out not in tracked, out
        ignored = subprocess.run(["git", "check-ignore", "-q", out], cwd=ROOT).returncode == 0
        assert ignored, f"{out}: a README command writes where git would see it"


def test_bench_kernels_default_output_is_untracked():
    out = load_script("bench_kernels").parse_args([]).out
    assert subprocess.run(["git", "check-ignore", "-q", out + ".json"], cwd=ROOT).returncode == 0, out
