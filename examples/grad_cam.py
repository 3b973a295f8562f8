"""Grad-CAM on a small CNN trained for a few steps on synthetic images: where in the image is the evidence?

Each 24x24 image holds one Gaussian spot at a random place in noise; the class is its polarity (0: bright,
1: dark). The CNN ends in global average pooling, so a class can only be recognised where a spot is, and
Grad-CAM should light up there. A forward hook keeps the last conv block's output A; a full backward pre-hook on
the same module keeps dscore/dA (its grad_output); the CAM is relu(sum_k mean_xy(dscore/dA_k) * A_k).
(Grad-CAM's channel-averaged gradient assumes such a head: with a flatten + linear head, the per-position weights
average out and the CAM points anywhere; element-wise gradient x activation, "HiResCAM", suits those.)

hookstats' part: `hookstats.Monitor` logs the conv layers' outputs and output gradients during training (one
kernel call per tensor, read once at the end), and one `hookstats.stats` call summarises the captured Grad-CAM
gradients (norm, range, fraction of zeros) instead of one op and one sync per statistic in plain PyTorch.

    python examples/grad_cam.py --steps 30 --out out/     # writes out/grad_cam.png
"""
from __future__ import annotations

import os
from collections import OrderedDict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import hookstats  # noqa: E402
from _common import example_parser, parse_args, sgd_step, write_json  # noqa: E402

SIZE = 24
SPOT, NOISE = 3.0, 0.3  # spot amplitude, noise std
LR = 1.0  # large, because global average pooling divides every gradient by 24 * 24


def build_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(OrderedDict(conv1=nn.Conv2d(1, 8, 3, padding=1), relu1=nn.ReLU(),
                                     conv2=nn.Conv2d(8, 16, 3, padding=1), relu2=nn.ReLU(),
                                     pool=nn.AdaptiveAvgPool2d(1), flat=nn.Flatten(), fc=nn.Linear(16, 2)))


def spots(n: int, g: torch.Generator):
    """n images [n, 1, SIZE, SIZE], labels (0 bright, 1 dark) and the spots' centres (row, column)."""
    label = torch.randint(0, 2, (n,), generator=g)
    cy = torch.randint(3, SIZE - 3, (n,), generator=g)
    cx = torch.randint(3, SIZE - 3, (n,), generator=g)
    yy, xx = torch.meshgrid(torch.arange(SIZE), torch.arange(SIZE), indexing="ij")
    d2 = (yy - cy[:, None, None]) ** 2 + (xx - cx[:, None, None]) ** 2
    sign = (1.0 - 2.0 * label)[:, None, None]
    img = sign * SPOT * torch.exp(-d2 / (2 * 1.5**2)) + NOISE * torch.randn(n, SIZE, SIZE, generator=g)
    return img[:, None], label, cy, cx


def grad_cam(model: nn.Module, layer: nn.Module, x: torch.Tensor, target: torch.Tensor):
    """The Grad-CAM of class `target` at `layer`'s output, [n, h, w], plus the captured activations and grads."""
    saved = {}
    h1 = layer.register_forward_hook(lambda m, args, out: saved.__setitem__("A", out))
    h2 = layer.register_full_backward_pre_hook(lambda m, grad_output: saved.__setitem__("dA", grad_output[0]))
    scores = model(x)
    scores.gather(1, target[:, None]).sum().backward()  # samples are independent: one backward for all
    h1.remove()
    h2.remove()
    A, dA = saved["A"].detach(), saved["dA"]
    weights = dA.mean(dim=(2, 3), keepdim=True)  # one weight per channel
    cam = torch.relu((weights * A).sum(1))
    return cam, A, dA, scores.detach()


def main(argv=None) -> dict:
    ap = example_parser(__doc__, steps=30, steps_help="training steps (batch 32)")
    ap.add_argument("--images", type=int, default=16, help="test images to explain")
    args = parse_args(ap, argv)

    model = build_model().to(args.device)
    g = torch.Generator().manual_seed(1)
    with hookstats.Monitor(model, include="conv*", kinds=("forward", "backward_pre")) as mon:
        for _ in range(args.steps):
            x, y, _, _ = spots(32, g)
            loss = nn.functional.cross_entropy(model(x.to(args.device)), y.to(args.device))
            loss.backward()
            sgd_step(model.parameters(), LR)
            mon.step()
        print(mon.summary())

    x, y, cy, cx = spots(args.images, torch.Generator().manual_seed(2))
    cam, A, dA, scores = grad_cam(model, model.relu2, x.to(args.device), y.to(args.device))
    s = hookstats.stats(dA)  # one read; fields stay on the device until printed
    grad_stats = {k: v for k, v in s.to_dict().items() if k in ("l2", "min", "max", "zero_count", "numel")}
    print(f"captured dscore/dA: l2 {grad_stats['l2']:.4g}, range [{grad_stats['min']:.3g}, {grad_stats['max']:.3g}], "
          f"{grad_stats['zero_count'] / grad_stats['numel']:.1%} zeros")

    cam = cam.cpu()
    peak = cam.flatten(1).argmax(1)
    py, px = peak // cam.shape[2], peak % cam.shape[2]
    hit = (py - cy).abs().maximum((px - cx).abs()) <= 2  # the CAM peaks on the spot
    accuracy = (scores.argmax(1).cpu() == y).float().mean().item()
    print(f"accuracy {accuracy:.0%}; CAM peak within 2 px of the spot for {hit.float().mean():.0%} of the images")

    # Two mosaics (inputs; Grad-CAM over inputs), one imshow each: much cheaper than an axes per image.
    cols = min(8, args.images)
    rows, tile = -(-args.images // cols), SIZE + 2

    def mosaic(maps: torch.Tensor) -> torch.Tensor:  # [n, SIZE, SIZE] -> [rows * tile, cols * tile], NaN borders
        grid = torch.full((rows * cols, tile, tile), float("nan"))
        grid[: len(maps), 1:-1, 1:-1] = maps
        return grid.view(rows, cols, tile, tile).transpose(1, 2).reshape(rows * tile, cols * tile)

    fig, axes = plt.subplots(2, 1, figsize=(cols * tile / 20, 2 * rows * tile / 20 + 0.6))
    for ax, title in zip(axes, ("inputs (class: bright or dark spot; +: its centre)", "Grad-CAM of the true class")):
        ax.imshow(mosaic(x[:, 0]), cmap="gray", vmin=-SPOT, vmax=SPOT)
        ax.set_title(title, fontsize=9)
        ax.axis("off")
    idx = torch.arange(args.images)
    axes[0].plot(idx % cols * tile + 1 + cx, idx // cols * tile + 1 + cy, "r+", markersize=6)
    axes[1].imshow(mosaic(cam / cam.flatten(1).amax(1).clamp_min(1e-12)[:, None, None]), cmap="jet", alpha=0.5)
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.93, hspace=0.12)
    png = os.path.join(args.out, "grad_cam.png")
    fig.savefig(png, dpi=80)
    plt.close(fig)
    write_json(args.out, "grad_cam.json", {"accuracy": accuracy, "peak_hits": hit.tolist(), "grad_stats": grad_stats})
    return {"cam": cam, "png": png, "x": x, "labels": y, "centres": (cy, cx), "peak": (py, px), "hits": hit,
            "accuracy": accuracy, "grad_stats": grad_stats, "activations": A.cpu(), "grads": dA.cpu(),
            "model": model}


if __name__ == "__main__":
    main()
