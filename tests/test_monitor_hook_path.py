"""The Monitor's hook path (issue #36; Note [grad_output per output slot] in csrc/monitor/slots.cpp): a forward
pre-hook (the call's start) only where grad_output is recorded, the records PyTorch's grad_output, and the output objects
kept where a tensor hook is exact."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hookstats
from real_models import SlotTwin, assert_grads_match, monitor_grads


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * 2.0


class MyLinear(nn.Linear):  # a subclass that overrides forward: its forward is its own
    def forward(self, x):
        return super().forward(x) + 1.0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.0)
        self.drop_inplace = nn.Dropout(0.5, inplace=True)
        self.short = nn.Identity()
        self.custom = Custom()
        self.mine = MyLinear(4, 4)

    def forward(self, x):
        h = self.act(self.fc(x))
        y = self.drop(h) + self.short(input=h) * 3.0  # Identity by keyword: its hook does not see the input
        z = self.drop_inplace(self.custom(y) * 1.0)
        return (self.mine(z).sin() + self.short(h)).sum(1)


def test_pre_hooks_only_where_the_start_is_needed():
    model = Net()
    mon = hookstats.Monitor(model, kinds=("forward", "backward_pre"))
    assert all(len(m._forward_pre_hooks) == 1 for m in model.modules())  # the start of every call: grad_output
    mon.detach()
    assert all(len(m._forward_pre_hooks) == 0 for m in model.modules())
    mon = hookstats.Monitor(model, kinds=("forward",))  # no grad_output: no start needed anywhere
    assert all(len(m._forward_pre_hooks) == 0 for m in model.modules())
    mon.detach()


def test_records_are_pytorch_grad_output():
    torch.manual_seed(0)
    model = Net().double()
    twin, plain = copy.deepcopy(model), copy.deepcopy(model)
    xs = [torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    mon = hookstats.Monitor(model, kinds=("forward", "backward_pre"))
    for s, x in enumerate(xs):
        torch.manual_seed(100 + s)  # the same dropout masks in every copy
        model(x).sum().backward()
        mon.step()
    recs = mon.records()
    mon.detach()
    st = SlotTwin(twin)
    for s, x in enumerate(xs):
        torch.manual_seed(100 + s)
        twin(x).sum().backward()
        torch.manual_seed(100 + s)
        plain(x).sum().backward()
    assert_grads_match(monitor_grads(recs), st.grads)
    assert {k for k in monitor_grads(recs) if k[0] == "short"} == {("short", 0)}
    assert len(monitor_grads(recs)[("short", 0)]) == 4  # two calls a step (by keyword and positional), two steps
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        # h has four consumers, three through aliases: their sum may round in another grouping (Note [grad_output
        # by tensor hooks]), as it did before with a pre-hook; nothing more
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-13, atol=0, msg=n)


def test_known_modules_keep_their_output_object():
    # A Linear's and a ReLU's outputs are exact (made by the call, nothing after them): tensor hooks, the output
    # objects unchanged.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    mon = hookstats.Monitor(model, kinds=("backward_pre",))
    seen = []
    for m in model:
        m.register_forward_hook(lambda mod, a, o: seen.append(o))
    y = model(torch.randn(2, 4))
    assert y is seen[1] and seen[0].grad_fn.name().startswith("Addmm") and y.grad_fn.name().startswith("Relu")
    y.sum().backward()
    assert {(r["module"], r["index"]) for r in mon.records()} == {("", 0), ("0", 0), ("1", 0)}
    mon.detach()
