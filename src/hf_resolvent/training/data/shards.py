"""Reading a prepared folder: a split as one array of token ids (:class:`TokenShards`), the training windows of
each step (:class:`StepSampler`) and the validation windows (:func:`eval_windows`)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .errors import DataError
from .manifest import TOKEN_DTYPE, verify_prepared

# ---------------------------------------------------------------------------------------------- reading


class TokenShards:
    """One split of a prepared folder as a single virtual array of token ids (memory-mapped shards).

    ``len(ts)`` is the number of tokens; ``ts.read(start, length)`` returns int64 ids ``(length,)`` and may span
    shards.
    """

    def __init__(self, data_dir: str | os.PathLike, split: str = "train"):
        data_dir = Path(data_dir)
        # sizes of all files against the manifest (cheap): a truncated shard is named here, not met mid-training
        self.meta = verify_prepared(data_dir)
        if split not in self.meta["shards"]:
            raise DataError(f"split must be one of {list(self.meta['shards'])}, got {split!r}")
        self.arrays = []
        for rel in self.meta["shards"][split]:
            path = data_dir / rel
            if path.stat().st_size:
                self.arrays.append(np.memmap(path, dtype=TOKEN_DTYPE, mode="r"))
        self.offsets = np.cumsum([0] + [a.size for a in self.arrays])
        self.split = split

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        if start < 0 or start + length > len(self):
            raise IndexError(f"window [{start}, {start + length}) outside the {self.split} split of {len(self)} tokens")
        out = np.empty(length, dtype=np.int64)
        pos, filled = int(start), 0
        k = int(np.searchsorted(self.offsets, pos, side="right") - 1)
        while filled < length:
            a = self.arrays[k]
            lo = pos - int(self.offsets[k])
            take = min(length - filled, a.size - lo)
            out[filled:filled + take] = a[lo:lo + take]
            filled += take
            pos += take
            k += 1
        return out


class StepSampler:
    """Deterministic random windows indexed by optimizer step (so a resumed run reads the same data).

    Step ``s`` draws ``global_batch`` window starts from ``numpy.random.default_rng([seed, s])``; the process
    ``rank`` of ``world`` takes, for micro-step ``m``, rows ``(m * world + rank) * micro_batch`` onwards. The
    global batch of a step is therefore the same for any number of processes.
    """

    def __init__(self, tokens: TokenShards, seq_len: int, micro_batch: int, grad_accum: int, world: int,
                 seed: int):
        self.tokens, self.seq_len, self.micro_batch = tokens, seq_len, micro_batch
        self.grad_accum, self.world, self.seed = grad_accum, world, seed
        self.global_batch = micro_batch * grad_accum * world
        if len(tokens) < seq_len + 2:
            raise DataError(f"the {tokens.split} split has {len(tokens)} tokens, fewer than one window of "
                            f"{seq_len + 1}; prepare more data or lower seq_len")

    def starts(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.global_batch)

    def batch(self, step: int, micro: int, rank: int) -> np.ndarray:
        """int64 ``(micro_batch, seq_len + 1)``: inputs are ``[:, :-1]``, next-token targets ``[:, 1:]``."""
        starts = self.starts(step)
        lo = (micro * self.world + rank) * self.micro_batch
        return np.stack([self.tokens.read(int(s), self.seq_len + 1) for s in starts[lo:lo + self.micro_batch]])


def eval_windows(tokens: TokenShards, seq_len: int, max_windows: int | None = None) -> list[int]:
    """Starts of consecutive non-overlapping windows of ``seq_len + 1`` tokens over a split (fixed eval set).

    Raises :class:`DataError` when the split is shorter than one window: an empty evaluation would report a
    NaN loss as if it were a result.
    """
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        split = getattr(tokens, "split", "evaluation")
        raise DataError(f"the {split} split has {len(tokens):,} tokens, fewer than one evaluation window of "
                        f"{seq_len + 1} (seq_len {seq_len} + 1); lower seq_len or prepare more validation data "
                        f"(a larger --val-fraction, or more documents)")
    if max_windows is not None and n > max_windows:
        # spread the windows evenly over the split
        idx = np.linspace(0, n - 1, max_windows).round().astype(np.int64)
        return [int(i) * seq_len for i in idx]
    return [i * seq_len for i in range(n)]
