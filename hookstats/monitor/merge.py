"""A flush's records merged across the ranks of a process group, in one all_gather (Note [merging records across
ranks] below): `pack` a rank's Block into one float64 buffer, `Gather` it (asynchronously where the backend allows),
`combine` every rank's buffers into the merged Block, the same on every rank.

Note [merging records across ranks]
With `Monitor(..., process_group=pg)`, `flush()` is a collective: every rank of pg calls it at the same points
(flush(), step() with flush_every, detach()). A record is keyed by (step, hook, tensor index, call number): the
hook ids are the same on every rank (the Monitor attaches its hooks in module order), and calls are numbered per
rank (Note [monitor sites]), so that the 3rd call of a module on rank 1 merges with the 3rd call on rank 0 if there
is one. A flush packs this rank's records (key, dtype, histogram length, location indices, the 13 statistics, then
the histogram rows and the shapes) into one float64 buffer (`pack`, below) and all_gathers the
buffers, each padded to a capacity agreed before (the largest payload seen, rounded up to a power of two; a payload
over it makes the flush send again at the new capacity: two collectives then, at the first flush and when records
grow). Each rank then combines the same buffers in the same order, so every rank holds the same merged records:
  - a record combines the ranks that wrote it: counts summed, statistics of the concatenation of their tensors
    (max / min / linf over the ranks with values; numel, sum, l1, NaN / Inf / zero counts summed; l2 as L sqrt(sum
    (l2_r / L)^2) with L the merged linf, so squares neither overflow nor underflow; the variance combined around
    the merged mid-range c, sum((n_r - 1) std_r^2 + n_r (mean_r - c)^2), not as E[x^2] - mean^2, so |mean| >> std
    costs little); histograms summed (exact in int64). `ranks` says how many ranks wrote it. A record that no rank
    wrote does not exist. Sums run in rank order: the merge is deterministic.
  - replicated records (the grad kind under DDP: Note [grad records across ranks]) are the lowest rank's row,
    counted once; replicas that differ are counted (Monitor.replica_mismatches) and warned about.
  - `nonfinite_ranks`: the ranks whose tensor held a NaN or Inf (a bitmask of ranks 0-62 in the Block). With
    locations=True the record names one element and its rank (`location_rank`): on the lowest rank with a NaN/Inf,
    else on the rank holding the largest |x|; coordinates and `shape` are that rank's tensor's.
  - what cannot be merged raises MergeError on every rank at the same flush (each rank computes from the same
    buffers): Monitors that differ (hook names, kinds, histogram or locations settings: a signature in each
    buffer's header), or one record with different dtypes or histogram lengths on different ranks. That flush's
    records are dropped and counted (Monitor.merge_failures, dropped_records); the rows were reset, so the next
    flush merges normally, and detach() detaches whatever a flush raises.
With flush_every, step()'s flush starts the all_gather asynchronously and returns; the merge ends at the next
flush, or at a read (records(), summary(), first_nonfinite(), table()): a read waits for the gather only, never
starts a collective (a payload that must be sent again waits for the next flush).
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import torch

from .._fields import DTYPES, STAT_INDEX, STATS, STATS_FIELDS
from .block import Block, gather_rows
from .sites import SiteTable

_NF = len(STATS_FIELDS)
_F = STAT_INDEX
_DTYPES = tuple(d.name for d in DTYPES)  # a dtype's code: its place here
# Per record: step, hook, index, call, dtype code, histogram length (0: none), ndim, argmax_abs and first_nonfinite
# flat indices (-1: none or no locations), then the 13 statistics.
_KEYS = ("step", "hook", "index", "call", "dtype", "hlen", "ndim", "argmax", "nonfinite")
_K = len(_KEYS)
_ROW = _K + _NF
_HEAD = 4  # payload length, records, signature, locations flag
INITIAL_CAPACITY = 4096  # float64 per rank (32 KB): a flush of ~180 records without histograms fits


class MergeError(RuntimeError):
    """Ranks recorded what cannot be merged (different models or Monitor settings, or one record with different
    dtypes or histograms on different ranks). Every rank raises it at the same flush; that flush's records are
    dropped (Monitor.merge_failures counts them) and the next flush merges normally."""


def _dtype_code(name: str) -> int:
    return _DTYPES.index(name) if name in _DTYPES else 100 + zlib.crc32(name.encode()) % 1000


def _dtype_name(code: int) -> str:
    return _DTYPES[code] if code < len(_DTYPES) else f"dtype#{code}"


def pack(block: Block, locations: bool) -> np.ndarray:
    """A rank's records as one float64 buffer: [n, _ROW] rows, then the histogram rows (by length, in row order),
    then the shapes (with locations). float64 holds every integer here exactly (< 2^53)."""
    t, n = block.table, len(block)
    sites = np.asarray(block.sites, dtype=np.int64)
    rows = np.empty((n, _ROW))
    rows[:, 0] = block.steps
    rows[:, 1] = t.hook[sites]
    rows[:, 2] = t.index[sites]
    rows[:, 3] = t.call[sites]
    codes = np.array([_dtype_code(d) for d in t.dtypes] or [0], dtype=np.int64)
    rows[:, 4] = codes[sites]
    g = np.asarray(block.hist_group, dtype=np.int64)
    lens = np.array([h.length for h in block.hists] + [0], dtype=np.int64)
    rows[:, 5] = lens[g]  # g = -1: the trailing 0
    if locations:
        rows[:, 6] = block.shape_ndim
        rows[:, 7:9] = block.loc
    else:
        rows[:, 6] = 0
        rows[:, 7:9] = -1
    rows[:, _K:] = block.stats
    parts = [rows.reshape(-1)]
    for L in sorted(set(lens[g[g >= 0]].tolist())):
        sel = np.flatnonzero(rows[:, 5] == L)
        dense = np.empty((len(sel), L))
        for gi in np.unique(g[sel]).tolist():  # one group per length on one device
            s = g[sel] == gi
            dense[s] = block.hists[gi][np.asarray(block.hist_row)[sel[s]]]
        parts.append(dense.reshape(-1))
    if locations:
        parts.append(np.asarray(block.shape_dims, dtype=np.float64))
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


class Gather:
    """One all_gather of every rank's packed buffer, each padded to a capacity the ranks agreed on before (the
    largest payload seen, rounded up to a power of two). A payload over it is found when the gather ends (every rank
    sees every rank's length) and sent again, once, at the new capacity: then the flush costs two collectives."""

    def __init__(self, group, device: torch.device, payload: np.ndarray, n: int, sig: float, locations: bool,
                 capacity: int, async_op: bool):
        import torch.distributed as dist

        self.group, self.device, self.payload, self.n = group, device, payload, n
        self.sig, self.locations = sig, locations
        self.world = dist.get_world_size(group)
        self.capacity = capacity
        self._start(async_op)

    def _start(self, async_op: bool) -> None:
        import torch.distributed as dist

        cap = self.capacity
        chunk = np.zeros(_HEAD + cap)
        p = self.payload
        chunk[:_HEAD] = (len(p), self.n, self.sig, float(self.locations))
        k = min(len(p), cap)
        chunk[_HEAD:_HEAD + k] = p[:k]
        self.send = torch.from_numpy(chunk).to(self.device)
        self.recv = torch.empty(self.world * (_HEAD + cap), dtype=torch.float64, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # all_gather_into_tensor's newer name
        self.work = gather(self.recv, self.send, group=self.group, async_op=async_op)
        self.done = not async_op

    def wait(self) -> None:
        if not self.done:
            self.work.wait()
            self.done = True

    def overflow(self) -> int:
        """0 when every payload fitted, else the largest payload length (every rank computes the same)."""
        self.wait()
        head = self.recv.view(self.world, -1)[:, 0].cpu().numpy()
        m = int(head.max())
        return m if m > self.capacity else 0

    def resend(self, capacity: int) -> None:
        """The gather again at a capacity that holds every payload (a collective: every rank calls it together)."""
        self.capacity = capacity
        self._start(async_op=False)

    def chunks(self) -> list:
        self.wait()
        all_ = self.recv.cpu().numpy().reshape(self.world, _HEAD + self.capacity)
        return [(all_[r, :_HEAD], all_[r, _HEAD:_HEAD + int(all_[r, 0])]) for r in range(self.world)]


def capacity_for(length: int) -> int:
    return max(INITIAL_CAPACITY, 1 << max(0, int(length) - 1).bit_length())


class Merged:
    """The merged columns, for merging.MergeSession to turn into a Block against its merged site table."""

    __slots__ = ("steps", "hook", "index", "call", "dtype", "stats", "hists", "hist_len", "ranks", "nonfinite_mask",
                 "loc", "shape_ndim", "shape_dims", "location_rank", "replica_mismatches")


def combine(chunks: list, sig: float, modes: np.ndarray, hook_names: list) -> Merged:
    """Every rank's (head, payload) into the merged records (Note [merging records across ranks]). Raises MergeError
    (on every rank alike: each computes from the same chunks) for what cannot be merged."""
    world = len(chunks)
    counts = [int(h[1]) for h, _ in chunks]
    sigs = [h[2] for h, _ in chunks]
    if -1.0 in sigs:
        raise MergeError(f"hookstats.Monitor(process_group=...) records tensors of one device per rank; rank "
                         f"{sigs.index(-1.0)} recorded tensors on several: records of this flush "
                         f"({', '.join(f'rank {r}: {c}' for r, c in enumerate(counts))}) were dropped.")
    if any(s != sig for s in sigs):
        raise MergeError(
            "hookstats.Monitor: ranks' Monitors differ (other models, hooks, kinds or histogram settings: signatures "
            f"{[int(s) for s in sigs]}); records of this flush ({', '.join(f'rank {r}: {c}' for r, c in enumerate(counts))}"
            ") were dropped. Every rank must attach the same Monitor to the same model.")
    locations = bool(chunks[0][0][3])
    parts = []
    for r, (h, p) in enumerate(chunks):
        n = int(h[1])
        rows = p[:n * _ROW].reshape(n, _ROW)
        off = n * _ROW
        hlen = rows[:, 5].astype(np.int64)
        hists = {}
        hidx = np.full(n, -1, dtype=np.int64)
        for L in sorted(set(hlen[hlen > 0].tolist())):
            sel = np.flatnonzero(hlen == L)
            hists[L] = p[off:off + len(sel) * L].reshape(len(sel), L)
            hidx[sel] = np.arange(len(sel))
            off += len(sel) * L
        ndim = rows[:, 6].astype(np.int64)
        dims = p[off:off + int(ndim.sum())].astype(np.int64) if locations else np.empty(0, dtype=np.int64)
        parts.append((rows, hists, hidx, ndim, dims))
    rows = np.concatenate([pr[0] for pr in parts]) if parts else np.empty((0, _ROW))
    rank = np.concatenate([np.full(len(pr[0]), r, dtype=np.int64) for r, pr in enumerate(parts)])
    pos = np.concatenate([np.arange(len(pr[0]), dtype=np.int64) for pr in parts])
    out = Merged()
    N = len(rows)
    key = rows[:, :4].astype(np.int64)
    n0 = counts[0]
    # the usual case: every rank wrote the same records in the same order (a [world, n] layout, no grouping)
    aligned = all(c == n0 for c in counts) and all(np.array_equal(key[:n0], key[r * n0:(r + 1) * n0])
                                                   for r in range(1, world))
    if aligned:
        uniq, gid = key[:n0], np.tile(np.arange(n0, dtype=np.int64), world)
        o = np.arange(N, dtype=np.int64).reshape(world, n0).T.reshape(-1)
        first = np.arange(n0, dtype=np.int64)
    elif N:
        uniq, gid = np.unique(key, axis=0, return_inverse=True)
        gid = gid.reshape(-1)
    else:
        uniq, gid = np.empty((0, 4), dtype=np.int64), np.empty(0, dtype=np.int64)
    G = len(uniq)
    if not aligned:
        o = np.lexsort((rank, gid))  # rows by record, then rank: every sum below runs in rank order
        first = o[np.searchsorted(gid[o], np.arange(G))] if G else np.empty(0, dtype=np.int64)
    # dtype and histogram length must agree within a record
    for col, what in ((4, "dtype"), (5, "histogram length")):
        v = rows[:, col]
        bad = np.flatnonzero(v != v[first[gid]])
        if len(bad):
            i = int(bad[0])
            j = int(first[gid[i]])
            name, kind = hook_names[int(key[i, 1])]
            fmt = (lambda x: _dtype_name(int(x))) if col == 4 else (lambda x: str(int(x)))
            raise MergeError(
                f"hookstats.Monitor: step {int(key[i, 0])}, module {name or '<model>'}, kind {kind}, index "
                f"{int(key[i, 2])}, call {int(key[i, 3])} has {what} {fmt(rows[j, col])} on rank {int(rank[j])} and "
                f"{fmt(rows[i, col])} on rank {int(rank[i])}: records of this flush "
                f"({', '.join(f'rank {r}: {c}' for r, c in enumerate(counts))}) were dropped.")
    # merged records in step order, then by their place on the first rank that wrote them
    order = np.lexsort((rank[first], pos[first], key[first, 0])) if G else np.empty(0, dtype=np.int64)
    remap = np.empty(G, dtype=np.int64)
    remap[order] = np.arange(G)
    gid = remap[gid]
    first = first[order]
    uniq = uniq[order]
    st = rows[:, _K:]
    rep = modes[key[first, 1]] == 1 if G else np.zeros(0, dtype=bool)  # replicated records: rank first's row
    out.steps, out.hook, out.index, out.call = uniq[:, 0], uniq[:, 1], uniq[:, 2], uniq[:, 3]
    out.dtype = rows[first, 4].astype(np.int64)
    out.ranks = np.bincount(gid, minlength=G).astype(np.int64)
    bad_rank = (st[:, _F["nan_count"]] + st[:, _F["inf_count"]]) > 0
    mask = np.zeros(G, dtype=np.int64)
    bits = np.where(bad_rank & (rank < 63), np.left_shift(np.int64(1), np.minimum(rank, 62)), 0).astype(np.int64)
    np.bitwise_or.at(mask, gid, bits)
    out.nonfinite_mask = mask
    stats = _merge_stats(st, gid, o, G, world if aligned and not (order != np.arange(G)).any() else 0)
    stats[rep] = st[first[rep]]
    mism = 0
    if rep.any():
        rows_rep = rep[gid]
        a, b = st[rows_rep], st[first[gid[rows_rep]]]
        diff = ~((a == b) | (np.isnan(a) & np.isnan(b))).all(axis=1)
        mism = len(np.unique(gid[rows_rep][diff]))
    out.stats = stats
    # histograms: summed over the ranks (exact in int64), the first rank's for replicated records
    hlen = rows[first, 5].astype(np.int64)
    out.hist_len = hlen
    out.hists = {}
    hidx_all = np.concatenate([pr[2] for pr in parts]) if parts else np.empty(0, dtype=np.int64)
    for L in sorted(set(hlen[hlen > 0].tolist())):
        gsel = np.flatnonzero(hlen == L)
        slot = np.full(G, -1, dtype=np.int64)
        slot[gsel] = np.arange(len(gsel))
        acc = np.zeros((len(gsel), L), dtype=np.int64)
        for r, pr in enumerate(parts):
            if L not in pr[1]:
                continue
            sel = np.flatnonzero((rank == r) & (rows[:, 5] == L))
            tgt = slot[gid[sel]]
            contrib = pr[1][L][hidx_all[sel]].round().astype(np.int64)
            keep = ~rep[gid[sel]] | (first[gid[sel]] == sel)
            np.add.at(acc, tgt[keep], contrib[keep])
        out.hists[L] = (gsel, acc)
    out.replica_mismatches = mism
    # locations: the element on one rank, the first with a NaN/Inf, else the one holding the largest |x|
    out.loc = out.shape_ndim = out.shape_dims = out.location_rank = None
    if locations:
        lin = st[:, _F["linf"]]
        has = st[:, _F["numel"]] > 0
        glinf = stats[gid, _F["linf"]]
        score = np.where(bad_rank, 3, np.where(has & (lin == glinf), 2, np.where(has, 1, 0)))
        best = np.full(G, -1, dtype=np.int64)
        for s in (0, 1, 2, 3):  # the highest score wins, the lowest rank within it (o runs by rank)
            sel = o[score[o] == s]
            if len(sel):
                g_s = gid[sel]
                firsts = np.unique(g_s, return_index=True)[1]
                best[g_s[firsts]] = sel[firsts]
        best[rep] = first[rep]
        out.location_rank = rank[best]
        out.loc = rows[best, 7:9].astype(np.int64)
        out.shape_ndim = np.concatenate([pr[3] for pr in parts])[best] if G else np.empty(0, dtype=np.int64)
        dims_by_row = []
        for pr in parts:
            off = np.zeros(len(pr[3]) + 1, dtype=np.int64)
            np.cumsum(pr[3], out=off[1:])
            dims_by_row += [pr[4][off[i]:off[i + 1]] for i in range(len(pr[3]))]
        out.shape_dims = (np.concatenate([dims_by_row[int(b)] for b in best]) if G and out.shape_ndim.sum()
                          else np.empty(0, dtype=np.int64))
    return out


# Note [record fields]: a statistic merges by its field's rule, "sum" (added over the ranks, in rank order) or one of
# the others here (_merge_stats); tests/test_fields.py checks that every field's rule is one of these.
RULES = ("sum", "mean", "var", "std", "l2", "linf", "min", "max")
_SUMMED = tuple(f.name for f in STATS if f.merge == "sum")


def _merge_stats(st: np.ndarray, gid: np.ndarray, o: np.ndarray, G: int, world: int = 0) -> np.ndarray:
    """The 13 statistics of each record's concatenation over its ranks (Note [merging records across ranks]).
    world > 0: the rows are [world, G] rank-major, record g of every rank at row r G + g (reduced along ranks, in
    rank order); else grouped by gid, o ordering the rows by (record, rank)."""
    F = _F
    if world:
        s = st

        def reduce(fn, v, init):
            return fn.reduce(v.reshape((world, G) + v.shape[1:]), axis=0)
    else:
        gid_o, s = gid[o], st[o]

        def reduce(fn, v, init):
            out = np.full((G,) + v.shape[1:], init)
            fn.at(out, gid_o, v)
            return out
    cnt, nan = s[:, F["numel"]], s[:, F["nan_count"]]
    no_value = (cnt == 0) | (nan > 0)
    gmax = reduce(np.maximum, np.where(no_value, -math.inf, s[:, F["max"]]), -math.inf)
    gmin = reduce(np.minimum, np.where(no_value, math.inf, s[:, F["min"]]), math.inf)
    glinf = reduce(np.maximum, np.where(no_value, 0.0, s[:, F["linf"]]), 0.0)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        L = np.where(np.isfinite(glinf) & (glinf > 0), glinf, 1.0)
        c = np.where(np.isfinite(gmax) & np.isfinite(gmin), 0.5 * gmax + 0.5 * gmin, 0.0)
        Lr, cr = (np.tile(L, world), np.tile(c, world)) if world else (L[gid_o], c[gid_o])
        sd = s[:, F["std"]] / Lr
        m2 = np.where(cnt >= 2, sd * sd * (cnt - 1), 0.0)
        dm = np.where(cnt >= 1, (s[:, F["mean"]] - cr) / Lr, 0.0)
        l2s = s[:, F["l2"]] / Lr
        add = np.stack([s[:, F[f]] for f in _SUMMED] + [l2s * l2s, m2 + cnt * dm * dm], 1)
        *summed, L2s, M2c = reduce(np.add, add, 0.0).T
        tot = dict(zip(_SUMMED, summed))
        N, S, NAN, INF = tot["numel"], tot["sum"], tot["nan_count"], tot["inf_count"]
        gmean = np.where(N > 0, S / np.maximum(N, 1), math.nan)
        d = (gmean - c) / L
        std = L * np.sqrt(np.maximum(M2c - N * d * d, 0) / np.maximum(N - 1, 1))
        std = np.where((N < 2) | (NAN > 0) | (INF > 0), math.nan, std)
        l2 = np.where(INF > 0, math.inf, L * np.sqrt(L2s))
    has_nan, empty = NAN > 0, N == 0
    rules = {"sum": tot, "mean": gmean, "var": std * std, "std": std, "l2": np.where(has_nan, math.nan, l2),
             "linf": np.where(has_nan, math.nan, glinf), "min": np.where(has_nan | empty, math.nan, gmin),
             "max": np.where(has_nan | empty, math.nan, gmax)}
    assert set(rules) == set(RULES)
    out = np.empty((G, _NF))
    for f in STATS:
        out[:, F[f.name]] = tot[f.name] if f.merge == "sum" else rules[f.merge]
    return out


def hist_rows(dense: np.ndarray):
    """Dense [k, L] int64 rows as HistRows (their nonzero columns)."""
    k = len(dense)
    return gather_rows(dense[None], np.zeros(k, dtype=np.int64), np.arange(k, dtype=np.int64))


def signature(parts) -> float:
    crc = 0
    for m in parts:
        crc = zlib.crc32(repr(m).encode(), crc)
    return float(crc)


class MergedSites(SiteTable):
    """The site table of merged Blocks: the sites of every rank (a rank holds the sites it recorded, a merged
    record may come from another rank's), numbered in the order they are first merged, the same on every rank.
    Shares the hook names of the rank's own table (the same on every rank: the signature checks it)."""

    def __init__(self, hook_names: list):
        super().__init__()
        self.hook_names = hook_names
        self._ids: dict = {}

    def ids(self, hook, index, call, dtype) -> np.ndarray:
        keys = list(zip(np.asarray(hook).tolist(), np.asarray(index).tolist(), np.asarray(call).tolist(),
                        np.asarray(dtype).tolist()))
        out = np.empty(len(keys), dtype=np.int64)
        new = []
        for i, k in enumerate(keys):
            sid = self._ids.get(k)
            if sid is None:
                sid = self._ids[k] = self._n + len(new)
                new.append(k)
            out[i] = sid
        if new:
            arr = np.array(new, dtype=np.int64).reshape(-1, 4)
            add = {"hook": arr[:, 0], "index": arr[:, 1], "call": arr[:, 2]}
            for c in self._cols:
                col = add.get(c, np.full(len(new), -1, dtype=np.int64))
                self._cols[c] = np.concatenate([self._cols[c], col])
            self.dtypes.extend(_dtype_name(int(k[3])) for k in new)
            self._n += len(new)
        return out
