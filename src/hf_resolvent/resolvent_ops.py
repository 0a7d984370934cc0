"""The mixer functions that the model code calls, gathered in one flat module.

In the installed library this re-exports :mod:`hf_resolvent.ops` (the forms, and the backends that its dispatch
chooses). ``save_pretrained`` replaces this file in a saved folder by an entry that imports the PyTorch
paths from verbatim copies of the ops modules next to it, so that ``trust_remote_code=True`` works where
``hf_resolvent`` is not installed. The imports below are absolute on purpose: transformers copies the files of
relative imports into saved folders, and ``hf_resolvent.ops`` is a package, not a file.
"""

from hf_resolvent.ops import (
    DecodeState,
    decode_tokens,
    decode_tokens_tied,
    resolvent_mix,
    resolvent_mix_tied,
)
from hf_resolvent.ops.common import require
from hf_resolvent.ops.gelu import gelu_tanh
from hf_resolvent.ops.rope import rotated_heads
from hf_resolvent.ops.state import StaticDecodeState

IS_BUNDLE = False

__all__ = [
    "IS_BUNDLE",
    "DecodeState",
    "decode_tokens",
    "decode_tokens_tied",
    "gelu_tanh",
    "require",
    "resolvent_mix",
    "resolvent_mix_tied",
    "rotated_heads",
    "StaticDecodeState",
]
