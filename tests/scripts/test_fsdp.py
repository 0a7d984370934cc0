"""scripts/pretrain.py sharded with FSDP2 on CPU processes (gloo), as on GPUs: the run says how it is distributed,
parameters are DTensors, checkpoints are sharded (DCP) and resume exactly after a kill -9, in one process too, the
final model is one save_pretrained folder; two "nodes" of one process each through torchrun's multi-node launch;
each rank reads only its windows of the memory-mapped token shards.

Every run here is a subprocess (a process group cannot be undone inside pytest), with a timeout."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import REPO, load_script, tiny_run_args
from safetensors.torch import load_file
from servers import free_port

from hf_resolvent.training import data as D
from hf_resolvent.training import launch, loop
from hf_resolvent.training.checkpoints import (
    check_layout,
    finalize_checkpoint,
    latest_checkpoint,
    manifest_problem,
    sharded_problem,
)
from hf_resolvent.training.config import ConfigError, RunError
from hf_resolvent.training.fsdp import FSDP_SETTINGS, fit_wrap_classes, fsdp_env, fsdp_plugin
from hf_resolvent.training.launch import relaunch_cpu_processes_if_needed
from hf_resolvent.training.memory import memory_use
from hf_resolvent.training.metrics import read_metrics
from hf_resolvent.training.models import build_model

pretrain = load_script("pretrain")
PRETRAIN = str(REPO / "scripts" / "pretrain.py")
BIN = Path(sys.executable).parent
TIMEOUT = 300  # seconds for any one launch; a run here takes 10-40 s


def _env() -> dict[str, str]:
    """This environment without launcher state (ranks, FSDP settings), one thread per process, offline."""
    drop = ("ACCELERATE_", "FSDP_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[")]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _losses(folder: Path) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(folder / "metrics.jsonl")]


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory):
    """The same 7 steps in one process without sharding (in this process)."""
    out = tmp_path_factory.mktemp("straight")
    return out, pretrain.train(tiny_run_args(tiny_data, out, "--max-steps", "7"))


@pytest.fixture(scope="module")
def two_nodes(tiny_data, tmp_path_factory):
    """An uninterrupted FSDP run of 7 steps as 2 nodes x 1 process: two torchrun launchers, node ranks 0 and 1,
    meeting at 127.0.0.1 (the multi-node launch path); checkpoints at steps 3, 6 and 7."""
    out = tmp_path_factory.mktemp("two_nodes")
    logs = tmp_path_factory.mktemp("two_nodes_logs")
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        with open(logs / f"{rank}.out", "w") as stdout, open(logs / f"{rank}.err", "w") as stderr:
            procs.append(subprocess.Popen(
                [str(BIN / "torchrun"), "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
                 "--master-addr", "127.0.0.1", "--master-port", port, PRETRAIN, "--fsdp",
                 *tiny_run_args(tiny_data, out, "--max-steps", "7")],
                env=_env(), stdout=stdout, stderr=stderr, cwd=REPO))
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    outputs = [((logs / f"{r}.out").read_text(), (logs / f"{r}.err").read_text()) for r in (0, 1)]
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return out, [o[0] for o in outputs]


def test_two_nodes_shard_with_fsdp2_and_write_one_model_folder(two_nodes, straight):
    out, (node0, node1) = two_nodes
    assert _lines(node0)[0] == "[pretrain] FSDP2, 2 processes on 2 nodes, full shard (cpu, gloo)"
    assert not _lines(node1)  # only global rank 0 speaks
    results = json.loads((out / "train_results.json").read_text())
    assert results["processes"] == 2 and results["distributed"].startswith("FSDP2, 2 processes on 2 nodes")

    # sharded checkpoints: one DCP file per rank for the model and the optimizer, all in the manifest
    last = out / "checkpoints" / "step_0000007"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (last / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    manifest = json.loads((last / "manifest.json").read_text())["files"]
    assert "pytorch_model_fsdp_0/__1_0.distcp" in manifest and "optimizer_0/__1_0.distcp" in manifest
    assert manifest_problem(last) is None and sharded_problem(last) is None
    assert not (last / "model.safetensors").exists()
    assert json.loads((last / "trainer_state.json").read_text())["distributed"] == results["distributed"]

    # one gathered save_pretrained folder, the model's own code in it (none of torch's FSDP modules)
    from transformers import AutoModelForCausalLM

    import hf_resolvent  # noqa: F401  (registers the model type)

    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "ResolventForCausalLM" and model.config.n_layer == 2
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["ResolventForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_resolvent.ResolventForCausalLM"
    assert not list(out.glob("_fsdp*.py")) and "FSDP" not in (out / "README.md").read_text()

    # sharding trains the same model as one unsharded process (up to the order of float summation); the tied
    # output embedding is stored once, as in the unsharded folder
    wa, wb = _weights(straight[0]), _weights(out)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5)

    # what each rank held in memory: peak RSS, and the token shards resident in its mappings
    assert len(results["peak_rss_mib"]) == 2 and all(m > 50 for m in results["peak_rss_mib"])
    assert all(0 <= m <= results["shards_mib"] + 0.1 for m in results["shards_resident_mib"])
    assert "peak RSS" in node0


def _kill_9(proc: subprocess.Popen) -> None:
    """kill -9 of a launcher and every process under it (torchrun starts its workers in sessions of their own, so
    killing its process group alone would leave them running)."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=30)


def _wait_for(proc: subprocess.Popen, text: str, timeout: float, stderr: Path) -> list[str]:
    """The stdout lines of ``proc`` up to one containing ``text``; the processes are killed after ``timeout``."""
    timer = threading.Timer(timeout, _kill_9, (proc,))
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if text in line:
                return lines
    finally:
        timer.cancel()
    raise AssertionError(f"{text!r} never came; output:\n" + "\n".join(lines[-30:]) + stderr.read_text()[-3000:])


def test_kill_9_and_resume_under_fsdp_equals_the_uninterrupted_run(tiny_data, two_nodes, tmp_path):
    ref, _ = two_nodes
    out = tmp_path / "killed"
    # the GPU config on CPU processes, as the issue tried it (it ran DDP then)
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(REPO / "scripts/accelerate/fsdp_8gpu.yaml"),
           "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", "0", PRETRAIN,
           *tiny_run_args(tiny_data, out, "--max-steps", "7", "--pause-after", "6")]
    stderr = tmp_path / "killed.err"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(cmd, env={**_env(), "ACCELERATE_USE_CPU": "true"}, stdout=subprocess.PIPE,
                                stderr=err, text=True, cwd=REPO)
    try:
        lines = _wait_for(proc, "--pause-after 6: waiting to be killed", TIMEOUT, stderr)
    finally:
        _kill_9(proc)  # launcher and both ranks, mid-run
        proc.wait(timeout=30)
        proc.stdout.close()
    assert _lines("\n".join(lines))[0] == "[pretrain] FSDP2, 2 processes, full shard (cpu, gloo)"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000003", "step_0000006"]
    assert not (out / "config.json").exists()

    # rank 1's model shard of the newest checkpoint damaged: the manifest catches it, step 3 is resumed
    shard = out / "checkpoints" / "step_0000006" / "pytorch_model_fsdp_0" / "__1_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    shard.write_bytes(bytes(raw))
    resumed = _run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), PRETRAIN, "--fsdp",
                    *tiny_run_args(tiny_data, out, "--max-steps", "7", "--resume")])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "took over the run folder" in resumed.stderr  # the lock of the killed run
    assert ("skipped the damaged checkpoint(s) step_0000006 (pytorch_model_fsdp_0/__1_0.distcp is damaged"
            in resumed.stderr) and "resuming from step_0000003" in resumed.stderr
    assert _lines(resumed.stdout)[0] == "[pretrain] FSDP2, 2 processes, full shard (cpu, gloo)"
    wa, wb = _weights(ref), _weights(out)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert _losses(ref) == _losses(out)


def _unfinished_copy(src: Path, dest: Path) -> Path:
    """``src``, a finished 7-step run, as if killed after its step-6 checkpoint."""
    shutil.copytree(src, dest)
    shutil.rmtree(dest / "checkpoints" / "step_0000007")
    for name in ("config.json", "model.safetensors"):
        (dest / name).unlink()
    return dest


def test_a_sharded_checkpoint_resumes_in_one_process_and_only_with_fsdp(tiny_data, two_nodes, tmp_path, capsys):
    ref, _ = two_nodes
    out = _unfinished_copy(ref, tmp_path / "run")
    # without --fsdp: refused, naming the way that works
    assert pretrain.main(tiny_run_args(tiny_data, out, "--max-steps", "7", "--resume")) == 2
    err = capsys.readouterr().err
    assert "step_0000006 is a sharded (FSDP) checkpoint, written by FSDP2, 2 processes on 2 nodes" in err, err
    assert "--fsdp" in err and "Traceback" not in err
    assert not (out / "checkpoints" / "step_0000007").exists()
    # with --fsdp in one plain process: DCP loads the two ranks' shards into one
    one = _run([sys.executable, PRETRAIN, "--fsdp", *tiny_run_args(tiny_data, out, "--max-steps", "7", "--resume")])
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert _lines(one.stdout)[:2] == ["[pretrain] FSDP2, 1 process, full shard (cpu, gloo)",
                                      f"[pretrain] resumed from {out / 'checkpoints' / 'step_0000006'} (step 6/7)"]
    wa, wb = _weights(ref), _weights(out)
    for k in wa:  # step 7 as 1 process x 2 micro-batches instead of 2 processes x 1
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)


def test_a_whole_checkpoint_is_refused_under_fsdp(straight, tmp_path):
    out = _unfinished_copy(straight[0], tmp_path / "run")
    with pytest.raises(ConfigError, match="whole .unsharded. checkpoint, written by one process, no sharding"):
        check_layout(out / "checkpoints" / "step_0000006", True, "FSDP2, 2 processes, full shard (cpu)")
    check_layout(out / "checkpoints" / "step_0000006", False, "one process, no sharding (cpu)")


def test_fsdp_asked_for_and_not_set_up_is_an_error():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    ddp = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=2, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"FSDP was asked for \(--fsdp\) but Accelerate set up DDP, 2 processes, "
                                            r"replicated \(cpu\).*or drop --fsdp"):
        loop._require_fsdp(ddp, "--fsdp")
    one = SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="set up one process, no sharding"):
        loop._require_fsdp(one, "the accelerate config")


def test_the_fsdp_configs_are_one_setting_that_fits_both_model_types():
    configs = {p.name: yaml.safe_load(p.read_text()) for p in (REPO / "scripts" / "accelerate").glob("fsdp_*.yaml")}
    assert sorted(configs) == ["fsdp_2cpu.yaml", "fsdp_8gpu.yaml", "fsdp_multinode.yaml"]
    for name, config in configs.items():
        assert config["distributed_type"] == "FSDP" and config["fsdp_config"] == FSDP_SETTINGS, name
    multi = configs["fsdp_multinode.yaml"]
    assert multi["num_processes"] == 8 * multi["num_machines"] and multi["num_machines"] > 1

    # what pretrain.py passes on when Accelerate's CPU launcher drops FSDP: the variables its GPU launcher sets
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(REPO / "scripts/accelerate/fsdp_8gpu.yaml"),
                                               "train.py"])
    launcher = prepare_multi_gpu_env(_validate_launch_command(args)[0])
    assert fsdp_env(FSDP_SETTINGS).items() <= launcher.items()

    plugin = fsdp_plugin(FSDP_SETTINGS)  # the settings as the plugin's arguments
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True and plugin.cpu_ram_efficient_loading
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT" and plugin.activation_checkpointing is False
    assert plugin.transformer_cls_names_to_wrap == ["ResolventBlock", "GPT2Block"]
    shape = {"n_layer": 1, "n_embd": 16, "n_head": 2, "n_inner": 32}
    resolvent = build_model({"type": "resolvent", "preset": "tiny", "mixer": "dense", "overrides": shape}, 50, 16)
    gpt2 = build_model({"type": "gpt2", "preset": "tiny", "overrides": shape}, 50, 16)
    assert fit_wrap_classes(fsdp_plugin(FSDP_SETTINGS), resolvent) == ["ResolventBlock"]
    assert fit_wrap_classes(fsdp_plugin(FSDP_SETTINGS), gpt2) == ["GPT2Block"]
    with pytest.raises(ConfigError, match="none of the FSDP wrap classes .'LlamaBlock'. .*ResolventBlock"):
        fit_wrap_classes(fsdp_plugin({**FSDP_SETTINGS, "fsdp_transformer_layer_cls_to_wrap": "LlamaBlock"}),
                           resolvent)
    with pytest.raises(ConfigError, match="FSDP2 only: set fsdp_version: 2"):
        fsdp_plugin({**FSDP_SETTINGS, "fsdp_version": 1})


def test_accelerate_launch_cpu_passes_its_fsdp_config_on(monkeypatch):
    """``accelerate launch --cpu`` starts one process and no FSDP variables: pretrain.py starts the processes with
    torch.distributed.run and hands them the launch's FSDP settings, as Accelerate's GPU launcher would."""
    config = yaml.safe_load((REPO / "scripts" / "accelerate" / "fsdp_8gpu.yaml").read_text())
    args = ["python", "accelerate", "launch", "--cpu", "--config_file", "fsdp_8gpu.yaml", "--num_processes", "2",
            "--fsdp_reshard_after_forward", "false", "pretrain.py"]
    monkeypatch.setattr(launch, "_parent_launch", lambda: (args, config))
    for var in launch._RANK_VARS + ("HF_RESOLVENT_RELAUNCHED", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    started = []
    monkeypatch.setattr(os, "execve", lambda exe, cmd, env: started.append((cmd, env)))
    relaunch_cpu_processes_if_needed("pretrain.py", ["--config", "tiny"])
    (cmd, env), = started
    assert cmd[cmd.index("--nproc_per_node") + 1] == "2" and cmd[-3:] == ["pretrain.py", "--config", "tiny"]
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == "false"  # a flag of the command line over the config file
    expected = {**fsdp_env(FSDP_SETTINGS), "FSDP_RESHARD_AFTER_FORWARD": "false"}
    assert expected.items() <= env.items()
    config["distributed_type"] = "MULTI_GPU"  # a DDP config passes no FSDP variables
    started.clear()
    relaunch_cpu_processes_if_needed("pretrain.py", [])
    assert "ACCELERATE_USE_FSDP" not in started[0][1]


def test_a_checkpoint_missing_a_rank_shard_is_not_published(two_nodes, tmp_path):
    ref, _ = two_nodes
    tmp = tmp_path / "checkpoints" / ".tmp_step_0000009"
    shutil.copytree(ref / "checkpoints" / "step_0000007", tmp)
    (tmp / "manifest.json").unlink()
    (tmp / "optimizer_0" / "__1_0.distcp").unlink()  # rank 1 wrote on a disk rank 0 does not see
    assert "optimizer_0/__1_0.distcp is missing" in sharded_problem(tmp)
    with pytest.raises(RunError, match="step_0000009 is incomplete: .*filesystem shared by all"):
        finalize_checkpoint(tmp, tmp_path / "checkpoints" / "step_0000009", keep=2)
    assert tmp.exists() and not (tmp / "manifest.json").exists() and latest_checkpoint(tmp_path) is None


class _CountingShards:
    """A TokenShards that records the windows read from it."""

    def __init__(self, tokens: D.TokenShards):
        self.tokens, self.split, self.reads = tokens, tokens.split, []

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, length: int) -> np.ndarray:
        self.reads.append(start)
        return self.tokens.read(start, length)


def test_each_rank_reads_only_its_windows_of_memory_mapped_shards(tiny_data, tmp_path):
    tokens = D.TokenShards(tiny_data, "train")
    assert all(isinstance(a, np.memmap) for a in tokens.arrays)  # mapped, never loaded whole
    world, micro, accum = 2, 2, 3
    reads = []
    for rank in range(world):
        counted = _CountingShards(tokens)
        sampler = D.StepSampler(counted, 16, micro, accum, world, seed=0)
        for step in range(4):
            for m in range(accum):
                sampler.batch(step, m, rank)
        reads.append(counted.reads)
    # together the ranks read each step's global batch once; each rank a 1/world share of it
    everything = [int(s) for step in range(4) for s in sampler.starts(step)]
    assert sorted(reads[0] + reads[1]) == sorted(everything)
    assert len(reads[0]) == len(reads[1]) == len(everything) // world

    # what one window costs in memory: its pages, not the file (the kernel maps page cache in blocks of up to 2 MiB)
    path = tmp_path / "big.bin"
    np.arange(16_000_000, dtype=np.uint16).tofile(path)  # 32 MB
    mapped = np.memmap(path, dtype=np.uint16, mode="r")
    window = np.array(mapped[8_000_000:8_000_257])
    use = memory_use([path])
    assert window[0] == 8_000_000 % 65536
    assert use["shards_bytes"] == 32_000_000 and 0 < use["shards_resident_bytes"] <= 4 * 2**20
    assert use["peak_rss_bytes"] > 0
