"""What vLLM can serve of a resolvent model, and the settings it needs, checked when vLLM builds its config.

vLLM keeps two kinds of per-request memory: a paged cache that grows with the tokens (its attention layers), and
one fixed-shape state per request (``MambaBase`` layers: Mamba, linear attention). Resolvent layers map onto them
as follows:

- ``attention`` layers run vLLM's own attention layer over its paged cache (with a short convolution, its rows are
  kept per request in a fixed-shape state of the layer's own);
- layers whose decode state has a bound that does not grow with the context (cache-efficient patterns such as
  ``exp2:ce`` and ``square:ce``, the windows ``banded:w``, ``diagonal`` and ``local_attention:w``, their ``+tied``
  forms) keep it in vLLM's fixed-shape state, sized for ``max_model_len`` tokens, the short convolution's rows
  with it;
- layers that read every earlier output through their feedback channel (``dense``, plain f-patterns such as
  ``exp2`` and ``square``) would need a state that grows with the context in a form vLLM cannot page: refused.
"""

from __future__ import annotations

import logging

from vllm.model_executor.models.config import VerifyAndUpdateConfig

from ..configuration_resolvent import ResolventConfig
from ..ops.state import DecodeState
from ..patterns import get_pattern

logger = logging.getLogger(__name__)

__all__ = ["ATTENTION_LAYER", "STATE_LAYER", "ResolventVllmConfig", "check_servable", "layer_kinds", "uses_attention"]

# vLLM's names for the two kinds of layer (hf_config.layer_types): a model is hybrid when some layer is not attention
# alone. An attention layer with a short convolution keeps its convolution's rows per request, so it counts as a
# layer with a state.
ATTENTION_LAYER, STATE_LAYER = "full_attention", "linear_attention"

SUPPORTED = ("attention", "local_attention:w", "exp2:ce", "square:ce", "f:<expression>:ce", "banded:w", "diagonal",
             "the +tied forms of the resolvent ones")

# RoPE types whose frequencies follow the longest sequence seen (transformers' dynamic_rope_update): in vLLM's
# batches that would be another request's length
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def uses_attention(config: ResolventConfig, layer_idx: int) -> bool:
    """True for a layer that runs vLLM's paged attention (an ``attention`` layer, with or without a convolution)."""
    return get_pattern(config.layer_mixers[layer_idx]["pattern"]).kind == "attention"


def layer_kinds(config: ResolventConfig) -> list[str]:
    """Per layer, :data:`ATTENTION_LAYER` (vLLM's paged attention alone) or :data:`STATE_LAYER` (a per-request state
    of fixed shape, beside paged attention for an attention layer with a convolution)."""
    return [ATTENTION_LAYER if uses_attention(config, i) and not config.conv_size else STATE_LAYER
            for i in range(config.n_layer)]


def check_servable(config: ResolventConfig) -> None:
    """Raise a ValueError naming every layer vLLM cannot serve, the supported mixers and what to do instead."""
    refused = [(i, spec["pattern"]) for i, spec in enumerate(config.layer_mixers)
               if get_pattern(spec["pattern"]).kind != "attention" and DecodeState.keeps_every_token(spec["pattern"])]
    if refused:
        layers = ", ".join(f"layer {i} is {name!r}" for i, name in refused)
        raise ValueError(
            f"vLLM cannot serve this resolvent model: {layers}, a mixer whose feedback channel reads every earlier "
            f"output, so its decode state grows with the context in a form vLLM cannot page. vLLM serves the mixers "
            f"{', '.join(SUPPORTED)}, alone or mixed per layer. Serve this model with python -m hf_resolvent.serve "
            "(or generate()), or train it with a cache-efficient pattern (exp2 -> exp2:ce)")
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if config.position_embedding == "rope" and any(kind in rope_type for kind in LENGTH_DEPENDENT_ROPE):
        raise ValueError(
            f"vLLM cannot serve rope_type {rope_type!r}: its frequencies follow the longest sequence in the batch, "
            "which in vLLM's batches is another request's; use a fixed scaling (linear, yarn, llama3) or none")


class ResolventVllmConfig(VerifyAndUpdateConfig):
    """vLLM's per-architecture config hook for ``ResolventForCausalLM`` (registered by
    :func:`hf_resolvent.vllm.register`)."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        model_config = vllm_config.model_config
        hf_config = model_config.hf_config
        check_servable(hf_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise ValueError("resolvent models run on one device in vLLM: set tensor_parallel_size=1 and "
                             "pipeline_parallel_size=1 (data parallel replicas work)")
        if vllm_config.speculative_config is not None:
            raise ValueError("resolvent models do not take speculative decoding in vLLM: their states keep no "
                             "per-draft copies; leave speculative_config unset")
        kinds = layer_kinds(hf_config)
        hf_config.layer_types = kinds  # vLLM calls a model hybrid when some layer is not attention
        # the layers read a request's slot and length on the host, and the model is not written for vLLM's
        # compiler: a captured CUDA graph would replay the capture's values
        model_config.enforce_eager = True
        if STATE_LAYER not in kinds:
            return
        cache = vllm_config.cache_config
        if cache.enable_prefix_caching:
            # a state after n tokens is kept for the request's next token only, never per block of tokens
            logger.info("resolvent layers keep one state per request: prefix caching is turned off")
            cache.enable_prefix_caching = False
        cache.mamba_cache_mode = "none"
        # one block per request, holding its whole state: sized for max_model_len tokens
        cache.mamba_block_size = model_config.max_model_len
