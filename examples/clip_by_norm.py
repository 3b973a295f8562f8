"""Clip gradients by norm inside the backward pass (a module's grad_input) and after it (the parameters).

Shows two hookstats tools:
- `layer.register_full_backward_hook(hookstats.fused_clip(max_norm))`: the gradient flowing out of `fc2` into the
  layers below (its grad_input) is rescaled to norm <= max_norm before those layers see it. The hook returns a
  new grad_input tuple (a full backward hook must not modify its arguments); `last_norm` keeps the norm before
  clipping as a device tensor. A `hookstats.record` on the ReLU below shows what arrives downstream.
- `hookstats.clip_grad_norm_(model.parameters(), max_norm)`: drop-in for `torch.nn.utils.clip_grad_norm_`, same
  return value (the total norm before clipping), one norm call and one scale call for all gradients.

Plain PyTorch instead: the hook needs a norm op per tensor, a stack, a norm of norms, a clamp and a multiply; the
usual version also calls `.item()` to compare with max_norm (a host sync per hook call). `clip_grad_norm_` needs
per-tensor norm outputs and stacking, whose overhead grows with the number of parameters (pytorch#133586).

    python examples/clip_by_norm.py --steps 10 --out out/
"""
from __future__ import annotations

import torch
from torch import nn

import hookstats
from _common import cpu_state_dict, example_parser, mlp, parse_args, save_results, sgd_step, synthetic_batches

LR = 0.1


def build_model(seed: int = 0) -> nn.Module:
    return mlp(16, 64, 64, 4, seed=seed)  # fc1, act1, fc2, act2, head


def batches(steps: int, seed: int = 1, device: str = "cpu"):
    """4-class classification of Gaussian points by the sign pattern of two features."""
    def label(x, *_):
        return x, (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()
    return synthetic_batches(steps, (64, 16), label, seed=seed, device=device)


def main(argv=None) -> dict:
    ap = example_parser(__doc__, steps=10)
    ap.add_argument("--act-max-norm", type=float, default=0.01, help="max norm of fc2's grad_input")
    ap.add_argument("--max-norm", type=float, default=0.25, help="max total norm of the parameters' grads")
    args = parse_args(ap, argv)

    model = build_model().to(args.device)
    clip = hookstats.fused_clip(args.act_max_norm)
    model.fc2.register_full_backward_hook(clip)  # the object itself is the full-backward-hook form
    # Downstream of fc2 in the backward pass is act1: its grad_output is what fc2's hook returned.
    seen = hookstats.record("act1 grad_output")
    model.act1.register_full_backward_pre_hook(seen.backward_pre)

    before, totals, losses = [], [], []  # device tensors: no sync inside the loop
    for x, y in batches(args.steps, device=args.device):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        before.append(clip.last_norm)  # fc2's grad_input norm before clipping, this step
        totals.append(hookstats.clip_grad_norm_(model.parameters(), args.max_norm))
        sgd_step(model.parameters(), LR)
        losses.append(loss.detach())
        seen.step += 1  # a bare record keeps its step counter in .step

    after = [r["stats"]["l2"] for r in seen.records()]  # one host copy
    out = {
        "grad_input_norm_before": torch.stack(before).tolist(),
        "grad_input_norm_after": after,
        "total_norm_before": torch.stack(totals).tolist(),
        "loss": torch.stack(losses).tolist(),
    }
    print(f"{'step':>4}  {'fc2 grad_input norm':>20}  {'after clip':>10}  {'param grad norm':>15}  {'loss':>6}")
    for i in range(args.steps):
        print(f"{i:>4}  {out['grad_input_norm_before'][i]:>20.4g}  {after[i]:>10.4g}  "
              f"{out['total_norm_before'][i]:>15.4g}  {out['loss'][i]:>6.4f}")
    return save_results(args.out, "clip_by_norm.json", out, state_dict=cpu_state_dict(model))


if __name__ == "__main__":
    main()
