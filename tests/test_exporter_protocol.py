"""Every hookstats writer implements the Exporter protocol; a Monitor takes any Exporter or RecordWriter, and
Block.iter_records() is what the record-dict writers read."""
import pytest
import torch
from torch import nn

import hookstats
from hookstats.export import Exporter, JSONLWriter, RecordWriter


def _writers(tmp_path):
    out = [JSONLWriter(tmp_path / "log.jsonl")]
    pytest.importorskip("pyarrow")
    out.append(hookstats.export.ParquetWriter(tmp_path / "log.parquet"))
    pytest.importorskip("tensorboard")
    out.append(hookstats.export.TensorBoardWriter(tmp_path / "tb"))
    return out


def test_every_writer_is_an_exporter(tmp_path):
    writers = _writers(tmp_path)
    for w in writers:
        assert isinstance(w, Exporter), type(w).__name__
    assert isinstance(hookstats.export.WandbWriter.__new__(hookstats.export.WandbWriter), Exporter)
    for w in writers:
        w.close()


class Collect:
    """A RecordWriter: record dicts only."""

    def __init__(self):
        self.records, self.began = [], None

    def begin(self, info):
        self.began = info

    def write(self, records, scalars=()):
        self.records += list(records)


class Columns:
    """An Exporter reading the block's columns and its records one at a time."""

    def __init__(self):
        self.rows, self.records = 0, []

    def begin(self, info):
        pass

    def write_block(self, block, scalars=()):
        self.rows += len(block)
        self.records += list(block.iter_records())

    def close(self):
        self.closed = True


def test_monitor_takes_either_form():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    a, b = Collect(), Columns()
    assert isinstance(a, RecordWriter) and isinstance(b, Exporter) and not isinstance(a, Exporter)
    mon = hookstats.Monitor(m, kinds=("forward",), exporters=[a, b])
    for _ in range(3):
        m(torch.randn(5, 4))
        mon.step()
    mon.detach()
    mine = mon.records()
    assert a.began is not None and b.closed
    assert b.rows == len(mine) == 9
    strip = lambda rs: [{k: v for k, v in r.items() if k != "seq"} for r in rs]  # noqa: E731
    assert strip(a.records) == strip(b.records) == strip(mine)


def test_iter_records_does_not_keep_dicts():
    m = nn.Linear(4, 3)
    mon = hookstats.Monitor(m, kinds=("forward",))
    m(torch.randn(2, 4))
    block = mon._flush_block()
    got = list(block.iter_records())
    assert len(got) == 1 and block._records is None  # not cached: a kept block must not hold the dicts
    assert got == block.records()
    mon.detach()


def test_not_an_exporter_is_refused():
    with pytest.raises(TypeError, match="write"):
        hookstats.Monitor(nn.Linear(2, 2), exporters=[object()])
