"""hf-resolvent: resolvent token mixers Y = (I - B)^-1 A X for Hugging Face transformers.

Importing the package registers the ``resolvent`` model type with ``AutoConfig``, ``AutoModel`` and
``AutoModelForCausalLM``, and registers the classes for their auto classes so that saved folders carry the
model code (``auto_map``; load with ``trust_remote_code=True`` where hf_resolvent is not installed).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache_resolvent import ResolventCache
from .configuration_resolvent import ResolventConfig
from .modeling_resolvent import ResolventForCausalLM, ResolventModel, ResolventPreTrainedModel
from .patterns import Pattern, get_pattern

__version__ = "0.1.0"

AutoConfig.register("resolvent", ResolventConfig, exist_ok=True)
AutoModel.register(ResolventConfig, ResolventModel, exist_ok=True)
AutoModelForCausalLM.register(ResolventConfig, ResolventForCausalLM, exist_ok=True)
ResolventConfig.register_for_auto_class("AutoConfig")
ResolventModel.register_for_auto_class("AutoModel")
ResolventForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "Pattern",
    "ResolventCache",
    "ResolventConfig",
    "ResolventForCausalLM",
    "ResolventModel",
    "ResolventPreTrainedModel",
    "get_pattern",
    "__version__",
]
