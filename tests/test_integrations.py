"""The framework callbacks in real trainers, on CPU: hookstats.integrations.transformers.HookstatsCallback in a Hugging
Face Trainer and hookstats.integrations.lightning.HookstatsCallback in a Lightning Trainer, training a tiny randomly
initialised GPT-2 (2 layers, n_embd 32, vocab 100) on a small in-memory dataset; and a Monitor with accelerate."""
from __future__ import annotations

import collections
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import hookstats
from hookstats.runlog import read_run

ROOT = Path(__file__).resolve().parents[1]
MAX_NORM = 0.5  # below the tiny GPT-2's gradient norm (~1), so the Trainer's clipping changes every step


@pytest.fixture(autouse=True)
def offline(monkeypatch, one_thread):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_import_hookstats_imports_no_framework():
    code = ("import sys, hookstats, hookstats.integrations, hookstats.export\n"
            "bad = [m for m in ('transformers', 'lightning', 'pytorch_lightning', 'accelerate') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_unwrap_model(tmp_path):
    import torch.distributed as dist

    from hookstats.integrations._common import unwrap_model

    class Compiled(torch.nn.Module):  # what torch.compile returns: the module as _orig_mod
        def __init__(self, m):
            super().__init__()
            self._orig_mod = m

    m = torch.nn.Linear(2, 2)
    assert unwrap_model(m) is m
    assert unwrap_model(torch.nn.DataParallel(m)) is m
    assert unwrap_model(Compiled(torch.nn.DataParallel(m))) is m
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert unwrap_model(torch.nn.parallel.DistributedDataParallel(m)) is m
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face Trainer
# ---------------------------------------------------------------------------------------------------------------

class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int = 48, length: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, 100, (n, length), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def hf_args(out, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=6,
                max_grad_norm=MAX_NORM, logging_steps=3, report_to="none", save_strategy="no", use_cpu=True,
                disable_tqdm=True, seed=0, dataloader_num_workers=0, learning_rate=1e-3)
    base.update(kw)
    return TrainingArguments(**base)


class OptimizerSaw:
    """A step pre-hook on the optimizer: each parameter's grad l2 norm (float64) when optimizer.step() runs."""

    def __init__(self, model, opt):
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.steps: list = []
        opt.register_step_pre_hook(self)

    def __call__(self, opt, args, kwargs):
        self.steps.append({self.names[id(p)]: torch.linalg.vector_norm(p.grad.double()).item()
                           for g in opt.param_groups for p in g["params"] if p.grad is not None})


def per_step(t, kind):
    out = collections.defaultdict(dict)
    for s, m, k, v in zip(*(t.column(c).to_pylist() for c in ("step", "module", "kind", "l2"))):
        if k == kind:
            assert m not in out[s], f"{m} recorded twice at step {s}"
            out[s][m] = v
    return out


def per_batch(kinds=("forward", "backward_pre")) -> collections.Counter:
    """Records a plain Monitor makes in one forward and backward of the model (some modules give several tensors,
    some are never called): what each micro-batch adds to a step."""
    m = gpt2()
    mon = hookstats.Monitor(m, kinds=kinds)
    x = TokenData()[0]["input_ids"][None].repeat(4, 1)
    m(input_ids=x, labels=x).loss.backward()
    return collections.Counter(r["kind"] for r in mon.records())


def count(t):
    return collections.Counter(zip(t.column("step").to_pylist(), t.column("kind").to_pylist()))


def test_trainer_callback_steps_clipping_grads_and_logs(tmp_path):
    from transformers import Trainer

    from hookstats.integrations.transformers import HookstatsCallback

    def trainer(model, out, callbacks=()):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return Trainer(model=model, args=hf_args(out, eval_strategy="steps", eval_steps=2), train_dataset=TokenData(),
                       eval_dataset=TokenData(8, seed=1), optimizers=(opt, None), callbacks=list(callbacks)), opt

    twin = gpt2()  # the same training without the callback
    trainer(twin, tmp_path / "twin")[0].train()
    model = gpt2()
    cb = HookstatsCallback()
    tr, opt = trainer(model, tmp_path / "out", [cb])
    saw = OptimizerSaw(model, opt)
    assert tr.callback_handler.callbacks[0] is cb  # first, so that report_to callbacks see its scalars
    tr.train()

    # the callback changes nothing in the training
    for (n, a), b in zip(twin.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), n
    assert cb.log_path == str(tmp_path / "out" / "hookstats" / "log.parquet")
    run = read_run(tmp_path / "out" / "hookstats")
    t = run.records
    one = per_batch()
    n_par = len(list(model.parameters()))
    c = count(t)
    # one step per optimizer step, 1-based like the Trainer's global_step: each holds both micro-batches' forwards
    # (and no evaluation forward: the Monitor is paused between steps) and the grads once
    assert sorted({s for s, _ in c}) == [1, 2, 3, 4, 5, 6]
    for s in range(1, 7):
        assert c[(s, "forward")] == 2 * one["forward"] and c[(s, "backward_pre")] == 2 * one["backward_pre"]
        assert c[(s, "grad")] == n_par
    # the grads recorded are those the optimizer used: after the Trainer's clipping
    grads = per_step(t, "grad")
    assert len(saw.steps) == 6
    for s, want in enumerate(saw.steps, start=1):
        assert grads[s].keys() == want.keys()
        for name, v in want.items():
            assert math.isclose(grads[s][name], v, rel_tol=2e-6, abs_tol=1e-12), (s, name)
        total = math.sqrt(sum(v * v for v in want.values()))
        assert total <= MAX_NORM * (1 + 1e-5)  # clipped ...
    logged = [h for h in tr.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == [3, 6]
    for h in logged:
        assert h["grad_norm"] > MAX_NORM  # ... from a larger norm (the Trainer logs the norm before clipping)
        want = math.sqrt(sum(v * v for v in saw.steps[h["step"] - 1].values()))
        assert math.isclose(h["hookstats/grad_norm"], want, rel_tol=1e-6)
        assert math.isclose(h["hookstats/grad_norm_max"], max(saw.steps[h["step"] - 1].values()), rel_tol=2e-6)
        assert h["hookstats/nonfinite"] == 0 and h["hookstats/activation_absmax"] > 0
        fw = [v for s, k, v in zip(*(t.column(x).to_pylist() for x in ("step", "kind", "linf")))
              if s == h["step"] and k == "forward"]
        assert h["hookstats/activation_absmax"] == max(fw)
    # the Trainer's logs are in the run log as scalars, at their step
    sc = {(s["tag"], s["step"]): s["value"] for s in run.scalars}
    for h in logged:
        assert sc[("loss", h["step"])] == h["loss"] and sc[("grad_norm", h["step"])] == h["grad_norm"]
    assert ("eval_loss", 2) in sc
    # detached at the end: no hook left on the model
    assert not any(m._forward_hooks for m in model.modules())
    assert cb.monitor is not None and cb.monitor.current_step == 6


def test_trainer_report_to_tensorboard_gets_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import Trainer

    from hookstats.integrations.transformers import HookstatsCallback

    model = gpt2()
    tb = tmp_path / "out"  # the Trainer's TensorBoardCallback writes under output_dir/runs/
    tr = Trainer(model=model, args=hf_args(tmp_path / "out", report_to="tensorboard"),
                 train_dataset=TokenData(), callbacks=[HookstatsCallback(kinds=("forward", "grad"),
                                                                         log_format="jsonl")])
    tr.train()
    logged = {h["step"]: h for h in tr.state.log_history if "loss" in h}
    events = [os.path.join(d, f) for d, _, fs in os.walk(tb) for f in fs if f.startswith("events.")]
    assert events
    got = collections.defaultdict(dict)
    for e in events:
        acc = EventAccumulator(e)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for ev in acc.Scalars(tag):
                got[tag][ev.step] = ev.value
    for name in ("grad_norm", "grad_norm_max", "activation_absmax", "nonfinite"):
        tag = f"train/hookstats/{name}"
        assert got[tag].keys() == {3, 6}, (tag, dict(got))
        for s, v in got[tag].items():
            assert math.isclose(v, logged[s][f"hookstats/{name}"], rel_tol=1e-6)  # float32 in the event file
    assert "train/hookstats/grad_output_absmax" not in got  # not a recorded kind
    # without pyarrow's Parquet asked for, the log is JSONL
    run = read_run(tmp_path / "out" / "hookstats")
    assert run.format == "jsonl" and {s for s, _ in count(run.records)} == set(range(1, 7))


def test_trainer_resumed_run_continues_its_steps(tmp_path):
    from transformers import Trainer, TrainerCallback

    from hookstats.integrations.transformers import HookstatsCallback

    class StopAt3(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                control.should_training_stop = True

    out = tmp_path / "out"
    args = hf_args(out, save_strategy="steps", save_steps=3)
    Trainer(model=gpt2(), args=args, train_dataset=TokenData(),
            callbacks=[HookstatsCallback(kinds=("forward", "grad")), StopAt3()]).train()
    first = read_run(out / "hookstats").records
    assert sorted({s for s, _ in count(first)}) == [1, 2, 3]
    cb = HookstatsCallback(kinds=("forward", "grad"))
    Trainer(model=gpt2(), args=args, train_dataset=TokenData(), callbacks=[cb]).train(
        resume_from_checkpoint=str(out / "checkpoint-3"))
    t = read_run(out / "hookstats").records
    c = count(t)
    one = per_batch()
    assert sorted({s for s, _ in c}) == [1, 2, 3, 4, 5, 6]  # continued, each step once
    assert all(c[(s, "forward")] == 2 * one["forward"] for s in range(1, 7))
    assert t.column("step").to_pylist()[:first.num_rows] == first.column("step").to_pylist()


# ---------------------------------------------------------------------------------------------------------------
# Lightning
# ---------------------------------------------------------------------------------------------------------------

def lit_module():
    L = pytest.importorskip("lightning.pytorch")

    class LitGPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = gpt2()
            self.pre_clip: list = []  # each optimizer step: {param name: grad l2} where callbacks get the grads
            self.post_clip: list = []  # the total norm after Lightning's clipping, when the optimizer steps

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.model(**batch).loss)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_before_optimizer_step(self, optimizer):  # runs after the callbacks' hook, before clipping
            self.pre_clip.append({n: torch.linalg.vector_norm(p.grad.double()).item()
                                  for n, p in self.named_parameters() if p.grad is not None})

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            self.post_clip.append(math.sqrt(sum(torch.linalg.vector_norm(p.grad.double()).item() ** 2
                                                for p in self.parameters() if p.grad is not None)))

    return LitGPT()


def lit_trainer(root, max_steps, callbacks, loggers=None, **kw):
    import lightning.pytorch as L

    return L.Trainer(default_root_dir=str(root), accelerator="cpu", devices=1, max_steps=max_steps,
                     accumulate_grad_batches=2, gradient_clip_val=MAX_NORM, log_every_n_steps=3,
                     logger=loggers if loggers is not None else False, callbacks=callbacks,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
                     val_check_interval=4, limit_val_batches=1, deterministic=True, **kw)


def loaders():
    dl = torch.utils.data.DataLoader
    return dl(TokenData(), batch_size=4), dl(TokenData(8, seed=1), batch_size=4)


def test_lightning_callback_steps_grads_clipping_and_loggers(tmp_path):
    import lightning.pytorch as L
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from hookstats.integrations.lightning import HookstatsCallback

    assert isinstance(HookstatsCallback(), L.Callback)
    mod = lit_module()
    cb = HookstatsCallback()
    loggers = [TensorBoardLogger(str(tmp_path), name="tb"), CSVLogger(str(tmp_path), name="csv")]
    trainer = lit_trainer(tmp_path, 6, [cb], loggers, enable_checkpointing=False)
    trainer.fit(mod, *loaders())
    assert cb.log_path == os.path.join(trainer.log_dir, "hookstats", "log.parquet")
    run = read_run(cb.log_path)
    t = run.records
    c = count(t)
    one = per_batch()
    assert sorted({s for s, _ in c}) == [1, 2, 3, 4, 5, 6]
    for s in range(1, 7):  # both micro-batches, no validation forward, the grads once
        assert c[(s, "forward")] == 2 * one["forward"] and c[(s, "backward_pre")] == 2 * one["backward_pre"]
        assert c[(s, "grad")] == len(list(mod.parameters()))
    grads = per_step(t, "grad")
    assert len(mod.pre_clip) == len(mod.post_clip) == 6
    for s, want in enumerate(mod.pre_clip, start=1):
        assert grads[s].keys() == want.keys()
        for name, v in want.items():
            assert math.isclose(grads[s][name], v, rel_tol=2e-6, abs_tol=1e-12), (s, name)
        total = math.sqrt(sum(v * v for v in want.values()))
        assert total > MAX_NORM >= mod.post_clip[s - 1] * (1 - 1e-6)  # Lightning's clipping still clips
    # the summary scalars through both loggers, at the trainer's global step
    import csv

    rows = list(csv.DictReader(open(os.path.join(loggers[1].log_dir, "metrics.csv"))))
    got = {int(r["step"]): float(r["hookstats/grad_norm"]) for r in rows if r.get("hookstats/grad_norm")}
    assert sorted(got) == [3, 6]
    for s, v in got.items():
        assert math.isclose(v, math.sqrt(sum(x * x for x in mod.pre_clip[s - 1].values())), rel_tol=1e-6)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(loggers[0].log_dir)
    acc.Reload()
    assert {e.step for e in acc.Scalars("hookstats/grad_norm")} == {3, 6}
    assert {e.step for e in acc.Scalars("hookstats/activation_absmax")} == {3, 6}
    # the trainer's callback metrics are in the run log
    assert {s["step"] for s in run.scalars if s["tag"] == "train_loss"} == {3, 6}
    assert not any(m._forward_hooks for m in mod.modules())  # detached


def test_lightning_resumed_fit_continues_its_steps(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from hookstats.integrations.lightning import HookstatsCallback

    ck = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3, save_top_k=-1)
    cb = HookstatsCallback(kinds=("forward", "grad"), log_format="jsonl")
    lit_trainer(tmp_path, 3, [cb, ck]).fit(lit_module(), *loaders())
    path = sorted((tmp_path / "ckpt").iterdir())[-1]
    state = torch.load(path, weights_only=False)["callbacks"]["HookstatsCallback"]
    assert state == {"step": 3, "log_path": cb.log_path}
    cb2 = HookstatsCallback(kinds=("forward", "grad"), log_format="jsonl")
    lit_trainer(tmp_path, 6, [cb2]).fit(lit_module(), *loaders(), ckpt_path=str(path))
    assert cb2.log_path == cb.log_path
    c = count(read_run(cb.log_path).records)
    one = per_batch(("forward",))
    assert sorted({s for s, _ in c}) == [1, 2, 3, 4, 5, 6]  # continued, each step once
    assert all(c[(s, "forward")] == 2 * one["forward"] for s in range(1, 7))


def test_pytorch_lightning_package_gets_its_own_callback_class(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from hookstats.integrations.pytorch_lightning import HookstatsCallback

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def training_step(self, batch, i):
            return self.lin(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = HookstatsCallback(kinds=("forward", "grad"), log_format="jsonl")
    assert isinstance(cb, pl.Callback)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3)), batch_size=2)
    pl.Trainer(default_root_dir=str(tmp_path), accelerator="cpu", max_steps=3, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               callbacks=[cb]).fit(Tiny(), data)
    c = count(read_run(cb.log_path).records)
    # lin (the module's own forward is never called), its weight and bias
    assert c == {(s, k): n for s in (1, 2, 3) for k, n in (("forward", 1), ("grad", 2))}


# ---------------------------------------------------------------------------------------------------------------
# accelerate (examples/accelerate_monitor.py), two processes
# ---------------------------------------------------------------------------------------------------------------

def test_accelerate_example_two_ranks_merge(tmp_path):
    pytest.importorskip("accelerate")
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from dist_helpers import launch
    finally:
        sys.path.pop(0)
    import json

    env = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + env if env else "")
    try:
        r = launch(ROOT / "examples" / "accelerate_monitor.py", ["--out", str(tmp_path)], tmp_path / "logs",
                   timeout=150)
    finally:
        if env is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = env
    assert r.returncodes == [0, 0], r.describe()
    ranks = [json.load(open(tmp_path / f"accelerate_rank{i}.json")) for i in (0, 1)]
    assert ranks[0]["world"] == 2 and ranks[0]["clipped"] == ranks[1]["clipped"]  # DDP: the same grads
    run = read_run(tmp_path / "log.jsonl")  # rank 0's
    recs = T_records(run)
    steps = sorted({x["step"] for x in recs})
    assert steps == [1, 2, 3, 4] == list(range(1, len(ranks[0]["clipped"]) + 1))
    for x in recs:
        if x["kind"] == "grad":  # merged across ranks, counted once: the grad each rank's optimizer used
            want = ranks[0]["clipped"][x["step"] - 1][x["module"]]
            assert math.isclose(x["stats"]["l2"], want, rel_tol=2e-6), x
        elif x["module"] == "fc1":  # activations: the two ranks' micro-batches together, 16 x 16 values each
            assert x["stats"]["numel"] == 2 * 16 * 16
    assert sum(1 for x in recs if x["kind"] == "grad") == 4 * 4


def T_records(run):
    from hookstats.runlog.schema import table_records

    return table_records(run.records)


# ---------------------------------------------------------------------------------------------------------------
# the Monitor's parts the callbacks use: start_step, pause/resume, optimizer="manual"
# ---------------------------------------------------------------------------------------------------------------

def test_monitor_start_step_pause_resume_and_manual_grads():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    mon = hookstats.Monitor(m, kinds=("forward", "grad"), optimizer="manual", start_step=5, every=2,
                            histogram="exp", histogram_every=2)
    x = torch.randn(2, 3)
    m(x).sum().backward()  # step 5: not a multiple of every=2, nothing recorded
    mon.step()
    m(x).sum().backward()  # step 6: forwards only; no grad records without record_grads()
    mon.pause()
    m(x)  # an evaluation pass: not recorded
    mon.resume()
    m(x).sum().backward()
    mon.record_grads()  # the grads as they are now, once
    want = {n: torch.linalg.vector_norm(p.grad.double()).item() for n, p in m.named_parameters()}
    mon.step()
    mon.step()  # step 8
    mon.pause()
    m(x)
    mon.record_grads()  # paused: nothing
    mon.resume()
    m(x)
    recs = mon.records()
    assert collections.Counter((r["step"], r["kind"]) for r in recs) == {(6, "forward"): 6, (6, "grad"): 4,
                                                                         (8, "forward"): 3}
    for r in recs:
        if r["kind"] == "grad":
            assert math.isclose(r["stats"]["l2"], want[r["module"]], rel_tol=2e-6)
    # histogram_every counts the recorded steps from step 0 on, as a run started at 0 would: steps 0, 2, 4 were
    # recorded (3 of them), so 6 is the 4th (no histogram) and 8 the 5th (histograms)
    assert [r["histogram"] is not None for r in recs] == [False] * 10 + [True] * 3
    with pytest.raises(ValueError, match="start_step"):
        hookstats.Monitor(m, start_step=-1)
    mon.detach()


def test_lightning_wandb_logger_offline_gets_the_scalars(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    import time

    from lightning.pytorch.loggers import WandbLogger

    from hookstats.integrations.lightning import HookstatsCallback

    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import wandb_offline
    finally:
        sys.path.pop(0)
    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                 "WANDB_CONSOLE": "off"}.items():
        monkeypatch.setenv(k, v)
    mod = lit_module()
    logger = WandbLogger(project="hookstats-test", save_dir=str(tmp_path), offline=True)
    lit_trainer(tmp_path, 6, [HookstatsCallback(kinds=("forward", "grad"), log_format="jsonl")], [logger],
                enable_checkpointing=False).fit(mod, *loaders())
    wandb.finish()
    want = {s: math.sqrt(sum(v * v for v in mod.pre_clip[s - 1].values())) for s in (3, 6)}
    got = {}
    for _ in range(40):  # the service process may write the last records a moment after finish() returns
        got = {int(r["trainer/global_step"]): r["hookstats/grad_norm"] for r in wandb_offline.history(str(tmp_path))
               if "hookstats/grad_norm" in r}
        if got.keys() == want.keys():
            break
        time.sleep(0.25)
    assert got.keys() == want.keys()
    for s, v in got.items():
        assert math.isclose(v, want[s], rel_tol=1e-6)
