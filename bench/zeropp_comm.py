"""Communication table: bytes per iteration inside and across nodes, by phase, for
ZeRO-3 and each ZeRO++ technique alone and all three, counted by the Communicator
(parallel/comm.py, NCCL ring model) next to the theory.

Setting: every weight is released after forward and gathered again in backward
(stage3_max_reuse_distance 0, prefetch buckets of 1/8 of the model), as
for a model larger than its prefetch bucket.
Theory, per phase, relative to the counted ZeRO-3 bytes of the same phase
(W ranks = N nodes x L, e = bytes per element of the compute dtype):
  qwZ  gathers: INT8 + an fp32 scale per 256 elements: (1 + 4/256) / e
  hpZ  backward gather: inside the node group: 0 across nodes
  qgZ  gradients: one INT4 all-to-all between nodes (+ an fp32 scale per 128)
       instead of a ring reduce-scatter: (0.5 + 4/128) W (N-1) / (N (W-1) e)
  LoCo (qgZ's error feedback): the same bytes across nodes (exact inside)
  deltas (INT4 weight deltas, with hpZ): the forward gather in INT4 + an fp32
       scale per 128 elements, across nodes among the ranks of one local index
       only (then inside the node) where a ring over the world crosses more:
       (0.5 + 4/128) W (N-1) / (N (W-1) e) (a weight's chunk pads to whole
       blocks: a little more on small weights)
The last columns repeat what each run reports as the plain equivalent (what
ZeRO-3 without ZeRO++ would have sent): it must equal ZeRO-3's own count.

    python -m bench.zeropp_comm [--layers 2 --hidden 256] [--out bench/results/zeropp_comm.json]
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from parallel.spawn import run_distributed
from zeropp.kernels.quant import wire_nbytes

SYSTEMS = {"ZeRO-3": {}, "+qwZ": {"zero_quantized_weights": True},
           "+hpZ": {"zero_hpz_partition_size": None},      # None: the ranks per node
           "+qgZ": {"zero_quantized_gradients": True},
           "ZeRO++ (all three)": {"zero_quantized_weights": True, "zero_hpz_partition_size": None,
                                  "zero_quantized_gradients": True}}
# Beyond ZeRO++ (issue 18): qgZ's error feedback, INT4 weight deltas, both.
_ZPP = SYSTEMS["ZeRO++ (all three)"]
SYSTEMS.update({"ZeRO++ + LoCo": {**_ZPP, "zeropp_loco_param": {}},
                "ZeRO++ + deltas": {**_ZPP, "zero_quantized_weight_deltas": True},
                "ZeRO++ + LoCo + deltas": {**_ZPP, "zeropp_loco_param": {}, "zero_quantized_weight_deltas": True}})
PHASES = ("forward_gather", "backward_gather", "grad_reduce")


def _rank(rank, world, a, ranks_per_node, dtype):
    import zeropp
    from model import GPT, GPTConfig
    from parallel.comm import Communicator
    from parallel.topology import topology_from_env
    cfg = GPTConfig(vocab_size=a.vocab, num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=4,
                    max_position_embeddings=a.seq, hidden_dropout=0.0, attention_dropout=0.0)
    out = {}
    for name, zero in SYSTEMS.items():
        zero = {k: (ranks_per_node if v is None else v) for k, v in zero.items()}
        # prefetch buckets of 1/8 of the model; reuse distance 0: backward gathers every weight again
        ds = {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0,
                                    "stage3_prefetch_bucket_size": num_params(cfg) // 8, **zero}}
        if dtype != "fp32":
            ds[dtype] = {"enabled": True}
        comm = Communicator(topology_from_env(ranks_per_node))
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(cfg)
        engine = zeropp.initialize(model, zeropp.DeepSpeedConfig.from_dict(ds), comm, torch.device("cpu"),
                                   zeropp.OptimizerSettings(), param_init=model.init_parameter)
        x = torch.randint(0, a.vocab, (1, a.seq + 1), generator=torch.Generator().manual_seed(rank))
        for step in range(2):   # count the second step: schedules are recorded in the first, deltas need a base
            comm.reset_stats()
            engine.backward(engine(x[:, :-1], x[:, 1:]))
            engine.step()
        s = comm.stats
        row = [s.by_phase.get(p, [0, 0])[i] for p in PHASES for i in (0, 1)]
        row += [s.intra_node_bytes, s.inter_node_bytes, s.plain_intra_node_bytes, s.plain_inter_node_bytes]
        t = torch.tensor(row, dtype=torch.int64)
        torch.distributed.all_reduce(t)   # summed over ranks, then averaged: a ring charges some ranks only
        out[name] = (t.double() / world).tolist()
    return out


def num_params(cfg) -> int:
    from model import GPT
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def theory_ratios(world, nodes, elt) -> dict:
    w8 = wire_nbytes(1 << 20, 8) / (1 << 20)   # bytes per element, INT8 + scales
    w4 = wire_nbytes(1 << 20, 4) / (1 << 20)
    qgz = w4 * world * (nodes - 1) / (nodes * (world - 1))
    deltas = w4 * world * (nodes - 1) / (nodes * (world - 1))   # one hop across, then inside the node
    return {"ZeRO-3": (1, 1, 1), "+qwZ": (w8 / elt, w8 / elt, 1), "+hpZ": (1, 0, 1),
            "+qgZ": (1, 1, qgz / elt), "ZeRO++ (all three)": (w8 / elt, 0, qgz / elt),
            "ZeRO++ + LoCo": (w8 / elt, 0, qgz / elt), "ZeRO++ + deltas": (deltas / elt, 0, qgz / elt),
            "ZeRO++ + LoCo + deltas": (deltas / elt, 0, qgz / elt)}


def table(world, ranks_per_node, dtype, result):
    nodes = world // ranks_per_node
    elt = 4 if dtype == "fp32" else 2
    theory = theory_ratios(world, nodes, elt)
    z3 = result["ZeRO-3"]
    mb = 2 ** 20
    print(f"\n{world} ranks = {nodes} nodes x {ranks_per_node}, {dtype}; MB per iteration per rank "
          f"(mean over ranks), counted [theory]")
    print(f"{'system':20} {'fwd gather x-node':>20} {'bwd gather x-node':>20} {'grad x-node':>20} "
          f"{'x-node total':>14} {'/ZeRO-3':>8} {'intra total':>12} {'plain x-node':>13}")
    rows = []
    for name, r in result.items():
        cells = []
        for i, _ in enumerate(PHASES):
            counted, expect = r[2 * i + 1], theory[name][i] * z3[2 * i + 1]
            cells.append(f"{counted / mb:9.3f} [{expect / mb:7.3f}]")
        expect_total = sum(theory[name][i] * z3[2 * i + 1] for i in range(3)) + (z3[7] - sum(z3[1:6:2]))
        ratio = r[7] / z3[7]
        print(f"{name:20} {cells[0]:>20} {cells[1]:>20} {cells[2]:>20} {r[7] / mb:14.3f} {ratio:8.3f} "
              f"{r[6] / mb:12.3f} {r[9] / mb:13.3f}")
        rows.append({"system": name, "by_phase_inter_bytes": dict(zip(PHASES, r[1:6:2])),
                     "by_phase_intra_bytes": dict(zip(PHASES, r[0:6:2])),
                     "inter_bytes": r[7], "intra_bytes": r[6], "theory_inter_bytes": expect_total,
                     "theory_ratio_by_phase": dict(zip(PHASES, theory[name])),
                     "ratio_to_zero3": ratio, "plain_inter_bytes": r[9]})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "zeropp_comm.json"))
    a = ap.parse_args(argv)
    results = []
    for world, rpn, dtype in ((4, 2, "bf16"), (4, 2, "fp32"), (8, 4, "bf16"), (8, 2, "bf16")):
        r = run_distributed(_rank, world, args=(a, rpn, dtype), timeout=600)[0]
        results.append({"world": world, "ranks_per_node": rpn, "dtype": dtype,
                        "rows": table(world, rpn, dtype, r)})
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"model": vars(a), "results": results}, f, indent=1)
    print("\nwrote", a.out)


if __name__ == "__main__":
    main()
