"""Scaffolding shared by the example scripts, so that each script keeps only the hook use case it shows.

- Synthetic data: `synthetic_batches` draws every batch from one seeded `torch.Generator` (no downloads, the same
  numbers on every run and device); each script's `batches()` says what the batch means.
- Small models: `mlp` builds a seeded `nn.Sequential` of Linear layers with an activation between them, with the
  module names the scripts' hooks refer to (`fc1`, `act1`, ..., `head`).
- Training: `sgd_step`, plain SGD without `torch.optim`.
- Command line and results: `example_parser` / `parse_args` give every script `--steps`, `--device` and `--out`
  (created if missing); `write_json` writes a result file there; `save_results` writes one and returns it
  with the extras (such as `cpu_state_dict`, the trained weights) that a script's `main()` returns for the tests
  to compare.

The scripts import it as a sibling module (`from _common import ...`): `python examples/x.py` puts `examples/`
first on `sys.path`, and `tests/test_examples.py` adds it before loading the scripts.
"""
from __future__ import annotations

import argparse
import json
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch
from torch import nn

# -- synthetic data --------------------------------------------------------------------------------------------------
def synthetic_batches(steps: int, shape: tuple[int, ...], make: Callable | None = None, *, seed: int = 1,
                      device: str = "cpu") -> Iterator:
    """`steps` batches from one generator seeded with `seed`. Each step draws z = torch.randn(*shape); the batch is
    `make(z, step, g)` (a tensor or a tuple of tensors; `g` is the generator, for further draws in the same step),
    or z itself when `make` is None. Every tensor of the batch is built on the CPU, then moved to `device`, so a
    run gives the same data on every device."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        z = torch.randn(*shape, generator=g)
        batch = z if make is None else make(z, step, g)
        yield batch.to(device) if isinstance(batch, torch.Tensor) else tuple(t.to(device) for t in batch)


# -- small models ----------------------------------------------------------------------------------------------------
def mlp(*sizes: int, act: Callable[[], nn.Module] = nn.ReLU, names: str | bool = True, seed: int = 0,
        before: dict[str, nn.Module] | None = None) -> nn.Sequential:
    """Linear layers sizes[0] -> sizes[1] -> ... -> sizes[-1] with `act()` between them, initialised after
    `torch.manual_seed(seed)`.

    names: True: fc1, act1, fc2, act2, ..., head (the last Linear); False: nn.Sequential's "0", "1", ...; a string:
    one space-separated name per module, in order. before: named modules without parameters (so they leave the
    initialisation alone) placed ahead of the first Linear."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i:
            layers.append(act())
        layers.append(nn.Linear(n_in, n_out))
    if names is False:
        assert not before, "before= needs named modules"
        return nn.Sequential(*layers)
    if names is True:
        n = len(sizes) - 1
        names = " ".join([*(f"fc{i} act{i}" for i in range(1, n)), "head"])
    keys = names.split()
    assert len(keys) == len(layers), f"{len(keys)} names for {len(layers)} modules"
    return nn.Sequential(OrderedDict([*(before or {}).items(), *zip(keys, layers)]))


# -- training --------------------------------------------------------------------------------------------------------
@torch.no_grad()
def sgd_step(params, lr: float) -> None:
    """p -= lr * p.grad, then clear the grads: what torch.optim.SGD(params, lr).step() and zero_grad() do. (The
    first torch.optim optimizer imports torch._dynamo: seconds of start-up that a short example can skip.)"""
    for p in params:
        if p.grad is not None:
            p.add_(p.grad, alpha=-lr)
            p.grad = None


# -- command line and results ----------------------------------------------------------------------------------------
def example_parser(doc: str, steps: int, steps_help: str | None = None) -> argparse.ArgumentParser:
    """The options every example takes: --steps (default `steps`), --device cpu|cuda, --out (a folder). The
    description is the first line of the script's docstring `doc`; the script adds its own options."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--steps", type=int, default=steps, help=steps_help)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", default="out")
    return ap


def parse_args(ap: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """ap.parse_args(argv) (None: the command line), creating the --out folder."""
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    return args


def write_json(out_dir: str, name: str, obj, indent: int | None = 1) -> str:
    """Writes `obj` as JSON to out_dir/name; returns the path."""
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent)
    return path


def save_results(out_dir: str, name: str, out: dict, **extra) -> dict:
    """Writes the results `out` as JSON to out_dir/name, then adds to `out` what main() returns beside them (`extra`,
    such as tensors for the tests, not written) and "json": the file's path. Returns `out`."""
    path = write_json(out_dir, name, out)
    out.update(extra)
    out["json"] = path
    return out


def cpu_state_dict(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The model's weights, detached and on the CPU, keys prefixed with `prefix`: what a script's main() returns
    for the tests to compare with a plain-PyTorch run."""
    return {prefix + k: v.detach().cpu() for k, v in model.state_dict().items()}
