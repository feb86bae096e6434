"""The outer synchronization's command line (--outer-*, --group-size) and its wiring: the
engine of each group runs over its own ranks (parallel/topology.py `group_topology`) and
synchronizes across the groups (zeropp/outer/diloco.py)."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import time

import torch
import torch.distributed as dist

from common import ConfigError, note
from parallel.comm import Communicator
from parallel.startup import die_with_launcher, print_rank0
from parallel.topology import Topology
from zeropp.collectives.partition import Partition
from parallel.membership import lighthouse_answers
from parallel.run_shape import RunShape
from training.checkpoint import META, TRACKER, complete_iterations
from zeropp.kernels.sparse import DEFAULT_CHUNK
from zeropp.outer.asynchronous import AsyncOuterSync
from zeropp.outer.diloco import PHASE, WARMUP, OuterSettings, OuterSync, attach, saved_layout
from zeropp.outer.edges import final_sync as synchronize_groups
from zeropp.outer.edges import heal, join, outer_state, with_global_weights

OUTER_FLAGS = ("outer_lr", "outer_momentum", "outer_fragments", "outer_quantization", "outer_sync_delay",
               "outer_merge_alpha", "outer_warmup_iters", "outer_topk_fraction", "group_size", "lighthouse",
               "group_id", "num_groups", "outer_timeout", "outer_async", "outer_min_groups", "outer_max_staleness")
FAULT_TOLERANT_FLAGS = ("group_id", "num_groups", "outer_timeout", "outer_async", "outer_min_groups",
                        "outer_max_staleness")
THROTTLE = "ZEROPP_GROUPS_THROTTLE"   # the test harness's: this group's inner steps take k times as long
TRACE = "ZEROPP_GROUPS_TRACE"   # the goodput bench's: a JSON line per inner step to this file (rank 0)
LIGHTHOUSE_WAIT_S = 10.0   # how long the start looks for the Lighthouse (one started with the groups may be late)


def check_outer_args(args, flag):
    """One line per bad input, before any work; `flag(args, dest, value)` names a flag."""
    if args.outer_sync_interval is None:
        given = [flag(args, d) for d in OUTER_FLAGS if d in args.explicit]
        if given:
            raise ConfigError(f"{', '.join(given)} has no effect without --outer-sync-interval; add "
                              f"--outer-sync-interval H (e.g. 64) or drop it")
        return
    H = flag(args, "outer_sync_interval", args.outer_sync_interval)
    if args.outer_quantization != "topk2" and "outer_topk_fraction" in args.explicit:
        raise ConfigError(f"{flag(args, 'outer_topk_fraction', args.outer_topk_fraction)} has no effect without "
                          f"--outer-quantization topk2; add it or drop the fraction")
    if args.outer_quantization == "topk2" and args.outer_topk_fraction * DEFAULT_CHUNK < 1:   # (sparse.topk_count)
        raise ConfigError(f"{flag(args, 'outer_topk_fraction', args.outer_topk_fraction)} is less than one element "
                          f"of each chunk of {DEFAULT_CHUNK} (one would be sent anyway); pass at least "
                          f"1/{DEFAULT_CHUNK} = {1 / DEFAULT_CHUNK:.8g}")
    if getattr(args, "sharding", "zero") != "zero":   # the outer loop steps this application's fp32 masters
        raise ConfigError(f"{H} runs this application's engine in each group; drop --sharding {args.sharding}")
    stage = args.ds_config.zero_optimization.stage
    if stage != 3:
        raise ConfigError(f"{H} runs ZeRO-3 (or ZeRO++) inside each group, and this run is ZeRO stage {stage}; "
                          f"pass --zero-stage 3")
    if args.ds_config.zero_optimization.auto_switches():   # the link probe measures the job, not a group
        raise ConfigError(f"--zeropp auto does not choose for {H} yet; set the ZeRO++ switches yourself")
    if args.no_load_optim:   # the outer state would keep the weights from before the load
        raise ConfigError(f"--no-load-optim does not reset the outer state of {H} yet; drop it")
    if args.outer_sync_delay >= args.outer_sync_interval:
        raise ConfigError(f"{flag(args, 'outer_sync_delay', args.outer_sync_delay)} must be below {H} (a fragment "
                          f"is merged before its next exchange); pass at most {args.outer_sync_interval - 1}")
    if args.outer_sync_delay == 0 and "outer_merge_alpha" in args.explicit:   # nothing to mix: the merge is at once
        raise ConfigError(f"{flag(args, 'outer_merge_alpha', args.outer_merge_alpha)} has no effect with "
                          f"--outer-sync-delay 0 (the exchange is merged at once); drop it or pass a delay")
    if args.outer_fragments > args.outer_sync_interval:
        raise ConfigError(f"{flag(args, 'outer_fragments', args.outer_fragments)} exceeds {H} (each fragment is "
                          f"exchanged at its own inner step); pass at most {args.outer_sync_interval}")
    if args.lighthouse is not None or any(d in args.explicit for d in FAULT_TOLERANT_FLAGS):
        check_fault_tolerant_args(args, flag, H)
        if not args.dry_run:
            group_paths(args)
    elif not args.dry_run:   # the dry run checks the groups on --cluster's nodes (planner/outer.py)
        world = int(os.environ.get("WORLD_SIZE", 1))
        per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        check_groups(args, flag, world // per_node, per_node)
    warmup = args.outer_warmup_iters
    if warmup and args.train_iters is not None and warmup >= args.train_iters:
        note(f"{flag(args, 'outer_warmup_iters', warmup)} covers all {args.train_iters} iterations of the run: it "
             f"trains as one synchronous job throughout, with no exchange between the groups; shorten the warm-up "
             f"to leave inner steps for {H}")


def check_groups(args, flag, nodes: int, per_node: int) -> tuple[int, int]:
    """(groups, nodes a group) of a job of `nodes` nodes of `per_node` ranks (training: torchrun's;
    the dry run: --cluster's), one line for a layout that training refuses: the dry run plans
    only what trains. --lighthouse (the dry run's only): --num-groups groups of equal nodes."""
    H = flag(args, "outer_sync_interval", args.outer_sync_interval)
    shape = (f"the {nodes} nodes of --cluster {args.cluster} ({per_node} GPUs each)" if args.dry_run
             else f"the {nodes} node(s) of {per_node} rank(s)")
    if fault_tolerant(args):
        if nodes % args.num_groups:
            raise ConfigError(f"--num-groups {args.num_groups} must divide {shape}: each group is a torchrun job of "
                              f"equal nodes; pass a divisor of {nodes}")
        return args.num_groups, nodes // args.num_groups
    size = args.group_size
    if nodes % size == 0 and size < nodes and size * per_node >= 2:
        return nodes // size, size
    given = flag(args, "group_size", size)
    if nodes == 1:   # a group is one node or more: the ranks per node are what is wrong
        source = (f"--cluster {args.cluster}" if args.dry_run else "torchrun's --nproc-per-node, LOCAL_WORLD_SIZE"
                  if args.ranks_per_node is None else flag(args, "ranks_per_node", args.ranks_per_node))
        what = f"{H} synchronizes groups of nodes, and this job is one node of {per_node} ranks ({source})"
    elif nodes % size:
        what = f"{given} must divide {shape}"
    elif size * per_node < 2:
        what = f"{given} makes groups of one rank ({shape}); ZeRO-3 needs 2+ ranks a group"
    else:
        what = f"{given} makes one group of {shape}: there is no other group to synchronize with"
    sizes = [s for s in range(1, nodes) if nodes % s == 0 and s * per_node >= 2]
    if sizes:
        fix = f"pass --group-size {' or '.join(map(str, sizes))}" if len(sizes) <= 3 else \
            f"pass a --group-size that divides {nodes} and is below it (e.g. {sizes[-1]})"
    elif args.dry_run:
        fix = f"plan a --cluster of 2+ nodes, or drop {H}"
    else:   # emulated nodes (--ranks-per-node): the most ranks a node that still makes 2 groups of 2+
        world = nodes * per_node
        emulated = [r for r in range(world // 2, 1, -1) if world % r == 0]
        fix = (f"pass --ranks-per-node {emulated[0]} (emulated nodes of {emulated[0]} ranks, a group each) or "
               f"drop {H}" if emulated else f"run 4+ ranks (2 groups of 2), or drop {H}")
    raise ConfigError(f"{what}; {fix}")


def check_fault_tolerant_args(args, flag, H):
    """--lighthouse: this torchrun job is one group; one line per bad input."""
    if args.lighthouse is None:
        given = [flag(args, d, None if d == "outer_async" else getattr(args, d)) for d in FAULT_TOLERANT_FLAGS
                 if d in args.explicit]
        raise ConfigError(f"{', '.join(given)} needs --lighthouse URL (torchft's Lighthouse; "
                          f"scripts/launch_groups.sh starts one)")
    if args.group_id is None or args.num_groups is None:
        raise ConfigError("--lighthouse needs --group-id G and --num-groups N (this job is group G of N); add both")
    if args.group_id >= args.num_groups:
        raise ConfigError(f"{flag(args, 'group_id', args.group_id)} must be below --num-groups {args.num_groups}")
    if "group_size" in args.explicit:
        raise ConfigError(f"{flag(args, 'group_size', args.group_size)} has no effect with --lighthouse (each "
                          f"torchrun job is one group); drop it")
    if args.outer_min_groups > args.num_groups:
        raise ConfigError(f"{flag(args, 'outer_min_groups', args.outer_min_groups)} exceeds --num-groups "
                          f"{args.num_groups}: no exchange could commit; pass at most {args.num_groups}")
    if not args.outer_async and "outer_max_staleness" in args.explicit:
        raise ConfigError(f"{flag(args, 'outer_max_staleness', args.outer_max_staleness)} has no effect without "
                          f"--outer-async (a synchronous exchange is never stale); add --outer-async or drop it")
    if args.outer_warmup_iters:   # an all-reduce across groups every step: no group could leave
        raise ConfigError(f"{flag(args, 'outer_warmup_iters', args.outer_warmup_iters)} is not fault tolerant "
                          f"yet; drop it with --lighthouse (or train the warm-up as one job and --load it)")
    spacing = args.outer_sync_interval // args.outer_fragments
    if args.outer_sync_delay >= spacing:   # one quorum at a time: an exchange is merged before the next opens
        raise ConfigError(f"{flag(args, 'outer_sync_delay', args.outer_sync_delay)} must be below {H} / "
                          f"--outer-fragments {args.outer_fragments} = {spacing} with --lighthouse; pass at most "
                          f"{spacing - 1}")
    if not args.dry_run and importlib.util.find_spec("torchft") is None:   # found, not imported (it imports Triton)
        raise ConfigError("--lighthouse needs torchft; pip install torchft")
    wait = min(args.outer_timeout, LIGHTHOUSE_WAIT_S)
    # before the model is built, not torchft's traceback later; a dry run plans without one
    if not args.dry_run and not lighthouse_answers(args.lighthouse, wait):
        raise ConfigError(f"--lighthouse {args.lighthouse}: nothing answers there within {wait:g} s; start torchft's "
                          f"Lighthouse first (scripts/launch_groups.sh lighthouse) or fix the URL")


def group_paths(args):
    """--lighthouse: the directories the run names (flags or --config) made this group's own,
    DIR/group<g>, so that no two groups write one checkpoint or TensorBoard folder, however the
    groups are launched. --load DIR reads DIR/group<g> too, unless only DIR holds a checkpoint:
    one that every group starts from (a warm-up trained as one job)."""
    own = lambda path: os.path.join(path, f"group{args.group_id}")   # noqa: E731
    if args.load and (holds_checkpoint(own(args.load)) or not holds_checkpoint(args.load)):
        args.load = own(args.load)
    for dest in ("save", "tensorboard_dir"):
        if getattr(args, dest):
            setattr(args, dest, own(getattr(args, dest)))
    named = [f"--{d.replace('_', '-')} {getattr(args, d)}" for d in ("save", "load", "tensorboard_dir")
             if getattr(args, d)]
    if named:
        note(f"group {args.group_id} keeps its own files: {', '.join(named)}")


def holds_checkpoint(path: str) -> bool:
    """Whether --load `path` names a checkpoint (training/checkpoint/files.py resolve_checkpoint)."""
    return any(os.path.exists(os.path.join(path, name)) for name in (TRACKER, META)) or bool(complete_iterations(path))


def fault_tolerant(args) -> bool:
    return args.outer_sync_interval is not None and args.lighthouse is not None


def data_partition(args, topology: Topology) -> tuple[int, int]:
    """(rank, world) of this rank in the training data: with --lighthouse group G of N reads the
    G-th of N parts of every global batch, as its ranks would in one job of N groups."""
    if not fault_tolerant(args):
        return topology.rank, topology.world_size
    return args.group_id * topology.world_size + topology.rank, args.num_groups * topology.world_size


def engine_comm(args, topology: Topology) -> Communicator:
    """The communicator of this rank's engine: over its group in the outer mode, else the job."""
    if args.outer_sync_interval is None or fault_tolerant(args):   # (--lighthouse: the job is the group)
        return Communicator(topology)
    return Communicator(topology.group_topology(args.group_size).build_groups())


def attach_outer(args, engine):
    """The outer loop on `engine`, exchanging with the same rank of every other group (the group
    holding the same shard); nothing without --outer-sync-interval."""
    if args.outer_sync_interval is None:
        return None
    group = engine.comm.topology
    settings = OuterSettings(args.outer_sync_interval, args.outer_lr, args.outer_momentum, args.outer_fragments,
                             args.outer_quantization, args.outer_sync_delay, args.outer_merge_alpha,
                             warmup=args.outer_warmup_iters, topk_fraction=args.outer_topk_fraction,
                             asynchronous=fault_tolerant(args) and args.outer_async,
                             max_staleness=getattr(args, "outer_max_staleness", 4))
    if fault_tolerant(args):
        from parallel.torchft_groups import TorchftGroups   # (it imports torchft, which imports Triton)
        die_with_launcher()   # a group whose launcher is killed leaves no rank behind in the exchanges
        cross = TorchftGroups(engine.comm, args.group_id, args.num_groups, args.lighthouse, args.outer_timeout,
                              args.outer_min_groups)
        print_rank0(f"> outer membership: group {args.group_id} of {args.num_groups} ({group.num_nodes} node(s) x "
                    f"{group.ranks_per_node} ranks), meeting the others through torchft's Lighthouse at "
                    f"{args.lighthouse}; an exchange waits {args.outer_timeout:g} s for a group"
                    + (f", commits with at least {args.outer_min_groups} groups" if args.outer_min_groups > 1 else "")
                    + ("; asynchronous: no group waits for another (outer gradients older than "
                       f"{settings.max_staleness} outer steps of their fragment are dropped)" if settings.asynchronous
                       else ""))
    else:
        cross = Partition(group=group.across_group, size=group.groups, rank=group.offset // group.world_size)
    groups = args.num_groups if fault_tolerant(args) else group.groups
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
    if args.train_iters is not None and settings.interval >= args.train_iters:   # (the benches build no schedule)
        print_rank0(f"> note: --outer-sync-interval {settings.interval} >= --train-iters {args.train_iters}: the "
                    f"final synchronization at the end of training is the only one")
    if args.clip_grad:
        print_rank0(f"> note: --clip-grad {args.clip_grad:g} clips each group's own gradient norm, not the job's"
                    + (" (the job's during the warm-up)" if settings.warmup else "")
                    + ": with --outer-sync-interval 1 pass --clip-grad 0 for synchronous data parallel")
    sync = attach(engine, cross, settings, AsyncOuterSync if settings.asynchronous else OuterSync)
    sync.end_iteration = args.train_iters
    if fault_tolerant(args):   # what a group that is behind takes from a peer; the groups must agree on the shapes
        cross.register(lambda: outer_state(sync), lambda state: heal(sync, state), run_shape(args, engine, sync))
    return sync


def run_shape(args, engine, sync) -> RunShape:
    """What every group of a --lighthouse run must share (parallel/run_shape.py), by category."""
    def of(*names):
        return "/".join(f"{n}={getattr(args, n, None)}" for n in names)
    s = sync.s
    return RunShape({
        "model": f"{of('num_layers', 'hidden_size', 'num_attention_heads', 'ffn_hidden_size', 'max_position_embeddings')}"
                 f"/ranks={engine.comm.topology.world_size}/params={sum(x.numel for x in engine.shards)}"
                 f"/shard={sync.flat['global'].numel()}",
        "outer": f"{saved_layout(s)}/lr={s.lr}/momentum={s.momentum}/alpha={s.merge_alpha}/async={s.asynchronous}"
                 f"/staleness={s.max_staleness}/{of('outer_min_groups')}",
        "data": of("data_path", "split", "seed", "seq_length", "global_batch_size", "tokenizer_type", "tokenizer_model",
                   "vocab_file", "merge_file"),
        "groups": of("num_groups")})


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
