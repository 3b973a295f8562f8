"""The scalars a Monitor logs beside its statistics (Monitor.log): one float64 slot each, on the value's device."""
from __future__ import annotations

import math

import torch

from .recorder import to_host


class ScalarBuffer:
    """Scalars logged with Monitor.log(): one float64 slot each, on the value's device, copied there (no sync)."""

    def __init__(self, slots: int = 64, keep: bool = True):
        self.slots = slots
        self.keep = keep  # flushed scalars kept for Monitor.scalars() (keep_records)
        self._bufs: dict[torch.device, torch.Tensor] = {}
        self._used: dict[torch.device, int] = {}
        self._meta: dict[torch.device, list] = {}
        self.flushed: list[dict] = []
        self._seq = 0

    def add(self, value, step: int, tag: str) -> None:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"hookstats.Monitor.log needs a one-element tensor or a number, got shape "
                                 f"{tuple(value.shape)}")
            dev = value.device
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            dev = torch.device("cpu")
        else:
            raise TypeError(f"hookstats.Monitor.log needs a tensor or a number, got {type(value).__name__}")
        buf = self._bufs.get(dev)
        n = self._used.get(dev, 0)
        if buf is None or n == buf.shape[0]:
            new = torch.full((self.slots if buf is None else 2 * buf.shape[0],), math.nan, dtype=torch.float64,
                             device=dev)
            if buf is not None:
                new[:n].copy_(buf[:n])
            self._bufs[dev] = buf = new
        if isinstance(value, torch.Tensor):
            buf[n].copy_(value.detach().reshape(()))
        else:
            buf[n] = float(value)
        self._meta.setdefault(dev, []).append((self._seq, step, tag))
        self._seq += 1
        self._used[dev] = n + 1

    def flush(self) -> list[dict]:
        """The scalars logged since the last flush, in call order (kept in `flushed` too, with keep)."""
        new: list[dict] = []
        for dev, buf in self._bufs.items():
            n = self._used.get(dev, 0)
            if n:
                for (seq, step, tag), v in zip(self._meta[dev], to_host(buf[:n]).tolist()):
                    new.append({"seq": seq, "step": step, "tag": tag, "value": v})
            self._used[dev] = 0
            self._meta[dev] = []
        new.sort(key=lambda r: r["seq"])
        if self.keep:
            self.flushed.extend(new)
        return new

    @property
    def pending(self) -> int:
        return sum(self._used.values())

    def release(self) -> None:
        self._bufs.clear()
        self._used.clear()
        self._meta.clear()
