"""Intra-op threading policy of the parallel form.

The sparse paths and the leaves of the dense tree are thousands of small ops. Run with PyTorch's
intra-op threads, every op is a parallel region that waits for its slowest thread: too small to gain
much on an idle 2-core machine, and on a shared one (other processes on the same cores) each region
can stall for a scheduler time slice. Measured on the 2-core CPU this project targets, with other jobs
running: the exp2 mixer at n = 2048 took 24x the time of causal SDPA with intra-op threads and 0.4x on
one thread. :func:`serial` runs such sections on one thread; only a few large kernels (causal SDPA and
the dense tree's flash-attention nodes) use the intra-op threads.

``torch.set_num_threads`` is process-wide: :func:`serial` changes it for the duration of the block and
restores it, so do not call the mixer from several Python threads at once.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


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
