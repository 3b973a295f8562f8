"""Per-channel statistics along one dimension, in one read: `channel_stats`, `channel_stats_into` (accumulating
over calls into a device buffer) and `ChannelCalibrator` (forward hooks on chosen modules, the calibration use case
of SmoothQuant / AWQ-style quantization). Semantics: csrc/core/channel_ops.h, Note [channel stats]."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from ._kernels import reference_checked, result_of, use_kernels
from ._nested import first_floating
from ._owned_hooks import in_backward, register
from ._select import Selection, Site
from ._types import CHANNEL_FIELDS, ChannelStats, check_tensor  # noqa: F401  (CHANNEL_FIELDS: re-exported)

# The sites a ChannelCalibrator sits on, and the side each one's results are named by (its public `on` names).
FORWARD_SITES = (Site.FORWARD_PRE, Site.FORWARD)
_SIDE = {Site.FORWARD_PRE: "inputs", Site.FORWARD: "outputs"}


def _check_dim(x: torch.Tensor, dim, op: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"hookstats.{op}: dim must be an int, got {type(dim).__name__}")
    if x.dim() == 0:
        raise ValueError(f"hookstats.{op} needs a tensor with at least one dimension, got a 0-d tensor")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"hookstats.{op}: dim {dim} is out of range for a tensor of {x.dim()} dimensions")
    return dim % x.dim()


def channel_stats(x: torch.Tensor, dim: int = -1) -> ChannelStats:
    """Per-channel statistics of `x` along `dim` (the kept dimension; every other one is reduced), in one read, on
    `x.device`, with no host sync. Any layout (contiguous, transposed, channels_last, expanded, sliced, empty);
    float32/float64/float16/bfloat16 inputs, accumulated in float32 pieces whose sums are added in float64 (CUDA:
    float64 throughout), so the float32 results are the float64 sums rounded once. See `ChannelStats` for the NaN
    rules."""
    check_tensor(x, "channel_stats")
    dim = _check_dim(x, dim, "channel_stats")
    if not use_kernels(x, "channel_stats"):
        return reference_checked((x,), "channel_stats").channel_stats(x, dim)
    values, counts = torch.ops.hookstats.channel_stats.default(x.detach(), dim)
    return result_of(ChannelStats, values, counts)


def channel_stats_buffer(channels: int, device=None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A `[7, channels]` buffer for `channel_stats_into`, holding the identities of each row's combination (absmax,
    sums and counts 0, min +inf, max -inf). float64 (the default) keeps sums over many batches at float64 accuracy
    and counts exact to 2^53; float32 rounds at every call and keeps counts exact to 2^24."""
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"hookstats.channel_stats_buffer dtype must be torch.float32 or torch.float64, got {dtype}")
    if isinstance(channels, bool) or not isinstance(channels, int) or channels < 0:
        raise ValueError(f"hookstats.channel_stats_buffer needs channels >= 0, got {channels!r}")
    buf = torch.zeros((len(CHANNEL_FIELDS), channels), dtype=dtype, device=device)
    buf[3].fill_(float("inf"))
    buf[4].fill_(float("-inf"))
    return buf


def channel_stats_into(x: torch.Tensor, buf: torch.Tensor, dim: int = -1) -> None:
    """Combines the per-channel statistics of `x` along `dim` into `buf` (see `channel_stats_buffer`), on the
    device, no host sync: absmax and max by max, min by min, sums and counts added. Call it on every batch (e.g. in
    a forward hook) and read `ChannelStats.from_buffer(buf)` once at the end."""
    check_tensor(x, "channel_stats_into")
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"hookstats.channel_stats_into needs a buffer tensor, got {type(buf).__name__}")
    dim = _check_dim(x, dim, "channel_stats_into")
    if not use_kernels(x, "channel_stats_into"):
        reference_checked((x,), "channel_stats_into").channel_stats_into(x, buf, dim)
        return
    # The op checks the buffer (dtype: TypeError; shape, device: ValueError), see csrc/core/channel_bindings.h.
    torch.ops.hookstats.channel_stats_into.default(x.detach(), buf, dim)


class ChannelCalibrator:
    """Per-channel statistics of chosen modules' inputs (or outputs) accumulated over calibration batches.

    `ChannelCalibrator(model, include="*Linear*", dim=-1, on="inputs")` registers a forward pre-hook (inputs: the
    first positional floating tensor) or a forward hook (outputs: the output, or its first floating tensor) on every
    module whose qualified name or class name matches a glob of `include` and none of `exclude`. Each call is one
    `channel_stats_into` kernel call into that module's device buffer (allocated on the first call, `[7, C]`,
    `dtype`, default float64): nothing is copied to the host until you read. A module called several times per
    batch accumulates every call. Non-floating inputs (token ids) are skipped. `on` also takes `Site.FORWARD_PRE` /
    `Site.FORWARD` (or their values); `.on` keeps "inputs" or "outputs", `.site` the Site.

    `stats()` gives `ChannelStats` views of the device buffers; `results()` copies every buffer to the host in one
    copy per device; `reset()` restarts the accumulation; `remove()` (or leaving a `with` block) removes the hooks.
    SmoothQuant's activation scales are `results()[name].absmax`; AWQ's mean magnitudes `results()[name].mean_abs()`.
    """

    def __init__(self, model: torch.nn.Module, include: Sequence[str] | str = "*Linear*",
                 exclude: Sequence[str] | str = (), dim: int = -1, on: str | Site = "inputs",
                 dtype: torch.dtype = torch.float64):
        site = Site.parse(on, FORWARD_SITES, "hookstats.ChannelCalibrator: on must be a forward site, got")
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"hookstats.ChannelCalibrator: dtype must be torch.float32 or torch.float64, got {dtype}")
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"hookstats.ChannelCalibrator: dim must be an int, got {type(dim).__name__}")
        selection = Selection(include, exclude)
        self.dim, self.dtype = dim, dtype
        self.site = site
        self.on = _SIDE[site]  # the name results are keyed by (channel_stats={"inputs": ...})
        self.buffers: Dict[str, torch.Tensor] = {}
        self.calls: Dict[str, int] = {}
        self._handles = []
        self.modules = []
        for name, mod in selection.modules(model):
            self.modules.append(name)
            if site is Site.FORWARD_PRE:
                h = register(mod, "register_forward_pre_hook", self._pre_hook(name))
            else:
                h = register(mod, "register_forward_hook", self._post_hook(name))
            self._handles.append(h)
        if not self.modules:
            raise ValueError(f"hookstats.ChannelCalibrator: no module matches include={include!r}, "
                             f"exclude={exclude!r}")

    def _record(self, name: str, t: Optional[torch.Tensor]) -> None:
        if t is None or (not torch.compiler.is_compiling() and in_backward()):  # a checkpointed block's recompute
            return
        buf = self.buffers.get(name)
        c = t.shape[self.dim] if t.dim() else 0
        if buf is None:
            buf = self.buffers[name] = channel_stats_buffer(c, device=t.device, dtype=self.dtype)
        elif buf.shape[1] != c or buf.device != t.device:
            raise ValueError(f"hookstats.ChannelCalibrator: module {name!r} got {c} channels on {t.device}, but its "
                             f"buffer holds {buf.shape[1]} on {buf.device}; reset() between models")
        channel_stats_into(t, buf, self.dim)
        self.calls[name] = self.calls.get(name, 0) + 1

    def _pre_hook(self, name: str):
        def hook(module, args):
            self._record(name, first_floating(args))
        return hook

    def _post_hook(self, name: str):
        def hook(module, args, output):
            self._record(name, first_floating(output))
        return hook

    def stats(self) -> Dict[str, ChannelStats]:
        """`ChannelStats` views of the device buffers, per module that was called (no copy, no sync)."""
        return {n: ChannelStats.from_buffer(b) for n, b in self.buffers.items()}

    def results(self) -> Dict[str, ChannelStats]:
        """The statistics on the host: one copy per device of every buffer together."""
        out: Dict[str, ChannelStats] = {}
        by_dev: Dict[torch.device, list] = {}
        for n, b in self.buffers.items():
            by_dev.setdefault(b.device, []).append(n)
        for names in by_dev.values():
            flat = torch.cat([self.buffers[n].reshape(-1) for n in names]).cpu()
            off = 0
            for n in names:
                k = self.buffers[n].numel()
                out[n] = ChannelStats.from_buffer(flat[off:off + k].view(self.buffers[n].shape))
                off += k
        return out

    def reset(self) -> None:
        """Forgets what was accumulated; the hooks stay (a new calibration pass starts)."""
        self.buffers.clear()
        self.calls.clear()

    def remove(self) -> None:
        """Removes the hooks; results() still reads what was accumulated."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "ChannelCalibrator":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
