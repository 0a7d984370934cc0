"""Triton kernels of the resolvent mixer (installed as ``hf_resolvent.backends.triton``). See kernels/README.md.

Entry points used by :mod:`hf_resolvent.ops` when :mod:`hf_resolvent.ops.dispatch` chooses them:

- :func:`triton_ready` -> bool: Triton can run here (a CUDA device, or ``TRITON_INTERPRET=1``);
- :func:`triton_mix`: same contract as ``ops.parallel_mix`` (the tied variant with ``d``), differentiable (fused
  forward and backward kernels);
- :func:`triton_decode_step`: same contract as ``ops.recurrent_step`` (one token against a layer's
  ``DecodeState``); :func:`triton_decode_projected`: same contract as ``ops.decode_projected`` (the mixer's
  step from its projection, RoPE and the gate in the kernel);
- :func:`triton_rope_heads`: same contract as ``ops.rope.rotated_heads`` (and with ``rotate``, the whole
  ``ops.rope.rotated_parts``), :func:`triton_gate_values`: same contract as ``ops.mixer.gate_values``, both
  differentiable, their outputs contiguous in the layout the mixer kernels read.

Importing this package does not import Triton; the kernels are loaded on first use.
"""

import importlib

# Loaded on first attribute access (PEP 562). Besides keeping ``import hf_resolvent`` light, this matters
# when the repository root is on sys.path (``python -m pytest``, ``python -c`` there): this folder is then
# also importable as a top-level ``kernels``, the name of the Hugging Face kernels package that transformers
# probes while it is being imported; an eager import of hf_resolvent from here would be circular.
_EXPORTS = {
    "check_ready": "._loader",
    "interpreting": "._loader",
    "triton_ready": "._loader",
    "triton_decode_projected": ".decode",
    "triton_decode_step": ".decode",
    "triton_gate_values": ".rope_gate",
    "triton_rope_heads": ".rope_gate",
    "BlockConfig": ".launching",
    "block_config": ".launching",
    "get_block_config": ".launching",
    "make_plan": ".launching",
    "set_nan_fill": ".launching",
    "triton_mix": ".mix",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)


__all__ = [
    "BlockConfig",
    "block_config",
    "check_ready",
    "get_block_config",
    "interpreting",
    "make_plan",
    "set_nan_fill",
    "triton_decode_projected",
    "triton_decode_step",
    "triton_gate_values",
    "triton_mix",
    "triton_ready",
    "triton_rope_heads",
]
