"""The systems bench/zero_bench.py compares (named and configured in
bench/system_catalog.py), and one rank's timed loop. Each `setup_*` (ours here, the
peers' in bench/peer_systems.py) builds one system on this rank and returns
its step functions (`fwd_bwd`, `opt_step`, `mem`, optionally `counted`/`reset`); `run_rank`
times them. Imported by the spawned
ranks, so it must not start anything on import."""
from __future__ import annotations

import resource
import time
import warnings

import torch
import torch.distributed as dist

from bench.dist_counter import COUNTER
from bench.peer_systems import setup_deepspeed, setup_fsdp2, setup_plain
from bench.system_catalog import (
    DEEPSPEED,
    FSDP2,
    OPTIM,
    OURS,
    bf16,
    make_batches,
    make_model,
    outer_argv,
    zero_section,
)

def rss_now_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# --------------------------------------------------------------------------------------
# Systems: each returns (fwd_bwd(x, y) -> loss, opt_step(), mem() -> dict|None, stats())
# --------------------------------------------------------------------------------------
def setup_ours(a, system, world, prepare=None):
    import zeropp
    from parallel.comm import Communicator
    from parallel.topology import topology_from_env
    raw = {"zero_optimization": zero_section(system, a)}
    if bf16(a):
        raw["bf16"] = {"enabled": True}
    outer = outer_argv(system, a)
    if outer is not None:   # a DiLoCo row: wired as train.py wires it
        from training.flags import build_parser
        from training.outer import attach_outer, engine_comm
        outer = build_parser().parse_args(outer)
        comm = engine_comm(outer, topology_from_env())
    else:
        comm = Communicator(topology_from_env())
    if prepare is not None:  # e.g. resolve "auto" switches (bench/slow_link_auto.py): dict or config
        raw = prepare(raw, comm)
    ds = raw if isinstance(raw, zeropp.DeepSpeedConfig) else zeropp.DeepSpeedConfig.from_dict(raw)
    model = make_model(a, meta=True)  # no memory until the engine materializes its shards
    engine = zeropp.initialize(model, ds, comm, torch.device("cpu"),
                               zeropp.OptimizerSettings(type="adamw", lr=OPTIM["lr"], betas=OPTIM["betas"],
                                                        eps=OPTIM["eps"],
                                                        weight_decay=OPTIM["weight_decay"]),
                               gradient_accumulation_steps=1, param_init=model.init_parameter)
    extra = {}
    if outer is not None:
        attach_outer(outer, engine)
        # The steps line up inside a group only: groups meet at their exchanges alone (as in
        # train.py), and a barrier across the slow link would queue behind an exchange's bytes.
        extra["barrier"] = lambda: dist.barrier(group=comm.topology.world_group)

    def fwd_bwd(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        return loss

    def mem():
        from zeropp.memory import memory_report
        r = memory_report(engine)
        return {"model_state_bytes": r["measured_bytes"]["total"],
                "model_state_predicted_bytes": r["predicted_bytes"]["total"],
                "peaks": r.get("peaks", {}),
                "memory_report": r}

    return dict(fwd_bwd=fwd_bwd, opt_step=engine.step, mem=mem, **communicator_counts(comm), **extra)


def communicator_counts(comm):
    """`reset` and `counted` for a system whose collectives go through our Communicator `comm`
    (our engine, FSDP2 + plug-in): its byte accounting, as the row's counted bytes."""
    def reset():
        comm.reset_stats()

    def counted():
        s = comm.stats
        return {"bytes": s.total_bytes, "inter_bytes": s.inter_node_bytes, "calls": sum(s.calls.values()),
                "issued_inter_bytes": s.issued_inter_node_bytes,
                "inter_by_phase": {k: v[1] for k, v in s.by_phase.items()},
                "by_op": {k: v[0] + v[1] for k, v in s.by_op.items()},
                "by_phase": {k: v[0] + v[1] for k, v in s.by_phase.items()},
                "calls_by_phase": dict(s.calls)}

    return dict(reset=reset, counted=counted, counted_source="Communicator", comm=comm)


# --------------------------------------------------------------------------------------
# One rank of one system.
# --------------------------------------------------------------------------------------
def build_system(rank, world, system, a, prepare=None):
    """Set up `system` on this rank: its step functions (see the section above).
    `prepare(raw_config, comm) -> raw_config`, for ours: applied before the engine is built."""
    torch.set_num_threads(1)
    if system in DEEPSPEED:
        import deepspeed  # noqa: F401  (its import is not the system's memory)
    base_rss = rss_now_mb()
    if system in DEEPSPEED:
        sysd = setup_deepspeed(a, system, world)
    elif system in OURS:
        sysd = setup_ours(a, system, world, prepare)
    elif system in FSDP2:
        sysd = setup_fsdp2(a, world, system)
        if "comm" in sysd:   # FSDP2 + plug-in
            sysd.update(communicator_counts(sysd["comm"]))
    elif system == "plain":
        sysd = setup_plain(a, world)
    else:
        raise ValueError(f"unknown system {system}")
    sysd["base_rss"] = base_rss
    return sysd


def bench_rank(rank, world, system, a):
    """One rank of `system` under parallel.spawn (started without a process group:
    DeepSpeed joins through deepspeed.init_distributed)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    COUNTER.install()  # before DeepSpeed binds torch.distributed functions
    if system not in DEEPSPEED:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    return run_rank(rank, world, system, a)


def run_rank(rank, world, system, a, hook=None):
    """Build `system`, then `timed_loop`."""
    return timed_loop(rank, world, build_system(rank, world, system, a), a, hook=hook)


def timed_loop(rank, world, sysd, a, hook=None):
    """a["warmup"] + a["steps"] steps of `sysd`; the last a["steps"] are counted.
    `hook(event)`, if given, is called on every rank with "start" just before the first
    timed step's barrier and with "end" after the last step (bench/slow_link.py reads the
    link's byte counters there). May be called again on the same `sysd` (more steps)."""
    base_rss = sysd["base_rss"]
    batches = make_batches(a, world)
    micro = a["micro_batch"]
    n_total = a["warmup"] + a["steps"]
    times, losses, mem = [], [], None
    sync = dist.is_initialized() and world > 1
    for i, batch in enumerate(batches):
        if i == a["warmup"]:
            COUNTER.reset()
            COUNTER.enabled = True
            if "reset" in sysd:
                sysd["reset"]()
        mine = batch[rank * micro:(rank + 1) * micro]
        x, y = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
        if hook is not None and i == a["warmup"]:
            was, COUNTER.enabled = COUNTER.enabled, False
            hook("start")
            COUNTER.enabled = was
        if sync:
            was, COUNTER.enabled = COUNTER.enabled, False
            sysd.get("barrier", dist.barrier)()
            COUNTER.enabled = was
        t0 = time.perf_counter()
        loss = sysd["fwd_bwd"](x, y)
        t1 = time.perf_counter()
        if i == n_total - 1:
            mem = sysd["mem"]()  # between backward and step, after >= 1 step (untimed)
        t2 = time.perf_counter()
        sysd["opt_step"]()
        t3 = time.perf_counter()
        times.append((t1 - t0) + (t3 - t2))
        losses.append(float(loss.detach().float().item()))
    COUNTER.enabled = False
    if hook is not None:
        hook("end")
    counted = sysd["counted"]() if "counted" in sysd else None
    intercepted = {"bytes": COUNTER.bytes, "inter_bytes": COUNTER.inter_bytes, "calls": COUNTER.calls,
                   "by_op": dict(COUNTER.by_op), "calls_by_op": dict(COUNTER.calls_by_op),
                   "seconds_by_op": dict(COUNTER.seconds_by_op)}
    # One step's time is its slowest rank's; the loss is the mean over ranks.
    t = torch.tensor(times, dtype=torch.float64)
    l = torch.tensor(losses, dtype=torch.float64)
    if sync:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(l)
        l /= world
    return {"step_times_s": t.tolist(), "losses": l.tolist(), "mem": mem,
            "counted": counted, "counted_source": sysd.get("counted_source"),
            "intercepted": intercepted, "step_barrier": "group" if "barrier" in sysd else "world",
            "base_rss_mb": base_rss,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
