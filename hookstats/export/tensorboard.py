"""TensorBoard exporter: scalars per module / hook kind / statistic, and histograms from the bins the kernels already
counted (`add_histogram_raw`): no tensor is read again."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from .._ops import STATS_FIELDS
from ._common import DEFAULT_STATS, by_step


class TensorBoardWriter:
    """Writes each Monitor flush to TensorBoard event files.

    Tags: `{kind}.{stat}/{module}` for statistics (one chart group per statistic and hook kind, all layers in it),
    `{kind}.hist/{module}` (range histograms, value axis) or `{kind}.log2abs/{module}` (exponent histograms, on the
    axis log2|x|), and each Monitor.log() tag as is. `log_dir` or an existing `SummaryWriter` (`writer=`);
    `stats` picks the statistics written as scalars (any of hookstats.STATS_FIELDS). Event files are flushed at each
    write. Needs the `tensorboard` package.
    """

    def __init__(self, log_dir: Optional[str | os.PathLike] = None, *, writer=None,
                 stats: Sequence[str] = DEFAULT_STATS, histograms: bool = True):
        bad = [s for s in stats if s not in STATS_FIELDS]
        if bad:
            raise ValueError(f"hookstats.TensorBoardWriter: unknown statistics {bad}; choose from {STATS_FIELDS}")
        if writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # torch raises this when the tensorboard package is missing
                raise ImportError("hookstats.TensorBoardWriter needs the tensorboard package: pip install tensorboard"
                                  ) from e
            writer = SummaryWriter(log_dir=None if log_dir is None else os.fspath(log_dir))
            self._own = True
        else:
            self._own = False
        self.writer = writer
        self.stats = tuple(stats)
        self.histograms = histograms
        self.info: Optional[dict] = None

    @property
    def log_dir(self) -> str:
        """The directory the event files go to (tensorboard --logdir it)."""
        return self.writer.log_dir

    def begin(self, info: dict) -> None:
        """Writes the run header as a text summary."""
        self.info = info
        text = ", ".join(f"{k}: {info[k]}" for k in ("hookstats", "torch", "histogram", "kinds") if k in info)
        self.writer.add_text("hookstats/run", text, 0)

    def write_block(self, block, scalars: list = ()) -> None:
        """One Monitor flush (a columnar Block), written as write() writes its records."""
        self.write(list(block.iter_records()), scalars)

    def write(self, records: list, scalars: list = ()) -> None:
        """One Summary event per step holding every scalar and histogram of that step (far cheaper than one
        add_scalar call each: a flush of thousands of records writes in milliseconds)."""
        from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

        fw = self.writer._get_file_writer()
        for step, items in by_step(records, scalars, self.stats, self.histograms, self.info):
            values = [Summary.Value(tag=tag, simple_value=v) if isinstance(v, float) else
                      Summary.Value(tag=tag, histo=HistogramProto(min=v.min, max=v.max, num=v.num, sum=v.sum,
                                                                  sum_squares=v.sum_squares, bucket_limit=v.limits,
                                                                  bucket=v.counts))
                      for tag, v in items]
            fw.add_summary(Summary(value=values), step)
        self.writer.flush()

    def close(self) -> None:
        """Flushes the event file, and closes the SummaryWriter if this writer made it."""
        self.writer.flush()
        if self._own:
            self.writer.close()
