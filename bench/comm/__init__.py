#!/usr/bin/env python
"""Communication volume: bytes per iteration inside and across nodes, by phase, for ZeRO-3, each
ZeRO++ technique alone, all three, and with LoCo and INT4 weight deltas, counted by our Communicator
(parallel/comm.py, NCCL ring model), each beside the theory (its limit) and as a ratio to ZeRO-3.

    .venv/bin/python -m bench.comm                         # 2 x 2, 2 x 4, 4 x 2 ranks; bf16, fp32: ~2 min
    .venv/bin/python -m bench.comm --configs 4x2:bf16 --systems +qgZ --layers 1 --hidden 64   # seconds

Every weight is released after forward and gathered again in backward (reuse distance 0, prefetch
buckets of 1/8 of the model). Theory per phase, relative to ZeRO-3's counted bytes of that phase
(W ranks = N nodes x L, e = bytes per element of the compute dtype):
  qwZ    gathers in INT8 + an fp32 scale per 256 elements: (1 + 4/256) / e
  hpZ    backward gather inside the node: 0 across nodes
  qgZ    gradients as one INT4 all-to-all between nodes (+ an fp32 scale per 128) instead of a ring
         reduce-scatter: (0.5 + 4/128) W (N-1) / (N (W-1) e); LoCo: the same bytes across nodes
  deltas (with hpZ) the forward gather in INT4 across nodes among the ranks of one local index, then
         inside the node: (0.5 + 4/128) W (N-1) / (N (W-1) e) (small weights pad to whole blocks)
The last column is what each run reports as its plain equivalent: it must equal ZeRO-3's own count.
Writes results/zeropp_comm.json: results[] = {world, ranks_per_node, dtype, rows[] = {system,
by_phase_inter_bytes, by_phase_intra_bytes, inter_bytes, intra_bytes, theory_inter_bytes,
theory_ratio_by_phase, ratio_to_zero3, plain_inter_bytes}}.
"""
from __future__ import annotations

import argparse

import torch

from bench import RESULTS, write_result

_ZPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": None, "zero_quantized_gradients": True}
SYSTEMS = {"ZeRO-3": {}, "+qwZ": {"zero_quantized_weights": True},
           "+hpZ": {"zero_hpz_partition_size": None},      # None: the ranks per node
           "+qgZ": {"zero_quantized_gradients": True}, "ZeRO++ (all three)": _ZPP,
           "ZeRO++ + LoCo": {**_ZPP, "zeropp_loco_param": {}},
           "ZeRO++ + deltas": {**_ZPP, "zero_quantized_weight_deltas": True},
           "ZeRO++ + LoCo + deltas": {**_ZPP, "zeropp_loco_param": {}, "zero_quantized_weight_deltas": True}}
PHASES = ("forward_gather", "backward_gather", "grad_reduce")
CONFIGS = "4x2:bf16,4x2:fp32,8x4:bf16,8x2:bf16"   # WORLDxRANKS_PER_NODE:DTYPE


def _rank(rank, world, a, ranks_per_node, dtype):
    import zeropp
    from model import GPT, GPTConfig
    from parallel.comm import Communicator
    from parallel.topology import topology_from_env
    cfg = GPTConfig(vocab_size=a.vocab, num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=4,
                    max_position_embeddings=a.seq, hidden_dropout=0.0, attention_dropout=0.0)
    with torch.device("meta"):
        psi = sum(p.numel() for p in GPT(cfg).parameters())
    out = {}
    for name, zero in SYSTEMS.items():
        if name not in a.systems:
            continue
        ds = {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": psi // 8,
                                    **{k: (ranks_per_node if v is None else v) for k, v in zero.items()}},
              **({dtype: {"enabled": True}} if dtype != "fp32" else {})}
        comm = Communicator(topology_from_env(ranks_per_node))
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(cfg)
        engine = zeropp.initialize(model, zeropp.DeepSpeedConfig.from_dict(ds), comm, torch.device("cpu"),
                                   zeropp.OptimizerSettings(), param_init=model.init_parameter)
        x = torch.randint(0, a.vocab, (1, a.seq + 1), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):   # count the second step: schedules are recorded in the first, deltas need a base
            comm.reset_stats()
            engine.backward(engine(x[:, :-1], x[:, 1:]))
            engine.step()
        s = comm.stats
        row = [s.by_phase.get(p, [0, 0])[i] for p in PHASES for i in (0, 1)]
        t = torch.tensor(row + [s.intra_node_bytes, s.inter_node_bytes, s.plain_intra_node_bytes,
                                s.plain_inter_node_bytes], dtype=torch.int64)
        torch.distributed.all_reduce(t)   # summed over ranks, then averaged: a ring charges some ranks only
        out[name] = (t.double() / world).tolist()
    return out


def theory_ratios(world, nodes, elt) -> dict:
    from zeropp.kernels.quant import wire_nbytes
    w8, w4 = (wire_nbytes(1 << 20, b) / (1 << 20) for b in (8, 4))   # bytes per element with scales
    hop = w4 * world * (nodes - 1) / (nodes * (world - 1)) / elt     # qgZ's all-to-all, deltas' one hop
    return {"ZeRO-3": (1, 1, 1), "+qwZ": (w8 / elt, w8 / elt, 1), "+hpZ": (1, 0, 1), "+qgZ": (1, 1, hop),
            "ZeRO++ (all three)": (w8 / elt, 0, hop), "ZeRO++ + LoCo": (w8 / elt, 0, hop),
            "ZeRO++ + deltas": (hop, 0, hop), "ZeRO++ + LoCo + deltas": (hop, 0, hop)}


def table(world, ranks_per_node, dtype, result):
    nodes, mb = world // ranks_per_node, 2 ** 20
    theory, z3 = theory_ratios(world, nodes, 4 if dtype == "fp32" else 2), result["ZeRO-3"]
    print(f"\n{world} ranks = {nodes} nodes x {ranks_per_node}, {dtype}; MB per iteration per rank (mean over ranks), "
          f"counted [theory]\n{'system':22} {'fwd gather x-node':>20} {'bwd gather x-node':>20} {'grad x-node':>20} "
          f"{'x-node total':>14} {'/ZeRO-3':>8} {'intra total':>12} {'plain x-node':>13}")
    rows = []
    for name, r in result.items():
        cells = [f"{r[2 * i + 1] / mb:9.3f} [{theory[name][i] * z3[2 * i + 1] / mb:7.3f}]" for i in range(3)]
        expect = sum(theory[name][i] * z3[2 * i + 1] for i in range(3)) + (z3[7] - sum(z3[1:6:2]))
        print(f"{name:22} {cells[0]:>20} {cells[1]:>20} {cells[2]:>20} {r[7] / mb:14.3f} {r[7] / z3[7]:8.3f} "
              f"{r[6] / mb:12.3f} {r[9] / mb:13.3f}")
        rows.append({"system": name, "by_phase_inter_bytes": dict(zip(PHASES, r[1:6:2])),
                     "by_phase_intra_bytes": dict(zip(PHASES, r[0:6:2])), "inter_bytes": r[7], "intra_bytes": r[6],
                     "theory_inter_bytes": expect, "theory_ratio_by_phase": dict(zip(PHASES, theory[name])),
                     "ratio_to_zero3": r[7] / z3[7], "plain_inter_bytes": r[9]})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.comm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for k, d in (("layers", 2), ("hidden", 256), ("vocab", 4096), ("seq", 64)):
        ap.add_argument(f"--{k}", type=int, default=d)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="rows, comma separated (ZeRO-3 always runs)")
    ap.add_argument("--configs", default=CONFIGS, help="WORLDxRANKS_PER_NODE:DTYPE, comma separated")
    ap.add_argument("--out", default=str(RESULTS / "zeropp_comm.json"))
    a = ap.parse_args(argv)
    a.systems = ["ZeRO-3"] + [s for s in a.systems.split(",") if s in SYSTEMS and s != "ZeRO-3"]
    from scenarios.harness.spawn import run_distributed
    results = []
    for c in a.configs.split(","):
        shape, dtype = c.split(":")
        world, rpn = map(int, shape.split("x"))
        r = run_distributed(_rank, world, args=(a, rpn, dtype), timeout=600)[0]
        results.append({"world": world, "ranks_per_node": rpn, "dtype": dtype, "rows": table(world, rpn, dtype, r)})
    print("\nwrote", write_result(a.out, {"model": vars(a), "results": results}))
