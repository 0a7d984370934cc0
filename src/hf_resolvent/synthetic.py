"""Moved to :mod:`hf_resolvent.experiments.synthetic`; this name forwards there with a DeprecationWarning."""

import warnings

from .experiments import synthetic as _moved


def __getattr__(name: str):
    warnings.warn("hf_resolvent.synthetic moved to hf_resolvent.experiments.synthetic; import it from there",
                  DeprecationWarning, stacklevel=2)
    return getattr(_moved, name)
