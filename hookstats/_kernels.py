"""The compiled library: loading it, the fake (meta) kernel of every op, and the one choice between the kernels and
the pure-PyTorch reference.

Note [kernels or reference]
Every public wrapper asks `use_kernels(x, op)` once, with the first tensor it got: CPU, CUDA and meta (tracing)
tensors go to the compiled ops (a CUDA tensor on a build without CUDA kernels raises, saying how to rebuild);
tensors on any other device (mps, xla, ...), and every tensor when the extension could not be loaded, go to
`hookstats.reference`, which computes the same results in plain PyTorch (slowly). The wrappers take no other path.
Registering the reference as each op's CompositeExplicitAutograd kernel would let the dispatcher make this choice,
but it would also serve meta tensors (torch.compile's fakes) with eager Python code, and it cannot exist when the
library itself failed to load, which is the case the fallback is for.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from . import reference
from ._types import check_tensor, from_parts, hist_length, part_codes, result_dtype

try:
    from . import _C  # loading the library registers torch.ops.hookstats

    HAVE_EXTENSION = True
    _EXTENSION_ERROR: Optional[BaseException] = None
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    _C = None
    HAVE_EXTENSION = False
    _EXTENSION_ERROR = e
    warnings.warn(
        f"hookstats: the compiled extension hookstats._C could not be loaded ({e}); falling back to the "
        "pure-PyTorch reference implementation, which is correct but slow. Rebuild with "
        "`pip install --no-build-isolation -e .`.",
        RuntimeWarning,
        stacklevel=2,
    )

_CUDA_BUILT: Optional[bool] = None
_FIELDS = getattr(_C, "_fields", None)
_is_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def result_of(cls, values: torch.Tensor, counts: torch.Tensor):
    """_types.from_parts (the result type cls from a stats op's (values, counts)), its fields made by the extension in
    one call where it can (Note [field views] in csrc/monitor/py_tensors.cpp): plain tensors, not under dynamo."""
    if _FIELDS is not None and type(values) is torch.Tensor and type(counts) is torch.Tensor and not _is_compiling():
        return cls._make(_FIELDS(values, counts, part_codes(cls)))
    return from_parts(cls, values, counts)


def extension(what: str = "hookstats.Monitor and hookstats.record"):
    """The compiled module hookstats._C (its pybind11 objects: the Monitor's recorder and hooks), or a RuntimeError
    saying why it could not be loaded: those have no reference fallback."""
    if _C is None:
        raise RuntimeError(f"{what} need the compiled extension hookstats._C, which could not be loaded "
                           f"({_EXTENSION_ERROR}). Rebuild with `pip install --no-build-isolation -e .`")
    return _C


def cuda_kernels_built() -> bool:
    """Whether this build of hookstats has its CUDA kernels."""
    global _CUDA_BUILT
    if _CUDA_BUILT is None:
        _CUDA_BUILT = HAVE_EXTENSION and torch._C._dispatch_has_kernel_for_dispatch_key("hookstats::stats", "CUDA")
    return _CUDA_BUILT


def check_device(x: torch.Tensor, op: str) -> None:
    if x.is_cuda:
        if not cuda_kernels_built():
            raise RuntimeError(
                f"hookstats.{op} got a CUDA tensor, but this build of hookstats has no CUDA kernels. Rebuild with a "
                "CUDA build of torch and a CUDA toolkit: `HOOKSTATS_CUDA=1 CUDA_HOME=/usr/local/cuda pip install "
                "--no-build-isolation -e .` (a build where no GPU is visible skips them unless HOOKSTATS_CUDA=1 or "
                "TORCH_CUDA_ARCH_LIST asks; docs/development.md)."
            )
    elif not (x.is_cpu or x.is_meta):
        raise RuntimeError(f"hookstats.{op} runs on CPU and CUDA tensors, got a tensor on {x.device}")


def use_kernels(x: torch.Tensor, op: str) -> bool:
    """True: the compiled op serves `x` (after the device check); False: `hookstats.reference` does. Note [kernels
    or reference]."""
    if not HAVE_EXTENSION or not (x.is_cpu or x.is_cuda or x.is_meta):
        return False
    check_device(x, op)
    return True


def explained(xs, op: str, call):
    """Runs an op on a list; when it fails, says which tensor was wrong in check_tensor's words (the op's own checks
    run in C++ and cost nothing in Python on the way in)."""
    try:
        return call()
    except (TypeError, NotImplementedError, RuntimeError, ValueError):
        for x in xs:
            check_tensor(x, op)
        raise


def reference_checked(xs, op: str):
    """`hookstats.reference`, after check_tensor on every tensor of xs."""
    for x in xs:
        check_tensor(x, op)
    return reference


# ---------------------------------------------------------------------------------------------------------------
# Fake kernels (torch.compile traces the ops with them), one per op of csrc/hookstats.cpp.
if HAVE_EXTENSION:

    @torch.library.register_fake("hookstats::stats")
    def _stats_fake(x):
        rt = result_dtype(x.dtype)
        return x.new_empty((9,), dtype=rt), x.new_empty((4,), dtype=torch.int64)

    @torch.library.register_fake("hookstats::stats_loc")
    def _stats_loc_fake(x, hist_mode=0, bins=0, lo=0.0, hi=0.0):
        values, counts = _stats_fake(x)
        n = hist_length(x.dtype, hist_mode, bins) if hist_mode else 0
        return values, counts, x.new_empty((2,), dtype=torch.int64), x.new_empty((n,), dtype=torch.int64)

    @torch.library.register_fake("hookstats::stats_into")
    def _stats_into_fake(x, out, slot, hist=None, hist_slot=0, hist_mode=0, bins=0, lo=0.0, hi=0.0,
                         hist_accumulate=False, ring=None, loc=None, loc_slot=0):
        if loc is not None and loc.device != x.device:
            raise ValueError(f"hookstats.stats_into: the location buffer is on {loc.device} but the tensor is on "
                             f"{x.device}")
        if out.device != x.device or (hist is not None and hist.device != x.device):
            raise ValueError(
                f"hookstats.stats_into: the buffers must be on the tensor's device {x.device}, got {out.device}"
                + ("" if hist is None else f" and {hist.device}")
            )
        return None

    @torch.library.register_fake("hookstats::stats_hist")
    def _stats_hist_fake(x, hist_mode, bins, lo, hi):
        values, counts = _stats_fake(x)
        return values, counts, x.new_empty((hist_length(x.dtype, hist_mode, bins),), dtype=torch.int64)

    def _list_device(xs, op: str) -> torch.device:
        if len(xs) == 0:
            raise ValueError(f"hookstats.{op}: the op needs at least one tensor (the wrappers handle empty lists)")
        dev = xs[0].device
        for i, x in enumerate(xs):
            if x.device != dev:
                raise ValueError(f"hookstats.{op}: tensor {i} is on {x.device} but tensor 0 is on {dev}; "
                                 "group the tensors by device")
        return dev

    @torch.library.register_fake("hookstats::norms")
    def _norms_fake(xs, p):
        _list_device(xs, "norms")
        return (xs[0].new_empty((len(xs),), dtype=torch.float64), xs[0].new_empty((), dtype=torch.float64))

    @torch.library.register_fake("hookstats::scale_by_norm_")
    def _scale_by_norm_fake(xs, total, max_norm, eps, policy):
        if xs:
            _list_device(xs, "scale_by_norm_")
        return None

    @torch.library.register_fake("hookstats::clip_norm_")
    def _clip_norm_fake(x, p, max_norm, eps, policy, path=0):
        return x.new_empty((), dtype=torch.float64)

    @torch.library.register_fake("hookstats::clamp_count_")
    def _clamp_count_fake(xs, lo, hi):
        _list_device(xs, "clamp_count_")
        return xs[0].new_empty((), dtype=torch.int64)

    @torch.library.register_fake("hookstats::stats_multi_into")
    def _stats_multi_into_fake(xs, out, rows, hist=None, hist_rows=(), hist_mode=0, bins=0, lo=0.0, hi=0.0,
                               hist_accumulate=False, ring=None):
        if any(x.device != out.device for x in xs) or (hist is not None and hist.device != out.device):
            raise ValueError(f"hookstats.stats_multi_into: the tensors and buffers must be on one device, got "
                             f"{sorted({str(x.device) for x in xs} | {str(out.device)})}")
        return None

    def _fake_channels(x, dim, op):
        if x.dim() == 0:
            raise ValueError(f"hookstats.{op} needs a tensor with at least one dimension")
        return x.shape[dim]

    @torch.library.register_fake("hookstats::channel_stats")
    def _channel_stats_fake(x, dim):
        c = _fake_channels(x, dim, "channel_stats")
        return x.new_empty((5, c), dtype=result_dtype(x.dtype)), x.new_empty((2, c), dtype=torch.int64)

    @torch.library.register_fake("hookstats::channel_stats_into")
    def _channel_stats_into_fake(x, out, dim):
        _fake_channels(x, dim, "channel_stats_into")
        if out.device != x.device:
            raise ValueError(f"hookstats.channel_stats_into: the buffer is on {out.device} but the tensor is on "
                             f"{x.device}")
        return None

    @torch.library.register_fake("hookstats::_monitor_record")
    def _record_op_fake(xs, monitor, hook, index=-1) -> None:
        return None
