"""Weights & Biases exporter (optional: needs `wandb`). Same tags as the TensorBoard exporter; histograms from our
bins through `wandb.Histogram(np_histogram=(counts, edges))`."""
from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence

from ._common import DEFAULT_STATS, bucket_edges, buckets, hist_tag, scalar_items


class WandbWriter:
    """Logs each Monitor flush to a wandb run (`run=`, default `wandb.run`, else `wandb.init(**init_kwargs)`), one
    `run.log(..., step=step)` per step in step order. For offline use: `WandbWriter(mode="offline")`."""

    def __init__(self, run=None, *, stats: Sequence[str] = DEFAULT_STATS, histograms: bool = True, **init_kwargs):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("hookstats.WandbWriter needs the wandb package: pip install wandb") from e
        self._wandb = wandb
        self._own = False
        if run is None:
            run = wandb.run
        if run is None:
            run = wandb.init(**init_kwargs)
            self._own = True
        self.run = run
        self.stats = tuple(stats)
        self.histograms = histograms
        self.info: Optional[dict] = None

    def begin(self, info: dict) -> None:
        self.info = info
        try:
            self.run.config.update({"hookstats": info}, allow_val_change=True)
        except Exception:  # a config that refuses updates (e.g. a disabled run) is not worth failing a training for
            pass

    def write(self, records: list, scalars: list = ()) -> None:
        import numpy as np

        per_step: dict[int, dict] = defaultdict(dict)
        for step, tag, value in scalar_items(records, self.stats):
            per_step[step][tag] = value
        if self.histograms:
            for r in records:
                b = buckets(r, self.info)
                if b is not None:
                    per_step[r["step"]][hist_tag(r, self.info)] = self._wandb.Histogram(
                        np_histogram=(np.asarray(b.counts), np.asarray(bucket_edges(b))))
        for s in scalars:
            per_step[s["step"]][s["tag"]] = float(s["value"])
        for step in sorted(per_step):
            self.run.log(per_step[step], step=step)

    def close(self) -> None:
        if self._own:
            self.run.finish()
