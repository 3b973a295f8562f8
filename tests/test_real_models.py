"""The Monitor on real models built from their own libraries with random weights (issue #23, section 3: the records
half; tests/real_models.py builds them and the twins).

For each model: gradients bitwise equal with and without a Monitor (float32); every backward_pre record equal to
PyTorch's register_full_backward_pre_hook on a twin, where PyTorch gives one, and to the gradient through its slot
(SlotTwin) everywhere (float64); forward records equal to plain forward hooks; compiled (aot_eager) records equal to
eager ones (Mixtral by default; the rest of the compiled matrix is marked slow: `make test` runs it).
"""
from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch

import hookstats
from real_models import (BUILDERS, OutOfPlace, PreHookTwin, SlotTwin, _count, assert_grads_match, build,
                         monitor_grads, twin)

pytest.importorskip("transformers")
pytest.importorskip("timm")

MODELS = list(BUILDERS)
STEPS = 2


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _steps(rm, model, steps=STEPS, mon=None):
    for s in range(steps):
        rm.step_loss(model, s).backward()
        if mon is not None:
            mon.step()


@pytest.mark.parametrize("name", MODELS)
def test_gradients_bitwise_equal_with_and_without_the_monitor(name):
    rm = build(name)
    ref = twin(rm)
    mon = hookstats.Monitor(rm.model, kinds=("forward", "backward_pre", "grad"))
    _steps(rm, rm.model, mon=mon)
    assert mon.records()
    mon.detach()
    _steps(ref, ref.model)
    for (n, p), (_, q) in zip(rm.model.named_parameters(), ref.model.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            assert torch.equal(p.grad.view(torch.int32), q.grad.view(torch.int32)), n


def _forward_stats(model) -> tuple[dict, list]:
    """Plain forward hooks on every module: {(module, index): [float64 output, ...]} of the floating outputs."""
    got: dict = {}
    handles = []
    for name, mod in model.named_modules():
        def hook(m, args, out, name=name):
            flat: list = []
            _count(out, flat)
            for i, t in enumerate(flat):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    got.setdefault((name, i), []).append(t.detach().double().clone())
        handles.append(mod.register_forward_hook(hook))
    return got, handles


@pytest.mark.parametrize("name", MODELS)
def test_records_equal_pytorch_hooks_on_twins(name):
    rm = build(name, torch.float64)
    pre_twin, slot_twin, fwd_twin = twin(rm), twin(rm), twin(rm)
    mon = hookstats.Monitor(rm.model, kinds=("forward", "backward_pre"))
    _steps(rm, rm.model, mon=mon)
    recs = mon.records()
    assert mon.unrecorded_grad_outputs == 0
    mon.detach()

    pre = PreHookTwin(pre_twin.model)
    slots = SlotTwin(slot_twin.model)
    with warnings.catch_warnings(), OutOfPlace():  # PyTorch warns at each module that returns a dict
        warnings.simplefilter("ignore")
        _steps(pre_twin, pre_twin.model)
        _steps(slot_twin, slot_twin.model)
    got = monitor_grads(recs)
    assert pre.grads, "PyTorch's pre-hook recorded nothing"
    assert_grads_match(got, pre.grads, subset=True)  # where PyTorch gives a grad_output: the same
    assert_grads_match(got, slots.grads)  # and every slot: the gradient through it

    fwd, handles = _forward_stats(fwd_twin.model)
    _steps(fwd_twin, fwd_twin.model)
    for h in handles:
        h.remove()
    got_fwd: dict = {}
    for r in recs:
        if r["kind"] == "forward":
            got_fwd.setdefault((r["module"], r["index"]), []).append(dict(r["stats"], dtype=r["dtype"]))
    assert set(got_fwd) == set(fwd)
    for k, ts in fwd.items():
        for s, t in zip(got_fwd[k], ts):
            assert s["numel"] == t.numel(), k
            rel = 1e-12 if s["dtype"] == "torch.float64" else 1e-6  # the result dtype is the input's (float32)
            assert math.isclose(s["l2"], float(t.norm()), rel_tol=rel, abs_tol=1e-300), k
            assert (s["min"], s["max"]) == (float(t.min()), float(t.max())), k


def _records(rm, compiled: bool) -> list:
    torch._dynamo.reset()
    mon = hookstats.Monitor(rm.model, kinds=("forward", "backward_pre"))
    model = torch.compile(rm.model, backend="aot_eager") if compiled else rm.model
    _steps(rm, model, mon=mon)
    recs = mon.records()
    mon.detach()
    torch._dynamo.reset()
    return recs


def _key(r) -> tuple:
    return r["step"], r["module"], r["kind"], r["index"]


# Compiling a model takes ~30 s here (dynamo and AOTAutograd on the HF code, with or without a Monitor): Mixtral
# (the MoE, the case of issue #23: its `model` site and the root called with labels=) runs by default, the others
# are marked slow (`make test` runs them, `make test-fast` not). One layer each.
FAST_COMPILE = ("mixtral",)
# Known differences of the traced path (its view_as aliases; Note [grad_output by tensor hooks]): never a wrong
# value, but not eager's sites.
COMPILE_XFAIL = {
    "resnet18": "under torch.compile an output modified in place after the module (ReLU(inplace=True), "
                "x += shortcut) loses its backward_pre record: the in-place op rebases the traced view_as alias",
    "t5": "under torch.compile a returned slot that nothing uses (the last layer's position_bias) is recorded "
          "with a zero gradient (AOTAutograd materialises it) where eager records nothing",
}


def _compile_param(n: str):
    marks = [] if n in FAST_COMPILE else [pytest.mark.slow]
    if n in COMPILE_XFAIL:
        marks.append(pytest.mark.xfail(strict=True, reason=COMPILE_XFAIL[n]))
    return pytest.param(n, marks=marks)


@pytest.mark.parametrize("name", [_compile_param(n) for n in MODELS])
def test_compiled_records_equal_eager(name):
    rm = build(name, torch.float64, layers=1)
    comp = twin(rm)
    want = _records(rm, compiled=False)
    got = _records(comp, compiled=True)
    assert sorted(map(_key, got)) == sorted(map(_key, want))
    roots = {r["index"] for r in want if r["module"] == "" and r["kind"] == "backward_pre"}
    assert roots, "no backward_pre record of the model's own outputs"
    by_key: dict = {}
    for r in want:
        by_key.setdefault(_key(r), []).append(r["stats"])
    for r in got:
        w = by_key[_key(r)].pop(0)
        for f in ("l2", "min", "max"):
            assert math.isclose(r["stats"][f], w[f], rel_tol=1e-9, abs_tol=1e-12), (_key(r), f, r["stats"][f], w[f])
