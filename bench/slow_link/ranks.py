"""One rank of one system (named in bench/slow_link/systems.py): `build_system` sets it up and returns
its step functions (`fwd_bwd`, `opt_step`, `mem`, optionally `counted`/`reset`/`comm`);
`timed_loop` times them. Ours through zeropp.initialize; the peers: a plain PyTorch loop,
FSDP2 (alone and with our plug-in) and DeepSpeed, with the same model, data and AdamW.
Imported by spawned ranks: starts nothing on import."""
from __future__ import annotations

import resource
import time
import warnings

import torch
import torch.distributed as dist

from bench.slow_link.dist_counter import COUNTER
from bench.slow_link.systems import (DEEPSPEED, FSDP2, FSDP2_PLUGIN, HSDP, OPTIM, OURS, bf16, make_batches, make_model,
                           outer_argv, ranks_per_node, zero_section)


def rss_now_mb():
    with open("/proc/self/status") as f:
        return next((int(l.split()[1]) / 1024 for l in f if l.startswith("VmRSS:")), float("nan"))


def local_bytes(tensors):
    """Bytes of this rank's part of each tensor (DTensor -> local shard), storages counted once."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        st = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if st.nbytes() and key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def communicator_counts(comm):
    """`reset`/`counted` for a system on our Communicator: its byte accounting is the row's."""
    def counted():
        s = comm.stats
        return {"bytes": s.total_bytes, "inter_bytes": s.inter_node_bytes, "calls": sum(s.calls.values()),
                "issued_inter_bytes": s.issued_inter_node_bytes,
                "inter_by_phase": {k: v[1] for k, v in s.by_phase.items()},
                "by_op": {k: v[0] + v[1] for k, v in s.by_op.items()},
                "by_phase": {k: v[0] + v[1] for k, v in s.by_phase.items()}, "calls_by_phase": dict(s.calls)}
    return dict(reset=comm.reset_stats, counted=counted, counted_source="Communicator", comm=comm)


def setup_ours(a, system, prepare=None):
    import zeropp
    from parallel.comm import Communicator
    from parallel.topology import topology_from_env
    raw = {"zero_optimization": zero_section(system, a), **({"bf16": {"enabled": True}} if bf16(a) else {})}
    outer = outer_argv(system, a)
    if outer is not None:   # a DiLoCo row: wired as train.py wires it
        from training.flags import build_parser
        from training.outer import attach_outer, engine_comm
        from training.outer_args import groups_job
        outer = groups_job(build_parser().parse_args(outer))
        comm = engine_comm(outer, topology_from_env())
    else:
        comm = Communicator(topology_from_env())
    if prepare is not None:  # e.g. resolve "auto" switches: returns a dict or a config
        raw = prepare(raw, comm)
    ds = raw if isinstance(raw, zeropp.DeepSpeedConfig) else zeropp.DeepSpeedConfig.from_dict(raw)
    model = make_model(a, meta=True)  # no memory until the engine materializes its shards
    engine = zeropp.initialize(model, ds, comm, torch.device("cpu"),
                               zeropp.OptimizerSettings(type="adamw", lr=OPTIM["lr"], betas=OPTIM["betas"],
                                                        eps=OPTIM["eps"], weight_decay=OPTIM["weight_decay"]),
                               gradient_accumulation_steps=1, param_init=model.init_parameter)
    extra = {}
    if outer is not None:
        attach_outer(outer, engine)
        # groups meet at their exchanges alone: a barrier across the slow link would queue behind one
        extra["barrier"] = lambda: dist.barrier(group=comm.topology.world_group)

    def fwd_bwd(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        return loss

    def mem():
        from zeropp.memory import memory_report
        r = memory_report(engine)
        return {"model_state_bytes": r["measured_bytes"]["total"],
                "model_state_predicted_bytes": r["predicted_bytes"]["total"], "peaks": r.get("peaks", {}),
                "memory_report": r}

    return dict(fwd_bwd=fwd_bwd, opt_step=engine.step, mem=mem, **communicator_counts(comm), **extra)


def torch_adamw(params):
    """AdamW with weight decay on matrices only."""
    ps = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in ps if p.ndim >= 2], "weight_decay": OPTIM["weight_decay"]},
              {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=OPTIM["lr"], betas=OPTIM["betas"],
                             eps=OPTIM["eps"], foreach=True)


def torch_loop(model):
    """A plain PyTorch step (FSDP2 runs the same): loss.backward(), AdamW, zero_grad."""
    ps = list(model.parameters())
    opt = torch_adamw(ps)

    def fwd_bwd(x, y):
        loss = model(x, y)
        loss.backward()
        return loss

    def opt_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    def mem():
        p, g = local_bytes(ps), local_bytes([q.grad for q in ps])
        o = local_bytes([t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)])
        return {"model_state_bytes": p + g + o, "model_state_by_kind": {"parameters": p, "gradients": g, "optimizer": o}}

    return dict(fwd_bwd=fwd_bwd, opt_step=opt_step, mem=mem, opt=opt)


def plugin_reduce_dtype(system: str) -> torch.dtype:
    """The gradient reduction's dtype in bf16: bf16 for plain FSDP2 and plug-in rows without qgZ; fp32
    with qgZ (INT4 on the wire either way; an fp32 result lets the plug-in finish it under backward)."""
    return torch.float32 if FSDP2_PLUGIN.get(system, {}).get("quantized_gradients") else torch.bfloat16


def setup_fsdp2(a, system="fsdp2"):
    """fully_shard per transformer block (FSDP2's "bucket"), then the root, reshard_after_forward=True
    (every weight re-gathered, as our reuse-0 row); "fsdp2-hpz": reshard to the node; "hsdp...": on a
    (nodes, ranks per node) mesh; "...+...": then our plug-in with the row's switches, its
    Communicator's counts the row's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=plugin_reduce_dtype(system))
          } if bf16(a) else {}
    reshard = ranks_per_node(a) if system == "fsdp2-hpz" else True
    if system in HSDP:   # one copy of the model per node, sharded over its ranks
        from torch.distributed.device_mesh import init_device_mesh
        rpn = ranks_per_node(a)
        kw["mesh"] = init_device_mesh("cpu", (dist.get_world_size() // rpn, rpn),
                                      mesh_dim_names=("dp_replicate", "dp_shard"))
    model = make_model(a)
    for unit in [*model.blocks, model]:
        fully_shard(unit, reshard_after_forward=reshard, **kw)
    sysd = torch_loop(model)
    if system in FSDP2_PLUGIN:
        from zeropp.fsdp import apply_zeropp
        sysd.update(communicator_counts(apply_zeropp(model, ranks_per_node(a), **FSDP2_PLUGIN[system])
                                        .attach(sysd["opt"]).comm))
    return sysd


def setup_deepspeed(a, system, world):
    import logging

    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    stage = DEEPSPEED[system]
    model = make_model(a)
    config = {"train_micro_batch_size_per_gpu": a["micro_batch"], "gradient_accumulation_steps": 1,
              "train_batch_size": a["micro_batch"] * world, "gradient_clipping": 0.0,
              "zero_optimization": zero_section(system, a), "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
              **({"bf16": {"enabled": True}} if bf16(a) else {})}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch_adamw(list(model.parameters())), config=config)
    torch.set_num_threads(1)  # in case DeepSpeed's CPU accelerator changed it

    def fwd_bwd(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        return loss

    def mem():   # found through DeepSpeed's optimizer wrapper (its attribute names; best effort)
        zo, tensors = engine.optimizer, []
        tensors += [getattr(p, "ds_tensor", None) if stage == 3 else p.data for p in engine.module.parameters()]
        for name in ("fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat", "single_partition_of_fp32_groups",
                     "bit16_groups_flat", "averaged_gradients", "grad_partitions_flat_buffer", "ipg_buffer"):
            v = getattr(zo, name, None)
            v = [t for x in v.values() for t in (x if isinstance(x, (list, tuple)) else [x])] if isinstance(v, dict) else v
            tensors += [t for t in v if torch.is_tensor(t)] if isinstance(v, (list, tuple)) else [v]
        inner = getattr(zo, "optimizer", None)
        if inner is not None:
            tensors += [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
        tensors += [p.grad for p in engine.module.parameters()]
        return {"model_state_bytes": local_bytes(tensors), "model_state_note": "best effort"}

    return dict(fwd_bwd=fwd_bwd, opt_step=engine.step, mem=mem)


def build_system(rank, world, system, a, prepare=None):
    """Set up `system` on this rank; `prepare(raw_config, comm)`, ours only, runs before the engine is built."""
    torch.set_num_threads(1)
    if system in DEEPSPEED:
        import deepspeed  # noqa: F401  (its import is not the system's memory)
    base_rss = rss_now_mb()
    if system in DEEPSPEED:
        sysd = setup_deepspeed(a, system, world)
    elif system in OURS:
        sysd = setup_ours(a, system, prepare)
    elif system in FSDP2:
        sysd = setup_fsdp2(a, system)
    elif system == "plain":
        sysd = torch_loop(make_model(a))
    else:
        raise ValueError(f"unknown system {system}")
    sysd["base_rss"] = base_rss
    return sysd


def bench_rank(rank, world, system, a):
    """One rank under scenarios.harness.spawn, without a process group (DeepSpeed joins through its own init)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    COUNTER.install()  # before DeepSpeed binds torch.distributed functions
    if system not in DEEPSPEED:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    return run_rank(rank, world, system, a)


def run_rank(rank, world, system, a, hook=None):
    return timed_loop(rank, world, build_system(rank, world, system, a), a, hook=hook)


def timed_loop(rank, world, sysd, a, hook=None):
    """a["warmup"] + a["steps"] steps of `sysd`, the last a["steps"] counted; a step's time is its
    slowest rank's (forward + backward + optimizer, barrier before). `hook(event)` runs on every rank
    with "start" before the first timed step's barrier and "end" after the last step."""
    micro, n_total = a["micro_batch"], a["warmup"] + a["steps"]
    times, losses, mem = [], [], None
    sync = dist.is_initialized() and world > 1

    def uncounted(fn):
        was, COUNTER.enabled = COUNTER.enabled, False
        fn()
        COUNTER.enabled = was

    for i, batch in enumerate(make_batches(a, world)):
        if i == a["warmup"]:
            COUNTER.reset()
            COUNTER.enabled = True
            sysd.get("reset", lambda: None)()
            if hook is not None:
                uncounted(lambda: hook("start"))
        mine = batch[rank * micro:(rank + 1) * micro]
        x, y = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
        if sync:
            uncounted(sysd.get("barrier", dist.barrier))
        t0 = time.perf_counter()
        loss = sysd["fwd_bwd"](x, y)
        t1 = time.perf_counter()
        if i == n_total - 1:
            mem = sysd["mem"]()  # between backward and step, untimed
        t2 = time.perf_counter()
        sysd["opt_step"]()
        times.append((t1 - t0) + (time.perf_counter() - t2))
        losses.append(float(loss.detach().float().item()))
    COUNTER.enabled = False
    if hook is not None:
        hook("end")
    intercepted = {"bytes": COUNTER.bytes, "inter_bytes": COUNTER.inter_bytes, "calls": COUNTER.calls,
                   "by_op": dict(COUNTER.by_op), "calls_by_op": dict(COUNTER.calls_by_op),
                   "seconds_by_op": dict(COUNTER.seconds_by_op)}
    t, l = torch.tensor(times, dtype=torch.float64), torch.tensor(losses, dtype=torch.float64)
    if sync:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(l)
        l /= world
    return {"step_times_s": t.tolist(), "losses": l.tolist(), "mem": mem,
            "counted": sysd["counted"]() if "counted" in sysd else None, "counted_source": sysd.get("counted_source"),
            "intercepted": intercepted, "step_barrier": "group" if "barrier" in sysd else "world",
            "base_rss_mb": sysd["base_rss"], "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
