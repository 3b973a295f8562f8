"""Weights & Biases exporter (optional: needs `wandb`). Same tags as the TensorBoard exporter; histograms from our
bins through `wandb.Histogram(np_histogram=(counts, edges))`."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ._common import DEFAULT_STATS, bucket_edges, by_step


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
        """Puts the run header into the W&B run's config (under "hookstats")."""
        self.info = info
        try:
            self.run.config.update({"hookstats": info}, allow_val_change=True)
        except Exception:  # a config that refuses updates (e.g. a disabled run) is not worth failing a training for
            pass

    def write_block(self, block, scalars: list = ()) -> None:
        """One Monitor flush (a columnar Block), written as write() writes its records."""
        self.write(list(block.iter_records()), scalars)

    def write(self, records: list, scalars: list = ()) -> None:
        """One run.log call per step: the chosen statistics as scalars, histograms as wandb.Histogram."""
        for step, items in by_step(records, scalars, self.stats, self.histograms, self.info):
            self.run.log({tag: v if isinstance(v, float) else
                          self._wandb.Histogram(np_histogram=(np.asarray(v.counts), np.asarray(bucket_edges(v))))
                          for tag, v in items}, step=step)

    def close(self) -> None:
        """Finishes the W&B run if this writer started it (a run given to it is left open)."""
        if self._own:
            self.run.finish()
