"""The host side of the site table (Note [monitor sites] in csrc/monitor/recorder.h): which (module, kind, tensor
index, call number, dtype) each site id stands for, and where its rows are. Kept once, as columns; a record is a
(step, site id) pair and carries no metadata of its own."""
from __future__ import annotations

import numpy as np

from .._fields import DTYPE_NAMES

_INT_COLS = ("hook", "index", "call", "dev", "row", "hgroup", "hrow")


class SiteTable:
    def __init__(self):
        self.hook_names: list[tuple[str, str]] = []  # hook id -> (module or parameter name, kind)
        self.dtypes: list[str] = []
        self._n = 0
        self._cols = {c: np.empty(0, dtype=np.int64) for c in _INT_COLS}

    def add_hook(self, hid: int, name: str, kind: str) -> None:
        assert hid == len(self.hook_names), (hid, len(self.hook_names))
        self.hook_names.append((name, kind))

    def __len__(self) -> int:
        return self._n

    def __getattr__(self, name: str):
        cols = self.__dict__.get("_cols")
        if cols is not None and name in cols:
            return cols[name]
        raise AttributeError(name)

    def sync(self, recorder) -> None:
        """Pulls the sites the recorder created since the last sync."""
        new = recorder.sites_from(self._n)
        if not new:
            return
        arr = np.array([s[:3] + s[4:] for s in new], dtype=np.int64).reshape(-1, 7)
        for j, c in enumerate(_INT_COLS):
            self._cols[c] = np.concatenate([self._cols[c], arr[:, j]])
        self.dtypes.extend(DTYPE_NAMES.get(s[3], s[3]) for s in new)  # c10's name -> the record's
        self._n += len(new)

    def column(self, name: str) -> np.ndarray:
        """A column over all sites: module, kind (object arrays of str), index, call, dtype."""
        if name in ("module", "kind"):
            j = 0 if name == "module" else 1
            names = np.array([n[j] for n in self.hook_names] or [""], dtype=object)
            return names[self._cols["hook"]]
        if name == "dtype":
            return np.array(self.dtypes, dtype=object)
        return self._cols[name]
