"""The argument checks that the clipping functions and the hook objects share: each returns the checked value
(or raises a TypeError / ValueError naming the function, `op`, and the argument), so that a bad argument is refused
with the same words wherever it is given."""
from __future__ import annotations

import math

import torch

NONFINITE_POLICIES = ("propagate", "error", "zero")
POLICY_CODE = {"propagate": 0, "error": 0, "zero": 1}  # the kernels' code: "error" is checked before they run


def check_norm_type(norm_type, op: str) -> float:
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(f"hookstats.{op}: norm_type must be a number or 'inf', got {norm_type!r}") from None
    if not p > 0:  # also NaN
        raise ValueError(f"hookstats.{op} needs norm_type > 0 (a finite p or inf), got {norm_type!r}")
    return p


def check_max_norm(max_norm, op: str) -> float:
    if isinstance(max_norm, torch.Tensor) and max_norm.numel() != 1:
        raise TypeError(f"hookstats.{op}: max_norm must be a number or a one-element tensor, got a tensor of shape "
                        f"{tuple(max_norm.shape)} (one bound clips every tensor the hook sees; for one bound per "
                        "layer, make one hook per layer)")
    if isinstance(max_norm, (bool, str, bytes)):
        raise TypeError(f"hookstats.{op}: max_norm must be a number, got {max_norm!r}")
    try:
        m = float(max_norm)
    except (TypeError, ValueError):
        raise TypeError(f"hookstats.{op}: max_norm must be a number, got {type(max_norm).__name__}") from None
    if not m >= 0:  # negative or NaN
        raise ValueError(f"hookstats.{op} needs max_norm >= 0, got {max_norm!r}")
    return m


def check_eps(eps, op: str) -> float:
    e = float(eps)
    if not (e >= 0 and math.isfinite(e)):
        raise ValueError(f"hookstats.{op} needs a finite eps >= 0, got {eps!r}")
    return e


def check_policy(nonfinite: str, op: str) -> str:
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"hookstats.{op}: nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
    return nonfinite


def check_writable(x: torch.Tensor, op: str) -> None:
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            f"hookstats.{op} modifies its tensor in place and has no autograd formula, but the tensor requires grad "
            "and grad mode is on; call it under torch.no_grad(), or on a .grad tensor"
        )


def check_bounds(lo, hi, op: str) -> tuple[float, float]:
    """[-lo, lo] when hi is None (lo >= 0), else [lo, hi] (lo <= hi); NaN bounds refused."""
    lo_f = float(lo)
    if hi is None:
        if not lo_f >= 0:
            raise ValueError(f"hookstats.{op}(v) clamps to [-v, v] and needs v >= 0, got {lo!r}")
        return -lo_f, lo_f
    hi_f = float(hi)
    if not lo_f <= hi_f:
        raise ValueError(f"hookstats.{op} needs lo <= hi (and no NaN bound), got [{lo!r}, {hi!r}]")
    return lo_f, hi_f
