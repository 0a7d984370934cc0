"""The mixer functions that the model code calls, gathered in one flat module: in the library, :mod:`hf_resolvent.ops`
(the forms, and the backends that its dispatch chooses).

A saved folder gets this file with each ``from hf_resolvent.ops.<module> import`` made flat (``from .<module>
import``) beside copies of the ops modules it reaches (:mod:`hf_resolvent.remote_code` says why and how). The imports
below are absolute for that reason: transformers copies into a saved folder the files of the relative imports it
finds, and ``hf_resolvent.ops`` is a package, not a file. Import each name from the module that defines it.
"""

from hf_resolvent.ops.common import require
from hf_resolvent.ops.conv import causal_conv_silu
from hf_resolvent.ops.gelu import gelu_tanh
from hf_resolvent.ops.mixer import decode_projected, gate_values, resolvent_mix, tied_weights
from hf_resolvent.ops.rope import rotated_parts
from hf_resolvent.ops.state import DecodeState

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
