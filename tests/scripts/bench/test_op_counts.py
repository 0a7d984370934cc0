"""scripts/bench/op_counts.py: the aten calls that would launch a device kernel and the host syncs of a piece of
code, counted on a CPU (what gpu_measure.py's dry run reports in place of the profiler's CUDA counts)."""

from __future__ import annotations

import torch
from conftest import load_script

op_counts = load_script("bench/op_counts")
OpCounter = op_counts.OpCounter


def counted(fn):
    with OpCounter() as c:
        fn()
    return c


def test_a_pointwise_op_launches_one_kernel_and_syncs_nothing():
    x = torch.randn(4, 5)
    c = counted(lambda: x + 1)
    assert c.launches == {"aten::add": 1} and c.n_launches == 1
    assert c.n_syncs == 0 and c.sync_sites == []


def test_views_allocations_and_metadata_launch_nothing():
    x = torch.randn(4, 6)

    def metadata():
        x.view(-1), x.reshape(2, 12), x.t(), x.transpose(0, 1), x.permute(1, 0), x.unsqueeze(0).squeeze(0)
        x[0], x[1:3], x.narrow(0, 0, 2), x.expand(2, 4, 6), x.as_strided((2,), (1,)), x.detach()
        x.split(2), x.chunk(3), x.unbind(0), x.size(), x.stride()
        torch.empty(3), torch.empty_like(x), x.new_empty(2), torch.empty_strided((2, 2), (2, 1))
        y = torch.randn(3, 2)
        y.t_(), y.unsqueeze_(0)

    c = counted(metadata)
    assert c.launches == {"aten::randn": 1} and c.n_syncs == 0  # the one op that fills memory


def test_a_reshape_that_copies_launches_the_copy():
    x = torch.randn(4, 6)
    assert counted(lambda: x.t().reshape(-1)).launches == {"aten::clone": 1}


def test_a_value_read_on_the_host_is_a_sync_with_its_site():
    x = torch.randn(4, 5)
    c = counted(lambda: x.sum().item())
    assert c.launches == {"aten::sum": 1}
    assert c.syncs == {"aten::_local_scalar_dense": 1} and c.n_syncs == 1
    assert len(c.sync_sites) == 1 and "test_op_counts.py:" in c.sync_sites[0]  # this file, not torch's
    c = counted(lambda: (bool(x[0, 0] > 0), int(x[0, 0]), float(x.max())))
    assert c.syncs == {"aten::_local_scalar_dense": 3}


def test_boolean_mask_indexing_and_shape_from_data_ops_are_syncs():
    x = torch.randn(4, 5)
    c = counted(lambda: x[x > 0])
    assert c.syncs == {"aten::index": 1} and c.launches == {"aten::gt": 1, "aten::index": 1}
    assert counted(lambda: x[torch.tensor([0, 2])]).n_syncs == 0  # integer indices: the shape is known

    def setitem():
        y = x.clone()
        y[y > 0] = 0

    assert counted(setitem).syncs == {"aten::index_put_": 1}
    for fn, op in ((lambda: x.nonzero(), "aten::nonzero"), (lambda: torch.equal(x, x), "aten::equal"),
                   (lambda: torch.unique(x), "aten::_unique2"), (lambda: x.masked_select(x > 0), "aten::masked_select"),
                   (lambda: torch.repeat_interleave(torch.tensor([1, 2])), "aten::repeat_interleave")):
        assert counted(fn).syncs == {op: 1}, op
    assert counted(lambda: torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)).n_syncs == 0


def test_tolist_is_a_sync_and_is_restored_afterwards():
    x = torch.randn(3)
    c = counted(lambda: x.tolist())
    assert c.syncs == {"Tensor.tolist": 1} and c.n_launches == 0
    assert "tolist" not in torch.Tensor.__dict__ and x.tolist() == [float(v) for v in x]


def test_the_backward_and_an_optimizer_step_are_counted():
    w = torch.randn(5, 3, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    x = torch.randn(4, 5)

    def step():
        (x @ w).square().sum().backward()
        opt.step()

    c = counted(step)
    assert c.launches["aten::mm"] == 2  # the forward's and the one for w's gradient
    assert c.n_launches > 4 and c.n_syncs == 0


def test_a_device_filter_counts_only_that_device():
    x = torch.randn(3)
    with OpCounter(device_type="cuda") as c:
        x + 1, x.sum().item(), x.tolist()
    assert c.n_launches == 0 and c.n_syncs == 0


def test_snapshots_and_site_depth():
    x = torch.randn(3)

    def helper():
        return x.sum().item()

    with OpCounter(site_depth=2) as c:
        before = c.snapshot()
        helper()
        assert c.snapshot() == (before[0] + 1, before[1] + 1)
    inner, outer = c.sync_sites[0].split(" < ")
    assert inner.endswith(f"test_op_counts.py:{helper.__code__.co_firstlineno + 1}") and "test_op_counts.py:" in outer


def test_a_triton_kernel_is_one_launch_whatever_the_interpreter_does_inside(monkeypatch):
    """Under TRITON_INTERPRET=1 a kernel runs as Python over copies of its tensors: the counter counts the launch once,
    by the kernel's name, and none of the copies; the run methods are restored afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from triton.runtime.interpreter import InterpretedFunction

    from hf_resolvent import ops

    run = InterpretedFunction.__dict__["run"]
    gen = torch.Generator().manual_seed(0)
    qa, ka, x = (torch.randn(1, 2, 16, 16, generator=gen) for _ in range(3))
    with OpCounter() as counter:
        ops.resolvent_mix(qa, ka, None, None, x, None, "attention", impl="triton")
    assert counter.launches["triton::attn_fwd_kernel"] == 1
    assert counter.launches["aten::copy_"] == 0, counter.launches  # the interpreter copies every tensor argument
    assert InterpretedFunction.__dict__["run"] is run
