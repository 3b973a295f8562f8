"""NaN hunting that can stay on: find the first module (and step, and hook kind) where a NaN or Inf appeared.

A model with a log-transform layer (as for counts, prices or power spectra) trains on positive features; at step
`--bad-step` one corrupt reading is 0, `log(0) = -inf`, and from there the loss and every gradient become
non-finite. `hookstats.Monitor(model, kinds=("forward", "backward_pre"))` records statistics of every module's
output and output gradient, in hook-call order (forward in execution order, then backward), into a device
buffer; `mon.first_nonfinite()` returns the first record whose tensor held a NaN or Inf: module "log", kind
"forward", the bad step. `hookstats.clip_grad_norm_(..., nonfinite="zero")` meanwhile zeroes the non-finite
gradients on the device, so the bad step updates nothing and the weights stay finite, without a host sync.

Plain PyTorch instead: `torch.autograd.detect_anomaly()` checks every backward op's output and syncs, making
training ~2x slower (ignite PR #219), so it is only switched on after the fact, to re-run and reproduce; hooks
that call `torch.isfinite(t).all().item()` sync once per module.

    python examples/nan_hunting.py --steps 10 --out out/
"""
from __future__ import annotations

import torch
from torch import nn

import hookstats
from _common import example_parser, mlp, parse_args, sgd_step, synthetic_batches, write_json

LR = 0.05


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def build_model(seed: int = 0) -> nn.Module:
    return mlp(12, 32, 1, names="fc1 act fc2", before={"log": Log()}, seed=seed)  # log, fc1, act, fc2


def batches(steps: int, bad_step: int, seed: int = 1, device: str = "cpu"):
    """Positive features (log-normal); at bad_step one reading is 0."""
    def readings(z, step, g):
        x = torch.exp(z)
        if step == bad_step:
            x[5, 3] = 0.0  # a dead sensor
        return x, z[:, :3].sum(1, keepdim=True)
    return synthetic_batches(steps, (64, 12), readings, seed=seed, device=device)


def main(argv=None) -> dict:
    ap = example_parser(__doc__, steps=10)
    ap.add_argument("--bad-step", type=int, default=None, help="the step with the corrupt batch (default: steps // 2)")
    args = parse_args(ap, argv)
    bad_step = args.steps // 2 if args.bad_step is None else args.bad_step

    model = build_model().to(args.device)
    losses = []
    with hookstats.Monitor(model, kinds=("forward", "backward_pre")) as mon:
        for x, y in batches(args.steps, bad_step, device=args.device):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            hookstats.clip_grad_norm_(model.parameters(), 1.0, nonfinite="zero")  # skip a non-finite update
            sgd_step(model.parameters(), LR)
            losses.append(loss.detach())
            mon.step()
        first = mon.first_nonfinite()  # flushes: one host copy of every record
        bad = [r for r in mon.records() if r["stats"]["nan_count"] or r["stats"]["inf_count"]]

    losses = torch.stack(losses).tolist()
    params_finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    if first is None:
        print("no NaN or Inf seen")
    else:
        s = first["stats"]
        print(f"first non-finite value: step {first['step']}, module {first['module']!r}, kind {first['kind']}, "
              f"tensor {first['index']}: {s['nan_count']} NaN, {s['inf_count']} Inf of {s['numel']}")
        where = [f"{r['module'] or '<model>'}:{r['kind']}" for r in bad]
        print(f"{len(bad)} records held NaN/Inf, in order: " + ", ".join(where[:8]) + (" ..." if len(bad) > 8 else ""))
    print(f"losses: {' '.join(f'{v:.3g}' for v in losses)}; weights finite after training: {params_finite}")
    write_json(args.out, "nan_hunting.json", {"first_nonfinite": first, "bad_step": bad_step, "losses": losses})
    return {"first": first, "bad_records": bad, "bad_step": bad_step, "losses": losses,
            "params_finite": params_finite}


if __name__ == "__main__":
    main()
