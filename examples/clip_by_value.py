"""Clip gradients by value: an activation's gradient in the backward pass, then the parameters' gradients, counting
how many values were clipped, with no host sync.

Shows:
- `hookstats.clip_value(c).tensor` as a `Tensor.register_hook` hook on fc1's output (registered from a forward
  hook, the usual way to reach an intermediate tensor): it returns a new, clamped gradient (tensor hooks must not
  modify their argument) and keeps the number of clipped values in `last_count`, a device tensor.
- `hookstats.clip_grad_value_(model.parameters(), c)`: like `torch.nn.utils.clip_grad_value_`, but it also returns
  the count of clipped values (PyTorch returns None), from one clamp-and-count kernel call for all gradients.
- `--during-backward`: the same parameter clipping done as each gradient is accumulated, with
  `hookstats.clip_value(c).post_accumulate` (the one hook kind that may modify `param.grad` in place), so a
  gradient is clipped while still hot in cache and no pass over all gradients follows backward().

Plain PyTorch instead: a count needs `(g.abs() > c).sum()` before the clamp (another full read of every
gradient), and reading it is a host sync; `clip_grad_value_` returns nothing.

    python examples/clip_by_value.py --steps 10 --out out/
"""
from __future__ import annotations

import torch
from torch import nn

import hookstats
from _common import cpu_state_dict, example_parser, mlp, parse_args, save_results, sgd_step, synthetic_batches

LR = 0.1


def build_model(seed: int = 0) -> nn.Module:
    return mlp(16, 64, 64, 1, act=nn.Tanh, seed=seed)  # fc1, act1, fc2, act2, head


def batches(steps: int, seed: int = 1, device: str = "cpu"):
    """Regression with a few outlier targets: the kind of batch whose gradients one clips by value."""
    def with_outliers(x, *_):
        y = x[:, :2].sum(1, keepdim=True)
        y[:4] *= 20.0  # outliers
        return x, y
    return synthetic_batches(steps, (64, 16), with_outliers, seed=seed, device=device)


def main(argv=None) -> dict:
    ap = example_parser(__doc__, steps=10)
    ap.add_argument("--act-clip", type=float, default=0.002, help="bound for fc1's output gradient")
    ap.add_argument("--clip", type=float, default=0.05, help="bound for the parameters' gradients")
    ap.add_argument("--during-backward", action="store_true",
                    help="clip each param.grad in a post-accumulate hook instead of clip_grad_value_ after backward")
    args = parse_args(ap, argv)

    model = build_model().to(args.device)

    act_clip = hookstats.clip_value(args.act_clip)

    def clip_output_grad(module, inputs, output):
        # A forward hook that attaches a tensor hook to this call's output; its gradient is clipped on the way back.
        if output.requires_grad:
            output.register_hook(act_clip.tensor)

    model.fc1.register_forward_hook(clip_output_grad)

    # One clip_value object per parameter: each keeps the count of its own last call.
    param_clips = {}
    if args.during_backward:
        for name, p in model.named_parameters():
            param_clips[name] = hookstats.clip_value(args.clip)
            p.register_post_accumulate_grad_hook(param_clips[name].post_accumulate)

    act_counts, param_counts, max_abs = [], [], []  # device tensors
    for x, y in batches(args.steps, device=args.device):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        act_counts.append(act_clip.last_count)
        if args.during_backward:  # already clipped, inside backward()
            param_counts.append(torch.stack([c.last_count for c in param_clips.values()]).sum())
        else:
            param_counts.append(hookstats.clip_grad_value_(model.parameters(), args.clip))
        grads = [p.grad for p in model.parameters()]
        max_abs.append(hookstats.norms(grads, float("inf")).total)  # max |grad| after clipping: one kernel call
        sgd_step(model.parameters(), LR)

    n_params = sum(p.numel() for p in model.parameters())
    out = {
        "act_clipped": torch.stack(act_counts).tolist(),  # one host copy each, after the loop
        "param_clipped": torch.stack(param_counts).tolist(),
        "max_abs_grad": torch.stack(max_abs).tolist(),
        "n_params": n_params,
    }
    print(f"{'step':>4}  {'fc1 output grads clipped':>24}  {'param grads clipped':>20}  {'max |grad|':>10}")
    for i in range(args.steps):
        print(f"{i:>4}  {out['act_clipped'][i]:>24}  {out['param_clipped'][i]:>11} of {n_params:<5}  "
              f"{out['max_abs_grad'][i]:>10.4g}")
    return save_results(args.out, "clip_by_value.json", out, state_dict=cpu_state_dict(model))


if __name__ == "__main__":
    main()
