"""The outer synchronization's wiring: the engine of each group runs over its own ranks
(parallel/topology.py `group_topology`) and synchronizes across the groups (zeropp/outer/diloco.py);
the trainer's per-step hooks. Its command line is training/outer_args.py's."""
from __future__ import annotations

import contextlib
import json
import os
import time

import torch
import torch.distributed as dist

from parallel.comm import Communicator
from parallel.startup import die_with_launcher, print_rank0
from parallel.topology import Topology
from parallel.run_shape import RunShape
from training.outer_args import GroupsJob
from zeropp.collectives.partition import Partition
from zeropp.outer.asynchronous import AsyncOuterSync
from zeropp.outer.diloco import PHASE, WARMUP, OuterSync, attach, saved_layout
from zeropp.outer.edges import final_sync as synchronize_groups
from zeropp.outer.edges import heal, join, outer_state, with_global_weights

THROTTLE = "ZEROPP_GROUPS_THROTTLE"   # the test harness's: this group's inner steps take k times as long
TRACE = "ZEROPP_GROUPS_TRACE"   # the goodput bench's: a JSON line per inner step to this file (rank 0)


def data_partition(job: GroupsJob | None, topology: Topology) -> tuple[int, int]:
    """(rank, world) of this rank in the training data: with --lighthouse group G of N reads the
    G-th of N parts of every global batch, as its ranks would in one job of N groups."""
    if job is None or not job.fault_tolerant:
        return topology.rank, topology.world_size
    return job.group_id * topology.world_size + topology.rank, job.num_groups * topology.world_size


def engine_comm(job: GroupsJob | None, topology: Topology) -> Communicator:
    """The communicator of this rank's engine: over its group in the outer mode, else the job."""
    if job is None or job.fault_tolerant:   # (--lighthouse: the job is the group)
        return Communicator(topology)
    return Communicator(topology.group_topology(job.group_size).build_groups())


def attach_outer(job: GroupsJob | None, engine):
    """The outer loop on `engine`, exchanging with the same rank of every other group (the group
    holding the same shard); nothing without --outer-sync-interval."""
    if job is None:
        return None
    group, settings = engine.comm.topology, job.settings
    if job.fault_tolerant:
        from parallel.torchft_groups import TorchftGroups   # (it imports torchft, which imports Triton)
        die_with_launcher()   # a group whose launcher is killed leaves no rank behind in the exchanges
        cross = TorchftGroups(engine.comm, job.group_id, job.num_groups, job.lighthouse, job.timeout_s,
                              job.min_groups)
        print_rank0(f"> outer membership: group {job.group_id} of {job.num_groups} ({group.num_nodes} node(s) x "
                    f"{group.ranks_per_node} ranks), meeting the others through torchft's Lighthouse at "
                    f"{job.lighthouse}; an exchange waits {job.timeout_s:g} s for a group"
                    + (f", commits with at least {job.min_groups} groups" if job.min_groups > 1 else "")
                    + ("; asynchronous: no group waits for another (outer gradients older than "
                       f"{settings.max_staleness} outer steps of their fragment are dropped)" if settings.asynchronous
                       else ""))
    else:
        cross = Partition(group=group.across_group, size=group.groups, rank=group.offset // group.world_size)
    groups = job.num_groups if job.fault_tolerant else group.groups
    print_rank0(f"> outer synchronization: {groups} groups of {group.num_nodes} node(s) x "
                f"{group.ranks_per_node} ranks, each its own engine; every {settings.interval} inner steps in "
                f"{settings.fragments} fragment(s), outer lr {settings.lr}, Nesterov momentum {settings.momentum}, "
                f"{settings.quantization} outer gradients"
                + (f" (top {settings.topk_fraction:g} of each chunk)" if settings.quantization == "topk2" else "")
                + f", merged {settings.delay} inner step(s) after issue"
                + (f" keeping {settings.merge_alpha:g} of the local values" if settings.delay else "")
                + ("; what a group does not send stays in its weights" if settings.quantization == "topk2" else "")
                + (f"; the first {settings.warmup} iterations as one synchronous job (gradients averaged across "
                   f"the groups)" if settings.warmup else ""))
    if job.train_iters is not None and settings.interval >= job.train_iters:   # (the benches build no schedule)
        print_rank0(f"> note: --outer-sync-interval {settings.interval} >= --train-iters {job.train_iters}: the "
                    f"final synchronization at the end of training is the only one")
    if job.clip_grad:
        print_rank0(f"> note: --clip-grad {job.clip_grad:g} clips each group's own gradient norm, not the job's"
                    + (" (the job's during the warm-up)" if settings.warmup else "")
                    + ": with --outer-sync-interval 1 pass --clip-grad 0 for synchronous data parallel")
    sync = attach(engine, cross, settings, AsyncOuterSync if settings.asynchronous else OuterSync)
    sync.end_iteration = job.train_iters
    if job.fault_tolerant:   # what a group that is behind takes from a peer; the groups must agree on the shapes
        cross.register(lambda: outer_state(sync), lambda state: heal(sync, state), run_shape(job, engine, sync))
    return sync


def run_shape(job: GroupsJob, engine, sync) -> RunShape:
    """What every group of a --lighthouse run must share (parallel/run_shape.py), by category."""
    s = sync.s
    return RunShape({
        "model": f"{job.model_shape}/ranks={engine.comm.topology.world_size}"
                 f"/params={sum(x.numel for x in engine.shards)}/shard={sync.flat['global'].numel()}",
        "outer": f"{saved_layout(s)}/lr={s.lr}/momentum={s.momentum}/alpha={s.merge_alpha}/async={s.asynchronous}"
                 f"/staleness={s.max_staleness}/outer_min_groups={job.min_groups}",
        "data": job.data_shape,
        "groups": f"num_groups={job.num_groups}"})


def join_groups(engine, iteration: int) -> int:
    """--lighthouse, before the first step: meet the groups present, heal from them if behind;
    the iteration to continue from (the others' when they are ahead). `iteration` elsewhere."""
    sync = outer_sync(engine)
    if sync is None or not sync.cross.fault_tolerant:
        return iteration
    sync.steps = iteration
    print_rank0(f"> outer membership: {join(sync)}")
    trace(sync, start=True)
    return sync.steps


def outer_iteration(engine, iteration: int) -> int:
    """The iteration after an inner step: the others' when this group took their schedule at an
    exchange (--lighthouse), --train-iters when --outer-async took this group to the run's final
    round, else `iteration`."""
    sync = outer_sync(engine)
    if sync is None or not sync.cross.fault_tolerant:
        return iteration
    throttle(sync)
    trace(sync)
    return sync.steps


def trace(sync, **more):
    """The goodput bench's trace (TRACE in a group's environment, rank 0): per inner step its end,
    its wall time, the part of it the inner steps' thread spent in exchanges, and the last inner
    step whose work is in the global model (bench/groups/__init__.py)."""
    path = os.environ.get(TRACE)
    if not path or sync.comm.topology.rank != 0:
        return
    now, waited = time.time(), sync.cross.waited
    last, last_waited = getattr(sync, "traced", (None, 0.0))
    sync.traced = now, waited
    line = {"t": now, "it": sync.steps, "dt": None if last is None else now - last, "waited": waited - last_waited,
            "counted": sync.counted_through, **more}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def throttle(sync):
    """The test harness's straggler (THROTTLE=k in a group's environment): each inner step takes k
    times as long, the rest of it asleep (the exchanges' thread goes on meanwhile). Every rank of
    the group sleeps the same, from the shortest step among them (a rank's step includes waiting for
    a peer that slept longer: each sleeping in proportion to its own would feed that back)."""
    k, now = float(os.environ.get(THROTTLE) or 0), time.monotonic()
    last, sync.stepped_at = getattr(sync, "stepped_at", None), now
    if k > 1 and last is not None:
        step = torch.tensor([now - last], dtype=torch.float64)
        sync.comm.all_reduce(step, op=dist.ReduceOp.MIN)
        time.sleep((k - 1) * step.item())
        sync.stepped_at = time.monotonic()


def outer_fields(engine, stats, iterations: int) -> dict:
    """The log line's outer fields (none when the mode is off): exchanges applied so far, this
    rank's bytes across groups per iteration, and its shard's RMS distance between its group's
    parameters and the mean over the groups at the last exchange."""
    sync = outer_sync(engine)
    if sync is None:
        return {}
    inter = sum(stats.by_phase[p][1] for p in (PHASE, WARMUP) if p in stats.by_phase)
    if sync.cross.fault_tolerant:
        status = sync.cross.status()
        for event in status["events"]:
            print_rank0(f"> outer membership: {event}")
        if sync.s.asynchronous and (line := sync.board.window_line()):
            print_rank0(f"> outer rounds: {line}")
        return {"outer_steps": sync.outer_steps, "cross_group_mb": inter / iterations / 2**20,
                "outer_drift": sync.drift, "quorum": status["quorum_size"], "heals": status["heals"],
                "loss_of": f"group {sync.cross.group_id}"}
    return {"outer_steps": sync.outer_steps, "cross_group_mb": inter / iterations / 2**20, "outer_drift": sync.drift,
            "loss_of": f"group 0 of {sync.cross.size}"}


def outer_sync(engine):
    """The engine's outer synchronization (zeropp/outer/diloco.py OuterFace), None when the mode is off."""
    return engine.outer


def final_sync(engine) -> bool:
    """The end of training: every fragment averaged over the groups, so the global parameters a
    checkpoint exports hold the last inner steps of every group (collective over the job). False
    when off."""
    sync = outer_sync(engine)
    if sync is None:
        return False
    note = synchronize_groups(sync)
    if sync.cross.fault_tolerant:
        trace(sync, final=True)
    print_rank0(f"> outer synchronization: final exchange of all {sync.s.fragments} fragment(s) after iteration "
                f"{sync.steps}: every group now holds the global parameters, the groups' exact mean"
                + (f" ({note})" if note else ""))
    return True


@contextlib.contextmanager
def global_weights(engine):
    """Evaluation computes with the global parameters (what an export takes) in the outer mode,
    yielding the groups' RMS drift from them; with the engine's own weights otherwise (None)."""
    sync = outer_sync(engine)
    if sync is None:
        yield None
        return
    with with_global_weights(sync) as drift:
        yield drift
