"""Buffers the clip's large per-sample temporaries reuse from one backward to the next on the CPU (Note
[workspace])."""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

# Note [workspace]: with max_norm, the per-sample products a term materialises (Note [book-keeping] in
# bookkeeping.py: [B, out, in] per Linear weight) live until the end of the backward, when the clip has read them.
# On the CPU a fresh tensor that large comes from the C allocator, which hands big blocks back to the system when
# they are freed: every step then pays a page fault and a page clear for each 4 KiB of them (measured: 4x the plain
# step's minor faults on the tied transformer of benchmarks/test_bench_per_sample.py, and the bmm writing into them
# 3x slower than into warm memory). So they are taken from here instead: buffers by shape and dtype, handed out in
# turn during one backward and all free again once the clip is done (release(), at the end of the backward and at
# step()). The memory is what the backward needs at its peak anyway; it stays allocated between steps until
# remove() (or reset()). A buffer handed out is never returned to the user: the clipped gradient itself is a fresh
# tensor. On other devices the caching allocator already reuses memory: take() is torch.empty there.


_ACTIVE: list = []  # the workspace of the backward whose rule is running (core.py sets it around Rule.terms)


def scratch(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor for a rule's large temporary (im2col patches): a buffer of the running backward's
    workspace, free again when that backward is done (Note [workspace]); torch.empty outside one."""
    if _ACTIVE:
        return _ACTIVE[-1].take(shape, dtype, device)
    return torch.empty(shape, dtype=dtype, device=device)


class Workspace:
    __slots__ = ("_bufs", "_taken", "_views")

    def __init__(self):
        self._bufs: Dict[Tuple, List[torch.Tensor]] = {}
        self._taken: Dict[Tuple, int] = {}
        self._views: Dict[Tuple, torch.Tensor] = {}  # (id of a buffer, shape) -> its view (take_pair)

    def take(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised [shape] tensor no other term of this backward holds."""
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        key = (tuple(shape), dtype, device)
        i = self._taken.get(key, 0)
        self._taken[key] = i + 1
        bufs = self._bufs.setdefault(key, [])
        if i == len(bufs):
            bufs.append(torch.empty(shape, dtype=dtype, device=device))
        return bufs[i]

    def take_pair(self, shape: Tuple[int, ...], flat: Tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """take(shape, ...) and a view of it as `flat` (the same memory), the view made once per buffer."""
        t = self.take(shape, dtype, device)
        if device.type != "cpu":
            return t, t.view(flat)
        key = (id(t), tuple(flat))
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = t.view(flat)
        return t, v

    def release(self) -> None:
        """Every buffer free again: the terms that held them are gone."""
        self._taken.clear()

    def clear(self) -> None:
        """Frees the memory."""
        self._taken.clear()
        self._views.clear()
        self._bufs.clear()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for bufs in self._bufs.values() for t in bufs)
