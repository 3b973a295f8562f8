"""hookstats.detect_nonfinite: the first ATen op whose output held a NaN or an Inf, forward, backward or optimizer,
cheap enough to leave on.

A guard installs one C++ at::RecordFunction observer (csrc/anomaly/observer.cpp, Note [nonfinite observer]) that
reads every floating output of every op on its device into a small device-side state (Note [nonfinite guard state]
in csrc/anomaly/nonfinite_ops.h): no host sync, no Python per op. Only the model's module hooks run Python (once
per module call, to name the module an op ran in). `first()` reads the states once.
"""
from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch

from ._kernels import extension
from ._owned_hooks import register
from ._types import unravel

# The slots of a device state: csrc/anomaly/nonfinite_ops.h (enum Slot), which _nf_counters() reports the size of.
_FOUND, _STEP, _HIT_STEP, _PHASE, _OP, _MODULE, _NODE, _SEQ, _OUTPUT, _NAN, _INF, _FIRST, _NUMEL, _DTYPE, _NDIM, \
    _DATA_PTR, _INPUTS, _BAD_INPUTS, _SHAPE = range(19)
_MAX_SHAPE_DIMS = 8
_NUM_SLOTS = _SHAPE + _MAX_SHAPE_DIMS
_NO_INDEX = 2**63 - 1
PHASES = {1: "forward", 2: "backward", 3: "optimizer"}
_DTYPES = {5: torch.float16, 6: torch.float32, 7: torch.float64, 15: torch.bfloat16}  # c10::ScalarType codes

_ACTIVE: list = []  # the guard that holds the process's observer (one at a time)


class NonfiniteOp(dict):
    """The first op output that held a NaN or an Inf: a dict (step, phase, op, module, node, nan, inf, shape, dtype,
    index, flat_index, seq, output, order, device, param, inputs_finite, nonfinite_inputs) that prints as one
    line."""

    def __str__(self) -> str:
        module = self.get("module")
        where = "" if module is None else f" in {module or '<model>'}"
        node = f" (autograd node {self['node']})" if self.get("node") else ""
        param = f" ({self['param']})" if self.get("param") else ""
        counts = ", ".join(f"{self[k]} {k}" for k in ("nan", "inf") if self[k])
        at = self["index"] if self["index"] is not None else self["flat_index"]
        ins = {True: "its inputs were finite", False: f"its input(s) {self['nonfinite_inputs']} already were not",
               None: "its inputs were not checked"}[self["inputs_finite"]]
        return (f"step {self['step']}, {self['phase']}: {self['op']}{where}{node}{param} made {counts} in a "
                f"{list(self['shape'])} {str(self['dtype']).replace('torch.', '')} output (#{self['output']}), first "
                f"at {tuple(at) if isinstance(at, (list, tuple)) else at}; {ins}")


class NonfiniteGuard:
    """A context manager that checks every floating output of every ATen op run while it is active (forward,
    backward on any thread, optimizer; CPU and CUDA; float32/64, float16, bfloat16) for NaN and Inf, on the
    output's device, and keeps the first one. Made by `hookstats.detect_nonfinite(model, every=N)`.

    `step()` ends a training step (numbers the steps on the devices; no sync); with every=N only steps 0, N, 2N, ...
    are checked and nothing runs per op in between. `first()` reads the devices' states once and returns the first
    non-finite op output as a `NonfiniteOp` (None when all were finite). `checked` / `unchecked` count the outputs
    read and those that could not be (a CUDA tensor on a build without CUDA kernels, a new device met during a CUDA
    graph capture)."""

    def __init__(self, model: Optional[torch.nn.Module] = None, *, every: int = 1, ignore_ops: Sequence[str] = (),
                 start_step: int = 0):
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"hookstats.detect_nonfinite takes a torch.nn.Module (or None), got {type(model).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"hookstats.detect_nonfinite: every must be an int >= 1, got {every!r}")
        if isinstance(ignore_ops, str) or not all(isinstance(o, str) and "::" in o for o in ignore_ops):
            raise TypeError("hookstats.detect_nonfinite: ignore_ops takes a list of op names such as "
                            f"['aten::masked_fill'], got {ignore_ops!r}")
        self.model = model
        self.every = every
        self.ignore_ops = list(ignore_ops)
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"hookstats.detect_nonfinite: start_step must be an int >= 0, got {start_step!r}")
        self.start_step = start_step
        self._step = 0
        self._handles: list = []
        self._modules: list = []
        self._states: list = []
        self._names: list = []
        self._tls = threading.local()
        self._on = False
        self._active = False

    # -- lifetime ---------------------------------------------------------------------------------------------------
    def __enter__(self) -> "NonfiniteGuard":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "NonfiniteGuard":
        """Installs the observer (and the module hooks); refused while another guard is active."""
        extension("hookstats.detect_nonfinite")  # a clear error where hookstats._C could not be loaded
        if self._active:
            raise RuntimeError("hookstats.detect_nonfinite: this guard is already active")
        if _ACTIVE:
            raise RuntimeError("hookstats.detect_nonfinite: another guard is active in this process (one observer "
                               "sees every op of the process); exit it first")
        self._step = self.start_step
        cpu = self._new_state(torch.device("cpu"), self._step)
        cuda = [self._new_state(torch.device("cuda", d), self._step) for d in self._cuda_devices()]
        torch.ops.hookstats._nf_start(cpu, cuda, self.ignore_ops)
        _ACTIVE.append(self)
        self._active = self._on = True
        try:
            self._set_on(self._step % self.every == 0, force=True)
        except BaseException:
            self.stop()
            raise
        return self

    def _set_on(self, on: bool, force: bool = False) -> None:
        """The observer runs on checked steps only. The module hooks stay (adding and removing them would make
        torch.compile recompile a compiled model at every switch); between checked steps they return at once."""
        if force and self.model is not None and not self._handles:
            self._hook(self.model)
        if on == self._on and not force:
            return
        torch.ops.hookstats._nf_enable(on)
        self._on = on
        self._tls.stack = []

    def stop(self) -> None:
        """Removes the observer and the hooks; first() still reads what was found."""
        if not self._active:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        self._states = list(torch.ops.hookstats._nf_states())
        self._names = list(torch.ops.hookstats._nf_names())
        self._counters = list(torch.ops.hookstats._nf_counters())
        torch.ops.hookstats._nf_stop()
        _ACTIVE.remove(self)
        self._active = self._on = False

    @staticmethod
    def _new_state(device: torch.device, step: int) -> torch.Tensor:
        s = torch.zeros(_NUM_SLOTS, dtype=torch.int64, device=device)
        s[_FIRST] = _NO_INDEX
        s[_STEP] = step
        return s

    @staticmethod
    def _cuda_devices() -> list:
        # States for the devices CUDA has started on; a device first used later gets one from the observer.
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return []
        return list(range(torch.cuda.device_count()))

    def _hook(self, model: torch.nn.Module) -> None:
        set_module = torch.ops.hookstats._nf_set_module.default
        tls = self._tls

        def pre(mid):
            def hook(module, args):
                if torch.compiler.is_compiling() or not self._on:
                    return
                stack = getattr(tls, "stack", None)
                if stack is None:
                    stack = tls.stack = []
                stack.append(mid)
                set_module(mid)
            return hook

        def post(mid):
            def hook(module, args, output):
                if torch.compiler.is_compiling() or not self._on:
                    return
                stack = getattr(tls, "stack", None)
                if stack and stack[-1] == mid:
                    stack.pop()
                    set_module(stack[-1] if stack else -1)
            return hook

        self._modules = []
        for name, mod in model.named_modules():
            mid = len(self._modules)
            self._modules.append(name)
            # owned: saving or copying the model while a guard is on leaves them out (Note [hooks that stay with
            # their owner])
            self._handles.append(register(mod, "register_forward_pre_hook", pre(mid)))
            self._handles.append(register(mod, "register_forward_hook", post(mid), always_call=True))

    # -- steps ------------------------------------------------------------------------------------------------------
    def step(self) -> None:
        """Ends a step: the devices' step counters move on (a one-thread kernel on CUDA, no sync); with every=N the
        observer runs only on steps that are multiples of N."""
        if not self._active:
            raise RuntimeError("hookstats.detect_nonfinite: step() outside the guard (use it inside `with guard:`)")
        self._step += 1
        torch.ops.hookstats._nf_step()
        on = self._step % self.every == 0
        self._set_on(on)

    @property
    def current_step(self) -> int:
        """The step ops are recorded under now (the step() calls so far)."""
        return self._step

    @property
    def checked(self) -> int:
        """Op outputs read so far."""
        return self._counter(0)

    @property
    def unchecked(self) -> int:
        """Floating CUDA op outputs that could not be read (no CUDA kernels in this build, or a device first met
        inside a CUDA graph capture)."""
        return self._counter(1)

    def _counter(self, i: int) -> int:
        if self._active:
            return int(torch.ops.hookstats._nf_counters()[i])
        return int(getattr(self, "_counters", [0, 0])[i])

    # -- reading ----------------------------------------------------------------------------------------------------
    def first(self) -> Optional[NonfiniteOp]:
        """The first op output (in the order the ops ran) that held a NaN or an Inf, or None: one host read of each
        device's state (a sync on CUDA)."""
        states = list(torch.ops.hookstats._nf_states()) if self._active else self._states
        names = list(torch.ops.hookstats._nf_names()) if self._active else self._names
        best = None
        for s in states:
            row = s.tolist()
            if row[_FOUND] > 0 and (best is None or row[_FOUND] < best[0][_FOUND]):
                best = (row, s.device)
        if best is None:
            return None
        return self._describe(best[0], best[1], names)

    def _describe(self, r: list, device: torch.device, names: list) -> NonfiniteOp:
        ndim = r[_NDIM]
        shape = tuple(r[_SHAPE:_SHAPE + min(ndim, _MAX_SHAPE_DIMS)])
        flat = r[_FIRST] if r[_FIRST] != _NO_INDEX else None
        index = unravel(flat, shape) if flat is not None and ndim <= _MAX_SHAPE_DIMS else None
        n_in, bad = r[_INPUTS], r[_BAD_INPUTS]
        bad_list = [i for i in range(n_in) if bad >> i & 1]
        return NonfiniteOp(
            step=r[_HIT_STEP], phase=PHASES.get(r[_PHASE], "?"), op=names[r[_OP]],
            module=self._modules[r[_MODULE]] if 0 <= r[_MODULE] < len(self._modules) else None,
            node=names[r[_NODE]] if r[_NODE] >= 0 else None,
            nan=r[_NAN], inf=r[_INF], shape=shape if ndim <= _MAX_SHAPE_DIMS else None, ndim=ndim,
            numel=r[_NUMEL], dtype=_DTYPES.get(r[_DTYPE]), index=list(index) if index is not None else None,
            flat_index=flat, seq=r[_SEQ], output=r[_OUTPUT], order=r[_FOUND], device=str(device),
            param=self._param_name(r[_DATA_PTR]),
            inputs_finite=(not bad_list) if n_in > 0 else None, nonfinite_inputs=bad_list)

    def _param_name(self, ptr: int) -> Optional[str]:
        """The parameter (or ".grad" of one) whose memory the output is, if any: names what the optimizer wrote."""
        if self.model is None or ptr == 0:
            return None
        for name, p in self.model.named_parameters():
            if p.data_ptr() == ptr:
                return name
            if p.grad is not None and p.grad.data_ptr() == ptr:
                return name + ".grad"
        return None


def detect_nonfinite(model: Optional[torch.nn.Module] = None, *, every: int = 1, ignore_ops: Sequence[str] = (),
                     start_step: int = 0) -> NonfiniteGuard:
    """A guard that finds the first ATen op whose floating output held a NaN or an Inf, in forward, backward or the
    optimizer, on CPU and CUDA, without a host sync and without Python per op. In a training loop::

        guard = hookstats.detect_nonfinite(model)
        with guard:
            for x, y in data:
                loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
                guard.step()
        print(guard.first())   # None, or: step 3, forward: aten::log in blocks.1.act made 8 inf in ...

    `model` (optional) names the module each op ran in (a forward pre/post hook per module; in backward, the module
    whose forward made the autograd node) and, in the optimizer, the parameter written. `every=N` checks steps that
    are multiples of N only (nothing runs per op in between). `ignore_ops` names ops whose non-finite outputs are
    intended (["aten::masked_fill"] for a -inf attention mask): nothing such an op runs is checked, its consumers
    are. `start_step` numbers the first step (a resumed run).

    The report (`NonfiniteOp`): step, phase ("forward" / "backward" / "optimizer"), op ("aten::log"), module, node
    (the autograd node in backward: "SqrtBackward0"), nan / inf counts, shape, dtype, index (the first NaN/Inf
    element), seq (the autograd sequence number), and whether the op's inputs were finite (they are, unless they came
    from outside every checked op: the model's inputs, its parameters, data made before the guard).
    Under torch.compile only the ops that run through the ATen dispatcher are checked (eager code, graph breaks,
    the aot_eager backend, inductor's extern kernels such as matmuls), not the code inductor generates; under CUDA
    graph capture the checks are captured with the ops (the step counter lives on the device). Docs:
    docs/guide/anomaly.md."""
    return NonfiniteGuard(model, every=every, ignore_ops=ignore_ops, start_step=start_step)
