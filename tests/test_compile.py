"""hookstats under torch.compile (issue #7, part 3): a model compiled with a Monitor attached records what the same
model records eagerly, without recompiling from one step to the next; the hook objects clip the same way compiled
as eager; the private op that traced Monitor hooks call passes opcheck (the public ops' opchecks are in
test_stats.py, test_histogram.py and test_clip.py).

How a traced Monitor hook records: Note [monitor under torch.compile] in hookstats/monitor/compile.py. Where PyTorch
traces which hook:
  forward_pre, forward   traced into the forward graph (fullgraph=True works)
  backward_pre, backward traced into the backward graph by compiled autograd (forward and backward run under
                         torch._dynamo.compiled_autograd._enable); without it dynamo refuses module backward hooks:
                         a graph break at every module that has them (the hooks then run eagerly, and record the
                         same)
  grad                   run by the autograd engine after AccumulateGrad (eagerly, no graph break), or traced by
                         compiled autograd

PyTorch does not guard compiled code on module hooks (torch._dynamo.config.skip_nnmodule_hook_guards): a Monitor is
attached before compiling, and every test starts from torch._dynamo.reset(). Records are compared by (step, module,
kind, index) with exact counts and histograms and float statistics within 1e-5 (sum and mean: 1e-5 of l1; the
compiled graphs can round differently); their order must match, except that of "grad" records, which follows the
order in which the autograd engine (or the compiled backward) accumulates gradients.
"""
from __future__ import annotations

import os

import contextlib
import math

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import hookstats

ALL_KINDS = ("forward_pre", "forward", "backward_pre", "backward", "grad")
FWD_KINDS = ("forward_pre", "forward")
COUNT_FIELDS = ("numel", "nan_count", "inf_count", "zero_count")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # compiled code is not guarded on hooks: never reuse another test's
    counters.clear()
    yield
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------------
# Models, the training loop, the comparison
# ---------------------------------------------------------------------------------------------------------------

class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 12)
        self.b = nn.Linear(12, 12)

    def forward(self, h):
        return self.a(h), None, torch.sigmoid(self.b(h))  # a tuple with a None: indices 0 and 2


class TupleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 12)
        self.heads = Heads()
        self.out = nn.Linear(12, 3)

    def forward(self, x):
        a, _, b = self.heads(torch.tanh(self.inp(x)))
        return self.out(a * b), a.sum(dim=1)


class Loopy(nn.Module):
    """A graph break inside a loop: dynamo skips forward and runs each layer's call (and its hooks) eagerly."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
            torch._dynamo.graph_break()
        return x


def make_mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), (5, 8)


def make_cnn():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(6 * 4 * 4, 5)), (2, 3, 6, 6)


def make_tuple():
    return TupleNet(), (5, 8)


def make_loopy():
    return Loopy(), (4, 8)


MODELS = {"mlp": make_mlp, "cnn": make_cnn, "tuple": make_tuple, "loopy": make_loopy}


def outputs(out) -> list:
    return list(out) if isinstance(out, tuple) else [out]


def train(model_name: str, kinds=ALL_KINDS, histogram=None, *, backend=None, compiled_autograd=False,
          fullgraph=False, steps=3, micro=1, every=1, no_recompiles=True):
    """(records, graphs compiled so far after each step) of `steps` training steps (forward, backward, grads
    dropped; no optimizer) of `micro` micro-batches each, eager (backend None) or compiled with `backend`; with
    compiled_autograd, forward and backward run under compiled autograd (its backward graph compiled with `backend`
    too)."""
    torch.manual_seed(0)
    model, shape = MODELS[model_name]()
    mon = hookstats.Monitor(model, kinds=kinds, histogram=histogram, every=every)
    fwd = model if backend is None else torch.compile(model, backend=backend, fullgraph=fullgraph)
    g = torch.Generator().manual_seed(1)
    per_step: list[int] = []
    with contextlib.ExitStack() as stack:
        if backend is not None:
            stack.enter_context(torch._dynamo.config.patch(error_on_recompile=no_recompiles))
        if compiled_autograd:  # forward and backward inside: dynamo traces module backward hooks only then
            stack.enter_context(torch._dynamo.compiled_autograd._enable(torch.compile(backend=backend)))
        for _ in range(steps):
            for _ in range(micro):
                x = torch.randn(shape, generator=g).requires_grad_()
                loss = sum(o.square().sum() for o in outputs(fwd(x)))
                loss.backward()
            model.zero_grad(set_to_none=True)
            mon.step()
            per_step.append(graphs())
    return mon.records(), per_step


def key(r) -> tuple:
    return r["step"], r["module"], r["kind"], r["index"]


def assert_same_records(got: list, want: list) -> None:
    assert want, "the eager run recorded nothing"
    # Forward records come in hook order either way. Backward ones in the order autograd computes the gradients,
    # which compiled autograd may change: grad records (post-accumulate hooks run after the compiled backward) and
    # grad_output records of a module with several outputs (each output's tensor hook runs when its gradient is
    # ready; Note [grad_output by tensor hooks]) are compared as sets.
    fwd = ("forward", "forward_pre")
    assert [key(r) for r in got if r["kind"] in fwd] == [key(r) for r in want if r["kind"] in fwd]
    assert sorted(map(key, got)) == sorted(map(key, want))
    for a, b in zip(sorted(got, key=key), sorted(want, key=key)):
        assert a["dtype"] == b["dtype"], key(a)
        assert a["histogram"] == b["histogram"], key(a)
        for f, v in a["stats"].items():
            w = b["stats"][f]
            if f in COUNT_FIELDS:
                assert v == w, (key(a), f, v, w)
            else:  # sum and mean can cancel to ~0: their tolerance scales with l1
                tol = 1e-6 + 1e-5 * {"sum": b["stats"]["l1"], "mean": b["stats"]["l1"] / max(b["stats"]["numel"], 1)
                                     }.get(f, 0.0)
                assert (math.isnan(v) and math.isnan(w)) or math.isclose(v, w, rel_tol=1e-5, abs_tol=tol), \
                    (key(a), f, v, w)


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def graph_breaks() -> list[str]:
    return list(counters["graph_break"])


# ---------------------------------------------------------------------------------------------------------------
# Monitor: compiled records == eager records
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model,histogram", [("mlp", None), ("cnn", "exp"), ("tuple", (8, (-2.0, 2.0)))])
def test_forward_kinds_fullgraph(model, histogram):
    want, _ = train(model, FWD_KINDS, histogram, steps=5)
    got, _ = train(model, FWD_KINDS, histogram, backend="aot_eager", fullgraph=True, steps=5)
    assert_same_records(got, want)
    assert graphs() == 1, "one graph, compiled once: no recompile over 5 steps"
    assert graph_breaks() == []


@pytest.mark.parametrize("model,histogram", [("mlp", None), ("mlp", (8, (-2.0, 2.0))), ("cnn", "exp"),
                                             ("tuple", None)])
def test_all_kinds_with_compiled_autograd(model, histogram):
    want, _ = train(model, ALL_KINDS, histogram)
    got, _ = train(model, ALL_KINDS, histogram, backend="aot_eager", compiled_autograd=True, fullgraph=True)
    assert_same_records(got, want)
    assert graphs() == 2, "the forward graph and the compiled autograd graph, each compiled once"
    assert graph_breaks() == []


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_hooks_make_no_python_call(backend):
    """A traced hook is a call of the C++ op hookstats::_monitor_record: running the compiled graph calls no Python
    function of hookstats (it used to call back into a Python custom op for every hook)."""
    import sys

    torch.manual_seed(0)
    model, shape = MODELS["mlp"]()
    mon = hookstats.Monitor(model, kinds=FWD_KINDS)
    fwd = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(shape)
    for _ in range(2):
        fwd(x)
        mon.step()
    pkg = os.path.dirname(hookstats.__file__)
    calls = []

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(pkg):
            calls.append(frame.f_code.co_name)

    n_before = len(mon.records())
    sys.setprofile(prof)
    try:
        fwd(x)
    finally:
        sys.setprofile(None)
    mon.step()
    assert calls == []
    assert len(mon.records()) - n_before == 2 * len(list(model.modules()))  # forward_pre + forward of each module
    assert torch.Tag.cudagraph_unsafe in torch.ops.hookstats._monitor_record.default.tags


def test_backward_kinds_without_compiled_autograd_break_the_graph_but_record_the_same():
    # PyTorch's limitation: module backward hooks need compiled autograd. Dynamo breaks the graph at each module
    # that has them and runs them eagerly; "grad" hooks (post-accumulate) never enter the forward graph.
    got, per_step = train("mlp", ALL_KINDS, backend="aot_eager", no_recompiles=False, steps=4)
    want, _ = train("mlp", ALL_KINDS, steps=4)
    assert_same_records(got, want)
    assert per_step[0] == per_step[-1], "graphs compiled after the first step"
    assert any("backward" in b.lower() and "compiled autograd" in b.lower() for b in graph_breaks()), graph_breaks()

    torch._dynamo.reset()
    counters.clear()
    want, _ = train("mlp", FWD_KINDS + ("grad",))
    got, _ = train("mlp", FWD_KINDS + ("grad",), backend="aot_eager", fullgraph=True)
    assert_same_records(got, want)
    assert graph_breaks() == []


def test_hooks_run_eagerly_after_a_graph_break_are_not_compiled():
    # Loopy's forward is skipped by dynamo: each layer call, and the Monitor hooks it runs, are eager frames. Those
    # hooks must record eagerly, not be compiled once per hook (error_on_recompile would raise).
    want, _ = train("loopy", FWD_KINDS)
    got, _ = train("loopy", FWD_KINDS, backend="aot_eager")
    assert_same_records(got, want)
    assert any("graph break in loop" in u for u in counters["unimplemented"]), "Loopy.forward was not skipped"
    compiled = [c() for c in torch._dynamo.convert_frame.input_codes.seen]
    monitor_dir = os.path.dirname(hookstats.monitor.__file__)
    assert not [c for c in compiled if c is not None and os.path.dirname(c.co_filename) == monitor_dir]


def test_gradient_accumulation_does_not_recompile():
    # Several forward / backward calls per step: a hook that appended to a Python list would recompile on its length.
    want, _ = train("mlp", ALL_KINDS, micro=3)
    got, per_step = train("mlp", ALL_KINDS, backend="aot_eager", compiled_autograd=True, micro=3)
    assert_same_records(got, want)
    # Step 0 compiles the forward and two backward graphs (the first micro-batch's creates the grads, the next ones
    # accumulate into them); the next steps reuse them.
    assert per_step == [3, 3, 3]
    assert {r["step"] for r in got} == {0, 1, 2} and len(got) == len(want)


def test_every_is_read_when_the_graph_runs():
    want, _ = train("mlp", ALL_KINDS, every=2, steps=5)
    got, _ = train("mlp", ALL_KINDS, backend="aot_eager", compiled_autograd=True, every=2, steps=5)
    assert_same_records(got, want)
    assert {r["step"] for r in got} == {0, 2, 4}
    assert graphs() == 2, "skipped steps run the same graphs"


def test_inductor_all_kinds():
    want, _ = train("mlp", ALL_KINDS, "exp")
    got, _ = train("mlp", ALL_KINDS, "exp", backend="inductor", compiled_autograd=True, fullgraph=True)
    assert_same_records(got, want)
    assert graphs() == 2
    assert graph_breaks() == []


def test_detach_and_a_second_monitor_under_compile():
    torch.manual_seed(0)
    model, shape = make_mlp()
    mon = hookstats.Monitor(model, kinds=FWD_KINDS)
    cm = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(shape)
    cm(x)
    mon.step()
    cm(x)
    assert {r["step"] for r in mon.records()} == {0, 1}
    n = len(mon.records())
    mon.detach()
    cm(x)  # the compiled graph still calls the detached monitor's hooks: they record nothing
    assert len(mon.records()) == n
    other = hookstats.Monitor(model, kinds="forward")
    torch._dynamo.reset()  # hooks are not guarded on: recompile to trace the new monitor's hooks
    cm(x)
    assert len(other.records()) == 4 and len(mon.records()) == n


def _record_hook_run(backend, histogram):
    """records of a standalone hookstats.record on the tuple model's heads (forward_pre, and forward: a tuple output
    with a None), 4 steps."""
    torch.manual_seed(0)
    model, shape = make_tuple()
    r = hookstats.record("heads", histogram=histogram)
    model.heads.register_forward_pre_hook(r.forward_pre)
    model.heads.register_forward_hook(r.forward)
    fwd = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(shape, generator=g).requires_grad_()
        sum(o.square().sum() for o in outputs(fwd(x))).backward()
        r.step += 1
    return r.records()


@pytest.mark.parametrize("histogram", [None, "exp"])
def test_standalone_record_compiles_without_recompiles(histogram):
    """The record hook object, like Monitor, reads no step or counter in traced code: one graph for every step."""
    want = _record_hook_run(None, histogram)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _record_hook_run("aot_eager", histogram)
    assert graphs() == 1 and not graph_breaks()
    for r in got + want:  # assert_same_records keys on module: the record's name
        r.setdefault("module", "heads")
    assert_same_records(got, want)
    assert {r["kind"] for r in got} == {"forward_pre", "forward"} and max(r["step"] for r in got) == 3


def test_record_op_opcheck():
    torch.manual_seed(0)
    model, shape = make_mlp()
    mon = hookstats.Monitor(model, kinds="forward")
    xs = [torch.randn(5, 3), None, torch.arange(4), torch.randn(7, dtype=torch.float64).bfloat16()]
    torch.library.opcheck(torch.ops.hookstats._monitor_record.default, (xs, mon._rec.id, 0),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    recs = mon.records()
    assert recs and {(r["module"], r["kind"], r["index"]) for r in recs} == {("", "forward", 0), ("", "forward", 3)}
    assert mon.skipped > 0  # the int64 tensor, as an eager hook would


# ---------------------------------------------------------------------------------------------------------------
# Hook objects under torch.compile
# ---------------------------------------------------------------------------------------------------------------

CLIPS = {"fused_clip": lambda: hookstats.fused_clip(0.5), "clip_value": lambda: hookstats.clip_value(0.05)}


def clip_run(clip_name: str, form: str, backend=None):
    torch.manual_seed(0)
    model, shape = make_mlp()
    clip = CLIPS[clip_name]()
    if form == "forward_pre":
        model[2].register_forward_pre_hook(clip.forward_pre)
    elif form == "forward":
        model[0].register_forward_hook(clip.forward)
    elif form == "tensor":
        model[0].weight.register_hook(clip.tensor)
    elif form == "post_accumulate":
        model[0].weight.register_post_accumulate_grad_hook(clip.post_accumulate)
    fwd = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    got = []
    for _ in range(3):
        y = fwd(torch.randn(shape, generator=g) * 3)
        y.square().sum().backward()
        got.append([y.detach().clone()] + [p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    last = clip.last_norm if clip_name == "fused_clip" else clip.last_count
    return got, last


@pytest.mark.parametrize("form", ["forward_pre", "forward", "tensor", "post_accumulate"])
@pytest.mark.parametrize("clip_name", list(CLIPS))
def test_clip_hooks_compiled_match_eager(clip_name, form):
    want, want_last = clip_run(clip_name, form)
    got, got_last = clip_run(clip_name, form, backend="aot_eager")
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_last, want_last, rtol=1e-5, atol=0)
    if clip_name == "fused_clip":
        assert float(want_last) > 0.5, "the hook clipped something"
    else:
        assert int(want_last) > 0, "the hook clipped something"
    assert graph_breaks() == []
