"""The systems bench/zero_bench.py compares, and one rank's timed loop.

Each `setup_*` builds one system on this rank and returns its step functions
(`fwd_bwd`, `opt_step`, `mem`, optionally `counted`/`reset`); `run_rank` times
them. Imported by the spawned ranks, so it must not start anything on import.
"""
from __future__ import annotations

import resource
import threading
import time

import torch
import torch.distributed as dist

OURS = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
DEEPSPEED = {"deepspeed-z1": 1, "deepspeed-z2": 2, "deepspeed-z3": 3}
ALL_SYSTEMS = list(OURS) + ["fsdp2"] + list(DEEPSPEED)
DEFAULT_SYSTEMS = ["ddp", "zero1", "zero2", "zero3", "fsdp2", "deepspeed-z3"]
WORLD1_SYSTEMS = ["plain", "ddp", "zero3"]
LABELS = {"ddp": "ours stage 0 (DDPEngine)", "zero1": "ours ZeRO-1", "zero2": "ours ZeRO-2",
          "zero3": "ours ZeRO-3", "fsdp2": "PyTorch FSDP2", "deepspeed-z1": "DeepSpeed ZeRO-1",
          "deepspeed-z2": "DeepSpeed ZeRO-2", "deepspeed-z3": "DeepSpeed ZeRO-3",
          "plain": "plain PyTorch loop"}
PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default stage3_param_persistence_threshold (1e5)
OPTIM = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


# --------------------------------------------------------------------------------------
# Byte counting at the torch.distributed API (for FSDP2 and DeepSpeed, and a cross-check
# of our Communicator). Same charging rules as parallel/comm.py: a rank is charged for
# the data it must hand to each other member of the group.
# --------------------------------------------------------------------------------------
class DistCounter:
    def __init__(self):
        self.enabled = False
        self.bytes = 0
        self.by_op: dict[str, int] = {}
        self._local = threading.local()
        self._orig = {}

    @staticmethod
    def _nb(t):
        return t.numel() * t.element_size()

    def _charge(self, op, group, per_peer):
        n = dist.get_world_size(group)
        if n <= 1 or per_peer <= 0:
            return
        b = per_peer * (n - 1)
        self.bytes += b
        self.by_op[op] = self.by_op.get(op, 0) + b

    def _cost(self, name, args, kw):
        def arg(i, key):
            return args[i] if len(args) > i else kw.get(key)
        group = kw.get("group")
        if name in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base"):
            if group is None and len(args) > 2:
                group = args[2]
            return group, self._nb(arg(1, "input_tensor") if arg(1, "input_tensor") is not None
                                   else arg(1, "input"))
        if name == "all_gather":
            if group is None and len(args) > 2:
                group = args[2]
            return group, self._nb(arg(1, "tensor"))
        if name in ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base"):
            if group is None and len(args) > 3:
                group = args[3]
            return group, self._nb(arg(0, "output"))
        if name == "reduce_scatter":
            if group is None and len(args) > 3:
                group = args[3]
            return group, self._nb(arg(0, "output"))
        if name == "all_reduce":
            if group is None and len(args) > 2:
                group = args[2]
            return group, 2 * self._nb(arg(0, "tensor")) // dist.get_world_size(group)
        if name == "all_reduce_coalesced":
            if group is None and len(args) > 2:
                group = args[2]
            return group, 2 * sum(self._nb(t) for t in arg(0, "tensors")) // dist.get_world_size(group)
        if name == "broadcast":
            if group is None and len(args) > 2:
                group = args[2]
            src = arg(1, "src")
            return group, self._nb(arg(0, "tensor")) if dist.get_rank() == src else 0
        if name == "all_to_all_single":
            if group is None and len(args) > 4:
                group = args[4]
            return group, self._nb(arg(1, "input")) // dist.get_world_size(group)
        return group, 0

    def install(self):
        names = ["all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather",
                 "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base",
                 "reduce_scatter", "all_reduce", "all_reduce_coalesced", "broadcast",
                 "all_to_all_single"]
        for name in names:
            fn = getattr(dist, name, None)
            if fn is None or name in self._orig:
                continue
            self._orig[name] = fn
            setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        counter = self

        def wrapped(*args, **kw):
            depth = getattr(counter._local, "depth", 0)
            if counter.enabled and depth == 0:  # only the outermost call: wrappers calling wrappers
                try:
                    group, per_peer = counter._cost(name, args, kw)
                    counter._charge(name, group, per_peer)
                except Exception:  # never let accounting break the run
                    pass
            counter._local.depth = depth + 1
            try:
                return fn(*args, **kw)
            finally:
                counter._local.depth = depth
        wrapped.__wrapped__ = fn
        return wrapped


COUNTER = DistCounter()


# --------------------------------------------------------------------------------------
# Model, data, optimizer: identical for every system.
# --------------------------------------------------------------------------------------
def model_config(a):
    from model import GPTConfig
    return GPTConfig(vocab_size=a["vocab"], num_layers=a["num_layers"], hidden_size=a["hidden"],
                     num_attention_heads=a["heads"], max_position_embeddings=a["seq"],
                     hidden_dropout=0.0, attention_dropout=0.0)


def make_model(a):
    from model import GPT
    torch.manual_seed(a["seed"])
    return GPT(model_config(a))


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
def setup_ours(a, stage, world):
    import zeropp
    from parallel.comm import Communicator
    from parallel.topology import topology_from_env
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = PERSISTENCE_THRESHOLD
    ds = zeropp.DeepSpeedConfig.from_dict({"zero_optimization": zero})
    comm = Communicator(topology_from_env())
    engine = zeropp.initialize(make_model(a), ds, comm, torch.device("cpu"),
                               zeropp.OptimizerSettings(lr=OPTIM["lr"], betas=OPTIM["betas"],
                                                        eps=OPTIM["eps"],
                                                        weight_decay=OPTIM["weight_decay"]),
                               gradient_accumulation_steps=1)

    def fwd_bwd(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        return loss

    def mem():
        try:
            from zeropp.memory import memory_report
        except ImportError:
            return None
        r = memory_report(engine)
        return {"model_state_bytes": r["measured_bytes"]["total"],
                "model_state_predicted_bytes": r["predicted_bytes"]["total"],
                "memory_report": r}

    def reset():
        comm.reset_stats()

    def counted():
        s = comm.stats
        return {"bytes": s.total_bytes, "by_op": {k: v[0] + v[1] for k, v in s.by_op.items()}}

    return dict(fwd_bwd=fwd_bwd, opt_step=engine.step, mem=mem, reset=reset, counted=counted,
                counted_source="Communicator")


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


def setup_fsdp2(a, world):
    from torch.distributed.fsdp import fully_shard
    model = make_model(a)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return torch_loop(model)


def setup_deepspeed(a, stage, world):
    import logging

    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    model = make_model(a)
    opt = torch_adamw(list(model.parameters()))
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = PERSISTENCE_THRESHOLD
    config = {"train_micro_batch_size_per_gpu": a["micro_batch"], "gradient_accumulation_steps": 1,
              "train_batch_size": a["micro_batch"] * world, "gradient_clipping": 0.0,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
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
def run_rank(rank, world, system, a):
    torch.set_num_threads(1)
    if system in DEEPSPEED:
        import deepspeed  # noqa: F401  (its import is not the system's memory)
    base_rss = rss_now_mb()
    if system in DEEPSPEED:
        sysd = setup_deepspeed(a, DEEPSPEED[system], world)
    elif system in OURS:
        sysd = setup_ours(a, OURS[system], world)
    elif system == "fsdp2":
        sysd = setup_fsdp2(a, world)
    elif system == "plain":
        sysd = setup_plain(a, world)
    else:
        raise ValueError(f"unknown system {system}")
    batches = make_batches(a, world)
    micro = a["micro_batch"]
    n_total = a["warmup"] + a["steps"]
    times, losses, mem = [], [], None
    sync = dist.is_initialized() and world > 1
    for i, batch in enumerate(batches):
        if i == a["warmup"]:
            COUNTER.bytes, COUNTER.by_op = 0, {}
            COUNTER.enabled = True
            if "reset" in sysd:
                sysd["reset"]()
        mine = batch[rank * micro:(rank + 1) * micro]
        x, y = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
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
    counted = sysd["counted"]() if "counted" in sysd else None
    intercepted = {"bytes": COUNTER.bytes, "by_op": dict(COUNTER.by_op)}
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
