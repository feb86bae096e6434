"""`train.py --dry-run` with --outer-sync-interval (zeropp/outer/diloco.py): the plan of one group's
engine on its nodes, then what crosses between the groups: the bytes each rank sends per inner
step, against ZeRO-3 over the whole job, each fragment's exchange at the cluster's link and the
inner step with the part of the exchanges its --outer-sync-delay steps do not hide."""
from __future__ import annotations

import dataclasses

from planner.cluster import load_cluster
from planner.comm import PHASES, rank_bytes
from planner.plan import companion, format_plan, job_from_args, label, plan_config
from planner.trace import shard_layout, trace_model
from training.args import flag
from training.outer_args import check_groups
from zeropp.outer.diloco import exchange_per_step, fragment_bounds
from zeropp.stages.engine import compute_dtype


def format_outer_plan(args) -> str:
    cluster = load_cluster(args.cluster)
    rpn = cluster.gpus_per_node
    groups, size = check_groups(args, flag, cluster.nodes, rpn)   # training's own check, on the cluster's nodes
    job = job_from_args(args, cluster)   # the batch over the whole job
    zero = job.ds.zero_optimization
    trace = trace_model(job.cfg, compute_dtype(job.ds), job.micro_batch, job.seq_length,
                        zero.stage3_param_persistence_threshold)
    group_cluster = dataclasses.replace(cluster, nodes=size)
    group_job = dataclasses.replace(job, world=size * rpn)
    mine = plan_config(group_job, zero, trace, group_cluster)
    base = plan_config(job, zero if label(zero) == "ZeRO-3" else companion(zero, rpn), trace, cluster)

    settings = args.groups.settings   # (training's own, typed at the edge)
    shards = shard_layout(trace, group_job.world, 0, mine.zero.stage, mine.zero.stage3_param_persistence_threshold,
                          mine.zero.zero_hpz_partition_size)
    c = exchange_per_step(sum(s.valid for s in shards), settings)
    across = tuple(g * group_job.world for g in range(groups))   # rank 0 and its peers in the other groups
    inter = sum(rank_bytes(c.op, across, 0, c.nbytes, rpn))
    zero3_inter = sum(base.mean_bytes(ph)[1] for ph in PHASES)
    # Each fragment's exchange, cut by bytes as the training's (zeropp/outer/diloco.py): every rank of a
    # node sends at once through its link.
    bounds = fragment_bounds(sum(s.valid for s in shards), settings.fragments)
    owned = [b - a for a, b in zip(bounds, bounds[1:])]
    whole = [exchange_per_step(n, dataclasses.replace(settings, interval=1)) for n in owned]
    sent = [rpn * sum(rank_bytes(x.op, across, 0, x.nbytes, rpn)) for x in whole]
    step = mine.timing.iteration
    exchanges = exchange_times(cluster, sent, settings.interval / settings.fragments * step, groups)
    # An exchange overlaps `delay` inner steps, but at most the H / F steps between two issues: past
    # those the link is the bound (a step + its exposed part = the link's time per inner step).
    overlap = min(settings.delay, settings.interval / settings.fragments) * step
    exposed = sum(max(0.0, t - overlap) for t in exchanges) / settings.interval
    each = ", ".join(f"{t:.3f}" for t in exchanges) if len(exchanges) <= 8 else f"longest {max(exchanges):.3f}"
    lines = [format_plan(group_job, group_cluster, trace, [mine]), "",
             f"-- Outer synchronization: {groups} groups of {size} node(s) (the plan above is one group's; "
             f"{label(mine.zero)} inside), every {settings.interval} inner steps, {settings.fragments} fragment(s), "
             f"{settings.quantization} outer gradients, merged {settings.delay} inner step(s) after issue",
             f"   across groups per inner step per GPU: {inter / 1e6:.6f} MB ({c.op} over {groups} ranks / H); "
             f"ZeRO-3 over all {cluster.world_size} GPUs: {zero3_inter / 1e6:.1f} MB inter-node "
             f"(ratio {inter / zero3_inter if zero3_inter else float('nan'):.4g})",
             f"   each fragment's exchange at {cluster.inter_node_gbps:g} Gbit/s per node"
             + (f" (burst {cluster.inter_node_burst_kib:g} KiB)" if cluster.inter_node_burst_kib else "")
             + f": {each} s; "
             f"inner step {step:.3f} s + {exposed:.3f} s exposed = {step + exposed:.3f} s; ZeRO-3 over the job: "
             f"{base.timing.iteration:.3f} s"]
    if settings.warmup:   # the gradients' all-reduce across groups: one whole exchange each step
        warm = exchange_per_step(sum(owned), dataclasses.replace(settings, interval=1, quantization="none"))
        warm_bytes = sum(rank_bytes(warm.op, across, 0, warm.nbytes, rpn))   # a GPU's; a node sends rpn of them
        lines.append(f"   the first {settings.warmup} iterations as one synchronous job: "
                     f"{warm_bytes / 1e6:.3f} MB across groups per iteration per GPU, "
                     f"{rpn * warm_bytes / cluster.inter_bw:.3f} s of link per iteration")
    return "\n".join(lines)


def exchange_times(cluster, sent: list[float], spacing: float, groups: int) -> list[float]:
    """Seconds of each fragment's exchange, for the bytes a node `sent` through its link. A token
    bucket (an emulated link's tc tbf burst, tc-tbf(8)) passes what it holds at once; it refills
    while the link idles, from the previous exchange's end to this one's issue, `spacing` s later."""
    wire = cluster.inter_bw / cluster.link_efficiency   # the bucket meters wire bytes
    full = [b / cluster.inter_bw for b in sent]
    times = []
    for i, b in enumerate(sent):
        tokens = min(cluster.inter_node_burst_kib * 1024, wire * max(0.0, spacing - full[i - 1]))
        times.append(max(0.0, b - tokens * cluster.link_efficiency) / cluster.inter_bw
                     + (groups - 1) * cluster.inter_node_latency_us * 1e-6)
    return times
