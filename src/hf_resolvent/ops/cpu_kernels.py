"""Deprecated: the compiled CPU kernels are :mod:`hf_resolvent.backends.cpu`, and the choice to use them is
:mod:`hf_resolvent.ops.dispatch`'s (``disabled()`` is ``dispatch.torch_only()``)."""

import warnings

from ..backends.cpu import available, build_dir  # noqa: F401
from .dispatch import compiled_for, compiled_ops  # noqa: F401
from .dispatch import torch_only as disabled  # noqa: F401

warnings.warn("hf_resolvent.ops.cpu_kernels is deprecated: use hf_resolvent.backends.cpu (build_dir, available) and "
              "hf_resolvent.ops.dispatch (compiled_for, torch_only)", DeprecationWarning, stacklevel=2)
