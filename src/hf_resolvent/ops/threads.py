"""Coarse-grained CPU parallelism for the parallel form: head groups on threads, ops on one thread each.

The sparse solves and slot updates are thousands of small ops. Run with PyTorch's intra-op threads,
every op is a parallel region that waits for its slowest thread: too small to gain much on an idle
machine, and on a loaded one (other processes on the same cores) each region can stall for a
scheduler time slice. Instead the (batch x head) rows are split into one group per thread, each group
runs its whole loop with single-threaded ops, and the groups only meet at the end.

``torch.set_num_threads`` is process-wide, so :func:`serial` changes it for the duration of the
enclosed block (and restores it); pool threads are only ever used inside such a block and keep a
single intra-op thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext

import torch

ENABLED = False  # split head groups over threads (set False to use PyTorch's intra-op threads only)

_pool: ThreadPoolExecutor | None = None
_pool_workers = 0
_pool_lock = threading.Lock()


@contextmanager
def serial():
    """Run the enclosed ops with one intra-op thread (restores the previous count afterwards)."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _pool_with(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or _pool_workers < workers:
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hf_resolvent")
            _pool_workers = workers
        return _pool


def over_heads(fn: Callable[[slice], None], heads: int, force: bool = False) -> None:
    """Call ``fn(group)`` for slices ``group`` covering range(heads), one group per thread.

    ``fn`` must only write to its own group's rows. With one intra-op thread, fewer than two heads,
    inside another :func:`over_heads` (or :func:`serial`) block, or with ``ENABLED`` False (and not
    ``force``), it is a single call ``fn(slice(0, heads))`` (on one thread when ``force``).
    """
    threads = torch.get_num_threads()
    if not (ENABLED or force) or threads <= 1 or heads < 2:
        with serial() if force else nullcontext():
            fn(slice(0, heads))
        return
    parts = min(threads, heads)
    bounds = [heads * i // parts for i in range(parts + 1)]
    groups = [slice(bounds[i], bounds[i + 1]) for i in range(parts)]
    grad = torch.is_grad_enabled()  # thread-local: the pool threads must see the caller's mode

    def call(group: slice) -> None:
        with torch.set_grad_enabled(grad):
            fn(group)

    with serial():
        futures = [_pool_with(parts - 1).submit(call, group) for group in groups[1:]]
        try:
            fn(groups[0])
        finally:
            errors = [f.exception() for f in futures]  # wait for all: they write into shared tensors
        for err in errors:
            if err is not None:
                raise err


def flat_heads(t: torch.Tensor) -> torch.Tensor:
    """(B, H, ...) -> (1, B * H, ...) (a view when possible), so head groups span the batch too."""
    return t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:])
