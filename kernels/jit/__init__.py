"""The ``@triton.jit`` code of the resolvent mixer, one module per op (:mod:`.common` holds the conventions and
what the ops share). Loaded once per Triton mode by ``_loader.jit_module``, which returns this package: its
attributes are the kernels the launchers start.
"""

from .attention import attn_bwd_atomic_kernel, attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_fwd_kernel
from .decode import decode_step_kernel
from .dense_solve import dense_chunk_bwd_kernel, dense_chunk_fwd_kernel, dense_solve_bwd_kernel, dense_solve_fwd_kernel
from .sparse_chunked import chunk_carry_kernel, chunk_grads_kernel, chunk_prepare_kernel, chunk_rows_bwd_kernel
from .sparse_solve import sparse_direct_kernel, sparse_grads_kernel, sparse_solve_bwd_kernel, sparse_solve_fwd_kernel

__all__ = [
    "attn_bwd_atomic_kernel",
    "attn_bwd_dkdv_kernel",
    "attn_bwd_dq_kernel",
    "attn_fwd_kernel",
    "dense_chunk_bwd_kernel",
    "dense_chunk_fwd_kernel",
    "dense_solve_bwd_kernel",
    "dense_solve_fwd_kernel",
    "sparse_direct_kernel",
    "sparse_grads_kernel",
    "sparse_solve_bwd_kernel",
    "sparse_solve_fwd_kernel",
    "chunk_carry_kernel",
    "chunk_grads_kernel",
    "chunk_prepare_kernel",
    "chunk_rows_bwd_kernel",
    "decode_step_kernel",
]
