"""The Triton kernels of the resolvent mixer, one module per op: its ``@triton.jit`` code, its launchers and the cost
model of its kernels (:mod:`.common` holds the conventions and the device helpers the ops share). Loaded once per
Triton mode by ``_loader.jit_module``, which returns this package: ``jit.<op>.<launcher>`` runs an op, and
``COSTS`` maps each kernel's name to its cost model (``cost.launch_cost``).
"""

from . import attention, decode_step, dense_solve, gate, rope, sparse_chunked, sparse_solve

OPS = (attention, dense_solve, sparse_solve, sparse_chunked, decode_step, rope, gate)
KERNELS = {name: getattr(op, name) for op in OPS for name in dir(op) if name.endswith("_kernel")}
COSTS = {name: model for op in OPS for name, model in op.COSTS.items()}

__all__ = ["COSTS", "KERNELS", "OPS", "attention", "decode_step", "dense_solve", "gate", "rope", "sparse_chunked",
           "sparse_solve"]
