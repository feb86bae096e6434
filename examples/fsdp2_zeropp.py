"""A plain FSDP2 training loop with ZeRO++ (qwZ, hpZ, qgZ, LoCo) plugged in: no train.py.

    torchrun --nproc-per-node 4 examples/fsdp2_zeropp.py --ranks-per-node 2 --steps 20 --ckpt /tmp/ck
    torchrun --nproc-per-node 4 examples/fsdp2_zeropp.py --ranks-per-node 2 --steps 10 --ckpt /tmp/ck --resume

gloo on CPU (NCCL on CUDA); --ranks-per-node 2 makes 4 ranks on one machine two emulated
nodes (default: torchrun's LOCAL_WORLD_SIZE). Data: a learnable random stream (y = 3x + 1).
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from model import GPT, GPTConfig
from zeropp.fsdp import apply_zeropp


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--ckpt", default=None, help="DCP checkpoint directory, written at the end")
    p.add_argument("--resume", action="store_true", help="load --ckpt first")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    with device:
        model = GPT(GPTConfig(vocab_size=256, max_position_embeddings=64, num_layers=2, num_attention_heads=2,
                              hidden_size=64, hidden_dropout=0.0, attention_dropout=0.0))
    # fp32 reductions let the plug-in finish qgZ's reductions while backward goes on (INT4 on the wire anyway)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if args.bf16 else {}
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    zeropp = apply_zeropp(model, args.ranks_per_node, quantized_weights=True, hpz=True, quantized_gradients=True,
                          loco=True).attach(opt)   # attach: LoCo's error is committed after each opt.step()
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
            print(f"step {step} loss {losses[-1]:.6f} cross-node MB so far {zeropp.stats.inter_node_bytes / 1e6:.3f}")
    if args.ckpt:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(first + args.steps),
                  "zeropp": zeropp.state_dict()}, checkpoint_id=args.ckpt)
    return losses


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
