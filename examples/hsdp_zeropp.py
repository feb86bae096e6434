"""HSDP with ZeRO++ compressing its gradient all-reduce across nodes, in torchtitan's shape: a
`parallelize` function composes `fully_shard` on a 2-D (dp_replicate, dp_shard) mesh, one copy of
the model per node, then `apply_zeropp`. No train.py.

    torchrun --nproc-per-node 4 examples/hsdp_zeropp.py --ranks-per-node 2 --steps 20 --ckpt /tmp/ck
    torchrun --nproc-per-node 4 examples/hsdp_zeropp.py --ranks-per-node 2 --steps 10 --ckpt /tmp/ck --resume

gloo on CPU (NCCL on CUDA); --ranks-per-node 2 makes 4 ranks on one machine two emulated nodes
(default: torchrun's LOCAL_WORLD_SIZE), so the mesh is (2 replicas, 2 shards). HSDP's weights are
gathered inside the node only; its one collective across nodes, the all-reduce of each unit's reduced
gradient shard, goes as INT4 (qgZ's hop across nodes, LoCo's error carried) and a gather of the
reduced rows (docs/fsdp2.md). Data: a learnable random stream (y = 3x + 1).
"""
import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from model import GPT, GPTConfig
from zeropp.fsdp import ZeroPP, apply_zeropp


@dataclass
class Parallelism:
    """torchtitan's parallelism keys that matter here, and the plug-in's switches."""
    data_parallel_replicate_degree: int = -1   # -1: one replica per node
    ranks_per_node: int | None = None          # None: torchrun's LOCAL_WORLD_SIZE
    mixed_precision_param: torch.dtype = torch.float32
    mixed_precision_reduce: torch.dtype = torch.float32   # fp32: the plug-in quantizes it to INT4 anyway
    quantized_gradients: bool = True
    loco: bool = True
    exact_replica_gather: bool = False


def build_mesh(p: Parallelism, device_type: str) -> DeviceMesh:
    """(dp_replicate, dp_shard): consecutive ranks (a node) shard one copy of the model."""
    world = dist.get_world_size()
    per_node = p.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    replicate = p.data_parallel_replicate_degree if p.data_parallel_replicate_degree > 0 else world // per_node
    return init_device_mesh(device_type, (replicate, world // replicate), mesh_dim_names=("dp_replicate", "dp_shard"))


def apply_fsdp(model: GPT, dp_mesh: DeviceMesh, p: Parallelism):
    """torchtitan's apply_fsdp: each transformer block a unit, then the root."""
    mp = MixedPrecisionPolicy(param_dtype=p.mixed_precision_param, reduce_dtype=p.mixed_precision_reduce)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


def parallelize(model: GPT, world_mesh: DeviceMesh, p: Parallelism) -> ZeroPP:
    """FSDP2 on the HSDP mesh, then the plug-in (collective: every rank calls it)."""
    apply_fsdp(model, world_mesh, p)
    return apply_zeropp(model, p.ranks_per_node, quantized_weights=False, hpz=False,
                        quantized_gradients=p.quantized_gradients, loco=p.loco,
                        exact_replica_gather=p.exact_replica_gather)


def main(argv=None) -> list[float]:
    a = argparse.ArgumentParser()
    a.add_argument("--steps", type=int, default=20)
    a.add_argument("--ranks-per-node", type=int, default=None)
    a.add_argument("--plain", action="store_true", help="plain HSDP: the plug-in's techniques off")
    a.add_argument("--ckpt", default=None, help="DCP checkpoint directory, written at the end")
    a.add_argument("--resume", action="store_true", help="load --ckpt first")
    args = a.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    p = Parallelism(ranks_per_node=args.ranks_per_node, quantized_gradients=not args.plain, loco=not args.plain)
    torch.manual_seed(0)
    with device:
        model = GPT(GPTConfig(vocab_size=256, max_position_embeddings=64, num_layers=2, num_attention_heads=2,
                              hidden_size=64, hidden_dropout=0.0, attention_dropout=0.0))
    zeropp = parallelize(model, build_mesh(p, device.type), p)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    zeropp.attach(opt)   # LoCo's error is committed after each opt.step()
    first, losses = 0, []
    if args.resume:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=args.ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for note in zeropp.load(args.ckpt):   # on another layout LoCo's error restarts from zero
            print(f"rank {rank}: {note}")
        first = int(state["step"])
    for step in range(first, first + args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)   # each rank its own batch
        x = torch.randint(0, 64, (4, 64), generator=g).to(device)
        loss = model(x, (3 * x + 1) % 64)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step} loss {losses[-1]:.6f} cross-node MB so far {zeropp.stats.inter_node_bytes / 1e6:.3f} "
                  f"(plain HSDP: {zeropp.stats.plain_inter_node_bytes / 1e6:.3f})")
    if args.ckpt:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(first + args.steps),
                  "zeropp": zeropp.state_dict()}, checkpoint_id=args.ckpt)
    return losses


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
