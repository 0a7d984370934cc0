"""Counts what a piece of PyTorch code asks of a device, on any device, a CPU included: the aten calls that would
launch a kernel, and the host syncs (a device value the host must wait for), with where each sync was made.

    from op_counts import OpCounter

    with OpCounter() as c:
        loss = model(ids).loss
        loss.backward()
    c.launches            # Counter: {"aten::mm": 48, "aten::add": 31, ...}
    c.syncs               # Counter: {"aten::_local_scalar_dense": 2, "Tensor.tolist": 1}
    c.sync_sites          # ["src/hf_resolvent/ops/state.py:120", ...], one per sync, in order
    c.n_launches, c.n_syncs

It is a ``TorchDispatchMode``: it sees every op below autograd (the backward's too), after the composite ops have
been broken into the ops that run, so ``x.reshape(...)`` is counted as the ``view`` or the copy it becomes.

A call **launches a kernel** unless it only makes or changes tensor metadata:

- a view: every value it returns aliases an input and is not written (its schema's ``alias_info``, e.g.
  ``view(Tensor(a) self, ...) -> Tensor(a)``; ``transpose``, ``expand``, ``select``, ``slice``, ``split``,
  ``unbind``, ``detach``, ``alias``, ``as_strided`` are such);
- an op tagged ``inplace_view`` (``t_``, ``transpose_``, ``unsqueeze_``, ``as_strided_``, ``set_``, ``resize_``);
- by name, what the schemas do not say: ``_unsafe_view`` (a view whose schema declares no alias), allocations
  without a fill (``empty*``, ``new_empty*``), size and symbol queries (``sym_*``, ``size``, ``stride``, ...),
  metadata checks, and ``_local_scalar_dense`` (a copy to the host, counted as a sync).

A call is a **host sync** when its result on the host depends on device values: the ops tagged
``data_dependent_output`` (``_local_scalar_dense``: ``.item()``, ``int()``, ``bool()``; ``equal``) or
``dynamic_output_shape`` (``nonzero``, ``masked_select``, ``unique*``, ``bincount``), where the shape is known
beforehand excepted: ``index`` / ``index_put`` only with a boolean index, ``repeat_interleave`` without
``output_size``, ``one_hot`` without ``num_classes``; also ``is_nonzero``, ``allclose``, a copy from a device
to the host, and ``Tensor.tolist()``, which does not reach the dispatcher on a CPU (it is patched while the
counter is active). A sync on a GPU also launches kernels (``nonzero``'s, ``equal``'s): such a call is counted in
both.

A Triton kernel's launch counts as one (``triton::<kernel>``), and under Triton's interpreter nothing inside it does
(the interpreter's copies of its tensors are not the kernel's): on a CPU the Triton path then counts what a GPU
launches.

``device_type="cuda"`` counts only calls that touch a tensor of that device type (on a GPU, the host's own small
tensors then do not count); by default every call counts, as on a CPU, where every call stands for a GPU one.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Metadata-only ops that the schemas and tags do not mark: a view without an alias annotation, allocations
# without a fill, queries and checks.
NO_KERNEL = {"_unsafe_view", "_local_scalar_dense", "size", "stride", "numel", "dim", "storage_offset",
             "is_contiguous", "is_same_size", "is_nonzero", "_assert_tensor_metadata", "_assert_scalar",
             "record_stream", "_nested_tensor_size", "_nested_tensor_strides"}
NO_KERNEL_PREFIXES = ("empty", "new_empty", "sym_", "_empty")
# Syncs by name, beside the tags (the composite ones never reach the mode; listed for any build where they do).
SYNC_NAMES = {"is_nonzero", "allclose", "equal", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
              "unique_consecutive", "unique_dim_consecutive", "bincount"}
# Syncs only for some arguments: {op name: a test of (args, kwargs)}.
BOOL_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"}


def _name(func) -> str:
    return func._schema.name.split("::", 1)[-1]


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _has_bool_index(args, kwargs) -> bool:
    indices = kwargs.get("indices", args[1] if len(args) > 1 else ())
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ())


def _to_host(name: str, args, kwargs, out) -> bool:
    """A copy from a device tensor into host memory (``.cpu()``, ``.to("cpu")``, ``cpu_tensor.copy_(gpu)``)."""
    if name == "_to_copy":
        return args[0].device.type != "cpu" and isinstance(out, torch.Tensor) and out.device.type == "cpu"
    if name == "copy_":
        src = kwargs.get("src", args[1] if len(args) > 1 else None)
        return args[0].device.type == "cpu" and isinstance(src, torch.Tensor) and src.device.type != "cpu"
    return False


class _Kind:
    """What one op overload is, decided once from its schema, tags and name."""

    __slots__ = ("name", "short", "launches", "syncs", "sync_if", "copies")

    def __init__(self, func):
        self.short = name = _name(func)
        self.name = func._schema.name  # "aten::add": the profiler's name of the op
        tags = set(func.tags)
        self.launches = not (_is_view(func) or torch.Tag.inplace_view in tags or name in NO_KERNEL
                             or name.startswith(NO_KERNEL_PREFIXES))
        self.sync_if = None
        if name in BOOL_INDEXED:
            self.sync_if = _has_bool_index
        elif name == "repeat_interleave" and func._overloadname == "Tensor":
            self.sync_if = lambda args, kwargs: kwargs.get("output_size", args[1] if len(args) > 1 else None) is None
        elif name == "one_hot":
            self.sync_if = lambda args, kwargs: kwargs.get("num_classes", args[1] if len(args) > 1 else -1) < 0
        self.syncs = self.sync_if is None and (
            name in SYNC_NAMES or torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags)
        self.copies = name in ("_to_copy", "copy_")  # a sync when it copies to the host (_to_host)


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...``: ``c.launches`` and ``c.syncs`` (Counters by op name), ``c.sync_sites``
    ("file:line" of the code that made each sync, outside torch; ``site_depth`` frames of it, " < " between them),
    ``c.n_launches``, ``c.n_syncs``."""

    def __init__(self, device_type: str | None = None, site_depth: int = 1):
        super().__init__()
        self.device_type, self.site_depth = device_type, site_depth
        self.launches: Counter = Counter()
        self.syncs: Counter = Counter()
        self.sync_sites: list[str] = []
        self._kinds: dict = {}
        self._muted = 0
        self._saved_tolist = None
        self._saved_runs: list = []

    @property
    def n_launches(self) -> int:
        return sum(self.launches.values())

    @property
    def n_syncs(self) -> int:
        return sum(self.syncs.values())

    def snapshot(self) -> tuple[int, int]:
        """(launches, syncs) so far: the difference of two snapshots counts what ran between them."""
        return self.n_launches, self.n_syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._muted:
            return out
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _Kind(func)
        if self.device_type is not None and not self._touches(args, kwargs, out):
            return out
        if kind.launches:
            self.launches[kind.name] += 1
        if (kind.syncs or (kind.sync_if is not None and kind.sync_if(args, kwargs))
                or (kind.copies and _to_host(kind.short, args, kwargs, out))):
            self._sync(kind.name)
        return out

    def _touches(self, args, kwargs, out) -> bool:
        leaves = tree_flatten((args, kwargs, out))[0]
        return any(isinstance(t, torch.Tensor) and t.device.type == self.device_type for t in leaves)

    def _sync(self, name: str) -> None:
        self.syncs[name] += 1
        self.sync_sites.append(call_site(self.site_depth))

    def __enter__(self):
        counter = self
        self._saved_tolist = torch.Tensor.__dict__.get("tolist")
        original = torch.Tensor.tolist
        self._patch_triton()

        def tolist(tensor):
            if not counter._muted and (counter.device_type is None or tensor.device.type == counter.device_type):
                counter._sync("Tensor.tolist")
            counter._muted += 1  # its own copy to the host, on a GPU, is the same sync
            try:
                return original(tensor)
            finally:
                counter._muted -= 1

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._saved_tolist is None:
                del torch.Tensor.tolist
            else:
                torch.Tensor.tolist = self._saved_tolist
            for cls, run in self._saved_runs:
                cls.run = run

    def _patch_triton(self) -> None:
        """Count each Triton kernel launch as one (``triton::<kernel>``). Triton's interpreter (``TRITON_INTERPRET=1``)
        runs a kernel as Python over copies of its tensors: those copies are not the kernel's, so nothing is counted
        inside a launch, which stands for the one launch it makes on a GPU."""
        self._saved_runs = []
        try:
            from triton.runtime.interpreter import InterpretedFunction
            from triton.runtime.jit import JITFunction
        except ImportError:  # no Triton: nothing of it to count
            return
        counter = self
        for cls in (InterpretedFunction, JITFunction):
            run = cls.__dict__["run"]
            self._saved_runs.append((cls, run))

            def counted(kernel, *args, _run=run, **kwargs):
                if not counter._muted and not kwargs.get("warmup", False):
                    counter.launches[f"triton::{getattr(kernel, '__name__', None) or kernel.fn.__name__}"] += 1
                counter._muted += 1
                try:
                    return _run(kernel, *args, **kwargs)
                finally:
                    counter._muted -= 1

            cls.run = counted


_SKIPPED = (os.path.dirname(torch.__file__) + os.sep, os.path.abspath(__file__))


def call_site(depth: int = 1) -> str:
    """"file:line" of the innermost frame outside torch and this module: the code that asked for the value; with
    ``depth`` > 1, that many such frames from there outwards, joined by " < " (a helper's callers)."""
    sites, frame = [], sys._getframe(1)
    while frame is not None and len(sites) < depth:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(_SKIPPED[0]) or path == _SKIPPED[1] or path.startswith("<")):
            sites.append(f"{_short(path)}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(sites) or "?"


def _short(path: str) -> str:
    """An installed package's path from the package (after site-packages), else relative to the working directory
    where it is under it, else as it is."""
    marker = os.sep + "site-packages" + os.sep
    if marker in path:
        return path.split(marker, 1)[1]
    cwd = os.getcwd() + os.sep
    return path[len(cwd):] if path.startswith(cwd) else path
