"""Per-GPU bytes: model states exactly as zeropp.memory.memory_report()
measures them, plus the buffers and activations around them.

Model states of rank r (w = bytes of the compute dtype; valid, chunk, secondary_slice
from the engine's layout, planner.trace.shard_layout):
- weights (memory_report's "parameters"): stage 3: sum of chunks x w of the
  partitioned weights (the flat shard buffer, padding included) + numel x w of
  each persistent one; stages 1-2: every weight whole;
- gradients: the fp32 gradient partition, sum(valid) x 4;
- optimizer: Adam's two fp32 moments (valid x 8 per owned shard) and its
  4-byte step counter per owned shard, plus the fp32 masters (sum(valid) x 4)
  in 16-bit training (in fp32 the master is the weight itself).
The ZeRO formula (zeropp.memory.predicted_bytes_per_param: (2 + 4 + 12)/N per
parameter for 16-bit stage 3) is shown next to it. What the techniques keep (hpZ's copy,
LoCo's errors, the deltas' references) their parts say themselves, each in its MemoryLine
(planner/plan.py asks them).

Stage 0 (torch DDP): weights, fp32 gradients and optimizer states whole.

Around them (estimates, each stated):
- gradient buckets (stage 0: DDP's buckets, a compute-dtype copy of every
  gradient): the bound GradientReducer can reach, from the engine's own buckets
  (zeropp.collectives.exact.reducer_buffers_bound: the largest bucket being filled and,
  with overlap_comm, two in flight, each [N, total] rows + [total] result in the
  communication dtype; buckets hold at most the model, whatever reduce_bucket_size
  says), without qgZ's wire buffers;
- gathered weights (stage 3): the weights held from forward to backward plus
  the two largest gather buckets (the one computing, the one prefetched), x w,
  and for qwZ their INT8 receive buffers (about half of that again);
- activations: what autograd saves in one micro-batch, from the traced
  forward (planner.trace.ModelTrace.activation_bytes), with and without
  activation checkpointing.
"""
from __future__ import annotations

from zeropp.collectives.exact import reducer_buffers_bound
from zeropp.memory import predicted_bytes_per_param


def model_state_bytes(shards, stage: int, weight_bytes: int, optimizer_type: str, momentum: float) -> dict[str, int]:
    """memory_report()'s measured_bytes of one rank, from its layout, without what the techniques keep."""
    if stage == 0:
        return _replicated_state_bytes([s.numel for s in shards], weight_bytes, optimizer_type, momentum)
    if stage == 3:
        weights = sum(s.chunk if not s.persistent else s.numel for s in shards) * weight_bytes
    else:
        weights = sum(s.numel for s in shards) * weight_bytes
    valid = sum(s.valid for s in shards)
    owned = sum(1 for s in shards if s.valid)
    if optimizer_type in ("adam", "adamw"):
        optimizer = 8 * valid + 4 * owned
    else:  # SGD: a momentum buffer, or nothing
        optimizer = 4 * valid if momentum else 0
    if weight_bytes != 4 and valid:
        optimizer += 4 * valid   # fp32 masters, one flat buffer
    return {"weights": weights, "gradients": 4 * valid, "optimizer": optimizer}


def _replicated_state_bytes(numels: list[int], weight_bytes: int, optimizer_type: str,
                           momentum: float) -> dict[str, int]:
    """Stage 0 (zeropp.stages.stage0.DDPEngine): every state whole on every rank; the
    gradient is fp32 (the masters' in 16-bit training)."""
    n = sum(numels)
    if optimizer_type in ("adam", "adamw"):
        optimizer = 8 * n + 4 * len(numels)
    else:
        optimizer = 4 * n if momentum else 0
    if weight_bytes != 4:
        optimizer += 4 * n   # fp32 masters
    return {"weights": n * weight_bytes, "gradients": 4 * n, "optimizer": optimizer}


def formula_bytes(num_params: int, stage: int, world: int, dtype, optimizer_bytes: float) -> dict:
    """ZeRO's closed form (zeropp/memory.py) for the same categories."""
    per = predicted_bytes_per_param(stage, world, dtype, optimizer_bytes)
    return {"weights": per["parameters"] * num_params, "gradients": per["gradients"] * num_params,
            "optimizer": per["optimizer"] * num_params}


def buffer_bytes(step, shards, zero, world: int, weight_bytes: int, grad_bytes: int) -> dict[str, int]:
    if zero.stage == 0:   # DDP's buckets hold a copy of every gradient in the compute dtype
        return {"gradient_buckets": sum(s.numel for s in shards) * weight_bytes, "gathered_weights": 0}
    chunk = {s.index: s.chunk for s in shards}
    grad = reducer_buffers_bound([sum(chunk[i] for i in b) for b in step.gradient_buckets], world, grad_bytes,
                                 zero.overlap)
    gathered = 0
    if zero.stage == 3:
        numel = {s.index: s.numel for s in shards}
        sizes = sorted((sum(numel[i] for i in b) for b in step.forward_buckets + step.backward_buckets),
                       reverse=True)
        held = sum(numel[i] for i in step.held)
        gathered = (held + sum(sizes[:2])) * weight_bytes
        if zero.zero_quantized_weights:
            gathered += sum(sizes[:2]) * (1 + 4 / zero.zero_quantized_weights_block_size)
    return {"gradient_buckets": grad, "gathered_weights": int(gathered)}
