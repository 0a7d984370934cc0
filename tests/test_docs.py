"""What a new user copies runs as written: the Python blocks of the README and of docs/ (after the install their
text names: every package a block imports is in that extra of pyproject.toml, or a base dependency), the model
card's usage block (in a process without hf_resolvent, at a terminal where an interactive prompt would wait), the
benchmark commands of the README and docs/ write to an untracked folder, never over the committed reference results
in bench/, and every relative link of the README, docs/, kernels/README.md and bench/NOTES.md leads to a file (and
heading) that exists."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import textwrap
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from conftest import REPO, load_script, tiny_run_args
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI (the dev extra installs it there)
    import tomli as tomllib

README = (REPO / "README.md").read_text()
# What a user reads as instructions: the README, the docs, and model cards where the repository has them.
USER_DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted(REPO.glob("model_cards/**/*.md"))]
# Every Markdown file whose links are checked.
LINKED_DOCS = [*USER_DOCS, *(REPO / p / "README.md" for p in ("kernels", "experiments")), REPO / "bench" / "NOTES.md"]


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


def _name(path: Path) -> str:
    return str(path.relative_to(REPO))


# (file, index of the Python block in it), one test each
PYTHON_BLOCKS = [(doc, i) for doc in USER_DOCS for i in range(len(_blocks(doc.read_text(), "python")))]


@pytest.mark.parametrize("doc, index", PYTHON_BLOCKS, ids=[f"{_name(d)}:{i}" for d, i in PYTHON_BLOCKS])
def test_every_python_block_of_the_docs_runs_as_written(doc, index, tmp_path):
    result = _python(_blocks(doc.read_text(), "python")[index], tmp_path)
    assert result.returncode == 0, f"{_name(doc)}, Python block {index}:\n{result.stderr[-3000:]}"


def test_the_docs_have_python_blocks_beyond_the_readme():
    assert len(PYTHON_BLOCKS) > len(_blocks(README, "python"))


PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
_HEADING = re.compile(r"^#{1,6} ", flags=re.M)
# pip install "hf-resolvent[export]", pip install hf-resolvent, pip install -e ".[dev]", pip install -e .
_INSTALL = re.compile(r"""pip install\s+(?:-e\s+)?["']?(?:hf-resolvent|\.)(?:\[([\w,\s-]*)\])?""")


def _python_blocks_and_extras(text: str) -> list[tuple[str, set[str]]]:
    """Each Python block of ``text`` with the extras its install line names: the last ``pip install`` of this
    package in the block itself, or else in the prose that leads to it (since the previous code block or heading).
    No install line: the base install."""
    found, prose_start = [], 0
    for fence in _FENCE.finditer(text):
        if fence.group(1) == "python":
            lead = text[prose_start:fence.start()]
            headings = list(_HEADING.finditer(lead))
            if headings:
                lead = lead[headings[-1].start():]
            installs = _INSTALL.findall(lead + fence.group(2))
            extras = {e.strip() for e in installs[-1].split(",") if e.strip()} if installs else set()
            found.append((fence.group(2), extras))
        prose_start = fence.end()
    return found


def _installed_by(extras: set[str]) -> set[str]:
    """The distributions ``pip install "hf-resolvent[extras]"`` asks for by name (an extra may name others)."""
    names = {canonicalize_name(PROJECT["name"])}
    names |= {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}
    todo, seen = set(extras), set()
    while todo:
        extra = todo.pop()
        seen.add(extra)
        for requirement in map(Requirement, PROJECT["optional-dependencies"][extra]):
            if canonicalize_name(requirement.name) == canonicalize_name(PROJECT["name"]):
                todo |= requirement.extras - seen
            names.add(canonicalize_name(requirement.name))
    return names


def _imported_modules(code: str) -> set[str]:
    """The top-level modules ``code`` imports, the standard library's left out."""
    modules = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names)


def test_the_install_lines_are_found():
    for doc in USER_DOCS:
        text = doc.read_text()
        assert len(_python_blocks_and_extras(text)) == len(_blocks(text, "python")), _name(doc)
    assert any("onnxruntime" in code and extras == {"export"}
               for code, extras in _python_blocks_and_extras((REPO / "docs" / "serving.md").read_text()))


@pytest.mark.parametrize("doc, index", PYTHON_BLOCKS, ids=[f"{_name(d)}:{i}" for d, i in PYTHON_BLOCKS])
def test_every_python_block_imports_only_what_its_install_line_installs(doc, index):
    code, extras = _python_blocks_and_extras(doc.read_text())[index]
    assert extras <= set(PROJECT["optional-dependencies"]), f"block {index}: no such extra in pyproject.toml"
    install = f"pip install \"hf-resolvent[{','.join(sorted(extras))}]\"" if extras else "pip install hf-resolvent"
    installed = _installed_by(extras)
    distributions = packages_distributions()
    for module in sorted(_imported_modules(code)):
        providers = {canonicalize_name(d) for d in distributions.get(module, [])}
        assert providers, f"block {index} imports {module}, which is not installed here (no distribution has it)"
        assert providers & installed, (
            f"{_name(doc)} Python block {index} imports {module} ({', '.join(sorted(providers))}), which `{install}` "
            f"does not install: add it to that extra in pyproject.toml, or name the extra that has it")


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
    for block in (b for doc in USER_DOCS for b in _blocks(doc.read_text(), "bash")):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if any(w.startswith(("scripts/", "experiments/")) for w in words):
                commands.append(words)
    return commands


def test_doc_commands_write_to_an_untracked_folder():
    tracked = set(subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout.split())
    outs = []
    for words in _bench_commands():
        for flag in ("--out", "--output-dir"):
            if flag in words:
                outs.append(words[words.index(flag) + 1])
    assert len(outs) >= 10
    for out in outs:
        assert not out.startswith("bench/") and out not in tracked, out
        ignored = subprocess.run(["git", "check-ignore", "-q", out], cwd=REPO).returncode == 0
        assert ignored, f"{out}: a command of the docs writes where git would see it"


def test_the_readme_keeps_a_benchmark_command_per_table():
    readme_outs = [w for b in _blocks(README, "bash") for w in shlex.split(b.replace("\\\n", " "), comments=True)
                   if w.startswith("runs/bench/")]
    assert len(readme_outs) >= 5, readme_outs


# [text](target) and ![alt](target); the target ends at the first space or closing bracket
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of ``markdown``: lower case, punctuation dropped, spaces to hyphens,
    a repeated one numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", _FENCE.sub("", markdown), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _broken_links(doc: Path) -> list[str]:
    """Each relative link of ``doc`` whose file is missing, or whose #anchor names no heading of a Markdown file."""
    prose = _CODE_SPAN.sub(lambda m: "x" * len(m.group()), _FENCE.sub("", doc.read_text()))
    broken = []
    for target in _LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            broken.append(f"{target}: no heading with that anchor")
    return broken


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=[_name(d) for d in LINKED_DOCS])
def test_every_relative_link_leads_to_a_file_that_exists(doc):
    assert doc.exists()
    assert _broken_links(doc) == []


def test_broken_links_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading (here)\n")
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\n[ok](other.md) [ok](other.md#a-code-heading-here) ![ok](other.md) [ok](#title)\n"
                   "[ok](https://example.com/x.md) `[not a link](missing.md)`\n"
                   "```bash\necho [not a link](missing.md)\n```\n"
                   "[gone](missing.md) [bad anchor](other.md#nothing) [bad](#no-such-heading)\n")
    assert _broken_links(doc) == ["missing.md: no such file", "other.md#nothing: no heading with that anchor",
                                  "#no-such-heading: no heading with that anchor"]


def test_bench_kernels_default_output_is_untracked():
    out = load_script("bench/bench_kernels").parse_args([]).out
    assert subprocess.run(["git", "check-ignore", "-q", out + ".json"], cwd=REPO).returncode == 0, out


def test_the_patterns_command_prints_no_warning(tmp_path):
    png = tmp_path / "figures" / "patterns.png"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "hf_resolvent", "-n", "64", "--plot", str(png)], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Warning" not in result.stderr, result.stderr[-3000:]  # runpy's, when the package ran patterns.py again
    assert "diagonal" in result.stdout and png.stat().st_size > 0
    # running the module itself names the command instead of doing nothing
    older = subprocess.run([sys.executable, "-m", "hf_resolvent.patterns", "-n", "64"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert older.returncode == 1 and "python -m hf_resolvent [SPEC" in older.stderr and not older.stdout


def test_demo_mixer_draws_the_patterns_of_its_table_where_git_ignores_it(tmp_path, monkeypatch):
    demo = load_script("bench/demo_mixer")
    default = demo.parse_args([]).plot
    assert subprocess.run(["git", "check-ignore", "-q", default], cwd=REPO).returncode == 0, default
    drawn = []

    def plot_patterns(path, specs=None, n=64):
        drawn.append(specs)
        return real_plot_patterns(path, specs, n)

    real_plot_patterns = demo.plot_patterns
    monkeypatch.setattr(demo, "plot_patterns", plot_patterns)
    png = tmp_path / "figures" / "patterns.png"
    demo.main(["--n", "16", "--plot", str(png)])
    assert drawn == [demo.SPECS] and "diagonal" in demo.SPECS
    assert png.stat().st_size > 0
