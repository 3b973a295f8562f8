"""JSONL run log: one JSON object per line, appended and flushed (and fsynced) at each Monitor flush, so a run killed
at any moment leaves every completed line readable.

Lines (strict JSON: a non-finite float is written as the string "NaN", "Infinity" or "-Infinity"):
  {"type": "run", "hookstats": ..., "torch": ..., "histogram": null | {"kind": "exp"} |
   {"kind": "range", "bins": B, "lo": L, "hi": H}, "stats_fields": [...], "kinds": [...], "modules": [...],
   "time": unix seconds, "start_step": S}                            -- once per writer opened (a resumed run appends
                                                                        a second one; Note [one run per log])
  {"type": "record", "seq", "step", "module", "kind", "index", "dtype", "stats": {field: value},
   "histogram": null | {"length": L, "nonzero": [[i, count], ...]}}  -- one per recorded tensor; histograms sparse
  {"type": "scalar", "seq", "step", "tag", "value"}                  -- one per Monitor.log()

`read_jsonl(path)` gives back the run header, the records (histograms as dense lists) and the scalars, skipping a
last line cut short by a kill.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Iterable, NamedTuple, Optional

import numpy as np

from .._fields import FIELDS, STATS, decode_record, encode_record
from .._fields import dec_float as _dec_float
from .._fields import enc_float as _enc_float
from .resume import check_resume, plain


def _row_template() -> str:
    """A stats row's JSON, as encode_record writes a finite one (Note [record fields])."""
    return ",".join(f'"{f.name}":%d' if f.kind == "count" else f'"{f.name}":%r' for f in STATS)


_ROW_FIELDS = tuple(f.name for f in FIELDS if f.kind == "identity" and not f.site)  # seq, step: per row
_SITE_FIELDS = tuple(f.name for f in FIELDS if f.site)  # module, kind, index, dtype: per site
assert [f.name for f in FIELDS[:len(_ROW_FIELDS) + len(_SITE_FIELDS)]] == list(_ROW_FIELDS + _SITE_FIELDS), \
    "encode_block writes a record's per-row identity fields, then its per-site ones, then its statistics"


def encode_block(block) -> str:
    """The record lines of a Block, exactly as json.dumps(encode_record(record)) writes them (tested): finite rows
    through one %-template, rows holding NaN/Inf through encode_record."""
    n = len(block)
    if not n:
        return ""
    t = block.table
    sites, inv = np.unique(np.asarray(block.sites, dtype=np.int64), return_inverse=True)
    dumps = json.dumps
    site_vals = [t.column(c)[sites].tolist() for c in _SITE_FIELDS]
    site_part = ["".join(f',"{c}":{dumps(v[k])}' for c, v in zip(_SITE_FIELDS, site_vals)) + ',"stats":{'
                 for k in range(len(sites))]
    row_tmpl = '{"type":"record"' + "".join(f',"{c}":%d' for c in _ROW_FIELDS)
    tmpl = _row_template()
    stats = block.stats
    finite = np.isfinite(stats).all(axis=1)
    if getattr(block, "loc", None) is not None or getattr(block, "ranks", None) is not None:
        finite[:] = False  # records with locations or merged across ranks: each through encode_record
    rows = stats.tolist()
    row_vals = {"seq": range(block.seq0, block.seq0 + n), "step": block.steps.tolist()}
    row_ids = list(zip(*(row_vals[c] for c in _ROW_FIELDS)))
    inv = inv.tolist()
    hg, hr = block.hist_group, block.hist_row
    out = []
    for i in range(n):
        g = int(hg[i])
        if g >= 0:
            h = block.hists[g][int(hr[i])]
            nz = np.flatnonzero(h)
            hist = dumps({"length": int(h.shape[0]), "nonzero": np.stack([nz, h[nz]], 1).tolist()},
                         separators=(",", ":"))
        else:
            hist = "null"
        if finite[i]:
            out.append(f'{row_tmpl % row_ids[i]}{site_part[inv[i]]}{tmpl % tuple(rows[i])}}},"histogram":{hist}}}\n')
        else:
            out.append(dumps(encode_record(block.record(i, rows[i])), allow_nan=False, separators=(",", ":")) + "\n")
    return "".join(out)


class JSONLWriter:
    """Appends a Monitor's records to `path` as JSONL (see the module docstring for the format).

    `fsync=True` (the default) makes each flush durable on disk, not only in the OS cache: a power loss keeps what a
    kill keeps. Use as `Monitor(model, exporters=[JSONLWriter("runs/x/log.jsonl")])`, or call write() yourself.
    An existing file is appended to only when it is a hookstats JSONL log of the same run (Note [one run per log]):
    anything else is refused, before a line is written.
    """

    def __init__(self, path: str | os.PathLike, fsync: bool = True):
        self.path = os.fspath(path)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self.fsync = fsync
        self._old, self._has_records = _existing(self.path)
        self._f = open(self.path, "a", encoding="utf-8")
        self._began = False

    def _emit(self, objs: Iterable[dict]) -> None:
        if self._f is None:
            raise RuntimeError(f"hookstats.JSONLWriter({self.path!r}) is closed")
        # One write per flush: the lines reach the file together, each one complete.
        text = "".join(json.dumps(o, allow_nan=False, separators=(",", ":")) + "\n" for o in objs)
        self._f.write(text)
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())

    def begin(self, info: dict) -> None:
        """Writes the run header (Monitor calls this when it attaches), after checking that a file being continued
        holds the same run (Note [one run per log]: ValueError otherwise)."""
        check_resume("JSONLWriter", self.path, self._old, info, self._has_records)
        head = {"type": "run", **info, "time": time.time()}
        self._emit([head])
        self._began = True

    def end(self, info: dict) -> None:
        """What the run learned by its end (Monitor.detach(), before close(): nonfinite_ops=True's first non-finite
        op), as a "run_end" line; read_jsonl puts the last one into the header as "end"."""
        self._emit([{"type": "run_end", **plain(info), "time": time.time()}])

    def write_block(self, block, scalars: list[dict] = ()) -> None:
        """One Monitor flush (a columnar Block): the same lines as write(block's records), formatted from the
        columns (a template per row, the site's part encoded once per site), without a dict per record."""
        self._emit_text(encode_block(block) + "".join(
            json.dumps({"type": "scalar", "seq": s["seq"], "step": s["step"], "tag": s["tag"],
                        "value": _enc_float(float(s["value"]))}, allow_nan=False, separators=(",", ":")) + "\n"
            for s in scalars))

    def _emit_text(self, text: str) -> None:
        if self._f is None:
            raise RuntimeError(f"hookstats.JSONLWriter({self.path!r}) is closed")
        if text:
            self._f.write(text)
            self._f.flush()
            if self.fsync:
                os.fsync(self._f.fileno())

    def write(self, records: list[dict], scalars: list[dict] = ()) -> None:
        """Appends record dicts (records()'s form) and scalars, one JSON line each, then flushes the file."""
        objs: list[dict] = [encode_record(r) for r in records]
        objs += [{"type": "scalar", "seq": s["seq"], "step": s["step"], "tag": s["tag"],
                  "value": _enc_float(float(s["value"]))} for s in scalars]
        if objs:
            self._emit(objs)

    def close(self) -> None:
        """Closes the file (a second close does nothing)."""
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> "JSONLWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _existing(path: str):
    """(the first run header, whether any record or scalar line follows) of an existing JSONL log; ({}, False) for a
    new or empty file. Refuses a path that is not a hookstats JSONL log."""
    if os.path.isdir(path):
        raise ValueError(f"hookstats.JSONLWriter: {path!r} is a directory (a Parquet log?), not a JSONL log file")
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return {}, False
    with f:
        head = f.readline(1 << 20)
        if not head.strip():
            if f.read(1):
                raise ValueError(f"hookstats.JSONLWriter: {path!r} is not a hookstats JSONL log (it does not begin "
                                 "with a run header line): a writer writes only into its own log; give it a new path")
            return {}, False
        try:
            d = json.loads(head)
        except (UnicodeDecodeError, ValueError):
            d = None
        if not isinstance(d, dict) or d.get("type") != "run":
            raise ValueError(f"hookstats.JSONLWriter: {path!r} is not a hookstats JSONL log (its first line is not a "
                             "run header): a writer writes only into its own log; give it a new path")
        more = False
        for line in f:
            if b'"type":"run"' not in line and line.strip():
                more = True
                break
    return {k: v for k, v in d.items() if k != "type"}, more


class RunLog(NamedTuple):
    info: dict  # the first run header ({} when the file has none)
    records: list
    scalars: list
    bad_lines: int  # lines that were not valid JSON (a last line cut short by a kill)


def read_jsonl(path: str | os.PathLike) -> RunLog:
    """Reads a JSONLWriter file back: records with dense histograms and floats restored, in file order."""
    info: dict[str, Any] = {}
    end: Optional[dict] = None  # the last run_end line's (JSONLWriter.end)
    records, scalars, bad = [], [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            t = d.get("type")
            if t == "record":
                records.append(decode_record(d))
            elif t == "scalar":
                scalars.append({"seq": d["seq"], "step": d["step"], "tag": d["tag"], "value": _dec_float(d["value"])})
            elif t == "run" and not info:
                info = {k: v for k, v in d.items() if k != "type"}
            elif t == "run_end":
                end = {k: v for k, v in d.items() if k != "type"}
    if end is not None:
        info = {**info, "end": end}
    return RunLog(info, records, scalars, bad)


__all__ = ["JSONLWriter", "RunLog", "read_jsonl", "encode_record", "decode_record", "encode_block"]
