"""A decode step reads nothing back from the device: no op of one generated token (the model's forward after a cache,
with its attention mask) needs a device value on the host, for every mixer family, with the growing and the static
cache, a short convolution or none, on the PyTorch path, the CPU kernels and the Triton kernels (interpreted).

The counter (scripts/bench/op_counts.py) flags ``.item()``/``int()``/``bool()`` of a tensor, ``nonzero``,
``masked_select``, ``equal``, boolean indexing, ``tolist`` and copies to the host: on a GPU each makes the host wait
for the device. On a CPU they cost nothing, which is why this is held here, where the code runs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, family_model, load_script

import hf_resolvent as hr

OpCounter = load_script("bench/op_counts").OpCounter

pytestmark = pytest.mark.usefixtures("one_thread_module")


def _decode_step_syncs(model, static: bool, impl: str) -> list[str]:
    """The host syncs of the third token after a left-padded prefill (the first two may grow buffers)."""
    ids = torch.randint(1, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    cache = hr.ResolventCache(model.config, max_cache_len=16 if static else None)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        model.config.mixer_impl = impl  # the prefill on the default path; the steps on the one under test
        for _ in range(3):
            token = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            with OpCounter() as counter:
                out = model(token, attention_mask=mask, past_key_values=cache, use_cache=True)
    return counter.sync_sites


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_decode_step_reads_nothing_back(family, static):
    for impl in ("torch", "auto"):
        for conv in (0, 4):
            model = family_model(family, conv_size=conv)
            assert _decode_step_syncs(model, static, impl) == [], (impl, conv)


@pytest.mark.parametrize("family", ["attention", "local", "dense", "sparse", "ce", "tied"])
def test_a_decode_step_on_the_triton_kernels_reads_nothing_back(family, monkeypatch):
    """The decode kernel's launcher takes sizes and positions from the state's tensors, never from their values."""
    from hf_resolvent.ops import dispatch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels, calls = dispatch.triton(), []
    step = kernels.triton_decode_projected
    monkeypatch.setattr(kernels, "triton_decode_projected", lambda *a, **k: calls.append(1) or step(*a, **k))
    for static in (False, True):
        model = family_model(family, conv_size=4 if family == "ce" else 0)
        assert _decode_step_syncs(model, static, "triton") == [], static
    assert len(calls) == 2 * 3 * model.config.n_layer  # every step of every layer ran the kernel


def test_the_counter_sees_a_sync_in_a_decode_step(monkeypatch):
    """The check above can fail: a state that reads its count back from the device is caught."""
    from hf_resolvent.ops import state as state_module

    model = family_model("ce")
    monkeypatch.setattr(state_module.Growing, "count", lambda self: int(torch.tensor(self.seen)))
    assert _decode_step_syncs(model, False, "torch")
