"""How the resolvent model reads its inputs: the 2-D attention mask as each sequence's left padding (``start``), a
prefill mask with holes and packed documents (position_ids that restart) laid out again as separate left-padded
rows (:class:`Regroup`), the checks of ids and masks, and the cache argument's two names.

This file is copied into saved model folders beside ``modeling_resolvent.py`` (remote code): it imports only
``torch``, ``transformers`` and flat sibling modules.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast

from .resolvent_ops import require

__all__ = ["CACHE_NAME", "Regroup", "check_inputs", "lay_out", "one_cache"]

# transformers 5.24 renamed the cache argument of forward() and generate(), and the output field, from
# ``past_key_values`` to ``cache``. The supported releases lie on both sides of the rename (pyproject.toml): forward()
# takes either name, and the generate() hooks and outputs below use the installed release's.
CACHE_NAME = "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"


def one_cache(past_key_values: Cache | None, cache: Cache | None) -> Cache | None:
    """The cache given to forward() under either name (see :data:`CACHE_NAME`)."""
    if past_key_values is not None and cache is not None and past_key_values is not cache:
        raise ValueError("got two different caches, as past_key_values and as cache; pass one (cache= on "
                         "transformers >= 5.24, past_key_values= before)")
    return cache if cache is not None else past_key_values


def start_from_mask(mask: torch.Tensor, past: int, n: int, cache_start: torch.Tensor | None):
    """(start, regroup) from a 2-D attention mask: the leading padding per sequence (B,) or None, and for a prefill
    whose mask has holes the :class:`Regroup` that moves each sequence's real tokens to the right end (so that they
    read as left-padded), else None. Raises on unsupported masks."""
    if mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be 2-D (batch, length) with 1 for tokens and 0 for padding, got shape "
            f"{tuple(mask.shape)}; resolvent mixers take their structure from the pattern, not from a 4-D mask"
        )
    batch, length = mask.shape
    if not isinstance(past, int) or past > 0:  # after a cache: one pass over the mask as given, no copy of it (a
        return check_continued_mask(mask, past, n, cache_start), None  # decode step's mask grows with n)
    if length != n:
        raise ValueError(f"attention_mask has {length} columns but the input has {n} positions")
    mask = mask.to(torch.bool)
    columns = torch.arange(length, device=mask.device)
    count = mask.sum(1)
    lead = (mask.long().cumsum(1) == 0).sum(1)
    contiguous = (columns[None] >= lead[:, None]) & (columns[None] < (lead + count)[:, None])
    if torch.compiler.is_compiling():  # a graph keeps its shapes: left and right padding only, no branch on values
        problem = "attention_mask has holes or an all-padding sequence, which a compiled forward cannot regroup"
        require((count > 0).all() & (contiguous == mask).all(), problem, lambda: problem)
        return lead, None
    if (count == 0).any():
        raise ValueError("attention_mask has a sequence without any real token (all padding); remove it (with "
                         "generate(prefill_chunk_size=...), the first chunk must reach a real token of every "
                         "sequence: use chunks longer than the longest left padding)")
    if not torch.equal(contiguous, mask):  # holes: no later row reads a hidden position
        return n - count, Regroup.right_aligned(mask)
    return (lead if bool(lead.any()) else None), None


def check_continued_mask(mask: torch.Tensor, past: int, n: int, cache_start: torch.Tensor | None):
    """The start of tokens after a cache (the cache's own), once their 2-D mask checks out, by a check that reads
    nothing back (a decode step never waits for the device): the prefill's mask then ones, as many real tokens as
    the cache holds plus the new ones (a zero among the new columns, or a longer mask, counts differently), or the
    new tokens' ones alone."""
    length = mask.shape[1]
    if length == past + n:
        real = past + n - (0 if cache_start is None else cache_start.to(mask.device))
        problem = ("attention_mask does not match the cache: when continuing from a cache the mask must be the "
                   "prefill's mask followed by ones (right padding cannot be continued; pad on the left with "
                   "tokenizer.padding_side = 'left')")
        counted = mask.sum(1) if mask.dtype != torch.bool else mask.sum(1, dtype=torch.long)
        require((counted == real).all(), problem, lambda: problem, read_back=False)
    elif length == n:
        problem = "attention_mask of new tokens after a cache must be all ones (no padding after tokens)"
        require(mask.bool().all(), problem, lambda: problem, read_back=False)
    else:
        raise ValueError(
            f"attention_mask has {length} columns; expected {past + n} (cached {past} + new {n}) or {n} (new only)"
        )
    return cache_start


class Regroup:
    """A batch (B, n) laid out again for the mixers, and back: packed documents become one row each (right-padded,
    :func:`packed_documents`), and the real tokens of a sequence whose mask has holes move to the right end of
    their row (left-padded, :meth:`right_aligned`). Positions that no row holds come back as zeros.

    Attributes: index (R, L) flat positions b * n + t of the tokens each row holds (0 on padding), valid (R, L)."""

    def __init__(self, index: torch.Tensor, valid: torch.Tensor, shape: tuple[int, int]):
        self.index, self.valid, self.shape = index, valid, shape

    @classmethod
    def right_aligned(cls, mask: torch.Tensor) -> Regroup:
        """Each row's real tokens (mask True), in order, at the right end of the row."""
        batch, n = mask.shape
        slot = (n - mask.sum(1))[:, None] + mask.long().cumsum(1) - 1  # where each real token goes in its row
        flat = torch.arange(batch * n, device=mask.device).view(batch, n)
        rows = torch.arange(batch, device=mask.device)[:, None].expand(batch, n)
        index = torch.zeros(batch, n, dtype=torch.long, device=mask.device)
        valid = torch.zeros(batch, n, dtype=torch.bool, device=mask.device)
        index[rows[mask], slot[mask]] = flat[mask]
        valid[rows[mask], slot[mask]] = True
        return cls(index, valid, (batch, n))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """(B, n, ...) -> (R, L, ...)."""
        return t.reshape(self.shape[0] * self.shape[1], *t.shape[2:])[self.index]

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """(R, L, ...) -> (B, n, ...): every token back in its place."""
        out = t.new_zeros(self.shape[0] * self.shape[1], *t.shape[2:])
        out[self.index[self.valid]] = t[self.valid]
        return out.view(*self.shape, *t.shape[2:])


def refuse_right_padding(attention_mask: torch.Tensor) -> None:
    """A batch whose mask rows end in zeros is right-padded: generation would continue each row after its padding.
    Named where the positions generate() derives from such a mask would otherwise read as packed documents (with a
    cache, or beside left-padded rows)."""
    mask = attention_mask.bool()
    rows = (~mask[:, -1] & mask.any(1)).nonzero().flatten().tolist()
    if rows:
        raise ValueError(
            f"the prompt is right-padded (the attention mask of row {', '.join(map(str, rows[:8]))} ends in zeros): a "
            "decode cache and generate() continue each row after its last position, so pad on the left "
            "(tokenizer.padding_side = 'left', or padding_side='left' when tokenizing); right padding is for "
            "training")


def packed_documents(position_ids: torch.Tensor, start: torch.Tensor | None) -> Regroup | None:
    """The documents of packed sequences: a new one wherever a position is not above the previous one (position_ids
    restarting, as ``DataCollatorWithFlattening`` writes them); None when no row restarts. Left padding is skipped."""
    batch, n = position_ids.shape
    columns = torch.arange(n, device=position_ids.device)
    lead = torch.zeros(batch, dtype=torch.long, device=position_ids.device) if start is None else start
    real = columns[None] >= lead[:, None]
    new = torch.ones_like(real)
    new[:, 1:] = (position_ids[:, 1:] <= position_ids[:, :-1]) | ~real[:, :-1]  # a restart, or the first token
    new &= real
    if torch.compiler.is_compiling():  # a graph cannot split rows into documents: one document per row
        problem = "position_ids restart inside a row (packed documents), which a compiled forward cannot split"
        require(new.sum() == batch, problem, lambda: problem)
        return None
    if int(new.sum()) == batch:  # one document per row (host sync, like the position check)
        return None
    if start is not None and bool(start.any()):
        raise ValueError("packed sequences (position_ids restarting inside a row) cannot be left-padded as well; "
                         "pack the documents without padding")
    doc = new.long().cumsum(1) - 1 + (new.sum(1).cumsum(0) - new.sum(1))[:, None]  # (B, n) global document id
    flat_doc = doc.reshape(-1)
    count = torch.bincount(flat_doc)
    first = torch.cumsum(count, 0) - count  # flat position of each document's first token
    offset = torch.arange(batch * n, device=doc.device) - first[flat_doc]
    length = int(count.max())
    index = torch.zeros(count.numel(), length, dtype=torch.long, device=doc.device)
    valid = torch.zeros(count.numel(), length, dtype=torch.bool, device=doc.device)
    index[flat_doc, offset] = torch.arange(batch * n, device=doc.device)
    valid[flat_doc, offset] = True
    return Regroup(index, valid, (batch, n))


def check_inputs(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, vocab_size: int,
                  bos_token_id: int | None, read_back: bool = True) -> None:
    """Refuse what the embedding lookup or the mixers would fail on deep inside torch: a wrong rank, no sequences,
    no positions, token ids outside [0, vocab_size). ``input_ids`` (B, n) or ``inputs_embeds`` (B, n, width);
    ``bos_token_id`` (or None) is suggested as the prompt of an empty one.

    Every forward and every generate() step passes here; the id range costs one min/max reduction, and one host
    sync unless ``read_back`` is False (tokens after a cache: an assert queued on the device, see ``require``).
    """
    name, tokens, rank = ("input_ids", input_ids, 2) if inputs_embeds is None else ("inputs_embeds", inputs_embeds, 3)
    shape = tuple(tokens.shape)
    if tokens.dim() != rank:
        dims = "batch, length" if rank == 2 else "batch, length, width"
        raise ValueError(f"{name} must be ({dims}), got shape {shape}")
    if shape[0] == 0:
        raise ValueError(f"{name} holds no sequences (shape {shape}, a batch of 0); pass at least one sequence")
    if shape[1] == 0:  # no shape in the message: generate() may have repeated the rows (beams) by now
        start = "" if bos_token_id is None else f" (to generate from nothing, start with the BOS token {bos_token_id})"
        raise ValueError(f"{name} holds no tokens (length 0): an empty prompt; give at least one token{start}")
    if inputs_embeds is None:
        low, high = input_ids.min(), input_ids.max()  # not aminmax: ONNX has no full-tensor form of it
        require((low >= 0) & (high < vocab_size), f"input_ids outside the vocabulary (vocab_size = {vocab_size})", lambda: (
            f"input_ids holds the token id {int(low) if low < 0 else int(high)}, outside the vocabulary (vocab_size = "
            f"{vocab_size}: ids 0 to {vocab_size - 1}); use the model's own tokenizer, or call "
            "model.resize_token_embeddings(len(tokenizer)) after adding tokens"), read_back=read_back)


def lay_out(inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
            past, cache_start: torch.Tensor | None, cache_asked: bool):
    """How a batch runs through the blocks: ``(inputs_embeds, position_ids, start, regroup, documents)``.

    ``start`` (B,) is each sequence's left padding (the mask's, or after a cache the cache's own); a prefill mask with
    holes gives ``regroup`` (its real tokens right-aligned, ``inputs_embeds`` and ``position_ids`` packed by it);
    position_ids that restart inside a row give ``documents`` (packed sequences, each run as a sequence of its own;
    the caller packs after adding learned positions). Positions default to counting from each sequence's first real
    token. ``past``: the tokens the cache holds (an int, or a static cache's 0-d tensor inside a graph: arithmetic
    only); ``cache_asked``: a cache was given or asked for, which packed documents cannot have.
    """
    batch, n = inputs_embeds.shape[:2]
    device = inputs_embeds.device
    regroup = documents = None
    if attention_mask is not None:
        start, regroup = start_from_mask(attention_mask.to(device), past, n, cache_start)
    else:
        start = cache_start
    if regroup is not None:  # a mask with holes: the real tokens, right-aligned, run as left-padded sequences
        inputs_embeds = regroup.pack(inputs_embeds)
        if position_ids is not None:
            position_ids = regroup.pack(position_ids.to(device).view(-1, n).expand(batch, -1))
    if position_ids is None:
        position_ids = (torch.arange(n, device=device) + past)[None].expand(batch, -1)
        if start is not None:
            position_ids = (position_ids - start.to(device)[:, None]).clamp(min=0)
    else:
        position_ids = position_ids.to(device).view(-1, n).expand(batch, -1)
        if n > 1 and past == 0:
            if attention_mask is not None and (cache_asked or (start is not None and bool(start.any()))):
                refuse_right_padding(attention_mask)  # its positions (0, 1, 2, 1, 1) are not documents
            documents = packed_documents(position_ids, start)
    if documents is not None and regroup is not None:
        raise ValueError("packed sequences (position_ids restarting inside a row) cannot have attention-mask "
                         "holes as well; pass the documents without padding")
    if documents is not None and cache_asked:
        raise ValueError(
            "position_ids restart inside a sequence (packed documents, e.g. DataCollatorWithFlattening): "
            "that is for training; a decode cache needs one document per sequence, so pass the documents "
            "as separate (left-padded) sequences to use_cache / generate()")
    return inputs_embeds, position_ids, start, regroup, documents
