"""How the training processes start and how they are spread: ``accelerate launch --cpu --num_processes N`` made
to start N processes (:func:`relaunch_cpu_processes_if_needed`), and the distribution described in words
(:func:`describe_distributed`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .config import read_config_file
from .fsdp import fsdp_env

_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")


def _flag(args: list[str], *names: str) -> str | None:
    """The value of the last ``--name value`` / ``--name=value`` of ``args``, else None."""
    found = None
    for i, a in enumerate(args):
        for flag in names:
            if a == flag and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(flag + "="):
                found = a.split("=", 1)[1]
    return found


def _parent_launch() -> tuple[list[str], dict] | None:
    """The parent ``accelerate launch`` command line and the settings of its ``--config_file`` (Linux /proc), else
    None."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    args = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    if not any("accelerate" in a for a in args[:3]):
        return None
    config: dict = {}
    path = _flag(args, "--config_file", "--config-file")
    if path:
        try:  # relative to the launcher's working folder
            config = read_config_file(Path(f"/proc/{os.getppid()}/cwd") / path)
        except Exception:  # unreadable: the launcher has said so already
            config = {}
    return args, config


def _requested_processes_from_parent() -> int | None:
    """``--num_processes N`` of the parent ``accelerate launch`` command line or its config file, else None."""
    parent = _parent_launch()
    if parent is None:
        return None
    args, config = parent
    n = _flag(args, "--num_processes", "--num-processes")
    n = n if n is not None else config.get("num_processes")
    return int(n) if n is not None else None


def _fsdp_settings_from_parent() -> dict | None:
    """The FSDP settings (``fsdp_config`` keys) the parent ``accelerate launch`` asked for, through its config file
    (``distributed_type: FSDP``) or ``--use_fsdp``, with its ``--fsdp_*`` flags on top; None when it asked for none.
    Accelerate's CPU launcher drops them (it passes no FSDP variables to the processes)."""
    parent = _parent_launch()
    if parent is None:
        return None
    args, config = parent
    if config.get("distributed_type") != "FSDP" and "--use_fsdp" not in args:
        return None
    settings = dict(config.get("fsdp_config") or {})
    for i, a in enumerate(args[:-1]):
        if a.startswith("--fsdp_") and "=" not in a:
            settings[a[2:]] = args[i + 1]
    return settings


def relaunch_cpu_processes_if_needed(script: str | os.PathLike, argv: list[str]) -> None:
    """Make ``accelerate launch --num_processes N --cpu script.py`` start N processes.

    Accelerate's launcher runs multi-process CPU jobs only through ``mpirun`` (``--mpirun_hostfile``); without it
    ``--cpu --num_processes N`` starts ONE process (with ``MASTER_ADDR`` set and no rank variables). In that case
    this replaces the current process by ``python -m torch.distributed.run --nproc_per_node N script.py ...`` with
    ``ACCELERATE_USE_CPU=true``, which Accelerate runs as ``MULTI_CPU`` over gloo. When the launch asked for FSDP
    (a config file with ``distributed_type: FSDP``, or ``--use_fsdp``), its settings are passed on as the FSDP_*
    variables Accelerate's GPU launcher would set, so that the script shards (:func:`enable_fsdp_on_cpu`) instead of
    silently running DDP. Does nothing otherwise.
    """
    env = os.environ
    if env.get("ACCELERATE_USE_CPU", "").lower() not in ("true", "1", "yes") or "MASTER_ADDR" not in env:
        return
    if any(v in env for v in _RANK_VARS) or env.get("HF_RESOLVENT_RELAUNCHED"):
        return
    n = _requested_processes_from_parent()
    if not n or n < 2:
        return
    port = env.get("MASTER_PORT", "29500")
    if port in ("", "0"):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr",
           env["MASTER_ADDR"], "--master_port", port, str(script), *argv]
    fsdp = _fsdp_settings_from_parent()
    print(f"[hf_resolvent] accelerate launch --cpu --num_processes {n} starts one process without mpirun; "
          f"starting {n} CPU processes with torch.distributed.run (gloo) instead"
          + (", with the FSDP settings of the launch" if fsdp is not None else ""), flush=True)
    new_env = {**env, "HF_RESOLVENT_RELAUNCHED": "1", "ACCELERATE_USE_CPU": "true",
               **(fsdp_env(fsdp) if fsdp is not None else {})}
    new_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or n) // n)))
    sys.stdout.flush()
    os.execve(sys.executable, cmd, new_env)


def describe_distributed(accelerator) -> str:
    """How the run is distributed, in words: ``FSDP2, 2 processes, full shard (cpu, gloo)``,
    ``DDP, 2 processes on 2 nodes, replicated (cuda, nccl)``, ``one process, no sharding (cpu)``."""
    import torch
    from accelerate.utils import DistributedType

    n = accelerator.num_processes
    procs = f"{n} process" + ("" if n == 1 else "es")
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or n)
    if n > local:
        procs += f" on {n // local} nodes"
    where = accelerator.device.type
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        where += f", {torch.distributed.get_backend()}"
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        shard = ("full shard" if plugin.reshard_after_forward is True
                 else "gradients and optimizer state sharded, parameters kept after forward")
        return f"FSDP{plugin.fsdp_version}, {procs}, {shard} ({where})"
    if kind == DistributedType.NO:
        return f"one process, no sharding ({where})"
    if kind.value.startswith("MULTI_"):
        return f"DDP, {procs}, replicated ({where})"
    return f"{kind.value}, {procs} ({where})"
