"""A Monitor in an `accelerate` training loop, one process or several.

Shows: which model to hand the Monitor (`accelerator.unwrap_model(model)`: the module under DDP, whose modules and
parameters the hooks go on), where to record the grads under gradient accumulation (`optimizer="manual"` and
`mon.record_grads()` once per optimizer step, after `accelerator.clip_grad_norm_`: the clipped grads
the optimizer uses), one `mon.step()` per optimizer step, and how ranks merge: with `process_group="world"` every
flush is a collective that merges the ranks' rows on the device (activations: the statistics of the global batch;
DDP's grads, the same on every rank after its all_reduce, counted once), and rank 0 alone writes the log.

    python examples/accelerate_monitor.py --steps 8 --out out/
    accelerate launch --cpu --num_processes 2 examples/accelerate_monitor.py --steps 8 --out out/
"""
from __future__ import annotations

import torch
from torch import nn

import hookstats
from _common import example_parser, mlp, parse_args, save_results, synthetic_batches
from hookstats.export import JSONLWriter

ACCUMULATE = 2
MAX_NORM = 0.5


def batches(steps: int, seed: int = 1):
    """Synthetic regression (y: the sum of the first four features), ACCUMULATE micro-batches per step."""
    def target(x, *_):
        return x, x[:, :4].sum(1, keepdim=True)
    return list(synthetic_batches(steps * ACCUMULATE, (16, 8), target, seed=seed))


def main(argv=None) -> dict:
    from accelerate import Accelerator

    ap = example_parser(__doc__, steps=8)
    args = parse_args(ap, argv)
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE, cpu=args.device == "cpu")
    model = mlp(8, 16, 1, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = batches(args.steps)[accelerator.process_index::accelerator.num_processes]  # each rank its own shard
    model, opt = accelerator.prepare(model, opt)
    log = f"{args.out}/log.jsonl"
    mon = hookstats.Monitor(accelerator.unwrap_model(model), kinds=("forward", "grad"), optimizer="manual",
                            process_group="world" if accelerator.num_processes > 1 else None,
                            exporters=[JSONLWriter(log)], start_step=1)
    clipped = []
    for x, y in data:
        x, y = x.to(accelerator.device), y.to(accelerator.device)
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:  # the last micro-batch: grads summed (and averaged across ranks)
                accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                mon.record_grads()  # what opt.step() uses
                clipped.append({n: torch.linalg.vector_norm(p.grad.double()).item()
                                for n, p in accelerator.unwrap_model(model).named_parameters()})
            opt.step()  # accelerate skips it on the other micro-batches
            opt.zero_grad()
        if accelerator.sync_gradients:
            mon.log("loss", loss.detach())
            mon.step()
    mon.detach()  # the last flush (a collective), then rank 0 closes the log
    if accelerator.is_main_process:
        print(f"{len(clipped)} optimizer steps; log: {log}")
        print(mon.summary())  # the merged records (every rank has them)
    accelerator.wait_for_everyone()
    return save_results(args.out, f"accelerate_rank{accelerator.process_index}.json",
                        {"clipped": clipped, "rank": accelerator.process_index,
                         "world": accelerator.num_processes}, records=mon.records())


if __name__ == "__main__":
    main()
