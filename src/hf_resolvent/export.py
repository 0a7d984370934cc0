"""A model's prefill and decode step as functions of tensors, for ``torch.export`` and ONNX.

A forward reads and writes every layer's decode state. :class:`ResolventDecodeStep` makes those states plain
inputs and outputs: it lays them out as a static cache (each layer's :class:`~hf_resolvent.ops.DecodeState` in
buffers whose shapes the batch size and ``max_cache_len`` fix) and maps

    (input_ids (B, n), *state) -> (logits (B, n, vocab), *next_state)

with the tensors of each layer's state in :attr:`ResolventDecodeStep.state_names` order. Exported with n = 1 it is
the decode step (:func:`export_decode_step`); with the prompt's length and :meth:`ResolventDecodeStep.initial_state`
it is the prefill (:func:`export_prefill`: the parallel form, traced as its graph form), whose state the decode
step continues from. ONNX has no triangular solve, so :func:`export_onnx` writes the decode step alone, and a
prompt runs through it one token at a time from the initial state: the recurrent form, which gives the logits and
states of the parallel prefill (docs/DESIGN.md section 3.3). Batches without padding only (left padding is a
``generate()`` feature).

    step = ResolventDecodeStep(model, batch_size=1, max_cache_len=256)
    program = torch.export.export(step, step.example_inputs())        # or export_onnx(model, "step.onnx", ...)
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .cache_resolvent import ResolventCache

__all__ = ["ResolventDecodeStep", "export_decode_step", "export_onnx", "export_prefill"]


class ResolventDecodeStep(nn.Module):
    """One decode step of ``model`` with the layers' states as inputs and outputs (see the module docstring).

    Args:
        model: a :class:`~hf_resolvent.ResolventForCausalLM` (its parameters are shared, not copied).
        batch_size: B, fixed in the exported graph.
        max_cache_len: tokens a state can hold, prompt included (default: ``model.config.n_positions``).
    """

    def __init__(self, model: nn.Module, batch_size: int = 1, max_cache_len: int | None = None):
        super().__init__()
        self.model = model
        self.max_cache_len = max_cache_len or model.config.n_positions
        param = next(model.parameters())
        self._layout = ResolventCache(model.config, max_cache_len=self.max_cache_len).allocate(
            batch_size, dtype=param.dtype, device=param.device).states
        self.state_names = [f"layer{i}.{name}" for i, state in enumerate(self._layout) for name in state.buffers()]

    def initial_state(self) -> tuple[torch.Tensor, ...]:
        """The states before the first token (fresh tensors), in :attr:`state_names` order."""
        return tuple(t.clone() for state in self._layout for t in state.buffers().values())

    def example_inputs(self, length: int = 1) -> tuple[torch.Tensor, ...]:
        """(input_ids (B, length), *initial_state()): the arguments of :meth:`forward`, for tracing."""
        batch = self._layout[0].batch_size
        return (torch.zeros(batch, length, dtype=torch.long, device=self._layout[0].positions.device),
                *self.initial_state())

    def forward(self, input_ids: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(input_ids (B, n), *state) -> (logits (B, n, vocab), *next_state); the inputs are not written."""
        if len(state) != len(self.state_names):
            raise ValueError(f"expected {len(self.state_names)} state tensors ({', '.join(self.state_names)}), "
                             f"got {len(state)}")
        cache = ResolventCache(self.model.config, max_cache_len=self.max_cache_len)
        given = iter(state)
        for layer, layout in zip(cache.layers, self._layout):
            layer.state = layout.with_buffers({name: next(given).clone() for name in layout.buffers()})
        logits = self.model(input_ids, past_key_values=cache, use_cache=True).logits
        return (logits, *(t for layer in cache.layers for t in layer.state.buffers().values()))


def export_decode_step(model: nn.Module, batch_size: int = 1,
                       max_cache_len: int | None = None) -> torch.export.ExportedProgram:
    """``torch.export`` of :class:`ResolventDecodeStep` (run ``program.module()(ids, *state)``)."""
    step = ResolventDecodeStep(model, batch_size, max_cache_len).eval()
    with torch.no_grad():
        return torch.export.export(step, step.example_inputs(), strict=False)


def export_prefill(model: nn.Module, length: int, batch_size: int = 1,
                   max_cache_len: int | None = None) -> torch.export.ExportedProgram:
    """``torch.export`` of the prefill of ``length`` tokens: ``program.module()(ids (B, length), *initial_state)``
    gives the logits and the state that :func:`export_decode_step`'s program (same ``batch_size`` and
    ``max_cache_len``) continues from."""
    step = ResolventDecodeStep(model, batch_size, max_cache_len).eval()
    if not 1 <= length <= step.max_cache_len:
        raise ValueError(f"length must lie in [1, max_cache_len = {step.max_cache_len}], got {length}")
    with torch.no_grad():
        return torch.export.export(step, step.example_inputs(length), strict=False)


def export_onnx(model: nn.Module, path: str | Path, batch_size: int = 1, max_cache_len: int | None = None) -> Path:
    """Write :class:`ResolventDecodeStep` as an ONNX model at ``path`` (needs ``onnx`` and ``onnxscript``: ``pip
    install "hf-resolvent[export]"``). Its inputs are ``input_ids`` and the state tensors by
    :attr:`ResolventDecodeStep.state_names`; its outputs ``logits`` and the next state, each name + ``".next"``."""
    try:
        import onnxscript  # noqa: F401  (torch.onnx's exporter needs it; say so before a long trace)
    except ImportError:
        raise ImportError('ONNX export needs onnx and onnxscript: pip install "hf-resolvent[export]"') from None
    step = ResolventDecodeStep(model, batch_size, max_cache_len).eval()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        program = torch.onnx.export(step, step.example_inputs(), dynamo=True, verbose=False,
                                    input_names=["input_ids", *step.state_names],
                                    output_names=["logits", *(f"{name}.next" for name in step.state_names)])
    program.save(str(path))
    return path
