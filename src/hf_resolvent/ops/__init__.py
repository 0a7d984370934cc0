"""The resolvent mixer as functions: Y = (I - B)^-1 A X for a pattern (docs/DESIGN.md sections 1 and 3).

Four forms compute the same function and are tested against each other:

- ``reference``: materialised A and B and one triangular solve (O(n^2) memory, tests only);
- ``parallel``: block forward substitution (training and prefill), in PyTorch (``dense_solve``, ``slots``,
  ``sparse_solve``, ``attention``) or on a backend's kernels;
- ``graph``: the same block forward substitution in tensor operations alone (``graph``), which ``torch.compile``
  and ``torch.export`` trace;
- ``recurrent``: one token at a time from a :class:`DecodeState` (decode; its buffers grow, or are allocated once
  for a static cache, decoding in a ``torch.compile`` graph);
- ``extend``: several tokens at once after a :class:`DecodeState` (a chunked prefill, assisted decoding's drafts):
  the graph form's gathers and substitution over the held rows and the new ones.

:func:`resolvent_mix`, :func:`decode_step` and :func:`decode_tokens` (``mixer.py``) run the backend that
:func:`.dispatch.choose` names from ``impl`` (argument, then ``HF_RESOLVENT_MIXER_IMPL``), by its row of
:data:`.mixer.BACKENDS`: PyTorch, the CPU kernels of :mod:`hf_resolvent.backends.cpu` or the Triton kernels of
:mod:`hf_resolvent.backends.triton`, each in the form that suits the call.

Every function takes the tied variant (A = B D + D', paper B.3) through one argument: ``d`` (the per-token
weights of D), with ``qa = ka = None``.
"""

from __future__ import annotations

from .dispatch import IMPLS
from .extend import extend_mix
from .graph import graph_mix
from .mixer import decode_step, decode_tokens, resolvent_mix
from .parallel import parallel_mix
from .recurrent import recurrent_mix, recurrent_step
from .reference import mixer_matrices, reference_mix
from .state import DecodeState

__all__ = [
    "IMPLS",
    "DecodeState",
    "decode_step",
    "decode_tokens",
    "extend_mix",
    "graph_mix",
    "mixer_matrices",
    "parallel_mix",
    "recurrent_mix",
    "recurrent_step",
    "reference_mix",
    "resolvent_mix",
]
