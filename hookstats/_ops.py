"""Typed wrappers over torch.ops.hookstats.*, and a fake kernel for each op (torch.compile)."""
from __future__ import annotations

import warnings
from typing import NamedTuple, Optional

import torch

try:
    from . import _C  # noqa: F401  (loading the library registers torch.ops.hookstats)

    HAVE_EXTENSION = True
    _EXTENSION_ERROR: Optional[BaseException] = None
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    HAVE_EXTENSION = False
    _EXTENSION_ERROR = e
    warnings.warn(
        f"hookstats: the compiled extension hookstats._C could not be loaded ({e}); falling back to the "
        "pure-PyTorch reference implementation, which is correct but slow. Rebuild with "
        "`pip install --no-build-isolation -e .`.",
        RuntimeWarning,
        stacklevel=2,
    )

# Note [stats row layout] (csrc/core/stats_ops.h): the order of Stats' fields and of a stats_into row.
STATS_FIELDS = (
    "numel", "sum", "mean", "var", "std", "l1", "l2", "linf", "min", "max",
    "nan_count", "inf_count", "zero_count",
)
COUNT_FIELDS = ("numel", "nan_count", "inf_count", "zero_count")
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class Stats(NamedTuple):
    """Statistics of one tensor, each a 0-d tensor on the tensor's device (nothing is copied to the host).

    Float fields are float32 (float64 for float64 inputs); numel and the counts are int64 when returned by
    `hookstats.stats`, and of the buffer's dtype when read from a `stats_into` row.
    """

    numel: torch.Tensor
    sum: torch.Tensor
    mean: torch.Tensor
    var: torch.Tensor
    std: torch.Tensor
    l1: torch.Tensor
    l2: torch.Tensor
    linf: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor
    nan_count: torch.Tensor
    inf_count: torch.Tensor
    zero_count: torch.Tensor

    @classmethod
    def from_row(cls, row: torch.Tensor) -> "Stats":
        """Views of one row of a `stats_buffer` (no copy)."""
        if row.shape != (len(STATS_FIELDS),):
            raise ValueError(f"hookstats.Stats.from_row needs a row of {len(STATS_FIELDS)} values, got shape {tuple(row.shape)}")
        return cls(*row.unbind(0))

    def to_dict(self) -> dict:
        """Python numbers. This copies to the host (one sync per call): do it when you read results, not in a hook."""
        packed = torch.stack([t.to(torch.float64) for t in self]).tolist()
        return {k: (int(v) if k in COUNT_FIELDS and v == v else v) for k, v in zip(STATS_FIELDS, packed)}


def result_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tensor(x, op: str) -> None:
    """TypeError for anything hookstats' kernels do not take, before any dispatch."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"hookstats.{op} needs a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"hookstats.{op} needs a dense (strided) tensor, got layout {x.layout}; call .to_dense() first")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"hookstats.{op} needs a floating tensor (float32, float64, float16 or bfloat16), got {x.dtype}"
        )


_CUDA_BUILT: Optional[bool] = None


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
                "CUDA build of torch and a CUDA toolkit: `CUDA_HOME=/usr/local/cuda pip install "
                "--no-build-isolation -e .` (HOOKSTATS_FORCE_CPU must be unset)."
            )
    elif not (x.is_cpu or x.is_meta):
        raise RuntimeError(f"hookstats.{op} runs on CPU and CUDA tensors, got a tensor on {x.device}")


if HAVE_EXTENSION:

    @torch.library.register_fake("hookstats::stats")
    def _stats_fake(x):
        rt = result_dtype(x.dtype)
        return x.new_empty((9,), dtype=rt), x.new_empty((4,), dtype=torch.int64)

    @torch.library.register_fake("hookstats::stats_into")
    def _stats_into_fake(x, out, slot):
        if out.device != x.device:
            raise ValueError(
                f"hookstats.stats_into: the buffer is on {out.device} but the tensor is on {x.device}; "
                "allocate the buffer on the tensor's device"
            )
        return None


def _stats_from_parts(values: torch.Tensor, counts: torch.Tensor) -> Stats:
    v = values.unbind(0)
    c = counts.unbind(0)
    return Stats(c[0], v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], c[1], c[2], c[3])


def stats(x: torch.Tensor) -> Stats:
    """All statistics of `x` in one fused read, as a `Stats` of 0-d tensors on `x.device`. No host sync.

    Semantics match PyTorch's (`sum`, `mean`, `var(correction=1)`, `std`, `linalg.vector_norm` for l1/l2/linf,
    `amin`/`amax`, `isnan/isinf/== 0` counts) with these deliberate differences: results are float32 for
    float16/bfloat16/float32 inputs (float64 for float64), so fp16 sums do not overflow; l2 and std never
    overflow or underflow when the true value fits the result dtype; an empty tensor gives numel 0, sum/l1/l2/
    linf 0 and NaN for mean/var/std/min/max instead of raising.
    """
    check_tensor(x, "stats")
    if not HAVE_EXTENSION:
        from . import reference

        return reference.stats(x)
    check_device(x, "stats")
    values, counts = torch.ops.hookstats.stats.default(x.detach())
    return _stats_from_parts(values, counts)


def stats_buffer(slots: int, device=None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A buffer for `stats_into`: `slots` rows of the 13 `STATS_FIELDS`, NaN until written.

    float64 keeps counts exact up to 2^53; float32 halves the size and keeps counts exact up to 2^24.
    """
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"hookstats.stats_buffer dtype must be torch.float32 or torch.float64, got {dtype}")
    if not isinstance(slots, int) or slots < 1:
        raise ValueError(f"hookstats.stats_buffer needs slots >= 1, got {slots!r}")
    return torch.full((slots, len(STATS_FIELDS)), float("nan"), dtype=dtype, device=device)


def stats_into(x: torch.Tensor, out: torch.Tensor, slot: int) -> None:
    """Writes the statistics of `x` into row `slot` of `out` (see `stats_buffer`), on the device, no host sync.

    Many hooks can fill one preallocated buffer; read it back once with `out.cpu()`.
    """
    check_tensor(x, "stats_into")
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"hookstats.stats_into needs a buffer tensor, got {type(out).__name__}")
    if not HAVE_EXTENSION:
        from . import reference

        reference.stats_into(x, out, slot)
        return
    check_device(x, "stats_into")
    # The op checks the buffer (dtype: TypeError; shape, device, slot: ValueError), see csrc/core/checks.h.
    torch.ops.hookstats.stats_into.default(x.detach(), out, slot)
