"""The squared norms and clip sums of the small per-sample terms of a backward, side by side (Note [stacked small
terms])."""
from __future__ import annotations

from typing import Dict, List

import torch

# Note [stacked small terms]: most parameters of a model are small (biases, norm weights) and their per-sample
# gradient a lone Dense term [B, n]: computing each one's squared norm, and in the clip each one's weighted sum, as
# ops of their own costs a few microseconds of dispatch each for a few hundred values, about as much as the large
# layers' arithmetic together on small models. So such a term (one per parameter this backward, at most STACK_MAX
# values per sample) waits for the end of the backward, where the terms of one width are put side by side, [B, k n]:
# one vector norm gives the k squared norms, and the clip one matrix-vector product for the k weighted sums. Large
# terms (the per-sample products of the weights) are reduced as soon as they are complete, while still in cache.
STACK_MAX = 2048


def stack_small(small: list, dead: set, sq: Dict[str, List[torch.Tensor]], pname: Dict[int, str],
                clipping: bool) -> list:
    """Note [stacked small terms]: the squared norms of the lone small Dense terms of this backward (`small`: (pid,
    samples, D [B, n], deferred); those of `dead` parameters dropped), k parameters of one width at a time, appended
    to `sq` by parameter name; empties `small`. Returns, for the clip (when `clipping`), (pids, samples, C [B, k n],
    squared norms [B, k], deferred) per width."""
    by: Dict[tuple, list] = {}
    for pid, n, d, deferred in small:
        if pid not in dead:
            by.setdefault((d.shape[1], d.dtype, d.device, n, deferred), []).append((pid, d))
    small.clear()
    out = []
    for (width, _, _, n, deferred), items in by.items():
        c = torch.cat([d for _, d in items], 1) if len(items) > 1 else items[0][1]
        v = torch.linalg.vector_norm(c.reshape(n, len(items), width), dim=2).square_()  # [B, k]
        for (pid, _), row in zip(items, v.unbind(1)):
            sq.setdefault(pname[pid], []).append(row)
        out.append(([pid for pid, _ in items], n, c, v, deferred))
    return out if clipping else []
