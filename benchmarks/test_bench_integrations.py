"""The step overhead of the framework callbacks: a Hugging Face Trainer and a Lightning Trainer training the same
small GPT-2 (2 layers, n_embd 32, vocab 100, batch 4 x 16 tokens, gradient accumulation 2, clipping at 1.0) on CPU,
one thread, with hookstats' HookstatsCallback (default kinds: module outputs, grad_outputs and parameter grads;
a flush every 50 optimizer steps and at every log, logging every 10 steps, a Parquet log) and without it.

An optimizer step's time is measured from the end of one optimizer step to the end of the next (a timing callback
after every other callback), so it holds everything the callback adds (recording, the pause between steps, the
flushes and summary scalars at each log) and nothing of the trainers' set-up. The two sides alternate, ROUNDS runs
of STEPS optimizer steps each; extra_info holds the fastest and the median step of each side and their ratios
(`ratios`: with / without; on a shared machine a busy neighbour only adds time, and the sides ran interleaved), and
`overhead_s` (median with - median without, per optimizer step). Quick in --benchmark-disable mode (2 steps each).
"""
from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

STEPS = 20
ROUNDS = 5
LOG_EVERY = 10

# The report's table (benchmarks/report.py reads this literal).
REPORT = [
    {"id": "integrations_step", "title": "Framework callbacks, one optimizer step, interleaved", "family": "integrations",
     "where": "bench == 'step'",
     "explode": {"key": "case", "fields": ["step_s", "median_step_s", "ratios", "median_ratios"]},
     "split": ["framework"], "rows": ["case"],
     "labels": {"none": "the trainer alone", "hookstats": "+ HookstatsCallback (default kinds, Parquet log)"},
     "columns": [["case", "label(case)"], ["step ms (fastest round)", "step_s", "ms"],
                 ["step ms (median round)", "median_step_s", "ms"], ["vs the trainer alone", "ratios", "x"],
                 ["median ratio", "median_ratios", "x"],
                 ["added ms a step (medians)", "overhead_s if case == 'hookstats' else None", "ms"]],
     "note": "A tiny GPT-2 (2 layers, n_embd 32, vocab 100), batch 4 x 16 tokens, gradient accumulation 2, clipping, "
             "CPU, one thread; the callback records module outputs, grad_outputs and grads (~290 records a step), "
             "flushes and logs every 10 steps. A step: from one optimizer step's end to the next; the two sides "
             "alternate, 5 rounds of 20 steps."},
]



class Data(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.x = torch.randint(0, 100, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def gpt2():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def summarize(benchmark, framework: str, times: dict, steps: int) -> None:
    best = {c: min(v) for c, v in times.items()}
    med = {c: statistics.median(v) for c, v in times.items()}
    benchmark.group = f"integrations-{framework}"
    benchmark.extra_info.update(
        family="integrations", bench="step", framework=framework, steps_per_round=steps, log_every=LOG_EVERY,
        step_s=best, median_step_s=med, ratios={"none": 1.0, "hookstats": best["hookstats"] / best["none"]},
        median_ratios={"none": 1.0, "hookstats": med["hookstats"] / med["none"]},
        overhead_s=med["hookstats"] - med["none"], torch_threads=torch.get_num_threads())


def test_transformers_trainer_step(benchmark, hookstats, one_thread, tmp_path):
    transformers = pytest.importorskip("transformers")
    from hookstats.integrations.transformers import HookstatsCallback

    smoke = benchmark.disabled
    steps, rounds = (2, 1) if smoke else (STEPS, ROUNDS)

    class Timer(transformers.TrainerCallback):
        def __init__(self):
            self.t, self.times = None, []

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            if self.t is not None:
                self.times.append(now - self.t)
            self.t = now

    def trainer(side: str):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / side), per_device_train_batch_size=4, gradient_accumulation_steps=2,
            max_steps=steps + 1, max_grad_norm=1.0, logging_steps=LOG_EVERY, report_to="none", save_strategy="no",
            use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0)
        timer = Timer()
        cbs = ([HookstatsCallback()] if side == "hookstats" else []) + [timer]
        return transformers.Trainer(model=gpt2(), args=args, train_dataset=Data(8 * (steps + 1)), callbacks=cbs), timer

    sides = {s: trainer(s) for s in ("none", "hookstats")}
    times: dict = {s: [] for s in sides}
    for _ in range(rounds):
        for s, (tr, timer) in sides.items():
            timer.t, timer.times = None, []
            tr.train()
            times[s].append(statistics.median(timer.times) if timer.times else 0.0)
    hook_cb = sides["hookstats"][0].callback_handler.callbacks[0]
    assert type(hook_cb).__name__ == "HookstatsCallback" and os.path.isdir(hook_cb.log_path)
    summarize(benchmark, "transformers", times, steps)
    benchmark.pedantic(sides["hookstats"][0].train, rounds=1, iterations=1)


def test_lightning_trainer_step(benchmark, hookstats, one_thread, tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    pytest.importorskip("transformers")
    from hookstats.integrations.lightning import HookstatsCallback

    smoke = benchmark.disabled
    steps, rounds = (2, 1) if smoke else (STEPS, ROUNDS)

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = gpt2()

        def training_step(self, batch, i):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Timer(L.Callback):
        def __init__(self):
            self.t, self.times, self.seen = None, [], 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == self.seen:
                return  # a micro-batch: the optimizer has not stepped
            self.seen = trainer.global_step
            now = time.perf_counter()
            if self.t is not None:
                self.times.append(now - self.t)
            self.t = now

    def fit(side: str) -> list:
        timer = Timer()
        cbs = ([HookstatsCallback(log_every=LOG_EVERY)] if side == "hookstats" else []) + [timer]
        tr = L.Trainer(default_root_dir=str(tmp_path / side), accelerator="cpu", devices=1, max_steps=steps + 1,
                       accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, callbacks=cbs)
        tr.fit(Lit(), torch.utils.data.DataLoader(Data(8 * (steps + 1)), batch_size=4))
        return timer.times

    times: dict = {"none": [], "hookstats": []}
    for _ in range(rounds):
        for s in times:
            t = fit(s)
            times[s].append(statistics.median(t) if t else 0.0)
    summarize(benchmark, "lightning", times, steps)
    benchmark.pedantic(lambda: fit("hookstats"), rounds=1, iterations=1)
