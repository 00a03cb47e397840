"""Training with PyTorch's parallelisms beyond DDP, unchanged on any torch.distributed backend:

    torchrun --nproc-per-node 2 examples/python/parallel_train.py fsdp --backend weft
    torchrun --nproc-per-node 2 examples/python/parallel_train.py tp --backend weft
    torchrun --nproc-per-node 2 examples/python/parallel_train.py pipeline --backend weft
    torchrun --nproc-per-node 4 examples/python/parallel_train.py fsdp-tp --backend weft

* `fsdp`: FSDP2 (`fully_shard`) on a small MLP over a 1-D DeviceMesh, each rank its own batches.
* `tp`: tensor parallel (`ColwiseParallel` then `RowwiseParallel`) on a 2-layer MLP, every rank
  the same batches: the result is the single-process model's (`--save` of rank 0 also writes
  the single-process reference as PREFIX.single.pt).
* `pipeline`: a 2-stage `torch.distributed.pipelining` schedule (GPipe, 4 micro-batches), one
  stage per rank (2 ranks).
* `fsdp-tp`: a 2-D mesh `("dp", "tp")` of shape (world/2, 2): TP inside each pair, FSDP2 across.

`--save PREFIX` writes each rank's full parameters after the steps to PREFIX.rank<r>.pt, and
rank 0 the model's parameters before them to PREFIX.init.pt.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import weftcc.torch  # noqa: F401  registers the "weft" backend

DIM = 16


def mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, DIM)
    ).double()


def batch(gen):
    x = torch.randn(8, DIM, generator=gen, dtype=torch.float64)
    return x, x.flip(1) * 0.5 + 1.0  # a target the model can learn


def full_state(model):
    """Every parameter in full (DTensors gathered), detached, on every rank."""
    out = {}
    for k, v in model.state_dict().items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = full.detach().clone()
    return out


def train(model, steps, gen, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss = None
    for _ in range(steps):
        x, y = batch(gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss


def fsdp(args, rank, world):
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = mlp(args.seed)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    return model, train(model, args.steps, gen)


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def tp(args, rank, world):
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(mlp(args.seed), mesh, tp_plan())
    gen = torch.Generator().manual_seed(args.seed)  # every rank the same batches
    loss = train(model, args.steps, gen)
    if args.save and rank == 0:
        single = mlp(args.seed)
        train(single, args.steps, torch.Generator().manual_seed(args.seed))
        torch.save(full_state(single), f"{args.save}.single.pt")
    return model, loss


def fsdp_tp(args, rank, world):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(mlp(args.seed), mesh["tp"], tp_plan())
    fully_shard(model, mesh=mesh["dp"])
    # The two ranks of a TP pair see the same batches; the data-parallel replicas differ.
    gen = torch.Generator().manual_seed(args.seed * 1000 + mesh["dp"].get_local_rank())
    return model, train(model, args.steps, gen)


def pipeline(args, rank, world):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    if world != 2:
        raise SystemExit("pipeline: 2 ranks, one stage each")
    full = mlp(args.seed)
    stage_module = full[0:2] if rank == 0 else full[2:3]
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    loss_fn = torch.nn.functional.mse_loss
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)  # every rank: backward too
    opt = torch.optim.SGD(stage_module.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(args.seed)  # every rank draws the same batches
    losses = []
    for _ in range(args.steps):
        x, y = batch(gen)
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        opt.step()
    # A slice of a Sequential keeps the full model's layer names.
    state = {k: v.detach().clone() for k, v in stage_module.state_dict().items()}
    return state, (sum(losses) / len(losses)) if losses else None


MODES = {"fsdp": fsdp, "tp": tp, "fsdp-tp": fsdp_tp, "pipeline": pipeline}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=sorted(MODES))
    p.add_argument("--backend", default="weft")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None)
    args = p.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.save and rank == 0:
        torch.save(full_state(mlp(args.seed)), f"{args.save}.init.pt")
    model, loss = MODES[args.mode](args, rank, world)
    state = model if isinstance(model, dict) else full_state(model)
    if loss is not None and (rank == 0 or args.mode == "pipeline"):
        print(f"{args.mode}: loss {float(loss.detach() if torch.is_tensor(loss) else loss):.6f} ({args.backend}, {world} ranks)", flush=True)
    if args.save:
        torch.save(state, f"{args.save}.rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
