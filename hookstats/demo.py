"""The training run of `python -m hookstats demo`: a small model trained on synthetic data (nothing to download)
with a Monitor on every layer, fused_clip on the gradients between blocks, clip_grad_norm_ on the parameters, a NaN
batch injected to be found, and the run directory written: JSONL log, TensorBoard events, plots and report."""
from __future__ import annotations

import math
import os
import shutil
import sys
import time
from typing import Optional

import torch
from torch import nn

import hookstats
from .export import LOG_NAME, REPORT_DIR, TENSORBOARD_DIR, JSONLWriter, TensorBoardWriter
from .runlog import PARQUET_NAME, ParquetWriter
from .runlog.parquet import remove_log

MODELS = ("transformer", "mlp", "cnn", "deep")
DEEP_BLOCKS = 500  # the "deep" model: 500 x (Linear, ReLU), 1,001 modules with the model itself


class _TinyTransformer(nn.Module):
    """Token classification: is each token larger than the sequence's mean token? (needs attention)."""

    def __init__(self, vocab: int = 64, d: int = 64, heads: int = 4, layers: int = 2, seq: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=2 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.pos))

    def blocks(self):
        return list(self.encoder.layers)


class _MLP(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))

    def blocks(self):
        return [m for m in self if isinstance(m, nn.Linear)][1:]


class _Deep(nn.Sequential):
    """A deep, narrow MLP: `blocks` x (Linear(width, width), ReLU), for runs with a thousand monitored modules (a
    few thousand records a step). Residual-free and default-initialised: its gradients fade with depth, which is
    what the gradient-flow plot shows."""

    def __init__(self, blocks: int = DEEP_BLOCKS, width: int = 32):
        layers = []
        for _ in range(blocks):
            layers += [nn.Linear(width, width), nn.ReLU()]
        super().__init__(*layers)

    def blocks(self):
        return [m for m in self if isinstance(m, nn.Linear)][1::50]


class _CNN(nn.Module):
    """Which quadrant holds the bright blob? 1x16x16 images."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1),
                                      nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(2)  # keeps where things are: the answer is a position
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.pool(self.features(x)).flatten(1))

    def blocks(self):
        return [m for m in self.features if isinstance(m, nn.Conv2d)][1:]


def make_task(name: str, device: torch.device, batch: int = 32, seed: int = 0):
    """(model, batch_fn(step) -> (input, target), loss_fn) for the named model, all synthetic."""
    g = torch.Generator().manual_seed(seed)
    if name == "transformer":
        model = _TinyTransformer()

        def batch_fn(step):
            tok = torch.randint(0, 64, (batch, 32), generator=g)
            y = (tok.float() > tok.float().mean(1, keepdim=True)).long()
            return tok.to(device), y.to(device)

        def loss_fn(out, y):
            return nn.functional.cross_entropy(out.reshape(-1, 2), y.reshape(-1))
    elif name == "mlp":
        model = _MLP()
        w = torch.randn(64, 10, generator=g)

        def batch_fn(step):
            x = torch.randn(batch, 64, generator=g)
            return x.to(device), (x @ w).argmax(1).to(device)

        loss_fn = nn.functional.cross_entropy
    elif name == "cnn":
        model = _CNN()

        def batch_fn(step):
            q = torch.randint(0, 4, (batch,), generator=g)
            x = torch.randn(batch, 1, 16, 16, generator=g) * 0.8
            rows = torch.arange(16).view(1, 16, 1) // 8 == (q // 2).view(-1, 1, 1)
            cols = torch.arange(16).view(1, 1, 16) // 8 == (q % 2).view(-1, 1, 1)
            x += 1.0 * (rows & cols).unsqueeze(1)  # the bright quadrant
            return x.to(device), q.to(device)

        loss_fn = nn.functional.cross_entropy
    elif name == "deep":
        model = _Deep()
        w = torch.randn(32, 32, generator=g)

        def batch_fn(step):
            x = torch.randn(batch, 32, generator=g)
            return x.to(device), (x @ w).argmax(1).to(device)

        loss_fn = nn.functional.cross_entropy
    else:
        raise ValueError(f"hookstats demo: unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return model.to(device), batch_fn, loss_fn


def _nan_output(module, args, out):
    out = out.clone()
    out.view(-1)[7] = math.nan
    return out


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="step", file=sys.stdout, dynamic_ncols=True, leave=True)


def prepare_out(out: str) -> None:
    """The demo's files in `out` are replaced (the Parquet log's sidecars and what a killed writer left too: a log
    holds one run, Note [one run per log]); anything else there is left alone."""
    os.makedirs(out, exist_ok=True)
    remove_log(os.path.join(out, PARQUET_NAME))
    log = os.path.join(out, LOG_NAME)
    if os.path.exists(log):
        os.remove(log)
    for name in (TENSORBOARD_DIR, REPORT_DIR):
        p = os.path.join(out, name)
        if os.path.isdir(p):
            shutil.rmtree(p)


def train(model_name: str = "transformer", steps: int = 200, device: str | torch.device = "cpu",
          out: Optional[str] = "runs/demo", nan_step: Optional[int] = -1, max_norm: float = 1.0,
          flush_every: int = 25, histogram="exp", progress: bool = True, lr: float = 3e-3,
          log_format: Optional[str] = None, tensorboard: Optional[bool] = None,
          histogram_every: Optional[int] = None) -> dict:
    """Trains `model_name` for `steps` steps with a Monitor (forward, grad_output and parameter-grad statistics,
    with exponent histograms) on every layer, `fused_clip(max_norm)` as a full backward hook on each block, and
    `clip_grad_norm_(nonfinite="zero")` on the parameters. A NaN is put into the input batch at `nan_step`
    (-1: three quarters of the way; None: never). Returns the monitor's summary, first non-finite record, losses
    and total norms, and the paths written (when `out` is given). log_format: "jsonl" (log.jsonl) or "parquet"
    (log.parquet/, needs pyarrow); default parquet for "deep", else jsonl. tensorboard: write TensorBoard events
    (default: yes, except for "deep": thousands of tags a step). histogram_every: default 10 for "deep", else 1."""
    device = torch.device(device)
    deep = model_name == "deep"
    log_format = log_format or ("parquet" if deep else "jsonl")
    if log_format not in ("jsonl", "parquet"):
        raise ValueError(f"hookstats demo: log_format must be 'jsonl' or 'parquet', got {log_format!r}")
    tensorboard = (not deep) if tensorboard is None else tensorboard
    histogram_every = histogram_every or (10 if deep else 1)
    if nan_step == -1:
        nan_step = (3 * steps) // 4 if steps > 1 else None
    torch.manual_seed(0)
    model, batch_fn, loss_fn = make_task(model_name, device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    clip = hookstats.fused_clip(max_norm)
    handles = [b.register_full_backward_hook(clip) for b in model.blocks()]
    exporters = []
    tb_dir = log_path = None
    if out is not None:
        prepare_out(out)
        if log_format == "parquet":
            log_path = os.path.join(out, PARQUET_NAME)
            exporters.append(ParquetWriter(log_path))
        else:
            log_path = os.path.join(out, LOG_NAME)
            exporters.append(JSONLWriter(log_path))
        if tensorboard:
            try:
                tb_dir = os.path.join(out, TENSORBOARD_DIR)
                exporters.append(TensorBoardWriter(tb_dir))
            except ImportError as e:
                tb_dir = None
                print(f"hookstats demo: no TensorBoard events ({e})", file=sys.stderr)
    bar = _progress(steps, f"{model_name} on {device}") if progress else None
    t0 = time.perf_counter()
    mon = hookstats.Monitor(model, kinds=("forward", "backward_pre", "grad"), histogram=histogram,
                            exporters=exporters, flush_every=flush_every, histogram_every=histogram_every,
                            nonfinite_ops=True)  # the injected NaN found down to the op that first read it
    try:
        for step in range(steps):
            x, y = batch_fn(step)
            poison = None
            if step == nan_step:  # a bad batch
                if x.is_floating_point():
                    x = x.clone()
                    x.view(-1)[7] = math.nan
                else:  # token ids cannot hold a NaN: poison the embedding's output for this step
                    poison = model.embed.register_forward_hook(_nan_output, prepend=True)  # before the Monitor sees it
            loss = loss_fn(model(x), y)
            if poison is not None:
                poison.remove()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            total = hookstats.clip_grad_norm_(model.parameters(), max_norm, nonfinite="zero")
            mon.log("loss", loss)
            mon.log("grad_norm", total)
            opt.step()
            mon.step()  # flushes every flush_every steps: one host copy per buffer
            if bar is not None:
                bar.update(1)
                if mon.flush_every and (step + 1) % mon.flush_every == 0:
                    last = {}  # the last flushed loss and grad_norm (flushed by step(): no copy); the features log
                    for s in reversed(mon.scalars()):  # scalars of their own after them (nonfinite_ops/found)
                        last.setdefault(s["tag"], s["value"])
                        if "loss" in last and "grad_norm" in last:
                            break
                    bar.set_postfix(loss=f"{last.get('loss', math.nan):.3f}",
                                    grad_norm=f"{last.get('grad_norm', math.nan):.3g}", refresh=False)
        scalars = mon.scalars()
        rows = mon.summary_rows()  # from the columns: no record dicts built for a deep model's run
        result = {
            "model": model_name, "steps": steps, "device": str(device), "seconds": time.perf_counter() - t0,
            "records": sum(r["records"] for r in rows), "summary": mon.summary(), "summary_rows": rows,
            "first_nonfinite": mon.first_nonfinite(), "nan_step": nan_step,
            "first_nonfinite_op": mon.feature("nonfinite_ops").first(),
            "loss": [s["value"] for s in scalars if s["tag"] == "loss"],
            "grad_norm": [s["value"] for s in scalars if s["tag"] == "grad_norm"],
            "log": log_path, "log_format": log_format, "tensorboard": tb_dir, "out": out,
            "flush_every": flush_every, "modules": len(mon.modules), "export_waits": mon.export_waits,
        }
    finally:
        if bar is not None:
            bar.close()
        mon.detach()  # flushes the rest to the exporters and closes them
        for h in handles:
            h.remove()
    return result
