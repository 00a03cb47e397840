"""DDP training of a small model that runs unchanged on any torch.distributed backend:

    torchrun --nproc-per-node 2 examples/python/ddp_train.py --backend gloo
    torchrun --nproc-per-node 2 examples/python/ddp_train.py --backend weft
    weft run -n 2 -- python examples/python/ddp_train.py --backend weft

`import weftcc.torch` is the only change weftcc needs (it registers the "weft" backend).
`--save PREFIX` writes each rank's final parameters to PREFIX.rank<r>.pt. `--die-once FILE`
makes the last rank exit at the second step unless FILE exists (it creates it first): under
`torchrun --max-restarts 1` the restarted workers make their group again and finish.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import weftcc.torch  # noqa: F401  registers the "weft" backend


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="weft")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None)
    p.add_argument("--die-once", default=None)
    args = p.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial model on every rank (DDP also broadcasts it)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    ).double()
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets, so several all-reduces per step
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.5)
    data = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    for step in range(args.steps):
        if args.die_once and step == 1 and rank == world - 1 and not os.path.exists(args.die_once):
            open(args.die_once, "w").close()
            print(f"rank {rank}: exiting at step {step} (--die-once)", flush=True)
            os._exit(1)
        x = torch.randn(8, 16, generator=data, dtype=torch.float64)
        y = x[:, :4] * 2 - x[:, 4:8]  # a target the model can learn
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.6f} ({args.backend}, {world} ranks)", flush=True)
    if args.save:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{args.save}.rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
