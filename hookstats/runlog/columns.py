"""The records of a run as numpy columns, for the report and the plots: from a records table (pyarrow, as read_log and
Monitor.table() give it; the site columns stay dictionary codes) or from record dicts (records(), read_jsonl). The
plots and the report group by integer codes with numpy, so a run of millions of records is read in seconds."""
from __future__ import annotations

import numpy as np

from .._fields import COUNT_FIELDS, STATS_FIELDS
from .schema import HIST_PREFIX, hist_column, hist_columns, table_records


def _is_table(x) -> bool:
    return hasattr(x, "schema") and hasattr(x, "column_names") and hasattr(x, "num_rows")


def _codes(col):
    """(codes int64, names list) of a string or dictionary column of a pyarrow table."""
    import pyarrow as pa

    if pa.types.is_dictionary(col.type):
        col = col.unify_dictionaries() if hasattr(col, "unify_dictionaries") else col
        chunks = col.chunks
        if not chunks:
            return np.empty(0, dtype=np.int64), []
        names = chunks[0].dictionary.to_pylist()
        codes = np.concatenate([c.indices.to_numpy(zero_copy_only=False).astype(np.int64) for c in chunks])
        return codes, names
    enc = col.combine_chunks().dictionary_encode() if col.num_chunks else pa.array([], pa.string()).dictionary_encode()
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64), enc.dictionary.to_pylist()


class Columns:
    """n rows: step, seq (int64), module / kind / dtype codes into module_names / kind_names / dtype_names, and the
    statistics (float64 arrays, `stat(name)`). Histograms: `hist_lengths()`, `hist(length)` -> (rows, counts)."""

    def __init__(self):
        self.n = 0
        self._stats: dict = {}
        self._table = None
        self._records = None

    @classmethod
    def of(cls, records) -> "Columns":
        if isinstance(records, Columns):
            return records
        if _is_table(records):
            return cls.from_table(records)
        return cls.from_records(records)

    @classmethod
    def from_table(cls, t) -> "Columns":
        c = cls()
        c._table = t
        c.n = t.num_rows
        c.step = t.column("step").to_numpy().astype(np.int64) if c.n else np.empty(0, dtype=np.int64)
        c.seq = (t.column("seq").to_numpy().astype(np.int64) if "seq" in t.column_names and c.n
                 else np.arange(c.n, dtype=np.int64))
        c.module, c.module_names = _codes(t.column("module"))
        c.kind, c.kind_names = _codes(t.column("kind"))
        if "dtype" in t.column_names:
            c.dtype, c.dtype_names = _codes(t.column("dtype"))
        else:
            c.dtype, c.dtype_names = np.zeros(c.n, dtype=np.int64), ["float32"]
        return c

    @classmethod
    def from_records(cls, records) -> "Columns":
        records = list(records)
        c = cls()
        c._records = records
        c.n = len(records)
        c.step = np.array([r["step"] for r in records], dtype=np.int64)
        c.seq = np.array([r.get("seq", i) for i, r in enumerate(records)], dtype=np.int64)

        def enc(vals):
            names: dict = {}
            codes = np.array([names.setdefault(v, len(names)) for v in vals], dtype=np.int64)
            return codes, list(names)

        c.module, c.module_names = enc(r["module"] for r in records)
        c.kind, c.kind_names = enc(r["kind"] for r in records)
        c.dtype, c.dtype_names = enc(r.get("dtype") for r in records)
        return c

    def stat(self, name: str) -> np.ndarray:
        v = self._stats.get(name)
        if v is None:
            if self._table is not None:
                if name in self._table.column_names and self.n:
                    v = self._table.column(name).to_numpy().astype(np.float64)
                else:
                    v = np.full(self.n, 0.0 if name in COUNT_FIELDS else np.nan)
            else:
                dflt = 0 if name in COUNT_FIELDS else np.nan
                v = np.array([r["stats"].get(name, dflt) for r in self._records], dtype=np.float64)
            self._stats[name] = v
        return v

    def stats_matrix(self) -> np.ndarray:
        """[n, 13] in STATS_FIELDS order."""
        if not self.n:
            return np.empty((0, len(STATS_FIELDS)))
        return np.stack([self.stat(f) for f in STATS_FIELDS], axis=1)

    def coordinates(self, name: str, row: int):
        """Row's location column `name` ("argmax_abs_index", "first_nonfinite_index", "shape": runs recorded with
        Monitor(locations=True)) as a tuple, or None where the row has none or the run has no such column."""
        if self._table is not None:
            if name not in self._table.column_names:
                return None
            v = self._table.column(name)[int(row)].as_py()
        else:
            v = self._records[int(row)].get(name)
        return None if v is None else tuple(v)

    def first_nonfinite_row(self) -> int:
        """The row of the first record (by step, then seq) whose tensor held a NaN or Inf; -1 when none."""
        rows = np.flatnonzero((self.stat("nan_count") > 0) | (self.stat("inf_count") > 0))
        if not len(rows):
            return -1
        return int(rows[np.lexsort((rows, self.seq[rows], self.step[rows]))[0]])

    def code(self, which: str, name: str) -> int:
        """The code of a module / kind name, -1 when absent."""
        names = self.module_names if which == "module" else self.kind_names
        try:
            return names.index(name)
        except ValueError:
            return -1

    def kind_mask(self, kind: str) -> np.ndarray:
        k = self.code("kind", kind)
        return self.kind == k if k >= 0 else np.zeros(self.n, dtype=bool)

    # -- histograms -----------------------------------------------------------------------------------------------
    def hist_lengths(self) -> list:
        if self._table is not None:
            return [int(c[len(HIST_PREFIX):]) for c in hist_columns(self._table.column_names)
                    if self._table.column(c).null_count < self.n]
        return sorted({len(r["histogram"]) for r in self._records if r.get("histogram") is not None})

    def hist_chunks(self, length: int):
        """(rows, counts [k, length] int64) pieces of the rows that have a histogram of that length."""
        if self._table is not None:
            start = 0
            for ch in self._table.column(hist_column(length)).chunks:
                m = len(ch)
                valid = ~np.asarray(ch.is_null().to_numpy(zero_copy_only=False), dtype=bool)
                rows = np.flatnonzero(valid)
                if len(rows):
                    vals = ch.flatten().to_numpy(zero_copy_only=False)  # the non-null entries, L counts each
                    yield start + rows, np.asarray(vals, dtype=np.int64).reshape(len(rows), length)
                start += m
            return
        rows = [i for i, r in enumerate(self._records) if r.get("histogram") is not None and
                len(r["histogram"]) == length]
        if rows:
            yield np.array(rows, dtype=np.int64), np.array([self._records[i]["histogram"] for i in rows],
                                                            dtype=np.int64)

    def has_hist(self) -> np.ndarray:
        out = np.zeros(self.n, dtype=bool)
        for L in self.hist_lengths():
            for rows, _ in self.hist_chunks(L):
                out[rows] = True
        return out

    def records_at(self, rows: np.ndarray) -> list:
        """Record dicts of the given rows (few of them: what a plot draws in detail), with every field the records
        have (schema.table_records)."""
        rows = np.asarray(rows, dtype=np.int64)
        if self._records is not None:
            return [self._records[i] for i in rows]
        return table_records(self._table.take(rows))


def first_seen(codes: np.ndarray) -> list:
    """The distinct codes in order of first appearance."""
    if not len(codes):
        return []
    u, idx = np.unique(codes, return_index=True)
    return [int(x) for x in u[np.argsort(idx, kind="stable")]]


__all__ = ["Columns", "first_seen"]
