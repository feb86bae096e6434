"""The outer synchronization's command line (--outer-*, --group-size, --lighthouse): one line per
bad input before any work, and the typed `GroupsJob` the wiring below the edge reads
(training/outer.py)."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from common import ConfigError, note
from parallel.membership import lighthouse_answers
from training.checkpoint import META, TRACKER, complete_iterations
from zeropp.kernels.sparse import DEFAULT_CHUNK
from zeropp.outer.settings import OuterSettings

OUTER_FLAGS = ("outer_lr", "outer_momentum", "outer_fragments", "outer_quantization", "outer_sync_delay",
               "outer_merge_alpha", "outer_warmup_iters", "outer_topk_fraction", "group_size", "lighthouse",
               "group_id", "num_groups", "outer_timeout", "outer_async", "outer_min_groups", "outer_max_staleness")
FAULT_TOLERANT_FLAGS = ("group_id", "num_groups", "outer_timeout", "outer_async", "outer_min_groups",
                        "outer_max_staleness")
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


@dataclass(frozen=True)
class GroupsJob:
    """The outer mode as the command line set it, typed at the edge (training/args.py): what the
    wiring below reads, not argparse's namespace. Without --lighthouse the job's nodes form groups
    of `group_size` nodes; with it this torchrun job is group `group_id` of `num_groups`."""
    settings: OuterSettings
    group_size: int
    train_iters: int | None
    clip_grad: float
    lighthouse: str | None = None
    group_id: int = 0
    num_groups: int = 1
    timeout_s: float = 60.0          # --outer-timeout: how long an exchange waits for a group
    min_groups: int = 1
    model_shape: str = ""            # the flags every group of a --lighthouse run must share, by category
    data_shape: str = ""

    @property
    def fault_tolerant(self) -> bool:
        return self.lighthouse is not None


def groups_job(args) -> GroupsJob | None:
    """The typed outer mode of checked arguments (check_outer_args); None without --outer-sync-interval."""
    if args.outer_sync_interval is None:
        return None
    ft = fault_tolerant(args)

    def of(*names):
        return "/".join(f"{n}={getattr(args, n, None)}" for n in names)
    settings = OuterSettings(args.outer_sync_interval, args.outer_lr, args.outer_momentum, args.outer_fragments,
                             args.outer_quantization, args.outer_sync_delay, args.outer_merge_alpha,
                             warmup=args.outer_warmup_iters, topk_fraction=args.outer_topk_fraction,
                             asynchronous=ft and args.outer_async, max_staleness=args.outer_max_staleness)
    return GroupsJob(settings, args.group_size, args.train_iters, args.clip_grad or 0.0,
                     lighthouse=args.lighthouse if ft else None, group_id=args.group_id if ft else 0,
                     num_groups=args.num_groups if ft else 1, timeout_s=args.outer_timeout,
                     min_groups=args.outer_min_groups,
                     model_shape=of("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                    "max_position_embeddings"),
                     data_shape=of("data_path", "split", "seed", "seq_length", "global_batch_size", "tokenizer_type",
                                   "tokenizer_model", "vocab_file", "merge_file"))
