"""FSDP2 through Accelerate: the settings of the project's launcher configs (:data:`FSDP_SETTINGS`), the plugin
made from them, the wrap classes fitted to a model, and Accelerate's FSDP2 path switched on for CPU processes."""

from __future__ import annotations

import dataclasses
import os

from .config import ConfigError

# The fsdp_config of scripts/accelerate/fsdp_8gpu.yaml (a test keeps the two equal): FSDP2, one shard group per
# transformer block (the class names of both model types; the model's own are kept), parameters, gradients and
# optimizer state fully sharded, sharded checkpoints through torch.distributed.checkpoint (DCP).
FSDP_SETTINGS = {
    "fsdp_version": 2,
    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "fsdp_transformer_layer_cls_to_wrap": "ResolventBlock,GPT2Block",
    "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    "fsdp_cpu_ram_efficient_loading": True,
    "fsdp_reshard_after_forward": True,
    "fsdp_activation_checkpointing": False,
}


def fsdp_env(settings: dict) -> dict[str, str]:
    """The variables ``accelerate launch`` gives its processes for an ``fsdp_config`` (``FSDP_*``, read by
    ``FullyShardedDataParallelPlugin``)."""
    env = {"ACCELERATE_USE_FSDP": "true"}
    for key, value in settings.items():
        name = key.removeprefix("fsdp_").upper().replace("TRANSFORMER_LAYER_CLS_TO_WRAP", "TRANSFORMER_CLS_TO_WRAP")
        env[f"FSDP_{name}"] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def fsdp_plugin(settings: dict | None = None):
    """Accelerate's FSDP plugin for ``settings`` (``fsdp_config`` keys), passed as its arguments, or, when None, for the
    FSDP_* variables an ``accelerate launch`` set. Only FSDP2 is supported (:class:`ConfigError` otherwise)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    if settings is None:
        version = os.environ.get("FSDP_VERSION", "1")  # Accelerate's default is 1
    else:
        version = str(settings.get("fsdp_version", 1))
    if version != "2":
        raise ConfigError(f"FSDP version {version} was asked for; this script shards with FSDP2 only: set "
                          f"fsdp_version: 2 in the accelerate config (as scripts/accelerate/fsdp_8gpu.yaml does)")
    if settings is None:
        return FullyShardedDataParallelPlugin()
    fields = {f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)}
    arguments = {}
    for key, value in settings.items():  # the plugin's argument of each key: fsdp_version, state_dict_type, ...
        name = key if key in fields else key.removeprefix("fsdp_").replace("layer_cls", "cls_names")
        arguments[name] = value
    return FullyShardedDataParallelPlugin(**arguments)


def fit_wrap_classes(plugin, model) -> list[str]:
    """Keep the plugin's wrap classes that ``model`` has: the GPU config names the blocks of both model types, and
    Accelerate refuses a class the model lacks. :class:`ConfigError` when none is left."""
    names = plugin.transformer_cls_names_to_wrap
    if plugin.auto_wrap_policy is None or not names:
        return list(names or [])
    present = {type(m).__name__ for m in model.modules()}
    keep = [n for n in names if n in present]
    if not keep:
        blocks = getattr(model, "_no_split_modules", None)
        raise ConfigError(f"none of the FSDP wrap classes {names} is a module of {type(model).__name__} (its blocks: "
                          f"{blocks}); set fsdp_transformer_layer_cls_to_wrap to its block class")
    plugin.transformer_cls_names_to_wrap = keep
    return keep


def enable_fsdp_on_cpu(accelerator, plugin) -> bool:
    """Run Accelerate's FSDP2 path on CPU processes (gloo); True when it switched.

    Accelerate turns an FSDP plugin into ``DistributedType.FSDP`` only on GPU-like devices: CPU processes get
    ``MULTI_CPU`` (DDP) and the plugin is dropped, silently. torch's ``fully_shard`` shards on CPU over gloo, so the
    shared state is switched to FSDP before ``prepare()``, as Accelerate does for GPUs (``AcceleratorState`` and
    ``PartialState`` both, since a later ``AcceleratorState()`` copies the latter). What follows is Accelerate's own
    FSDP2 code, the GPU path: ``prepare`` (``fully_shard`` per block), ``clip_grad_norm_``, ``save_state`` /
    ``load_state`` through DCP, ``get_state_dict``. The caller checks that the parameters are sharded after
    ``prepare``."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        return False
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True
