"""hookstats under torch.distributed, with real process groups: 2 ranks on the CPU, gloo on 127.0.0.1.

Two launches (tests/dist_helpers.py, one module-scoped fixture each) hold every check, since starting the ranks
costs most of the time here (importing torch; DDP imports torch._dynamo):
  "monitor"   Monitor(process_group="world") on plain models and on a pass-through module fed chosen per-rank
              tensors: merged records against hookstats.reference of the concatenation of what each rank's hook
              saw (Note [merging records across ranks] in hookstats/monitor/merge.py), histograms, identical records
              on every rank, exporters on rank 0 only, flush_every, and ranks that recorded different tensors.
  "parallel"  DDP: Monitor records of the whole batch, clip_grad_norm_ against torch.nn.utils on an unsharded copy
              trained on the whole batch, no collective for plain grads. FSDP2 (fully_shard per Linear and the root,
              uneven shards and an empty shard): total norms, clip_grad_norm_, clip_grads_with_norm_,
              clip_grad_value_ against the unsharded copy, one all_reduce each; Monitor grad records of the full
              grads. DTensors with Replicate / Shard / Partial placements.
The ranks only compute and save (torch.save, a file per rank); the asserts run here. Each launch has a deadline: a
rank that hangs fails these tests instead of hanging the run.

Tolerances: tests/_testing.py's, for the recorded tensor's dtype (merged statistics must be as close to the
reference as single-process ones); float64 models throughout where a reference model is involved, so that the
sharded and unsharded computations agree to ~1e-15 and 1e-12 relative bounds can be asserted.
"""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import hookstats
from hookstats import reference

import dist_helpers
from _testing import stats_mismatches, tol_for

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend",
)

HELPERS = Path(dist_helpers.__file__)
WORLD = dist_helpers.WORLD
DEADLINE_S = 180.0  # per launch; each takes ~20-30 s on a loaded 2-core machine
EXP = hookstats.Histogram.exponent()
RANGE = hookstats.Histogram.range(8, -2.0, 2.0)
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------------------------
# Launches


class Run(SimpleNamespace):
    """A launch and what its ranks saved."""

    def section(self, name: str) -> list[dict]:
        """Each rank's results of one section; fails the test with the ranks' output when a rank has none."""
        got = []
        for rank, res in enumerate(self.results):
            sec = None if res is None else res.get(name)
            if sec is None:
                pytest.fail(f"rank {rank} saved no results for section {name!r}:\n{self.launch.describe()}")
            if not sec["ok"]:
                pytest.fail(f"section {name!r} raised on rank {rank}:\n{sec['error']}")
            got.append(sec)
        return got


def _run(scenario: str, tmp_path_factory) -> Run:
    out = tmp_path_factory.mktemp(f"dist_{scenario}")
    launch = dist_helpers.launch(HELPERS, [scenario, str(out)], out, world=WORLD, timeout=DEADLINE_S)
    return Run(launch=launch, results=dist_helpers.load_results(out, WORLD), out=out)


@pytest.fixture(scope="module")
def monitor_run(tmp_path_factory) -> Run:
    return _run("monitor", tmp_path_factory)


@pytest.fixture(scope="module")
def parallel_run(tmp_path_factory) -> Run:
    return _run("parallel", tmp_path_factory)


@pytest.fixture(scope="module")
def per_sample_run(tmp_path_factory) -> Run:
    return _run("per_sample", tmp_path_factory)


# ---------------------------------------------------------------------------------------------------------------
# Comparisons


def key(rec: dict) -> tuple:
    return rec["step"], rec["module"], rec["kind"], rec["index"]


def as_stats(rec: dict) -> SimpleNamespace:
    return SimpleNamespace(**{f: torch.tensor(float(v), dtype=torch.float64) for f, v in rec["stats"].items()})


def check_record(rec: dict, parts: list, hist=None, where: str = "") -> list[str]:
    """Mismatches of a merged record against the reference statistics (and histogram) of the concatenation of
    `parts` (what each rank saw)."""
    x = torch.cat([p.reshape(-1) for p in parts])
    dtype = DTYPES[rec["dtype"]]
    bad = []
    if x.dtype != dtype:
        bad.append(f"dtype {rec['dtype']}, the tensors are {x.dtype}")
    bad += stats_mismatches(as_stats(rec), reference.stats(x.double()), dtype, tol=tol_for(dtype))
    if hist is not None:
        want = reference.histogram_of(x, hist).tolist()
        if rec["histogram"] != want:
            bad.append(f"histogram {rec['histogram']}, expected {want}")
    elif rec["histogram"] is not None:
        bad.append("a histogram where none was configured")
    return [f"{where or key(rec)}: {b}" for b in bad]


def check_against_seen(records_per_rank: list, seen_per_rank: list, hist=None) -> None:
    """Every merged record (rank 0's) matches the concatenation of what every rank's capture saw under its key, and
    every captured key has a record."""
    records = records_per_rank[0]
    keys = [key(r) for r in records]
    assert len(set(keys)) == len(keys), "duplicate records"
    assert set(keys) == set(seen_per_rank[0]), (
        f"records and captured tensors differ: only recorded {sorted(set(keys) - set(seen_per_rank[0]))}, "
        f"only captured {sorted(set(seen_per_rank[0]) - set(keys))}")
    bad = []
    for rec in records:
        bad += check_record(rec, [seen[key(rec)] for seen in seen_per_rank], hist)
    assert not bad, "merged records differ from the reference:\n  " + "\n  ".join(bad)


def same_value(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def assert_same_on_every_rank(per_rank: list, what: str) -> None:
    for rank in range(1, len(per_rank)):
        assert same_value(per_rank[0], per_rank[rank]), f"{what}: rank {rank} differs from rank 0"


def assert_rel(got: float, want: float, rtol: float, what: str) -> None:
    if math.isnan(want) or math.isinf(want):
        assert same_value(got, want), f"{what}: got {got!r}, expected {want!r}"
    else:
        assert abs(got - want) <= rtol * abs(want), f"{what}: got {got!r}, expected {want!r} (rtol {rtol:g})"


def assert_tensors_close(got: list, want: list, what: str, rtol: float = 1e-10) -> None:
    assert len(got) == len(want), what
    scale = max(float(w.abs().max()) for w in want if w.numel())
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=rtol, atol=1e-13 * scale, msg=lambda m: f"{what}[{i}]: {m}")


# ---------------------------------------------------------------------------------------------------------------
# Monitor merges on plain models


@pytest.mark.parametrize("monitor", ["exp", "range", "f32"])
def test_merged_model_records_match_reference(monitor_run, monitor):
    """Two steps of forward_pre, forward, backward_pre and grad records of a float64 (exp and range histograms) and
    a float32 model (range histogram), each rank with its own data and batch size."""
    ranks = monitor_run.section("model")
    seen = [r["seen32" if monitor == "f32" else "seen64"] for r in ranks]
    records = [r[monitor] for r in ranks]
    assert len(records[0]) == 2 * (4 * 3 + 4)  # 2 steps of 4 modules (the root included) x 3 kinds + 4 grads
    check_against_seen(records, seen, EXP if monitor == "exp" else RANGE)
    kinds = {r["kind"] for r in records[0]}
    assert kinds == {"forward_pre", "forward", "backward_pre", "grad"}
    # records() does not flush when a process group is set (it would be a collective on one rank only)
    assert all(r["records_before_flush"] == [0, 0] for r in ranks)


def test_merged_model_records_are_the_same_on_every_rank(monitor_run):
    ranks = monitor_run.section("model")
    for monitor in ("exp", "range", "f32"):
        assert_same_on_every_rank([r[monitor] for r in ranks], f"{monitor} records")


SPECIAL = [name for name, _ in dist_helpers.special_cases(0)]
SPECIAL_PARAMS = SPECIAL


@pytest.mark.parametrize("case", SPECIAL_PARAMS)
def test_merged_special_tensors(monitor_run, case):
    """One record per case of a pass-through module fed each rank's tensor: NaN or Inf on one rank, empty tensors,
    one element, mean >> std, identical ranks, zeros, huge and tiny values; with the exponent histogram, a range
    histogram and none."""
    ranks = monitor_run.section("special")
    i = ranks[0]["names"].index(case)
    parts = [r["seen"][i] for r in ranks]
    for monitor, hist in (("exp", EXP), ("range", RANGE), ("none", None)):
        recs = [r[monitor] for r in ranks]
        assert [len(x) for x in recs] == [len(SPECIAL)] * WORLD
        rec = recs[0][i]
        assert rec["step"] == i
        bad = check_record(rec, parts, hist, where=f"{case} ({monitor})")
        assert not bad, "\n".join(bad)
        assert_same_on_every_rank([x[i] for x in recs], f"{case} ({monitor})")

    s = ranks[0]["none"][i]["stats"]
    ref = reference.stats(torch.cat(parts).double())
    n = sum(p.numel() for p in parts)
    assert s["numel"] == n
    if case.startswith("nan_on"):
        assert s["nan_count"] == 1
        for f in ("min", "max", "linf", "l2", "var", "std"):
            assert math.isnan(s[f]), f"{f} = {s[f]} with a NaN on one rank"
    elif case == "inf_on_rank1":
        assert (s["inf_count"], s["l2"], s["linf"], s["max"]) == (1, math.inf, math.inf, math.inf)
        assert math.isnan(s["var"]) and math.isnan(s["std"])
    elif case == "-inf_and_+inf":
        assert (s["inf_count"], s["min"], s["max"], s["l2"]) == (2, -math.inf, math.inf, math.inf)
        assert math.isnan(s["var"])
    elif case.startswith("empty_on_rank"):
        assert n == 40 and s["min"] == float(ref.min) and s["max"] == float(ref.max)
    elif case == "empty_on_both":
        assert s["numel"] == 0 and s["sum"] == 0.0 and s["l2"] == 0.0
    elif case in ("one_and_empty",):
        assert s["numel"] == 1 and math.isnan(s["var"])
    elif case == "one_each":
        assert s["var"] == pytest.approx(((2.5 + 1.0) ** 2) / 2, rel=1e-15)  # var of {2.5, -1}: (3.5^2)/2
    elif case == "mean_gg_std_f64":
        # Combined around the merged mid-range, not as E[x^2] - mean^2 (which would lose every digit here)
        assert_rel(s["var"], float(ref.var), 1e-9, f"{case} var")
        assert_rel(s["std"], float(ref.std), 1e-9, f"{case} std")
    elif case == "negative_mean_gg_std":
        # mean / std = 5e10, and the rank means differ by ~std: each rank's mean carries ~1 ulp(5e6) = 9e-10 of
        # rounding, which the between-rank term n (mean_r - c)^2 turns into ~1e-6 of var (2 n |mean_r - c| ulp / var)
        # while one process gets 1e-11. Within _testing's tolerance (checked above); bound it here.
        assert_rel(s["var"], float(ref.var), 2e-5, f"{case} var")
    elif case == "identical":
        assert n == 2 * parts[0].numel() and s["l2"] == pytest.approx(math.sqrt(2) * float(parts[0].norm()), rel=1e-14)
    elif case == "constant_per_rank":
        assert s["var"] == pytest.approx(20 / 19, rel=1e-14)  # ten 5s and ten 7s: sum of squared deviations 20
    elif case == "huge_f64":
        assert math.isfinite(s["l2"]) and s["l2"] > 1e300  # the squares overflow float64; the merge must not
    elif case == "tiny_f64":
        # the squares underflow float64: std stays right (1e-300), var = std^2 is 0, as in one process
        assert s["l2"] > 0 and s["std"] > 0 and s["var"] == 0.0


def test_flush_every_merges_across_ranks(monitor_run):
    """flush_every=2 on a model that records 2 tensors a step: records() shows each rank the merged records of every
    second step, without flushing itself; detach() flushes the rest."""
    ranks = monitor_run.section("flush_every")
    for r in ranks:
        assert r["counts"] == [0, 4, 4, 8, 8, 10]
    check_against_seen([r["records"] for r in ranks], [r["seen"] for r in ranks])
    assert_same_on_every_rank([r["records"] for r in ranks], "flush_every records")


def test_exporters_write_on_rank0_only(monitor_run):
    from hookstats.runlog import read_jsonl

    ranks = monitor_run.section("flush_every")
    log0 = read_jsonl(ranks[0]["path"])
    assert log0.info.get("kinds") == ["forward"]
    assert same_value([{k: r[k] for k in ("step", "module", "kind", "index", "stats")} for r in log0.records],
                      [{k: r[k] for k in ("step", "module", "kind", "index", "stats")} for r in ranks[0]["records"]])
    path1 = Path(ranks[1]["path"])
    assert not path1.exists() or path1.read_text() == "", "rank 1's exporter was written to"


def check_calls(records: list, seen: dict, world_seen: list, hist=None) -> None:
    """forward records merged per call: the k-th record of (step, module) is the concatenation of the k-th call's
    tensors on the ranks that made a k-th call, and says how many ranks did."""
    by_key: dict = {}
    for r in records:
        by_key.setdefault((r["step"], r["module"]), []).append(r)
    keys = set().union(*[set(s) for s in world_seen])
    assert set(by_key) == keys, f"records {sorted(set(by_key) ^ keys)} differ from the calls made"
    bad = []
    for k in sorted(keys):
        ncalls = max(len(s.get(k, [])) for s in world_seen)
        assert len(by_key[k]) == ncalls, f"{k}: {len(by_key[k])} records for {ncalls} calls"
        for c, rec in enumerate(by_key[k]):
            parts = [s[k][c] for s in world_seen if len(s.get(k, [])) > c]
            assert rec["ranks"] == len(parts), f"{k} call {c}: ranks {rec['ranks']}, {len(parts)} ranks called"
            bad += check_record(rec, parts, hist, where=f"{k} call {c}")
    assert not bad, "merged records differ from the reference:\n  " + "\n  ".join(bad)


def test_site_recorded_on_one_rank_merges(monitor_run):
    """The issue's ModuleDict case: step 1 runs "a" on rank 0 and "b" on rank 1; each merged record holds the ranks
    that wrote it (ranks = 1), records() and summary_rows() work on both ranks, rank 0's log holds every site."""
    from hookstats.runlog import read_jsonl

    ranks = monitor_run.section("uneven")
    recs = [r["records"] for r in ranks]
    assert [(r["step"], r["module"], r["ranks"]) for r in recs[0]] == [(0, "a", 2), (0, "b", 2), (1, "a", 1),
                                                                        (1, "b", 1)]
    check_calls(recs[0], ranks[0]["seen"], [r["seen"] for r in ranks], RANGE)
    assert_same_on_every_rank(recs, "uneven records")
    for r in ranks:
        assert [(x["module"], x["records"]) for x in r["summary"]] == [("a", 2), ("b", 2)]
    log = read_jsonl(ranks[0]["path"])
    assert [(x["step"], x["module"], x["ranks"], x["stats"]["numel"]) for x in log.records] == \
        [(x["step"], x["module"], x["ranks"], x["stats"]["numel"]) for x in recs[0]]
    path1 = Path(ranks[1]["path"])
    assert not path1.exists() or path1.read_text() == ""


def test_moe_routing_merges_calls_per_rank(monitor_run):
    """Experts called a different number of times on each rank (and some on one rank only), flush_every=2 (the
    merge's all_gather started by step() and ended by the next flush or read), exponent histograms: each call
    merges with the same-numbered call of the other rank."""
    ranks = monitor_run.section("uneven")
    recs = [r["moe_records"] for r in ranks]
    check_calls(recs[0], ranks[0]["moe_seen"], [r["moe_seen"] for r in ranks], EXP)
    assert_same_on_every_rank(recs, "MoE records")
    assert {r["ranks"] for r in recs[0]} == {1, 2}, "the case should hold calls made on one rank only"
    assert len({r["step"] for r in recs[0]}) == 4


@pytest.mark.parametrize("case", ["extra_record", "other_module"])
def test_different_calls_per_rank_merge(monitor_run, case):
    """Rank 1 calls a module once more, or the ranks call different modules: merged, each record from the ranks
    that wrote it; the next step merges normally."""
    for r in monitor_run.section("mismatch"):
        assert r["errors"][case] is None, r["errors"][case]
        got = [(x["module"], x["ranks"], x["stats"]["numel"]) for x in r["after"][case]["flushed"]]
        want = [("", 2, 8), ("", 1, 4)] if case == "extra_record" else [("0", 1, 4), ("1", 1, 4)]
        assert got == want
        assert r["after"][case]["failures"] == 0


def test_unmergeable_records_raise_then_recover(monitor_run):
    """One record of another dtype on rank 1: MergeError on every rank, naming the record and counting records;
    the flush's records are dropped and counted, and the next step merges normally."""
    for rank, r in enumerate(monitor_run.section("mismatch")):
        err = r["errors"]["other_dtype"]
        assert err is not None, f"rank {rank} merged records of different dtypes"
        assert "kind forward, index 0, call 0 has dtype float64 on rank 0 and float32 on rank 1" in err, err
        assert "rank 0: 2, rank 1: 2) were dropped" in err, err
        after = r["after"]["other_dtype"]
        assert after["error_type"] == "MergeError"
        assert (after["failures"], after["dropped"]) == (1, 2)
        assert [(x["ranks"], x["stats"]["numel"]) for x in after["next"]] == [(2, 8)]


def test_differing_monitors_raise_and_detach_detaches(monitor_run):
    """Monitors with other settings on the ranks: flush() raises on every rank; detach() after that raises again
    (its own flush) but removes the hooks; the group still works."""
    for rank, r in enumerate(monitor_run.section("mismatch")):
        for err in (r["errors"]["other_settings"], r["detach_error"]):
            assert err is not None and "Monitors differ" in err and "rank 0: 1, rank 1: 1" in err, err
        assert r["hooks_after_detach"] == 0
        assert r["failures_settings"] == 2
        assert r["all_reduce_after"] == [float(WORLD)] * 3


def test_rank_on_several_devices_raises_everywhere(monitor_run):
    """A rank whose records are on several devices cannot merge; it still takes part in the gather, so every rank
    raises (none waits in a collective) and the next flush merges."""
    for r in monitor_run.section("mismatch"):
        err = r["errors"]["several_devices"]
        assert err is not None and "rank 1 recorded tensors on several" in err, err
        assert r["several_devices_next"] == [(WORLD, 8)]


@pytest.mark.parametrize("locations", [False, True])
def test_nonfinite_names_the_rank(monitor_run, locations):
    """A NaN put at element (1, 2) on rank 1 at step 1: first_nonfinite() on every rank names step 1, module 1 and
    rank 1 (and with locations the element, on rank 1); the summary's NaN/Inf ranks column says 1."""
    ranks = monitor_run.section("nonfinite")
    for rank, r in enumerate(ranks):
        res = r[locations]
        f = res["first"]
        assert (f["step"], f["module"], f["nonfinite_ranks"], f["stats"]["nan_count"]) == (1, "1", [1], 1)
        want = "step 1, module 1, kind forward, index 0, NaN/Inf on ranks [1]"
        if locations:
            assert f["first_nonfinite_index"] == (1, 2) and f["location_rank"] == 1 and f["shape"] == (4, 5)
            want += ", element (1, 2) on rank 1"
        assert res["str"] == want
        rows = {x["module"]: x for x in res["summary"]}
        assert rows["0"]["nonfinite_ranks"] == [] and rows["1"]["nonfinite_ranks"] == [1]
        assert "NaN/Inf ranks" in res["text"]
        clean = [x for x in res["records"] if x["stats"]["nan_count"] == 0]
        assert clean and all(x["nonfinite_ranks"] == [] for x in clean)
        if locations:  # a clean record names the largest |x|, on the rank holding it, in that rank's shape
            for x in clean:
                t = ranks[x["location_rank"]]["seen"][(x["step"], x["module"])][0]
                assert x["shape"] == tuple(t.shape)
                assert float(t[x["argmax_abs_index"]].abs()) == x["stats"]["linf"], x
        else:
            assert "location_rank" not in f and "shape" not in f
    assert_same_on_every_rank([r[locations]["records"] for r in ranks], "non-finite records")


# ---------------------------------------------------------------------------------------------------------------
# DDP


def test_ddp_monitor_records_are_the_whole_batch(parallel_run):
    """forward and backward_pre records of a DDP model (Monitor on the wrapped module) merge to the statistics of
    the whole batch's tensors; the forward ones also match the unsharded copy run on the whole batch."""
    ranks = parallel_run.section("ddp")
    records = [r["records"] for r in ranks]
    assert len(records[0]) == 2 * 6  # 6 modules (the root included), forward and backward_pre
    check_against_seen(records, [r["seen"] for r in ranks], RANGE)
    assert_same_on_every_rank(records, "DDP records")
    full = ranks[0]["full_forward"]
    fwd = [r for r in records[0] if r["kind"] == "forward"]
    assert len(fwd) == 6
    for rec in fwd:
        ref = reference.stats(full[key(rec)])
        s = rec["stats"]
        assert s["numel"] == int(ref.numel) == 8 * full[key(rec)].shape[1]
        for f in ("sum", "l1", "l2", "linf", "min", "max"):
            assert s[f] == pytest.approx(float(getattr(ref, f)), rel=1e-12, abs=1e-13 * s["l1"]), f


def test_ddp_clip_grad_norm_matches_unsharded(parallel_run):
    ranks = parallel_run.section("ddp")
    for rank, r in enumerate(ranks):
        for p, want in r["ref_totals"].items():
            assert_rel(r["totals"][p], want, 1e-12, f"rank {rank} get_total_norm p={p}")
        assert r["total_dtype"] == "torch.float64"
        assert_rel(r["clip_total"], r["ref_clip_total"], 1e-12, f"rank {rank} clip_grad_norm_ total")
        assert_tensors_close(r["grads"], r["ref_grads"], f"rank {rank} clipped grads")
        # it did clip: by max_norm / (norm + 1e-6), about half
        before = math.sqrt(sum(float(g.square().sum()) for g in r["grads_before"]))
        after = math.sqrt(sum(float(g.square().sum()) for g in r["grads"]))
        assert before == pytest.approx(2 * r["max_norm"], rel=1e-12)
        assert after == pytest.approx(before * r["max_norm"] / (before + 1e-6), rel=1e-12)
        # DDP's grads are plain tensors, the same on every rank: nothing to reduce
        assert r["calls_norm"] == {p: 0 for p in r["ref_totals"]}
        assert r["calls_clip"] == 0
    assert_tensors_close(ranks[1]["grads"], ranks[0]["grads"], "rank 1 vs rank 0 grads", rtol=0)


@pytest.mark.parametrize("how", ["ddp", "opt"])
def test_ddp_grad_records_are_the_optimizers_grads(parallel_run, how):
    """kinds=("grad",) with the Monitor on the DDP module (after DDP's allreduce, once per syncing backward: step 1
    has a no_sync() micro-batch first) or with optimizer=: one record per parameter and step, numel once, the
    statistics of the grads DDP left (the same on both ranks; replicated: counted once), which are the full-batch
    run's grads (to rounding)."""
    ranks = parallel_run.section("ddp_grads")
    names = ranks[0]["names"]
    for rank, r in enumerate(ranks):
        recs = r[how]
        prefix = "module." if how == "ddp" else ""
        assert [(x["step"], x["module"]) for x in recs] == [(s, prefix + n) for s in (0, 1) for n in names]
        bad = []
        for x in recs:
            i = names.index(x["module"][len(prefix):])
            full, got = r["ref_grads"][x["step"]][i], r["grads"][x["step"]][i]
            assert x["ranks"] == WORLD and x["stats"]["numel"] == full.numel(), x["module"]
            bad += check_record(x, [got], where=f"rank {rank} {x['module']} step {x['step']}")
            assert_rel(x["stats"]["l2"], float(full.norm()), 1e-12, f"{x['module']} l2 vs the full-batch run")
        assert not bad, "\n".join(bad)
    assert_same_on_every_rank([r[how] for r in ranks], f"{how} grad records")


def test_ddp_local_grad_records_without_optimizer(parallel_run):
    """Post-accumulate hooks on the module DDP wraps (no optimizer=): each rank's local grads, before DDP's
    allreduce, merged as their concatenation (every accumulation its own call: two on step 1)."""
    ranks = parallel_run.section("ddp_grads")
    recs = ranks[0]["local"]
    assert len(recs) == 4 + 8
    bad = []
    calls: dict = {}
    for x in recs:
        k = (x["step"], x["module"], "grad", 0)
        c = calls[k] = calls.get(k, -1) + 1
        want = [r["local_seen"][k] for r in ranks]  # Capture keeps the last call's tensor
        if x["step"] == 0 or c == 1:
            bad += check_record(x, want, where=str(k))
        assert x["ranks"] == WORLD
    assert not bad, "\n".join(bad)


def test_ddp_find_unused_parameters(parallel_run):
    """A branch used on rank 0 only (find_unused_parameters=True): its forward and backward_pre records come from
    rank 0 (ranks = 1), its grads are DDP's averaged ones (replicated, ranks = 2, numel once)."""
    for r in parallel_run.section("ddp_grads"):
        got = {(x["module"], x["kind"]): x for x in r["unused"]}
        assert got[("module.b", "forward")]["ranks"] == 1 and got[("module.a", "forward")]["ranks"] == 2
        assert got[("module.b", "backward_pre")]["ranks"] == 1
        for n, g in r["unused_grads"].items():
            x = got[(n, "grad")]
            assert x["ranks"] == WORLD and x["stats"]["numel"] == g.numel()
            assert x["stats"]["l2"] == pytest.approx(float(g.norm()), rel=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# FSDP2


def test_fsdp_parameters_are_sharded_unevenly(parallel_run):
    """The premise of the FSDP2 tests: DTensor params and grads, a 7-row weight sharded 4 + 3, and a 1-row weight
    and 1-element bias whose shard on rank 1 is empty."""
    ranks = parallel_run.section("fsdp")
    assert ranks[0]["names"] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert all(r["all_dtensor"] for r in ranks)
    assert ranks[0]["local_shapes"] == [(4, 5), (4,), (3, 7), (3,), (1, 6), (1,)]
    assert ranks[1]["local_shapes"] == [(3, 5), (3,), (3, 7), (3,), (0, 6), (0,)]


@pytest.mark.parametrize("p", [2.0, math.inf, 1.0, 3.0])
def test_fsdp_get_total_norm_matches_unsharded(parallel_run, p):
    for rank, r in enumerate(parallel_run.section("fsdp")):
        assert_rel(r["totals"][p], r["ref_totals"][p], 1e-12, f"rank {rank} get_total_norm p={p}")
        assert r["total_types"][p] == "Tensor", "the total of DTensor grads is a plain tensor"
        assert r["calls_norm"][p] == 1, "one all_reduce over the one sharding mesh dim"


def test_fsdp_clip_grad_norm_matches_unsharded(parallel_run):
    for rank, r in enumerate(parallel_run.section("fsdp")):
        assert_rel(r["clip_total"], r["ref_clip_total"], 1e-12, f"rank {rank} clip_grad_norm_ total")
        assert r["clip_total_type"] == "Tensor"
        assert r["calls_clip"] == 1
        assert_tensors_close(r["clipped"], r["ref_clipped"], f"rank {rank} clipped grads (full_tensor)")
        assert not torch.equal(r["clipped"][0], r["full_grads"][0]), "nothing was clipped"


def test_fsdp_clip_grads_with_norm_matches_unsharded(parallel_run):
    """Given PyTorch's own total of the DTensor grads (a DTensor in PyTorch 2.5+)."""
    for rank, r in enumerate(parallel_run.section("fsdp")):
        assert_tensors_close(r["with_norm"], r["ref_with_norm"], f"rank {rank} grads ({r['torch_total_type']} total)")
        assert not torch.equal(r["with_norm"][0], r["clipped"][0]), "nothing was clipped"


def test_fsdp_clip_grad_value_matches_unsharded(parallel_run):
    for rank, r in enumerate(parallel_run.section("fsdp")):
        assert r["count"] == r["ref_count"] > 0, f"rank {rank}: count {r['count']}, expected {r['ref_count']}"
        assert r["calls_value"] == 1
        assert_tensors_close(r["value_clipped"], r["ref_value_clipped"], f"rank {rank} value-clipped grads")


def test_fsdp_monitor_records_full_grads(parallel_run):
    """Monitor(kinds=("forward", "grad")) attached after fully_shard: each grad record has the full numel and the
    statistics of the whole (unsharded) grad, before clipping; forward records are the whole batch's."""
    ranks = parallel_run.section("fsdp")
    records = ranks[0]["records"]
    assert_same_on_every_rank([r["records"] for r in ranks], "FSDP records")
    grads = {r["module"]: r for r in records if r["kind"] == "grad"}
    assert sorted(grads) == sorted(ranks[0]["names"])
    # with optimizer=: the same full grads (DTensor shards are merged, not taken as replicas)
    opt = {r["module"]: r for r in ranks[0]["opt_records"]}
    assert sorted(opt) == sorted(grads)
    for name, rec in opt.items():
        assert same_value(rec["stats"], grads[name]["stats"]), name
        assert rec["ranks"] == WORLD  # rank 1's empty shards are records too
    bad = []
    for name, full in zip(ranks[0]["names"], ranks[0]["full_grads"]):
        rec = grads[name]
        assert rec["stats"]["numel"] == full.numel(), name
        bad += check_record(rec, [full], where=name)
    assert not bad, "grad records differ from the full grads:\n  " + "\n  ".join(bad)
    fwd = [r for r in records if r["kind"] == "forward"]
    assert len(fwd) == 6
    check_against_seen([fwd], [r["seen"] for r in ranks])


# ---------------------------------------------------------------------------------------------------------------
# DTensor placements


def test_replicated_dtensor_is_counted_once(parallel_run):
    """A Replicate DTensor's norm is its tensor's (not sqrt(world) times it) with no collective; beside a Shard one,
    the total is the norm of the two tensors; clip_grad_value_ counts its elements once; a Monitor record of it has
    its numel once; a Partial DTensor's norm is refused."""
    for rank, r in enumerate(parallel_run.section("placements")):
        t = r["t"]
        assert_rel(r["norm_rep"], float(t.norm()), 1e-14, "Replicate norm")
        assert r["norm_rep_inf"] == float(t.abs().max())
        assert r["calls_rep"] == r["calls_rep_inf"] == 0
        assert_rel(r["norm_rep_sh"], math.sqrt(2) * float(t.norm()), 1e-14, "Replicate + Shard norm")
        assert r["calls_rep_sh"] == 1
        assert r["count_rep"] == int((t.abs() > r["count_cv"]).sum()) == 15
        assert r["calls_count_rep"] == 0
        assert_rel(r["clip_rep_total"], float(t.norm()), 1e-14, "Replicate clip_grad_norm_ total")
        assert_tensors_close([r["clip_rep_grad"]], [t * (0.5 * float(t.norm()) / (float(t.norm()) + 1e-6))],
                             "Replicate clipped grad")
        assert r["partial_error"] is not None and "Partial" in r["partial_error"]
        recs = {x["module"]: x for x in r["records"]}
        assert sorted(recs) == ["rep", "sh"]
        for name in ("rep", "sh"):
            assert recs[name]["stats"]["numel"] == t.numel(), name
            bad = check_record(recs[name], [t], EXP, where=name)
            assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------------------------------
# Real models: transformers Llama and GPT-2 (random weights) under DDP

# Tensors every rank computes whole (not per sample): their merged record holds each rank's copy, numel x WORLD.
# The rotary / position embeddings of the positions, and the loss (each rank's mean).
PER_RANK_WHOLE = {"llama": {("model.rotary_emb", 0), ("model.rotary_emb", 1), ("", 0)},
                  "gpt2": {("transformer.wpe", 0), ("", 0)}}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_real_model_ddp_records_match_full_batch(parallel_run, name):
    """Every forward and grad record of the DDP run (Monitor on the DDP module) equals the single-process run on the
    whole batch, except the tensors each rank computes whole (PER_RANK_WHOLE: numel x WORLD, each rank's copy);
    the clip total equals torch's and the clipped grads the copy's."""
    for rank, r in enumerate(parallel_run.section("models")):
        r = r[name]
        ref = {(x["step"], x["module"], x["kind"], x["index"]): x for x in r["ref_records"]}
        compared, whole, bad = 0, set(), []
        for x in r["records"]:
            if x["module"] == "":  # the DDP wrapper's own forward: the same tensors as "module"'s
                continue
            m = "" if x["module"] == "module" else x["module"][len("module."):]
            y = ref[(x["step"], m, x["kind"], x["index"])]
            assert x["ranks"] == WORLD
            if y["stats"]["numel"] != x["stats"]["numel"]:
                assert x["stats"]["numel"] == WORLD * y["stats"]["numel"], (m, x["kind"], x["index"])
                whole.add((m, x["index"]))
                continue
            compared += 1
            for f in ("numel", "nan_count", "inf_count"):
                if x["stats"][f] != y["stats"][f]:
                    bad.append(f"{m} {x['kind']} {x['index']} {f}: {x['stats'][f]} vs {y['stats'][f]}")
            for f in ("sum", "l1", "l2", "linf", "min", "max", "std"):
                a, b = x["stats"][f], y["stats"][f]
                if abs(a - b) > 1e-10 * max(abs(b), 1e-3 * y["stats"]["linf"]):
                    bad.append(f"{m} {x['kind']} {x['index']} {f}: {a!r} vs {b!r}")
        assert not bad, f"rank {rank}:\n  " + "\n  ".join(bad)
        assert whole == PER_RANK_WHOLE[name]
        grads = [x for x in r["records"] if x["kind"] == "grad"]
        assert len(grads) == len([x for x in r["ref_records"] if x["kind"] == "grad"]) > 10
        assert compared == len(r["records"]) - len(whole) - len([x for x in r["records"] if x["module"] == ""])
        assert_rel(r["clip_total"], r["ref_clip_total"], 1e-12, f"{name} clip total")
        assert r["grad_rel_error"] < 1e-12


def test_one_collective_per_flush(monitor_run):
    """step() with flush_every=1 issues one all_gather (and nothing else) and returns with it pending; records()
    ends it without a collective; a flush that outgrows the agreed capacity sends twice, the next ones once."""
    ag = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"
    for r in monitor_run.section("collectives"):
        assert r["per_step"] == [[ag]] * 3
        assert r["pending"] == [True] * 3
        assert r["read_calls"] == [[]] * 3
        assert r["counts"] == [8, 16, 24]
        assert r["big"] == [[ag] * 2, [ag], [ag]]
        assert r["big_records"] == 17


# ---------------------------------------------------------------------------------------------------------------
# Per-sample clipping under DDP


@pytest.mark.parametrize("how", dist_helpers.CLIP_DDP)
def test_ddp_per_sample_clipping_matches_per_sample_loop(per_sample_run, how):
    """PerSampleGradNorms(max_norm=) inside DDP (Note [clipping under DDP]): the Linear weights' clipped gradients
    delivered through AccumulateGrad (DDP's reducer averages them), the biases' and LayerNorm's autograd gradients
    corrected after DDP's reduction by the all-reduced corrections: every .grad is the average over the ranks of
    each rank's sum of its samples' clipped gradients (a float64 loop, one backward per sample), on both ranks,
    for a plain step and for a step with a no_sync() micro-batch first; the coefficients are each rank's own."""
    ranks = per_sample_run.section("ddp_clip")
    for rank, r in enumerate(ranks):
        got = r[how]
        for step in range(2):
            torch.testing.assert_close(got["coef"][step], got["want_coef"][step], rtol=1e-12, atol=0)
            assert float(got["coef"][step].max()) < 0.1  # every sample clipped: the clip matters
            for name, g, w in zip(got["names"], got["grads"][step], got["want"][step]):
                # the corrected ones: the average of unclipped sums (~30x larger) plus the correction
                torch.testing.assert_close(g, w, rtol=0, atol=1e-12 * float(w.abs().max()),
                                           msg=lambda m: f"rank {rank} step {step} {name}: {m}")
    for a, b in zip(ranks[0][how]["grads"], ranks[1][how]["grads"]):
        for g0, g1 in zip(a, b):
            assert torch.equal(g0, g1)


def test_ddp_per_sample_clipping_refuses_a_comm_hook(per_sample_run):
    for r in per_sample_run.section("ddp_clip"):
        assert "communication hook" in r["comm_hook"], r["comm_hook"]
