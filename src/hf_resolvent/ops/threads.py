"""Intra-op threading policy of the parallel form.

The sparse paths and the leaves of the dense tree are thousands of small ops. Run with PyTorch's
intra-op threads, every op is a parallel region that waits for its slowest thread: too small to gain
much on an idle 2-core machine, and on a shared one (other processes on the same cores) each region
can stall for a scheduler time slice: on the 2-core CPU this project targets, with other jobs running, the
exp2 mixer was many times slower with intra-op threads than on one thread (figures: bench/NOTES.md).
:func:`serial` runs such sections on one thread.

The dense tree's backward at n >= 2048 goes one step further (:func:`by_head_groups`): its (batch x head) rows
are split into one group per intra-op thread, each solved in a worker thread with one intra-op thread, so its many
small ops keep every core busy. Of the arrangements tried on the 2-core machine, head groups did best for the
dense backward, and all ops on the intra-op threads for the dense forward, which has fewer ops per leaf
(figures: bench/NOTES.md).

:func:`serial` changes the calling thread's intra-op thread count for the duration of the block and
restores it; calling the mixer from several Python threads at once is not supported.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext

import torch

from .dispatch import cpu_kernels_for


@contextmanager
def serial():
    """Run the enclosed ops with one intra-op thread (restores the previous count afterwards). Inside a
    ``torch.compile`` graph the ops are fused and the thread count is the graph's business: nothing changes."""
    if torch.compiler.is_compiling():
        yield
        return
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def serial_for(*tensors: torch.Tensor):
    """:func:`serial` for sections of small PyTorch ops on ``tensors``; a no-op where the CPU kernels
    (:mod:`hf_resolvent.backends.cpu`) take them, which spread the (batch x head) rows over the intra-op threads
    themselves."""
    return nullcontext() if cpu_kernels_for(*tensors) else serial()


_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (process id, workers, pool)


def _pool(workers: int) -> ThreadPoolExecutor:
    global _POOL
    # A forked child inherits the pool object but not its threads: make a new one there.
    if _POOL is None or _POOL[:2] != (os.getpid(), workers):
        if _POOL is not None and _POOL[0] == os.getpid():
            _POOL[2].shutdown(wait=False)  # the intra-op thread count changed
        # Each worker runs its ops on one intra-op thread (torch's count is per OS thread with OpenMP).
        pool = ThreadPoolExecutor(workers, thread_name_prefix="hf_resolvent", initializer=torch.set_num_threads,
                                  initargs=(1,))
        _POOL = (os.getpid(), workers, pool)
    return _POOL[2]


def head_groups(t: torch.Tensor) -> int:
    """How many (batch x head) groups :func:`by_head_groups` splits ``t`` (B, H, ...) into: one per intra-op
    thread on CPU (at most B * H), 1 elsewhere (GPUs parallelise inside each kernel)."""
    if t.device.type != "cpu":
        return 1
    return max(1, min(torch.get_num_threads(), t.shape[0] * t.shape[1]))


def by_head_groups(fn, tensors: tuple[torch.Tensor, ...], groups: int):
    """``fn(*tensors)`` computed on ``groups`` slices of the batch x head rows, concurrently, one thread each.

    For functions made of many small ops (a row tree's leaves and merges): run serially with two intra-op
    threads, each op waits for its slowest thread; split by heads, every op runs on one thread and both cores
    stay busy (the ops release the GIL). ``tensors`` are (B, H, ...) and contiguous, ``fn`` acts on each
    (batch x head) row independently and may write into its inputs in place (the slices are views). Returns
    ``fn``'s outputs (a tuple of (B, H, ...) tensors) reassembled.
    """
    if groups <= 1:
        return fn(*tensors)
    b, h = tensors[0].shape[:2]
    rows = [t.view(1, b * h, *t.shape[2:]) for t in tensors]
    size = -(-(b * h) // groups)
    grad_mode = torch.is_grad_enabled()  # thread-local: carry the caller's into the workers

    def run(*args):
        with torch.set_grad_enabled(grad_mode):
            return fn(*args)

    pool = _pool(groups)
    futures = [pool.submit(run, *(t[:, s: s + size] for t in rows)) for s in range(0, b * h, size)]
    wait(futures)  # all of them, even when one fails: they write into the shared tensors
    parts = [f.result() for f in futures]
    return tuple(torch.cat(outs, dim=1).view(b, h, *outs[0].shape[2:]) for outs in zip(*parts))
