"""Change what a layer receives with forward pre-hooks: clip outliers in its input, then standardize it, without
touching the model's code or the caller's tensor.

Shows the return-value rule of `module.register_forward_pre_hook(hook(module, args))`: `args` is the tuple of
positional inputs; returning a new tuple (or a single tensor, which PyTorch wraps) replaces them; returning None
keeps them. Hooks run in registration order, each seeing what the previous one returned:
  1. `hookstats.clip_value(0, 100).forward_pre`: clamps sensor spikes to the physical range and returns new args,
     counting the clipped values on the device (`last_count`); plain PyTorch needs a separate comparison pass
     to count them, and reading the count is a host sync.
  2. `standardize`: one `hookstats.stats(x)` read gives mean and std (two reductions, each a full pass, in plain
     PyTorch); it returns `((x - mean) / std,)`. Without step 1 the spikes would inflate the std.
  3. `hookstats.record(...).forward_pre`: statistics of what fc1 finally receives (mean 0, std 1).
The raw batch is not modified in place: a hook must return new tensors.

    python examples/modify_inputs.py --steps 10 --out out/
"""
from __future__ import annotations

import torch
from torch import nn

import hookstats
from _common import cpu_state_dict, example_parser, mlp, parse_args, save_results, sgd_step, synthetic_batches

LR = 0.05
LO, HI = 0.0, 100.0  # the sensor's physical range


def build_model(seed: int = 0) -> nn.Module:
    return mlp(8, 32, 1, names="fc1 act head", seed=seed)


def batches(steps: int, seed: int = 1, device: str = "cpu"):
    """Raw sensor readings: offset 50, scale 10, with a few spikes of 100 sigma."""
    def sensor(z, step, g):
        x = 50.0 + 10.0 * z
        x[torch.rand(64, 8, generator=g) < 0.01] = 1000.0  # spikes
        return x, z[:, :1]
    return synthetic_batches(steps, (64, 8), sensor, seed=seed, device=device)


def standardize(module, args):
    (x,) = args
    # mean and std (and 11 more statistics) in one read, as 0-d device tensors. They are constants for autograd
    # (hookstats.stats is not differentiable): right for data, which needs no gradient; a hidden layer's input
    # that should backpropagate through its own mean and std needs x.mean() and x.std().
    s = hookstats.stats(x)
    return ((x - s.mean) / s.std,)  # new args; returning the bare tensor would work too


def main(argv=None) -> dict:
    args = parse_args(example_parser(__doc__, steps=10), argv)

    model = build_model().to(args.device)
    clip = hookstats.clip_value(LO, HI)
    seen = hookstats.record("fc1 input")
    model.fc1.register_forward_pre_hook(clip.forward_pre)
    model.fc1.register_forward_pre_hook(standardize)
    model.fc1.register_forward_pre_hook(seen.forward_pre)

    clipped, losses = [], []
    raw_max = []
    for x, y in batches(args.steps, device=args.device):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        sgd_step(model.parameters(), LR)
        clipped.append(clip.last_count)
        losses.append(loss.detach())
        raw_max.append(x.max())  # still the raw spike: the hooks did not modify x in place
        seen.step += 1

    recs = seen.records()
    out = {
        "clipped": torch.stack(clipped).tolist(),
        "seen_min": [r["stats"]["min"] for r in recs],
        "seen_max": [r["stats"]["max"] for r in recs],
        "seen_mean": [r["stats"]["mean"] for r in recs],
        "seen_std": [r["stats"]["std"] for r in recs],
        "raw_max": torch.stack(raw_max).tolist(),
        "loss": torch.stack(losses).tolist(),
    }
    print(f"{'step':>4}  {'raw max':>8}  {'clipped':>7}  {'fc1 input: min':>14}  {'max':>6}  {'mean':>6}  {'std':>5}"
          f"  {'loss':>7}")
    for i in range(args.steps):
        print(f"{i:>4}  {out['raw_max'][i]:>8.1f}  {out['clipped'][i]:>7}  {out['seen_min'][i]:>14.3f}  "
              f"{out['seen_max'][i]:>6.3f}  {out['seen_mean'][i]:>6.3f}  {out['seen_std'][i]:>5.3f}  "
              f"{out['loss'][i]:>7.4f}")
    return save_results(args.out, "modify_inputs.json", out, state_dict=cpu_state_dict(model))


if __name__ == "__main__":
    main()
