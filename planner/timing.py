"""Estimated time of one iteration, from the collectives and the cluster.

Compute (per micro-batch, per GPU): F = Megatron's FLOPs per iteration for one
micro-batch (model.flops_per_iteration: 72 B s L h^2 (1 + s/6h + V/12Lh), or
96 ... (1 + s/6h + V/16Lh) with activation recomputation), run at
peak_flops x compute_efficiency. Forward is 1/3 of F (1/4 with
recomputation: forward, recompute, backward = 1 + 1 + 2).

A collective (planner.comm.Collective) over a group of n ranks takes

    t = (n - 1) x latency + max( max over ranks of intra-node bytes / intra_bw,
                                 max over nodes of the node's inter-node bytes / inter_bw )

latency being the inter-node one when the group spans nodes; a ring streams
its intra- and inter-node hops at once, so the slower side bounds it. Inter-node
bandwidth is per node (all the node's NICs) times link_efficiency (headers),
and every rank of a node that sends across shares it. The bytes are those the
collective puts on the wire (planner.comm.issued_bytes: on gloo a reduce-scatter goes
as the all-to-all of its rows, which sends more across nodes than a ring).
(De)quantization costs Collective.quant_elements / the cluster's rate for its bit
width (int8_quantize_gelems, int4_quantize_gelems: elements per second through one
quantize or dequantize kernel; per element, since the CPU's torch path is compute
bound whatever the input dtype, and a GPU's is memory bound at ~3 bytes per element).
The optimizer step streams 16 bytes per owned element (fp32 master, gradient, two
moments) at the GPU's memory bandwidth.

Overlap (zero_optimization.overlap_comm and the cluster's `overlap`): forward
gathers are prefetched under the forward and gradient reductions run under the
backward, so per micro-step

    t_fwd = first forward gather + max(compute_fwd + quant_fwd, rest of forward gathers)
    t_bwd = max(compute_bwd + quant_bwd, backward gathers + gradient reductions but the last) + last reduction

and without overlap every term adds up. The iteration is
A x (t_fwd + t_bwd) + optimizer step + optimizer collectives. The cluster's
step_overhead_ms (host work the model does not itemize: hooks, copies, Python; 0
unless measured) counts as compute, split between forward and backward as the
FLOPs are: it runs on the same processor, beside the collectives in flight, so a
link-bound step hides it as it hides compute.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.comm import _group, issued_bytes

OPTIMIZER_BYTES_PER_ELEMENT = 16


@dataclass
class Timing:
    compute_fwd: float
    compute_bwd: float
    quant: float
    comm: dict            # phase -> seconds (unoverlapped sum)
    optimizer: float      # the optimizer step's own time
    iteration: float
    exposed_comm: float   # what overlap could not hide

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def collective_time(c, cluster, world: int, ranks_per_node: int, hpz: int) -> float:
    intra_max, node_inter = 0, {}
    for r in range(world):
        intra, inter = issued_bytes(c, world, ranks_per_node, hpz, r)
        intra_max = max(intra_max, intra)
        node_inter[r // ranks_per_node] = node_inter.get(r // ranks_per_node, 0) + inter
    group = _group(c.group, world, ranks_per_node, hpz, 0)
    spans = len({r // ranks_per_node for r in group}) > 1
    n = len(group)
    if n == 1:
        return 0.0
    latency = (cluster.inter_node_latency_us if spans else cluster.intra_node_latency_us) * 1e-6
    inter = max(node_inter.values(), default=0) / cluster.inter_bw
    return (n - 1) * latency + max(intra_max / cluster.intra_bw, inter)


def iteration_time(step, cluster, flops_per_micro: float, recompute: bool, accumulation: int,
                   owned_elements: int, world: int, ranks_per_node: int, hpz: int, overlap: bool) -> Timing:
    rate = cluster.peak_flops * cluster.compute_efficiency
    fwd_share = 0.25 if recompute else 1 / 3
    # Host work (hooks, copies, Python) runs on the same processor as the compute and, like it,
    # beside the collectives in flight: spread over the micro-steps as compute.
    host = cluster.step_overhead_ms * 1e-3 / accumulation
    c_fwd = flops_per_micro * fwd_share / rate + host * fwd_share
    c_bwd = flops_per_micro * (1 - fwd_share) / rate + host * (1 - fwd_share)
    per_micro = {}   # micro-step -> {phase: [times]}, {phase: quant}
    comm = {p: 0.0 for p in ("forward_gather", "backward_gather", "grad_reduce", "optimizer")}
    quant_total = 0.0
    for c in step.collectives:
        t = collective_time(c, cluster, world, ranks_per_node, hpz)
        q = c.quant_elements / cluster.quantize_rate(c.quant_bits) if c.quant_elements else 0.0
        comm[c.phase] += t
        quant_total += q
        times, quants = per_micro.setdefault(c.micro_step, ({}, {}))
        times.setdefault(c.phase, []).append(t)
        quants[c.phase] = quants.get(c.phase, 0.0) + q
    total = 0.0
    exposed = 0.0
    for m in range(accumulation):
        times, quants = per_micro.get(m, ({}, {}))
        fg, bg, gr = (times.get(p, []) for p in ("forward_gather", "backward_gather", "grad_reduce"))
        q_fwd = quants.get("forward_gather", 0.0)
        q_bwd = quants.get("backward_gather", 0.0) + quants.get("grad_reduce", 0.0)
        if overlap:
            first = fg[0] if fg else 0.0
            t_fwd = first + max(c_fwd + q_fwd, sum(fg) - first)
            last = gr[-1] if gr else 0.0
            t_bwd = max(c_bwd + q_bwd, sum(bg) + sum(gr) - last) + last
        else:
            t_fwd = c_fwd + q_fwd + sum(fg)
            t_bwd = c_bwd + q_bwd + sum(bg) + sum(gr)
        exposed += t_fwd + t_bwd - (c_fwd + c_bwd + q_fwd + q_bwd)
        total += t_fwd + t_bwd
    opt = owned_elements * OPTIMIZER_BYTES_PER_ELEMENT / cluster.memory_bw
    total += opt + comm["optimizer"]
    exposed += comm["optimizer"]
    return Timing(compute_fwd=c_fwd * accumulation, compute_bwd=c_bwd * accumulation, quant=quant_total,
                  comm=comm, optimizer=opt, iteration=total, exposed_comm=exposed)
