"""Several ranks of the engine on ONE GPU, joined by gloo: the CUDA code paths of ZeRO-3 and
ZeRO++ (the Triton quantization kernels inside qwZ and qgZ, the engine's CUDA buffers)
exercised with a real multi-rank step where no multi-GPU machine is lent (NCCL refuses two
ranks on one GPU; gloo moves CUDA tensors through host memory where it supports them).

First it probes which collectives gloo runs on CUDA tensors; then each system (our ZeRO-3 and
ZeRO++, torch's FSDP2 alone, with hpZ and with the whole plug-in) trains the same GPT from the
same initialization on the same batches and reports its step time, its losses and its bytes
across the emulated nodes, and whether hpZ alone gave FSDP2's losses bit for bit. The ranks share the one GPU, so a step time is the
time-sliced GPU's plus gloo's host copies: a check of the paths and the numerics, not a
multi-GPU speed. `python -m bench.slow_link gpu [--ranks 4] [--ranks-per-node 2] [--steps 8]`
"""
from __future__ import annotations

import gc
import os
import time

import torch
import torch.distributed as dist

ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
LOCO = {"zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}
SYSTEMS = {   # name: (sharding, zero_optimization switches)
    "ZeRO-3": ("zero", {}),
    "ZeRO++ (qwZ, hpZ, qgZ)": ("zero", ZEROPP),
    "ZeRO++ + LoCo": ("zero", {**ZEROPP, **LOCO}),
    "FSDP2": ("fsdp2", {}),
    "FSDP2 + hpZ": ("fsdp2", {"zero_hpz_partition_size": 2}),
    "FSDP2 + plug-in + LoCo": ("fsdp2", {**ZEROPP, **LOCO}),
}


def probe(device) -> dict:
    """Which collectives gloo runs on `device` tensors (the ones parallel/comm.py issues)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.full((world * 4,), float(rank + 1), device=device)
    tries = {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(world * 4 * world, device=device), x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(4, device=device), x),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(x), x),
        "broadcast": lambda: dist.broadcast(x.clone(), 0),
    }
    out = {}
    for name, fn in tries.items():
        try:
            fn()
            torch.cuda.synchronize(device) if device.type == "cuda" else None
            out[name] = "ok"
        except Exception as e:   # report what gloo refuses, go on with the rest
            out[name] = " ".join(str(e).split())[:160]
    return out


def run_rank(rank, world, args):
    from model import GPT, GPTConfig
    from parallel.comm import Communicator
    from parallel.topology import topology_from_env
    import zeropp
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "probe": probe(device),
              "systems": {}}
    cfg = dict(vocab_size=args.vocab, num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
               max_position_embeddings=args.seq, hidden_dropout=0.0, attention_dropout=0.0)
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, args.vocab, (args.micro_batch * world, args.seq + 1), generator=g)
               for _ in range(args.steps)]
    for name, (sharding, switches) in SYSTEMS.items():
        try:
            torch.manual_seed(0)
            with torch.device("meta"):
                model = GPT(GPTConfig(**cfg))
            ds = zeropp.DeepSpeedConfig.from_dict({"bf16": {"enabled": True}, "gradient_clipping": 1.0,
                                                   "zero_optimization": {"stage": 3, **switches}})
            comm = Communicator(topology_from_env(args.ranks_per_node))
            engine = zeropp.initialize(model, ds, comm, device, zeropp.OptimizerSettings(lr=3e-4),
                                       param_init=model.init_parameter, sharding=sharding)
            losses, times = [], []
            comm.reset_stats()
            for step, batch in enumerate(batches):
                mine = batch[rank * args.micro_batch:(rank + 1) * args.micro_batch].to(device)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dist.barrier()
                t0 = time.perf_counter()
                loss = engine(mine[:, :-1], mine[:, 1:])
                engine.backward(loss)
                engine.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
                t = torch.tensor([loss.item()])
                dist.all_reduce(t)
                losses.append(t.item() / world)
            stats = comm.reset_stats()
            warm = times[2:] or times
            result["systems"][name] = {"ms_per_step": 1000 * sum(warm) / len(warm), "losses": losses,
                                       "inter_node_mb_per_step": stats.inter_node_bytes / len(batches) / 2**20,
                                       "intra_node_mb_per_step": stats.intra_node_bytes / len(batches) / 2**20,
                                       "peak_gpu_mb": (torch.cuda.max_memory_allocated(device) / 2**20
                                                       if device.type == "cuda" else None)}
            del engine, model
            gc.collect()   # the next system's peak must not hold this one's tensors
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
        except Exception as e:   # one system's failure is a finding, not the end of the check
            result["systems"][name] = {"error": " ".join(str(e).split())[:400]}
    return result


def add_args(ap):
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu_ranks.json"))


def run(args):
    from bench import write_result
    from scenarios.harness.spawn import run_distributed
    results = run_distributed(run_rank, args.ranks, args=(args,), timeout=540)
    r0 = results[0]
    print(f"{args.ranks} ranks as {args.ranks // args.ranks_per_node} emulated nodes x {args.ranks_per_node} on one "
          f"{r0['device']}, gloo; GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro-batch "
          f"{args.micro_batch} per rank, bf16")
    print("gloo on CUDA tensors: " + ", ".join(f"{k} {v}" for k, v in r0["probe"].items()))
    print(f"{'system':24} {'ms/step':>9} {'x-node MB/step':>15} {'first loss':>11} {'last loss':>10} {'peak GPU MB':>12}")
    for name, s in r0["systems"].items():
        if "error" in s:
            print(f"{name:24} error: {s['error']}")
            continue
        peak = max(r["systems"][name]["peak_gpu_mb"] or 0 for r in results)
        # the mean over ranks: in a ring only some ranks send across nodes
        inter = sum(r["systems"][name]["inter_node_mb_per_step"] for r in results) / len(results)
        print(f"{name:24} {s['ms_per_step']:9.1f} {inter:15.3f} {s['losses'][0]:11.4f} "
              f"{s['losses'][-1]:10.4f} {peak:12.0f}")
    same = {name: all("losses" in r["systems"].get(name, {})
                      and r["systems"][name]["losses"] == r["systems"].get("FSDP2", {}).get("losses") for r in results)
            for name in ("FSDP2 + hpZ",)}
    print("hpZ alone gives FSDP2's losses bit for bit on every rank: " + ", ".join(f"{k} {v}" for k, v in same.items()))
    print("wrote", write_result(args.out, {"config": vars(args), "hpz_alone_equals_fsdp2": same, "ranks": results}))
