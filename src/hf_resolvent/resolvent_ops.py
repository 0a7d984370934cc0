"""The mixer functions that the model code calls, gathered in one flat module: in the library, :mod:`hf_resolvent.ops`
(the forms, and the backends that its dispatch chooses).

A saved folder gets a generated file of the same name in its place (:mod:`hf_resolvent.remote_code` says why and
how). The imports below are absolute for that reason: transformers copies into a saved folder the files of the
relative imports it finds, and ``hf_resolvent.ops`` is a package, not a file.
"""

from hf_resolvent.ops import (
    DecodeState,
    resolvent_mix,
)
from hf_resolvent.ops.common import require
from hf_resolvent.ops.conv import causal_conv_silu
from hf_resolvent.ops.gelu import gelu_tanh
from hf_resolvent.ops.mixer import decode_projected, gate_values, tied_weights
from hf_resolvent.ops.rope import rotated_parts

IS_BUNDLE = False  # this is the library's module, not a saved folder's entry

__all__ = [
    "IS_BUNDLE",
    "DecodeState",
    "causal_conv_silu",
    "decode_projected",
    "gate_values",
    "gelu_tanh",
    "require",
    "resolvent_mix",
    "rotated_parts",
    "tied_weights",
]
