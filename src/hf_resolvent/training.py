"""Moved to :mod:`hf_resolvent.experiments.training`; this name forwards there with a DeprecationWarning."""

import warnings

from .experiments import training as _moved


def __getattr__(name: str):
    warnings.warn("hf_resolvent.training moved to hf_resolvent.experiments.training; import it from there",
                  DeprecationWarning, stacklevel=2)
    return getattr(_moved, name)
