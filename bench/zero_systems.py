"""The systems bench/zero_bench.py compares, and one rank's timed loop. Each `setup_*`
builds one system on this rank and returns its step functions (`fwd_bwd`, `opt_step`,
`mem`, optionally `counted`/`reset`); `run_rank` times them. Imported by the spawned
ranks, so it must not start anything on import."""
from __future__ import annotations

import os
import resource
import time
import warnings

import torch
import torch.distributed as dist

from bench.dist_counter import COUNTER

# ZeRO++ rows (bench/slow_link.py): our reuse-0 ZeRO-3 plus one or all of qwZ, hpZ, qgZ.
# hpZ's partition size is the number of ranks per node (a["ranks_per_node"]).
# "auto": all three "auto", resolved by build_system(prepare=...) (bench/slow_link_auto.py).
ZEROPP = {"zeropp-qwz": ("qwz",), "zeropp-hpz": ("hpz",), "zeropp-qgz": ("qgz",),
          "zeropp": ("qwz", "hpz", "qgz"), "deepspeed-z3-hpz": ("hpz",), "auto": ("auto",)}
OURS = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero3-reuse0": 3,
        "zeropp-qwz": 3, "zeropp-hpz": 3, "zeropp-qgz": 3, "zeropp": 3, "auto": 3}
DEEPSPEED = {"deepspeed-z1": 1, "deepspeed-z2": 2, "deepspeed-z3": 3, "deepspeed-z3-reuse0": 3,
             "deepspeed-z3-hpz": 3}
FSDP2 = ("fsdp2", "fsdp2-hpz")
# bench/zero_bench.py's systems (one node); the ZeRO++ rows need several nodes: SLOW_LINK_SYSTEMS.
ALL_SYSTEMS = ["ddp", "zero1", "zero2", "zero3", "zero3-reuse0", "fsdp2", "deepspeed-z1", "deepspeed-z2",
               "deepspeed-z3", "deepspeed-z3-reuse0"]
SLOW_LINK_SYSTEMS = ["zero3-reuse0", "zero3", "zeropp-qwz", "zeropp-hpz", "zeropp-qgz", "zeropp", "auto", "fsdp2",
                     "fsdp2-hpz", "deepspeed-z3-reuse0", "deepspeed-z3-hpz"]
DEFAULT_SYSTEMS = ["ddp", "zero1", "zero2", "zero3", "zero3-reuse0", "fsdp2", "deepspeed-z3"]
WORLD1_SYSTEMS = ["plain", "ddp", "zero3"]
LABELS = {"ddp": "ours stage 0 (DDPEngine)", "zero1": "ours ZeRO-1", "zero2": "ours ZeRO-2",
          "zero3": "ours ZeRO-3", "zero3-reuse0": "ours ZeRO-3 (reuse 0)",
          "fsdp2": "PyTorch FSDP2 (reshard)", "deepspeed-z1": "DeepSpeed ZeRO-1",
          "deepspeed-z2": "DeepSpeed ZeRO-2", "deepspeed-z3": "DeepSpeed ZeRO-3",
          "deepspeed-z3-reuse0": "DeepSpeed ZeRO-3 (reuse 0)", "plain": "plain PyTorch loop",
          "zeropp-qwz": "ours ZeRO-3 + qwZ", "zeropp-hpz": "ours ZeRO-3 + hpZ",
          "zeropp-qgz": "ours ZeRO-3 + qgZ", "zeropp": "ours ZeRO++ (qwZ+hpZ+qgZ)",
          "auto": "ours ZeRO++ auto (planner.auto)", "fsdp2-hpz": "PyTorch FSDP2 (reshard to node)",
          "deepspeed-z3-hpz": "DeepSpeed ZeRO-3 + hpZ (reuse 0)"}
PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default stage3_param_persistence_threshold (1e5)
# The "reuse 0" rows: weights released after forward, gathered again in backward (reuse distance 0),
# prefetch bucket 1/REUSE0_PREFETCH_FRACTION of the model; a["bucket_fraction"] (bench/slow_link.py):
# prefetch and reduce buckets 1/that, also for ours with held weights ("zero3").
REUSE0 = ("zero3-reuse0", "deepspeed-z3-reuse0", "zeropp-qwz", "zeropp-hpz", "zeropp-qgz", "zeropp",
          "deepspeed-z3-hpz", "auto")
REUSE0_PREFETCH_FRACTION = 4
OPTIM = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def stage_of(system: str) -> int:
    return OURS.get(system, DEEPSPEED.get(system, 3 if system in FSDP2 else 0))


def ranks_per_node(a) -> int:
    """Ranks per node for hpZ: a["ranks_per_node"], else torchrun's LOCAL_WORLD_SIZE."""
    return int(a.get("ranks_per_node") or os.environ.get("LOCAL_WORLD_SIZE", "1"))


def bf16(a) -> bool:
    """a["dtype"] == "bf16": 16-bit weights/gradients (all systems); default fp32."""
    return a.get("dtype", "fp32") == "bf16"


def zero_section(system: str, a) -> dict:
    """The zero_optimization section our engine and DeepSpeed get for `system`."""
    stage = stage_of(system)
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = PERSISTENCE_THRESHOLD
    if system in REUSE0:
        zero["stage3_max_reuse_distance"] = 0
        fraction = a.get("bucket_fraction")
        zero["stage3_prefetch_bucket_size"] = num_params(a) // (fraction or REUSE0_PREFETCH_FRACTION)
        if fraction:
            zero["reduce_bucket_size"] = num_params(a) // fraction
    elif stage == 3 and system in OURS and a.get("bucket_fraction"):   # held weights, the same buckets
        zero.update(dict.fromkeys(("stage3_prefetch_bucket_size", "reduce_bucket_size"),
                                  num_params(a) // a["bucket_fraction"]))
    switches = ZEROPP.get(system, ())
    if "auto" in switches:
        zero.update(zero_quantized_weights="auto", zero_hpz_partition_size="auto", zero_quantized_gradients="auto")
    if "qwz" in switches:
        zero["zero_quantized_weights"] = True
    if "hpz" in switches:
        zero["zero_hpz_partition_size"] = ranks_per_node(a)
    if "qgz" in switches:
        zero["zero_quantized_gradients"] = True
    return zero


# --------------------------------------------------------------------------------------
# Model, data, optimizer: identical for every system.
# --------------------------------------------------------------------------------------
def model_config(a):
    from model import GPTConfig
    # Every weight's initial values come from (init_seed, its name) alone, so every system,
    # whole or built on the meta device and materialized shard by shard, starts the same.
    return GPTConfig(vocab_size=a["vocab"], num_layers=a["num_layers"], hidden_size=a["hidden"],
                     num_attention_heads=a["heads"], max_position_embeddings=a["seq"],
                     hidden_dropout=0.0, attention_dropout=0.0, init_seed=a["seed"])


def make_model(a, meta: bool = False):
    from model import GPT
    if meta:
        with torch.device("meta"):
            return GPT(model_config(a))
    return GPT(model_config(a))


def num_params(a) -> int:
    return sum(p.numel() for p in make_model(a, meta=True).parameters())


def make_batches(a, world):
    """Step i: world*micro sequences; rank r takes rows [r*micro, (r+1)*micro)."""
    g = torch.Generator().manual_seed(a["seed"] + 1)
    n = a["warmup"] + a["steps"]
    return [torch.randint(0, a["vocab"], (world * a["micro_batch"], a["seq"] + 1), generator=g)
            for _ in range(n)]


def torch_adamw(params):
    decay = [p for p in params if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in params if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": OPTIM["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=OPTIM["lr"], betas=OPTIM["betas"],
                             eps=OPTIM["eps"], foreach=True)


def rss_now_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def local_bytes(tensors):
    """Bytes of this rank's part of each tensor (DTensor -> local shard), storages counted once."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if st.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


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

    def reset():
        comm.reset_stats()

    def counted():
        s = comm.stats
        return {"bytes": s.total_bytes, "inter_bytes": s.inter_node_bytes, "calls": sum(s.calls.values()),
                "inter_by_phase": {k: v[1] for k, v in s.by_phase.items()},
                "by_op": {k: v[0] + v[1] for k, v in s.by_op.items()},
                "by_phase": {k: v[0] + v[1] for k, v in s.by_phase.items()},
                "calls_by_phase": dict(s.calls)}

    return dict(fwd_bwd=fwd_bwd, opt_step=engine.step, mem=mem, reset=reset, counted=counted,
                counted_source="Communicator", comm=comm)


def torch_loop(model):
    """A plain PyTorch step: loss.backward(), AdamW, zero_grad (FSDP2 runs the same loop)."""
    opt = torch_adamw(list(model.parameters()))

    def fwd_bwd(x, y):
        loss = model(x, y)
        loss.backward()
        return loss

    def opt_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    def mem():
        ps = list(model.parameters())
        opt_t = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        p, g, o = local_bytes(ps), local_bytes([q.grad for q in ps]), local_bytes(opt_t)
        return {"model_state_bytes": p + g + o,
                "model_state_by_kind": {"parameters": p, "gradients": g, "optimizer": o}}

    return dict(fwd_bwd=fwd_bwd, opt_step=opt_step, mem=mem)


def setup_plain(a, world):
    return torch_loop(make_model(a))


def setup_fsdp2(a, world, system="fsdp2"):
    """fully_shard on each transformer block (FSDP2's unit: its "bucket"), then the root,
    all with reshard_after_forward=True (the root's default would keep wte/wpe/ln_f from
    forward to backward): every weight is re-gathered, as in our reuse-0 row. "fsdp2-hpz":
    reshard_after_forward = ranks per node, backward gathers inside the node (its hpZ).
    bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) over fp32 masters."""
    from torch.distributed.fsdp import fully_shard
    kw = {}
    if bf16(a):
        from torch.distributed.fsdp import MixedPrecisionPolicy
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    reshard = ranks_per_node(a) if system == "fsdp2-hpz" else True
    model = make_model(a)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    return torch_loop(model)


def setup_deepspeed(a, system, world):
    import logging

    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    stage = DEEPSPEED[system]
    model = make_model(a)
    opt = torch_adamw(list(model.parameters()))
    zero = zero_section(system, a)
    config = {"train_micro_batch_size_per_gpu": a["micro_batch"], "gradient_accumulation_steps": 1,
              "train_batch_size": a["micro_batch"] * world, "gradient_clipping": 0.0,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    if bf16(a):
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    torch.set_num_threads(1)  # in case DeepSpeed's CPU accelerator changed it

    def fwd_bwd(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        return loss

    def mem():
        # What this rank holds for the model states, found through DeepSpeed's
        # optimizer wrapper (its attribute names; best effort).
        zo = engine.optimizer
        tensors = []
        for p in engine.module.parameters():
            tensors.append(getattr(p, "ds_tensor", None) if stage == 3 else p.data)
        for name in ("fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat",
                     "single_partition_of_fp32_groups", "bit16_groups_flat",
                     "averaged_gradients", "grad_partitions_flat_buffer", "ipg_buffer"):
            v = getattr(zo, name, None)
            if isinstance(v, dict):
                v = [t for x in v.values() for t in (x if isinstance(x, (list, tuple)) else [x])]
            if isinstance(v, (list, tuple)):
                tensors += [t for t in v if torch.is_tensor(t)]
            elif torch.is_tensor(v):
                tensors.append(v)
        inner = getattr(zo, "optimizer", None)
        if inner is not None:
            tensors += [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
        tensors += [p.grad for p in engine.module.parameters()]
        return {"model_state_bytes": local_bytes(tensors), "model_state_note": "best effort"}

    return dict(fwd_bwd=fwd_bwd, opt_step=engine.step, mem=mem)


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
            dist.barrier()
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
                   "by_op": dict(COUNTER.by_op), "calls_by_op": dict(COUNTER.calls_by_op)}
    # One step's time is its slowest rank's; the loss is the mean over ranks.
    t = torch.tensor(times, dtype=torch.float64)
    l = torch.tensor(losses, dtype=torch.float64)
    if sync:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(l)
        l /= world
    return {"step_times_s": t.tolist(), "losses": l.tolist(), "mem": mem,
            "counted": counted, "counted_source": sysd.get("counted_source"),
            "intercepted": intercepted,
            "base_rss_mb": base_rss,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
