"""scripts/push_to_hub.py: the dry run writes exactly the upload (weights, tokenizer, code, card), which loads with
trust_remote_code=True where hf_resolvent is not importable; without token or network a clear error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import load_script

from hf_resolvent import ResolventConfig, ResolventForCausalLM
from hf_resolvent.training import data as D
from hf_resolvent.training.card import render_model_card

push = load_script("push_to_hub")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    config = ResolventConfig.from_preset("tiny", mixer="exp2:ce", vocab_size=300, n_layer=1, n_embd=32, n_head=2,
                                         n_inner=64, resid_pdrop=0.0, embd_pdrop=0.0)
    ResolventForCausalLM(config).save_pretrained(folder)
    tok = D.train_bpe_tokenizer([d["text"] for d in D.stdlib_corpus(max_docs=5)], vocab_size=300)
    tok.save_pretrained(folder)
    card = render_model_card({"model_name": "run", "mixer": "exp2:ce", "repo_id": "REPO_ID", "val_ppl": 12.5,
                                "val_loss": 2.53, "datasets": [], "tags": ["hf-resolvent"]})
    (folder / "README.md").write_text(card)
    (folder / "loss.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)  # the card links it
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (folder / "checkpoints" / "step_0000001").mkdir(parents=True)
    (folder / "checkpoints" / "step_0000001" / "optimizer.bin").write_bytes(b"x" * 100)
    (folder / "logs").mkdir()
    (folder / "logs" / "events").write_text("tb")
    return folder


def test_dry_run_writes_exactly_the_upload(model_folder, tmp_path, capsys):
    dest = tmp_path / "upload"
    assert push.main([str(model_folder), "--repo-id", "someone/resolvent-test", "--dry-run", str(dest)]) == 0
    printed = capsys.readouterr().out
    files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert push.STAGING_MARK in files  # the mark that lets a later dry run replace this folder, not uploaded
    files.remove(push.STAGING_MARK)
    manifest = json.loads((tmp_path / "upload.manifest.json").read_text())
    assert [m["path"] for m in manifest["files"]] == files and manifest["repo_id"] == "someone/resolvent-test"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md", "loss.png",
            "modeling_resolvent.py", "configuration_resolvent.py"} <= set(files)
    assert not any(f.startswith(("checkpoints", "logs")) for f in files) and "metrics.jsonl" not in files
    assert f"{len(files)} files" in printed
    card = (dest / "README.md").read_text()
    assert "someone/resolvent-test" in card and "REPO_ID" not in card
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["model-index"][0]["results"][0]["metrics"][0]["value"] == 12.5
    # the staged folder loads with remote code in a process where hf_resolvent cannot be imported
    code = (
        "import sys; sys.modules['hf_resolvent'] = None\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(dest)!r}, trust_remote_code=True)\n"
        f"t = AutoTokenizer.from_pretrained({str(dest)!r})\n"
        "ids = t('The', return_tensors='pt')['input_ids']\n"
        "print(type(m).__module__, m.config.mixer, m(ids).logits.shape[-1])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    module, mixer, vocab = proc.stdout.split()[-3:]
    assert "hf_resolvent" not in module and module.startswith("transformers_modules")
    assert mixer == "exp2:ce" and vocab == "300"


def test_upload_without_token_or_network_fails_clearly(model_folder, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no stored login
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    assert push.main([str(model_folder), "--repo-id", "someone/x"]) == 2
    assert "no Hugging Face token" in capsys.readouterr().err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert push.main([str(model_folder), "--repo-id", "someone/x", "--token", "hf_dummy"]) == 2
    assert "not reachable" in capsys.readouterr().err


def test_bad_inputs(tmp_path, capsys):
    assert push.main([str(tmp_path), "--repo-id", "someone/x", "--dry-run"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert push.main([str(tmp_path), "--repo-id", "not a repo"]) == 2
    assert "namespace/name" in capsys.readouterr().err


def _copy(folder, tmp_path, name="model"):
    import shutil

    return Path(shutil.copytree(folder, tmp_path / name))


def _files(path):
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("where", ["the model folder", "the folder above it", "a folder inside it"])
def test_dry_run_never_stages_over_the_model_or_a_folder_around_it(model_folder, tmp_path, capsys, where):
    parent = tmp_path / "work"
    model = _copy(model_folder, parent)
    (parent / "notes.txt").write_text("mine")
    before = _files(parent)
    dest = {"the model folder": model, "the folder above it": parent, "a folder inside it": model / "up"}[where]
    assert push.main([str(model), "--repo-id", "someone/x", "--dry-run", str(dest)]) == 2
    err = capsys.readouterr().err
    assert ("holds the model folder" if where != "a folder inside it" else "inside the model folder") in err
    assert _files(parent) == before and "Traceback" not in err


def test_dry_run_replaces_only_a_folder_it_made(model_folder, tmp_path, capsys):
    dest = tmp_path / "upload"
    dest.mkdir()
    (dest / "thesis.tex").write_text("years of work")
    assert push.main([str(model_folder), "--repo-id", "someone/x", "--dry-run", str(dest)]) == 2
    assert "files this tool did not stage" in capsys.readouterr().err
    assert _files(dest) == ["thesis.tex"] and not (tmp_path / "upload.manifest.json").exists()
    (dest / "thesis.tex").unlink()  # an empty folder is used, and the tool's own staging is replaced on a rerun
    for _ in range(2):
        assert push.main([str(model_folder), "--repo-id", "someone/x", "--dry-run", str(dest)]) == 0
    manifest = json.loads((tmp_path / "upload.manifest.json").read_text())
    assert [m["path"] for m in manifest["files"]] == [f for f in _files(dest) if f != push.STAGING_MARK]
    (tmp_path / "other.manifest.json").write_text("my notes")  # a file where the manifest would go is kept
    assert push.main([str(model_folder), "--repo-id", "someone/x", "--dry-run", str(tmp_path / "other")]) == 2
    assert "not a manifest this tool wrote" in capsys.readouterr().err
    assert (tmp_path / "other.manifest.json").read_text() == "my notes" and not (tmp_path / "other").exists()


@pytest.mark.parametrize("damage", ["truncated weights", "NaN weights", "broken config", "missing shard"])
def test_a_damaged_model_is_refused_before_anything_is_staged(model_folder, tmp_path, capsys, damage):
    from safetensors.torch import load_file, save_file

    model = _copy(model_folder, tmp_path)
    weights = model / "model.safetensors"
    if damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "NaN weights":
        tensors = load_file(weights)
        name = next(iter(tensors))
        tensors[name][0] = float("nan")
        save_file(tensors, weights, metadata={"format": "pt"})
    elif damage == "broken config":
        (model / "config.json").write_text('{"model_type": "resolvent", ')
    else:
        weights.unlink()
        (model / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    dest = tmp_path / "upload"
    for extra in (["--dry-run", str(dest)], ["--token", "hf_dummy"]):  # dry run or not
        assert push.main([str(model), "--repo-id", "someone/x", *extra]) == 2
        err = capsys.readouterr().err
        expected = {"truncated weights": "cannot read the weights file", "NaN weights": "NaN or infinite values",
                    "broken config": "is not valid JSON", "missing shard": "is missing: the model folder is incomplete"}[
            damage]  # the messages of from_pretrained's checks, which push_to_hub shares
        assert expected in err and "Traceback" not in err, err
    assert not dest.exists() and not (tmp_path / "upload.manifest.json").exists()


class _RunsACommand:
    """A pickled object whose unpickling would run a shell command (what a hostile pytorch_model.bin holds)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        import os

        return os.system, (self.command,)


def test_a_pickled_weights_file_that_would_run_code_is_refused_without_running_it(model_folder, tmp_path, capsys):
    import torch

    model = _copy(model_folder, tmp_path)
    (model / "model.safetensors").unlink()  # the legacy pickle is then the folder's only weights
    marker = tmp_path / "the-payload-ran"
    torch.save({"lm_head.weight": torch.zeros(2, 2), "x": _RunsACommand(f"touch {marker}")},
               model / "pytorch_model.bin")
    for extra in (["--dry-run", str(tmp_path / "upload")], ["--token", "hf_dummy"]):
        assert push.main([str(model), "--repo-id", "someone/x", *extra]) == 2
        err = capsys.readouterr().err
        assert "pytorch_model.bin is a pickle that holds more than tensors" in err and "not safe to load" in err
        assert "Traceback" not in err and "UnpicklingError" not in err, err
    assert not marker.exists()
    assert not (tmp_path / "upload").exists()


def _plant(model: Path, outside: Path) -> dict[str, str]:
    """Put into ``model`` what a working folder collects besides the model (``outside`` is a folder beside it);
    returns the secrets' texts by name, which must reach no staged file."""
    secrets = {"key": "-----BEGIN OPENSSH PRIVATE KEY----- fake", "secret": "the secret beside the folder",
               "credentials": '{"aws_secret_access_key": "fake"}', "token": "hf_faketoken"}
    (outside / "home" / ".ssh").mkdir(parents=True)
    (outside / "home" / ".ssh" / "id_rsa").write_text(secrets["key"])
    (outside / "secret.txt").write_text(secrets["secret"])
    (model / "tokenizer_extra.json").symlink_to(outside / "home" / ".ssh" / "id_rsa")
    (model / "notes.txt").symlink_to(Path("..") / "secret.txt")  # relative, out of the folder
    (model / "credentials.json").write_text(secrets["credentials"])
    (model / ".cache" / "huggingface").mkdir(parents=True)
    (model / ".cache" / "huggingface" / "token").write_text(secrets["token"])
    (model / "wandb" / "run-1").mkdir(parents=True)
    (model / "wandb" / "run-1" / "output.log").write_text("log")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"):
        (model / name).write_bytes(b"state")
    # a figure the card links (through a link inside the folder) and one it does not
    (model / "plots").mkdir()
    (model / "plots" / "attention.png").write_bytes(b"\x89PNG figure")
    (model / "plots" / "unused.png").write_bytes(b"\x89PNG unused")
    (model / "figures").mkdir()
    (model / "figures" / "attention.png").symlink_to(Path("..") / "plots" / "attention.png")
    card = model / "README.md"
    card.write_text(card.read_text() + "\n![Attention maps](figures/attention.png)\n")
    return secrets


def test_dry_run_stages_the_model_and_says_what_it_left_out(model_folder, tmp_path, capsys):
    model = _copy(model_folder, tmp_path)
    secrets = _plant(model, tmp_path)
    dest = tmp_path / "upload"
    assert push.main([str(model), "--repo-id", "someone/x", "--dry-run", str(dest)]) == 0
    out = capsys.readouterr().out
    code = {p.name for p in model_folder.glob("*.py")}
    assert _files(dest) == sorted({push.STAGING_MARK, "config.json", "generation_config.json", "model.safetensors",
                                   "tokenizer.json", "tokenizer_config.json", "README.md", "loss.png",
                                   "figures/attention.png"} | code)
    assert not any(p.is_symlink() for p in dest.rglob("*"))
    assert (dest / "figures" / "attention.png").read_bytes() == b"\x89PNG figure"
    for f in dest.rglob("*"):
        if f.is_file():
            assert not any(s.encode() in f.read_bytes() for s in secrets.values()), f
    left_out = {line.split("left out: ", 1)[1] for line in out.splitlines() if "left out: " in line}
    for name, why in [("tokenizer_extra.json", "a link to outside the folder"),
                      ("notes.txt", "a link to outside the folder"), ("credentials.json", "secret"),
                      ("optimizer.pt", "training state"), ("scheduler.pt", "training state"),
                      ("rng_state.pth", "training state"), ("training_args.bin", "training state"),
                      ("checkpoints/", "training state"), ("metrics.jsonl", "training log"),
                      ("wandb/", "training log"), (".cache/huggingface/token", "secret"), ("plots/", "a figure the card does not link")]:
        assert any(line.startswith(name + " (") and why in line for line in left_out), (name, left_out)
    manifest = json.loads((tmp_path / "upload.manifest.json").read_text())
    assert [m["path"] for m in manifest["files"]] == [f for f in _files(dest) if f != push.STAGING_MARK]
    listed = {m["path"]: m["reason"] for m in manifest["left_out"]}
    assert {"tokenizer_extra.json", "notes.txt", "credentials.json", ".cache/huggingface/token",
            "wandb/run-1/output.log", "optimizer.pt", "checkpoints/step_0000001/optimizer.bin",
            "plots/attention.png", "plots/unused.png"} <= set(listed)
    assert "outside the folder" in listed["tokenizer_extra.json"]


def test_include_publishes_what_it_names_but_never_a_link_out_or_a_secret(model_folder, tmp_path, capsys,
                                                                          monkeypatch):
    model = _copy(model_folder, tmp_path)
    _plant(model, tmp_path)
    dest = tmp_path / "upload"
    monkeypatch.chdir(tmp_path)  # the folder named as a relative path
    args = ["model", "--repo-id", "someone/x", "--dry-run", str(dest)]
    assert push.main([*args, "--include", "metrics.jsonl", "--include", "wandb", "--include", "plots/un*",
                      "--include", "notes.txt", "--include", "credentials.json", "--include", ".cache/*"]) == 0
    out = capsys.readouterr().out
    files = _files(dest)
    assert {"metrics.jsonl", "wandb/run-1/output.log", "plots/unused.png"} <= set(files)
    assert not {"notes.txt", "credentials.json", ".cache/huggingface/token", "plots/attention.png"} & set(files)
    assert "left out: notes.txt (a link to outside the folder" in out
    assert "left out: credentials.json (" in out and "left out: .cache/huggingface/token (" in out
    assert push.main([*args, "--include", "no-such-file*"]) == 2  # a pattern that names nothing is a mistake
    err = capsys.readouterr().err
    assert "--include no-such-file*" in err and "names no file" in err


def test_the_token_and_the_hub_are_checked_before_anything_is_staged(model_folder, monkeypatch, tmp_path, capsys):
    import shutil
    import tempfile

    import huggingface_hub

    staged = []  # every copy or temporary folder, before the error or not
    for module, name in [(shutil, "copy2"), (shutil, "copyfile"), (shutil, "copytree"),
                         (tempfile, "TemporaryDirectory"), (tempfile, "mkdtemp")]:
        monkeypatch.setattr(module, name, lambda *a, _name=name, **k: staged.append(_name))
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert push.main([str(model_folder), "--repo-id", "someone/x"]) == 2
    assert "no Hugging Face token" in capsys.readouterr().err and staged == []
    monkeypatch.setattr(push.hdata, "hub_reachable", lambda: False)
    assert push.main([str(model_folder), "--repo-id", "someone/x", "--token", "hf_dummy"]) == 2
    assert "not reachable" in capsys.readouterr().err and staged == []


def test_files_are_hashed_in_blocks_not_read_whole(model_folder, tmp_path, monkeypatch):
    from hf_resolvent.files import file_sha256

    weights = model_folder / "model.safetensors"
    expected = file_sha256(weights)
    read_bytes = Path.read_bytes

    def no_whole_weights(path):  # a multi-GB weights file read at once would need its size in memory
        assert path.suffix != ".safetensors", f"{path} read whole"
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", no_whole_weights)
    assert push.main([str(model_folder), "--repo-id", "someone/x", "--dry-run", str(tmp_path / "upload")]) == 0
    manifest = json.loads((tmp_path / "upload.manifest.json").read_text())
    (entry,) = [m for m in manifest["files"] if m["path"] == "model.safetensors"]
    assert entry == {"path": "model.safetensors", "bytes": weights.stat().st_size, "sha256": expected}


def test_the_upload_sends_what_the_dry_run_stages_without_copying_the_weights(model_folder, monkeypatch, tmp_path,
                                                                              capsys):
    import huggingface_hub

    model = _copy(model_folder, tmp_path)
    _plant(model, tmp_path)
    assert push.main([str(model), "--repo-id", "someone/x", "--dry-run", str(tmp_path / "upload")]) == 0
    staged = json.loads((tmp_path / "upload.manifest.json").read_text())["files"]
    capsys.readouterr()
    sent = {}

    def create_commit(self, repo_id, operations, **kwargs):
        for op in operations:
            data = op.path_or_fileobj
            sent[op.path_in_repo] = data if isinstance(data, bytes) else Path(data)
        return "https://huggingface.co/someone/x/commit/1"

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_dummy")
    monkeypatch.setattr(push.hdata, "hub_reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, *a, **k: None)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **k: sent.setdefault("folder", k))
    assert push.main([str(model), "--repo-id", "someone/x"]) == 0
    assert sorted(sent) == [m["path"] for m in staged]
    assert sent["model.safetensors"] == (model / "model.safetensors").resolve()  # read where it is, not copied
    for m in staged:
        data = sent[m["path"]]
        assert (data if isinstance(data, bytes) else data.read_bytes()) == (tmp_path / "upload" / m["path"]).read_bytes()
    assert f"uploaded {len(staged)} files" in capsys.readouterr().out


def test_local_paths_are_not_published(model_folder, tmp_path, monkeypatch):
    user = "adalovelace7"
    home = tmp_path / "home" / user
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("USER", user)
    monkeypatch.setenv("LOGNAME", user)
    run = _copy(model_folder, home / "runs", "44m-dense")
    data, shared = home / "data" / "openwebtext", tmp_path / "scratch" / "corpora" / "owt-extra"
    argv = f"--config 44m-dense --data {data} --output-dir {run} --set data.extra={shared}/"
    card = render_model_card({"model_name": run.name, "mixer": "exp2:ce", "repo_id": "REPO_ID", "val_ppl": 30.1,
                              "val_loss": 3.4, "data": f"files: {data}/*.txt", "datasets": [],
                              "train_command": f"python scripts/pretrain.py {argv}", "tags": ["hf-resolvent"]})
    card += f"\nCurves: ![loss]({run}/loss.png), the run in [{run}]({run}); data in `~/data/openwebtext`.\n"
    (run / "README.md").write_text(card)
    (run / "run_config.json").write_text(json.dumps({"data": {"dir": str(data), "seq_len": 1024},
                                                     "name": "44m-dense", "home": str(home)}, indent=2))
    (run / "train_results.json").write_text(json.dumps({"output_dir": str(run), "val_ppl": 30.1,
                                                        "plot": str(run / "loss.png")}, indent=2))
    tokenizer_config = json.loads((run / "tokenizer_config.json").read_text())
    (run / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "name_or_path": str(run)}))
    dest = tmp_path / "upload"
    assert push.main([str(run), "--repo-id", "someone/x", "--dry-run", str(dest)]) == 0
    assert {"README.md", "run_config.json", "train_results.json", "loss.png"} <= set(_files(dest))
    assert json.loads((dest / "tokenizer_config.json").read_text()) == {**tokenizer_config, "name_or_path": run.name}
    for f in dest.rglob("*"):
        if f.is_file():
            text = f.read_bytes()
            assert str(tmp_path).encode() not in text and user.encode() not in text, f
    published = (dest / "README.md").read_text()
    assert "--data openwebtext --output-dir 44m-dense --set data.extra=owt-extra/" in published
    assert "![loss](loss.png)" in published and "files: openwebtext/*.txt" in published
    assert json.loads((dest / "run_config.json").read_text())["data"] == {"dir": "openwebtext", "seq_len": 1024}
    results = json.loads((dest / "train_results.json").read_text())
    assert results == {"output_dir": "44m-dense", "val_ppl": 30.1, "plot": "loss.png"}


def test_a_folder_saved_without_its_code_gets_it_from_a_re_save(model_folder, tmp_path, capsys):
    model = _copy(model_folder, tmp_path)
    for code in model.glob("*.py"):
        code.unlink()
    config = json.loads((model / "config.json").read_text())
    del config["auto_map"]
    (model / "config.json").write_text(json.dumps(config))
    dest = tmp_path / "upload"
    assert push.main([str(model), "--repo-id", "someone/x", "--dry-run", str(dest)]) == 0
    assert "lacks its model code" in capsys.readouterr().out
    assert {p.name for p in model_folder.glob("*.py")} <= set(_files(dest))
    assert json.loads((dest / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"].startswith(
        "modeling_resolvent.")
