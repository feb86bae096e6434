"""The peers our systems are compared with (bench/zero_systems.py builds them): a plain
PyTorch loop, PyTorch FSDP2 (alone and with our plug-in) and DeepSpeed, each set up on this rank with the same model,
data and AdamW; each returns its step functions (`fwd_bwd`, `opt_step`, `mem`)."""
from __future__ import annotations

import torch

from bench.system_catalog import DEEPSPEED, FSDP2_PLUGIN, OPTIM, bf16, make_model, ranks_per_node, zero_section


def torch_adamw(params):
    decay = [p for p in params if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in params if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": OPTIM["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=OPTIM["lr"], betas=OPTIM["betas"],
                             eps=OPTIM["eps"], foreach=True)


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

    return dict(fwd_bwd=fwd_bwd, opt_step=opt_step, mem=mem, opt=opt)


def setup_plain(a, world):
    return torch_loop(make_model(a))


def setup_fsdp2(a, world, system="fsdp2"):
    """fully_shard on each transformer block (FSDP2's unit: its "bucket"), then the root,
    all with reshard_after_forward=True (the root's default would keep wte/wpe/ln_f from
    forward to backward): every weight is re-gathered, as in our reuse-0 row. "fsdp2-hpz":
    reshard_after_forward = ranks per node, backward gathers inside the node (its hpZ).
    "fsdp2+...": the same, then our plug-in (zeropp.fsdp.apply_zeropp) with the row's
    switches (FSDP2_PLUGIN), attached to the optimizer; its Communicator's counts are the row's.
    bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=plugin_reduce_dtype(system))
    over fp32 masters."""
    from torch.distributed.fsdp import fully_shard
    kw = {}
    if bf16(a):
        from torch.distributed.fsdp import MixedPrecisionPolicy
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=plugin_reduce_dtype(system))
    reshard = ranks_per_node(a) if system == "fsdp2-hpz" else True
    model = make_model(a)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    sysd = torch_loop(model)
    if system in FSDP2_PLUGIN:
        from zeropp.fsdp import apply_zeropp
        sysd["comm"] = apply_zeropp(model, ranks_per_node(a), **FSDP2_PLUGIN[system]).attach(sysd["opt"]).comm
    return sysd


def plugin_reduce_dtype(system: str) -> torch.dtype:
    """The gradient reduction's dtype in bf16. Plain FSDP2 and the plug-in's rows without qgZ:
    bf16 (half the bytes of an fp32 reduction on the wire). Rows with qgZ: fp32, INT4 on the
    wire either way, and an fp32 result is what FSDP2 views as the fp32 masters' gradient
    without a cast, which lets the plug-in complete the reduction later, under backward
    (zeropp/fsdp/comms.py UnitReduce); a bf16 one it must complete at once."""
    quantized = FSDP2_PLUGIN.get(system, {}).get("quantized_gradients")
    return torch.float32 if quantized else torch.bfloat16


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
