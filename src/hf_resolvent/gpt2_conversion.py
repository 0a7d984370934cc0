"""A resolvent model from a GPT-2 checkpoint (``ResolventForCausalLM.from_gpt2``).

This file is copied into saved model folders beside ``modeling_resolvent.py`` (remote code): it imports only
``torch``, ``transformers`` and flat sibling modules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .configuration_resolvent import ResolventConfig

__all__ = ["from_gpt2"]


def from_gpt2(cls, model_or_path, mixer: Any = "attention", position_embedding: str = "learned",
              gate_init: str | float = "closed", **config_overrides):
    """A ``cls`` (``ResolventForCausalLM``) with a ``GPT2LMHeadModel``'s weights: see
    ``ResolventForCausalLM.from_gpt2``."""
    from transformers import GPT2LMHeadModel

    if position_embedding == "none":
        raise ValueError("from_gpt2 with position_embedding='none': GPT-2's weights were trained with its learned "
                         "position table, and without positions its attention sees an unordered prefix; convert "
                         "with 'learned' (the table is copied) or 'rope' and fine-tune")
    gpt2 = model_or_path if isinstance(model_or_path, nn.Module) else GPT2LMHeadModel.from_pretrained(model_or_path)
    gc = gpt2.config
    if getattr(gc, "scale_attn_by_inverse_layer_idx", False) or not getattr(gc, "scale_attn_weights", True):
        raise ValueError("from_gpt2 supports GPT-2 attention scaled by head_dim ** -0.5 only")
    if getattr(gc, "add_cross_attention", False):
        raise ValueError("from_gpt2 does not convert cross-attention (add_cross_attention=True)")
    fields = dict(
        vocab_size=gc.vocab_size, n_positions=gc.n_positions, n_embd=gc.n_embd, n_layer=gc.n_layer,
        n_head=gc.n_head, n_inner=gc.n_inner, activation_function=gc.activation_function,
        resid_pdrop=gc.resid_pdrop, embd_pdrop=gc.embd_pdrop, layer_norm_epsilon=gc.layer_norm_epsilon,
        initializer_range=gc.initializer_range, bos_token_id=gc.bos_token_id, eos_token_id=gc.eos_token_id,
        pad_token_id=gc.pad_token_id, tie_word_embeddings=gc.tie_word_embeddings,
        position_embedding=position_embedding, mixer=mixer, gate_init=gate_init,
    )
    fields.update(config_overrides)
    model = cls(ResolventConfig(**fields))
    src, dst = gpt2.transformer, model.transformer
    width = gc.n_embd
    with torch.no_grad():
        dst.wte.weight.copy_(src.wte.weight)
        if dst.wpe is not None:
            dst.wpe.weight.copy_(src.wpe.weight[: dst.wpe.weight.shape[0]])
        dst.ln_f.load_state_dict(src.ln_f.state_dict())
        for block_src, block in zip(src.h, dst.h):
            block.ln_1.load_state_dict(block_src.ln_1.state_dict())
            block.ln_2.load_state_dict(block_src.ln_2.state_dict())
            block.mlp.c_fc.weight.copy_(block_src.mlp.c_fc.weight.t())
            block.mlp.c_fc.bias.copy_(block_src.mlp.c_fc.bias)
            block.mlp.c_proj.weight.copy_(block_src.mlp.c_proj.weight.t())
            block.mlp.c_proj.bias.copy_(block_src.mlp.c_proj.bias)
            w = block_src.attn.c_attn.weight.t()  # (3 width, width): rows q, k, v
            b = block_src.attn.c_attn.bias
            parts = {"qa": 0, "ka": 1, "x": 2, "qb": 0, "kb": 1}
            mixer_mod = block.mixer
            for i, name in enumerate(mixer_mod.parts):
                j = parts[name]
                mixer_mod.in_proj.weight[i * width:(i + 1) * width].copy_(w[j * width:(j + 1) * width])
                mixer_mod.in_proj.bias[i * width:(i + 1) * width].copy_(b[j * width:(j + 1) * width])
            mixer_mod.out_proj.weight.copy_(block_src.attn.c_proj.weight.t())
            mixer_mod.out_proj.bias.copy_(block_src.attn.c_proj.bias)
            if mixer_mod.conv is not None:  # the identity tap: each token's own projection
                mixer_mod.conv.weight.zero_()
                mixer_mod.conv.weight[:, 0, -1] = 1.0
                mixer_mod.conv.bias.zero_()
        if not model.config.tie_word_embeddings:
            model.lm_head.weight.copy_(gpt2.lm_head.weight)
    return model
