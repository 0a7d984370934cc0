"""Deprecated: the Triton kernels are :mod:`hf_resolvent.backends.triton` (this name also belongs to Hugging Face's
``kernels`` package). Attribute access is forwarded there, with a DeprecationWarning."""

import importlib
import warnings


def __getattr__(name: str):
    warnings.warn("hf_resolvent.kernels is deprecated: import hf_resolvent.backends.triton instead",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("hf_resolvent.backends.triton"), name)
